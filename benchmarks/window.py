"""Sliding-window attention (issue 31's Musts): the windowed kernels' speed against causal
attention scaled by the visible area, plus a correctness check, on one GPU in one run (< 4 min).

    python benchmarks/window.py [--json FILE] [--out FILE.md] [--lengths 16384,32768]
                                [--window 4096] [--configs mha,gqa] [--skip-check]
    python benchmarks/window.py --cpu-smoke   # tiny shapes, kernels in Triton's interpreter (no GPU)

Problems: bf16, B 1, D 128, window W (query i sees keys i-W+1..i, HF's `sliding_window`), "mha"
Hq = Hkv = 16 and "gqa" Hq 32 / Hkv 8, q/k/v contiguous (B, H, L, D) (--layout blhd: views of
(B, L, H, D) memory, as a model's head split gives: there the causal families' output needs no
copy into the op's layout, which costs cuDNN's causal forward 4-5% with contiguous inputs). Per problem, forward and
backward ms (median of `triton.testing.do_bench`, no CUDA graphs, the best of --repeats medians) of
  causal          our launchers (kernels/attention.py), causal, no window, the registry's family
  causal-general  the same with the general family forced (registry.forced("general"))
  window          our launchers with window=W, the registry's family
  window-general  the same with the general family forced (before stop 35 the only one with windows)
With --sweep also "causal-gluon" (the Gluon family forced) and the window under each of SWEEP's
forward / backward configs (the Gluon variants).
  sdpa-band       F.scaled_dot_product_attention with the dense (L, L) bool band mask, among its
                  mask-taking backends (cuDNN, efficient; math is left out: its scores do not fit)
  sdpa-causal     SDPA is_causal=True (flash, cuDNN or efficient: whichever torch picks)
Our backward is the launcher `attention_backward` on the saved out / lse of a forward of the same
family. SDPA's is `torch.autograd.grad` of its output on a retained graph (its backward kernels
plus the autograd engine's host work, small at these sizes). SDPA takes k / v repeated to Hq
beforehand (off the clock): a reference only. The family columns name what the registry chose
(ours) and the backend whose kernel ran (SDPA, read once under the profiler).

The Must: r = (visible (i, j) pairs with the window) / (visible pairs causal), exactly
(W·L − W(W−1)/2) / (L(L+1)/2); the window's fwd + bwd over r × (fwd + bwd) of "causal", and of
"causal-general", is at most 1.15 ("vs ideal" column: the ratios, also against "causal-gluon"
where --sweep ran it).

Before the timing, a correctness check at small sizes (L 2048 W 512 H 4, and L 1000 W 300 GQA
4/2; D 128, bf16, fresh torch.randn inputs): the op `torch.ops.fuse_plugin.attention(...,
window)` with autograd against a float64 band-masked reference (out, lse, dq, dk, dv); each
max abs error over the reference's max |x| must be at most 2e-2. A failed check still lets the
timing run (one device call), then exits 1 with the failure in the last lines.

Prints a progress line per row, then the markdown table last (also to --out); --json writes
every number.
"""
from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # the interpreter must be switched on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["FUSE_PLUGIN_CPU_KERNELS"] = "triton"

import argparse
import contextlib
import json
import time

import torch
from common import emit
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fuse_plugin  # noqa: F401  (registers torch.ops.fuse_plugin)
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.attention import AttentionConfig, attention_backward, attention_forward
from fuse_plugin.kernels.call import AttentionCall

OPS = torch.ops.fuse_plugin

MUST = 1.15  # window fwd+bwd <= MUST x r x causal fwd+bwd
TOL = 2e-2  # correctness: max abs error / max |reference|
CONFIGS = {"mha": (16, 16), "gqa": (32, 8), "gqa16": (16, 4)}  # name: (Hq, Hkv); gqa16: e2e.py's model
BAND_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
CAUSAL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def visible_pairs(L: int, W: int = 0) -> int:
    """The (i, j) pairs with j <= i, and i - j < W when W > 0: sum over i of min(i + 1, W)."""
    if W <= 0 or W >= L:
        return L * (L + 1) // 2
    return W * L - W * (W - 1) // 2


