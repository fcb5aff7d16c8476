"""Rotary speed on the GPU: our q+k op vs the eager HF expression vs that expression compiled.

    python benchmarks/rotary.py [--out FILE.md]

GB/s = bytes / median time (`triton.testing.do_bench`), counting q and k read once and written
once, and cos/sin read once (the fewest bytes any implementation must move). Forward and backward
(the gradient w.r.t. q and k). The device-to-device copy rate of a tensor of q+k's size, measured
in the same run, is the ceiling. bf16 throughout, HF layout: q/k from `view(B, L, H, D).transpose(1, 2)`,
cos/sin (B, L, rotary_dim) as HF's rotary embedding returns them.
"""
from __future__ import annotations

import argparse
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


def ours(q, k, cos, sin, rd):
    return OPS.rotary_qk(q, k, cos.unsqueeze(1), sin.unsqueeze(1), False, rd)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16
    with fuse_plugin.disabled():  # the stock compiled expression must stay stock
        compiled = torch.compile(hf_rope, dynamic=False)
        lines = [
            f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
            f"{time.strftime('%Y-%m-%d')} | GB/s (median of do_bench; q,k read+write, cos/sin once), bf16",
            "",
            "| shape (B, Hq, Hkv, S, D, rotary_dim) | pass | copy | eager | compiled | ours | ours / compiled | ours / copy |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for b, hq, hkv, s, d, rd in SHAPES:
            q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            pos = torch.arange(s, device="cuda", dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, device="cuda", dtype=torch.float32) / rd))
            emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)[None].expand(b, s, rd)
            cos, sin = emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()
            elem = q.element_size()
            qk_bytes = (q.numel() + k.numel()) * elem
            table_bytes = 2 * cos.numel() * elem
            moved = 2 * qk_bytes + table_bytes
            src = torch.randn(qk_bytes // elem, device="cuda", dtype=dtype)
            dst = torch.empty_like(src)
            copy_ms = bench(lambda: dst.copy_(src))
            copy_gbs = 2 * qk_bytes / copy_ms / 1e6

            # correctness first: ours vs the eager expression (float32 math in ours, bf16 in eager)
            ref = hf_rope(q.double(), k.double(), cos.double(), sin.double(), rd)
            got = ours(q, k, cos, sin, rd)
            for r, g in zip(ref, got):
                err = ((g.double() - r).norm() / r.norm()).item()
                assert err < 1e-2, f"ours differs from eager: rel err {err}"

            impls = {"eager": hf_rope, "compiled": compiled, "ours": ours}
            for phase in ("fwd", "bwd"):
                gbs = {}
                for name, fn in impls.items():
                    if phase == "fwd":
                        with torch.no_grad():
                            ms = bench(lambda: fn(q, k, cos, sin, rd))
                    else:
                        outs = fn(q, k, cos, sin, rd)
                        grads = [torch.randn_like(o) for o in outs]
                        ms = bench(lambda: torch.autograd.grad(outs, (q, k), grads, retain_graph=True))
                    gbs[name] = moved / ms / 1e6
                lines.append(
                    f"| ({b}, {hq}, {hkv}, {s}, {d}, {rd}) | {phase} | {copy_gbs:.0f} | {gbs['eager']:.0f} | "
                    f"{gbs['compiled']:.0f} | {gbs['ours']:.0f} | {gbs['ours'] / gbs['compiled']:.2f} | "
                    f"{gbs['ours'] / copy_gbs:.2f} |"
                )
                print(lines[-1], flush=True)
            del q, k, src, dst
            torch.cuda.empty_cache()
    emit(lines, args.out)


if __name__ == "__main__":
    main()
