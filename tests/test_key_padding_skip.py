"""Padding (issue 31): the general kernels skip the key blocks a per-key padding mask hides
(kernels/key_range.py: the live key range [k_lo, k_hi) per batch[/head], computed on the device;
the kernels' KEY_RANGE cuts the forward's and dQ's key loops and the dK/dV programs' query loops).

Kernels on the CPU run in Triton's interpreter (tiny shapes, ``key_range.MIN_KEYS`` lowered so that
the skip is taken at them), against a float64 reference with the mask applied as eager does: a bool
mask as -inf, a float bias added (finfo.min rows with no visible key are eager's uniform average).
Every output is allocated NaN (``poisoned``), so an element a kernel skipped without writing fails.
No timing here (benchmarks/padding.py, on a GPU)."""
import pytest
import torch
from helpers import DEVICE, INTERPRETER, check_close

from fuse_plugin import settings
from fuse_plugin.kernels import attention_general, key_range
from fuse_plugin.kernels.attention import AttentionConfig, Rope, attention_backward, attention_forward

kernels_here = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETER, reason="the Triton kernels run on a GPU "
                                  "or, on the CPU, in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)")
SKIPPED = ("attention_fwd_kernel", "attention_bwd_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel")
CFG = AttentionConfig(16, 16, 4, 1)
MIN = torch.finfo(torch.float32).min


@pytest.fixture
def skip_small(monkeypatch):
    """The skip taken from two key blocks on (tiny shapes), its switch on; records KEY_RANGE of
    every general launch: ``launches`` [(kernel name, KEY_RANGE)]."""
    monkeypatch.setattr(key_range, "MIN_KEYS", 1)
    monkeypatch.setenv(settings.KEY_PADDING_SKIP, "on")  # off by default until measured on a GPU
    launches = []
    real = attention_general.launch

    def spy(kernel, *args, **kwargs):
        launches.append((kernel.__name__, kwargs.get("KEY_RANGE")))
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(attention_general, "launch", spy)
    return launches


def keep_of(lens, Lk, left=False):
    """(B, Lk) bool: the first ``lens[b]`` keys (right padding) or the last (left padding)."""
    pos = torch.arange(Lk)[None]
    lens = torch.tensor(lens)[:, None]
    keep = pos >= Lk - lens if left else pos < lens
    return keep.to(DEVICE)


def padding_bias(keep, form, Hq, Lq):
    """(B, Hq, Lq, Lk) view of a padding mask, query (and head) stride 0: bool keep, or a float
    bias of 0 / finfo.min or 0 / -inf. ``keep`` may be (B, Hq, Lk) (a mask per head)."""
    if form == "bool":
        b = keep
    else:
        b = torch.zeros(keep.shape, device=DEVICE).masked_fill(~keep, MIN if form == "min" else float("-inf"))
    b = b[:, None, None, :] if b.dim() == 2 else b[:, :, None, :]
    return b.expand(b.shape[0], Hq, Lq, b.shape[-1])


