"""HF transformers families, fused end to end (issue: eager HF attention and rotary, compiled).

Tiny random-weight models built from configs (no downloads), `attn_implementation="eager"`, dropout
off in the parity tests (a random mask cannot be compared with eager's; one test trains Llama with
attention dropout on and checks it is fused and repeatable under torch.manual_seed). For each
family, compiled against eager:

* counts: `counters["fuse_plugin"]` per compiled graph: every attention layer (T5: the encoder's
  self attention, the decoder's self and cross attention), every rotated tensor (a q+k pair
  counts 2, see fuse_plugin/patterns/rotary.py) and every rotary q+k pair folded into its attention
  (`rope_attention`: all of them without a KV cache, none in the decode step, whose rotated k also
  goes to the cache);
* values: logits equal eager everywhere (fp32 rel ≤ 1e-5), the padded positions included (eager
  gives them finite values: a row masked everywhere with finfo.min has uniform weights, and the op
  reproduces that), and in training the gradients of every parameter (≤ 1e-4);
* with a padding `attention_mask` (left padding for decoders, right padding for encoders) and
  without one.

GPT-2 runs twice: as configured by default, and with `reorder_and_upcast_attn=True`, whose scores
are a baddbmm over merged (batch, heads) in fp32.

The spellings of tests/test_spellings.py, in their families: Falcon's MQA (one kv head broadcast by
the matmuls) and ALiBi (a 4-D view of the alibi, the weights viewed before · v), BLOOM's
baddbmm(alibi, q, kᵀ) over merged heads with the weights viewed back to 3-D, DeBERTa-v2's
disentangled bias (from q and k, with its gradient) added on merged heads before the padding fill,
SigLIP's pooling head (nn.MultiheadAttention, weights dropped); DistilBERT, MBart, ESM and Whisper
(transformers 5.x writes them with the shared eager attention function).

Most families run through `helpers.rewrite_aot_eager` (our rewrite + AOTAutograd with the ops'
autograd, eager kernels): the same graph Inductor would get, compiled in a fraction of the time.
Llama and T5 also run through the real backend (Inductor on the CPU). One decoder compiles with a
dynamic sequence length and must not recompile across three lengths; one decodes a token against
its KV cache.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from helpers import rel_err, rewrite_aot_eager

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]'): the HF family tests need it"
)

import fuse_plugin  # noqa: E402,F401  (registers the ops and the backend)

VOCAB, BATCH, SEQ, PAD = 96, 2, 12, 4
LOGITS_TOL, GRAD_TOL = 1e-5, 1e-4
ZERO_GRAD = 1e-8  # relative to the model's gradient norm: a gradient that is zero but for rounding


# =============================================================================== the families


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[], "torch.nn.Module"]
    attention: int  # attention sites per compiled graph
    rotary: int  # rotated tensors per compiled graph (q and k of each layer: 2 per layer)
    rope_attention: int  # rotary q+k pairs folded into their attention (fuse_plugin.rope_attention)
    # "decoder" (left padding) | "encoder" (right padding) | "encoder-decoder" | "speech" (Whisper:
    # input features, padding on the decoder side) | "text-image" (SigLIP: both towers, text padded)
    kind: str = "decoder"
    logits: Callable = lambda out: out.logits  # the output compared with eager


def _decoder_config(cls, **extra):
    """2 layers, hidden 64, 4 heads of 16, dropout off (each config names its dropout differently)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return cls(**{**common, **extra})


def _model(model_cls, config):
    torch.manual_seed(0)
    return model_cls._from_config(config, attn_implementation="eager")


def _llama():
    return _model(transformers.LlamaForCausalLM, _decoder_config(transformers.LlamaConfig, num_key_value_heads=2))


def _mistral():
    return _model(transformers.MistralForCausalLM,
                  _decoder_config(transformers.MistralConfig, num_key_value_heads=2, sliding_window=None))


