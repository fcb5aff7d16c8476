"""Flash-attention kernels (fuse_plugin.kernels.attention) against a float64 eager reference.

Runs on the GPU when there is one, else in Triton's CPU interpreter (see conftest.py), so the
shapes are tiny. Each case combines several features; small `config=` tiles make short sequences
span several blocks (partial blocks, causal block skipping, BLOCK_M != BLOCK_N).
"""
import math

import pytest
import torch
import helpers
from helpers import DEVICE, poisoned_empty, rel_err

from fuse_plugin.kernels import attention as attn
from fuse_plugin.kernels import attention_config as C
from fuse_plugin.kernels import attention_general as G
from fuse_plugin.kernels import attention_hopper as Hop
from fuse_plugin.kernels import host, registry
from fuse_plugin.kernels.host import layout_like

NEG_INF = float("-inf")
# The interpreter evaluates with numpy, which warns about the intended 0/0 and log2(0) of fully
# masked rows (real ones and the padding rows of partial tiles).
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _home(name: str):
    """The launch module that calls kernel ``name`` (where a spy must replace it)."""
    for module in (G, Hop):
        if hasattr(module, name):
            return module
    raise AttributeError(name)


@pytest.fixture(autouse=True)
def poisoned_outputs_no_tf32(poisoned):
    """Every test here runs with NaN-poisoned kernel outputs and without tf32 (conftest's
    ``poisoned``: an element a kernel forgets to write fails the NaN checks below)."""
    yield


