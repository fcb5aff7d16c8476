"""SDPA as a candidate for hand-written attention sites (patterns/choice.py, attention._sdpa_call).

Where the choice table measured SDPA fastest for a site's class (timm's windows, whose fused path
is SDPA; cuDNN's dropout), the rewrite puts an SDPA call in the site's place instead of our op.
Here the table is a synthetic one (no GPU): the decision itself (fastest of ours / Inductor /
SDPA, SDPA only where the site can be one), then parity of the emitted call with eager — outputs
and every gradient in float64 — for each form it handles: plain, causal with a padding mask,
a float bias with rows masked everywhere (eager's NaN kept), Swin's window-periodic bias,
hand-written GQA; a dropout site's graph; and the sites SDPA cannot compute (softcap, a finite
fill), which keep our op."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import rewrite_aot_eager
from models_plain import repeat_kv  # (not test_attention_patterns': it needs expecttest, which the GPU machine lacks)

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import choice_table
from fuse_plugin.patterns import Report, attention, choice, rewrite

SDPA_FASTEST = {"fwd": {"general": 10.0}, "bwd": {"general": 20.0},
                "inductor": {"fwd": 12.0, "train": 40.0}, "sdpa": {"fwd": 5.0, "train": 15.0}}


# --------------------------------------------------------------------------- the decision


def test_decide_from_takes_the_fastest_of_three():
    t = SDPA_FASTEST
    d = choice.decide_from(t, "fwd", "k", sdpa_ok=True)
    assert d.ours and d.as_sdpa and d.reason.startswith("as SDPA: measured 2.00x faster")
    d = choice.decide_from(t, "train", "k", sdpa_ok=True)  # 15 < 30 (ours) < 40 (Inductor)
    assert d.ours and d.as_sdpa
    # the site cannot be an SDPA call: ours (10) against Inductor (12)
    d = choice.decide_from(t, "fwd", "k", sdpa_ok=False)
    assert d.ours and not d.as_sdpa and "than Inductor" in d.reason
    # Inductor fastest: left to it
    t2 = dict(t, inductor={"fwd": 4.0, "train": 10.0})
    d = choice.decide_from(t2, "fwd", "k", sdpa_ok=True)
    assert not d.ours and not d.as_sdpa and d.reason.startswith("left to Inductor")
    # ours fastest: ours, against the faster of the two others
    t3 = dict(t, sdpa={"fwd": 11.0, "train": 45.0})
    d = choice.decide_from(t3, "fwd", "k", sdpa_ok=True)
    assert d.ours and not d.as_sdpa and "than SDPA" in d.reason
    # SDPA measured but not Inductor (an SDPA-only entry) still counts
    d = choice.decide_from({"fwd": t["fwd"], "bwd": t["bwd"], "sdpa": t["sdpa"]}, "fwd", "k", sdpa_ok=True)
    assert d.as_sdpa
    assert choice.decide_from(None, "fwd", "k", sdpa_ok=True) == choice.Decision(True, "")


def test_a_measured_tie_keeps_the_sites_default():
    """Within NOISE (2%) a measured difference is a tie: a hand-written site keeps our op, an SDPA
    call stays SDPA; beyond it the faster one is taken (the llama-8k class measured SDPA 1267.0 vs
    our 1267.1 us on the H200)."""
    tie = {"fwd": {"cudnn": 347.3}, "bwd": {"cudnn": 919.8}, "sdpa": {"fwd": 346.4, "train": 1267.0},
           "inductor": {"fwd": 4051.3, "train": 7899.4}}
    d = choice.decide_from(tie, "train", "k", sdpa_ok=True)
    assert d.ours and not d.as_sdpa and "a tie with SDPA within 2%" in d.reason
    s = choice.decide_sdpa_from(tie, "train", "k")
    assert not s.ours and s.reason.startswith("left as SDPA: measured a tie within 2%")
    clear = dict(tie, sdpa={"fwd": 346.4, "train": 1200.0})  # SDPA 5.6% faster: taken
    assert choice.decide_from(clear, "train", "k", sdpa_ok=True).as_sdpa
    ours_clear = dict(tie, sdpa={"fwd": 346.4, "train": 1350.0})  # ours 6% faster: an SDPA call becomes ours
    assert choice.decide_sdpa_from(ours_clear, "train", "k").ours


# H100 llama-512-fp32 (Llama 8x512's attention in float32, GQA 16/4), microseconds: SDPA's
# efficient kernel takes the call with k/v repeated, enable_gqa falls to the math path
FP32_GQA = {"fwd": {"general": 506.59}, "bwd": {"general": 1691.34}, "inductor": {"fwd": 391.19, "train": 1027.13},
            "sdpa": {"fwd": 767.92, "train": 1575.56}, "sdpa_repeat": {"fwd": 229.62, "train": 747.92}}


def test_a_gqa_site_may_become_sdpa_on_repeated_kv():
    for mode in ("fwd", "train"):
        d = choice.decide_from(FP32_GQA, mode, "k", sdpa_ok=True, gqa=True)
        assert d.ours and d.as_sdpa and d.repeat_kv, d
        assert d.reason.startswith("as SDPA with k/v repeated: measured")
    # near misses: a site without GQA has no repeated call (Inductor is the fastest left), one that
    # cannot be an SDPA call neither
    d = choice.decide_from(FP32_GQA, "fwd", "k", sdpa_ok=True, gqa=False)
    assert not d.ours and not d.repeat_kv and d.reason.startswith("left to Inductor")
    d = choice.decide_from(FP32_GQA, "fwd", "k", sdpa_ok=False, gqa=True)
    assert not d.ours and not d.as_sdpa
    # bf16 (H100 llama-512): enable_gqa's flash call is the faster SDPA call; a tie keeps our op
    bf16 = {"fwd": {"general": 22.94, "cudnn": 23.41}, "bwd": {"cudnn": 96.37}, "inductor": {"fwd": 135.52, "train": 339.52},
            "sdpa": {"fwd": 22.5, "train": 117.97}, "sdpa_repeat": {"fwd": 51.63, "train": 155.36}}
    d = choice.decide_from(bf16, "fwd", "k", sdpa_ok=True, gqa=True)
    assert d.ours and not d.as_sdpa and "a tie with SDPA within 2%" in d.reason
    d = choice.decide_from(dict(bf16, sdpa={"fwd": 20.0, "train": 100.0}), "fwd", "k", sdpa_ok=True, gqa=True)
    assert d.as_sdpa and not d.repeat_kv and d.reason.startswith("as SDPA: measured")


# --------------------------------------------------------------------------- the rewrite


@pytest.fixture
def sdpa_measured_fastest(monkeypatch):
    """Every site's class measured as SDPA_FASTEST on a (pretended) GPU."""
    monkeypatch.delenv("FUSE_PLUGIN_SITE_CHOICE", raising=False)
    real = choice.class_of

    def class_of(site):
        key, mode, _ = real(site)
        return key, mode, torch.device("cuda")

    monkeypatch.setattr(choice, "class_of", class_of)
    monkeypatch.setattr(choice_table, "lookup", lambda device, key: SDPA_FASTEST)


