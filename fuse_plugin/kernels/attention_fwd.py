"""Flash-attention forward kernel (online softmax, lse kept); see kernels/attention.py for shapes,
layouts, numerics and the launcher."""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import (
    _LN2,
    _LOG2E,
    _dot_acc,
    _dot_nt,
    _doc_key_blocks,
    _dropout_keep,
    _exp,
    _key_blocks,
    _load_d,
    _load_qk,
    _capped_scores,
    _cut_key_blocks,
    _store_d,
    _zero_parts,
)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(q0, q1, q2, m_i, l_i, acc0, acc1, k_base, v_base, bias_base, ck_base, sk_base,
              start_m, start_n, offs_m, offs_n, Lq, Lk, stride_kn, stride_kd, stride_vn,
              stride_vd, stride_bm, stride_bn, stride_ckn, stride_ckd, score_scale, cap,
              seed, bh, drop_thresh, rep_base, stride_rm, stride_rn,
              DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REPLACE: tl.constexpr,
              D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
              Dv: tl.constexpr, DV0: tl.constexpr, DV1: tl.constexpr,
              ROT: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
              IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, MASK: tl.constexpr,
              SCALE_POS: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
              BLOCK_N: tl.constexpr, BIAS_KEYS: tl.constexpr, WINDOW: tl.constexpr, window,
              docs):
    """One key block of the online softmax (with ROT, the key tile is rotated after its load).
    WINDOW: a sliding window, chunks or documents (``docs``: WINDOW 3), which can hide a row's
    whole block (the -inf guard below)."""
    k0, k1, k2 = _load_qk(k_base, start_n, Lk, stride_kn, stride_kd, ck_base, sk_base,
                          stride_ckn, stride_ckd, D, D0, D1, D2, ROT, INTERLEAVED, HALF_TABLE,
                          BLOCK_N)
    v0, v1 = _load_d(v_base, start_n, Lk, stride_vn, stride_vd, Dv, DV0, DV1, BLOCK_N)
    qk = _dot_nt(q0, q1, q2, k0, k1, k2, D1, D2, PRECISION, UPCAST_DOT)
    if BIAS_KIND == 0:
        if MASK or SOFTCAP:
            s, _, _ = _capped_scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :], Lq,
                                     Lk, bias_base, stride_bm, stride_bn, rep_base, stride_rm,
                                     stride_rn, score_scale, cap, IS_CAUSAL, BIAS_KIND, MASK,
                                     SOFTCAP, HAS_REPLACE, BIAS_KEYS, WINDOW, window, docs)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if WINDOW:  # a row may have met only hidden keys so far: keep (-inf) - (-inf) out
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_ref = m_new
            p = tl.exp2(s - m_ref[:, None])
        else:
            # Fully visible block: the row max is taken on the raw dots and the scale is folded
            # into one FMA per score. Every row has a finite max here (see the callers), and
            # without a bias the first block a row meets always holds a visible key, so m_new
            # is finite and no -inf guard is needed.
            if SCALE_POS:
                m_blk = tl.max(qk, 1) * score_scale
            else:
                m_blk = tl.min(qk, 1) * score_scale
            m_new = tl.maximum(m_i, m_blk)
            m_ref = m_new
            p = tl.exp2(qk * score_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_ref)
    else:
        s, _, _ = _capped_scores(qk, start_m, start_n, offs_m[:, None], offs_n[None, :], Lq, Lk,
                                 bias_base, stride_bm, stride_bn, rep_base, stride_rm, stride_rn,
                                 score_scale, cap, IS_CAUSAL, BIAS_KIND, MASK, SOFTCAP,
                                 HAS_REPLACE, BIAS_KEYS, WINDOW, window, docs)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A bias can mask a row's whole block: while a row has seen only -inf, use 0 as the
        # reference so that (-inf) - (-inf) never produces NaN (p and alpha are then 0).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m_i - m_ref, BIAS_KIND == 2)
        p = _exp(s - m_ref[:, None], BIAS_KIND == 2)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        # The row sum l_i is of the undropped weights; 1/(1-p) is applied to the output once.
        p = tl.where(_dropout_keep(seed, bh, start_m, start_n, offs_m, offs_n, drop_thresh, False),
                     p, 0.0)
    # P is rounded to the input dtype for the P.V product (as flash-attention does).
    pc = p.to(v0.dtype)
    acc0 = _dot_acc(pc, v0, acc0 * alpha[:, None], PRECISION, UPCAST_DOT)
    if DV1 != 0:
        acc1 = _dot_acc(pc, v1, acc1 * alpha[:, None], PRECISION, UPCAST_DOT)
    return m_new, l_i, acc0, acc1


