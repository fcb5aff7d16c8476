"""One rank of tests/test_context_parallel.py: `fuse_plugin::attention` on sequence-sharded DTensors.

    python tests/context_parallel_worker.py RANK WORLD_SIZE STORE_FILE OUT_DIR

Joins a gloo group of WORLD_SIZE CPU processes (a FileStore at STORE_FILE), registers the
context-parallel handlers (ops/context_parallel.py; the test's setup, so the tests do not depend on
the ops' own hook), runs every scenario and writes OUT_DIR/rank{RANK}.json: {scenario: {"facts":
{...}} or {"error": traceback}}. The scenarios only measure (relative errors against the
single-process op on the full tensors, placements, error messages); the test file asserts.

Every rank builds the same full q, k, v and output gradient (one seed), runs the op on them in
this one process (autograd: out, lse, dq, dk, dv) and compares the full tensors of the DTensor
results (`full_tensor()`, an all-gather) with it.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the "kernels" case)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_harness import error_of as _error_of, full_problem, rel_err, run_scenarios  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for fuse_plugin

import fuse_plugin  # noqa: E402,F401
from fuse_plugin.ops import _dispatch  # noqa: E402
from fuse_plugin.ops import context_parallel as cp  # noqa: E402

# name: (B, Hq, Hkv, global length, D, is_causal, CPU implementation of the op)
CASES = {
    "noncausal": (2, 2, 2, 16, 16, False, "reference"),
    "causal": (2, 2, 2, 16, 16, True, "reference"),
    "gqa_causal": (1, 4, 2, 16, 16, True, "reference"),
    "gqa_noncausal": (1, 4, 2, 16, 16, False, "reference"),
    "odd_shards_causal": (1, 2, 1, 14, 16, True, "reference"),  # 7 tokens a rank (2 ranks)
    # the op's kernels (Triton's interpreter): the ring's block backward reads the global out/lse
    "kernels_gqa_causal": (1, 2, 1, 16, 16, True, "triton"),
}


def dtensor(t, mesh, placement, grad=False):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.detach().clone(), mesh, [placement]).requires_grad_(grad)


class RingCalls:
    """Counts the ring's forward and backward runs of the handlers (patched module names)."""

    def __init__(self):
        self.counts = {"forward": 0, "backward": 0}

    def __enter__(self):
        self.saved = cp.ring_attention_forward, cp.ring_attention_backward

        def fwd(*a, **kw):
            self.counts["forward"] += 1
            self.load_balanced = kw.get("load_balanced")
            return self.saved[0](*a, **kw)

        def bwd(*a, **kw):
            self.counts["backward"] += 1
            return self.saved[1](*a, **kw)

        cp.ring_attention_forward, cp.ring_attention_backward = fwd, bwd
        return self

    def __exit__(self, *exc):
        cp.ring_attention_forward, cp.ring_attention_backward = self.saved


def run_case(ctx, B, Hq, Hkv, L, D, causal, impl, dout_placement=None):
    """The op on Shard(2) q/k/v DTensors, forward and backward, vs the op on the full tensors."""
    from torch.distributed.tensor import Shard

    mesh = ctx["mesh"]
    scale = D ** -0.5
    q, k, v, dout = full_problem(B, Hq, Hkv, L, D)
    with _dispatch.cpu_kernels(impl):
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = torch.ops.fuse_plugin.attention(*ref_in, None, 0.0, causal, scale)
        ref_out.backward(dout)
        mine = [dtensor(t, mesh, Shard(2), grad=True) for t in (q, k, v)]
        t0 = time.perf_counter()
        with RingCalls() as calls:
            out, lse = torch.ops.fuse_plugin.attention(*mine, None, 0.0, causal, scale)
            out.backward(dtensor(dout, mesh, dout_placement or Shard(2)))
        seconds = time.perf_counter() - t0
    facts = {"out_rel_err": rel_err(out.full_tensor(), ref_out), "lse_rel_err": rel_err(lse.full_tensor(), ref_lse),
             "placements": {n: str(t.placements) for n, t in (("out", out), ("lse", lse))},
             "out_shape": list(out.shape), "out_local_strides": list(out.to_local().stride()),
             "out_strides": list(out.stride()), "lse_dtype": str(lse.dtype),
             "ring_calls": calls.counts, "load_balanced": calls.load_balanced, "seconds": seconds}
    for name, m, r in zip(("dq", "dk", "dv"), mine, ref_in):
        facts[f"{name}_rel_err"] = rel_err(m.grad.full_tensor(), r.grad)
        facts["placements"][name] = str(m.grad.placements)
        facts[f"{name}_shape"] = list(m.grad.shape)
    facts["ref_grad_norms"] = [r.grad.norm().item() for r in ref_in]  # nonzero: the comparison means something
    return facts


