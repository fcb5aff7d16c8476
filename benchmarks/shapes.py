"""Whole models at the shapes real workloads run: the plugin against stock compile and sdpa + compile.

    python benchmarks/shapes.py [--layers 12] [--rows ROW,...] [--modes default,reduce-overhead]
                                [--variants compile,sdpa+compile,plugin[,plugin-sdpa]] [--steps 10]
                                [--rounds 5] [--min-run-ms 50] [--min-timing-s 3]
                                [--out FILE.md] [--profile N]

With ``--rounds 0`` it only compiles and warms up every cell: a few such processes run in
parallel over disjoint ``--rows`` fill Inductor's and Triton's caches, so that the timed run
after them compiles from the caches (stop 15's table: RESULTS.md).

Rows (bf16 unless the row says otherwise; throughput = tokens/s, images/s for the ViT):
  llama train 8x512, 4x2048, 1x8192 and infer 1x128, 8x512, 4x2048, 1x8192: transformers
      LlamaForCausalLM from benchmarks/e2e.py's config (hidden 1024, 16/4 heads, head dim 64,
      intermediate 4096, vocab 32000; ``--layers`` layers, 12 by default);
  llama-infer-fp32-8x512: the same Llama loaded in float32 (the dtype HF models load in by
      default), no autocast, inference (fp32 matmuls as torch's defaults leave them: no TF32);
  llama-train-amp-8x512: float32 weights trained under ``torch.autocast("cuda",
      dtype=torch.bfloat16)`` as a user writes it: forward and loss under autocast, backward and
      the fused AdamW step (on the fp32 weights) outside; every variant alike (PRECISION below);
  vit infer / train: ViT-S/16 (224 px: 197 tokens, 6 heads of 64, batch 64): timm's
      vit_small_patch16_224 when timm is installed (its fused attention off for the eager and
      plugin variants, on for sdpa), else a plain-torch model of the same shape written like
      timm's non-fused path;
  bert train: transformers BertForMaskedLM, BERT-base config, batch 32 x seq 128, with a padding
      mask (lengths 96-128) as real batches have.
Variants: ``compile`` = eager attention + stock torch.compile (the plugin kept off while it
compiles); ``sdpa+compile`` = the model's SDPA path + stock torch.compile; ``plugin`` = eager
attention + torch.compile(backend="fuse_plugin"); ``plugin-sdpa`` (not run unless named) = the
model's SDPA path + torch.compile(backend="fuse_plugin"), the plugin on a model's default attention
(its SDPA calls go to our op where measured faster), compared with sdpa+compile in a column of its
own. Modes: default, reduce-overhead (CUDA graphs).
A training step is forward, cross-entropy, backward and a fused AdamW step; inference a forward
under no_grad. Each row and mode runs in one go: every variant gets its own model and compile
(3 warm-up steps), then ``--rounds`` rounds in which the variants take turns, each running
``--steps`` timed steps synchronised once (the host may run ahead of the GPU, as in a real loop);
a row whose fastest variant runs them in under ``--min-run-ms`` (50 by default) runs more, the
same number for every variant (run_steps; the log gives each row's), and a row whose rounds would
time for less than ``--min-timing-s`` (3 by default) runs more of them, up to 25 (run_rounds).
The garbage collector is off inside a timed run (collected between runs, as timeit does).
A cell is the median of its rounds (the best in brackets): the host of the device machine drifts
by 10-30% over minutes, and interleaving puts that drift on every variant alike (variants
measured one after another, minutes apart, disagreed with each other by that much: RESULTS.md,
stop 14). Each round starts one variant later (common.round_order), and the ratio cells carry the
paired ratio beside the ratio of medians: the median of each round's own ratio
(common.paired_median), which noise moving a whole round cancels out of. The last table: host µs per op call (overhead.py's compiled rows) next to SDPA's.

``--profile N`` then profiles N more steps of each variant (torch.profiler, kernels inside
CUDA-graph replays included) and prints per step: the host's time to issue a step, wall, GPU
kernel time and count, the host's synchronising calls, and the kernels by time, so that a row's
gap can be placed (on the device or on the host).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from common import emit, paired_median, prepass, profile_steps, round_order, run_waves, timed_run, wait_for_turn
from torch import nn

import fuse_plugin

VARIANTS = ("compile", "sdpa+compile", "plugin")
# plugin-sdpa (--variants ...,plugin-sdpa): the model on its default SDPA attention compiled with the
# plugin (`import fuse_plugin; torch.compile(model)`: its SDPA calls go to our op where measured
# faster, patterns/sdpa.py), against sdpa+compile, the same model compiled stock.
ALL_VARIANTS = VARIANTS + ("plugin-sdpa",)
MODES = ("default", "reduce-overhead")
# row name -> (family, kind, batch, seq)
ROWS = {
    "llama-train-8x512": ("llama", "train", 8, 512),
    "llama-train-4x2048": ("llama", "train", 4, 2048),
    "llama-train-1x8192": ("llama", "train", 1, 8192),
    "llama-infer-1x128": ("llama", "infer", 1, 128),
    "llama-infer-8x512": ("llama", "infer", 8, 512),
    "llama-infer-4x2048": ("llama", "infer", 4, 2048),
    "llama-infer-1x8192": ("llama", "infer", 1, 8192),
    "vit-infer-64": ("vit", "infer", 64, 197),
    "vit-train-64": ("vit", "train", 64, 197),
    "bert-train-32x128": ("bert", "train", 32, 128),
    "llama-infer-fp32-8x512": ("llama", "infer", 8, 512),
    "llama-train-amp-8x512": ("llama", "train", 8, 512),
}
# row name -> "fp32" (float32 weights) or "amp" (float32 weights, forward and loss under bf16
# autocast); rows not named here are "bf16" (bf16 weights). Every variant of a row gets the same.
PRECISION = {
    "llama-infer-fp32-8x512": "fp32",
    "llama-train-amp-8x512": "amp",
}


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def llama(attn: str, layers: int, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=16384)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn,
                                            dtype=dtype).cuda()


def bert(attn: str, layers: int, dtype=torch.bfloat16):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM._from_config(BertConfig(), attn_implementation=attn)
    return model.to(device="cuda", dtype=dtype)


class _VitAttention(nn.Module):
    """timm's Attention, non-fused path (q * scale, q @ kᵀ, softmax, @ v) or F.sdpa."""

    def __init__(self, dim, heads, fused):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            x = attn @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class _VitBlock(nn.Module):
    def __init__(self, dim, heads, fused):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), _VitAttention(dim, heads, fused)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PlainViT(nn.Module):
    """ViT-S/16 shaped (224 px, patch 16, dim 384, 12 blocks, 6 heads), written like timm."""

    def __init__(self, fused, dim=384, depth=12, heads=6, classes=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 16, 16)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 197, dim) * 0.02)
        self.blocks = nn.Sequential(*[_VitBlock(dim, heads, fused) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit(attn: str, layers: int, dtype=torch.bfloat16):
    fused = attn == "sdpa"
    torch.manual_seed(0)
    try:
        import timm

        model = timm.create_model("vit_small_patch16_224", pretrained=False)
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = fused
        vit.source = f"timm {timm.__version__} vit_small_patch16_224"
    except ImportError:
        model = PlainViT(fused)
        vit.source = "plain-torch ViT-S/16 (timm not installed)"
    return model.to(device="cuda", dtype=dtype)


FAMILIES = {"llama": llama, "bert": bert, "vit": vit}


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


def make_batch(family: str, batch: int, seq: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    if family == "vit":
        images = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16, generator=g)
        return dict(x=images), torch.randint(0, 1000, (batch,), device="cuda", generator=g)
    vocab = 32000 if family == "llama" else 30522
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    inputs = dict(input_ids=ids)
    if family == "bert":
        lengths = torch.randint(96, seq + 1, (batch,), device="cuda", generator=g)
        inputs["attention_mask"] = (torch.arange(seq, device="cuda")[None] < lengths[:, None]).long()
    return inputs, ids


def logits_of(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def make_step(fn, kind, inputs, labels, opt, cudagraphs, precision="bf16"):
    """A step: inference under no_grad, or forward, loss, backward, optimizer step. With
    precision "amp" the forward and the loss run under bf16 autocast, the rest outside."""
    def autocast():
        return (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "amp"
                else contextlib.nullcontext())

    def forward():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            if "x" in inputs:
                return logits_of(fn(inputs["x"]))
            return logits_of(fn(**inputs))

    if kind == "infer":
        def step():
            with torch.no_grad():
                forward()
        return step

    def step():
        logits = forward()
        with autocast():
            loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _variant_context(variant):
    return fuse_plugin.disabled() if not variant.startswith("plugin") else contextlib.nullcontext()


def build(family, variant, mode, layers, precision="bf16"):
    """One model of `family` for `variant` (its own weights, seeded alike) and its compiled forward;
    bf16 weights, or float32 for precision "fp32" and "amp"."""
    attn = "sdpa" if variant in ("sdpa+compile", "plugin-sdpa") else "eager"
    model = FAMILIES[family](attn, layers, torch.bfloat16 if precision == "bf16" else torch.float32)
    kwargs = dict(mode=None if mode == "default" else mode, dynamic=False)
    if variant.startswith("plugin"):
        fn = torch.compile(model, backend="fuse_plugin", **kwargs)
    else:
        fn = torch.compile(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, fn, opt


def _free():
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    with contextlib.suppress(Exception):
        torch._inductor.cudagraph_trees.reset_cudagraph_trees()


def run_steps(steps: int, probe_s: list, min_run_s: float) -> int:
    """Steps per timed run of a row: ``steps``, or more where the row's fastest variant ran
    ``steps`` in under ``min_run_s`` (``probe_s``: each variant's seconds for one run of ``steps``),
    so that every run lasts at least that long. A run of a few ms (Llama inference at 1 x 128
    tokens under CUDA graphs: 4 ms for 10 steps) is moved by one host hiccup: stop 43 read that row
    0.88 and 0.94 by its medians, 1.09 and 1.06 paired."""
    import math

    fastest = min(probe_s, default=0.0)
    if min_run_s <= 0 or fastest <= 0 or fastest >= min_run_s:
        return steps
    return math.ceil(steps * min_run_s / fastest)


MAX_ROUNDS = 25  # run_rounds' most


def run_rounds(rounds: int, round_s: float, min_timing_s: float, cap: int = MAX_ROUNDS) -> int:
    """Rounds of a row: ``rounds``, or more (at most ``cap``) where a round (every variant's run,
    ``round_s`` seconds) is so short that ``rounds`` of them time for less than ``min_timing_s``.
    Five rounds of a host-bound row are moved by one slow phase of the host: llama-infer-1x128 in
    default mode read 0.79 by its medians and 1.17 paired (H100, stop 51), its rounds lasting
    0.04 s a variant; 25 of them cost ~3 s, nothing beside the row's compile."""
    import math

    if min_timing_s <= 0 or round_s <= 0 or rounds * round_s >= min_timing_s:
        return rounds
    return max(rounds, min(cap, math.ceil(min_timing_s / round_s)))


def run_row(name, mode, variants, layers, steps, rounds, results, log, profile=0, before_timing=lambda: None,
            min_run_s=0.0, min_timing_s=0.0):
    """One row in one mode, every variant in this process: each variant gets its own model and
    compile (3 warm-up steps), then `rounds` rounds in which each variant runs `steps` timed steps
    (more where a run would be shorter than ``min_run_s``: run_steps) in turn, so that the host's
    drift over minutes falls on all variants alike. A cell is the median (and the best) of its
    variant's rounds. ``before_timing``: called once every variant is built (--parallel's worker
    waits there for its turn)."""
    family, kind, batch, seq = ROWS[name]
    precision = PRECISION.get(name, "bf16")
    items = batch if family == "vit" else batch * seq
    inputs, labels = make_batch(family, batch, seq)
    steps_of, times, t0 = {}, {v: [] for v in variants}, time.perf_counter()
    for variant in variants:
        try:
            model, fn, opt = build(family, variant, mode, layers, precision)
            model.train(kind == "train")
            step = make_step(fn, kind, inputs, labels, opt, mode == "reduce-overhead", precision)
            with _variant_context(variant):
                for _ in range(3):  # compile, warm-up (CUDA graphs record on the 2nd/3rd call)
                    step()
            torch.cuda.synchronize()
            steps_of[variant] = (step, model, fn, opt)
            torch.cuda.empty_cache()  # a built variant holds its model, not its warm-up's activations
        except torch.OutOfMemoryError:
            results[(name, mode, variant)] = "OOM"
        except Exception as e:  # reported in the table, the other cells still run
            import traceback

            traceback.print_exc()
            results[(name, mode, variant)] = f"error: {type(e).__name__}"
    compiled_s = time.perf_counter() - t0
    before_timing()
    if rounds == 0:  # --rounds 0: compile and warm up only (fills Inductor's and Triton's caches)
        log(f"  {name:20} {mode:16} compiled and warmed up: {', '.join(steps_of)}   ({compiled_s:.0f} s)")
        return
    probe = []
    for variant in steps_of if min_run_s > 0 or min_timing_s > 0 else ():
        with _variant_context(variant):
            probe.append(timed_run(steps_of[variant][0], steps))
    probe_steps, steps = steps, run_steps(steps, probe, min_run_s)
    rounds = run_rounds(rounds, sum(probe) * steps / probe_steps, min_timing_s)
    results[(name, mode, "steps")] = steps
    for i in range(rounds):
        for variant in round_order(list(steps_of), i):
            with _variant_context(variant):
                times[variant].append(timed_run(steps_of[variant][0], steps))
    for variant in steps_of:
        ts = sorted(times[variant])
        results[(name, mode, variant)] = items * steps / ts[len(ts) // 2]
        results[(name, mode, variant, "best")] = items * steps / ts[0]
        results[(name, mode, variant, "rounds")] = times[variant]
    for variant, (step, *_rest) in steps_of.items() if profile else ():
        with _variant_context(variant):
            log(profile_steps(step, profile, f"{name} {mode} {variant}"))
    cells = "  ".join(f"{v} {results[(name, mode, v)]:.0f}" if isinstance(results[(name, mode, v)], float)
                      else f"{v} {results[(name, mode, v)]}" for v in variants)
    log(f"  {name:20} {mode:16} {cells}   (compile {compiled_s:.0f} s, {rounds} rounds of {steps} steps, total "
        f"{time.perf_counter() - t0:.0f} s)")
    if rounds > 1:  # each run's ms per step, in round order: the host's drift between rounds
        log("    ms a step by round: " + " | ".join(
            f"{v} " + " ".join(f"{1e3 * t / steps:.2f}" for t in times[v]) for v in steps_of))


def table(results, rows, modes, variants) -> list[str]:
    """Cells: median of the interleaved rounds (best in brackets); the ratio is of the medians, with
    the paired ratio beside it (the median of the rounds' own ratios, ``_paired``)."""
    sdpa = "plugin-sdpa" in variants and "sdpa+compile" in variants
    lines = ["| row | mode | " + " | ".join(variants) + " | plugin / best other |"
             + (" plugin-sdpa / sdpa+compile |" if sdpa else ""),
             "|---|---|" + "---|" * (len(variants) + 1 + sdpa)]
    for name in rows:
        for mode in modes:
            vals = {v: results.get((name, mode, v)) for v in variants}
            cells = [f"{vals[v]:.0f} ({results[(name, mode, v, 'best')]:.0f})" if isinstance(vals[v], float)
                     else str(vals[v]) for v in variants]
            others = [v for v, x in vals.items() if not v.startswith("plugin") and isinstance(x, float)]
            ratio = (f"{vals['plugin'] / max(vals[v] for v in others):.2f}"
                     + _paired(results, name, mode, "plugin", others)
                     if isinstance(vals.get("plugin"), float) and others else "-")
            line = f"| {name} | {mode} | " + " | ".join(cells) + f" | {ratio} |"
            if sdpa:
                a, b = vals.get("plugin-sdpa"), vals.get("sdpa+compile")
                line += (f" {a / b:.2f}{_paired(results, name, mode, 'plugin-sdpa', ['sdpa+compile'])} |"
                         if isinstance(a, float) and isinstance(b, float) else " - |")
            lines.append(line)
    return lines


def _paired(results, name, mode, variant, others) -> str:
    """" (paired x)": the median over rounds of ``variant`` against the fastest of ``others`` in the
    same round (common.paired_median); "" where the rounds are not recorded."""
    p = paired_median(results.get((name, mode, variant, "rounds")),
                      [results[(name, mode, v, "rounds")] for v in others if (name, mode, v, "rounds") in results])
    return f" (paired {p:.2f})" if p else ""


def report(header, results, rows, modes, variants) -> list[str]:
    """The header, the ViT's source where a ViT row ran, and the table of the rows in ``results``."""
    lines = [header, ""]
    if any(ROWS[r][0] == "vit" for r in rows):
        lines.append(f"ViT: {getattr(vit, 'source', '?')}")
    return lines + [""] + table(results, rows, modes, variants)


def worker_argv(args, name, mode, prefix, variants=None) -> list[str]:
    """One row and mode's command line for --parallel (``prefix``: its run_waves files), or with
    ``prefix`` None a ``--rounds 0`` run of ``variants`` (the pre-pass)."""
    argv = [sys.executable, os.path.abspath(__file__), "--layers", str(args.layers), "--rows", name, "--modes", mode,
            "--variants", ",".join(variants or args.variants.split(",")), "--steps", str(args.steps), "--rounds",
            str(args.rounds if prefix else 0), "--profile", str(args.profile if prefix else 0), "--no-overhead",
            "--min-run-ms", str(args.min_run_ms), "--min-timing-s", str(args.min_timing_s)]
    return argv + (["--worker", prefix] if prefix else [])


def run_worker(args, variants) -> None:
    """--parallel's row: build every variant, wait for the turn, time, write the results as JSON."""
    results = {}

    def turn():
        wait_for_turn(args.worker, torch.cuda.memory_reserved() / 2**30)

    run_row(args.rows, args.modes, variants, args.layers, args.steps, args.rounds, results,
            lambda s: print(s, flush=True), args.profile, before_timing=turn, min_run_s=args.min_run_ms / 1e3,
            min_timing_s=args.min_timing_s)
    if hasattr(vit, "source"):  # the parent's report names the ViT's source
        results[("vit-source",)] = vit.source
    with open(args.worker + ".json", "w") as f:
        json.dump([[list(key), value] for key, value in results.items()], f)


def run_parallel(args, rows, modes, variants, report_partial) -> dict:
    """--parallel N: a process per row and mode (default mode first), built N at a time and timed
    one at a time (common.run_waves), after a --prepass of every (row, mode, variant) alone."""
    order = [(name, mode) for mode in modes for name in rows]
    t0 = time.perf_counter()
    deadline = t0 + args.deadline if args.deadline else float("inf")
    if args.prepass:
        prepass([worker_argv(args, name, mode, None, [v]) for name, mode in order for v in variants], args.prepass,
                min(deadline, t0 + args.prepass_limit))
    results = {}

    def progress(done):
        for row in done.values():
            results.update((tuple(key), value) for key, value in (row if isinstance(row, list) else []))
        if ("vit-source",) in results:
            vit.source = results.pop(("vit-source",))
        report_partial(results)

    done = run_waves(order, lambda row, prefix: worker_argv(args, *row, prefix), args.parallel, deadline,
                     lambda row, why: [[[*row, v], why] for v in variants], progress)
    progress(done)
    return results


def main(argv=None):
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="Llama layers (default 12)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run (at least)")
    parser.add_argument("--min-run-ms", type=float, default=50, metavar="MS",
                        help="more steps per run in a row whose fastest variant runs --steps in less "
                             "(run_steps; 0: always --steps)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved timed runs per variant (0: only compile and warm up, which "
                             "fills the compile caches for a later timed run)")
    parser.add_argument("--min-timing-s", type=float, default=3.0, metavar="S",
                        help=f"more rounds (at most {MAX_ROUNDS}) in a row whose --rounds would time for "
                             "less than S seconds (run_rounds; 0: always --rounds)")
    parser.add_argument("--no-overhead", action="store_true", help="skip the host-time table")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed rounds, profile N steps of each variant (see above)")
    parser.add_argument("--parallel", type=int, default=0, metavar="N",
                        help="a process per row and mode, N building at once, timed one at a time")
    parser.add_argument("--prepass", type=int, default=0, metavar="N",
                        help="--parallel: first compile every (row, mode, variant) alone, N at a time")
    parser.add_argument("--prepass-limit", type=float, default=240, metavar="S")
    parser.add_argument("--deadline", type=float, default=0, metavar="S",
                        help="--parallel: rows not done S seconds after the start are reported as such")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # --parallel's rows: a file prefix
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    modes, variants = args.modes.split(","), args.variants.split(",")
    if any(v not in ALL_VARIANTS for v in variants):
        parser.error(f"unknown variants in {variants}; known: {list(ALL_VARIANTS)}")
    more = ([f"at least {args.min_run_ms:g} ms a run"] if args.min_run_ms else []) + (
        [f"{args.min_timing_s:g} s of runs a row, up to {MAX_ROUNDS} rounds"] if args.min_timing_s else [])
    header = (f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers "
              f"{transformers.__version__} | {time.strftime('%Y-%m-%d')} | bf16 (rows -fp32-: "
              f"fp32, -amp-: fp32 weights + bf16 autocast) | Llama {args.layers} layers | median (best) of "
              f"{args.rounds} interleaved runs of {args.steps} steps"
              + (" (or more: " + ", ".join(more) + "; the log gives each row's)" if more else ""))
    if args.worker:
        return run_worker(args, variants)
    print(header, flush=True)
    results = {}
    t_start = time.perf_counter()
    if args.parallel:
        results = run_parallel(args, rows, modes, variants, lambda res: emit(
            report(header, res, rows, modes, variants) + ["", "(partial)"], args.out, quiet=True) if args.out else None)
    for name in rows if not args.parallel else ():
        for mode in modes:
            run_row(name, mode, variants, args.layers, args.steps, args.rounds, results,
                    lambda s: print(s, flush=True), args.profile, min_run_s=args.min_run_ms / 1e3,
                    min_timing_s=args.min_timing_s)
            _free()  # the row's models and compiled graphs are gone once run_row returns
            if args.out and args.rounds:  # the rows so far, should the run be cut short
                emit(report(header, results, rows, modes, variants) + ["", "(partial)"], args.out, quiet=True)
    if args.rounds == 0:
        return
    lines = report(header, results, rows, modes, variants)
    lines.append(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    if not args.no_overhead:
        import overhead

        lines += ["", "host µs per op call (compiled, tiny inputs; best of 3 runs):", ""]
        lines += [f"| {name} | {us:.1f} |" for name, us in overhead.compiled_rows()]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
