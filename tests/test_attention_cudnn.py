"""cuDNN's attention as a family of the op (kernels/attention_cudnn.py).

Which calls it takes is checked everywhere (fake CUDA tensors, cuDNN and an H100 pretended);
what it computes needs a GPU with cuDNN (skipped elsewhere, saying so): the op's forward and
backward against a float64 reference where the family runs, the gradients' layouts in eager.
How compiled graphs take it: tests/test_inductor_launch.py (``cudnn*`` cases).
"""
import pytest
import torch
from helpers import check_close
from torch._subclasses.fake_tensor import FakeTensorMode

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.kernels import attention_cudnn as cudnn

H100 = (9, 0)


def fake_qkv(B=2, Hq=8, Hkv=2, Lq=1024, Lk=1024, D=64, Dv=None, dtype=torch.bfloat16):
    with FakeTensorMode():
        q = torch.empty(B, Hq, Lq, D, device="cuda", dtype=dtype)
        k = torch.empty(B, Hkv, Lk, D, device="cuda", dtype=dtype)
        v = torch.empty(B, Hkv, Lk, Dv or D, device="cuda", dtype=dtype)
    return q, k, v


@pytest.fixture
def with_cudnn(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)


def test_plain_problems_take_it(with_cudnn):
    q, k, v = fake_qkv()
    assert cudnn.why_not(q, k, v, None, is_causal=True, capability=H100) is None
    assert cudnn.why_not(*fake_qkv(D=256), None, is_causal=True, capability=H100) is None
    assert cudnn.family("fwd", q, k, v, None, is_causal=True, capability=H100) == "cudnn"
    assert cudnn.family("bwd", q, k, v, None, is_causal=True, capability=H100) == "cudnn"


@pytest.mark.parametrize("Lq, fwd, bwd", [(197, None, "cudnn"), (128, None, None), (512, "cudnn", "cudnn")])
def test_lengths_where_it_wins(with_cudnn, Lq, fwd, bwd):
    q, k, v = fake_qkv(Lq=Lq, Lk=Lq)
    assert cudnn.family("fwd", q, k, v, None, is_causal=False, capability=H100) == fwd
    assert cudnn.family("bwd", q, k, v, None, is_causal=False, capability=H100) == bwd


@pytest.mark.parametrize("change, reason", [
    (dict(capability=(8, 0)), "measured on sm 90 only"),
    (dict(dtype=torch.float32), "torch.float32"),
    (dict(D=72, Dv=64), "head dims 72/64 (equal, multiples of 8 up to 256)"),
    (dict(bias=True), "a bias"),
    (dict(dropout=True), "dropout"),
    (dict(softcap=True), "softcap"),
    (dict(replace=True), "a replace mask"),
    (dict(rope=True), "rope"),
    (dict(need_dbias=True), "dbias"),
    (dict(deterministic=True), "deterministic mode"),
    (dict(Lq=1000), "causal with Lq != Lk"),
])
def test_what_it_does_not_take(with_cudnn, change, reason):
    shape = {key: change.pop(key) for key in ("dtype", "D", "Dv", "Lq") if key in change}
    q, k, v = fake_qkv(**shape)
    bias = q.new_empty(()) if change.pop("bias", False) else None
    flags = {"is_causal": True, "capability": H100, **change}
    assert cudnn.why_not(q, k, v, bias, **flags) == reason
    assert cudnn.family("bwd", q, k, v, bias, **flags) is None


def test_switched_off_or_absent(monkeypatch):
    q, k, v = fake_qkv()
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert "disabled" in cudnn.why_not(q, k, v, None, is_causal=True, capability=H100)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert cudnn.why_not(q, k, v, None, is_causal=True, capability=H100) == "no cuDNN"
    cpu = torch.empty(1, 2, 600, 64, dtype=torch.bfloat16)
    assert cudnn.why_not(cpu, cpu, cpu, None, is_causal=True, capability=H100) == "not on CUDA"


def _gpu_family_ready() -> bool:
    from fuse_plugin.kernels import attention_hopper as Hop

    return (torch.cuda.is_available() and torch.backends.cudnn.is_available()
            and Hop.capability(torch.device("cuda")) == cudnn.CAPABILITY)


gpu = pytest.mark.skipif(not _gpu_family_ready(),
                         reason="needs an sm 90 GPU with cuDNN: the only place the family runs")


def reference(q, k, v, is_causal, scale, dout):
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    out = s.softmax(-1) @ v64.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out, q64.grad, k64.grad, v64.grad


