"""The op's inference form: ``need_lse=False`` (ops/attention.py).

An inference site's op skips the logsumexp where a family pays for it (PyTorch's efficient kernels),
as SDPA does under no_grad (issue 28's kernel table: Swin-T's stage-1 windows 0.181 vs
0.173 ms with and without it, H100). Here, on the CPU: the rewrite passes it exactly where no input
of a site needs a gradient and the site does not read the lse itself; under autograd the op ignores
it (the backward reads the lse); the families ask ATen for no lse (fake CUDA tensors, the calls
recorded). The GPU numbers are tests/test_attention_efficient.py's.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import rewrite_aot_eager
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import attention as K
from fuse_plugin.kernels import registry
from fuse_plugin.patterns import attention, rewrite

OP = torch.ops.fuse_plugin.attention.default


@pytest.fixture(autouse=True)
def ours(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")


def hand_written(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def padded(q, k, v, keep):  # an SDPA call with a bool mask: the rewrite zeroes its dead rows from the lse
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def op_kwargs(fn, *args):
    """The kwargs of every attention op the rewrite put in fn's graph."""
    got = []

    def backend(gm, example_inputs):
        rewrite(gm)
        got.extend(dict(n.kwargs) for n in gm.graph.nodes if n.target is OP)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    torch._dynamo.reset()
    return got


def qkv(requires_grad=False, L=8):
    torch.manual_seed(0)
    return [torch.randn(2, 3, L, 16, dtype=torch.float64, requires_grad=requires_grad) for _ in range(3)]


def test_an_inference_site_asks_for_no_lse():
    assert op_kwargs(hand_written, *qkv()) == [{"need_lse": False}]
    with torch.no_grad():
        assert op_kwargs(hand_written, *qkv(requires_grad=True)) == [{"need_lse": False}]


def test_a_training_site_keeps_it():
    assert op_kwargs(hand_written, *qkv(requires_grad=True)) == [{}]


def test_a_site_that_reads_its_lse_keeps_it():
    """The SDPA site with a mask: rows masked everywhere are found from the lse (_zero_dead_rows)."""
    keep = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    assert op_kwargs(padded, *qkv(), keep) == [{}]


def test_inference_and_training_match_eager():
    """Compiled (rewrite + AOTAutograd) in both modes against eager, float64: the inference form's
    output, and under autograd the gradients (the op computes the lse there regardless)."""
    for grad in (False, True):
        args = qkv(requires_grad=grad)
        want = hand_written(*args)
        torch._dynamo.reset()
        got = torch.compile(hand_written, backend=rewrite_aot_eager)(*args)
        torch._dynamo.reset()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        if grad:
            dout = torch.randn_like(want)
            torch.testing.assert_close(torch.autograd.grad(got, args, dout), torch.autograd.grad(want, args, dout),
                                       rtol=1e-12, atol=1e-12)


def test_the_op_under_autograd_ignores_it():
    """A direct call with need_lse=False whose inputs need gradients: the backward still works."""
    q, k, v = qkv(requires_grad=True)
    out, lse = OP(q, k, v, None, 0.0, False, 0.25, None, 0.0, None, 0, False)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout))
    with torch.no_grad():  # the inference form: the same output
        torch.testing.assert_close(OP(q, k, v, None, 0.0, False, 0.25, None, 0.0, None, 0, False)[0], ref)


class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family, aten, L, bias, honoured", [
    ("efficient", torch.ops.aten._scaled_dot_product_efficient_attention.default, 49, True, True),
    # cuDNN computes its lse unless the class measured it faster without (choice_table.lse_free):
    # without, it measured 1-4% slower on causal rows (H100, stop 28), 3% faster at D64 full 4k (stop 39)
    ("cudnn", torch.ops.aten._scaled_dot_product_cudnn_attention.default, 1024, False, False),
    ("cudnn", torch.ops.aten._scaled_dot_product_cudnn_attention.default, 1024, False, True),
], ids=["efficient", "cudnn", "cudnn-measured-faster-without"])
@pytest.mark.parametrize("need_lse", [True, False])
def test_the_families_ask_aten_for_no_lse(monkeypatch, family, aten, L, bias, honoured, need_lse):
    """On fake CUDA tensors, the family forced: ATen's compute_log_sumexp is need_lse where the
    family honours it, and the lse returned has the op's shape either way."""
    from fuse_plugin.kernels import attention_hopper, choice_table

    if family == "cudnn":  # the class's "infer" time below its "fwd" time, or not
        monkeypatch.setattr(choice_table, "lookup", lambda device, key: {
            "fwd": {"cudnn": 24.0}, "infer": {"cudnn": 22.0 if honoured else 25.0}})
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(attention_hopper, "capability", lambda device: (9, 0))
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        b = torch.empty(1, 4, L, L, device="cuda", dtype=torch.bfloat16).expand(2, 4, L, L) if bias else None
        with registry.forced(family), Calls() as rec:
            out, lse = K.attention_forward(q, k, v, b, is_causal=False, scale=0.125, need_lse=need_lse)
    asked = [args for func, args in rec.calls if func is aten]
    assert len(asked) == 1 and asked[0][4] is (need_lse or not honoured)
    assert out.shape == (2, 4, L, 64) and lse.shape == (2, 4, L) and lse.dtype == torch.float32


def test_a_folded_rotary_drops_it():
    """HF's rotary folded into an inference site: rope_attention (which has no need_lse) takes the
    site's other arguments, and the compiled inference matches eager."""
    from test_rope_attention import hf_attention, hf_inputs

    args = hf_inputs()
    targets = []

    def backend(gm, example_inputs):
        rewrite(gm)
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(hf_attention, backend=backend)(*args)
    torch._dynamo.reset()
    assert torch.ops.fuse_plugin.rope_attention.default in targets and OP not in targets
    torch.testing.assert_close(got, hf_attention(*args), rtol=1e-5, atol=1e-5)
