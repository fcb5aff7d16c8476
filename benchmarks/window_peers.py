"""How far a sliding window's cost falls below causal in other implementations: issue 31's window
Must measured as a property of each kernel, ours and its peers, in one run (< 5 min).

    python benchmarks/window_peers.py [--lengths 16384,32768] [--window 4096] [--configs mha,gqa] [--tile-cost]
                                      [--impls ours,flex,cudnn-jax] [--json FILE] [--out FILE.md]
    python benchmarks/window_peers.py --cpu-smoke   # tiny shapes on the CPU: the script runs

Issue 31's Must asks of the window's forward + backward at most 1.15 x (visible-area ratio r) x the
causal forward + backward. Whether any kernel reaches that is a fact about tiles, not about our
code: a window tile visits ~W / BLOCK_N key blocks, a causal one L / (2 BLOCK_N) on average, so the
tile's fixed costs (Q load, pipeline fill, epilogue) weigh 2-4x more in the window (NOTES attempt
51). This script measures r-normalised window cost for each implementation against its own causal:

  ours       our launchers (kernels/attention.py), the registry's family: causal (cuDNN on an
             H100, stop 35), causal with the Gluon family forced, the window (Gluon there; its
             forward the persistent kernel from registry.GLUON_PERSISTENT_MIN_TILES tiles, stop 37);
             and the persistent Gluon forward forced on the causal and window problems, with the
             same backward ("causal-persistent", "window-persistent");
  flex       PyTorch's FlexAttention (torch.compile'd flex_attention) with a block mask from
             the causal / causal-window mask_mod (its kernels skip the blocks the mask hides);
  cudnn-jax  cuDNN's own sliding window (``sliding_window_length``) and causal through
             ``jax.nn.dot_product_attention(implementation="cudnn")`` (JAX is on the device
             machines; torch's SDPA does not expose cuDNN's window). Run in a subprocess (its own
             CUDA libraries and allocator), after the torch part, never beside it.

``--tile-cost``: what a tile costs before its first key block, in key-block iterations, for the
family the window runs on (Gluon where it takes the problem, else the registry's): the forward
without a mask at Lq 16384 and Lk = n x 128 (n = 4..64), time = tiles x (a + b n), fitted by least
squares; a / b is the fixed cost of a tile (Q load, pipeline fill, epilogue) as key blocks. The
backward likewise with Lq = n x 128 and Lk 16384 (its programs walk query blocks per key block).
A window tile visits ~W / 128 + 2 blocks, a causal one ~L / 256 on average: with the fixed cost a/b,
the window's floor over r x causal is about (W / 128 + 2 + a/b) / (W / 128) x (L / 256) / (L / 256
+ a/b), printed beside the fit.

Problems as benchmarks/window.py's: bf16, B 1, D 128, "mha" 16/16 heads, "gqa" 32/8, window W
(query i sees keys i-W < j <= i). Times: forward, and forward + backward ("train"; JAX: the jitted
vjp of the forward, which runs both), median ms (torch: do_bench, best of --repeats medians; JAX:
wall time of 10 jitted calls after block_until_ready, median of 5). Each implementation's "vs
ideal" = window train / (r x its own causal train); "vs best causal" = window train / (r x the
fastest causal train in the run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

JAX_WORKER = "--jax-worker"


# --------------------------------------------------------------------------- cuDNN through JAX


def jax_worker(argv) -> None:
    """The subprocess: time cuDNN's causal and window through JAX, print one JSON line."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    spec = json.loads(argv[0])
    impl, problems = spec["impl"], spec["problems"]  # "cudnn"; "xla" for the CPU smoke run
    out = {}
    try:
        import jax
        import jax.numpy as jnp
    except Exception as e:  # noqa: BLE001  no JAX here: the row says so
        print(json.dumps({"error": f"jax unavailable ({type(e).__name__}: {e})"}))
        return
    for cfg, (hq, hkv, L, W, D) in problems.items():
        key = jax.random.PRNGKey(0)
        kq, kk, kv, kd = jax.random.split(key, 4)
        dt = jnp.bfloat16 if impl == "cudnn" else jnp.float32
        q = jax.random.normal(kq, (1, L, hq, D), dt)  # JAX's layout: (B, T, N, H)
        k = jax.random.normal(kk, (1, L, hkv, D), dt)
        v = jax.random.normal(kv, (1, L, hkv, D), dt)
        do = jax.random.normal(kd, (1, L, hq, D), dt)
        res = {}
        for case, window in (("causal", None), ("window", (W - 1, 0))):
            def attn(q, k, v, window=window):
                return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                                    implementation=impl)

            fwd = jax.jit(attn)
            train = jax.jit(lambda q, k, v, do, attn=attn: jax.vjp(attn, q, k, v)[1](do))
            try:
                res[case] = {"fwd": _jax_ms(jax, fwd, q, k, v), "train": _jax_ms(jax, train, q, k, v, do)}
            except Exception as e:  # noqa: BLE001  cuDNN refused the problem: the row says so
                res[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        out[cfg] = res
    out["versions"] = f"jax {jax.__version__}"
    print(json.dumps(out))


def _jax_ms(jax, fn, *args, calls: int = 10, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile, warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def run_jax(problems: dict, impl: str = "cudnn", timeout: float = 240) -> dict:
    """cuDNN through JAX in a subprocess (``problems``: {key: (Hq, Hkv, L, W, D)}): {key: {case:
    {fwd, train} or {error}}, "versions": ...}, or {"error": why}."""
    spec = json.dumps({"impl": impl, "problems": problems})
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), JAX_WORKER, spec],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the JAX worker ran past {timeout:.0f} s"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        return {"error": f"the JAX worker exited {p.returncode}: {p.stderr.strip().splitlines()[-1:] or ''}"}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- torch: ours, Flex


