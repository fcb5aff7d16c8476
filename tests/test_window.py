"""Sliding windows (issue 31): the op's ``window`` (with is_causal, query i sees keys i - W + 1 .. i),
the general kernels that skip the key blocks it hides, and the rewrite that passes a proven window
instead of a bias.

Kernels on the CPU run in Triton's interpreter (tiny shapes, fp32, against a float64 band-mask
reference); the rewrite's tests run the op's CPU reference. Timings are in benchmarks/window.py."""
import math

import pytest
import torch
from torch import nn

import fuse_plugin
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.attention import AttentionConfig, attention_backward, attention_forward
from fuse_plugin.kernels.call import AttentionCall, window_area
from fuse_plugin.patterns.attention import _average_dead_rows
from helpers import DEVICE, INTERPRETER, check_close, needs_interpreter, rewrite_aot_eager

ATTENTION = torch.ops.fuse_plugin.attention.default
# the kernels run on a GPU, or on the CPU in Triton's interpreter (CI)
kernels_here = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETER, reason="the Triton kernels run on a GPU "
                                  "or, on the CPU, in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)")


def band(lq: int, lk: int, window: int, device="cpu") -> torch.Tensor:
    """(Lq, Lk) keep mask: i - window < j <= i."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j <= i) & (j > i - window)


def reference(q, k, v, window, bias=None):
    """float64 attention with the band as a -inf mask (GQA by repeating k/v); rows that see no key
    give 0 (the op gives NaN there, like eager; compared on the live rows)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~band(q.shape[2], k.shape[2], window, q.device), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


# ------------------------------------------------------------------------------------ kernels


CASES = [  # (Lq, Lk, window, Hq, Hkv, config of the general family or None: its own tiles)
    (37, 37, 5, 2, 1, None),  # a short window: the blocks past it are skipped
    (70, 70, 16, 2, 2, AttentionConfig(16, 32, 4, 1)),  # block_n > block_m: edge blocks both sides
    (129, 129, 40, 4, 2, AttentionConfig(32, 16, 4, 1)),  # GQA, a partial last block
    (100, 100, 1, 2, 1, AttentionConfig(16, 32, 4, 1)),  # each query sees itself alone
    (64, 64, 200, 2, 1, None),  # a window past the length: plain causal
    (50, 30, 7, 2, 1, AttentionConfig(16, 32, 4, 1)),  # Lq > Lk: the last rows see no key (NaN, as eager)
    (30, 50, 7, 2, 1, None),  # Lq < Lk
]


@kernels_here
@pytest.mark.parametrize("family", ["general", "two_kernel"])
@pytest.mark.parametrize("lq, lk, window, hq, hkv, cfg", CASES)
def test_kernels_match_the_band_reference(family, lq, lk, window, hq, hkv, cfg):
    torch.manual_seed(lq + window)
    q = torch.randn(1, hq, lq, 16, device=DEVICE)
    k, v = (torch.randn(1, hkv, lk, 16, device=DEVICE) for _ in range(2))
    bias = torch.randn(1, hq, lq, lk, device=DEVICE) if lq == 129 else None  # float bias + its gradient
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if bias is not None:
        bias.requires_grad_()
    want = reference(q, k, v, window, bias)
    cfg = cfg if family == "general" else None
    b4 = None if bias is None else bias.expand(1, hq, lq, lk)
    with registry.forced(family):
        out, lse = attention_forward(q, k, v, b4, is_causal=True, scale=16 ** -0.5, window=window, config=cfg)
        dout = torch.randn_like(out)
        dq, dk, dv, dbias = attention_backward(dout, q, k, v, b4, out, lse, is_causal=True, scale=16 ** -0.5,
                                               need_dbias=bias is not None, window=window, config=cfg,
                                               deterministic=family == "two_kernel")
    live = band(lq, lk, window, out.device).any(-1)  # rows that see a key
    assert torch.isnan(out[:, :, ~live]).all() and torch.isneginf(lse[:, :, ~live]).all()
    check_close("out", out[:, :, live], want[:, :, live], 1e-5)
    grads = torch.autograd.grad(want, [q, k, v] + ([bias] if bias is not None else []), dout.double())
    check_close("dq", dq, grads[0], 1e-5)
    check_close("dk", dk, grads[1], 1e-5)
    check_close("dv", dv, grads[2], 1e-5)
    if bias is not None:
        check_close("dbias", dbias.sum_to_size(bias.shape), grads[3], 1e-5)


