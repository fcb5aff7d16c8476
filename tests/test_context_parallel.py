"""Sequence-sharded DTensors run ring attention (issue 32; fuse_plugin/ops/context_parallel.py), on
the CPU: one gloo group of 2 processes.

Each rank runs every scenario of tests/context_parallel_worker.py (which registers the handlers
itself, the test's setup) and writes what it measured; each test here asserts one scenario on
both ranks:

* `torch.ops.fuse_plugin.attention` called eagerly on q, k, v DTensors placed Shard(2) equals the
  single-process op on the full tensors: out, lse and dq/dk/dv through the op's autograd (fp32:
  rel ≤ 1e-5 / 1e-4), every result a Shard(2) DTensor, out in the op's memory layout; non-causal,
  causal (contiguous layout: exact), GQA (Hq 4, Hkv 2), 7 tokens a rank, the op's kernels (Triton's
  interpreter), an output gradient that arrives replicated; the ring ran once each way, with
  load_balanced=False (PyTorch's plain Shard(2) layout);
* near misses (Shard(2) with a bias, dropout, a window, softcap, q and k of different lengths, a
  length the mesh does not divide, a Partial output gradient, a compiled call) raise a
  ShardingError naming the op, the placement and what the ring does not take; placements that are
  the sharding rules' business raise exactly the rules' error, as without the handlers; without
  the handlers the Shard(2) call raises (what they change);
* replicated, batch and head shards give bit for bit what DTensor's path without the handlers
  gives (outputs, gradients, placements), and never run the ring;
* registration is idempotent and survives PyTorch's context parallelism swapping the handler table.
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
    "compiled": ("traced (torch.compile)",),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_misses_raise_naming_the_op_the_placement_and_why(results, case):
    for f in facts(results, "errors"):
        c = f[case]
        assert c["raised"] in ("ShardingError", "TorchRuntimeError"), c  # (Dynamo wraps it when compiling)
        for part in ("fuse_plugin::attention", "(Shard(dim=2),)", "runs ring attention", "Redistribute",
                     *NEAR_MISSES[case]):
            assert part in c["message"], (part, c["message"])


@pytest.mark.parametrize("case", ["q sequence, k/v replicated (the rules)", "q Partial (the rules)"])
def test_other_placements_raise_the_rules_error_unchanged(results, case):
    for f in facts(results, "errors"):
        got, before = f[case], f[f"{case}, without the handlers"]
        assert got["raised"] is not None and got == before, (got, before)
        assert "fuse_plugin::attention: argument 'q' has placement" in got["message"]


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
