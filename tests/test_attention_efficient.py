"""PyTorch's memory-efficient attention as a family of the op (kernels/attention_efficient.py).

Everywhere (CPU): which calls it takes (fake CUDA tensors), the aligned bias it reads (values and
strides, copied only when needed), the dS reduction, and the launchers' outputs with the family
forced, as shapes and layouts (fake CUDA tensors: nothing runs). On a GPU: forward and backward
through the launchers, the family forced, against the float64 reference of
tests/test_attention_small.py (Swin's periodic and relative-position biases with their
gradients, odd window counts, L 1-128, D 16-64 where it runs), and a compiled Swin-style block
with the family forced against eager; skipped elsewhere, saying so (the kernel is CUDA-only).
"""
import pytest
import torch
from helpers import DEVICE, check_close
from test_attention_small import make_bias, make_qkv, reference
from torch._subclasses.fake_tensor import FakeTensorMode

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import attention as K
from fuse_plugin.kernels import attention_efficient as eff
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.call import sum_dbias

ON_GPU = DEVICE == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="PyTorch's memory-efficient attention runs on CUDA only")


def fake(*shape, dtype=torch.bfloat16):
    with FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=dtype)


def fake_qkv(B=8, Hq=3, Hkv=3, L=49, D=32, Dv=None, dtype=torch.bfloat16):
    return fake(B, Hq, L, D, dtype=dtype), fake(B, Hkv, L, D, dtype=dtype), fake(B, Hkv, L, Dv or D, dtype=dtype)


def test_takes_float_biases_and_plain_problems():
    q, k, v = fake_qkv()
    assert eff.why_not(q, k, v, None, is_causal=False) is None
    assert eff.why_not(q, k, v, fake(1, 3, 49, 49).expand(8, 3, 49, 49), is_causal=True) is None
    assert eff.why_not(*fake_qkv(dtype=torch.float32), None, is_causal=False) is None


@pytest.mark.parametrize("change, reason", [
    (dict(Hkv=1), "GQA (it would repeat k/v)"),
    (dict(D=36), "head dims 36/36 (multiples of 8 up to 256)"),
    (dict(bias=torch.bool), "a bool mask (it adds a float bias only)"),
    (dict(bias=torch.float32), "a torch.float32 bias with torch.bfloat16 inputs"),
    (dict(dropout=True), "dropout"),
    (dict(softcap=True), "softcap"),
    (dict(replace=True), "a replace mask"),
    (dict(rope=True), "rope"),
    (dict(window=4), "a sliding window"),
    (dict(deterministic=True), "deterministic mode"),
])
def test_what_it_does_not_take(change, reason):
    shape = {key: change.pop(key) for key in ("Hkv", "D") if key in change}
    q, k, v = fake_qkv(**shape)
    bias = fake(8, 3, 49, 49, dtype=change.pop("bias")) if "bias" in change else None
    assert eff.why_not(q, k, v, bias, is_causal=bool(change.get("window")), **change) == reason


def test_not_on_cpu_or_switched_off(monkeypatch):
    cpu = torch.empty(1, 2, 49, 32)
    assert eff.why_not(cpu, cpu, cpu, None, is_causal=False) == "not on CUDA"
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: False)
    assert "disabled" in eff.why_not(*fake_qkv(), None, is_causal=False)


def _aligned(t):
    return t.stride(-1) == 1 and all(s % eff.ALIGN == 0 for s in t.stride()[:-1])