@pytest.mark.parametrize("band, why, described", [
    ("window", "no sliding window", "window 16"),
    ("chunk", "no chunks", "chunks of 16"),  # (the op's `chunk`: tests/test_chunk.py)
])
def test_other_families_say_why_not(band, why, described):
    q = torch.randn(1, 2, 64, 64, device="meta")
    call = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.125, **{band: 16})
    reasons = registry.reasons(call)
    assert reasons["general"] is None
    for name in ("cudnn", "decode", "small", "gluon", "tma"):
        if name == "gluon" and band == "window":  # it runs one (test_gluon_window_matches_the_band_reference)
            assert "window" not in reasons[name], reasons[name]
            continue
        assert reasons[name] == f"it takes {why} (the general kernels do)", name
    with registry.forced("cudnn"), pytest.raises(registry.FamilyError, match=why):
        registry.choose(call)
    assert described in call.describe()


def _gluon_why_not():
    from fuse_plugin.kernels import attention_hopper as hopper

    if DEVICE != "cuda":
        return "the Gluon kernels need a CUDA GPU (sm_90 with Triton 3.6); CI runs on the CPU"
    if not (hopper.gluon_fwd.GLUON_AVAILABLE and hopper.gluon_bwd.GLUON_AVAILABLE):
        return "this Triton has no Gluon API the kernels are written for (Triton 3.6)"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the Gluon kernels run on sm_90 (Hopper) only"
    return None


GLUON_WINDOW_CASES = [  # (Lq, Lk, window, Hq, Hkv, D)
    (1000, 1000, 300, 4, 2, 128),  # GQA (its dK / dV partials), a partial last block, an odd window
    (2048, 2048, 512, 2, 2, 128),  # a window of whole blocks: skipped blocks on both sides
    (300, 300, 1, 2, 1, 128),  # each query sees itself alone: every lower-edge block hides whole rows
    (700, 700, 129, 2, 2, 64),  # D 64, a window one key past a block
    (256, 256, 1000, 2, 1, 128),  # a window past the length: plain causal
    (300, 700, 200, 2, 2, 128),  # Lq < Lk
    (17, 17, 5, 2, 1, 128),  # one block
]
GLUON_FWD = {"pingpong": AttentionConfig(128, 128, 4, 2, False, "gluon_pingpong"),
             "plain": AttentionConfig(128, 128, 4, 2, False, "gluon")}


@pytest.mark.skipif(_gluon_why_not() is not None, reason=str(_gluon_why_not()))
@pytest.mark.parametrize("fwd", list(GLUON_FWD), ids=list(GLUON_FWD))
@pytest.mark.parametrize("lq, lk, window, hq, hkv, d", GLUON_WINDOW_CASES)
def test_gluon_window_matches_the_band_reference(monkeypatch, fwd, lq, lk, window, hq, hkv, d):
    """The warp-specialised Gluon forward and backward with a sliding window (bf16) against the
    float64 band reference: out, lse and the three gradients, every output and scratch buffer
    poisoned with NaN first (an element a kernel skipped reads NaN)."""
    from fuse_plugin.kernels import attention_hopper as hopper
    from fuse_plugin.kernels import host
    from helpers import poisoned_empty

    torch.manual_seed(lq + window + d)
    q = torch.randn(1, hq, lq, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, lk, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    scale = d ** -0.5
    monkeypatch.setattr(host, "empty", poisoned_empty)
    launches = {"fwd": 0, "bwd": 0}
    fwd_kernel, bwd_launcher = hopper.gluon_fwd.attention_fwd_gluon_kernel, hopper.gluon_bwd.attention_backward_gluon

    class Spy:
        def __getitem__(self, grid):
            launches["fwd"] += 1
            return fwd_kernel[grid]

    def bwd_spy(*a, **kw):
        launches["bwd"] += 1
        if window < lk:  # (a window past the keys may reach the kernels as plain causal)
            assert kw["window"] == window
        return bwd_launcher(*a, **kw, poison=True)

    monkeypatch.setattr(hopper.gluon_fwd, "attention_fwd_gluon_kernel", Spy())
    monkeypatch.setattr(hopper.gluon_bwd, "attention_backward_gluon", bwd_spy)
    out, lse = attention_forward(q, k, v, None, is_causal=True, scale=scale, window=window, config=GLUON_FWD[fwd])
    dout = torch.randn_like(out)
    dq, dk, dv, _ = attention_backward(dout, q, k, v, None, out, lse, is_causal=True, scale=scale,
                                       need_dbias=False, window=window, deterministic=False,
                                       config=AttentionConfig(64, 128, 8, 2, False, "gluon_lpt"))
    assert launches == {"fwd": 1, "bwd": 1}
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = reference(q64, k64, v64, window)
    g = hq // hkv
    s = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) * scale
    want_lse = s.masked_fill(~band(lq, lk, window, q.device), float("-inf")).logsumexp(-1)
    check_close("out", out.double(), want, 1e-2)
    check_close("lse", lse.double(), want_lse, 1e-3)
    grads = torch.autograd.grad(want, [q64, k64, v64], dout.double())
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        check_close(name, got.double(), ref, 1e-2)