def reference(q, k, v, bias, is_causal, scale):
    """float64 eager attention -> (out, lse). Fully masked rows come out as 0 rather than NaN
    (max/sum guarded) so that autograd stays finite; the kernel's backward treats such rows as
    contributing nothing, which is what these reference gradients are."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s.masked_fill(~bias, NEG_INF) if bias.dtype == torch.bool else s + bias
    if is_causal:
        Lq, Lk = s.shape[-2:]
        visible = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, NEG_INF)
    with torch.no_grad():
        lse = torch.logsumexp(s, -1)
        m = s.amax(-1, keepdim=True)
        m = m.masked_fill(torch.isinf(m), 0.0)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    return p @ v, lse


def make_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, transposed):
    """Random q, k, v; `transposed` gives the (B, L, H, D).transpose(1, 2) layout."""
    def rand(H, L, d):
        if transposed:
            return torch.randn(B, L, H, d, device=DEVICE).to(dtype).transpose(1, 2)
        return torch.randn(B, H, L, d, device=DEVICE).to(dtype)
    return rand(Hq, Lq, D), rand(Hkv, Lk, D), rand(Hkv, Lk, Dv)


def make_bias(kind, B, Hq, Lq, Lk, dtype):
    shape = (B, Hq, Lq, Lk)
    if kind is None:
        return None
    if kind == "float_11":  # per (query, key), shared by batch and heads
        return (2 * torch.randn(1, 1, Lq, Lk, device=DEVICE)).to(dtype).expand(shape)
    if kind == "float_b1":  # per (batch, key): a padding-style bias
        return (2 * torch.randn(B, 1, 1, Lk, device=DEVICE)).to(dtype).expand(shape)
    if kind == "bool_b1":  # per (batch, key): a key-padding mask; key 0 kept (no dead row)
        keep = torch.rand(B, 1, 1, Lk, device=DEVICE) > 0.4
        keep[..., 0] = True
        return keep.expand(shape)
    if kind == "bool_b1q":  # per (batch, query, key); key 0 always kept so no row is dead
        keep = torch.rand(B, 1, Lq, Lk, device=DEVICE) > 0.4
        keep[..., 0] = True
        return keep.expand(shape)
    raise ValueError(kind)


def check_close(name, actual, expected, tol, nan_rows=None):
    """rel_err within tol; NaN exactly on `nan_rows` (a bool mask over the leading dims)."""
    if nan_rows is None:
        nan_rows = torch.zeros(actual.shape[:3], dtype=torch.bool, device=actual.device)
    nan = torch.isnan(actual)
    if actual.dim() == 4:
        assert nan[nan_rows].all(), f"{name}: expected NaN rows are not NaN"
        assert not nan[~nan_rows].any(), f"{name}: unexpected NaN"
    else:
        assert not nan.any(), f"{name}: unexpected NaN"
    helpers.check_close(name, actual[~nan_rows], expected[~nan_rows], tol)


def run_case(*, dtype, B, Hq, Hkv, Lq, Lk, D, Dv, causal, bias, transposed=False,
             dout_kind="dense", need_dbias=False, config=None, scale=None, edit_bias=None,
             deterministic=False, group_split=None, config_bwd=None):
    torch.manual_seed(1234)
    scale = D ** -0.5 if scale is None else scale
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, transposed)
    bias_t = make_bias(bias, B, Hq, Lq, Lk, dtype)
    if edit_bias is not None:
        bias_t = edit_bias(bias_t)
    if dout_kind == "expanded":  # stride 0 along the query dim
        dout = torch.randn(B, Hq, 1, Dv, device=DEVICE).to(dtype).expand(B, Hq, Lq, Dv)
    else:
        dout = torch.randn(B, Hq, Lq, Dv, device=DEVICE).to(dtype)

    # Reference on float64 leaves (the bias as a dense leaf, so its grad is the full dS).
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_bias = None
    if bias_t is not None:
        ref_bias = bias_t if bias_t.dtype == torch.bool else \
            bias_t.detach().double().contiguous().requires_grad_()
    ref_out, ref_lse = reference(*leaves, ref_bias, causal, scale)
    ref_out.backward(dout.double())

    cfg_f = cfg_b = None
    if config is not None:  # a Gluon forward config leaves the backward to the table
        cfg_f = attn.AttentionConfig(*config)
        cfg_b = None if cfg_f.kernel in C.GLUON_FWD_KERNELS else cfg_f
    if config_bwd is not None:
        cfg_b = attn.AttentionConfig(*config_bwd)
    out, lse = attn.attention_forward(q, k, v, bias_t, is_causal=causal, scale=scale, config=cfg_f)
    assert out.shape == (B, Hq, Lq, Dv) and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous(), f"out must be laid out (B, Lq, Hq, Dv), strides {out.stride()}"
    assert lse.shape == (B, Hq, Lq) and lse.dtype == torch.float32 and lse.is_contiguous()

    tol = TOL[dtype]
    dead = torch.isneginf(ref_lse)  # fully masked rows
    check_close("out", out, ref_out, tol, nan_rows=dead)
    assert torch.isneginf(lse[dead]).all(), "lse of a fully masked row must be -inf"
    # Huge lse (finfo.min rows) only to fp32 relative precision; the rest by rel_err.
    huge = ref_lse.abs() > 1e30
    assert torch.allclose(lse[huge].double(), ref_lse[huge], rtol=1e-6, atol=0)
    normal = ~dead & ~huge
    lse_err = rel_err(lse[normal], ref_lse[normal])
    assert lse_err <= tol, f"lse: rel_err {lse_err:.3g}"

    dq, dk, dv, dbias = attn.attention_backward(
        dout, q, k, v, bias_t, out, lse, is_causal=causal, scale=scale, need_dbias=need_dbias,
        config=cfg_b, deterministic=deterministic, group_split=group_split)
    for name, got, want, ref in (("dq", dq, q, leaves[0]), ("dk", dk, k, leaves[1]),
                                 ("dv", dv, v, leaves[2])):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        # dense in its input's memory order (host.layout_like, as the op's fake)
        assert got.stride() == layout_like(want, want.dtype).stride(), (name, got.stride(), want.stride())
        check_close(name, got, ref.grad, tol)
    if need_dbias:
        # summed over the dims the bias broadcasts over (stride 0): its un-broadcast shape
        want = tuple(1 if st == 0 else n for n, st in zip(bias_t.shape, bias_t.stride()))
        assert dbias.shape == want and dbias.dtype == torch.float32
        check_close("dbias", dbias, ref_bias.grad.sum_to_size(want), tol)
    else:
        assert dbias is None


CASES = {
    # GQA 4/2, causal with Lq < Lk (skipped key blocks still get dS = 0), shared 2-D float
    # bias, transposed q/k/v, dbias, 16x16 tiles.
    "fp32-gqa-causal-floatbias-transposed-dbias": dict(
        dtype=torch.float32, B=2, Hq=4, Hkv=2, Lq=17, Lk=33, D=16, Dv=16, causal=True,
        bias="float_11", transposed=True, need_dbias=True, config=(16, 16, 4, 1)),
    # MQA, causal with Lq > Lk, D=80 != Dv=48 (masked head dims), padding-style bias,
    # stride-0 dout, dbias, BLOCK_M != BLOCK_N.
    "fp32-mqa-causal-d80-dv48-paddingbias-expanded-dout": dict(
        dtype=torch.float32, B=2, Hq=4, Hkv=1, Lq=33, Lk=17, D=80, Dv=48, causal=True,
        bias="float_b1", dout_kind="expanded", need_dbias=True, config=(32, 16, 4, 1), scale=0.3),
    # Single query row, Dv != D, bool bias, GQA, default tiles.
    "fp16-lq1-boolbias-gqa": dict(
        dtype=torch.float16, B=2, Hq=4, Hkv=2, Lq=1, Lk=33, D=16, Dv=32, causal=False,
        bias="bool_b1q"),
    # Single key, causal (every row sees key 0 only), padding bias, dbias.
    "fp16-lk1-causal-dbias": dict(
        dtype=torch.float16, B=1, Hq=2, Hkv=2, Lq=17, Lk=1, D=16, Dv=16, causal=True,
        bias="float_b1", need_dbias=True, config=(16, 16, 4, 1)),
    # bf16, MQA, causal + bool bias, D=80, transposed, stride-0 dout, 16x32 tiles.
    "bf16-mqa-causal-boolbias-d80-transposed": dict(
        dtype=torch.bfloat16, B=1, Hq=4, Hkv=1, Lq=33, Lk=33, D=80, Dv=80, causal=True,
        bias="bool_b1q", transposed=True, dout_kind="expanded", config=(16, 32, 4, 1)),
    # A bool key-padding mask (read one value per key, BIAS_KEYS), GQA, causal, Lq < Lk.
    "fp16-gqa-causal-boolpadding": dict(
        dtype=torch.float16, B=2, Hq=4, Hkv=2, Lq=33, Lk=40, D=32, Dv=32, causal=True,
        bias="bool_b1", config=(16, 16, 4, 1)),
    # bf16, no bias, GQA, default tiles, Lq != Lk.
    "bf16-nobias-gqa": dict(
        dtype=torch.bfloat16, B=1, Hq=4, Hkv=2, Lq=33, Lk=17, D=16, Dv=16, causal=False,
        bias=None),


    # Split head dims (96 = 64 + 32, Dv 80 = 64 + 16), causal, key blocks wider than query
    # blocks (several masked diagonal blocks, last key block partial), GQA, transposed.
    "bf16-split-d96-dv80-causal-gqa": dict(
        dtype=torch.bfloat16, B=1, Hq=4, Hkv=2, Lq=70, Lk=70, D=96, Dv=80, causal=True,
        bias=None, transposed=True, config=(16, 64, 4, 1, True)),
    # Split head dims with a float bias and dbias, query blocks wider than key blocks, Lq > Lk.
    "fp16-split-d80-floatbias-dbias": dict(
        dtype=torch.float16, B=2, Hq=2, Hkv=1, Lq=45, Lk=37, D=80, Dv=80, causal=True,
        bias="float_11", need_dbias=True, config=(32, 16, 4, 1, True)),
    # A large head dim with the default tiles (deterministic: the general pair's 64 x 64, the
    # fallback of a table "tma_pair" entry; atomic: 32 x 64), MQA, causal, partial blocks.
    "bf16-d160-default-tiles": dict(
        dtype=torch.bfloat16, B=1, Hq=2, Hkv=1, Lq=70, Lk=70, D=160, Dv=160, causal=True,
        bias=None),
    # Non-causal, lengths that are exact multiples of the tiles (no partial block at all), a
    # negative scale (the fully visible blocks take the row max from the raw dots).
    "fp32-aligned-negative-scale": dict(
        dtype=torch.float32, B=1, Hq=2, Hkv=2, Lq=32, Lk=64, D=32, Dv=32, causal=False,
        bias=None, config=(16, 32, 4, 1), scale=-0.2),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_attention_matches_reference(case, deterministic):
    """Both backward paths: the default one-kernel atomic-dQ path and the deterministic pair."""
    run_case(**case, deterministic=deterministic)


@pytest.mark.parametrize("split", [2, 4])
def test_gqa_group_split_over_programs(split):
    """The atomic backward with each GQA group shared out over `split` programs (fp32 dK/dV
    partials summed afterwards), causal, with a bias gradient and partial blocks."""
    run_case(dtype=torch.float32, B=1, Hq=8, Hkv=2, Lq=40, Lk=33, D=32, Dv=16, causal=True,
             bias="float_b1", need_dbias=True, config=(16, 16, 4, 1), group_split=split)


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.float16, 128),
                                     (torch.bfloat16, 256), (torch.float32, 192)],
                         ids=["bf16-d64", "fp16-d128", "bf16-d256", "fp32-d192"])
def test_default_configs(dtype, D):
    """The default tiles of every head-dim bracket (so a GPU run compiles and checks them too)."""
    run_case(dtype=dtype, B=1, Hq=2, Hkv=1, Lq=40, Lk=72, D=D, Dv=D, causal=True,
             bias="float_11", need_dbias=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_and_finfo_min_rows(dtype):
    """Row 3 of head 0 fully masked by a -inf bias (out NaN, lse -inf as eager; no NaN in any
    gradient) and row 5 of head 1 biased by finfo.min everywhere (uniform weights as eager; its
    gradients need the exact row statistics the backward preprocess recomputes)."""
    def edit(bias):
        bias = bias.clone()  # dense, so single rows can be set
        bias[0, 0, 3, :] = NEG_INF
        bias[0, 1, 5, :] = torch.finfo(dtype).min
        return bias
    run_case(dtype=dtype, B=1, Hq=2, Hkv=1, Lq=17, Lk=33, D=16, Dv=16, causal=False,
             bias="float_11", need_dbias=True, config=(16, 16, 4, 1), edit_bias=edit)


# The one-launch backward (ONE_KEY_BLOCK): every key in one block, no preprocess kernel, dQ
# stored by the kernel. Edge rows as above (a -inf row, a finfo.min row whose exact statistics
# the kernel takes from its own tile, a bool-masked dead row), partial and exact blocks.
def _finfo_rows(dtype):
    def edit(bias):
        bias = bias.clone()
        bias[0, 0, 3, :] = NEG_INF
        bias[0, 1, 5, :] = torch.finfo(dtype).min
        return bias
    return edit


def _bool_dead_row(bias):
    bias = bias.clone()
    bias[0, 1, 7, :] = False
    return bias


ONE_BLOCK_CASES = {
    "fp32-floatbias-finfo-rows-dbias": dict(
        dtype=torch.float32, B=1, Hq=2, Hkv=1, Lq=40, Lk=33, D=16, Dv=16, causal=False,
        bias="float_11", need_dbias=True, config_bwd=(16, 64, 4, 1),
        edit_bias=_finfo_rows(torch.float32)),
    "bf16-floatbias-finfo-rows": dict(
        dtype=torch.bfloat16, B=1, Hq=2, Hkv=1, Lq=17, Lk=32, D=32, Dv=32, causal=False,
        bias="float_b1", config_bwd=(16, 32, 4, 1), edit_bias=_finfo_rows(torch.bfloat16)),
    "fp16-causal-booldead-gqa-transposed": dict(
        dtype=torch.float16, B=2, Hq=4, Hkv=2, Lq=33, Lk=33, D=16, Dv=32, causal=True,
        bias="bool_b1q", transposed=True, config_bwd=(16, 64, 4, 1), edit_bias=_bool_dead_row),
    "bf16-split-d80-causal-lq-gt-lk": dict(
        dtype=torch.bfloat16, B=1, Hq=2, Hkv=2, Lq=45, Lk=20, D=80, Dv=80, causal=True,
        bias=None, config_bwd=(16, 32, 4, 1, True)),
    "bf16-boolpadding-transposed": dict(
        dtype=torch.bfloat16, B=2, Hq=2, Hkv=1, Lq=40, Lk=30, D=32, Dv=32, causal=False,
        bias="bool_b1", transposed=True, config_bwd=(16, 32, 4, 1)),
    "fp32-gqa-split-expanded-dout": dict(
        dtype=torch.float32, B=1, Hq=8, Hkv=2, Lq=24, Lk=16, D=32, Dv=16, causal=False,
        bias=None, dout_kind="expanded", config_bwd=(16, 16, 4, 1), group_split=2),
}


@pytest.mark.parametrize("case", list(ONE_BLOCK_CASES.values()), ids=list(ONE_BLOCK_CASES))
def test_one_key_block_backward(monkeypatch, case):
    """Lk <= BLOCK_N: one launch of attention_bwd_kernel and nothing else (no preprocess, no dQ
    cast), gradients against float64."""
    spies = {n: _LaunchSpy(getattr(_home(n), n)) for n in (
        "attention_bwd_kernel", "attention_bwd_preprocess_kernel", "attention_dq_cast_kernel")}
    for n, spy in spies.items():
        monkeypatch.setattr(_home(n), n, spy)
    run_case(**case)
    assert [s.launches for s in spies.values()] == [1, 0, 0]


def test_bool_bias_dead_row():
    """A bool bias that masks a whole row, with causal on: out NaN, lse -inf, finite grads."""
    def edit(bias):
        bias = bias.clone()
        bias[1, 2, 7, :] = False
        return bias
    run_case(dtype=torch.float16, B=2, Hq=4, Hkv=2, Lq=17, Lk=17, D=16, Dv=16, causal=True,
             bias="bool_b1q", config=(16, 16, 4, 1), edit_bias=edit)


def test_configs_fit_head_dims():
    """Default tiles are powers of 2 >= 16 for every supported head dim and dtype."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (16, 64, 80, 96, 128, 160, 192, 256):
            for cfg in (C.forward_config(d, d, dtype), C.backward_config(d, d, dtype),
                        C.deterministic_backward_config(d, d, dtype)):
                for blk in (cfg.block_m, cfg.block_n):
                    assert blk >= 16 and blk & (blk - 1) == 0
            assert C.block_d(d) == max(16, 1 << math.ceil(math.log2(d)))


