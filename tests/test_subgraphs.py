"""The rewrite walks the subgraphs that higher-order ops hold (fuse_plugin/patterns/__init__.py):
activation checkpointing (`tag_activation_checkpoint`), `torch.compiler.nested_compile_region`
(`invoke_subgraph`), `torch.cond` branches (inference only, see test_cond_in_training_...); fused
there as at top level, training included.

What Dynamo does with `torch.utils.checkpoint(..., use_reentrant=True)` under torch.compile (torch
2.13, checked by `test_checkpoint_is_one_higher_order_op_in_both_modes`): no graph break, the same
`tag_activation_checkpoint` op as use_reentrant=False (with the kwarg recorded), so both are fused
the same way. AOTAutograd then recomputes the checkpointed region in the backward: the attention op
runs twice per step, and the dropout seed drawn in the region (a `randint` node in the graph, see
patterns/attention.py) is replayed, not redrawn, in the recompute: AOTAutograd's partitioner
functionalizes the RNG of recomputed random ops and Inductor fixes the seed of each random op
before partitioning (torch/_higher_order_ops/wrap.py, TagActivationCheckpoint). The dropout tests
below check that the forward and the recompute run with the same seed and equal the reference run
with it.
"""
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin.ops import reference
from helpers import rel_err, rewrite_aot_eager

# our rewrite + aot_eager; the named backend (Inductor); plain torch.compile with the automatic patch,
# where Inductor runs the pre-grad pass on each subgraph too (torch 2.13): the pass leaves those
# calls alone and the root's rewrite walks the subgraphs (autopatch._inductor_subgraph_call)
BACKENDS = [pytest.param(rewrite_aot_eager, id="aot_eager"), pytest.param("fuse_plugin", id="inductor"),
            pytest.param("inductor", id="autopatch")]


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def softmax_over_queries(q, k, v):  # not attention: left alone wherever it is
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v


def attn_dropout(q, k, v):
    w = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return F.dropout(w, p=0.3, training=True) @ v


def inputs(n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, 12, 16, generator=g) for _ in range(n)]


@pytest.fixture
def seeds(monkeypatch):
    """The dropout seed of every execution of the attention op's CPU kernel (None without dropout)."""
    calls = []
    real = reference.attention_forward
    monkeypatch.setattr(reference, "attention_forward", lambda *a: calls.append(a[-1]) or real(*a))
    return calls


@pytest.fixture(autouse=True)
def fresh():
    fuse_plugin.install()  # the "autopatch" runs need it (idempotent)
    counters.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def backward(out, leaves):
    """Gradients of <out, gy> by .backward() (eager reentrant checkpointing refuses autograd.grad)."""
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * gy).sum().backward()
    return gy, [t.grad for t in leaves]