def _qwen2():
    return _model(transformers.Qwen2ForCausalLM, _decoder_config(transformers.Qwen2Config, num_key_value_heads=2))


def _gemma():  # MQA (one kv head), head_dim given explicitly
    return _model(transformers.GemmaForCausalLM,
                  _decoder_config(transformers.GemmaConfig, num_key_value_heads=1, head_dim=16))


def _phi3():  # fused qkv projection, rotary through Phi-3's partial-rotary code path
    return _model(transformers.Phi3ForCausalLM, _decoder_config(transformers.Phi3Config, num_key_value_heads=2))


def _gpt_neox():  # partial rotary: the first 8 of 16 channels
    cfg = _decoder_config(transformers.GPTNeoXConfig, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    return _model(transformers.GPTNeoXForCausalLM, cfg)


def _gpt_j():  # interleaved (rotate_every_two) partial rotary: 8 of 16 channels
    cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return _model(transformers.GPTJForCausalLM, cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return _model(transformers.GPT2LMHeadModel, cfg)


def _gpt2_reordered():  # reorder_and_upcast_attn: scores by baddbmm over merged (batch, heads), in fp32
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
                                  reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)
    return _model(transformers.GPT2LMHeadModel, cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0)
    return _model(transformers.BertForMaskedLM, cfg)


def _t5():  # relative position bias (a learned additive bias: its gradient goes through the op)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=2,
                                decoder_start_token_id=0)
    return _model(transformers.T5ForConditionalGeneration, cfg)


def _distilbert():  # (HF ≤ 4.x spelled its mask `(mask == 0).view(...).expand_as(scores)`: tests/test_spellings.py)
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, pad_token_id=0)
    return _model(transformers.DistilBertForMaskedLM, cfg)


def _mbart():
    cfg = transformers.MBartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                   decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                   activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   decoder_start_token_id=2)
    return _model(transformers.MBartForConditionalGeneration, cfg)


def _falcon(**extra):
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=False, hidden_dropout=0.0, attention_dropout=0.0,
                                    max_position_embeddings=64, bos_token_id=1, eos_token_id=2, **extra)
    return _model(transformers.FalconForCausalLM, cfg)


def _falcon_rope_mqa():  # rotary, one kv head broadcast over the 4 q heads by the matmuls
    return _falcon(multi_query=True, alibi=False)


def _falcon_alibi():  # ALiBi added as a 4-D view of (B·H, 1, Lk); the weights viewed before · v
    return _falcon(multi_query=False, alibi=True)


def _bloom():  # ALiBi through baddbmm(alibi, q, kᵀ) on merged heads, viewed 4-D, weights viewed back 3-D
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _model(transformers.BloomForCausalLM, cfg)


def _deberta_v2():  # disentangled attention: a (B·H, L, L) bias from q and k terms, with its gradient
    cfg = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, relative_attention=True,
                                       pos_att_type=["p2c", "c2p"], max_relative_positions=32, position_buckets=16,
                                       pad_token_id=0)
    return _model(transformers.DebertaV2ForMaskedLM, cfg)


def _siglip():  # text tower, vision tower and the vision tower's attention-pooling head (nn.MultiheadAttention)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8, attention_dropout=0.0)
    return _model(transformers.SiglipModel, transformers.SiglipConfig(text_config=text, vision_config=vision))


def _esm():  # rotary ESM (q scaled before the rotation)
    cfg = transformers.EsmConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, position_embedding_type="rotary", pad_token_id=0,
                                 mask_token_id=1)
    return _model(transformers.EsmForMaskedLM, cfg)


def _whisper():
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=8,
                                     max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)
    return _model(transformers.WhisperForConditionalGeneration, cfg)


def _siglip_embeds(out):
    return torch.cat([out.text_embeds, out.image_embeds, out.logits_per_image], dim=-1)


