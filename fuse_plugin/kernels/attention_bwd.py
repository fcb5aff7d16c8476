"""Flash-attention backward kernels: the preprocess (Delta, softmax statistics), the default
one-kernel path with atomic dQ and its cast kernels, and the deterministic two-kernel path; see
kernels/attention.py for shapes, layouts, numerics and the launcher."""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import (
    _LOG2E,
    _LSE_EXACT_LIMIT,
    _atomic_add_dq,
    _band_end,
    _band_lo,
    _capped_scores,
    _doc_query_blocks,
    _doc_span,
    _dot,
    _dot_acc,
    _dot_nt,
    _dropout_keep,
    _exp,
    _key_block_program,
    _live_key_blocks,
    _live_query_end,
    _load_d,
    _load_qk,
    _load_tile,
    _pair_ptrs,
    _probs,
    _query_block_program,
    _query_blocks,
    _store_d,
    _store_grad,
    _store_tile,
    _zero_parts,
)


# --------------------------------------------------------------------------------------------
# Backward: preprocess (both paths)
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_stats(o_base, stride_om, stride_od, lse_base, stride_lm, do0, do1, start_m, Lq,
               Dv: tl.constexpr, DV0: tl.constexpr, DV1: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(delta, live, lse)`` of the query rows at ``start_m``: Delta = rowsum(dO * O) as the
    preprocess kernel stores it, live = the lse is finite, and the lse itself (-inf for padding
    rows). Dead (fully masked) rows have O = NaN; their p is 0 in the backward, so only a finite
    delta (0) is needed to keep 0 * (dp - delta) == 0. dO comes as the caller's head-dim parts."""
    rows = start_m + tl.arange(0, BLOCK_M)
    o0, o1 = _load_d(o_base, start_m, Lq, stride_om, stride_od, Dv, DV0, DV1, BLOCK_M)
    delta = tl.sum(o0.to(tl.float32) * do0.to(tl.float32), 1)
    if DV1 != 0:
        delta += tl.sum(o1.to(tl.float32) * do1.to(tl.float32), 1)
    lse = tl.load(lse_base + rows.to(tl.int64) * stride_lm, mask=rows < Lq, other=float("-inf"))
    live = lse != float("-inf")
    delta = tl.where(live, delta, 0.0)
    return delta, live, lse


@triton.jit
def attention_bwd_preprocess_kernel(
    Out, DO, Lse, Delta, RowM, RowR, Q, K, Bias, Rep, DQA, Cos, Sin, Docs,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm, stride_rn,
    stride_cqb, stride_cqh, stride_cqm, stride_cqd,
    stride_ckb, stride_ckh, stride_ckn, stride_ckd,
    Hq, kv_group, Lq, Lk, window, stride_docb, D: tl.constexpr, Dv: tl.constexpr, score_scale, cap,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BIAS_KIND: tl.constexpr, ZERO_DQ: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_REPLACE: tl.constexpr, BIAS_KEYS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
):
    """Per row: Delta = rowsum(dO * O); RowM (and RowR with a float bias) = the statistics the
    other backward kernels turn scores into probabilities with. Delta/RowM/RowR are contiguous
    (B * Hq, Lq). ZERO_DQ: also zero these rows of the fp32 dQ accumulator DQA (contiguous
    (B * Hq, Lq, D)) that the atomic backward adds into."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, cap = tl.cast(score_scale, tl.float32), tl.cast(cap, tl.float32)
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

    if ZERO_DQ:
        _store_tile(DQA + pid_bh.to(tl.int64) * Lq * D, tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                    start_m, Lq, D, D, 1, BLOCK_M, BLOCK_D)
    do0, do1 = _load_d(DO + b * stride_dob + h * stride_doh, start_m, Lq, stride_dom,
                       stride_dod, Dv, BLOCK_DV, 0, BLOCK_M)
    delta, live, lse = _row_stats(Out + b * stride_ob + h * stride_oh, stride_om, stride_od,
                                  Lse + b * stride_lb + h * stride_lh, stride_lm, do0, do1,
                                  start_m, Lq, Dv, BLOCK_DV, 0, BLOCK_M)

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
            rep_base = Rep + b * stride_rb + h * stride_rh
            ck_base = Cos + b * stride_ckb + kvh * stride_ckh
            sk_base = Sin + b * stride_ckb + kvh * stride_ckh
            doc_base = Docs + b * stride_docb
            q0, q1, q2 = _load_qk(Q + b * stride_qb + h * stride_qh, start_m, Lq, stride_qm,
                                  stride_qd, Cos + b * stride_cqb + h * stride_cqh,
                                  Sin + b * stride_cqb + h * stride_cqh, stride_cqm, stride_cqd,
                                  D, D0, D1, D2, ROT, INTERLEAVED, HALF_TABLE, BLOCK_M)
            offs_n = tl.arange(0, BLOCK_N)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            if IS_CAUSAL:
                hi = tl.minimum(Lk, start_m + BLOCK_M)
            else:
                hi = Lk
            for start_n in range(0, hi, BLOCK_N):
                k0, k1, k2 = _load_qk(k_base, start_n, Lk, stride_kn, stride_kd, ck_base, sk_base,
                                      stride_ckn, stride_ckd, D, D0, D1, D2, ROT, INTERLEAVED,
                                      HALF_TABLE, BLOCK_N)
                qk = _dot_nt(q0, q1, q2, k0, k1, k2, D1, D2, PRECISION, UPCAST_DOT)
                s, _, _ = _capped_scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :],
                                         Lq, Lk, bias_base, stride_bm, stride_bn, rep_base,
                                         stride_rm, stride_rn, score_scale, cap, IS_CAUSAL,
                                         BIAS_KIND, True, SOFTCAP, HAS_REPLACE, BIAS_KEYS, WINDOW,
                                         window, doc_base)
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


# --------------------------------------------------------------------------------------------
# Backward: default path (one kernel, atomic dQ)
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_step(k0, k1, k2, v0, v1, dk0, dk1, dk2, dv0, dv1, q_base, do_base, dq_base, bias_base,
              ds_base, cq_base, sq_base, Delta, RowM, RowR, stat_base, start_n, start_m, offs_n,
              offs_m, Lq, Lk, stride_qm, stride_qd, stride_dom, stride_dod, stride_bm, stride_bn,
              stride_dsm, stride_dsn, stride_cqm, stride_cqd, score_scale, cap,
              seed, bh, drop_thresh, inv_keep, rep_base, stride_rm, stride_rn,
              o_base, stride_om, stride_od, lse_base, stride_lm, dq_out_base, stride_dqm,
              stride_dqd, sm_scale, ONE_KEY_BLOCK: tl.constexpr,
              DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REPLACE: tl.constexpr,
              BIAS_KEYS: tl.constexpr,
              D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
              Dv: tl.constexpr, DV0: tl.constexpr, DV1: tl.constexpr,
              ROT: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
              IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, MASK: tl.constexpr,
              NEED_DS: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
              BLOCK_M: tl.constexpr, WINDOW: tl.constexpr, window, docs):
    """One (key block, query block) pair on transposed (keys x queries) tiles: dV += P^T dO and
    dK += dS^T Q stay in registers; dQ += dS K is added atomically (unscaled; the cast kernel
    applies the softmax scale). With ROT, q (and k) are the rotated tiles, dK/dQ gradients
    w.r.t. them (rotated back at the store / in the cast kernel). With DROPOUT, dV takes the
    kept weights (1/(1-p) is applied at the store) and dP the kept entries scaled by 1/(1-p).

    ONE_KEY_BLOCK (every key in this program's block, so no other program touches these query
    rows): the row statistics come from O, dO and the lse here instead of the preprocess
    kernel's buffers (``_row_stats``), and dQ = dS K * scale is stored, in dQ's dtype, instead
    of added into the fp32 buffer."""
    q0, q1, q2 = _load_qk(q_base, start_m, Lq, stride_qm, stride_qd, cq_base, sq_base,
                          stride_cqm, stride_cqd, D, D0, D1, D2, ROT, INTERLEAVED, HALF_TABLE,
                          BLOCK_M)
    do0, do1 = _load_d(do_base, start_m, Lq, stride_dom, stride_dod, Dv, DV0, DV1, BLOCK_M)
    rows = start_m + offs_m
    row_ok = rows < Lq
    if ONE_KEY_BLOCK:
        delta, live, lse = _row_stats(o_base, stride_om, stride_od, lse_base, stride_lm, do0,
                                      do1, start_m, Lq, Dv, DV0, DV1, BLOCK_M)
        row_m = tl.where(live, lse * _LOG2E, float("inf"))  # log2 units (no float bias)
    else:
        # Padding query rows get RowM = +inf, hence p = 0 and no contribution (no mask needed).
        row_m = tl.load(RowM + stat_base + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(Delta + stat_base + rows, mask=row_ok, other=0.0)

    qk_t = _dot_nt(k0, k1, k2, q0, q1, q2, D1, D2, PRECISION, UPCAST_DOT)
    if BIAS_KIND == 0 and not (MASK or SOFTCAP):  # (two operands: Triton 3.6 refuses chains)
        p_t = tl.exp2(qk_t * score_scale - row_m[None, :])
        t_t = qk_t  # unused
        rep_t = 0  # unused
    else:
        s_t, t_t, rep_t = _capped_scores(qk_t, start_m, start_n, offs_m[None, :], offs_n[:, None],
                                         Lq, Lk, bias_base, stride_bm, stride_bn, rep_base,
                                         stride_rm, stride_rn, score_scale, cap, IS_CAUSAL,
                                         BIAS_KIND, MASK, SOFTCAP, HAS_REPLACE, BIAS_KEYS, WINDOW,
                                         window, docs)
        if BIAS_KIND == 2 and ONE_KEY_BLOCK:
            # Natural units, as the preprocess: RowM = lse, RowR = 0; where the lse lost
            # precision (|lse| > _LSE_EXACT_LIMIT in this block), the rows' exact max and log2
            # sum, taken from this tile, which holds each row's every score.
            worst = tl.max(tl.where(live, tl.abs(lse), 0.0), 0)
            if worst > _LSE_EXACT_LIMIT:
                m = tl.max(s_t, 0)
                row_m = tl.where(live & (m > float("-inf")), m, float("inf"))
                l_t = tl.sum(tl.exp2((s_t - row_m[None, :]) * _LOG2E), 0)
                row_r = tl.where(row_m < float("inf"), tl.log2(l_t), 0.0)
            else:
                row_m = tl.where(live, lse, float("inf"))
                row_r = tl.zeros_like(row_m)
        elif BIAS_KIND == 2:
            row_r = tl.load(RowR + stat_base + rows, mask=row_ok, other=0.0)
        else:
            row_r = row_m  # unused
        p_t = _probs(s_t, row_m[None, :], row_r[None, :], BIAS_KIND)
    if DROPOUT:
        keep = _dropout_keep(seed, bh, start_m, start_n, offs_m, offs_n, drop_thresh, True)
        pc = tl.where(keep, p_t, 0.0).to(do0.dtype)
    else:
        pc = p_t.to(do0.dtype)
    dv0 = _dot_acc(pc, do0, dv0, PRECISION, UPCAST_DOT)
    if DV1 != 0:
        dv1 = _dot_acc(pc, do1, dv1, PRECISION, UPCAST_DOT)
    dp_t = _dot(v0, tl.trans(do0), PRECISION, UPCAST_DOT)
    if DV1 != 0:
        dp_t = _dot_acc(v1, tl.trans(do1), dp_t, PRECISION, UPCAST_DOT)
    if DROPOUT:
        dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    if NEED_DS:
        ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[None, :], offs_n[:, None],
                             stride_dsm, stride_dsn)
        tl.store(ds_ptrs, ds_t, mask=row_ok[None, :] & (start_n + offs_n < Lk)[:, None])
    if HAS_REPLACE:  # a replaced score is the bias alone: no gradient into q·kᵀ (dbias above has it)
        ds_t = tl.where(rep_t, 0.0, ds_t)
    if SOFTCAP:  # dS w.r.t. the scaled scores before the softcap (dbias above is after it)
        ds_t = ds_t * (1.0 - t_t * t_t)
    dsc = ds_t.to(q0.dtype)
    dk0 = _dot_acc(dsc, q0, dk0, PRECISION, UPCAST_DOT)
    if D1 != 0:
        dk1 = _dot_acc(dsc, q1, dk1, PRECISION, UPCAST_DOT)
    if D2 != 0:
        dk2 = _dot_acc(dsc, q2, dk2, PRECISION, UPCAST_DOT)
    if ONE_KEY_BLOCK:
        ds_q = tl.trans(dsc)
        g0 = _dot(ds_q, k0, PRECISION, UPCAST_DOT) * sm_scale
        g1, g2 = g0, g0  # absent parts alias the first (never stored)
        if D1 != 0:
            g1 = _dot(ds_q, k1, PRECISION, UPCAST_DOT) * sm_scale
        if D2 != 0:
            g2 = _dot(ds_q, k2, PRECISION, UPCAST_DOT) * sm_scale
        _store_grad(dq_out_base, g0, g1, g2, start_m, Lq, stride_dqm, stride_dqd, cq_base,
                    sq_base, stride_cqm, stride_cqd, D, D0, D1, D2, ROT, INTERLEAVED, HALF_TABLE,
                    BLOCK_M)
    else:
        _atomic_add_dq(dq_base, tl.trans(dsc), k0, k1, k2, start_m, Lq, D, D0, D1, D2, ROT,
                       PRECISION, UPCAST_DOT, BLOCK_M)
    return dk0, dk1, dk2, dv0, dv1


@triton.jit
def attention_bwd_kernel(
    Q, K, V, Bias, Rep, DO, DQA, DK, DV, DS, Delta, RowM, RowR, Cos, Sin, Out, Lse, DQ, Docs, KeyRange,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm, stride_rn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dsb, stride_dsh, stride_dsm, stride_dsn,
    stride_cqb, stride_cqh, stride_cqm, stride_cqd,
    stride_ckb, stride_ckh, stride_ckn, stride_ckd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    Hq, Hkv, kv_group, Lq, Lk, window, stride_docb, stride_krb, stride_krh, score_scale, sm_scale,
    Seed, drop_thresh, inv_keep, group_split, split_stride_dk, split_stride_dv, cap,
    D: tl.constexpr, Dv: tl.constexpr, ONE_KEY_BLOCK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BIAS_KIND: tl.constexpr, NEED_DS: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REPLACE: tl.constexpr,
    BIAS_KEYS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, DV0: tl.constexpr, DV1: tl.constexpr,
    D2: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
    KEY_RANGE: tl.constexpr = False,
):
    """dK, dV of one key block of one KV head (looping over the query blocks of every query head
    of its GQA group), and that block's share of dQ (atomics into the fp32 buffer DQA, contiguous
    (B, Hq, Lq, D)). With NEED_DS also writes this key block's columns of dS (zeros for the query
    blocks the causal mask hides entirely).

    With ``group_split`` > 1 the GQA group's query heads are shared out over that many programs
    (more programs when B * Hkv * key blocks is too few for the GPU); each writes its partial
    dK/dV at DK/DV + split * split_stride_dk/dv (fp32 buffers the launcher sums).

    ONE_KEY_BLOCK (Lk <= BLOCK_N: one key block, so each program owns whole rows of dQ): no
    preprocess kernel and no fp32 buffer. The statistics come from Out/Lse ((B, Hq, Lq, Dv) and
    (B, Hq, Lq), any strides) and dQ is stored into DQ ((B, Hq, Lq, D), q's dtype): the whole
    backward is this one launch (Delta/RowM/RowR/DQA are then unused).

    KEY_RANGE (a per-key padding mask's live keys, KeyRange: int32 [k_lo, k_hi) per (batch,
    head), kernels/key_range.py; never with a window, ONE_KEY_BLOCK or NEED_DS): each query
    head's query range is cut to ``_live_query_end``; a key block outside the live keys visits
    no query block and stores exact zeros for dK/dV."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale, inv_keep, cap = (
        tl.cast(score_scale, tl.float32), tl.cast(sm_scale, tl.float32),
        tl.cast(inv_keep, tl.float32), tl.cast(cap, tl.float32))
    pid_n, split, b, kvh, heads_per_split = _key_block_program(Lk, Hkv, kv_group, group_split,
                                                               BLOCK_N)
    b = b.to(tl.int64)
    kvh = kvh.to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    ck_base = Cos + b * stride_ckb + kvh * stride_ckh
    sk_base = Sin + b * stride_ckb + kvh * stride_ckh
    if DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    k0, k1, k2 = _load_qk(K + b * stride_kb + kvh * stride_kh, start_n, Lk, stride_kn, stride_kd,
                          ck_base, sk_base, stride_ckn, stride_ckd, D, D0, D1, D2, ROT,
                          INTERLEAVED, HALF_TABLE, BLOCK_N)
    v0, v1 = _load_d(V + b * stride_vb + kvh * stride_vh, start_n, Lk, stride_vn, stride_vd,
                     Dv, DV0, DV1, BLOCK_N)
    dk0, dk1, dk2 = _zero_parts(BLOCK_N, D0, D1, D2)
    dv0, dv1, _ = _zero_parts(BLOCK_N, DV0, DV1, 0)

    doc_base = Docs + b * stride_docb  # the documents table (WINDOW 3): (L, 2) int32 rows
    if WINDOW == 3:  # documents: the query blocks of this key block's documents, all masked
        lo, mid, n_full, end = _doc_query_blocks(doc_base, start_n, Lq, Lk, IS_CAUSAL, BLOCK_M,
                                                 BLOCK_N)
    else:
        lo, mid, n_full, end = _query_blocks(start_n, Lq, Lk, IS_CAUSAL, BLOCK_M, BLOCK_N, WINDOW,
                                             window)
    if ONE_KEY_BLOCK:
        end = Lq  # each program stores its rows' dQ: rows the window hides get their zeros too
    # The masked blocks, [lo, mid) then (with a window) [tail, end), walked by one loop (so the
    # kernel keeps the two loops it has without a window).
    tail = mid + n_full * BLOCK_M
    n_lo = tl.cdiv(tl.maximum(mid - lo, 0), BLOCK_M)
    n_masked = n_lo + tl.cdiv(tl.maximum(end - tail, 0), BLOCK_M)
    for g in range(split * heads_per_split, (split + 1) * heads_per_split):
        h = kvh * kv_group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        dq_base = DQA + (b * Hq + h) * Lq * D
        bias_base = Bias + b * stride_bb + h * stride_bh
        rep_base = Rep + b * stride_rb + h * stride_rh
        ds_base = DS + b * stride_dsb + h * stride_dsh
        cq_base = Cos + b * stride_cqb + h * stride_cqh
        sq_base = Sin + b * stride_cqb + h * stride_cqh
        stat_base = (b * Hq + h) * Lq
        o_base = Out + b * stride_ob + h * stride_oh
        lse_base = Lse + b * stride_lb + h * stride_lh
        dq_out_base = DQ + b * stride_dqb + h * stride_dqh
        if KEY_RANGE:  # this head's live query rows for the key block (never with a window)
            q_end = _live_query_end(KeyRange + b * stride_krb + h * stride_krh, start_n, Lq,
                                    IS_CAUSAL, BLOCK_N)
            mid_h = tl.minimum(mid, q_end)
            n_full_h = tl.cdiv(tl.maximum(q_end - mid_h, 0), BLOCK_M)
        else:
            mid_h = mid
            n_full_h = n_full
        if NEED_DS:
            # Key block hidden from query blocks [0, lo) by the causal mask: dS = 0 there.
            zero = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for start_m in range(0, tl.minimum(lo, Lq), BLOCK_M):
                ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[None, :], offs_n[:, None],
                                     stride_dsm, stride_dsn)
                tl.store(ds_ptrs, zero, mask=((start_m + offs_m) < Lq)[None, :]
                         & (start_n + offs_n < Lk)[:, None])
        if WINDOW:
            for idx in range(0, n_masked):
                start_m = tl.where(idx < n_lo, lo + idx * BLOCK_M, tail + (idx - n_lo) * BLOCK_M)
                dk0, dk1, dk2, dv0, dv1 = _bwd_step(
                    k0, k1, k2, v0, v1, dk0, dk1, dk2, dv0, dv1, q_base, do_base, dq_base,
                    bias_base, ds_base, cq_base, sq_base, Delta, RowM, RowR, stat_base, start_n,
                    start_m, offs_n, offs_m, Lq, Lk, stride_qm, stride_qd, stride_dom, stride_dod,
                    stride_bm, stride_bn, stride_dsm, stride_dsn, stride_cqm, stride_cqd,
                    score_scale, cap, seed, b * Hq + h, drop_thresh, inv_keep, rep_base, stride_rm,
                    stride_rn, o_base, stride_om, stride_od, lse_base, stride_lm, dq_out_base,
                    stride_dqm, stride_dqd, sm_scale, ONE_KEY_BLOCK, DROPOUT, SOFTCAP,
                    HAS_REPLACE, BIAS_KEYS, D, D0, D1, D2, Dv, DV0, DV1, ROT, INTERLEAVED,
                    HALF_TABLE, IS_CAUSAL, BIAS_KIND, True, NEED_DS, PRECISION, UPCAST_DOT,
                    BLOCK_M, WINDOW, window, doc_base)
        else:
            for start_m in range(lo, mid_h, BLOCK_M):
                dk0, dk1, dk2, dv0, dv1 = _bwd_step(
                    k0, k1, k2, v0, v1, dk0, dk1, dk2, dv0, dv1, q_base, do_base, dq_base, bias_base,
                    ds_base, cq_base, sq_base, Delta, RowM, RowR, stat_base, start_n, start_m,
                    offs_n, offs_m, Lq, Lk, stride_qm, stride_qd, stride_dom, stride_dod, stride_bm,
                    stride_bn, stride_dsm, stride_dsn, stride_cqm, stride_cqd, score_scale, cap,
                    seed, b * Hq + h, drop_thresh, inv_keep, rep_base, stride_rm, stride_rn,
                    o_base, stride_om, stride_od, lse_base, stride_lm, dq_out_base, stride_dqm,
                    stride_dqd, sm_scale, ONE_KEY_BLOCK, DROPOUT, SOFTCAP, HAS_REPLACE, BIAS_KEYS,
                    D, D0, D1, D2, Dv, DV0, DV1, ROT, INTERLEAVED, HALF_TABLE,
                    IS_CAUSAL, BIAS_KIND, True, NEED_DS, PRECISION, UPCAST_DOT, BLOCK_M, WINDOW,
                    window, doc_base)
        # Fully visible blocks, visited from a per-program rotation so that the key blocks of
        # one head do not all add into the same dQ rows at the same time.
        # The modulus is never 0, even where the loop runs no iteration: a pipelined loop's
        # prologue computes its first row before the trip-count test, and a modulo by 0 hung the
        # GPU (a windowed key block past every full query block, 2 stages; H200 and H100, Triton
        # 3.6; NOTES attempt 36 / stop 33).
        for j in range(0, n_full_h):
            start_m = mid_h + ((j + pid_n) % tl.maximum(n_full_h, 1)) * BLOCK_M
            dk0, dk1, dk2, dv0, dv1 = _bwd_step(
                k0, k1, k2, v0, v1, dk0, dk1, dk2, dv0, dv1, q_base, do_base, dq_base, bias_base,
                ds_base, cq_base, sq_base, Delta, RowM, RowR, stat_base, start_n, start_m,
                offs_n, offs_m, Lq, Lk, stride_qm, stride_qd, stride_dom, stride_dod, stride_bm,
                stride_bn, stride_dsm, stride_dsn, stride_cqm, stride_cqd, score_scale, cap,
                seed, b * Hq + h, drop_thresh, inv_keep, rep_base, stride_rm, stride_rn,
                o_base, stride_om, stride_od, lse_base, stride_lm, dq_out_base, stride_dqm,
                stride_dqd, sm_scale, ONE_KEY_BLOCK, DROPOUT, SOFTCAP, HAS_REPLACE, BIAS_KEYS,
                D, D0, D1, D2, Dv, DV0, DV1, ROT, INTERLEAVED, HALF_TABLE,
                IS_CAUSAL, BIAS_KIND, False, NEED_DS, PRECISION, UPCAST_DOT, BLOCK_M, WINDOW,
                window, doc_base)
        if WINDOW:
            if NEED_DS:
                # Query blocks past the window's reach see none of this key block: dS = 0.
                zero = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for start_m in range(tl.cdiv(end, BLOCK_M) * BLOCK_M, Lq, BLOCK_M):
                    ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[None, :],
                                         offs_n[:, None], stride_dsm, stride_dsn)
                    tl.store(ds_ptrs, zero, mask=((start_m + offs_m) < Lq)[None, :]
                             & (start_n + offs_n < Lk)[:, None])

    dk0 = dk0 * sm_scale
    if D1 != 0:
        dk1 = dk1 * sm_scale
    if D2 != 0:
        dk2 = dk2 * sm_scale
    split64 = split.to(tl.int64)
    _store_grad(DK + split64 * split_stride_dk + b * stride_dkb + kvh * stride_dkh, dk0, dk1, dk2,
                start_n, Lk, stride_dkn, stride_dkd, ck_base, sk_base, stride_ckn, stride_ckd, D, D0,
                D1, D2, ROT, INTERLEAVED, HALF_TABLE, BLOCK_N)
    if DROPOUT:
        dv0 = dv0 * inv_keep
        if DV1 != 0:
            dv1 = dv1 * inv_keep
    _store_d(DV + split64 * split_stride_dv + b * stride_dvb + kvh * stride_dvh, dv0, dv1, start_n,
             Lk, stride_dvn, stride_dvd, Dv, DV0, DV1, BLOCK_N)


