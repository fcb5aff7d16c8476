"""Tests of the Triton rotary-embedding kernels (fuse_plugin/kernels/rotary.py).

Everything is checked against a float64 plain-torch reference (rotate_half / rotate_every_two,
partial rotary by concatenating the untouched tail); backward against torch.autograd of that
reference.  cos/sin are random (not real angles) and, at full width, have UNEQUAL halves, so a
backward that merely negates sin would fail.  On CPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1).
"""
import pytest
import torch

from helpers import DEVICE, rel_err
from fuse_plugin.kernels.rotary import rotary_forward, rotary_qk_forward

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# ------------------------------------------------------------------------------------------------
# float64 reference
# ------------------------------------------------------------------------------------------------

def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_every_two(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def full_width(t, rotary_dim, interleaved):
    """A half-width table (value per pair) as the full-width table it stands for."""
    if t.shape[-1] == rotary_dim:
        return t
    if interleaved:
        return t.repeat_interleave(2, dim=-1)
    return torch.cat((t, t), dim=-1)


def reference(x, cos, sin, *, interleaved, rotary_dim):
    """Rotary in float64; cos/sin broadcast against x[..., :rotary_dim]."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    cos = full_width(cos, rotary_dim, interleaved)
    sin = full_width(sin, rotary_dim, interleaved)
    xr, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    rot = rotate_every_two(xr) if interleaved else rotate_half(xr)
    return torch.cat((xr * cos + rot * sin, tail), dim=-1)


def reference_backward(g, cos, sin, *, interleaved, rotary_dim):
    """dL/dx of the reference for upstream gradient g, through torch.autograd."""
    x = torch.zeros(g.shape, dtype=torch.float64, requires_grad=True)
    y = reference(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    (dx,) = torch.autograd.grad(y, x, g.double())
    return dx


def expected(x, cos, sin, *, interleaved, rotary_dim, backward):
    x, cos, sin = x.cpu(), cos.cpu(), sin.cpu()
    f = reference_backward if backward else reference
    return f(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)


# ------------------------------------------------------------------------------------------------
# input builders
# ------------------------------------------------------------------------------------------------

def make_x(B, H, L, D, dtype=torch.float32, layout="bhld"):
    """(B, H, L, D) input.  'blhd': the usual non-contiguous q.view(B, L, H, D).transpose(1, 2);
    'strided_d': additionally a last-dim stride of 2."""
    if layout == "bhld":
        return torch.randn(B, H, L, D, device=DEVICE).to(dtype)
    if layout == "blhd":
        return torch.randn(B, L, H * D, device=DEVICE).to(dtype).view(B, L, H, D).transpose(1, 2)
    if layout == "strided_d":
        base = torch.randn(B, L, H, 2 * D, device=DEVICE).to(dtype)
        return base[..., ::2].transpose(1, 2)
    raise ValueError(layout)


def make_tables(shape, dtype=torch.float32):
    """Random cos/sin of the given shape (not real angles: halves unequal, |cos|²+|sin|² != 1)."""
    cos = torch.randn(shape, device=DEVICE).to(dtype)
    sin = torch.randn(shape, device=DEVICE).to(dtype)
    return cos, sin


def check(out, exp, dtype):
    err = rel_err(out, exp)
    assert err <= TOL[dtype], f"rel err {err:.3g} > {TOL[dtype]}"


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("half_width", [False, True], ids=["fullW", "halfW"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("D,R", [(16, 16), (64, 64), (80, 80), (80, 32), (16, 8), (64, 2)])
def test_layouts_widths_partial(D, R, interleaved, half_width, backward):
    B, H, L = 2, 3, 17
    x = make_x(B, H, L, D, layout="blhd")
    W = R // 2 if half_width else R
    cos, sin = make_tables((B, 1, L, W))
    cos4, sin4 = cos.expand(B, H, L, W), sin.expand(B, H, L, W)
    out = rotary_forward(x, cos4, sin4, interleaved=interleaved, rotary_dim=R, backward=backward,
                         out_dtype=torch.float32)
    assert out.shape == x.shape and out.dtype == torch.float32 and out.is_contiguous()
    exp = expected(x, cos, sin, interleaved=interleaved, rotary_dim=R, backward=backward)
    check(out, exp, torch.float32)
    if R < D:  # pass-through tail is exact
        assert torch.equal(out[..., R:].cpu(), x[..., R:].cpu())


@pytest.mark.parametrize("layout", ["bhld", "blhd", "strided_d"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_input_strides(layout, interleaved):
    B, H, L, D, R = 2, 4, 9, 64, 48
    x = make_x(B, H, L, D, layout=layout)
    if layout != "bhld":
        assert not x.is_contiguous()
    x_before = x.clone()
    cos, sin = make_tables((L, R))
    out = rotary_forward(x, cos.expand(B, H, L, R), sin.expand(B, H, L, R), interleaved=interleaved,
                         rotary_dim=R, out_dtype=torch.float32)
    check(out, expected(x, cos, sin, interleaved=interleaved, rotary_dim=R, backward=False), torch.float32)
    assert torch.equal(x, x_before)  # input untouched


@pytest.mark.parametrize("table_shape", ["B1LW", "11LW", "LW", "BHLW"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_table_broadcast(table_shape, backward):
    B, H, L, D, R = 2, 3, 17, 64, 64
    W = R
    shape = {"B1LW": (B, 1, L, W), "11LW": (1, 1, L, W), "LW": (L, W), "BHLW": (B, H, L, W)}[table_shape]
    cos, sin = make_tables(shape)
    # Separate strides for cos and sin: a transposed-then-expanded sin.
    sin = sin.transpose(-1, -2).contiguous().transpose(-1, -2)
    x = make_x(B, H, L, D, layout="blhd")
    cos4, sin4 = cos.expand(B, H, L, W), sin.expand(B, H, L, W)
    out = rotary_forward(x, cos4, sin4, interleaved=False, rotary_dim=R, backward=backward,
                         out_dtype=torch.float32)
    exp = expected(x, cos, sin, interleaved=False, rotary_dim=R, backward=backward)
    check(out, exp, torch.float32)
    # The launcher also broadcasts un-expanded tables itself.
    out2 = rotary_forward(x, cos, sin, interleaved=False, rotary_dim=R, backward=backward,
                          out_dtype=torch.float32)
    assert torch.equal(out, out2)


@pytest.mark.parametrize(
    "x_dtype,table_dtype,out_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16, torch.float16),
        (torch.bfloat16, torch.float32, torch.float32),  # mixed: math in fp32, fp32 out
        (torch.float16, torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_dtypes(x_dtype, table_dtype, out_dtype, interleaved, backward):
    B, H, L, D, R = 2, 3, 17, 80, 32
    x = make_x(B, H, L, D, dtype=x_dtype, layout="blhd")
    cos, sin = make_tables((1, 1, L, R // 2), dtype=table_dtype)
    out = rotary_forward(x, cos.expand(B, H, L, R // 2), sin.expand(B, H, L, R // 2),
                         interleaved=interleaved, rotary_dim=R, backward=backward, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    # Reference from the actual (already rounded) input values, so the tolerance measures the kernel.
    exp = expected(x, cos, sin, interleaved=interleaved, rotary_dim=R, backward=backward)
    check(out, exp, out_dtype)


@pytest.mark.parametrize("L", [1, 17])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_seq_lengths(L, interleaved):
    B, H, D, R = 3, 2, 16, 16
    x = make_x(B, H, L, D, layout="blhd")
    cos, sin = make_tables((B, 1, L, R))
    out = rotary_forward(x, cos.expand(B, H, L, R), sin.expand(B, H, L, R), interleaved=interleaved,
                         rotary_dim=R, out_dtype=torch.float32)
    check(out, expected(x, cos, sin, interleaved=interleaved, rotary_dim=R, backward=False), torch.float32)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved,half_width", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("L", [1, 17])
def test_qk_one_launch(backward, interleaved, half_width, L):
    B, Hq, Hk, D, R = 2, 4, 2, 64, 64
    W = R // 2 if half_width else R
    q = make_x(B, Hq, L, D, dtype=torch.bfloat16, layout="blhd")
    k = make_x(B, Hk, L, D, dtype=torch.bfloat16, layout="blhd")
    cos, sin = make_tables((B, 1, L, W))
    # Form 1: separately expanded views of the same tables.
    q_out, k_out = rotary_qk_forward(
        q, k, cos.expand(B, Hq, L, W), sin.expand(B, Hq, L, W), cos.expand(B, Hk, L, W), sin.expand(B, Hk, L, W),
        interleaved=interleaved, rotary_dim=R, backward=backward,
        q_out_dtype=torch.bfloat16, k_out_dtype=torch.float32)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.float32
    assert q_out.is_contiguous() and k_out.is_contiguous()
    kw = dict(interleaved=interleaved, rotary_dim=R, backward=backward)
    check(q_out, expected(q, cos, sin, **kw), torch.bfloat16)
    check(k_out, expected(k, cos, sin, **kw), torch.float32)
    # Form 2: one table pair used for both (expanded to q's head count; stride 0 serves k too).
    q_out2, k_out2 = rotary_qk_forward(
        q, k, cos.expand(B, Hq, L, W), sin.expand(B, Hq, L, W),
        interleaved=interleaved, rotary_dim=R, backward=backward,
        q_out_dtype=torch.bfloat16, k_out_dtype=torch.float32)
    assert torch.equal(q_out, q_out2) and torch.equal(k_out, k_out2)


def test_qk_different_leading_dims_and_partial():
    """q and k differing in all three leading dims (k broadcast-free, own tables) and in head_dim."""
    R = 32
    q = make_x(2, 4, 17, 80, layout="blhd")
    k = make_x(1, 1, 5, 48, layout="bhld")
    cq, sq = make_tables((1, 1, 17, R))
    ck, sk = make_tables((5, R))
    q_out, k_out = rotary_qk_forward(q, k, cq.expand(2, 4, 17, R), sq.expand(2, 4, 17, R),
                                     ck.expand(1, 1, 5, R), sk.expand(1, 1, 5, R),
                                     interleaved=False, rotary_dim=R,
                                     q_out_dtype=torch.float32, k_out_dtype=torch.float32)
    check(q_out, expected(q, cq, sq, interleaved=False, rotary_dim=R, backward=False), torch.float32)
    check(k_out, expected(k, ck, sk, interleaved=False, rotary_dim=R, backward=False), torch.float32)


def test_qk_matches_single():
    B, Hq, Hk, L, D, R = 2, 8, 2, 17, 64, 64
    q = make_x(B, Hq, L, D, layout="blhd")
    k = make_x(B, Hk, L, D, layout="blhd")
    cos, sin = make_tables((1, 1, L, R))
    kw = dict(interleaved=True, rotary_dim=R, backward=True)
    q_out, k_out = rotary_qk_forward(q, k, cos, sin, q_out_dtype=torch.float32, k_out_dtype=torch.float32, **kw)
    assert torch.equal(q_out, rotary_forward(q, cos.expand(B, Hq, L, R), sin.expand(B, Hq, L, R),
                                             out_dtype=torch.float32, **kw))
    assert torch.equal(k_out, rotary_forward(k, cos.expand(B, Hk, L, R), sin.expand(B, Hk, L, R),
                                             out_dtype=torch.float32, **kw))


@pytest.mark.parametrize("config", [{"BLOCK_ROWS": 1, "num_warps": 1}, {"BLOCK_ROWS": 4}, {"BLOCK_ROWS": 64, "num_warps": 8}])
def test_config_override(config):
    B, H, L, D, R = 2, 3, 17, 80, 32
    x = make_x(B, H, L, D, layout="blhd")
    cos, sin = make_tables((L, R))
    out = rotary_forward(x, cos, sin, interleaved=True, rotary_dim=R, out_dtype=torch.float32, config=config)
    check(out, expected(x, cos, sin, interleaved=True, rotary_dim=R, backward=False), torch.float32)
    q_out, k_out = rotary_qk_forward(x, x[:, :1], cos, sin, interleaved=True, rotary_dim=R,
                                     q_out_dtype=torch.float32, k_out_dtype=torch.float32, config=config)
    assert torch.equal(q_out, out) and torch.equal(k_out, out[:, :1])


def test_backward_is_transpose():
    """<rope(x), g> == <x, rope_bwd(g)> with unequal full-width halves (fp32, both layouts)."""
    B, H, L, D, R = 1, 2, 5, 16, 16
    cos, sin = make_tables((L, R))
    for interleaved in (False, True):
        x = make_x(B, H, L, D)
        g = make_x(B, H, L, D)
        y = rotary_forward(x, cos, sin, interleaved=interleaved, rotary_dim=R, out_dtype=torch.float32)
        dx = rotary_forward(g, cos, sin, interleaved=interleaved, rotary_dim=R, backward=True,
                            out_dtype=torch.float32)
        lhs = (y.double() * g.double()).sum()
        rhs = (x.double() * dx.double()).sum()
        assert abs(lhs - rhs).item() <= 1e-4 * (abs(lhs).item() + 1.0)
        # and it is not merely "negate sin"
        neg = rotary_forward(g, cos, -sin, interleaved=interleaved, rotary_dim=R, out_dtype=torch.float32)
        assert rel_err(neg, dx) > 1e-2


def test_empty():
    x = make_x(2, 3, 0, 16)
    cos, sin = make_tables((0, 16))
    out = rotary_forward(x, cos, sin, interleaved=False, rotary_dim=16, out_dtype=torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


def test_bad_arguments():
    x = make_x(1, 2, 3, 16)
    cos, sin = make_tables((3, 16))
    kw = dict(interleaved=False, out_dtype=torch.float32)
    with pytest.raises(ValueError):
        rotary_forward(x, cos, sin, rotary_dim=15, **kw)  # odd
    with pytest.raises(ValueError):
        rotary_forward(x, cos, sin, rotary_dim=32, **kw)  # > D
    with pytest.raises(ValueError):
        rotary_forward(x, cos, sin, rotary_dim=12, **kw)  # width neither R nor R/2
    with pytest.raises(ValueError):
        rotary_forward(x, *make_tables((4, 16)), rotary_dim=16, **kw)  # seq mismatch
    with pytest.raises(ValueError):
        rotary_forward(x[0], cos, sin, rotary_dim=16, **kw)  # not 4-D
    with pytest.raises(ValueError):
        rotary_forward(x, cos, sin, rotary_dim=16, config={"BLOCK_ROWS": 3}, **kw)


# ------------------------------------------------------------------------------------------------
# kernel variants and launch paths (configs, head chunks, q+k sharing positions, swapped dims)
# ------------------------------------------------------------------------------------------------

VARIANT_CONFIGS = [
    {"BLOCK_ROWS": 4, "BLOCK_HEADS": 2, "num_warps": 2},  # head loop over all heads, rows tile
    {"BLOCK_ROWS": 4, "BLOCK_HEADS": 2, "SPLIT_HALVES": True, "num_warps": 2},
    {"BLOCK_ROWS": 8, "BLOCK_HEADS": 1, "HEADS_PER_PROGRAM": 3, "num_stages": 2},  # chunks across q|k
    {"BLOCK_ROWS": 2, "BLOCK_HEADS": 4, "HEADS_PER_PROGRAM": 4, "SPLIT_HALVES": True, "num_stages": 3},
]


@pytest.mark.parametrize("config", VARIANT_CONFIGS, ids=["rows", "halves", "chunks", "halves-chunks"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved,half_width", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("D,R", [(96, 96), (80, 48), (16, 16)])
def test_variants_qk(config, backward, interleaved, half_width, D, R):
    """Every kernel variant against float64, q (5 heads) and k (3 heads) sharing positions, odd L."""
    B, Hq, Hk, L = 2, 5, 3, 7
    W = R // 2 if half_width else R
    q = make_x(B, Hq, L, D, dtype=torch.bfloat16, layout="blhd")
    k = make_x(B, Hk, L, D, dtype=torch.bfloat16, layout="bhld")
    cos, sin = make_tables((B, 1, L, W))
    q_out, k_out = rotary_qk_forward(
        q, k, cos.expand(B, Hq, L, W), sin.expand(B, Hq, L, W), cos.expand(B, Hk, L, W), sin.expand(B, Hk, L, W),
        interleaved=interleaved, rotary_dim=R, backward=backward,
        q_out_dtype=torch.float32, k_out_dtype=torch.bfloat16, config=config)
    kw = dict(interleaved=interleaved, rotary_dim=R, backward=backward)
    check(q_out, expected(q, cos, sin, **kw), torch.float32)  # bf16 input, fp32 math and output
    check(k_out, expected(k, cos, sin, **kw), torch.bfloat16)
    if R < D:
        assert torch.equal(q_out[..., R:].cpu(), q[..., R:].float().cpu())


@pytest.mark.parametrize("D,R", [(160, 160), (192, 64), (256, 256), (256, 128)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_large_head_dims(D, R, interleaved):
    B, H, L = 1, 3, 5
    x = make_x(B, H, L, D, layout="blhd")
    cos, sin = make_tables((L, R))
    for backward in (False, True):
        out = rotary_forward(x, cos, sin, interleaved=interleaved, rotary_dim=R, backward=backward,
                             out_dtype=torch.float32)
        check(out, expected(x, cos, sin, interleaved=interleaved, rotary_dim=R, backward=backward), torch.float32)


@pytest.mark.parametrize("table_per_head", [False, True], ids=["bcast", "per_head"])
def test_heads_in_dim2(table_per_head):
    """x as (B, L, H, D) (rotation before the head transpose): tables broadcast over dim 2, so the
    launcher loops over dim 2 instead; with per-head tables (no broadcast) it keeps dim 1."""
    B, L, H, D, R = 2, 9, 4, 64, 64
    x = torch.randn(B, L, H, D, device=DEVICE)
    shape = (B, L, H, R) if table_per_head else (B, L, 1, R)
    cos, sin = make_tables(shape)
    for backward in (False, True):
        out = rotary_forward(x, cos.expand(B, L, H, R), sin.expand(B, L, H, R), interleaved=False, rotary_dim=R,
                             backward=backward, out_dtype=torch.float32)
        assert out.is_contiguous()
        check(out, expected(x, cos, sin, interleaved=False, rotary_dim=R, backward=backward), torch.float32)


def test_qk_same_positions_different_head_dims():
    """q and k share (A, C) (one program does both) but differ in head_dim and head count."""
    R = 32
    q = make_x(2, 3, 11, 64, layout="blhd")
    k = make_x(2, 2, 11, 80, layout="blhd")
    cos, sin = make_tables((2, 1, 11, R // 2))
    for config in (None, {"BLOCK_ROWS": 4, "BLOCK_HEADS": 2, "HEADS_PER_PROGRAM": 2, "SPLIT_HALVES": True}):
        q_out, k_out = rotary_qk_forward(q, k, cos, sin, interleaved=False, rotary_dim=R, q_out_dtype=torch.float32,
                                         k_out_dtype=torch.float32, config=config)
        check(q_out, expected(q, cos, sin, interleaved=False, rotary_dim=R, backward=False), torch.float32)
        check(k_out, expected(k, cos, sin, interleaved=False, rotary_dim=R, backward=False), torch.float32)


def test_default_config_shapes():
    from fuse_plugin.kernels.rotary import default_config
    for D in (16, 64, 80, 128, 256):
        for n_heads, n_pos in ((1, 1), (40, 16384), (64, 16384), (4, 3)):
            cfg = default_config(D, n_heads * n_pos, n_heads=n_heads, n_pos=n_pos)
            assert cfg["BLOCK_ROWS"] <= triton_next_pow2(n_pos)
            assert cfg["BLOCK_ROWS"] * cfg.get("BLOCK_HEADS", 1) * triton_next_pow2(D) <= 16384


def triton_next_pow2(n):
    return 1 << (max(n, 1) - 1).bit_length()
