"""Dropout inside the attention kernels (issue 4): the mask is a pure function of the seed, the
kernels draw exactly the CPU reference's mask (so forward and backward agree with a float64
reference using the same seed), it keeps 1 - p of the weights, the output is unbiased, and the
seed comes from torch's RNG (torch.manual_seed repeats it), also when the recogniser fuses an
`F.dropout(..., training=True)` on the attention weights.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), on a GPU compiled; shapes are
small. The reference's counter hash is checked against the kernels', not against a known-answer
vector: what matters is that both sides draw the same bits (and, test_draws_are_uniform_and_
uncorrelated, that the bits look random)."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, rel_err, rewrite_aot_eager
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin.ops import reference
from fuse_plugin.ops.attention import new_dropout_seed

OPS = torch.ops.fuse_plugin


def seed_tensor(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64, device=DEVICE)


def kernel_mask(b, hq, lq, lk, p, seed):
    """The keep-mask the op draws, read back through the op: q = k = 0 makes every weight 1/Lk, and
    v = identity (Dv = Lk) copies each row's dropped weights into the output."""
    q = torch.zeros(b, hq, lq, 16, device=DEVICE)
    k = torch.zeros(b, hq, lk, 16, device=DEVICE)
    v = torch.eye(lk, device=DEVICE).expand(b, hq, lk, lk).contiguous()
    out, _ = OPS.attention(q, k, v, None, p, False, 1.0, seed)
    keep_rate = 1 - reference.dropout_threshold(p) / 2**16
    scaled = out.double().cpu() * lk * keep_rate  # 1 where kept, 0 where dropped
    assert torch.allclose(scaled, scaled.round(), atol=1e-4), "output is not a 0/1 mask"
    return scaled.round().bool()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kernel_draws_the_reference_mask(p):
    b, hq, lq, lk = 2, 3, 19, 32  # odd Lq: a partial query block
    seed = 0x1234_5678_9ABC_DEF0
    got = kernel_mask(b, hq, lq, lk, p, seed_tensor(seed))
    want = reference.dropout_keep(seed, (b, hq, lq, lk), p)
    assert torch.equal(got, want)
    # a negative seed (all 64 bits used) and another seed give other masks
    other = kernel_mask(b, hq, lq, lk, p, seed_tensor(-5))
    assert torch.equal(other, reference.dropout_keep(-5, (b, hq, lq, lk), p))
    assert not torch.equal(other, got)


def test_keep_rate():
    p = 0.3
    keep = reference.dropout_keep(7, (4, 8, 128, 128), p)  # 524288 draws
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(keep.double().mean().item() - (1 - p)) < 5 * sigma
    # every (batch, head) and every row draws independently: no two heads share a mask
    heads = keep.view(32, -1)
    assert len({tuple(h[:64].tolist()) for h in heads}) == 32
    # the kernels' own draws (through the op) keep the same fraction
    km = kernel_mask(1, 64, 16, 32, p, seed_tensor(11))
    sigma = math.sqrt(p * (1 - p) / km.numel())
    assert abs(km.double().mean().item() - (1 - p)) < 5 * sigma


def test_draws_are_uniform_and_uncorrelated():
    """The counter hash behind the mask (reference.dropout_keep, bit for bit the kernels'): keep
    rates right at low, middle and high p, and no correlation between neighbouring scores (next
    key, next query, next head) or between two seeds, within 5 sigma."""
    shape = (2, 8, 128, 128)  # 262144 draws
    for p in (0.05, 0.5, 0.9):
        keep = reference.dropout_keep(3, shape, p).double()
        sigma = math.sqrt(p * (1 - p) / keep.numel())
        assert abs(keep.mean().item() - (1 - p)) < 5 * sigma, p
        z = (keep - keep.mean()) / keep.std()
        pairs = {"key": (z[..., 1:], z[..., :-1]), "query": (z[..., 1:, :], z[..., :-1, :]),
                 "head": (z[:, 1:], z[:, :-1])}
        if p == 0.5:
            other = reference.dropout_keep(4, shape, p).double()
            pairs["seed"] = (z, (other - other.mean()) / other.std())
        for what, (a, b) in pairs.items():
            corr = (a * b).mean().item()
            assert abs(corr) < 5 / math.sqrt(a.numel()), (p, what, corr)


def test_output_is_unbiased():
    """Every head gets its own mask: 64 heads with the same q, k, v are 64 dropout samples of one
    attention, whose mean must be the undropped output (within 6 standard errors everywhere)."""
    torch.manual_seed(0)
    h, lq, lk, d = 64, 16, 16, 16
    q, k, v = (torch.randn(1, 1, n, d, device=DEVICE).expand(1, h, n, d) for n in (lq, lk, lk))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    want, _ = OPS.attention(q[:, :1], k[:, :1], v[:, :1], None, 0.0, False, 0.25)
    out, _ = OPS.attention(q, k, v, None, 0.2, False, 0.25, seed_tensor(3))
    samples = out[0].double().cpu()  # (h, lq, d)
    mean, sem = samples.mean(0), samples.std(0) / math.sqrt(h)
    z = (mean - want[0, 0].double().cpu()) / sem
    assert z.abs().max().item() < 6, z.abs().max().item()
    assert not torch.allclose(samples[0], samples[1])  # and it did drop something


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal,bias", [(False, False), (True, True)], ids=["plain", "causal_bias"])
def test_forward_and_backward_match_reference_with_the_same_seed(causal, bias, deterministic):
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 17, 23, 32  # GQA, Lq != Lk, partial blocks
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    attn_bias = torch.randn(b, 1, lq, lk, generator=g) if bias else None
    seed = 424242
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    bias_dev = attn_bias.to(DEVICE).requires_grad_() if bias else None
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, _ = OPS.attention(*leaves, bias_dev, 0.25, causal, 0.3, seed_tensor(seed))
        dout = torch.randn(out.shape, generator=g).to(DEVICE)
        grads = torch.autograd.grad(out, leaves + ([bias_dev] if bias else []), dout)
    finally:
        torch.use_deterministic_algorithms(False)
    ref_bias = None if attn_bias is None else attn_bias.double().expand(b, hq, lq, lk)
    ref_seed = torch.tensor(seed)
    ro, _ = reference.attention_forward(q.double(), k.double(), v.double(), ref_bias, causal, 0.3, 0.25, ref_seed)
    rdq, rdk, rdv, rds = reference.attention_backward(
        dout.double().cpu(), q.double(), k.double(), v.double(), ref_bias, causal, 0.3, bias, 0.25, ref_seed
    )
    assert rel_err(out, ro) < 1e-5
    want = [rdq, rdk, rdv] + ([rds.sum(1, keepdim=True)] if bias else [])
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, want):
        assert rel_err(got, ref) < 1e-5, name