PERSISTENT_CASES = GLUON_WINDOW_CASES + [  # (Lq, Lk, window (0: causal; -1: no mask), Hq, Hkv, D)
    (4096, 4096, 1024, 16, 4, 128),  # 512 tiles: each program walks 3-4 of them (132 SMs)
    (4096, 4096, 0, 16, 4, 128),  # causal, the tiles of unequal length
    (1000, 1000, -1, 8, 8, 64),  # no mask, a partial last block
    (3000, 3000, 0, 33, 33, 64),  # 33 x 24 tiles: 6 per program, one program with fewer
]


@pytest.mark.skipif(_gluon_why_not() is not None, reason=str(_gluon_why_not()))
@pytest.mark.parametrize("lq, lk, window, hq, hkv, d", PERSISTENT_CASES)
def test_gluon_persistent_forward_matches_the_reference(lq, lk, window, hq, hkv, d):
    """The persistent Gluon forward (one program per SM walking tiles; the registry's pick for wide
    windowed problems) against float64: out and lse poisoned with NaN first. (It first ran alone
    under a timeout, as a barrier bug would hang the GPU: 11 passed on an H100, stop 37.)"""
    from fuse_plugin.kernels import attention_fwd_gluon as gf
    from helpers import poisoned_empty

    torch.manual_seed(lq + window + d + hq)
    q = torch.randn(1, hq, lq, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, lk, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    scale = d ** -0.5
    out = poisoned_empty((1, hq, lq, d), dtype=torch.bfloat16, device=DEVICE)
    lse = poisoned_empty((1, hq, lq), dtype=torch.float32, device=DEVICE)
    var = gf.resolve_variant(None, d)._replace(persistent=True)
    causal, w = window >= 0, max(window, 0)
    gf.attention_forward_gluon(q, k, v, is_causal=causal, scale=scale, variant=var, out=out, lse=lse, window=w)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    g = hq // hkv
    s = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if causal:  # (window 0: plain causal, a band wider than the keys)
        s = s.masked_fill(~band(lq, lk, w or lq + lk, q.device), float("-inf"))
    want = torch.softmax(s, -1) @ v64.repeat_interleave(g, 1)
    check_close("out", out.double(), want, 1e-2)
    check_close("lse", lse.double(), s.logsumexp(-1), 1e-3)


@pytest.mark.parametrize("window, d, want", [
    (4096, 128, "gluon"),  # the measured range (stop 35, H100: 0.64-0.70x the general kernels' time)
    (8192, 128, "gluon"),
    (128, 128, "general"),  # narrower (gpt-oss's 128): not measured with the Gluon kernels
    (4096, 64, "general"),  # another head dim: not measured
])
def test_gluon_takes_the_window_only_where_measured(monkeypatch, window, d, want):
    """On an H100 with Triton 3.6 (its platform checks pretended here) the table's Gluon pick runs a
    sliding window only in its measured range; elsewhere the general kernels keep it, as before;
    chunks never (and a forced Gluon family says why)."""
    from fuse_plugin.kernels import attention_hopper as hopper

    monkeypatch.setattr(hopper, "why_not_tma", lambda call: None)
    monkeypatch.setattr(hopper, "why_not_gluon_platform", lambda call: None)
    monkeypatch.setattr(hopper, "why_not_gluon_bwd", lambda call, cfg: None)
    q = torch.zeros(1, 4, 16384, d, device="meta", dtype=torch.bfloat16)
    for direction, entry in (("fwd", AttentionConfig(128, 128, 4, 2, False, "gluon")),
                             ("bwd", AttentionConfig(64, 128, 8, 2, False, "gluon_lpt"))):
        monkeypatch.setattr(registry, "table_config", lambda *a, entry=entry: entry)
        if direction == "fwd":
            call = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.1, window=window)
        else:
            out = torch.zeros_like(q)
            call = AttentionCall.backward(out, q, q, q, None, out, torch.zeros(q.shape[:3], device="meta"),
                                          need_dbias=False, deterministic=False, is_causal=True, scale=0.1,
                                          window=window)
        family, _, why = registry.choose(call)
        assert family.name == want, (direction, why)
        if want == "general":
            assert "not measured with the Gluon kernels" in registry.FAMILIES[direction]["gluon"].declines(call)
    chunked = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.1, chunk=window)
    assert registry.choose(chunked)[0].name == "general"
    with registry.forced("gluon"), pytest.raises(registry.FamilyError, match="it takes no chunks"):
        registry.choose(chunked)


