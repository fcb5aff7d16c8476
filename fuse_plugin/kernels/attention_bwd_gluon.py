"""Hopper (sm_90) flash-attention backward written in Gluon with explicit warp specialisation.

FA3-style design (one CTA per key block of BLOCK_N keys x kv head x batch x share of the GQA group):

* Partitions (``gl.warp_specialize``):
  - default partition = the MMA consumers, ``num_warps`` = 8 (two warpgroups). Every [BLOCK_N, *]
    wgmma is split by rows over the two warpgroups (warps_per_cta [8, 1]), so each warpgroup owns
    BLOCK_N / 2 keys, FA3's "2 consumer warpgroups, 64 keys each".
  - worker 0 = TMA producer (1 warp): loads K and V once, then streams the Q and dO tiles of every
    query block (of every query head of its share of the GQA group) through a STAGES-deep
    mbarrier ring (ready: TMA transaction count; empty: released by the consumers once the
    wgmmas that read the stage have retired).
  - worker 1 = dQ writer (1 warp): the consumers park each fp32 dQ tile in shared memory
    (2 buffers) and this warp adds it to global memory with fp32 atomics, so the atomics never
    sit on the MMA warps' critical path.
  Workers get 24 registers at D128 (the consumers keep 240; with 32-register workers they get
  232 and ptxas serialises every wgmma of the causal / masked-key specialisations, C7512), 32 at
  D64 (the writer would spill at 24; the consumers have room anyway).
  ``.devrun/gluon_bwd_compile.py`` reports registers, spills and C7512 per specialisation.
* Per query block (BLOCK_M queries), in the consumer warpgroups (transposed formulation, keys are
  the M dimension of every wgmma):
    S^T  = K Q^T            (smem x smem, async)       P^T  = exp2(S^T * scale*log2e - lse2)
    dP^T = V dO^T           (smem x smem, async)       dS^T = P^T * (dP^T - Delta)
    dV  += P^T dO           (registers x smem, async)  dK  += dS^T Q (registers x smem, async)
    dS^T -> shared memory,  dQ = dS K = (dS^T)^T K     (smem (transposed view) x smem, async)
  The dV wgmma is issued before dS is computed, the dK / dQ wgmmas are in flight together.
* dQ: fp32 atomics (relaxed, by the writer warp) into a zeroed (B, Hq, LQ_PAD, D) fp32 buffer
  padded to whole query blocks, so no row mask is needed and no neighbouring head is touched; a
  small Triton kernel scales by ``scale`` and casts into dq (any strides).
* Preprocess (plain Triton): Delta = rowsum(dO * O) and lse2 = lse * log2(e) into padded
  (B, Hq, LQ_PAD) fp32 buffers (padding rows: Delta 0, lse2 +inf so P = 0 exactly there), and
  zeroes the dQ accumulator.
* Tiles beyond the tensor ends: all TMA descriptors are rank 4 ((B, H, L, D), block
  [1, 1, rows, D]) over the real tensors, so out-of-range rows read as zeros and never come from
  the neighbouring head; the dK/dV TMA stores are clipped the same way. Keys >= Lk are masked
  out of P (when Lk % BLOCK_N != 0) so no inf * 0 can reach dQ.

Grid: 1-D, one program per (key block, b, kv head, share of the GQA group). ``group_split`` S > 1
shares each group's Hq/Hkv query heads over S programs (more, shorter CTAs for GQA); their dK / dV
go out as fp32 per-share partials, summed and cast by a small Triton kernel
(``_gluon_bwd_split_sum``). Variants: ``m64n128s2x`` (default) runs the programs row-major, key
block fastest; ``m64n128s2xl`` orders causal launches LPT, heaviest key block first, inside
sections of rows whose Q / dO / dQ accumulator fit ``LPT_MB`` MiB of L2 (non-causal ones as x).

Measured (H100, stop 10): kept x (consumer registers 240: without it ptxas serialised every
wgmma, warning C7512) and xl (LPT order of key blocks, L2 sections). Lost: consumers issuing the
dQ atomics themselves (no writer warp) -10-20%, dS from the rounded P -7-15%, 3 stages no gain,
pure LPT without L2 sections -25% on causal, dK/dV partial sums by atomics instead of a sum
kernel -2-5%.

Semantics: top-left causal (key j visible to query i iff j <= i), also for Lq != Lk; a sliding
window (``window`` > 0, Lq <= Lk: also i - window < j), each key block's program then visiting
only the query blocks that see it; GQA with
query head h -> kv head h // (Hq // Hkv); bf16 / fp16; D in {64, 128}; arbitrary strides with
unit last stride and 16-byte aligned other strides.

Importing this module never compiles anything; when Gluon (or its Hopper API as of triton 3.6)
is missing, ``GLUON_AVAILABLE`` is False and ``why_not_gluon_backward`` says so.

No softcap (Gemma 2 / Grok logit softcapping): the launcher (kernels/attention.py,
``_softcap_config``) never picks this kernel for a softcapped call; the general kernels take it.
"""


