"""Text generation with a static KV cache: HF `generate` (greedy), the forward compiled.

    python benchmarks/generate.py [--models llama100m,e2e] [--prompts 512,4096] [--batches 1,8]
                                  [--new-tokens 256] [--variants eager,compile,sdpa+compile,plugin]
                                  [--modes default,reduce-overhead] [--runs 3] [--out FILE.md]
    python benchmarks/generate.py --cpu --tiny      # a smoke run on the CPU (a 2-layer model, fp32)

Models (random weights, bf16 on the GPU): ``llama100m`` = transformers LlamaForCausalLM with 12
layers, hidden 768, 12 q / 4 kv heads of 64, intermediate 2048, vocab 32000, tied embeddings
(~100M parameters); ``e2e`` = benchmarks/e2e.py's config (12 layers, hidden 1024, 16/4 heads,
intermediate 4096, vocab 32000, ~250M). ``--tiny``: 2 layers, hidden 64, 4/2 heads (fp32).

Variants: ``eager`` (eager attention, no compile), ``compile`` (eager attention + stock
torch.compile, the plugin off while it compiles), ``sdpa+compile`` (HF's SDPA attention + stock
compile), ``plugin`` (eager attention + torch.compile(backend="fuse_plugin")); the compiled ones in
each ``--modes`` mode (reduce-overhead = CUDA graphs). The recipe is HF's documented one:
``model.forward = torch.compile(model.forward, mode=...)`` with one `StaticCache` of prompt +
new-tokens slots per row, reset before each call (static addresses for CUDA graphs), so prefill and
decode both run compiled.

Per cell (after two warm-up generations, which compile): TTFT = the best of ``--runs`` timed
``generate(max_new_tokens=1)`` (the prefill and one token); decode tokens/s = batch x (N - 1) /
(T_N - T_1) with T_N the best of ``--runs`` full generations of N new tokens; peak memory = max
allocated during the full generations; ``= eager``: the sequences whose tokens equal eager's (greedy;
bf16 may differ after a near tie); for the plugin, the attention sites fused per compiled graph.
The last column is the plugin's decode tokens/s over the best of compile and sdpa+compile in the
same mode.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import time

import torch
from common import emit
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin.backend import fuse_plugin_backend

VARIANTS = ("eager", "compile", "sdpa+compile", "plugin")
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


def build(name: str, attn: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

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
        before = counters["fuse_plugin"]["attention"]
        compiled = fuse_plugin_backend(gm, example_inputs, **kwargs)
        self.graphs.append(counters["fuse_plugin"]["attention"] - before)
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


def run_cell(model, inputs, cache, new_tokens, runs, device, stock):
    """(ttft s, decode tokens/s, peak MiB or None, tokens)."""
    ctx = fuse_plugin.disabled if stock else contextlib.nullcontext

    def generate(n):
        cache.reset()
        with torch.no_grad(), ctx():
            return model.generate(**inputs, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False)

    def best(n):
        times, out = [], None
        for _ in range(runs):
            sync(device)
            t0 = time.perf_counter()
            out = generate(n)
            sync(device)
            times.append(time.perf_counter() - t0)
        return min(times), out

    for _ in range(2):  # compiles: the prefill (the cache's lazy init, then initialised), the decode step
        generate(new_tokens)
    t1, _ = best(1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tn, out = best(new_tokens)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    batch = inputs["input_ids"].shape[0]
    decode = batch * (new_tokens - 1) / max(tn - t1, 1e-9)
    return t1, decode, peak, out


def run_row(name, prompt_len, batch, args, results, log):
    from transformers import StaticCache

    device, dtype = args.device, args.dtype
    eager_tokens = None
    for variant in args.variants:
        for mode in (args.modes if variant != "eager" else ["-"]):
            t0 = time.perf_counter()
            model = build(name, "sdpa" if variant == "sdpa+compile" else "eager", device, dtype)
            inputs = prompt(batch, prompt_len, model.config.vocab_size, device)
            cache = StaticCache(config=model.config, max_cache_len=prompt_len + args.new_tokens)
            backend = CountingBackend() if variant == "plugin" else None
            if variant != "eager":
                kwargs = {"mode": None if mode == "default" else mode, "fullgraph": True}
                model.forward = torch.compile(model.forward, backend=backend or "inductor", **kwargs)
            try:
                ttft, decode, peak, tokens = run_cell(model, inputs, cache, args.new_tokens, args.runs, device,
                                                      stock=variant in ("compile", "sdpa+compile"))
                if variant == "eager":
                    eager_tokens = tokens
                same = "-" if eager_tokens is None else int((tokens == eager_tokens).all(dim=1).sum())
                cell = {"ttft_ms": ttft * 1e3, "decode": decode, "peak": peak, "same": same,
                        "fused": backend.graphs if backend else None}
            except torch.OutOfMemoryError:
                cell = {"error": "OOM"}
            except Exception as e:  # reported in the table, the other cells still run
                import traceback

                traceback.print_exc()
                cell = {"error": f"error: {type(e).__name__}"}
            results[(name, prompt_len, batch, variant, mode)] = cell
            log(f"  {name} prompt {prompt_len} batch {batch} {variant:13} {mode:16} {fmt(cell)}   "
                f"({time.perf_counter() - t0:.0f} s)")
            del model, cache
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()


def fmt(cell) -> str:
    if "error" in cell:
        return cell["error"]
    peak = f"{cell['peak']:.0f} MiB" if cell["peak"] is not None else "-"
    fused = f" fused {cell['fused']}" if cell["fused"] is not None else ""
    return f"ttft {cell['ttft_ms']:.1f} ms, decode {cell['decode']:.1f} tok/s, peak {peak}, = eager {cell['same']}{fused}"


def table(results, args) -> list[str]:
    lines = ["| model | prompt | batch | variant | mode | TTFT ms | decode tok/s | peak MiB | = eager | "
             "attention fused per graph | plugin / best stock (decode) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, plen, batch, variant, mode), cell in results.items():
        if "error" in cell:
            lines.append(f"| {name} | {plen} | {batch} | {variant} | {mode} | {cell['error']} | | | | | |")
            continue
        ratio = ""
        if variant == "plugin":
            others = [results.get((name, plen, batch, v, mode), {}).get("decode") for v in ("compile", "sdpa+compile")]
            others = [o for o in others if o]
            ratio = f"{cell['decode'] / max(others):.2f}" if others else "-"
        peak = f"{cell['peak']:.0f}" if cell["peak"] is not None else "-"
        fused = "/".join(str(g) for g in cell["fused"]) if cell["fused"] is not None else ""
        lines.append(f"| {name} | {plen} | {batch} | {variant} | {mode} | {cell['ttft_ms']:.1f} | "
                     f"{cell['decode']:.1f} | {peak} | {cell['same']}/{batch} | {fused} | {ratio} |")
    return lines


def main(argv=None):
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama100m,e2e")
    parser.add_argument("--prompts", default="512,4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (fp32)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer model, prompt 16, batch 2, 8 new tokens, default mode (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        defaults = parser.parse_args([])
        for key, value in (("models", "tiny"), ("prompts", "16"), ("batches", "2"), ("new_tokens", 8),
                           ("modes", "default"), ("runs", 1)):
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
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    header = (f"{device_name} | torch {torch.__version__} | transformers {transformers.__version__} | "
              f"{time.strftime('%Y-%m-%d')} | {str(args.dtype).replace('torch.', '')} | static cache, greedy, "
              f"{args.new_tokens} new tokens | best of {args.runs} runs")
    print(header, flush=True)
    results: dict = {}
    t_start = time.perf_counter()
    for name in args.models.split(","):
        for plen in (int(p) for p in args.prompts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                run_row(name, plen, batch, args, results, lambda s: print(s, flush=True))
    lines = [header, ""] + table(results, args) + [f"\n(total {time.perf_counter() - t_start:.0f} s)"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
