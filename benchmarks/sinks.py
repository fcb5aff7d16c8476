"""Attention sinks (issue 31, gpt-oss): what the sink costs over the same attention without it, on one
GPU in one run (< 2 min).

    python benchmarks/sinks.py [--length 4096] [--window 128] [--out FILE.md]

Problem: a gpt-oss-shaped attention layer, bf16, B 1, 64 query heads, 8 KV heads, D 64, causal, laid
out as HF builds it ((B, L, H, D) transposed to (B, H, L, D)); gpt-oss alternates full-causal layers
with sliding-window layers (window 128), so both are timed. Per layer kind, forward + backward device
ms (CUDA graphs: `do_bench_cudagraph` medians, the best of 2) of one compiled step that calls the ops
directly (the forward op, then its backward op; no autograd, so the step is one graph), as a compiled
model runs them (Inductor decomposes the ops into the kernels' launches and fuses the sink's merge
with its neighbours):
  attention   fuse_plugin::attention + attention_backward (no sink)
  sinks       fuse_plugin::attention_sinks + attention_sinks_backward (the sink's gradient too)
"sinks / attention" is the issue's Must (within 1.05). Before the timing, the sinks op with autograd at
L 1000 (window 128 and none) against a float64 reference with the sink column in its softmax (out,
dq, dk, dv, dsinks; max abs error over the reference's max |x|, at most 2e-2). Prints the table last.
"""
from __future__ import annotations

import argparse

import torch
import triton
from common import emit, graph_ms, report_check

import fuse_plugin  # noqa: F401  (registers torch.ops.fuse_plugin)

HQ, HKV, D = 64, 8, 64


def inputs(L: int, requires_grad: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    q = torch.randn(1, L, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(1, L, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    sinks = torch.randn(HQ, device="cuda", dtype=torch.bfloat16)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)]


def reference(q, k, v, sinks, window: int):
    """float64: softmax over [scores, sink] with the sink column dropped (HF gpt-oss eager)."""
    g = HQ // HKV
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    L = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None]
    keep = (j <= i) & ((j > i - window) if window else True)
    s = s.masked_fill(~keep, float("-inf"))
    s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(1, HQ, L, 1)], -1)
    return torch.softmax(s, -1)[..., :-1] @ v


def check(L: int = 1000) -> dict:
    errs = {}
    for window in (0, 128):
        q, k, v, sinks = inputs(L, requires_grad=True, seed=window)
        out, _ = torch.ops.fuse_plugin.attention_sinks(q, k, v, None, 0.0, True, D ** -0.5, sinks, None, None,
                                                       window)
        dout = torch.randn_like(out)
        got = (out,) + torch.autograd.grad(out, (q, k, v, sinks), dout)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
        out64 = reference(*leaves, window)
        want = (out64,) + torch.autograd.grad(out64, leaves, dout.double())
        for n, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            errs[f"{n} w{window}"] = ((a.double() - b).abs().max() / b.abs().max()).item()
    return errs


def steps(L: int, window: int):
    """The two compiled steps (forward op, then backward op) and their arguments."""
    q, k, v, sinks = inputs(L)
    scale = D ** -0.5
    dout = torch.randn_like(q)

    def plain(q, k, v, dout):
        out, lse = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, True, scale, window=window)
        return torch.ops.fuse_plugin.attention_backward(dout, q, k, v, None, out, lse, 0.0, True, scale, None,
                                                        False, window=window)

    def with_sinks(q, k, v, sinks, dout):
        out, lse = torch.ops.fuse_plugin.attention_sinks(q, k, v, None, 0.0, True, scale, sinks, None, None, window)
        return torch.ops.fuse_plugin.attention_sinks_backward(dout, q, k, v, None, out, lse, sinks, 0.0, True,
                                                              scale, None, False, None, window)

    return ((torch.compile(plain, fullgraph=True), (q, k, v, dout)),
            (torch.compile(with_sinks, fullgraph=True), (q, k, v, sinks, dout)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ok = report_check("L 1000, GQA 64/8, D 64, bf16 vs float64", check())

    def bench(fn, a):
        fn(*a)  # compile outside the capture
        return graph_ms(lambda: fn(*a))

    lines = [f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16, "
             f"B 1, Hq {HQ}, Hkv {HKV}, D {D}, L {args.length}, causal | fwd + bwd device ms (compiled step, "
             "CUDA graphs, median, best of 2)", "",
             "| layer | attention | sinks | sinks / attention |", "|---|---|---|---|"]
    for window in (0, args.window):
        (plain, pa), (sinked, sa) = steps(args.length, window)
        t_plain, t_sinks = bench(plain, pa), bench(sinked, sa)
        name = f"sliding window {window}" if window else "full causal"
        lines.append(f"| {name} | {t_plain:.3f} | {t_sinks:.3f} | {t_sinks / t_plain:.3f} |")
        print(lines[-1], flush=True)
    emit(lines, args.out)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