@gpu
@pytest.mark.parametrize("B, Hq, Hkv, L, D, causal, which", [
    (2, 6, 6, 197, 64, False, "bwd"),  # ViT: our forward, cuDNN's backward
    (1, 8, 2, 1024, 128, True, "both"),  # GQA, causal
    (2, 4, 4, 1000, 96, False, "both"),
    (1, 4, 4, 600, 256, True, "both"),  # D 256 (cuDNN from this stop)
])
def test_op_matches_reference(monkeypatch, B, Hq, Hkv, L, D, causal, which):
    calls = []
    for name in ("forward", "backward"):
        real = getattr(cudnn, name)
        monkeypatch.setattr(cudnn, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    torch.manual_seed(0)
    q = torch.randn(B, L, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    k, v = (torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
            for _ in range(2))
    scale = D ** -0.5
    out, lse = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, causal, scale)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert calls == (["backward"] if which == "bwd" else ["forward", "backward"])
    assert out.transpose(1, 2).is_contiguous()  # the op's layout, whichever family
    with torch.no_grad():
        grads = torch.ops.fuse_plugin.attention_backward(dout, q, k, v, None, out, lse, 0.0, causal, scale,
                                                         None, False)
    # laid out as q/k/v (HF's transposed views), as the op's fake says
    assert [g.stride() for g in grads[:3]] == [q.stride(), k.stride(), v.stride()]
    ref = reference(q, k, v, causal, scale, dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        check_close(name, got, want, 1e-2)
    with torch.no_grad():  # the inference form (need_lse=False: cuDNN computes its lse regardless), the same output
        out_inf = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, causal, scale, None, 0.0, None, 0, False)[0]
    check_close("out (need_lse=False)", out_inf, ref[0], 1e-2)


class _ClassAttention(torch.nn.Module):
    """CaiT's class attention, hand-written as timm writes it: the class token's one query over
    every token (CaiT-XXS24: 4 heads of 48, 197 tokens)."""

    def __init__(self, dim=192, heads=4):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, N, C = x.shape
        H = self.heads
        q = self.q(x[:, 0]).unsqueeze(1).reshape(B, 1, H, C // H).permute(0, 2, 1, 3)
        k = self.k(x).reshape(B, N, H, C // H).permute(0, 2, 1, 3)
        v = self.v(x).reshape(B, N, H, C // H).permute(0, 2, 1, 3)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, 1, C))


@gpu
@pytest.mark.parametrize("family", ["cudnn", "general"])
def test_class_attention_trains_under_cuda_graphs_without_a_skip(monkeypatch, family):
    """A training step compiled for CUDA graphs (reduce-overhead) with the site on cuDNN's family
    (below its length rule: what the H100 table chose for CaiT's class attention until stop 55)
    or our general kernels: the step is replayed as a CUDA graph (Inductor skips none: a skip would
    issue every kernel from the host) and its gradients are as close to float64 as eager's."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FUSE_PLUGIN_ATTENTION_FAMILY", family)
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")  # the op, not an SDPA call (choice.py)
    traced = []
    real = cudnn.backward
    monkeypatch.setattr(cudnn, "backward", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    ref = _ClassAttention().cuda().double()
    model = _ClassAttention().cuda().to(torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    ref.load_state_dict(model.state_dict())  # the reference holds the bf16 weights, in float64
    x = torch.randn(8, 197, 192, device="cuda", dtype=torch.bfloat16)

    def grads(m, fn, dtype):
        for p in m.parameters():
            p.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        fn(x.to(dtype)).float().pow(2).mean().backward()
        return [p.grad.detach().double() for p in m.parameters()]

    want, eager = grads(ref, ref, torch.float64), grads(model, model, torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fuse_plugin", mode="reduce-overhead")
    with torch._inductor.config.patch({"force_disable_caches": True}):  # traced here, not read from a cache
        for _ in range(3):  # records, then replays
            got = grads(model, compiled, torch.bfloat16)
    assert counters["fuse_plugin"]["attention"] == 1 and not counters["fuse_plugin"]["attention_as_sdpa"]
    assert bool(traced) == (family == "cudnn")  # the family the compiled backward took
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for g, e, w in zip(got, eager, want):
        err, eager_err = ((a - w).norm() / w.norm()).item(), ((e - w).norm() / w.norm()).item()
        assert err <= max(2 * eager_err, 1e-2), (err, eager_err)
