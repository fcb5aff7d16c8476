"""Hopper forward of the plain attention case: tiles loaded by TMA through tensor descriptors.

The general forward (attention_fwd.py) loads its tiles with pointer arithmetic and masks. On
sm_90 Triton lowers a tensor-descriptor load to a TMA bulk copy into shared memory, which frees
the registers and issue slots the address and mask math took, and lets the pipeliner keep more
key/value tiles in flight. This kernel covers only the common case: no bias, no dropout, no rope,
``Dv == D`` with ``D`` in {64, 128}, a positive scale, 2-byte dtypes, and q/k/v/out whose
sequence strides are 16-byte multiples with unit head-dim stride (TMA's requirements); the
launcher sends everything else to the general kernel. Whether it runs is a table choice
(``AttentionConfig.tma``; on the H100 it wins the D 128 forward, NOTES.md, stop 9).

Shapes: q/out (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) with any batch/head/sequence strides, lse
(B, Hq, Lq) fp32 in natural-log units. Each tensor comes as a host-side 4-D tensor descriptor
over its (B, H, L, D) view with [1, 1, BLOCK, D] blocks (``kernels/attention.py``,
``_tma_descriptor``), so a block's bounds are its head's rows: out-of-range rows read as zero and
are never written. Same program order, causal alignment (top-left) and numerics as the general
kernel. (Host-side descriptors measured 1.5-9% faster than building them in each program with
``tl.make_tensor_descriptor``, most at N = 1k: NOTES.md, stop 9.)

Under Triton's CPU interpreter the same code runs (how CI tests it); bf16 dots are widened there
(``UPCAST_DOT``) as in the general kernel.

No softcap (Gemma 2 / Grok logit softcapping): the launcher (kernels/attention.py,
``_softcap_config``) never picks this kernel for a softcapped call; the general kernels take it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import _LN2, _dot, _dot_acc, _key_blocks


@triton.jit
def _tma_fwd_step(q, k_desc, v_desc, b, kvh, m_i, l_i, acc, start_m, start_n, offs_m, offs_n, Lk,
                  qk_scale, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One key block of the online softmax; MASK: the causal diagonal / last partial block."""
    k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    qk = _dot(q, k.T, PRECISION, UPCAST_DOT)
    if MASK:
        cols = start_n + offs_n
        visible = cols[None, :] < Lk
        if IS_CAUSAL:
            visible = visible & (offs_m[:, None] >= cols[None, :])
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        # The row max on the raw dots, the scale folded into one FMA per score (scale > 0).
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, D)
    acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def attention_fwd_tma_kernel(
    q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh,
    Hq, kv_group, Lq, Lk, qk_scale,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # 1-D grid, query blocks of one head adjacent, the causally heaviest block first (as the
    # general kernel).
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    pid_bh = pid // n_m_blocks
    b = pid_bh // Hq
    h = pid_bh % Hq
    kvh = h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # Top-left causal: every row sees key 0, so each row's max is finite after its first block
    # (no -inf guard needed).
    _, _, full_end, hi = _key_blocks(start_m, Lk, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _tma_fwd_step(q, k_desc, v_desc, b, kvh, m_i, l_i, acc, start_m, start_n,
                                      offs_m, offs_n, Lk, qk_scale, IS_CAUSAL, False, D, BLOCK_N,
                                      PRECISION, UPCAST_DOT)
    for start_n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _tma_fwd_step(q, k_desc, v_desc, b, kvh, m_i, l_i, acc, start_m, start_n,
                                      offs_m, offs_n, Lk, qk_scale, IS_CAUSAL, True, D, BLOCK_N,
                                      PRECISION, UPCAST_DOT)

    out = (acc / l_i[:, None]).to(o_desc.dtype)
    o_desc.store([b, h, start_m, 0], out.reshape(1, 1, BLOCK_M, D))
    lse = (m_i + tl.log2(l_i)) * _LN2
    tl.store(Lse + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m, lse,
             mask=offs_m < Lq)
