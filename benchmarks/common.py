"""Small pieces the benchmark scripts share.

Importing this module puts the source tree (this folder's parent) on sys.path, right after the
script's own folder, so that `python benchmarks/<script>.py` measures this tree's fuse_plugin from a
checkout without `pip install` (the backend name then comes from `import fuse_plugin`, which registers
it when no entry point declares it)."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)


def emit(lines: list[str], out: str | None, quiet: bool = False) -> None:
    """Print the finished table (unless quiet) and, with --out, write it to a file (for RESULTS.md)."""
    text = "\n".join(lines)
    if not quiet:
        print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def report_check(what: str, errs: dict, limit: float = 2e-2) -> bool:
    """Print a float64 check's line (each max error over the reference's max |x|) and say whether
    every error is within ``limit``."""
    ok = all(e <= limit for e in errs.values())
    print(f"check ({what}, max err / max |ref|):", ", ".join(f"{n} {e:.1e}" for n, e in errs.items()),
          "PASS" if ok else "FAIL", flush=True)
    return ok


def kernel_times(fn, iters: int, warm: int = 1) -> dict:
    """{GPU kernel name (60 characters): device us per call} over ``iters`` calls of ``fn`` under
    torch.profiler, after ``warm`` calls. window_profile.py, table_gather.py."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time / iters
    return dict(per)


def graph_ms(fn, rep: int = 50) -> float:
    """Device ms of ``fn`` under CUDA graphs: the best of two ``do_bench_cudagraph`` medians."""
    import triton

    return min(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") for _ in range(2))


def timed_run(step, steps: int, sync=None, issued: list | None = None) -> float:
    """Wall seconds of ``steps`` calls of ``step``, synchronised once (``sync``, default
    torch.cuda.synchronize) at the end, with Python's garbage collector off (as timeit does): a
    collection of the process's millions of objects (every variant's model and compiled graphs)
    takes tens of ms and lands at random in one variant's round, which spread host-bound cells by
    up to 50% (stop 17's bert-train rounds). Collected after. shapes.py, zoo.py, padding.py.

    ``issued``: a list that gets the seconds until the last call returned, before the sync (the
    host's issue time; the wall minus it is the GPU's tail). Where the two are close the run is
    host-bound: a variant then wins or loses by its host work, not by its kernels."""
    import gc

    import torch

    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if issued is not None:
            issued.append(time.perf_counter() - t0)
        (sync or torch.cuda.synchronize)()
        return time.perf_counter() - t0
    finally:
        gc.enable()
        gc.collect()


@contextlib.contextmanager
def switch_of(variant: str):
    """``FUSE_PLUGIN_<SWITCH>=value`` set while a ``BASE@SWITCH=value`` variant compiles (the
    plugin's choices are made at trace time); nothing for a plain variant. zoo.py, host_sites.py."""
    if "@" not in variant:
        yield
        return
    name, _, value = variant.split("@", 1)[1].partition("=")
    env = "FUSE_PLUGIN_" + name.upper()
    old = os.environ.get(env)
    os.environ[env] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old


def room_for_compiles(n: int = 64) -> None:
    """Dynamo's recompile limit raised to ``n`` at least (``cache_size_limit`` on older torch):
    the variants of a benchmark all compile the same code objects, and past the limit (8 by
    default) Dynamo runs a frame eagerly, timing eager code as if compiled. generate.py, zoo.py,
    host_sites.py."""
    import torch

    config = torch._dynamo.config
    knob = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, knob, max(getattr(config, knob), n))


def round_order(variants: list, i: int) -> list:
    """Round i's order of an interleaved A/B: the variants rotated by i, so that no variant always
    runs first or right after another (a host state one leaves lands on each in turn). shapes.py,
    zoo.py."""
    k = i % len(variants) if variants else 0
    return variants[k:] + variants[:k]


