"""Distributed training with the plugin, on the CPU: 2 processes, gloo (issue 16).

One process group runs every scenario (tests/distributed_worker.py: starting 2 processes and
importing torch costs more than most scenarios), each rank writes what it measured, and each test
here asserts one scenario on both ranks:

* DDP: a compiled tiny Llama-style decoder trains 3 SGD steps on half the global batch per rank;
  the losses (averaged over ranks) and the parameters equal the eager single-process run on the
  whole global batch (fp32, rel ≤ 1e-5), every attention and rotary site fused;
* FSDP2: fully_shard on each block and on the root, then torch.compile: the same check (the rope
  folded into attention, `rope_attention`);
* TP: parallelize_module with q/k/v ColwiseParallel (DTensor outputs) and o RowwiseParallel, so the
  heads are sharded 2 ways: the fused ops run on DTensors sharded on the head dim (the sharding
  rules of fuse_plugin/ops/sharding.py are called with Shard(1) and return Shard(1)); losses,
  first-step gradients and parameters equal the single-process run;
* register_hf() (not compiled) on an HF Llama whose attention is tensor-parallel: the op called
  eagerly on DTensors, which failed before the rules with "does not have a sharding strategy
  registered"; logits and gradients equal HF's eager attention in one process;
* every op called eagerly on DTensors in each supported placement (replicated, batch, heads;
  rotary on the sequence too), outputs and gradients against the op on full tensors;
* placements an op cannot take raise an error naming the op, the argument and the placement.

Compiled scenarios use the plugin's rewrite + AOTAutograd with eager kernels by default (seconds);
`FUSE_PLUGIN_DIST_BACKEND=fuse_plugin python -m pytest tests/test_distributed.py` runs them
through the real backend (Inductor's C++ compile on the CPU: about a minute more on 2 cores).
"""
from __future__ import annotations

import os

import pytest
import torch
from dist_harness import facts, spawn_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
WORLD = 2
TOL = 1e-5  # fp32, relative

