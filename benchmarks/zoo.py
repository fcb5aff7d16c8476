"""The timm zoo with its hand-written attention: the plugin against stock compile and timm's fused path.

    python benchmarks/zoo.py [--models vit_s16,swin_t,...] [--tasks infer,train]
                             [--modes default,reduce-overhead] [--variants compile,fused+compile,plugin]
                             [--batch 64] [--steps 10] [--rounds 5] [--parallel N] [--deadline S]
                             [--out FILE.md] [--json FILE.json] [--profile N]
    python benchmarks/zoo.py --merge a.json,b.json [--out FILE.md] [--json FILE.json]
    python benchmarks/zoo.py --cpu --tiny [--models tiny]     # a CPU smoke run: NOT a benchmark

Models (timm, random weights, ``num_classes=1000``, bf16 weights on the GPU, 224 px, batch 64):
ViT-S/16, DeiT-III-S, EVA-02-Ti, Swin-T, BEiT-B, PVTv2-b0, LeViT-128S, XCiT-nano, Twins-SVT-S,
CaiT-XXS24 (MODELS below: short name -> timm name). Every module with a ``fused_attn`` attribute
(timm sets it at construction from ``use_fused_attn()``; Swin's WindowAttention and XCiT's XCA
take the "experimental" default, off) is switched off for the hand-written variants and on for
``fused+compile``. Where a model has no such module (LeViT) ``fused+compile`` would be
``compile`` again: it is not built, and the table says ``= compile (no fused path)``. The
``fused path`` column lists the modules that have one (CaiT: only its 2 class-attention layers,
not the 24 talking-heads ones).

Rows: model x task (``infer``: a forward under no_grad in eval mode; ``train``: forward,
cross-entropy on random labels, backward and a fused AdamW step, as shapes.py's make_step) x mode
(``default``, ``reduce-overhead`` = CUDA graphs). Variants: ``compile`` = hand-written attention +
stock torch.compile (the plugin kept off while it compiles and runs, ``fuse_plugin.disabled()``);
``fused+compile`` = timm's fused path (F.scaled_dot_product_attention) + stock torch.compile;
``plugin`` = hand-written attention + torch.compile(backend="fuse_plugin"); optional ``eager`` =
hand-written attention, no compile; optional ``plugin-fused`` = timm's fused path compiled with the
plugin (its SDPA call sites weighed by the choice, issue 30), with its own ratio over the same best.
``BASE@SWITCH=value`` (e.g. ``plugin-fused@ROTARY_SITES=ours``): variant BASE compiled with
``FUSE_PLUGIN_<SWITCH>=value`` (docs/SETTINGS.md), a column of its own beside BASE's (its own
graph: Dynamo's cache is keyed on the plugin's switches, fuse_plugin/dynamo_cache.py). Method as shapes.py: every variant of a row is built in one
process (its own model, seeded alike, compiled with 3 warm-up steps), then ``--rounds`` rounds in
which the variants take turns (each round starting one variant later, common.round_order), each
running ``--steps`` steps synchronised once (after ``--warm-steps`` untimed ones, timed_round), the
garbage collector off inside a timed run; a cell
is the median of its rounds in images/s (best in brackets), ``plugin / best`` the plugin's median
over the better of compile and fused+compile, and in brackets the paired ratio (``paired_ratio``:
the median over rounds of the plugin against the faster stock run of the same round; host noise
that moves a whole round moves both sides of each of its ratios).

Per row also: ``attn fused / left`` = the attention sites the plugin's rewrite fused and those it
matched but left to Inductor by its per-shape choice (``counters["fuse_plugin"]["attention"]`` and
``["attention_left"]`` over the plugin variant's compile; 0 where a key is absent), with "(N as SDPA)"
where the choice made N of the fused ones SDPA calls (``["attention_as_sdpa"]``); parity = the
plugin's logits of its first warm-up step against the eager hand-written model's, same weights,
same dtype (max |diff|, and that over max |eager logit|; printed, never a failure); ``graphs`` =
Dynamo graphs compiled per variant, in column order (more than 1: a graph break or a recompile);
``recompiles`` = graphs compiled during the timed rounds (must be 0); each variant's build logs its
CUDA-graph skips (``counters["inductor"]["cudagraph_skips"]``: a graph that reduce-overhead runs
without CUDA graphs, every kernel issued by the host; in the JSON too). The JSON (``--json``) has
every number: each variant's rounds (wall, and the host's issue time before each round's sync: a
row whose two are close is host-bound; printed per row in the log), compile seconds, parity; each
row's build wall and CPU seconds, timing seconds, peak GPU memory reserved.

Models for parity: stochastic depth and dropout off (Swin's default drop_path_rate 0.1 made a
training row's logits random) and every layer-scale gamma 1 (timm inits them to 1e-5 in CaiT,
1e-6 in DeiT-III: in bf16 each block's output then vanishes next to the residual, and the logits
did not depend on the attention at all). Both change weights, not the work a step does. Before
an inference variant compiles, one eager forward fills what a model caches on its first eval call
(LeViT's attention biases; made inside a CUDA graph, the next replay overwrote them).

``--parallel N``: a process per row, rows in waves of at most N processes; a wave's rows build
(compile and warm up) at once, then time one at a time, the others idle (no compile on the host or
work on the GPU while a row times), each exiting after its turn (freeing its memory) before the
next wave starts. Rows go default mode first, inference first (a reduce-overhead wave then finds
the Triton kernels of the same graphs in the cache). Each worker gets TORCHINDUCTOR_COMPILE_THREADS
and OMP_NUM_THREADS = cores / N unless set: the parallelism is the processes' (20 workers of 16
threads each kept the load at 100-140 on 16 cores). The thread count stays for the timing: the
steps run on the GPU, and changing it after the compile fails Dynamo's global-state guard (every
variant recompiled in its first timed run). ``--deadline S``: rows not built or timed S seconds
after the start are reported as such and their processes ended, so that a table always comes out
inside a device command's limit; ``--out``/``--json`` are rewritten after every row. ``--rounds 0``
compiles and warms up only (fills Inductor's and Triton's caches). ``--merge`` prints one table
from several ``--json`` files (a row given again, a rerun of rows a deadline cut, replaces the
earlier one).

Time plan: add ``--prepass N`` (common.prepass): every (row, variant) compiles alone first, N at a
time, so a row's three compiles no longer run in series (the critical path was Twins-SVT-S
training, ~120 s a compile), and the rows then build from Inductor's and Triton's caches. On a
machine of several GPUs (common.run_waves) the builds spread over them and their cores, and each
row still times alone. Measured (stop 36, an nvidia-h200-x2 machine: 2 GPUs, 32 cores, cold
caches): ``--modes default --parallel 20 --prepass 32 --prepass-limit 200`` built the 20 rows in
200 + 237 s and timed them in ~115 s; ``--modes reduce-overhead`` right after it on the same machine
took 155 + 39 + 75 s. Without the pre-pass, on an H100 host of 16 cores, the 20 default-mode rows
built in 362 s (20 processes at once, the GPU at most 38 GB) and a whole mode did not fit one
command (stop 27).

``--cpu --tiny``: the CPU in fp32, batch 2, 1 round of 1 step, default mode; ``--models tiny`` is a
two-block plain-torch ViT written like timm's Attention (32 px, no timm needed). A check that the
script runs, never a number to report.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from common import (emit, kernel_diff, paired_median, prepass, profile_steps, room_for_compiles, round_order,
                    run_waves, switch_of, timed_run, wait_for_turn)
from torch import nn

VARIANTS = ("compile", "fused+compile", "plugin")
ALL_VARIANTS = ("eager",) + VARIANTS + ("plugin-fused",)
# plugin-fused (named in --variants): timm's fused path (its F.sdpa call sites) compiled with the plugin,
# issue 30's "ViT-S / EVA-02 on their fused path" rows; its ratio is against the same best of STOCK.
PLUGIN = ("plugin", "plugin-fused")  # the variants compiled with backend="fuse_plugin"
STOCK = ("compile", "fused+compile")  # the plugin's ratio is against the better of these
TASKS = ("infer", "train")
MODES = ("default", "reduce-overhead")
# short name -> timm model name (checked against timm.list_models() of timm 1.0.31)
MODELS = {
    "vit_s16": "vit_small_patch16_224",
    "deit3_s": "deit3_small_patch16_224",
    "eva02_ti": "eva02_tiny_patch14_224",
    "swin_t": "swin_tiny_patch4_window7_224",
    "beit_b": "beit_base_patch16_224",
    "pvt_v2_b0": "pvt_v2_b0",
    "levit_128s": "levit_128s",
    "xcit_nano": "xcit_nano_12_p16_224",
    "twins_svt_s": "twins_svt_small",
    "cait_xxs24": "cait_xxs24_224",
}
TINY = "tiny"  # the plain-torch stand-in (smoke runs and tests; not part of the zoo)


def _plugin():
    """fuse_plugin, imported when first needed (a worker timing only `eager` starts faster)."""
    import fuse_plugin

    return fuse_plugin


def _counters():
    from torch._dynamo.utils import counters

    return counters


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class _TinyAttention(nn.Module):
    """timm's Attention in small: ``fused_attn`` picks F.sdpa or q * scale, q @ kᵀ, softmax, @ v
    (``fused_path=False``: no such attribute, the hand-written path only, as LeViT's)."""

    def __init__(self, dim, heads, fused_path=True):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        if fused_path:
            self.fused_attn = False
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if getattr(self, "fused_attn", False):
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            x = attn @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class _TinyBlock(nn.Module):
    def __init__(self, dim, heads, fused_path):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), _TinyAttention(dim, heads, fused_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """The ``tiny`` stand-in: 32 px, patch 8 (17 tokens), dim 64, 2 blocks of 2 heads, 10 classes."""

    input_size = (3, 32, 32)
    num_classes = 10

    def __init__(self, dim=64, depth=2, heads=2, fused_path=True):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, 8)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.Sequential(*[_TinyBlock(dim, heads, fused_path) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, self.num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1)
        return self.head(self.norm(self.blocks(x))[:, 0])


def create(name: str) -> nn.Module:
    """The model `name` (a MODELS key, a timm name, or ``tiny``) in fp32 on the CPU, seeded; no
    stochastic depth or dropout, layer-scale gammas 1 (module doc: Parity)."""
    torch.manual_seed(0)
    if name == TINY:
        return TinyViT()
    import timm

    model = timm.create_model(MODELS.get(name, name), pretrained=False, num_classes=1000, drop_rate=0.0,
                              drop_path_rate=0.0)
    return unit_layer_scale(model)


def unit_layer_scale(model: nn.Module) -> nn.Module:
    """Every layer-scale gamma (``gamma``, ``gamma_1``, ``gamma2``, ...) set to 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"(^|\.)gamma(_?\d)?$", name):
                p.fill_(1.0)
    return model


def set_fused_attn(model: nn.Module, flag: bool) -> dict[str, int]:
    """Set ``fused_attn`` on every module that has it; return {class name: count} of those."""
    found: dict[str, int] = {}
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = flag
            found[type(m).__name__] = found.get(type(m).__name__, 0) + 1
    return found


def input_size(model: nn.Module) -> tuple[int, int, int]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return tuple(cfg.get("input_size", getattr(model, "input_size", (3, 224, 224))))


def num_classes(model: nn.Module) -> int:
    return int(getattr(model, "num_classes", 1000))


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def resolve_models(spec: str) -> list[str]:
    """`--models`: comma-separated MODELS keys or timm names (mapped to their key), or ``tiny``."""
    by_timm = {v: k for k, v in MODELS.items()}
    out = []
    for name in (s for s in spec.split(",") if s):
        if name in MODELS or name == TINY:
            out.append(name)
        elif name in by_timm:
            out.append(by_timm[name])
        else:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or their timm names), {TINY}")
    return out


def rows_of(models, tasks, modes) -> list[tuple[str, str, str]]:
    """Every (model, task, mode), in the order of the table: model, then task, then mode."""
    return [(m, t, mode) for m in models for t in tasks for mode in modes]


def build_order(rows) -> list[tuple[str, str, str]]:
    """The order ``--parallel`` builds and times rows in: default mode first (its compiles put the
    Triton kernels in the cache for reduce-overhead's), inference before training, then the
    table's order."""
    return sorted(rows, key=lambda r: (MODES.index(r[2]) if r[2] in MODES else len(MODES),
                                       TASKS.index(r[1]) if r[1] in TASKS else len(TASKS), rows.index(r)))


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


def logits_of(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def make_step(fn, task, images, labels, opt, cudagraphs):
    """A step of `task` (shapes.py's make_step); ``step(capture=True)`` also returns a copy of the
    logits (CUDA-graph outputs are overwritten by the next replay)."""
    def forward():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return logits_of(fn(images))

    if task == "infer":
        def step(capture=False):
            with torch.no_grad():
                logits = forward()
                return logits.detach().clone() if capture else None
        return step

    def step(capture=False):
        logits = forward()
        kept = logits.detach().clone() if capture else None
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return kept
    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def base(variant: str) -> str:
    """The variant a ``BASE@SWITCH=value`` spelling runs (module doc), e.g. ``plugin-fused``."""
    return variant.split("@", 1)[0]


def _known_switch(variant: str) -> bool:
    """A ``BASE@SWITCH=value`` variant names one of settings.py's switches."""
    from fuse_plugin import settings

    name = "FUSE_PLUGIN_" + variant.split("@", 1)[1].partition("=")[0].upper()
    return "=" in variant and name in vars(settings).values()


def _variant_context(variant):
    """The plugin off for every variant but ``plugin`` (the automatic patch would rewrite them)."""
    return contextlib.nullcontext() if base(variant) in PLUGIN + ("eager",) else _plugin().disabled()


def parity(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max |out - ref| and that over max |ref| (fp32 arithmetic)."""
    diff = (out.float() - ref.float()).abs().max().item()
    return {"max_abs": diff, "rel": diff / max(ref.float().abs().max().item(), 1e-30)}


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (compile workers, ptxas)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def graphs_compiled() -> int:
    if "torch._dynamo" not in sys.modules:  # nothing compiled here (eager only): no 2 s import
        return 0
    return _counters()["stats"]["unique_graphs"]


def _as_sdpa(plugin: dict) -> str:
    """" (N as SDPA)" where the choice made N of the fused sites SDPA calls, else ""."""
    n = plugin.get("attention_as_sdpa", 0)
    return f" ({n} as SDPA)" if n else ""


def cudagraph_skips() -> int:
    """Graphs Inductor compiled for CUDA graphs but ran without them (a CPU tensor, a mutation...):
    such a variant under reduce-overhead issues every kernel from the host."""
    if "torch._dynamo" not in sys.modules:
        return 0
    return int(_counters()["inductor"]["cudagraph_skips"])


def log_kernel_diffs(kernels: dict, title: str, log) -> None:
    """--profile: each profiled variant's GPU kernels against the stock reference's (timm's fused
    path where the row has one, else stock compile): what a route adds to or saves from a step."""
    ref = next((v for v in ("fused+compile", "compile") if v in kernels), None)
    for variant, ks in kernels.items() if ref else ():
        if variant != ref:
            log(kernel_diff(kernels[ref], ks, f"{title} {variant} - {ref}"))


def plugin_counts() -> dict[str, int]:
    c = _counters()["fuse_plugin"]
    return {k: int(c.get(k, 0)) for k in ("attention", "attention_as_sdpa", "attention_left", "rotary", "sdpa",
                                          "sdpa_left")}


# --------------------------------------------------------------------------------------------
# One row
# --------------------------------------------------------------------------------------------


def build_variant(model_name, variant, task, mode, images, labels, ref, args):
    """One variant of a row: its model (seeded like the others), compile, 3 warm-up steps; returns
    (step, kept objects, cell dict with compile seconds, graphs, parity and plugin counts)."""
    t0 = time.perf_counter()
    variant, spelled = base(variant), variant
    model = create(model_name)
    set_fused_attn(model, variant in ("fused+compile", "plugin-fused"))
    model = model.to(device=args.device, dtype=args.dtype).train(task == "train")
    if task == "infer":  # what a model caches on its first eval call (LeViT's attention biases) is
        with torch.no_grad():  # made here, not inside a CUDA graph whose next replay overwrites it
            model(images)
    if variant == "eager":
        fn = model
    else:
        kwargs = dict(mode=None if mode == "default" else mode, dynamic=False)
        backend = "fuse_plugin" if variant in PLUGIN else "inductor"
        if variant in PLUGIN:
            _plugin()  # registers the backend name where no entry point declares it
        fn = torch.compile(model, backend=backend, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True) if task == "train" else None
    step = make_step(fn, task, images, labels, opt, mode == "reduce-overhead" and variant != "eager")
    graphs, counts, skips = graphs_compiled(), plugin_counts() if variant in PLUGIN else None, cudagraph_skips()
    with _variant_context(variant), switch_of(spelled):
        logits = step(capture=True)  # compiles; its logits are of the weights `ref` saw
        for _ in range(2):  # CUDA graphs record on the 2nd/3rd call
            step()
    sync(args.device)
    cell = {"compile_s": time.perf_counter() - t0, "graphs": graphs_compiled() - graphs,
            "cudagraph_skips": cudagraph_skips() - skips, **parity(logits, ref)}
    if variant in PLUGIN:
        after = plugin_counts()
        cell.update({k: after[k] - counts[k] for k in counts})
    return step, (model, fn, opt), cell


def reference(model_name, task, args):
    """The row's inputs (seeded images of the model's input size, labels) and the hand-written
    model's logits, eager, before any step changed its weights; also the modules with a fused path."""
    model = create(model_name)
    fused_path = set_fused_attn(model, False)
    model = model.to(device=args.device, dtype=args.dtype).train(task == "train")
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, *input_size(model), generator=g).to(device=args.device, dtype=args.dtype)
    labels = torch.randint(0, num_classes(model), (args.batch,), generator=g).to(args.device)
    with torch.no_grad():
        ref = logits_of(model(images)).detach().clone()
    return images, labels, ref, fused_path


def run_row(model_name, task, mode, args, log, before_timing=lambda: None) -> dict:
    """One row in one mode (module doc): every variant built in this process, then the interleaved
    timed rounds. Returns the row's dict (the JSON's); errors are reported in it, never raised."""
    row = {"model": model_name, "timm": MODELS.get(model_name, model_name), "task": task, "mode": mode,
           "batch": args.batch, "variants": {}}
    t0 = time.perf_counter()
    try:
        images, labels, ref, row["fused_path"] = reference(model_name, task, args)
    except Exception as e:  # the model does not build (timm version, name): the row says so
        import traceback

        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        log(f"  {model_name} {task} {mode}: {row['error']}")
        before_timing()
        return row
    steps = {}
    for variant in args.variants:
        if base(variant) in ("fused+compile", "plugin-fused") and not row["fused_path"]:
            same = "compile" if base(variant) == "fused+compile" else "plugin"
            row["variants"][variant] = {"same_as": same, "why": "no fused path"}
            continue
        try:
            step, kept, cell = build_variant(model_name, variant, task, mode, images, labels, ref, args)
            steps[variant] = (step, kept)
            row["variants"][variant] = cell
            log(f"  built {model_name} {task} {mode} {variant} in {cell['compile_s']:.0f} s: {cell['graphs']} "
                f"graph(s), {cell['cudagraph_skips']} CUDA-graph skip(s), parity {cell['max_abs']:.2e} "
                f"({cell['rel']:.1e})"
                + (f", attention fused {cell['attention']} left {cell['attention_left']} rotary {cell['rotary']}"
                   if base(variant) in PLUGIN else ""))
        except Exception as e:  # reported in the table, the other variants still run
            import traceback

            traceback.print_exc()
            oom = isinstance(e, torch.OutOfMemoryError)
            row["variants"][variant] = {"error": "OOM" if oom else type(e).__name__}
            log(f"  {model_name} {task} {mode} {variant}: {row['variants'][variant]['error']}")
        if args.device == "cuda":
            torch.cuda.empty_cache()  # an idle row holds its models, not its activations
    row["build_s"], row["build_cpu_s"] = time.perf_counter() - t0, cpu_seconds()
    if args.device == "cuda":
        row["reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    before_timing()
    if args.rounds == 0:
        return row
    # The models and compiled graphs live until the end: frozen, the collections between timed
    # runs (shapes.py's method) walk only what the rounds allocate, not every object of the process.
    gc.collect()
    gc.freeze()
    times, issued = {v: [] for v in steps}, {v: [] for v in steps}
    graphs, t1 = graphs_compiled(), time.perf_counter()
    for i in range(args.rounds):
        for variant in round_order(list(steps), i):
            with _variant_context(variant):
                times[variant].append(timed_round(steps[variant][0], args, issued[variant]))
    row["recompiles"], row["timing_s"] = graphs_compiled() - graphs, time.perf_counter() - t1
    for variant, rounds in times.items():
        ts, cell = sorted(rounds), row["variants"][variant]
        cell["rounds_s"] = rounds  # in the order they ran (the host's drift shows in it)
        cell["issue_s"] = issued[variant]  # each round's host issue time (common.timed_run)
        cell["img_s"] = args.batch * args.steps / ts[len(ts) // 2]
        cell["best_img_s"] = args.batch * args.steps / ts[0]
    gc.unfreeze()
    row["plugin_vs_best"], row["plugin_vs_best_paired"] = ratio(row), paired_ratio(row)
    if "plugin-fused" in times:
        row["plugin_fused_vs_best"] = ratio(row, "plugin-fused")
        row["plugin_fused_vs_best_paired"] = paired_ratio(row, "plugin-fused")
    kernels = {}  # variant -> {kernel: (us, count) per step}, for the diffs below
    for variant, (step, _kept) in steps.items() if args.profile and args.device == "cuda" else ():
        with _variant_context(variant):
            title = f"{model_name} {task} {mode} {variant}"
            row["variants"][variant]["profile"] = profile_steps(step, args.profile, title,
                                                                kernels_out=kernels.setdefault(variant, {}))
        log(row["variants"][variant]["profile"])
    log_kernel_diffs(kernels, f"{model_name} {task} {mode}", log)
    log(f"  {model_name} {task} {mode}, ms a step, host issue / wall (medians): " + "  ".join(
        f"{v} {issue_ms(row, v, args.steps)}" for v in times))
    log(f"  {model_name} {task} {mode}: " + "  ".join(f"{v} {fmt_cell(row, v)}" for v in row["variants"])
        + f"  plugin/best {row['plugin_vs_best'] or '-'}  (build {row['build_s']:.0f} s, total "
        f"{time.perf_counter() - t0:.0f} s)")
    del steps
    return row


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def timed_round(step, args, issued: list) -> float:
    """One variant's turn in a round: ``--warm-steps`` untimed steps and a sync, then
    ``--steps`` timed ones (common.timed_run). The first steps after another variant's turn run
    slower on a host-bound row (two-step rounds timed cait_xxs24 and xcit_nano training at
    0.59-0.73 of their ten-step speed, every variant alike, H100, stop 54): warm steps keep rounds
    short and many (paired finer) and still time the steady state a training run sees."""
    for _ in range(args.warm_steps):
        step()
    if args.warm_steps:
        sync(args.device)
    return timed_run(step, args.steps, lambda: sync(args.device), issued)


def issue_ms(row, variant, steps) -> str:
    """``variant``'s median host issue time and median wall time per step, in ms ("a / b"): a
    host-bound cell has the two close (``issue_s`` and ``rounds_s`` of its rounds)."""
    cell = row["variants"][variant]
    med = [sorted(t)[len(t) // 2] * 1e3 / steps for t in (cell.get("issue_s") or [0.0], cell["rounds_s"])]
    return f"{med[0]:.1f} / {med[1]:.1f}"


def img_s(row, variant):
    """The variant's median img/s, following ``same_as``; None where it has none."""
    cell = row.get("variants", {}).get(variant, {})
    if "same_as" in cell:
        cell = row["variants"].get(cell["same_as"], {})
    return cell.get("img_s")


def ratio(row, variant="plugin") -> float | None:
    """``variant`` (plugin or plugin-fused) over the better of compile and fused+compile (medians),
    None where either side is missing."""
    plugin = img_s(row, variant)
    stock = [x for x in (img_s(row, v) for v in STOCK) if x]
    return round(plugin / max(stock), 3) if plugin and stock else None


def paired_ratio(row, variant="plugin") -> float | None:
    """The median over rounds of ``variant``'s speed over the faster stock variant's in the same
    round (``rounds_s``; common.paired_median); ``ratio`` compares medians taken separately.
    None without paired rounds."""
    cells = row.get("variants", {})
    stock = [cells[v]["rounds_s"] for v in STOCK if "rounds_s" in cells.get(v, {})]
    return paired_median(cells.get(variant, {}).get("rounds_s"), stock)


def _ratio_cell(row, variant) -> str:
    r, p = ratio(row, variant), paired_ratio(row, variant)
    return (f"{r:.2f}" if r else "-") + (f" (paired {p:.2f})" if p else "")


def fmt_cell(row, variant) -> str:
    cell = row.get("variants", {}).get(variant)
    if cell is None:
        return "-"
    if "same_as" in cell:
        return f"= {cell['same_as']} ({cell['why']})"
    if "error" in cell:
        return cell["error"]
    if "img_s" not in cell:
        return "built" if "compile_s" in cell else "-"
    return f"{cell['img_s']:.0f} ({cell['best_img_s']:.0f})"


def fmt_path(fused_path) -> str:
    if fused_path is None:
        return "?"
    return ", ".join(f"{k}×{n}" for k, n in fused_path.items()) or "none"


def table(rows, variants) -> list[str]:
    """One line per model x task x mode: images/s per variant (median (best)), the ratio, the
    plugin's sites, parity, graphs and recompiles (module doc)."""
    fused = "plugin-fused" in variants  # its ratio and sites get two more columns
    extra = " plugin-fused / best | plugin-fused SDPA sites ours / left |" if fused else ""
    lines = ["| model | task | mode | fused path | " + " | ".join(variants)
             + " | plugin / best | attn fused / left | plugin parity max abs (rel) | graphs | recompiles |" + extra,
             "|---|---|---|---|" + "---|" * (len(variants) + 5 + 2 * fused)]
    for row in rows:
        head = f"| {row['model']} | {row['task']} | {row['mode']} | {fmt_path(row.get('fused_path'))} | "
        if "error" in row:
            lines.append(head + row["error"] + " |" * (len(variants) + 5 + 2 * fused))
            continue
        cells = [fmt_cell(row, v) for v in variants]
        plugin = row["variants"].get("plugin", {})
        sites = (f"{plugin['attention']}{_as_sdpa(plugin)} / {plugin['attention_left']}" if "attention" in plugin
                 else "-")
        par = f"{plugin['max_abs']:.2e} ({plugin['rel']:.1e})" if "max_abs" in plugin else "-"
        graphs = "/".join(str(row["variants"][v].get("graphs", "-")) for v in variants if v in row["variants"])
        line = (head + " | ".join(cells) + f" | {_ratio_cell(row, 'plugin')} | {sites} | {par} | {graphs} | "
                f"{row.get('recompiles', '-')} |")
        if fused:
            pf = row["variants"].get("plugin-fused", {})
            pf_sites = f"{pf['sdpa']} / {pf['sdpa_left']}" if "sdpa" in pf else "-"  # its SDPA call sites
            line += f" {_ratio_cell(row, 'plugin-fused')} | {pf_sites} |"
        lines.append(line)
    return lines


def write_outputs(header, rows, variants, args, quiet=True, footer=()):
    emit([header, ""] + table(rows, variants) + list(footer), args.out, quiet=quiet)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "variants": list(variants), "rows": rows}, f, indent=1)


# --------------------------------------------------------------------------------------------
# --parallel
# --------------------------------------------------------------------------------------------


def worker_argv(args, row, prefix, variants=None) -> list[str]:
    """The command line of one row's worker (``prefix``: run_waves'), or with ``prefix`` None of a
    ``--rounds 0`` run of ``variants`` (the pre-pass)."""
    model, task, mode = row
    argv = [sys.executable, os.path.abspath(__file__), "--models", model, "--tasks", task, "--modes", mode,
            "--variants", ",".join(variants or args.variants), "--batch", str(args.batch), "--steps",
            str(args.steps), "--warm-steps", str(args.warm_steps), "--rounds", str(args.rounds if prefix else 0),
            "--profile", str(args.profile if prefix else 0)]
    return argv + (["--worker", prefix] if prefix else []) + (["--cpu"] if args.device == "cpu" else [])


def run_worker(args) -> None:
    """One row of ``--parallel``: build, wait for its turn (common.wait_for_turn), time, write the
    row to ``<prefix>.json``."""
    (model, task, mode), = rows_of(args.models, args.tasks, args.modes)

    def turn():
        wait_for_turn(args.worker, torch.cuda.memory_reserved() / 2**30 if args.device == "cuda" else 0.0)

    row = run_row(model, task, mode, args, lambda s: print(s, flush=True), before_timing=turn)
    with open(args.worker + ".json", "w") as f:
        json.dump(row, f)


def run_parallel(args, header, t_start) -> list[dict]:
    """``--parallel N`` (module doc): common.run_waves over the rows in build_order."""
    rows = rows_of(args.models, args.tasks, args.modes)

    def missing(row, why):
        return {"model": row[0], "task": row[1], "mode": row[2], "variants": {}, "error": why}

    def progress(done):
        write_outputs(header, [done[r] for r in rows if r in done], args.variants, args, footer=["", "(partial)"])

    if args.prepass:  # every (row, variant) compiled alone first: the rows then build from the caches
        cells = [(row, v) for row in build_order(rows) for v in args.variants]
        prepass([worker_argv(args, row, None, [v]) for row, v in cells], args.prepass,
                time.perf_counter() + args.prepass_limit)
    done = run_waves(build_order(rows), lambda row, prefix: worker_argv(args, row, prefix), args.parallel,
                     t_start + args.deadline if args.deadline else float("inf"), missing, progress)
    return [done[r] for r in rows]


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="MODELS keys or timm names, or tiny")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(ALL_VARIANTS)}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--warm-steps", type=int, default=0, metavar="N",
                        help="untimed steps before each timed run (timed_round)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved timed runs per variant (0: compile and warm up only)")
    parser.add_argument("--prepass", type=int, default=0, metavar="N",
                        help="--parallel: first compile every (row, variant) alone, N processes at a time")
    parser.add_argument("--prepass-limit", type=float, default=240, metavar="S",
                        help="--prepass: end the pre-pass after S seconds")
    parser.add_argument("--parallel", type=int, default=0, metavar="N",
                        help="a process per row, at most N at once (module doc)")
    parser.add_argument("--deadline", type=float, default=0, metavar="S",
                        help="--parallel: report rows not done S seconds after the start as such")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU in fp32 (a smoke run)")
    parser.add_argument("--tiny", action="store_true",
                        help="batch 2, 1 round of 1 step, default mode (a smoke run, not a benchmark)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after a row's timed rounds, profile N steps of each variant (shapes.py's "
                        "--profile: host issue time, GPU time, top kernels; printed and in the JSON), then "
                        "log each variant's kernels that differ from the fused path's (or compile's)")
    parser.add_argument("--out", default=None, help="the markdown table")
    parser.add_argument("--json", default=None, help="every number, machine-readable")
    parser.add_argument("--merge", default=None, help="comma-separated --json files: print their rows' table")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # --parallel's rows: a file prefix
    args = parser.parse_args(argv)
    if args.tiny:
        defaults = parser.parse_args([])
        for key, value in (("batch", 2), ("steps", 1), ("rounds", 1), ("modes", "default")):
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    try:
        args.models = resolve_models(args.models)
    except ValueError as e:
        parser.error(str(e))
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    for what, given, known in (("tasks", args.tasks, TASKS), ("modes", args.modes, MODES),
                               ("variants", args.variants, ALL_VARIANTS)):
        unknown = [x for x in given if (base(x) if what == "variants" else x) not in known
                   or (what == "variants" and "@" in x and not _known_switch(x))]
        if unknown:
            parser.error(f"unknown {what} {unknown}; known: {list(known)}")
    args.device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    return args


def merge(paths: list[str]) -> tuple[str, list[str], list[dict]]:
    """The headers, variants and rows of several --json files; a row given again (a rerun of rows
    a --deadline cut) replaces the earlier one in its place."""
    headers, variants, rows = [], [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        headers.append(data["header"])
        variants += [v for v in data["variants"] if v not in variants]
        rows.update({(row["model"], row["task"], row["mode"]): row for row in data["rows"]})
    return "\n".join(dict.fromkeys(headers)), variants, list(rows.values())


def header_of(args) -> str:
    try:
        import timm

        timm_version = timm.__version__
    except ImportError:
        timm_version = "not installed"
    where = (f"{torch.cuda.get_device_name()} | bf16" if args.device == "cuda"
             else "CPU | fp32 | a smoke run, NOT a benchmark")
    return (f"{where} | torch {torch.__version__} | timm {timm_version} | {time.strftime('%Y-%m-%d')} | batch "
            f"{args.batch} | img/s, median (best) of {args.rounds} interleaved runs of {args.steps} steps"
            + (f" after {args.warm_steps} untimed" if args.warm_steps else ""))


def main(argv=None):
    args = parse(argv)
    if args.merge:
        header, variants, rows = merge([p for p in args.merge.split(",") if p])
        write_outputs(header, rows, variants, args, quiet=False)
        return
    if args.variants != ["eager"]:
        # every variant compiles the same code objects (one per model class): room for all of them
        room_for_compiles()
    if args.worker:
        return run_worker(args)
    header = header_of(args)
    print(header, flush=True)
    t_start = time.perf_counter()
    if args.parallel:
        rows = run_parallel(args, header, t_start)
    else:
        rows = []
        for model, task, mode in rows_of(args.models, args.tasks, args.modes):
            rows.append(run_row(model, task, mode, args, lambda s: print(s, flush=True)))
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
            with contextlib.suppress(Exception):
                torch._inductor.cudagraph_trees.reset_cudagraph_trees()
            if args.rounds:
                write_outputs(header, rows, args.variants, args, footer=["", "(partial)"])
    if args.rounds == 0:
        print(f"compiled and warmed up only (--rounds 0), {time.perf_counter() - t_start:.0f} s")
        return
    write_outputs(header, rows, args.variants, args, quiet=False,
                  footer=[f"\n(total {time.perf_counter() - t_start:.0f} s)"])


if __name__ == "__main__":
    main()