def rewritten(fn, *args):
    """(the rewritten graph's call targets, the report) for fn(*args)."""
    out = {}

    def backend(gm, example_inputs):
        out["report"] = rewrite(gm)
        out["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    torch._dynamo.reset()
    return out["targets"], out["report"]


def check_parity(fn, *args, grads=True):
    """fn compiled (rewrite + AOTAutograd) against eager: outputs (NaN where eager's are) and the
    gradients of every float input, float64, where eager's are finite (a row masked everywhere
    makes eager's gradients NaN over its head; SDPA's are finite there, ours too)."""
    leaves = [a.detach().clone().requires_grad_(grads and a.is_floating_point()) for a in args]
    want = fn(*leaves)
    torch._dynamo.reset()
    got = torch.compile(fn, backend=rewrite_aot_eager)(*[a.detach().clone().requires_grad_(b.requires_grad)
                                                         for a, b in zip(args, leaves)])
    torch._dynamo.reset()
    assert torch.equal(got.isnan(), want.isnan()), "NaN rows differ from eager's"
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-9, atol=1e-9)
    if not grads:
        return
    dout = torch.randn_like(want)
    live = ~want.isnan()
    want_g = torch.autograd.grad(want[live], [x for x in leaves if x.requires_grad], dout[live])
    args2 = [a.detach().clone().requires_grad_(b.requires_grad) for a, b in zip(args, leaves)]
    torch._dynamo.reset()
    got_out = torch.compile(fn, backend=rewrite_aot_eager)(*args2)
    torch._dynamo.reset()
    got_g = torch.autograd.grad(got_out[live], [x for x in args2 if x.requires_grad], dout[live])
    for g, w in zip(got_g, want_g):  # (eager's NaN from a row masked everywhere is not reproduced)
        finite = w.isfinite()
        torch.testing.assert_close(g[finite], w[finite], rtol=1e-9, atol=1e-9)
        assert finite.any() and g.isfinite().all()