import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .attention_fwd_gluon import why_not_window
from .host import layout_like, sm_count
from .launch import aligned16, tma_strides_ok

GLUON_AVAILABLE = False
_GLUON_IMPORT_ERROR = None
try:  # triton >= 3.6 with the Gluon Hopper API (warp_specialize(fns_and_args, warps, regs))
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        tma as _tma,
        mbarrier as _mbarrier,
        fence_async_shared as _fence_async_shared,
        warpgroup_mma as _wgmma,
        warpgroup_mma_wait as _wgmma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonTensorDescriptor
    import inspect as _inspect

    # The 3.6 signature; later versions changed it (and the tma op names), so refuse them.
    _ws_params = list(_inspect.signature(gl.warp_specialize).parameters)
    if _ws_params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        raise ImportError(f"unsupported gl.warp_specialize signature {_ws_params}")
    if not hasattr(_tma, "async_copy_global_to_shared"):
        raise ImportError("gluon hopper tma has no async_copy_global_to_shared")
    GLUON_AVAILABLE = True
except Exception as _e:  # pragma: no cover - depends on the installed triton
    _GLUON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"
    GLUON_AVAILABLE = False

LOG2E = 1.4426950408889634
_TESTED_TRITON = ("3.6", )  # Gluon changes between releases; other versions are refused by the predicate

# ----------------------------------------------------------------------------------------------
# Variants: name -> launch knobs (per head dim). BLOCK_N is the key block of one CTA (rows of the
# wgmmas, split over the two consumer warpgroups), BLOCK_M the query block of one iteration.
# ----------------------------------------------------------------------------------------------
# Worker (producer, dQ writer) registers per head dim, see the module docstring. 12 warps: 8 consumer
# warps + the worker warpgroup; MAXNREG 168 * 384 threads = 64512 <= 64K registers, and triton gives
# the consumers what the workers leave (240 with 24-register workers, 232 with 32).
_WORKER_REGS = {128: 24, 64: 32}
_BASE = dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, PRODUCER_REGS=_WORKER_REGS, WRITER_PASSES=4, MAXNREG=168)
VARIANTS = {
    # 128 keys (2 warpgroups x 64) x 64 queries per step, 2-stage Q/dO ring, dQ writer warp;
    # programs row-major (key block fastest).
    "m64n128s2x": dict(_BASE, LPT_MB=0),
    # s2x with causal LPT program order: sections of (b, kv head, share) rows whose Q / dO / dQ
    # accumulator fit LPT_MB MiB of L2, heaviest key blocks first inside a section. Non-causal
    # launches are the same as s2x.
    "m64n128s2xl": dict(_BASE, LPT_MB=32),
}
DEFAULT_VARIANT = {128: "m64n128s2x", 64: "m64n128s2x"}
VARIANT_HEAD_DIMS = {name: (64, 128) for name in VARIANTS}


