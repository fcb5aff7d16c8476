"""PyTorch's flash forward as a family of the op (kernels/attention_flash.py).

Everywhere (CPU): which calls it takes (fake CUDA tensors), that no rule takes it, and the
launcher's output with the family forced, as shapes and layouts (fake CUDA tensors: nothing
runs). On a GPU: the forward through the launcher, the family
forced, against the float64 reference of tests/test_attention_small.py (GQA, causal, awkward
lengths and head dims 16-256), the op's training step with it (its lse read by the backward
families), and a compiled GQA site with the family forced against eager; skipped elsewhere,
saying so (the kernel is CUDA-only).
"""
import math

import pytest
import torch
from helpers import DEVICE, check_close
from test_attention_small import make_qkv, reference
from torch._subclasses.fake_tensor import FakeTensorMode

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import attention as K
from fuse_plugin.kernels import attention_flash as fl
from fuse_plugin.kernels import attention_hopper, registry

ON_GPU = DEVICE == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="PyTorch's flash attention runs on CUDA only")
H100 = (9, 0)


def fake(*shape, dtype=torch.bfloat16):
    with FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=dtype)


def fake_qkv(B=2, Hq=16, Hkv=4, Lq=512, Lk=512, D=64, Dv=None, dtype=torch.bfloat16):
    return fake(B, Hq, Lq, D, dtype=dtype), fake(B, Hkv, Lk, D, dtype=dtype), fake(B, Hkv, Lk, Dv or D, dtype=dtype)


def test_takes_plain_problems_and_gqa():
    assert fl.why_not(*fake_qkv(), None, is_causal=True, capability=H100) is None
    assert fl.why_not(*fake_qkv(Hkv=16, Lq=17, Lk=1000, D=256), None, is_causal=False, capability=H100) is None
    assert fl.why_not(*fake_qkv(dtype=torch.float16, D=80), None, is_causal=True, capability=(8, 0)) is None


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "torch.float32"),
    (dict(D=36), "head dims 36/36 (equal, multiples of 8 up to 256)"),
    (dict(D=64, Dv=32), "head dims 64/32 (equal, multiples of 8 up to 256)"),
    (dict(D=512), "head dims 512/512 (equal, multiples of 8 up to 256)"),
    (dict(bias=True), "a bias"),
    (dict(dropout=True), "dropout"),
    (dict(softcap=True), "softcap"),
    (dict(replace=True), "a replace mask"),
    (dict(rope=True), "rope"),
    (dict(Lq=1), "causal with Lq != Lk"),
    (dict(capability=(7, 5)), "sm 75 (FlashAttention-2 needs sm 80 or later)"),
])
def test_what_it_does_not_take(change, reason):
    shape = {key: change.pop(key) for key in ("D", "Dv", "Lq", "dtype") if key in change}
    q, k, v = fake_qkv(**shape)
    bias = fake(2, 16, q.shape[2], 512) if change.pop("bias", False) else None
    capability = change.pop("capability", H100)
    assert fl.why_not(q, k, v, bias, is_causal=True, capability=capability, **change) == reason


def test_not_on_cpu_or_switched_off(monkeypatch):
    cpu = torch.empty(1, 2, 49, 32)
    assert fl.why_not(cpu, cpu, cpu, None, is_causal=False, capability=H100) == "not on CUDA"
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    assert "disabled" in fl.why_not(*fake_qkv(), None, is_causal=False, capability=H100)


def test_the_registry_lists_it_forward_only_and_no_rule_takes_it():
    assert "flash" in registry.FAMILIES["fwd"] and "flash" not in registry.FAMILIES["bwd"]
    assert "measured" in registry.FAMILIES["fwd"]["flash"].declines(None)
    assert "flash" in registry.NAMES


def test_forced_through_the_launchers_on_fake_tensors(monkeypatch):
    """The forward with the family forced: the op's output layout, a contiguous fp32 lse (the
    backward, which has no flash family, reads it: the GPU test below)."""
    monkeypatch.setattr(attention_hopper, "capability", lambda device: H100)
    with FakeTensorMode():
        # a model's head split of its projections: (B, L, H, D) seen transposed
        q = torch.empty(2, 512, 16, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.empty(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        with registry.forced("flash"):
            out, lse = K.attention_forward(q, k, v, None, is_causal=True, scale=0.125)
    assert out.shape == (2, 16, 512, 64) and out.transpose(1, 2).is_contiguous()
    assert lse.shape == (2, 16, 512) and lse.is_contiguous() and lse.dtype == torch.float32


# ------------------------------------------------------------------------------------- GPU

GPU_CASES = {  # B, Hq, Hkv, Lq, Lk, D, causal, dtype, layout
    "llama-512-gqa-causal": (2, 16, 4, 512, 512, 64, True, torch.bfloat16, "blhd"),
    "l1": (3, 4, 4, 1, 1, 32, False, torch.bfloat16, "bhld"),
    "l17-lk1000-d80": (2, 4, 2, 17, 1000, 80, False, torch.float16, "blhd"),
    "l49-d16-causal": (4, 3, 3, 49, 49, 16, True, torch.bfloat16, "bhld"),
    "l1000-d96-causal-mqa": (1, 6, 1, 1000, 1000, 96, True, torch.bfloat16, "blhd"),
    "l128-d256": (2, 2, 2, 128, 128, 256, False, torch.float16, "bhld"),
}


@needs_gpu
@pytest.mark.parametrize("case", list(GPU_CASES.values()), ids=list(GPU_CASES))
def test_matches_float64_on_the_gpu(case):
    torch.manual_seed(0)
    B, Hq, Hkv, Lq, Lk, D, causal, dtype, layout = case
    scale = D ** -0.5
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, D, dtype, layout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, None, causal, scale)
    dout = torch.randn(B, Hq, Lq, D, device=DEVICE).to(dtype)
    ref_out.backward(dout.double())
    with registry.forced("flash"):
        out, lse = K.attention_forward(q, k, v, None, is_causal=causal, scale=scale)
        out_inf, _ = K.attention_forward(q, k, v, None, is_causal=causal, scale=scale, need_lse=False)
        # the backward families (ours or cuDNN's) read the flash forward's out and lse
        dq, dk, dv, _ = K.attention_backward(dout, q, k, v, None, out, lse, is_causal=causal, scale=scale,
                                             need_dbias=False)
    check_close("out", out, ref_out, 1e-2)
    check_close("out (need_lse=False)", out_inf, ref_out, 1e-2)
    check_close("lse", lse, ref_lse, 1e-2)
    for name, got, ref in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        check_close(name, got, ref.grad, 1e-2)


@needs_gpu
def test_compiled_gqa_site_with_the_family_forced(monkeypatch):
    """HF-style hand-written GQA attention (k/v repeated, causal), compiled with the plugin and
    the forward family forced, against eager float32 (inference and one backward)."""
    torch.manual_seed(0)
    monkeypatch.setenv("FUSE_PLUGIN_ATTENTION_FAMILY", "flash")
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    B, Hq, Hkv, L, D = 2, 8, 2, 256, 64

    def site(q, k, v):
        k, v = (t[:, :, None].expand(B, Hkv, Hq // Hkv, L, D).reshape(B, Hq, L, D) for t in (k, v))
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    got = torch.compile(site)(*leaves)
    torch._dynamo.reset()
    want_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = site(*want_leaves)
    check_close("out", got, want, 1e-2)
    dout = torch.randn_like(want)
    got.backward(dout.to(got.dtype))
    want.backward(dout)
    for g, w in zip(leaves, want_leaves):
        check_close("grad", g.grad, w.grad, 1e-2)
