"""Regenerate the attention launch-configuration table on the current GPU.

    python -m fuse_plugin.tune [--out PATH] [--budget-s 420] [--workers N] [--plan full|main|quick]
                               [--log FILE.jsonl]
    python -m fuse_plugin.tune --choices [--out PATH] [--classes NAME,...] [--log FILE.jsonl]

``--choices`` measures the other table, which implementation a problem class runs fastest on
(tune_choices.py, kernels/choice_table.py); without it, this module tunes the tiles:

Writes ``fuse_plugin/kernels/attention_configs_sm<cc>.json`` (or ``--out``), keeping the entry
sets of other GPU names already in that file. Steps:

1. Candidates: for every tuned group (kernel, dtype, head-dim bucket, causal, mask kind) a small
   hand-picked set of (block_m, block_n, num_warps, num_stages, split_d), pruned by an estimate
   of shared memory against the GPU's limit. The no-mask fp16/bf16 groups of head dims 64 and
   128 also try the Hopper TMA kernels' tiles (``TMA_CANDIDATES``; written as entries ending in
   ``"tma"``) and, on sm_90 with Triton 3.6, the warp-specialised Gluon kernels' (forward
   ``GLUON_CANDIDATES``: ``"gluon"`` / ``"gluon_pingpong"``; backward ``GLUON_BWD_CANDIDATES``:
   ``"gluon"`` / ``"gluon_lpt"``); the backward of large head dims
   tries the atomic-free pair's (``TWO_KERNEL_CANDIDATES``; entries ending in ``"two_kernel"``),
   and the no-mask fp16/bf16 backward of head dim 256 that pair with TMA tiles
   (``TMA_PAIR_CANDIDATES``; entries ending in ``"tma_pair"`` and the dQ kernel's tile).
2. Compile + validate, in parallel worker processes (each a fresh CUDA context, so a crash costs
   one candidate): every candidate runs forward or backward on odd lengths (397 x 397, GQA 4/2)
   and is compared with a float64 golden; it also runs once on a small aligned shape so that the
   timing runs below find its compiled binary in Triton's cache. A candidate passes when it
   compiled, produced no NaN, and its error on the output and on every gradient is at most
   3x the best candidate's error of its group.
3. Timing (this process): each sequence bucket's representative shape (N = bucket, B*N = 16k
   tokens, H*D = 2048), median of ``triton.testing.do_bench``; N = 4096 times every valid
   candidate, the other buckets the 4 fastest at 4096. The fastest wins.
4. Keys not tuned (the plan is restricted to fit a few minutes; see ``PLANS``) are filled:
   fp16 from the bf16 entry, a bool mask from the float-mask entry (else the no-mask one), a
   float mask from the no-mask entry, a bucket that ran out of time from the 4096 winner, and
   anything else (fp32, untuned head dims) from the kernels' heuristic. Each entry records its
   source.

The plan stops timing when ``--budget-s`` runs out and fills the rest as above.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Head-dim buckets tuned per plan, most important first; masks tuned beyond "none".
PLANS = {
    "full": dict(dbuckets=(128, 64, 96, 80, 256, 192, 32), float_dbuckets=(128, 64)),
    "main": dict(dbuckets=(128, 64, 96, 80, 256), float_dbuckets=(128,)),
    "quick": dict(dbuckets=(128, 64), float_dbuckets=(128,)),
}
TUNE_DTYPE = "bf16"  # fp16 has the same tensor-core rate and tile limits: it copies bf16
REPRESENTATIVE_D = {16: 16, 32: 32, 48: 48, 64: 64, 80: 80, 96: 96, 128: 128, 160: 160,
                    192: 192, 256: 256}
VAL_SHAPE = dict(B=1, Hq=4, Hkv=2, L=397)
TOP_K_OTHER_BUCKETS = 4
ERR_FACTOR = 3.0

FWD_CANDIDATES = {
    "small": [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3),
              (128, 32, 4, 4), (64, 64, 4, 3), (128, 128, 4, 2), (64, 128, 4, 3)],
    "mid": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "d128": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2),
             (128, 32, 4, 4), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3)],
    "large": [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    "d256": [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 1),
             (64, 32, 4, 3), (128, 32, 8, 2)],
}
# The Hopper TMA kernels (AttentionConfig.kernel "tma"; no mask, fp16/bf16, D 64 or 128), candidates for
# the groups they cover, timed against the general kernels' (H100 sweeps, NOTES.md stop 9).
TMA_CANDIDATES = {
    "fwd": [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
            (64, 128, 4, 2), (128, 128, 4, 3)],
    "bwd": [(64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 2),
            (32, 128, 8, 2)],
}
BWD_CANDIDATES = {
    "small": [(32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2), (16, 128, 8, 2),
              (32, 128, 8, 3), (64, 128, 8, 1), (64, 64, 4, 2)],
    "mid": [(32, 128, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2),
            (64, 64, 4, 2)],
    "d128": [(32, 128, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2),
             (32, 64, 4, 2), (64, 64, 8, 3), (16, 64, 4, 2)],
    "large": [(16, 64, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2), (32, 64, 8, 1)],
    "d256": [(16, 64, 8, 2), (32, 64, 8, 2), (16, 128, 8, 1), (32, 64, 8, 1), (16, 64, 4, 2),
             (32, 32, 8, 2), (32, 32, 4, 2)],
}
# The warp-specialised Gluon forward (AttentionConfig.kernel "gluon" / "gluon_pingpong"; sm_90 with
# Triton 3.6, the TMA kernels' problems): (block_m = 2 x rows per consumer warpgroup, block_n,
# stages, ping-pong), from the H100 sweep of stop 10 (NOTES.md). 256-row tiles spill at D 128.
GLUON_CANDIDATES = {
    64: [(128, 128, 2, True), (128, 128, 3, True), (128, 128, 4, True), (256, 64, 3, True),
         (256, 64, 4, True), (128, 128, 2, False)],
    128: [(128, 128, 2, True), (128, 128, 2, False), (128, 128, 3, True), (128, 64, 4, True),
          (128, 64, 4, False)],
}
# The warp-specialised Gluon backward (AttentionConfig.kernel "gluon" / "gluon_lpt"; same platform
# and problems): (block_m queries per step, block_n keys per program, stages, LPT order), the
# variants of attention_bwd_gluon.VARIANTS (H100 sweeps, stop 10).
GLUON_BWD_CANDIDATES = [(64, 128, 2, False), (64, 128, 2, True)]
# The atomic-free backward pair (AttentionConfig.kernel "two_kernel") for head dims whose atomic
# kernel is register- and dQ-atomic-bound (H100, D 256: 182-187 vs 158-167 TFLOP/s; NOTES.md,
# stop 10). Both kernels of the pair run with the same tiles.
TWO_KERNEL_CANDIDATES = {
    "large": [(64, 64, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2), (64, 32, 8, 2)],
    "d256": [(64, 64, 8, 2), (64, 64, 8, 1), (32, 64, 8, 2), (32, 32, 4, 2), (64, 32, 8, 2)],
}


# The atomic-free pair with TMA tiles (AttentionConfig.kernel "tma_pair"; no mask, fp16/bf16,
# D 64/128/256): (dK/dV tile, dQ tile), each (block_m, block_n, num_warps, num_stages), from
# the H100 sweep of stop 11 (NOTES.md attempt 17: at D 256 236 vs 183 TFLOP/s causal).
TMA_PAIR_CANDIDATES = {
    256: [((64, 64, 8, 2), (128, 32, 8, 3)), ((64, 64, 8, 2), (64, 64, 4, 2)),
          ((32, 64, 8, 2), (128, 32, 8, 3)), ((64, 64, 8, 2), (128, 32, 8, 2))],
}


def _family(dbucket: int) -> str:
    if dbucket <= 64:
        return "small"
    if dbucket <= 96:
        return "mid"
    if dbucket == 128:
        return "d128"
    if dbucket <= 192:
        return "large"
    return "d256"


def candidates(kernel: str, dbucket: int, mask: str, smem_limit: int) -> list[tuple]:
    import torch

    from .kernels import attention as A
    from .kernels import attention_config as C
    from .kernels import attention_hopper as Hop

    base = (FWD_CANDIDATES if kernel == "fwd" else BWD_CANDIDATES)[_family(dbucket)]
    d = REPRESENTATIVE_D[dbucket]
    splits = (True, False) if C.d_parts(d, True)[1] else (False,)
    bias_elt = {"none": 0, "bool": 1, "float": 2}[mask]
    out = []
    for split in splits:
        for bm, bn, w, s in base:
            cfg = A.AttentionConfig(bm, bn, w, s, split)
            if C.smem_estimate(kernel, cfg, d, d, 2, bias_elt) <= smem_limit:
                out.append(tuple(cfg))
    if mask == "none" and d in Hop.TMA_HEAD_DIMS:
        for bm, bn, w, s in TMA_CANDIDATES[kernel]:
            cfg = A.AttentionConfig(bm, bn, w, s, False, "tma")
            if C.smem_estimate(kernel, cfg, d, d, 2, bias_elt) <= smem_limit:
                out.append(tuple(cfg))
    if kernel == "fwd" and mask == "none" and d in GLUON_CANDIDATES and Hop.gluon_fwd.GLUON_AVAILABLE \
            and torch.cuda.get_device_capability() == (9, 0):
        for bm, bn, s, pingpong in GLUON_CANDIDATES[d]:
            cfg = A.AttentionConfig(bm, bn, 4, s, False, "gluon_pingpong" if pingpong else "gluon")
            if C.smem_estimate(kernel, cfg, d, d, 2, bias_elt) <= smem_limit:
                out.append(tuple(cfg))
    if kernel == "bwd" and mask == "none" and d in Hop.TMA_HEAD_DIMS \
            and Hop.gluon_bwd.GLUON_AVAILABLE and torch.cuda.get_device_capability() == (9, 0):
        for bm, bn, s, lpt in GLUON_BWD_CANDIDATES:
            cfg = A.AttentionConfig(bm, bn, 8, s, False, "gluon_lpt" if lpt else "gluon")
            if C.gluon_bwd_variant(cfg) in Hop.gluon_bwd.VARIANTS and \
                    C.smem_estimate(kernel, cfg, d, d, 2, bias_elt) <= smem_limit:
                out.append(tuple(cfg))
    if kernel == "bwd":  # the pair reads whole head dims (split_d does not apply)
        for bm, bn, w, s in TWO_KERNEL_CANDIDATES.get(_family(dbucket), ()):
            cfg = A.AttentionConfig(bm, bn, w, s, False, "two_kernel")
            if C.smem_estimate(kernel, cfg, d, d, 2, bias_elt) <= smem_limit:
                out.append(tuple(cfg))
    if kernel == "bwd" and mask == "none" and d in Hop.TMA_PAIR_HEAD_DIMS:
        for tile, dq_tile in TMA_PAIR_CANDIDATES.get(d, ()):
            cfg = A.AttentionConfig(*tile, False, "tma_pair", dq_tile)
            if C.smem_estimate(kernel, cfg, d, d, 2, bias_elt) <= smem_limit:
                out.append(tuple(cfg))
    return out


# --------------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------------


def _torch_dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


DEVICE = os.environ.get("FUSE_TUNE_DEVICE", "cuda")  # "cpu": interpreter dry run (tests)


def make_problem(dtype_name, D, causal, mask, B, Hq, Hkv, L, seed=0, device=None):
    """q, k, v, bias, dout for one problem (bias: (B, 1, L, L) expanded, as the benchmark)."""
    import torch

    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    dt = _torch_dtype(dtype_name)
    q = torch.randn(B, Hq, L, D, device=device, generator=g).to(dt)
    k = torch.randn(B, Hkv, L, D, device=device, generator=g).to(dt)
    v = torch.randn(B, Hkv, L, D, device=device, generator=g).to(dt)
    dout = torch.randn(B, Hq, L, D, device=device, generator=g).to(dt)
    bias = None
    if mask == "float":
        bias = torch.randn(B, 1, L, L, device=device, generator=g).to(dt).expand(B, Hq, L, L)
    elif mask == "bool":
        keep = torch.rand(B, 1, L, L, device=device, generator=g) > 0.3
        keep[..., 0] = True
        bias = keep.expand(B, Hq, L, L)
    return q, k, v, bias, dout


def golden(q, k, v, bias, dout, causal, scale):
    """float64 (out, dq, dk, dv)."""
    import torch

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = leaves
    grp = qq.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(grp, 1), vv.repeat_interleave(grp, 1)
    s = qq @ kk.transpose(-1, -2) * scale
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias.double()
    if causal:
        L = s.shape[-1]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    out = s.softmax(-1) @ vv
    grads = torch.autograd.grad(out, leaves, dout.double())
    return [out.detach(), *grads]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------
# Worker: compile + validate
# --------------------------------------------------------------------------------------------


def _is_fatal_cuda(e: BaseException) -> bool:
    msg = str(e).lower()
    return any(s in msg for s in ("cuda error", "illegal", "misaligned", "unspecified launch",
                                  "device-side assert", "an illegal memory"))


def run_worker(task_file: str, result_file: str) -> int:
    import torch

    from .kernels import attention as A

    tasks = json.load(open(task_file))
    done = set()
    if os.path.exists(result_file):
        for line in open(result_file):
            done.add(json.loads(line)["id"])
    goldens = {}
    fwd_cache = {}
    with open(result_file, "a") as res:
        for t in tasks:
            if t["id"] in done:
                continue
            rec = {"id": t["id"], "ok": False}
            try:
                kernel, D, causal, mask, dt = t["kernel"], t["D"], t["causal"], t["mask"], t["dtype"]
                cfg = A.AttentionConfig(*t["cfg"])
                scale = D ** -0.5
                gkey = (D, causal, mask, dt)
                if gkey not in goldens:
                    prob = make_problem(dt, D, causal, mask, VAL_SHAPE["B"], VAL_SHAPE["Hq"],
                                        VAL_SHAPE["Hkv"], VAL_SHAPE["L"], seed=1)
                    goldens[gkey] = (prob, golden(*prob, causal, scale))
                (q, k, v, bias, dout), gold = goldens[gkey]
                if kernel == "fwd":
                    out, lse = A.attention_forward(q, k, v, bias, is_causal=causal, scale=scale,
                                                   config=cfg)
                    got = [out]
                else:
                    if gkey not in fwd_cache:
                        fwd_cache[gkey] = A.attention_forward(q, k, v, bias, is_causal=causal,
                                                              scale=scale)
                    out, lse = fwd_cache[gkey]
                    dq, dk, dv, _ = A.attention_backward(
                        dout, q, k, v, bias, out, lse, is_causal=causal, scale=scale,
                        need_dbias=False, config=cfg, deterministic=False)
                    got = [dq, dk, dv]
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                names = ["out"] if kernel == "fwd" else ["dq", "dk", "dv"]
                refs = gold[:1] if kernel == "fwd" else gold[1:]
                errs = {n: rel_err(g, r) for n, g, r in zip(names, got, refs)}
                nan = any(bool(torch.isnan(g).any()) for g in got)
                # Warm the compile cache with the timing shapes' specialization.
                wq, wk, wv, wb, wd = make_problem(dt, D, causal, mask, 1, t["H"], t["H"], 256)
                if kernel == "fwd":
                    A.attention_forward(wq, wk, wv, wb, is_causal=causal, scale=scale, config=cfg)
                else:
                    wo, wl = A.attention_forward(wq, wk, wv, wb, is_causal=causal, scale=scale)
                    A.attention_backward(wd, wq, wk, wv, wb, wo, wl, is_causal=causal, scale=scale,
                                         need_dbias=False, config=cfg, deterministic=False)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                rec.update(ok=not nan and all(math.isfinite(e) for e in errs.values()),
                           errs=errs, nan=nan)
            except Exception as e:  # compile error, out of resources, CUDA fault
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                res.write(json.dumps(rec) + "\n")
                res.flush()
                if _is_fatal_cuda(e):
                    return 3  # this context is poisoned: the parent restarts the rest
                continue
            res.write(json.dumps(rec) + "\n")
            res.flush()
    return 0


def run_workers(tasks: list[dict], n_workers: int, deadline: float, progress) -> dict:
    """Runs the tasks in worker processes; returns {task id: record}."""
    tmp = Path(tempfile.mkdtemp(prefix="fuse_tune_"))
    # Tasks of one golden stay together; groups go, in plan (priority) order, to the shortest
    # shard, so every worker does its most important groups first.
    groups: dict = {}
    for t in tasks:
        groups.setdefault((t["D"], t["causal"], t["mask"], t["kernel"]), []).append(t)
    shards = [[] for _ in range(max(1, n_workers))]
    for grp in groups.values():
        min(shards, key=len).extend(grp)
    shards = [s for s in shards if s]
    results: dict = {}
    procs = []

    def start(i, shard):
        tf, rf = tmp / f"tasks{i}.json", tmp / f"res{i}.jsonl"
        tf.write_text(json.dumps(shard))
        p = subprocess.Popen([sys.executable, "-m", "fuse_plugin.tune", "--worker", str(tf),
                              "--result", str(rf)], stdout=subprocess.DEVNULL,
                             stderr=open(tmp / f"err{i}.txt", "a"))
        return [p, shard, rf, i]

    procs = [start(i, s) for i, s in enumerate(shards)]
    restarts = [0]
    seen = 0
    while procs:
        time.sleep(0.5)
        still = []
        for p, shard, rf, i in procs:
            lines = rf.read_text().splitlines() if rf.exists() else []
            for line in lines:
                r = json.loads(line)
                results[r["id"]] = r
            rc = p.poll()
            if rc is None:
                if time.time() > deadline:
                    p.kill()
                else:
                    still.append([p, shard, rf, i])
                continue
            left = [t for t in shard if t["id"] not in results]
            if left and rc not in (0, 3):
                # Died without a record (segfault, abort): the first unfinished task did it.
                results[left[0]["id"]] = {"id": left[0]["id"], "ok": False,
                                          "error": f"worker crashed (exit {rc})"}
                left = left[1:]
            if left and time.time() < deadline:
                if rc == 0:  # finished without recording them: mark failed
                    for t in left:
                        results[t["id"]] = {"id": t["id"], "ok": False, "error": "no result"}
                else:
                    restarts[0] += 1
                    still.append(start(1000 * restarts[0] + i, left))
        procs = still
        if progress is not None and len(results) > seen:
            progress.update(len(results) - seen)
            seen = len(results)
    for t in tasks:
        results.setdefault(t["id"], {"id": t["id"], "ok": False, "error": "not run (budget)"})
    return results


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


class _Bar:
    """tqdm if available, else a one-line text bar."""

    def __init__(self, total, desc):
        try:
            from tqdm import tqdm

            self._t = tqdm(total=total, desc=desc, file=sys.stdout, mininterval=1.0)
        except ImportError:
            self._t = None
        self.n, self.total, self.desc, self._last = 0, total, desc, 0.0

    def update(self, k=1):
        if self._t is not None:
            self._t.update(k)
            return
        self.n += k
        now = time.time()
        if now - self._last > 2 or self.n >= self.total:
            self._last = now
            frac = self.n / max(1, self.total)
            print(f"{self.desc}: [{'#' * int(30 * frac):30s}] {self.n}/{self.total}", flush=True)

    def close(self):
        if self._t is not None:
            self._t.close()


def _flops(kernel, B, H, L, D, causal):
    f = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    return f * 2.5 if kernel == "bwd" else f


def _timing_shape(dbucket, L):
    D = REPRESENTATIVE_D[dbucket]
    return dict(B=max(1, 16384 // L), H=max(1, 2048 // D), L=L, D=D)


def tune(args) -> int:
    import torch
    import triton

    from .kernels import attention as A
    from .kernels import attention_config as C
    from .kernels import tuning

    t0 = time.time()
    deadline = t0 + args.budget_s
    dev = torch.device("cuda")
    cc = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    smem_limit = C.smem_limit(dev) or 232448
    plan = PLANS[args.plan]
    os.environ[tuning.ENV] = "off"  # the tuner itself must not read a stale table
    tuning.clear_cache()

    groups = []  # (kernel, dbucket, causal, mask)
    for db in plan["dbuckets"]:
        for kernel in ("fwd", "bwd"):
            for causal in (False, True):
                groups.append((kernel, db, causal, "none"))
    for db in plan["float_dbuckets"]:
        for kernel in ("fwd", "bwd"):
            for causal in (False, True):
                groups.append((kernel, db, causal, "float"))
    tasks = []
    for kernel, db, causal, mask in groups:
        for cfg in candidates(kernel, db, mask, smem_limit):
            tasks.append(dict(id=len(tasks), kernel=kernel, D=REPRESENTATIVE_D[db], dbucket=db,
                              causal=causal, mask=mask, dtype=TUNE_DTYPE, cfg=list(cfg),
                              H=_timing_shape(db, 4096)["H"]))
    print(f"tuning {name} (sm{cc[0]}{cc[1]}, triton {triton.__version__}, torch "
          f"{torch.__version__}): {len(groups)} groups, {len(tasks)} candidates, "
          f"budget {args.budget_s:.0f} s", flush=True)

    n_workers = args.workers or max(1, min(14, (os.cpu_count() or 2) - 1))
    bar = _Bar(len(tasks), "compile+validate")
    results = run_workers(tasks, n_workers, t0 + 0.6 * args.budget_s, bar)
    bar.close()
    log = open(args.log, "w") if args.log else None

    # Validity per group: error <= 3x the group's best on every tensor.
    valid: dict = {}
    for grp in groups:
        recs = [(t, results[t["id"]]) for t in tasks
                if (t["kernel"], t["dbucket"], t["causal"], t["mask"]) == grp]
        ok = [(t, r) for t, r in recs if r.get("ok")]
        best = {}
        for _, r in ok:
            for n, e in r["errs"].items():
                best[n] = min(best.get(n, math.inf), e)
        keep = []
        for t, r in recs:
            good = r.get("ok") and all(e <= ERR_FACTOR * best[n] + 1e-7
                                       for n, e in r["errs"].items())
            if log:
                log.write(json.dumps(dict(phase="validate", group=list(grp), cfg=t["cfg"],
                                          ok=bool(good), errs=r.get("errs"),
                                          error=r.get("error"))) + "\n")
            if good:
                keep.append(tuple(t["cfg"]))
        valid[grp] = keep
    print(f"validated in {time.time() - t0:.0f} s: "
          f"{sum(len(v) for v in valid.values())}/{len(tasks)} candidates pass", flush=True)
    for t in tasks:
        r = results[t["id"]]
        if not r.get("ok"):
            print(f"  rejected {t['kernel']} d{t['D']} causal={t['causal']} {t['mask']} "
                  f"{t['cfg']}: {r.get('error', r.get('errs'))}", flush=True)

    # Timing.
    from triton.testing import do_bench

    timed: dict = {}  # (grp, L) -> [(ms, cfg)]
    order = [4096, 16384, 1024]
    n_timings = sum(len(v) for v in valid.values()) + \
        2 * sum(min(TOP_K_OTHER_BUCKETS, len(v)) for v in valid.values())
    bar = _Bar(n_timings, "timing")
    out_of_time = False
    for L in order:
        for grp in groups:
            kernel, db, causal, mask = grp
            cands = valid[grp]
            if L != 4096:
                ranked = sorted(timed.get((grp, 4096), []))
                cands = [c for _, c in ranked[:TOP_K_OTHER_BUCKETS]]
            if not cands:
                continue
            if time.time() > deadline:
                out_of_time = True
                break
            shp = _timing_shape(db, L)
            q, k, v, bias, dout = make_problem(TUNE_DTYPE, shp["D"], causal, mask, shp["B"],
                                               shp["H"], shp["H"], shp["L"], seed=2)
            scale = shp["D"] ** -0.5
            if kernel == "bwd":
                out, lse = A.attention_forward(q, k, v, bias, is_causal=causal, scale=scale)
            rows = []
            for cfg in cands:
                if time.time() > deadline:
                    out_of_time = True
                    break
                c = A.AttentionConfig(*cfg)
                if kernel == "fwd":
                    fn = lambda: A.attention_forward(q, k, v, bias, is_causal=causal,  # noqa: E731
                                                     scale=scale, config=c)
                else:
                    fn = lambda: A.attention_backward(  # noqa: E731
                        dout, q, k, v, bias, out, lse, is_causal=causal, scale=scale,
                        need_dbias=False, config=c, deterministic=False)
                try:
                    ms = do_bench(fn, warmup=5, rep=25, return_mode="median")
                except Exception as e:
                    print(f"  timing failed {grp} {cfg}: {e}", flush=True)
                    ms = math.inf
                rows.append((ms, cfg))
                bar.update()
                if log:
                    tf = _flops(kernel, shp["B"], shp["H"], L, shp["D"], causal) / ms / 1e9
                    log.write(json.dumps(dict(phase="time", group=list(grp), L=L, cfg=list(cfg),
                                              ms=ms, tflops=tf)) + "\n")
            timed[(grp, L)] = rows
            q = k = v = bias = dout = None  # free before the next shape
        if out_of_time:
            break
    bar.close()
    if out_of_time:
        print("budget reached: untimed buckets are filled from the 4096 winners", flush=True)

    # Winners, then fill every key.
    entries: dict = {}
    summary = []
    for (grp, L), rows in timed.items():
        rows = [r for r in rows if math.isfinite(r[0])]
        if not rows:
            continue
        ms, cfg = min(rows)
        kernel, db, causal, mask = grp
        key = tuning.make_key(kernel, TUNE_DTYPE, db, causal, mask, L)
        entries[key] = [*cfg[:4], int(cfg[4]), "tuned"] + _kernel_marker(*cfg[5:7])
        shp = _timing_shape(db, L)
        summary.append((key, cfg, ms, _flops(kernel, shp["B"], shp["H"], L, shp["D"], causal)
                        / ms / 1e9))
    table_entries = fill_table(entries, smem_limit)

    out_path = Path(args.out) if args.out else tuning.table_path(cc)
    table = tuning.load_table(out_path) or {"format": tuning.FORMAT, "gpus": {}}
    # The short-sequence entries are measured apart (benchmarks/tiles.py): a retune keeps them.
    old = (table["gpus"].get(name) or {}).get("entries", {})
    table_entries.update({k: e for k, e in old.items() if k in set(tuning.optional_keys())})
    table["gpus"][name] = {
        "cc": list(cc), "triton": triton.__version__, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "tuned_by": "python -m fuse_plugin.tune",
        "plan": args.plan, "restricted": describe_plan(plan),
        "entries": table_entries,
    }
    write_table(out_path, table)
    print(f"\nwrote {out_path} ({len(table_entries)} entries, "
          f"{sum(1 for e in table_entries.values() if e[5] == 'tuned')} tuned) "
          f"in {time.time() - t0:.0f} s\n", flush=True)
    print("| key | block_m block_n warps stages split kernel | ms | TFLOP/s |")
    print("|---|---|---|---|")
    for key, cfg, ms, tf in sorted(summary):
        dq = f" dQ {'x'.join(map(str, cfg[6]))}" if len(cfg) > 6 and cfg[6] else ""
        print(f"| {key} | {cfg[0]} {cfg[1]} {cfg[2]} {cfg[3]} {int(cfg[4])} "
              f"{cfg[5]}{dq} | {ms:.3f} | {tf:.0f} |")
    if log:
        log.close()
    return 0


def describe_plan(plan) -> str:
    return (f"dtype {TUNE_DTYPE} only (fp16 copies it); head-dim buckets "
            f"{list(plan['dbuckets'])} with no mask, {list(plan['float_dbuckets'])} also with a "
            f"float mask (bool copies float); causal and full; N 4096 all candidates, "
            f"1024/16384 the top {TOP_K_OTHER_BUCKETS}; fp32 and other head dims: heuristic")


def fill_table(tuned: dict, smem_limit: int) -> dict:
    """Every dispatcher key -> entry (tuned, copied from a tuned sibling, or heuristic)."""
    import torch

    from .kernels import attention as A
    from .kernels import attention_config as C
    from .kernels import tuning

    def resolved(key, seen=()):
        if key in tuned:
            return tuned[key], key
        p = tuning.parse_key(key)
        mk = lambda **kw: tuning.make_key(**{**p, **kw})  # noqa: E731
        tries = []
        if p["dtype"] == "fp16":
            tries.append(mk(dtype="bf16"))
        if p["mask"] == "bool":
            tries += [mk(mask="float"), mk(mask="none")]
        elif p["mask"] == "float":
            tries.append(mk(mask="none"))
        if p["sbucket"] != 4096:
            tries.append(mk(sbucket=4096))
        for t in tries:
            if t in seen:
                continue
            got = resolved(t, seen + (key,))
            if got is not None:
                return got
        return None

    out = {}
    for key in tuning.all_keys():
        p = tuning.parse_key(key)
        got = resolved(key)
        d = REPRESENTATIVE_D[p["dbucket"]]
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[p["dtype"]]
        cfg = None
        if got is not None and len(got[0]) >= 7 and not tuning.kernel_covers(got[0][6], key):
            if got[0][6] == "tma_pair":  # a mask key: what such an entry falls back to at run time
                cfg = C.tma_pair_fallback(d, d, dt)
                src = "heuristic"
            got = None  # e.g. a TMA-kernel entry on a key that kernel does not cover
        bias_elt = {"none": 0, "bool": 1, "float": 4}[p["mask"]]
        elt = 4 if p["dtype"] == "fp32" else 2
        if got is not None:
            entry, src = got
            cfg = A.AttentionConfig(*tuning.entry_to_config(entry))
            src = "tuned" if src == key else f"from:{src}"
        elif cfg is None:
            h = C.forward_config if p["kernel"] == "fwd" else C.backward_config
            cfg, src = h(d, d, dt), "heuristic"
        # A tuned entry ran on the GPU as it is; copies and heuristics are fitted to the
        # shared-memory estimate (a float mask may be fp32: 4 bytes a score).
        while src != "tuned" and cfg.num_stages > 1 and \
                C.smem_estimate(p["kernel"], cfg, d, d, elt, bias_elt) > smem_limit:
            cfg = cfg._replace(num_stages=cfg.num_stages - 1)
        out[key] = [*cfg[:4], int(cfg.split_d), src] + _kernel_marker(cfg.kernel, cfg.dq_tile)
    return out


def _kernel_marker(kernel: str, dq_tile=None) -> list:
    """An entry's optional 7th (and for "tma_pair" 8th) elements (kernels/tuning.py)."""
    if kernel == "general":
        return []
    return [kernel] if dq_tile is None else [kernel, list(dq_tile)]