def band(L: int, W: int, device) -> torch.Tensor:
    """(L, L) bool keep-mask: causal, and the last W keys only when W > 0."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None]
    return (j <= i) & (j > i - W) if W else j <= i


class Timer:
    """Median ms of fn: do_bench on a GPU (the best of `repeats` medians), wall time of one call
    after a warm one under the interpreter (--cpu-smoke: the numbers mean nothing there)."""

    def __init__(self, repeats: int, smoke: bool):
        self.repeats, self.smoke = repeats, smoke

    def __call__(self, fn) -> float:
        if self.smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return min(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                   for _ in range(self.repeats))


# --------------------------------------------------------------------------- the timed cases


def ours(q, k, v, W, family, bench, tiles=None):
    """Our launchers, causal with window W (0: none), `family` forced (None: the registry's
    choice), or `tiles` = (forward config, backward config) forced: {fwd, bwd ms, the families
    chosen}."""
    kw = dict(is_causal=True, scale=q.shape[-1] ** -0.5, **({"window": W} if W else {}))
    fc, bc = ({"config": t} for t in tiles) if tiles else ({}, {})
    with registry.forced(family):
        out, lse = attention_forward(q, k, v, None, **kw, **fc)
        dout = torch.randn_like(out)
        fwd = bench(lambda: attention_forward(q, k, v, None, **kw, **fc))
        bwd = bench(lambda: attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, **kw, **bc))
        if tiles:
            return {"fwd": fwd, "bwd": bwd, "family": "/".join(t.kernel for t in tiles)}
        fam_f = registry.choose(AttentionCall.forward(q, k, v, None, **kw))[0].name
        fam_b = registry.choose(AttentionCall.backward(dout, q, k, v, None, out, lse, need_dbias=False,
                                                       **kw))[0].name
    return {"fwd": fwd, "bwd": bwd, "family": f"{fam_f}/{fam_b}"}


# --sweep: the Gluon kernels' variants on the window (name: (forward config, backward config)).
SWEEP = {
    "gluon-s2/x": (AttentionConfig(128, 128, 4, 2, False, "gluon"), AttentionConfig(64, 128, 8, 2, False, "gluon")),
    "pingpong-s2/lpt": (AttentionConfig(128, 128, 4, 2, False, "gluon_pingpong"),
                        AttentionConfig(64, 128, 8, 2, False, "gluon_lpt")),
    "pingpong-s3/lpt": (AttentionConfig(128, 128, 4, 3, False, "gluon_pingpong"),
                        AttentionConfig(64, 128, 8, 2, False, "gluon_lpt")),
    "pingpong-n64s4/lpt": (AttentionConfig(128, 64, 4, 4, False, "gluon_pingpong"),
                           AttentionConfig(64, 128, 8, 2, False, "gluon_lpt")),
}


def backend_of(fn) -> str:
    """Which SDPA backend one call of fn ran, by the name of its longest GPU kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return "?"
    name = max(kernels, key=lambda e: e.device_time).name.lower()
    for tag, keys in (("cudnn", ("cudnn",)), ("flash", ("flash",)), ("efficient", ("cutlass", "fmha", "mem_eff"))):
        if any(key in name for key in keys):
            return tag
    return name[:30]


def sdpa(q, k, v, mask, backends, bench, smoke):
    """SDPA on k/v repeated to Hq: with the bool `mask`, or is_causal when None; only
    `backends` (all on the CPU). {fwd, bwd ms, backend}, or None where none of them runs it."""
    g = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().requires_grad_() for t in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))

    def fwd():
        with contextlib.nullcontext() if smoke else sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    try:
        out = fwd()
        dout = torch.randn_like(out)
        res = {"fwd": bench(fwd),
               "bwd": bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)),
               "family": "cpu" if smoke else backend_of(fwd)}
    except (RuntimeError, torch.OutOfMemoryError) as e:  # no allowed backend takes it, or OOM
        print(f"  sdpa skipped: {str(e).splitlines()[0][:160]}", flush=True)
        return None
    return res


