"""Compile the Gluon kernels (kernels/attention_fwd_gluon.py, attention_bwd_gluon.py) for sm_90 on a
machine WITHOUT a GPU, with Triton 3.6 (the version they are written against), and read ptxas's
registers and spills for each specialisation.

    pip download --no-deps triton==3.6.0 -d /tmp/t36whl
    pip install --no-deps --target /tmp/t36 /tmp/t36whl/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python benchmarks/gluon_compile_check.py [--strict] [--ptx DIR]

``--ptx DIR`` also writes each specialisation's PTX there (one file per line printed): a
refactor's PTX compared before and after, modulo virtual register names and debug lines.

compile_check.py does the same for the Triton kernels with the installed Triton; the Gluon API
moves between releases, so these kernels need 3.6 beside whatever CI runs (3.9 here). A kernel's
``warmup`` compiles it with the active driver replaced by a stand-in that reports an sm_90 GPU (no
CUDA needed); ptxas (Triton's own) then assembles the PTX with ``-v``. A spill that appears after
a change is the thing to look at before spending device time (stop 35: the window's kernels were
checked this way; stop 36: the persistent forward). A developer check, not a test: it prints one
line per specialisation and PASS / FAIL last.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402

import common  # noqa: E402,F401  (puts the source tree on sys.path)

if not triton.__version__.startswith("3.6"):
    sys.exit(f"Triton {triton.__version__}: the Gluon kernels are written for 3.6 (see the docstring to put it "
             "beside this one)")

from triton.backends.compiler import GPUTarget  # noqa: E402

from fuse_plugin.kernels import attention_bwd_gluon as gb  # noqa: E402
from fuse_plugin.kernels import attention_fwd_gluon as gf  # noqa: E402

STRICT = "--strict" in sys.argv  # a spill fails the check too
PTX_DIR = sys.argv[sys.argv.index("--ptx") + 1] if "--ptx" in sys.argv else None

# The active driver's place, taken by an sm_90 GPU that does not exist (compiling needs no device).
DRIVER = SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32), get_current_device=lambda: 0,
                         get_current_stream=lambda d=None: 0, get_device_interface=lambda: torch.cuda,
                         utils=SimpleNamespace(get_device_properties=lambda i: {"max_shared_mem": 232448}))


def ptxas_lines(ptx: str) -> str:
    """ptxas -v's registers / spill lines for one kernel's PTX."""
    import triton.backends.nvidia as nv

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", out], capture_output=True, text=True)
    keep = [line.split(":", 1)[-1].strip() for line in (r.stdout + r.stderr).splitlines()
            if "registers" in line or "spill" in line or "rror" in line]
    return "; ".join(keep) if r.returncode == 0 else f"ptxas failed: {'; '.join(keep)[:300]}"


def compile_one(name: str, kernel, grid, args, kwargs) -> bool:
    t0 = time.time()
    try:
        with mock.patch.object(triton.runtime.driver, "_active", DRIVER, create=True):
            c = kernel.warmup(*args, grid=grid, **kwargs)
    except Exception as e:  # noqa: BLE001  the failure is the finding: printed, the others still run
        print(f"{name:52} FAIL {type(e).__name__}: {str(e)[:1500]}", flush=True)
        return False
    info = ptxas_lines(c.asm["ptx"])
    if PTX_DIR:
        os.makedirs(PTX_DIR, exist_ok=True)
        with open(os.path.join(PTX_DIR, re.sub(r"[^\w.=-]+", "_", name) + ".ptx"), "w") as f:
            f.write(c.asm["ptx"])
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info))
    print(f"{name:52} ok {time.time() - t0:4.1f} s, shared {c.metadata.shared} B | {info}", flush=True)
    return "ptxas failed" not in info and not (spilled and STRICT)


def main() -> int:
    ok = True
    dt = torch.bfloat16
    for D in (128, 64):
        q = torch.randn(1, 4, 256, D, dtype=dt)
        k, v = torch.randn(1, 2, 256, D, dtype=dt), torch.randn(1, 2, 256, D, dtype=dt)
        out, lse = torch.empty_like(q), torch.empty(1, 4, 256)
        for name, var in gf.VARIANTS.items():
            if D not in gf.VARIANT_HEAD_DIMS[name]:
                continue
            for causal, window in ((True, 0), (True, 100), (False, 0)):
                grid, args, kwargs = gf._launch_args(q, k, v, out, lse, causal, 0.1, var, window)
                ok &= compile_one(f"fwd D{D} {name} causal={causal} window={window}", gf.attention_fwd_gluon_kernel,
                                  grid, args, kwargs)
                if name == gf.DEFAULT_VARIANTS[D]:  # the persistent forward (not chosen by the registry)
                    pvar = var._replace(persistent=True)
                    grid, args, kwargs = gf._launch_args(q, k, v, out, lse, causal, 0.1, pvar, window)
                    ok &= compile_one(f"fwd D{D} {name} persistent causal={causal} window={window}",
                                      gf.attention_fwd_gluon_persistent_kernel, grid, args, kwargs)
        cfg = gb.variant_config("m64n128s2xl", D)
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        lse2, delta, dqacc = torch.empty(1, 4, 256), torch.empty(1, 4, 256), torch.empty(1, 4, 256, D)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for causal, window, dkv_out in ((True, 0, 0), (False, 0, 0), (True, 100, 0), (True, 100, 1)):
            args = (gb._desc(q, bm, D), gb._desc(q, bm, D), gb._desc(k, bn, D), gb._desc(v, bn, D),
                    gb._desc(dk, bn, D), gb._desc(dv, bn, D), gb._vec_desc(lse2, bm), gb._vec_desc(delta, bm),
                    dqacc, dqacc, dqacc, 1, 4, 2, 256, 256, 256, 1, 1, window, 0.1, 0.1)
            kwargs = dict(**gb.kernel_constexprs(cfg, D, causal, False, dkv_out, window), num_warps=gb._NUM_WARPS,
                          maxnreg=cfg["MAXNREG"])
            ok &= compile_one(f"bwd D{D} causal={causal} window={window} dkv_out={dkv_out}",
                              gb._attn_bwd_ws_kernel, (4,), args, kwargs)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