def without_handlers(fn):
    """fn() with the handlers taken out of DTensor's table (today's behaviour), then put back."""
    cp.unregister()
    try:
        return fn()
    finally:
        cp.register()


def scenario_errors(ctx):
    """Near misses of the ring (q/k/v Shard(2) with what it does not take) and a placement that
    stays the rules' business (q sequence-sharded, k/v replicated), with and without the handlers."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh, ops = ctx["mesh"], torch.ops.fuse_plugin
    B, L, D = 1, 8, 16
    q, k, v, dout = full_problem(B, 4, 2, L, D)

    def seq(t):
        return dtensor(t, mesh, Shard(2))

    def partial(t):
        return DTensor.from_local(t, mesh, [Partial()], run_check=False)

    bias = torch.randn(B, 1, L, L)
    cases = {
        "bias replicated": lambda: ops.attention(seq(q), seq(k), seq(v), dtensor(bias, mesh, Replicate()), 0.0,
                                                 False, 0.25),
        "bias sharded with the queries": lambda: ops.attention(seq(q), seq(k), seq(v), seq(bias), 0.0, False, 0.25),
        "dropout": lambda: ops.attention(seq(q), seq(k), seq(v), None, 0.1, True, 0.25,
                                         torch.tensor(7, dtype=torch.int64)),
        "window": lambda: ops.attention(seq(q), seq(k), seq(v), None, 0.0, True, 0.25, None, 0.0, None, 4),
        "softcap": lambda: ops.attention(seq(q), seq(k), seq(v), None, 0.0, True, 0.25, None, 30.0),
        "cross-attention": lambda: ops.attention(seq(q), seq(k[:, :, :4]), seq(v[:, :, :4]), None, 0.0, False, 0.25),
        "uneven shards": lambda: ops.attention(seq(q[:, :, :7]), seq(k[:, :, :7]), seq(v[:, :, :7]), None, 0.0,
                                               True, 0.25),
        "backward dout Partial": lambda: ops.attention_backward(
            partial(dout), seq(q), seq(k), seq(v), None, seq(dout), seq(torch.randn(B, 4, L)), 0.0, True, 0.25,
            None, False),
        "compiled": lambda: torch.compile(
            lambda q, k, v: ops.attention(q, k, v, None, 0.0, True, 0.25), backend="eager")(seq(q), seq(k), seq(v)),
    }
    facts = {name: _error_of(fn) for name, fn in cases.items()}
    rules = lambda: ops.attention(seq(q), dtensor(k, mesh, Replicate()), dtensor(v, mesh, Replicate()),  # noqa: E731
                                  None, 0.0, True, 0.25)
    facts["q sequence, k/v replicated (the rules)"] = _error_of(rules)
    facts["q sequence, k/v replicated (the rules), without the handlers"] = without_handlers(lambda: _error_of(rules))
    q_partial = lambda: ops.attention(  # noqa: E731
        partial(q), dtensor(k, mesh, Replicate()), dtensor(v, mesh, Replicate()), None, 0.0, True, 0.25)
    facts["q Partial (the rules)"] = _error_of(q_partial)
    facts["q Partial (the rules), without the handlers"] = without_handlers(lambda: _error_of(q_partial))
    facts["sequence-sharded, without the handlers"] = without_handlers(lambda: _error_of(
        lambda: ops.attention(seq(q), seq(k), seq(v), None, 0.0, True, 0.25)))
    return facts


def scenario_unchanged(ctx):
    """Replicated, batch and head shards (GQA, causal, a bias) with the handlers registered give
    bit for bit what DTensor's path without them gives: outputs, placements, gradients."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, ops = ctx["mesh"], torch.ops.fuse_plugin
    B, L, D = 2, 8, 16
    q, k, v, dout = full_problem(B, 4, 2, L, D, seed=1)
    bias = torch.randn(B, 1, L, L, generator=torch.Generator().manual_seed(2))

    def run(placement, bias_placement):
        ins = [dtensor(t, mesh, placement, grad=True) for t in (q, k, v)]
        b = dtensor(bias, mesh, bias_placement, grad=True)
        out, lse = ops.attention(*ins, b, 0.0, True, 0.25)
        out.backward(dtensor(dout, mesh, out.placements[0]))
        return [out, lse] + [t.grad for t in ins + [b]]

    facts = {}
    for name, (p, bp) in {"replicated": (Replicate(), Replicate()), "batch": (Shard(0), Shard(0)),
                          "heads": (Shard(1), Replicate())}.items():
        with RingCalls() as calls:
            got = run(p, bp)
        ref = without_handlers(lambda: run(p, bp))
        facts[name] = {"bitwise_equal": all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(got, ref)),
                       "placements": [str(t.placements) for t in got],
                       "placements_equal": [t.placements for t in got] == [t.placements for t in ref],
                       "ring_calls": calls.counts}
    return facts


