"""Ring attention (context parallelism, issue 32) on the CPU: gloo groups of 2 and 3 processes.

Both groups run at once, each rank running every scenario of tests/ring_worker.py in one process
group (starting processes and importing torch cost more than the scenarios) and writing what it
measured; each test here asserts one scenario on every rank of both groups:

* outputs, lse and every gradient (dq, dk, dv) of `ring_attention` on sequence shards equal the
  single-process op on the full sequence (fp32: rel ≤ 1e-5 out/lse, ≤ 1e-4 grads): non-causal;
  causal in PyTorch's load-balanced order and contiguous; GQA (Hq 4, Hkv 2); uneven lengths (2W
  chunks of 5 tokens; 7 tokens per rank); the op's kernels (Triton's interpreter), whose backward
  reads the global out/lse, and the CPU reference (the plain-torch block backward);
* each k/v (and dk/dv) transfer is posted before the computation it overlaps, waited for after;
* our shards are PyTorch context parallelism's (its head-tail load balancer, or none), both ways;
* clear errors: q and k shards of different lengths, an odd load-balanced shard, no process group.

Without processes: the plan computes every visible (query, key) pair exactly once and skips the
hidden ones (W 1-5, both layouts), load-balanced work is equal across ranks, the logsumexp merge
and the block backward with -inf rows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fuse_plugin.ops import ring_attention as ring

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_worker.py")
WORLDS = (2, 3)
OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32, relative

needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the worker on groups of 2 and 3 ranks at once; {world: {rank: {scenario: ...}}}."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {}
    for ws in WORLDS:
        out = tmp_path_factory.mktemp(f"ring{ws}")
        procs[ws] = (out, [subprocess.Popen([sys.executable, WORKER, str(r), str(ws), str(out / "store"), str(out)],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
                           for r in range(ws)])
    found = {}
    for ws, (out, ranks) in procs.items():
        logs = []
        for p in ranks:
            try:
                logs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                for _, others in procs.values():
                    for q in others:
                        q.kill()
                pytest.fail(f"the ring worker (world {ws}) did not finish in 300 s")
        found[ws] = {}
        for r, (p, log) in enumerate(zip(ranks, logs)):
            path = out / f"rank{r}.json"
            if not path.exists():
                pytest.fail(f"world {ws} rank {r} wrote no results (exit {p.returncode}); its output:\n{log[-5000:]}")
            found[ws][r] = json.loads(path.read_text())
    return found


def facts(results, ws, scenario):
    """The scenario's facts from every rank of the group of `ws` (a rank's traceback fails the test)."""
    out = []
    for r, per_rank in results[ws].items():
        res = per_rank[scenario]
        assert "error" not in res, f"world {ws}, rank {r}, scenario {scenario}:\n{res['error']}"
        out.append(res["facts"])
    assert len(out) == ws
    return out


CASES = {  # scenario: the block backward that runs (the op's kernels, or the plain-torch one)
    "noncausal": False, "causal_balanced": False, "causal_contiguous": False, "gqa_causal_balanced": False,
    "gqa_causal_contiguous": False, "uneven_balanced": False, "uneven_contiguous": False,
    "kernels_gqa_causal_balanced": True, "kernels_noncausal": True,
    # masks: a sliding window (whole remote chunks hidden, chunks cut by it, a window of 2), a dense
    # bias sharded with the queries (with -inf entries), both
    "window_balanced": False, "window_balanced_wide": False, "window_contiguous": False, "window_two": False,
    "bias_noncausal": False, "bias_window_balanced": False, "kernels_window_balanced": True,
    "kernels_bias_causal": True, "padding_causal_balanced": False,
}


@needs_gloo
@pytest.mark.parametrize("ws", WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_ring_matches_single_process_op(results, ws, case):
    for f in facts(results, ws, case):
        assert f["out_rel_err"] <= OUT_TOL and f["lse_rel_err"] <= OUT_TOL, f
        assert f["unshard_rel_err"] <= OUT_TOL, f  # unshard_sequence(out) is the whole reference output
        for g in ("dq", "dk", "dv"):
            assert f[f"{g}_rel_err"] <= GRAD_TOL, (g, f)
        assert min(f["ref_grad_norms"]) > 0  # the gradients compared are not all zero
        assert f["lse_dtype"] == "torch.float32"
        b, hq, lq, dv = f["out_shape"]
        assert f["out_strides"] == [lq * hq * dv, dv, hq * dv, 1]  # the op's (B, Lq, Hq, Dv) memory layout
        assert f["dk_shape"][1] < f["dq_shape"][1] or "gqa" not in case  # GQA: kv heads, not repeated
        assert f["block_backward_runs_op_kernels"] is CASES[case], f


def expected_trace(ws):
    """Forward: post the next k/v, compute, wait (last step: compute). Backward: post the next k/v,
    compute, wait for the block's dk/dv accumulator (none at step 0), post it onward, wait for
    the k/v; after the last step, wait for the own accumulator's arrival."""
    forward = ["post kv", "fwd", "wait"] * (ws - 1) + ["fwd"]
    backward = []
    for step in range(ws):
        backward += (["post kv"] if step < ws - 1 else []) + ["bwd"] + (["wait"] if step else [])
        backward += ["post dkv"] + (["wait"] if step < ws - 1 else [])
    return forward, backward + ["wait"]