if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the worker on WORLD ranks once; {rank: {scenario: {"facts": ...} | {"error": ...}}}."""
    return spawn_ranks(WORKER, WORLD, tmp_path_factory.mktemp("dist"), 600, "distributed worker")


def check_training(f, sites):
    assert f["loss_rel_err"] <= TOL, (f["losses"], f["ref_losses"])
    assert f["param_rel_err"] <= TOL, f["param_rel_err"]
    assert f["losses"][-1] != f["losses"][0]  # the steps did change the model
    got = {k: f["sites"][k] for k in sites}
    assert got == sites, f["sites"]
    assert f["sites"]["misses"] == [], f["sites"]["misses"]


def test_ddp_compiled_matches_single_process(results):
    for f in facts(results, "ddp"):
        # one graph for the whole model (DDP's optimizer splits it by bucket; one bucket here):
        # both layers' attention and q/k rotations fused, the rotary pair not folded (default)
        check_training(f, {"attention": 2, "rotary": 4, "rope_attention": 0})


def test_fsdp2_compiled_matches_single_process(results):
    for f in facts(results, "fsdp2"):
        # FSDP2's hooks break the graph around each block, and Dynamo compiles Block.forward once
        # for both blocks (their parameters are graph inputs): one attention site, which every layer runs
        check_training(f, {"attention": 1, "rotary": 2, "rope_attention": 1})
        assert f["param_placements"] == ["(Shard(dim=0),)"]  # the parameters really are sharded


def test_tp_heads_sharded_compiled_matches_single_process(results):
    for f in facts(results, "tp"):
        check_training(f, {"attention": 2, "rotary": 4, "rope_attention": 2})
        assert f["grad_rel_err"] <= TOL, f["grad_rel_err"]
        calls = {c["op"]: c for c in f["rule_calls"]}
        fwd, bwd = calls["fuse_plugin::rope_attention"], calls["fuse_plugin::rope_attention_backward"]
        # DTensor in (q, k, v sharded on heads, cos/sin and the mask replicated), DTensor out
        assert fwd["in"][:3] == ["(Shard(dim=1),)"] * 3 and fwd["out"] == ["(Shard(dim=1),)"] * 2, fwd
        assert bwd["out"][:3] == ["(Shard(dim=1),)"] * 3, bwd
        assert fwd["shape0"] == [4, 4, 12, 16]  # global (B, Hq, L, D): each rank runs 2 of the 4 heads


def test_register_hf_eager_on_tensor_parallel_dtensors(results):
    for f in facts(results, "hf_tp_eager"):
        assert f["logits_rel_err"] <= TOL, f["logits_rel_err"]
        assert f["grad_rel_err"] <= 1e-4, f["grad_rel_err"]
        ops = {c["op"]: c for c in f["rule_calls"]}
        assert ops["fuse_plugin::attention"]["in"] == ["(Shard(dim=1),)"] * 3, ops
        assert ops["fuse_plugin::attention_backward"]["out"][:3] == ["(Shard(dim=1),)"] * 3, ops


EAGER_CASES = {  # case: the placements of the outputs and of the inputs' gradients
    "attention heads GQA causal": (["S1", "S1"], ["S1", "S1", "S1"]),
    "attention heads, bias broadcast over heads (dbias Partial)": (["S1", "S1"], ["S1", "S1", "S1", "P"]),
    "attention batch, per-row bias": (["S0", "S0"], ["S0", "S0", "S0", "S0"]),
    "attention replicated": (["R", "R"], ["R", "R", "R", "R"]),
    "rope_attention heads, learned tables (dcos Partial)": (["S1", "S1"], ["S1", "S1", "S1", "P", "P"]),
    "rope_attention batch": (["S0", "S0"], ["S0", "S0", "S0", "P", "P"]),
    "rotary sequence, tables sharded alike": (["S2"], ["S2", "S2", "S2"]),
    "rotary sequence, replicated tables sliced locally": (["S2"], ["S2", "S2", "S2"]),
    "rotary batch": (["S0"], ["S0", "P", "P"]),
    "rotary_qk heads": (["S1", "S1"], ["S1", "S1", "P", "P"]),
    "attention_sinks heads (sinks with them)": (["S1", "S1"], ["S1", "S1", "S1", "P", "S0"]),
    "attention_sinks batch (dsinks Partial)": (["S0", "S0"], ["S0", "S0", "S0", "S0", "P"]),
    "rotary_qk sequence": (["S2", "S2"], ["S2", "S2", "S2", "S2"]),
}
_SHORT = {"(Shard(dim=0),)": "S0", "(Shard(dim=1),)": "S1", "(Shard(dim=2),)": "S2", "(Replicate(),)": "R",
          "(Partial(sum),)": "P"}


@pytest.mark.parametrize("case", list(EAGER_CASES))
def test_ops_eagerly_on_dtensors(results, case):
    outs, grads = EAGER_CASES[case]
    for f in facts(results, "eager_ops"):
        c = f[case]
        assert [_SHORT.get(p, p) for p in c["out_placements"]] == outs, c
        assert [_SHORT.get(p, p) for p in c["grad_placements"]] == grads, c
        assert c["out_rel_err"] <= TOL and c["grad_rel_err"] <= TOL, c


ERROR_CASES = {  # case: (op, argument, placement) the message must name
    "attention q sequence-sharded": ("fuse_plugin::attention", "'q'", "Shard(dim=2)"),
    "attention k batch while q heads": ("fuse_plugin::attention", "'k'", "Shard(dim=0)"),
    "attention q Partial": ("fuse_plugin::attention", "'q'", "Partial(sum)"),
    "attention kv heads not divisible": ("fuse_plugin::attention", "'k'", "3 heads sharded over 2 ranks"),
    "attention dropout on shards": ("fuse_plugin::attention", "dropout_p=0.1", "Shard(dim=1)"),
    "attention bias sharded on its query dim": ("fuse_plugin::attention", "'attn_bias'", "Shard(dim=2)"),
    "rotary x replicated, tables sharded (a gather)": ("fuse_plugin::rotary", "'cos'", "Shard(dim=2)"),
    "rotary channel dim sharded": ("fuse_plugin::rotary", "'x'", "Shard(dim=3)"),
    "rotary tables sharded on another dim": ("fuse_plugin::rotary", "'cos'", "Shard(dim=2)"),
    "rotary_qk q and k on different dims": ("fuse_plugin::rotary_qk", "'k'", "Shard(dim=2)"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_unsupported_placement_raises_naming_it(results, case):
    for f in facts(results, "errors"):
        c = f[case]
        assert c["raised"] is not None, f"{case}: no error (the op ran, or DTensor redistributed silently)"
        for part in ERROR_CASES[case]:
            assert part in c["message"], (part, c["message"])


def test_explicit_redistribute_then_runs(results):
    """What the error tells the user to do works: redistribute by hand, then call the op."""
    for f in facts(results, "errors"):
        c = f["explicit redistribute works"]
        assert c["placements"] == "(Shard(dim=1),)" and c["rel_err"] <= TOL, c


def test_every_op_has_a_sharding_rule():
    """Every op of the namespace (the internal Gluon ones included) has a rule: none falls back to
    DTensor's "does not have a sharding strategy registered" (or to a silent redistribution)."""
    import fuse_plugin  # noqa: F401
    from fuse_plugin.ops.sharding import registered_ops

    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fuse_plugin::"))
    assert len(ops) >= 10 and sorted(registered_ops()) == ops


def test_benchmark_script_imports_and_parses_on_the_cpu():
    """benchmarks/distributed.py (GPU: FSDP2/TP vs one GPU) imports without CUDA; its defaults are
    the ones its docstring and the README promise."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "distributed.py")
    spec = importlib.util.spec_from_file_location("benchmark_distributed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args([])
    assert (args.layers, args.seq, args.batch, args.steps, args.cpu) == (4, 1024, 4, 20, False)
    smoke = mod.parse_args(["--cpu"])
    assert smoke.cpu and (smoke.seq, smoke.batch, smoke.steps) == (32, 2, 4)