@pytest.mark.parametrize("form", ["relpos", "keys", "periodic", "full"])
def test_aligned_bias_values_and_strides(form):
    B, H, L = 6, 2, 49
    base = {"relpos": (1, H, L, L), "keys": (B, 1, 1, L), "periodic": (3, H, L, L), "full": (B, H, L, L)}[form]
    bias = torch.randn(*base)
    period = 3 if form == "periodic" else None
    view = bias if period else bias.expand(B, H, L, L)
    got = eff.aligned_bias(view, B, period)
    want = bias.repeat(B // 3, 1, 1, 1) if period else bias.expand(B, H, L, L)
    assert got.shape == (B, H, L, L) and _aligned(got)
    assert torch.equal(got, want)
    # broadcast dims stay broadcast: a (1, H, L, L) bias is never repeated per window batch
    if form == "relpos":
        assert got.stride(0) == 0 and got.untyped_storage().nbytes() == H * L * 64 * 4
    if form == "keys":
        assert got.stride(1) == got.stride(2) == 0


def test_an_aligned_bias_is_read_as_it_is():
    bias = torch.randn(1, 2, 40, 64).expand(4, 2, 40, 64)
    got = eff.aligned_bias(bias, 4, None)
    assert got.data_ptr() == bias.data_ptr() and got.stride() == bias.stride()


@pytest.mark.parametrize("target, period", [((1, 2, 5, 7), None), ((4, 1, 1, 7), None), ((3, 2, 5, 7), 3),
                                            ((4, 2, 5, 7), None)])
def test_dbias_summed_in_fp32_to_its_shape(target, period):
    ds = torch.randn(6 if period else 4, 2, 5, 7, dtype=torch.float64).to(torch.bfloat16)
    got = sum_dbias(ds, target, ds.shape[0])
    want = ds.double()
    if period:
        want = want.view(2, 3, 2, 5, 7).sum(0)
    want = want.sum_to_size(target)
    assert got.dtype == torch.float32 and tuple(got.shape) == target
    check_close("dbias", got, want, 1e-6)


def test_forced_through_the_launchers_on_fake_tensors():
    """The launchers with the family forced: the op's output layout, a contiguous lse, the
    gradients in q/k/v's layouts, dbias reduced to the periodic bias's (P, H, L, L)."""
    with FakeTensorMode():
        qkv = torch.empty(8, 49, 3, 3, 32, device="cuda", dtype=torch.bfloat16)  # timm's packed qkv
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        bias = torch.empty(4, 3, 49, 49, device="cuda", dtype=torch.bfloat16)  # Swin's windows, P 4
        with registry.forced("efficient"):
            out, lse = K.attention_forward(q, k, v, bias, is_causal=False, scale=0.17)
            dq, dk, dv, db = K.attention_backward(out, q, k, v, bias, out, lse, is_causal=False,
                                                  scale=0.17, need_dbias=True)
    assert out.shape == (8, 3, 49, 32) and out.transpose(1, 2).is_contiguous()
    assert lse.shape == (8, 3, 49) and lse.is_contiguous() and lse.dtype == torch.float32
    for g in (dq, dk, dv):
        assert g.shape == (8, 3, 49, 32) and g.transpose(1, 2).is_contiguous()
    assert db.shape == (4, 3, 49, 49) and db.dtype == torch.float32


def test_rules_never_take_it():
    """Where nothing is measured it declines (taken only where measured faster, or forced)."""
    assert "measured" in registry.FAMILIES["fwd"]["efficient"].declines(None)
    assert "efficient" in registry.NAMES


# ------------------------------------------------------------------------------------- GPU

GPU_CASES = {
    # Swin-T stage 1: L 49, D 32, packed qkv, the shifted windows' periodic bias (nW 4 of B 8)
    "swin-periodic-dbias": dict(dtype=torch.bfloat16, B=8, H=3, L=49, D=32, bias="swin", nW=4,
                                layout="packed", need_dbias=True),
    # its relative-position bias alone (1, H, L, L), an odd window count, dbias of the bias
    "swin-relpos-nw3-dbias": dict(dtype=torch.bfloat16, B=9, H=3, L=49, D=32, bias="swin_relpos",
                                  nW=3, need_dbias=True),
    "head-bias-fp32-l17-d16": dict(dtype=torch.float32, B=3, H=2, L=17, D=16, bias="head", need_dbias=True),
    "keypad-fp16-l128-d64": dict(dtype=torch.float16, B=2, H=4, L=128, D=64, bias="keypad", need_dbias=True),
    "causal-bf16-l100-d64": dict(dtype=torch.bfloat16, B=2, H=2, L=100, D=64, causal=True),
    "plain-bf16-l1-d32": dict(dtype=torch.bfloat16, B=4, H=2, L=1, D=32),
    "full-bias-bf16-l1000-d64": dict(dtype=torch.bfloat16, B=1, H=2, L=1000, D=64, bias="full", need_dbias=True),
}
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@needs_gpu
@pytest.mark.parametrize("case", list(GPU_CASES.values()), ids=list(GPU_CASES))
def test_matches_float64_on_the_gpu(case):
    torch.manual_seed(0)
    dtype, B, H, L, D = case["dtype"], case["B"], case["H"], case["L"], case["D"]
    causal, need_dbias = case.get("causal", False), case.get("need_dbias", False)
    scale = D ** -0.5
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        q, k, v = make_qkv(B, H, H, L, L, D, D, dtype, case.get("layout", "bhld"))
        leaf, bias_t, full = make_bias(case.get("bias"), B, H, L, L, dtype, case.get("nW"))
        dout = torch.randn(B, H, L, D, device=DEVICE).to(dtype)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference(*leaves, full, causal, scale)
        ref_out.backward(dout.double())
        with registry.forced("efficient"):
            out, lse = K.attention_forward(q, k, v, bias_t, is_causal=causal, scale=scale)
            dq, dk, dv, db = K.attention_backward(dout, q, k, v, bias_t, out, lse, is_causal=causal,
                                                  scale=scale, need_dbias=need_dbias)
            out_inf, _ = K.attention_forward(q, k, v, bias_t, is_causal=causal, scale=scale, need_lse=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    tol = TOL[dtype]
    check_close("out", out, ref_out, tol)
    check_close("out (need_lse=False)", out_inf, ref_out, tol)
    check_close("lse", lse, ref_lse, tol)
    for name, got, ref in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        check_close(name, got, ref.grad, tol)
        assert got.stride() == torch.empty_like(ref.grad, dtype=dtype).stride() or got.is_contiguous() \
            or got.transpose(1, 2).is_contiguous()
    if need_dbias:
        check_close("dbias", db.sum_to_size(leaf.shape), leaf.grad, tol)


@needs_gpu
def test_compiled_swin_block_with_the_family_forced(monkeypatch):
    """A Swin-style window attention (packed qkv, relative-position bias + shifted-window mask
    through a 5-D view), compiled with the plugin and the family forced, against eager: the
    traced launch's layouts are the kernel's (forward and backward)."""
    torch.manual_seed(0)
    monkeypatch.setenv("FUSE_PLUGIN_ATTENTION_FAMILY", "efficient")
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    B, nW, H, N, D = 2, 4, 3, 49, 32
    qkv_w = torch.randn(3 * H * D, H * D, device="cuda", dtype=torch.bfloat16) * 0.05
    relpos = (torch.randn(1, H, N, N, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    mask = torch.where(torch.rand(nW, N, N, device="cuda") < 0.3, -100.0, 0.0).to(torch.bfloat16)

    def block(x, relpos):
        Bw = x.shape[0]
        qkv = (x @ qkv_w.t()).reshape(Bw, N, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * D ** -0.5) @ k.transpose(-2, -1) + relpos
        attn = attn.view(-1, nW, H, N, N) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, H, N, N).softmax(-1)
        return (attn @ v).transpose(1, 2).reshape(Bw, N, H * D)

    x = torch.randn(B * nW, N, H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="fuse_plugin")
    got = compiled(x, relpos)
    want = block(x, relpos)
    g_got = torch.autograd.grad(got.float().square().sum(), (x, relpos))
    g_want = torch.autograd.grad(want.float().square().sum(), (x, relpos))
    check_close("out", got, want, 2e-2)
    for name, a, b in zip(("dx", "drelpos"), g_got, g_want):
        check_close(name, a, b, 3e-2)
