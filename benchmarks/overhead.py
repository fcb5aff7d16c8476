"""Per-call host overhead of the ops: tiny inputs, so the GPU work is negligible and the wall time
per call is what the CPU spends (dispatch, autograd, our launcher, the Triton launch).

    python benchmarks/overhead.py
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import fuse_plugin  # noqa: F401

OPS = torch.ops.fuse_plugin


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 4, 64, 64, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, 1, 64, 64, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, 1, 64, 64, device=dev, dtype=dt, requires_grad=True)
    kr, vr = k.detach().expand(1, 4, 64, 64).contiguous(), v.detach().expand(1, 4, 64, 64).contiguous()
    cos = torch.randn(1, 1, 64, 64, device=dev, dtype=dt)
    sin = torch.randn(1, 1, 64, 64, device=dev, dtype=dt)
    out, lse = OPS.attention(q, k, v, None, 0.0, True, 0.125)
    dout = torch.randn_like(out)
    from fuse_plugin.kernels import attention as ka
    from fuse_plugin.kernels import rotary as kr_

    rows = []
    with torch.no_grad():
        rows.append(("attention op fwd (no grad)", per_call_us(lambda: OPS.attention(q, k, v, None, 0.0, True, 0.125))))
        rows.append(("attention launcher fwd (no op dispatch)", per_call_us(lambda: ka.attention_forward(q, k, v, None, is_causal=True, scale=0.125))))
        rows.append(("attention_backward op", per_call_us(lambda: OPS.attention_backward(dout, q, k, v, None, out, lse, 0.0, True, 0.125, None, False))))
        rows.append(("attention launcher bwd", per_call_us(lambda: ka.attention_backward(dout, q, k, v, None, out, lse, is_causal=True, scale=0.125, need_dbias=False))))
        rows.append(("rotary_qk op fwd", per_call_us(lambda: OPS.rotary_qk(q, k, cos, sin, False, 64))))
        rows.append(("SDPA fwd (flash, GQA repeated)", per_call_us(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))))
        x = torch.randn(1024, device=dev)
        rows.append(("torch add (reference launch)", per_call_us(lambda: x.add(1.0))))
    rows.append(("attention op fwd+bwd via autograd", per_call_us(lambda: torch.autograd.grad(OPS.attention(q, k, v, None, 0.0, True, 0.125)[0], (q, k, v), dout), n=500)))
    qr, krg, vrg = (t.detach().requires_grad_() for t in (q, kr, vr))
    rows.append(("SDPA fwd+bwd via autograd (flash)", per_call_us(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qr, krg, vrg, is_causal=True), (qr, krg, vrg), dout), n=500)))
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for name, us in rows:
        print(f"{name:45} {us:8.1f} us/call")
    del kr_
    if "--profile" in sys.argv:  # where the forward launcher's host time goes
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        with torch.no_grad():
            for _ in range(2000):
                ka.attention_forward(q, k, v, None, is_causal=True, scale=0.125)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        # and the whole training call: op forward, autograd, op backward
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            torch.autograd.grad(OPS.attention(q, k, v, None, 0.0, True, 0.125)[0], (q, k, v), dout)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
