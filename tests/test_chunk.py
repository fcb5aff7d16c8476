"""Chunked attention (issue 31; Llama 4): the op's ``chunk`` (with is_causal, query i sees the keys j of
its chunk, j // C == i // C, up to itself), the general kernels that skip the key blocks outside a
query block's chunks (the sliding window's machinery: attention_tiles._band_lo / _band_end), and the
rewrite that passes proven chunks instead of a bias.

Kernels on the CPU run in Triton's interpreter (tiny shapes, against a float64 reference with the
chunks as a -inf mask); the rewrite's tests run the op's CPU reference. No timing here: the kernel
Must of issue 31 (documents and chunks within 1.25x of the live area's ideal) needs a GPU run."""
import math

import pytest
import torch
from helpers import DEVICE, INTERPRETER, check_close, rewrite_aot_eager
from torch import nn
from test_window import Banded, _rewritten

import fuse_plugin
from fuse_plugin.kernels.attention import AttentionConfig, attention_backward, attention_forward
from fuse_plugin.kernels.call import AttentionCall, window_area

ATTENTION = torch.ops.fuse_plugin.attention.default
kernels_here = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETER, reason="the Triton kernels run on a GPU "
                                  "or, on the CPU, in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)")


def chunks(lq: int, lk: int, chunk: int, device="cpu") -> torch.Tensor:
    """(Lq, Lk) keep mask: j <= i and j // chunk == i // chunk."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j <= i) & (j // chunk == i // chunk)


def reference(q, k, v, chunk, bias=None):
    """float64 attention with the chunks as a -inf mask (GQA by repeating k/v)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~chunks(q.shape[2], k.shape[2], chunk, q.device), float("-inf"))
    return torch.softmax(s, -1) @ v


# ------------------------------------------------------------------------------------ kernels

CASES = [  # (L, chunk, Hq, Hkv, dtype, config of the general family or None: its own tiles)
    (100, 24, 2, 1, torch.float32, AttentionConfig(16, 32, 4, 1)),  # chunks cut blocks both ways, GQA
    (70, 7, 2, 2, torch.float32, None),  # chunks shorter than a block
    (33, 64, 2, 1, torch.float32, None),  # one chunk: plain causal
    (100, 24, 2, 2, torch.bfloat16, None),  # 16-bit, <= 128 keys: the one-key-block backward
]


@kernels_here
@pytest.mark.parametrize("family", ["general", "two_kernel"])
@pytest.mark.parametrize("L, chunk, hq, hkv, dtype, cfg", CASES)
def test_kernels_match_the_chunked_reference(family, L, chunk, hq, hkv, dtype, cfg):
    torch.manual_seed(0)
    q = torch.randn(2, hq, L, 16, device=DEVICE).to(dtype)
    k, v = (torch.randn(2, hkv, L, 16, device=DEVICE).to(dtype) for _ in range(2))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, chunk)
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(want, leaves, dout)
    kw = dict(is_causal=True, scale=16 ** -0.5, chunk=chunk)
    fwd_cfg = cfg if family == "general" else None
    out, lse = attention_forward(q, k, v, None, config=fwd_cfg, **kw)
    det = family == "two_kernel"
    dq, dk, dv, _ = attention_backward(dout.to(dtype), q, k, v, None, out, lse, need_dbias=False, config=cfg,
                                       deterministic=det, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_close("out", out, want, tol)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        check_close(name, got, ref, tol)


@kernels_here
def test_kernels_with_a_bias_and_its_gradient():
    torch.manual_seed(1)
    L, chunk = 90, 40
    q, k, v = (torch.randn(1, 2, L, 16, device=DEVICE) for _ in range(3))
    bias = torch.randn(1, 2, L, L, device=DEVICE)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    want = reference(*leaves[:3], chunk, leaves[3])
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(want, leaves, dout)
    kw = dict(is_causal=True, scale=16 ** -0.5, chunk=chunk)
    out, lse = attention_forward(q, k, v, bias, **kw)
    dq, dk, dv, dbias = attention_backward(dout.float(), q, k, v, bias, out, lse, need_dbias=True, **kw)
    check_close("out", out, want, 1e-5)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), grads):
        check_close(name, got, ref, 1e-5)


def test_live_area_and_flops():
    assert window_area(50, 50, 0, 7) == int(chunks(50, 50, 7).sum())
    assert window_area(30, 50, 0, 8) == int(chunks(30, 50, 8).sum())
    q = torch.randn(1, 1, 8, 16, device="meta")
    call = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.25, chunk=3)
    assert call.flops() == pytest.approx(4.0 * 8 * 8 * 16 * int(chunks(8, 8, 3).sum()) / 64)


# ------------------------------------------------------------------------------------ the op