def write_table(path: Path, table: dict) -> None:
    """JSON with one entry per line (readable diffs)."""
    lines = ["{", f'  "format": {table["format"]},', '  "gpus": {']
    gpus = list(table["gpus"].items())
    for gi, (gname, g) in enumerate(gpus):
        lines.append(f"    {json.dumps(gname)}: {{")
        for f in ("cc", "triton", "torch", "date", "tuned_by", "plan", "restricted"):
            if f in g:
                lines.append(f"      {json.dumps(f)}: {json.dumps(g[f])},")
        lines.append('      "entries": {')
        items = sorted(g["entries"].items())
        for i, (k, e) in enumerate(items):
            lines.append(f"        {json.dumps(k)}: {json.dumps(e)}{',' if i + 1 < len(items) else ''}")
        lines.append("      }")
        lines.append("    }" + ("," if gi + 1 < len(gpus) else ""))
    lines += ["  }", "}"]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuse_plugin.tune", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="table path (default: the package's file for this GPU)")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--plan", choices=sorted(PLANS), default="full")
    p.add_argument("--log", default=None, help="JSON lines of every validation and timing")
    p.add_argument("--choices", action="store_true",
                   help="measure the choice table (tune_choices.py) instead of the tiles")
    p.add_argument("--classes", default=None, help="with --choices: these classes only (comma-separated)")
    p.add_argument("--warm", action="store_true", help="with --choices: compile and run once, untimed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.result)
    import torch

    if not torch.cuda.is_available():
        print("python -m fuse_plugin.tune needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.choices:
        from . import tune_choices

        return tune_choices.main(args)
    return tune(args)


if __name__ == "__main__":
    sys.exit(main())