def test_public_attention_follows_torch_manual_seed():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    torch.manual_seed(5)
    a = fuse_plugin.attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(5)
    b = fuse_plugin.attention(q, k, v, dropout_p=0.2)
    c = fuse_plugin.attention(q, k, v, dropout_p=0.2)  # the generator moved on: a new mask
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # and the seed it drew is what the op used
    torch.manual_seed(5)
    seed = new_dropout_seed(q.device)
    out, _ = OPS.attention(q, k, v, None, 0.2, False, 0.25, seed)
    assert torch.equal(out, a)


def test_errors_name_the_problem():
    q, k, v = (torch.randn(1, 2, 4, 16, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="dropout_seed"):
        OPS.attention(q, k, v, None, 0.1, False, 0.25)
    with pytest.raises(ValueError, match="dropout_seed must be one int64"):
        OPS.attention(q, k, v, None, 0.1, False, 0.25, torch.tensor(1.0, device=DEVICE))
    with pytest.raises(ValueError, match="dropout_p"):
        OPS.attention(q, k, v, None, 1.0, False, 0.25, seed_tensor(1))
    with pytest.raises(ValueError, match="dropout_p"):
        fuse_plugin.attention(q, k, v, dropout_p=1.0)


def _attention_with_dropout(q, k, v):
    w = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return F.dropout(w, p=0.3, training=True) @ v


def test_fused_dropout_in_a_compiled_model_uses_torch_rng():
    """The recogniser fuses F.dropout(training=True): the op's seed is drawn in the graph from
    torch's generator, so with the same torch.manual_seed the compiled model equals the reference
    run with that seed, forward and backward (aot_eager runs the rewritten graph eagerly)."""
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g).to(DEVICE) for _ in range(3))
    compiled = torch.compile(_attention_with_dropout, backend=rewrite_aot_eager, fullgraph=True)
    compiled(q, k, v)  # compile first: tracing must not shift the generator of the timed call
    assert counters["fuse_plugin"]["attention"] == 1
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(9)
    out = compiled(*leaves)
    torch.manual_seed(9)
    seed = new_dropout_seed(q.device).cpu()
    ro, _ = reference.attention_forward(q.double().cpu(), k.double().cpu(), v.double().cpu(), None, False, 0.25, 0.3, seed)
    assert rel_err(out, ro) < 1e-5
    dout = torch.randn(out.shape, generator=g).to(DEVICE)
    grads = torch.autograd.grad(out, leaves, dout)
    want = reference.attention_backward(dout.double().cpu(), q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                        None, False, 0.25, False, 0.3, seed)
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) < 1e-5


def test_fused_dropout_under_inductor_is_repeatable():
    """With the named backend (Inductor draws the seed): same manual_seed → same output and
    gradients; another seed → another mask; the mean keep-rate is sane."""
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    compiled = torch.compile(_attention_with_dropout, backend="fuse_plugin", fullgraph=True)
    runs = []
    for s in (4, 4, 5):
        torch.manual_seed(s)
        out = compiled(q, k, v)
        runs.append((out.detach(), torch.autograd.grad(out.sum(), (q, k, v))))
    assert counters["fuse_plugin"]["attention"] == 1
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert not torch.equal(runs[0][0], runs[2][0])


def test_rope_attention_drops_like_the_unfused_pair():
    """The rotation folded into the kernels leaves the dropout draw as it is: rope_attention with a
    seed equals rotary_qk then attention with that seed, forward and backward."""
    g = torch.Generator().manual_seed(4)
    b, hq, hkv, l, d = 1, 4, 2, 21, 32
    q, k, v = (torch.randn(b, h, l, d, generator=g).to(DEVICE) for h in (hq, hkv, hkv))
    cos, sin = (torch.randn(1, 1, l, d // 2, generator=g).to(DEVICE) for _ in range(2))
    seed = seed_tensor(99)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = OPS.rope_attention(*a, cos, sin, False, d, None, 0.4, True, 0.2, seed)
    u = [t.clone().requires_grad_() for t in (q, k, v)]
    qr, kr = OPS.rotary_qk(u[0], u[1], cos, sin, False, d)
    ref, _ = OPS.attention(qr, kr, u[2], None, 0.4, True, 0.2, seed)
    assert rel_err(out, ref) < 1e-5
    dout = torch.randn(out.shape, generator=g).to(DEVICE)
    for x, y in zip(torch.autograd.grad(out, a, dout), torch.autograd.grad(ref, u, dout)):
        assert rel_err(x, y) < 1e-5
