"""Where the sliding window's time goes: the GPU kernels of one forward and one backward of our
launchers, causal (the registry's family) against window W, by kernel, under torch.profiler.

    python benchmarks/window_profile.py [--lengths 16384,32768] [--window 4096] [--configs mha,gqa]
                                        [--iters 5] [--out FILE.md] [--splits 1,2,4]

Problems as window.py's (bf16, B 1, D 128, q/k/v contiguous (B, H, L, D); "mha" 16/16, "gqa"
32/8). Per problem and direction: each kernel's device time per call (mean of --iters calls after
a warm one), for causal and for the window, with r x causal beside the window (r = visible pairs
with the window over causal's, window.py's `visible_pairs`). The backward's passes that do not
scale with the visible area (Delta / zeroing the dQ accumulator, the dQ cast, the GQA split sum)
show up as their own rows: what the window pays for them beyond r x causal's share is part of its
ratio that no tile of the main kernel can win back.

--splits: for the GQA configs also the Gluon backward with each GQA group split (the programs per
(key block, kv head); > 1: fp32 partials summed by one more kernel) forced, do_bench median ms of
the whole backward, against the launcher's own choice.
"""
from __future__ import annotations

import argparse
import torch
import triton

import fuse_plugin  # noqa: F401
from fuse_plugin.kernels.attention import attention_backward, attention_forward
from common import kernel_times
from window import CONFIGS, inputs, visible_pairs


def run(cfg: str, L: int, W: int, iters: int) -> list:
    hq, hkv = CONFIGS[cfg]
    q, k, v = (inputs(h, L, 128, torch.bfloat16, "cuda", "bhld") for h in (hq, hkv, hkv))
    r = visible_pairs(L, W) / visible_pairs(L)
    rows = []
    for direction in ("fwd", "bwd"):
        got = {}
        for name, w in (("causal", 0), ("window", W)):
            kw = dict(is_causal=True, scale=128 ** -0.5, **({"window": w} if w else {}))
            out, lse = attention_forward(q, k, v, None, **kw)
            dout = torch.randn_like(out)
            fn = (lambda: attention_forward(q, k, v, None, **kw)) if direction == "fwd" else (
                lambda: attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, **kw))
            got[name] = kernel_times(fn, iters)
        tot_c, tot_w = sum(got["causal"].values()), sum(got["window"].values())
        for name, per in got.items():
            for kname, us in sorted(per.items(), key=lambda kv: -kv[1]):
                rows.append((f"{cfg} L{L // 1024}k", direction, name, kname, us))
        rows.append((f"{cfg} L{L // 1024}k", direction, "total", f"window / (r x causal) = {tot_w / (r * tot_c):.3f}"
                     f" (r {r:.4f}; causal {tot_c:.0f}, window {tot_w:.0f} us)", tot_w))
    return rows


def splits(cfg: str, L: int, W: int, choices) -> list:
    """(problem, "bwd", "split S", "gluon backward ms", ms) rows: the Gluon backward of the window
    with each group split forced, and the launcher's whole backward."""
    from fuse_plugin.kernels.attention_bwd_gluon import attention_backward_gluon

    hq, hkv = CONFIGS[cfg]
    q, k, v = (inputs(h, L, 128, torch.bfloat16, "cuda", "bhld") for h in (hq, hkv, hkv))
    kw = dict(is_causal=True, scale=128 ** -0.5)
    out, lse = attention_forward(q, k, v, None, window=W, **kw)
    dout = torch.randn_like(out)
    rows = []

    def ms(fn):
        return min(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(2))

    t = ms(lambda: attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, window=W, **kw))
    rows.append((f"{cfg} L{L // 1024}k", "bwd", "launcher", "whole backward (ms)", t))
    for s in choices:
        if (hq // hkv) % s:
            continue
        t = ms(lambda s=s: attention_backward_gluon(dout, q, k, v, out, lse, group_split=s, window=W, **kw))
        rows.append((f"{cfg} L{L // 1024}k", "bwd", f"split {s}", "gluon backward (ms)", t))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--configs", default="mha,gqa")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--splits", default=None, help="comma-separated GQA group splits to time (GQA configs)")
    a = p.parse_args()
    lines = ["| problem | pass | case | kernel | us per call |", "|---|---|---|---|---|"]
    for cfg in a.configs.split(","):
        for L in (int(x) for x in a.lengths.split(",")):
            rows = run(cfg, L, a.window, a.iters) if a.iters else []
            if a.splits and CONFIGS[cfg][0] != CONFIGS[cfg][1]:
                rows += splits(cfg, L, a.window, [int(x) for x in a.splits.split(",")])
            for row in rows:
                lines.append("| " + " | ".join(row[:4]) + f" | {row[4]:.3f} |")
                print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