# ----------------------------------------------------------------------------------------------
# Plain Triton pre/post-processing
# ----------------------------------------------------------------------------------------------
@triton.jit
def _row_block(Hq, Lq, D: tl.constexpr, BLOCK: tl.constexpr):
    """This program's (b, h, b * Hq + h, BLOCK rows, D cols, rows < Lq): grid (row blocks, B * Hq)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return bh // Hq, bh % Hq, bh, rows, tl.arange(0, D), rows < Lq


@triton.jit
def _gluon_bwd_preprocess(o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, dqacc_ptr,  #
                          so_b, so_h, so_l, sdo_b, sdo_h, sdo_l, slse_b, slse_h, slse_l,  #
                          Hq, Lq, LQ_PAD,  #
                          D: tl.constexpr, BLOCK: tl.constexpr):
    b, h, bh, rows, cols, inb = _row_block(Hq, Lq, D, BLOCK)
    o = tl.load(o_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + rows[:, None].to(tl.int64) * so_l
                + cols[None, :], mask=inb[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h + rows[:, None].to(tl.int64) * sdo_l
                 + cols[None, :], mask=inb[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    lse = tl.load(lse_ptr + b.to(tl.int64) * slse_b + h.to(tl.int64) * slse_h + rows.to(tl.int64) * slse_l,
                  mask=inb, other=0.0)
    lse2 = tl.where(inb, lse * 1.4426950408889634, float("inf"))
    base = bh.to(tl.int64) * LQ_PAD
    tl.store(delta_ptr + base + rows, delta)
    tl.store(lse2_ptr + base + rows, lse2)
    tl.store(dqacc_ptr + (base + rows[:, None]) * D + cols[None, :], tl.zeros([BLOCK, D], dtype=tl.float32))


@triton.jit
def _gluon_bwd_dq_cast(dqacc_ptr, dq_ptr, sdq_b, sdq_h, sdq_l, Hq, Lq, LQ_PAD, scale,  #
                       D: tl.constexpr, BLOCK: tl.constexpr):
    b, h, bh, rows, cols, inb = _row_block(Hq, Lq, D, BLOCK)
    acc = tl.load(dqacc_ptr + (bh.to(tl.int64) * LQ_PAD + rows[:, None]) * D + cols[None, :], mask=inb[:, None],
                  other=0.0)
    tl.store(dq_ptr + b.to(tl.int64) * sdq_b + h.to(tl.int64) * sdq_h + rows[:, None].to(tl.int64) * sdq_l
             + cols[None, :], (acc * scale).to(dq_ptr.dtype.element_ty), mask=inb[:, None])


@triton.jit
def _gluon_bwd_split_sum(part_ptr, dk_ptr, dv_ptr, numel, Hkv, Lk, sdk_b, sdk_h, sdk_l, sdv_b, sdv_h, sdv_l,  #
                         S: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """dk / dv (B, Hkv, Lk, D) in the input dtype, any strides with a unit last one (laid out as k
    and v) = sum over S of the fp32 (2, S, numel) partials, contiguous (B, Hkv, Lk, D) each."""
    pid = tl.program_id(0)
    which = tl.program_id(1)  # 0: dk, 1: dv
    n64 = numel.to(tl.int64)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n64
    src = part_ptr + which.to(tl.int64) * S * n64 + offs
    acc = tl.load(src, mask=inb, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(src + s * n64, mask=inb, other=0.0)
    d = offs % D
    row = offs // D
    lk = row % Lk
    bh = row // Lk
    h = bh % Hkv
    b = bh // Hkv
    if which == 0:
        tl.store(dk_ptr + b * sdk_b + h * sdk_h + lk * sdk_l + d, acc.to(dk_ptr.dtype.element_ty), mask=inb)
    else:
        tl.store(dv_ptr + b * sdv_b + h * sdv_h + lk * sdv_l + d, acc.to(dv_ptr.dtype.element_ty), mask=inb)


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def _mma_warps(M, num_warps):
        # warps along M first (16 rows per warp, a warpgroup needs 64 rows), the rest along N
        wm = min(num_warps, max(M // 16, 4))
        return [wm, num_warps // wm]

    @gluon.constexpr_function
    def _mma_instr_n(M, N, num_warps):
        wm = min(num_warps, max(M // 16, 4))
        return min(N // (num_warps // wm), 256)

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,  #
                  q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,  #
                  kv_bar, ready_bars, empty_bars, dq_smem, dq_ready, dq_empty, dqacc_ptr,  #
                  off_b, off_hkv, h0, Hq, n_start, GS, m_start, n_m, LQ_PAD,  #
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,  #
                  STAGES: gl.constexpr, WRITER_PASSES: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_l4: gl.constexpr = q_desc.layout
        k_l4: gl.constexpr = k_desc.layout
        # K and V once (rank-4 TMA over (B, H, L, D): rows past Lk read as zeros).
        _mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, n_start, 0], kv_bar,
                                         k_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_l4))
        _tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, n_start, 0], kv_bar,
                                         v_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_l4))
        nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes
        t = 0
        for g in range(GS):
            hq = h0 + g
            row = off_b * Hq + hq
            for mi in range(m_start, n_m):
                s = t % STAGES
                ph = (t // STAGES) & 1
                m0 = mi * BLOCK_M
                _mbarrier.wait(empty_bars.index(s), ph ^ 1)
                bar = ready_bars.index(s)
                _mbarrier.expect(bar, nbytes)
                _tma.async_copy_global_to_shared(q_desc, [off_b, hq, m0, 0], bar,
                                                 q_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_l4))
                _tma.async_copy_global_to_shared(do_desc, [off_b, hq, m0, 0], bar,
                                                 do_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_l4))
                _tma.async_copy_global_to_shared(lse_desc, [row, m0], bar, lse_smem.index(s))
                _tma.async_copy_global_to_shared(delta_desc, [row, m0], bar, delta_smem.index(s))
                t += 1

    @gluon.jit
    def _dq_writer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,  #
                   q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,  #
                   kv_bar, ready_bars, empty_bars, dq_smem, dq_ready, dq_empty, dqacc_ptr,  #
                   off_b, off_hkv, h0, Hq, n_start, GS, m_start, n_m, LQ_PAD,  #
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,  #
                   STAGES: gl.constexpr, WRITER_PASSES: gl.constexpr):
        # 1 warp: 4 consecutive fp32 per thread (16-byte smem reads), HEAD_DIM/4 threads per row.
        TPR: gl.constexpr = HEAD_DIM // 4
        CH: gl.constexpr = 32 // TPR
        ROWS: gl.constexpr = CH * WRITER_PASSES  # WRITER_PASSES x 4 fp32 per thread per chunk
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [CH, TPR], [1, 1], [1, 0])
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        offs = rows[:, None] * HEAD_DIM + cols[None, :]
        t = 0
        for g in range(GS):
            hq = h0 + g
            head_base = dqacc_ptr + (off_b * Hq + hq).to(gl.int64) * LQ_PAD * HEAD_DIM
            for mi in range(m_start, n_m):
                slot = t % 2
                _mbarrier.wait(dq_ready.index(slot), (t // 2) & 1)
                buf = dq_smem.index(slot)
                base = head_base + mi * (BLOCK_M * HEAD_DIM)
                for r in gl.static_range(0, BLOCK_M, ROWS):
                    vals = buf.slice(r, ROWS, dim=0).load(layout)
                    gl.atomic_add(base + r * HEAD_DIM + offs, vals, sem="relaxed")
                _mbarrier.arrive(dq_empty.index(slot))
                t += 1

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, ready_bars, empty_bars,  #
                  dq_smem, dq_ready, dq_empty,  #
                  n_start, GS, m_start, n_m, Lk, window, qk_scale,  #
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,  #
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, MASK_K: gl.constexpr,  #
                  num_warps: gl.constexpr):
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=_mma_warps(BLOCK_N, num_warps),
            instr_shape=[16, _mma_instr_n(BLOCK_N, BLOCK_M, num_warps), 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=_mma_warps(BLOCK_N, num_warps),
            instr_shape=[16, _mma_instr_n(BLOCK_N, HEAD_DIM, num_warps), 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=_mma_warps(BLOCK_M, num_warps),
            instr_shape=[16, _mma_instr_n(BLOCK_M, HEAD_DIM, num_warps), 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        vec_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)

        _mbarrier.wait(kv_bar, 0)
        t = 0
        for g in range(GS):
            for mi in range(m_start, n_m):
                s = t % STAGES
                m0 = mi * BLOCK_M
                q_t = q_smem.index(s)
                do_t = do_smem.index(s)
                _mbarrier.wait(ready_bars.index(s), (t // STAGES) & 1)
                st = _wgmma(k_smem, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt = _wgmma(v_smem, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                # lse2 (padding rows: +inf -> P = 0) and Delta of this query block, from smem.
                lse2 = lse_smem.index(s)._reinterpret(gl.float32, [BLOCK_M], vec_sl).load(col_layout)
                st = _wgmma_wait(1, deps=(st, ))
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                if CAUSAL:
                    if m0 < n_start + BLOCK_N:  # block touches the diagonal: key j visible iff j <= i
                        keys = n_start + gl.arange(0, BLOCK_N, layout=row_layout)
                        qidx = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
                        pt = gl.where(keys[:, None] <= qidx[None, :], pt, 0.0)
                if WINDOW:
                    if m0 + BLOCK_M > n_start + window:  # past the window's edge: j visible iff j > i - window
                        keys = n_start + gl.arange(0, BLOCK_N, layout=row_layout)
                        qidx = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
                        pt = gl.where(keys[:, None] > qidx[None, :] - window, pt, 0.0)
                if MASK_K:  # zero-filled K rows past Lk: keep them out of P (no inf * 0 in dQ)
                    if n_start + BLOCK_N > Lk:
                        keys = n_start + gl.arange(0, BLOCK_N, layout=row_layout)
                        pt = gl.where((keys < Lk)[:, None], pt, 0.0)
                pt16 = pt.to(dtype)
                dv = _wgmma(gl.convert_layout(pt16, a_layout), do_t, dv, is_async=True)
                delta = delta_smem.index(s)._reinterpret(gl.float32, [BLOCK_M], vec_sl).load(col_layout)
                dpt = _wgmma_wait(1, deps=(dpt, ))
                dst16 = (pt * (dpt - delta[None, :])).to(dtype)
                dk = _wgmma(gl.convert_layout(dst16, a_layout), q_t, dk, is_async=True)
                ds_smem.store(dst16)
                _fence_async_shared()
                dq = _wgmma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
                dv, dk, dq = _wgmma_wait(0, deps=(dv, dk, dq))
                # Both warpgroups' wgmmas (which read this Q/dO stage and all of ds_smem) have retired
                # before the single elected arrive releases the stage / the next dS store.
                gl.thread_barrier()
                _mbarrier.arrive(empty_bars.index(s))
                # dQ tile -> a free smem buffer, added to global memory by the writer warp.
                slot = t % 2
                _mbarrier.wait(dq_empty.index(slot), ((t // 2) & 1) ^ 1)
                dq_smem.index(slot).store(dq)
                gl.thread_barrier()  # every consumer thread's part of the tile is in smem
                _mbarrier.arrive(dq_ready.index(slot))
                t += 1
        return dk, dv

    @gluon.jit(do_not_specialize=["B", "Hq", "Hkv", "Lq", "Lk", "LQ_PAD", "SPLIT", "SW", "window"])
    def _attn_bwd_ws_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, delta_desc,  #
                            dqacc_ptr, dkp_ptr, dvp_ptr, B, Hq, Hkv, Lq, Lk, LQ_PAD, SPLIT, SW, window,  #
                            qk_scale, dk_scale,  #
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,  #
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,  #
                            MASK_K: gl.constexpr,  #
                            PRODUCER_REGS: gl.constexpr,  #
                            LPT: gl.constexpr, DKV_OUT: gl.constexpr, WRITER_PASSES: gl.constexpr,  #
                            num_warps: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        # 1-D grid of n_nb * R programs, R = B * Hkv * SPLIT "rows" (row = (b, kv head, share of the
        # GQA group), the share fastest). LPT: rows in sections of SW (the host sizes a section's
        # Q / dO / dQ-accumulator to stay L2 resident), inside a section the key block is the slow
        # index, so the causally heaviest key blocks (block 0 sees every query block) start first.
        # Without LPT: row-major, key block fastest (every section is one row).
        pid = gl.program_id(0)
        n_nb = gl.cdiv(Lk, BLOCK_N)
        if LPT:
            sec_size = SW * n_nb
            sec = pid // sec_size
            within = pid - sec * sec_size
            rows_here = gl.minimum(SW, B * Hkv * SPLIT - sec * SW)
            pid_n = within // rows_here
            row = sec * SW + (within - pid_n * rows_here)
        else:
            pid_n = pid % n_nb
            row = pid // n_nb
        split = row % SPLIT
        pid_bh = row // SPLIT
        off_b = pid_bh // Hkv
        off_hkv = pid_bh % Hkv
        G = Hq // Hkv
        GS = G // SPLIT  # query heads of this program: h0 .. h0 + GS - 1
        h0 = off_hkv * G + split * GS
        n_start = pid_n * BLOCK_N
        n_m = gl.cdiv(Lq, BLOCK_M)
        if WINDOW:  # the last query that sees this block's last key: n_start + BLOCK_N - 2 + window
            n_m = gl.minimum(n_m, gl.cdiv(n_start + BLOCK_N - 1 + window, BLOCK_M))
        if CAUSAL:
            m_start = n_start // BLOCK_M  # first query block with a query i >= n_start
        else:
            m_start = n_start * 0

        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_sl)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_sl)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_sl)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
        # 4-row XOR swizzle of 16-byte groups: 2-way conflicts for the consumers' wgmma-layout
        # store, conflict-free 16-byte row reads for the writer, 4-row slices stay legal.
        dq_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=4, order=[1, 0])
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_sl)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], _mbarrier.MBarrierLayout())
        ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _mbarrier.MBarrierLayout())
        dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], _mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], _mbarrier.MBarrierLayout())
        _mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            _mbarrier.init(ready_bars.index(i), count=1)
            _mbarrier.init(empty_bars.index(i), count=1)
        for i in gl.static_range(2):
            _mbarrier.init(dq_ready.index(i), count=1)
            _mbarrier.init(dq_empty.index(i), count=1)

        # (argument tuples must be written inline: a tuple bound to a name first turns the
        #  constexprs in it into runtime values in triton 3.6)
        dk, dv = gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, ready_bars,
                         empty_bars, dq_smem, dq_ready, dq_empty,  #
                         n_start, GS, m_start, n_m, Lk, window, qk_scale,  #
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, WINDOW, MASK_K, num_warps)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,  #
                         q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,  #
                         kv_bar, ready_bars, empty_bars, dq_smem, dq_ready, dq_empty, dqacc_ptr,  #
                         off_b, off_hkv, h0, Hq, n_start, GS, m_start, n_m, LQ_PAD,  #
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, WRITER_PASSES)),
            (_dq_writer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,  #
                          q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,  #
                          kv_bar, ready_bars, empty_bars, dq_smem, dq_ready, dq_empty, dqacc_ptr,  #
                          off_b, off_hkv, h0, Hq, n_start, GS, m_start, n_m, LQ_PAD,  #
                          BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, WRITER_PASSES)),
        ], [1, 1], [PRODUCER_REGS, PRODUCER_REGS])

        if DKV_OUT == 0:
            # Epilogue: every wgmma has retired and every TMA load was consumed -> reuse the K / V smem.
            k_l4: gl.constexpr = k_desc.layout
            k_smem.store((dk * dk_scale).to(dtype))
            v_smem.store(dv.to(dtype))
            _fence_async_shared()
            _tma.async_copy_shared_to_global(dk_desc, [off_b, off_hkv, n_start, 0],
                                             k_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_l4))
            _tma.async_copy_shared_to_global(dv_desc, [off_b, off_hkv, n_start, 0],
                                             v_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_l4))
            _tma.store_wait(0)
        else:
            # GQA group split: fp32 dK / dV straight from the wgmma registers (each quad of threads
            # writes 32 contiguous bytes of a row, whole sectors) into this share's slice of the
            # (SPLIT, B, Hkv, Lk, D) partial buffers; _gluon_bwd_split_sum sums and casts them.
            kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=_mma_warps(BLOCK_N, num_warps),
                instr_shape=[16, _mma_instr_n(BLOCK_N, HEAD_DIM, num_warps), 16])
            rows = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
            offs = rows[:, None] * HEAD_DIM + cols[None, :]
            inb = (rows < Lk)[:, None] & (cols < HEAD_DIM)[None, :]
            base = ((split * B + off_b) * Hkv + off_hkv).to(gl.int64) * Lk * HEAD_DIM
            gl.store(dkp_ptr + base + offs, dk * dk_scale, mask=inb)
            gl.store(dvp_ptr + base + offs, dv, mask=inb)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
_PAD = 128  # query padding of the lse2 / Delta / dQ-accumulator buffers (multiple of every BLOCK_M)
_PRE_BLOCK = 64
_SUM_BLOCK = 2048
_NUM_WARPS = 8  # consumer warps (two warpgroups)


def _gl_dtype(dt: torch.dtype):
    return gl.bfloat16 if dt == torch.bfloat16 else gl.float16


def variant_config(variant: Optional[str], head_dim: int) -> dict:
    name = variant or DEFAULT_VARIANT[head_dim]
    if name not in VARIANTS:
        raise ValueError(f"unknown gluon backward variant {name!r}; known: {sorted(VARIANTS)}")
    if head_dim not in VARIANT_HEAD_DIMS[name]:
        raise ValueError(f"variant {name!r} does not support head dim {head_dim}")
    return dict(VARIANTS[name], name=name)


def _per_dim(knob, head_dim: int):
    return knob[head_dim] if isinstance(knob, dict) else knob


def kernel_constexprs(cfg: dict, head_dim: int, causal: bool, mask_k: bool, dkv_out: int = 0,
                      window: int = 0) -> dict:
    """The constexpr arguments of _attn_bwd_ws_kernel for one specialisation (shared with the
    local compile script). ``dkv_out``: 0 dK/dV stored by TMA in the input dtype (no group split),
    1 fp32 per-share partials (group split > 1). ``window``: a sliding window (0: none)."""
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=head_dim, STAGES=cfg["STAGES"],
                CAUSAL=bool(causal), WINDOW=bool(window), MASK_K=bool(mask_k),
                PRODUCER_REGS=_per_dim(cfg["PRODUCER_REGS"], head_dim), LPT=bool(cfg["LPT_MB"]) and bool(causal),
                DKV_OUT=int(dkv_out),
                WRITER_PASSES=cfg["WRITER_PASSES"])


# With a sliding window every program does the same work (the query blocks of one window), so a
# split buys no balance, only its partials' extra pass: measured (H100, bf16, D 128, GQA 32/8, W 4096,
# benchmarks/window_profile.py --splits): at 1024 / 2048 unsplit programs (16k / 32k tokens) the
# backward took 5.29 / 11.26 ms unsplit, 5.33 / 11.46 split 2, 5.49 / 12.76 split 4 (the old rule's).
WINDOW_PROGRAMS_PER_SM = 8


def default_group_split(programs: int, kv_group: int, sms: int, window: bool = False) -> int:
    """Same rule as the Triton backward's ``_group_split`` (kernels/attention.py): share a GQA
    group's query heads over up to 4 programs (a power of 2 dividing the group) while the grid
    stays within 32 programs per SM (``WINDOW_PROGRAMS_PER_SM`` with a window: split only
    where the unsplit grid leaves SMs idle). ``programs``: key blocks x B x Hkv (the unsplit grid)."""
    per_sm = WINDOW_PROGRAMS_PER_SM if window else 32
    split = 1
    while split < 4 and kv_group % (2 * split) == 0 and programs * 2 * split <= per_sm * sms:
        split *= 2
    return split


def lpt_section_rows(cfg: dict, rows: int, lq_pad: int, head_dim: int, elt: int) -> int:
    """Rows (b, kv head, share) per LPT section: as many as keep their current query head's Q, dO
    (elt bytes) and fp32 dQ accumulator within cfg['LPT_MB'] MiB (L2)."""
    mb = cfg["LPT_MB"]
    per_row = lq_pad * head_dim * (2 * elt + 4)
    return max(1, min(rows, (mb << 20) // per_row))


def smem_bytes_estimate(cfg: dict, head_dim: int, elt: int = 2) -> int:
    bm, bn, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]
    # Q / dO ring, K, V, dS, the writer's 2 fp32 dQ buffers, barriers and lse / Delta
    return 2 * st * bm * head_dim * elt + 2 * bn * head_dim * elt + bn * bm * elt + 2 * bm * head_dim * 4 + 1024


def _aligned16(t: torch.Tensor) -> bool:
    e = t.element_size()
    # strides of size-1 dims are never used (and get replaced in _desc)
    return t.data_ptr() % 16 == 0 and all((st * e) % 16 == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)


def _tma_readable(t: torch.Tensor) -> bool:
    """Can a TMA descriptor read t as it is: unit last stride, 16-byte aligned base and strides, no
    zero stride over a dim of size > 1 (a broadcast dout, e.g. of ``out.sum()``): launch.py's tests."""
    return t.stride(-1) == 1 and aligned16(t) and tma_strides_ok(t)


