"""The attention op's replace mask: a finite masked_fill / where next to additive terms, fused exactly.

    s = where(replace, bias, q·kᵀ·scale [softcapped] + bias)     [then is_causal]

* kernels (fuse_plugin.kernels.attention, on the GPU or in Triton's CPU interpreter): forward, lse
  and every gradient (dq, dk, dv, dbias) of the general kernels, atomic and deterministic backward,
  fp32 and bf16, against float64 autograd of that math; rows whose every score is replaced; every
  output starts as NaN (poisoned);
* the CPU reference (ops/reference.py) against the same, the op (opcheck, autograd, errors), and
  the kernel choice (no TMA / Gluon kernel with a replace mask);
* the matcher (patterns/attention_bias.py): a bias added before a finite fill (DeBERTa-v2) and a
  finite fill followed by an additive mask (GPT-2, Inductor's sfdp_19), also where the additive
  term is itself a mask (the fuzzer's seeds 196 / 405 / 453 of stop 14), fused with parity of the
  output and every gradient (q, k, v and the learned bias) in rows masked everywhere; near misses
  left alone.
"""
import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, check_close, capture, chosen_family, rel_err, rewrite_aot_eager
from torch._dynamo.utils import counters

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import attention as attn
from fuse_plugin.ops import reference

OPS = torch.ops.fuse_plugin
FMIN = torch.finfo(torch.float32).min
NEG_INF = float("-inf")
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning")  # the interpreter's finfo.min * log2(e) (-inf: weight 0)


def eager(q, k, v, bias, replace, causal, scale, softcap=0.0):
    """The op's math, in q's dtype, GQA by repeating k/v."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = torch.where(replace, bias, s + bias)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, NEG_INF)
    return s.softmax(-1) @ v


def make_problem(B, Hq, Hkv, Lq, Lk, D, replace_shape, seed=0, device=DEVICE):
    """q, k, v, a float bias (B, 1, Lq, Lk) and a replace mask. Row 3 is replaced everywhere with
    finfo.min (uniform weights, no gradient into q·kᵀ), row 5 everywhere with -1e9 on some keys and
    finfo.min on the others (uniform over the -1e9 keys); elsewhere the replaced scores take the
    bias's own (learned) values."""
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(B, Hq, Lq, D, generator=g)
    k = 2 * torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    bias = 3 * torch.randn(B, 1, Lq, Lk, generator=g)
    if replace_shape == "keys":  # (B, 1, 1, Lk): padding-like, broadcast over heads and queries
        replace = torch.rand(B, 1, 1, Lk, generator=g) > 0.6
    else:  # (B, 1, Lq, Lk), broadcast over heads
        replace = torch.rand(B, 1, Lq, Lk, generator=g) > 0.5
        if Lq > 3:
            replace[:, :, 3] = True
            bias[:, :, 3] = FMIN
        if Lq > 5:
            replace[:, :, 5] = True
            bias[:, :, 5] = torch.where(torch.arange(Lk) % 3 == 0, -1e9, FMIN)
    return [t.to(device) for t in (q, k, v, bias, replace)]