FAMILIES = [
    Family("llama", _llama, attention=2, rotary=4, rope_attention=2),
    Family("mistral", _mistral, attention=2, rotary=4, rope_attention=2),
    Family("qwen2", _qwen2, attention=2, rotary=4, rope_attention=2),
    Family("gemma", _gemma, attention=2, rotary=4, rope_attention=2),
    Family("phi3", _phi3, attention=2, rotary=4, rope_attention=2),
    Family("gpt_neox", _gpt_neox, attention=2, rotary=4, rope_attention=2),  # partial: rotary_dim 8 of 16
    # rotated in (B, L, H, D) and permuted afterwards: folded with permuted q/k and tables
    Family("gpt_j", _gpt_j, attention=2, rotary=4, rope_attention=2),
    Family("gpt2", _gpt2, attention=2, rotary=0, rope_attention=0),
    Family("gpt2_reordered", _gpt2_reordered, attention=2, rotary=0, rope_attention=0),
    Family("bert", _bert, attention=2, rotary=0, rope_attention=0, kind="encoder"),
    # 2 encoder self attentions + 2 decoder self attentions + 2 cross attentions
    Family("t5", _t5, attention=6, rotary=0, rope_attention=0, kind="encoder-decoder"),
    Family("distilbert", _distilbert, attention=2, rotary=0, rope_attention=0, kind="encoder"),
    Family("mbart", _mbart, attention=6, rotary=0, rope_attention=0, kind="encoder-decoder"),
    Family("falcon_rope_mqa", _falcon_rope_mqa, attention=2, rotary=4, rope_attention=2),
    Family("falcon_alibi", _falcon_alibi, attention=2, rotary=0, rope_attention=0),
    Family("bloom", _bloom, attention=2, rotary=0, rope_attention=0),
    # DeBERTa-v2 adds its disentangled bias before a finite padding fill: the op's replace mask
    # (the filled scores are the bias alone, no gradient into q·kᵀ: patterns/attention_bias.py)
    Family("deberta_v2", _deberta_v2, attention=2, rotary=0, rope_attention=0, kind="encoder"),
    # 2 text + 2 vision layers + the pooling head's nn.MultiheadAttention (weights returned, unused)
    Family("siglip", _siglip, attention=5, rotary=0, rope_attention=0, kind="text-image", logits=_siglip_embeds),
    Family("esm", _esm, attention=2, rotary=4, rope_attention=2, kind="encoder"),
    # 2 encoder self attentions (no mask) + 2 decoder self + 2 cross attentions
    Family("whisper", _whisper, attention=6, rotary=0, rope_attention=0, kind="speech"),
]


# Gemma 2 (issue 14, softcap): attention logit softcapping (tanh(s / c) * c between the scaling and
# the mask) goes into the op's softcap; final_logit_softcapping (on the LM logits, no softmax) stays
# eager. Layers alternate sliding-window (window 4 < SEQ: the window mask hides keys) and full
# attention. MQA, head_dim 16, query_pre_attn_scalar 16, q/k projections scaled up so the cap bites. rope_attention has no softcap, so the
# rotary stays a separate fused rotary op next to each attention (rope_attention 0).
def _gemma2():
    cfg = _decoder_config(transformers.Gemma2Config, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=4)
    model = _model(transformers.Gemma2ForCausalLM, cfg)
    with torch.no_grad():  # scores of several times the cap (random init gives |s| << 1: tanh(s/c)·c ≈ s)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    return model


FAMILIES.append(Family("gemma2", _gemma2, attention=2, rotary=4, rope_attention=0))