def test_launch_checks():
    """Bad tile sizes and layouts whose in-tile offsets would overflow int32 are refused."""
    q = torch.randn(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="powers of 2"):
        attn.attention_forward(q, q, q, None, is_causal=False, scale=1.0,
                               config=attn.AttentionConfig(24, 16, 4, 1))
    with pytest.raises(ValueError, match="overflow int32"):
        G.check_tile_offsets([("bias", 2**28, 1, 16, 16)])  # 15 * 2**28 > 2**31
    G.check_tile_offsets([("bias", 2**28, 1, 8, 16)])  # 7 * 2**28 + 15 < 2**31


def test_head_dim_split():
    """Split head dims cover d with two powers of 2 only where that saves padding."""
    assert C.d_parts(80, True) == (64, 16)
    assert C.d_parts(96, True) == (64, 32)
    assert C.d_parts(160, True) == (128, 32)
    assert C.d_parts(192, True) == (128, 64)
    assert C.d_parts(112, True) == (128, 0)  # 64 + 64 saves nothing
    assert C.d_parts(128, True) == (128, 0)
    assert C.d_parts(80, False) == (128, 0)
    for d in range(16, 257):
        d0, d1 = C.d_parts(d, True)
        assert d0 + d1 >= d and (d1 == 0 or d0 < d)