def why_not_gluon_backward(q, k, v, out, dout, is_causal, scale, window: int = 0) -> Optional[str]:
    """None when attention_backward_gluon handles these inputs, else the reason it refuses."""
    if not GLUON_AVAILABLE:
        return f"gluon unavailable ({_GLUON_IMPORT_ERROR})"
    why = why_not_window(q.shape[2], k.shape[2], is_causal, window)
    if why is not None:
        return why
    if not triton.__version__.startswith(_TESTED_TRITON):
        return f"Gluon API of triton {triton.__version__} untested (written for {_TESTED_TRITON})"
    ts = (q, k, v, out, dout)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return "non-tensor input"
    if not all(t.is_cuda for t in ts):
        return "not on a CUDA device"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"needs sm_90, got {torch.cuda.get_device_capability(q.device)}"
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in ts):
        return "dtype must be bf16 or fp16 and equal for q, k, v, out, dout"
    if any(t.dim() != 4 for t in ts):
        return "expects 4-D (B, H, L, D) tensors"
    B, Hq, Lq, D = q.shape
    _, Hkv, Lk, _ = k.shape
    if D not in (64, 128):
        return f"head dim {D} not in (64, 128)"
    if tuple(v.shape) != tuple(k.shape):
        return "v must have k's shape (Dv == D)"
    if k.shape[0] != B or k.shape[3] != D:
        return "k batch / head dim differ from q"
    if tuple(out.shape) != tuple(q.shape) or tuple(dout.shape) != tuple(q.shape):
        return "out / dout must have q's shape"
    if Hkv == 0 or Hq % Hkv != 0:
        return "Hq must be a multiple of Hkv"
    if Lq == 0 or Lk == 0 or B == 0 or Hq == 0:
        return "empty tensor"
    if any(t.stride(-1) != 1 for t in ts):
        return "last-dim stride must be 1"
    if not all(_aligned16(t) for t in ts):
        return "base pointers and non-last strides must be 16-byte aligned (TMA)"
    if max(Lq, Lk) >= 2**31 or B * Hq * (Lq + _PAD) * D >= 2**31 * 64:
        return "too large"
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return "scale must be a finite positive number"
    return None


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    """Built once per block shape and dtype: building one costs ~20 us of host time per
    descriptor (H100 host, stop 10), and a backward makes eight descriptors."""
    gdt = gl.float32 if dtype == torch.float32 else _gl_dtype(dtype)
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