@triton.jit
def attention_dq_cast_kernel(DQA, DQ, numel, stride_dqb, stride_dqh, stride_dqm, stride_dqd, Hq,
                             Lq, D, sm_scale, BLOCK: tl.constexpr):
    """DQ = (DQA * scale).to(DQ's dtype): DQA contiguous (B, Hq, Lq, D), DQ of the same shape
    with its own strides (laid out as q: host.layout_like)."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    sm_scale = tl.cast(sm_scale, tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    x = tl.load(DQA + offs, mask=ok, other=0.0)
    d = offs % D
    m = (offs // D) % Lq
    bh = offs // (D * Lq)
    dst = (bh // Hq) * stride_dqb + (bh % Hq) * stride_dqh + m * stride_dqm + d * stride_dqd
    tl.store(DQ + dst, (x * sm_scale).to(DQ.dtype.element_ty), mask=ok)


@triton.jit
def attention_dq_rope_cast_kernel(
    DQA, DQ, Cos, Sin,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_cqb, stride_cqh, stride_cqm, stride_cqd,
    Hq, Lq, sm_scale,
    D: tl.constexpr, D0: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The rope variant of the cast: DQA (contiguous fp32 (B, Hq, Lq, D), the gradient w.r.t.
    the rotated q with the parts side by side, see ``_atomic_add_dq``) is scaled, rotated back by
    the transpose of the rotation (q's tables) and stored in channel order in DQ's dtype."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    sm_scale = tl.cast(sm_scale, tl.float32)
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % n_m_blocks
    pid_bh = pid // n_m_blocks
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    start_m = pid_m * BLOCK_M
    src = DQA + pid_bh.to(tl.int64) * Lq * D
    g0 = _load_tile(src, start_m, Lq, ROT // 2, D, 1, BLOCK_M, D0) * sm_scale
    g1 = _load_tile(src + ROT // 2, start_m, Lq, ROT // 2, D, 1, BLOCK_M, D0) * sm_scale
    if D2 != 0:
        g2 = _load_tile(src + ROT, start_m, Lq, D - ROT, D, 1, BLOCK_M, D2) * sm_scale
    else:
        g2 = g0
    _store_grad(DQ + b * stride_dqb + h * stride_dqh, g0, g1, g2, start_m, Lq, stride_dqm,
                stride_dqd, Cos + b * stride_cqb + h * stride_cqh,
                Sin + b * stride_cqb + h * stride_cqh, stride_cqm, stride_cqd, D, D0, D0, D2,
                ROT, INTERLEAVED, HALF_TABLE, BLOCK_M)


# --------------------------------------------------------------------------------------------
# Backward: deterministic path (two atomic-free kernels)
# --------------------------------------------------------------------------------------------


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, Bias, Rep, DO, DK, DV, Delta, RowM, RowR, Cos, Sin, Docs, KeyRange,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm, stride_rn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_cqb, stride_cqh, stride_cqm, stride_cqd,
    stride_ckb, stride_ckh, stride_ckn, stride_ckd,
    Hq, Hkv, kv_group, Lq, Lk, window, stride_docb, stride_krb, stride_krh, D: tl.constexpr,
    Dv: tl.constexpr, score_scale,
    sm_scale,
    Seed, drop_thresh, inv_keep, cap,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BIAS_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_REPLACE: tl.constexpr, BIAS_KEYS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr, KEY_RANGE: tl.constexpr = False,
):
    """dK, dV of one key block of one KV head. Works on transposed (keys x queries) tiles so that
    both accumulations are plain dots: dV += P^T dO, dK += dS^T Q * scale. q/k as head-dim parts
    (without rope one tile: D0 = the padded head dim, D1 = D2 = 0). KEY_RANGE: each query head's
    rows cut to ``_live_query_end`` (a padding mask's live keys; zeros for a block outside them)."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale, inv_keep, cap = (
        tl.cast(score_scale, tl.float32), tl.cast(sm_scale, tl.float32),
        tl.cast(inv_keep, tl.float32), tl.cast(cap, tl.float32))
    n_n_blocks = tl.cdiv(Lk, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % n_n_blocks
    pid_bh = pid // n_n_blocks
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = (pid_bh % Hkv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if DROPOUT:
        seed = tl.load(Seed)

    ck_base = Cos + b * stride_ckb + kvh * stride_ckh
    sk_base = Sin + b * stride_ckb + kvh * stride_ckh
    k0, k1, k2 = _load_qk(K + b * stride_kb + kvh * stride_kh, start_n, Lk, stride_kn, stride_kd,
                          ck_base, sk_base, stride_ckn, stride_ckd, D, D0, D1, D2, ROT,
                          INTERLEAVED, HALF_TABLE, BLOCK_N)
    v = _load_tile(V + b * stride_vb + kvh * stride_vh, start_n, Lk, Dv, stride_vn, stride_vd,
                   BLOCK_N, BLOCK_DV)
    dk0, dk1, dk2 = _zero_parts(BLOCK_N, D0, D1, D2)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # Causal: query blocks ending before this key block's first key see none of it.
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    # Sliding window (or chunks): query rows from the band's end after this block's last key see none of it.
    doc_base = Docs + b * stride_docb
    if WINDOW == 3:  # documents: the query rows of this key block's documents (_doc_span)
        first, end = _doc_span(doc_base, start_n, Lk, BLOCK_N)
        lo = tl.maximum(lo, (first // BLOCK_M) * BLOCK_M)
        end = tl.minimum(Lq, end)
    elif WINDOW:
        end = tl.minimum(Lq, _band_end(start_n + BLOCK_N - 1, window, WINDOW))
    else:
        end = Lq
    # Every query head of the GQA group accumulates into the same registers: no atomics.
    for g in range(0, kv_group):
        h = kvh * kv_group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        bias_base = Bias + b * stride_bb + h * stride_bh
        rep_base = Rep + b * stride_rb + h * stride_rh
        cq_base = Cos + b * stride_cqb + h * stride_cqh
        sq_base = Sin + b * stride_cqb + h * stride_cqh
        stat_base = (b * Hq + h) * Lq
        if KEY_RANGE:  # this head's live query rows for the key block (never with a window)
            end_h = tl.minimum(end, _live_query_end(KeyRange + b * stride_krb + h * stride_krh,
                                                    start_n, Lq, IS_CAUSAL, BLOCK_N))
        else:
            end_h = end
        for start_m in range(lo, end_h, BLOCK_M):
            q0, q1, q2 = _load_qk(q_base, start_m, Lq, stride_qm, stride_qd, cq_base, sq_base,
                                  stride_cqm, stride_cqd, D, D0, D1, D2, ROT, INTERLEAVED,
                                  HALF_TABLE, BLOCK_M)
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
            qk_t = _dot_nt(k0, k1, k2, q0, q1, q2, D1, D2, PRECISION, UPCAST_DOT)
            s_t, t_t, rep_t = _capped_scores(qk_t, start_m, start_n, offs_m[None, :],
                                             offs_n[:, None], Lq, Lk, bias_base, stride_bm,
                                             stride_bn, rep_base, stride_rm, stride_rn,
                                             score_scale, cap, IS_CAUSAL, BIAS_KIND, True,
                                             SOFTCAP, HAS_REPLACE, BIAS_KEYS, WINDOW, window,
                                             doc_base)
            p_t = _probs(s_t, row_m[None, :], row_r[None, :], BIAS_KIND)
            dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST_DOT)
            if DROPOUT:
                keep = _dropout_keep(seed, b * Hq + h, start_m, start_n, offs_m, offs_n,
                                     drop_thresh, True)
                dv += _dot(tl.where(keep, p_t, 0.0).to(do.dtype), do, PRECISION, UPCAST_DOT)
                dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
            else:
                dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST_DOT)
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_REPLACE:  # a replaced score is the bias alone: no gradient into q·kᵀ
                ds_t = tl.where(rep_t, 0.0, ds_t)
            if SOFTCAP:  # through the softcap: d(c·tanh(x/c))/dx = 1 - tanh²
                ds_t = ds_t * (1.0 - t_t * t_t)
            dsc = ds_t.to(q0.dtype)
            dk0 += _dot(dsc, q0, PRECISION, UPCAST_DOT)
            if D1 != 0:
                dk1 += _dot(dsc, q1, PRECISION, UPCAST_DOT)
            if D2 != 0:
                dk2 += _dot(dsc, q2, PRECISION, UPCAST_DOT)

    dk0 = dk0 * sm_scale
    if D1 != 0:
        dk1 = dk1 * sm_scale
    if D2 != 0:
        dk2 = dk2 * sm_scale
    _store_grad(DK + b * stride_dkb + kvh * stride_dkh, dk0, dk1, dk2, start_n, Lk, stride_dkn,
                stride_dkd, ck_base, sk_base, stride_ckn, stride_ckd, D, D0, D1, D2, ROT,
                INTERLEAVED, HALF_TABLE, BLOCK_N)
    if DROPOUT:
        dv = dv * inv_keep
    _store_tile(DV + b * stride_dvb + kvh * stride_dvh, dv, start_n, Lk, Dv, stride_dvn,
                stride_dvd, BLOCK_N, BLOCK_DV)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, Bias, Rep, DO, DQ, DS, Delta, RowM, RowR, Cos, Sin, Docs, KeyRange,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm, stride_rn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dsb, stride_dsh, stride_dsm, stride_dsn,
    stride_cqb, stride_cqh, stride_cqm, stride_cqd,
    stride_ckb, stride_ckh, stride_ckn, stride_ckd,
    Hq, kv_group, Lq, Lk, window, stride_docb, stride_krb, stride_krh, D: tl.constexpr,
    Dv: tl.constexpr, score_scale,
    sm_scale,
    Seed, drop_thresh, inv_keep, cap,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BIAS_KIND: tl.constexpr, NEED_DS: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REPLACE: tl.constexpr,
    BIAS_KEYS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr, KEY_RANGE: tl.constexpr = False,
):
    """dQ of one query block (dQ += dS K * scale over the visible key blocks); with NEED_DS also
    writes every element of that block's rows of dS (zeros for causally skipped key blocks).
    KEY_RANGE: the key blocks cut to a padding mask's live keys (``_live_key_blocks``; never with
    NEED_DS or a window)."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale, inv_keep, cap = (
        tl.cast(score_scale, tl.float32), tl.cast(sm_scale, tl.float32),
        tl.cast(inv_keep, tl.float32), tl.cast(cap, tl.float32))
    pid_bh, b, h, kvh, start_m = _query_block_program(Lq, Hq, kv_group, BLOCK_M)
    b = b.to(tl.int64)
    h = h.to(tl.int64)
    kvh = kvh.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = start_m + offs_m
    row_ok = rows < Lq

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    bias_base = Bias + b * stride_bb + h * stride_bh
    rep_base = Rep + b * stride_rb + h * stride_rh
    ds_base = DS + b * stride_dsb + h * stride_dsh
    cq_base = Cos + b * stride_cqb + h * stride_cqh
    sq_base = Sin + b * stride_cqb + h * stride_cqh
    ck_base = Cos + b * stride_ckb + kvh * stride_ckh
    sk_base = Sin + b * stride_ckb + kvh * stride_ckh
    q0, q1, q2 = _load_qk(Q + b * stride_qb + h * stride_qh, start_m, Lq, stride_qm, stride_qd,
                          cq_base, sq_base, stride_cqm, stride_cqd, D, D0, D1, D2, ROT,
                          INTERLEAVED, HALF_TABLE, BLOCK_M)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, start_m, Lq, Dv, stride_dom, stride_dod,
                    BLOCK_M, BLOCK_DV)
    stat_off = pid_bh.to(tl.int64) * Lq + rows
    row_m = tl.load(RowM + stat_off, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + stat_off, mask=row_ok, other=0.0)
    if BIAS_KIND == 2:
        row_r = tl.load(RowR + stat_off, mask=row_ok, other=0.0)
    else:
        row_r = row_m  # unused
    if DROPOUT:
        seed = tl.load(Seed)
    dq0, dq1, dq2 = _zero_parts(BLOCK_M, D0, D1, D2)

    if IS_CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M)
    else:
        hi = Lk
    # Sliding window (or chunks): key blocks ending before the block's first row's first key are hidden.
    doc_base = Docs + b * stride_docb
    if WINDOW == 3:  # documents: the key blocks of the block's rows' documents (_doc_span)
        first, last = _doc_span(doc_base, start_m, Lq, BLOCK_M)
        lo = (first // BLOCK_N) * BLOCK_N
        hi = tl.minimum(hi, last)
    elif WINDOW:
        lo = (_band_lo(start_m, window, WINDOW) // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    if KEY_RANGE:
        live_lo, k_hi = _live_key_blocks(KeyRange + b * stride_krb + h * stride_krh, start_m,
                                         IS_CAUSAL, BLOCK_N)
        lo = tl.maximum(lo, live_lo)
        hi = tl.minimum(hi, k_hi)
    for start_n in range(lo, hi, BLOCK_N):
        k0, k1, k2 = _load_qk(k_base, start_n, Lk, stride_kn, stride_kd, ck_base, sk_base,
                              stride_ckn, stride_ckd, D, D0, D1, D2, ROT, INTERLEAVED,
                              HALF_TABLE, BLOCK_N)
        v = _load_tile(v_base, start_n, Lk, Dv, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
        qk = _dot_nt(q0, q1, q2, k0, k1, k2, D1, D2, PRECISION, UPCAST_DOT)
        s, t, rep = _capped_scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :], Lq, Lk,
                                   bias_base, stride_bm, stride_bn, rep_base, stride_rm,
                                   stride_rn, score_scale, cap, IS_CAUSAL, BIAS_KIND, True,
                                   SOFTCAP, HAS_REPLACE, BIAS_KEYS, WINDOW, window, doc_base)
        p = _probs(s, row_m[:, None], row_r[:, None], BIAS_KIND)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST_DOT)
        if DROPOUT:
            dp = tl.where(_dropout_keep(seed, pid_bh, start_m, start_n, offs_m, offs_n, drop_thresh,
                                        False), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if NEED_DS:
            ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[:, None], offs_n[None, :],
                                 stride_dsm, stride_dsn)
            tl.store(ds_ptrs, ds, mask=row_ok[:, None] & (start_n + offs_n < Lk)[None, :])
        if HAS_REPLACE:  # a replaced score is the bias alone: no gradient into q·kᵀ
            ds = tl.where(rep, 0.0, ds)
        if SOFTCAP:  # dbias above is after the softcap; dQ goes through it
            ds = ds * (1.0 - t * t)
        dsc = ds.to(k0.dtype)
        dq0 += _dot(dsc, k0, PRECISION, UPCAST_DOT)
        if D1 != 0:
            dq1 += _dot(dsc, k1, PRECISION, UPCAST_DOT)
        if D2 != 0:
            dq2 += _dot(dsc, k2, PRECISION, UPCAST_DOT)

    if NEED_DS:
        # Key blocks the causal loop skipped are entirely masked: their dS is 0.
        zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start_n in range(tl.cdiv(hi, BLOCK_N) * BLOCK_N, Lk, BLOCK_N):
            ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[:, None], offs_n[None, :],
                                 stride_dsm, stride_dsn)
            tl.store(ds_ptrs, zero, mask=row_ok[:, None] & (start_n + offs_n < Lk)[None, :])
        for start_n in range(0, lo, BLOCK_N):  # and those the window hides
            ds_ptrs = _pair_ptrs(ds_base, start_m, start_n, offs_m[:, None], offs_n[None, :],
                                 stride_dsm, stride_dsn)
            tl.store(ds_ptrs, zero, mask=row_ok[:, None] & (start_n + offs_n < Lk)[None, :])

    dq0 = dq0 * sm_scale
    if D1 != 0:
        dq1 = dq1 * sm_scale
    if D2 != 0:
        dq2 = dq2 * sm_scale
    _store_grad(DQ + b * stride_dqb + h * stride_dqh, dq0, dq1, dq2, start_m, Lq, stride_dqm,
                stride_dqd, cq_base, sq_base, stride_cqm, stride_cqd, D, D0, D1, D2, ROT,
                INTERLEAVED, HALF_TABLE, BLOCK_M)