def train_step(fn, backend, tensors, *extra):
    """Compiled and eager forward + backward of fn(*extra, *tensors); returns ((out, grads), (ref, ref_grads))."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = torch.compile(fn, backend=backend)(*extra, *leaves)
    _, grads = backward(out, leaves)
    ref_leaves = [t.clone().requires_grad_() for t in tensors]
    ref = fn(*extra, *ref_leaves)
    return (out, grads), (ref, backward(ref, ref_leaves)[1])


def assert_close(got, want, tol=1e-5):
    (out, grads), (ref, ref_grads) = got, want
    assert rel_err(out, ref) <= tol
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) <= tol


def test_checkpoint_is_one_higher_order_op_in_both_modes():
    ops = {}
    for reentrant in (False, True):
        graphs = []
        torch._dynamo.reset()
        torch.compile(lambda *a: cp.checkpoint(attn, *a, use_reentrant=reentrant),
                      backend=lambda gm, _: graphs.append(gm) or gm.forward)(*inputs())
        ops[reentrant] = [n.target.name() for gm in graphs for n in gm.graph.nodes
                          if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert ops == {False: ["tag_activation_checkpoint"], True: ["tag_activation_checkpoint"]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_attention_is_fused_and_trains(reentrant, backend, seeds):
    fn = lambda *a: cp.checkpoint(attn, *a, use_reentrant=reentrant)  # noqa: E731
    got, want = train_step(fn, backend, inputs())
    assert counters["fuse_plugin"]["attention"] == 1
    assert len(seeds) == 2  # the forward, and its recompute in the backward
    assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_dropout_recompute_uses_the_same_mask(reentrant, backend, seeds):
    q, k, v = inputs()
    fn = lambda *a: cp.checkpoint(attn_dropout, *a, use_reentrant=reentrant)  # noqa: E731
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(fn, backend=backend)(*leaves)
    gy, grads = backward(out, leaves)
    assert counters["fuse_plugin"]["attention"] == 1
    assert len(seeds) == 2 and seeds[0] is not None and torch.equal(seeds[0], seeds[1])
    seed = seeds[0]
    want, _ = reference.attention_forward(q, k, v, None, False, 0.25, 0.3, seed)
    assert rel_err(out, want) <= 1e-5
    want_grads = reference.attention_backward(gy, q, k, v, None, False, 0.25, False, 0.3, seed)
    for a, b in zip(grads, want_grads):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("backend", [BACKENDS[0], BACKENDS[2]])  # the backend's Inductor path: test_inductor_attention.py
def test_left_alone_inside_a_checkpoint(backend, seeds):
    """The near miss: not attention inside the region: not fused (named in explain), equal to eager."""
    fn = lambda *a: cp.checkpoint(softmax_over_queries, *a, use_reentrant=False)  # noqa: E731
    got, want = train_step(fn, backend, inputs())
    assert counters["fuse_plugin"]["attention"] == 0 and not seeds
    assert_close(got, want)


def test_explain_names_the_subgraph():
    def fn(q, k, v):
        o = cp.checkpoint(attn, q, k, v, use_reentrant=False)
        return cp.checkpoint(softmax_over_queries, o, k, v, use_reentrant=False)

    report = fuse_plugin.explain(fn, *inputs())
    assert report.walked_subgraphs == 2
    assert [(s.kind, s.graph) for s in report.sites] == [("attention", "wrap_body_0 (tag_activation_checkpoint)")]
    assert [m.graph for m in report.misses] == ["wrap_body_1 (tag_activation_checkpoint)"]
    assert report.subgraphs() == {"wrap_body_0 (tag_activation_checkpoint)": 1}
    text = str(report)
    assert "and 2 subgraph(s) of higher-order ops" in text and "[in wrap_body_0 (tag_activation_checkpoint)]" in text


def test_nested_checkpoints_are_walked():
    def fn(q, k, v):
        return cp.checkpoint(lambda *a: cp.checkpoint(attn, *a, use_reentrant=False) * 2, q, k, v,
                             use_reentrant=False)

    report = fuse_plugin.explain(fn, *inputs())
    assert report.count("attention") == 1, str(report)
    (site,) = report.sites
    assert site.graph.count("tag_activation_checkpoint") == 2, site.graph


@pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                    reason="torch.compiler.nested_compile_region does not exist in this torch")
@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_compile_region_is_rewritten_once(backend, seeds):
    """One region called twice: one subgraph module, rewritten (and counted) once, run twice."""
    block = torch.compiler.nested_compile_region(attn)

    def fn(q, k, v):
        return block(block(q, k, v), k, v)

    got, want = train_step(fn, backend, inputs())
    assert counters["fuse_plugin"]["attention"] == 1
    assert len(seeds) == 2
    assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cond_branch_in_inference(backend, seeds):
    """Attention in cond's true branch is fused; the false branch (not attention) is left alone."""
    def fn(pred, q, k, v):
        return torch.cond(pred, attn, softmax_over_queries, (q, k, v))

    compiled = torch.compile(fn, backend=backend)
    for pred in (True, False):
        out = compiled(torch.tensor(pred), *inputs())
        assert rel_err(out, fn(torch.tensor(pred), *inputs())) <= 1e-5
    assert counters["fuse_plugin"]["attention"] == 1
    assert len(seeds) == 1


def test_cond_in_training_is_left_alone_and_says_why(seeds):
    """cond's backward is a cond whose branches must give their gradients in one layout: ours (the
    op's contiguous ones) against a matmul's transposed dk would not compile, so cond is walked in
    inference only. In training it stays as written, trains like eager, and explain says so."""
    def fn(pred, q, k, v):
        return torch.cond(pred, attn, softmax_over_queries, (q, k, v))

    for backend in (rewrite_aot_eager, "inductor"):  # "inductor": the automatic patch
        torch._dynamo.reset()
        got, want = train_step(fn, backend, inputs(), torch.tensor(True))
        assert counters["fuse_plugin"]["attention"] == 0 and not seeds
        assert_close(got, want)
    report = fuse_plugin.explain(fn, torch.tensor(True), *[t.requires_grad_() for t in inputs()])
    assert not report.sites and [m.kind for m in report.misses] == ["subgraph"]
    assert "cond in training" in report.misses[0].reason