def reference(q, k, v, bias, causal, scale):
    """float64 attention (GQA by repeating k/v), the mask as eager applies it."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias.double()
    if causal:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def run(q, k, v, bias, causal, config=CFG, deterministic=False, dout=None, **kw):
    """(out, lse, dq, dk, dv, dout) of the launchers."""
    scale = q.shape[-1] ** -0.5
    out, lse = attention_forward(q, k, v, bias, is_causal=causal, scale=scale, config=config, **kw)
    dout = torch.randn_like(out) if dout is None else dout
    dq, dk, dv, _ = attention_backward(dout, q, k, v, bias, out, lse, is_causal=causal, scale=scale,
                                       need_dbias=False, config=config, deterministic=deterministic, **kw)
    return out, lse, dq, dk, dv, dout


def check_against_reference(q, k, v, bias, causal, tol=1e-5, **kw):
    out, lse, dq, dk, dv, dout = run(q, k, v, bias, causal, **kw)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, bias, causal, q.shape[-1] ** -0.5)
    grads = torch.autograd.grad(want, leaves, dout.double())
    check_close("out", out, want, tol)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        check_close(name, got, r, tol)
    return dq, dk, dv


def inputs(B, Hq, Hkv, Lq, Lk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, 16, generator=g)
    k, v = (torch.randn(B, Hkv, Lk, 16, generator=g) for _ in range(2))
    return (t.to(DEVICE, dtype) for t in (q, k, v))


# ------------------------------------------------------------------------------------ the table


def test_key_ranges_table():
    keep = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    want = [[[1, 5]], [[0, 6]], [[0, 6]]]  # a row with no visible key: the full range
    for form in ("bool", "min", "-inf"):
        table = key_range.key_ranges(padding_bias(keep.to(DEVICE), form, 3, 4))
        assert table.dtype == torch.int32 and table.is_contiguous()
        assert table.cpu().tolist() == want, form
    # fp16 / bf16: their own finfo.min; anything below it too
    for dt in (torch.float16, torch.bfloat16):
        b = torch.tensor([[torch.finfo(dt).min, 0.0, -1e3, torch.finfo(dt).min]], dtype=dt)
        assert key_range.key_ranges(b[:, None, None, :].expand(1, 2, 3, 4)).tolist() == [[[1, 3]]]
    # a mask per head: one row per (batch, head); one row for every batch when it is broadcast
    per_head = torch.tensor([[[1, 0, 0], [0, 0, 1]]], dtype=torch.bool)
    assert key_range.key_ranges(per_head[:, :, None, :].expand(1, 2, 5, 3)).tolist() == [[[0, 1], [2, 3]]]
    shared = torch.tensor([0, 1, 0], dtype=torch.bool)
    assert key_range.key_ranges(shared.expand(4, 2, 5, 3)).tolist() == [[[1, 2]]]


def test_when_it_is_taken(monkeypatch):
    q = torch.randn(2, 2, 300, 64, device="meta")
    keep = torch.ones(2, 1, 1, 300, dtype=torch.bool, device="meta").expand(2, 2, 300, 300)
    from fuse_plugin.kernels.call import AttentionCall

    def taken(bias=keep, L=300, **kw):
        qq = q[:, :, :L]
        b = bias[..., :L, :L] if bias is not None else None
        call = AttentionCall.forward(qq, qq, qq, b, is_causal=kw.pop("causal", False), scale=0.125, **kw)
        return key_range.wanted(call, 64)

    monkeypatch.delenv(settings.KEY_PADDING_SKIP, raising=False)
    assert not taken()  # the default (auto): too small a problem to be measured faster
    big = torch.randn(32, 12, 1024, 64, device="meta")
    keys = torch.ones(32, 1, 1, 1024, dtype=torch.bool, device="meta").expand(32, 12, 1024, 1024)
    auto = AttentionCall.forward(big, big, big, keys, is_causal=False, scale=0.125)
    assert key_range.wanted(auto, 128)  # the smallest measured win
    assert not key_range.wanted(AttentionCall.forward(big[:16], big[:16], big[:16], keys[:16], is_causal=False,
                                                      scale=0.125), 128)  # half its work
    monkeypatch.setenv(settings.KEY_PADDING_SKIP, "1")  # a boolean spelling
    assert taken()
    monkeypatch.setenv(settings.KEY_PADDING_SKIP, "on")
    assert taken() and taken(causal=True)
    assert not taken(L=key_range.MIN_KEYS - 1)  # too short
    assert not taken(bias=None)
    assert not taken(bias=torch.ones(2, 2, 300, 300, dtype=torch.bool, device="meta"))  # varies over queries
    assert not taken(causal=True, window=64)
    monkeypatch.setenv(settings.KEY_PADDING_SKIP, "off")
    assert not taken()
    monkeypatch.setenv(settings.KEY_PADDING_SKIP, "maybe")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_KEY_PADDING_SKIP must be auto or one of"):
        taken()


# ------------------------------------------------------------------------------------ kernels

CASES = [  # (lens per batch, Lk, left padding, mask form, causal, Hq, Hkv)
    ([20, 49], 49, False, "min", False, 2, 2),  # right padding, HF's finfo.min
    ([20, 3], 49, True, "min", False, 2, 1),  # left padding, GQA
    ([33, 0], 49, False, "min", False, 2, 2),  # a batch row with no visible key: eager's uniform average
    ([17, 40], 49, False, "-inf", False, 2, 1),
    ([17, 40], 49, False, "bool", False, 2, 2),
    ([5, 130], 200, False, "bool", False, 1, 1),  # many fully padded blocks
    ([17, 49], 49, False, "min", True, 2, 1),  # causal + right padding
    ([30, 10], 49, True, "min", True, 2, 2),  # causal + left padding: rows before the first key are uniform
    ([16, 2], 17, False, "min", False, 2, 2),  # two key blocks, the second one key
    ([1], 1, False, "min", False, 1, 1),  # one key: nothing to skip
]


@kernels_here
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "pair"])
@pytest.mark.parametrize("lens, Lk, left, form, causal, hq, hkv", CASES)
def test_kernels_match_float64(poisoned, skip_small, deterministic, lens, Lk, left, form, causal, hq, hkv):
    q, k, v = inputs(len(lens), hq, hkv, Lk, Lk)
    keep = keep_of(lens, Lk, left)
    bias = padding_bias(keep, form, hq, Lk)
    cfg = AttentionConfig(32, 32, 4, 1) if Lk > 100 else CFG
    dq, dk, dv = check_against_reference(q, k, v, bias, causal, config=cfg, deterministic=deterministic)
    if Lk > 16:
        assert {kr for name, kr in skip_small if name in SKIPPED} == {True}, skip_small
    # hidden keys of rows that have a visible key get exact zeros (causal + left padding: the
    # rows before the first key give the keys before it their uniform weights)
    for b, n in enumerate(lens):
        if n and not (causal and left):
            hidden = ~keep[b]
            assert (dk[b][:, hidden] == 0).all() and (dv[b][:, hidden] == 0).all()


@kernels_here
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "pair"])
def test_a_mask_per_head(poisoned, skip_small, deterministic):
    """A padding mask that varies over the query heads of a GQA group: one range per (batch, head);
    a dK/dV program walks each head's own rows."""
    lens = torch.tensor([[5, 40, 49, 20], [33, 1, 17, 49]])
    keep = (torch.arange(49)[None, None] < lens[..., None]).to(DEVICE)
    q, k, v = inputs(2, 4, 2, 30, 49)
    check_against_reference(q, k, v, padding_bias(keep, "min", 4, 30), False, deterministic=deterministic)
    check_against_reference(q, k, v, padding_bias(keep, "bool", 4, 30), False, deterministic=deterministic)


