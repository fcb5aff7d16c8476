"""Attention of many small problems (Triton): whole score tiles, several problems per program.

For problems whose every query and key fits one tile (Lq, Lk <= ``MAX_LEN`` = 128, head dims
16-128): Swin's 7x7 windows (L 49, D 32, up to 4096 windows x 3-24 heads), small ViTs, BERT at
128 tokens, LeViT (D 16, Dv 64). The general kernels (attention_fwd.py, attention_bwd.py) give
each (query block, batch, head) a program of 64-128 rows with an online softmax; at L 49 most of
such a tile is padding, the grid is one program per problem, and every program pays its set-up
for one tiny problem. Here:

* One program owns ``problems_per_program`` consecutive *units* (``SmallConfig``); a unit is one
  (batch b, key/value head) with all its ``Hq // Hkv`` query heads (one (b, h) without GQA). The
  program loops over its units (``tl.range`` with ``num_stages``: the next unit's loads are
  issued while this one computes) and, inside a unit, over its query heads (unrolled), so K/V
  are loaded once per unit and, in the backward, the GQA group's dK/dV are summed in registers:
  no atomics for dK/dV, and dQ rows are each owned by one program (no dQ atomics either).
* Whole tiles: the (Lq x Lk) scores of a problem are one register tile of BLOCK_Q x BLOCK_K =
  max(16, next_pow2(L)) each way; head dims are padded to max(16, next_pow2(D)) (likewise Dv).
  Padding rows/columns are masked (read as 0, scored -inf, never stored). Tile sizes and head
  dims are compile-time constants; lengths, strides, the batch and the unit count are run-time
  arguments, so one compiled kernel serves every length up to the tile.
* The softmax is exact (max, exp, sum over the whole row at once, no rescaling).
* Forward: S = Q Kᵀ, scale, bias / masks, P, O = (P V) / l, lse. Backward (transposed tiles,
  keys x queries, as the general backward): P recomputed from lse, Delta = rowsum(dO ∘ O) from
  O itself (no preprocess kernel), dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − Delta), dQ = dS K
  (stored), dK += dSᵀ Q. One launch per direction.

Shapes and layouts
------------------
As the general kernels (kernels/attention.py), except the bias's batch:

* ``q`` (B, Hq, Lq, D), ``k`` (B, Hkv, Lk, D), ``v`` (B, Hkv, Lk, Dv), ``Hq % Hkv == 0``; query
  head h reads key/value head ``h // (Hq // Hkv)`` (never repeated). Any strides (e.g. the
  head-split view ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)[0]``, strided rows); a
  unit last stride reads coalesced.
* ``bias``: None, or (Pb, Hq, Lq, Lk) with ``B % Pb == 0``: batch b reads ``bias[b % Pb]``, every
  dim through its strides (0 where broadcast: an ``.expand`` view is never materialised). So
  Pb == B is an ordinary (B, Hq, Lq, Lk) bias (a (1, H, L, L) one expanded to it has batch
  stride 0), and Swin's window bias arrives as (nW, Hq, L, L) with Pb = nW (window w of batch
  row b·nW + w). A bool bias keeps True and masks False; a float one (any float dtype) is added
  in fp32 after scaling: ``s = q·kᵀ·scale + bias``. A bias whose query stride is 0 (key
  padding, (B, 1, 1, Lk) expanded) is read one value per key (``host.bias_over_keys``).
* ``is_causal``: top-left aligned, key j visible to query i iff ``j <= i``.
* Outputs are written into the caller's tensors through their strides: ``out`` (B, Hq, Lq, Dv)
  in q's dtype (the op passes its (B, Lq, Hq, Dv) buffer seen transposed), ``lse`` (B, Hq, Lq)
  fp32; ``dq``/``dk``/``dv`` shaped and typed as q/k/v (any layout). ``dout`` is read through its
  strides.
* ``dbias``: None, or an fp32 (Pd, Hd, Lqd, Lk) tensor, each dim 1 or the bias's full size
  (Pd in {1, Pb}, Hd in {1, Hq}, Lqd in {1, Lq}; it is written through its strides). It receives
  the sum of dS (the gradient of the scores s, fp32) over every (b, h, i) that maps to each of
  its elements: (b, h, i, j) adds to ``dbias[b % Pd, h % Hd, i % Lqd, j]``. So Swin's (nW, H, L, L)
  sums over the B / nW images, a (1, H, L, L) bias over all batches, a key-padding (B, 1, 1, Lk)
  over heads and queries. The caller need not zero it: the launcher zeroes it where the kernel
  adds into it (``_dbias_plan``).

Numerics
--------
Those of the general kernels. Scores in fp32 (fp32 inputs: tf32 or ieee dots as an eager
matmul would, ``host.dot_precision``; bf16 dots upcast in the CPU interpreter, ``host.upcast_dot``).
Without a float bias log2(e) is folded into the score scale (exp2 of the scores directly); with
one the scores stay in natural units until the row max is subtracted. P is rounded to v's dtype
for P·V (and dS to q's for the dQ/dK dots), as flash attention does.

A row whose every score is -inf (bool / -inf masks) gives NaN output and ``lse = -inf``, as
eager softmax; in the backward it contributes nothing (its dQ and dS rows are 0; dK, dV and
dbias take no NaN). The backward recomputes P from lse, except in a problem where a live row's
|lse| exceeds ``_LSE_EXACT_LIMIT`` (a row biased by finfo.min): fp32 lse has lost log(l) there,
so that problem's rows take the exact max and sum from the score tile, which holds each row
whole (as the general ``ONE_KEY_BLOCK`` backward does).

Dropout (``dropout_p > 0``, ``dropout_seed`` one int64 on q's device): the general kernels' draw
(``_dropout_keep`` of (seed, b·Hq + h, i, j)), bit for bit, so ``reference.dropout_keep`` and the
general kernels drop the same weights; kept weights are scaled by ``host.dropout_scale(p)``, lse
is of the undropped softmax, and the backward draws the same mask again.

The bias gradient
-----------------
Per problem, dS (keys x queries, fp32) is added into one register accumulator; consecutive
problems that feed the same dbias slot (b % Pd, h % Hd) keep adding to it, and it is written
out ("flushed", summed over the queries then when Lqd == 1) only when the next problem feeds
another slot or the program ends. The backward therefore visits the units slot by slot:
unit u is (b, kvh) with ``u = ((b % Pd) * Hkv + kvh) * (B // Pd) + b // Pd`` (the batches of a
slot adjacent), and a flush is one of (``_dbias_plan``):

* a plain store, when every slot's problems are consecutive and inside one program (the slot's
  problem count divides ``problems_per_program``, or is 1): no zeroing, no atomics;
* fp32 atomic adds into the zeroed dbias otherwise (at most a few per slot and program);
* deterministic mode (``torch.are_deterministic_algorithms_enabled()``): no atomics ever;
  ``problems_per_program`` is raised to a multiple of the slot's unit count so that each
  program owns its slots whole and sums them in a fixed order (a plain store, or, with GQA and
  a per-head dbias reduced over batches, where a unit's heads feed different slots in turn, a
  load-add-store into the zeroed dbias). ``why_not`` declines a deterministic dbias whose slots
  would leave too few programs (more than ``DETERMINISTIC_MAX_SLOT_UNITS`` units per slot).

Without dbias the units are visited in (b, kvh) order.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .args import KEY_ROWS, ROW_STATS, SCORES, strides
from .attention_bwd import _row_stats
from .attention_tiles import (
    _LN2,
    _LOG2E,
    _LSE_EXACT_LIMIT,
    _dot,
    _dot_acc,
    _dropout_keep,
    _exp,
    _load_tile,
    _pair_ptrs,
    _probs,
    _scores,
    _store_tile,
)
from .attention_config import smem_limit
from .call import dropout_args
from .host import (FLOAT_BIAS, bias_args, bias_over_keys, cdiv, dot_precision, next_pow2, placeholder,
                   sm_count, upcast_dot)
from .launch import hint, launch

__all__ = ["MAX_LEN", "SmallConfig", "why_not", "forward", "backward", "default_config"]

MAX_LEN = 128  # Lq and Lk at most this (one tile each way)
MAX_HEAD_DIM = 128
MIN_HEAD_DIM = 16
# Deterministic dbias: at most this many units per dbias slot, all owned by one program
# (``why_not``); beyond it the grid would be too short (e.g. a (1, H, L, L) bias of 4096
# windows: H programs of 4096 units each).
DETERMINISTIC_MAX_SLOT_UNITS = 64
# Bytes of shared memory a pipeline stage takes beyond ``stage_bytes``'s tiles (1 KB was seen).
STAGE_SLACK = 2048
# default_config: aim for this many programs per SM, each with at most MAX_UNITS_PER_PROGRAM.
PROGRAMS_PER_SM = 4
MAX_UNITS_PER_PROGRAM = 16
_H100_SMS = 132  # the CPU interpreter's stand-in SM count

# Values of the backward's DBIAS constexpr: how a flush writes the accumulated dS.
NO_DBIAS, DBIAS_STORE, DBIAS_ADD, DBIAS_ATOMIC = 0, 1, 2, 3

_DTYPE_NAMES = {torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.float32: "fp32"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class SmallConfig(NamedTuple):
    """Launch parameters (pass as ``config=`` to override ``default_config``)."""

    problems_per_program: int  # units (b, kv head with its query heads) per program, >= 1
    num_warps: int
    num_stages: int  # software-pipelining depth of the loop over a program's units


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------


@triton.jit
def _unit(u, Hkv, period, reps):
    """(b, kvh) of unit ``u`` in the order ``u = ((b % period) * Hkv + kvh) * reps + b // period``
    (``reps = B // period``): ``period = B`` is plain (b, kvh) order, a dbias's batch period puts
    the batches that share a dbias slot next to each other. int64, for the base offsets."""
    r = u % reps
    t = u // reps
    b = r * period + t // Hkv
    return b.to(tl.int64), (t % Hkv).to(tl.int64)


@triton.jit
def _fwd_problem(q_base, k, v, bias_base, out_base, lse_ptrs, seed, bh, offs_q, offs_k, Lq, Lk,
                 stride_qm, stride_qd, stride_bm, stride_bn, stride_om, stride_od,
                 score_scale, drop_thresh, inv_keep,
                 D: tl.constexpr, Dv: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 BIAS_KIND: tl.constexpr, BIAS_KEYS: tl.constexpr, DROPOUT: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Out and lse of one (b, h) problem against its loaded K/V tiles, with an exact softmax."""
    q = _load_tile(q_base, 0, Lq, D, stride_qm, stride_qd, BLOCK_Q, BLOCK_D)
    qk = _dot(q, tl.trans(k), PRECISION, UPCAST_DOT)
    s = _scores(qk, 0, 0, offs_q[:, None], offs_k[None, :], Lq, Lk, bias_base, stride_bm,
                stride_bn, 0, score_scale, IS_CAUSAL, BIAS_KIND, True, False, BIAS_KEYS)
    # A fully masked row: 0 as the reference, so p = 0, l = 0, out = 0/0 = NaN, lse = -inf.
    m = tl.max(s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = _exp(s - m[:, None], BIAS_KIND == 2)
    l = tl.sum(p, 1)
    inv_l = 1.0 / l
    if DROPOUT:  # l is of the undropped weights; 1/(1-p) applied to the output once
        p = tl.where(_dropout_keep(seed, bh, 0, 0, offs_q, offs_k, drop_thresh, False), p, 0.0)
        inv_l = inv_l * inv_keep
    o = _dot(p.to(v.dtype), v, PRECISION, UPCAST_DOT) * inv_l[:, None]
    _store_tile(out_base, o, 0, Lq, Dv, stride_om, stride_od, BLOCK_Q, BLOCK_DV)
    if BIAS_KIND == 2:
        lse = m + tl.log2(l) * _LN2
    else:
        lse = (m + tl.log2(l)) * _LN2
    tl.store(lse_ptrs, lse, mask=offs_q < Lq)


@triton.jit
def attention_small_fwd_kernel(
    Q, K, V, Bias, Out, Lse, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    Hkv, Lq, Lk, bias_period, n_units, units_per_program,
    score_scale, drop_thresh, inv_keep,
    D: tl.constexpr, Dv: tl.constexpr, GROUP: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, BIAS_KEYS: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Out and lse of units [pid * units_per_program, ...) in (b, kvh) order: per unit K/V are
    loaded once and each of its GROUP query heads is one ``_fwd_problem``."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, inv_keep = tl.cast(score_scale, tl.float32), tl.cast(inv_keep, tl.float32)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_K)
    if DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    u0 = tl.program_id(0) * units_per_program
    u1 = tl.minimum(u0 + units_per_program, n_units)
    for u in tl.range(u0, u1, num_stages=NUM_STAGES):
        b = (u // Hkv).to(tl.int64)
        kvh = (u % Hkv).to(tl.int64)
        k = _load_tile(K + b * stride_kb + kvh * stride_kh, 0, Lk, D, stride_kn, stride_kd,
                       BLOCK_K, BLOCK_D)
        v = _load_tile(V + b * stride_vb + kvh * stride_vh, 0, Lk, Dv, stride_vn, stride_vd,
                       BLOCK_K, BLOCK_DV)
        for g in tl.static_range(GROUP):
            h = kvh * GROUP + g
            _fwd_problem(Q + b * stride_qb + h * stride_qh, k, v,
                         Bias + (b % bias_period) * stride_bb + h * stride_bh,
                         Out + b * stride_ob + h * stride_oh,
                         Lse + b * stride_lb + h * stride_lh + offs_q * stride_lm,
                         seed, b * (Hkv * GROUP) + h, offs_q, offs_k, Lq, Lk, stride_qm,
                         stride_qd, stride_bm, stride_bn, stride_om, stride_od, score_scale,
                         drop_thresh, inv_keep, D, Dv, IS_CAUSAL, BIAS_KIND, BIAS_KEYS, DROPOUT,
                         PRECISION, UPCAST_DOT, BLOCK_Q, BLOCK_D, BLOCK_DV)


@triton.jit
def _probs_t(s_t, lse, live, BIAS_KIND: tl.constexpr):
    """P (keys x queries) of a whole score tile from the forward's lse (``_probs``); dead and
    padding rows (not ``live``) get 0. Where a live row's |lse| is too large for fp32 to hold
    log(l) (a float bias of ~finfo.min), the exact max and log2 sum are taken from the tile."""
    if BIAS_KIND == 2:
        worst = tl.max(tl.where(live, tl.abs(lse), 0.0), 0)
        if worst > _LSE_EXACT_LIMIT:
            m = tl.max(s_t, 0)
            row_m = tl.where(live & (m > float("-inf")), m, float("inf"))
            l_t = tl.sum(tl.exp2((s_t - row_m[None, :]) * _LOG2E), 0)
            row_r = tl.where(row_m < float("inf"), tl.log2(l_t), 0.0)
        else:
            row_m = tl.where(live, lse, float("inf"))
            row_r = tl.zeros_like(row_m)
    else:  # log2 units
        row_m = tl.where(live, lse * _LOG2E, float("inf"))
        row_r = row_m  # unused
    return _probs(s_t, row_m[None, :], row_r[None, :], BIAS_KIND)


@triton.jit
def _bwd_problem(k, v, dk, dv, q_base, do_base, o_base, lse_base, bias_base, dq_base, seed, bh,
                 offs_q, offs_k, Lq, Lk, stride_qm, stride_qd, stride_dom, stride_dod,
                 stride_om, stride_od, stride_lm, stride_bm, stride_bn, stride_dqm, stride_dqd,
                 score_scale, sm_scale, drop_thresh, inv_keep,
                 D: tl.constexpr, Dv: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 BIAS_KIND: tl.constexpr, BIAS_KEYS: tl.constexpr, DROPOUT: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One (b, h) problem of the backward on transposed (keys x queries) tiles: stores its dQ,
    adds into the unit's dK/dV accumulators (unscaled dK; dV of the kept weights, unscaled) and
    returns (dS (keys x queries, fp32), dk, dv)."""
    q = _load_tile(q_base, 0, Lq, D, stride_qm, stride_qd, BLOCK_Q, BLOCK_D)
    do = _load_tile(do_base, 0, Lq, Dv, stride_dom, stride_dod, BLOCK_Q, BLOCK_DV)
    delta, live, lse = _row_stats(o_base, stride_om, stride_od, lse_base, stride_lm, do, do, 0,
                                  Lq, Dv, BLOCK_DV, 0, BLOCK_Q)
    qk_t = _dot(k, tl.trans(q), PRECISION, UPCAST_DOT)
    s_t = _scores(qk_t, 0, 0, offs_q[None, :], offs_k[:, None], Lq, Lk, bias_base, stride_bm,
                  stride_bn, 0, score_scale, IS_CAUSAL, BIAS_KIND, True, False, BIAS_KEYS)
    p_t = _probs_t(s_t, lse, live, BIAS_KIND)
    dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST_DOT)
    if DROPOUT:
        keep = _dropout_keep(seed, bh, 0, 0, offs_q, offs_k, drop_thresh, True)
        dv = _dot_acc(tl.where(keep, p_t, 0.0).to(do.dtype), do, dv, PRECISION, UPCAST_DOT)
        dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
    else:
        dv = _dot_acc(p_t.to(do.dtype), do, dv, PRECISION, UPCAST_DOT)
    ds_t = p_t * (dp_t - delta[None, :])
    dsc = ds_t.to(q.dtype)
    dk = _dot_acc(dsc, q, dk, PRECISION, UPCAST_DOT)
    dq = _dot(tl.trans(dsc), k, PRECISION, UPCAST_DOT) * sm_scale
    _store_tile(dq_base, dq, 0, Lq, D, stride_dqm, stride_dqd, BLOCK_Q, BLOCK_D)
    return ds_t, dk, dv


@triton.jit
def _dbias_slot(b, h, period, Hq, PER_HEAD: tl.constexpr):
    """The dbias slot (b % period, h) that problem (b, h) feeds, as one int (heads summed
    without PER_HEAD)."""
    slot = b % period
    if PER_HEAD:
        slot = slot * Hq + h
    return slot


@triton.jit
def _flush_dbias(base, acc, offs_q, offs_k, Lq, Lk, stride_dm, stride_dn,
                 DBIAS: tl.constexpr, DBIAS_ROWS: tl.constexpr):
    """Writes the dS accumulated for one dbias slot (``acc``, keys x queries): the tile, or with
    DBIAS_ROWS False its sum over the queries (one value per key); DBIAS says how
    (store / load-add-store / atomic add, see ``_dbias_plan``)."""
    if DBIAS_ROWS:
        ptrs = _pair_ptrs(base, 0, 0, offs_q[None, :], offs_k[:, None], stride_dm, stride_dn)
        mask = (offs_k < Lk)[:, None] & (offs_q < Lq)[None, :]
    else:
        # (Summed here, once per flush: a sum per problem into a per-key accumulator, with
        # GQA, crashes Triton 3.6's TritonGPUCoalesce pass.)
        acc = tl.sum(acc, 1)
        ptrs = base + offs_k * stride_dn
        mask = offs_k < Lk
    if DBIAS == 1:
        tl.store(ptrs, acc, mask=mask)
    elif DBIAS == 2:
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def attention_small_bwd_kernel(
    Q, K, V, Bias, DO, Out, Lse, DQ, DK, DV, DBias, Seed,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    Hkv, Lq, Lk, bias_period, dbias_period, order_period, order_reps,
    n_units, units_per_program, score_scale, sm_scale, drop_thresh, inv_keep,
    D: tl.constexpr, Dv: tl.constexpr, GROUP: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, BIAS_KEYS: tl.constexpr,
    DROPOUT: tl.constexpr, DBIAS: tl.constexpr, DBIAS_ROWS: tl.constexpr,
    DBIAS_PER_HEAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """dQ, dK, dV (and dbias, DBIAS != 0) of units [pid * units_per_program, ...) in the order
    of ``_unit(u, Hkv, order_period, order_reps)``. dS is summed into the register accumulator
    ``acc`` while consecutive problems feed the same dbias slot (``_dbias_slot``) and flushed
    (``_flush_dbias``) when the next one feeds another or the program ends: after every
    problem where a unit's heads feed different slots (DBIAS_PER_HEAD with GQA), else after a
    unit whose successor feeds another slot. (The flush sites are placed by constexprs only:
    a site whose condition folds to false, as a per-head check does when dbias sums the
    heads, crashes Triton 3.6's TritonGPUCoalesce pass on the query-summed dbias.)"""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale, inv_keep = (tl.cast(score_scale, tl.float32),
                                       tl.cast(sm_scale, tl.float32),
                                       tl.cast(inv_keep, tl.float32))
    offs_q = tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_K)
    if DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    acc = tl.zeros([BLOCK_K, BLOCK_Q], tl.float32)  # dS of the current dbias slot
    u0 = tl.program_id(0) * units_per_program
    u1 = tl.minimum(u0 + units_per_program, n_units)
    for u in tl.range(u0, u1, num_stages=NUM_STAGES):
        b, kvh = _unit(u, Hkv, order_period, order_reps)
        k = _load_tile(K + b * stride_kb + kvh * stride_kh, 0, Lk, D, stride_kn, stride_kd,
                       BLOCK_K, BLOCK_D)
        v = _load_tile(V + b * stride_vb + kvh * stride_vh, 0, Lk, Dv, stride_vn, stride_vd,
                       BLOCK_K, BLOCK_DV)
        dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_K, BLOCK_DV], tl.float32)
        if DBIAS != 0:
            if not (DBIAS_PER_HEAD and GROUP > 1):  # the next unit's slot (-1: none)
                b_next, kvh_next = _unit(u + 1, Hkv, order_period, order_reps)
                slot_after = tl.where(u + 1 < u1, _dbias_slot(b_next, kvh_next * GROUP,
                                                              dbias_period, Hkv * GROUP,
                                                              DBIAS_PER_HEAD), -1)
        for g in tl.static_range(GROUP):
            h = kvh * GROUP + g
            ds_t, dk, dv = _bwd_problem(
                k, v, dk, dv, Q + b * stride_qb + h * stride_qh,
                DO + b * stride_dob + h * stride_doh, Out + b * stride_ob + h * stride_oh,
                Lse + b * stride_lb + h * stride_lh,
                Bias + (b % bias_period) * stride_bb + h * stride_bh,
                DQ + b * stride_dqb + h * stride_dqh, seed, b * (Hkv * GROUP) + h, offs_q,
                offs_k, Lq, Lk, stride_qm, stride_qd, stride_dom, stride_dod, stride_om,
                stride_od, stride_lm, stride_bm, stride_bn, stride_dqm, stride_dqd, score_scale,
                sm_scale, drop_thresh, inv_keep, D, Dv, IS_CAUSAL, BIAS_KIND, BIAS_KEYS,
                DROPOUT, PRECISION, UPCAST_DOT, BLOCK_Q, BLOCK_D, BLOCK_DV)
            if DBIAS != 0:
                acc += ds_t
                # (stride_dbh is 0 where dbias sums the heads)
                db_base = DBias + (b % dbias_period) * stride_dbb + h * stride_dbh
                if DBIAS_PER_HEAD and GROUP > 1:
                    _flush_dbias(db_base, acc, offs_q, offs_k, Lq, Lk, stride_dbm, stride_dbn,
                                 DBIAS, DBIAS_ROWS)
                    acc = tl.zeros_like(acc)
                elif g + 1 == GROUP:
                    if slot_after != _dbias_slot(b, h, dbias_period, Hkv * GROUP,
                                                 DBIAS_PER_HEAD):
                        _flush_dbias(db_base, acc, offs_q, offs_k, Lq, Lk, stride_dbm,
                                     stride_dbn, DBIAS, DBIAS_ROWS)
                        acc = tl.zeros_like(acc)
        _store_tile(DK + b * stride_dkb + kvh * stride_dkh, dk * sm_scale, 0, Lk, D, stride_dkn,
                    stride_dkd, BLOCK_K, BLOCK_D)
        if DROPOUT:
            dv = dv * inv_keep
        _store_tile(DV + b * stride_dvb + kvh * stride_dvh, dv, 0, Lk, Dv, stride_dvn,
                    stride_dvd, BLOCK_K, BLOCK_DV)


# --------------------------------------------------------------------------------------------
# Host side: eligibility, configs, launches
# --------------------------------------------------------------------------------------------


def _tile(n: int) -> int:
    return max(16, next_pow2(n))


def _row_offsets_fit(t: torch.Tensor, rows: int) -> bool:
    """Do a tile's in-tile offsets (``rows`` rows by the whole last dim) fit int32?"""
    stride_r, stride_c = (abs(hint(s)) for s in t.stride()[-2:])
    return stride_r * (rows - 1) + stride_c * (_tile(hint(t.shape[-1])) - 1) < 2**31


def _dbias_slot_units(B: int, Hkv: int, Pd: int, Hd: int) -> int:
    """Units (b, kvh) that feed one dbias slot: B // Pd batches, times every kv head when the
    heads are summed (Hd == 1)."""
    return B // Pd * (Hkv if Hd == 1 else 1)


def stage_bytes(direction: str, Lq: int, Lk: int, D: int, Dv: int, dtype: torch.dtype,
                bias: Optional[torch.Tensor], group: int = 1) -> int:
    """Shared memory one software-pipeline stage of a unit's loads takes: k, v, and for each of
    the unit's ``group`` query heads (GQA: Hq // Hkv, unrolled in the kernel) q (and dO, O in the
    backward) as whole tiles, the bias tile (one row where it is per key), the lse row. On the
    H200 (Triton 3.6) the compiler asked for ``num_stages`` times this within 1 KB a stage:
    forward bf16 L 128 D 128 with a full bias, forward fp32 L 64 D 80, backward fp32 L 100 D 64
    with key padding (262144, 344064, 331776 bytes). ``STAGE_SLACK`` more a stage is assumed.
    The query side is counted once per group member: on the H100 every backward config of
    Llama's 1 x 128 tokens (bf16, D 64, GQA 16/4, 2 stages) failed asking 362496-364544 bytes
    (stop 39's choice table) where one head's count gave 84 KB a stage. That is ~177 KB a stage;
    this counts 228 KB, so a GQA problem whose single stage would just fit may be refused (no
    single-stage GQA backward was measured)."""
    tq, tk, td, tdv = _tile(Lq), _tile(Lk), _tile(D), _tile(Dv)
    per_head = tq * td * dtype.itemsize + 4 * tq
    if direction == "bwd":
        per_head += 2 * tq * tdv * dtype.itemsize  # dO, O
    if bias is not None:
        per_key = bias.dim() == 4 and (hint(bias.shape[2]) == 1 or hint(bias.stride(2)) == 0)
        per_head += (tk if per_key else tq * tk) * bias.element_size()
    return (tk * td + tk * tdv) * dtype.itemsize + max(1, group) * per_head + STAGE_SLACK


def why_not(q, k, v, bias, *, dropout: bool = False, softcap: bool = False,
            replace: bool = False, rope: bool = False, need_dbias: bool = False,
            deterministic: bool = False, direction: str = "fwd") -> Optional[str]:
    """None when this family runs the problem, else a short reason. Reads only shapes, strides
    and dtypes (fake tensors work; SymInt sizes are read by their hints, ``launch.hint``: the
    launchers guard the sizes the tiles depend on). ``deterministic`` with ``need_dbias``: see
    the module docstring (the dbias target is taken to be the bias's non-broadcast dims).
    ``direction`` ("fwd" / "bwd"): whose tiles must fit the GPU's shared memory in one stage."""
    if softcap:
        return "a softcap"
    if replace:
        return "a replace mask"
    if rope:
        return "rope"
    if q.dtype not in _DTYPES:
        return _DTYPE_NAMES.get(q.dtype, str(q.dtype))
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v of different dtypes"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v not 4-D"
    B, Hq, Lq, D = (hint(n) for n in q.shape)
    Hkv, Lk, Dv = hint(k.shape[1]), hint(k.shape[2]), hint(v.shape[3])
    if Lq > MAX_LEN:
        return f"Lq {Lq} > {MAX_LEN}"
    if Lk > MAX_LEN:
        return f"Lk {Lk} > {MAX_LEN}"
    for d in (D, Dv):
        if d > MAX_HEAD_DIM:
            return f"head dim {d} > {MAX_HEAD_DIM}"
        if d < MIN_HEAD_DIM:
            return f"head dim {d} < {MIN_HEAD_DIM}"
    if Hkv == 0 or Hq % Hkv:
        return f"Hq {Hq} not a multiple of Hkv {Hkv}"
    tiles = [("q", q, Lq), ("k", k, Lk), ("v", v, Lk)]
    if bias is not None:
        if bias.dtype != torch.bool and not bias.dtype.is_floating_point:
            return f"a {bias.dtype} bias"
        shape = tuple(hint(n) for n in bias.shape)
        if len(shape) != 4 or shape[1:] != (Hq, Lq, Lk) or shape[0] == 0 or B % shape[0]:
            return f"bias shape {shape} is not (Pb, {Hq}, {Lq}, {Lk}) with B % Pb == 0"
        tiles.append(("bias", bias, Lq))
    for name, t, rows in tiles:
        if not _row_offsets_fit(t, rows):
            return f"{name}'s strides {tuple(t.stride())} overflow int32 tile offsets"
    budget = smem_limit(q.device)  # None on the CPU: no limit
    need = stage_bytes(direction, Lq, Lk, D, Dv, q.dtype, bias, Hq // Hkv)
    if budget is not None and need > budget:
        return f"its {direction} tiles need {need // 1024} KB of shared memory (> {budget // 1024} KB)"
    if need_dbias and deterministic and bias is not None:
        Pd = 1 if hint(bias.stride(0)) == 0 else shape[0]
        Hd = 1 if hint(bias.stride(1)) == 0 else Hq
        n = _dbias_slot_units(B, Hkv, Pd, Hd)
        if n > DETERMINISTIC_MAX_SLOT_UNITS:
            return (f"a deterministic dbias of {n} problems per slot "
                    f"(> {DETERMINISTIC_MAX_SLOT_UNITS}, one program each)")
    return None


def default_config(direction: str, units: int, Lq: int, Lk: int, D: int, Dv: int,
                   dtype: torch.dtype, sms: int = _H100_SMS, stage: int = 0,
                   budget: Optional[int] = None) -> SmallConfig:
    """A first heuristic (one H100 sweep, of Swin's shape only). ``direction`` "fwd" or "bwd";
    ``units`` = B * Hkv. Units per program: enough programs for ``PROGRAMS_PER_SM`` per SM, at
    most ``MAX_UNITS_PER_PROGRAM``. Warps by the live tiles: 8 where the score tile is 128 wide (a
    128 x 128 fp32 tile is 64 KB: 64 registers a thread at 8 warps), with fp32 inputs from 64
    wide (ieee dots hold their fp32 operands in registers: 4 warps spilled at Swin's shape,
    sm_90 compiles), and in the backward, which also holds the fp32 dK/dV accumulators, where a
    head dim is 128; else 4. Pipeline stages: at tiles up to 64 wide 3 in the forward and 1 in
    the backward (Swin stage 1, bf16, H100: 120 vs 130 us forward, 438 vs 458 us backward
    against 2 stages), else 2; fewer where ``stage`` bytes a stage (``stage_bytes``) times the
    stages would pass the shared-memory ``budget`` (None: no limit)."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    per_program = max(1, min(MAX_UNITS_PER_PROGRAM, units // (PROGRAMS_PER_SM * sms)))
    tile = max(_tile(Lq), _tile(Lk))
    wide = tile >= 128 or (dtype == torch.float32 and tile >= 64)
    if direction == "bwd":
        wide = wide or max(_tile(D), _tile(Dv)) >= 128
    stages = 2 if tile >= 128 else 3 if direction == "fwd" else 1
    if budget is not None and stage:
        stages = max(1, min(stages, budget // stage))
    return SmallConfig(per_program, 8 if wide else 4, stages)


class _Common(NamedTuple):
    """What both directions' launches share: sizes, and kernel arguments by name, grouped as the
    kernels declare them."""

    B: Any
    Hkv: int
    Lq: Any
    Lk: Any
    tensors: dict  # Q, K, V, Bias, Seed
    strides: dict  # q's, k's, v's, the bias's
    scalars: dict  # Hkv, Lq, Lk, bias_period, score_scale, drop_thresh, inv_keep
    consts: dict  # the constexprs


def _common(direction: str, q, k, v, bias, is_causal: bool, scale: float, dropout_p: float,
            dropout_seed) -> _Common:
    """The checks and the arguments both directions share. Raises ValueError where ``why_not``
    gives a reason; with SymInt lengths, guards that they fit the tiles picked by their
    hints."""
    reason = why_not(q, k, v, bias, dropout=dropout_p != 0.0, direction=direction)
    if reason is not None:
        raise ValueError(f"attention_small does not run this problem: {reason}")
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    Hq, Hkv, D, Dv = int(Hq), int(Hkv), int(D), int(Dv)  # compile-time constants (guards)
    block_q, block_k = _tile(hint(Lq)), _tile(hint(Lk))
    # The tiles are picked by the lengths' hints; they must hold the lengths themselves. In
    # eager calls this always holds; with dynamic shapes the comparison is a guard (lengths
    # past the tile recompile).
    if not (Lq <= block_q and Lk <= block_k):
        raise AssertionError(f"lengths {Lq}, {Lk} past the tiles {block_q}, {block_k}")
    dummy = placeholder(q)  # for the pointers a launch never reads
    kind, bias_t, sb = bias_args(bias, dummy)
    seed, drop_thresh, inv_keep, dropout = dropout_args(dropout_p, dropout_seed, q, dummy)
    consts = dict(D=D, Dv=Dv, GROUP=Hq // Hkv, IS_CAUSAL=bool(is_causal), BIAS_KIND=kind,
                  BIAS_KEYS=bias_over_keys(kind, sb), DROPOUT=dropout,
                  PRECISION=dot_precision(q), UPCAST_DOT=upcast_dot(q), BLOCK_Q=block_q,
                  BLOCK_K=block_k, BLOCK_D=_tile(D), BLOCK_DV=_tile(Dv))
    score_scale = scale if kind == FLOAT_BIAS else scale * 1.4426950408889634
    bias_period = bias.shape[0] if bias is not None else 1
    return _Common(
        B, Hkv, Lq, Lk,
        tensors=dict(Q=q, K=k, V=v, Bias=bias_t, Seed=seed),
        strides={**strides("q", q), **strides("k", k, KEY_ROWS), **strides("v", v, KEY_ROWS),
                 **strides("b", sb, SCORES)},
        scalars=dict(Hkv=Hkv, Lq=Lq, Lk=Lk, bias_period=bias_period, score_scale=score_scale,
                     drop_thresh=drop_thresh, inv_keep=inv_keep),
        consts=consts)


def _config(direction, config, units, Lq, Lk, D, Dv, q, bias, group: int = 1) -> SmallConfig:
    if config is None:
        Lq, Lk = hint(Lq), hint(Lk)
        return default_config(direction, hint(units), Lq, Lk, D, Dv, q.dtype,
                              sm_count(q.device) or _H100_SMS,
                              stage_bytes(direction, Lq, Lk, D, Dv, q.dtype, bias, group),
                              smem_limit(q.device))
    cfg = SmallConfig(*config)
    if cfg.problems_per_program < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"config {cfg}: every field must be >= 1")
    return cfg


def forward(q, k, v, bias, *, is_causal: bool, scale: float, lse: torch.Tensor,
            out: Optional[torch.Tensor] = None, out_buf: Optional[torch.Tensor] = None,
            dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None,
            config: Optional[SmallConfig] = None) -> None:
    """Attention forward into ``out`` and ``lse`` (module docstring: semantics, numerics).

    Args:
        q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv); fp16/bf16/fp32, any strides.
        bias: None, or (Pb, Hq, Lq, Lk), B % Pb == 0, bool (keep) or float (added); batch b
            reads ``bias[b % Pb]``.
        is_causal: top-left causal mask. scale: the factor of q·kᵀ.
        out: (B, Hq, Lq, Dv) in q's dtype, written through its strides; or
        out_buf: the (B, Lq, Hq, Dv) buffer the op's output views (``out_buf.transpose(1, 2)``),
            the tensor the kernel is given (traced, Inductor then writes the buffer itself, not a
            copy of a view of it; the general and decode launchers do the same).
        lse: (B, Hq, Lq) fp32, written through its strides.
        dropout_p, dropout_seed: dropout of the weights (one int64 seed on q's device).
        config: ``SmallConfig`` (default: ``default_config("fwd", ...)``).
    Raises ValueError for a problem ``why_not`` declines."""
    c = _common("fwd", q, k, v, bias, is_causal, scale, dropout_p, dropout_seed)
    units = c.B * c.Hkv
    if units == 0:
        return
    cfg = _config("fwd", config, units, c.Lq, c.Lk, c.consts["D"], c.consts["Dv"], q, bias, c.consts["GROUP"])
    per_program = cfg.problems_per_program
    if (out is None) == (out_buf is None):
        raise ValueError("give one of out and out_buf")
    written, out_strides = (out, out.stride()) if out is not None else \
        (out_buf, out_buf.transpose(1, 2).stride())
    launch(attention_small_fwd_kernel, (cdiv(units, per_program),),
           **c.tensors, Out=written, Lse=lse,
           **c.strides, **strides("o", out_strides), **strides("l", lse, ROW_STATS),
           **c.scalars, n_units=units, units_per_program=per_program,
           **c.consts, NUM_STAGES=cfg.num_stages,
           writes=("Out", "Lse"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


class _DbiasPlan(NamedTuple):
    mode: int  # the DBIAS constexpr
    rows: bool  # DBIAS_ROWS: one row per query (Lqd == Lq) rather than their sum
    period: int  # dbias batch period Pd (the unit order's period)
    per_head: bool  # DBIAS_PER_HEAD: a slot per query head (Hd == Hq > 1), else heads summed
    per_program: int  # units per program (raised to whole slots in deterministic mode)
    zero: bool  # the launcher zeroes dbias first


def _dbias_plan(B, Hq, Hkv, dbias_shape, per_program: int, deterministic: bool) -> _DbiasPlan:
    """How the backward writes dbias (module docstring, "The bias gradient"). A slot's units
    are consecutive in the unit order; a GQA unit feeds ``Hq // Hkv`` different slots in turn
    when dbias is per head, so their sums are then not complete before the slot's last unit
    (``interleaved``). ``exclusive``: no slot straddles two programs. These decide correctness:
    with dynamic shapes the comparisons are guards (no ``hint``)."""
    Pd, Hd, Lqd = dbias_shape[0], int(dbias_shape[1]), dbias_shape[2]
    slot_units = _dbias_slot_units(B, Hkv, Pd, Hd)
    if deterministic:  # whole slots per program
        per_program = cdiv(per_program, slot_units) * slot_units
    exclusive = bool(per_program % slot_units == 0)
    interleaved = Hd != 1 and Hq // Hkv > 1 and bool(B // Pd > 1)
    if exclusive and not interleaved:
        mode = DBIAS_STORE
    else:
        mode = DBIAS_ADD if deterministic else DBIAS_ATOMIC
    return _DbiasPlan(mode, bool(Lqd != 1), Pd, Hd != 1, per_program, mode != DBIAS_STORE)


def _check_dbias(dbias, B, Hq, Lq, Lk, bias) -> None:
    if bias is None:
        raise ValueError("dbias needs a bias")
    Pb = bias.shape[0]
    if dbias.dtype != torch.float32 or dbias.dim() != 4:
        raise ValueError(f"dbias must be a 4-D fp32 tensor, got {dbias.dtype} {tuple(dbias.shape)}")
    Pd, Hd, Lqd, Lkd = dbias.shape
    if Pd not in (1, Pb) or Hd not in (1, Hq) or Lqd not in (1, Lq) or Lkd != Lk:
        raise ValueError(f"dbias shape {tuple(dbias.shape)} is not (1 or {Pb}, 1 or {Hq}, "
                         f"1 or {Lq}, {Lk})")


def backward(dout, q, k, v, bias, out, lse, *, is_causal: bool, scale: float,
             dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             dbias: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
             dropout_seed: Optional[torch.Tensor] = None,
             config: Optional[SmallConfig] = None) -> None:
    """Attention backward into dq, dk, dv (and dbias); one launch (plus a zero fill of dbias
    where the plan adds into it).

    Args:
        dout: (B, Hq, Lq, Dv), any strides. q, k, v, bias, is_causal, scale, dropout_p,
            dropout_seed: as given to ``forward``.
        out, lse: ``forward``'s outputs.
        dq, dk, dv: shaped and typed as q, k, v; written through their strides.
        dbias: None, or fp32 (Pd, Hd, Lqd, Lk), Pd in {1, Pb}, Hd in {1, Hq}, Lqd in {1, Lq}:
            receives the sum of dS over the (b, h, i) that map to each element (its previous
            contents are ignored).
        config: ``SmallConfig`` (default: ``default_config("bwd", ...)``). In deterministic
            mode (``torch.are_deterministic_algorithms_enabled()``) with a dbias whose slots
            span several units, ``problems_per_program`` is raised to whole slots.
    Raises ValueError for a problem ``why_not`` declines."""
    c = _common("bwd", q, k, v, bias, is_causal, scale, dropout_p, dropout_seed)
    B, Hkv, Lq, Lk = c.B, c.Hkv, c.Lq, c.Lk
    Hq = c.consts["GROUP"] * Hkv
    units = B * Hkv
    if units == 0:
        return
    cfg = _config("bwd", config, units, Lq, Lk, c.consts["D"], c.consts["Dv"], q, bias, c.consts["GROUP"])
    if dbias is None:
        plan = _DbiasPlan(NO_DBIAS, True, B, False, cfg.problems_per_program, False)
        dbias_t, dbias_strides = lse, (0, 0, 0, 0)
    else:
        _check_dbias(dbias, B, Hq, Lq, Lk, bias)
        plan = _dbias_plan(B, Hq, Hkv, dbias.shape, cfg.problems_per_program,
                           torch.are_deterministic_algorithms_enabled())
        if plan.zero:
            dbias.zero_()
        # 0 for the dims dbias sums over (the kernel steps the head stride whatever Hd is)
        dbias_t = dbias
        dbias_strides = tuple(0 if n == 1 else st for n, st in zip(dbias.shape, dbias.stride()))
    launch(attention_small_bwd_kernel, (cdiv(units, plan.per_program),),
           **c.tensors, DO=dout, Out=out, Lse=lse, DQ=dq, DK=dk, DV=dv, DBias=dbias_t,
           **c.strides, **strides("do", dout), **strides("o", out), **strides("l", lse, ROW_STATS),
           **strides("dq", dq), **strides("dk", dk, KEY_ROWS), **strides("dv", dv, KEY_ROWS),
           **strides("db", dbias_strides, SCORES),
           **c.scalars, dbias_period=plan.period, order_period=plan.period,
           order_reps=B // plan.period, n_units=units, units_per_program=plan.per_program,
           sm_scale=scale,
           **c.consts, DBIAS=plan.mode, DBIAS_ROWS=plan.rows, DBIAS_PER_HEAD=plan.per_head,
           NUM_STAGES=cfg.num_stages,
           writes=("DQ", "DK", "DV") + (("DBias",) if dbias is not None else ()),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