def test_op_chunk_matches_sdpa_with_the_chunk_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = ATTENTION(q, k, v, None, 0.0, True, 0.25, chunk=16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=chunks(40, 40, 16), scale=0.25)
    torch.testing.assert_close(out, want)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    exp = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(ATTENTION, (q, k, v, None, 0.0, True, 0.25), {"chunk": 16})


@pytest.mark.parametrize("kw, causal, match", [
    (dict(chunk=8), False, "needs is_causal=True"),
    (dict(chunk=-1), True, "chunk must be an int >= 0"),
    (dict(chunk=8, window=4), True, "together"),
])
def test_op_chunk_errors(kw, causal, match):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=match):
        ATTENTION(q, q, q, None, 0.0, causal, 0.25, **kw)


# ------------------------------------------------------------------------------------ the rewrite


@pytest.mark.parametrize("keep", [lambda i, j: (j <= i) & (i // 4 == j // 4),
                                  lambda i, j: (j // 4 == i // 4) & (j <= i)], ids=["causal_first", "chunk_first"])
@pytest.mark.parametrize("additive", [False, True])
def test_causal_chunks_become_the_chunk_argument(keep, additive):
    model = Banded(keep, additive=additive)
    q, k, v = (torch.randn(2, 3, 13, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    calls, out = _rewritten(model, q, k, v)
    assert len(calls) == 1 and calls[0].kwargs.get("chunk") == 4 and "window" not in calls[0].kwargs
    assert calls[0].args[3] is None and calls[0].args[5] is True  # no bias left, is_causal
    want = model(q, k, v)
    torch.testing.assert_close(out, want)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("keep, why", [
    (lambda i, j: i // 4 == j // 4, "no causal mask: block-diagonal, stays a bias"),
    (lambda i, j: (j <= i) & (i // 4 == j // 5), "two chunk sizes"),
    (lambda i, j: (j <= i) & ((i + 1) // 4 == j // 4), "an offset query index"),
    (lambda i, j: (j <= i) & (i // 4 == i // 4), "the query index on both sides"),
])
def test_near_misses_pass_no_chunk(keep, why):
    model = Banded(keep)
    q, k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    calls, out = _rewritten(model, q, k, v)
    assert len(calls) == 1 and "chunk" not in calls[0].kwargs, why
    torch.testing.assert_close(out, model(q, k, v), equal_nan=True)  # (rows some masks hide whole: NaN, as eager)


def test_explain_names_the_chunks():
    model = Banded(lambda i, j: (j <= i) & (i // 4 == j // 4))
    q, k, v = (torch.randn(1, 2, 12, 16) for _ in range(3))
    text = str(fuse_plugin.explain(model, q, k, v))
    assert "chunks of 4 (proved: query i sees keys j with j // 4 == i // 4, j <= i): the kernels skip" in text


def test_chunks_stay_out_of_rope_attention_and_sdpa_calls(monkeypatch):
    """The rope fold and the SDPA-call rewrite take no chunks: the site stays our op with them."""
    from fuse_plugin.patterns import attention

    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "sdpa")
    model = Banded(lambda i, j: (j <= i) & (i // 4 == j // 4))
    q, k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float64) for _ in range(3))
    calls, out = _rewritten(model, q, k, v)
    assert len(calls) == 1 and calls[0].kwargs.get("chunk") == 4  # our op: no SDPA call computes chunks
    torch.testing.assert_close(out, model(q, k, v))
    assert math.isclose(float(calls[0].args[6]), 0.25)
    assert attention.ATTENTION_OP is ATTENTION


class ChunkedSinks(nn.Module):
    """gpt-oss-style sinks (the sink column concatenated, softmax, dropped) over causal chunks."""

    def forward(self, q, k, v, sinks):
        lq = q.shape[-2]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lq)[None, :]
        s = (q @ k.transpose(2, 3) * 0.25).masked_fill(~((j <= i) & (i // 4 == j // 4)), float("-inf"))
        col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, lq, -1)
        return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1] @ v


def test_sinks_with_chunks_keep_the_chunks_in_the_bias():
    """The sinks op takes no chunks: the site is still one sinks op, its chunk mask a bias (the fuzzer
    drew this form), with eager's numbers and gradients."""
    model = ChunkedSinks()
    q, k, v = (torch.randn(2, 4, 11, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    calls = []

    def backend(gm, example_inputs):
        compiled = rewrite_aot_eager(gm, example_inputs)
        calls.extend(n for n in gm.graph.nodes if n.target is torch.ops.fuse_plugin.attention_sinks.default)
        return compiled

    torch._dynamo.reset()
    got = torch.compile(model, backend=backend, fullgraph=True)(q, k, v, sinks)
    assert len(calls) == 1 and "chunk" not in calls[0].kwargs and calls[0].args[3] is not None  # the mask
    want = model(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, sinks)), torch.autograd.grad(want.sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b)
