"""Logit softcapping (Gemma 2, Grok): scores c·tanh(q·kᵀ·scale / c) before the bias and masks.

* kernels (fuse_plugin.kernels.attention, on the GPU or in Triton's CPU interpreter): forward and
  every gradient (dq, dk, dv, dbias) of the general kernels, atomic and deterministic backward,
  against float64 autograd of the eager math; every output starts as NaN (poisoned);
* the CPU reference (ops/reference.py) against the same, and the op (opcheck, autograd, errors);
* kernel choice: the TMA and Gluon families have no softcap, so a table entry naming them yields
  to the general kernels and a user config naming them raises;
* the matcher: `tanh(s / c) * c` (and spellings) between the scaling and the mask is fused with the
  op's softcap; near misses are left alone with a reason.
"""
import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from helpers import DEVICE, check_close, chosen_family, rel_err, rewrite_aot_eager

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import attention as attn
from fuse_plugin.kernels.attention_tiles import _tanh
from fuse_plugin.ops import reference

OPS = torch.ops.fuse_plugin
NEG_INF = float("-inf")
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning")


def eager(q, k, v, bias, causal, scale, softcap):
    """The eager math (Gemma 2's order: scale, softcap, mask, softmax) in q's dtype, GQA by
    repeating k/v."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * scale
    s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s.masked_fill(~bias, NEG_INF) if bias.dtype == torch.bool else s + bias
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, NEG_INF)
    return s.softmax(-1) @ v


def make_bias(kind, B, Hq, Lq, Lk):
    if kind is None:
        return None
    if kind == "float":  # per (batch, query, key), broadcast over heads; learned: gets dbias
        return 3 * torch.randn(B, 1, Lq, Lk, device=DEVICE)
    keep = torch.rand(B, 1, Lq, Lk, device=DEVICE) > 0.4
    keep[..., 0] = True  # no fully masked row
    return keep


KERNEL_CASES = {
    # name: (B, Hq, Hkv, Lq, Lk, D, causal, bias, softcap, scale, config, deterministic)
    "gqa-causal-floatbias-dbias-lq17-lk33": (2, 4, 2, 17, 33, 16, True, "float", 5.0, None, (16, 16, 4, 1), False),
    "noncausal-boolbias-d80-split": (1, 2, 2, 17, 17, 80, False, "bool", 2.0, None, (16, 16, 4, 1, True), False),
    "causal-nobias-lq33-lk17-deterministic": (1, 2, 1, 33, 17, 16, True, None, 3.0, 0.7, (16, 16, 4, 1), True),
    "lq1-nobias": (2, 2, 2, 1, 17, 16, False, None, 1.5, 0.9, None, False),
    "lk1-causal-floatbias-deterministic": (1, 2, 2, 17, 1, 16, True, "float", 4.0, None, (16, 16, 4, 1), True),
    "d80-gqa-floatbias-default-tiles": (1, 4, 2, 17, 17, 80, False, "float", 50.0, 2.0, None, False),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernels_vs_float64(case, poisoned):
    """fp32 forward, lse and all gradients of the general kernels against float64 autograd."""
    B, Hq, Hkv, Lq, Lk, D, causal, bias_kind, softcap, scale, config, deterministic = KERNEL_CASES[case]
    torch.manual_seed(0)
    scale = D ** -0.5 if scale is None else scale
    # scores of several times the cap, so that tanh saturates in places (the interesting part)
    q = 2 * torch.randn(B, Hq, Lq, D, device=DEVICE)
    k = 2 * torch.randn(B, Hkv, Lk, D, device=DEVICE)
    v = torch.randn(B, Hkv, Lk, D, device=DEVICE)
    bias = make_bias(bias_kind, B, Hq, Lq, Lk)
    dout = torch.randn(B, Hq, Lq, D, device=DEVICE)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_bias = bias.double().requires_grad_() if bias_kind == "float" else bias
    want = eager(*leaves, ref_bias, causal, scale, softcap)
    want.backward(dout.double())

    cfg = attn.AttentionConfig(*config) if config else None
    b4 = bias.expand(B, Hq, Lq, Lk) if bias is not None else None
    out, lse = attn.attention_forward(q, k, v, b4, is_causal=causal, scale=scale, config=cfg,
                                      softcap=softcap)
    check_close("out", out, want, 1e-5)
    rb4 = ref_bias.detach().expand(B, Hq, Lq, Lk) if bias is not None else None
    _, want_lse = reference.attention_forward(*(t.detach() for t in leaves), rb4, causal, scale, softcap=softcap)
    check_close("lse", lse, want_lse, 1e-5)
    need_dbias = bias_kind == "float"
    dq, dk, dv, ds = attn.attention_backward(dout, q, k, v, b4, out, lse, is_causal=causal,
                                             scale=scale, need_dbias=need_dbias, config=cfg,
                                             deterministic=deterministic, softcap=softcap)
    for name, got, leaf in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        check_close(name, got, leaf.grad, 1e-5)
    if need_dbias:
        check_close("dbias", ds.sum(1, keepdim=True), ref_bias.grad, 1e-5)


@triton.jit
def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    tl.store(Y + offs, _tanh(x), mask=offs < N)


def test_tanh_helper_accuracy():
    """The kernels' tanh (exp2 only, a polynomial near 0) against torch.tanh in float64, across the
    polynomial / formula switch and into saturation."""
    x = torch.cat([torch.linspace(-30, 30, 401), torch.linspace(-0.2, 0.2, 101),
                   torch.tensor([0.0, 0.125, -0.125, 0.12499, 1e-30, -1e-6, 88.0, -100.0])]).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    err = ((y.double() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert err < 2e-6, f"relative error {err:.3g}"


# --------------------------------------------------------------------------- reference and op


@pytest.mark.parametrize("causal,bias_kind", [(True, "float"), (False, "bool"), (True, None)])
def test_reference_vs_float64(causal, bias_kind):
    """ops/reference.py (the op's CPU kernel) against float64 autograd, every gradient."""
    torch.manual_seed(1)
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 8
    q, k, v = (2 * torch.randn(B, h, l, D, dtype=torch.float64) for h, l in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    bias = make_bias(bias_kind, B, Hq, Lq, Lk)
    bias = bias.double().cpu() if bias_kind == "float" else (bias.cpu() if bias is not None else None)
    dout = torch.randn(B, Hq, Lq, D, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rb = bias.clone().requires_grad_() if bias_kind == "float" else bias
    want = eager(*leaves, rb, causal, 0.5, 2.5)
    want.backward(dout)
    b4 = bias.expand(B, Hq, Lq, Lk) if bias is not None else None
    out, _ = reference.attention_forward(q, k, v, b4, causal, 0.5, softcap=2.5)
    assert rel_err(out, want) < 1e-12
    dq, dk, dv, ds = reference.attention_backward(dout, q, k, v, b4, causal, 0.5, bias_kind == "float", softcap=2.5)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert rel_err(got, leaf.grad) < 1e-12
    if bias_kind == "float":
        assert rel_err(ds.sum(1, keepdim=True), rb.grad) < 1e-12


def _op_samples():
    torch.manual_seed(2)
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, requires_grad=True)
    v = torch.randn(2, 2, 7, 8, requires_grad=True)
    bias = torch.randn(2, 1, 5, 7, requires_grad=True)
    yield (q, k, v, None, 0.0, True, 0.5), {"softcap": 3.0}
    yield (q, k, v, bias, 0.0, False, 0.5, None, 2.0), {}
    yield (q, k, v, bias, 0.3, True, 0.5, torch.tensor(12345, dtype=torch.int64)), {"softcap": 1.5}


@pytest.mark.parametrize("i", range(3))
def test_opcheck(i):
    args, kwargs = list(_op_samples())[i]
    torch.library.opcheck(OPS.attention.default, args, kwargs, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_op_autograd_and_default():
    """The op's autograd through the softcap equals eager's; softcap=0 is the old op."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = OPS.attention(q, k, v, None, 0.0, True, 0.25, softcap=4.0)
    want = eager(q, k, v, None, True, 0.25, 4.0)
    g = torch.randn_like(out)
    got_g = torch.autograd.grad(out, (q, k, v), g)
    want_g = torch.autograd.grad(want, (q, k, v), g)
    assert rel_err(out, want) < 1e-12
    for a, b in zip(got_g, want_g):
        assert rel_err(a, b) < 1e-12
    plain, _ = OPS.attention(q, k, v, None, 0.0, True, 0.25)
    assert torch.equal(plain, OPS.attention(q, k, v, None, 0.0, True, 0.25, softcap=0.0)[0])
    assert not torch.allclose(plain, out)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_bad_softcap(bad):
    q = torch.randn(1, 1, 3, 8)
    with pytest.raises(ValueError, match="softcap"):
        OPS.attention(q, q, q, None, 0.0, False, 1.0, softcap=bad)


# --------------------------------------------------------------------------- kernel choice


@pytest.mark.parametrize("kernel,name", [("fwd", "tma"), ("fwd", "gluon"), ("fwd", "gluon_pingpong"),
                                         ("bwd", "tma"), ("bwd", "tma_pair"), ("bwd", "gluon"),
                                         ("bwd", "gluon_lpt")])
def test_no_tma_or_gluon_with_softcap(monkeypatch, kernel, name):
    """A table entry naming a TMA/Gluon kernel yields to the general kernels (which take the
    softcap); a user-given config naming one raises."""
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    entry = attn.AttentionConfig(128, 64, 4, 2, False, name)
    assert chosen_family(monkeypatch, kernel, entry, q, softcap=5.0) in ("general", "two_kernel")
    with pytest.raises(ValueError, match="softcap"):
        chosen_family(monkeypatch, kernel, entry, q, softcap=5.0, config=entry)
    for ok in ("general",) + (("two_kernel",) if kernel == "bwd" else ()):
        general = attn.AttentionConfig(32, 32, 4, 1, False, ok)
        assert chosen_family(monkeypatch, kernel, general, q, softcap=5.0, config=general) == ok


def test_user_tma_config_with_softcap_raises():
    q = torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="no bias, dropout, softcap"):
        attn.attention_forward(q, q, q, None, is_causal=False, scale=0.1, softcap=5.0,
                               config=attn.AttentionConfig(64, 64, 4, 1, False, "tma"))


# --------------------------------------------------------------------------- the matcher


class Softcapped(torch.nn.Module):
    """Gemma 2's eager attention: scale, softcap, additive mask, fp32 softmax, ·v."""

    def __init__(self, spelling="div", cap=5.0, cap_out=None, where="before_mask", scale=0.25):
        super().__init__()
        self.spelling, self.cap, self.cap_out, self.where, self.scale = spelling, cap, cap_out, where, scale
        self.learned_cap = torch.nn.Parameter(torch.tensor(float(cap)))

    def forward(self, q, k, v, mask):
        c, out_c = self.cap, self.cap if self.cap_out is None else self.cap_out
        s = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if self.where == "after_mask":
            s = s + mask
        if self.spelling == "div":
            s = s / c
            s = torch.tanh(s)
            s = s * out_c
        elif self.spelling == "mul_inverse":
            s = out_c * (s * (1.0 / c)).tanh()
        elif self.spelling == "no_multiply_back":
            s = torch.tanh(s / c)
        elif self.spelling == "shift_inside":
            s = torch.tanh((s + 1.0) / c) * out_c
        elif self.spelling == "scale_after":
            s = torch.tanh(s / c) * out_c * 2.0
        elif self.spelling == "tensor_multiply":
            s = torch.tanh(s / c) * self.learned_cap
        elif self.spelling == "twice":
            s = torch.tanh(torch.tanh(s / c) * out_c / c) * out_c
        if self.where == "before_mask":
            s = s + mask
        w = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)


def _inputs(lq=6, lk=6):
    torch.manual_seed(4)
    q = (3 * torch.randn(2, 2, lq, 16)).requires_grad_()
    k = (3 * torch.randn(2, 2, lk, 16)).requires_grad_()
    v = torch.randn(2, 2, lk, 16, requires_grad=True)
    keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    keep = keep[None, None].expand(2, 1, lq, lk).clone()
    keep[0, ..., :2] = False  # left padding: rows 0-1 of batch 0 see no key (finite fill)
    mask = torch.zeros(2, 1, lq, lk).masked_fill(~keep, torch.finfo(torch.float32).min)
    return q, k, v, mask


def _compile_and_compare(module, expect_fused):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    inputs = _inputs()
    want = module(*inputs)
    want_g = torch.autograd.grad(want.sum(), inputs[:3])
    compiled = torch.compile(module, backend=rewrite_aot_eager, fullgraph=True)
    got = compiled(*inputs)
    got_g = torch.autograd.grad(got.sum(), inputs[:3])
    assert counters["fuse_plugin"]["attention"] == (1 if expect_fused else 0)
    assert rel_err(got, want) <= 1e-5
    for a, b in zip(got_g, want_g):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("spelling", ["div", "mul_inverse"])
def test_matcher_fuses_softcap(spelling):
    _compile_and_compare(Softcapped(spelling), expect_fused=True)


def test_matcher_expect_graph():
    """The rewritten graph holds one attention op with softcap=5.0 and the scale 0.25, no tanh."""
    from fuse_plugin.patterns import attention as pat
    from fuse_plugin.patterns.report import Report

    gm = _dynamo_graph(Softcapped(), _inputs())
    report = Report()
    pat.rewrite(gm, report)
    ops = [n for n in gm.graph.nodes if n.target is pat.ATTENTION_OP]
    assert len(ops) == 1 and ops[0].kwargs == {"softcap": 5.0}
    assert ops[0].args[6] == pytest.approx(0.25)
    assert not any("tanh" in str(n.target) for n in gm.graph.nodes)
    assert "softcap=5" in report.sites[0].detail


# Constant factors around the tanh distribute over the masks: A·tanh(B·s) is the softcap A of the
# scores scaled by A·B (`_softcap`), so these are softcaps too, fused with (cap, scale):
REWRITTEN = {
    "mismatched": (dict(cap=4.0, cap_out=6.0), 6.0, 0.25 * 6.0 / 4.0),  # tanh(s / 4) · 6
    "no_multiply_back": (dict(spelling="no_multiply_back", cap=4.0), 1.0, 0.25 / 4.0),  # tanh(s / 4)
    "scale_after": (dict(spelling="scale_after", cap=4.0), 8.0, 0.25 * 2.0),  # tanh(s / 4) · 4 · 2
}


@pytest.mark.parametrize("name", list(REWRITTEN))
def test_matcher_constant_factors_fold_into_cap_and_scale(name):
    from fuse_plugin.patterns import attention as pat
    from fuse_plugin.patterns.report import Report

    kwargs, cap, scale = REWRITTEN[name]
    gm = _dynamo_graph(Softcapped(**kwargs), _inputs())
    pat.rewrite(gm, Report())
    (op,) = [n for n in gm.graph.nodes if n.target is pat.ATTENTION_OP]
    assert op.kwargs["softcap"] == pytest.approx(cap) and op.args[6] == pytest.approx(scale)
    _compile_and_compare(Softcapped(**kwargs), expect_fused=True)


NEAR_MISSES = {
    "shift_inside": "after a mask, a bias or a constant shift",  # tanh((s + 1) / c) · c
    "tensor_multiply": "run-time value",  # tanh(s / c) · a learned 0-d parameter
    "twice": "twice",  # a softcap of a softcap
}


@pytest.mark.parametrize("spelling", list(NEAR_MISSES))
def test_matcher_near_misses(spelling):
    module = Softcapped(spelling)
    reasons = _miss_reasons(module)
    assert any(NEAR_MISSES[spelling] in r for r in reasons), reasons
    _compile_and_compare(module, expect_fused=False)


def test_matcher_softcap_after_mask_refused():
    """tanh over the masked scores squashes the mask (finfo.min or -inf becomes -c, a visible
    key): not the op's softcap, left alone (and eager's result kept)."""
    module = Softcapped(where="after_mask")
    assert any("after a mask" in r for r in _miss_reasons(module))
    _compile_and_compare(module, expect_fused=False)


def _dynamo_graph(module, inputs):
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=grab, fullgraph=True)(*inputs)
    return graphs[0]


def _miss_reasons(module):
    from fuse_plugin.patterns import attention as pat
    from fuse_plugin.patterns.report import Report

    gm = _dynamo_graph(module, _inputs())
    report = Report()
    pat.rewrite(gm, report)
    assert not report.sites
    return [m.reason for m in report.misses if m.kind == "attention"]