@kernels_here
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "pair"])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_padded_blocks_are_never_read(poisoned, skip_small, deterministic, causal):
    """k and v are NaN from the first fully padded key block on (and, with left padding, before the
    last fully padded one): a visited block would bring 0 * NaN into its rows. Everything matches
    the reference of the unpadded keys, and dk/dv there are exact zeros."""
    q, k, v = inputs(2, 2, 1, 40, 64)
    keep = torch.cat([keep_of([20], 64), keep_of([33], 64, left=True)])
    bias = padding_bias(keep, "bool", 2, 40)
    k_nan, v_nan = k.clone(), v.clone()
    for t in (k_nan, v_nan):
        t[0, :, 32:] = float("nan")  # batch 0: keys [0, 20) live, blocks of 16 from 32 on padded
        if not causal:
            t[1, :, :16] = float("nan")  # batch 1: keys [31, 64) live (causal: rows < 31 see [0, i])
    out, lse, dq, dk, dv, dout = run(q, k_nan, v_nan, bias, causal, deterministic=deterministic)
    want = run(q, k, v, bias, causal, deterministic=deterministic, dout=dout)
    if causal:  # rows before batch 1's first key have no visible key: NaN as in eager, in both
        live = torch.ones(2, 1, 40, 1, dtype=torch.bool, device=DEVICE)
        live[1, :, :31] = False
        assert out[1, :, :31].isnan().all() and want[0][1, :, :31].isnan().all()
        out, ref_out = out.masked_fill(~live, 0), want[0].masked_fill(~live, 0)
    else:
        ref_out = want[0]
    assert torch.equal(out, ref_out)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), want[2:5]):
        assert not got.isnan().any(), name
        torch.testing.assert_close(got, r, rtol=1e-6, atol=1e-6)
    assert (dk[0, :, 32:] == 0).all() and (dv[0, :, 32:] == 0).all()


