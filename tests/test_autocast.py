"""Attention under ``torch.autocast``: the op computes in the dtype autocast ran the products in.

HF Llama trained in fp32 under ``autocast(bfloat16)`` has fp32 q and k (its rotary multiplies
them by fp32 cos/sin), bf16 v, and q·kᵀ and w·v in bf16. Before this the site was refused
("q, k, v dtypes differ") while our compile kept Inductor's own attention patterns off: the
H200's llama-train-amp-8x512 row ran at 0.45x stock compile (RESULTS.md). Now q, k, v are cast
to bf16 as autocast casts them for the products, and the op runs its bf16 kernels.
"""

import torch
from helpers import capture, rewrite_aot_eager
from torch._dynamo.utils import counters


def _attention(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1, dtype=torch.float32).to(q.dtype)
    return w @ v


def _inputs():
    torch.manual_seed(0)
    q, k = (torch.randn(2, 4, 16, 64) for _ in range(2))  # fp32: after an fp32 rotary
    v = torch.randn(2, 4, 16, 64).to(torch.bfloat16)  # a bf16 linear under autocast
    return q, k, v


def _op_inputs_cast(after: str) -> bool:
    """Are the op's q, k, v (its first three inputs) bf16 casts of graph inputs in `after`?"""
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in after.splitlines()}
    (op,) = [d for d in lines.values() if d.startswith("fuse_plugin.attention(")]
    refs = [a.strip().lstrip("#") for a in op[len("fuse_plugin.attention("):].split(",")[:3]]
    return all(lines[r].startswith("to(") and lines[r].endswith("(bfloat16))") for r in refs)


def _in_autocast(fn):
    def run(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args)
    return run


def test_hand_written_site_takes_autocast_dtype():
    _, after, report = capture(_in_autocast(_attention), *_inputs())
    assert "dtypes differ" not in str(report)
    # q, k and v are cast to bf16 right before the op, as autocast casts them for the products
    assert _op_inputs_cast(after), after


def test_hand_written_parity_under_autocast(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    q, k, v = (t.requires_grad_(True) for t in _inputs())
    fn = _in_autocast(_attention)
    want = fn(q, k, v)
    want.float().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(fn, backend=rewrite_aot_eager)(q, k, v)
    got.float().sum().backward()
    assert counters["fuse_plugin"]["attention"] == 1
    assert got.dtype == want.dtype == torch.bfloat16
    # bf16 products either way; eager also rounds the scores to bf16 before its softmax
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    for t, g in zip((q, k, v), grads):
        assert t.grad.dtype == g.dtype
        torch.testing.assert_close(t.grad.float(), g.float(), atol=5e-2, rtol=5e-2)


def test_sdpa_site_takes_autocast_dtype(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = _inputs()
    _, after, report = capture(_in_autocast(sdpa), q, k, v)
    assert _op_inputs_cast(after), (after, report)
    want = _in_autocast(sdpa)(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(_in_autocast(sdpa), backend=rewrite_aot_eager)(q, k, v)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_near_miss_autocast_around_one_product_only():
    """Autocast around q·kᵀ alone: the products ran in different dtypes (bf16, fp32), so no cast
    is read from them; q, k, v are all fp32 and the op computes in fp32, as w·v did."""

    def half(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = q @ k.transpose(-2, -1)
        return torch.softmax(s.float() * 0.125, dim=-1) @ v

    q, k, _ = _inputs()
    v = torch.randn(2, 4, 16, 64)
    _, after, _ = capture(half, q, k, v)
    assert "fuse_plugin.attention(" in after and "to(" not in after, after  # fp32 q, k, v as they are
    torch._dynamo.reset()
    got = torch.compile(half, backend=rewrite_aot_eager)(q, k, v)
    assert got.dtype == torch.float32
