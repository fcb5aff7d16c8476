"""The flash-decoding forward (fuse_plugin.kernels.attention_decode) against a float64 reference.

Runs on the GPU when there is one, else in Triton's CPU interpreter (conftest.py): tiny shapes,
small tiles and forced split counts so that short key ranges span several splits and blocks
(the combine, partial blocks, skipped blocks). Outputs start as NaN, so an element the kernels
forget to write fails.
"""
import contextlib

import pytest
import torch
from helpers import DEVICE, rel_err
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fuse_plugin  # noqa: F401  (registers the ops and the backend)
from fuse_plugin.kernels import attention as attn
from fuse_plugin.kernels import attention_decode as dec
from fuse_plugin.ops import cpu_kernels

OPS = torch.ops.fuse_plugin


def kernels():
    """The op's Triton kernels: on the GPU always, on the CPU in the interpreter."""
    return contextlib.nullcontext() if DEVICE == "cuda" else cpu_kernels("triton")

NEG_INF = float("-inf")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def reference(q, k, v, bias, is_causal, scale):
    """float64 eager attention -> (out, lse): NaN output and -inf lse on fully masked rows."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s.masked_fill(~bias, NEG_INF) if bias.dtype == torch.bool else s + bias.double()
    if is_causal:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(), NEG_INF)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def poisoned(B, Hq, Lq, Dv, dtype):
    out_buf = torch.full((B, Lq, Hq, Dv), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((B, Hq, Lq), float("nan"), dtype=torch.float32, device=DEVICE)
    return out_buf, lse


def check(out, lse, ref_out, ref_lse, dtype, tol=None):
    """Within tolerance; NaN exactly on the reference's dead rows (lse -inf there)."""
    dead = torch.isneginf(ref_lse)
    assert torch.isnan(out[dead]).all(), "a fully masked row must be NaN"
    assert torch.isneginf(lse[dead]).all(), "a fully masked row's lse must be -inf"
    live_out, live_ref = out[~dead], ref_out[~dead]
    assert not torch.isnan(live_out).any(), "unwritten or NaN output"
    assert not torch.isnan(lse[~dead]).any(), "unwritten or NaN lse"
    if live_ref.numel():
        err = rel_err(live_out, live_ref)
        assert err <= (tol or TOL[dtype]), f"out rel err {err:.3g}"
        lerr = (lse[~dead].double() - ref_lse[~dead]).abs() / ref_lse[~dead].abs().clamp_min(1)
        assert lerr.max() <= (1e-5 if dtype == torch.float32 else 1e-3), f"lse err {lerr.max():.3g}"