@triton.jit
def attention_fwd_kernel(
    Q, K, V, Bias, Rep, Out, Lse, Cos, Sin, Docs, Sinks, KeyRange,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm, stride_rn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_cqb, stride_cqh, stride_cqm, stride_cqd,
    stride_ckb, stride_ckh, stride_ckn, stride_ckd,
    Hq, kv_group, Lq, Lk, window, stride_docb, stride_krb, stride_krh, score_scale,
    Seed, drop_thresh, inv_keep, cap,
    D: tl.constexpr, Dv: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BIAS_KIND: tl.constexpr, SCALE_POS: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REPLACE: tl.constexpr,
    BIAS_KEYS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, DV0: tl.constexpr, DV1: tl.constexpr,
    D2: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
    SINKS: tl.constexpr = False, KEY_RANGE: tl.constexpr = False,
):
    # 1-D grid (a 2-D one would cap B*Hq at 65535 on the y axis). Query blocks of one head are
    # adjacent so they share K/V in L2; the last (causally heaviest) block is launched first.
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, inv_keep, cap = (tl.cast(score_scale, tl.float32), tl.cast(inv_keep, tl.float32),
                                  tl.cast(cap, tl.float32))
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
    rep_base = Rep + b * stride_rb + h * stride_rh  # the replace mask (HAS_REPLACE; uint8)
    # rope tables (ROT > 0) at this query head and at its kv head
    cq_base = Cos + b * stride_cqb + h * stride_cqh
    sq_base = Sin + b * stride_cqb + h * stride_cqh
    ck_base = Cos + b * stride_ckb + kvh * stride_ckh
    sk_base = Sin + b * stride_ckb + kvh * stride_ckh
    doc_base = Docs + b * stride_docb  # the documents table (WINDOW 3): (L, 2) int32 rows

    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = start_m + offs_m
    if DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0

    q0, q1, q2 = _load_qk(q_base, start_m, Lq, stride_qm, stride_qd, cq_base, sq_base,
                          stride_cqm, stride_cqd, D, D0, D1, D2, ROT, INTERLEAVED, HALF_TABLE,
                          BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0, acc1, _ = _zero_parts(BLOCK_M, DV0, DV1, 0)

    # [lo, full_lo): the window's lower edge (masked); [full_lo, full_end): fully visible;
    # [full_end, hi): the causal diagonal / last partial key block (masked). Documents: the
    # key blocks of the rows' documents, all masked.
    if WINDOW == 3:
        lo, full_lo, full_end, hi = _doc_key_blocks(doc_base, start_m, Lq, Lk, IS_CAUSAL, BLOCK_M,
                                                    BLOCK_N)
    else:
        lo, full_lo, full_end, hi = _key_blocks(start_m, Lk, IS_CAUSAL, BLOCK_M, BLOCK_N, WINDOW,
                                                window)
        if KEY_RANGE:  # a padding mask's live keys (kernels/key_range.py; never with a window)
            lo, full_lo, full_end, hi = _cut_key_blocks(KeyRange + b * stride_krb + h * stride_krh,
                                                        start_m, lo, full_lo, full_end, hi,
                                                        IS_CAUSAL, BLOCK_N)
    if WINDOW:
        for start_n in range(lo, full_lo, BLOCK_N):
            m_i, l_i, acc0, acc1 = _fwd_step(
                q0, q1, q2, m_i, l_i, acc0, acc1, k_base, v_base, bias_base, ck_base, sk_base,
                start_m, start_n, offs_m, offs_n, Lq, Lk, stride_kn, stride_kd, stride_vn,
                stride_vd, stride_bm, stride_bn, stride_ckn, stride_ckd, score_scale, cap,
                seed, pid_bh, drop_thresh, rep_base, stride_rm, stride_rn, DROPOUT, SOFTCAP,
                HAS_REPLACE,
                D, D0, D1, D2, Dv, DV0, DV1, ROT, INTERLEAVED, HALF_TABLE,
                IS_CAUSAL, BIAS_KIND, True, SCALE_POS, PRECISION, UPCAST_DOT, BLOCK_N,
                BIAS_KEYS, WINDOW, window, doc_base)
    for start_n in range(full_lo, full_end, BLOCK_N):
        m_i, l_i, acc0, acc1 = _fwd_step(
            q0, q1, q2, m_i, l_i, acc0, acc1, k_base, v_base, bias_base, ck_base, sk_base,
            start_m, start_n, offs_m, offs_n, Lq, Lk, stride_kn, stride_kd, stride_vn,
            stride_vd, stride_bm, stride_bn, stride_ckn, stride_ckd, score_scale, cap,
            seed, pid_bh, drop_thresh, rep_base, stride_rm, stride_rn, DROPOUT, SOFTCAP,
            HAS_REPLACE,
            D, D0, D1, D2, Dv, DV0, DV1, ROT, INTERLEAVED, HALF_TABLE,
            IS_CAUSAL, BIAS_KIND, False, SCALE_POS, PRECISION, UPCAST_DOT, BLOCK_N,
            BIAS_KEYS, WINDOW, window, doc_base)
    for start_n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc0, acc1 = _fwd_step(
            q0, q1, q2, m_i, l_i, acc0, acc1, k_base, v_base, bias_base, ck_base, sk_base,
            start_m, start_n, offs_m, offs_n, Lq, Lk, stride_kn, stride_kd, stride_vn,
            stride_vd, stride_bm, stride_bn, stride_ckn, stride_ckd, score_scale, cap,
            seed, pid_bh, drop_thresh, rep_base, stride_rm, stride_rn, DROPOUT, SOFTCAP,
            HAS_REPLACE,
            D, D0, D1, D2, Dv, DV0, DV1, ROT, INTERLEAVED, HALF_TABLE,
            IS_CAUSAL, BIAS_KIND, True, SCALE_POS, PRECISION, UPCAST_DOT, BLOCK_N,
            BIAS_KEYS, WINDOW, window, doc_base)

    if SINKS:
        # gpt-oss's sink (ops/attention_sinks.py): the head's logit (natural units, Sinks: (Hq,)
        # fp32) joins every row's softmax denominator and nothing else; a row whose every key is
        # masked then gets out 0 and lse = the sink.
        sink = tl.load(Sinks + h).to(tl.float32)
        if BIAS_KIND != 2:
            sink = sink * _LOG2E  # the scores' units (see _scores)
        m_new = tl.maximum(m_i, sink)
        alpha = _exp(m_i - m_new, BIAS_KIND == 2)
        l_i = l_i * alpha + _exp(sink - m_new, BIAS_KIND == 2)
        acc0 = acc0 * alpha[:, None]
        if DV1 != 0:
            acc1 = acc1 * alpha[:, None]
        m_i = m_new
    # A fully masked row has l_i == 0: 0/0 = NaN like eager softmax, and lse = -inf.
    inv_l = 1.0 / l_i
    if DROPOUT:
        inv_l = inv_l * inv_keep
    if BIAS_KIND == 2:
        lse = m_i + tl.log2(l_i) * _LN2
    else:
        lse = (m_i + tl.log2(l_i)) * _LN2
    out_base = Out + b * stride_ob + h * stride_oh
    out0 = acc0 * inv_l[:, None]
    if DV1 != 0:
        out1 = acc1 * inv_l[:, None]
    else:
        out1 = out0
    _store_d(out_base, out0, out1, start_m, Lq, stride_om, stride_od, Dv, DV0, DV1, BLOCK_M)
    tl.store(Lse + b * stride_lb + h * stride_lh + rows.to(tl.int64) * stride_lm, lse,
             mask=rows < Lq)