KERNEL_CASES = {
    # name: (B, Hq, Hkv, Lq, Lk, D, causal, dtype, softcap, replace shape, config, deterministic)
    "gqa-lq17-lk33-atomic": (2, 4, 2, 17, 33, 16, False, torch.float32, 0.0, "full", (16, 16, 4, 1), False),
    "lq33-lk17-keys-deterministic": (1, 2, 1, 33, 17, 16, False, torch.float32, 0.0, "keys", (16, 16, 4, 1), True),
    "lq1": (2, 2, 2, 1, 17, 16, False, torch.float32, 0.0, "full", None, False),
    "d80-split-causal-softcap": (1, 2, 2, 17, 17, 80, True, torch.float32, 3.0, "full", (16, 16, 4, 1, True), False),
    "bf16-gqa-atomic": (1, 4, 2, 17, 33, 16, False, torch.bfloat16, 0.0, "full", (16, 16, 4, 1), False),
    "bf16-lk1-deterministic": (1, 2, 2, 17, 1, 16, False, torch.bfloat16, 0.0, "full", (16, 16, 4, 1), True),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernels_vs_float64(case, poisoned):
    """Forward, lse and all gradients of the general kernels against float64 autograd."""
    B, Hq, Hkv, Lq, Lk, D, causal, dtype, softcap, rshape, config, deterministic = KERNEL_CASES[case]
    q, k, v, bias, replace = make_problem(B, Hq, Hkv, Lq, Lk, D, rshape)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    scale = D ** -0.5
    # bf16: out 1e-2; gradients 2e-2, as dS is rounded to bf16 before its dots (without a replace
    # mask the same problems measure the same 1-1.2% on dq/dk: tests/test_attention_kernel.py's
    # inputs are less peaked)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    gtol = 1e-5 if dtype == torch.float32 else 2e-2
    dout = torch.randn(B, Hq, Lq, D, device=DEVICE).to(dtype)
    leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
    want = eager(*leaves, replace, causal, scale, softcap)
    want.backward(dout.double())

    cfg = attn.AttentionConfig(*config) if config else None
    b4, r4 = bias.expand(B, Hq, Lq, Lk), replace.expand(B, Hq, Lq, Lk)
    out, lse = attn.attention_forward(q, k, v, b4, is_causal=causal, scale=scale, config=cfg,
                                      softcap=softcap, replace=r4)
    check_close("out", out, want, tol)
    _, want_lse = reference.attention_forward(*(t.detach() for t in leaves[:3]), leaves[3].detach().expand(b4.shape),
                                              causal, scale, softcap=softcap, replace=r4)
    check_close("lse", lse, want_lse, 1e-5)
    dq, dk, dv, ds = attn.attention_backward(dout, q, k, v, b4, out, lse, is_causal=causal, scale=scale,
                                             need_dbias=True, config=cfg, deterministic=deterministic,
                                             softcap=softcap, replace=r4)
    for name, got, leaf in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        check_close(name, got, leaf.grad, gtol)
    check_close("dbias", ds.sum(1, keepdim=True), leaves[3].grad, gtol)
    if rshape == "full" and Lq > 5:  # rows replaced everywhere: no gradient into q at all
        assert torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3]))
        assert torch.equal(dq[:, :, 5], torch.zeros_like(dq[:, :, 5]))


# --------------------------------------------------------------------------- reference and op


@pytest.mark.parametrize("causal,softcap,rshape", [(False, 0.0, "full"), (True, 2.5, "full"), (False, 0.0, "keys")])
def test_reference_vs_float64(causal, softcap, rshape):
    """ops/reference.py (the op's CPU kernel) against float64 autograd, every gradient."""
    q, k, v, bias, replace = make_problem(2, 4, 2, 7, 9, 8, rshape, seed=1, device="cpu")
    q, k, v, bias = (t.double() for t in (q, k, v, bias))
    dout = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    want = eager(*leaves, replace, causal, 0.5, softcap)
    want.backward(dout)
    b4, r4 = bias.expand(2, 4, 7, 9), replace.expand(2, 4, 7, 9)
    out, _ = reference.attention_forward(q, k, v, b4, causal, 0.5, softcap=softcap, replace=r4)
    assert rel_err(out, want) < 1e-12
    dq, dk, dv, ds = reference.attention_backward(dout, q, k, v, b4, causal, 0.5, True, softcap=softcap, replace=r4)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert rel_err(got, leaf.grad) < 1e-12
    assert rel_err(ds.sum(1, keepdim=True), leaves[3].grad) < 1e-12


def _op_samples():
    q, k, v, bias, replace = make_problem(2, 4, 2, 5, 7, 8, "full", seed=2, device="cpu")
    q, k, v, bias = (t.requires_grad_() for t in (q, k, v, bias))
    yield (q, k, v, bias, 0.0, False, 0.5), {"replace": replace}
    yield (q, k, v, bias, 0.0, True, 0.5, None, 0.0, replace[:, :, :1]), {}
    yield (q, k, v, bias, 0.3, False, 0.5, torch.tensor(7, dtype=torch.int64)), {"softcap": 2.0, "replace": replace}