def qkv(B=2, Hq=4, Hkv=4, L=8, D=16):
    torch.manual_seed(0)
    return (torch.randn(B, Hq, L, D, dtype=torch.float64), torch.randn(B, Hkv, L, D, dtype=torch.float64),
            torch.randn(B, Hkv, L, D, dtype=torch.float64))


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def causal_padding(q, k, v, keep):
    L = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) * 0.3
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def float_bias(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, dim=-1) @ v


def gqa(q, k, v):
    n = q.shape[1] // k.shape[1]
    return torch.softmax(q @ repeat_kv(k, n).transpose(-2, -1) * 0.25, dim=-1) @ repeat_kv(v, n)


def softcapped(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(30.0 * torch.tanh(s / 30.0), dim=-1) @ v


def finite_fill(q, k, v, keep):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep[:, None, None, :], -10000.0)
    return torch.softmax(s, dim=-1) @ v


def dropped(q, k, v):
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1), 0.1, training=True) @ v


def _fused(report: Report):
    return [s.detail for s in report.sites if s.kind == attention.KIND]


def test_plain_site_becomes_sdpa(sdpa_measured_fastest):
    from torch._dynamo.utils import counters

    counters.clear()
    targets, report = rewritten(plain, *qkv())
    assert counters["fuse_plugin"]["attention_as_sdpa"] == 1  # zoo.py's "(N as SDPA)"
    assert F.scaled_dot_product_attention in targets
    assert attention.ATTENTION_OP not in targets
    (detail,) = _fused(report)
    assert "an SDPA call in its place" in detail and "as SDPA: measured" in detail
    check_parity(plain, *qkv())


def test_causal_and_padding(sdpa_measured_fastest):
    keep = torch.arange(8)[None, :] < torch.tensor([8, 5])[:, None]
    targets, _ = rewritten(causal_padding, *qkv(), keep)
    assert F.scaled_dot_product_attention in targets
    check_parity(causal_padding, *qkv(), keep)


def test_float_bias_with_dead_rows_keeps_eager_nan(sdpa_measured_fastest):
    torch.manual_seed(1)
    bias = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    bias[0, 1, 3] = float("-inf")  # a row masked everywhere: NaN in eager
    bias[1, :, :, 6:] = float("-inf")
    targets, _ = rewritten(float_bias, *qkv(), bias)
    assert F.scaled_dot_product_attention in targets
    check_parity(float_bias, *qkv(), bias)


def test_hand_written_gqa(sdpa_measured_fastest):
    args = qkv(Hq=4, Hkv=2)
    targets, report = rewritten(gqa, *args)
    assert F.scaled_dot_product_attention in targets
    assert "GQA" in _fused(report)[0]
    check_parity(gqa, *args)