@pytest.mark.parametrize("D", [64, 96])
def test_deterministic_flag_picks_atomic_free_path(monkeypatch, D):
    """torch.use_deterministic_algorithms(True) routes the backward to the two atomic-free
    kernels; the results agree with the atomic path to rounding."""
    calls = []
    for name in ("attention_bwd_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"):
        kernel = getattr(_home(name), name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                calls.append(self.name)
                return self.kernel[grid]

        monkeypatch.setattr(_home(name), name, Spy(kernel, name))
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 2, 1, 40, 40, D, D, torch.float16, False)
    dout = torch.randn_like(q)
    out, lse = attn.attention_forward(q, k, v, None, is_causal=True, scale=D ** -0.5)
    grads = {}
    for det in (False, True):
        calls.clear()
        with torch_deterministic(det):
            grads[det] = attn.attention_backward(dout, q, k, v, None, out, lse, is_causal=True,
                                                 scale=D ** -0.5, need_dbias=False)[:3]
        pair = ["attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]
        if det:
            assert calls == pair
        else:  # the table's kernel (on an H100 a Gluon one, which these spies do not see)
            assert not set(pair) & set(calls), calls
    for a, b in zip(grads[False], grads[True]):
        assert rel_err(a, b) < 2e-3


def test_two_kernel_config_runs_the_atomic_free_pair(monkeypatch):
    """A "two_kernel" config (user-given or a table entry) runs the atomic-free pair outside
    deterministic mode too, with the same gradients; the forward refuses it by name."""
    spies = {n: _LaunchSpy(getattr(_home(n), n)) for n in
             ("attention_bwd_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel")}
    for n, spy in spies.items():
        monkeypatch.setattr(_home(n), n, spy)
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4, 2, 40, 40, 32, 32, torch.bfloat16, False)
    dout = torch.randn_like(q)
    out, lse = attn.attention_forward(q, k, v, None, is_causal=True, scale=0.2)
    two = attn.AttentionConfig(16, 32, 4, 1, False, "two_kernel")
    atomic = attn.attention_backward(dout, q, k, v, None, out, lse, is_causal=True, scale=0.2,
                                     need_dbias=False, deterministic=False)[:3]
    assert [s.launches for s in spies.values()] == [1, 0, 0]
    got = attn.attention_backward(dout, q, k, v, None, out, lse, is_causal=True, scale=0.2,
                                  need_dbias=False, config=two, deterministic=False)[:3]
    assert [s.launches for s in spies.values()] == [1, 1, 1]
    monkeypatch.setattr(registry, "table_config", lambda *a: two)
    table = attn.attention_backward(dout, q, k, v, None, out, lse, is_causal=True, scale=0.2,
                                    need_dbias=False, deterministic=False)[:3]
    assert [s.launches for s in spies.values()] == [1, 2, 2]
    for a, b, c in zip(atomic, got, table):
        assert rel_err(b, a) < 1e-2 and torch.equal(b, c)
    with pytest.raises(ValueError, match="'two_kernel' is not a fwd kernel"):
        attn.attention_forward(q, k, v, None, is_causal=True, scale=0.2, config=two)
    with pytest.raises(ValueError, match="config kernel must be one of"):
        attn.attention_forward(q, k, v, None, is_causal=True, scale=0.2,
                               config=(16, 32, 4, 1, False, True))


class torch_deterministic:
    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.old = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(self.on)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.old)


def test_out_of_resources_falls_back(monkeypatch):
    """A table/heuristic config the GPU cannot hold is retried with fewer stages, then with the
    smallest tiles (with a warning), and the working fallback is remembered; a config the user
    passed is not second-guessed."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(G, "_FAILED_CONFIGS", {})
    big = attn.AttentionConfig(128, 128, 8, 3)
    seen = []

    def launch(cfg):
        seen.append(cfg)
        if cfg.block_m == 128:
            raise OutOfResources(300000, 232448, "shared memory")
        return "ok"

    with pytest.warns(RuntimeWarning, match="does not fit"):
        assert G.with_retry(launch, big, user_given=False) == "ok"
    assert seen == [big, big._replace(num_stages=2), big._replace(num_stages=1),
                    C.SAFE_CONFIG]
    seen.clear()
    assert G.with_retry(launch, big, user_given=False) == "ok"  # remembered: no retries
    assert seen == [C.SAFE_CONFIG]
    with pytest.raises(OutOfResources):
        G.with_retry(launch, big, user_given=True)

    seen.clear()
    fits_with_two = attn.AttentionConfig(64, 128, 8, 4)
    monkeypatch.setattr(G, "_FAILED_CONFIGS", {})

    def launch2(cfg):
        seen.append(cfg)
        if cfg.num_stages > 2:
            raise OutOfResources(300000, 232448, "shared memory")
        return "ok"

    with pytest.warns(RuntimeWarning):
        assert G.with_retry(launch2, fits_with_two, user_given=False) == "ok"
    assert seen[-1] == fits_with_two._replace(num_stages=2)



# The Hopper TMA kernels (kernels/attention_fwd_tma.py, attention_bwd_tma.py; `AttentionConfig.tma`).
# On the CPU their tensor-descriptor loads run in Triton's interpreter (the backward's dQ through
# element atomics there: the interpreter has no descriptor reductions).
TMA_CASES = {
    # GQA, causal, partial last blocks, HF's transposed (B, L, H, D) layout.
    "bf16-d64-gqa-causal-transposed": dict(
        dtype=torch.bfloat16, B=1, Hq=4, Hkv=2, Lq=70, Lk=70, D=64, Dv=64, causal=True,
        bias=None, transposed=True, config=(32, 16, 4, 1, False, "tma")),
    # Full attention, Lq < Lk, MQA with the group shared over 2 programs, D 128.
    "fp16-d128-mqa-full-lq-lt-lk-split": dict(
        dtype=torch.float16, B=2, Hq=2, Hkv=1, Lq=17, Lk=40, D=128, Dv=128, causal=False,
        bias=None, config=(16, 16, 4, 1, False, "tma"), group_split=2),
    # Causal with Lq > Lk: rows past the last key see every key (top-left alignment).
    "bf16-d128-causal-lq-gt-lk": dict(
        dtype=torch.bfloat16, B=1, Hq=2, Hkv=2, Lq=40, Lk=17, D=128, Dv=128, causal=True,
        bias=None, config=(16, 32, 4, 1, False, "tma")),
    # One query, one key.
    "fp16-d64-single": dict(
        dtype=torch.float16, B=2, Hq=2, Hkv=1, Lq=1, Lk=1, D=64, Dv=64, causal=True,
        bias=None, config=(16, 16, 4, 1, False, "tma")),
}


class _LaunchSpy:
    """Stands in for a Triton kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