@pytest.mark.parametrize("heads, lq, window, stages, persistent", [
    (32, 16384, 4096, 2, True),    # 4096 query tiles: 0.98-0.99x the per-tile forward, launcher to
    (16, 32768, 4096, 2, True),    # launcher (H100, stop 37, benchmarks/window_forward.py)
    (16, 16384, 4096, 2, False),   # 2048 tiles: 1.08x, the per-tile kernel kept
    (32, 16384, 0, 2, False),      # causal without a window: the persistent kernel measured slower
    (32, 16384, 4096, 3, False),   # 3 K/V stages and the O buffer do not fit an H100's shared memory
])
def test_the_gluon_forward_runs_wide_windows_persistent(monkeypatch, heads, lq, window, stages, persistent):
    """The Gluon forward's tiles for a windowed call: the persistent kernel (one program per SM)
    from GLUON_PERSISTENT_MIN_TILES query tiles, where it measured faster; a caller's config as given."""
    from fuse_plugin.kernels import attention_hopper as hopper
    from fuse_plugin.kernels.attention_config import gluon_variant

    entry = AttentionConfig(128, 128, 4, stages, False, "gluon")
    monkeypatch.setattr(registry, "table_config", lambda *a: entry)
    q = torch.zeros(1, heads, lq, 128, device="meta", dtype=torch.bfloat16)
    call = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.1, window=window)
    cfg = registry.FAMILIES["fwd"]["gluon"].config(call)
    assert (cfg.kernel == "gluon_persistent") == persistent, cfg
    assert cfg[:4] == entry[:4]
    var = gluon_variant(cfg)
    assert var.persistent == persistent and hopper.gluon_fwd.variant_fits(var, 128)
    if persistent:
        assert var.pingpong and (var.m_wg, var.block_n, var.stages) == (64, 128, 2)
    given = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.1, window=window, config=entry)
    assert registry.FAMILIES["fwd"]["gluon"].config(given) == entry


@pytest.mark.parametrize("programs, window, want", [
    (1024, True, 1),   # GQA 32/8 at 16k tokens, W 4096: unsplit measured fastest (H100, stop 38)
    (2048, True, 1),   # 32k tokens: likewise
    (1024, False, 4),  # without a window the causal rule: up to 32 programs per SM
    (128, True, 4),    # a short windowed grid still splits to fill the SMs
])
def test_the_gluon_backward_splits_a_windowed_group_only_to_fill_the_sms(programs, window, want):
    from fuse_plugin.kernels.attention_bwd_gluon import default_group_split

    assert default_group_split(programs, 4, 132, window) == want


def test_window_area_and_flops():
    assert window_area(5, 5, 2) == int(band(5, 5, 2).sum())
    assert window_area(50, 30, 7) == int(band(50, 30, 7).sum())
    q = torch.randn(1, 1, 8, 16, device="meta")
    call = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.25, window=3)
    assert call.flops() == pytest.approx(4.0 * 8 * 8 * 16 * int(band(8, 8, 3).sum()) / 64)


# ------------------------------------------------------------------------------------ the op


def test_op_window_matches_sdpa_with_the_band_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = ATTENTION(q, k, v, None, 0.0, True, 0.25, None, 0.0, None, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band(40, 40, 8), scale=0.25)
    torch.testing.assert_close(out, want)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    exp = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(ATTENTION, (q, k, v, None, 0.0, True, 0.25, None, 0.0, None, 8))


@pytest.mark.parametrize("window, causal, match", [
    (8, False, "needs is_causal=True"),
    (-1, True, "window must be an int >= 0"),
])
def test_op_window_errors(window, causal, match):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=match):
        ATTENTION(q, q, q, None, 0.0, causal, 0.25, None, 0.0, None, window)


# ------------------------------------------------------------------------------------ the rewrite


