"""Compile the attention kernels for sm_90 on a machine WITHOUT a GPU (Triton's front end, the
Hopper passes and ptxas), with the exact arguments our launchers pass.

    python benchmarks/compile_check.py [--quick]

Triton's interpreter (what CI runs) resolves names through Python and never lowers anything, so a
kernel can pass every CPU test and still fail to compile (a name a moved helper no longer sees,
a layout conversion the Hopper backend rejects, shared memory over the limit). This records the
launches of representative calls (forward/backward, TMA forward, decode, dropout, deterministic,
rope, bias, the small family) with the kernels replaced by recorders in the modules that launch
them, then compiles each distinct kernel specialisation for
GPUTarget("cuda", 90). Uses Triton internals (ASTSource, GPUTarget) on purpose: a developer check
before spending device time, not a test. A backward with dropout takes ~80 s to compile.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import common  # noqa: E402,F401  (puts the source tree on sys.path)
import fuse_plugin.kernels.attention as A  # noqa: E402
import fuse_plugin.kernels.attention_config as AC  # noqa: E402
import fuse_plugin.kernels.attention_decode as DEC  # noqa: E402
import fuse_plugin.kernels.attention_general as GEN  # noqa: E402
import fuse_plugin.kernels.attention_hopper as HOP  # noqa: E402
import fuse_plugin.kernels.attention_small as SMALL  # noqa: E402
from fuse_plugin.kernels import registry  # noqa: E402
from fuse_plugin.kernels.launch import bind  # noqa: E402

# The launch modules and the kernels they launch (each replaced by a recorder in its module).
KERNELS = {
    GEN: ["attention_fwd_kernel", "attention_bwd_preprocess_kernel", "attention_bwd_kernel",
          "attention_dq_cast_kernel", "attention_dq_rope_cast_kernel", "attention_bwd_dkdv_kernel",
          "attention_bwd_dq_kernel"],
    HOP: ["attention_fwd_tma_kernel", "attention_bwd_tma_kernel", "attention_bwd_dkdv_tma_kernel",
          "attention_bwd_dq_tma_kernel"],
    DEC: ["attention_decode_split_kernel", "attention_decode_combine_kernel"],
    SMALL: ["attention_small_fwd_kernel", "attention_small_bwd_kernel"],
}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.int64: "*i64", torch.uint8: "*u8"}


class Recorder:
    """Stands in for a kernel: records each launch's arguments instead of running it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def record(quick: bool):
    launches = []
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, Recorder(getattr(module, name), launches))
        # The tensors here are CPU tensors; compile what a CUDA launch would: no interpreter
        # upcast of bf16 dots (fp16/bf16 dots ignore the precision argument), no interpreter.
        for helper, value in (("upcast_dot", False), ("interpreted", False)):
            if hasattr(module, helper):
                setattr(module, helper, lambda t, _v=value: _v)
    AC.smem_limit = lambda device: None  # no device to ask
    dt = torch.bfloat16
    q = torch.randn(1, 4, 128, 128, dtype=dt)
    k, v = torch.randn(1, 2, 128, 128, dtype=dt), torch.randn(1, 2, 128, 128, dtype=dt)
    bias = torch.randn(1, 1, 128, 128, dtype=dt).expand(1, 4, 128, 128)
    out, lse = A.attention_forward(q, k, v, None, is_causal=True, scale=0.1)
    # the decode kernels (attention_decode.py): one query against a static cache, HF's float mask
    kc, vc = torch.randn(2, 2, 768, 128, dtype=dt), torch.randn(2, 2, 768, 128, dtype=dt)
    mask = torch.zeros(2, 1, 1, 768, dtype=dt).expand(2, 4, 1, 768)
    A.attention_forward(torch.randn(2, 4, 1, 128, dtype=dt), kc, vc, mask, is_causal=False,
                        scale=0.1)
    A.attention_forward(torch.randn(2, 4, 1, 64, dtype=dt), kc[..., :64], vc[..., :64], mask,
                        is_causal=False, scale=0.1)  # D 64 (generate.py's llama100m)
    for causal, tile in ((True, (128, 64, 4, 2)), (False, (64, 128, 4, 2))):  # the TMA forward
        A.attention_forward(q, k, v, None, is_causal=causal, scale=0.1,
                            config=A.AttentionConfig(*tile, False, "tma"))
    for causal, tile in ((True, (64, 128, 8, 2)), (False, (64, 64, 4, 2))):  # the TMA backward
        A.attention_backward(out, q, k, v, None, out, lse, is_causal=causal, scale=0.1,
                             need_dbias=False, config=A.AttentionConfig(*tile, False, "tma"))
    A.attention_backward(out, q, k, v, None, out, lse, is_causal=True, scale=0.1, need_dbias=False)
    # the atomic-free TMA pair (also at D 256, where the table picks it)
    pair = A.AttentionConfig(64, 64, 8, 2, False, "tma_pair", (128, 32, 8, 3))
    A.attention_backward(out, q, k, v, None, out, lse, is_causal=True, scale=0.1, need_dbias=False,
                         config=pair)
    q256, k256, v256 = (torch.randn(1, 2, 128, 256, dtype=dt) for _ in range(3))
    A.attention_backward(q256, q256, k256, v256, None, q256, lse[:, :2], is_causal=True, scale=0.1,
                         need_dbias=False, config=pair)
    if not quick:
        seed = torch.tensor(1, dtype=torch.int64)
        A.attention_forward(q, k, v, bias, is_causal=False, scale=0.1, dropout_p=0.1, dropout_seed=seed)
        A.attention_backward(out, q, k, v, bias, out, lse, is_causal=False, scale=0.1, need_dbias=True,
                             dropout_p=0.1, dropout_seed=seed)
        A.attention_backward(out, q, k, v, None, out, lse, is_causal=True, scale=0.1, need_dbias=False,
                             deterministic=True)
        rope = A.Rope(torch.randn(1, 1, 128, 64), torch.randn(1, 1, 128, 64), False, 128)
        A.attention_forward(q, k, v, None, is_causal=True, scale=0.1, rope=rope)
        A.attention_backward(out, q, k, v, None, out, lse, is_causal=True, scale=0.1, need_dbias=False, rope=rope)
    # the small family (forced): Swin's windows with a window-periodic bias and its gradient
    qs, ks, vs = (torch.randn(8, 3, 49, 32, dtype=dt) for _ in range(3))
    wbias = torch.randn(4, 3, 49, 49)
    with registry.forced("small"):
        os_, ls = A.attention_forward(qs, ks, vs, wbias, is_causal=False, scale=0.2)
        A.attention_backward(os_, qs, ks, vs, wbias, os_, ls, is_causal=False, scale=0.2, need_dbias=True)
    return launches