class _ArgSpy(_LaunchSpy):
    """A launch spy that also keeps each launch's keyword arguments (the constexprs)."""

    def __init__(self, kernel):
        super().__init__(kernel)
        self.kwargs = []

    def __getitem__(self, grid):
        launch = super().__getitem__(grid)

        def call(*args, **kwargs):
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)
        return call


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("bias,keys", [("float_b1", True), ("bool_b1", True),
                                       ("float_11", False), ("bool_b1q", False)])
def test_key_padding_bias_is_read_per_key(monkeypatch, bias, keys, deterministic):
    """A bias with query stride 0 (a padding mask broadcast over the queries) is read one value
    per key (BIAS_KEYS) by the forward and every backward kernel that reads the bias; a bias
    that varies over queries is read as tiles. Results against float64 as everywhere."""
    names = ("attention_fwd_kernel", "attention_bwd_kernel", "attention_bwd_preprocess_kernel",
             "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel")
    spies = {n: _ArgSpy(getattr(_home(n), n)) for n in names}
    for n, spy in spies.items():
        monkeypatch.setattr(_home(n), n, spy)
    run_case(dtype=torch.float32, B=2, Hq=2, Hkv=1, Lq=20, Lk=40, D=16, Dv=16, causal=False,
             bias=bias, config=(16, 16, 4, 1), deterministic=deterministic)
    seen = [kw["BIAS_KEYS"] for spy in spies.values() for kw in spy.kwargs]
    assert len(seen) >= 3 and set(seen) == {keys}, seen


@pytest.mark.parametrize("case", list(TMA_CASES.values()), ids=list(TMA_CASES))
def test_tma_kernels_match_reference(monkeypatch, case):
    """Forward and (atomic) backward through the TMA kernels; the deterministic backward has
    no TMA variant and ignores the flag."""
    spies = {}
    for name in ("attention_fwd_tma_kernel", "attention_bwd_tma_kernel"):
        spies[name] = _LaunchSpy(getattr(_home(name), name))
        monkeypatch.setattr(_home(name), name, spies[name])
    run_case(**case)
    assert all(s.launches == 1 for s in spies.values()), {n: s.launches for n, s in spies.items()}
    run_case(**case, deterministic=True)
    assert spies["attention_bwd_tma_kernel"].launches == 1


# The atomic-free pair with TMA tiles ("tma_pair"): the dK/dV kernel and the dQ kernel, each with
# its own tiles; D 256 too.
TMA_PAIR_CASES = TMA_CASES | {
    "bf16-d256-gqa-causal-lq-lt-lk": dict(
        dtype=torch.bfloat16, B=1, Hq=4, Hkv=2, Lq=23, Lk=40, D=256, Dv=256, causal=True,
        bias=None),
    "fp16-d256-full-lq-gt-lk": dict(
        dtype=torch.float16, B=2, Hq=1, Hkv=1, Lq=40, Lk=17, D=256, Dv=256, causal=False,
        bias=None),
}
TMA_PAIR_CONFIG = (16, 32, 4, 1, False, "tma_pair", (32, 16, 4, 1))


@pytest.mark.parametrize("case", list(TMA_PAIR_CASES.values()), ids=list(TMA_PAIR_CASES))
def test_tma_pair_matches_reference(monkeypatch, case):
    """The backward through the TMA pair (outputs poisoned with NaN beforehand), in and out of
    deterministic mode (it is atomic-free, so both run it), with the group split of the case."""
    spies = {}
    for name in ("attention_bwd_dkdv_tma_kernel", "attention_bwd_dq_tma_kernel",
                 "attention_bwd_tma_kernel", "attention_bwd_kernel", "attention_bwd_dkdv_kernel"):
        spies[name] = _LaunchSpy(getattr(_home(name), name))
        monkeypatch.setattr(_home(name), name, spies[name])
    case = {n: v for n, v in case.items() if n != "config"}
    for det in (False, True):
        run_case(**case, config_bwd=TMA_PAIR_CONFIG, deterministic=det)
    assert [s.launches for s in spies.values()] == [2, 2, 0, 0, 0], \
        {n: s.launches for n, s in spies.items()}


def test_tma_pair_is_deterministic_and_matches_the_general_pair():
    """Same bits on a second run (no atomics), and the general pair's gradients to rounding."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4, 2, 50, 50, 64, 64, torch.bfloat16, False)
    dout = torch.randn_like(q)
    out, lse = attn.attention_forward(q, k, v, None, is_causal=True, scale=0.125)
    run = lambda cfg: attn.attention_backward(dout, q, k, v, None, out, lse, is_causal=True,  # noqa: E731
                                              scale=0.125, need_dbias=False, config=cfg)[:3]
    a, b = run(TMA_PAIR_CONFIG), run(TMA_PAIR_CONFIG)
    general = run(attn.AttentionConfig(16, 32, 4, 1, False, "two_kernel"))
    for x, y, z in zip(a, b, general):
        assert torch.equal(x, y) and rel_err(x, z) < 1e-2


@pytest.mark.parametrize("config", [None, (16, 16, 4, 1, False, "two_kernel"), (16, 16, 4, 1, False, "tma"),
                                    TMA_PAIR_CONFIG], ids=["default", "two_kernel", "tma", "tma_pair"])
def test_backward_reads_lse_through_its_strides(config):
    """An lse given as the view of a 32-row-padded buffer (as PyTorch's efficient kernel keeps
    its own), the padding poisoned: every backward family of ours reads lse through its strides
    and gives the gradients of the contiguous lse (to bf16 rounding: the atomic ones add in any
    order)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 2, 1, 40, 40, 64, 64, torch.bfloat16, False)
    dout = torch.randn_like(q)
    out, lse = attn.attention_forward(q, k, v, None, is_causal=True, scale=0.125)
    padded = torch.full((2, 2, 64), float("nan"), device=DEVICE)
    padded[..., :40] = lse
    view = padded[..., :40]
    cfg = None if config is None else attn.AttentionConfig(*config)
    run = lambda lse: attn.attention_backward(dout, q, k, v, None, out, lse, is_causal=True,  # noqa: E731
                                              scale=0.125, need_dbias=False, config=cfg)[:3]
    for got, want in zip(run(view), run(lse)):
        assert not got.isnan().any() and rel_err(got, want) < 1e-2