def test_hand_written_gqa_on_repeated_kv(monkeypatch):
    """Measured as llama-512-fp32: the GQA site becomes an SDPA call on k/v repeated to the query
    heads (no enable_gqa), eager's numbers and gradients; the same site without GQA is left to
    Inductor (the near miss)."""
    monkeypatch.delenv("FUSE_PLUGIN_SITE_CHOICE", raising=False)
    real = choice.class_of
    monkeypatch.setattr(choice, "class_of", lambda site: (real(site)[0], real(site)[1], torch.device("cuda")))
    monkeypatch.setattr(choice_table, "lookup", lambda device, key: FP32_GQA)
    calls = {}

    def backend(gm, example_inputs):
        rewrite(gm)
        calls["sdpa"] = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
        return gm.forward

    args = qkv(Hq=4, Hkv=2)
    torch._dynamo.reset()
    torch.compile(gqa, backend=backend)(*args)
    (call,) = calls["sdpa"]
    assert not call.kwargs.get("enable_gqa") and call.args[1].meta["example_value"].shape[1] == 4
    targets, report = rewritten(gqa, *args)
    assert "GQA: k/v repeated for the SDPA call (2 q heads per kv head)" in _fused(report)[0]
    assert "as SDPA with k/v repeated: measured" in _fused(report)[0]
    check_parity(gqa, *args)
    targets, report = rewritten(plain, *qkv())
    assert F.scaled_dot_product_attention not in targets and attention.ATTENTION_OP not in targets
    assert report.left and "left to Inductor" in report.left[0].reason


def test_swin_window_periodic_bias(sdpa_measured_fastest):
    from models_plain import WindowAttention, shifted_window_mask, swin

    torch.manual_seed(0)
    m = WindowAttention().double()
    x = torch.randn(8, 16, 64, dtype=torch.float64)
    mask = shifted_window_mask().double()
    targets, report = rewritten(lambda x, mk: swin(m, x, mk), x, mask)
    assert F.scaled_dot_product_attention in targets
    assert "an SDPA call" in _fused(report)[0]
    check_parity(lambda x, mk: swin(m, x, mk), x, mask)
    # the module's parameters (the relative-position table) get their gradient too
    torch._dynamo.reset()
    torch.compile(lambda x, mk: swin(m, x, mk), backend=rewrite_aot_eager)(x, mask).sum().backward()
    got = m.relative_position_bias_table.grad.clone()
    m.zero_grad()
    swin(m, x, mask).sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, m.relative_position_bias_table.grad, rtol=1e-9, atol=1e-9)


def test_dropout_site_becomes_sdpa_with_its_p(sdpa_measured_fastest):
    targets, report = rewritten(dropped, *qkv())
    assert F.scaled_dot_product_attention in targets
    assert "dropout p=0.1 in SDPA" in _fused(report)[0]
    torch.manual_seed(0)
    out = torch.compile(dropped, backend=rewrite_aot_eager)(*qkv())
    torch._dynamo.reset()
    assert out.shape == (2, 4, 8, 16) and out.isfinite().all()


@pytest.mark.parametrize("fn", [softcapped, finite_fill])
def test_sites_sdpa_cannot_compute_keep_our_op(sdpa_measured_fastest, fn):
    keep = torch.arange(8)[None, :] < torch.tensor([8, 5])[:, None]
    args = qkv() + ((keep,) if fn is finite_fill else ())
    targets, report = rewritten(fn, *args)
    assert F.scaled_dot_product_attention not in targets
    assert attention.ATTENTION_OP in targets
    assert "as SDPA" not in _fused(report)[0]
    check_parity(fn, *args)


def finite_causal_and_padding(q, k, v, keep):
    """An additive finfo.min causal mask, then a -inf padding fill that hides key 0: row 0 keeps
    only finfo.min scores (eager averages them; the fuzzer's seed 1073)."""
    L = q.shape[-2]
    s = q @ k.transpose(-2, -1) * 0.25 + torch.full((L, L), torch.finfo(q.dtype).min, dtype=q.dtype,
                                                      device=q.device).triu(1)
    return torch.softmax(s.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1) @ v


def added_finite_mask(q, k, v, keep):
    """A keep mask added as zeros.masked_fill(~keep, finfo.min) (the fuzzer's seed 2452): a row
    whose keys it all hides keeps only finfo.min scores."""
    m = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + m, dim=-1) @ v


