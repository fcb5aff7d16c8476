"""The custom ops: semantics vs float64 eager expressions, torch.library.opcheck, autograd, errors."""
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

import fuse_plugin
from fuse_plugin.ops import cpu_kernels

OPS = torch.ops.fuse_plugin


def eager_attention(q, k, v, mask=None, is_causal=False, scale=None):
    """The eager math in float64 with k/v repeated for GQA."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def make_qkv(b=2, hq=4, hkv=2, lq=5, lk=7, d=16, dv=None, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


# --------------------------------------------------------------------------- attention semantics


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(is_causal=True),
        dict(lq=7, lk=3, is_causal=True),
        dict(mask="float"),
        dict(mask="bool", is_causal=True),
        dict(hq=4, hkv=1, dv=8, lq=1, lk=17),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain",
)
def test_attention_matches_float64_eager(case):
    case = dict(case)
    mask_kind = case.pop("mask", None)
    is_causal = case.pop("is_causal", False)
    q, k, v = make_qkv(grad=True, **case)
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    mask = None
    if mask_kind == "float":
        mask = torch.randn(b, 1, 1, lk).requires_grad_()
    elif mask_kind == "bool":
        mask = torch.rand(1, hq, lq, lk) > 0.3
        mask[..., 0] = True  # keep every row non-empty
    out = fuse_plugin.attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    inputs = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    ref = eager_attention(*[t.detach().double().requires_grad_() for t in (q, k, v)], mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.detach().double().requires_grad_()), is_causal=is_causal)
    assert rel_err(out, ref) < 1e-5
    # gradients, the reference recomputed on leaves we can differentiate
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    lq_, lk_, lv_ = leaves[:3]
    lmask = leaves[3] if len(leaves) > 3 else mask
    ref = eager_attention(lq_, lk_, lv_, mask=lmask, is_causal=is_causal)
    gout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, gout)
    ref_grads = torch.autograd.grad(ref, leaves, gout.double())
    for name, g, rg in zip("qkvb", grads, ref_grads):
        assert g.shape == rg.shape, name
        assert rel_err(g, rg) < 1e-5, name


def test_attention_fully_masked_rows_follow_eager():
    q, k, v = make_qkv(b=1, hq=2, hkv=2, lq=3, lk=4)
    neg_inf = torch.zeros(1, 1, 3, 4)
    neg_inf[..., 1, :] = float("-inf")
    out = fuse_plugin.attention(q, k, v, attn_mask=neg_inf)
    assert torch.isnan(out[:, :, 1]).all() and not torch.isnan(out[:, :, [0, 2]]).any()
    finfo_min = torch.zeros(1, 1, 3, 4)
    finfo_min[..., 1, :] = torch.finfo(torch.float32).min
    out = fuse_plugin.attention(q, k, v, attn_mask=finfo_min)
    assert torch.allclose(out[:, :, 1], v.mean(2), atol=1e-6)  # uniform weights


def test_attention_lse_is_logsumexp_and_not_differentiable():
    q, k, v = make_qkv(grad=True)
    out, lse = OPS.attention(q, k, v, None, 0.0, True, 0.3)
    s = (q.double() @ k.double().repeat_interleave(2, 1).mT * 0.3).masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(1), float("-inf"))
    assert rel_err(lse, s.logsumexp(-1)) < 1e-6 and lse.dtype == torch.float32
    assert not lse.requires_grad


def test_attention_half_precision_dtypes():
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = make_qkv(dtype=dtype)
        out = fuse_plugin.attention(q, k, v, is_causal=True)
        assert out.dtype == dtype
        assert rel_err(out, eager_attention(q, k, v, is_causal=True)) < 1e-2


# --------------------------------------------------------------------------- rotary semantics


def eager_rope(x, cos, sin, interleaved=False, rotary_dim=None):
    """The eager expressions (HF rotate_half / GPT-J rotate_every_two, partial via cat) in float64."""
    rd = rotary_dim or x.shape[-1]
    x, cos, sin = x.double(), cos.double(), sin.double()
    if cos.shape[-1] == rd // 2:  # half-width tables → full width
        rep = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat((t, t), -1))
        cos, sin = rep(cos), rep(sin)
    xr = x[..., :rd]
    rot = rotate_every_two(xr) if interleaved else rotate_half(xr)
    return torch.cat((xr * cos + rot * sin, x[..., rd:]), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("width", ["full", "half"])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rotary_matches_float64_eager(interleaved, width, rotary_dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g).transpose(1, 2).requires_grad_()  # (B, H, L, D) view
    rd = rotary_dim or 16
    w = rd if width == "full" else rd // 2
    cos = torch.randn(2, 1, 5, w, generator=g).requires_grad_()  # random, unequal halves: learned tables
    sin = torch.randn(2, 1, 5, w, generator=g).requires_grad_()
    out = fuse_plugin.apply_rotary(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    leaves = [t.detach().double().requires_grad_() for t in (x, cos, sin)]
    ref = eager_rope(*leaves, interleaved=interleaved, rotary_dim=rd)
    assert out.shape == x.shape and out.stride() == x.stride()  # x's layout, as eager's x * cos gives
    assert rel_err(out, ref) < 1e-6
    gout = torch.randn_like(out)
    for name, a, b in zip(("x", "cos", "sin"), torch.autograd.grad(out, (x, cos, sin), gout), torch.autograd.grad(ref, leaves, gout.double())):
        assert rel_err(a, b) < 1e-6, name


def test_rotary_output_dtype_follows_eager_promotion():
    x = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    cos32, sin32 = torch.randn(3, 8), torch.randn(3, 8)
    assert fuse_plugin.apply_rotary(x, cos32, sin32).dtype == torch.float32  # as GPT-J's fp32 tables give
    assert fuse_plugin.apply_rotary(x, cos32.bfloat16(), sin32.bfloat16()).dtype == torch.bfloat16


def test_rotary_qk_equals_two_single_calls():
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    cos, sin = torch.randn(2, 1, 6, 16), torch.randn(2, 1, 6, 16)
    qo, ko = fuse_plugin.apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(qo, fuse_plugin.apply_rotary(q, cos, sin))
    assert torch.equal(ko, fuse_plugin.apply_rotary(k, cos, sin))


# --------------------------------------------------------------------------- opcheck


def _attention_samples():
    q, k, v = make_qkv(grad=True)
    bias = torch.randn(2, 1, 5, 7, requires_grad=True)
    keep = torch.rand(1, 1, 5, 7) > 0.2
    keep[..., 0] = True
    yield (q, k, v, None, 0.0, False, 0.25)
    yield (q, k, v, bias, 0.0, True, 0.25)
    yield (q, k, v, keep, 0.0, False, 0.5)
    q1, k1, v1 = make_qkv(hq=3, hkv=3, lq=1, lk=17, dv=8, grad=True)
    yield (q1, k1, v1, None, 0.0, True, 1.0)
    yield (q, k, v, bias, 0.3, True, 0.25, torch.tensor(987654321, dtype=torch.int64))  # dropout


N_ATTENTION_SAMPLES = 5


def _rotary_samples():
    x = torch.randn(2, 5, 3, 16).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    yield (x, cos, sin, False, 16)
    yield (x, cos[..., :4], sin[..., :4], True, 8)


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("i", range(N_ATTENTION_SAMPLES))
def test_opcheck_attention(i):
    _opcheck(OPS.attention.default, list(_attention_samples())[i])


@pytest.mark.parametrize("i", range(N_ATTENTION_SAMPLES))
def test_opcheck_attention_backward(i):
    q, k, v, bias, p, causal, scale, *seed = list(_attention_samples())[i]
    seed = seed[0] if seed else None
    out, lse = OPS.attention(q, k, v, bias, p, causal, scale, seed)
    need_dbias = bias is not None and bias.dtype != torch.bool
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), bias if bias is None else bias.detach(), out.detach(), lse, p, causal, scale, seed, need_dbias)
    _opcheck(OPS.attention_backward.default, args)


@pytest.mark.parametrize("i", range(2))
def test_opcheck_rotary(i):
    x, cos, sin, inter, rd = list(_rotary_samples())[i]
    _opcheck(OPS.rotary.default, (x, cos, sin, inter, rd))
    _opcheck(OPS.rotary_backward.default, (torch.randn(x.shape), cos, sin, inter, rd, torch.float32))
    k = torch.randn(2, 1, 5, 16, requires_grad=True)
    _opcheck(OPS.rotary_qk.default, (x, k, cos, sin, inter, rd))
    _opcheck(OPS.rotary_qk_backward.default, (torch.randn(x.shape), torch.randn(k.shape), cos, sin, inter, rd, torch.float32, torch.float32))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter (set by conftest only where there is no GPU; "
                           "on a GPU benchmarks/gpu_check.py runs opcheck on the compiled kernels)")
def test_opcheck_with_interpreted_triton_kernels():
    """The same ops with the Triton kernels (interpreter) behind them: fake strides = real strides."""
    with cpu_kernels("triton"):
        _opcheck(OPS.attention.default, list(_attention_samples())[1])
        _opcheck(OPS.attention.default, list(_attention_samples())[4])  # dropout
        x, cos, sin, inter, rd = next(_rotary_samples())
        _opcheck(OPS.rotary.default, (x, cos, sin, inter, rd))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(q=torch.randn(2, 5, 16)), ValueError, r"q must have shape \(B, H, L, D\)"),
        (dict(k=torch.randn(2, 3, 7, 16), v=torch.randn(2, 3, 7, 16)), ValueError, "multiple of k/v.s head count"),
        (dict(k=torch.randn(2, 2, 7, 8)), ValueError, r"k must have shape \(B, Hkv, Lk, D\)"),
        (dict(v=torch.randn(2, 2, 6, 16)), ValueError, r"v must have shape \(B, Hkv, Lk, Dv\)"),
        (dict(q=torch.randn(2, 4, 5, 16, dtype=torch.float16)), ValueError, "same dtype"),
        (dict(q=torch.randint(0, 3, (2, 4, 5, 16))), TypeError, "q must be float16, bfloat16"),
        (dict(attn_mask=torch.randn(2, 3, 5, 7)), ValueError, r"broadcastable to \(B, Hq, Lq, Lk\)"),
        (dict(attn_mask=torch.ones(5, 7, dtype=torch.int32)), TypeError, "attn_mask must be bool"),
        (dict(q=torch.randn(1, 2, 3, 288), k=torch.randn(1, 2, 3, 288), v=torch.randn(1, 2, 3, 288)), ValueError, "at most 256"),
        (dict(dropout_p=1.5), ValueError, "dropout_p"),
    ],
)
def test_attention_bad_input_names_the_argument(kwargs, error, match):
    q, k, v = make_qkv()
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fuse_plugin.attention(**args)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cos=torch.randn(5, 12)), ValueError, "cos and sin must have the same shape"),
        (dict(cos=torch.randn(5, 12), sin=torch.randn(5, 12)), ValueError, "full width"),
        (dict(rotary_dim=7), ValueError, "rotary_dim must be an even int"),
        (dict(cos=torch.randn(4, 16), sin=torch.randn(4, 16)), ValueError, "must broadcast to x's leading dims"),
        (dict(x=torch.randn(2, 3, 5, 16).long()), TypeError, "x must be float16"),
        (dict(interleaved=1), TypeError, "interleaved must be a bool"),
    ],
)
def test_rotary_bad_input_names_the_argument(kwargs, error, match):
    args = dict(x=torch.randn(2, 3, 5, 16), cos=torch.randn(5, 16), sin=torch.randn(5, 16))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fuse_plugin.apply_rotary(**args)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = make_qkv(d=20)
    assert rel_err(fuse_plugin.attention(q, k, v), eager_attention(q, k, v, scale=1 / math.sqrt(20))) < 1e-6
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert rel_err(fuse_plugin.attention(q, k, v), sdpa) < 1e-5


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("layout", ["hf_transposed", "contiguous", "last_dim_strided", "sliced", "5d"])
def test_rotary_output_layout(layout, kernels):
    """The rotation's output keeps x's memory layout where x is dense with a unit last stride (HF's
    transposed q/k: two sequential streams), else it is contiguous; the fake output has the same
    strides (so compiled graphs see the real layout), and values equal the eager expression."""
    from fuse_plugin.ops.rotary import output_like

    base = torch.randn(2, 5, 3, 16)
    x = {"hf_transposed": base.transpose(1, 2), "contiguous": base.contiguous(),
         "last_dim_strided": base.transpose(-1, -2).contiguous().transpose(-1, -2), "sliced": torch.randn(2, 5, 3, 24)[..., :16],
         "5d": base.view(2, 5, 3, 2, 8).transpose(1, 2)}[layout]
    cos, sin = torch.randn(x.shape[-1]), torch.randn(x.shape[-1])
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU Triton path needs the interpreter (conftest sets it where there is no GPU)")
    with cpu_kernels(kernels):
        out = OPS.rotary(x, cos, sin, False, x.shape[-1])
    want = eager_rope(x, cos, sin, False, x.shape[-1])
    assert rel_err(out, want) < 1e-6
    if layout in ("hf_transposed", "contiguous"):
        assert out.stride() == x.stride()
    if layout in ("last_dim_strided", "5d"):
        assert out.is_contiguous()
    assert out.stride(-1) == 1
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = OPS.rotary(mode.from_tensor(x), mode.from_tensor(cos), mode.from_tensor(sin), False, x.shape[-1])
    assert fake.stride() == out.stride() and fake.shape == out.shape
    assert output_like(x, torch.float32).stride() == out.stride()


@pytest.mark.parametrize("op", ["attention", "attention_sinks"])
def test_double_backward_is_refused_by_name(op):
    """The backward ops are not differentiable: a create_graph backward says which op refused."""
    q, k, v = (torch.randn(1, 2, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    extra = (torch.zeros(2, dtype=torch.float64, requires_grad=True),) if op == "attention_sinks" else ()
    out, _ = getattr(torch.ops.fuse_plugin, op)(q, k, v, None, 0.0, False, 0.25, *extra)
    with pytest.raises(RuntimeError, match=f"fuse_plugin::{op}_backward is not differentiable"):
        torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
