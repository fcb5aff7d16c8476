"""GPU check (issue 15): greedy generation with a static KV cache, fused, under CUDA graphs.

Run on a CUDA machine from the repository root:   python tests/gpu_generate_check.py
(a minute or two on an H100: Inductor compiles of two 4-layer models, caches off). Prints one
PASS/FAIL row per check and exits 1 if any fails. Not collected by pytest (no test_ prefix);
``--cpu`` is a smoke test of the script (default mode instead of CUDA graphs, which need CUDA).

Models: LlamaForCausalLM and Qwen2ForCausalLM from a config (no download), 4 layers, hidden 512,
8 query / 4 kv heads of 64, `attn_implementation="eager"`; 2 prompts of 40 tokens, the first
left-padded by 5; 24 new tokens; a StaticCache of 320 slots (>= 256 keys, so the decode steps take
the flash-decoding kernels: kernels/attention_decode.py).

Checks, per model, fp32 (tokens must equal eager's exactly):
  forward compiled   HF's static-cache recipe with the whole forward compiled
                     (``torch.compile(model.forward, backend="fuse_plugin", mode="reduce-overhead",
                     fullgraph=True)``, the cache initialised before the compile, HF's own decode
                     compile off): tokens equal eager's; every attention fused in the prefill and the
                     decode graph; no CUDA-graph skips; a second generate compiles no graph; the
                     decode graph's generated code launches the decode kernel
  compile_config     HF's own decode compile (``generate(compile_config=CompileConfig(
                     backend="fuse_plugin", mode="reduce-overhead", fullgraph=True))``, the prefill
                     eager): tokens equal eager's, every attention of the decode graph fused, no
                     CUDA-graph skips
Once, bf16 (Llama, forward compiled, reduce-overhead):
  bf16 tokens        each row equals eager bf16's, or first differs at a near tie: eager's margin
                     between its top two logits there is within the two runs' logit difference at
                     that step (both runs had the same prefix), shown.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuse_plugin  # noqa: E402,F401
from gpu_checkpoint_check import header, report  # noqa: E402

LAYERS, PROMPT, PAD, NEW, CACHE = 4, 40, 5, 24, 320
DECODE_KERNEL = "attention_decode_split_kernel"


def make(family: str, dtype: torch.dtype, device: str):
    import transformers

    cls, cfg_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[family]
    cfg = cfg_cls(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=CACHE,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="eager", dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # always NEW tokens
    return model


def prompt(device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (2, PROMPT), generator=g)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    ids[0, :PAD], mask[0, :PAD] = 0, 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def static_cache(model, early: bool):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=CACHE)
    if early:  # static buffer addresses before the compile (the prefill is compiled too)
        cache.early_initialization(2, model.config.num_key_value_heads, 64, model.dtype, model.device)
    return cache


class PerGraph:
    """backend="fuse_plugin" with the mode torch.compile passes on, counting the attention sites
    fused per compiled graph; survives HF's deep copy of a CompileConfig."""

    def __init__(self):
        self.backend = torch._dynamo.lookup_backend("fuse_plugin")
        self.graphs: list[int] = []

    def __deepcopy__(self, memo):
        return self

    def __call__(self, gm, example_inputs, **kwargs):
        before = counters["fuse_plugin"]["attention"]
        out = self.backend(gm, example_inputs, **kwargs)
        self.graphs.append(counters["fuse_plugin"]["attention"] - before)
        return out


def generate(model, inputs, cache, **kw):
    if cache is not None:
        cache.reset()
    with torch.no_grad():
        return model.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)


def cudagraph_skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