def arg_type(a) -> str:
    if isinstance(a, torch.Tensor):
        return POINTER[a.dtype]
    if isinstance(a, TensorDescriptor):  # host-side TMA descriptor (the TMA kernels)
        return f"tensordesc<{POINTER[a.base.dtype][1:]}[{','.join(map(str, a.block_shape))}]>"
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2**31 <= a < 2**31 else "i64"
    if isinstance(a, float):
        return "fp32"
    raise TypeError(f"unexpected launch argument {a!r}")


def specialisation(kernel, args, kwargs):
    """(options, {parameter: its type, or ("constexpr", value)}) of one recorded launch, every
    argument bound by name (launch.bind)."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound = bind(kernel, args, {k: v for k, v in kwargs.items() if k not in options})
    spec = {}
    for p in kernel.params:
        value = bound[p.name]
        spec[p.name] = ("constexpr", value) if p.is_constexpr or value is None else arg_type(value)
    return options, spec


def compile_launch(kernel, options, spec):
    signature = {n: "constexpr" if isinstance(t, tuple) else t for n, t in spec.items()}
    constexprs = {(i,): t[1] for i, t in enumerate(spec.values()) if isinstance(t, tuple)}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="plain forward/backward only")
    args = parser.parse_args()
    seen, ok = set(), True
    for kernel, a, kw in record(args.quick):
        options, spec = specialisation(kernel, a, kw)
        key = (kernel.__name__, tuple(sorted(options.items())), tuple((n, repr(t)) for n, t in spec.items()))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        try:
            c = compile_launch(kernel, options, spec)
            print(f"{kernel.__name__:32} ok   {time.time() - t0:6.1f} s  {c.metadata.shared:7d} B smem  "
                  f"{options.get('num_warps')}w/{options.get('num_stages')}s", flush=True)
        except Exception as e:  # report and go on
            ok = False
            print(f"{kernel.__name__:32} FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
    print(f"compile_check: {'PASS' if ok else 'FAIL'} ({len(seen)} specialisations, sm_90, triton {triton.__version__})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
