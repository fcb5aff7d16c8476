"""Packed documents (issue 31; torchtitan / TRL packing): the document kernels' speed against causal attention
scaled by the visible area, and against SDPA with the documents as a dense mask, plus a correctness check,
on one GPU in one run (< 2 min).

    python benchmarks/documents.py [--shapes 8192:8,32768:32] [--heads 16] [--out FILE.md]

Problems: bf16, B 1, Hq = Hkv = --heads, D 128, causal, L tokens packed as N documents of equal length
(`--shapes L:N`; ids 0..N-1 in runs: query i sees keys j with doc[j] == doc[i], j <= i), q/k/v contiguous.
Per shape, forward and backward ms (device time under CUDA graphs: `do_bench_cudagraph` medians, the best
of 2) of
  causal-general  our launchers, causal, the general family forced (the kernels the documents run on)
  documents       our launchers with documents=ids (the general family: the only one that takes them)
  sdpa-mask       F.scaled_dot_product_attention with the (1, 1, L, L) bool mask (documents and causal):
                  what the model ran before the rewrite passed documents (PyTorch's efficient kernel;
                  timed without CUDA graphs: autograd's SDPA backward fails inside a capture)
The ideal: r = visible pairs with the documents / visible pairs causal; "vs ideal" = documents' fwd + bwd
over r x causal-general's (issue 31 asks 1.25 for documents). "vs sdpa" = sdpa-mask's fwd + bwd over
documents'. Before the timing, the op with documents and autograd at L 2048 (GQA 8/2; 5 documents of
unequal lengths and one split in two places, so one span is a superset) against a float64 masked
reference (out, dq, dk, dv; max abs error over the reference's max |x|, at most 2e-2). Prints the table
last. Then the ceiling table: the same documents as a batch of separate causal problems (our
general kernels, and the registry's choice), against which the documents' own cost and the
area ideal are read (how much of the gap is the short problems themselves).
"""
from __future__ import annotations

import argparse

import torch
from common import emit, graph_ms, report_check, sdpa_autograd_ms

import fuse_plugin  # noqa: F401  (registers torch.ops.fuse_plugin)
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.attention import attention_backward, attention_forward