@pytest.mark.parametrize("fn, keep", [
    (finite_causal_and_padding, torch.arange(8)[None, :] >= torch.tensor([1, 0])[:, None]),  # batch 0: key 0 padded
    (added_finite_mask, ((torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 3 != 0)
     & (torch.arange(8) != 2)[:, None]),  # row 2: every key hidden
], ids=["causal_then_padding", "added_masked_fill"])
def test_finite_mask_values_keep_our_op(monkeypatch, fn, keep):
    """torch 2.13's CPU SDPA backward gives 0 to such a row, eager does not (CUDA's efficient and
    cuDNN backends differ from eager too: the GPU test below): the site keeps our op, whose
    gradients are eager's (attention.why_not_sdpa)."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "sdpa")
    args = qkv() + (keep,)
    targets, report = rewritten(fn, *args)
    assert F.scaled_dot_product_attention not in targets and attention.ATTENTION_OP in targets
    assert "our op: no SDPA call computes a finite mask value" in _fused(report)[0]
    check_parity(fn, *args)


def test_the_emitted_call_is_not_read_again_as_an_sdpa_site(sdpa_measured_fastest):
    """patterns/sdpa.py skips the calls the attention rewrite emitted (one site, one report line)."""
    _, report = rewritten(plain, *qkv())
    assert [s.kind for s in report.sites] == [attention.KIND]
    assert not [m for m in report.left + report.misses if m.kind == "sdpa"]


def test_site_choice_sdpa_switch(monkeypatch):
    """FUSE_PLUGIN_SITE_CHOICE=sdpa, no table: hand-written sites that can be become SDPA calls,
    the others keep our op (with the reason), SDPA call sites stay SDPA."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "sdpa")
    targets, report = rewritten(plain, *qkv())
    assert F.scaled_dot_product_attention in targets and attention.ATTENTION_OP not in targets
    assert "as SDPA (FUSE_PLUGIN_SITE_CHOICE=sdpa)" in _fused(report)[0]
    targets, report = rewritten(softcapped, *qkv())
    assert attention.ATTENTION_OP in targets
    assert "our op: no SDPA call computes a softcap" in _fused(report)[0]
    targets, report = rewritten(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *qkv())
    assert attention.ATTENTION_OP not in targets
    assert [m.reason for m in report.left if m.kind == "sdpa"] == ["left as SDPA (FUSE_PLUGIN_SITE_CHOICE=sdpa)"]


class RelPosAttention(torch.nn.Module):
    """BEiT's hand-written attention: a learned relative-position table gathered by an integer
    index buffer, viewed and permuted into a (1, H, L, L) bias."""

    def __init__(self, H=4, L=8):
        super().__init__()
        self.H, self.L = H, L
        self.table = torch.nn.Parameter(torch.randn(2 * L - 1, H, dtype=torch.float64))
        idx = torch.arange(L)[:, None] - torch.arange(L)[None, :] + L - 1
        self.register_buffer("index", idx)

    def forward(self, q, k, v, extra=None):
        bias = self.table[self.index.view(-1)].view(self.L, self.L, -1).permute(2, 0, 1).contiguous()
        s = q @ k.transpose(-2, -1) * 0.25 + bias.unsqueeze(0)
        if extra is not None:
            s = s + extra
        return torch.softmax(s, dim=-1) @ v


def _dead_row_pass(targets) -> bool:
    return torch.isneginf in targets


def test_a_learned_bias_needs_no_dead_row_pass(sdpa_measured_fastest):
    """A bias of parameters alone (bias_source.py) is -inf on a whole row only where they are: the
    SDPA call takes no extra pass over its output; a bias that is (or adds) an input keeps it."""
    m = RelPosAttention()
    targets, _ = rewritten(m, *qkv())
    assert F.scaled_dot_product_attention in targets and not _dead_row_pass(targets)
    check_parity(m, *qkv())
    torch._dynamo.reset()
    torch.compile(m, backend=rewrite_aot_eager)(*qkv()).sum().backward()
    got = m.table.grad.clone()
    m.zero_grad()
    m(*qkv()).sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, m.table.grad, rtol=1e-9, atol=1e-9)
    extra = torch.zeros(2, 1, 1, 8, dtype=torch.float64)
    extra[1, ..., :] = float("-inf")  # an input bias: rows masked everywhere stay eager's NaN
    targets, _ = rewritten(m, *qkv(), extra)
    assert F.scaled_dot_product_attention in targets and _dead_row_pass(targets)
    check_parity(m, *qkv(), extra)