def paired_median(mine: list, others: list) -> float | None:
    """The median over rounds of ``min(others' times in round i) / mine[i]`` (``mine``: one
    variant's seconds per round; ``others``: the rivals' lists, aligned by round): each round's
    ratio is taken inside the round, so host noise that moves a whole round moves both of its
    sides. None where the rounds do not pair up."""
    if not mine or not others or any(len(t) != len(mine) for t in others):
        return None
    ratios = sorted(min(t[i] for t in others) / mine[i] for i in range(len(mine)))
    return round(ratios[len(ratios) // 2], 3)


def sdpa_autograd_ms(q, k, v, mask) -> dict:
    """{"fwd", "bwd"} device ms of F.scaled_dot_product_attention with ``mask`` and its autograd
    backward (total minus forward), plain do_bench, best of two medians: timed without CUDA graphs,
    as autograd's SDPA backward fails inside a capture (H100, torch 2.11: 'operation would make the
    legacy stream depend on a capturing blocking stream'); its kernels take milliseconds at the
    shapes timed, so the host's launch time is hidden. documents.py, padding.py."""
    import torch
    import torch.nn.functional as F
    import triton

    def bench(fn):
        return min(triton.testing.do_bench(fn, rep=100, return_mode="median") for _ in range(2))

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    total = bench(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), dout))
    return {"fwd": fwd, "bwd": max(total - fwd, 0.0)}


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profile_steps(step, n: int, title: str, top: int = 25, kernels_out: Optional[dict] = None) -> str:
    """--profile: where n steps of one cell spend their time, per step: the host's time to issue a
    step (median over n steps, each started on an idle GPU), then under the profiler: wall, the
    summed time and count of GPU kernels, the host's synchronising calls (any of SYNCS, with
    their count), and the top kernels by GPU time (names cut to 60 characters). ``kernels_out``,
    where given, receives every kernel's (us, count) per step by name (for ``kernel_diff``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    issue = []
    for _ in range(n):  # the host's time to issue one step, the GPU idle at its start
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        issue.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    issue = sorted(issue)[n // 2]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        t, c = by_name.get(e.name[:60], (0.0, 0))
        by_name[e.name[:60]] = (t + e.device_time, c + 1)
    syncs: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(SYNCS):
            t, c = syncs.get(e.name, (0.0, 0))
            syncs[e.name] = (t + e.cpu_time_total, c + 1)
    gpu = sum(e.device_time for e in kernels) / n
    if kernels_out is not None:
        kernels_out.update({k: (t / n, c / n) for k, (t, c) in by_name.items()})
    lines = [f"[profile] {title}: host issue {issue * 1e6:.0f} us/step (median), wall {wall * 1e6:.0f} "
             f"us/step, GPU {gpu:.0f} us in {len(kernels) / n:.0f} kernels/step; syncs/step: "
             + (", ".join(f"{k} {c / n:.1f}x {t / n:.0f}us" for k, (t, c) in syncs.items()) or "none")]
    for k, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"[profile]   {t / n:8.1f} us x{c / n:<5.1f} {k}")
    lines += _host_lines(prof, n, top)
    return "\n".join(lines)


def kernel_diff(base: dict, other: dict, title: str, least_us: float = 1.0, top: int = 15) -> str:
    """Where two profiled cells' GPU time differs (``profile_steps``' ``kernels_out`` of each, per
    step): the total, then the kernels whose time differs by at least ``least_us`` (a kernel only
    one cell runs included), largest difference first. Finds what one route of a row adds to a
    step that the other's does not run (stop 55: a cost outside the sites' own kernels)."""
    total = sum(t for t, _ in other.values()) - sum(t for t, _ in base.values())
    rows = []
    for name in set(base) | set(other):
        (tb, cb), (to, co) = base.get(name, (0.0, 0.0)), other.get(name, (0.0, 0.0))
        if abs(to - tb) >= least_us:
            rows.append((to - tb, name, cb, co))
    lines = [f"[diff] {title}: GPU {total:+.1f} us/step; kernels differing by >= {least_us:g} us "
             f"({len(rows)}, largest {min(top, len(rows))}):"]
    for d, name, cb, co in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        lines.append(f"[diff]   {d:+8.1f} us (x{cb:.1f} -> x{co:.1f}) {name}")
    return "\n".join(lines)


def _host_lines(prof, n: int, top: int) -> list[str]:
    """Where the host's time goes: launches per step (runtime and driver calls that start a
    kernel), then the top CPU events by self time and the fuse_plugin ops by total time (their
    Python included), per step."""
    import torch

    launches, self_t, total = 0, {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if "LaunchKernel" in e.name:
            launches += 1
        t, c = self_t.get(e.name[:70], (0.0, 0))
        self_t[e.name[:70]] = (t + e.self_cpu_time_total, c + 1)
        if e.name.startswith("fuse_plugin::"):
            t, c = total.get(e.name, (0.0, 0))
            total[e.name] = (t + e.cpu_time_total, c + 1)
    lines = [f"[host] {launches / n:.0f} kernel launches/step; top CPU self time per step:"]
    for k, (t, c) in sorted(self_t.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"[host]   {t / n:8.1f} us x{c / n:<6.1f} {k}")
    for k, (t, c) in sorted(total.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"[host] total {t / n:8.1f} us x{c / n:<6.1f} {k} ({t / max(c, 1):.1f} us/call)")
    return lines


# --------------------------------------------------------------------------------------------
# Parallel builds, one timed row at a time (zoo.py --parallel, shapes.py --parallel)
# --------------------------------------------------------------------------------------------


def visible_gpus() -> list[str]:
    """The CUDA devices a worker may be put on (``CUDA_VISIBLE_DEVICES`` entries or indices); one
    entry, or none without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    given = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return (given or [str(i) for i in range(n)])[:n]


