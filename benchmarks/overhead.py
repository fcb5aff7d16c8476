"""Host time per op call under torch.compile: tiny inputs, so the GPU work is negligible and the
wall time is what the CPU spends.

    python benchmarks/overhead.py [--eager] [--profile] [--dynamic]

A compiled function pays a fixed cost per call (Dynamo's guards, the runtime wrappers) whatever
it holds, so one op alone would mostly measure that. Each row compiles a chain of N = 1 and
N = 11 calls of the op (each feeding the next, as the layers of a model do) and reports
(time(11) - time(1)) / 10: the host time one more op call adds to a compiled model. Rows:
  plugin    our op decomposed into its kernel launches (ops/inductor.py), Inductor launching them;
  opaque    the same op kept one custom-op call (FUSE_PLUGIN_INDUCTOR_LAUNCH=0: how every call
            ran before issue 13);
  SDPA      F.scaled_dot_product_attention (flash; the GQA heads via enable_gqa);
  Inductor rope  HF's eager rotate_half rope, which Inductor fuses into its own kernels;
Training rows chain the attention N times, then take the gradient of q, k, v through all of them.
With --dynamic the chains compile with dynamic=True (the length a SymInt, as Dynamo makes it
once a model has seen two lengths). With --eager: the ops and launchers called directly (no
compile). Inductor's and AOTAutograd's caches are off: the plugin and opaque rows compile the
same Dynamo graph, and the caches do not see FUSE_PLUGIN_INDUCTOR_LAUNCH.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F

import common  # noqa: E402,F401  (puts the source tree on sys.path)
import fuse_plugin  # noqa: F401

OPS = torch.ops.fuse_plugin
L, D = 64, 64
DYNAMIC = False  # --dynamic


def per_call_us(fn, n=1000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def best_of(fn, n=1000, runs=3):
    """The host's speed swings between runs: the best of a few runs of n calls."""
    return min(per_call_us(fn, n) for _ in range(runs))