def test_tma_pair_refused_or_replaced_where_it_cannot_run(monkeypatch):
    """A user-given "tma_pair" config on a problem it does not cover is an error naming why; a
    table entry falls back to the general pair (with rope outside deterministic mode: the atomic
    kernel), still right. Malformed dq tiles and a dq tile on another kernel are refused."""
    torch.manual_seed(0)
    pair = attn.AttentionConfig(*TMA_PAIR_CONFIG)
    q, k, v = make_qkv(1, 2, 2, 20, 20, 96, 96, torch.float16, False)
    out, lse = attn.attention_forward(q, k, v, None, is_causal=True, scale=0.1)
    bwd = lambda cfg, **kw: attn.attention_backward(  # noqa: E731
        out, q, k, v, kw.pop("bias", None), out, lse, is_causal=True, scale=0.1,
        need_dbias=kw.pop("need_dbias", False), config=cfg, **kw)
    with pytest.raises(ValueError, match=r"'tma_pair' kernel family cannot run this problem \(.*\): it needs D == Dv in \(64, 128, 256\)"):
        bwd(pair)
    q64, k64, v64 = (t[..., :64].contiguous() for t in (q, k, v))
    o64, l64 = attn.attention_forward(q64, k64, v64, None, is_causal=True, scale=0.1)
    with pytest.raises(ValueError, match=r"'tma_pair' kernel family cannot run this problem \(.*\): it writes no dbias"):
        attn.attention_backward(o64, q64, k64, v64, None, o64, l64, is_causal=True, scale=0.1,
                                need_dbias=True, config=pair)
    for bad, match in ((pair._replace(dq_tile=(24, 16, 4, 1)), "powers of 2"),
                       (pair._replace(dq_tile=(16, 16, 4)), "dq_tile is"),
                       (attn.AttentionConfig(16, 16, 4, 1, False, "two_kernel", (16, 16, 4, 1)),
                        "dq_tile is")):
        with pytest.raises(ValueError, match=match):
            attn.attention_backward(o64, q64, k64, v64, None, o64, l64, is_causal=True,
                                    scale=0.1, need_dbias=False, config=bad)
    with pytest.raises(ValueError, match="'tma_pair' is not a fwd kernel"):
        attn.attention_forward(q64, k64, v64, None, is_causal=True, scale=0.1, config=pair)
    # Table path: D 96 -> the general pair (deterministic tiles), right answer.
    spies = {n: _LaunchSpy(getattr(_home(n), n)) for n in
             ("attention_bwd_dq_tma_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_kernel")}
    for n, spy in spies.items():
        monkeypatch.setattr(_home(n), n, spy)
    monkeypatch.setattr(registry, "table_config", lambda *a: pair)
    got = bwd(None)[:3]
    want = bwd(C.deterministic_backward_config(96, 96, torch.float16)._replace(
        kernel="two_kernel"))[:3]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [s.launches for s in spies.values()] == [0, 2, 0]
    # ... and with rope outside deterministic mode the atomic kernel's heuristic tiles.
    rope = attn.Rope(torch.randn(1, 1, 20, 96, device=DEVICE), torch.randn(1, 1, 20, 96, device=DEVICE),
                     False, 96)
    bwd(None, rope=rope, deterministic=False)
    assert [s.launches for s in spies.values()] == [0, 2, 1]


def _gluon_why_not() -> str | None:
    if not torch.cuda.is_available():
        return "the Gluon kernels need a CUDA GPU (sm_90 with Triton 3.6); CI runs on the CPU"
    if not Hop.gluon_fwd.GLUON_AVAILABLE:
        return Hop.gluon_fwd._GLUON_WHY_NOT
    if torch.cuda.get_device_capability() != (9, 0):
        return "the Gluon kernels run on sm_90 (Hopper) only"
    return None


GLUON_CONFIGS = {"pingpong-128x128-2": (128, 128, 4, 2, False, "gluon_pingpong"),
                 "128x64-4": (128, 64, 4, 4, False, "gluon"),
                 "persistent-128x128-2": (128, 128, 4, 2, False, "gluon_persistent")}
GLUON_BWD_CONFIGS = {"64x128-2": (64, 128, 8, 2, False, "gluon"),
                     "lpt-64x128-2": (64, 128, 8, 2, False, "gluon_lpt")}


@pytest.mark.skipif(_gluon_why_not() is not None, reason=str(_gluon_why_not()))
@pytest.mark.parametrize("cfg", list(GLUON_CONFIGS.values()), ids=list(GLUON_CONFIGS))
@pytest.mark.parametrize("case", list(TMA_CASES.values()), ids=list(TMA_CASES))
def test_gluon_forward_matches_reference(monkeypatch, case, cfg):
    """The warp-specialised Gluon forward (per tile, and persistent) on the TMA kernels' cases (GQA,
    transposed layout, Lq != Lk both ways, one query), its outputs poisoned with NaN beforehand (an
    unwritten element fails); the backward runs from its out / lse."""
    monkeypatch.setattr(host, "empty", poisoned_empty)
    name = "attention_fwd_gluon_persistent_kernel" if cfg[5] == "gluon_persistent" else "attention_fwd_gluon_kernel"
    spy = _LaunchSpy(getattr(Hop.gluon_fwd, name))
    monkeypatch.setattr(Hop.gluon_fwd, name, spy)
    run_case(**(case | dict(config=cfg)))
    assert spy.launches == 1


@pytest.mark.skipif(_gluon_why_not() is not None, reason=str(_gluon_why_not()))
@pytest.mark.parametrize("cfg", list(GLUON_BWD_CONFIGS.values()), ids=list(GLUON_BWD_CONFIGS))
@pytest.mark.parametrize("case", list(TMA_CASES.values()), ids=list(TMA_CASES))
def test_gluon_backward_matches_reference(monkeypatch, case, cfg):
    """The warp-specialised Gluon backward on the TMA kernels' cases (the forward from the
    table), outputs poisoned with NaN beforehand."""
    spy = _LaunchSpy(Hop.gluon_bwd._attn_bwd_ws_kernel)
    monkeypatch.setattr(Hop.gluon_bwd, "_attn_bwd_ws_kernel", spy)
    launcher = Hop.gluon_bwd.attention_backward_gluon
    monkeypatch.setattr(Hop.gluon_bwd, "attention_backward_gluon",
                        lambda *a, **kw: launcher(*a, **kw, poison=True))
    run_case(**(case | dict(config=None, config_bwd=cfg)))
    assert spy.launches == 1


