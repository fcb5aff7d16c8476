"""Where a host-bound training step's time goes, per phase, and what Inductor generated (issue 28).

    python benchmarks/host_split.py [--model twins_svt_s] [--task train] [--rounds 30] [--steps 2]
                                    [--variants compile,fused+compile,plugin,plugin@SITE_CHOICE=inductor]
                                    [--code-out code.tar.gz] [--cprofile-out cprofile.txt]
                                    [--launch-costs launches.txt] [--gpu-time gpu.txt]

Builds each variant of one zoo row (zoo.py's build_variant: same model, inputs, compile and warm-up)
in this process, then times interleaved rounds (common.round_order) of ``--steps`` steps, reading
the host's clock after each phase returns, with no sync inside the round: the forward call, the
loss and its backward, the optimizer step. In a host-bound step (the GPU idle between launches)
those are the host's time for each phase, which the zoo's one issue time per round lumps
together (twins_svt_s training: 53.1 ms a step against stock compile's 50.8, stop 43).

Also, per variant: the generated wrapper code of every graph it compiled (Inductor's PyCodeCache
modules with a ``call``), counted by what the wrapper does per call (kernel launches, allocations,
extern calls, views) and packed into ``--code-out``; and one cProfile of two steps (the Python
functions by their own time), into ``--cprofile-out``; and the host's time in each Triton kernel
launch (``CachingAutotuner.run``, timed around the call) over two steps, per kernel, with a
cProfile of the costliest kernel of ours launched again 200 times, into ``--launch-costs``; and the
GPU's own time a step (the kernels' time under torch.profiler, summed: is the step bound by the
host at all?) with the costliest kernels, into ``--gpu-time``.

Prints one table last: per variant the median ms a step of each phase, the paired ratio of its
total to stock compile's, and the forward / backward wrappers' counts.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import statistics
import sys
import tarfile
import time

import common  # (also puts this tree's fuse_plugin on sys.path)
import torch
import torch.nn.functional as F
import zoo
from common import room_for_compiles, round_order

VARIANTS = ("compile", "fused+compile", "plugin", "plugin@SITE_CHOICE=inductor")
PHASES = ("fwd", "bwd", "opt")
# What a wrapper's call() does per call, counted from its source (Inductor's generated Python).
COUNTS = {
    "launch": r"\.run\(",  # a Triton kernel launch (Inductor's own and user-defined ones)
    "alloc": r"empty_strided",  # an allocation
    "extern": r"extern_kernels\.",  # an extern call (cuBLAS bmm / mm / addmm, SDPA kernels, ...)
    "aten": r"torch\.ops\.",  # an op called through the dispatcher (opaque custom ops included)
    "view": r"reinterpret_tensor|as_strided",  # a view made in Python
}


def wrapper_counts(source: str) -> dict[str, int]:
    """Counts of COUNTS' patterns in the body of ``def call(`` (the per-call code)."""
    body = source.split("def call(", 1)[-1].split("\ndef ", 1)[0]
    out = {k: len(re.findall(p, body)) for k, p in COUNTS.items()}
    out["lines"] = body.count("\n")
    return out


def new_wrappers(before: int) -> list:
    """The wrapper modules PyCodeCache loaded since it held ``before`` modules."""
    from torch._inductor.codecache import PyCodeCache

    return [m for m in PyCodeCache.modules[before:] if hasattr(m, "call") and getattr(m, "__file__", None)]


def ours_static(modules) -> str:
    """"s of n": how many of the kernels of ours in these wrapper modules Inductor launches
    statically (kernels/static_launch.py)."""
    from fuse_plugin.kernels.static_launch import compiled_kernels_of_ours

    found = [v for _, v in compiled_kernels_of_ours(modules)]
    return f"{sum(bool(v.is_statically_launchable()) for v in found)} of {len(found)}"


def code_modules() -> int:
    from torch._inductor.codecache import PyCodeCache

    return len(PyCodeCache.modules)


def phase_step(model, fn, opt, images, labels, clock: list):
    """One training (or inference) step, appending the host's clock after each phase."""
    if opt is None:
        with torch.no_grad():
            fn(images)
        clock.append(time.perf_counter())
        return
    logits = zoo.logits_of(fn(images))
    clock.append(time.perf_counter())
    F.cross_entropy(logits.float(), labels).backward()
    clock.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=True)
    clock.append(time.perf_counter())