@contextlib.contextmanager
def opaque_ops():
    old = os.environ.get("FUSE_PLUGIN_INDUCTOR_LAUNCH")
    os.environ["FUSE_PLUGIN_INDUCTOR_LAUNCH"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FUSE_PLUGIN_INDUCTOR_LAUNCH")
        else:
            os.environ["FUSE_PLUGIN_INDUCTOR_LAUNCH"] = old


def inputs(grad: bool):
    dev, dt = "cuda", torch.bfloat16
    # HF layout: (B, L, H, D) memory, seen as (B, H, L, D); GQA 4/1
    q = torch.randn(1, L, 4, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(grad)
    k = torch.randn(1, L, 1, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(grad)
    v = torch.randn(1, L, 1, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(grad)
    cos = torch.randn(1, 1, L, D, device=dev, dtype=dt)
    sin = torch.randn(1, 1, L, D, device=dev, dtype=dt)
    return q, k, v, cos, sin


def plugin_attention(q, k, v):
    return OPS.attention(q, k, v, None, 0.0, True, 0.125)[0]


def sdpa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)


def plugin_rope(q, k, cos, sin):
    return OPS.rotary_qk(q, k, cos, sin, False, D)


def inductor_rope(q, k, cos, sin):
    def rotate_half(x):
        return torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def chain_attention(attn, n):
    def f(q, k, v):
        for _ in range(n):
            q = attn(q, k, v)
        return q
    return f


def chain_rope(rope, n):
    def f(q, k, cos, sin):
        for _ in range(n):
            q, k = rope(q, k, cos, sin)
        return q, k
    return f


def compiled_call_us(make, args, train=False, dout=None, n_calls=1000):
    """(time(11 ops) - time(1 op)) / 10 of the compiled chains built by make(n)."""
    times = {}
    for n in (1, 11):
        torch._dynamo.reset()
        c = torch.compile(make(n), dynamic=DYNAMIC)
        if train:
            inp = [a for a in args if a.requires_grad]
            times[n] = best_of(lambda: torch.autograd.grad(c(*args), inp, dout), n=n_calls // 4)
        else:
            with torch.no_grad():
                times[n] = best_of(lambda: c(*args), n=n_calls)
    torch._dynamo.reset()
    return (times[11] - times[1]) / 10


def launches_of(make, args) -> str:
    """Which kernels/ops the compiled chain of one op runs (from Inductor's generated code)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(make(1), dynamic=DYNAMIC), *args)
    code = "\n".join(code)
    names = sorted(set(re.findall(r"torch\.ops\.fuse_plugin\.(\w+)", code))
                   | set(re.findall(r"\b(\w+_kernel)_\d+\.run\(", code)))
    return ", ".join(names) or "-"


def compiled_rows():
    """(name, µs per additional op call) of compiled chains; see the module docstring."""
    rows = []
    q, k, v, cos, sin = inputs(False)
    for label, make, args in (
            ("attention fwd", lambda n: chain_attention(plugin_attention, n), (q, k, v)),
            ("rotary_qk fwd", lambda n: chain_rope(plugin_rope, n), (q, k, cos, sin))):
        rows.append((f"{label}: plugin [{launches_of(make, args)}]", compiled_call_us(make, args)))
        with opaque_ops():
            rows.append((f"{label}: opaque op (before)", compiled_call_us(make, args)))
    rows.append(("attention fwd: SDPA",
                 compiled_call_us(lambda n: chain_attention(sdpa_attention, n), (q, k, v))))
    rows.append(("rope fwd: Inductor's fused HF rope",
                 compiled_call_us(lambda n: chain_rope(inductor_rope, n), (q, k, cos, sin))))
    q, k, v, _, _ = inputs(True)
    dout = torch.randn(1, 4, L, D, device="cuda", dtype=torch.bfloat16)
    rows.append(("attention fwd+bwd: plugin",
                 compiled_call_us(lambda n: chain_attention(plugin_attention, n), (q, k, v), True, dout)))
    with opaque_ops():
        rows.append(("attention fwd+bwd: opaque op (before)",
                     compiled_call_us(lambda n: chain_attention(plugin_attention, n), (q, k, v), True, dout)))
    rows.append(("attention fwd+bwd: SDPA",
                 compiled_call_us(lambda n: chain_attention(sdpa_attention, n), (q, k, v), True, dout)))
    return rows


def eager_rows():
    from fuse_plugin.kernels import attention as ka

    q, k, v, cos, sin = inputs(False)
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    out, lse = OPS.attention(qc, kc, vc, None, 0.0, True, 0.125)
    dout = torch.randn_like(out)
    rows = []
    with torch.no_grad():
        rows.append(("eager attention op fwd", best_of(lambda: OPS.attention(qc, kc, vc, None, 0.0, True, 0.125))))
        rows.append(("eager attention launcher fwd", best_of(lambda: ka.attention_forward(qc, kc, vc, None, is_causal=True, scale=0.125))))
        rows.append(("eager attention_backward op", best_of(lambda: OPS.attention_backward(dout, qc, kc, vc, None, out, lse, 0.0, True, 0.125, None, False))))
        rows.append(("eager rotary_qk op fwd", best_of(lambda: OPS.rotary_qk(q, k, cos, sin, False, D))))
        rows.append(("eager SDPA fwd", best_of(lambda: sdpa_attention(qc, kc, vc))))
        x = torch.randn(1024, device="cuda")
        rows.append(("eager torch add (one launch)", best_of(lambda: x.add(1.0))))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--eager", action="store_true", help="also the eager op / launcher rows")
    parser.add_argument("--profile", action="store_true", help="cProfile of 1000 compiled fwd+bwd")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    args = parser.parse_args(argv)
    global DYNAMIC
    DYNAMIC = args.dynamic
    torch._inductor.config.force_disable_caches = True
    rows = compiled_rows()
    if args.eager:
        rows += eager_rows()
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | host µs per op call "
          f"(compiled{' dynamic=True' if DYNAMIC else ''}: per extra op in a chain; best of 3 runs; bf16, "
          f"B 1, L {L}, D {D}, GQA 4/1)")
    for name, us in rows:
        print(f"  {name:70} {us:8.1f}")
    if args.profile:
        import cProfile
        import pstats

        q, k, v, _, _ = inputs(True)
        dout = torch.randn(1, 4, L, D, device="cuda", dtype=torch.bfloat16)
        c = torch.compile(chain_attention(plugin_attention, 11), dynamic=False)
        torch.autograd.grad(c(q, k, v), (q, k, v), dout)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            torch.autograd.grad(c(q, k, v), (q, k, v), dout)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return rows


if __name__ == "__main__":
    main()