# gpt-oss (issue 31, sinks): a learned sink logit per head concatenated to the scores, softmax, the
# sink column dropped (the op's sinks, gradient included), with sliding-window layers (window 4 <
# SEQ) alternating with full ones, GQA 4/2, MoE blocks (left eager). The sinks are drawn away from
# their zero init so they change the softmax. rope_attention takes no sinks: rotary stays separate.
def _gpt_oss():
    cfg = _decoder_config(transformers.GptOssConfig, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"])
    model = _model(transformers.GptOssForCausalLM, cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


if hasattr(transformers, "GptOssForCausalLM"):
    FAMILIES.append(Family("gpt_oss", _gpt_oss, attention=2, rotary=4, rope_attention=0))
KINDS = ("attention", "rotary", "rope_attention")


def _expected(family: Family, **override) -> dict:
    return {**{k: getattr(family, k) for k in KINDS}, **override}
BY_NAME = {f.name: f for f in FAMILIES}


def _inputs(family: Family, padding: bool, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, seq), generator=g)
    kwargs: dict = {"input_ids": ids}
    if family.kind in ("decoder", "encoder-decoder", "speech"):
        kwargs["use_cache"] = False
    if family.kind == "text-image":
        kwargs["pixel_values"] = torch.randn(BATCH, 3, 32, 32, generator=g)
    if family.kind == "speech":  # (B, mel bins, 2 · max_source_positions)
        kwargs["input_features"] = torch.randn(BATCH, 8, 16, generator=g)
        kwargs["decoder_input_ids"] = kwargs.pop("input_ids")
        if padding:
            dmask = torch.ones(BATCH, seq, dtype=torch.long)
            dmask[1, seq - PAD:] = 0
            kwargs["decoder_attention_mask"] = dmask
        return kwargs
    if padding:
        mask = torch.ones(BATCH, seq, dtype=torch.long)
        if family.kind == "decoder":
            mask[0, :PAD] = 0  # left padding: those queries see no key at all
        else:
            mask[0, seq - PAD:] = 0  # right padding
        kwargs["attention_mask"] = mask
    if family.kind == "encoder-decoder":
        kwargs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, seq - 2), generator=g)
        if padding:
            dmask = torch.ones(BATCH, seq - 2, dtype=torch.long)
            dmask[1, seq - 2 - PAD:] = 0
            kwargs["decoder_attention_mask"] = dmask
    return kwargs


# =============================================================================== checking


class PerGraphCounts:
    """A backend wrapper that records, per compiled graph, how many sites the rewrite fused."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.graphs: list[dict] = []

    def __call__(self, gm, example_inputs):
        before = {k: counters["fuse_plugin"][k] for k in KINDS}
        compiled = self.backend(gm, example_inputs)
        self.graphs.append({k: counters["fuse_plugin"][k] - before[k] for k in KINDS})
        return compiled


def check_family(family: Family, padding: bool, backend=rewrite_aot_eager, training: bool = True) -> None:
    """Compile `family`, run it (and its backward, in training) next to eager; compare counts,
    logits everywhere and every parameter's gradient."""
    eager = family.make()
    model = copy.deepcopy(eager)
    eager.train(training), model.train(training)
    kwargs = _inputs(family, padding)
    torch._dynamo.reset()
    counters.clear()
    counting = PerGraphCounts(backend)
    compiled = torch.compile(model, backend=counting)
    with torch.set_grad_enabled(training):
        ref = family.logits(eager(**kwargs))
        out = family.logits(compiled(**kwargs))
    expected = _expected(family)
    assert counting.graphs == [expected], f"fused per graph: {counting.graphs}, expected {expected}"
    for k in KINDS:
        assert counters["fuse_plugin"][k] == expected[k], k
    assert out.shape == ref.shape and torch.isfinite(ref).all()
    err = rel_err(out, ref)
    assert err <= LOGITS_TOL, f"logits rel err {err:.2e}"
    if not training:
        return
    ref.float().square().mean().backward()
    out.float().square().mean().backward()
    check_gradients(eager, model)