def _desc(t: torch.Tensor, rows: int, D: int):
    layout = _shared_layout((1, 1, rows, D), t.dtype)
    strides = [st if n > 1 else 16 // t.element_size() for n, st in zip(t.shape[:3], t.stride()[:3])] + [1]
    return _GluonTensorDescriptor(t, list(t.shape), strides, [1, 1, rows, D], layout)


def _vec_desc(t: torch.Tensor, rows: int):
    """(B, Hq, LQ_PAD) fp32 buffer as a 2-D (B*Hq, LQ_PAD) TMA source of [1, rows] blocks."""
    t2 = t.view(-1, t.shape[-1])
    layout = _shared_layout((1, rows), torch.float32)
    return _GluonTensorDescriptor(t2, list(t2.shape), list(t2.stride()), [1, rows], layout)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: a constexpr function, slow to call from Python


def attention_backward_gluon(dout, q, k, v, out, lse, *, is_causal: bool, scale: float, variant: Optional[str] = None,
                             poison: bool = False, group_split: Optional[int] = None, window: int = 0):
    """(dq, dk, dv) of softmax(scale * q k^T [top-left causal]) v, by the warp-specialised Gluon kernel.

    ``window`` (with is_causal, Lq <= Lk; 0: none): a sliding window, key j visible to query i iff
    i - window < j <= i; each key block's program visits only the query blocks that see it.

    lse: (B, Hq, Lq) fp32 natural-log logsumexp of the forward. Outputs in the inputs' dtypes, each
    laid out as its input (host.layout_like).
    Call ``why_not_gluon_backward`` first; this function assumes the inputs pass it.
    ``group_split`` (GQA only): each (key block, kv head) is shared by that many programs, each
    taking Hq / Hkv / group_split of the group's query heads; their fp32 dK / dV partials are
    summed by a small kernel (default ``default_group_split``; must divide Hq / Hkv).
    ``poison`` (tests only) fills every output and scratch buffer with NaN first.
    """
    B, Hq, Lq, D = q.shape
    _, Hkv, Lk, _ = k.shape
    if tuple(lse.shape) != (B, Hq, Lq):
        raise ValueError(f"lse must be (B, Hq, Lq) = {(B, Hq, Lq)}, got {tuple(lse.shape)}")
    # dout is read through a TMA descriptor by its strides ((B, Lq, Hq, D) memory from the op's
    # output layout, no copy); out only by the preprocess kernel's pointers, any strides
    dout = dout if _tma_readable(dout) else dout.contiguous()
    cfg = variant_config(variant, D)
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    dev = q.device
    kv_group = Hq // Hkv
    n_nb = _cdiv(Lk, BN)
    split = group_split or default_group_split(n_nb * B * Hkv, kv_group, sm_count(dev), window > 0)
    if split < 1 or kv_group % split:
        raise ValueError(f"group_split={split} does not divide the GQA group of {kv_group}")
    dkv_out = 0 if split == 1 else 1
    LQ_PAD = _cdiv(Lq, _PAD) * _PAD
    delta = torch.empty((B, Hq, LQ_PAD), device=dev, dtype=torch.float32)
    lse2 = torch.empty((B, Hq, LQ_PAD), device=dev, dtype=torch.float32)
    dqacc = torch.empty((B, Hq, LQ_PAD, D), device=dev, dtype=torch.float32)
    lse = lse.float() if lse.dtype != torch.float32 else lse
    # the gradients laid out as their inputs (the op's (B, L, H, D) views: no copy after): dk / dv
    # stored by TMA through descriptors of their strides or by the split sum, dq by the cast
    dk, dv, dq = layout_like(k, k.dtype), layout_like(v, v.dtype), layout_like(q, q.dtype)
    # (dK | dV, share, B, Hkv, Lk, D) fp32 partials, every element stored
    part = torch.empty((2, split, B, Hkv, Lk, D), device=dev, dtype=torch.float32) if dkv_out else None
    if poison:
        for t in (delta, lse2, dqacc, dk, dv, dq) + ((part, ) if part is not None else ()):
            t.fill_(float("nan"))
    _gluon_bwd_preprocess[(LQ_PAD // _PRE_BLOCK, B * Hq)](
        out, dout, lse, delta, lse2, dqacc,  #
        out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),  #
        lse.stride(0), lse.stride(1), lse.stride(2), Hq, Lq, LQ_PAD, D=D, BLOCK=_PRE_BLOCK, num_warps=4)

    q_desc, do_desc = _desc(q, BM, D), _desc(dout, BM, D)
    k_desc, v_desc = _desc(k, BN, D), _desc(v, BN, D)
    dk_desc, dv_desc = _desc(dk, BN, D), _desc(dv, BN, D)
    rows = B * Hkv * split
    sw = lpt_section_rows(cfg, rows, LQ_PAD, D, q.element_size())
    dkp, dvp = (part[0], part[1]) if part is not None else (dqacc, dqacc)
    _attn_bwd_ws_kernel[(n_nb * rows, )](
        q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, _vec_desc(lse2, BM), _vec_desc(delta, BM), dqacc,  #
        dkp, dvp, B, Hq, Hkv, Lq, Lk, LQ_PAD, split, sw, int(window), float(scale) * LOG2E, float(scale),  #
        **kernel_constexprs(cfg, D, is_causal, Lk % BN != 0, dkv_out, window),
        num_warps=_NUM_WARPS, maxnreg=cfg["MAXNREG"])

    if part is not None:
        numel = B * Hkv * Lk * D
        _gluon_bwd_split_sum[(_cdiv(numel, _SUM_BLOCK), 2)](
            part, dk, dv, numel, Hkv, Lk, *dk.stride()[:3], *dv.stride()[:3], S=part.shape[1], D=D,
            BLOCK=_SUM_BLOCK, num_warps=4)
    _gluon_bwd_dq_cast[(_cdiv(Lq, _PRE_BLOCK), B * Hq)](
        dqacc, dq, dq.stride(0), dq.stride(1), dq.stride(2), Hq, Lq, LQ_PAD, float(scale),  #
        D=D, BLOCK=_PRE_BLOCK, num_warps=4)
    return dq, dk, dv