def inputs(h, L, D, dtype, device, layout):
    """(1, h, L, D) random: contiguous ("bhld") or a view of (1, L, h, D) memory ("blhd", what a
    model's head split gives and the op's output layout)."""
    if layout == "blhd":
        return torch.randn(1, L, h, D, device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(1, h, L, D, device=device, dtype=dtype)


def problem(cfg, L, W, D, dtype, device, bench, smoke, sweep=False, only=None, layout="bhld", gluon_case=False):
    """Every case of one (config, L) (``only``: those named): {case: result or None}, printed as
    each finishes."""
    hq, hkv = CONFIGS[cfg]
    q, k, v = (inputs(h, L, D, dtype, device, layout) for h in (hq, hkv, hkv))
    mask = band(L, W, device)
    runs = {
        "causal": lambda: ours(q, k, v, 0, None, bench),
        "causal-general": lambda: ours(q, k, v, 0, "general", bench),
        "window": lambda: ours(q, k, v, W, None, bench),
        "window-general": lambda: ours(q, k, v, W, "general", bench),
        **({"window-gluon": lambda: ours(q, k, v, W, "gluon", bench)} if gluon_case else {}),
        "sdpa-band": lambda: sdpa(q, k, v, mask, BAND_BACKENDS, bench, smoke),
        "sdpa-causal": lambda: sdpa(q, k, v, None, CAUSAL_BACKENDS, bench, smoke),
    }
    if sweep:
        runs["causal-gluon"] = lambda: ours(q, k, v, 0, "gluon", bench)
        for name, tiles in SWEEP.items():
            runs[f"window {name}"] = lambda tiles=tiles: ours(q, k, v, W, None, bench, tiles)
    res = {}
    for case, run in runs.items():
        if only is not None and case not in only:
            res[case] = None
            continue
        t0 = time.perf_counter()
        try:
            res[case] = r = run()
        except Exception as e:  # noqa: BLE001  one failing case must not cost the run's other numbers
            res[case] = r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        if r:
            print(f"{cfg} L{L} {case}: " + (r.get("error") or f"{r['family']} fwd {r['fwd']:.3f} ms, bwd "
                  f"{r['bwd']:.3f} ms") + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return res


BASELINES = ("causal", "causal-general", "causal-gluon")  # those that ran are compared


def must(res, L, W):
    """The window's time over r x each causal baseline's that ran, in total and per direction;
    pass: every one of them within MUST."""
    r = visible_pairs(L, W) / visible_pairs(L)
    w = res.get("window")
    out = {"r": r}
    bases = [b for b in BASELINES if "fwd" in (res.get(b) or {})]
    if "fwd" not in (w or {}) or not bases:
        return {**out, "pass": False, "error": "a case did not run"}
    for base in bases:
        c = res[base]
        out[base] = {"total": (w["fwd"] + w["bwd"]) / (r * (c["fwd"] + c["bwd"])),
                     "fwd": w["fwd"] / (r * c["fwd"]), "bwd": w["bwd"] / (r * c["bwd"])}
    out["pass"] = all(out[b]["total"] <= MUST for b in bases)
    return out


# --------------------------------------------------------------------------- correctness


def check(L, W, hq, hkv, D, dtype, device):
    """The op with window W and autograd against a float64 band-masked reference:
    {tensor: (max abs error, that over max |reference|)}."""
    assert visible_pairs(L, W) == int(band(L, W, "cpu").sum())  # the closed form, counted
    q = torch.randn(1, hq, L, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, L, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, L, D, device=device, dtype=dtype, requires_grad=True)
    scale = D ** -0.5
    out, lse = OPS.attention(q, k, v, None, 0.0, True, scale, None, 0.0, None, W)  # W: window
    dout = torch.randn_like(out)
    got = (out, lse) + torch.autograd.grad(out, (q, k, v), dout)
    # the reference: float64, k/v repeated for GQA (their gradients summed back by autograd)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = hq // hkv
    s = (q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~band(L, W, device), float("-inf"))
    out64 = torch.softmax(s, -1) @ v64.repeat_interleave(g, 1)
    want = (out64, s.logsumexp(-1)) + torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    errs = {}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        err = (a.detach().double() - b.detach()).abs().max().item()  # NaN stays NaN: fails below
        errs[name] = (err, err / b.detach().abs().max().item())
    return errs


# --------------------------------------------------------------------------- main


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16384,32768", help="comma-separated sequence lengths")
    p.add_argument("--window", type=int, default=4096, help="the window W (keys i-W+1..i)")
    p.add_argument("--configs", default="mha,gqa", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--repeats", type=int, default=2, help="do_bench medians per number (the best kept)")
    p.add_argument("--skip-check", action="store_true", help="no correctness check")
    p.add_argument("--cases", default=None, help="comma-separated: time only these cases (default: all)")
    p.add_argument("--sweep", action="store_true",
                   help="also: causal with the Gluon family forced, and the window with each of SWEEP's tiles")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes in Triton's interpreter on the CPU: the script runs end to end")
    p.add_argument("--layout", default="bhld", choices=("bhld", "blhd"),
                   help="q/k/v memory: contiguous (B, H, L, D), or (B, L, H, D) viewed as (B, H, L, D) "
                        "(a model's layout: the op's output layout, so no launcher copies O)")
    p.add_argument("--head-dim", type=int, default=128, help="D of q, k, v (GPU runs; the checks use it too)")
    p.add_argument("--gluon-window-head-dims", default=None,
                   help="comma-separated head dims at which the Gluon kernels may take a window for this run "
                        "(registry.GLUON_WINDOW_HEAD_DIMS, shipped: 128), and a case 'window-gluon' (the Gluon "
                        "family forced): to measure a head dim before the registry takes it")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--out", default=None, help="write the table here too")
    args = p.parse_args()

    if args.cpu_smoke:  # tiny: L above the small family's 128, D 32; SDPA on its CPU backends
        device, D, lengths, W, dtype = "cpu", 32, [192], 64, torch.float32
        checks = [(160, 40, 2, 2), (150, 50, 2, 1)]
        CONFIGS.update(mha=(2, 2), gqa=(4, 2))
        head = f"CPU smoke (Triton interpreter) | torch {torch.__version__} | triton {triton.__version__}"
    else:
        device, D, lengths, W, dtype = "cuda", args.head_dim, [int(x) for x in args.lengths.split(",")], args.window, torch.bfloat16
        checks = [(2048, 512, 4, 4), (1000, 300, 4, 2)]
        head = (f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
                f"{time.strftime('%Y-%m-%d')} | bf16 B1 D{D} W{W} q/k/v {args.layout}; ms, median of do_bench (best of "
                f"{args.repeats}), no CUDA graphs")
    configs = args.configs.split(",")
    gluon_case = bool(args.gluon_window_head_dims)
    if gluon_case:
        registry.GLUON_WINDOW_HEAD_DIMS = tuple(int(x) for x in args.gluon_window_head_dims.split(","))
        head += f" | Gluon window head dims {registry.GLUON_WINDOW_HEAD_DIMS} (not the shipped rule)"
    bench = Timer(args.repeats, args.cpu_smoke)
    t_start = time.perf_counter()
    print(head, flush=True)

    # 1. correctness (its kernels compile here too)
    check_rows, failed = [], []
    for L, w, hq, hkv in [] if args.skip_check else checks:
        try:
            errs = check(L, w, hq, hkv, D, dtype, device)
            ok = all(rel <= TOL for _, rel in errs.values())  # False on NaN
            check_rows.append({"L": L, "W": w, "Hq": hq, "Hkv": hkv, "ok": ok, "max_abs": {n: e[0] for n, e in errs.items()},
                               "rel": {n: e[1] for n, e in errs.items()}})
            line = (f"check L{L} W{w} H{hq}/{hkv}: {'ok' if ok else 'FAIL'}; max abs err (/ max |ref|): "
                    + ", ".join(f"{n} {a:.2e} ({r:.1e})" for n, (a, r) in errs.items()))
        except Exception as e:  # noqa: BLE001  a failed check; the timing still runs
            ok, error = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            check_rows.append({"L": L, "W": w, "Hq": hq, "Hkv": hkv, "ok": ok, "error": error})
            line = f"check L{L} W{w} H{hq}/{hkv}: FAIL, {error}"
        print(line, flush=True)
        if not ok:
            failed.append(line)

    # 2. timing, 3. the Must
    rows, musts = [], []
    for cfg in configs:
        for L in lengths:
            res = problem(cfg, L, W, D, dtype, device, bench, args.cpu_smoke, args.sweep,
                          args.cases.split(",") if args.cases else None, args.layout, gluon_case)
            rows += [{"config": cfg, "Hq": CONFIGS[cfg][0], "Hkv": CONFIGS[cfg][1], "L": L, "W": W,
                      "case": case, **(r or {})} for case, r in res.items()]
            m = must(res, L, W)
            musts.append({"config": cfg, "L": L, "W": W, **m})

    # 4. the table, last
    lines = [head, "", "| config | L | case | family fwd/bwd | fwd ms | bwd ms | total ms | vs ideal (causal / general / gluon) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "fwd" not in row:  # SDPA refused it, or it raised (the error is in the log and JSON)
            lines.append(f"| {row['config']} | {row['L']} | {row['case']} | {'error' if 'error' in row else '—'} "
                         "| — | — | — | |")
            continue
        ideal = ""
        m = next(m for m in musts if m["config"] == row["config"] and m["L"] == row["L"])
        if row["case"] == "window" and "error" not in m:
            ideal = " / ".join(f"{m[b]['total']:.3f}" if b in m else "—" for b in BASELINES)
        lines.append(f"| {row['config']} | {row['L']} | {row['case']} | {row['family']} | {row['fwd']:.3f} | "
                     f"{row['bwd']:.3f} | {row['fwd'] + row['bwd']:.3f} | {ideal} |")
    lines.append("")
    for m in musts:
        if "error" in m:
            lines.append(f"Must {m['config']} L{m['L']}: FAIL ({m['error']})")
            continue
        lines.append(f"Must (<= {MUST}) {m['config']} L{m['L']} W{m['W']}: r {m['r']:.4f}; window / (r x "
                     + ", ".join(f"{b}) {m[b]['total']:.3f} (fwd {m[b]['fwd']:.2f}, bwd {m[b]['bwd']:.2f})"
                                 for b in BASELINES if b in m)
                     + f": {'PASS' if m['pass'] else 'FAIL'}")
    lines.append(f"correctness: {len(check_rows) - len(failed)}/{len(check_rows)} ok (tol {TOL}); "
                 f"wall {time.perf_counter() - t_start:.0f} s")
    lines += failed
    emit(lines, args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "must_bound": MUST, "tol": TOL, "checks": check_rows, "rows": rows,
                       "must": musts}, f, indent=1)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