@needs_gloo
@pytest.mark.parametrize("ws", WORLDS)
def test_transfers_are_posted_before_the_compute_they_overlap(results, ws):
    forward, backward = expected_trace(ws)
    for f in facts(results, ws, "trace"):  # load-balanced causal: one block call per step
        assert f["forward"] == forward, f["forward"]
        assert f["backward"] == backward, f["backward"]


@needs_gloo
@pytest.mark.parametrize("ws", WORLDS)
def test_shards_are_pytorch_context_parallel_shards(results, ws):
    for f in facts(results, ws, "pytorch_layout"):
        assert len(f) == 8 and all(f.values()), f


ERRORS = {
    "q and k shards differ in length": ("q 8 tokens, k 6", "cross-attention is not supported"),
    "odd shard, load-balanced causal": ("must be even, got 7", "load_balanced=False"),
    "no process group": ("no process group", "init_process_group"),
}


@needs_gloo
@pytest.mark.parametrize("ws", WORLDS)
@pytest.mark.parametrize("case", list(ERRORS))
def test_near_misses_raise_a_clear_error(results, ws, case):
    for f in facts(results, ws, "errors"):
        assert f[case]["raised"] == "ValueError", f[case]
        for part in ERRORS[case]:
            assert part in f[case]["message"], (part, f[case]["message"])


# ----------------------------------------------------------------------------- no processes


def _computed_pairs(rank, ws, chunk, causal, balanced):
    """{(query position, key position)} the plan of `rank` computes over all steps, and whether
    any pair was computed twice."""
    local = chunk * (2 if balanced and causal else 1)
    positions = [ring.shard_positions(local, r, ws, load_balanced=balanced and causal).tolist() for r in range(ws)]
    seen, twice = set(), False
    for step in range(ws):
        src = (rank - step) % ws
        for call in ring.step_calls(rank, ws, step, local, causal, balanced):
            qs, ks = range(local)[call.q], range(local)[call.k]
            for a, i in enumerate(qs):
                for b, j in enumerate(ks):
                    if call.causal and b > a:
                        continue
                    pair = (positions[rank][i], positions[src][j])
                    twice |= pair in seen
                    seen.add(pair)
    return seen, twice, positions[rank]


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5])
def test_plan_computes_each_visible_pair_once_and_skips_hidden_ones(ws, causal, balanced):
    chunk = 3
    for rank in range(ws):
        seen, twice, mine = _computed_pairs(rank, ws, chunk, causal, balanced)
        total = chunk * ws * (2 if balanced and causal else 1)
        visible = {(i, j) for i in mine for j in range(total) if not causal or j <= i}
        assert not twice and seen == visible, (rank, sorted(seen ^ visible)[:5])


