"""Decode-step attention on the GPU: our decode kernels vs our general kernel vs SDPA, one run.

    python benchmarks/decode.py [--quick] [--out FILE.md]

A KV-cache decode step as HF's static cache makes it: q (B, Hq, Lq, D) laid out (B, Lq, Hq, D)
(the projection's view), k/v the whole static buffer (B, Hkv, Lmax, D), and HF's 4-D float mask
(B, 1, Lq, Lmax): 0 on the filled part (causal among the Lq new tokens, which sit at the end of
it), finfo(bf16).min elsewhere. bf16, B 1 and 8, Hq/Hkv 12/4 and 16/4, D 64 and 128, Lq 1 and 4,
Lmax 768 and 4352, filled 50% and 90%.

Each shape is first checked against a float64 reference (max relative error, printed). Times are
device times in µs, the median of ``triton.testing.do_bench_cudagraph`` (the calls replayed from
a CUDA graph: what a step costs under ``mode="reduce-overhead"``, with no host time in it):

* ``decode``: our op's forward as dispatched (``_forward_family`` picks the decode kernels);
* ``general``: our general forward kernel, forced (a user config: its heuristic tiles);
* SDPA with the mask, the efficient and cuDNN backends, K/V repeated to Hq heads (what HF's
  sdpa_attention_forward does with a mask under torch.compile: ``repeat_kv``; the repeat is part
  of the timed call) and with ``enable_gqa=True`` (n/a where the backend refuses it), and, at
  Lq 1, HF's eager trick ``pack_gqa`` (the group's q heads as the query rows of its kv head, the
  mask broadcast); flash takes no mask;
* ``flash*``: SDPA flash with ``enable_gqa`` on the filled keys only, no mask (a dynamic cache's
  read: the floor a mask-skipping kernel aims at, not a like-for-like choice).

``speedup`` = best SDPA-with-mask time / decode time. Must finish in < 3 min on an H100.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton
from common import emit
from torch.nn.attention import SDPBackend, sdpa_kernel

import fuse_plugin  # noqa: F401
from fuse_plugin.kernels import attention as attn
from fuse_plugin.kernels import attention_config as C

OPS = torch.ops.fuse_plugin
DTYPE = torch.bfloat16
BACKENDS = {"eff": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}


def make_step(B, Hq, Hkv, Lq, Lmax, D, fill, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    filled = int(Lmax * fill)
    q = torch.randn(B, Lq, Hq, D, device="cuda", dtype=DTYPE, generator=g).transpose(1, 2)
    k = torch.randn(B, Hkv, Lmax, D, device="cuda", dtype=DTYPE, generator=g)
    v = torch.randn(B, Hkv, Lmax, D, device="cuda", dtype=DTYPE, generator=g)
    k[:, :, filled:] = 0  # the unfilled tail of a static cache
    v[:, :, filled:] = 0
    pos = filled - Lq + torch.arange(Lq, device="cuda")  # the new tokens' cache positions
    visible = torch.arange(Lmax, device="cuda")[None, :] <= pos[:, None]
    mask = torch.zeros(Lq, Lmax, device="cuda", dtype=DTYPE)
    mask = mask.masked_fill(~visible, torch.finfo(DTYPE).min).expand(B, 1, Lq, Lmax)
    return q, k, v, mask.contiguous(), filled


def reference(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) * scale + mask.double()
    return torch.softmax(s, -1) @ v


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def repeat_kv(x, n):
    B, H, L, D = x.shape
    return x[:, :, None].expand(B, H, n, L, D).reshape(B, H * n, L, D) if n > 1 else x


def impls(q, k, v, mask, filled, scale):
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    n = Hq // Hkv
    bias4 = mask.expand(B, Hq, Lq, k.shape[2])
    general = C.forward_config(D, D, DTYPE)

    def sdpa(backend, how):
        def run():
            with sdpa_kernel(BACKENDS[backend]):
                if how == "rep":
                    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n),
                                                          attn_mask=mask, scale=scale)
                if how == "gqa":
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                          enable_gqa=True)
                # HF's pack_gqa (Lq 1): (B, Hkv, group, D) queries, the mask broadcast
                o = F.scaled_dot_product_attention(q.reshape(B, Hkv, n, D), k, v,
                                                   attn_mask=mask, scale=scale)
                return o.reshape(B, Hq, 1, D)
        return run

    def flash_prefix():
        with sdpa_kernel(BACKENDS["flash"]):
            return F.scaled_dot_product_attention(q, k[:, :, :filled], v[:, :, :filled],
                                                  scale=scale, enable_gqa=True)

    out = {
        "decode": lambda: OPS.attention(q, k, v, mask, 0.0, False, scale)[0],
        "general": lambda: attn.attention_forward(q, k, v, bias4, is_causal=False, scale=scale,
                                                  config=general)[0],
        "eff-rep": sdpa("eff", "rep"), "eff-gqa": sdpa("eff", "gqa"),
        "cudnn-rep": sdpa("cudnn", "rep"), "cudnn-gqa": sdpa("cudnn", "gqa"),
    }
    if Lq == 1:
        out["eff-pack"] = sdpa("eff", "pack")
        out["cudnn-pack"] = sdpa("cudnn", "pack")
    if Lq == 1:  # the prefix read has no causal structure to add at Lq 1
        out["flash*"] = flash_prefix
    return out


def _chosen_family(q, k, v, mask, scale) -> str:
    """The kernel family the op runs for this step (kernels/registry.py), as the launcher chooses it."""
    from fuse_plugin.kernels import registry
    from fuse_plugin.kernels.call import AttentionCall
    from fuse_plugin.ops.attention import bias_4d

    return registry.choose(AttentionCall.forward(q, k, v, bias_4d(mask, q, k), is_causal=False, scale=scale))[0].name


MASKED_SDPA = ("eff-rep", "eff-gqa", "eff-pack", "cudnn-rep", "cudnn-gqa", "cudnn-pack")
COLUMNS = ("decode", "general", "eff-rep", "eff-gqa", "eff-pack", "cudnn-rep", "cudnn-gqa",
           "cudnn-pack", "flash*")


def time_us(fn, quick):
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=10 if quick else 25,
                                                 return_mode="median") * 1e3
    except Exception as e:  # a backend that refuses the problem
        return f"n/a ({type(e).__name__})"


def fmt(t):
    return f"{t:.1f}" if isinstance(t, float) else "n/a"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="B 8, D 128, Lmax 4352 only")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    grid = list(itertools.product((1, 8), ((12, 4), (16, 4)), (64, 128), (1, 4), (768, 4352),
                                  (0.5, 0.9)))
    if args.quick:
        grid = [g for g in grid if g[0] == 8 and g[2] == 128 and g[4] == 4352]
    t_start = time.time()
    lines = [f"{time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch "
             f"{torch.__version__} | triton {triton.__version__} | bf16, µs per call (median of "
             "do_bench_cudagraph), static cache with HF's float mask",
             "",
             "| B | Hq/Hkv | D | Lq | Lmax | filled | err | " + " | ".join(COLUMNS)
             + " | speedup |",
             "|" + "---|" * (8 + len(COLUMNS))]
    worst = 0.0
    for B, (Hq, Hkv), D, Lq, Lmax, fill in grid:
        q, k, v, mask, filled = make_step(B, Hq, Hkv, Lq, Lmax, D, fill)
        scale = D ** -0.5
        family = _chosen_family(q, k, v, mask, scale)
        assert family == "decode", f"the op chose {family!r} for a decode step, not the decode kernels"
        out = OPS.attention(q, k, v, mask, 0.0, False, scale)[0]
        err = rel_err(out, reference(q, k, v, mask, scale))
        worst = max(worst, err)
        fns = impls(q, k, v, mask, filled, scale)
        times = {name: time_us(fn, args.quick) for name, fn in fns.items()}
        best_sdpa = min((t for n, t in times.items() if n in MASKED_SDPA and isinstance(t, float)),
                        default=None)
        speed = f"{best_sdpa / times['decode']:.2f}x" if best_sdpa and isinstance(
            times["decode"], float) else "n/a"
        lines.append(f"| {B} | {Hq}/{Hkv} | {D} | {Lq} | {Lmax} | {filled} | {err:.1e} | "
                     + " | ".join(fmt(times.get(c, "-")) if c in times else "-" for c in COLUMNS)
                     + f" | {speed} |")
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"max rel err vs float64: {worst:.2e} (bf16 tolerance 1e-2); "
                 f"{time.time() - t_start:.0f} s")
    if worst > 1e-2:
        lines.append("ERROR: the decode kernels exceed the bf16 tolerance")
    print()
    emit(lines, args.out)


if __name__ == "__main__":
    main()
