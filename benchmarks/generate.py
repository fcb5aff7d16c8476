"""Text generation with a static KV cache: HF `generate` (greedy), the forward compiled.

    python benchmarks/generate.py [--models llama100m,e2e] [--prompts 512,4096] [--batches 1,8]
                                  [--new-tokens 256] [--variants eager,compile,sdpa+compile,plugin,floor]
                                  [--modes default,reduce-overhead] [--rounds 3] [--out FILE.md]
                                  [--parallel]
    python benchmarks/generate.py --cpu --tiny      # a smoke run on the CPU (a 2-layer model, fp32)

Models (random weights, bf16 on the GPU): ``llama100m`` = transformers LlamaForCausalLM with 12
layers, hidden 768, 12 q / 4 kv heads of 64, intermediate 2048, vocab 32000, tied embeddings
(~100M parameters); ``e2e`` = benchmarks/e2e.py's config (12 layers, hidden 1024, 16/4 heads,
intermediate 4096, vocab 32000, ~250M). ``--tiny``: 2 layers, hidden 64, 4/2 heads (fp32).

Variants: ``eager`` (eager attention, no compile), ``compile`` (eager attention + stock
torch.compile, the plugin off while it compiles), ``sdpa+compile`` (HF's SDPA attention + stock
compile), ``plugin`` (eager attention + torch.compile(backend="fuse_plugin")), ``plugin-sdpa`` (HF's
SDPA attention + the plugin: its SDPA call sites weighed by the choice, issue 30; not run unless
named, its ratio against the same best stock); the compiled ones in
each ``--modes`` mode (reduce-overhead = CUDA graphs). The recipe is HF's documented static-cache
one with the whole forward compiled: ``model.forward = torch.compile(model.forward, mode=...,
fullgraph=True)``, one `StaticCache` of prompt + new-tokens slots per cell, initialised before
the compile (`early_initialization`: its buffers are then static addresses, which CUDA graphs
need once the prefill is compiled too) and reset before each call, and ``generate(...,
disable_compile=True)`` (on CUDA, HF would otherwise wrap the forward in its own decode compile,
a second torch.compile around ours).

Every cell of a row (model, prompt, batch) is built and compiled first (two warm-up generations
of 3 tokens: the first compiles the prefill and decode graphs, the second records their CUDA
graphs in reduce-overhead mode); then ``--rounds`` rounds in which the cells take turns: a round of
a cell times ``generate(max_new_tokens=1)`` (the prefill and one token: TTFT) and one full
generation of N tokens; decode tokens/s = batch x (N - 1) / (T_N - T_1). A figure is the median
over the rounds (the device machine's host drifts by 10-30% over minutes: interleaving keeps that
out of the ratios). ``peak MiB``: the most memory the cell had allocated during its warm-up (its
weights, cache, activations and CUDA-graph pools; the other cells' memory is subtracted). ``=
eager``: the sequences of the last full generation whose tokens equal eager's (greedy; bf16 may
differ after a near tie); ``recompiles``: graphs compiled during the timed rounds (0: no graph
per decoded token); for the plugin, the attention sites fused per compiled graph. ``plugin /
best stock``: the plugin's decode tokens/s over the best of compile and sdpa+compile in the same
mode. ``floor`` (``--floor-modes``, reduce-overhead by default) is the model with no attention at
all (stock compile, wrong tokens by design): ``floor / best stock`` is the most that any
attention kernel could give that row, the ceiling of the plugin's ratio. With ``--out`` the
table is rewritten after every row.
``--profile N`` prints, per cell, where a generation of N tokens spends host and GPU time.
``--rounds 0`` compiles and warms up only: a few such processes over disjoint rows, run in
parallel, fill Inductor's and Triton's caches for the timed run.
``--parallel`` runs each row in a process of its own: all rows build (compile and warm up) at
once, and only when every row is built do they time, one row at a time in a fixed order (the
smallest first), the others waiting idle (no compile or other work on the host or the GPU while a
row times; each row's ratios still come from its own interleaved rounds). The full table (8
rows) then takes the longest build plus the sum of the timed rounds, instead of the sum of the
builds plus a separate compile pre-pass (stop 16: ~37 min, more than a device hold; stop 21: the
8 rows in 16 min, at most 62 GB of the H100's memory while all rows were built). A row's process
exits after its turn, freeing its memory before the larger rows time.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import time

import torch
from common import emit, room_for_compiles
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin.backend import fuse_plugin_backend

VARIANTS = ("eager", "compile", "sdpa+compile", "plugin", "plugin-sdpa", "floor")
# The attention implementation each variant builds its model with.
ATTENTION = {"sdpa+compile": "sdpa", "plugin-sdpa": "sdpa", "floor": "fuse_plugin_floor"}
PLUGIN = ("plugin", "plugin-sdpa")  # compiled with backend="fuse_plugin"
MODES = ("default", "reduce-overhead")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def config(name: str):
    from transformers import LlamaConfig

    if name == "llama100m":
        return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                           num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=16384,
                           tie_word_embeddings=True)
    if name == "e2e":  # benchmarks/e2e.py
        return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384)
    if name == "tiny":
        return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(f"unknown model {name!r} (llama100m, e2e)")


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """The ``floor`` variant's attention: none (the queries pass through as its output, (B, L, H,
    D)); the cache is still written, and HF builds the same mask for it as for eager attention
    (``generate`` builds it outside the compiled forward at every step: host time that every
    other variant pays). Wrong tokens by design: a model whose attention costs nothing, the
    bound on what any attention kernel can give the step."""
    return query.transpose(1, 2), None


def build(name: str, attn: str, device: str, dtype: torch.dtype):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("fuse_plugin_floor", no_attention)
    # without a mask function of its own HF would build no mask at all for it (a cheaper step)
    AttentionMaskInterface.register("fuse_plugin_floor", ALL_MASK_ATTENTION_FUNCTIONS["eager"])

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config(name)), attn_implementation=attn, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.pad_token_id = model.config.pad_token_id or 0
    model.generation_config.eos_token_id = None  # always N new tokens
    return model


class CountingBackend:
    """backend="fuse_plugin" (with the mode torch.compile passes on), recording the attention sites
    fused per compiled graph."""

    def __init__(self):
        self.graphs: list[int] = []

    def __call__(self, gm, example_inputs, **kwargs):
        before = counters["fuse_plugin"]["attention"] + counters["fuse_plugin"]["sdpa"]
        compiled = fuse_plugin_backend(gm, example_inputs, **kwargs)
        fused = counters["fuse_plugin"]["attention"] + counters["fuse_plugin"]["sdpa"] - before
        # a graph with symbolic sizes keeps our ops opaque (ops/inductor.py): marked "(dynamic)"
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        dynamic = any(isinstance(v, torch.SymInt) or isinstance(v, torch.Tensor)
                      and any(isinstance(s, torch.SymInt) for s in v.shape) for v in values)
        self.graphs.append(f"{fused} (dynamic)" if dynamic else fused)
        return compiled


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prompt(batch: int, length: int, vocab: int, device: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def static_cache(model, batch: int, max_len: int):
    """A StaticCache initialised now (static buffer addresses before anything compiles)."""
    from transformers import StaticCache

    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(batch, cfg.num_key_value_heads, head_dim, model.dtype, model.device)
    return cache


class Cell:
    """One variant x mode of a row: its model, compiled forward, cache and measurements."""

    def __init__(self, name, variant, mode, inputs, max_len, args):
        self.variant, self.mode, self.args, self.inputs = variant, mode, args, inputs
        self.model = build(name, ATTENTION.get(variant, "eager"), args.device, args.dtype)
        self.cache = static_cache(self.model, inputs["input_ids"].shape[0], max_len)
        self.backend = CountingBackend() if variant in PLUGIN else None
        if variant != "eager":
            kwargs = {"mode": None if mode == "default" else mode, "fullgraph": True}
            self.model.forward = torch.compile(self.model.forward, backend=self.backend or "inductor", **kwargs)
        self.stock = variant in ("compile", "sdpa+compile", "floor")
        self.t1, self.tn = [], []

    def generate(self, n):
        self.cache.reset()
        ctx = fuse_plugin.disabled if self.stock else contextlib.nullcontext
        with torch.no_grad(), ctx():
            return self.model.generate(**self.inputs, past_key_values=self.cache, max_new_tokens=n,
                                       min_new_tokens=n, do_sample=False, disable_compile=True)

    def timed(self, n):
        sync(self.args.device)
        t0 = time.perf_counter()
        out = self.generate(n)
        sync(self.args.device)
        return time.perf_counter() - t0, out


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


WARM_TOKENS = 3  # a warm-up generation: the prefill once, the decode step twice


def run_row(name, prompt_len, batch, args, results, log, before_timing=lambda: None):
    """Build and warm every cell of the row, then the interleaved timed rounds (module doc).
    ``before_timing`` is called between the two (``--parallel``: wait for this row's turn)."""
    device, n = args.device, args.new_tokens
    cells = []
    for variant in args.variants:
        modes = ["-"] if variant == "eager" else args.floor_modes if variant == "floor" else args.modes
        for mode in modes:
            key = (name, prompt_len, batch, variant, mode)
            t0 = time.perf_counter()
            before = torch.cuda.memory_allocated() if device == "cuda" else 0
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            cell = None
            try:
                inputs = prompt(batch, prompt_len, config(name).vocab_size, device)
                cell = Cell(name, variant, mode, inputs, prompt_len + n, args)
                # the first compiles the prefill and the decode step, the second records their CUDA
                # graphs in reduce-overhead mode (the memory they keep is in the cell's peak)
                for _ in range(2):
                    cell.generate(WARM_TOKENS)
                cell.peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if device == "cuda" else None
                if args.rounds:
                    cells.append((key, cell))
                log(f"  built {key} in {time.perf_counter() - t0:.0f} s"
                    + (f", fused {cell.backend.graphs}" if cell.backend else ""))
            except Exception as e:  # reported in the table, the other cells still run
                import traceback

                traceback.print_exc()
                results[key] = {"error": "OOM" if isinstance(e, torch.OutOfMemoryError) else f"error: {type(e).__name__}"}
                log(f"  {key}: {results[key]['error']}")
            del cell
            if device == "cuda":
                torch.cuda.empty_cache()
    before_timing()
    graphs_before = graphs_compiled()
    tokens = {}
    for _ in range(args.rounds):
        for key, cell in cells:
            t1, _ = cell.timed(1)
            tn, tokens[key] = cell.timed(n)
            cell.t1.append(t1)
            cell.tn.append(tn)
    recompiles = graphs_compiled() - graphs_before
    for key, cell in cells if args.profile else ():
        log(f"  profile {' '.join(map(str, key))}: {profile(cell, args.profile)}")
    eager = next((t for (_, _, _, variant, _), t in tokens.items() if variant == "eager"), None)
    for key, cell in cells:
        decode = [batch * (n - 1) / max(tn - t1, 1e-9) for t1, tn in zip(cell.t1, cell.tn)]
        same = "-" if eager is None or key[3] == "floor" else int((tokens[key] == eager).all(dim=1).sum())
        results[key] = {"ttft_ms": median(cell.t1) * 1e3, "decode": median(decode), "peak": cell.peak,
                        "same": same, "recompiles": recompiles,
                        "fused": cell.backend.graphs if cell.backend else None}
        log(f"  {' '.join(map(str, key))}: {fmt(results[key])}")
    del cells
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def profile(cell, n: int, top: int = 6) -> str:
    """Where a generation of n tokens spends its time (torch.profiler; kernels in CUDA-graph
    replays are recorded too): the prefill (generate(1)) and the n - 1 decode steps apart, per
    call: host wall, GPU kernels launched and their summed time, the top kernels by time; for the
    prefill also the host's top ops by self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def one(tokens):
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall, _ = cell.timed(tokens)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict = {}
        for e in kernels:
            t, c = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (t + e.device_time, c + 1)
        host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                      key=lambda e: -e.self_cpu_time_total)[:top]
        host = ", ".join(f"{e.key[:40]} {e.self_cpu_time_total:.0f}us x{e.count}" for e in host)
        return wall * 1e6, len(kernels), sum(e.device_time for e in kernels), by_name, host

    w1, k1, g1, _, host1 = one(1)
    wn, kn, gn, names, _ = one(n)
    steps = n - 1
    tops = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    tops = ", ".join(f"{name[:40]} {t / steps:.0f}us x{c / steps:.1f}" for name, (t, c) in tops)
    return (f"prefill: wall {w1:.0f} us, {k1} kernels, {g1:.0f} us GPU, host self time: {host1} | "
            f"per decode step: wall "
            f"{(wn - w1) / steps:.0f} us, {(kn - k1) / steps:.1f} kernels, {(gn - g1) / steps:.0f} us GPU | "
            f"top (whole run, per step): {tops}")


def fmt(cell) -> str:
    if "error" in cell:
        return cell["error"]
    peak = f"{cell['peak']:.0f} MiB" if cell["peak"] is not None else "-"
    fused = f" fused {cell['fused']}" if cell["fused"] is not None else ""
    return (f"ttft {cell['ttft_ms']:.1f} ms, decode {cell['decode']:.1f} tok/s, peak {peak}, = eager {cell['same']}, "
            f"recompiles {cell['recompiles']}{fused}")


def table(results) -> list[str]:
    lines = ["| model | prompt | batch | variant | mode | TTFT ms | decode tok/s | peak MiB | = eager | "
             "recompiles | attention fused per graph | plugin / best stock (decode) | floor / best stock |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, plen, batch, variant, mode), cell in results.items():
        if "error" in cell:
            lines.append(f"| {name} | {plen} | {batch} | {variant} | {mode} | {cell['error']} | | | | | | | |")
            continue
        ratios = ["", ""]
        if variant in PLUGIN + ("floor",):
            others = [results.get((name, plen, batch, v, mode), {}).get("decode") for v in ("compile", "sdpa+compile")]
            others = [o for o in others if o]
            ratios[variant == "floor"] = f"{cell['decode'] / max(others):.2f}" if others else "-"
        peak = f"{cell['peak']:.0f}" if cell["peak"] is not None else "-"
        fused = "/".join(str(g) for g in cell["fused"]) if cell["fused"] is not None else ""
        same = f"{cell['same']}/{batch}" if cell["same"] != "-" else "-"
        lines.append(f"| {name} | {plen} | {batch} | {variant} | {mode} | {cell['ttft_ms']:.1f} | "
                     f"{cell['decode']:.1f} | {peak} | {same} | {cell['recompiles']} | {fused} | {ratios[0]} | {ratios[1]} |")
    return lines


def rows(args) -> list[tuple[str, int, int]]:
    return [(name, int(plen), int(batch)) for name in args.models.split(",")
            for plen in args.prompts.split(",") for batch in args.batches.split(",")]


def run_worker(args) -> None:
    """One row of ``--parallel``: build, write ``<prefix>.built``, wait for ``<prefix>.go``, time,
    write the row's results to ``<prefix>.json``."""
    import json
    import os

    (name, plen, batch), = rows(args)
    prefix = args.worker

    parent = os.getppid()

    def wait_for_turn():
        open(prefix + ".built", "w").close()
        while not os.path.exists(prefix + ".go"):
            if os.getppid() != parent:  # the parent is gone: nobody will give this row its turn
                raise SystemExit(f"generate.py --parallel: the parent of row {name} {plen} x {batch} exited")
            time.sleep(0.2)
        print(f"  timing from t = {time.time():.3f}", flush=True)

    results: dict = {}
    run_row(name, plen, batch, args, results, lambda s: print(s, flush=True), before_timing=wait_for_turn)
    with open(prefix + ".json", "w") as f:
        json.dump([[list(key), cell] for key, cell in results.items()], f)


def run_parallel(args, header, results, t_start) -> None:
    """``--parallel`` (module doc): a worker process per row, all building at once, then timed one
    at a time, the smallest row first; the workers' logs are printed as each row finishes."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    order = sorted(rows(args), key=lambda r: (r[1] * r[2], r[0] == "e2e"))
    sync = tempfile.mkdtemp(prefix="generate_parallel_")
    procs = []
    for i, (name, plen, batch) in enumerate(order):
        cmd = [sys.executable, os.path.abspath(__file__), "--models", name, "--prompts", str(plen),
               "--batches", str(batch), "--new-tokens", str(args.new_tokens), "--variants", ",".join(args.variants),
               "--floor-modes", ",".join(args.floor_modes) or ",", "--modes", ",".join(args.modes),
               "--rounds", str(args.rounds), "--profile", str(args.profile), "--worker", f"{sync}/{i}"]
        cmd += ["--cpu"] if args.device == "cpu" else []
        log = open(f"{sync}/{i}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    print(f"{len(order)} rows building in parallel (logs in {sync})", flush=True)
    while not all(os.path.exists(f"{sync}/{i}.built") or p.poll() is not None for i, p in enumerate(procs)):
        time.sleep(1)
    print(f"all rows built after {time.perf_counter() - t_start:.0f} s (t = {time.time():.3f}); timing one row "
          "at a time", flush=True)
    done: dict = {}
    for i, ((name, plen, batch), p) in enumerate(zip(order, procs)):
        open(f"{sync}/{i}.go", "w").close()
        rc = p.wait()
        print(f"row {name} {plen} x {batch} done at t = {time.time():.3f}", flush=True)
        with open(f"{sync}/{i}.log") as f:
            print(f"--- row {name} {plen} x {batch} (exit {rc}) ---\n{f.read().rstrip()}", flush=True)
        try:
            with open(f"{sync}/{i}.json") as f:
                done[(name, plen, batch)] = {tuple(key): cell for key, cell in json.load(f)}
        except (OSError, ValueError):
            done[(name, plen, batch)] = {(name, plen, batch, "(row)", "-"): {"error": f"worker exit {rc}"}}
        if args.out and args.rounds:
            partial = {k: v for row in rows(args) if row in done for k, v in done[row].items()}
            emit([header, ""] + table(partial) + ["", "(partial)"], args.out, quiet=True)
    for row in rows(args):  # the table in the rows' own order
        results.update(done[row])


def main(argv=None):
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama100m,e2e")
    parser.add_argument("--prompts", default="512,4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "plugin-sdpa"))
    parser.add_argument("--floor-modes", default="reduce-overhead",
                        help="the modes the floor variant (attention costs nothing) runs in")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timed rounds per row (0: compile and warm up only)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the rounds, profile one generation of N tokens per cell (where the time goes)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (fp32)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer model, prompt 16, batch 2, 8 new tokens, default mode (a smoke run)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--parallel", action="store_true",
                        help="a process per row: all rows build at once, then time one at a time (module doc)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # --parallel's rows: a file prefix
    args = parser.parse_args(argv)
    if args.tiny:
        defaults = parser.parse_args([])
        for key, value in (("models", "tiny"), ("prompts", "16"), ("batches", "2"), ("new_tokens", 8),
                           ("modes", "default"), ("rounds", 1)):
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    args.device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if "eager" in args.variants:  # first: the reference tokens
        args.variants = ["eager"] + [v for v in args.variants if v != "eager"]
    args.modes = [m for m in args.modes.split(",") if m]
    args.floor_modes = [m for m in args.floor_modes.split(",") if m and m in args.modes]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    header = (f"{device_name} | torch {torch.__version__} | transformers {transformers.__version__} | "
              f"{time.strftime('%Y-%m-%d')} | {str(args.dtype).replace('torch.', '')} | static cache, greedy, "
              f"{args.new_tokens} new tokens | median of {args.rounds} interleaved rounds")
    print(header, flush=True)
    # The cells of a row all compile LlamaForCausalLM.forward (one code object): 2 graphs per cell.
    room_for_compiles()
    # Dynamo's automatic dynamic shapes are per code object: once an earlier cell compiled the
    # prefill (L = prompt) and the decode step (L = 1), every later cell's prefill would compile
    # with a symbolic length (stop 17: the plugin's prefill ops were then opaque, ~0.4 ms a call).
    # A process generating at one prompt length, as each cell models, compiles both static.
    torch._dynamo.config.automatic_dynamic_shapes = False
    results: dict = {}
    t_start = time.perf_counter()
    if args.worker:
        return run_worker(args)
    if args.parallel:
        run_parallel(args, header, results, t_start)
    for name, plen, batch in () if args.parallel else rows(args):
        run_row(name, plen, batch, args, results, lambda s: print(s, flush=True))
        if args.out and args.rounds:  # the rows so far, in case a later row does not finish
            emit([header, ""] + table(results) + ["", "(partial)"], args.out, quiet=True)
    if args.rounds == 0:
        print(f"compiled and warmed up only (--rounds 0), {time.perf_counter() - t_start:.0f} s")
        return
    lines = [header, ""] + table(results) + [f"\n(total {time.perf_counter() - t_start:.0f} s)"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
