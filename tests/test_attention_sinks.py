"""`fuse_plugin::attention_sinks` (gpt-oss's sink logits): forward, every gradient (the sinks'
too) against float64 eager math, on the CPU reference and the kernels in Triton's interpreter;
rows masked everywhere; bad sinks rejected; torch.compile (aot_eager and Inductor)."""
import pytest
import torch
from helpers import check_close, needs_interpreter
from torch._dynamo.utils import counters

import fuse_plugin  # noqa: F401  (registers the ops)
from fuse_plugin.ops import cpu_kernels

OP = torch.ops.fuse_plugin.attention_sinks


def eager(q, k, v, bias, sinks, scale, causal=False):
    """HF gpt-oss's eager attention (GQA by repeating k/v)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        s = s + bias
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    col = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    c = torch.cat([s, col.to(s.dtype)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    p = torch.softmax(c, dim=-1)[..., :-1]
    return p @ v


def inputs(B=2, Hq=4, Hkv=2, Lq=9, Lk=9, D=16, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, D, dtype=dtype, requires_grad=True)
    b = torch.randn(B, 1, Lq, Lk, dtype=dtype, requires_grad=True) if bias else None
    sinks = torch.randn(Hq, dtype=dtype).mul(2).requires_grad_(True)
    return q, k, v, b, sinks


def grads(out, dout, tensors):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], dout)


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_eager(kernels, causal):
    q, k, v, b, sinks = inputs()
    scale = 0.25
    dout = torch.randn(2, 4, 9, 16)
    ts = (q, k, v, b, sinks)
    want = eager(*(t.double() for t in (q, k, v, b)), sinks.double(), scale, causal)
    want_g = grads(want, dout.double(), [t for t in ts])
    with cpu_kernels(kernels):
        out, lse = OP(q, k, v, b, 0.0, causal, scale, sinks)
    got_g = grads(out, dout, ts)
    check_close("out", out, want, 1e-5)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got_g, want_g):
        check_close(name, g, w, 1e-5)
    # lse: the log of the denominator with the sink
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-2, -1)) * scale + b.double()
    if causal:
        s = s.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    ref_lse = torch.logaddexp(torch.logsumexp(s, -1), sinks.double().view(1, -1, 1))
    check_close("lse", lse, ref_lse, 1e-6)


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_rows_masked_everywhere_give_zero(kernels):
    """Every key masked: the sink takes all the weight: out 0, lse = the sink, no NaN anywhere
    (a bool mask: the kernels' log2 units, where the sink is converted)."""
    q, k, v, _, sinks = inputs(bias=False)
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    keep[0, :, 3] = False
    with cpu_kernels(kernels):
        out, lse = OP(q, k, v, keep, 0.0, False, 0.25, sinks)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    check_close("lse", lse[0, :, 3], sinks.detach().view(4, 1).expand(4, 1).squeeze(1), 1e-6)
    with cpu_kernels(kernels):
        g = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    assert all(torch.isfinite(t).all() for t in g)
    bias = torch.zeros(2, 1, 9, 9).masked_fill(~keep, float("-inf"))
    want = eager(q.double(), k.double(), v.double(), bias.double(), sinks.double(), 0.25)
    check_close("out", out, want, 1e-5)


@needs_interpreter
@pytest.mark.parametrize("window", [0, 3])
def test_kernels_without_a_bias_fold_the_sink(window):
    """No bias (the kernels' fast unmasked blocks, log2 units), causal, a sliding window or not:
    the forward kernel folds the sink into its softmax; out, lse and every gradient as float64."""
    q, k, v, _, sinks = inputs(bias=False, Lq=40, Lk=40, seed=3)
    dout = torch.randn(2, 4, 40, 16)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None]
    keep = (j <= i) & ((j > i - window) if window else True)
    bias = torch.zeros(40, 40).masked_fill(~keep, float("-inf")).double()
    want = eager(q.double(), k.double(), v.double(), bias, sinks.double(), 0.25)
    want_g = grads(want, dout.double(), (q, k, v, sinks))
    with cpu_kernels("triton"):
        out, lse = OP(q, k, v, None, 0.0, True, 0.25, sinks, None, None, window)
        got_g = grads(out, dout, (q, k, v, sinks))
    check_close("out", out, want, 1e-5)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g):
        check_close(name, g, w, 1e-5)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-2, -1)) * 0.25 + bias
    check_close("lse", lse, torch.logaddexp(torch.logsumexp(s, -1), sinks.double().view(1, -1, 1)), 1e-6)