def inputs(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, transposed=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(H, L, d):  # (B, L, H, d).transpose(1, 2) like a model's projections, or contiguous
        shape = (B, L, H, d) if transposed else (B, H, L, d)
        t = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
        return t.transpose(1, 2) if transposed else t

    return rand(Hq, Lq, D), rand(Hkv, Lk, D), rand(Hkv, Lk, Dv)


def masks(kind, B, Hq, Lq, Lk, filled, dtype, seed=1):
    """HF-style masks over a static buffer: keys < filled visible (bool: plus random holes), the
    tail masked (float: finfo(dtype).min), broadcast over heads (stride 0)."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        keep = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
        keep[..., 0] = True
        keep[..., filled:] = False
        return keep.to(DEVICE).expand(B, Hq, Lq, Lk)
    bias = torch.randn(B, 1, Lq, Lk, generator=g)
    bias[..., filled:] = torch.finfo(dtype).min
    return bias.to(dtype).to(DEVICE).expand(B, Hq, Lq, Lk)


def run(q, k, v, bias, *, is_causal=False, splits=None, config=None, scale=None):
    B, Hq, Lq, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    out_buf, lse = poisoned(B, Hq, Lq, v.shape[-1], q.dtype)
    out, lse = dec.attention_decode_forward(q, k, v, bias, is_causal=is_causal, scale=scale,
                                            out_buf=out_buf, lse=lse, splits=splits,
                                            config=config)
    assert out.shape == (B, Hq, Lq, v.shape[-1]) and out.transpose(1, 2).is_contiguous()
    return out, lse, reference(q, k, v, bias, is_causal, scale)


SMALL = dec.DecodeConfig(16, 16, 4, 1)

CASES = [
    # (dtype, B, Hq, Hkv, Lq, Lk, D, Dv, mask, filled, splits, config)
    (torch.float32, 2, 4, 1, 1, 300, 64, 64, "float", 150, 3, None),   # MQA, static-cache tail
    (torch.float32, 1, 8, 2, 3, 300, 16, 16, "bool", 200, 4, SMALL),   # GQA 4, holes, 19 blocks
    (torch.float32, 1, 2, 2, 16, 300, 80, 80, None, 300, 5, SMALL),    # Lq 16, D 80 (padded)
    (torch.float32, 2, 4, 1, 16, 17, 64, 16, "float", 9, 2, SMALL),    # 4 x 16 = 64 rows, Dv 16
    (torch.float32, 1, 4, 4, 3, 1, 64, 64, None, 1, None, None),       # one key
    (torch.float32, 1, 2, 1, 1, 17, 16, 32, "bool", 17, 2, SMALL),
    (torch.bfloat16, 2, 4, 1, 1, 300, 64, 64, "float", 280, 3, None),
    (torch.float16, 1, 8, 2, 3, 300, 64, 64, "float", 100, None, SMALL),
    (torch.float32, 1, 16, 1, 16, 40, 16, 16, None, 40, 2, SMALL),     # 256 rows: 4 row blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:11])).replace("torch.", ""))
def test_matches_reference(case):
    dtype, B, Hq, Hkv, Lq, Lk, D, Dv, mask, filled, splits, config = case
    q, k, v = inputs(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, transposed=B != 1)
    bias = masks(mask, B, Hq, Lq, Lk, filled, dtype)
    out, lse, (ref_out, ref_lse) = run(q, k, v, bias, splits=splits, config=config)
    check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("mask", ["float", "bool", "neg_inf"])
def test_masked_blocks_are_not_read(mask):
    """K/V of whole masked blocks (left padding, the unfilled tail) are NaN and must not be read:
    the result equals the reference computed with clean K/V. Keys [0, 32) and [160, 300) are
    masked, blocks of 16 keys, 5 splits (two of them see no visible key at all)."""
    dtype, B, Hq, Hkv, Lq, Lk = torch.float32, 2, 4, 2, 2, 300
    q, k, v = inputs(B, Hq, Hkv, Lq, Lk, 32, 32, dtype)
    hidden = torch.zeros(Lk, dtype=torch.bool)
    hidden[:32] = hidden[160:] = True
    if mask == "bool":
        bias = (~hidden).to(DEVICE).expand(B, Hq, Lq, Lk)
    else:
        fill = torch.finfo(dtype).min if mask == "float" else NEG_INF
        bias = torch.zeros(Lk).masked_fill(hidden, fill).to(DEVICE).expand(B, Hq, Lq, Lk)
    _, _, (ref_out, ref_lse) = run(q, k, v, bias, splits=5, config=SMALL)
    kn, vn = k.clone(), v.clone()
    kn[:, :, hidden.to(DEVICE)] = float("nan")
    vn[:, :, hidden.to(DEVICE)] = float("nan")
    out, lse, _ = run(q, kn, vn, bias, splits=5, config=SMALL)
    check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("fill", [NEG_INF, "bool", torch.finfo(torch.float32).min, -65504.0, -1e4])
def test_fully_masked_rows(fill):
    """Rows whose every key is masked. -inf / bool: NaN and lse -inf (eager). A finite fill:
    eager's softmax over the masked scores (uniform for finfo.min, where q·k is lost; the plain
    softmax for -65504); the splits skip those blocks and the combine must recompute the row.
    Other rows keep a visible prefix and a masked tail."""
    dtype, B, Hq, Hkv, Lq, Lk = torch.float32, 1, 4, 2, 3, 200
    q, k, v = inputs(B, Hq, Hkv, Lq, Lk, 32, 32, dtype)
    visible = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
    visible[..., :70] = True
    visible[:, :, 1] = False  # query 1 sees nothing
    if fill == "bool":
        bias = visible
    else:
        bias = torch.zeros(visible.shape).masked_fill(~visible, fill)
    bias = bias.to(DEVICE).expand(B, Hq, Lq, Lk)
    out, lse, (ref_out, ref_lse) = run(q, k, v, bias, splits=4, config=SMALL)
    # -65504 + q·k in fp32 keeps q·k to 2**-8 only (-1e4: 2**-10) (eager fp32 and the general kernel alike):
    # against the float64 reference to 1e-3, against the general kernel to 1e-5.
    check(out, lse, ref_out, ref_lse, dtype, tol=1e-3 if fill in (-65504.0, -1e4) else None)
    gen_out, gen_lse = attn.attention_forward(q, k, v, bias, is_causal=False, scale=32 ** -0.5,
                                              config=attn.AttentionConfig(16, 16, 4, 1))
    check(out, lse, gen_out, gen_lse, dtype)


def test_causal_top_left():
    """is_causal: query i sees keys <= i only (top-left, as the op defines it), bias on top."""
    dtype = torch.float32
    q, k, v = inputs(1, 4, 2, 3, 300, 32, 32, dtype)
    bias = masks("float", 1, 4, 3, 300, 300, dtype)
    out, lse, (ref_out, ref_lse) = run(q, k, v, bias, is_causal=True, splits=2, config=SMALL)
    check(out, lse, ref_out, ref_lse, dtype)
    out, lse, (ref_out, ref_lse) = run(q, k, v, None, is_causal=True, scale=-0.3)
    check(out, lse, ref_out, ref_lse, dtype)


def _family(Lq, Lk, config=False, rope=False, dropout=False, softcap=False, replace=False):
    """The forward family the registry chooses for such a call (CPU tensors: the interpreter's)."""
    from fuse_plugin.kernels import registry
    from fuse_plugin.kernels.call import AttentionCall, Rope

    q, k = torch.zeros(1, 2, Lq, 16), torch.zeros(1, 2, Lk, 16)
    bias = torch.zeros(1, 2, Lq, Lk) if replace else None
    call = AttentionCall.forward(
        q, k, k, bias, is_causal=False, scale=0.25,
        config=attn.AttentionConfig(16, 16, 4, 1) if config else None,
        rope=Rope(torch.ones(16), torch.zeros(16), False, 16) if rope else None,
        dropout_p=0.1 if dropout else 0.0,
        dropout_seed=torch.zeros((), dtype=torch.int64) if dropout else None,
        softcap=30.0 if softcap else 0.0,
        replace=torch.zeros(1, 2, Lq, Lk, dtype=torch.bool) if replace else None)
    return registry.choose(call)[0].name


def test_forward_family_choice():
    for Lq, Lk in [(1, 256), (1, 768), (4, 4352), (16, 4352)]:
        assert _family(Lq, Lk) == "decode", (Lq, Lk)
    for Lq, Lk in [(17, 4352), (1, 255), (16, 100), (512, 512)]:
        assert _family(Lq, Lk) == "general", (Lq, Lk)
    for flag in ("config", "rope", "dropout", "softcap", "replace"):
        assert _family(1, 4352, **{flag: True}) == "general", flag


def test_num_splits():
    assert dec.num_splits(4, 34, 132) == dec.MAX_SPLITS  # B 1, Hkv 4, 4352 keys: capped
    assert dec.num_splits(32, 34, 132) == 9  # B 8: 2 programs per SM
    assert dec.num_splits(4, 3, 132) == 1  # too few key blocks to share
    assert dec.num_splits(1024, 68, 132) == 1  # the grid is full without splitting
    assert dec.num_splits(4, 34, None) == 4  # CPU


@pytest.fixture
def spy(monkeypatch, poisoned):
    """Counts the decode launches made through kernels/attention.py's dispatch (outputs
    poisoned: conftest's ``poisoned``)."""
    calls = []
    real = dec.attention_decode_forward

    def spying(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(dec, "attention_decode_forward", spying)
    return calls


def _hf_step(B=2, Hq=4, Hkv=2, Lq=1, Lk=300, D=32, filled=120, dtype=torch.float32):
    q, k, v = inputs(B, Hq, Hkv, Lq, Lk, D, D, dtype)
    mask = masks("float", B, 1, Lq, Lk, filled, dtype)  # (B, 1, Lq, Lk), broadcast by the op
    return q, k, v, mask


def test_op_dispatches_decode_and_backward_matches(spy):
    """The op picks the decode forward for a decode step; its backward (the general kernels,
    from the decode forward's out and lse) matches the reference's gradients."""
    q, k, v, mask = _hf_step()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with kernels():
        out, lse = OPS.attention(*leaves, mask, 0.0, False, 0.125)
        assert len(spy) == 1, "the decode kernels did not run"
        ref_out, ref_lse = reference(*ref_leaves, mask, False, 0.125)
        check(out.detach(), lse, ref_out.detach(), ref_lse.detach(), torch.float32)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        out.backward(dout)
    ref_out.backward(dout.double())
    for name, a, r in zip("qkv", leaves, ref_leaves):
        err = rel_err(a.grad, r.grad)
        assert err <= 1e-5, f"d{name}: rel err {err:.3g}"


def test_replace_mask_takes_the_general_kernel(spy):
    """A decode-shaped call with a replace mask (which the decode kernels do not take) runs the
    general kernel and gives the replaced scores the bias alone, as the reference does."""
    q, k, v, mask = _hf_step()
    replace = torch.zeros(mask.shape, dtype=torch.bool, device=DEVICE)
    replace[..., 200:] = True  # those keys' scores are the bias (finfo.min there) alone
    bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    rep = replace.expand(bias.shape)
    with kernels():
        out, lse = OPS.attention(q, k, v, bias, 0.0, False, 0.125, None, 0.0, rep)
    assert not spy, "the decode kernels ran with a replace mask"
    s_bias = torch.where(rep, bias.double(), bias.double())  # reference: scores zeroed where replaced
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.where(rep, 0.0, qd @ kd.transpose(-1, -2) * 0.125) + s_bias
    ref = torch.softmax(s, -1) @ vd
    check(out, lse, ref, torch.logsumexp(s, -1), torch.float32)


def test_compiled_decode_step_matches(spy):
    """An HF-style decode step (scores + 4-D float mask, softmax, @ v) compiled with the plugin:
    fused into the op, which runs the decode kernels (interpreter), matching the reference."""
    q, k, v, mask = _hf_step(Lq=3)

    def step(q, k, v, mask):
        k = k.repeat_interleave(2, 1)
        v = v.repeat_interleave(2, 1)
        s = q @ k.transpose(-1, -2) * 0.125 + mask
        return torch.softmax(s.float(), -1).to(q.dtype) @ v

    torch._dynamo.reset()
    counters.clear()
    # caches off: a cached graph would not trace the launcher again (the spy sees that trace)
    with kernels(), torch._inductor.config.patch(force_disable_caches=True):
        out, code = run_and_get_code(torch.compile(step, backend="fuse_plugin"), q, k, v, mask)
    assert counters["fuse_plugin"]["attention"] == 1, "the attention was not fused"
    # traced once in the interpreter; on the GPU Inductor may trace the launcher again (same call)
    assert spy and all(shape == spy[0] for shape in spy), f"the decode kernels did not run: {spy}"
    if DEVICE == "cuda":  # compiled on the GPU, Inductor launches them itself
        assert "attention_decode_split_kernel" in "\n".join(code)
    ref_out, _ = reference(q, k, v, mask, False, 0.125)
    assert rel_err(out, ref_out) <= 1e-5
