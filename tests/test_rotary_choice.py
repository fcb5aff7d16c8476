"""The rotary site choice (patterns/choice.decide_rotary, FUSE_PLUGIN_ROTARY_SITES).

Compiled for CUDA with static shapes, a rotate-half rotary site is left as written (Inductor fuses the eager
spelling faster than our op's decomposition, measured on an H100: see choice._ROTARY_RULE); on the
CPU, interleaved where nothing needs a gradient (measured faster as our op in inference, timm EVA-02; slower
in training, so left as written there), with symbolic sizes, or where the rewrite folds rotary into attention,
it stays our op. The switch forces either way. The CUDA cases are decided on fake CUDA tensors (no GPU needed).
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import capture
from fuse_plugin.patterns import choice
from test_rotary_patterns import hf_apply, qk, tables


def fake(*shape, device="cuda", requires_grad=False):
    with FakeTensorMode():
        return torch.empty(*shape, device=device, requires_grad=requires_grad)


def test_cuda_static_left_as_written(monkeypatch):
    monkeypatch.delenv("FUSE_PLUGIN_ROTARY_SITES", raising=False)
    d = choice.decide_rotary(fake(2, 4, 8, 16), folding=False)
    assert not d.ours and "left as written by rule" in d.reason and "1345" in d.reason, d


def test_stays_ours_on_cpu_when_folding_or_forced(monkeypatch):
    monkeypatch.delenv("FUSE_PLUGIN_ROTARY_SITES", raising=False)
    assert choice.decide_rotary(fake(2, 4, 8, 16, device="cpu"), folding=False).ours
    assert choice.decide_rotary(fake(2, 4, 8, 16), folding=True).ours  # rope_attention needs the op
    # EVA-02's spelling in inference (its output needs no gradient)
    assert choice.decide_rotary(fake(2, 4, 8, 16), folding=False, interleaved=True, out_value=fake(2, 4, 8, 16)).ours
    monkeypatch.setenv("FUSE_PLUGIN_ROTARY_SITES", "ours")
    assert choice.decide_rotary(fake(2, 4, 8, 16), folding=False).ours


@pytest.mark.parametrize("out_grad", [True, None])  # None: the output's value unknown, taken as training
def test_interleaved_in_training_left_as_written(monkeypatch, out_grad):
    monkeypatch.delenv("FUSE_PLUGIN_ROTARY_SITES", raising=False)
    out = None if out_grad is None else fake(2, 4, 8, 16, requires_grad=True)
    d = choice.decide_rotary(fake(2, 4, 8, 16, requires_grad=True), folding=False, interleaved=True, out_value=out)
    assert not d.ours and "interleaved rotary that needs a gradient" in d.reason and "6590" in d.reason, d
    # near misses: on the CPU, folded into attention, or forced, it stays our op
    assert choice.decide_rotary(fake(2, 4, 8, 16, device="cpu"), folding=False, interleaved=True, out_value=out).ours
    assert choice.decide_rotary(fake(2, 4, 8, 16), folding=True, interleaved=True, out_value=out).ours
    monkeypatch.setenv("FUSE_PLUGIN_ROTARY_SITES", "ours")
    assert choice.decide_rotary(fake(2, 4, 8, 16), folding=False, interleaved=True, out_value=out).ours


def test_off_leaves_every_site_reported_and_graph_untouched(monkeypatch):
    q, k = qk()
    cos, sin = tables(q.shape[0], q.shape[2], q.shape[3])
    monkeypatch.setenv("FUSE_PLUGIN_ROTARY_SITES", "off")
    before, after, report = capture(hf_apply, q, k, cos, sin)
    assert before == after and not report.sites, after
    assert len(report.left) == 2 and all(m.kind == "rotary" and "ROTARY_SITES=off" in m.reason
                                         for m in report.left), report.left
    monkeypatch.setenv("FUSE_PLUGIN_ROTARY_SITES", "ours")
    _, after, report = capture(hf_apply, q, k, cos, sin)
    assert report.count("rotary") == 2 and "fuse_plugin.rotary_qk" in after, after


def test_bad_value_names_the_switch(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_ROTARY_SITES", "maybe")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_ROTARY_SITES"):
        choice.decide_rotary(fake(2, 4, 8, 16), folding=False)
