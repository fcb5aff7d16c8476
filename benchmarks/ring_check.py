"""Ring attention on GPUs against a float64 reference (issue 32): one process per GPU, NCCL.

    torchrun --nproc-per-node 2 benchmarks/ring_check.py          # bf16, ~20 s after start-up

Every rank draws the same full q/k/v (fresh random, seeded), keeps its shard (`shard_sequence`),
runs `ring_attention` forward and backward (our op's kernels per block, NCCL transfers) and compares
its out, lse, dq, dk, dv with its rows of one float64 attention over the whole sequence (plain torch,
causal top-left). Cases: MHA and GQA, causal load-balanced, causal contiguous, non-causal, head dims
64 and 128, an odd chunk length. Error measure: max |ring - ref| / max |ref| per tensor (lse: max
absolute error), bound 1e-2 for bf16 (the house bound; each block's out and dk/dv are rounded to
bf16 once before the float32 merge). An unwritten row shows as an error of ~1 (the merge starts
from zeros and -inf), a NaN fails. Prints one row per case and PASS/FAIL last.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuse_plugin.ops.ring_attention import ring_attention, shard_sequence  # noqa: E402

BOUND = 1e-2
# (name, B, Hq, Hkv, global L, D, causal, load_balanced)
CASES = [
    ("mha causal lb", 1, 16, 16, 4096, 128, True, True),
    ("gqa causal lb", 2, 16, 4, 2048, 128, True, True),
    ("gqa causal contig", 1, 16, 4, 4096, 128, True, False),
    ("mha full", 1, 8, 8, 2048, 64, False, False),
    ("gqa causal lb odd", 1, 8, 2, 4 * 1000, 64, True, True),  # chunks of 1000 (not a tile multiple)
]


def reference(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        L = q.shape[2]
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)


def rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    cuda = torch.cuda.is_available()  # without a GPU (a smoke test of this script): gloo, fp32, short
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    worst = 0.0
    for seed, (name, B, Hq, Hkv, L, D, causal, lb) in enumerate(CASES):
        L = L if cuda else 8 * world * (1 + L % 7)
        gen = torch.Generator(device="cpu").manual_seed(1234 + seed)  # the same full tensors on every rank
        # drawn, rounded to the tested dtype, then float64: the reference sees the ring's inputs
        full = [torch.randn(B, h, L, D, generator=gen).to(dtype).double() for h in (Hq, Hkv, Hkv)]
        dout_full = torch.randn(B, Hq, L, D, generator=gen).to(dtype).double()
        scale = D ** -0.5
        # the reference in float64 on this GPU, with its gradients
        ref_in = [t.to(dev).clone().requires_grad_() for t in full]
        ref_out, ref_lse = reference(*ref_in, causal, scale)
        ref_out.backward(dout_full.to(dev))
        shard = lambda t: shard_sequence(t, rank, world, load_balanced=lb)  # noqa: E731
        ins = [shard(t.to(dev)).to(dtype).requires_grad_() for t in full]
        out, lse = ring_attention(*ins, is_causal=causal, scale=scale, load_balanced=lb)
        out.backward(shard(dout_full.to(dev)).to(dtype))
        errs = {"out": rel(out, shard(ref_out.detach())),
                "lse": (lse.double() - shard(ref_lse.detach())).abs().max().item(),
                "dq": rel(ins[0].grad, shard(ref_in[0].grad)),
                "dk": rel(ins[1].grad, shard(ref_in[1].grad)),
                "dv": rel(ins[2].grad, shard(ref_in[2].grad))}
        e = torch.tensor([errs[k] for k in ("out", "lse", "dq", "dk", "dv")], device=dev)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)  # NaN propagates through max
        e = e.tolist()
        bad = any(x != x for x in e) or max(e[0], e[2], e[3], e[4]) > BOUND or e[1] > 0.05
        worst = max(worst, max(e[0], e[2], e[3], e[4])) if not bad else float("inf")
        if rank == 0:
            print(f"ring {name:18s} B{B} H{Hq}/{Hkv} L{L} D{D} ws{world}: out {e[0]:.1e} lse {e[1]:.1e} "
                  f"dq {e[2]:.1e} dk {e[3]:.1e} dv {e[4]:.1e} {'FAIL' if bad else 'ok'}", flush=True)
    if rank == 0:
        print(f"ring_check {'PASS' if worst <= BOUND else 'FAIL'} (worst rel err {worst:.1e}, bound {BOUND})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