def check_forward_compiled(family: str, mode, device: str, rows: list) -> None:
    from torch._inductor.utils import run_and_get_code

    eager = make(family, torch.float32, device)
    inputs = prompt(device)
    ref = generate(eager, inputs, static_cache(eager, True), disable_compile=True).sequences
    model = copy.deepcopy(eager)
    cache = static_cache(model, True)
    torch._dynamo.reset()
    counters.clear()
    counting = PerGraph()
    model.forward = torch.compile(model.forward, backend=counting, mode=mode, fullgraph=True)
    out, code = run_and_get_code(lambda: generate(model, inputs, cache, disable_compile=True))
    graphs = counters["stats"]["unique_graphs"]
    again = generate(model, inputs, cache, disable_compile=True)
    label = f"{family} forward compiled"
    rows.append((f"{label} tokens", torch.equal(out.sequences, ref) and torch.equal(again.sequences, ref),
                 f"{out.sequences.shape[1] - PROMPT} new tokens x 2 rows (row 0 left-padded), fp32, {mode or 'default'}"))
    rows.append((f"{label} fused", counting.graphs == [LAYERS, LAYERS],
                 f"attention fused per graph (prefill, decode): {counting.graphs}"))
    rows.append((f"{label} graphs", counters["stats"]["unique_graphs"] == graphs == 2,
                 f"{graphs} graphs compiled by the first generate, "
                 f"{counters['stats']['unique_graphs'] - graphs} by the second"))
    rows.append((f"{label} cudagraphs", cudagraph_skips() == 0, f"CUDA-graph skips: {cudagraph_skips()}"))
    if device == "cuda":
        rows.append((f"{label} decode kernel", any(DECODE_KERNEL in c for c in code),
                     f"{DECODE_KERNEL} in Inductor's code: {[DECODE_KERNEL in c for c in code]} (per graph)"))


def check_compile_config(family: str, mode, device: str, rows: list) -> None:
    from transformers import CompileConfig

    eager = make(family, torch.float32, device)
    inputs = prompt(device)
    ref = generate(eager, inputs, static_cache(eager, False), disable_compile=True).sequences
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    counting = PerGraph()
    config = CompileConfig(backend=counting, mode=mode, fullgraph=True)
    config._compile_all_devices = device != "cuda"  # HF compiles on CUDA only unless told (private, 5.x)
    out = generate(model, inputs, static_cache(model, False), compile_config=config)
    label = f"{family} compile_config"
    rows.append((f"{label} tokens", torch.equal(out.sequences, ref), f"fp32, {mode or 'default'}"))
    rows.append((f"{label} fused", counting.graphs == [LAYERS], f"attention fused per graph (decode): {counting.graphs}"))
    rows.append((f"{label} cudagraphs", cudagraph_skips() == 0, f"CUDA-graph skips: {cudagraph_skips()}"))


def check_bf16(mode, device: str, rows: list) -> None:
    eager = make("llama", torch.bfloat16, device)
    inputs = prompt(device)
    ref = generate(eager, inputs, static_cache(eager, True), disable_compile=True)
    model = copy.deepcopy(eager)
    cache = static_cache(model, True)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="fuse_plugin", mode=mode, fullgraph=True)
    out = generate(model, inputs, cache, disable_compile=True)
    ok, notes = True, []
    for row in range(2):
        got, want = out.sequences[row, PROMPT:], ref.sequences[row, PROMPT:]
        diff = (got != want).nonzero()
        if len(diff) == 0:
            notes.append(f"row {row}: equal")
            continue
        t = int(diff[0])
        s_ref, s_got = ref.scores[t][row].float(), out.scores[t][row].float()
        top = s_ref.topk(2).values
        margin, noise = (top[0] - top[1]).item(), (s_got - s_ref).abs().max().item()
        ok &= margin <= noise
        notes.append(f"row {row}: first differs at token {t}, eager's top-2 margin {margin:.3g} vs logit difference {noise:.3g}")
    rows.append(("llama bf16 tokens", ok, "; ".join(notes)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a smoke test of the script on the CPU (default mode)")
    args = parser.parse_args(argv)
    if not header(args.cpu):
        return 1
    torch._inductor.config.fx_graph_cache = False  # Inductor's code is read back: compile it
    torch._functorch.config.enable_autograd_cache = False
    device = "cpu" if args.cpu else "cuda"
    mode = None if args.cpu else "reduce-overhead"
    rows: list = []
    for family in ("llama", "qwen2"):
        check_forward_compiled(family, mode, device, rows)
        check_compile_config(family, mode, device, rows)
    check_bf16(mode, device, rows)
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
