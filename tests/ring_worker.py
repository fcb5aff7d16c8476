"""One rank of tests/test_ring_attention.py: every ring-attention scenario in one process group.

    python tests/ring_worker.py RANK WORLD_SIZE STORE_FILE OUT_DIR

Joins a gloo group of WORLD_SIZE CPU processes (a FileStore at STORE_FILE), runs every scenario
and writes OUT_DIR/rank{RANK}.json: {scenario: {"facts": {...}} or {"error": traceback}}. The
scenarios only measure (relative errors against the single-process op on the full sequence, error
messages, the order of transfers and computation, PyTorch's shards); the test file asserts.

Every rank builds the same full q, k, v and output gradient (one seed), runs the single-process op
on them (autograd: out, lse, dq, dk, dv) and compares its own shard of each with what the ring
gives it; `unshard_sequence` of the ring's out is compared with the whole reference too.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the "kernels" cases)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_harness import error_of as _error_of, full_problem, rel_err, run_scenarios  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for fuse_plugin

import fuse_plugin  # noqa: E402,F401
from fuse_plugin.ops import _dispatch  # noqa: E402
from fuse_plugin.ops import ring_attention as ring  # noqa: E402

# name: (B, Hq, Hkv, local length, D, is_causal, load_balanced, CPU implementation of the op)
CASES = {
    "noncausal": (2, 2, 2, 8, 16, False, True, "reference"),
    "causal_balanced": (2, 2, 2, 8, 16, True, True, "reference"),
    "causal_contiguous": (2, 2, 2, 8, 16, True, False, "reference"),
    "gqa_causal_balanced": (1, 4, 2, 8, 16, True, True, "reference"),
    "gqa_causal_contiguous": (1, 4, 2, 8, 16, True, False, "reference"),
    "uneven_balanced": (1, 4, 2, 10, 16, True, True, "reference"),  # 2W chunks of 5 tokens
    "uneven_contiguous": (1, 2, 1, 7, 16, True, False, "reference"),  # 7 tokens per rank
    # the op's kernels (Triton's interpreter): their backward reads the global out/lse it is passed
    "kernels_gqa_causal_balanced": (1, 2, 1, 8, 16, True, True, "triton"),
    "kernels_noncausal": (1, 2, 1, 8, 16, False, True, "triton"),
    # masks (issue 32's second part): a sliding window (local 8: chunks of 4 balanced; windows that
    # hide whole remote chunks, cut them, or fit in one), a dense bias sharded with the queries
    "window_balanced": (1, 4, 2, 8, 16, True, True, "reference", 3),
    "window_balanced_wide": (1, 2, 2, 8, 16, True, True, "reference", 6),
    "window_contiguous": (1, 2, 1, 8, 16, True, False, "reference", 5),
    "window_two": (1, 2, 2, 8, 16, True, True, "reference", 2),  # (1: dq, dk are exactly 0)
    "bias_noncausal": (2, 2, 2, 8, 16, False, True, "reference", 0, True),
    "bias_window_balanced": (1, 2, 1, 8, 16, True, True, "reference", 5, True),
    "kernels_window_balanced": (1, 2, 1, 8, 16, True, True, "triton", 3),
    "kernels_bias_causal": (1, 2, 1, 8, 16, True, False, "triton", 0, True),
    "padding_causal_balanced": (2, 2, 2, 8, 16, True, True, "reference", 0, "keys"),  # (B, 1, 1, L) padding
}


def run_case(ctx, B, Hq, Hkv, local, D, causal, balanced, impl, window=0, with_bias=False):
    rank, ws = ctx["rank"], ctx["ws"]
    scale = D ** -0.5
    L = local * ws
    q, k, v, dout = full_problem(B, Hq, Hkv, L, D)
    # a dense float bias over the whole sequence (B, Hq, L, L), with some -inf (a mask)
    bias = rows = None
    if with_bias == "keys":  # a padding bias over the keys (B, 1, 1, L): the last keys of sequence 0 padded
        bias = torch.zeros(B, 1, 1, L)
        bias[0, ..., L - L // 4:] = float("-inf")
    elif with_bias:
        g = torch.Generator().manual_seed(7)
        bias = torch.randn(B, Hq, L, L, generator=g).masked_fill(torch.rand(B, Hq, L, L, generator=g) < 0.2,
                                                                  float("-inf"))
        bias.diagonal(dim1=-2, dim2=-1).zero_()  # every row keeps its own key (a row with none: NaN, as eager)
        if causal:
            bias = bias.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), 0.0)
    extra = (0.0, None, window) if window else ()
    with _dispatch.cpu_kernels(impl):
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = torch.ops.fuse_plugin.attention(*ref_in, bias, 0.0, causal, scale, None, *extra)
        ref_out.backward(dout)

        def shard(t):
            return ring.shard_sequence(t, rank, ws, load_balanced=balanced)

        mine = [shard(t).requires_grad_() for t in (q, k, v)]
        if bias is not None:  # this rank's query rows (a per-key bias: its one row), key columns in global order
            rows = bias if bias.shape[2] == 1 else shard(bias)
        t0 = time.perf_counter()
        out, lse = ring.ring_attention(*mine, is_causal=causal, scale=scale, load_balanced=balanced, window=window,
                                       bias=rows)
        out.backward(shard(dout))
        seconds = time.perf_counter() - t0
    names = ("dq", "dk", "dv")
    facts = {"out_rel_err": rel_err(out, shard(ref_out)), "lse_rel_err": rel_err(lse, shard(ref_lse)),
             "unshard_rel_err": rel_err(ring.unshard_sequence(out.detach(), load_balanced=balanced), ref_out),
             "out_shape": list(out.shape), "out_strides": list(out.stride()),
             "lse_dtype": str(lse.dtype), "seconds": seconds}
    for name, m, r in zip(names, mine, ref_in):
        facts[f"{name}_rel_err"] = rel_err(m.grad, shard(r.grad))
        facts[f"{name}_shape"] = list(m.grad.shape)
    facts["ref_grad_norms"] = [r.grad.norm().item() for r in ref_in]  # nonzero: the comparison means something
    with _dispatch.cpu_kernels(impl):  # which block backward ran: the op's kernels or the plain-torch one
        facts["block_backward_runs_op_kernels"] = ring._runs_kernel(mine[0], mine[2])
    return facts


def scenario_trace(ctx):
    """The order of posts, computation and waits in one causal load-balanced forward + backward:
    each transfer must be posted before the computation it overlaps and waited for after it."""
    events = []
    orig_shift, orig_wait = ring._Ring.shift, ring._Pending.wait
    orig_fwd, orig_bwd = ring._block_forward, ring._block_backward

    def shift(self, tensors, tag=0):
        events.append("post kv" if tag == 0 else "post dkv")
        return orig_shift(self, tensors, tag)

    def wait(self):
        events.append("wait")
        return orig_wait(self)

    def fwd(*a):
        events.append("fwd")
        return orig_fwd(*a)

    def bwd(*a):
        events.append("bwd")
        return orig_bwd(*a)

    ring._Ring.shift, ring._Pending.wait, ring._block_forward, ring._block_backward = shift, wait, fwd, bwd
    try:
        q, k, v, dout = full_problem(1, 2, 2, 8 * ctx["ws"], 16)
        mine = [ring.shard_sequence(t, ctx["rank"], ctx["ws"]).requires_grad_() for t in (q, k, v)]
        out, _ = ring.ring_attention(*mine, is_causal=True, scale=0.25)
        n_fwd = len(events)
        out.backward(ring.shard_sequence(dout, ctx["rank"], ctx["ws"]))
    finally:
        ring._Ring.shift, ring._Pending.wait, ring._block_forward, ring._block_backward = (
            orig_shift, orig_wait, orig_fwd, orig_bwd)
    return {"forward": events[:n_fwd], "backward": events[n_fwd:]}


def scenario_pytorch_layout(ctx):
    """Our shards and unshard against PyTorch's context parallelism (_context_parallel_shard with
    its head-tail load balancer, or none; context_parallel_unshard)."""
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard, _HeadTailLoadBalancer, context_parallel_unshard)

    rank, ws, mesh = ctx["rank"], ctx["ws"], ctx["mesh"]
    L = 4 * ws * 3
    x = torch.randn(2, 3, L, 4, generator=torch.Generator().manual_seed(5))
    facts = {}
    for balanced in (True, False):
        balancer = _HeadTailLoadBalancer(L, ws, "cpu") if balanced else None
        theirs = _context_parallel_shard(mesh, [x], [2], load_balancer=balancer)[0]
        ours = ring.shard_sequence(x, rank, ws, load_balanced=balanced)
        back = context_parallel_unshard(mesh, [ours], [2], load_balancer=balancer)[0]
        key = "balanced" if balanced else "contiguous"
        facts[f"{key}_shard_equal"] = torch.equal(theirs, ours)
        facts[f"{key}_their_unshard_of_ours_equal"] = torch.equal(back, x)
        facts[f"{key}_our_unshard_equal"] = torch.equal(ring.unshard_sequence(theirs, load_balanced=balanced), x)
        pos = ring.shard_positions(L // ws, rank, ws, load_balanced=balanced)
        facts[f"{key}_positions_equal"] = torch.equal(ring.shard_sequence(torch.arange(L)[None, None, :, None], rank,
                                                                          ws, load_balanced=balanced).flatten(), pos)
    return facts


def scenario_errors(ctx):
    q = torch.randn(1, 2, 8, 16)
    return {
        "q and k shards differ in length": _error_of(lambda: ring.ring_attention(
            q, torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), is_causal=True, scale=0.25)),
        "odd shard, load-balanced causal": _error_of(lambda: ring.ring_attention(
            q[:, :, :7], q[:, :, :7], q[:, :, :7], is_causal=True, scale=0.25)),
        "no process group": ctx["no_group"],  # recorded before the group was initialised
    }


def main():
    rank, ws, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    # before the group exists: group=None has no default group to fall back on
    x = torch.randn(1, 2, 8, 16)
    no_group = _error_of(lambda: ring.ring_attention(x, x, x, is_causal=True, scale=0.25))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws)
    from torch.distributed.device_mesh import init_device_mesh

    ctx = {"rank": rank, "ws": ws, "mesh": init_device_mesh("cpu", (ws,)), "no_group": no_group}
    scenarios = {name: (lambda c, a=args: run_case(c, *a)) for name, args in CASES.items()}
    scenarios.update(trace=scenario_trace, pytorch_layout=scenario_pytorch_layout, errors=scenario_errors)
    run_scenarios(scenarios, ctx, rank, out_dir)


if __name__ == "__main__":
    main()
