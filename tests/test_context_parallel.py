"""Context parallelism over our op (issue 32; fuse_plugin/ops/context_parallel.py), on the CPU: one
gloo group of 2 processes.

Each rank runs every scenario of a worker and writes what it measured; each test here asserts one
scenario on both ranks. tests/context_parallel_worker.py (sequence-sharded DTensors, eager; it
registers the handlers itself, the test's setup):

* `torch.ops.fuse_plugin.attention` called eagerly on q, k, v DTensors placed Shard(2) equals the
  single-process op on the full tensors: out, lse and dq/dk/dv through the op's autograd (fp32:
  rel ≤ 1e-5 / 1e-4), every result a Shard(2) DTensor, out in the op's memory layout; non-causal,
  causal (contiguous layout: exact), GQA (Hq 4, Hkv 2), 7 tokens a rank, the op's kernels (Triton's
  interpreter), an output gradient that arrives replicated; the ring ran once each way, with
  load_balanced=False (PyTorch's plain Shard(2) layout, its context parallelism off);
* near misses (Shard(2) with a bias, dropout, a window, softcap, q and k of different lengths, a
  length the mesh does not divide, a Partial output gradient) raise a ShardingError naming the op,
  the placement and what the ring does not take; placements that are the sharding rules' business
  raise exactly the rules' error, as without the handlers; without the handlers the Shard(2) call
  raises (what they change); a compiled Shard(2) call no longer raises;
* replicated, batch and head shards give bit for bit what DTensor's path without the handlers
  gives (outputs, gradients, placements), and never run the ring;
* registration is idempotent and survives PyTorch's context parallelism swapping the handler table.

tests/cp_compile_worker.py (compiled, under PyTorch's `context_parallel(...)`):

* a compiled tiny HF Llama (eager attention, fused by the rewrite; rewrite + route + AOTAutograd with
  eager kernels) under context_parallel(mesh, buffers=[ids, labels, positions]) equals the
  single-process run: loss (rel ≤ 1e-5) and every parameter gradient summed over the ranks
  (rel ≤ 1e-4); one graph, no break, both layers' attention one ring call each way, the buffers in
  the head-tail order; the same with the real backend (backend="fuse_plugin", Inductor, which routes
  after its rewrite; FUSE_PLUGIN_CP_INDUCTOR=0 skips it); without routing the loss is wrong
  (the control);
* a graph compiled inside context_parallel is not reused outside, nor the other way round, where
  the local shapes agree (the guard), and every call is right;
* a compiled tiny HF Mistral (sliding window 5) under context_parallel equals one process: the
  window reaches the ring; an SDPA call site stays for PyTorch's ring, a hand-written one is ours;
* sites the ring does not take (a bias, dropout, cross-attention, HF's padding mask) refuse to
  compile under context_parallel with a ContextParallelError;
* the op compiled on Shard(2) DTensors runs the ring's opaque ops (contiguous order outside
  context_parallel, load-balanced inside) and equals the single-process op; the opaque ops pass
  torch.library.opcheck.
"""
from __future__ import annotations

import os

import dist_harness
import pytest
import torch
from dist_harness import spawn_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "context_parallel_worker.py")
WORLD = 2
OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32, relative

