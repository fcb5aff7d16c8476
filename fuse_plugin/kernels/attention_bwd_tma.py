"""Hopper backward of the plain attention case, tiles moved by TMA (tensor descriptors): the
atomic-dQ backward with dQ added by TMA reductions, and the atomic-free pair.

Same problems as attention_fwd_tma.py (no bias, dropout or rope; fp16/bf16; ``Dv == D``;
16-byte aligned layouts), with D in {64, 128} for the atomic kernel and {64, 128, 256} for the
pair. Each tensor is a host-side 4-D descriptor over its (B, H, L, D) view with [1, 1, BLOCK, D]
blocks, so a block's bounds are its head's rows: out-of-range rows read as zero and are never
written. Both read the preprocess kernel's Delta / RowM rows (contiguous (B * Hq, Lq)).

* ``attention_bwd_tma_kernel``: program layout and order as ``attention_bwd_kernel`` (one
  program per key block of a KV head, or of a share of its GQA group with ``group_split``);
  dK/dV in registers; each query block's dQ share, a [BLOCK_M, D] fp32 tile, is added into the
  zeroed fp32 buffer DQA (contiguous (B, Hq, Lq, D), scaled and cast afterwards by
  ``attention_dq_cast_kernel``) by one bulk reduction (``cp.reduce.async.bulk``) instead of
  BLOCK_M * D element atomics. Triton's CPU interpreter has no descriptor reductions: there
  (``TMA_REDUCE`` off) dQ goes through element atomics, so CI checks everything but the
  reduction itself, which the GPU tests cover.
* The atomic-free pair: ``attention_bwd_dkdv_tma_kernel`` (dK/dV only, same program layout,
  query blocks in order), then ``attention_bwd_dq_tma_kernel`` (one program per query block:
  dQ = sum over key blocks of dS K, which recomputes S and dP: 7 matmuls per block pair instead
  of 5). No atomics, so it is deterministic; at D 256, where a [BLOCK_M, 256] fp32 dQ share per
  key block is heavy and registers are short, it is also the fastest (RESULTS.md, stop 11).
  Each kernel has its own tiles (``AttentionConfig.dq_tile``): dK/dV keep 2 x BLOCK_N x D fp32
  accumulators, dQ one BLOCK_M x D.

No softcap (Gemma 2 / Grok logit softcapping): the launcher (kernels/attention.py,
``_softcap_config``) never picks this kernel for a softcapped call; the general kernels take it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import (
    _atomic_add_tile,
    _dot,
    _dot_acc,
    _key_block_program,
    _query_block_program,
    _query_blocks,
    _store_d,
)


@triton.jit
def _tma_key_block(k_desc, v_desc, Lk, Hkv, kv_group, group_split, D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """A key-block program's start (``_key_block_program``): its K and V tiles and zeroed
    fp32 dK / dV accumulators."""
    pid_n, split, b, kvh, heads_per_split = _key_block_program(Lk, Hkv, kv_group, group_split,
                                                               BLOCK_N)
    start_n = pid_n * BLOCK_N
    k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    return pid_n, split, b, kvh, heads_per_split, start_n, k, v, dk, dv


@triton.jit
def _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, dq_desc, dq_base, b, h, RowM, Delta, stat_base,
                  start_n, start_m, offs_n, offs_m, Lq, Lk, score_scale, IS_CAUSAL: tl.constexpr,
                  MASK: tl.constexpr, ADD_DQ: tl.constexpr, TMA_REDUCE: tl.constexpr,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST_DOT: tl.constexpr):
    """One (key block, query block) pair on transposed (keys x queries) tiles, as ``_bwd_step``
    of the general kernel: dV += P^T dO, dK += dS^T Q in registers; with ADD_DQ (the atomic
    kernel, not the pair) also dQ += dS K by TMA reduction into dq_desc (unscaled; the cast
    kernel applies the softmax scale)."""
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
    if ADD_DQ:
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
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale = (tl.cast(score_scale, tl.float32), tl.cast(sm_scale, tl.float32))
    pid_n, split, b, kvh, heads_per_split, start_n, k, v, dk, dv = _tma_key_block(
        k_desc, v_desc, Lk, Hkv, kv_group, group_split, D, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    lo, mid, n_full, _ = _query_blocks(start_n, Lq, Lk, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for g in range(split * heads_per_split, (split + 1) * heads_per_split):
        h = kvh * kv_group + g
        stat_base = (b.to(tl.int64) * Hq + h) * Lq
        dq_base = DQA + stat_base * D
        for start_m in range(lo, mid, BLOCK_M):
            dk, dv = _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, dq_desc, dq_base, b, h, RowM,
                                   Delta, stat_base, start_n, start_m, offs_n, offs_m, Lq, Lk,
                                   score_scale, IS_CAUSAL, True, True, TMA_REDUCE, D, BLOCK_M,
                                   PRECISION, UPCAST_DOT)
        # Fully visible blocks from a per-program rotation (key blocks of one head do not all
        # reduce into the same dQ rows at once); never a modulo by 0, even with no iteration (a
        # pipelined prologue computes the first row: attention_bwd.py's atomic backward hung so).
        for j in range(0, n_full):
            start_m = mid + ((j + pid_n) % tl.maximum(n_full, 1)) * BLOCK_M
            dk, dv = _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, dq_desc, dq_base, b, h, RowM,
                                   Delta, stat_base, start_n, start_m, offs_n, offs_m, Lq, Lk,
                                   score_scale, IS_CAUSAL, False, True, TMA_REDUCE, D, BLOCK_M,
                                   PRECISION, UPCAST_DOT)

    split64 = split.to(tl.int64)
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    _store_d(DK + split64 * split_stride_dk + b64 * stride_dkb + kvh64 * stride_dkh, dk * sm_scale,
             dk, start_n, Lk, stride_dkn, 1, D, D, 0, BLOCK_N)
    _store_d(DV + split64 * split_stride_dv + b64 * stride_dvb + kvh64 * stride_dvh, dv, dv,
             start_n, Lk, stride_dvn, 1, D, D, 0, BLOCK_N)


@triton.jit
def attention_bwd_dkdv_tma_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Delta, RowM,
    B, Hq, Hkv, kv_group, Lq, Lk, score_scale, sm_scale, group_split,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV of one key block of one KV head (the dK/dV kernel of the atomic-free pair), stored
    by TMA. With ``group_split`` > 1 each program takes a share of the GQA group's query heads
    and stores its partial sums at rows ``split * B + b`` of dk_desc / dv_desc (fp32
    (group_split * B, Hkv, Lk, D) buffers the launcher sums)."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale = (tl.cast(score_scale, tl.float32), tl.cast(sm_scale, tl.float32))
    pid_n, split, b, kvh, heads_per_split, start_n, k, v, dk, dv = _tma_key_block(
        k_desc, v_desc, Lk, Hkv, kv_group, group_split, D, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # Causal: query blocks [lo, mid) hold the diagonal (masked), later ones see every key of
    # this block. Padding keys of a last partial key block need no mask here: they only reach
    # their own dK/dV rows, which the store clips.
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, Lq)
    else:
        lo = 0
        mid = 0
    for g in range(split * heads_per_split, (split + 1) * heads_per_split):
        h = kvh * kv_group + g
        stat_base = (b.to(tl.int64) * Hq + h) * Lq
        if IS_CAUSAL:
            for start_m in range(lo, mid, BLOCK_M):
                dk, dv = _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, q_desc, Delta, b, h, RowM,
                                       Delta, stat_base, start_n, start_m, offs_n, offs_m, Lq, Lk,
                                       score_scale, IS_CAUSAL, True, False, False, D, BLOCK_M,
                                       PRECISION, UPCAST_DOT)
        # Fully visible blocks in order (no atomics to spread out): the programs running
        # together stream the same Q/dO tiles, which L2 then serves (at D 256 a head's Q and dO
        # are 4 MB at N = 4k, read once per key block).
        for start_m in range(mid, Lq, BLOCK_M):
            dk, dv = _tma_bwd_step(k, v, dk, dv, q_desc, do_desc, q_desc, Delta, b, h, RowM, Delta,
                                   stat_base, start_n, start_m, offs_n, offs_m, Lq, Lk,
                                   score_scale, IS_CAUSAL, False, False, False, D, BLOCK_M,
                                   PRECISION, UPCAST_DOT)
    row = split * B + b
    dk_desc.store([row, kvh, start_n, 0],
                  (dk * sm_scale).to(dk_desc.dtype).reshape(1, 1, BLOCK_N, D))
    dv_desc.store([row, kvh, start_n, 0], dv.to(dv_desc.dtype).reshape(1, 1, BLOCK_N, D))


@triton.jit
def _tma_dq_step(q, do, dq, k_desc, v_desc, b, kvh, row_m, delta, start_m, start_n, offs_m,
                 offs_n, Lk, score_scale, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    """dQ += dS K for one key block (unscaled): S and dP = dO V^T recomputed from the tiles."""
    k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    p = tl.exp2(_dot(q, tl.trans(k), PRECISION, UPCAST_DOT) * score_scale - row_m[:, None])
    if MASK:
        cols = start_n + offs_n
        visible = cols[None, :] < Lk
        if IS_CAUSAL:
            visible = visible & ((start_m + offs_m)[:, None] >= cols[None, :])
        p = tl.where(visible, p, 0.0)
    dp = _dot(do, tl.trans(v), PRECISION, UPCAST_DOT)
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    return _dot_acc(ds, k, dq, PRECISION, UPCAST_DOT)


@triton.jit
def attention_bwd_dq_tma_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, Delta, RowM,
    Hq, kv_group, Lq, Lk, score_scale, sm_scale,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ of one query block of one query head (the dQ kernel of the atomic-free pair): dQ =
    scale * sum over its visible key blocks of dS K, stored by TMA in dq_desc's dtype."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale, sm_scale = (tl.cast(score_scale, tl.float32), tl.cast(sm_scale, tl.float32))
    pid_bh, b, h, kvh, start_m = _query_block_program(Lq, Hq, kv_group, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = start_m + offs_m
    row_ok = rows < Lq
    # Padding query rows get RowM = +inf, hence p = 0 (their q/dO rows also read as zeros).
    stat_off = pid_bh.to(tl.int64) * Lq + rows
    row_m = tl.load(RowM + stat_off, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + stat_off, mask=row_ok, other=0.0)
    q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, D)
    do = do_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, D)
    dq = tl.zeros([BLOCK_M, D], tl.float32)

    # Key blocks before ``mid`` are fully visible; [mid, hi) need the mask: the causal diagonal,
    # and a last partial key block (its zero-filled keys would get p = exp2(-RowM), not 0).
    mid = (Lk // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M)
        mid = tl.minimum(mid, (start_m // BLOCK_N) * BLOCK_N)
    else:
        hi = Lk
    for start_n in range(0, mid, BLOCK_N):
        dq = _tma_dq_step(q, do, dq, k_desc, v_desc, b, kvh, row_m, delta, start_m, start_n,
                          offs_m, offs_n, Lk, score_scale, IS_CAUSAL, False, D, BLOCK_N,
                          PRECISION, UPCAST_DOT)
    for start_n in range(mid, hi, BLOCK_N):
        dq = _tma_dq_step(q, do, dq, k_desc, v_desc, b, kvh, row_m, delta, start_m, start_n,
                          offs_m, offs_n, Lk, score_scale, IS_CAUSAL, True, D, BLOCK_N,
                          PRECISION, UPCAST_DOT)
    dq = dq * sm_scale
    dq_desc.store([b, h, start_m, 0], dq.to(dq_desc.dtype).reshape(1, 1, BLOCK_M, D))
