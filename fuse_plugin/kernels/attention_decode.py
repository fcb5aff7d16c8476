"""Flash-decoding forward (Triton): attention of a few query rows over a long key/value cache.

What ``attention_forward`` (kernels/attention.py) runs instead of the general forward when
``_forward_family`` says "decode": Lq <= 16 query rows (a KV-cache decode step, or a short
speculative / chunked step) against Lk >= 256 keys, typically HF's whole static cache buffer
(Lmax) with a 4-D float mask that hides its unfilled tail. The general kernel gives each (batch,
q head) one program with a 64-128-row query tile: at Lq = 1 most of that tile is padding, only
B * Hq programs run, and each KV head is read Hq / Hkv times. Here:

* One program owns ALL query rows of one GQA group (its ``Hq // Hkv`` q heads x Lq queries: row
  r = g * Lq + i is query i of head kvh * group + g), padded to a tile of >= 16 rows for
  ``tl.dot`` (groups of more than 64 rows are cut into row blocks, each its own program), so
  every K/V tile is read once per group, and the keys are split across programs
  (flash-decoding): grid (B * Hkv * row_blocks, num_splits), split s owning the keys
  [s * keys_per_split, (s + 1) * keys_per_split). ``num_splits`` is picked once from the shape
  and the SM count (``num_splits``).
* Each program writes its unnormalised partial result: fp32 ``acc`` (rows x Dv), the row max
  ``m`` and row sum ``l`` of its keys (the online softmax of the general kernel), and ``sk``
  (below). ``attention_decode_combine_kernel`` (grid (B * Hkv * row_blocks,)) merges the splits,
  out = Σ acc_s·e^(m_s - M) / Σ l_s·e^(m_s - M), M = max m_s, lse = M + log Σ l_s·e^(m_s - M),
  and writes ``out`` and ``lse``.
* Key blocks the mask removes are not read (``_live_range``): before its key loop a program
  reads only the mask over its keys and finds the first and last block holding a key that is
  not masked; K/V are loaded for the blocks in between only (so the loop stays a plain,
  pipelined loop; a masked hole inside that range is computed, which is always exact). The
  unfilled tail of a static cache (and left padding) is then never read.

Shapes and layouts
------------------
As the general forward (kernels/attention.py): q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv,
Lk, Dv), any strides with a unit last stride; bias None, bool (True keeps) or float, a (B, Hq,
Lq, Lk) view read through its strides (0 where broadcast); ``is_causal`` top-left (key j visible
to query i iff j <= i, so only keys < Lq are ever visible). Outputs written into the caller's
buffers: ``out`` (B, Hq, Lq, Dv) in q's dtype through its strides (the op passes the (B, Lq, Hq,
Dv) buffer's transposed view, ``out_layout``), ``lse`` (B, Hq, Lq) fp32 through its strides.
Scratch: fp32 partials (P, S, BLOCK_M, Dv) and 3 x (P, S, BLOCK_M), P = B * Hkv * row_blocks,
S = num_splits (at most ``MAX_SPLITS``): no buffer grows with Lq * Lk.
D and Dv in [16, 256], any (tiles are padded to a power of 2); fp16 / bf16 / fp32.

Numerics
--------
Those of the general forward: scores accumulated in fp32 (``PRECISION``: ieee, or tf32 where an
eager fp32 matmul would use it), ``s = (q @ k^T) * scale + bias`` with the bias added in fp32 in
natural units (without a float bias, log2(e) is folded into the scale), online softmax with
exp2, P rounded to v's dtype for the P·V dot. A row whose every score is -inf (bool / -inf
masked, causal padding) gives NaN output and lse -inf, as eager softmax does. Only the summation
order differs from the general kernel (per split, then the combine).

Skipped blocks. A block is left out only if its contribution is 0:
* masked for sure: bool False, a -inf bias, keys out of range or causally hidden: exp(-inf) = 0;
* a finite float bias <= ``MASKED_BIAS`` (-2**15; HF's finfo.min masks of every dtype, fp16's
  -65504 included, and -1e9-style masks): such a key's score is s <= sk + Q, sk the largest
  skipped bias of its row and Q a bound on |q·k·scale|. It contributes exactly 0 (exp underflows
  in fp32: s - M < -104) and does not change the row max M as long as M - sk >= Q + 128, where M
  is the max over the keys that were computed. Each program records ``sk`` per row and the
  combine checks this with Q = ``SCORE_BOUND`` (2**14: far beyond any trained model's logits,
  whose softmax would be one-hot long before); a row that fails it (every key of the row carries
  a finite mask, so eager's softmax is uniform over them all; or no computed key: M = -inf) has
  every row of its tile recomputed by the combine program over all keys, without skipping (the
  general algorithm), so such rows too are what eager gives. Exact as long as the skipped keys
  have |q·k·scale| <= 2**14.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .args import KEY_ROWS, ROW_STATS, SCORES, strides
from .attention_tiles import _LN2, _dot, _dot_acc, _exp
from .host import FLOAT_BIAS as _FLOAT_BIAS
from .host import bias_args as _bias_args
from .host import cdiv, dot_precision, next_pow2, placeholder, sm_count, upcast_dot
from .launch import hint, launch

# The family's problems (registry.py): at most this many query rows, at least this many keys.
DECODE_MAX_LQ = 16
DECODE_MIN_LK = 256

__all__ = ["DecodeConfig", "decode_config", "num_splits", "attention_decode_forward"]

# A finite float bias at or below this is a mask the program may skip (see Numerics).
MASKED_BIAS = -32768.0
# The bound on |q·k·scale| of a skipped key under which the skip is exact (see Numerics).
SCORE_BOUND = 16384.0
_MASKED_BIAS = tl.constexpr(MASKED_BIAS)
_SKIP_GAP = tl.constexpr(SCORE_BOUND + 128.0)  # row max - sk >= this: the skip was exact
# Splits per (batch, kv head, row block): the combine reads them all, so keep them few.
MAX_SPLITS = 16
# Fewest key blocks a split gets (its fixed cost: the q tile load, the partial store).
MIN_BLOCKS_PER_SPLIT = 2
# Programs aimed at per SM. Decode steps are latency-bound (a 4k-key step of a 12/4-head model
# reads a few MB): H100 sweep (stop 16, benchmarks/RESULTS.md) of splits 8-128 x 32-128 keys per
# step x 2-8 warps, B 1/8, D 64/128, 768/4352 keys: the best had 8-16 splits, 128-key steps and
# 4 warps; 2 programs per SM with at most 16 splits lands there (4 per SM, 32 splits and 64-key
# steps, the first guess, were 12-24% slower than the best swept).
PROGRAMS_PER_SM = 2


class DecodeConfig(NamedTuple):
    """Launch parameters: ``block_m`` rows (GQA group x queries) per program, ``block_n`` keys
    per loop step (powers of 2 >= 16)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(rows: int, D: int, Dv: int, dtype: torch.dtype) -> DecodeConfig:
    """Tiles for ``rows`` = (Hq // Hkv) * Lq query rows per GQA group: all of them in one tile up
    to 64 (32 at head dims above 128, fp32 included); 128 keys per step in 2 stages with 16-bit
    inputs up to head dim 128 (the H100 sweep's best, see ``PROGRAMS_PER_SM``), else 32 keys per
    step (the K/V tiles and the fp32 accumulator stay in registers)."""
    d = max(next_pow2(D), next_pow2(Dv), 16)
    wide = d > 128 or dtype == torch.float32
    block_m = max(16, min(next_pow2(rows), 32 if wide else 64))
    block_n = 32 if wide else 128
    # fp32 at D 128: ieee dots keep their operands in registers (4 warps spilled, sm_90 compile)
    warps = 8 if dtype == torch.float32 and d >= 128 else 4
    return DecodeConfig(block_m, block_n, warps, 2)


