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
output         a NEW contiguous ``(A, B, C, D)`` tensor of ``out_dtype``.

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
The three leading dims are flattened into rows (row-major over ``(A, B, C)``, which is also the
order of the contiguous output).  Each program handles ``BLOCK_ROWS`` rows and all ``D``
channels of them: the ``a`` lanes and the ``b`` lanes are loaded as two ``[BLOCK_ROWS, BLOCK_H]``
tiles (``BLOCK_H = next_pow2(R // 2)``, masked), the pass-through tail as one
``[BLOCK_ROWS, BLOCK_T]`` tile (``BLOCK_T = next_pow2(D - R)``).  So x is read once, cos/sin once
per row, the output written once: the kernel is purely memory bound.

``rotary_qk_forward`` rotates q and k in ONE launch: the grid covers the q row-blocks followed
by the k row-blocks; programs past the q blocks work on k.  q and k may differ in any leading
dim (e.g. 32 query heads vs 8 key/value heads) and even in head_dim; they share ``rotary_dim``
and the layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["rotary_kernel", "rotary_forward", "rotary_qk_forward", "default_config"]


@triton.jit
def _rotary_rows(
    block,  # index of this program's row block within the tensor it works on
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    n_rows, size1, size2,  # rows = A * B * C; sizes of leading dims 1 and 2 (dim 0 is implied)
    sx0, sx1, sx2, sx3,  # x strides (elements)
    sc0, sc1, sc2, sc3,  # cos strides (0 where broadcast)
    ss0, ss1, ss2, ss3,  # sin strides (0 where broadcast)
    HEAD_DIM: tl.constexpr,  # D
    ROT_DIM: tl.constexpr,  # R (even, <= D)
    HALF_WIDTH: tl.constexpr,  # cos/sin last dim is R // 2 instead of R
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_pow2(R // 2)
    BLOCK_T: tl.constexpr,  # next_pow2(D - R) (unused when D == R)
):
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    # int64 before any multiplication by a stride: B*L*H*D easily exceeds 2**31 elements.
    rows = rows.to(tl.int64)
    i2 = rows % size2
    i01 = rows // size2
    i1 = i01 % size1
    i0 = i01 // size1
    x_row = i0 * sx0 + i1 * sx1 + i2 * sx2  # [BLOCK_ROWS]
    c_row = i0 * sc0 + i1 * sc1 + i2 * sc2
    s_row = i0 * ss0 + i1 * ss1 + i2 * ss2
    out_row = rows * HEAD_DIM  # the output is contiguous (A, B, C, D)

    # ---- rotated channels: pair lanes j in [0, R/2) ----------------------------------------
    j = tl.arange(0, BLOCK_H)
    j_mask = j < ROT_DIM // 2
    mask = row_mask[:, None] & j_mask[None, :]
    if INTERLEAVED:
        ch_a = 2 * j
        ch_b = 2 * j + 1
    else:
        ch_a = j
        ch_b = j + ROT_DIM // 2
    # 64-bit column offsets: the last-dim stride of a strided view can be large.
    col_a = ch_a.to(tl.int64)
    col_b = ch_b.to(tl.int64)

    xa = tl.load(x_ptr + x_row[:, None] + (col_a * sx3)[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x_ptr + x_row[:, None] + (col_b * sx3)[None, :], mask=mask, other=0.0).to(tl.float32)

    if HALF_WIDTH:
        # One table value per pair: c_a == c_b, s_a == s_b.  Load once.
        jj = j.to(tl.int64)
        ca = tl.load(cos_ptr + c_row[:, None] + (jj * sc3)[None, :], mask=mask, other=0.0).to(tl.float32)
        sa = tl.load(sin_ptr + s_row[:, None] + (jj * ss3)[None, :], mask=mask, other=0.0).to(tl.float32)
        cb = ca
        sb = sa
    else:
        ca = tl.load(cos_ptr + c_row[:, None] + (col_a * sc3)[None, :], mask=mask, other=0.0).to(tl.float32)
        cb = tl.load(cos_ptr + c_row[:, None] + (col_b * sc3)[None, :], mask=mask, other=0.0).to(tl.float32)
        sa = tl.load(sin_ptr + s_row[:, None] + (col_a * ss3)[None, :], mask=mask, other=0.0).to(tl.float32)
        sb = tl.load(sin_ptr + s_row[:, None] + (col_b * ss3)[None, :], mask=mask, other=0.0).to(tl.float32)

    if BACKWARD:
        # Transpose of the forward map: same formula with (s_a, s_b) -> (-s_b, -s_a).
        sa_eff = -sb
        sb_eff = -sa
    else:
        sa_eff = sa
        sb_eff = sb

    out_a = xa * ca - xb * sa_eff
    out_b = xb * cb + xa * sb_eff
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_row[:, None] + ch_a[None, :], out_a.to(out_ty), mask=mask)
    tl.store(out_ptr + out_row[:, None] + ch_b[None, :], out_b.to(out_ty), mask=mask)

    # ---- pass-through tail [R, D) (same in forward and backward) --------------------------------
    if HEAD_DIM > ROT_DIM:
        t = ROT_DIM + tl.arange(0, BLOCK_T)
        t_mask = row_mask[:, None] & (t < HEAD_DIM)[None, :]
        xt = tl.load(x_ptr + x_row[:, None] + (t.to(tl.int64) * sx3)[None, :], mask=t_mask, other=0.0)
        tl.store(out_ptr + out_row[:, None] + t[None, :], xt.to(out_ty), mask=t_mask)


@triton.jit
def rotary_kernel(
    # first tensor ("q"; the only one for rotary_forward)
    q_ptr, qcos_ptr, qsin_ptr, qout_ptr,
    q_rows, q_size1, q_size2,
    q_sx0, q_sx1, q_sx2, q_sx3,
    q_sc0, q_sc1, q_sc2, q_sc3,
    q_ss0, q_ss1, q_ss2, q_ss3,
    # second tensor ("k"), only read when HAS_K
    k_ptr, kcos_ptr, ksin_ptr, kout_ptr,
    k_rows, k_size1, k_size2,
    k_sx0, k_sx1, k_sx2, k_sx3,
    k_sc0, k_sc1, k_sc2, k_sc3,
    k_ss0, k_ss1, k_ss2, k_ss3,
    q_blocks,  # number of programs working on q; programs [q_blocks, grid) work on k
    HAS_K: tl.constexpr,
    Q_HEAD_DIM: tl.constexpr,
    K_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_WIDTH: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    Q_BLOCK_T: tl.constexpr,
    K_BLOCK_T: tl.constexpr,
):
    """Rotary embedding over rows of one tensor, or of q and k in one launch (see module doc)."""
    pid = tl.program_id(0)
    if HAS_K:
        # Branch is uniform per program, so there is no divergence inside a program.
        if pid < q_blocks:
            _rotary_rows(pid, q_ptr, qcos_ptr, qsin_ptr, qout_ptr, q_rows, q_size1, q_size2,
                         q_sx0, q_sx1, q_sx2, q_sx3, q_sc0, q_sc1, q_sc2, q_sc3,
                         q_ss0, q_ss1, q_ss2, q_ss3,
                         Q_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD,
                         BLOCK_ROWS, BLOCK_H, Q_BLOCK_T)
        else:
            _rotary_rows(pid - q_blocks, k_ptr, kcos_ptr, ksin_ptr, kout_ptr, k_rows, k_size1, k_size2,
                         k_sx0, k_sx1, k_sx2, k_sx3, k_sc0, k_sc1, k_sc2, k_sc3,
                         k_ss0, k_ss1, k_ss2, k_ss3,
                         K_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD,
                         BLOCK_ROWS, BLOCK_H, K_BLOCK_T)
    else:
        _rotary_rows(pid, q_ptr, qcos_ptr, qsin_ptr, qout_ptr, q_rows, q_size1, q_size2,
                     q_sx0, q_sx1, q_sx2, q_sx3, q_sc0, q_sc1, q_sc2, q_sc3,
                     q_ss0, q_ss1, q_ss2, q_ss3,
                     Q_HEAD_DIM, ROT_DIM, HALF_WIDTH, INTERLEAVED, BACKWARD,
                     BLOCK_ROWS, BLOCK_H, Q_BLOCK_T)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------

def default_config(head_dim: int, n_rows: int) -> dict:
    """Launch parameters: ~2048 element slots per program (about 16 per thread at 4 warps),
    enough bytes in flight per SM for a memory-bound kernel without register pressure.
    Placeholder values; tuned later on an H100 (pass ``config=`` to override)."""
    block_d = triton.next_power_of_2(max(head_dim, 1))
    block_rows = max(1, 2048 // block_d)
    # Do not launch mostly-masked programs for tiny inputs (decode: a handful of rows).
    block_rows = min(block_rows, triton.next_power_of_2(max(n_rows, 1)))
    num_warps = 4 if block_rows * block_d >= 1024 else (2 if block_rows * block_d >= 256 else 1)
    return {"BLOCK_ROWS": block_rows, "num_warps": num_warps}


def _check_config(config: dict) -> tuple[int, int]:
    unknown = set(config) - {"BLOCK_ROWS", "num_warps"}
    if unknown:
        raise ValueError(f"rotary: unknown config keys {sorted(unknown)}")
    block_rows = int(config["BLOCK_ROWS"])
    num_warps = int(config.get("num_warps", 4))
    for name, v in (("BLOCK_ROWS", block_rows), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"rotary: config {name}={v} must be a positive power of 2")
    return block_rows, num_warps


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


def _prepare(x, cos, sin, rotary_dim, name):
    """Validate one tensor and return (n_rows, size1, size2, x_strides, cos_strides, sin_strides, half_width)."""
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
        half_width = False
    elif W == R // 2:
        half_width = True
    else:
        raise ValueError(f"rotary: cos/sin last dim {W} must be rotary_dim={R} or rotary_dim//2={R // 2}")
    for t, n in ((cos, "cos"), (sin, "sin")):
        if t.device != x.device:
            raise ValueError(f"rotary: {n} is on {t.device}, {name} on {x.device}")
    lead = tuple(x.shape[:3])
    c_strides = _table_strides(cos, lead, W, f"cos ({name})")
    s_strides = _table_strides(sin, lead, W, f"sin ({name})")
    n_rows = lead[0] * lead[1] * lead[2]
    return n_rows, lead[1], lead[2], tuple(x.stride()), c_strides, s_strides, half_width


def _launch(q, qcos, qsin, q_out, k, kcos, ksin, k_out, *, interleaved, rotary_dim, backward, config):
    has_k = k is not None
    qn, q1, q2, qsx, qsc, qss, q_half = _prepare(q, qcos, qsin, rotary_dim, "q" if has_k else "x")
    if has_k:
        kn, k1, k2, ksx, ksc, kss, k_half = _prepare(k, kcos, ksin, rotary_dim, "k")
        if k_half != q_half:
            raise ValueError("rotary: q and k tables must have the same width")
        if k.device != q.device:
            raise ValueError(f"rotary: k is on {k.device}, q on {q.device}")
    else:
        # Dummy second group: never touched (HAS_K is a constexpr, the branch is not compiled).
        k, kcos, ksin, k_out = q, qcos, qsin, q_out
        kn, k1, k2, ksx, ksc, kss = 0, 1, 1, qsx, qsc, qss
    if qn + kn == 0:
        return
    head_q, head_k = q.shape[-1], k.shape[-1]
    if config is None:
        config = default_config(max(head_q, head_k), max(qn, kn))
    block_rows, num_warps = _check_config(config)

    q_blocks = triton.cdiv(qn, block_rows)
    k_blocks = triton.cdiv(kn, block_rows) if has_k else 0
    grid = (q_blocks + k_blocks,)
    R = rotary_dim
    rotary_kernel[grid](
        q, qcos, qsin, q_out, qn, q1, q2, *qsx, *qsc, *qss,
        k, kcos, ksin, k_out, kn, k1, k2, *ksx, *ksc, *kss,
        q_blocks,
        HAS_K=has_k,
        Q_HEAD_DIM=head_q,
        K_HEAD_DIM=head_k,
        ROT_DIM=R,
        HALF_WIDTH=q_half,
        INTERLEAVED=bool(interleaved),
        BACKWARD=bool(backward),
        BLOCK_ROWS=block_rows,
        BLOCK_H=triton.next_power_of_2(R // 2),
        Q_BLOCK_T=triton.next_power_of_2(max(head_q - R, 1)),
        K_BLOCK_T=triton.next_power_of_2(max(head_k - R, 1)),
        num_warps=num_warps,
    )


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
) -> torch.Tensor:
    """Apply RoPE (or, with ``backward=True``, its transpose) to the first ``rotary_dim``
    channels of ``x``.

    x:        4-D ``(A, B, C, D)``, any strides (read in place, never copied).
    cos, sin: broadcastable to ``(A, B, C, W)``, ``W in (rotary_dim, rotary_dim // 2)``; normally
              4-D views expanded with ``.expand`` (zero strides are read as such).
    config:   optional ``{"BLOCK_ROWS": pow2, "num_warps": pow2}`` overriding
              :func:`default_config`.
    Returns a new contiguous ``(A, B, C, D)`` tensor of ``out_dtype``.
    """
    out = torch.empty(tuple(x.shape), dtype=out_dtype, device=x.device)
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
    Returns ``(q_out, k_out)``, new contiguous tensors of ``q_out_dtype`` / ``k_out_dtype``.
    """
    if (cos_k is None) != (sin_k is None):
        raise ValueError("rotary: pass both cos_k and sin_k, or neither")
    if cos_k is None:
        cos_k, sin_k = cos_q, sin_q
    q_out = torch.empty(tuple(q.shape), dtype=q_out_dtype, device=q.device)
    k_out = torch.empty(tuple(k.shape), dtype=k_out_dtype, device=k.device)
    _launch(q, cos_q, sin_q, q_out, k, cos_k, sin_k, k_out,
            interleaved=interleaved, rotary_dim=rotary_dim, backward=backward, config=config)
    return q_out, k_out
