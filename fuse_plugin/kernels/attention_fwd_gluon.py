"""Hopper (sm_90) attention forward in Triton's Gluon dialect, warp-specialised FA3 style.

Why: plain Triton's forward (attention_fwd_tma.py) reaches ~0.80-0.88x of cuDNN on the H100;
Triton 3.6's automatic warp specialisation crashes on it. This kernel does the specialisation by
hand (written against Triton 3.6's Gluon API):

* one program = one (batch, query head, BLOCK_M = 2 * M_WG query rows) tile;
* a 1-warp **producer** partition issues the TMA loads: the two Q sub-tiles, then K and V tiles
  through a ring of ``STAGES`` shared-memory slots (K and V with separate ready / empty barriers,
  K_{j+1} is issued before V_j, as FA3);
* two 4-warp **consumer** warpgroups (the default partition and one worker) each own M_WG query
  rows and run the online softmax over the same K/V tiles (each slot's empty barrier waits for
  both consumers). Inside a consumer the matmuls are software pipelined (FA3's intra-warpgroup
  overlap): S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued back to back as async wgmmas, the
  softmax of S_j runs while the PV wgmma is still in flight. With ``PINGPONG`` the two consumers
  additionally take turns issuing their wgmmas (two mbarriers passed back and forth), so the
  softmax of one warpgroup overlaps the tensor-core work of the other (FA3's inter-warpgroup
  overlap);
* P is fed to the PV wgmma from registers (no shared-memory round trip); O is normalised,
  written to the (dead) Q buffer and stored by TMA; lse (natural log) by a masked store.

Shapes: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) (GQA: query head h reads kv head h // (Hq // Hkv)),
bf16 / fp16, D in {64, 128}, any 16-byte aligned batch/head/sequence strides with unit last
stride. Causal masking is top-left (query i sees keys j <= i, also for Lq != Lk); with a sliding
window (``window`` > 0, Lq <= Lk) query i sees keys i - window < j <= i, and a tile visits only the
key blocks from its first row's window on (those at the window's lower edge masked). The tensors are
addressed through 4-D TMA descriptors with [1, 1, rows, D] blocks, so a tile never reads or
writes another head's rows: out-of-range rows read as zero and are clipped on store.

Importing this module never compiles anything and never fails: without Gluon (older / newer
Triton, CPU-only CI) ``GLUON_AVAILABLE`` is False and the predicate says so.

Measured (H100, stop 10; benchmarks/NOTES.md attempt 14): bf16 D 128 at 4k-16k 0.99-1.08x cuDNN
(the Triton TMA forward: 0.80-0.88x); at D 64 no better than the Triton kernels, which keep those
keys. Ping-pong helps at 16k and fp16, hurts short causal rows: the table picks per key.
kernels/attention.py reaches this kernel through ``launch_forward_gluon`` (AttentionConfig.kernel
"gluon" / "gluon_pingpong"); ``attention_forward_gluon`` is the checked entry for scripts.

``GluonFwdVariant(persistent=True)`` launches ``attention_fwd_gluon_persistent_kernel`` instead: one
program per SM walking the tiles, the next tile's loads and the O store overlapping a tile's end
(for the window's short tiles, NOTES attempt 53). The registry takes it (kernel "gluon_persistent")
for sliding windows over many query tiles, where it measured faster (registry.
GLUON_PERSISTENT_MIN_TILES; H100, stop 37); causal without a window it measured slower.

No softcap (Gemma 2 / Grok logit softcapping): the launcher (kernels/attention.py,
``_softcap_config``) never picks this kernel for a softcapped call; the general kernels take it.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

try:  # Gluon's API moves between Triton releases; this file is written against Triton 3.6.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    _tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
    GLUON_AVAILABLE = _tv == (3, 6)
    _GLUON_WHY_NOT = None if GLUON_AVAILABLE else (
        f"the Gluon forward is written for Triton 3.6 (found {triton.__version__})")
except Exception as _e:  # pragma: no cover - depends on the installed Triton
    GLUON_AVAILABLE = False
    _GLUON_WHY_NOT = f"triton.experimental.gluon is unavailable ({type(_e).__name__}: {_e})"

_LOG2E = 1.4426950408889634


class GluonFwdVariant(NamedTuple):
    """Design knobs of one compiled specialisation."""
    m_wg: int = 64          # query rows per consumer warpgroup (the CTA covers 2 * m_wg)
    block_n: int = 128      # keys per K/V tile
    stages: int = 2         # K/V ring depth
    pingpong: bool = True   # consumers take turns issuing wgmmas
    cons_regs: int = 240    # registers per thread of the worker consumer warpgroup
    load_regs: int = 24     # registers per thread of the producer warp
    maxnreg: int = 168      # launch register limit (default partition gets the remainder)
    persistent: bool = False  # one program per SM walking tiles (AttentionConfig kernel "gluon_persistent")


# Named variants offered to the GPU sweep (head dims each compiles for without spills, checked by
# .devrun/gluon_fwd_compile.py); DEFAULT_VARIANTS picks one per head dim.
VARIANTS = {
    "m64n128s2pp": GluonFwdVariant(64, 128, 2, True),
    "m64n128s2": GluonFwdVariant(64, 128, 2, False),
    "m64n128s3pp": GluonFwdVariant(64, 128, 3, True),
    "m64n64s4pp": GluonFwdVariant(64, 64, 4, True),
    "m64n128s4pp": GluonFwdVariant(64, 128, 4, True),
    "m128n64s3pp": GluonFwdVariant(128, 64, 3, True),
    "m128n64s4pp": GluonFwdVariant(128, 64, 4, True),
}
# m128 keeps a 128 x D fp32 accumulator per consumer: spills at D = 128.
VARIANT_HEAD_DIMS = {
    "m64n128s2pp": (64, 128), "m64n128s2": (64, 128), "m64n128s3pp": (64, 128),
    "m64n64s4pp": (64, 128), "m64n128s4pp": (64,), "m128n64s3pp": (64,), "m128n64s4pp": (64,),
}
DEFAULT_VARIANTS = {64: "m64n128s3pp", 128: "m64n128s2pp"}


def _smem_bytes(v: GluonFwdVariant, D: int, elt: int = 2) -> int:
    o_buffer = 2 * v.m_wg * D if v.persistent else 0  # the persistent kernel's O staging
    return (2 * v.m_wg * D + o_buffer + 2 * v.stages * v.block_n * D) * elt + 1024


def variant_fits(v: GluonFwdVariant, D: int) -> bool:
    return _smem_bytes(v, D) <= 227 * 1024


if GLUON_AVAILABLE:

    @gluon.jit
    def _kv_blocks(start_m, Lk, window, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(n_lo, n_lofull, n_full, n_total), key block indices: the tile visits blocks n_lo ..
        n_total - 1; those before n_full need no causal mask for any of its rows (top-left
        causal: row i sees keys j <= i), those from n_lofull on no window mask (a sliding
        window: row i sees keys j > i - window, so blocks before the first row's window are
        skipped and the blocks at the window's lower edge are masked)."""
        if IS_CAUSAL:
            hi = gl.minimum(Lk, start_m + BLOCK_M)
            n_full = gl.minimum(Lk // BLOCK_N, (start_m + 1) // BLOCK_N)
        else:
            hi = Lk
            n_full = Lk // BLOCK_N
        n_total = gl.cdiv(hi, BLOCK_N)
        if WINDOW:
            n_lo = gl.maximum(start_m - window + 1, 0) // BLOCK_N
            n_lofull = gl.cdiv(gl.maximum(start_m + BLOCK_M - window, 0), BLOCK_N)
        else:
            n_lo = start_m * 0
            n_lofull = start_m * 0
        return n_lo, n_lofull, n_full, n_total

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                  v_ready, v_empty, b, h, kvh, start_m, n_lo, n_total,
                  M_WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Iteration j loads key block n_lo + j (the ring's slots and phases count iterations).
        n_iter = n_total - n_lo
        # Both Q sub-tiles on one barrier.
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + M_WG, 0], q_bar,
                                        q_smem.index(1))
        # K_0, then (K_{j+1}, V_j) pairs: the consumers need K_{j+1} before V_j.
        mbarrier.wait(k_empty.index(0), 1)
        mbarrier.expect(k_ready.index(0), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, kvh, n_lo * BLOCK_N, 0], k_ready.index(0),
                                        k_smem.index(0))
        for j in range(n_iter):
            jn = j + 1
            if jn < n_iter:
                s = jn % STAGES
                mbarrier.wait(k_empty.index(s), ((jn // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [b, kvh, (n_lo + jn) * BLOCK_N, 0],
                                                k_ready.index(s), k_smem.index(s))
            s = j % STAGES
            mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, kvh, (n_lo + j) * BLOCK_N, 0],
                                            v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, rows, start_n, Lk, window, s_layout: gl.constexpr,
                      MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                      BLOCK_N: gl.constexpr):
        """Online-softmax update for one score tile: returns (p, m_new, l_new, alpha)."""
        if MASK:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = gl.expand_dims(cols, 0) < Lk
            if IS_CAUSAL:
                visible = visible & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
            if WINDOW:
                visible = visible & (gl.expand_dims(cols, 0) > gl.expand_dims(rows, 1) - window)
            s = gl.where(visible, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = m_new
            if WINDOW:
                # A window-edge block can hide every key of a row that has seen none yet: its
                # max stays -inf, exponentiated against 0 (p = 0, alpha = 0, not exp2(-inf + inf)).
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
            alpha = gl.exp2(m_i - m_use)
        else:
            # Row max on the raw dots, the scale folded into one FMA per score (scale > 0).
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _consumer_iter(j, start_n, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, o,
                       p_op, m_i, l_i, qk_scale, rows, Lk, window,
                       CID: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       p_layout: gl.constexpr, MASK: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       WINDOW: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_N: gl.constexpr,
                       D: gl.constexpr, STAGES: gl.constexpr, M_WG: gl.constexpr,
                       dtype: gl.constexpr):
        """Iteration j >= 1 of the K/V ring (its key block starts at start_n; the ring's slots and
        phases count j, across tiles in the persistent kernel): S_j = Q K_j^T and O += P_{j-1}
        V_{j-1} in flight together, the softmax of S_j overlapping the PV wgmma."""
        s_idx = j % STAGES
        jp = j - 1
        sp_idx = jp % STAGES
        mbarrier.wait(k_ready.index(s_idx), (j // STAGES) & 1)
        k2d = k_smem.index(s_idx).reshape([BLOCK_N, D])
        if PINGPONG:
            mbarrier.wait(turn.index(CID), (j & 1) ^ (1 - CID))
        s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q2d, k2d.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp_idx), (jp // STAGES) & 1)
        v2d = v_smem.index(sp_idx).reshape([BLOCK_N, D])
        o_tok = warpgroup_mma(p_op, v2d, o, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CID), count=1)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        mbarrier.arrive(k_empty.index(s_idx), count=1)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, rows, start_n, Lk,
                                           window, s_layout, MASK, IS_CAUSAL, WINDOW, BLOCK_N)
        o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_empty.index(sp_idx), count=1)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        o = o * gl.expand_dims(alpha_o, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        return o, p_op, m_i, l_i

    @gluon.jit
    def _kv_ring(k_desc, v_desc, STAGES: gl.constexpr):
        """The K/V ring in shared memory (STAGES K and V tiles), its barriers (ready: the producer's
        TMA; empty: both consumers) and the two ping-pong turns, initialised."""
        dtype: gl.constexpr = k_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        return k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn

    @gluon.jit
    def _tile_scores(g, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, rows, n_lo, n_lofull,
                     n_full, n_total, Lk, window, qk_scale, CID: gl.constexpr, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, p_layout: gl.constexpr, M_WG: gl.constexpr,
                     BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                     WINDOW: gl.constexpr, PINGPONG: gl.constexpr, dtype: gl.constexpr):
        """One tile's key blocks n_lo .. n_total - 1 as ring iterations g, g + 1, ... (g = 0 in the
        per-tile kernel; counted across tiles in the persistent one), every QK^T done; returns
        (o, p_op, m_i, l_i) with the last block's PV still to do (``_last_pv``)."""
        # Block n_lo (always masked: cheap, once), synchronous.
        s0 = g % STAGES
        mbarrier.wait(k_ready.index(s0), (g // STAGES) & 1)
        k2d = k_smem.index(s0).reshape([BLOCK_N, D])
        if PINGPONG:
            mbarrier.wait(turn.index(CID), (g & 1) ^ (1 - CID))
        s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q2d, k2d.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CID), count=1)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(s0), count=1)
        m_i = gl.full([M_WG], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([M_WG], gl.float32, gl.SliceLayout(1, s_layout))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, rows, n_lo * BLOCK_N, Lk, window,
                                           s_layout, True, IS_CAUSAL, WINDOW, BLOCK_N)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o = gl.zeros([M_WG, D], gl.float32, o_layout)

        # The window's masked lower edge, the unmasked blocks, then the masked tail (causal
        # diagonal / partial last block); without a window the first loop is empty.
        j_mid = gl.maximum(gl.minimum(n_lofull, n_full) - n_lo, 1)
        j_tail = gl.maximum(n_full - n_lo, j_mid)
        if WINDOW:
            for j in range(1, j_mid):
                o, p_op, m_i, l_i = _consumer_iter(
                    g + j, (n_lo + j) * BLOCK_N, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                    turn, o, p_op, m_i, l_i, qk_scale, rows, Lk, window, CID, s_layout, o_layout, p_layout,
                    True, IS_CAUSAL, WINDOW, PINGPONG, BLOCK_N, D, STAGES, M_WG, dtype)
        for j in range(j_mid, j_tail):
            o, p_op, m_i, l_i = _consumer_iter(
                g + j, (n_lo + j) * BLOCK_N, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn,
                o, p_op, m_i, l_i, qk_scale, rows, Lk, window, CID, s_layout, o_layout, p_layout, False,
                IS_CAUSAL, WINDOW, PINGPONG, BLOCK_N, D, STAGES, M_WG, dtype)
        for j in range(j_tail, n_total - n_lo):
            o, p_op, m_i, l_i = _consumer_iter(
                g + j, (n_lo + j) * BLOCK_N, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn,
                o, p_op, m_i, l_i, qk_scale, rows, Lk, window, CID, s_layout, o_layout, p_layout, True,
                IS_CAUSAL, WINDOW, PINGPONG, BLOCK_N, D, STAGES, M_WG, dtype)
        return o, p_op, m_i, l_i

    @gluon.jit
    def _last_pv(jl, p_op, o, v_smem, v_ready, v_empty, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 STAGES: gl.constexpr):
        """O += P V for the tile's last block (ring iteration jl); returns O."""
        sl = jl % STAGES
        mbarrier.wait(v_ready.index(sl), (jl // STAGES) & 1)
        v2d = v_smem.index(sl).reshape([BLOCK_N, D])
        o_tok = warpgroup_mma(p_op, v2d, o, is_async=True)
        o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_empty.index(sl), count=1)
        return o

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                  o_desc, lse_ptr, stride_lb, stride_lh, b, h, start_m, n_lo, n_lofull, n_full,
                  n_total, Lq, Lk, window, qk_scale, CID: gl.constexpr, M_WG: gl.constexpr,
                  BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr, PINGPONG: gl.constexpr):
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row0 = start_m + CID * M_WG
        rows = row0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))
        q_tile = q_smem.index(CID)
        q2d = q_tile.reshape([M_WG, D])

        mbarrier.wait(q_bar, 0)
        o, p_op, m_i, l_i = _tile_scores(
            0, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, rows, n_lo, n_lofull, n_full,
            n_total, Lk, window, qk_scale, CID, s_layout, o_layout, p_layout, M_WG, BLOCK_N, D, STAGES,
            IS_CAUSAL, WINDOW, PINGPONG, dtype)
        o = _last_pv(n_total - n_lo - 1, p_op, o, v_smem, v_ready, v_empty, BLOCK_N, D, STAGES)

        # Epilogue: O / l through the Q buffer (dead now) and a TMA store; lse by masked store.
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o = o / gl.expand_dims(l_o, 1)
        q2d.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_tile)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        lse_ptrs = lse_ptr + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows
        gl.store(lse_ptrs, lse, mask=rows < Lq)
        tma.store_wait(0)

    # Integer arguments are not specialised (on divisibility by 16 / == 1): one compile per
    # (dtype, D, causal, variant), whatever the sequence lengths and head counts.
    @gluon.jit(do_not_specialize=["stride_lb", "stride_lh", "Hq", "kv_group", "Lq", "Lk", "window"])
    def attention_fwd_gluon_kernel(
            q_desc, k_desc, v_desc, o_desc, lse_ptr, stride_lb, stride_lh, Hq, kv_group, Lq, Lk,
            window, qk_scale, D: gl.constexpr, M_WG: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
            PINGPONG: gl.constexpr, CONS_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
        BLOCK_M: gl.constexpr = 2 * M_WG
        n_m = gl.cdiv(Lq, BLOCK_M)
        pid = gl.program_id(0)
        pid_m = n_m - 1 - pid % n_m  # causally heaviest tile first
        pid_bh = pid // n_m
        b = pid_bh // Hq
        h = pid_bh % Hq
        kvh = h // kv_group
        start_m = pid_m * BLOCK_M
        n_lo, n_lofull, n_full, n_total = _kv_blocks(start_m, Lk, window, IS_CAUSAL, WINDOW,
                                                     BLOCK_M, BLOCK_N)

        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn = _kv_ring(k_desc, v_desc, STAGES)

        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                         o_desc, lse_ptr, stride_lb, stride_lh, b, h, start_m, n_lo, n_lofull,
                         n_full, n_total, Lq, Lk, window, qk_scale, 0, M_WG, BLOCK_N, D, STAGES,
                         IS_CAUSAL, WINDOW, PINGPONG)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                         o_desc, lse_ptr, stride_lb, stride_lh, b, h, start_m, n_lo, n_lofull,
                         n_full, n_total, Lq, Lk, window, qk_scale, 1, M_WG, BLOCK_N, D, STAGES,
                         IS_CAUSAL, WINDOW, PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                         v_ready, v_empty, b, h, kvh, start_m, n_lo, n_total, M_WG, BLOCK_N,
                         STAGES)),
        ], [4, 1], [CONS_REGS, LOAD_REGS])


    # ---------------------------------------------------------------- the persistent forward
    # One program per SM walks tiles t = pid, pid + P, ... (P programs): the producer loads the next
    # tile's Q and first K/V blocks while the consumers finish the current tile's last PV and its
    # epilogue, and the epilogue's O store (through a buffer of its own, not Q's) completes during
    # the next tile. The K/V ring's slots and phases, and the ping-pong turns, count iterations
    # across tiles (``g``). Checked against float64 on an H100 (tests/test_window.py, stop 37);
    # benchmarks/window_peers.py times it against the per-tile kernel.

    @gluon.jit
    def _tile(t, n_m, Hq, kv_group, BLOCK_M: gl.constexpr):
        """(b, h, kv head, first query row) of tile t: heads outer, query blocks last-first."""
        pid_m = n_m - 1 - t % n_m
        pid_bh = t // n_m
        h = pid_bh % Hq
        return pid_bh // Hq, h, h // kv_group, pid_m * BLOCK_M

    @gluon.jit
    def _producer_p(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                    v_ready, v_empty, n_m, n_tiles, Hq, kv_group, Lk, window, IS_CAUSAL: gl.constexpr,
                    WINDOW: gl.constexpr, M_WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_M: gl.constexpr = 2 * M_WG
        g = 0  # K/V iterations issued so far (all tiles)
        tc = 0  # tiles so far
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            b, h, kvh, start_m = _tile(t, n_m, Hq, kv_group, BLOCK_M)
            n_lo, n_lofull, n_full, n_total = _kv_blocks(start_m, Lk, window, IS_CAUSAL, WINDOW,
                                                         BLOCK_M, BLOCK_N)
            n_iter = n_total - n_lo
            # Q once both consumers are done with the previous tile's (its last QK^T).
            mbarrier.wait(q_empty, (tc & 1) ^ 1)
            mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_ready, q_smem.index(0))
            tma.async_copy_global_to_shared(q_desc, [b, h, start_m + M_WG, 0], q_ready, q_smem.index(1))
            s = g % STAGES
            mbarrier.wait(k_empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, kvh, n_lo * BLOCK_N, 0], k_ready.index(s),
                                            k_smem.index(s))
            for j in range(n_iter):
                jn = g + j + 1
                if j + 1 < n_iter:
                    s = jn % STAGES
                    mbarrier.wait(k_empty.index(s), ((jn // STAGES) & 1) ^ 1)
                    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [b, kvh, (n_lo + j + 1) * BLOCK_N, 0],
                                                    k_ready.index(s), k_smem.index(s))
                jc = g + j
                s = jc % STAGES
                mbarrier.wait(v_empty.index(s), ((jc // STAGES) & 1) ^ 1)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [b, kvh, (n_lo + j) * BLOCK_N, 0],
                                                v_ready.index(s), v_smem.index(s))
            g += n_iter
            tc += 1

    @gluon.jit
    def _consumer_p(q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                    turn, o_desc, lse_ptr, stride_lb, stride_lh, n_m, n_tiles, Hq, kv_group, Lq, Lk,
                    window, qk_scale, CID: gl.constexpr, M_WG: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                    PINGPONG: gl.constexpr):
        BLOCK_M: gl.constexpr = 2 * M_WG
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q2d = q_smem.index(CID).reshape([M_WG, D])
        o_tile = o_smem.index(CID)
        o2d = o_tile.reshape([M_WG, D])
        g = 0
        tc = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            b, h, kvh, start_m = _tile(t, n_m, Hq, kv_group, BLOCK_M)
            n_lo, n_lofull, n_full, n_total = _kv_blocks(start_m, Lk, window, IS_CAUSAL, WINDOW,
                                                         BLOCK_M, BLOCK_N)
            n_iter = n_total - n_lo
            row0 = start_m + CID * M_WG
            rows = row0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))

            mbarrier.wait(q_ready, tc & 1)
            o, p_op, m_i, l_i = _tile_scores(
                g, q2d, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, rows, n_lo, n_lofull, n_full,
                n_total, Lk, window, qk_scale, CID, s_layout, o_layout, p_layout, M_WG, BLOCK_N, D, STAGES,
                IS_CAUSAL, WINDOW, PINGPONG, dtype)
            # Every QK^T of this tile has completed: Q may be overwritten by the next tile's.
            mbarrier.arrive(q_empty, count=1)
            o = _last_pv(g + n_iter - 1, p_op, o, v_smem, v_ready, v_empty, BLOCK_N, D, STAGES)

            # Epilogue through this consumer's O buffer: the previous tile's store from it must
            # have read it; this tile's store completes while the next tile runs.
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            o = o / gl.expand_dims(l_o, 1)
            tma.store_wait(0)
            o2d.store(o.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], o_tile)
            lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            lse_ptrs = lse_ptr + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows
            gl.store(lse_ptrs, lse, mask=rows < Lq)
            g += n_iter
            tc += 1
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["stride_lb", "stride_lh", "Hq", "kv_group", "Lq", "Lk", "window", "n_bh"])
    def attention_fwd_gluon_persistent_kernel(
            q_desc, k_desc, v_desc, o_desc, lse_ptr, stride_lb, stride_lh, Hq, kv_group, Lq, Lk,
            window, qk_scale, n_bh, D: gl.constexpr, M_WG: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
            PINGPONG: gl.constexpr, CONS_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
        BLOCK_M: gl.constexpr = 2 * M_WG
        n_m = gl.cdiv(Lq, BLOCK_M)
        n_tiles = n_m * n_bh
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [2] + o_desc.block_type.shape, o_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)
        k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn = _kv_ring(k_desc, v_desc, STAGES)

        gl.warp_specialize([
            (_consumer_p, (q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, turn, o_desc, lse_ptr, stride_lb, stride_lh, n_m, n_tiles, Hq, kv_group,
                           Lq, Lk, window, qk_scale, 0, M_WG, BLOCK_N, D, STAGES, IS_CAUSAL, WINDOW,
                           PINGPONG)),
            (_consumer_p, (q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, turn, o_desc, lse_ptr, stride_lb, stride_lh, n_m, n_tiles, Hq, kv_group,
                           Lq, Lk, window, qk_scale, 1, M_WG, BLOCK_N, D, STAGES, IS_CAUSAL, WINDOW,
                           PINGPONG)),
            (_producer_p, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                           k_empty, v_ready, v_empty, n_m, n_tiles, Hq, kv_group, Lk, window, IS_CAUSAL,
                           WINDOW, M_WG, BLOCK_N, STAGES)),
        ], [4, 1], [CONS_REGS, LOAD_REGS])