def two_steps(model, fn, opt, images, labels) -> None:
    """Two untimed steps (the cProfile, the launch costs and the GPU time each watch two)."""
    for _ in range(2):
        phase_step(model, fn, opt, images, labels, [time.perf_counter()])


def timed_round(model, fn, opt, images, labels, steps: int, phases: int, device: str) -> tuple[list, float]:
    """Host seconds of each phase over ``steps`` steps (no sync inside), and the wall seconds."""
    import gc

    gc.disable()
    try:
        sums = [0.0] * phases
        t0 = time.perf_counter()
        for _ in range(steps):
            clock = [time.perf_counter()]
            phase_step(model, fn, opt, images, labels, clock)
            for i in range(phases):
                sums[i] += clock[i + 1] - clock[i]
        zoo.sync(device)
        return sums, time.perf_counter() - t0
    finally:
        gc.enable()
        gc.collect()


def launch_costs(built, images, labels, device: str) -> str:
    """Per variant: the host's time in each Triton launch over two steps (summed per kernel: ours
    and Inductor's apart, the costliest per launch first), then a cProfile of 200 launches of the
    costliest kernel of ours with its last arguments (where the time of one launch goes)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from fuse_plugin.kernels.launch import kernel_name, ours

    original = CachingAutotuner.run
    stats: dict = {}

    def timed_run(self, *a, **kw):
        t = time.perf_counter_ns()
        try:
            return original(self, *a, **kw)
        finally:
            s = stats.setdefault(id(self), [self, 0, 0, None])
            s[1] += 1
            s[2] += time.perf_counter_ns() - t
            s[3] = (a, kw)

    out = []
    for variant, (model, fn, opt) in built.items():
        stats.clear()
        CachingAutotuner.run = timed_run
        try:
            with zoo._variant_context(variant):
                two_steps(model, fn, opt, images, labels)
        finally:
            CachingAutotuner.run = original
        zoo.sync(device)
        rows = sorted(stats.values(), key=lambda s: -s[2] / s[1])
        mine = [s for s in rows if ours(s[0])]
        theirs = [s for s in rows if not ours(s[0])]
        total = lambda ss: (sum(s[1] for s in ss) // 2, sum(s[2] for s in ss) / 2e3)  # noqa: E731
        out.append(f"===== {variant}: a step: ours {total(mine)[0]} launches {total(mine)[1]:.0f} us, "
                   f"Inductor's {total(theirs)[0]} launches {total(theirs)[1]:.0f} us")
        for s in rows[:12]:
            out.append(f"  {'ours' if ours(s[0]) else 'ind.'} {kernel_name(s[0])[:60]:60s} args {len(s[3][0]):3d} "
                       f"launches/step {s[1] / 2:5.1f} us/launch {s[2] / s[1] / 1e3:6.1f}")
        if mine:
            kern, _, _, (a, kw) = mine[0]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                kern.run(*a, **kw)
            prof.disable()
            zoo.sync(device)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
            out.append(f"  200 launches of {kernel_name(kern)}:\n{buf.getvalue()}")
    return "\n".join(out)


def gpu_time(built, images, labels, device: str) -> str:
    """Per variant: the GPU kernels' own time a step (torch.profiler over two steps, summed), and
    the costliest kernels, a step."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for variant, (model, fn, opt) in built.items():
        with zoo._variant_context(variant), profile(activities=[ProfilerActivity.CUDA]) as prof:
            two_steps(model, fn, opt, images, labels)
            zoo.sync(device)
        own = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
        rows = sorted(prof.key_averages(), key=lambda e: -own(e))
        out.append(f"===== {variant}: GPU kernels {sum(own(e) for e in rows) / 2e3:.2f} ms a step, "
                   f"{sum(e.count for e in rows if own(e)) // 2} kernels a step")
        for e in rows[:15]:
            out.append(f"  {e.key[:80]:80s} {e.count / 2:6.1f} a step {own(e) / 2e3:7.3f} ms")
    return "\n".join(out)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="twins_svt_s")
    p.add_argument("--task", default="train", choices=zoo.TASKS)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--code-out", default=None, help="a .tar.gz of every variant's wrapper code")
    p.add_argument("--cprofile-out", default=None, help="each variant's cProfile of two steps")
    p.add_argument("--launch-costs", default=None, help="each variant's host time per Triton launch")
    p.add_argument("--gpu-time", default=None, help="each variant's GPU kernel time a step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--build-deadline", type=float, default=0.0,
                   help="s: no variant is built after this many seconds (0: no limit)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    args.dtype = torch.bfloat16
    variants = args.variants.split(",")
    room_for_compiles()
    images, labels, ref, fused_path = zoo.reference(args.model, args.task, args)
    built, code, counts = {}, {}, {}
    t_start = time.perf_counter()
    for variant in variants:
        if args.build_deadline and time.perf_counter() - t_start > args.build_deadline:
            print(f"{variant}: not built (--build-deadline {args.build_deadline:.0f} s passed)")
            continue
        if zoo.base(variant) == "fused+compile" and not fused_path:
            print(f"{variant}: no fused path, skipped")
            continue
        before = code_modules()
        step, kept, cell = zoo.build_variant(args.model, variant, args.task, "default", images, labels, ref, args)
        built[variant] = kept
        code[variant] = [(m.__file__, open(m.__file__).read()) for m in new_wrappers(before)]
        counts[variant] = [wrapper_counts(src) for _, src in code[variant]]
        cell["ours_static"] = ours_static(new_wrappers(before))
        print(f"built {variant} in {cell['compile_s']:.0f} s: {cell['graphs']} graph(s), parity "
              f"{cell['rel']:.1e}, attention {cell.get('attention', '-')} left {cell.get('attention_left', '-')}; "
              f"our kernels statically launched {cell['ours_static']}; wrappers {counts[variant]}", flush=True)
    phases = len(PHASES) if args.task == "train" else 1
    host = {v: [] for v in built}
    wall = {v: [] for v in built}
    for i in range(args.rounds):
        for variant in round_order(list(built), i):
            model, fn, opt = built[variant]
            with zoo._variant_context(variant):
                sums, w = timed_round(model, fn, opt, images, labels, args.steps, phases, args.device)
            host[variant].append(sums)
            wall[variant].append(w)
    if args.cprofile_out:
        with open(args.cprofile_out, "w") as f:
            for variant, (model, fn, opt) in built.items():
                prof = cProfile.Profile()
                with zoo._variant_context(variant):
                    prof.enable()
                    two_steps(model, fn, opt, images, labels)
                    prof.disable()
                zoo.sync(args.device)
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
                f.write(f"===== {variant}\n{s.getvalue()}\n")
    if args.launch_costs:
        text = launch_costs(built, images, labels, args.device)
        open(args.launch_costs, "w").write(text)
        print("\n".join(line for line in text.splitlines() if line.startswith("=====")))
    if args.gpu_time:
        text = gpu_time(built, images, labels, args.device)
        open(args.gpu_time, "w").write(text)
        print("\n".join(line for line in text.splitlines() if line.startswith("=====")))
    if args.code_out:
        with tarfile.open(args.code_out, "w:gz") as tar:
            for variant, files in code.items():
                for i, (path, src) in enumerate(files):
                    data = src.encode()
                    info = tarfile.TarInfo(f"{re.sub(r'[^A-Za-z0-9_.+=-]', '_', variant)}/{i}_{path.rsplit('/', 1)[-1]}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    ms = lambda xs: statistics.median(xs) * 1e3 / args.steps  # noqa: E731
    base = "compile" if "compile" in built else next(iter(built))
    print(f"\n{args.model} {args.task}, bs {args.batch}, {args.rounds} interleaved rounds of {args.steps} steps; "
          f"ms a step (medians); host: the phases' clock, no sync inside a round")
    print("| variant | " + " | ".join(f"host {p}" for p in PHASES[:phases]) + " | host total | wall | "
          f"total vs {base} (paired) | fwd wrapper launch/alloc/extern/aten/view/lines | bwd wrapper |")
    print("|---" * (phases + 6) + "|")
    for variant in built:
        per = [ms([r[i] for r in host[variant]]) for i in range(phases)]
        tot = [sum(r) for r in host[variant]]
        paired = statistics.median(t / b for t, b in zip(tot, [sum(r) for r in host[base]]))
        cs = counts[variant] + [{}] * 2
        fmt = lambda c: "/".join(str(c.get(k, "-")) for k in (*COUNTS, "lines")) if c else "-"  # noqa: E731
        print(f"| {variant} | " + " | ".join(f"{x:.2f}" for x in per) + f" | {ms(tot):.2f} | "
              f"{ms(wall[variant]):.2f} | {paired:.3f} | {fmt(cs[0])} | {fmt(cs[1])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