def packed_ids(L: int, n: int, device) -> torch.Tensor:
    """(1, L) ids of n documents of L // n tokens (the last takes the rest)."""
    return (torch.arange(L, device=device) // (L // n)).clamp_max(n - 1)[None]


def keep_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool: doc[j] == doc[i] and j <= i."""
    L = doc.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc.device).tril()
    return (doc[:, :, None] == doc[:, None, :])[:, None] & causal


def timed(q, k, v, doc, family, bench) -> dict:
    kw = dict(is_causal=True, scale=q.shape[-1] ** -0.5, **({"documents": doc} if doc is not None else {}))
    with registry.forced(family):
        out, lse = attention_forward(q, k, v, None, **kw)
        dout = torch.randn_like(out)
        return {"fwd": bench(lambda: attention_forward(q, k, v, None, **kw)),
                "bwd": bench(lambda: attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, **kw))}


def registry_families(q, k, v) -> str:
    """The families the registry chooses for a plain causal problem of q/k/v (fwd / bwd), or '?'."""
    try:
        from fuse_plugin.kernels.call import AttentionCall

        kw = dict(is_causal=True, scale=q.shape[-1] ** -0.5)
        out, lse = attention_forward(q, k, v, None, **kw)
        fwd = registry.choose(AttentionCall.forward(q, k, v, None, **kw))[0].name
        bwd = registry.choose(AttentionCall.backward(out, q, k, v, None, out, lse, need_dbias=False, **kw))[0].name
        return f"{fwd} / {bwd}"
    except Exception as e:  # a name changed: the table says so, the timing stands
        return f"? ({type(e).__name__})"


def check(L=2048, hq=8, hkv=2, D=128) -> dict:
    torch.manual_seed(0)
    doc = torch.repeat_interleave(torch.tensor([0, 1, 2, 3, 4, 1], device="cuda"),
                                  torch.tensor([300, 500, 200, 400, 348, 300], device="cuda"))[None]
    q = torch.randn(1, hq, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, hkv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out, _ = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, True, D ** -0.5, documents=doc)
    dout = torch.randn_like(out)
    got = (out,) + torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = hq // hkv
    s = (q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2)) * D ** -0.5
    out64 = torch.softmax(s.masked_fill(~keep_mask(doc), float("-inf")), -1) @ v64.repeat_interleave(g, 1)
    want = (out64,) + torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    return {n: ((a.double() - b).abs().max() / b.abs().max()).item()
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192:8,32768:32", help="L:documents, comma-separated")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ok = report_check("L 2048, 6 runs of 5 documents, GQA 8/2, bf16 vs float64", check())
    bench = graph_ms

    lines = [f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, B 1, H {args.heads}, D 128, "
             "causal documents | device ms (CUDA graphs, median, best of 2)", "",
             "| L | docs | causal-general fwd / bwd | documents fwd / bwd | sdpa-mask fwd / bwd | r (live / causal) "
             "| vs ideal | vs sdpa |", "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        L, n = (int(x) for x in shape.split(":"))
        q, k, v = (torch.randn(1, args.heads, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        doc = packed_ids(L, n, "cuda")
        mask = keep_mask(doc)
        cg = timed(q, k, v, None, "general", bench)
        dc = timed(q, k, v, doc, None, bench)
        sd = sdpa_autograd_ms(q, k, v, mask)
        r = mask.sum().item() / (L * (L + 1) / 2)
        vs = (dc["fwd"] + dc["bwd"]) / (r * (cg["fwd"] + cg["bwd"]))
        vs_sdpa = (sd["fwd"] + sd["bwd"]) / (dc["fwd"] + dc["bwd"])
        lines.append(f"| {L} | {n} | {cg['fwd']:.2f} / {cg['bwd']:.2f} | {dc['fwd']:.2f} / {dc['bwd']:.2f} | "
                     f"{sd['fwd']:.2f} / {sd['bwd']:.2f} | {r:.3f} | {vs:.2f} | {vs_sdpa:.2f} |")
        print(lines[-1], flush=True)
        del mask
    lines += ["", "The ceiling: the same work as separate problems (B = documents, L / documents tokens each, "
              "causal), our general kernels and the registry's choice; device ms fwd + bwd. A documents run at "
              "its batched-general time has no cost of its own; the batched rows over the ideal are what short "
              "causal problems cost any kernel here.", "",
              "| L | docs | causal general / chosen | documents | batched general / chosen (families) | "
              "documents / batched general | batched general / ideal | batched chosen / ideal (chosen causal) |",
              "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        L, n = (int(x) for x in shape.split(":"))
        if L % n:
            continue
        q, k, v = (torch.randn(1, args.heads, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        doc = packed_ids(L, n, "cuda")
        r = keep_mask(doc).sum().item() / (L * (L + 1) / 2)
        batched = [t.view(args.heads, n, L // n, 128).transpose(0, 1).contiguous() for t in (q, k, v)]
        tot = {name: sum(timed(*qkv, d, fam, bench).values()) for name, qkv, d, fam in (
            ("cg", (q, k, v), None, "general"), ("cc", (q, k, v), None, None), ("dc", (q, k, v), doc, None),
            ("bg", batched, None, "general"), ("bc", batched, None, None))}
        fams = registry_families(*batched)
        lines.append(f"| {L} | {n} | {tot['cg']:.3f} / {tot['cc']:.3f} | {tot['dc']:.3f} | {tot['bg']:.3f} / "
                     f"{tot['bc']:.3f} ({fams}) | {tot['dc'] / tot['bg']:.2f} | {tot['bg'] / (r * tot['cg']):.2f} | "
                     f"{tot['bc'] / (r * tot['cc']):.2f} |")
        print(lines[-1], flush=True)
    emit(lines, args.out)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