def num_splits(programs: int, key_blocks: int, sms: Optional[int]) -> int:
    """How many programs share the keys of one (batch, kv head, row block): enough that the
    grid holds ``PROGRAMS_PER_SM`` programs per SM, but at least ``MIN_BLOCKS_PER_SPLIT`` key
    blocks per split and at most ``MAX_SPLITS`` splits. ``sms`` None (the CPU interpreter): 4."""
    if sms is None:
        return max(1, min(4, key_blocks // MIN_BLOCKS_PER_SPLIT))
    want = cdiv(PROGRAMS_PER_SM * sms, max(programs, 1))
    return max(1, min(want, key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))




# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------


@triton.jit
def _program_rows(pid, row_blocks, Hkv, group, Lq, BLOCK_M: tl.constexpr):
    """The tile of program ``pid`` (grid axis 0: batch x kv head x row block): (batch, kv head,
    query head, query index, in-range mask), the last three (BLOCK_M,)."""
    row_block = pid % row_blocks
    bk = pid // row_blocks
    b = (bk // Hkv).to(tl.int64)
    kvh = (bk % Hkv).to(tl.int64)
    r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    g = r // Lq
    qi = r % Lq
    h = (kvh * group + g).to(tl.int64)
    return b, kvh, h, qi.to(tl.int64), r < group * Lq


@triton.jit
def _load_q(Q, b, h, qi, row_ok, stride_qb, stride_qh, stride_qm, stride_qd, D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    ptrs = Q + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qm \
        + d[None, :] * stride_qd
    return tl.load(ptrs, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def _mask_tile(bias_rows, qi, row_ok, start_n, hi, stride_bn, IS_CAUSAL: tl.constexpr,
               BIAS_KIND: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys [start_n, start_n + BLOCK_N) for every row: (visible, bias). ``visible``: in
    range (< hi), causally visible and not bool-masked; ``bias``: the fp32 float bias (-inf where
    not visible; 0 without a float bias)."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n
    visible = row_ok[:, None] & (cols < hi)[None, :]
    if IS_CAUSAL:
        visible = visible & (cols[None, :] <= qi[:, None])
    # int64 block origin, int32 in-tile offsets (as attention_tiles._tile_ptrs_mask)
    ptrs = bias_rows[:, None] + tl.cast(start_n, tl.int64) * stride_bn \
        + (offs_n * stride_bn)[None, :]
    if BIAS_KIND == 1:
        visible = visible & (tl.load(ptrs, mask=visible, other=0) != 0)
    if BIAS_KIND == 2:
        bias = tl.load(ptrs, mask=visible, other=float("-inf")).to(tl.float32)
    else:
        bias = tl.where(visible, 0.0, float("-inf"))  # unused
    return visible, bias


@triton.jit
def _live_range(bias_rows, qi, row_ok, lo, hi, stride_bn, IS_CAUSAL: tl.constexpr,
                BIAS_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The blocks of [lo, hi) to compute: (first, end), and ``sk``, each row's largest finite
    bias <= MASKED_BIAS over the blocks left out (-inf if none; module doc, Numerics). A block is
    live if any of its (row, key) entries is visible with a float bias above MASKED_BIAS (bool:
    visible). Without a mask (BIAS_KIND 0) every block of [lo, hi) is computed."""
    sk = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if BIAS_KIND == 0:
        first = lo
        end = hi
    else:
        first = tl.zeros([], tl.int32) + hi
        last = tl.zeros([], tl.int32) + lo - BLOCK_N
        sk_post = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            visible, bias = _mask_tile(bias_rows, qi, row_ok, start_n, hi, stride_bn, IS_CAUSAL,
                                       BIAS_KIND, BLOCK_N)
            if BIAS_KIND == 2:
                live = visible & (bias > _MASKED_BIAS)
                blk_sk = tl.max(tl.where(visible & (bias <= _MASKED_BIAS), bias, float("-inf")),
                                1)
            else:
                live = visible
                blk_sk = sk
            is_live = tl.max(tl.max(live.to(tl.int32), 1), 0) > 0
            none_yet = first == hi
            # dead blocks before the first live one, and since the last live one, are left out
            sk = tl.where(none_yet, tl.where(is_live, sk, tl.maximum(sk, blk_sk)), sk)
            sk_post = tl.where(is_live, float("-inf"),
                               tl.where(none_yet, sk_post, tl.maximum(sk_post, blk_sk)))
            first = tl.where(is_live & none_yet, start_n, first)
            last = tl.where(is_live, start_n, last)
        sk = tl.maximum(sk, sk_post)
        end = last + BLOCK_N
    return first, end, sk


@triton.jit
def _decode_keys(q, m_i, l_i, acc, k_base, v_base, bias_rows, qi, row_ok, lo, end, hi,
                 stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, score_scale,
                 D: tl.constexpr, Dv: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 BIAS_KIND: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The online softmax over the key blocks starting in [lo, end) (keys < hi): the general
    forward's step (attention_fwd.py ``_fwd_step``, masked form) on this program's rows."""
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    NATURAL: tl.constexpr = BIAS_KIND == 2
    for start_n in range(lo, end, BLOCK_N):
        in_range = (start_n + offs_n) < hi
        origin = tl.cast(start_n, tl.int64)  # int64 block origin, int32 in-tile offsets
        k = tl.load(k_base + origin * stride_kn + (offs_n[:, None] * stride_kn
                                                   + d[None, :] * stride_kd),
                    mask=in_range[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(v_base + origin * stride_vn + (offs_n[:, None] * stride_vn
                                                   + dv[None, :] * stride_vd),
                    mask=in_range[:, None] & (dv[None, :] < Dv), other=0.0)
        visible, bias = _mask_tile(bias_rows, qi, row_ok, start_n, hi, stride_bn, IS_CAUSAL,
                                   BIAS_KIND, BLOCK_N)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST_DOT) * score_scale
        if BIAS_KIND == 2:
            s = s + bias
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # while a row has seen only -inf, 0 is the reference: (-inf) - (-inf) never makes NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m_i - m_ref, NATURAL)
        p = _exp(s - m_ref[:, None], NATURAL)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attention_decode_split_kernel(
    Q, K, V, Bias, PartAcc, PartM, PartL, PartSk,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    Hkv, group, Lq, n_keys, keys_per_split, row_blocks, score_scale,
    D: tl.constexpr, Dv: tl.constexpr, IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Partial attention of one (batch, kv head, row block) over one split of the keys."""
    # Inductor passes float arguments as fp64 (kernels/launch.py): the math stays fp32.
    score_scale = tl.cast(score_scale, tl.float32)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b, kvh, h, qi, row_ok = _program_rows(pid, row_blocks, Hkv, group, Lq, BLOCK_M)
    bias_rows = Bias + b * stride_bb + h * stride_bh + qi * stride_bm
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_keys)
    first, end, sk = _live_range(bias_rows, qi, row_ok, lo, hi, stride_bn, IS_CAUSAL, BIAS_KIND,
                                 BLOCK_M, BLOCK_N)
    q = _load_q(Q, b, h, qi, row_ok, stride_qb, stride_qh, stride_qm, stride_qd, D, BLOCK_M,
                BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i, l_i, acc = _decode_keys(q, m_i, l_i, acc, k_base, v_base, bias_rows, qi, row_ok, first,
                                 end, hi, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn,
                                 score_scale, D, Dv, IS_CAUSAL, BIAS_KIND, PRECISION, UPCAST_DOT,
                                 BLOCK_N, BLOCK_D, BLOCK_DV)

    r = tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    part = (pid.to(tl.int64) * n_splits + split) * BLOCK_M
    real = row_ok  # padding rows are never read back
    tl.store(PartM + part + r, m_i, mask=real)
    tl.store(PartL + part + r, l_i, mask=real)
    tl.store(PartSk + part + r, sk, mask=real)
    tl.store(PartAcc + (part + r[:, None]) * Dv + dv[None, :], acc,
             mask=real[:, None] & (dv[None, :] < Dv))


@triton.jit
def attention_decode_combine_kernel(
    Q, K, V, Bias, PartAcc, PartM, PartL, PartSk, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    Hkv, group, Lq, n_keys, n_splits, row_blocks, score_scale,
    D: tl.constexpr, Dv: tl.constexpr, IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merges the splits of one (batch, kv head, row block) into out and lse (module doc); rows
    whose skipped keys could matter are recomputed here over all keys (Numerics)."""
    score_scale = tl.cast(score_scale, tl.float32)
    pid = tl.program_id(0)
    b, kvh, h, qi, row_ok = _program_rows(pid, row_blocks, Hkv, group, Lq, BLOCK_M)
    r = tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    base = pid.to(tl.int64) * n_splits * BLOCK_M

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        m_i = tl.maximum(m_i, tl.load(PartM + base + s * BLOCK_M + r, mask=row_ok,
                                      other=float("-inf")))
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    NATURAL: tl.constexpr = BIAS_KIND == 2
    l_i = tl.zeros([BLOCK_M], tl.float32)
    sk = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for s in range(0, n_splits):
        part = base + s * BLOCK_M
        w = _exp(tl.load(PartM + part + r, mask=row_ok, other=float("-inf")) - m_ref, NATURAL)
        l_i += w * tl.load(PartL + part + r, mask=row_ok, other=0.0)
        sk = tl.maximum(sk, tl.load(PartSk + part + r, mask=row_ok, other=float("-inf")))
        a = tl.load(PartAcc + (part + r[:, None]) * Dv + dv[None, :],
                    mask=row_ok[:, None] & (dv[None, :] < Dv), other=0.0)
        acc += a * w[:, None]

    bias_rows = Bias + b * stride_bb + h * stride_bh + qi * stride_bm
    if BIAS_KIND == 2:
        # (as a difference: sk + gap would round back to sk for sk = finfo.min)
        unsafe = row_ok & (sk > float("-inf")) & ~(m_i - sk >= _SKIP_GAP)
        if tl.max(unsafe.to(tl.int32), 0) > 0:
            # A skip that might not have been exact: the whole tile again, nothing skipped.
            q = _load_q(Q, b, h, qi, row_ok, stride_qb, stride_qh, stride_qm, stride_qd, D,
                        BLOCK_M, BLOCK_D)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            m_i, l_i, acc = _decode_keys(
                q, m_i, l_i, acc, K + b * stride_kb + kvh * stride_kh,
                V + b * stride_vb + kvh * stride_vh, bias_rows, qi, row_ok, 0, n_keys, n_keys,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, score_scale, D, Dv,
                IS_CAUSAL, BIAS_KIND, PRECISION, UPCAST_DOT, BLOCK_N, BLOCK_D, BLOCK_DV)

    # A fully masked row has l_i == 0: 0/0 = NaN like eager softmax, and lse = -inf.
    out = acc / l_i[:, None]
    if NATURAL:
        lse = m_i + tl.log2(l_i) * _LN2
    else:
        lse = (m_i + tl.log2(l_i)) * _LN2
    o_ptrs = Out + b * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_om \
        + dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < Dv))
    tl.store(Lse + b * stride_lb + h * stride_lh + qi * stride_lm, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

def attention_decode_forward(q, k, v, bias, *, is_causal: bool, scale: float,
                             out_buf: Optional[torch.Tensor] = None,
                             lse: Optional[torch.Tensor] = None,
                             splits: Optional[int] = None,
                             config: Optional[DecodeConfig] = None):
    """(out, lse) of the decode kernels (module doc). Inputs as ``attention_forward`` takes them
    (q/k/v with unit last strides, bias None or a (B, Hq, Lq, Lk) view). ``out_buf`` (B, Lq, Hq,
    Dv) and ``lse`` (B, Hq, Lq): the buffers to write (allocated when None); ``out`` is returned
    as ``out_buf.transpose(1, 2)`` (traced: the view of the buffer as written, as the general
    launcher does). ``splits`` / ``config`` override ``num_splits`` / ``decode_config`` (tests,
    benchmarks)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    Hq, D, Hkv, Dv = int(Hq), int(D), int(Hkv), int(Dv)  # compile-time constants (dynamic shapes)
    if out_buf is None:
        out_buf = torch.empty((B, Lq, Hq, Dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    out = out_buf.transpose(1, 2)
    if B * Hq * Lq == 0:
        return out, lse
    group = Hq // Hkv
    rows = group * Lq
    cfg = DecodeConfig(*config) if config is not None else decode_config(rows, D, Dv, q.dtype)
    bm, bn = cfg.block_m, cfg.block_n
    for blk in (bm, bn):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"decode block sizes must be powers of 2 >= 16, got {cfg}")
    row_blocks = cdiv(rows, bm)
    n_keys = torch.sym_min(Lk, Lq) if is_causal else Lk  # top-left causal: keys >= Lq unseen
    key_blocks = cdiv(n_keys, bn)
    programs = B * Hkv * row_blocks
    # The split count is a speed choice, by the sizes' hints (launch.hint: with dynamic shapes
    # no guard); the split length and count below are exact for every length.
    n_splits = splits or num_splits(hint(programs), hint(key_blocks), sm_count(q.device))
    n_splits = max(1, min(n_splits, hint(key_blocks)))
    blocks_per_split = cdiv(key_blocks, n_splits)
    n_splits = cdiv(key_blocks, blocks_per_split)  # no empty split
    keys_per_split = blocks_per_split * bn

    kind, bias_t, sb = _bias_args(bias, placeholder(q))
    score_scale = scale if kind == _FLOAT_BIAS else scale * 1.4426950408889634
    dev = q.device
    part_acc = torch.empty((programs, n_splits, bm, Dv), dtype=torch.float32, device=dev)
    part_m, part_l, part_sk = (torch.empty((programs, n_splits, bm), dtype=torch.float32,
                                           device=dev) for _ in range(3))
    consts = dict(D=D, Dv=Dv, IS_CAUSAL=bool(is_causal), BIAS_KIND=kind,
                  PRECISION=dot_precision(q),
                  UPCAST_DOT=upcast_dot(q),
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, next_pow2(D)),
                  BLOCK_DV=max(16, next_pow2(Dv)))
    # both kernels' arguments, by name: tensors, strides, sizes and scalars, constexprs
    tensors = dict(Q=q, K=k, V=v, Bias=bias_t, PartAcc=part_acc, PartM=part_m, PartL=part_l,
                   PartSk=part_sk)
    input_strides = {**strides("q", q), **strides("k", k, KEY_ROWS), **strides("v", v, KEY_ROWS),
                     **strides("b", sb, SCORES)}
    scalars = dict(Hkv=Hkv, group=group, Lq=Lq, n_keys=n_keys, row_blocks=row_blocks,
                   score_scale=score_scale)
    launch(attention_decode_split_kernel, (programs, n_splits),
           **tensors, **input_strides, **scalars, keys_per_split=keys_per_split, **consts,
           writes=("PartAcc", "PartM", "PartL", "PartSk"),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch(attention_decode_combine_kernel, (programs,),
           **tensors, Out=out_buf, Lse=lse,
           **input_strides, **strides("o", out), **strides("l", lse, ROW_STATS),
           **scalars, n_splits=n_splits, **consts,
           writes=("Out", "Lse"), num_warps=cfg.num_warps, num_stages=1)
    return out_buf.transpose(1, 2), lse