@needs_interpreter
def test_a_family_without_the_fold_gets_the_sink_merged():
    """The general forward folds the sink in; a family that does not (here the small family,
    forced) runs the plain problem and the sink is merged after it (kernels/attention.py
    merge_sinks): the same out and lse, a masked row 0."""
    from fuse_plugin.kernels import attention as K, registry

    q, k, v, _, sinks = (t if t is None else t.detach() for t in inputs(bias=False))
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    keep[0, :, 3] = False
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-2, -1)) * 0.25
    s = s.masked_fill(~keep, float("-inf"))
    want_lse = torch.logaddexp(torch.logsumexp(s, -1), sinks.double().view(1, -1, 1))
    want = eager(q.double(), k.double(), v.double(), torch.zeros(2, 1, 9, 9).masked_fill(~keep, float("-inf")).double(),
                 sinks.double(), 0.25)
    assert registry.FAMILIES["fwd"]["general"].takes_sinks and not registry.FAMILIES["fwd"]["small"].takes_sinks
    with cpu_kernels("triton"):
        for family in ("general", "small"):
            with registry.forced(family):
                out, lse = K.attention_forward(q, k, v, keep.expand(2, 4, 9, 9), is_causal=False, scale=0.25,
                                               sinks=sinks)
            check_close(f"out ({family})", out, want, 1e-5)
            check_close(f"lse ({family})", lse, want_lse, 1e-6)
            assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    with pytest.raises(ValueError, match="sinks must be a floating"):
        K.attention_forward(q, k, v, None, is_causal=True, scale=0.25, sinks=sinks[:2])


def test_bad_sinks_are_rejected():
    q, k, v, _, _ = inputs(bias=False)
    with pytest.raises(ValueError, match="sinks must be a 1-D tensor of the 4 query heads"):
        OP(q, k, v, None, 0.0, False, 0.25, torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must be floating point"):
        OP(q, k, v, None, 0.0, False, 0.25, torch.zeros(4, dtype=torch.int64))


def test_opcheck():
    q, k, v, b, sinks = inputs()
    torch.library.opcheck(OP, (q, k, v, b, 0.0, True, 0.25, sinks),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled(backend):
    q, k, v, b, sinks = inputs(dtype=torch.float32)
    dout = torch.randn(2, 4, 9, 16)

    def f(q, k, v, b, sinks):
        return OP(q, k, v, b, 0.0, True, 0.25, sinks)[0]

    want = f(q, k, v, b, sinks)
    want_g = grads(want, dout, (q, k, v, b, sinks))
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend)(q, k, v, b, sinks)
    got_g = grads(got, dout, (q, k, v, b, sinks))
    check_close("out", got, want, 1e-5)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got_g, want_g):
        check_close(name, g, w, 1e-5)


# --------------------------------------------------------------------------- the recogniser

def gpt_oss_like(q, k, v, mask, sinks):
    """HF gpt-oss's eager attention, as written there (transformers 5.x)."""
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    if mask is not None:
        s = s + mask
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    c = torch.cat([s, col], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    probs = torch.nn.functional.softmax(c, dim=-1, dtype=c.dtype)
    w = probs[..., :-1]
    return torch.matmul(torch.nn.functional.dropout(w, p=0.0, training=False), v)


def _site_inputs():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    mask = torch.zeros(2, 1, 9, 9).masked_fill(torch.rand(2, 1, 9, 9) < 0.2, float("-inf"))
    return q, k, v, mask, torch.randn(4)


def test_recognised_and_equal_to_eager(monkeypatch):
    from helpers import capture, rewrite_aot_eager

    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    args = _site_inputs()
    _, after, report = capture(gpt_oss_like, *args)
    assert "fuse_plugin.attention_sinks(" in after and "softmax" not in after and "cat(" not in after, after
    assert "sinks (a logit per head" in str(report)
    q, k, v, mask, sinks = (t.clone().requires_grad_(True) for t in args)
    want = gpt_oss_like(q, k, v, mask, sinks)
    want_g = torch.autograd.grad(want.sum(), (q, k, v, mask, sinks))
    torch._dynamo.reset()
    got = torch.compile(gpt_oss_like, backend=rewrite_aot_eager)(q, k, v, mask, sinks)
    got_g = torch.autograd.grad(got.sum(), (q, k, v, mask, sinks))
    check_close("out", got, want, 1e-5)
    for name, g, w in zip(("dq", "dk", "dv", "dmask", "dsinks"), got_g, want_g):
        check_close(name, g, w, 1e-4)


def test_near_miss_sink_column_kept():
    """The sink column not dropped after the softmax: not this form (and not attention)."""
    from helpers import capture

    def kept(q, k, v, mask, sinks):
        s = q @ k.transpose(2, 3) * 0.25 + mask
        c = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(2, -1, 9, -1)], dim=-1)
        return torch.softmax(c, dim=-1)[..., 1:] @ v  # drops the FIRST column

    before, after, report = capture(kept, *_site_inputs())
    assert before == after, after


def test_near_miss_column_per_query():
    """A column with a value per query, not per head: refused with the reason."""
    from helpers import capture

    def per_query(q, k, v, mask, col):
        s = q @ k.transpose(2, 3) * 0.25 + mask
        c = torch.cat([s, col], dim=-1)
        return torch.softmax(c, dim=-1)[..., :-1] @ v

    q, k, v, mask, _ = _site_inputs()
    before, after, report = capture(per_query, q, k, v, mask, torch.randn(2, 4, 9, 1))
    assert before == after
    assert "not one value per head" in str(report), report