class Banded(nn.Module):
    """Hand-written attention with a band mask from aranges; ``additive``: HF's form (a float mask,
    where(keep, 0, finfo.min), added to the scores), else a -inf masked_fill; ``pad``: a key-padding
    bool mask beside it."""

    def __init__(self, keep, additive=False, pad=False):
        super().__init__()
        self.keep, self.additive, self.pad = keep, additive, pad

    def forward(self, q, k, v, pad_keep=None):
        lq, lk = q.shape[-2], k.shape[-2]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        keep = self.keep(i, j)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if self.additive:
            s = s + torch.where(keep, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)
        else:
            s = s.masked_fill(~keep, float("-inf"))
        if pad_keep is not None:
            s = s.masked_fill(~pad_keep[:, None, None, :], float("-inf"))
        return s.softmax(-1) @ v


def _rewritten(model, *args):
    """The op calls of the rewritten graph, and the model's output through it (AOTAutograd and
    the op's autograd on the CPU reference: gradients flow)."""
    calls = []

    def backend(gm, example_inputs):
        compiled = rewrite_aot_eager(gm, example_inputs)  # (rewrites gm in place first)
        calls.extend(n for n in gm.graph.nodes if n.target is ATTENTION)
        return compiled

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    return calls, out


@pytest.mark.parametrize("additive", [False, True])
def test_causal_band_becomes_the_window_argument(additive):
    model = Banded(lambda i, j: (j <= i) & (j > i - 4), additive=additive)
    q, k, v = (torch.randn(2, 3, 12, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    calls, out = _rewritten(model, q, k, v)
    assert len(calls) == 1 and calls[0].kwargs.get("window") == 4
    assert calls[0].args[3] is None and calls[0].args[5] is True  # no bias left, is_causal
    want = model(q, k, v)
    torch.testing.assert_close(out, want)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    exp = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)


def test_window_beside_a_padding_mask():
    """-inf fills: the window becomes the argument, the padding stays the bias."""
    model = Banded(lambda i, j: (j <= i) & (j > i - 3))
    q, k, v = (torch.randn(2, 2, 10, 16, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, 7:] = False
    calls, out = _rewritten(model, q, k, v, pad)
    assert len(calls) == 1 and calls[0].kwargs.get("window") == 3 and calls[0].args[3] is not None
    torch.testing.assert_close(out, model(q, k, v, pad), equal_nan=True)


class OneFill(nn.Module):
    """HF's eager mask builders: causal, the window and the key padding ANDed into ONE bool, made a
    float mask `where(keep, 0, fill)` and added once (fill: finfo.min of the dtype unless given);
    ``second_fill``: the padding as a second fill instead (a near miss); ``dropout``: on the weights."""

    def __init__(self, window, fill=None, second_fill=False, dropout=0.0, band="4-D"):
        super().__init__()
        self.window, self.fill, self.second_fill, self.dropout, self.band = window, fill, second_fill, dropout, band

    def forward(self, q, k, v, pad_keep):
        lq, lk = q.shape[-2], k.shape[-2]
        if self.band == "4-D":  # HF indexes its mask functions 4-D
            i = torch.arange(lq)[None, None, :, None]
            j = torch.arange(lk)[None, None, None, :]
            keep = (j <= i) & (j > i - self.window)
        else:  # the (Lq, Lk) band made 4-D after the AND: [None, None], or rows reordered (a near miss)
            i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
            keep = (j <= i) & (j > i - self.window)
            keep = keep[None, None] if self.band == "2-D, [None, None]" else keep[None, torch.arange(lq).flip(0)]
        fill = torch.finfo(q.dtype).min if self.fill is None else self.fill
        if not self.second_fill:
            keep = keep & pad_keep[:, None, None, :]
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + torch.where(keep, torch.tensor(0.0, dtype=q.dtype), fill)
        if self.second_fill:
            s = s.masked_fill(~pad_keep[:, None, None, :], fill)
        w = s.softmax(-1)
        if self.dropout:
            w = torch.nn.functional.dropout(w, self.dropout)
        return w @ v


def _left_padded(b=3, l=14):  # batch 0: 5 pad tokens, batch 1: 9 (rows < 9 see no key with W 3)
    pad = torch.ones(b, l, dtype=torch.bool)
    pad[0, :5] = False
    pad[1, :9] = False
    return pad


@pytest.mark.parametrize("dtype, band", [(torch.float64, "4-D"), (torch.float32, "4-D"),
                                         (torch.float32, "2-D, [None, None]")])
def test_window_beside_finite_padding_averages_rows_masked_everywhere(dtype, band):
    """HF's one finfo.min fill of causal & window & padding: the window becomes the argument, the
    padding the bias, and the rows that see no key (queries at left-padded positions) average v
    over all keys after the op, as eager: output and gradients equal eager's there too."""
    model = OneFill(3, band=band)
    q = torch.randn(3, 4, 14, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(3, 2, 14, 16, dtype=dtype).repeat_interleave(2, 1).requires_grad_() for _ in range(2))
    pad = _left_padded()
    calls, out = _rewritten(model, q, k, v, pad)
    assert len(calls) == 1 and calls[0].kwargs.get("window") == 3 and calls[0].args[5] is True
    assert calls[0].args[3] is not None  # the padding
    assert any(u.target is _average_dead_rows for c in calls for g in c.users for u in g.users)
    want = model(q, k, v, pad)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    check_close("out", out, want, tol)
    check_close("dead rows", out[1, :, :9], want[1, :, :9], tol)
    text = str(fuse_plugin.explain(model, q.detach(), k.detach(), v.detach(), pad))
    assert "sliding window 3 (proved" in text and "rows masked everywhere" in text and "average v over all keys" in text
    dout = torch.randn_like(want)
    for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                          torch.autograd.grad(want, (q, k, v), dout)):
        check_close(name, a, b, tol * 10)


@pytest.mark.parametrize("kwargs, why", [
    (dict(second_fill=True), "the padding a second fill: not one value per key"),
    (dict(fill=-1e9), "a fill that does not absorb the scores (rows masked everywhere are not uniform)"),
    (dict(dropout=0.5), "dropout on the weights of a row masked everywhere"),
    (dict(band="2-D, rows reordered"), "the band's rows reordered by an index tensor: not a window"),
])
def test_window_beside_finite_padding_near_misses(kwargs, why):
    model = OneFill(3, **kwargs)
    q, k, v = (torch.randn(3, 2, 14, 16, dtype=torch.float64) for _ in range(3))
    pad = _left_padded()
    calls, out = _rewritten(model, q, k, v, pad)
    assert len(calls) == 1 and "window" not in calls[0].kwargs, why
    if not kwargs.get("dropout"):
        torch.testing.assert_close(out, model(q, k, v, pad))


@needs_interpreter
def test_window_beside_finite_padding_on_the_kernels():
    """The same on the general kernels (Triton's interpreter): the op's lse tells the rows that see
    no key, whatever the kernels did with their keys."""
    from fuse_plugin.ops._dispatch import cpu_kernels

    model = OneFill(3)
    torch.manual_seed(5)
    q = torch.randn(3, 2, 14, 16, requires_grad=True)
    k, v = (torch.randn(3, 2, 14, 16, requires_grad=True) for _ in range(2))
    pad = _left_padded()
    with cpu_kernels("triton"):
        calls, out = _rewritten(model, q, k, v, pad)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert calls and calls[0].kwargs.get("window") == 3
    want = model(*(t.double() for t in (q, k, v)), pad)
    check_close("out", out, want, 1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(want, (q, k, v), torch.ones_like(want))):
        check_close(name, a, b, 1e-4)


@pytest.mark.parametrize("keep, additive, why", [
    (lambda i, j: j > i - 4, False, "no causal part: a look-back bound alone"),
    (lambda i, j: (j <= i) & (j > 2 * i - 4), False, "not a band"),
    (lambda i, j: (j <= i) & (j > 3), False, "a fixed key range"),
])
def test_near_misses_pass_no_window(keep, additive, why):
    model = Banded(keep, additive=additive)
    q, k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float64) for _ in range(3))
    calls, out = _rewritten(model, q, k, v)
    assert len(calls) == 1 and "window" not in calls[0].kwargs, why
    torch.testing.assert_close(out, model(q, k, v), equal_nan=True)


