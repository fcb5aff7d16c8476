"""`fuse_plugin.register_hf()`: attn_implementation="fuse_plugin" for users who do not compile."""
import copy

import pytest
import torch
from helpers import rel_err

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

import fuse_plugin  # noqa: E402


def _pair():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fuse_plugin")
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("padding", [False, True])
def test_fuse_plugin_attention_matches_eager_with_and_without_padding(padding):
    fuse_plugin.register_hf()
    ref, ours = _pair()
    ids = torch.randint(0, 100, (2, 16))
    mask = None
    if padding:
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[0, :5] = 0  # left padding: rows with no visible key get uniform weights, as eager
    a = ref(ids, attention_mask=mask).logits
    b = ours(ids, attention_mask=mask).logits
    assert rel_err(b, a) < 1e-5
    # training: gradients of every parameter
    ref.train(), ours.train()
    ref(ids, attention_mask=mask).logits.square().mean().backward()
    ours(ids, attention_mask=mask).logits.square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-4, name


def test_register_hf_routes_attention_through_our_op(monkeypatch):
    fuse_plugin.register_hf()
    _, ours = _pair()
    seen = []
    real = fuse_plugin.hf.attention
    monkeypatch.setattr(fuse_plugin.hf, "attention", lambda *a, **k: seen.append(k["is_causal"]) or real(*a, **k))
    ours(torch.randint(0, 100, (1, 8)))
    assert seen == [True, True]  # two layers, no padding: no mask tensor, causal in the kernel