@pytest.mark.parametrize("ws", [2, 3, 4, 5])
def test_load_balanced_causal_work_is_equal_and_one_call_per_step(ws):
    chunk = 4
    work = []
    for rank in range(ws):
        per_step = []
        for step in range(ws):
            calls = ring.step_calls(rank, ws, step, 2 * chunk, True, True)
            assert len(calls) == 1
            c = calls[0]
            n_q, n_k = c.q.stop - c.q.start, c.k.stop - c.k.start
            per_step.append(n_q * (n_q + 1) // 2 if c.causal else n_q * n_k)
        assert per_step[1:] == [2 * chunk * chunk] * (ws - 1)  # every remote step: 2c² pairs
        work.append(sum(per_step))
    assert len(set(work)) == 1, work
    # contiguous shards: the last rank computes every block, the first only its own
    assert [len(ring.step_calls(0, ws, s, 8, True, False)) for s in range(ws)] == [1] + [0] * (ws - 1)
    assert [len(ring.step_calls(ws - 1, ws, s, 8, True, False)) for s in range(ws)] == [1] * ws


def _windowed_pairs(rank, ws, chunk, balanced, window):
    """{(query position, key position)} a windowed plan of `rank` leaves visible after each call's
    own masks (the op's causal window on a diagonal pair, the band's -inf on a cut pair), and the
    number of (query, key) cells its calls compute (hidden ones included)."""
    local = chunk * (2 if balanced else 1)
    positions = [ring.shard_positions(local, r, ws, load_balanced=balanced).tolist() for r in range(ws)]
    seen, twice, cells = set(), False, 0
    for step in range(ws):
        src = (rank - step) % ws
        for call in ring.step_calls(rank, ws, step, local, True, balanced, window):
            qs, ks = range(local)[call.q], range(local)[call.k]
            cells += len(qs) * len(ks)
            assert call.k_cols is not None and call.k_cols.stop - call.k_cols.start == len(ks)
            assert list(range(ws * local))[call.k_cols] == sorted(positions[src][j] for j in ks)  # bias columns
            for a, i in enumerate(qs):
                for b, j in enumerate(ks):
                    if call.causal and (b > a or a - b >= call.window):
                        continue
                    if call.band is not None and call.band + a - b >= call.window:
                        continue
                    pair = (positions[rank][i], positions[src][j])
                    twice |= pair in seen
                    seen.add(pair)
    return seen, twice, positions[rank], cells


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 7, 100])
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_windowed_plan_computes_each_visible_pair_once_and_skips_hidden_chunks(ws, window, balanced):
    """Under a sliding window every (query, key) pair with 0 <= i - j < window is computed exactly
    once, none other survives the calls' masks, and a chunk pair the window hides entirely is never
    called (the calls' cells stay within the window's reach)."""
    chunk = 3
    for rank in range(ws):
        seen, twice, mine, cells = _windowed_pairs(rank, ws, chunk, balanced, window)
        total = chunk * ws * (2 if balanced else 1)
        visible = {(i, j) for i in mine for j in range(total) if 0 <= i - j < window}
        assert not twice and seen == visible, (rank, sorted(seen ^ visible)[:5])
        # no call on a chunk pair without a visible cell: at most the chunks each query's window touches
        assert cells <= len(mine) * chunk * (2 + (window - 1) // chunk), (rank, cells)


def test_window_pair_kinds():
    """Chunks of 4: the causal window of 5 cuts (3, 2) (distances 1..7), hides (3, 1) (5..11),
    keeps (2, 1) whole with a window of 8 (1..7), and leaves the causal kinds alone."""
    kind = ring.window_pair_kind
    assert kind(3, 2, 4, True, 5) == ring.BAND and kind(3, 1, 4, True, 5) == ring.HIDDEN
    assert kind(2, 1, 4, True, 8) == ring.FULL and kind(2, 2, 4, True, 5) == ring.DIAGONAL
    assert kind(1, 2, 4, True, 5) == ring.HIDDEN and kind(3, 1, 4, True, 0) == ring.FULL


def test_mask_arguments_are_checked():
    """Clear errors, without processes: a window without is_causal or not an int, a bias of the
    wrong shape, one that requires grad, an odd load-balanced shard with a bias."""
    q = torch.zeros(1, 2, 4, 8)
    check = ring._check_mask
    with pytest.raises(ValueError, match="needs is_causal=True"):
        check(q, q, False, 3, None, 2)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        check(q, q, True, -1, None, 2)
    with pytest.raises(ValueError, match=r"\(B\|1, Hq\|1, 4\|1, 8\)"):
        check(q, q, True, 0, torch.zeros(1, 1, 4, 4), 2)
    with pytest.raises(ValueError, match="requires grad"):
        check(q, q, True, 0, torch.zeros(1, 1, 4, 8, requires_grad=True), 2)
    with pytest.raises(ValueError, match="even shard length"):
        check(torch.zeros(1, 2, 3, 8), q, False, 0, torch.zeros(1, 1, 3, 6), 2)
    check(q, q, True, 3, torch.zeros(1, 2, 4, 8), 2)  # right: no error
    check(q, q, True, 3, torch.zeros(1, 1, 1, 8), 2)  # a per-key (padding) bias, every query alike


def test_block_calls_fall_back_to_one_call_per_visible_pair():
    """A layout the module does not make (queries of chunks 0 and 2, keys of chunks 1 and 2): the
    visible pairs (2, 1) full and (2, 2) diagonal, each its own call; (0, ·) hidden."""
    calls = ring.block_calls((0, 2), (1, 2), 5, True)
    assert calls == [ring.BlockCall(slice(5, 10), slice(0, 5), False), ring.BlockCall(slice(5, 10), slice(5, 10), True)]
    assert ring.block_calls((0,), (1, 2), 5, True) == []
    assert ring.pair_kind(1, 0, True) == ring.FULL and ring.pair_kind(1, 1, True) == ring.DIAGONAL
    assert ring.pair_kind(0, 1, True) == ring.HIDDEN and ring.pair_kind(0, 1, False) == ring.FULL


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_load_balance_indices_are_pytorchs(ws):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    for L in (2 * ws, 6 * ws, 10 * ws):
        theirs = _HeadTailLoadBalancer(L, ws, "cpu")._generate_indices()[0].long()
        assert torch.equal(ring.load_balance_indices(L, ws), theirs)
        x = torch.arange(L).view(1, 1, L, 1)
        shards = [ring.shard_sequence(x, r, ws) for r in range(ws)]
        assert torch.equal(torch.cat(shards, 2).flatten(), theirs)
    with pytest.raises(ValueError, match="multiple of 2·world_size"):
        ring.load_balance_indices(2 * ws + 1, ws)


def test_merge_is_exact_and_ignores_blocks_with_minus_inf_lse():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    ops = torch.ops.fuse_plugin
    full_out, full_lse = ops.attention(q, k, v, None, 0.0, False, 0.25)
    out = torch.zeros(1, 2, 6, 16)
    lse = torch.full((1, 2, 6), float("-inf"))
    first = ops.attention(q, k[:, :, :2], v[:, :, :2], None, 0.0, False, 0.25)
    ring._merge(out, lse, slice(0, 6), *first)
    assert torch.equal(out, first[0]) and torch.equal(lse, first[1])  # a fresh row takes the block as it is
    # a block whose rows see nothing (NaN out, lse -inf, as the op gives fully masked rows) changes nothing
    ring._merge(out, lse, slice(0, 6), torch.full_like(out, float("nan")), torch.full_like(lse, float("-inf")))
    assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
    ring._merge(out, lse, slice(0, 6), *ops.attention(q, k[:, :, 2:], v[:, :, 2:], None, 0.0, False, 0.25))
    assert torch.allclose(out, full_out, rtol=1e-5, atol=1e-6) and torch.allclose(lse, full_lse, rtol=1e-6)


def test_reference_block_backward_reads_the_global_stats_and_skips_dead_rows():
    """The plain-torch block backward, given the full rows' out/lse, gives each block's share of
    the full gradients: the three visible blocks of a causal 6 x 6 attention (queries 0-2 x keys
    0-2 diagonal, 3-5 x 0-2 full, 3-5 x 3-5 diagonal) add up to the op's backward (GQA 4 / 2);
    a row whose lse is -inf adds nothing."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 4, 6, 16, generator=g) for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    ops = torch.ops.fuse_plugin
    out, lse = ops.attention(q, k, v, None, 0.0, True, 0.25)
    dq, dk, dv, _ = ops.attention_backward(dout, q, k, v, None, out, lse, 0.0, True, 0.25, None, False)

    def block(rows, cols, causal):
        return ring._reference_block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                              out[:, :, rows], lse[:, :, rows], causal, 0.25)

    early, late = slice(0, 3), slice(3, 6)
    d00, d10, d11 = block(early, early, True), block(late, early, False), block(late, late, True)
    got = (torch.cat([d00[0], d10[0] + d11[0]], 2), torch.cat([d00[1] + d10[1], d11[1]], 2),
           torch.cat([d00[2] + d10[2], d11[2]], 2))
    for name, a, b in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, (a - b).abs().max())
    dead = lse.clone()
    dead[:, :, 4] = float("-inf")
    d = ring._reference_block_backward(dout, q, k, v, out, dead, True, 0.25)
    assert torch.equal(d[0][:, :, 4], torch.zeros_like(d[0][:, :, 4])) and all(t.isfinite().all() for t in d)
