"""Rotary speed on the GPU: our q+k op vs the eager HF expression vs that expression compiled.

    python benchmarks/rotary.py [--out FILE.md] [--rounds N]

What is timed (every implementation the same way): device time, from CUDA-graph replays
(`triton.testing.do_bench_cudagraph`: the call captured in a graph, replayed, timed with CUDA
events, median), then the median over `--rounds` interleaved rounds of all implementations.
The graph removes host overhead (Python, op dispatch, Dynamo guards, Triton's launcher) from
every implementation alike; that overhead is reported separately, as host µs per call (the
time to enqueue one call, the GPU kept busy). q+k+outputs exceed the 50 MB L2 on all shapes.

* fwd: the rotation of q and k, no autograd (`torch.no_grad`):
    - ours      `torch.ops.fuse_plugin.rotary_qk(q, k, cos[:, None], sin[:, None], False, rd)`
    - eager     HF's `apply_rotary_pos_emb` (GPT-NeoX's split for partial rotary), eager
    - compiled  the same function under stock `torch.compile` (our automatic patch disabled)
* bwd: the backward rotation alone, the transpose of the forward map applied to given upstream
  gradients gq, gk (contiguous (B, H, S, D) bf16, the layout our forward returns; the same
  tensors for every implementation), giving dq, dk:
    - ours      `torch.ops.fuse_plugin.rotary_qk_backward(gq, gk, cos[:, None], sin[:, None], False,
                rd, bf16, bf16)`, the op our autograd calls
    - eager     the explicit transpose of HF's map, `dx = g·cos + rotate_halfᵀ(g·sin)` with
                `rotate_halfᵀ(y) = cat(y[h:], −y[:h])` (pass-through tail: `dx = g`), which is
                what autograd computes for HF's expression (checked below against autograd)
    - compiled  that expression under stock `torch.compile`
  Not timed: the autograd engine. (An earlier version timed `torch.autograd.grad` through the
  whole graph with `do_bench`'s per-call events. Measured on the H100: the engine plus our
  op's backward take ~235 µs of host time per call, the compiled graph's backward ~176 µs, more
  than the rotation's device time (~120 µs at S = 16k), so the events mostly timed the GPU
  waiting for the host: ~700–970 GB/s for both compiled and ours.)
* copy: `dst.copy_(src)` of one tensor with q+k's element count, same dtype (read + write),
  in the same run: the bandwidth ceiling.

GB/s = bytes / time with bytes = q and k read once and written once + cos and sin read once
(the fewest bytes any implementation must move), for fwd and bwd alike; the copy counts its
read and write. bf16 throughout, HF layout: q/k from `view(B, S, H, D).transpose(1, 2)`, cos/sin
(B, S, rotary_dim) as HF's rotary embedding returns them.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import emit
import triton

import fuse_plugin

OPS = torch.ops.fuse_plugin
SHAPES = [  # B, Hq, Hkv, S, D, rotary_dim
    (1, 32, 8, 16384, 128, 128),
    (8, 32, 32, 2048, 128, 128),
    (4, 32, 8, 4096, 64, 32),
]


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_t(y):
    """Transpose of rotate_half: rotate_half(x) = cat(-x2, x1)  =>  rotate_halfᵀ(y) = cat(y2, -y1)."""
    y1 = y[..., : y.shape[-1] // 2]
    y2 = y[..., y.shape[-1] // 2 :]
    return torch.cat((y2, -y1), dim=-1)


def hf_rope(q, k, cos, sin, rd):
    """HF's apply_rotary_pos_emb, with GPT-NeoX's partial-rotary split when rd < D."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if rd == q.shape[-1]:
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    k_rot, k_pass = k[..., :rd], k[..., rd:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def hf_rope_backward(gq, gk, cos, sin, rd):
    """dq, dk of hf_rope for upstream gradients gq, gk: the transposed map, written out."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def one(g):
        if rd == g.shape[-1]:
            return g * cos + rotate_half_t(g * sin)
        g_rot, g_pass = g[..., :rd], g[..., rd:]
        return torch.cat([g_rot * cos + rotate_half_t(g_rot * sin), g_pass], dim=-1)

    return one(gq), one(gk)


def ours(q, k, cos, sin, rd):
    return OPS.rotary_qk(q, k, cos.unsqueeze(1), sin.unsqueeze(1), False, rd)


def ours_backward(gq, gk, cos, sin, rd):
    return OPS.rotary_qk_backward(gq, gk, cos.unsqueeze(1), sin.unsqueeze(1), False, rd, gq.dtype, gk.dtype)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def host_us(fn, n=30):
    """Host time to enqueue one call (the GPU busy meanwhile, so nothing waits on it)."""
    torch.cuda.synchronize()
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_inputs(b, hq, hkv, s, d, rd, dtype=torch.bfloat16):
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    pos = torch.arange(s, device="cuda", dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, device="cuda", dtype=torch.float32) / rd))
    emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)[None].expand(b, s, rd)
    cos, sin = emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()
    gq = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
    gk = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
    return q, k, cos, sin, gq, gk


def check(q, k, cos, sin, gq, gk, rd, compiled_bwd):
    """Ours (fwd and bwd) against float64; the explicit backward expression against autograd."""
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    ref = hf_rope(q64, k64, cos.double(), sin.double(), rd)
    ref_g = torch.autograd.grad(ref, (q64, k64), (gq.double(), gk.double()))
    for r, g in zip(ref, ours(q, k, cos, sin, rd)):
        assert rel_err(g, r) < 1e-2, f"ours fwd differs from float64: {rel_err(g, r)}"
    for r, g in zip(ref_g, ours_backward(gq, gk, cos, sin, rd)):
        assert rel_err(g, r) < 1e-2, f"ours bwd differs from float64 autograd: {rel_err(g, r)}"
    for r, g in zip(ref_g, hf_rope_backward(gq.double(), gk.double(), cos.double(), sin.double(), rd)):
        assert rel_err(g, r) < 1e-12, "explicit backward expression != autograd"
    for r, g in zip(ref_g, compiled_bwd(gq, gk, cos, sin, rd)):
        assert rel_err(g, r) < 1e-2, f"compiled bwd expression differs: {rel_err(g, r)}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with fuse_plugin.disabled():  # the stock compiled expressions must stay stock
        compiled = torch.compile(hf_rope, dynamic=False)
        compiled_bwd = torch.compile(hf_rope_backward, dynamic=False)
        lines = [
            f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
            f"{time.strftime('%Y-%m-%d')} | GB/s (CUDA-graph replay, median; median of {args.rounds} rounds; "
            "q,k read+write, cos/sin once), bf16",
            "",
            "| shape (B, Hq, Hkv, S, D, rotary_dim) | pass | copy | eager | compiled | ours | ours / compiled | ours / copy "
            "| host µs/call compiled, ours |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b, hq, hkv, s, d, rd in SHAPES:
            q, k, cos, sin, gq, gk = make_inputs(b, hq, hkv, s, d, rd)
            elem = q.element_size()
            qk_bytes = (q.numel() + k.numel()) * elem
            moved = 2 * qk_bytes + 2 * cos.numel() * elem
            src = torch.randn(qk_bytes // elem, device="cuda", dtype=q.dtype)
            dst = torch.empty_like(src)
            check(q, k, cos, sin, gq, gk, rd, compiled_bwd)

            fns = {
                "fwd": {"eager": lambda: hf_rope(q, k, cos, sin, rd),
                        "compiled": lambda: compiled(q, k, cos, sin, rd),
                        "ours": lambda: ours(q, k, cos, sin, rd)},
                "bwd": {"eager": lambda: hf_rope_backward(gq, gk, cos, sin, rd),
                        "compiled": lambda: compiled_bwd(gq, gk, cos, sin, rd),
                        "ours": lambda: ours_backward(gq, gk, cos, sin, rd)},
            }
            for phase, impls in fns.items():
                times = {name: [] for name in ("copy", *impls)}
                with torch.no_grad():
                    for _ in range(args.rounds):
                        times["copy"].append(bench(lambda: dst.copy_(src)))
                        for name, fn in impls.items():
                            times[name].append(bench(fn))
                    host = {name: host_us(impls[name]) for name in ("compiled", "ours")}
                ms = {name: statistics.median(t) for name, t in times.items()}
                copy_gbs = 2 * qk_bytes / ms["copy"] / 1e6
                gbs = {name: moved / t / 1e6 for name, t in ms.items() if name != "copy"}
                lines.append(
                    f"| ({b}, {hq}, {hkv}, {s}, {d}, {rd}) | {phase} | {copy_gbs:.0f} | {gbs['eager']:.0f} | "
                    f"{gbs['compiled']:.0f} | {gbs['ours']:.0f} | {gbs['ours'] / gbs['compiled']:.2f} | "
                    f"{gbs['ours'] / copy_gbs:.2f} | {host['compiled']:.0f}, {host['ours']:.0f} |"
                )
                print(lines[-1], flush=True)
            del q, k, gq, gk, src, dst
            torch.cuda.empty_cache()
    emit(lines, args.out)


if __name__ == "__main__":
    main()