def check_gradients(eager, model) -> None:
    """Every parameter's gradient, relative error ≤ GRAD_TOL. A gradient that is zero in exact
    arithmetic (BERT's key bias: adding q·b to every score of a row leaves the softmax as it was)
    is rounding noise in both models: such a gradient must stay below ZERO_GRAD of the model's
    whole gradient norm in both, instead of agreeing in relative terms."""
    named = [(name, p, q) for (name, p), q in zip(eager.named_parameters(), model.parameters())]
    total = sum(p.grad.double().norm() ** 2 for _, p, _ in named if p.grad is not None).sqrt().item()
    for name, p, q in named:
        if p.grad is None:
            assert q.grad is None, name
            continue
        if p.grad.double().norm().item() <= ZERO_GRAD * total:
            assert q.grad.double().norm().item() <= ZERO_GRAD * total, f"gradient of {name} is not zero"
            continue
        err = rel_err(q.grad, p.grad)
        assert err <= GRAD_TOL, f"gradient of {name}: rel err {err:.2e}"


# =============================================================================== tests


@pytest.mark.parametrize("padding", [False, True], ids=["no_padding", "padding"])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_training_matches_eager(family, padding):
    """Training mode (dropout p=0): our rewrite + AOTAutograd; logits and all parameter gradients."""
    check_family(family, padding)


@pytest.mark.parametrize("family", ["llama", "t5", "bloom"])
def test_family_inductor_backend(family):
    """The real backend (`backend="fuse_plugin"`: Inductor on the CPU), training with padding."""
    check_family(BY_NAME[family], padding=True, backend="fuse_plugin")


def test_family_eval_inference():
    """Eval mode under no_grad (dropout modules off, an inference graph) fuses the same sites."""
    check_family(BY_NAME["qwen2"], padding=True, training=False)


def test_dynamic_sequence_length_no_recompile():
    """A decoder with the sequence dim marked dynamic: one graph for three lengths, every site fused."""
    family = BY_NAME["llama"]
    model = family.make().eval()
    cnt = CompileCounterWithBackend(rewrite_aot_eager)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=cnt)
    with torch.no_grad():
        for seq in (9, 13, 17):
            kwargs = _inputs(family, padding=True, seq=seq)
            for name in ("input_ids", "attention_mask"):
                torch._dynamo.mark_dynamic(kwargs[name], 1)
            ref = model(**kwargs).logits
            out = compiled(**kwargs).logits
            assert rel_err(out, ref) <= LOGITS_TOL
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} graphs"
    for k in KINDS:
        assert counters["fuse_plugin"][k] == getattr(family, k), k


def test_decode_step_with_kv_cache():
    """A decode step (one new token against the prefill's KV cache, padded batch): fused, equal to eager.
    The rotated k also goes into the cache, so the rotary stays a rotary_qk next to the attention."""
    family = BY_NAME["llama"]
    model = family.make().eval()
    kwargs = _inputs(family, padding=True)
    kwargs["use_cache"] = True
    with torch.no_grad():
        prefill = model(**kwargs)
        step = {"input_ids": prefill.logits[:, -1:].argmax(-1), "use_cache": True,
                "attention_mask": torch.cat([kwargs["attention_mask"], torch.ones(BATCH, 1, dtype=torch.long)], 1)}
        ref = model(**step, past_key_values=copy.deepcopy(prefill.past_key_values)).logits
        torch._dynamo.reset()
        counters.clear()
        counting = PerGraphCounts(rewrite_aot_eager)
        out = torch.compile(model, backend=counting)(**step, past_key_values=copy.deepcopy(prefill.past_key_values)).logits
    assert counting.graphs == [_expected(family, rope_attention=0)]
    assert rel_err(out, ref) <= LOGITS_TOL