if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the worker on WORLD ranks once; {rank: {scenario: {"facts": ...} | {"error": ...}}}."""
    return spawn_ranks(WORKER, WORLD, tmp_path_factory.mktemp("cp"), 300, "context-parallel worker")


def facts(results, scenario):
    """The scenario's facts from every rank (a rank's traceback fails the test)."""
    out = dist_harness.facts(results, scenario)
    assert len(out) == WORLD
    return out


CASES = ["noncausal", "causal", "gqa_causal", "gqa_noncausal", "odd_shards_causal", "kernels_gqa_causal",
         "dout_replicated"]


@pytest.mark.parametrize("case", CASES)
def test_sequence_sharded_dtensors_equal_the_single_process_op(results, case):
    for f in facts(results, case):
        assert f["out_rel_err"] <= OUT_TOL and f["lse_rel_err"] <= OUT_TOL, f
        for g in ("dq", "dk", "dv"):
            assert f[f"{g}_rel_err"] <= GRAD_TOL, (g, f)
        assert min(f["ref_grad_norms"]) > 0  # the gradients compared are not all zero
        assert set(f["placements"].values()) == {"(Shard(dim=2),)"}, f["placements"]  # out, lse, dq, dk, dv
        assert f["lse_dtype"] == "torch.float32"
        b, hq, L, dv = f["out_shape"]
        # the op's (B, L, Hq, Dv) memory layout, globally and locally (a batch of 1 may have any stride)
        assert f["out_strides"][1:] == f["out_local_strides"][1:] == [dv, hq * dv, 1], f
        assert b == 1 or (f["out_strides"][0], f["out_local_strides"][0]) == (L * hq * dv, L // WORLD * hq * dv), f
        assert f["dk_shape"][1] < f["dq_shape"][1] or "gqa" not in case  # GQA: kv heads, not repeated
        assert f["ring_calls"] == {"forward": 1, "backward": 1}, f["ring_calls"]
        assert f["load_balanced"] is False  # plain Shard(2): PyTorch's contiguous chunks


NEAR_MISSES = {  # case: what the message must say besides the op and the placement
    "bias replicated": ("attn_bias=", "(Replicate(),)", "no bias"),
    "bias sharded with the queries": ("attn_bias=", "no bias"),
    "dropout": ("dropout_p=0.1",),
    "window": ("window=4",),
    "softcap": ("softcap=30.0",),
    "cross-attention": ("q has 8 tokens and k 4", "cross-attention is not supported"),
    "uneven shards": ("7 tokens do not split evenly", "2 ranks"),
    "backward dout Partial": ("fuse_plugin::attention_backward", "'dout' is (Partial(sum),)"),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_misses_raise_naming_the_op_the_placement_and_why(results, case):
    for f in facts(results, "errors"):
        c = f[case]
        assert c["raised"] in ("ShardingError", "TorchRuntimeError"), c  # (Dynamo wraps it when compiling)
        for part in ("fuse_plugin::attention", "(Shard(dim=2),)", "runs ring attention", "Redistribute",
                     *NEAR_MISSES[case]):
            assert part in c["message"], (part, c["message"])


def test_a_compiled_sequence_sharded_call_no_longer_raises(results):
    # (traced, the handlers put the ring's opaque ops in the graph: tests of its results below)
    for f in facts(results, "errors"):
        assert f["compiled"]["raised"] is None, f["compiled"]


@pytest.mark.parametrize("case", ["q sequence, k/v replicated (the rules)", "q Partial (the rules)"])
def test_other_placements_raise_the_rules_error_unchanged(results, case):
    for f in facts(results, "errors"):
        got, before = f[case], f[f"{case}, without the handlers"]
        assert got["raised"] is not None and got == before, (got, before)
        assert "fuse_plugin::attention: argument 'q' has placement" in got["message"]


def test_the_ring_ops_run_on_head_shards_and_refuse_sequence_shards(results):
    """fuse_plugin::ring_attention (and its backward) on DTensors: head shards run locally (a CP
    group of one rank: equal to the attention op), a sequence shard raises naming the op."""
    for f in facts(results, "ring_op_rules"):
        assert all(p == "(Shard(dim=1),)" for p in f["placements"]), f
        assert max(f["rel_errs"]) <= 1e-6, f
        c = f["sequence_shard"]
        assert c["raised"] is not None and "fuse_plugin::ring_attention" in c["message"], c


def test_without_the_handlers_the_sequence_shard_is_refused(results):
    for f in facts(results, "errors"):
        c = f["sequence-sharded, without the handlers"]
        assert c["raised"] == "RuntimeError" and "Shard(dim=2)" in c["message"], c


@pytest.mark.parametrize("placement", ["replicated", "batch", "heads"])
def test_replicated_batch_and_head_shards_are_unchanged(results, placement):
    for f in facts(results, "unchanged"):
        c = f[placement]
        assert c["bitwise_equal"] and c["placements_equal"], c
        assert c["ring_calls"] == {"forward": 0, "backward": 0}, c


def test_registration_is_idempotent_and_survives_pytorch_context_parallel(results):
    for f in facts(results, "registration"):
        assert all(f.values()), f


def test_bind_fills_the_schema_defaults():
    from fuse_plugin.ops import context_parallel as cp

    op = torch.ops.fuse_plugin.attention.default
    q = torch.zeros(1)
    values = cp._bind(op, (q, q, q, None, 0.0, True, 0.5), {})
    assert values["is_causal"] is True and values["scale"] == 0.5
    assert (values["dropout_seed"], values["softcap"], values["replace"], values["window"]) == (None, 0.0, None, 0)
    assert cp._bind(op, (q, q, q, None, 0.0, True, 0.5), {"window": 3})["window"] == 3
    assert set(cp.handlers()) == {op, torch.ops.fuse_plugin.attention_backward.default}


# ----------------------------------------------------------------------------- compiled, under context_parallel
#
# tests/cp_compile_worker.py: a compiled tiny HF Llama (eager attention, fused by the rewrite) under
# PyTorch's context_parallel(mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]),
# its attention routed to the ring (ops/context_parallel.py, `route`), against the single-process run.

COMPILE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cp_compile_worker.py")
LOSS_TOL = 1e-5  # fp32, relative; gradients: GRAD_TOL


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return spawn_ranks(COMPILE_WORKER, WORLD, tmp_path_factory.mktemp("cp_compile"), 400,
                       "compiled context-parallel worker")


def _assert_parity(f):
    assert f["layout_is_head_tail"], f  # context_parallel sharded the buffers in the ring's load-balanced order
    assert f["state"] == {"group": f["state"]["group"], "load_balanced": True}, f["state"]
    assert f["loss_rel_err"] <= LOSS_TOL, f
    assert not f["missing_grads"] and len(f["grad_rel_errs"]) == f["n_params"], f
    worst = max(f["grad_rel_errs"].items(), key=lambda kv: kv[1])
    assert worst[1] <= GRAD_TOL, worst
    assert f["ref_grad_norms_min"] > 0
    assert f["graph_breaks"] == 0, f
    assert f["routed_counter"] == 2, f  # both layers' attention went to the ring


def test_compiled_llama_under_context_parallel_equals_one_process(compiled):
    """rewrite + route + AOTAutograd (eager kernels): loss and every gradient (summed over the
    ranks) equal the single-process run; one graph, each layer's attention one ring call each way."""
    for f in facts(compiled, "llama"):
        _assert_parity(f)
        assert f["compiles"] == 1 and f["routed"] == [2], f
        assert f["fw_ring"] == [2] and f["bw_ring"] == [2], f
        assert f["plain_attention_left"] == 0, f