def test_finite_band_with_more_queries_than_keys_stays_in_the_bias():
    """HF's finfo.min band over Lq > Lk: the last rows see no key, and eager spreads them uniformly
    over the fill values, which the op's -inf window would not: the mask stays the bias."""
    model = Banded(lambda i, j: (j <= i) & (j > i - 3), additive=True)
    q = torch.randn(1, 2, 12, 16, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 16, dtype=torch.float64) for _ in range(2))
    calls, out = _rewritten(model, q, k, v)
    assert len(calls) == 1 and "window" not in calls[0].kwargs
    torch.testing.assert_close(out, model(q, k, v))


def test_explain_names_the_window():
    model = Banded(lambda i, j: (j <= i) & (j > i - 4))
    q, k, v = (torch.randn(2, 3, 12, 16) for _ in range(3))
    text = str(fuse_plugin.explain(model, q, k, v))
    assert "sliding window 4 (proved: query i sees keys from i-3; arange comparison): the kernels skip" in text


def test_windowed_backward_runs_pipelined():
    """The windowed atomic backward takes the plain problem's tiles, pipelined (stop 33: its hang
    with 2 stages was a modulo by 0 in the full loop's prologue, now guarded; it ran with 1 stage
    before); the forward keeps its own."""
    q = torch.randn(1, 4, 2048, 128, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 2048, device="meta")
    fwd = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.088, window=512)
    bwd = AttentionCall.backward(q, q, q, q, None, q, lse, is_causal=True, scale=0.088, need_dbias=False,
                                 window=512)
    plain = AttentionCall.backward(q, q, q, q, None, q, lse, is_causal=True, scale=0.088, need_dbias=False)
    general = registry.FAMILIES["bwd"]["general"]
    assert general.config(bwd) == general.config(plain)
    assert registry.FAMILIES["fwd"]["general"].config(fwd) == registry.FAMILIES["fwd"]["general"].config(
        AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.088))