def test_hf_gpt_oss_eager(monkeypatch):
    """Tiny HF GptOss (a sliding-window layer and a full one, eager attention): every attention
    site fused with its sinks; logits and all gradients (the sinks' too) equal eager's."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    from helpers import rewrite_aot_eager

    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    cfg = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=100, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        attn_implementation="eager", layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    for layer in model.model.layers:  # sinks are zeros at init: make them matter
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding

    def step(m):
        logits = m(input_ids=ids, attention_mask=mask).logits
        logits.sum().backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return logits, g

    want, want_g = step(model)
    torch._dynamo.reset()
    counters.clear()
    got, got_g = step(torch.compile(model, backend=rewrite_aot_eager))
    # >= 2: with transformers 5.17 / torch 2.11 the MoE's data-dependent routing breaks the graph
    # and graphs are retried, each counting its sites again (5.24 / 2.13: exactly 2)
    assert counters["fuse_plugin"]["attention"] >= 2
    check_close("logits", got, want, 1e-5)
    assert set(got_g) == set(want_g)
    for name in want_g:
        check_close(name, got_g[name], want_g[name], 1e-4)
    assert any("sinks" in n for n in got_g)


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_finite_fill_next_to_a_bias_through_the_replace_mask(monkeypatch, kernels):
    """masked_fill with a finite value, then an additive bias, then the sink column: the op's
    replace mask (the filled scores are the fill value, no gradient into q·kᵀ there)."""
    from helpers import rewrite_aot_eager

    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")

    def f(q, k, v, keep, bias, sinks):
        s = (q @ k.transpose(2, 3) * 0.25).masked_fill(~keep, -1e4) + bias
        c = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(2, -1, 9, -1)], dim=-1)
        return torch.softmax(c, dim=-1)[..., :-1] @ v

    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 1, 9, 9) > 0.3
    bias = torch.randn(1, 4, 9, 9, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    ts = (q, k, v, bias, sinks)
    want = f(q, k, v, keep, bias, sinks)
    want_g = torch.autograd.grad(want.sum(), ts)
    torch._dynamo.reset()
    counters.clear()
    with cpu_kernels(kernels):
        got = torch.compile(f, backend=rewrite_aot_eager)(q, k, v, keep, bias, sinks)
        got_g = torch.autograd.grad(got.sum(), ts)
    assert counters["fuse_plugin"]["attention"] == 1
    check_close("out", got, want, 1e-5)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got_g, want_g):
        check_close(name, g, w, 1e-4)


GPU_CASES = {  # name: (dtype, B, Hq, Hkv, Lq, Lk, D, causal, bias)
    "bf16-d64-gqa-causal-l200": (torch.bfloat16, 2, 8, 2, 200, 200, 64, True, "pad_min"),
    "bf16-d128-l17": (torch.bfloat16, 1, 4, 4, 17, 17, 128, False, "float"),
    "fp16-d64-l1-lk1000": (torch.float16, 2, 4, 1, 1, 1000, 64, False, None),
    "fp32-d80-l49": (torch.float32, 3, 2, 2, 49, 49, 80, False, "float"),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU (CI runs on the CPU)")
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_kernels_match_float64(case):
    """The sinks op on the GPU's kernel families (whichever the registry picks) against float64
    eager: out, lse and every gradient; "pad_min" masks whole rows with finfo.min (the one-launch
    backward's exact-statistics path looks at |lse|)."""
    dtype, B, Hq, Hkv, Lq, Lk, D, causal, bias_kind = GPU_CASES[case]
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    sinks = torch.randn(Hq, generator=g) * 2
    bias = None
    if bias_kind == "float":
        bias = torch.randn(B, 1, Lq, Lk, generator=g)
    elif bias_kind == "pad_min":
        bias = torch.zeros(B, 1, Lq, Lk)
        bias[0, :, :, Lk // 2:] = torch.finfo(dtype).min  # padded keys
        bias[1, :, 3] = torch.finfo(dtype).min  # a row masked everywhere
    dout = torch.randn(B, Hq, Lq, D, generator=g)
    ref_in = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    want = eager(*ref_in[:3], None if bias is None else bias.double(), ref_in[3], D ** -0.5, causal)
    want_g = torch.autograd.grad(want, ref_in, dout.double())
    gpu = [t.to("cuda", dtype if t is not sinks else torch.float32).requires_grad_(True) for t in (q, k, v, sinks)]
    out, lse = OP(*gpu[:3], None if bias is None else bias.to("cuda", dtype), 0.0, causal, D ** -0.5, gpu[3])
    got_g = torch.autograd.grad(out, gpu, dout.to("cuda", dtype))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    check_close("out", out.cpu(), want, tol)
    for name, got, w in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g):
        check_close(name, got.cpu(), w, tol)
