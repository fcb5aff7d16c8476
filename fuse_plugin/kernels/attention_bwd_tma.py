"""Hopper backward of the plain attention case: the atomic-dQ backward with its tiles moved by
TMA (tensor descriptors), and dQ added by TMA reductions.

Same problems as attention_fwd_tma.py (no bias, dropout or rope; fp16/bf16; ``Dv == D`` in
{64, 128}; 16-byte aligned layouts), same program layout and order as ``attention_bwd_kernel``
(one program per key block of a KV head, or of a share of its GQA group with ``group_split``),
and the same inputs: the preprocess kernel's Delta / RowM rows and the zeroed fp32 dQ buffer
(contiguous (B, Hq, Lq, D)), which ``attention_dq_cast_kernel`` scales and casts afterwards.

What TMA changes: the streamed Q and dO tiles land in shared memory without address or mask math,
and each query block's dQ share, a [BLOCK_M, D] fp32 tile, is added by one bulk reduction
(``cp.reduce.async.bulk``) instead of BLOCK_M * D element atomics. Out-of-range rows of a head
read as zero and are never written (each tensor is a host-side 4-D descriptor over its
(B, H, L, D) view with [1, 1, BLOCK, D] blocks, so a block's bounds are its head's rows).
Triton's CPU interpreter has no descriptor reductions: there (``TMA_REDUCE`` off) dQ goes through element
atomics, so CI checks everything but the reduction itself, which the GPU tests cover.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import (
    _atomic_add_tile,
    _dot,
    _dot_acc,
    _key_block_program,
    _query_blocks,
    _store_d,
)


@triton.jit
def _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, dq_desc, dq_base, b, h, RowM, Delta, stat_base,
                  start_n, start_m, offs_n, offs_m, Lq, Lk, score_scale, IS_CAUSAL: tl.constexpr,
                  MASK: tl.constexpr, TMA_REDUCE: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One (key block, query block) pair on transposed (keys x queries) tiles, as ``_bwd_step``
    of the general kernel: dV += P^T dO, dK += dS^T Q in registers, dQ += dS K by TMA reduction
    (unscaled; the cast kernel applies the softmax scale)."""
    q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, D)
    do = do_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, D)
    rows = start_m + offs_m
    row_ok = rows < Lq
    # Padding query rows get RowM = +inf, hence p = 0 (their q rows also read as zeros).
    row_m = tl.load(RowM + stat_base + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + stat_base + rows, mask=row_ok, other=0.0)
    qk_t = _dot(k, tl.trans(q), PRECISION, UPCAST_DOT)
    p_t = tl.exp2(qk_t * score_scale - row_m[None, :])
    if MASK:
        cols = start_n + offs_n
        visible = cols[:, None] < Lk
        if IS_CAUSAL:
            visible = visible & (rows[None, :] >= cols[:, None])
        p_t = tl.where(visible, p_t, 0.0)
    dv = _dot_acc(p_t.to(do.dtype), do, dv, PRECISION, UPCAST_DOT)
    dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST_DOT)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = _dot_acc(ds_t, q, dk, PRECISION, UPCAST_DOT)
    dq = _dot(tl.trans(ds_t), k, PRECISION, UPCAST_DOT)
    if TMA_REDUCE:
        dq_desc.atomic_add([b, h, start_m, 0], dq.reshape(1, 1, BLOCK_M, D))
    else:  # Triton's interpreter has no descriptor reductions: element atomics
        _atomic_add_tile(dq_base, dq, start_m, Lq, D, D, BLOCK_M, D)
    return dk, dv


@triton.jit
def attention_bwd_tma_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DQA, DK, DV, Delta, RowM,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, kv_group, Lq, Lk, score_scale, sm_scale,
    group_split, split_stride_dk, split_stride_dv,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    TMA_REDUCE: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV of one key block of one KV head (its GQA group's query heads, or a ``group_split``
    share of them: partial dK/dV then go to fp32 buffers at DK/DV + split * split_stride_*),
    and that key block's share of dQ, added into DQA (also described by ``dq_desc``)."""
    pid_n, split, b, kvh, heads_per_split = _key_block_program(Lk, Hkv, kv_group, group_split,
                                                               BLOCK_N)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)

    lo, mid, n_full = _query_blocks(start_n, Lq, Lk, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for g in range(split * heads_per_split, (split + 1) * heads_per_split):
        h = kvh * kv_group + g
        stat_base = (b.to(tl.int64) * Hq + h) * Lq
        dq_base = DQA + stat_base * D
        for start_m in range(lo, mid, BLOCK_M):
            dk, dv = _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, dq_desc, dq_base, b, h, RowM,
                                   Delta, stat_base, start_n, start_m, offs_n, offs_m, Lq, Lk,
                                   score_scale, IS_CAUSAL, True, TMA_REDUCE, D, BLOCK_M,
                                   PRECISION, UPCAST_DOT)
        # Fully visible blocks from a per-program rotation (key blocks of one head do not all
        # reduce into the same dQ rows at once).
        for j in range(0, n_full):
            start_m = mid + ((j + pid_n) % n_full) * BLOCK_M
            dk, dv = _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, dq_desc, dq_base, b, h, RowM,
                                   Delta, stat_base, start_n, start_m, offs_n, offs_m, Lq, Lk,
                                   score_scale, IS_CAUSAL, False, TMA_REDUCE, D, BLOCK_M,
                                   PRECISION, UPCAST_DOT)

    split64 = split.to(tl.int64)
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    _store_d(DK + split64 * split_stride_dk + b64 * stride_dkb + kvh64 * stride_dkh, dk * sm_scale,
             dk, start_n, Lk, stride_dkn, 1, D, D, 0, BLOCK_N)
    _store_d(DV + split64 * split_stride_dv + b64 * stride_dvb + kvh64 * stride_dvh, dv, dv,
             start_n, Lk, stride_dvn, 1, D, D, 0, BLOCK_N)