@pytest.mark.skipif(_gluon_why_not() is not None, reason=str(_gluon_why_not()))
def test_gluon_backward_reads_dout_and_out_by_their_strides():
    """The Gluon backward takes out and dout in the op's output layout ((B, L, H, D) memory) without
    a copy, and copies a dout TMA cannot read (the broadcast gradient of ``out.sum()``): the
    gradients equal those from contiguous inputs (up to the order of dQ's atomic adds), and come
    laid out as q, k, v (also through the GQA split's sum kernel)."""
    torch.manual_seed(0)
    B, H, L, D = 2, 4, 200, 128
    q, k, v = (torch.randn(B, L, H, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    for hkv, split in ((4, None), (1, 2)):  # MHA: dK / dV by TMA; MQA split over 2: by the sum kernel
        kq, vq = k[:, :hkv], v[:, :hkv]
        out, lse = Hop.gluon_fwd.attention_forward_gluon(q, kq, vq, is_causal=True, scale=D ** -0.5)
        dout = torch.randn(B, L, H, D, device=DEVICE, dtype=out.dtype).transpose(1, 2)
        got = Hop.gluon_bwd.attention_backward_gluon(dout, q, kq, vq, out, lse, is_causal=True, scale=D ** -0.5,
                                                     group_split=split)
        want = Hop.gluon_bwd.attention_backward_gluon(dout, q.contiguous(), kq.contiguous(), vq.contiguous(), out,
                                                      lse, is_causal=True, scale=D ** -0.5, group_split=split)
        for g, w, x in zip(got, want, (q, kq, vq)):
            assert rel_err(g, w) < 1e-3
            assert g.stride() == host.layout_like(x, x.dtype).stride() and w.is_contiguous()
    out, lse = Hop.gluon_fwd.attention_forward_gluon(q, k, v, is_causal=True, scale=D ** -0.5)
    strided_out = torch.empty(B, L, H, D, device=DEVICE, dtype=out.dtype).transpose(1, 2).copy_(out)
    kw = dict(is_causal=True, scale=D ** -0.5)
    for dout in (torch.randn(B, L, H, D, device=DEVICE, dtype=out.dtype).transpose(1, 2),
                 torch.ones((), device=DEVICE, dtype=out.dtype).expand(B, H, L, D)):
        got = Hop.gluon_bwd.attention_backward_gluon(dout, q, k, v, strided_out, lse, **kw)
        want = Hop.gluon_bwd.attention_backward_gluon(dout.contiguous(), q, k, v, out, lse, **kw)
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-3


def test_gluon_backward_pre_and_post_kernels():
    """The Gluon backward's plain-Triton kernels (run here too, by the interpreter on the CPU):
    Delta and lse * log2(e) per row into buffers padded to whole query blocks (padding rows 0 and
    +inf), the dQ accumulator zeroed; the scaled cast of dQ into a strided output; the sum of the
    GQA split's fp32 dK / dV partials. Outputs poisoned with NaN beforehand."""
    G = Hop.gluon_bwd
    torch.manual_seed(0)
    B, Hq, Lq, D, pad = 2, 3, 77, 64, 128
    o = torch.randn(B, Lq, Hq, D, device=DEVICE).transpose(1, 2)
    do = torch.randn(B, Hq, Lq, D, device=DEVICE)
    lse = torch.randn(B, Hq, Lq, device=DEVICE)
    delta, lse2 = (torch.full((B, Hq, pad), float("nan"), device=DEVICE) for _ in range(2))
    dqacc = torch.full((B, Hq, pad, D), float("nan"), device=DEVICE)
    G._gluon_bwd_preprocess[(pad // 64, B * Hq)](
        o, do, lse, delta, lse2, dqacc, *o.stride()[:3], *do.stride()[:3], *lse.stride(), Hq, Lq,
        pad, D=D, BLOCK=64)
    assert torch.allclose(delta[..., :Lq], (o * do).sum(-1), atol=1e-5)
    assert (delta[..., Lq:] == 0).all() and (dqacc == 0).all()
    assert torch.allclose(lse2[..., :Lq], lse * 1.4426950408889634)
    assert torch.isposinf(lse2[..., Lq:]).all()
    acc = torch.randn(B, Hq, pad, D, device=DEVICE)
    dq = torch.full((B, Lq, Hq, D), float("nan"), device=DEVICE).transpose(1, 2)
    G._gluon_bwd_dq_cast[(2, B * Hq)](acc, dq, *dq.stride()[:3], Hq, Lq, pad, 0.5, D=D, BLOCK=64)
    assert torch.equal(dq, acc[..., :Lq, :] * 0.5)
    # the split sum into dk / dv laid out (B, L, H, D) in memory, seen (B, H, L, D)
    Bk, Hk, Lk, Dk = 2, 3, 5, 16
    part = torch.randn(2, 3, Bk, Hk, Lk, Dk, device=DEVICE)
    dk, dv = (torch.full((Bk, Lk, Hk, Dk), float("nan"), device=DEVICE, dtype=torch.float16).transpose(1, 2)
              for _ in range(2))
    G._gluon_bwd_split_sum[(Bk * Hk * Lk * Dk // 64 + 1, 2)](
        part, dk, dv, Bk * Hk * Lk * Dk, Hk, Lk, *dk.stride()[:3], *dv.stride()[:3], S=3, D=Dk, BLOCK=64)
    for got, want in ((dk, part[0].sum(0)), (dv, part[1].sum(0))):
        assert torch.allclose(got.float(), want, rtol=1e-3, atol=1e-3)


def test_gluon_config_refused_or_replaced_where_it_cannot_run(monkeypatch):
    """Where the Gluon forward cannot run (here: no sm_90 GPU with Triton 3.6, or a bias), a
    user-given Gluon config is an error naming why and a table Gluon entry runs the TMA kernel
    (same answer); a Gluon config for the backward or with other tiles is refused by name."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4, 2, 40, 40, 64, 64, torch.bfloat16, False)
    gluon = attn.AttentionConfig(128, 128, 4, 2, False, "gluon_pingpong")
    bias = torch.zeros(1, 1, 40, 40, device=DEVICE, dtype=torch.bfloat16).expand(1, 4, 40, 40)
    cases = [(bias, "it takes no bias, dropout, softcap, replace mask or rope")]
    if _gluon_why_not() is not None:
        cases.append((None, ""))
    for b, why in cases:
        with pytest.raises(ValueError, match=r"'gluon' kernel family cannot run this problem \(.*\): " + why):
            attn.attention_forward(q, k, v, b, is_causal=True, scale=0.125, config=gluon)
    with pytest.raises(ValueError, match="block_m 128 or 256"):
        attn.attention_forward(q, k, v, None, is_causal=True, scale=0.125,
                               config=gluon._replace(block_m=64))
    out, lse = attn.attention_forward(q, k, v, None, is_causal=True, scale=0.125)
    with pytest.raises(ValueError, match="'gluon_pingpong' is not a bwd kernel"):
        attn.attention_backward(out, q, k, v, None, out, lse, is_causal=True, scale=0.125,
                                need_dbias=False, config=gluon)
    with pytest.raises(ValueError, match="'gluon_lpt' is not a fwd kernel"):
        attn.attention_forward(q, k, v, None, is_causal=True, scale=0.125,
                               config=gluon._replace(kernel="gluon_lpt"))
    gluon_bwd = attn.AttentionConfig(64, 128, 8, 2, False, "gluon_lpt")
    for b, why in cases:
        with pytest.raises(ValueError, match=r"'gluon' kernel family cannot run this problem \(.*\): " + why):
            attn.attention_backward(out, q, k, v, b, out, lse, is_causal=True, scale=0.125,
                                    need_dbias=False, config=gluon_bwd, deterministic=False)
    with pytest.raises(ValueError, match=r"'gluon' kernel family cannot run this problem \(.*\): it has no tiles m16n128s2xl"):
        attn.attention_backward(out, q, k, v, None, out, lse, is_causal=True, scale=0.125,
                                need_dbias=False, config=gluon_bwd._replace(block_m=16))
    # Table path: a Gluon entry on a problem it cannot run -> the TMA kernel (no bias) or the
    # general kernel (bias), both right.
    monkeypatch.setattr(registry, "table_config", lambda *a: gluon)
    spy = _LaunchSpy(Hop.attention_fwd_tma_kernel)
    monkeypatch.setattr(Hop, "attention_fwd_tma_kernel", spy)
    for b in (bias, None):
        got, _ = attn.attention_forward(q, k, v, b, is_causal=True, scale=0.125)
        want, _ = reference(q.double(), k.double(), v.double(),
                            None if b is None else b.double(), True, 0.125)
        assert rel_err(got, want) < 1e-2
    assert spy.launches == (1 if _gluon_why_not() is not None else 0)
    # ... and a Gluon backward entry on a problem it cannot run -> the general kernel.
    monkeypatch.setattr(registry, "table_config", lambda *a: gluon_bwd)
    general = attn.attention_backward(out, q, k, v, bias, out, lse, is_causal=True, scale=0.125,
                                      need_dbias=False, deterministic=False)[:3]
    want = attn.attention_backward(out, q, k, v, bias, out, lse, is_causal=True, scale=0.125,
                                   need_dbias=False, deterministic=False,
                                   config=C.backward_config(64, 64, torch.bfloat16))[:3]
    # dK/dV are summed in registers (same bits); dQ by atomics, in any order on a GPU
    assert torch.equal(general[1], want[1]) and torch.equal(general[2], want[2])
    assert rel_err(general[0], want[0]) < 1e-2


def test_tma_kernels_refuse_what_they_do_not_cover(monkeypatch):
    """A user-given TMA config on a problem the kernel does not cover is an error naming why;
    a table TMA entry on such a problem falls back to the general kernel (still correct)."""
    torch.manual_seed(0)
    tma = attn.AttentionConfig(16, 16, 4, 1, False, "tma")
    q, k, v = make_qkv(1, 2, 2, 20, 20, 64, 64, torch.float16, False)
    bias = torch.zeros(1, 2, 20, 20, device=DEVICE, dtype=torch.float16)
    for args, match in (
            (dict(bias=bias), "no bias, dropout, softcap, replace mask or rope"),
            (dict(q=q.float(), k=k.float(), v=v.float()), "fp16/bf16"),
            (dict(scale=-0.5), "positive scale"),
            (dict(q=q[..., :48], k=k[..., :48], v=v[..., :48]), "D == Dv in"),
            # one element off a 16-byte boundary
            (dict(q=torch.randn(1 * 2 * 20 * 64 + 1, device=DEVICE).half()[1:].view(1, 2, 20, 64)),
             "16-byte"),
    ):
        call = dict(q=q, k=k, v=v, bias=None, scale=0.125) | args
        with pytest.raises(ValueError, match=match):
            attn.attention_forward(call["q"], call["k"], call["v"], call["bias"], is_causal=False,
                                   scale=call["scale"], config=tma)
    # K/V expanded over heads (stride 0): TMA takes no zero strides.
    with pytest.raises(ValueError, match="16-byte"):
        attn.attention_forward(q, k[:, :1].expand(1, 2, 20, 64), v, None, is_causal=False,
                               scale=0.125, config=tma)
    # A size-1 dim's stride is never used: an odd one does not stop the TMA kernels.
    q1 = q.as_strided((1, 2, 20, 64), (3, 20 * 64, 64, 1))
    out1, _ = attn.attention_forward(q1, k, v, None, is_causal=False, scale=0.125, config=tma)
    ref1, _ = reference(q1.double(), k.double(), v.double(), None, False, 0.125)
    assert rel_err(out1, ref1) < 1e-2
    out, lse = attn.attention_forward(q, k, v, None, is_causal=False, scale=0.125)
    with pytest.raises(ValueError, match=r"'tma' kernel family cannot run this problem \(.*\): it writes no dbias"):
        attn.attention_backward(out, q, k, v, None, out, lse, is_causal=False, scale=0.125,
                                need_dbias=True, config=tma, deterministic=False)
    # Table path: the entry says TMA, the problem has a bias -> general kernel, right answer.
    monkeypatch.setattr(registry, "table_config", lambda *a: tma)
    monkeypatch.setattr(Hop, "run_forward_tma", lambda *a: pytest.fail("TMA kernel launched"))
    out, _ = attn.attention_forward(q, k, v, bias, is_causal=True, scale=0.125)
    ref, _ = reference(q.double(), k.double(), v.double(), bias.double(), True, 0.125)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2, 3, 5, 8),  # contiguous: the buffer itself
    lambda: torch.empty(2, 5, 3, 8).transpose(1, 2),  # a head-split view of a projection
    lambda: torch.empty(2, 8, 5, 3).permute(0, 3, 2, 1)[..., :4].contiguous().transpose(1, 2),
])
def test_gradient_buffer_is_layout_like_over_a_plain_empty(make):
    """host.gradient_buffer: layout_like's shape and strides, allocated with torch.empty (which
    AOTAutograd's CSE leaves apart: three identical empty_strided became one buffer, copied by
    Inductor before each backward launch) and, where the layout is not the identity, a view
    carrying the buffer that a traced launch writes instead (launch.GRADIENT_BUFFER). Eager:
    layout_like's tensor."""
    from fuse_plugin.kernels.launch import GRADIENT_BUFFER, tracing

    like = make()
    eager = host.gradient_buffer(like, torch.float16)  # eager: layout_like's tensor itself
    assert eager._base is None and getattr(eager, GRADIENT_BUFFER, None) is None
    with tracing():
        got = host.gradient_buffer(like, torch.float16)
    want = layout_like(like, torch.float16)
    assert eager.stride() == want.stride()
    assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == torch.float16
    buf = getattr(got, GRADIENT_BUFFER, None)
    if like.is_contiguous():
        assert buf is None and got._base is None
    else:
        assert buf is not None and buf.is_contiguous() and buf.data_ptr() == got.data_ptr()
        assert buf.numel() == got.numel()
