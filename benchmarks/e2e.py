"""End-to-end: a Llama-style HF model (built from a config, random weights, bf16) on the GPU.

    python benchmarks/e2e.py --seq 2048 --batch 4 [--out FILE.md]

Training step (forward + backward + fused AdamW) and inference forward, tokens/s (median of timed
steps after warm-up/compile) and peak memory (max allocated during the timed training steps), for:
  eager            attn_implementation="eager", no compile
  compile          attn_implementation="eager" + stock torch.compile (our automatic patch disabled)
  sdpa+compile     attn_implementation="sdpa"  + torch.compile
  fuse_plugin      attn_implementation="eager" + torch.compile(backend="fuse_plugin")
  plugin-sdpa      attn_implementation="sdpa"  + torch.compile(backend="fuse_plugin") (HF's default
                   attention, its SDPA call sites rewritten where the choice takes them)
Model: 12 layers, hidden 1024, 16 heads, 4 kv heads, intermediate 4096, vocab 32000 (~250M params).
With --sliding-window W the same dims as a Mistral config (Llama with HF's `sliding_window`: query i
sees keys i-W+1..i; HF's sdpa path passes the band as a dense mask). With --left-pad N every row's
first N tokens are padding (an attention_mask): HF's eager path then ANDs the padding into the
window's finfo.min mask, which the plugin takes as the window plus the padding as a bias, the rows
that see no key averaged after the op (attention_bias.window_beside_one_fill).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import time

import torch
from common import emit
import torch.nn.functional as F

import fuse_plugin

VARIANTS = ("eager", "compile", "sdpa+compile", "fuse_plugin")
SLIDING_WINDOW = 0  # --sliding-window
LEFT_PAD = 0  # --left-pad: padded tokens at the start of every row
INFER = True  # --no-infer: training only


class _NotRun(Exception):
    pass


def build(attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    dims = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768)
    cfg = MistralConfig(**dims, sliding_window=SLIDING_WINDOW, head_dim=64) if SLIDING_WINDOW else LlamaConfig(**dims)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=torch.bfloat16)
    return model.cuda()


def prepare(variant: str):
    model = build("sdpa" if variant in ("sdpa+compile", "plugin-sdpa") else "eager")
    if variant == "eager":
        return model, model
    if variant in ("fuse_plugin", "plugin-sdpa"):
        return model, torch.compile(model, backend="fuse_plugin")
    return model, torch.compile(model)  # stock inductor; callers keep fuse_plugin.disabled() around compiles


def inputs(ids) -> dict:
    """The model's keyword inputs: the ids, and with --left-pad an attention_mask."""
    if not LEFT_PAD:
        return {"input_ids": ids}
    mask = torch.ones_like(ids)
    mask[:, :LEFT_PAD] = 0
    return {"input_ids": ids, "attention_mask": mask}


def step_train(fn, opt, ids):
    logits = fn(**inputs(ids)).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn, n):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure(variant, ids, steps):
    stock = variant in ("compile", "sdpa+compile")
    ctx = fuse_plugin.disabled() if stock else contextlib.nullcontext()
    tokens = ids.numel()
    res = {}
    with ctx:
        model, fn = prepare(variant)
        n_params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        try:
            t0 = time.perf_counter()
            for _ in range(2):
                step_train(fn, opt, ids)
            torch.cuda.synchronize()
            res["warmup_s"] = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            s = timed(lambda: step_train(fn, opt, ids), steps)
            res["train_tok_s"] = tokens / s
            res["train_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        except torch.OutOfMemoryError:
            res["train_tok_s"] = None
        opt.zero_grad(set_to_none=True)
        del opt
        gc.collect()
        torch.cuda.empty_cache()
        try:
            if not INFER:
                raise _NotRun
            with torch.no_grad():
                for _ in range(2):
                    fn(**inputs(ids))
                s = timed(lambda: fn(**inputs(ids)), steps)
            res["infer_tok_s"] = tokens / s
        except torch.OutOfMemoryError:
            res["infer_tok_s"] = None
        except _NotRun:
            res["infer_tok_s"] = "not run"
    del model, fn
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    res["params_m"] = n_params / 1e6
    return res


def main():
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--sliding-window", type=int, default=0, help="a Mistral config with this window")
    parser.add_argument("--no-infer", action="store_true", help="time training only")
    parser.add_argument("--left-pad", type=int, default=0, help="padded tokens at the start of every row")
    args = parser.parse_args()
    global SLIDING_WINDOW, INFER, LEFT_PAD
    SLIDING_WINDOW, INFER, LEFT_PAD = args.sliding_window, not args.no_infer, args.left_pad
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    lines = [
        f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__} | "
        f"{time.strftime('%Y-%m-%d')} | seq {args.seq} batch {args.batch}"
        + (f" | Mistral config, sliding_window {SLIDING_WINDOW}" if SLIDING_WINDOW else "")
        + (f" | {LEFT_PAD} padded tokens per row" if LEFT_PAD else "") + f" | bf16, fused AdamW, median of {args.steps} steps",
        "",
        "| variant | train tokens/s | inference tokens/s | train peak GB | warm-up (compile) s |",
        "|---|---|---|---|---|",
    ]
    for v in args.variants.split(","):
        r = measure(v, ids, args.steps)
        fmt = lambda x, f: "OOM" if x is None else x if isinstance(x, str) else f.format(x)  # noqa: E731
        lines.append(f"| {v} | {fmt(r.get('train_tok_s'), '{:.0f}')} | {fmt(r.get('infer_tok_s'), '{:.0f}')} | "
                     f"{fmt(r.get('train_peak_gb'), '{:.1f}')} | {r.get('warmup_s', float('nan')):.0f} |")
        print(lines[-1], f"(params {r['params_m']:.0f}M)", flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
