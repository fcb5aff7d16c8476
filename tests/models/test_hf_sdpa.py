"""HF transformers families on their default attention, `attn_implementation="sdpa"` (issue 30).

Tiny random-weight models (no downloads), as tests/models/test_hf_models.py builds them but on the
SDPA path, compiled with the site choice forced to our op (`FUSE_PLUGIN_SITE_CHOICE=ours`: nothing
is measured on the CPU, and unmeasured SDPA sites stay SDPA): every SDPA call of every layer is
read as an attention site and runs our op; logits equal eager SDPA (fp32 rel <= 1e-5) and so does
every parameter's gradient (<= 1e-4), with a padding mask and without; HF `generate` with a static
cache on the SDPA path gives eager's tokens, every site fused in the prefill and the decode graph.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import rel_err, rewrite_aot_eager

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]'): the HF family tests need it"
)

from test_hf_models import (BATCH, LOGITS_TOL, VOCAB, Family, _decoder_config, _inputs,  # noqa: E402
                            check_gradients)


@pytest.fixture(autouse=True)
def ours(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")


def _sdpa(model_cls, config):
    torch.manual_seed(0)
    return model_cls._from_config(config, attn_implementation="sdpa")


def _llama():
    return _sdpa(transformers.LlamaForCausalLM, _decoder_config(transformers.LlamaConfig, num_key_value_heads=2))


def _qwen2():
    return _sdpa(transformers.Qwen2ForCausalLM, _decoder_config(transformers.Qwen2Config, num_key_value_heads=2))


def _mistral_window():  # a sliding window (4) shorter than the sequence (12): the window is in the mask
    return _sdpa(transformers.MistralForCausalLM,
                 _decoder_config(transformers.MistralConfig, num_key_value_heads=2, sliding_window=4))


def _gemma():
    return _sdpa(transformers.GemmaForCausalLM,
                 _decoder_config(transformers.GemmaConfig, num_key_value_heads=1, head_dim=16))


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0)
    return _sdpa(transformers.BertForMaskedLM, cfg)


def _vit():
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, num_labels=10)
    return _sdpa(transformers.ViTForImageClassification, cfg)


def _whisper():
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=8,
                                     max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)
    return _sdpa(transformers.WhisperForConditionalGeneration, cfg)


def _clip():
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8, attention_dropout=0.0)
    return _sdpa(transformers.CLIPModel, transformers.CLIPConfig(text_config=text, vision_config=vision))


def _clip_embeds(out):
    return torch.cat([out.text_embeds, out.image_embeds, out.logits_per_image], dim=-1)


# sdpa: SDPA calls fused per graph; rotary: rotated tensors; rope_attention: rotary pairs folded in
FAMILIES = {
    "llama": (Family("llama", _llama, attention=0, rotary=4, rope_attention=2), 2),
    "qwen2": (Family("qwen2", _qwen2, attention=0, rotary=4, rope_attention=2), 2),
    "mistral_window": (Family("mistral", _mistral_window, attention=0, rotary=4, rope_attention=2), 2),
    "gemma": (Family("gemma", _gemma, attention=0, rotary=4, rope_attention=2), 2),
    "bert": (Family("bert", _bert, attention=0, rotary=0, rope_attention=0, kind="encoder"), 2),
    "vit": (Family("vit", _vit, attention=0, rotary=0, rope_attention=0, kind="image"), 2),
    "whisper": (Family("whisper", _whisper, attention=0, rotary=0, rope_attention=0, kind="speech"), 6),
    "clip": (Family("clip", _clip, attention=0, rotary=0, rope_attention=0, kind="text-image",
                    logits=_clip_embeds), 4),
}
KINDS = ("sdpa", "attention", "rotary", "rope_attention")


def _model_inputs(family: Family, padding: bool) -> dict:
    g = torch.Generator().manual_seed(2)
    if family.kind == "image":
        return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}
    return _inputs(family, padding)


@pytest.mark.parametrize("padding", [False, True], ids=["no_padding", "padding"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sdpa_family_training_matches_eager(name, padding):
    family, sdpa_sites = FAMILIES[name]
    if padding and family.kind == "image":
        pytest.skip("an image model takes no padding mask")
    eager = family.make()
    model = copy.deepcopy(eager)
    eager.train(), model.train()
    kwargs = _model_inputs(family, padding)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=rewrite_aot_eager)
    ref = family.logits(eager(**kwargs))
    out = family.logits(compiled(**kwargs))
    got = {k: counters["fuse_plugin"][k] for k in KINDS}
    want = {"sdpa": sdpa_sites, "attention": 0, "rotary": family.rotary, "rope_attention": family.rope_attention}
    assert got == want, f"fused: {got}, expected {want}"
    assert counters["fuse_plugin"]["sdpa_left"] == 0
    err = rel_err(out, ref)
    assert err <= LOGITS_TOL, f"logits rel err {err:.2e}"
    ref.float().square().mean().backward()
    out.float().square().mean().backward()
    check_gradients(eager, model)


def test_sdpa_sites_stay_sdpa_where_unmeasured(monkeypatch):
    """The default choice on the CPU (nothing measured): every SDPA call of Llama stays SDPA, each
    reported with the reason, and the logits are eager's exactly."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "auto")
    import fuse_plugin

    family, sites = FAMILIES["llama"]
    model = family.make().eval()
    kwargs = _inputs(family, padding=True)
    report = fuse_plugin.explain(model, **kwargs)
    assert len([m for m in report.left if m.kind == "sdpa"]) == sites
    assert all("left as SDPA" in m.reason for m in report.left)


def test_generate_static_cache_on_the_sdpa_path():
    """HF generate, static cache, the forward compiled: every SDPA call fused in the prefill and the
    decode graph (2 graphs), tokens equal eager's."""
    prompt_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    prompt_ids[0, :3] = 0
    eager = FAMILIES["llama"][0].make().eval()

    def generate(model):
        with torch.no_grad():
            return model.generate(input_ids=prompt_ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, cache_implementation="static")

    ref = generate(eager)
    model = copy.deepcopy(eager)
    per_graph = []

    def backend(gm, example_inputs):
        before = counters["fuse_plugin"]["sdpa"]
        compiled = rewrite_aot_eager(gm, example_inputs)
        per_graph.append(counters["fuse_plugin"]["sdpa"] - before)
        return compiled

    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend=backend)
    out = generate(model)
    assert per_graph == [2, 2], f"SDPA calls fused per graph: {per_graph}"
    assert torch.equal(out, ref)
