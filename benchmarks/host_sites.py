"""Host time per attention site, without the profiler (issue 28; NOTES attempt 60).

    python benchmarks/host_sites.py [--sites 8,32] [--tasks infer,train] [--rounds 30] [--steps 2]
                                    [--variants compile,plugin,plugin@SITE_CHOICE=inductor]

A stack of ``N`` blocks, each a linear q/k/v projection, a hand-written attention (timm's
spelling: ``(q * scale) @ kᵀ``, softmax, ``@ v``) and an output projection, at a Twins-SVT-S
window's shape (L 49, D 32, 2 heads) and a batch small enough that a step is bound by the host;
``--tokens 3136 --kv-tokens 49``: its global sub-sampled attention's shape instead (queries from
every token, keys and values from 49).
Every variant is built in this process and timed in interleaved rounds (common.round_order); a
round's time is the host's issue time of ``--steps`` steps, measured before the sync
(common.timed_run's ``issued``), and its wall time.

The slope over ``N`` is the host cost one site adds: ``(plugin - compile) / N`` at two values of
``N`` says whether our sites cost the host more than the decomposition stock compile runs, apart
from the model around them (twins_svt_s training read 53.1 ms a step against stock's 50.8 with
fewer launches, stop 43). ``plugin`` is what a user gets (the measured choice may leave a site to
Inductor), ``plugin@SITE_CHOICE=ours`` every site our op, ``plugin@SITE_CHOICE=inductor`` every
site left as written: the backend's own cost with none of our kernels. ``BASE@SWITCH=value`` sets
``FUSE_PLUGIN_<SWITCH>`` while that variant compiles (zoo.py's spelling).

Prints one table: per task and ``N``, each variant's median issue and wall µs a step and, for the
plugin variants, the sites fused and the issue µs a site over stock compile.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import common  # (also puts this tree's fuse_plugin on sys.path)
import torch
from common import room_for_compiles, switch_of
from torch import nn

import fuse_plugin

VARIANTS = ("compile", "plugin", "plugin@SITE_CHOICE=ours", "plugin@SITE_CHOICE=inductor")


class Block(nn.Module):
    """One attention site as timm's hand-written Attention spells it, with its projections.

    ``kv_tokens`` (fewer than the input's tokens): the keys and values come from the first
    ``kv_tokens`` tokens only, as in Twins-SVT's global sub-sampled attention and PVTv2's
    spatial reduction (timm's GlobalSubSampleAttn: ``q`` from every token, ``kv`` from the
    sub-sampled sequence), a long-query, short-key problem that the general family runs."""

    def __init__(self, dim: int, heads: int, kv_tokens: int = 0):
        super().__init__()
        self.heads, self.scale, self.kv_tokens = heads, (dim // heads) ** -0.5, kv_tokens
        if kv_tokens:
            self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, C = x.shape
        if self.kv_tokens:
            q = self.q(x).reshape(B, L, self.heads, C // self.heads).permute(0, 2, 1, 3)
            kv = self.kv(x[:, :self.kv_tokens]).reshape(B, -1, 2, self.heads, C // self.heads)
            k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = self.qkv(x).reshape(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return x + self.proj((attn @ v).transpose(1, 2).reshape(B, L, C))


def model_of(sites: int, dim: int, heads: int, kv_tokens: int = 0) -> nn.Module:
    return nn.Sequential(*[Block(dim, heads, kv_tokens) for _ in range(sites)])


def build(variant: str, sites: int, task: str, args) -> tuple:
    """A compiled step of ``variant`` (compiled and run once here, so the timed rounds only run)
    and the attention sites its compile fused (Dynamo's counters, as zoo.py reads them)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = model_of(sites, args.dim, args.heads, args.kv_tokens).to(args.device, args.dtype)
    x = torch.randn(args.batch, args.tokens, args.dim, device=args.device, dtype=args.dtype)
    plugin = variant.startswith("plugin")
    compiled = torch.compile(model, backend="fuse_plugin") if plugin else torch.compile(model)
    if task == "train":
        x.requires_grad_(True)

        def step():
            compiled(x).float().sum().backward()
    else:
        def step():
            with torch.no_grad():
                compiled(x)
    counters["fuse_plugin"].clear()
    graphs = int(counters["stats"]["unique_graphs"])
    with switch_of(variant), (contextlib.nullcontext() if plugin else fuse_plugin.disabled()):
        step()  # compiles: the plugin's choices are read at trace time
    if int(counters["stats"]["unique_graphs"]) == graphs:
        # Dynamo ran it without compiling (its recompile limit: every variant compiles the same
        # code objects): timing it would compare eager with eager
        raise RuntimeError(f"{variant} ({task}, {sites} sites) compiled no graph")
    fused = int(counters["fuse_plugin"].get("attention", 0))
    step()
    return step, fused


def sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure(args) -> list[dict]:
    """Every (task, N, variant): its rounds' issue and wall seconds, and the sites it fused."""
    # every variant compiles the same code objects (Sequential's forward): room for all of a cell's
    # (Dynamo's default limit of 8 ran the later cells of stop 44's first call eagerly)
    room_for_compiles()
    rows = []
    for task in args.tasks:
        for n in args.sites:
            built = {v: build(v, n, task, args) for v in args.variants}
            issued = {v: [] for v in args.variants}
            wall = {v: [] for v in args.variants}
            for i in range(args.rounds):
                for v in common.round_order(list(args.variants), i):
                    wall[v].append(common.timed_run(built[v][0], args.steps, sync(args.device), issued[v]))
            for v in args.variants:
                rows.append(dict(task=task, sites=n, variant=v, fused=built[v][1], issue=issued[v], wall=wall[v]))
            del built
            torch._dynamo.reset()  # the next cell's variants compile anew, each in its own room
    return rows


def us_per_step(seconds: list, steps: int) -> float:
    return 1e6 * statistics.median(seconds) / steps


def table(rows: list[dict], steps: int) -> list[str]:
    """Per task and N: each variant's issue / wall µs a step, its sites fused, and (plugin
    variants) its issue µs a site over stock compile's."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    what = {v: "issue / wall µs a step" + ("" if v == "compile" else "; fused; µs a site over compile")
            for v in variants}
    out = ["| task | sites | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants),
           "| | | " + " | ".join(what[v] for v in variants) + " |"]
    for task in dict.fromkeys(r["task"] for r in rows):
        for n in dict.fromkeys(r["sites"] for r in rows):
            cell = {r["variant"]: r for r in rows if r["task"] == task and r["sites"] == n}
            if not cell:
                continue
            base = us_per_step(cell["compile"]["issue"], steps) if "compile" in cell else None
            vals = []
            for v in variants:
                issue, wall = us_per_step(cell[v]["issue"], steps), us_per_step(cell[v]["wall"], steps)
                text = f"{issue:.0f} / {wall:.0f}"
                if v != "compile":
                    text += f"; {cell[v]['fused']}" + (f"; {(issue - base) / n:+.1f}" if base is not None else "")
                vals.append(text)
            out.append(f"| {task} | {n} | " + " | ".join(vals) + " |")
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", default="8,32", help="comma-separated numbers of attention blocks")
    p.add_argument("--tasks", default="infer,train")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="windows (B) per step")
    p.add_argument("--tokens", type=int, default=49)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=0,
                   help="keys and values from the first KV_TOKENS tokens only (Twins-SVT's global sub-sampled "
                        "attention: e.g. --tokens 3136 --kv-tokens 49); 0: from every token (a window)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU in fp32 (a smoke test: our ops stay opaque)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.sites = [int(s) for s in args.sites.split(",")]
    args.tasks = args.tasks.split(",")
    args.variants = args.variants.split(",")
    for v in args.variants:
        if v.split("@", 1)[0] not in ("compile", "plugin"):
            p.error(f"unknown variant {v!r}: compile, plugin, or plugin@SWITCH=value")
    for t in args.tasks:
        if t not in ("infer", "train"):
            p.error(f"unknown task {t!r}: infer or train")
    if not 0 <= args.kv_tokens < args.tokens:
        p.error(f"--kv-tokens {args.kv_tokens}: 0 (every token) or fewer than --tokens {args.tokens}")
    args.device = "cpu" if args.cpu else "cuda"
    args.dtype = torch.float32 if args.cpu else torch.bfloat16
    return args


def main(argv=None) -> list[str]:
    args = parse(argv)
    rows = measure(args)
    lines = [f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'} | torch {torch.__version__} | "
             f"{args.dtype} | B {args.batch}, L {args.tokens}"
             f"{f' (keys and values: the first {args.kv_tokens})' if args.kv_tokens else ''}, C {args.dim}, "
             f"{args.heads} heads | median of "
             f"{args.rounds} interleaved rounds of {args.steps} steps", ""] + table(rows, args.steps)
    common.emit(lines, args.out)
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