def test_the_choice_takes_a_window_only_where_measured(monkeypatch):
    """A windowed site on the GPU (pretended here) goes to our op by the measured window rule
    (patterns/choice.py) from WINDOW_RULE_MIN_KEYS keys on, bf16, where the window is shorter than
    the keys; below the measured lengths, in fp32, or where it hides nothing, the usual choice."""
    from fuse_plugin.kernels import choice_table
    from fuse_plugin.patterns import choice

    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "auto")
    monkeypatch.setattr(choice, "site_device", lambda site: torch.device("cuda"))
    monkeypatch.setattr(choice_table, "lookup", lambda device, key: None)  # (nothing measured)
    seen = []
    real = choice.decide

    def decide(site):
        seen.append(site)
        return real(site)

    monkeypatch.setattr(choice, "decide", decide)
    for L, dtype in ((12, torch.bfloat16), (3, torch.bfloat16), (12, torch.float32)):
        model = Banded(lambda i, j: (j <= i) & (j > i - 4))
        _rewritten(model, *(torch.randn(1, 2, L, 16, dtype=dtype) for _ in range(3)))
    long, short, fp32 = seen
    assert long.window == short.window == fp32.window == 4
    assert choice._window_rule(long) is None  # 12 keys: below the measured lengths
    monkeypatch.setattr(choice, "WINDOW_RULE_MIN_KEYS", 8)
    decision = choice._window_rule(long)
    assert decision.ours and "a sliding window of 4 over 12 keys" in decision.reason
    assert choice._window_rule(short) is None  # the window hides nothing
    assert choice._window_rule(fp32) is None  # measured in 16-bit only


def test_sdpa_call_with_a_band_mask_becomes_the_window(monkeypatch):
    """An SDPA call whose bool mask is the causal band (HF's sdpa path), taken for our op: our op
    with the window, no mask left; a look-back bound without the causal part stays a mask."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    def band_call(q, k, v, causal=True):
        L = q.shape[-2]
        i = torch.arange(L)[:, None]
        j = torch.arange(L)[None, :]
        keep = (j > i - 3) & (j <= i) if causal else j > i - 3
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    q, k, v = (torch.randn(1, 2, 10, 16, dtype=torch.float64) for _ in range(3))
    for causal, window in ((True, 3), (False, None)):
        calls, out = _rewritten(lambda q, k, v: band_call(q, k, v, causal), q, k, v)
        assert len(calls) == 1 and calls[0].kwargs.get("window") == window, causal
        assert (calls[0].args[3] is None) == causal  # the band leaves no mask; the bound alone stays one
        torch.testing.assert_close(out, band_call(q, k, v, causal))


@pytest.mark.parametrize("lq, lk, window, empties", [
    (5, 3, 2, True),    # rows 4.. see no key (fuzz_attention seed 14956): SDPA gives 0 there
    (9, 4, 3, True),
    (4, 3, 2, False),   # more queries than keys, yet every row keeps a key: no extra pass
    (6, 6, 2, False),   # Lq == Lk: every row keeps its own key
])
def test_sdpa_window_rows_with_no_key_give_sdpas_zeros(monkeypatch, lq, lk, window, empties):
    """An SDPA call whose causal band leaves some query rows no key (more queries than keys) gives 0
    in those rows, as SDPA does, and their gradients; the rewrite adds the zeroing only where a row
    can be empty."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")

    def band_call(q, k, v):
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - window))

    q = torch.randn(2, 2, lq, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, lk, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with sdpa_kernel([SDPBackend.MATH]):  # SDPA's exact math: 0 in rows masked everywhere
        want = band_call(q, k, v)
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    graphs = []

    def backend(gm, example_inputs):
        compiled = rewrite_aot_eager(gm, example_inputs)
        graphs.append(gm)
        return compiled

    torch._dynamo.reset()
    out = torch.compile(band_call, backend=backend, fullgraph=True)(q, k, v)
    calls = [n for n in graphs[0].graph.nodes if n.target is ATTENTION]
    assert len(calls) == 1 and calls[0].kwargs.get("window") == window
    zeroed = any(n.target is torch.isneginf for n in graphs[0].graph.nodes)
    assert zeroed == empties
    assert torch.isnan(want).any().item() is False and torch.isnan(out).any().item() is False
    torch.testing.assert_close(out, want)
    for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), want_grads):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------------------------ sinks