def test_bias_source_near_misses():
    """What keeps the test: a float buffer, a -inf constant, an op outside the list, float16."""
    from fuse_plugin.patterns.bias_source import from_parameters

    class M(torch.nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how = how
            self.p = torch.nn.Parameter(torch.randn(1, 2, 4, 4))
            self.register_buffer("buf", torch.zeros(1, 2, 4, 4))

        def forward(self, x):
            b = {"param": lambda: self.p * 2.0 + self.p, "buffer": lambda: self.p + self.buf,
                 "inf": lambda: self.p.masked_fill(self.p > 3, float("-inf")), "exp": lambda: self.p.exp().log(),
                 "half": lambda: self.p.half()}[self.how]()
            return x + b

    got = {}
    for how in ("param", "buffer", "inf", "exp", "half"):
        def backend(gm, ex, how=how):
            out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
            got[how] = from_parameters(out.args[1])
            return gm.forward
        torch._dynamo.reset()
        torch.compile(M(how), backend=backend)(torch.randn(1, 2, 4, 4))
    torch._dynamo.reset()
    assert got == {"param": True, "buffer": False, "inf": False, "exp": False, "half": False}


def finite_causal_only(q, k, v):
    """An additive finfo.min causal mask alone (HF's eager mask without padding)."""
    L = q.shape[-2]
    m = torch.full((L, L), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + m, dim=-1) @ v


def test_a_finite_causal_mask_alone_may_become_sdpa(monkeypatch):
    """Every row of a causal mask keeps its own key, so no row carries finite mask values only: the
    guard of the two tests above does not apply, and the site becomes an SDPA call with eager's
    numbers (forward and gradients)."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "sdpa")
    targets, report = rewritten(finite_causal_only, *qkv())
    assert F.scaled_dot_product_attention in targets and attention.ATTENTION_OP not in targets
    check_parity(finite_causal_only, *qkv())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA SDPA backends run on a GPU")
@pytest.mark.parametrize("fn", [finite_causal_and_padding, added_finite_mask], ids=["causal_then_padding",
                                                                                  "added_masked_fill"])
def test_finite_mask_values_keep_our_op_on_cuda(monkeypatch, fn):
    """On CUDA too (SDPA's efficient and cuDNN backward differ from MATH on a row whose every
    visible score carries finfo.min; H100, torch 2.11): the site keeps our op, and the compiled
    function's output and gradients are eager's (float64 on the CPU as the reference)."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "sdpa")
    keep = torch.arange(64)[None, :] >= torch.tensor([1, 0])[:, None]  # batch 0: key 0 padded
    if fn is added_finite_mask:
        keep = ((torch.arange(64)[:, None] + torch.arange(64)[None, :]) % 3 != 0) & (torch.arange(64) != 2)[:, None]
    q, k, v = qkv(L=64, D=32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = fn(*leaves, keep)
    dout = torch.randn_like(want)
    want_g = torch.autograd.grad(want, leaves, dout)
    cuda = [t.float().cuda().requires_grad_() for t in (q, k, v)]
    targets, report = rewritten(fn, *cuda, keep.cuda())
    assert attention.ATTENTION_OP in targets and F.scaled_dot_product_attention not in targets
    assert "no SDPA call computes a finite mask value" in _fused(report)[0]
    torch._dynamo.reset()
    got = torch.compile(fn, backend=rewrite_aot_eager)(*cuda, keep.cuda())
    torch._dynamo.reset()
    got_g = torch.autograd.grad(got, cuda, dout.float().cuda())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got,) + got_g, (want,) + want_g):
        err = ((a.double().cpu() - b).norm() / b.norm()).item()
        assert err < 1e-4, f"{name}: rel err {err:.3g} against eager float64"