def test_compiled_llama_under_context_parallel_with_the_real_backend(compiled):
    """backend="fuse_plugin" (Inductor, C++ on the CPU), nothing else asked of the user; then
    outside context_parallel with the same local shapes, a right (unrouted) result."""
    if "llama_inductor" not in compiled[0]:
        pytest.skip("FUSE_PLUGIN_CP_INDUCTOR=0")
    for f in facts(compiled, "llama_inductor"):
        _assert_parity(f)
        after = f["outside_after"]  # then outside, the same local shapes: recompiled unrouted, right
        assert after["loss_rel_err"] <= LOSS_TOL and after["routed_counter"] == 2, after


def test_compiled_llama_under_context_parallel_with_the_automatic_patch(compiled):
    """Plain torch.compile(model) after `import fuse_plugin` (Inductor): the same parity."""
    if "llama_autopatch" not in compiled[0]:
        pytest.skip("FUSE_PLUGIN_CP_INDUCTOR=0")
    for f in facts(compiled, "llama_autopatch"):
        _assert_parity(f)


def test_compiled_mistral_with_a_sliding_window_under_context_parallel(compiled):
    """A tiny HF Mistral (window 5) compiled under context_parallel: the window reaches the ring,
    which applies it over the global positions (loss and gradients as one process)."""
    for f in facts(compiled, "mistral_window"):
        _assert_parity(f)
        assert f["fw_ring"] and all(n == 2 for n in f["fw_ring"]), f