@kernels_here
def test_bf16(poisoned, skip_small):
    q, k, v = inputs(2, 2, 2, 40, 49, dtype=torch.bfloat16)
    keep = keep_of([17, 40], 49)
    bias = padding_bias(keep, "min", 2, 40).to(torch.bfloat16)
    check_against_reference(q, k, v, bias, False, tol=2e-2)


@kernels_here
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "pair"])
@pytest.mark.parametrize("extra", ["causal", "dropout_softcap", "rope"])
def test_switch_off_gives_the_same_numbers(poisoned, skip_small, monkeypatch, deterministic, extra):
    """FUSE_PLUGIN_KEY_PADDING_SKIP=off: every key block visited (the dense padding vector); the same
    forward bit for bit (hidden blocks add exact zeros) and the same gradients (up to the order of
    the dK/dV accumulation over query blocks). With dropout, a softcap, rope."""
    q, k, v = inputs(2, 2, 1, 33, 33)  # (Lq == Lk: one rope table serves q and k)
    bias = padding_bias(keep_of([10, 20], 33, left=True), "min", 2, 33)
    causal = extra == "causal"
    kw = {}
    if extra == "dropout_softcap":
        kw = dict(dropout_p=0.25, dropout_seed=torch.tensor(7, dtype=torch.int64, device=DEVICE), softcap=3.0)
    if extra == "rope":
        angle = torch.arange(33, device=DEVICE, dtype=torch.float32)[:, None] * torch.rand(8, device=DEVICE)
        kw = dict(rope=Rope(angle.cos(), angle.sin(), False, 16))
    on = run(q, k, v, bias, causal, deterministic=deterministic, **kw)
    assert {kr for name, kr in skip_small if name in SKIPPED} == {True}
    skip_small.clear()
    monkeypatch.setenv(settings.KEY_PADDING_SKIP, "off")
    off = run(q, k, v, bias, causal, deterministic=deterministic, dout=on[5], **kw)
    assert {kr for name, kr in skip_small if name in SKIPPED} == {False}
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    for name, a, b in zip(("dq", "dk", "dv"), on[2:5], off[2:5]):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@kernels_here
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "pair"])
def test_a_learned_bias_keeps_todays_path(poisoned, skip_small, deterministic):
    """A (B, 1, 1, Lk) float bias whose gradient is wanted (need_dbias: a requires_grad bias): the
    backward keeps every key block (today's path, dbias written whole). The forward cannot tell (a
    learned bias looks the same there) and skips: exact all the same, as a key at <= finfo.min
    weighs 0 wherever its row has a visible key (kernels/key_range.py)."""
    q, k, v = inputs(2, 2, 2, 20, 49)
    raw = torch.randn(2, 1, 1, 49, device=DEVICE).masked_fill(~keep_of([17, 40], 49)[:, None, None], MIN)
    bias = raw.expand(2, 2, 20, 49)
    scale = 0.25
    out, lse = attention_forward(q, k, v, bias, is_causal=False, scale=scale, config=CFG)
    dout = torch.randn_like(out)
    dq, dk, dv, dbias = attention_backward(dout, q, k, v, bias, out, lse, is_causal=False, scale=scale,
                                           need_dbias=True, config=CFG, deterministic=deterministic)
    assert {kr for name, kr in skip_small if name in SKIPPED[1:]} == {False}, skip_small
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, raw)]
    want = reference(*leaves[:3], leaves[3].expand(2, 2, 20, 49), False, scale)
    grads = torch.autograd.grad(want, leaves, dout.double())
    check_close("out", out, want, 1e-5)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        check_close(name, got, r, 1e-5)
    check_close("dbias", dbias.sum((1, 2), keepdim=True), grads[3], 1e-5)