@pytest.mark.parametrize("i", range(3))
def test_opcheck(i):
    args, kwargs = list(_op_samples())[i]
    torch.library.opcheck(OPS.attention.default, args, kwargs, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_op_autograd_matches_eager():
    """The op's autograd (q, k, v and the bias) equals eager's where(replace, bias, s + bias)."""
    q, k, v, bias, replace = make_problem(1, 2, 2, 6, 6, 16, "full", seed=3, device="cpu")
    q, k, v, bias = (t.double().requires_grad_() for t in (q, k, v, bias))
    out, _ = OPS.attention(q, k, v, bias, 0.0, False, 0.25, replace=replace)
    want = eager(q, k, v, bias, replace, False, 0.25)
    g = torch.randn_like(out)
    got_g = torch.autograd.grad(out, (q, k, v, bias), g)
    want_g = torch.autograd.grad(want, (q, k, v, bias), g)
    assert rel_err(out, want) < 1e-12
    for a, b in zip(got_g, want_g):
        assert rel_err(a, b) < 1e-12
    # an all-False mask is the plain op
    none = torch.zeros_like(replace)
    assert torch.equal(OPS.attention(q, k, v, bias, 0.0, False, 0.25, replace=none)[0],
                       OPS.attention(q, k, v, bias, 0.0, False, 0.25)[0])


@pytest.mark.parametrize("what", ["dtype", "no_bias", "bool_bias", "shape"])
def test_bad_replace(what):
    q, k, v, bias, replace = make_problem(1, 2, 2, 3, 5, 8, "full", device="cpu")
    if what == "dtype":
        replace, match = replace.float(), "replace must be a bool tensor"
    elif what == "no_bias":
        bias, match = None, "replace needs a floating-point attn_bias"
    elif what == "bool_bias":
        bias, match = bias > 0, "replace needs a floating-point attn_bias"
    else:
        replace, match = replace[..., :4], "does not broadcast to the scores"
    with pytest.raises(ValueError, match=match):
        OPS.attention(q, k, v, bias, 0.0, False, 1.0, replace=replace)


@pytest.mark.parametrize("kernel,name", [("fwd", "tma"), ("fwd", "gluon"), ("bwd", "tma_pair"), ("bwd", "gluon")])
def test_no_tma_or_gluon_with_replace(monkeypatch, kernel, name):
    """A table entry naming a TMA/Gluon kernel yields to the general kernels (which take the replace
    mask); a user-given config naming one raises."""
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    bias = torch.zeros(1, 2, 64, 64)
    replace = torch.zeros(1, 2, 64, 64, dtype=torch.bool)
    entry = attn.AttentionConfig(128, 64, 4, 2, False, name)
    assert chosen_family(monkeypatch, kernel, entry, q, bias=bias, replace=replace) in ("general", "two_kernel")
    with pytest.raises(ValueError, match="replace mask"):
        chosen_family(monkeypatch, kernel, entry, q, bias=bias, replace=replace, config=entry)


def test_user_tma_config_with_replace_raises():
    q = torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    bias = torch.zeros(1, 1, 16, 16, device=DEVICE)
    replace = torch.zeros(1, 1, 16, 16, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="no bias, dropout, softcap, replace mask"):
        attn.attention_forward(q, q, q, bias, is_causal=False, scale=0.1, replace=replace,
                               config=attn.AttentionConfig(64, 64, 4, 1, False, "tma"))


# --------------------------------------------------------------------------- the matcher

B, H, L, D = 2, 2, 6, 16


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def _keep(dead_batch=True):
    """(B, L) keys kept: batch 0 left-padded by 2 (with a causal mask its rows 0-1 see no key),
    batch 1 with every key padded (all its rows masked everywhere), or, without `dead_batch`, its
    last 3 keys."""
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[0, :2] = False
    keep[1, 3 if not dead_batch else 0:] = False
    return keep


def _pad_additive(keep, value=FMIN):
    return torch.zeros(B, 1, 1, L).masked_fill(~keep[:, None, None, :], value)


class BiasThenFill(torch.nn.Module):
    """DeBERTa-v2's order: a learned (relative-position-like) bias and a term from q, added to the
    scores, then the finite padding fill over queries and keys."""

    def __init__(self, fill=FMIN):
        super().__init__()
        self.rel = torch.nn.Parameter(torch.randn(1, H, L, L))
        self.proj = torch.nn.Parameter(torch.randn(D, L) / 4)
        self.fill = fill

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.25 + self.rel + q @ self.proj
        keep4 = keep[:, None, :, None] & keep[:, None, None, :]
        s = s.masked_fill(~keep4, self.fill)
        return F.softmax(s, dim=-1) @ v


class FillThenAdditive(torch.nn.Module):
    """GPT-2 / sfdp_19's order: where(causal, s, finfo.min), then the additive padding mask (and a
    learned bias after it: its gradient where the fill holds too)."""

    def __init__(self, pad_value=FMIN, learned=True, used_elsewhere=False):
        super().__init__()
        self.rel = torch.nn.Parameter(torch.randn(1, H, L, L)) if learned else None
        self.pad_value, self.used_elsewhere = pad_value, used_elsewhere

    def forward(self, q, k, v, keep):
        s = torch.where(_causal(L), q @ k.transpose(-1, -2) * 0.25, FMIN)
        if self.used_elsewhere:
            filled = s
        s = s + _pad_additive(keep, self.pad_value)
        if self.rel is not None:
            s = s + self.rel
        out = F.softmax(s, dim=-1) @ v
        return (out, filled.amax(-1)) if self.used_elsewhere else out


class MaskTermThenFill(torch.nn.Module):
    """An additive term that is itself a mask (-inf or finfo.min padding) before a finite causal
    fill: in a row masked everywhere the padded keys fall below the fill value (the fuzzer's
    seeds 196 / 405 / 453 of stop 14, wrong without the replace mask)."""

    def __init__(self, pad_value):
        super().__init__()
        self.pad_value = pad_value

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.25 + _pad_additive(keep, self.pad_value)
        s = s.masked_fill(~_causal(L), -1e9)
        return F.softmax(s, dim=-1) @ v


class FillNotAMaskValue(torch.nn.Module):
    """Near miss: a fill with -5 (a score value, not a mask value) next to an additive mask."""

    def forward(self, q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~_causal(L), -5.0) + _pad_additive(keep)
        return F.softmax(s, dim=-1) @ v


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3)]