def worker_env(i: int, gpus: list, at_once: int, keep_threads: bool) -> dict:
    """The environment of the i-th of a batch of processes run ``at_once``: its share of the cores
    for Inductor's compile threads and OpenMP (``keep_threads``: only where not set already), and,
    with several GPUs, its GPU round-robin."""
    env, share = dict(os.environ), str(max(1, (os.cpu_count() or 1) // max(1, at_once)))
    for name in ("TORCHINDUCTOR_COMPILE_THREADS", "OMP_NUM_THREADS"):
        env[name] = env.get(name, share) if keep_threads else share
    if len(gpus) > 1:
        env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
    return env


def wait_for_turn(prefix: str, reserved_gb: float) -> None:
    """A worker's side of ``run_waves``: say ``<prefix>.built`` (with the GPU memory it holds), then
    wait for ``<prefix>.go``; exit when the parent is gone (nobody would give the turn)."""
    import json

    parent = int(os.environ.get("BENCH_WAVES_PARENT", os.getppid()))  # run_waves' pid, set at the start
    with open(prefix + ".built", "w") as f:
        json.dump({"reserved_gb": reserved_gb}, f)
    while not os.path.exists(prefix + ".go"):
        if os.getppid() != parent:
            raise SystemExit(f"{prefix}: the parent exited before this row's turn")
        time.sleep(0.1)
    print(f"  timing from t = {time.time():.3f}", flush=True)


def run_waves(order: list, argv_of, parallel: int, deadline: float, missing, progress=lambda done: None,
              name=lambda row: " ".join(map(str, row))) -> dict:
    """Rows in waves of at most ``parallel`` worker processes: a wave builds at once (each worker
    compiles its row, then ``wait_for_turn``), then its rows time one at a time in ``order``, so no
    two timing processes ever run side by side; the next wave starts when the last row exits.

    ``argv_of(row, prefix)``: the worker's command line; the worker writes its result to
    ``<prefix>.json``. ``deadline``: a ``time.perf_counter()`` value (inf: none); rows it cuts get
    ``missing(row, why)``. ``progress(done)`` after each row (``done``: row -> result so far).
    Workers are spread over the visible GPUs round-robin (``CUDA_VISIBLE_DEVICES``): on a machine
    of several GPUs a wave builds on all of their memory and all cores, and each row still times
    alone (its variants on one GPU); the row's result gets ``"gpu"``. Each worker gets its share
    of the cores for Inductor's compile threads. Returns row -> result."""
    import json
    import subprocess
    import tempfile

    sync_dir = tempfile.mkdtemp(prefix="bench_waves_")
    gpus = visible_gpus()
    done: dict = {}

    def finish(row, i, proc, why=None):
        if why:
            proc.kill()
            proc.wait()
        try:
            with open(f"{sync_dir}/{i}.json") as f:
                done[row] = json.load(f)
        except (OSError, ValueError):
            done[row] = missing(row, why or f"worker exit {proc.returncode}")
        if isinstance(done[row], dict) and len(gpus) > 1:
            done[row]["gpu"] = gpus[i % len(gpus)]
        with open(f"{sync_dir}/{i}.log") as f:
            print(f"--- row {name(row)} (exit {proc.returncode}) ---\n{f.read().rstrip()}", flush=True)
        progress(done)

    index = {row: i for i, row in enumerate(order)}
    n = max(1, parallel)
    for w, wave in enumerate(order[k:k + n] for k in range(0, len(order), n)):
        t0 = time.perf_counter()
        if t0 > deadline:
            for row in wave:
                done[row] = missing(row, "not built (--deadline)")
            continue
        procs = []
        for row in wave:
            i = index[row]
            env = worker_env(i, gpus, parallel, keep_threads=True)
            env["BENCH_WAVES_PARENT"] = str(os.getpid())  # a worker whose parent is gone stops waiting
            with open(f"{sync_dir}/{i}.log", "w") as log:
                procs.append(subprocess.Popen(argv_of(row, f"{sync_dir}/{i}"), stdout=log,
                                              stderr=subprocess.STDOUT, env=env))
        print(f"wave {w + 1}: {len(wave)} rows building in parallel on {len(gpus) or 'no'} GPU(s) from "
              f"t = {time.time():.3f} (logs in {sync_dir})", flush=True)
        while not all(os.path.exists(f"{sync_dir}/{index[r]}.built") or p.poll() is not None
                      for r, p in zip(wave, procs)):
            if time.perf_counter() > deadline:
                break
            time.sleep(0.2)
        reserved = 0.0
        for row in wave:
            try:
                with open(f"{sync_dir}/{index[row]}.built") as f:
                    reserved += json.load(f)["reserved_gb"]
            except (OSError, ValueError):
                pass
        print(f"wave {w + 1}: all rows built in {time.perf_counter() - t0:.0f} s (t = {time.time():.3f}), "
              f"{reserved:.1f} GB reserved by them while idle; timing one row at a time", flush=True)
        for row, p in zip(wave, procs):
            i = index[row]
            if time.perf_counter() > deadline and p.poll() is None:
                finish(row, i, p, "not built (--deadline)" if not os.path.exists(f"{sync_dir}/{i}.built")
                       else "not timed (--deadline)")
                continue
            open(f"{sync_dir}/{i}.go", "w").close()
            try:
                p.wait(timeout=max(1.0, deadline - time.perf_counter()) if deadline != float("inf") else None)
            except subprocess.TimeoutExpired:
                finish(row, i, p, "not finished (--deadline)")
                continue
            print(f"row {name(row)} done at t = {time.time():.3f}", flush=True)
            finish(row, i, p)
    return done


def prepass(argvs: list, n: int, deadline: float, log_dir: str | None = None) -> None:
    """Run ``argvs`` (each a ``--rounds 0`` command: compile and warm up one cell) at most ``n`` at
    a time, spread over the visible GPUs, each with cores / n compile threads; stop starting new
    ones after ``deadline`` (a ``time.perf_counter()`` value) and end those still running there.
    The timed pass after it compiles from Inductor's and Triton's caches, and a row's compile
    no longer waits for its variants' compiles in series (zoo.py's critical path: Twins-SVT-S
    training, three compiles of ~120 s each)."""
    import subprocess
    import tempfile

    log_dir = log_dir or tempfile.mkdtemp(prefix="bench_prepass_")
    gpus = visible_gpus()
    t0, pending, running, failed, cut = time.perf_counter(), list(enumerate(argvs)), [], 0, 0
    while pending or running:
        for item in list(running):
            if item[1].poll() is not None:
                running.remove(item)
                failed += item[1].returncode != 0
        while pending and len(running) < max(1, n) and time.perf_counter() < deadline:
            i, argv = pending.pop(0)
            env = worker_env(i, gpus, n, keep_threads=False)
            with open(f"{log_dir}/{i}.log", "w") as log:
                running.append((i, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)))
        if time.perf_counter() >= deadline:
            for _, p in running:
                p.kill()
                p.wait()
            cut = len(running)
            break
        time.sleep(0.2)
    print(f"pre-pass: {len(argvs) - len(pending) - cut} of {len(argvs)} cells compiled in "
          f"{time.perf_counter() - t0:.0f} s ({failed} of them failed, {cut} cut by the limit; logs in {log_dir})",
          flush=True)
