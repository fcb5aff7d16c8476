"""Which tiles hang the windowed atomic backward on this GPU (NOTES.md attempts 36, 48).

    python benchmarks/window_hang.py [--timeout 25]

On the H200 and the H100 (Triton 3.6) the general atomic backward with a sliding window never
finished with 2-stage tiles and ran with 1-stage ones, so it ran unpipelined until stop 33 found
the cause: the full loop's rotation `(j + pid_n) % n_full`, whose modulus is 0 for a key block
with no fully visible query block; the pipelined loop's prologue computes that row before its
trip-count test. The modulus is now at least 1 and the windowed backward takes the plain
problem's (pipelined) tiles. Each case here runs in its own process with a timeout (a hung kernel
would otherwise hold the whole device call): the explicit configs as given, the last cases through
the registry as users do. Prints one line per case: ok (seconds, checksums) or TIMEOUT.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

CASE = r'''
import sys, time, torch
from fuse_plugin.kernels.attention import attention_forward, attention_backward, AttentionConfig
from fuse_plugin.kernels import registry
W, L, cfg = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = None if cfg == "registry" else AttentionConfig(*map(int, cfg.split(",")))
torch.manual_seed(0)
q, k, v = (torch.randn(1, 4, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
kw = dict(window=W) if W else {}
with registry.forced("general"):
    out, lse = attention_forward(q, k, v, None, is_causal=True, scale=0.088, **kw)
    t0 = time.time()
    g = attention_backward(torch.ones_like(out), q, k, v, None, out, lse, is_causal=True, scale=0.088,
                           need_dbias=False, config=cfg, **kw)
    torch.cuda.synchronize()
print("ok", f"{time.time() - t0:.1f}s", [round(float(t.float().abs().sum()), 1) for t in g[:3]])
'''

CASES = [(64, 256, c) for c in ("64,128,8,2", "64,128,8,1", "64,128,4,2", "64,64,8,2", "64,64,4,1")]
CASES += [(0, 256, "64,128,8,2"), (64, 256, "registry"), (64, 128, "registry"), (512, 2048, "registry")]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=25)
    args = p.parse_args()
    for w, length, cfg in CASES:
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, "-c", CASE, str(w), str(length), cfg], capture_output=True,
                               text=True, timeout=args.timeout)
            what = r.stdout.strip()[-160:] or r.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            what = "TIMEOUT"
        print(f"window {w} L {length} config {cfg}: {what} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