def differential(module, backend=rewrite_aot_eager, fused=1, tol=1e-5, keep=None):
    """module compiled against eager: `fused` attention sites; the output(s) and the gradients of
    q, k, v and every parameter. (No score is -inf everywhere in a row here: no NaN.)"""
    import copy

    torch.manual_seed(0)
    ours = copy.deepcopy(module)
    qkv = _inputs()
    ours_in = [t.detach().clone().requires_grad_() for t in qkv]
    keep = _keep() if keep is None else keep
    torch._dynamo.reset()
    counters.clear()
    ref = module(*qkv, keep)
    out = torch.compile(ours, backend=backend)(*ours_in, keep)
    assert counters["fuse_plugin"]["attention"] == fused
    refs, outs = (x if isinstance(x, tuple) else (x,) for x in (ref, out))
    for r, o in zip(refs, outs):
        assert not o.isnan().any() and rel_err(o, r) <= tol, rel_err(o, r)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(r.shape, generator=g) for r in refs]
    torch.autograd.backward(refs, grads)
    torch.autograd.backward(outs, grads)
    named = [("dq", qkv[0], ours_in[0]), ("dk", qkv[1], ours_in[1]), ("dv", qkv[2], ours_in[2])]
    named += [(f"d{n}", p, dict(ours.named_parameters())[n]) for n, p in module.named_parameters()]
    for name, a, b in named:
        assert a.grad is not None and b.grad is not None, name
        err = rel_err(b.grad, a.grad)
        assert err <= 10 * tol, f"{name}: rel err {err:.2e}"
    return refs, outs, qkv, ours_in


def _op_node(module):
    """The rewritten graph's attention node (the rewrite alone, on the Dynamo graph)."""
    from fuse_plugin.patterns import attention as pat
    from fuse_plugin.patterns.report import Report

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=grab, fullgraph=True)(*_inputs(), _keep())
    gm = graphs[0]
    report = Report()
    pat.rewrite(gm, report)
    ops = [n for n in gm.graph.nodes if n.target is pat.ATTENTION_OP]
    return ops, report