SINKS = torch.ops.fuse_plugin.attention_sinks.default


class BandedSinks(nn.Module):
    """gpt-oss's eager attention (the sink column concatenated, softmax, dropped) on a sliding
    layer: HF's finfo.min band added to the scores."""

    def forward(self, q, k, v, sinks, window=4):
        lq = q.shape[-2]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lq)[None, :]
        keep = (j <= i) & (j > i - window)
        s = q @ k.transpose(2, 3) * 0.25 + torch.where(keep, torch.tensor(0.0, dtype=q.dtype),
                                                         torch.finfo(q.dtype).min)
        col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, lq, -1)
        c = torch.cat([s, col], dim=-1)
        c = c - c.max(dim=-1, keepdim=True).values
        return torch.softmax(c, dim=-1)[..., :-1] @ v


def test_sinks_with_a_window_become_one_op():
    model = BandedSinks()
    q, k, v = (torch.randn(2, 4, 11, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    calls = []

    def backend(gm, example_inputs):
        compiled = rewrite_aot_eager(gm, example_inputs)
        calls.extend(n for n in gm.graph.nodes if n.target is SINKS)
        return compiled

    torch._dynamo.reset()
    got = torch.compile(model, backend=backend, fullgraph=True)(q, k, v, sinks)
    assert len(calls) == 1 and calls[0].kwargs.get("window") == 4 and calls[0].args[3] is None
    want = model(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, sinks)), torch.autograd.grad(want.sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b)


@needs_interpreter
def test_sinks_window_on_the_kernels():
    """The sinks op with a window on the general kernels (the merge after them) against the
    reference's softmax with the sink column."""
    from fuse_plugin.ops._dispatch import cpu_kernels

    torch.manual_seed(3)
    q = torch.randn(1, 4, 70, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 2, 70, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    args = (None, 0.0, True, 0.25, sinks, None, None, 9)
    outs = {}
    for how in ("triton", "reference"):
        with cpu_kernels(how):
            out, _ = SINKS(q, k, v, *args)
            outs[how] = (out,) + torch.autograd.grad(out, (q, k, v, sinks), torch.ones_like(out))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), outs["triton"], outs["reference"]):
        check_close(name, a, b, 1e-5)


# ------------------------------------------------------------------------------------ HF models


@pytest.mark.parametrize("family", ["mistral", "gemma2", "mistral-padded"])
def test_hf_windowed_models_train_as_eager(family):
    """Tiny HF Mistral (every layer windowed) and Gemma 2 (a windowed layer, then a full one, with
    logit softcapping), eager attention: the windowed sites pass the window to the op; logits and
    every gradient equal eager's."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
                  attn_implementation="eager")
    if family.startswith("mistral"):
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, attn_logit_softcapping=50.0))
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 12))
    # left padding (mistral-padded): HF ANDs it into the window's finfo.min mask; the queries at
    # padded positions see no key, and eager averages them over all keys (window_beside_one_fill)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :7] = 0
    kwargs = {"attention_mask": mask} if family == "mistral-padded" else {}
    windows = []

    def backend(gm, example_inputs):
        compiled = rewrite_aot_eager(gm, example_inputs)
        windows.extend(n.kwargs.get("window", 0) for n in gm.graph.nodes if n.target is ATTENTION)
        return compiled

    def step(m):
        logits = m(input_ids=ids, **kwargs).logits
        logits.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return logits, grads

    want, want_g = step(model)
    torch._dynamo.reset()
    counters.clear()
    got, got_g = step(torch.compile(model, backend=backend))
    assert sorted(windows) == ([0, 4] if family == "gemma2" else [4, 4])
    check_close("logits", got, want, 1e-5)
    assert set(got_g) == set(want_g)
    for name in want_g:
        check_close(name, got_g[name], want_g[name], 1e-4)
