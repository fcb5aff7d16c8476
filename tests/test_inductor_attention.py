"""The plugin owns attention in its compiles: Inductor's fuse_attention patterns stay off there
(fuse_plugin/inductor_attention.py), and only there."""
import pytest
import torch
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin import inductor_attention
from helpers import rel_err


def softmax_over_queries(q, k, v):
    """Not attention (the softmax runs over the queries): Inductor's sfdp pattern 1 matches it anyway,
    since its patterns ignore integer arguments, and the SDPA it makes differs from eager."""
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def inputs(grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 8, 16, generator=g).requires_grad_(grad) for _ in range(3)]


@pytest.fixture(autouse=True)
def fresh():
    counters.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):  # the passes run on a cache miss only
        yield
    torch._dynamo.reset()
    fuse_plugin.install()


def compile_with(entry, fn):
    return torch.compile(fn, backend="fuse_plugin") if entry == "backend" else torch.compile(fn)


@pytest.mark.parametrize("entry", ["backend", "autopatch"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_what_the_plugin_leaves_stays_as_eager(entry, grad):
    q, k, v = inputs(grad)
    out = compile_with(entry, softmax_over_queries)(q, k, v)
    ref = softmax_over_queries(*[t.detach().requires_grad_(grad) for t in (q, k, v)])
    assert counters["fuse_plugin"]["attention"] == 0
    assert counters["inductor"]["fuse_attention"] == 0
    assert rel_err(out, ref) < 1e-5
    if grad:
        gy = torch.randn_like(ref)
        got = torch.autograd.grad(out, (q, k, v), gy)
        ref_inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(softmax_over_queries(*ref_inputs), ref_inputs, gy)
        assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-5


@pytest.mark.parametrize("entry", ["backend", "autopatch"])
def test_attention_is_still_fused_by_the_plugin(entry):
    q, k, v = inputs()
    out = compile_with(entry, attention)(q, k, v)
    assert counters["fuse_plugin"]["attention"] == 1
    assert counters["inductor"]["fuse_attention"] == 0
    assert rel_err(out, attention(q, k, v)) < 1e-5


@pytest.mark.parametrize("off", ["disabled", "uninstalled"])
def test_stock_compiles_keep_inductors_attention_patterns(off):
    """The gate is scoped to our compiles: plain torch.compile under `fuse_plugin.disabled()` or after
    `fuse_plugin.uninstall()` is stock Inductor, whose fuse_attention rewrites this attention."""
    q, k, v = inputs()
    if off == "uninstalled":
        fuse_plugin.uninstall()
        assert torch._inductor.config.joint_custom_pre_pass is None
        out = torch.compile(attention)(q, k, v)
    else:
        with fuse_plugin.disabled():
            out = torch.compile(attention)(q, k, v)
    assert counters["fuse_plugin"]["attention"] == 0
    assert counters["inductor"]["fuse_attention"] == 1
    assert rel_err(out, attention(q, k, v)) < 1e-5


def test_only_the_sfdp_entries_are_gated():
    """Inductor's other joint-graph patterns (pad_mm, misc) keep their checks."""
    from torch._inductor.fx_passes import joint_graph

    torch.compile(attention)(*inputs())  # registers Inductor's patterns (lazily) and gates ours
    entries = [e for es in joint_graph.patterns.patterns.values() for e in es]
    gated = [e for e in entries if isinstance(e.extra_check, inductor_attention._Gate)]
    others = [e for e in entries if not isinstance(e.extra_check, inductor_attention._Gate)]
    assert len(gated) >= 30 and others
    assert inductor_attention.gate_inductor_attention() == len(gated)  # idempotent
    for e in others:
        assert not inductor_attention.is_sfdp_entry(e)
        assert not (getattr(e, "pattern_name", None) or "").startswith("_sfdp")
    names = [getattr(e, "pattern_name", None) for e in gated]
    if any(names):  # torch 2.13 names its entries; 2.11 may not
        assert all(n.startswith("_sfdp_pattern") for n in names)


def test_user_joint_pass_and_pre_grad_pass_still_run_through_the_backend():
    seen = []

    def joint(graph):
        seen.append("joint")

    def pre_grad(graph):
        seen.append("pre_grad")

    q, k, v = inputs()
    fuse_plugin.uninstall()
    out = torch.compile(softmax_over_queries, backend="fuse_plugin",
                        options={"joint_custom_pre_pass": joint, "pre_grad_custom_pass": pre_grad})(q, k, v)
    assert sorted(seen) == ["joint", "pre_grad"]
    assert counters["inductor"]["fuse_attention"] == 0
    assert rel_err(out, softmax_over_queries(q, k, v)) < 1e-5