# ------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------


def why_not_gluon_forward(q, k, v, is_causal, scale, window: int = 0) -> Optional[str]:
    """None when ``attention_forward_gluon`` covers this call, else the reason it does not."""
    if not GLUON_AVAILABLE:
        return _GLUON_WHY_NOT
    why = why_not_window(q.shape[2], k.shape[2], is_causal, window)
    if why is not None:
        return why
    import torch
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "tensors are not on a CUDA device"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "the Gluon forward is written for sm_90 (Hopper) only"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (B, H, L, D)"
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        return "v's shape differs from k's (Dv != D is not covered)"
    if Bk != B or Dk != D:
        return "q and k disagree on batch or head dim"
    if D not in (64, 128):
        return f"head dim {D} (64 / 128 only)"
    if Hkv == 0 or Hq % Hkv != 0:
        return "query heads are not a multiple of key/value heads"
    if B * Hq == 0 or Lq == 0 or Lk == 0:
        return "empty problem"
    if not (scale > 0 and math.isfinite(scale)):
        return "scale must be positive and finite"
    if Lq >= 2 ** 31 or Lk >= 2 ** 31:
        return "sequence too long for 32-bit TMA coordinates"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            return f"{name} has a non-unit last-dim stride"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
        for n, st in zip(t.shape[:3], t.stride()[:3]):
            if n > 1 and (st * t.element_size()) % 16:
                return f"{name} has a stride that is not a multiple of 16 bytes"
    if q.device != k.device or q.device != v.device:
        return "tensors on different devices"
    return None


