"""Triton kernels for rotary position embeddings (RoPE), forward and backward.

Shapes and layouts
------------------
``x``          4-D ``(A, B, C, D)`` with ANY strides.  Typically ``(batch, heads, seq, head_dim)``
               obtained as ``q.view(batch, seq, heads, head_dim).transpose(1, 2)``; the kernel
               reads it through its strides (including the last-dim stride), never copies it.
``cos, sin``   the tables, last dim ``W``:
                 * full width  ``W == rotary_dim``       value for every channel,
                 * half width  ``W == rotary_dim // 2``  value for channel pair ``j``.
               They must broadcast to ``(A, B, C, W)``.  The ops layer passes them already
               expanded to 4-D (``.expand`` -> strides may be 0); lower-rank tables or size-1
               dims are also accepted here and broadcast through zero strides (nothing is ever
               materialised).
output         ``(A, B, C, D)`` of ``out_dtype``, written through its strides (unit last stride):
               a new contiguous tensor, or the ``out=`` given (the ops pass one in x's own
               layout, so that the HF layout is read and written as sequential streams).

Only the first ``R = rotary_dim`` channels are rotated; channels ``[R:]`` are copied through
(cast to the output dtype).  All math is in fp32.

Pairing of channels (``a`` = first member of a pair, ``b`` = second, ``h = R // 2``)::

    half-split  (NeoX / HF rotate_half):   a = i,      b = i + h     for i in [0, h)
    interleaved (GPT-J / Meta complex):    a = 2j,     b = 2j + 1    for j in [0, h)

with ``c_a, s_a, c_b, s_b`` the table values of channels a and b (half width: both are the
value of pair i / j).  Forward::

    out_a = x_a * c_a - x_b * s_a
    out_b = x_b * c_b + x_a * s_b

Backward (``backward=True``) applies the TRANSPOSE of that linear map to the gradient ``g``::

    dx_a = g_a * c_a + g_b * s_b
    dx_b = g_b * c_b - g_a * s_a

which is the forward formula with ``(s_a, s_b) -> (-s_b, -s_a)``; for full-width tables whose
two halves differ this is NOT the same as merely negating sin.  Tail channels: ``dx = g``.

Kernel structure
----------------
Dim 1 of ``(A, B, C, D)`` is the "head" dim, the one the tables are normally broadcast over
(stride 0); ``(A, C)`` are the positions.  (When the tables are broadcast over dim 2 instead and
not over dim 1, e.g. x in ``(batch, seq, heads, D)`` order, the launcher swaps dims 1 and 2 of
x, tables and output views, so the head dim is always the one looped over.)

Each program owns ``BLOCK_C`` consecutive positions of the flattened ``(A, C)`` and a chunk of
heads.  It loads the cos/sin rows of its positions ONCE into registers (fp32, sign folded in),
then loops over its heads ``BLOCK_HH`` at a time: each step loads a ``[BLOCK_C, BLOCK_HH,
BLOCK_D]`` tile of whole rows (``BLOCK_D = next_pow2(D)``, 16-byte vector loads when the last
dim is contiguous), rotates it and stores whole output rows.  The partner channel of every
element is obtained

  * half-split: by two more masked loads of the same rows at columns ``d + h`` / ``d - h``
    (contiguous, hence vectorised; they hit the L1 lines the first load brought in, so DRAM
    sees x once), as Inductor does for ``rotate_half``;
  * interleaved: in registers, ``reshape(..., BLOCK_D/2, 2)`` + ``split`` / ``join``.

The pass-through tail ``[R, D)`` is part of the same row tile (``where(d < R, rotated, x)``).
So x is read from DRAM once, cos/sin once per position (not once per head), the output written
once: the kernel is purely memory bound.  Index math: int32 per position (one div/mod per
position, not per element), int64 row offsets, int32 column offsets.

``rotary_qk_forward`` rotates q and k in ONE launch.  When q and k share the position dims
(same ``A`` and ``C``, the usual case, head counts may differ, e.g. 32 query heads vs 8
key/value heads) a program handles q's AND k's heads of its positions (the chunks of heads
cover ``[0, Hq + Hk)``), so the k tables are re-read from L2, not DRAM.  Otherwise the grid
covers q's programs followed by k's.  q and k may differ in any leading dim and in head_dim;
they share ``rotary_dim`` and the layout.

Config (``default_config``; ``config=`` overrides): ``BLOCK_ROWS`` (= positions per program,
``BLOCK_C``), ``BLOCK_HEADS`` (heads per loop step), ``HEADS_PER_PROGRAM`` (size of a program's
chunk of heads; default: all, unless that leaves too few programs to fill the GPU),
``SPLIT_HALVES`` (half-split only: load the a half, b half and tail as three tiles instead of
whole rows + partner loads; default False), ``num_stages`` (software pipelining of the head loop,
cp.async on sm80+; default 3), ``num_warps``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .args import indexed, prefixed, remembered
from .host import cdiv, next_pow2
from .launch import launch

__all__ = ["rotary_kernel", "rotary_forward", "rotary_qk_forward", "default_config"]


@triton.jit
def _rope_block(
    pb, h_lo, h_hi,  # position block index; heads [h_lo, h_hi) of this tensor
    x_ptr, cos_ptr, sin_ptr, o_ptr,
    n_pos, size_c,  # positions = A * C; size of dim 2 (C)
    sx0, sx1, sx2, sx3,  # x strides (elements)
    so0, so1, so2,  # output strides (last one is 1)
    sc0, sc1, sc2, sc3,  # cos strides (0 where broadcast)
    ss0, ss1, ss2, ss3,  # sin strides
    HEAD_DIM: tl.constexpr,  # D
    ROT_DIM: tl.constexpr,  # R (even, <= D)
    HALF_WIDTH: tl.constexpr,  # table last dim is R // 2
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    TABLE_PER_HEAD: tl.constexpr,  # tables vary along dim 1 (not broadcast over heads)
    BLOCK_C: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_pow2(D)
    SPLIT_HALVES: tl.constexpr,  # half-split: load the two halves (and the tail) as separate tiles
    NUM_STAGES: tl.constexpr,  # software pipelining of the head loop (1: none)
    BLOCK_H: tl.constexpr,  # next_pow2(R // 2) (SPLIT_HALVES)
    BLOCK_T: tl.constexpr,  # next_pow2(D - R) (SPLIT_HALVES, D > R)
):
    H2: tl.constexpr = ROT_DIM // 2
    pos = pb * BLOCK_C + tl.arange(0, BLOCK_C)
    pmask = pos < n_pos
    ia = pos // size_c  # one int32 div/mod per position
    ic = pos - ia * size_c
    ia = ia.to(tl.int64)
    ic = ic.to(tl.int64)
    x_row = ia * sx0 + ic * sx2  # [BLOCK_C] int64
    o_row = ia * so0 + ic * so2
    c_row = ia * sc0 + ic * sc2
    s_row = ia * ss0 + ic * ss2
    hh = tl.arange(0, BLOCK_HH)
    d = tl.arange(0, BLOCK_D)
    rot = d < ROT_DIM
    out_ty = o_ptr.dtype.element_ty

    if INTERLEAVED:
        # Pairs (2j, 2j + 1), j in [0, BLOCK_D / 2): even/odd lanes split in registers.
        j = tl.arange(0, BLOCK_D // 2)
        jrot = j < H2
        if HALF_WIDTH:
            ce_col = j
            co_col = j
        else:
            ce_col = 2 * j
            co_col = 2 * j + 1
        # coefficient tables: ye = xe * Ae + xo * Be ; yo = xo * Ao + xe * Bo
        if not TABLE_PER_HEAD:
            tm = pmask[:, None] & jrot[None, :]
            ce = tl.load(cos_ptr + c_row[:, None] + (ce_col * sc3)[None, :], mask=tm, other=0.0).to(tl.float32)
            co = tl.load(cos_ptr + c_row[:, None] + (co_col * sc3)[None, :], mask=tm, other=0.0).to(tl.float32)
            se = tl.load(sin_ptr + s_row[:, None] + (ce_col * ss3)[None, :], mask=tm, other=0.0).to(tl.float32)
            so = tl.load(sin_ptr + s_row[:, None] + (co_col * ss3)[None, :], mask=tm, other=0.0).to(tl.float32)
            ae = ce[:, None, :]
            ao = co[:, None, :]
            if BACKWARD:
                be = so[:, None, :]
                bo = -se[:, None, :]
            else:
                be = -se[:, None, :]
                bo = so[:, None, :]
        for h0 in tl.range(h_lo, h_hi, BLOCK_HH, num_stages=NUM_STAGES):
            h = (h0 + hh).to(tl.int64)
            m2 = pmask[:, None] & (h < h_hi)[None, :]
            xb = x_ptr + x_row[:, None] + (h * sx1)[None, :]  # [BLOCK_C, BLOCK_HH] row pointers
            ob = o_ptr + o_row[:, None] + (h * so1)[None, :]
            if BLOCK_D == HEAD_DIM:
                m3 = m2[:, :, None]
            else:
                m3 = m2[:, :, None] & (d < HEAD_DIM)[None, None, :]
            x = tl.load(xb[:, :, None] + (d * sx3)[None, None, :], mask=m3, other=0.0).to(tl.float32)
            if TABLE_PER_HEAD:
                tm = m2[:, :, None] & jrot[None, None, :]
                cb = cos_ptr + c_row[:, None, None] + (h * sc1)[None, :, None]
                sb = sin_ptr + s_row[:, None, None] + (h * ss1)[None, :, None]
                ae = tl.load(cb + (ce_col * sc3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                ao = tl.load(cb + (co_col * sc3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                se = tl.load(sb + (ce_col * ss3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                so = tl.load(sb + (co_col * ss3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                if BACKWARD:
                    be = so
                    bo = -se
                else:
                    be = -se
                    bo = so
            xe, xo = tl.split(tl.reshape(x, [BLOCK_C, BLOCK_HH, BLOCK_D // 2, 2]))
            ye = xe * ae + xo * be
            yo = xo * ao + xe * bo
            y = tl.reshape(tl.join(ye, yo), [BLOCK_C, BLOCK_HH, BLOCK_D])
            if ROT_DIM < HEAD_DIM:
                y = tl.where(rot[None, None, :], y, x)
            tl.store(ob[:, :, None] + d[None, None, :], y.to(out_ty), mask=m3)
    elif SPLIT_HALVES:
        # Half-split pairs (i, i + R/2), the a half, the b half and the tail as three tiles.
        jj = tl.arange(0, BLOCK_H)
        jm = jj < H2
        if HALF_WIDTH:
            ca_col = jj
            cb_col = jj
        else:
            ca_col = jj
            cb_col = jj + H2
        if not TABLE_PER_HEAD:
            tm = pmask[:, None] & jm[None, :]
            ca = tl.load(cos_ptr + c_row[:, None] + (ca_col * sc3)[None, :], mask=tm, other=0.0).to(tl.float32)[:, None, :]
            cb = tl.load(cos_ptr + c_row[:, None] + (cb_col * sc3)[None, :], mask=tm, other=0.0).to(tl.float32)[:, None, :]
            sa = tl.load(sin_ptr + s_row[:, None] + (ca_col * ss3)[None, :], mask=tm, other=0.0).to(tl.float32)[:, None, :]
            sb = tl.load(sin_ptr + s_row[:, None] + (cb_col * ss3)[None, :], mask=tm, other=0.0).to(tl.float32)[:, None, :]
        for h0 in tl.range(h_lo, h_hi, BLOCK_HH, num_stages=NUM_STAGES):
            h = (h0 + hh).to(tl.int64)
            m2 = (pmask[:, None] & (h < h_hi)[None, :])[:, :, None]
            xb = (x_ptr + x_row[:, None] + (h * sx1)[None, :])[:, :, None]
            ob = (o_ptr + o_row[:, None] + (h * so1)[None, :])[:, :, None]
            if BLOCK_H == H2:
                mh = m2
            else:
                mh = m2 & jm[None, None, :]
            xa = tl.load(xb + (jj * sx3)[None, None, :], mask=mh, other=0.0).to(tl.float32)
            xbb = tl.load(xb + ((jj + H2) * sx3)[None, None, :], mask=mh, other=0.0).to(tl.float32)
            if TABLE_PER_HEAD:
                tm = mh
                cbase = cos_ptr + c_row[:, None, None] + (h * sc1)[None, :, None]
                sbase = sin_ptr + s_row[:, None, None] + (h * ss1)[None, :, None]
                ca = tl.load(cbase + (ca_col * sc3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                cb = tl.load(cbase + (cb_col * sc3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                sa = tl.load(sbase + (ca_col * ss3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
                sb = tl.load(sbase + (cb_col * ss3)[None, None, :], mask=tm, other=0.0).to(tl.float32)
            if BACKWARD:
                ya = xa * ca + xbb * sb
                yb = xbb * cb - xa * sa
            else:
                ya = xa * ca - xbb * sa
                yb = xbb * cb + xa * sb
            tl.store(ob + jj[None, None, :], ya.to(out_ty), mask=mh)
            tl.store(ob + (jj + H2)[None, None, :], yb.to(out_ty), mask=mh)
            if ROT_DIM < HEAD_DIM:
                t = tl.arange(0, BLOCK_T)
                if BLOCK_T == HEAD_DIM - ROT_DIM:
                    mt = m2
                else:
                    mt = m2 & (t < HEAD_DIM - ROT_DIM)[None, None, :]
                xt = tl.load(xb + ((t + ROT_DIM) * sx3)[None, None, :], mask=mt, other=0.0)
                tl.store(ob + (t + ROT_DIM)[None, None, :], xt.to(out_ty), mask=mt)
    else:
        # Half-split pairs (i, i + R/2): y = x * c + x[partner] * s with the sign folded into s.
        first = d < H2
        if HALF_WIDTH:
            c_col = tl.where(first, d, d - H2)
            s_col = c_col
        else:
            c_col = d
            if BACKWARD:  # the transpose reads sin at the partner channel
                s_col = tl.where(first, d + H2, d - H2)
            else:
                s_col = d
        if BACKWARD:
            neg = (d >= H2)[None, None, :]
        else:
            neg = first[None, None, :]
        if not TABLE_PER_HEAD:
            tm = pmask[:, None] & rot[None, :]
            c3 = tl.load(cos_ptr + c_row[:, None] + (c_col * sc3)[None, :], mask=tm, other=0.0).to(tl.float32)[:, None, :]
            s3 = tl.load(sin_ptr + s_row[:, None] + (s_col * ss3)[None, :], mask=tm, other=0.0).to(tl.float32)[:, None, :]
            s3 = tl.where(neg, -s3, s3)
        hi_m = first[None, None, :]
        lo_m = ((d >= H2) & rot)[None, None, :]
        for h0 in tl.range(h_lo, h_hi, BLOCK_HH, num_stages=NUM_STAGES):
            h = (h0 + hh).to(tl.int64)
            m2 = pmask[:, None] & (h < h_hi)[None, :]
            xb = (x_ptr + x_row[:, None] + (h * sx1)[None, :])[:, :, None]  # [BLOCK_C, BLOCK_HH, 1]
            ob = (o_ptr + o_row[:, None] + (h * so1)[None, :])[:, :, None]
            m2 = m2[:, :, None]
            if BLOCK_D == HEAD_DIM:
                m3 = m2
            else:
                m3 = m2 & (d < HEAD_DIM)[None, None, :]
            x = tl.load(xb + (d * sx3)[None, None, :], mask=m3, other=0.0).to(tl.float32)
            # partner lanes: two contiguous masked loads (L1 hits), as Inductor's rotate_half
            xhi = tl.load(xb + ((d + H2) * sx3)[None, None, :], mask=m2 & hi_m, other=0.0)
            xlo = tl.load(xb + ((d - H2) * sx3)[None, None, :], mask=m2 & lo_m, other=0.0)
            xp = tl.where(hi_m, xhi, xlo).to(tl.float32)
            if TABLE_PER_HEAD:
                tm = m2 & rot[None, None, :]
                c3 = tl.load(cos_ptr + c_row[:, None, None] + (h * sc1)[None, :, None] + (c_col * sc3)[None, None, :],
                             mask=tm, other=0.0).to(tl.float32)
                s3 = tl.load(sin_ptr + s_row[:, None, None] + (h * ss1)[None, :, None] + (s_col * ss3)[None, None, :],
                             mask=tm, other=0.0).to(tl.float32)
                s3 = tl.where(neg, -s3, s3)
            y = x * c3 + xp * s3
            if ROT_DIM < HEAD_DIM:
                y = tl.where(rot[None, None, :], y, x)
            tl.store(ob + d[None, None, :], y.to(out_ty), mask=m3)


@triton.jit
def rotary_kernel(
    # first tensor ("q"; the only one for rotary_forward)
    q_ptr, qcos_ptr, qsin_ptr, qout_ptr,
    q_pos, q_size_c, q_heads,
    q_sx0, q_sx1, q_sx2, q_sx3,
    q_so0, q_so1, q_so2,
    q_sc0, q_sc1, q_sc2, q_sc3,
    q_ss0, q_ss1, q_ss2, q_ss3,
    # second tensor ("k"), only read when HAS_K
    k_ptr, kcos_ptr, ksin_ptr, kout_ptr,
    k_pos, k_size_c, k_heads,
    k_sx0, k_sx1, k_sx2, k_sx3,
    k_so0, k_so1, k_so2,
    k_sc0, k_sc1, k_sc2, k_sc3,
    k_ss0, k_ss1, k_ss2, k_ss3,
    q_programs,  # not SAME_POS: programs [0, q_programs) work on q, the rest on k
    q_chunks, k_chunks,  # chunks of heads per position block (SAME_POS: q_chunks covers q and k)
    heads_per_program,
    HAS_K: tl.constexpr,
    SAME_POS: tl.constexpr,  # q and k share (A, C): one program does both for its positions
    Q_HEAD_DIM: tl.constexpr,
    K_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_WIDTH: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    Q_TABLE_PER_HEAD: tl.constexpr,
    K_TABLE_PER_HEAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    Q_BLOCK_D: tl.constexpr,
    K_BLOCK_D: tl.constexpr,
    SPLIT_HALVES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    Q_BLOCK_T: tl.constexpr,
    K_BLOCK_T: tl.constexpr,
):
    """Rotary embedding of one tensor, or of q and k in one launch (see module doc)."""
    pid = tl.program_id(0)
    if SAME_POS:
        pb = pid // q_chunks
        lo = (pid % q_chunks) * heads_per_program
        hi = tl.minimum(lo + heads_per_program, q_heads + k_heads)
        if lo < q_heads:
            _rope_block(pb, lo, tl.minimum(hi, q_heads), q_ptr, qcos_ptr, qsin_ptr, qout_ptr, q_pos, q_size_c,
                        q_sx0, q_sx1, q_sx2, q_sx3, q_so0, q_so1, q_so2,
                        q_sc0, q_sc1, q_sc2, q_sc3, q_ss0, q_ss1, q_ss2, q_ss3,
                        Q_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD, Q_TABLE_PER_HEAD,
                        BLOCK_C, BLOCK_HH, Q_BLOCK_D, SPLIT_HALVES, NUM_STAGES, BLOCK_H, Q_BLOCK_T)
        if hi > q_heads:
            _rope_block(pb, tl.maximum(lo, q_heads) - q_heads, hi - q_heads, k_ptr, kcos_ptr, ksin_ptr, kout_ptr,
                        k_pos, k_size_c,
                        k_sx0, k_sx1, k_sx2, k_sx3, k_so0, k_so1, k_so2,
                        k_sc0, k_sc1, k_sc2, k_sc3, k_ss0, k_ss1, k_ss2, k_ss3,
                        K_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD, K_TABLE_PER_HEAD,
                        BLOCK_C, BLOCK_HH, K_BLOCK_D, SPLIT_HALVES, NUM_STAGES, BLOCK_H, K_BLOCK_T)
    else:
        # One tensor (not HAS_K): every program on q, and no branch that writes through kout_ptr
        # is compiled (what Inductor's write analysis of the kernel sees: ops/inductor.py).
        if (not HAS_K) or pid < q_programs:
            lo = (pid % q_chunks) * heads_per_program
            _rope_block(pid // q_chunks, lo, tl.minimum(lo + heads_per_program, q_heads),
                        q_ptr, qcos_ptr, qsin_ptr, qout_ptr, q_pos, q_size_c,
                        q_sx0, q_sx1, q_sx2, q_sx3, q_so0, q_so1, q_so2,
                        q_sc0, q_sc1, q_sc2, q_sc3, q_ss0, q_ss1, q_ss2, q_ss3,
                        Q_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD, Q_TABLE_PER_HEAD,
                        BLOCK_C, BLOCK_HH, Q_BLOCK_D, SPLIT_HALVES, NUM_STAGES, BLOCK_H, Q_BLOCK_T)
        else:
            kid = pid - q_programs
            lo = (kid % k_chunks) * heads_per_program
            _rope_block(kid // k_chunks, lo, tl.minimum(lo + heads_per_program, k_heads),
                        k_ptr, kcos_ptr, ksin_ptr, kout_ptr, k_pos, k_size_c,
                        k_sx0, k_sx1, k_sx2, k_sx3, k_so0, k_so1, k_so2,
                        k_sc0, k_sc1, k_sc2, k_sc3, k_ss0, k_ss1, k_ss2, k_ss3,
                        K_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD, K_TABLE_PER_HEAD,
                        BLOCK_C, BLOCK_HH, K_BLOCK_D, SPLIT_HALVES, NUM_STAGES, BLOCK_H, K_BLOCK_T)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    try:
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    except Exception:  # no CUDA (interpreter): any sensible number
        return 132


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def default_config(head_dim: int, n_rows: int, *, n_heads: int = 1, n_pos: Optional[int] = None) -> dict:
    """Launch parameters.  ``n_rows`` = all rows (A * B * C) of the larger tensor; ``n_heads`` =
    heads a program may loop over (dim 1; q's plus k's when they share positions); ``n_pos`` =
    positions (A * C; default ``n_rows // n_heads``).

    A loop step moves a ``[BLOCK_ROWS, BLOCK_HEADS, next_pow2(D)]`` tile of ~2048 elements
    (2 x 8 heads x 128, 16 x 2 heads x 64), whole rows, the head loop software-pipelined 3 deep
    (cp.async); with D 128 and a multiple of 32 heads, 1 position x 32 heads.  Picked from H100
    sweeps of benchmarks/rotary.py's shapes."""
    block_d = next_pow2(max(head_dim, 1))
    if n_pos is None:
        n_pos = max(1, n_rows // max(n_heads, 1))
    if block_d == 128 and n_heads % 32 == 0:
        # Many heads per position (e.g. 32 q + 32 k): one position x 32 heads per step, 8 warps.
        # H100 sweep of (8, 32, 32, 2048, 128): 0.99x compiled fwd and bwd vs 0.96x with the
        # tiles below (NOTES.md, stop 9).
        return {"BLOCK_ROWS": 1, "BLOCK_HEADS": 32, "num_warps": 8, "num_stages": 2}
    block_hh = min(8 if block_d >= 128 else 2, next_pow2(max(n_heads, 1)))
    block_rows = max(1, 2048 // (block_d * block_hh))
    # Do not launch mostly-masked programs for tiny inputs (decode: a handful of positions).
    block_rows = min(block_rows, next_pow2(max(n_pos, 1)))
    elems = block_rows * block_hh * block_d
    num_warps = 4 if elems >= 2048 else (2 if elems >= 256 else 1)
    return {"BLOCK_ROWS": block_rows, "BLOCK_HEADS": block_hh, "num_warps": num_warps, "num_stages": 3}


_CONFIG_KEYS = {"BLOCK_ROWS", "BLOCK_HEADS", "HEADS_PER_PROGRAM", "SPLIT_HALVES", "num_warps", "num_stages"}


def _check_config(config: dict) -> tuple[int, int, Optional[int], int, bool, int]:
    unknown = set(config) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"rotary: unknown config keys {sorted(unknown)}")
    block_rows = int(config["BLOCK_ROWS"])
    block_hh = int(config.get("BLOCK_HEADS", 1))
    num_warps = int(config.get("num_warps", 4))
    for name, v in (("BLOCK_ROWS", block_rows), ("BLOCK_HEADS", block_hh), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"rotary: config {name}={v} must be a positive power of 2")
    hpp = config.get("HEADS_PER_PROGRAM")
    if hpp is not None:
        hpp = int(hpp)
        if hpp < 1:
            raise ValueError(f"rotary: config HEADS_PER_PROGRAM={hpp} must be >= 1")
    num_stages = int(config.get("num_stages", 1))
    if num_stages < 1:
        raise ValueError(f"rotary: config num_stages={num_stages} must be >= 1")
    return block_rows, block_hh, hpp, num_warps, bool(config.get("SPLIT_HALVES", False)), num_stages


def _table_strides(t: torch.Tensor, lead: tuple[int, int, int], width: int, name: str) -> tuple[int, ...]:
    """Strides through which the table ``t`` reads as shape ``(*lead, width)``.

    ``t`` may have fewer than 4 dims (leading dims are added), and size-1 or stride-0 dims
    broadcast (stride 0).  A stride-0 dim whose size differs from ``lead`` (a table expanded
    for q, reused for k with another head count) also broadcasts: every index reads the same
    element.  Nothing is copied."""
    if t.dim() < 1 or t.dim() > 4:
        raise ValueError(f"rotary: {name} must have 1 to 4 dims, got shape {tuple(t.shape)}")
    if t.shape[-1] != width:
        raise ValueError(f"rotary: {name} last dim {t.shape[-1]} != {width}")
    pad = 4 - t.dim()
    sizes = (1,) * pad + tuple(t.shape)
    strides = (0,) * pad + tuple(t.stride())
    out = []
    for d in range(3):
        if sizes[d] == lead[d]:
            out.append(strides[d] if lead[d] > 1 else 0)
        elif sizes[d] == 1 or strides[d] == 0:
            out.append(0)
        else:
            raise ValueError(
                f"rotary: {name} of shape {tuple(t.shape)} does not broadcast to {(*lead, width)}")
    out.append(strides[3])
    return tuple(out)


class _Side:
    """One tensor's launch arguments: sizes and strides in the kernel's (A, heads, C, D) order,
    named for the kernel's side ``q`` or ``k`` (``kwargs``)."""

    def __init__(self, x, cos, sin, out, rotary_dim, name):
        if x.dim() != 4:
            raise ValueError(f"rotary: {name} must be 4-D (A, B, C, D), got shape {tuple(x.shape)}")
        D = x.shape[-1]
        R = rotary_dim
        if R <= 0 or R % 2 or R > D:
            raise ValueError(f"rotary: rotary_dim={R} must be even and in [2, {D}]")
        if cos.shape[-1] != sin.shape[-1]:
            raise ValueError(f"rotary: cos width {cos.shape[-1]} != sin width {sin.shape[-1]}")
        W = cos.shape[-1]
        if W == R:
            self.half_width = False
        elif W == R // 2:
            self.half_width = True
        else:
            raise ValueError(f"rotary: cos/sin last dim {W} must be rotary_dim={R} or rotary_dim//2={R // 2}")
        for t, n in ((cos, "cos"), (sin, "sin")):
            if t.device != x.device:
                raise ValueError(f"rotary: {n} is on {t.device}, {name} on {x.device}")
        lead = tuple(x.shape[:3])
        sx, so = list(x.stride()), list(out.stride())
        sc = list(_table_strides(cos, lead, W, f"cos ({name})"))
        ss = list(_table_strides(sin, lead, W, f"sin ({name})"))
        sizes = list(lead)
        # Loop over the dim the tables are broadcast over: swap dims 1 and 2 when the tables
        # vary along dim 1 but not along dim 2 (x given as (batch, seq, heads, D)).
        if (sc[1] or ss[1]) and not (sc[2] or ss[2]) and sizes[2] > 1:
            for s in (sizes, sx, so, sc, ss):
                s[1], s[2] = s[2], s[1]
        self.n_heads = sizes[1]
        self.size_a, self.size_c = sizes[0], sizes[2]
        self.n_pos = sizes[0] * sizes[2]
        self.head_dim = D
        self.table_per_head = bool(sc[1] or ss[1]) and sizes[1] > 1
        self.tensors = (x, cos, sin, out)
        self.strides = (tuple(sx), tuple(so[:3]), tuple(sc), tuple(ss))

    def kwargs(self, side: str) -> dict:
        """The kernel's arguments of ``side`` ("q" or "k") by name: its tensor, tables and
        output, then its sizes and the strides of x, out, cos and sin."""
        x, cos, sin, out = self.tensors
        return {**prefixed(side, _ptr=x, cos_ptr=cos, sin_ptr=sin, out_ptr=out),
                **_side_args(side, self.n_pos, self.size_c, self.n_heads, *self.strides)}


@remembered
def _side_args(side: str, n_pos, size_c, n_heads, sx, so, sc, ss) -> dict:
    """A side's sizes and strides by the kernel's names (ints: remembered per layout)."""
    return {**prefixed(side, _pos=n_pos, _size_c=size_c, _heads=n_heads),
            **indexed(f"{side}_sx", sx), **indexed(f"{side}_so", so),
            **indexed(f"{side}_sc", sc), **indexed(f"{side}_ss", ss)}


def _launch(q, qcos, qsin, q_out, k, kcos, ksin, k_out, *, interleaved, rotary_dim, backward, config):
    has_k = k is not None
    qs = _Side(q, qcos, qsin, q_out, rotary_dim, "q" if has_k else "x")
    if has_k:
        if k.device != q.device:
            raise ValueError(f"rotary: k is on {k.device}, q on {q.device}")
        ks = _Side(k, kcos, ksin, k_out, rotary_dim, "k")
        if ks.half_width != qs.half_width:
            raise ValueError("rotary: q and k tables must have the same width")
    else:
        ks = None
    q_rows = qs.n_pos * qs.n_heads
    k_rows = ks.n_pos * ks.n_heads if has_k else 0
    if q_rows + k_rows == 0:
        return
    same_pos = has_k and qs.size_a == ks.size_a and qs.size_c == ks.size_c
    if same_pos:
        heads = qs.n_heads + ks.n_heads
    else:
        heads = max(qs.n_heads, ks.n_heads if has_k else 0)
    n_pos = max(qs.n_pos, ks.n_pos if has_k else 0)
    head_dim = max(qs.head_dim, ks.head_dim if has_k else 0)
    if config is None:
        config = default_config(head_dim, max(q_rows, k_rows), n_heads=heads, n_pos=n_pos)
    block_c, block_hh, hpp, num_warps, split, num_stages = _check_config(config)

    def blocks(side):
        return cdiv(side.n_pos, block_c) if side.n_pos else 0

    if hpp is None:
        # All heads in one program (tables read once per position) unless that leaves fewer
        # than ~4 programs per SM; then split the heads into chunks of whole loop steps.
        want = 4 * _sms(q.device)
        nb = blocks(qs) + (blocks(ks) if has_k and not same_pos else 0)
        chunks = 1 if nb >= want else min(cdiv(want, max(nb, 1)), cdiv(heads, block_hh))
        hpp = cdiv(cdiv(heads, chunks), block_hh) * block_hh
    hpp = max(1, min(hpp, max(heads, 1)))
    if same_pos:
        q_chunks = cdiv(heads, hpp)
        k_chunks = 1
        q_programs = blocks(qs) * q_chunks
        grid = (q_programs,)
    else:
        q_chunks = max(1, cdiv(qs.n_heads, hpp))
        k_chunks = max(1, cdiv(ks.n_heads, hpp)) if has_k else 1
        q_programs = blocks(qs) * q_chunks if q_rows else 0
        k_programs = blocks(ks) * k_chunks if k_rows else 0
        grid = (q_programs + k_programs,)
    if grid[0] == 0:
        return
    kside = ks if has_k else qs  # dummy second group when HAS_K is False (never read)
    R = rotary_dim
    kd = ks.head_dim if has_k else qs.head_dim
    launch(
        rotary_kernel, grid, **qs.kwargs("q"), **kside.kwargs("k"),
        q_programs=q_programs, q_chunks=q_chunks, k_chunks=k_chunks, heads_per_program=hpp,
        HAS_K=has_k,
        SAME_POS=same_pos,
        Q_HEAD_DIM=qs.head_dim,
        K_HEAD_DIM=kd,
        ROT_DIM=R,
        HALF_WIDTH=qs.half_width,
        INTERLEAVED=bool(interleaved),
        BACKWARD=bool(backward),
        Q_TABLE_PER_HEAD=qs.table_per_head,
        K_TABLE_PER_HEAD=(ks.table_per_head if has_k else False),
        BLOCK_C=block_c,
        BLOCK_HH=block_hh,
        Q_BLOCK_D=next_pow2(qs.head_dim),
        K_BLOCK_D=next_pow2(kd),
        SPLIT_HALVES=split,
        NUM_STAGES=num_stages,
        BLOCK_H=next_pow2(max(R // 2, 1)),
        Q_BLOCK_T=next_pow2(max(qs.head_dim - R, 1)),
        K_BLOCK_T=next_pow2(max(kd - R, 1)),
        num_warps=num_warps,
        writes=("qout_ptr", "kout_ptr") if has_k else ("qout_ptr",),
    )


def _check_out(out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if out.shape != x.shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(f"rotary: {name} must be {tuple(x.shape)} {dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if x.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"rotary: {name} must have a unit last-dim stride, got {out.stride()}")


def rotary_forward(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
    backward: bool = False,
    out_dtype: torch.dtype,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Apply RoPE (or, with ``backward=True``, its transpose) to the first ``rotary_dim``
    channels of ``x``.

    x:        4-D ``(A, B, C, D)``, any strides (read in place, never copied).
    cos, sin: broadcastable to ``(A, B, C, W)``, ``W in (rotary_dim, rotary_dim // 2)``; normally
              4-D views expanded with ``.expand`` (zero strides are read as such).
    config:   optional ``{"BLOCK_ROWS": pow2, "BLOCK_HEADS": pow2, "HEADS_PER_PROGRAM": int,
              "num_warps": pow2}`` (missing keys: 1, all heads, 4) overriding
              :func:`default_config`.
    out:      optional output ``(A, B, C, D)`` of ``out_dtype`` with a unit last stride, any other
              strides (the ops pass one in x's own layout); default a new contiguous tensor.
    Returns the output.
    """
    if out is None:
        out = torch.empty(tuple(x.shape), dtype=out_dtype, device=x.device)
    _check_out(out, x, out_dtype, "out")
    _launch(x, cos, sin, out, None, None, None, None,
            interleaved=interleaved, rotary_dim=rotary_dim, backward=backward, config=config)
    return out


def rotary_qk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_q: torch.Tensor,
    sin_q: torch.Tensor,
    cos_k: Optional[torch.Tensor] = None,
    sin_k: Optional[torch.Tensor] = None,
    *,
    interleaved: bool,
    rotary_dim: int,
    backward: bool = False,
    q_out_dtype: torch.dtype,
    k_out_dtype: torch.dtype,
    config: Optional[dict] = None,
    q_out: Optional[torch.Tensor] = None,
    k_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k in ONE kernel launch.

    q: ``(A, Bq, C, Dq)``, k: ``(A', Bk, C', Dk)``, any strides; the leading dims (and head dims)
    may differ, ``rotary_dim`` and the layout are shared.

    Tables, two accepted forms:
      * ``rotary_qk_forward(q, k, cos_q, sin_q, cos_k, sin_k, ...)``: separately expanded
        4-D views of the same tables, one pair broadcast to q's leading dims and one to k's.
      * ``rotary_qk_forward(q, k, cos, sin, ...)``: one pair used for both; it must broadcast
        to both (size-1 or stride-0 dims, e.g. ``(B, 1, L, W)`` or a view expanded to q's
        head count, whose zero head stride serves k's head count too).
    Returns ``(q_out, k_out)`` of ``q_out_dtype`` / ``k_out_dtype``: the given outputs (unit last
    stride, any other strides), else new contiguous tensors.
    """
    if (cos_k is None) != (sin_k is None):
        raise ValueError("rotary: pass both cos_k and sin_k, or neither")
    if cos_k is None:
        cos_k, sin_k = cos_q, sin_q
    if q_out is None:
        q_out = torch.empty(tuple(q.shape), dtype=q_out_dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(tuple(k.shape), dtype=k_out_dtype, device=k.device)
    _check_out(q_out, q, q_out_dtype, "q_out")
    _check_out(k_out, k, k_out_dtype, "k_out")
    _launch(q, cos_q, sin_q, q_out, k, cos_k, sin_k, k_out,
            interleaved=interleaved, rotary_dim=rotary_dim, backward=backward, config=config)
    return q_out, k_out