def flex_cases(q, k, v, W, bench, compiled: bool) -> dict:
    """FlexAttention, causal and the causal window, each with its block mask: {case: {fwd, train}}."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L, gqa = q.shape[2], q.shape[1] != k.shape[1]
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def causal(b, h, i, j):
        return i >= j

    def window(b, h, i, j):
        return (i >= j) & (i - j < W)

    out = {}
    for case, mod in (("causal", causal), ("window", window)):
        mask = create_block_mask(mod, None, None, L, L, device=q.device.type)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd(qg=qg, kg=kg, vg=vg, mask=mask):
            return flex(qg, kg, vg, block_mask=mask, enable_gqa=gqa)

        dout = torch.randn_like(fwd())
        out[case] = {"fwd": bench(lambda fwd=fwd: fwd().detach()),
                     "train": bench(lambda fwd=fwd, qg=qg, kg=kg, vg=vg, dout=dout:
                                    torch.autograd.grad(fwd(), (qg, kg, vg), dout))}
    return out


def ours_cases(q, k, v, W, bench, persistent: bool = True) -> dict:
    """Our launchers (window.py's ``ours``): causal (registry), causal-gluon, window (registry); with
    ``persistent`` also the persistent Gluon forward's rows."""
    import window as wb

    out = {}
    for case, w, family in (("causal", 0, None), ("causal-gluon", 0, "gluon"), ("window", W, None)):
        try:
            r = wb.ours(q, k, v, w, family, bench)
            out[case] = {"fwd": r["fwd"], "train": r["fwd"] + r["bwd"], "family": r["family"], "bwd": r["bwd"]}
        except Exception as e:  # noqa: BLE001  e.g. the Gluon family on a GPU without it
            out[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    # The persistent Gluon forward forced (the registry takes it for wide windows only) with the same
    # backward: "causal-persistent" (own causal of "window-persistent").
    for case, w, base in (("causal-persistent", 0, "causal-gluon"), ("window-persistent", W, "window")):
        if not persistent or "bwd" not in out.get(base, {}):
            continue
        try:
            from fuse_plugin.kernels import attention_fwd_gluon as gf

            why = gf.why_not_gluon_forward(q, k, v, True, q.shape[-1] ** -0.5, w)
            if why:
                raise ValueError(f"Gluon forward not applicable: {why}")
            var = gf.resolve_variant(None, q.shape[-1])._replace(persistent=True)
            kw = dict(is_causal=True, scale=q.shape[-1] ** -0.5, variant=var, window=w)
            gf.attention_forward_gluon(q, k, v, **kw)
            fwd = bench(lambda kw=kw: gf.attention_forward_gluon(q, k, v, **kw))
            out[case] = {"fwd": fwd, "train": fwd + out[base]["bwd"], "family": "gluon-persistent/" + base}
        except Exception as e:  # noqa: BLE001  no Gluon here
            out[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return out


def tile_cost(bench, family, heads: int = 16, long: int = 16384, ns=(4, 8, 16, 32, 64)) -> dict:
    """--tile-cost (module doc): {"fwd": {"a", "b", "a/b", "ms"}, "bwd": ...}; ``family`` forced
    (None: the registry's)."""
    import torch

    from fuse_plugin.kernels import registry
    from fuse_plugin.kernels.attention import attention_backward, attention_forward

    scale, out = 128 ** -0.5, {}
    for kind in ("fwd", "bwd"):
        xs, ys, ms = [], [], {}
        for n in ns:
            lq, lk = (long, n * 128) if kind == "fwd" else (n * 128, long)
            q = torch.randn(1, heads, lq, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, heads, lk, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            with registry.forced(family):
                o, lse = attention_forward(q, k, v, None, is_causal=False, scale=scale)
                if kind == "fwd":
                    t = bench(lambda: attention_forward(q, k, v, None, is_causal=False, scale=scale))
                    tiles = heads * (lq // 128)  # programs of 128 query rows
                else:
                    do = torch.randn_like(o)
                    t = bench(lambda: attention_backward(do, q, k, v, None, o, lse, is_causal=False, scale=scale,
                                                         need_dbias=False))
                    tiles = heads * (lk // 128)  # programs of 128 keys
            ms[n] = t
            xs.append(n)
            ys.append(t * 1e3 / tiles)  # us per program
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        out[kind] = {"a_us": a, "b_us": b, "a/b": a / b, "ms": ms}
    return out


def floor_ratio(fixed_blocks: float, L: int, W: int, block: int = 128) -> float:
    """The window's cost over r x causal if a tile costs ``fixed_blocks`` + its visited blocks
    (module doc)."""
    wb, cb = W / block + 2, L / (2 * block)
    return (wb + fixed_blocks) / (W / block) * cb / (cb + fixed_blocks)


# --------------------------------------------------------------------------- the table


def ratios(res: dict, r: float) -> dict:
    """Per implementation: window train / (r x its own causal train), and / (r x the fastest
    causal train of any implementation in ``res``)."""
    causal = [c["train"] for impl in res.values() if isinstance(impl, dict)
              for name, c in impl.items() if name.startswith("causal") and "train" in (c or {})]
    best = min(causal) if causal else None
    out = {}
    for impl, cases in res.items():
        for wname in [n for n in (cases or {}) if n.startswith("window")]:
            w = cases[wname] or {}
            if "train" not in w:
                continue
            own = {name: w["train"] / (r * c["train"]) for name, c in cases.items()
                   if name.startswith("causal") and "train" in (c or {})}
            key = impl if wname == "window" else f"{impl} {wname}"
            out[key] = {"own": own, "vs_best": w["train"] / (r * best) if best else None}
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [JAX_WORKER]:
        return jax_worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--configs", default="mha,gqa")
    p.add_argument("--impls", default="ours,flex,cudnn-jax,persistent",
                   help="persistent: our persistent Gluon forward's rows (leave it out until its test passed)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    p.add_argument("--tile-cost", action="store_true", help="also fit each tile's fixed cost (module doc)")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cpu_smoke:  # before triton is imported (window.py reads the same switch)
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["FUSE_PLUGIN_CPU_KERNELS"] = "triton"
    import torch
    import triton
    import window as wb
    from common import emit

    impls = args.impls.split(",")
    configs = {"mha": (16, 16), "gqa": (32, 8)}
    if args.cpu_smoke:
        device, D, lengths, W, dtype = "cpu", 32, [192], 64, torch.float32
        configs = {"mha": (2, 2), "gqa": (4, 2)}
        head = f"CPU smoke | torch {torch.__version__} | triton {triton.__version__}"
    else:
        device, D, lengths, W, dtype = "cuda", 128, [int(x) for x in args.lengths.split(",")], args.window, torch.bfloat16
        head = (f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
                f"{time.strftime('%Y-%m-%d')} | bf16 B1 D{D} W{W}; ms, median (torch: do_bench, best of "
                f"{args.repeats}; JAX: wall of 10 jitted calls, median of 5)")
    print(head, flush=True)
    bench = wb.Timer(args.repeats, args.cpu_smoke)
    results = {}
    for cfg in args.configs.split(","):
        hq, hkv = configs[cfg]
        for L in lengths:
            q = torch.randn(1, hq, L, D, device=device, dtype=dtype)
            k = torch.randn(1, hkv, L, D, device=device, dtype=dtype)
            v = torch.randn(1, hkv, L, D, device=device, dtype=dtype)
            res = {}
            if "ours" in impls:
                res["ours"] = ours_cases(q, k, v, W, bench, "persistent" in impls)
            if "flex" in impls:
                try:
                    res["flex"] = flex_cases(q, k, v, W, bench, compiled=not args.cpu_smoke)
                except Exception as e:  # noqa: BLE001  Flex refused it: the row says so
                    res["flex"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            results[f"{cfg}-{L}"] = res
            print(f"{cfg} L{L}: " + json.dumps(res), flush=True)
            del q, k, v
            if device == "cuda":
                torch.cuda.empty_cache()
    if "cudnn-jax" in impls:
        # the CPU smoke run takes JAX's own XLA attention (cuDNN needs a GPU): the path, not a number
        jax_res = run_jax({f"{cfg}-{L}": (*configs[cfg], L, W, D) for cfg in args.configs.split(",")
                           for L in lengths}, "xla" if args.cpu_smoke else "cudnn")
        for key, res in results.items():
            res["xla-jax" if args.cpu_smoke else "cudnn-jax"] = jax_res.get(key, {"error": jax_res.get("error", "no result")})
        head += f" | {jax_res.get('versions', 'jax: ' + jax_res.get('error', '?'))}"

    lines = [head, "", "| problem | impl | causal train ms (family) | window train ms | fwd causal / window ms | "
             "vs ideal (own causal) | vs best causal |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for key, res in results.items():
        L = int(key.split("-")[1])
        r = wb.visible_pairs(L, W) / wb.visible_pairs(L)
        rat = summary[key] = ratios(res, r)
        for impl, cases in res.items():
            if "error" in cases:
                lines.append(f"| {key} | {impl} | {cases['error'][:80]} | | | | |")
                continue
            for wname in [n for n in cases if n.startswith("window")]:
                rk = impl if wname == "window" else f"{impl} {wname}"
                for name in [n for n in cases if n.startswith("causal")]:
                    c, w = cases[name], cases[wname] or {}
                    label = f"{impl} ({name}{'' if wname == 'window' else ' / ' + wname})"
                    if "train" not in c or "train" not in w:
                        lines.append(f"| {key} | {label} | {c.get('error', w.get('error', '-'))[:80]} | | | | |")
                        continue
                    fam = f" ({c['family']})" if "family" in c else ""
                    own = rat.get(rk, {}).get("own", {}).get(name)
                    best = rat.get(rk, {}).get("vs_best")
                    lines.append(f"| {key} | {label} | {c['train']:.3f}{fam} | {w['train']:.3f} | "
                                 f"{c['fwd']:.3f} / {w['fwd']:.3f} | {own:.3f} | {best:.3f} |")
        lines.append(f"| {key} | r = {r:.4f} | | | | | |")
    costs = {}
    if args.tile_cost and not args.cpu_smoke:
        for fam in ("gluon", None):
            try:
                costs[fam or "registry"] = c = tile_cost(bench, fam)
            except Exception as e:  # noqa: BLE001  the family does not run here
                costs[fam or "registry"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                continue
            for kind in ("fwd", "bwd"):
                x = c[kind]
                floors = ", ".join(f"L{L} {floor_ratio(x['a/b'], L, W):.3f}" for L in lengths)
                lines.append(f"tile cost {fam or 'registry'} {kind}: a {x['a_us']:.2f} us + b {x['b_us']:.3f} us per "
                             f"block -> fixed = {x['a/b']:.1f} blocks; floor over r x causal: {floors}; ms "
                             + ", ".join(f"n{n} {t:.3f}" for n, t in x["ms"].items()))
    emit(lines, args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "window": W, "results": results, "ratios": summary, "tile_cost": costs},
                      f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
