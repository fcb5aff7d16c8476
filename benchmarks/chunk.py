"""Chunked attention (issue 31; Llama 4): the chunked kernels' speed against causal attention scaled by
the visible area, plus a correctness check, on one GPU in one run (< 2 min).

    python benchmarks/chunk.py [--lengths 16384,32768] [--chunk 8192] [--heads 16] [--out FILE.md]

Problems: bf16, B 1, Hq = Hkv = --heads, D 128, causal chunks of C keys (query i sees keys j with
j // C == i // C, j <= i: Llama 4's `attention_chunk_size`), q/k/v contiguous. Per length, forward and
backward ms (device time under CUDA graphs: `do_bench_cudagraph` medians, the best of 2; the eager
launcher's host work, ~1.3-1.6 ms a call with a family forced on the H100, would hide shorter kernels
from plain do_bench) of
  causal          our launchers, causal, the registry's family (cuDNN at these lengths on an H100)
  causal-general  the same with the general family forced (the kernels the chunks run on)
  chunk           our launchers with chunk=C (the general family: the only one that takes chunks)
The ideal: r = visible pairs with the chunks / visible pairs causal; "vs ideal" = chunk's fwd + bwd
over r x causal-general's (the cost follows the work left when it is close to 1; issue 31 asks 1.15
for windows, 1.25 for documents). Before the timing, the op with chunk=512 and autograd at L 2048
(GQA 8/2) against a float64 chunk-masked reference (out, dq, dk, dv; max abs error over the
reference's max |x|, at most 2e-2). Prints the table last.
"""
from __future__ import annotations

import argparse

import torch
from common import emit, graph_ms, report_check

import fuse_plugin  # noqa: F401  (registers torch.ops.fuse_plugin)
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.attention import attention_backward, attention_forward
from fuse_plugin.kernels.call import window_area


def keep_mask(L: int, C: int, device) -> torch.Tensor:
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None]
    return (j <= i) & (j // C == i // C)


def timed(q, k, v, C, family, bench) -> dict:
    kw = dict(is_causal=True, scale=q.shape[-1] ** -0.5, **({"chunk": C} if C else {}))
    with registry.forced(family):
        out, lse = attention_forward(q, k, v, None, **kw)
        dout = torch.randn_like(out)
        return {"fwd": bench(lambda: attention_forward(q, k, v, None, **kw)),
                "bwd": bench(lambda: attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, **kw))}


def check(L=2048, C=512, hq=8, hkv=2, D=128) -> dict:
    torch.manual_seed(0)
    q = torch.randn(1, hq, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, hkv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out, _ = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, True, D ** -0.5, chunk=C)
    dout = torch.randn_like(out)
    got = (out,) + torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = hq // hkv
    s = (q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2)) * D ** -0.5
    out64 = torch.softmax(s.masked_fill(~keep_mask(L, C, "cuda"), float("-inf")), -1) @ v64.repeat_interleave(g, 1)
    want = (out64,) + torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    return {n: ((a.double() - b).abs().max() / b.abs().max()).item()
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ok = report_check("L 2048, chunk 512, GQA 8/2, bf16 vs float64", check())
    bench = graph_ms

    lines = [f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, B 1, H {args.heads}, D 128, "
             f"chunk {args.chunk} | device ms (CUDA graphs, median, best of 2)", "",
             "| L | causal fwd / bwd | causal-general fwd / bwd | chunk fwd / bwd | r (live / causal) | vs ideal |",
             "|---|---|---|---|---|---|"]
    for L in (int(x) for x in args.lengths.split(",")):
        q, k, v = (torch.randn(1, args.heads, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        res = {name: timed(q, k, v, C, fam, bench) for name, C, fam in (
            ("causal", 0, None), ("causal-general", 0, "general"), ("chunk", args.chunk, None))}
        r = window_area(L, L, 0, args.chunk) / (L * (L + 1) / 2)
        cg, ch = res["causal-general"], res["chunk"]
        vs = (ch["fwd"] + ch["bwd"]) / (r * (cg["fwd"] + cg["bwd"]))
        lines.append(f"| {L} | {res['causal']['fwd']:.2f} / {res['causal']['bwd']:.2f} | {cg['fwd']:.2f} / "
                     f"{cg['bwd']:.2f} | {ch['fwd']:.2f} / {ch['bwd']:.2f} | {r:.3f} | {vs:.2f} |")
        print(lines[-1], flush=True)
    emit(lines, args.out)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