def scenario_ring_op_rules(ctx):
    """The ring's own ops on DTensors (their sharding rules, ops/sharding.py): head-sharded q/k/v
    with a CP group of one rank each (a CP dim beside the TP one) run locally and equal the
    attention op on the same DTensors, forward and backward; sequence-sharded ones are refused."""
    from torch.distributed.tensor import Shard

    mesh, ops = ctx["mesh"], torch.ops.fuse_plugin
    solo = [dist.new_group([r]) for r in range(ctx["ws"])][ctx["rank"]]  # (every rank creates every group)
    q, k, v, dout = full_problem(1, 4, 2, 8, 16, seed=4)

    def run(fn):
        ins = [dtensor(t, mesh, Shard(1), grad=True) for t in (q, k, v)]
        out, _ = fn(*ins)
        out.backward(dtensor(dout, mesh, Shard(1)))
        return [out] + [t.grad for t in ins]

    ring = run(lambda *a: ops.ring_attention(*a, True, 0.25, solo.group_name, False, 0))
    plain = run(lambda *a: ops.attention(*a, None, 0.0, True, 0.25))
    seq = _error_of(lambda: ops.ring_attention(*(dtensor(t, mesh, Shard(2)) for t in (q, k, v)), True, 0.25,
                                               solo.group_name, False, 0))
    return {"placements": [str(t.placements) for t in ring],
            "rel_errs": [rel_err(a.to_local(), b.to_local()) for a, b in zip(ring, plain)],
            "sequence_shard": seq}


def scenario_registration(ctx):
    """register() is idempotent and its handlers survive PyTorch's context parallelism swapping
    the handler table in and out (registered before its module loaded, and while it is on)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    def ours_in_table():
        table = DTensor._op_dispatcher._custom_op_handlers
        return all(table.get(op) is h for op, h in cp.handlers().items())

    facts = {"registered": ours_in_table(), "register_again": cp.register() and ours_in_table()}
    torch_cp._enable_cp_dtensor_dispatcher()
    facts["while_torch_cp_on"] = ours_in_table()
    torch_cp._disable_cp_dtensor_dispatcher()
    facts["after_torch_cp_off"] = ours_in_table()
    cp.unregister()
    facts["unregistered"] = not any(op in DTensor._op_dispatcher._custom_op_handlers for op in cp.handlers())
    torch_cp._enable_cp_dtensor_dispatcher()
    cp.register()  # while PyTorch's table is swapped in
    torch_cp._disable_cp_dtensor_dispatcher()
    facts["registered_while_on_kept_after_off"] = ours_in_table()
    cp.register()
    return facts


def main():
    rank, ws, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    cp.register()  # the test's setup: the ops' own hook may not call it yet
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    ctx = {"rank": rank, "ws": ws, "mesh": init_device_mesh("cpu", (ws,))}
    scenarios = {name: (lambda c, a=args: run_case(c, *a)) for name, args in CASES.items()}
    scenarios["dout_replicated"] = lambda c: run_case(c, *CASES["gqa_causal"], dout_placement=Replicate())
    scenarios.update(errors=scenario_errors, unchanged=scenario_unchanged, registration=scenario_registration,
                     ring_op_rules=scenario_ring_op_rules)
    run_scenarios(scenarios, ctx, rank, out_dir)


if __name__ == "__main__":
    main()