def test_attention_dropout_in_training_is_fused_and_repeatable():
    """HF's `dropout(attn_weights, p=attention_dropout, training=True)` goes into the op (its seed
    drawn in the graph from torch's RNG): every attention is still fused, the same
    torch.manual_seed gives the same logits and gradients, another seed other ones."""
    model = _model(transformers.LlamaForCausalLM,
                   _decoder_config(transformers.LlamaConfig, num_key_value_heads=2, attention_dropout=0.3))
    model.train()
    kwargs = _inputs(BY_NAME["llama"], padding=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=rewrite_aot_eager)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        logits = compiled(**kwargs).logits
        grads = torch.autograd.grad(logits.float().square().mean(), [p for p in model.parameters()], allow_unused=True)
        runs.append((logits.detach(), [g for g in grads if g is not None]))
    assert counters["fuse_plugin"]["attention"] == 2 and counters["fuse_plugin"]["rotary"] == 4
    assert torch.isfinite(runs[0][0]).all() and all(torch.isfinite(g).all() for g in runs[0][1])
    assert torch.equal(runs[0][0], runs[1][0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert not torch.equal(runs[0][0], runs[2][0])



@pytest.mark.parametrize("backend", [pytest.param(rewrite_aot_eager, id="aot_eager"), pytest.param("fuse_plugin", id="inductor")])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_trains_fused(reentrant, backend):
    """`gradient_checkpointing_enable()`: each decoder layer runs under torch.utils.checkpoint, which
    Dynamo captures as a `tag_activation_checkpoint` subgraph per layer (use_reentrant=True too: no
    graph break, the same op). Every attention and rotary site inside is fused, and training with
    padding equals eager (logits and every parameter's gradient)."""
    family = BY_NAME["llama"]
    eager = family.make()
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = copy.deepcopy(eager)
    eager.train(), model.train()
    kwargs = _inputs(family, padding=True)
    torch._dynamo.reset()
    counters.clear()
    counting = PerGraphCounts(backend)
    compiled = torch.compile(model, backend=counting)
    ref = eager(**kwargs).logits
    out = compiled(**kwargs).logits
    assert counting.graphs == [_expected(family)], counting.graphs
    assert rel_err(out, ref) <= LOGITS_TOL
    ref.float().square().mean().backward()
    out.float().square().mean().backward()
    check_gradients(eager, model)


def test_gradient_checkpointing_explain_lists_sites_per_layer():
    model = BY_NAME["llama"].make()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    report = fuse_plugin.explain(model, **_inputs(BY_NAME["llama"], padding=True))
    per_layer = report.subgraphs()
    assert report.walked_subgraphs == 2 and len(per_layer) == 2, str(report)
    # each layer: its attention (with the rotary q+k pair folded in when rope_attention is on) and rotary
    for graph, n in per_layer.items():
        assert "tag_activation_checkpoint" in graph
        kinds = sorted(s.kind for s in report.sites if s.graph == graph)
        assert kinds in (["attention", "rope_attention", "rotary", "rotary"], ["attention", "rotary", "rotary"]), kinds


def test_packed_sequences_by_position_ids_train_like_eager():
    """Qwen2 fed packed sequences the HF way (position_ids restarting at each document, no attention
    mask: masking_utils detects the packing and builds doc[q] == doc[kv] with doc =
    cumsum(diff(position_ids) != 1), beside a causal mask on the positions (5.24) or on the indices
    (5.17)). Fused as documents +
    is_causal (mask_structure.packed_positions: no (L, L) bias; the kernels skip the other documents'
    key blocks) and equal to eager in training, logits and gradients."""
    model = _qwen2()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.cat([torch.arange(5), torch.arange(4), torch.arange(SEQ - 9)])[None].expand(BATCH, -1).clone()
    kwargs = dict(input_ids=ids, position_ids=pos, use_cache=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=rewrite_aot_eager)
    ref, out = eager(**kwargs).logits, compiled(**kwargs).logits
    assert counters["fuse_plugin"]["attention"] == 2
    assert rel_err(out, ref) <= LOGITS_TOL
    text = str(fuse_plugin.explain(copy.deepcopy(eager), **kwargs))
    # (transformers 5.24 compares the positions, proven with the ids' steps; 5.17 the indices)
    assert text.count("documents (ids from") == 2 and text.count("is_causal") == 2, text
    ref.float().square().mean().backward()
    out.float().square().mean().backward()
    check_gradients(eager, model)