def test_an_sdpa_site_under_context_parallel_stays_for_pytorchs_ring(compiled):
    """While context_parallel is on, an SDPA call site is left as SDPA (PyTorch rings it, measured
    faster than our ring) and a hand-written one goes to our op (for our ring); before and after,
    the rule is off."""
    for f in facts(compiled, "sdpa_site"):
        assert (f["before"], f["on"], f["after"]) == (False, True, False), f
        assert not f["ours"] and "PyTorch's context parallelism rings it" in f["reason"], f
        # and a hand-written site goes to our op (for the ring), never Inductor or an SDPA call
        assert f["hand_written_ours"] and not f["hand_written_as_sdpa"], f
        assert "for the ring" in f["hand_written_reason"], f


def test_without_routing_the_loss_is_wrong(compiled):
    """The control: the same compile without `route` (each rank attends to its own shard only)."""
    for f in facts(compiled, "control"):
        assert f["loss_rel_err"] > 1e-3, f  # (measured: 1e-2; the parity tolerance is 1e-5)


def test_a_graph_is_not_reused_across_context_parallel_on_and_off(compiled):
    """The same local shapes inside and outside context_parallel (inside, outside, inside, outside):
    the guard recompiles once per state (routed inside, not outside), each graph is reused when its
    state returns, and every call is right."""
    for f in facts(compiled, "guards"):
        assert max(f["loss_rel_errs"]) <= LOSS_TOL, f
        assert f["routed"] == [2, 0], f  # two compiles, then both graphs reused


REFUSALS = {"bias": "attn_bias=", "dropout": "dropout_p=0.1", "cross-attention": "q has 8 tokens here and k 4",
            "hf padding mask": "attn_bias="}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_sites_the_ring_does_not_take_refuse_to_compile_under_context_parallel(compiled, case):
    for f in facts(compiled, "refusals"):
        c = f[case]
        assert c["raised"] is not None, c
        for part in ("ContextParallelError", "context_parallel(...) is active", "ring attention",
                     REFUSALS[case]):
            assert part in c["message"], (part, c["message"])


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_compiled_op_on_sequence_sharded_dtensors(compiled, where):
    """Traced, the DTensor handlers put the ring's opaque ops in the graph: one forward, one backward
    call; out, dq, dk, dv equal the single-process op (contiguous order outside context_parallel,
    its load-balanced order inside)."""
    for f in facts(compiled, "dtensor_compiled"):
        c = f[where]
        assert c["rel_errs"][0] <= OUT_TOL and max(c["rel_errs"][1:]) <= GRAD_TOL, c
        assert c["fw_ring"] == [1] and c["bw_ring"] == [1], c


def test_opaque_ring_ops_pass_opcheck(compiled):
    for f in facts(compiled, "opcheck"):
        for case, checks in f.items():
            assert set(checks.values()) == {"SUCCESS"}, (case, checks)


def test_route_outside_context_parallel_changes_nothing():
    """One process, PyTorch's context parallelism off: route leaves a graph with our op as it is
    (and, outside a torch.compile backend, adds no guard)."""
    from fuse_plugin.ops import context_parallel as cp

    def fn(q, k, v):
        return torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, True, 0.25)[0]

    gm = torch.fx.symbolic_trace(fn)
    before = gm.code
    assert cp.torch_context_parallel() is None and cp._state_key() is None
    assert cp.route(gm) == 0 and gm.code == before
    assert len(cp._sites(gm)) == 1  # (the call is seen: it is routed only under context parallelism)