@functools.lru_cache(maxsize=None)
def _layout_for(block, torch_dtype):
    import torch
    gdt = gl.bfloat16 if torch_dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


def _descriptor(t, rows):
    """4-D TMA descriptor of a (B, H, L, D) tensor with [1, 1, rows, D] blocks (size-1 dims get a
    harmless 16-byte stride, as in attention.py)."""
    block = [1, 1, rows, t.shape[3]]
    strides = [st if n > 1 else 16 // t.element_size()
               for n, st in zip(t.shape[:3], t.stride()[:3])] + [1]
    return GluonTensorDescriptor(t, list(t.shape), strides, block,
                                 _layout_for(tuple(block), t.dtype))


def resolve_variant(variant, D: int) -> GluonFwdVariant:
    if variant is None:
        variant = DEFAULT_VARIANTS[D]
    if isinstance(variant, str):
        variant = VARIANTS[variant]
    return GluonFwdVariant(*variant)


def attention_forward_gluon(q, k, v, *, is_causal: bool, scale: float, variant=None, out=None,
                            lse=None, window: int = 0):
    """(out (B, Hq, Lq, D) in q's dtype, lse (B, Hq, Lq) fp32 natural log). ``variant``: a name
    in VARIANTS, a GluonFwdVariant, or None (DEFAULT_VARIANTS by head dim). ``out`` / ``lse``:
    optional preallocated outputs (tests poison them to catch unwritten elements); ``out`` in any
    layout with a unit last stride (its TMA descriptor takes its strides: the op passes (B, Lq,
    Hq, D) memory seen transposed, its own output layout), ``lse`` with a unit last stride.
    ``window``: a sliding window (with is_causal, Lq <= Lk; 0 = none): query i sees keys
    i - window < j <= i, and the blocks before its window are not visited."""
    why = why_not_gluon_forward(q, k, v, is_causal, scale, window)
    if why is not None:
        raise ValueError(f"Gluon forward not applicable: {why}")
    import torch
    B, Hq, Lq, D = q.shape
    var = resolve_variant(variant, D)
    if not variant_fits(var, D):
        raise ValueError(f"variant {var} needs {_smem_bytes(var, D)} bytes of shared memory")
    if out is None:
        out = torch.empty((B, Hq, Lq, D), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(3) == 1  # TMA-stored: any strides
    assert lse.shape == (B, Hq, Lq) and lse.dtype == torch.float32 and lse.stride(2) == 1
    launch_forward_gluon(q, k, v, out, lse, is_causal, scale, var, window)
    return out, lse


def why_not_window(Lq: int, Lk: int, is_causal: bool, window: int) -> Optional[str]:
    """None when the Gluon kernels run this sliding window (0: none), else why not: with
    is_causal only, and Lq <= Lk, where every row sees at least its own key (a row that sees
    none would need eager's NaN, which these kernels do not write)."""
    if not window:
        return None
    if window < 0 or not is_causal:
        return f"a sliding window needs is_causal and window >= 1, got window={window}"
    if Lq > Lk:
        return f"a sliding window with more queries than keys ({Lq} > {Lk})"
    return None


def launch_forward_gluon(q, k, v, out, lse, is_causal, scale, var: GluonFwdVariant,
                         window: int = 0) -> None:
    """The launch alone, for callers that have checked the problem (kernels/attention.py):
    out (B, Hq, Lq, D) with a unit last stride (any layout: TMA-stored) and lse (B, Hq, Lq) fp32 with
    unit last stride."""
    grid, args, kwargs = _launch_args(q, k, v, out, lse, is_causal, scale, var, window)
    kernel = attention_fwd_gluon_persistent_kernel if var.persistent else attention_fwd_gluon_kernel
    kernel[grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    import torch
    if getattr(device, "type", "cuda") != "cuda" or not torch.cuda.is_available():
        return 132  # the local compile check (no GPU): an H100's count
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_args(q, k, v, out, lse, is_causal, scale, var: GluonFwdVariant, window: int = 0):
    """(grid, args, kwargs) of one kernel launch (also used by the local compile check)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    grid = (-(-Lq // (2 * var.m_wg)) * B * Hq,)  # not triton.cdiv: slow from Python
    args = (_descriptor(q, var.m_wg), _descriptor(k, var.block_n), _descriptor(v, var.block_n),
            _descriptor(out, var.m_wg), lse, lse.stride(0), lse.stride(1), Hq, Hq // Hkv, Lq, Lk,
            int(window), float(scale) * _LOG2E)
    if var.persistent:  # one program per SM (at most one per tile), the (batch, head) count passed
        grid = (min(grid[0], _sm_count(q.device)),)
        args = args + (B * Hq,)
    kwargs = dict(D=D, M_WG=var.m_wg, BLOCK_N=var.block_n, STAGES=var.stages,
                  IS_CAUSAL=bool(is_causal), WINDOW=bool(window), PINGPONG=bool(var.pingpong),
                  CONS_REGS=var.cons_regs, LOAD_REGS=var.load_regs, num_warps=4,
                  maxnreg=var.maxnreg)
    return grid, args, kwargs