def test_bias_then_fill_expect():
    """DeBERTa-v2's order: one op, bias = where(filled, finfo.min, terms), replace = the fill mask,
    no q·kᵀ-side row zeroing."""
    (op,), report = _op_node(BiasThenFill())
    replace = op.kwargs["replace"]
    assert op.args[5] is False  # no is_causal
    bias = op.args[3]
    assert bias.target is torch.where and bias.args[0] is replace and bias.args[1] == pytest.approx(FMIN)
    assert op.args[0].op == "placeholder"  # q as it is
    assert "replace mask (finite fill)" in report.sites[0].detail


def test_fill_then_additive_expect():
    """sfdp_19's order: bias = where(~causal, finfo.min, 0) + padding + the learned term, replace =
    ~causal (the causal fill stays in the bias: is_causal would change the rows masked everywhere)."""
    (op,), report = _op_node(FillThenAdditive())
    assert op.args[5] is False and "replace" in op.kwargs
    assert "kept in the bias" in report.sites[0].detail and "replace mask" in report.sites[0].detail


def test_additive_only_keeps_the_old_call():
    """Without a finite fill, the op is called as before (no replace argument)."""
    class AdditiveOnly(torch.nn.Module):
        def forward(self, q, k, v, keep):
            return F.softmax(q @ k.transpose(-1, -2) * 0.25 + _pad_additive(keep), dim=-1) @ v

    (op,), _ = _op_node(AdditiveOnly())
    assert "replace" not in op.kwargs and len(op.args) == 7


def test_bias_then_fill_parity():
    """Rows masked everywhere (padded queries, batch 1): uniform weights, no gradient into q·kᵀ or
    into the overwritten bias, as eager."""
    refs, outs, qkv, ours_in = differential(BiasThenFill())
    # batch 1: every row filled everywhere: q's only gradient comes from the term q @ proj, which the
    # fill overwrites: zero, in eager and here
    assert torch.equal(qkv[0].grad[1], torch.zeros(H, L, D))
    assert torch.equal(ours_in[0].grad[1], torch.zeros(H, L, D))


def test_fill_then_additive_parity_inductor():
    """sfdp_19's order through the real backend (Inductor on the CPU)."""
    differential(FillThenAdditive(), backend="fuse_plugin")


@pytest.mark.parametrize("pad_value", [NEG_INF, FMIN], ids=["-inf", "finfo.min"])
def test_fill_then_mask_additive_parity(pad_value):
    """The padding added after the causal fill is -inf or finfo.min (finfo.min + finfo.min = -inf)."""
    # (-inf: batch 1 keeps some keys, else its rows are -inf everywhere, NaN; batch 0's rows 0-1
    # are then uniform over the causally hidden keys, finfo.min, the padded ones being -inf)
    differential(FillThenAdditive(pad_value=pad_value, learned=False), keep=_keep(pad_value != NEG_INF))


@pytest.mark.parametrize("pad_value", [NEG_INF, FMIN], ids=["-inf", "finfo.min"])
def test_mask_term_then_fill_parity(pad_value):
    """The fuzzer's stop-14 failures: an additive mask before a finite fill, rows masked everywhere
    (batch 1, and batch 0's left-padded rows under the causal fill): exact with the replace mask."""
    differential(MaskTermThenFill(pad_value), keep=_keep(pad_value != NEG_INF))


def test_near_miss_fill_not_a_mask_value():
    module = FillNotAMaskValue()
    _, _, report = capture(module, *_inputs(), _keep())
    assert report.count("attention") == 0
    assert "not a mask value" in report.misses[0].reason
    differential(module, fused=0)


def test_near_miss_filled_scores_used_elsewhere():
    module = FillThenAdditive(used_elsewhere=True)
    _, _, report = capture(module, *_inputs(), _keep())
    assert report.count("attention") == 0
    assert "also used elsewhere" in report.misses[0].reason
    differential(module, fused=0)
