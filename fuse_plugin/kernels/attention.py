"""Flash-attention forward and backward kernels (Triton, FA2-style).

Shapes and layouts
------------------
* ``q``: (B, Hq, Lq, D), ``k``: (B, Hkv, Lk, D), ``v``: (B, Hkv, Lk, Dv), with ``Hq % Hkv == 0``.
  GQA/MQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``; K/V are never repeated.
  Any strides are accepted (e.g. ``x.view(B, L, H, D).transpose(1, 2)``); a tensor is copied
  only when its last-dim stride is not 1.
* ``bias``: None, or a (B, Hq, Lq, Lk) tensor (usually an ``.expand`` view with 0 strides, which
  are read as they are). A bool bias keeps True and masks False; a float bias is added in fp32
  after scaling: ``s = (q @ k^T) * scale + bias``.
* ``is_causal``: top-left aligned (as SDPA): key j is visible to query i iff ``j <= i``.
* Outputs: ``out`` (B, Hq, Lq, Dv) contiguous in q's dtype, ``lse`` (B, Hq, Lq) fp32 contiguous
  (natural-log logsumexp of the scaled, biased, masked scores of each row).
* Backward: ``dq``/``dk``/``dv`` contiguous, shaped/typed as q/k/v; optional ``dbias`` is the
  fp32 (B, Hq, Lq, Lk) gradient dS of the scores (the caller reduces it to the bias's shape).

Numerics
--------
Scores are accumulated in fp32 (fp32 inputs use tf32 or ieee dots like an eager matmul would).
The softmax is online (running max ``m`` and sum ``l``) with ``exp2``. Without a float bias,
log2(e) is folded into the score scale so each score costs one multiply. With a float bias the
scores stay in natural units and are converted only after subtracting the row max: a bias of
``finfo.min`` times log2(e) would overflow to -inf and turn an eager "uniform" row into a masked
one.

A row whose every score is -inf yields what eager softmax yields in the forward pass: NaN
output and ``lse = -inf``. In the backward pass such a row contributes nothing (its dq and dS
rows are 0 and dk/dv are not poisoned), where eager autograd would spread NaN to all of dk/dv.

The backward recomputes ``p = exp(s - lse)``. When |lse| is huge (e.g. a whole row biased with
``finfo.min``), fp32 ``lse`` has lost ``log(l)`` entirely (-3.4e38 + 3 == -3.4e38) and ``p``
would come out as 1 instead of 1/Lk. The preprocess kernel therefore recomputes the exact
(row max, log2 row sum) pair for blocks whose |lse| exceeds ``_LSE_EXACT_LIMIT``; in normal
attention that branch never runs.

Kernels: ``attention_fwd_kernel``, ``attention_bwd_preprocess_kernel`` (delta = rowsum(dO * O)
and the per-row softmax statistics), ``attention_bwd_dkdv_kernel`` (one key block, looping over
all query blocks of every query head of its GQA group: deterministic, no atomics) and
``attention_bwd_dq_kernel`` (one query block, looping over key blocks; also writes dS).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

__all__ = ["AttentionConfig", "attention_forward", "attention_backward"]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Above this |lse| an fp32 lse is too coarse (ulp(1024) ~ 1.2e-4) to recompute p from it.
_LSE_EXACT_LIMIT = tl.constexpr(1024.0)

# Values of the BIAS_KIND constexpr.
_NO_BIAS, _BOOL_BIAS, _FLOAT_BIAS = 0, 1, 2


class AttentionConfig(NamedTuple):
    """Launch parameters of one kernel family (pass as ``config=`` to override the defaults)."""

    block_m: int  # query rows per tile (power of 2, >= 16)
    block_n: int  # key rows per tile (power of 2, >= 16)
    num_warps: int
    num_stages: int


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """fp32-accumulating dot. UPCAST: Triton's CPU interpreter multiplies bf16 tensors as their raw
    uint16 bits, so on the interpreter bf16 operands are widened first (bf16 products are exact
    in fp32, so this matches the GPU up to summation order)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PRECISION)
    return r


