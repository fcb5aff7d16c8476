"""On the CPU: the plugin's default (every site left as written) against its ops and stock compile.

Off CUDA our ops run their plain-torch reference, an opaque call that materialises the scores,
where stock compile lets Inductor fuse the site (or swap in SDPA's CPU flash kernel): issue 28 asks
that importing the plugin never makes a model slower, so `patterns/choice.off_cuda` leaves such
sites as written unless `FUSE_PLUGIN_CPU_SITES=ours`. This measures the three ways, every variant
of a row built in one process and its rounds interleaved (common.round_order), the ratio paired
per round (common.paired_median) against stock compile:

* ``compile``: plain torch.compile (Inductor), the plugin switched off while it compiles;
* ``plugin``: ``backend="fuse_plugin"`` with its defaults (off CUDA: the sites left as written);
* ``plugin@CPU_SITES=ours``: the same with every site rewritten into our ops (before stop 57).

Rows (float32, torch's threads as set by --threads): the demo's Llama-style model (HF's eager
spelling: rotate_half rotary, repeat_kv GQA, an additive causal mask, a float32 softmax; hidden
512, 8/2 heads, 2 layers), a ViT-S-style block pair (384 wide, 6 heads), a causal block pair
(512 wide, 8 heads, masked_fill), and nn.MultiheadAttention (384 wide, 6 heads, need_weights as
default); inference under no_grad and a training step (forward + backward).

    python benchmarks/cpu_sites.py [--rows llama-infer-1x512,...] [--rounds 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("FUSE_PLUGIN_AUTOPATCH", "off")  # "compile" is stock: the patch stays out of it

import common  # noqa: E402  (puts this tree on sys.path)
import torch  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ["compile", "plugin", "plugin@CPU_SITES=ours"]


class Attention(nn.Module):
    """timm's hand-written attention (q·s @ kᵀ, softmax, @ v); ``causal``: GPT's masked_fill."""

    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal, self.scale = heads, causal, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q * self.scale) @ k.transpose(-2, -1)
        if self.causal:
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            a = a.masked_fill(~keep, float("-inf"))
        x = (a.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(dim), Attention(dim, heads, causal), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class MHA(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn, self.out = nn.MultiheadAttention(dim, heads, batch_first=True), nn.Linear(dim, dim)

    def forward(self, x):
        return self.out(self.attn(x, x, x)[0])


def _llama(batch: int, seq: int):
    from fuse_plugin.demo import LlamaConfig, TinyLlama

    cfg = LlamaConfig(vocab=4000, hidden=512, layers=2, heads=8, kv_heads=2, mlp=1408)
    return TinyLlama(cfg), torch.randint(0, cfg.vocab, (batch, seq))


def _blocks(dim, heads, batch, seq, causal=False):
    return nn.Sequential(Block(dim, heads, causal), Block(dim, heads, causal)), torch.randn(batch, seq, dim)


# name: (a model and its input, training?)
ROWS = {
    "llama-infer-1x512": (lambda: _llama(1, 512), False),
    "llama-train-1x512": (lambda: _llama(1, 512), True),
    "llama-infer-4x128": (lambda: _llama(4, 128), False),
    "vit-block-infer-4x197": (lambda: _blocks(384, 6, 4, 197), False),
    "vit-block-train-4x197": (lambda: _blocks(384, 6, 4, 197), True),
    "causal-block-infer-1x1024": (lambda: _blocks(512, 8, 1, 1024, causal=True), False),
    "causal-block-train-1x1024": (lambda: _blocks(512, 8, 1, 1024, causal=True), True),
    "mha-infer-8x197": (lambda: (MHA(384, 6), torch.randn(8, 197, 384)), False),
    "mha-train-8x197": (lambda: (MHA(384, 6), torch.randn(8, 197, 384)), True),
}


def _step(model, x, train: bool):
    if train:
        model(x).float().pow(2).mean().backward()
    else:
        with torch.no_grad():
            model(x)


def build(variant: str, model):
    """The compiled model of a variant (compiled at its first call, inside its switch)."""
    import fuse_plugin

    if variant == "compile":
        compiled = torch.compile(model)

        def first(x, train):
            with fuse_plugin.disabled():
                _step(compiled, x, train)
        return compiled, first
    compiled = torch.compile(model, backend="fuse_plugin")

    def first(x, train):
        with common.switch_of(variant):
            _step(compiled, x, train)
    return compiled, first


def run_row(name: str, rounds: int, warm: int) -> dict:
    from torch._dynamo.utils import counters

    make, train = ROWS[name]
    torch.manual_seed(0)
    base, x = make()
    if not train:
        base.eval()
    compiled, sites = {}, {}
    for v in VARIANTS:
        counters.clear()
        m, first = build(v, copy.deepcopy(base))
        first(x, train)
        sites[v] = {k: n for k, n in counters["fuse_plugin"].items() if k in ("attention", "rotary",
                                                                              "attention_left", "rotary_left")}
        for _ in range(warm):
            _step(m, x, train)
        compiled[v] = m
    times = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for v in common.round_order(VARIANTS, i):
            t = time.perf_counter()
            _step(compiled[v], x, train)
            times[v].append(time.perf_counter() - t)
    return {"row": name, "sites": sites, "rounds_s": times,
            "ms": {v: round(statistics.median(t) * 1e3, 2) for v, t in times.items()},
            "vs_compile": {v: common.paired_median(t, [times["compile"]]) for v, t in times.items()}}


def table(rows: list) -> list[str]:
    lines = ["| row | " + " | ".join(f"{v} ms (x compile)" for v in VARIANTS) + " | sites (plugin / ours) |",
             "|---|" + "---|" * (len(VARIANTS) + 1)]
    for r in rows:
        cells = [f"{r['ms'][v]} ({r['vs_compile'][v]:.3f})" for v in VARIANTS]
        ours = r["sites"]["plugin@CPU_SITES=ours"]
        mine = r["sites"]["plugin"]
        lines.append(f"| {r['row']} | " + " | ".join(cells)
                     + f" | {sum(mine.get(k, 0) for k in ('attention', 'rotary'))} fused, "
                       f"{sum(mine.get(k, 0) for k in ('attention_left', 'rotary_left'))} left / "
                       f"{sum(ours.get(k, 0) for k in ('attention', 'rotary'))} fused |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", default=None, help="write every row (rounds included) here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    common.room_for_compiles()
    header = (f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}, float32")
    print(header, flush=True)
    rows = []
    for name in args.rows.split(","):
        if name not in ROWS:
            p.error(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        rows.append(run_row(name, args.rounds, args.warm))
        print(table(rows)[-1], flush=True)
    print("\n".join([header, ""] + table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