@triton.jit
def _tile_ptrs_mask(base, row0, n_rows, stride_r, stride_c, N_COLS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pointers and in-range mask of rows [row0, row0 + BLOCK_R) x cols [0, BLOCK_C) of an
    (n_rows, N_COLS) matrix. The row offset is taken in int64 (row0 * stride may pass 2**31);
    the in-tile offsets are small enough for int32. The column mask is dropped at compile time
    when the head dim is a power of 2 (N_COLS == BLOCK_C)."""
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    origin = tl.cast(row0, tl.int64) * stride_r
    ptrs = base + origin + (r[:, None] * stride_r + c[None, :] * stride_c)
    if N_COLS == BLOCK_C:
        mask = (row0 + r)[:, None] < n_rows
    else:
        mask = ((row0 + r)[:, None] < n_rows) & (c[None, :] < N_COLS)
    return ptrs, mask


@triton.jit
def _load_tile(base, row0, n_rows, N_COLS: tl.constexpr, stride_r, stride_c,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile of an (n_rows, N_COLS) matrix (see ``_tile_ptrs_mask``); out of range reads as 0."""
    ptrs, mask = _tile_ptrs_mask(base, row0, n_rows, stride_r, stride_c, N_COLS, BLOCK_R, BLOCK_C)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_tile(base, value, row0, n_rows, N_COLS: tl.constexpr, stride_r, stride_c,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Inverse of ``_load_tile``: stores the in-range part of ``value``."""
    ptrs, mask = _tile_ptrs_mask(base, row0, n_rows, stride_r, stride_c, N_COLS, BLOCK_R, BLOCK_C)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _pair_ptrs(base, row0, col0, r, c, stride_r, stride_c):
    """Pointers of a (query, key) tile: the tile origin in int64 (row0 * stride_r can pass
    2**31 for a dense (Lq, Lk) matrix), the in-tile offsets ``r``/``c`` (broadcastable aranges)
    in int32, which keeps per-element address math cheap."""
    origin = tl.cast(row0, tl.int64) * stride_r + tl.cast(col0, tl.int64) * stride_c
    return base + origin + (r * stride_r + c * stride_c)


@triton.jit
def _scores(qk, row0, col0, r, c, Lq, Lk, bias_base, stride_bm, stride_bn, score_scale,
            IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr):
    """Scale, bias and mask a tile of raw dot products ``qk``.

    Query index = row0 + r, key index = col0 + c, with ``r``/``c`` aranges shaped to broadcast
    against ``qk`` ((M, 1)/(1, N), or (1, M)/(N, 1) for the transposed tiles of the dK/dV
    kernel). Units: natural log with a float bias (score_scale = scale), log2 otherwise
    (score_scale = scale * log2(e)). Masked entries (padding keys, causal, bool False) are -inf.
    """
    rows = row0 + r
    cols = col0 + c
    keep = cols < Lk
    if IS_CAUSAL:
        keep = keep & (cols <= rows)
    s = qk * score_scale
    if BIAS_KIND != 0:
        b_ptrs = _pair_ptrs(bias_base, row0, col0, r, c, stride_bm, stride_bn)
        in_range = (rows < Lq) & (cols < Lk)
        if BIAS_KIND == 2:
            s += tl.load(b_ptrs, mask=in_range, other=0.0).to(tl.float32)
        else:
            keep = keep & (tl.load(b_ptrs, mask=in_range, other=0) != 0)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _exp(x, NATURAL: tl.constexpr):
    """exp of a score difference in the kernel's units (see ``_scores``)."""
    if NATURAL:
        r = tl.exp2(x * _LOG2E)
    else:
        r = tl.exp2(x)
    return r


@triton.jit
def _probs(s, row_m, row_r, BIAS_KIND: tl.constexpr):
    """Backward recomputation of the softmax from the preprocess statistics; ``row_m``/``row_r``
    are already broadcast against ``s``. Dead rows have row_m = +inf, hence p = 0."""
    if BIAS_KIND == 2:
        p = tl.exp2((s - row_m) * _LOG2E - row_r)
    else:
        p = tl.exp2(s - row_m)
    return p


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def attention_fwd_kernel(
    Q, K, V, Bias, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    Hq, kv_group, Lq, Lk, D: tl.constexpr, Dv: tl.constexpr, score_scale,
    IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # 1-D grid (a 2-D one would cap B*Hq at 65535 on the y axis). Query blocks of one head are
    # adjacent so they share K/V in L2; the last (causally heaviest) block is launched first.
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    pid_bh = pid // n_m_blocks
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    kvh = h // kv_group

    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    bias_base = Bias + b * stride_bb + h * stride_bh

    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = start_m + offs_m

    q = _load_tile(q_base, start_m, Lq, D, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Causal: key blocks starting after this block's last row are fully masked; skip them.
    if IS_CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M)
    else:
        hi = Lk
    for start_n in range(0, hi, BLOCK_N):
        k = _load_tile(k_base, start_n, Lk, D, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
        v = _load_tile(v_base, start_n, Lk, Dv, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
        qk = _dot(q, tl.trans(k), PRECISION, UPCAST_DOT)
        s = _scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :], Lq, Lk, bias_base,
                    stride_bm, stride_bn, score_scale, IS_CAUSAL, BIAS_KIND)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen only -inf, use 0 as the reference so that (-inf) - (-inf) never
        # produces NaN: p and alpha are then exactly 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m_i - m_ref, BIAS_KIND == 2)
        p = _exp(s - m_ref[:, None], BIAS_KIND == 2)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the input dtype for the P.V product (as flash-attention does).
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST_DOT)
        m_i = m_new

    # A fully masked row has l_i == 0: 0/0 = NaN like eager softmax, and lse = -inf.
    out = acc / l_i[:, None]
    if BIAS_KIND == 2:
        lse = m_i + tl.log2(l_i) * _LN2
    else:
        lse = (m_i + tl.log2(l_i)) * _LN2
    _store_tile(Out + b * stride_ob + h * stride_oh, out, start_m, Lq, Dv, stride_om, stride_od,
                BLOCK_M, BLOCK_DV)
    tl.store(Lse + b * stride_lb + h * stride_lh + rows.to(tl.int64) * stride_lm, lse,
             mask=rows < Lq)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def attention_bwd_preprocess_kernel(
    Out, DO, Lse, Delta, RowM, RowR, Q, K, Bias,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    Hq, kv_group, Lq, Lk, D: tl.constexpr, Dv: tl.constexpr, score_scale,
    IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Per row: Delta = rowsum(dO * O); RowM (and RowR with a float bias) = the statistics the
    other backward kernels turn scores into probabilities with. Delta/RowM/RowR are contiguous
    (B * Hq, Lq)."""
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % n_m_blocks
    pid_bh = pid // n_m_blocks
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    row_ok = rows < Lq

    o = _load_tile(Out + b * stride_ob + h * stride_oh, start_m, Lq, Dv, stride_om, stride_od,
                   BLOCK_M, BLOCK_DV)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, start_m, Lq, Dv, stride_dom, stride_dod,
                    BLOCK_M, BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + rows.to(tl.int64) * stride_lm,
                  mask=row_ok, other=0.0)
    live = lse != float("-inf")
    # Dead (fully masked) rows have O = NaN; their p is 0 in the backward, so only a finite
    # delta is needed to keep 0 * (dp - delta) == 0.
    delta = tl.where(live, delta, 0.0)

    stat_off = pid_bh.to(tl.int64) * Lq + rows
    tl.store(Delta + stat_off, delta, mask=row_ok)
    if BIAS_KIND == 2:
        # Natural units: p = exp2((s - RowM) * log2(e) - RowR), RowR = log2(row sum).
        row_m = tl.where(live, lse, float("inf"))
        row_r = tl.zeros([BLOCK_M], tl.float32)
        worst = tl.max(tl.where(row_ok & live, tl.abs(lse), 0.0), 0)
        if worst > _LSE_EXACT_LIMIT:
            # lse lost precision: recompute the exact max and sum of this block's rows
            # (the forward pass's loop without V).
            kvh = h // kv_group
            k_base = K + b * stride_kb + kvh * stride_kh
            bias_base = Bias + b * stride_bb + h * stride_bh
            q = _load_tile(Q + b * stride_qb + h * stride_qh, start_m, Lq, D, stride_qm, stride_qd,
                           BLOCK_M, BLOCK_D)
            offs_n = tl.arange(0, BLOCK_N)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            if IS_CAUSAL:
                hi = tl.minimum(Lk, start_m + BLOCK_M)
            else:
                hi = Lk
            for start_n in range(0, hi, BLOCK_N):
                k = _load_tile(k_base, start_n, Lk, D, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
                qk = _dot(q, tl.trans(k), PRECISION, UPCAST_DOT)
                s = _scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :], Lq, Lk,
                            bias_base, stride_bm, stride_bn, score_scale, IS_CAUSAL, BIAS_KIND)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * _exp(m_i - m_ref, True) + tl.sum(_exp(s - m_ref[:, None], True), 1)
                m_i = m_new
            row_m = tl.where(live, m_i, float("inf"))
            row_r = tl.where(live, tl.log2(l_i), 0.0)
        tl.store(RowR + stat_off, row_r, mask=row_ok)
    else:
        # log2 units: p = exp2(s - RowM).
        row_m = tl.where(live, lse * _LOG2E, float("inf"))
    tl.store(RowM + stat_off, row_m, mask=row_ok)


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, Bias, DO, DK, DV, Delta, RowM, RowR,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Hq, Hkv, kv_group, Lq, Lk, D: tl.constexpr, Dv: tl.constexpr, score_scale, sm_scale,
    IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK, dV of one key block of one KV head. Works on transposed (keys x queries) tiles so that
    both accumulations are plain dots: dV += P^T dO, dK += dS^T Q * scale."""
    n_n_blocks = tl.cdiv(Lk, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % n_n_blocks
    pid_bh = pid // n_n_blocks
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = (pid_bh % Hkv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    k = _load_tile(K + b * stride_kb + kvh * stride_kh, start_n, Lk, D, stride_kn, stride_kd,
                   BLOCK_N, BLOCK_D)
    v = _load_tile(V + b * stride_vb + kvh * stride_vh, start_n, Lk, Dv, stride_vn, stride_vd,
                   BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # Causal: query blocks ending before this key block's first key see none of it.
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    # Every query head of the GQA group accumulates into the same registers: no atomics.
    for g in range(0, kv_group):
        h = kvh * kv_group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        bias_base = Bias + b * stride_bb + h * stride_bh
        stat_base = (b * Hq + h) * Lq
        for start_m in range(lo, Lq, BLOCK_M):
            q = _load_tile(q_base, start_m, Lq, D, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
            do = _load_tile(do_base, start_m, Lq, Dv, stride_dom, stride_dod, BLOCK_M, BLOCK_DV)
            rows = start_m + offs_m
            row_ok = rows < Lq
            # Padding rows get RowM = +inf, hence p = 0 and no contribution.
            row_m = tl.load(RowM + stat_base + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(Delta + stat_base + rows, mask=row_ok, other=0.0)
            if BIAS_KIND == 2:
                row_r = tl.load(RowR + stat_base + rows, mask=row_ok, other=0.0)
            else:
                row_r = row_m  # unused
            qk_t = _dot(k, tl.trans(q), PRECISION, UPCAST_DOT)
            s_t = _scores(qk_t, start_m, start_n, offs_m[None, :], offs_n[:, None], Lq, Lk,
                          bias_base, stride_bm, stride_bn, score_scale, IS_CAUSAL, BIAS_KIND)
            p_t = _probs(s_t, row_m[None, :], row_r[None, :], BIAS_KIND)
            dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST_DOT)
            dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST_DOT)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, PRECISION, UPCAST_DOT)

    dk = dk * sm_scale
    _store_tile(DK + b * stride_dkb + kvh * stride_dkh, dk, start_n, Lk, D, stride_dkn, stride_dkd,
                BLOCK_N, BLOCK_D)
    _store_tile(DV + b * stride_dvb + kvh * stride_dvh, dv, start_n, Lk, Dv, stride_dvn,
                stride_dvd, BLOCK_N, BLOCK_DV)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, Bias, DO, DQ, DS, Delta, RowM, RowR,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dsb, stride_dsh, stride_dsm, stride_dsn,
    Hq, kv_group, Lq, Lk, D: tl.constexpr, Dv: tl.constexpr, score_scale, sm_scale,
    IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, NEED_DS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of one query block (dQ += dS K * scale over the visible key blocks); with NEED_DS also
    writes every element of that block's rows of dS (zeros for causally skipped key blocks)."""
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    pid_bh = pid // n_m_blocks
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    kvh = h // kv_group
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = start_m + offs_m
    row_ok = rows < Lq

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    bias_base = Bias + b * stride_bb + h * stride_bh
    ds_base = DS + b * stride_dsb + h * stride_dsh
    q = _load_tile(Q + b * stride_qb + h * stride_qh, start_m, Lq, D, stride_qm, stride_qd,
                   BLOCK_M, BLOCK_D)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, start_m, Lq, Dv, stride_dom, stride_dod,
                    BLOCK_M, BLOCK_DV)
    stat_off = pid_bh.to(tl.int64) * Lq + rows
    row_m = tl.load(RowM + stat_off, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + stat_off, mask=row_ok, other=0.0)
    if BIAS_KIND == 2:
        row_r = tl.load(RowR + stat_off, mask=row_ok, other=0.0)
    else:
        row_r = row_m  # unused
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if IS_CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M)
    else:
        hi = Lk
    for start_n in range(0, hi, BLOCK_N):
        k = _load_tile(k_base, start_n, Lk, D, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
        v = _load_tile(v_base, start_n, Lk, Dv, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
        qk = _dot(q, tl.trans(k), PRECISION, UPCAST_DOT)
        s = _scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :], Lq, Lk, bias_base,
                    stride_bm, stride_bn, score_scale, IS_CAUSAL, BIAS_KIND)
        p = _probs(s, row_m[:, None], row_r[:, None], BIAS_KIND)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        if NEED_DS:
            ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[:, None], offs_n[None, :],
                                 stride_dsm, stride_dsn)
            tl.store(ds_ptrs, ds, mask=row_ok[:, None] & (start_n + offs_n < Lk)[None, :])
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST_DOT)

    if NEED_DS:
        # Key blocks the causal loop skipped are entirely masked: their dS is 0.
        zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start_n in range(tl.cdiv(hi, BLOCK_N) * BLOCK_N, Lk, BLOCK_N):
            ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[:, None], offs_n[None, :],
                                 stride_dsm, stride_dsn)
            tl.store(ds_ptrs, zero, mask=row_ok[:, None] & (start_n + offs_n < Lk)[None, :])

    dq = dq * sm_scale
    _store_tile(DQ + b * stride_dqb + h * stride_dqh, dq, start_m, Lq, D, stride_dqm, stride_dqd,
                BLOCK_M, BLOCK_D)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _empty(shape, dtype, device) -> torch.Tensor:
    """Allocation of every kernel output (one hook, so tests can poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _forward_config(D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """Default forward tiles, picked from sm_90 compiles (Triton 3.9, PTX through ptxas -v) as
    the largest tiles without register spills, all well inside the 227 KB of shared memory.
    fp32 has its own rows: with ieee precision its dots run on FMA units with register-held
    operands and need smaller tiles."""
    d = max(_block_d(D), _block_d(Dv))
    if dtype == torch.float32:
        if d <= 64:
            return AttentionConfig(64, 32, 8, 2)
        if d <= 128:
            return AttentionConfig(32, 64, 8, 2)
        return AttentionConfig(32, 32, 8, 1)
    if d <= 64:
        return AttentionConfig(128, 64, 8, 3)
    if d <= 128:
        return AttentionConfig(128, 64, 8, 2)
    return AttentionConfig(64, 32, 8, 2)


def _backward_config(D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """Default tiles of the three backward kernels (chosen as in ``_forward_config``). The dK/dV
    kernel keeps K, V and two fp32 BLOCK_N x D accumulators resident, so large head dims get
    small tiles."""
    d = max(_block_d(D), _block_d(Dv))
    if dtype == torch.float32:
        if d <= 64:
            return AttentionConfig(32, 32, 8, 1)
        if d <= 128:
            return AttentionConfig(16, 32, 4, 1)
        return AttentionConfig(16, 32, 8, 1)
    if d <= 64:
        return AttentionConfig(64, 64, 8, 2)
    if d <= 128:
        return AttentionConfig(32, 64, 8, 2)
    return AttentionConfig(32, 32, 8, 2)


def _dot_precision(t: torch.Tensor) -> str:
    # fp32 inputs follow the eager matmul setting; the interpreter only knows "ieee".
    if t.dtype == torch.float32 and t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _upcast_dot(t: torch.Tensor) -> bool:
    # CPU tensors run in Triton's interpreter, whose tl.dot mishandles bf16 (see _dot).
    return t.dtype == torch.bfloat16 and not t.is_cuda


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_inputs(q, k, v, bias) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (B, H, L, D)")
    if not (q.dtype == k.dtype == v.dtype) or \
            q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B or Dk != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if not (16 <= D <= 256 and 16 <= v.shape[3] <= 256):
        raise ValueError(f"head dims must be in [16, 256], got D={D}, Dv={v.shape[3]}")
    if Lq < 1 or Lk < 1:
        raise ValueError("sequence lengths must be >= 1")
    if bias is not None and tuple(bias.shape) != (B, Hq, Lq, Lk):
        raise ValueError(f"bias must be broadcast to {(B, Hq, Lq, Lk)}, got {tuple(bias.shape)}")


def _check_config(cfg: AttentionConfig) -> None:
    for blk in (cfg.block_m, cfg.block_n):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"block sizes must be powers of 2 >= 16 (tl.dot, tl.arange): {cfg}")


def _check_tile_offsets(tiles) -> None:
    """In-tile offsets are int32 (tile origins are int64; see ``_tile_ptrs_mask``/``_pair_ptrs``):
    the largest offset inside one tile must fit. Only absurd layouts (a row stride above
    ~2**31 / BLOCK) can fail this. ``tiles``: (name, row stride, col stride, rows, cols)."""
    for name, stride_r, stride_c, rows, cols in tiles:
        if abs(stride_r) * (rows - 1) + abs(stride_c) * (cols - 1) > 2**31 - 1:
            raise ValueError(
                f"{name}: strides ({stride_r}, {stride_c}) overflow int32 tile offsets")


def _bias_args(bias, dummy):
    """(kind, tensor, strides); a bool bias is read through a same-strided uint8 view."""
    if bias is None:
        return _NO_BIAS, dummy, (0, 0, 0, 0)
    if bias.dtype == torch.bool:
        return _BOOL_BIAS, bias.view(torch.uint8), bias.stride()
    if not bias.dtype.is_floating_point:
        raise ValueError(f"bias must be bool or floating point, got {bias.dtype}")
    return _FLOAT_BIAS, bias, bias.stride()


def _score_scale(kind: int, scale: float) -> float:
    # Natural units with a float bias (see module docstring), log2 units otherwise.
    return scale if kind == _FLOAT_BIAS else scale * 1.4426950408889634


def attention_forward(q, k, v, bias, *, is_causal: bool, scale: float,
                      config: Optional[AttentionConfig] = None):
    """Returns ``(out, lse)``; see the module docstring for shapes and semantics."""
    _check_inputs(q, k, v, bias)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = _empty((B, Hq, Lq, Dv), q.dtype, q.device)
    lse = _empty((B, Hq, Lq), torch.float32, q.device)
    if B * Hq == 0:
        return out, lse
    kind, bias_t, sb = _bias_args(bias, q)
    cfg = config or _forward_config(D, Dv, q.dtype)
    _check_config(cfg)
    bm, bn, bd, bdv = cfg.block_m, cfg.block_n, _block_d(D), _block_d(Dv)
    _check_tile_offsets([("q", *q.stride()[2:], bm, bd), ("k", *k.stride()[2:], bn, bd),
                         ("v", *v.stride()[2:], bn, bdv), ("out", *out.stride()[2:], bm, bdv),
                         ("bias", *sb[2:], bm, bn)])
    grid = (triton.cdiv(Lq, cfg.block_m) * B * Hq,)
    attention_fwd_kernel[grid](
        q, k, v, bias_t, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *sb, *out.stride(), *lse.stride(),
        Hq, Hq // Hkv, Lq, Lk, D, Dv, _score_scale(kind, scale),
        IS_CAUSAL=bool(is_causal), BIAS_KIND=kind,
        PRECISION=_dot_precision(q), UPCAST_DOT=_upcast_dot(q),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bdv,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def attention_backward(dout, q, k, v, bias, out, lse, *, is_causal: bool, scale: float,
                       need_dbias: bool, config: Optional[AttentionConfig] = None):
    """Returns ``(dq, dk, dv, dbias_or_None)``; see the module docstring."""
    _check_inputs(q, k, v, bias)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    dout = dout.contiguous()
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if tuple(dout.shape) != (B, Hq, Lq, Dv) or tuple(out.shape) != (B, Hq, Lq, Dv) \
            or tuple(lse.shape) != (B, Hq, Lq):
        raise ValueError("dout/out/lse shapes do not match q and v")
    dev = q.device
    dq = _empty((B, Hq, Lq, D), q.dtype, dev)
    dk = _empty((B, Hkv, Lk, D), k.dtype, dev)
    dv = _empty((B, Hkv, Lk, Dv), v.dtype, dev)
    dbias = _empty((B, Hq, Lq, Lk), torch.float32, dev) if need_dbias else None
    if B * Hq == 0:
        return dq, dk, dv, dbias

    kind, bias_t, sb = _bias_args(bias, q)
    cfg = config or _backward_config(D, Dv, q.dtype)
    _check_config(cfg)
    bm, bn, bd, bdv = cfg.block_m, cfg.block_n, _block_d(D), _block_d(Dv)
    # out/dout/dq are read with BLOCK_M rows, dk/dv with BLOCK_N rows (dbias is contiguous).
    _check_tile_offsets([("q", *q.stride()[2:], bm, bd), ("k", *k.stride()[2:], bn, bd),
                         ("v", *v.stride()[2:], bn, bdv), ("out", *out.stride()[2:], bm, bdv),
                         ("bias", *sb[2:], bm, bn), ("dbias", Lk, 1, bm, bn)])
    score_scale = _score_scale(kind, scale)
    consts = dict(IS_CAUSAL=bool(is_causal), BIAS_KIND=kind, PRECISION=_dot_precision(q),
                  UPCAST_DOT=_upcast_dot(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bdv,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    delta = _empty((B, Hq, Lq), torch.float32, dev)
    row_m = _empty((B, Hq, Lq), torch.float32, dev)
    row_r = _empty((B, Hq, Lq), torch.float32, dev) if kind == _FLOAT_BIAS else row_m
    grid_m = (triton.cdiv(Lq, cfg.block_m) * B * Hq,)
    attention_bwd_preprocess_kernel[grid_m](
        out, dout, lse, delta, row_m, row_r, q, k, bias_t,
        *out.stride(), *dout.stride(), *lse.stride(), *q.stride(), *k.stride(), *sb,
        Hq, Hq // Hkv, Lq, Lk, D, Dv, score_scale, **consts,
    )
    attention_bwd_dkdv_kernel[(triton.cdiv(Lk, cfg.block_n) * B * Hkv,)](
        q, k, v, bias_t, dout, dk, dv, delta, row_m, row_r,
        *q.stride(), *k.stride(), *v.stride(), *sb, *dout.stride(), *dk.stride(), *dv.stride(),
        Hq, Hkv, Hq // Hkv, Lq, Lk, D, Dv, score_scale, scale, **consts,
    )
    ds_t = dbias if need_dbias else q
    attention_bwd_dq_kernel[grid_m](
        q, k, v, bias_t, dout, dq, ds_t, delta, row_m, row_r,
        *q.stride(), *k.stride(), *v.stride(), *sb, *dout.stride(), *dq.stride(),
        *(dbias.stride() if need_dbias else (0, 0, 0, 0)),
        Hq, Hq // Hkv, Lq, Lk, D, Dv, score_scale, scale, NEED_DS=bool(need_dbias), **consts,
    )
    return dq, dk, dv, dbias
