"""Device helpers shared by the attention kernels (attention_fwd.py, attention_bwd.py): tile loads
and stores of head-dim parts, the rotary rotation of q/k tiles (rope folded into attention),
score scaling and masking, the softmax recomputation of the backward and the dropout draw.
Shapes, layouts and numerics: see the module docstring of kernels/attention.py."""
from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Above this |lse| an fp32 lse is too coarse (ulp(1024) ~ 1.2e-4) to recompute p from it.
_LSE_EXACT_LIMIT = tl.constexpr(1024.0)


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """fp32-accumulating dot. UPCAST: Triton's CPU interpreter multiplies bf16 tensors as their raw
    uint16 bits, so on the interpreter bf16 operands are widened first (bf16 products are exact
    in fp32, so this matches the GPU up to summation order)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PRECISION)
    return r


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` as one accumulating dot (see ``_dot``)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc, input_precision=PRECISION)
    return r


@triton.jit
def _tile_ptrs_mask(base, row0, n_rows, stride_r, stride_c, N_COLS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pointers and in-range mask of rows [row0, row0 + BLOCK_R) x cols [0, BLOCK_C) of an
    (n_rows, N_COLS) matrix. The row offset is taken in int64 (row0 * stride may pass 2**31);
    the in-tile offsets are small enough for int32. The column mask is dropped at compile time
    when the tile is as wide as the matrix (N_COLS == BLOCK_C)."""
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    origin = tl.cast(row0, tl.int64) * stride_r
    ptrs = base + origin + (r[:, None] * stride_r + c[None, :] * stride_c)
    if N_COLS == BLOCK_C:
        mask = (row0 + r)[:, None] < n_rows
    else:
        mask = ((row0 + r)[:, None] < n_rows) & (c[None, :] < N_COLS)
    return ptrs, mask


@triton.jit
def _load_tile(base, row0, n_rows, N_COLS: tl.constexpr, stride_r, stride_c,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile of an (n_rows, N_COLS) matrix (see ``_tile_ptrs_mask``); out of range reads as 0."""
    ptrs, mask = _tile_ptrs_mask(base, row0, n_rows, stride_r, stride_c, N_COLS, BLOCK_R, BLOCK_C)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_tile(base, value, row0, n_rows, N_COLS: tl.constexpr, stride_r, stride_c,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Inverse of ``_load_tile``: stores the in-range part of ``value``."""
    ptrs, mask = _tile_ptrs_mask(base, row0, n_rows, stride_r, stride_c, N_COLS, BLOCK_R, BLOCK_C)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_d(base, row0, n_rows, stride_r, stride_c, D: tl.constexpr, D0: tl.constexpr,
            D1: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [row0, row0 + BLOCK_R) of an (n_rows, D) matrix as the head-dim parts (t0, t1):
    columns [0, D0) and [D0, D0 + D1). Without a split (D1 == 0) t1 is t0 (never used)."""
    if D1 == 0:
        t0 = _load_tile(base, row0, n_rows, D, stride_r, stride_c, BLOCK_R, D0)
        t1 = t0
    else:
        t0 = _load_tile(base, row0, n_rows, D0, stride_r, stride_c, BLOCK_R, D0)
        t1 = _load_tile(base + D0 * stride_c, row0, n_rows, D - D0, stride_r, stride_c,
                        BLOCK_R, D1)
    return t0, t1


@triton.jit
def _store_d(base, t0, t1, row0, n_rows, stride_r, stride_c, D: tl.constexpr, D0: tl.constexpr,
             D1: tl.constexpr, BLOCK_R: tl.constexpr):
    """Inverse of ``_load_d``."""
    if D1 == 0:
        _store_tile(base, t0, row0, n_rows, D, stride_r, stride_c, BLOCK_R, D0)
    else:
        _store_tile(base, t0, row0, n_rows, D0, stride_r, stride_c, BLOCK_R, D0)
        _store_tile(base + D0 * stride_c, t1, row0, n_rows, D - D0, stride_r, stride_c,
                    BLOCK_R, D1)


@triton.jit
def _atomic_add_tile(base, value, row0, n_rows, N_COLS: tl.constexpr, stride_r,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 ``+=`` of ``value`` into rows [row0, ...) of a row-major (n_rows, N_COLS) buffer."""
    ptrs, mask = _tile_ptrs_mask(base, row0, n_rows, stride_r, 1, N_COLS, BLOCK_R, BLOCK_C)
    tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")


@triton.jit
def _zero_parts(ROWS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """fp32 zero accumulators for up to three head-dim parts of widths (W0, W1, W2); an absent
    part (width 0) aliases the first and is never used (see the parts convention below)."""
    z0 = tl.zeros([ROWS, W0], tl.float32)
    if W1 != 0:
        z1 = tl.zeros([ROWS, W1], tl.float32)
    else:
        z1 = z0
    if W2 != 0:
        z2 = tl.zeros([ROWS, W2], tl.float32)
    else:
        z2 = z0
    return z0, z1, z2


@triton.jit
def _band_lo(row, window, WINDOW: tl.constexpr):
    """The first key query ``row`` sees under its band (with causal): WINDOW 1, a sliding window
    (keys row - window + 1 .. row); WINDOW 2, chunks of ``window`` keys (keys of row's chunk,
    (row // window) * window .. row: Llama 4's chunked attention)."""
    if WINDOW == 2:
        lo = (row // window) * window
    else:
        lo = tl.maximum(row - window + 1, 0)
    return lo


@triton.jit
def _band_end(key, window, WINDOW: tl.constexpr):
    """The first query row that no longer sees ``key`` under the band (``_band_lo``): rows from
    it on start their keys after ``key``."""
    if WINDOW == 2:
        end = (key // window + 1) * window
    else:
        end = key + window
    return end


@triton.jit
def _key_blocks(start_m, Lk, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = False, window=0):
    """The forward's key range for the query block at ``start_m``: ``(lo, full_lo, full_end,
    hi)``. Key blocks [full_lo, full_end) are fully visible to every row of the block (no mask
    math); [lo, full_lo) and [full_end, hi) need the masks: the causal diagonal and/or the last
    partial key block, and with a sliding window the window's lower edge. Causal (top-left): key
    blocks starting after the block's last row are fully masked and skipped. WINDOW (with
    causal; query i sees keys i - window + 1 .. i): key blocks ending before the block's first
    row's first key are skipped too, found from the sizes alone (O(1), no mask is read); WINDOW 2
    (chunks, ``_band_lo``): likewise the key blocks before the block's first row's chunk."""
    if IS_CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M)
        full_end = (tl.minimum(start_m + 1, Lk) // BLOCK_N) * BLOCK_N
    else:
        hi = Lk
        full_end = (Lk // BLOCK_N) * BLOCK_N
    if WINDOW:
        lo = (_band_lo(start_m, window, WINDOW) // BLOCK_N) * BLOCK_N
        # the first key block every row of the block sees whole: its last row's first key on
        full_lo = tl.cdiv(_band_lo(start_m + BLOCK_M - 1, window, WINDOW), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), full_end)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_end, hi


@triton.jit
def _doc_span(docs, pos0, n, BLOCK: tl.constexpr):
    """``(first, end)`` of the documents of positions [pos0, pos0 + BLOCK) (those < n): the least
    ``lo`` and the greatest ``hi`` of their rows of the documents table (``docs``: the (L, 2)
    int32 rows of one batch, contiguous; row p holds [lo, hi), the first and one past the last
    position of p's document; call.document_ranges). As the queries and the keys share the ids
    (self-attention), this is both the keys these queries may see and the queries that may see
    these keys: exact where each document is contiguous, a superset otherwise (the tiles then
    mask by ``_same_document``). Two loads of BLOCK int32 and two reductions."""
    pos = pos0 + tl.arange(0, BLOCK)
    ok = pos < n
    first = tl.min(tl.load(docs + pos * 2, mask=ok, other=n), 0)
    end = tl.max(tl.load(docs + pos * 2 + 1, mask=ok, other=0), 0)
    return first, end


@triton.jit
def _same_document(docs, rows, cols, Lq, Lk):
    """The (query, key) pairs of one document: ``lo[row] == lo[col]`` (lo, a document's first
    position, names it uniquely; see ``_doc_span``). ``rows``/``cols`` broadcast against the
    tile; out-of-range positions never match."""
    a = tl.load(docs + rows * 2, mask=rows < Lq, other=-1)
    b = tl.load(docs + cols * 2, mask=cols < Lk, other=-2)
    return a == b


@triton.jit
def _doc_key_blocks(docs, start_m, Lq, Lk, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """``_key_blocks`` for documents (WINDOW 3): the key blocks from the one holding the first
    key of the block's rows' documents up to their last key (``_doc_span``), cut by causal;
    every block masked (``(lo, hi, hi, hi)``: the first loop of the forward walks them all)."""
    first, end = _doc_span(docs, start_m, Lq, BLOCK_M)
    hi = tl.minimum(Lk, end)
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)
    lo = (first // BLOCK_N) * BLOCK_N
    return lo, hi, hi, hi


@triton.jit
def _doc_query_blocks(docs, start_n, Lq, Lk, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """``_query_blocks`` for documents (WINDOW 3): the query blocks from the one holding the
    first query of the key block's documents up to their last (``_doc_span``; causal: none
    before the key block), all masked: ``(lo, end, 0, end)``."""
    first, end = _doc_span(docs, start_n, Lk, BLOCK_N)
    lo = (first // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        lo = tl.maximum(lo, (start_n // BLOCK_M) * BLOCK_M)
    end = tl.minimum(Lq, end)
    return lo, end, end * 0, end  # (n_full a run-time 0, as the other paths' tensor: no loop folded)


@triton.jit
def _live_key_blocks(key_range, start_m, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, hi)``: the keys a query block at ``start_m`` must visit under a per-key padding
    mask's live range (KEY_RANGE; ``key_range``: the [k_lo, k_hi) int32 pair of the block's
    (batch, head), kernels/key_range.py). lo is k_lo's key block start; hi is k_hi. Causal: 0
    where the block's first row is below k_lo (rows i < k_lo see only hidden keys, which a
    finfo.min bias leaves as eager's uniform average: those rows keep every key up to i)."""
    k_lo = tl.load(key_range)
    k_hi = tl.load(key_range + 1)
    if IS_CAUSAL:
        k_lo = tl.where(start_m >= k_lo, k_lo, 0)
    return (k_lo // BLOCK_N) * BLOCK_N, k_hi


@triton.jit
def _cut_key_blocks(key_range, start_m, lo, full_lo, full_end, hi, IS_CAUSAL: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """``_key_blocks``' ``(lo, full_lo, full_end, hi)`` cut to the live keys (``_live_key_blocks``;
    without a window, whose lower edge this does not compose with). The edge blocks stay exact:
    the bias is read and applied in every visited block."""
    live_lo, k_hi = _live_key_blocks(key_range, start_m, IS_CAUSAL, BLOCK_N)
    lo = tl.maximum(lo, live_lo)
    full_lo = tl.maximum(full_lo, live_lo)
    full_end = tl.maximum(tl.minimum(full_end, tl.cdiv(k_hi, BLOCK_N) * BLOCK_N), full_lo)
    hi = tl.minimum(hi, k_hi)
    return lo, full_lo, full_end, hi


@triton.jit
def _live_query_end(key_range, start_n, Lq, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of the query rows a key block at ``start_n`` must visit under a per-key padding
    mask's live range [k_lo, k_hi) (KEY_RANGE, ``_live_key_blocks``): Lq where the block overlaps
    it; 0 where it lies from k_hi on (every row that sees it sees a visible key: its weights are
    exact zeros) or, without causal, below k_lo; causal and below k_lo, k_lo (rows i < k_lo see
    only hidden keys, and give them eager's weights; later rows give them 0)."""
    k_lo = tl.load(key_range)
    k_hi = tl.load(key_range + 1)
    below = start_n + BLOCK_N <= k_lo
    if IS_CAUSAL:
        end = tl.where(below, tl.minimum(k_lo, Lq), Lq)
    else:
        end = tl.where(below, 0, Lq)
    return tl.where(start_n >= k_hi, 0, end)


@triton.jit
def _key_block_program(Lk, Hkv, kv_group, group_split, BLOCK_N: tl.constexpr):
    """What a program of the atomic backward owns: ``(pid_n, split, b, kvh, heads_per_split)``,
    key block ``pid_n`` (block 0, the causally heaviest, first) of KV head ``kvh`` of batch ``b``,
    and share ``split`` of the ``group_split`` shares of its GQA group's query heads."""
    n_n_blocks = tl.cdiv(Lk, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % n_n_blocks
    rest = pid // n_n_blocks
    split = rest % group_split
    pid_bh = rest // group_split
    return pid_n, split, pid_bh // Hkv, pid_bh % Hkv, kv_group // group_split


@triton.jit
def _query_block_program(Lq, Hq, kv_group, BLOCK_M: tl.constexpr):
    """What a program of the dQ kernels owns: ``(pid_bh, b, h, kvh, start_m)``, query block
    ``start_m`` of query head ``h`` of batch ``b`` (``pid_bh = b * Hq + h``) and its KV head;
    the last query blocks, causally the heaviest, first."""
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    pid_bh = pid // n_m_blocks
    h = pid_bh % Hq
    return pid_bh, pid_bh // Hq, h, h // kv_group, pid_m * BLOCK_M


@triton.jit
def _query_blocks(start_n, Lq, Lk, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = False, window=0):
    """The atomic backward's query range for the key block at ``start_n``: ``(lo, mid, n_full,
    end)``. Query blocks [lo, mid) need masks (the causal diagonal; every block when this key
    block is the last, partial one, whose padding keys must not reach dQ); the ``n_full``
    blocks from mid on are fully visible; [mid + n_full * BLOCK_M, end) need masks again (the
    sliding window's edge). The blocks visited are those starting in [lo, end). Causal: query
    blocks ending before the key block's first key see none of it. WINDOW (with causal; query
    i sees keys i - window + 1 .. i): query blocks starting at or after the block's last key +
    window see none of it either (``end``; WINDOW 2, chunks: rows after the last key's chunk);
    without it ``end`` is Lq."""
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    mid = tl.minimum(tl.where(start_n + BLOCK_N > Lk, Lq, mid), Lq)
    if WINDOW:
        end = tl.minimum(Lq, _band_end(start_n + BLOCK_N - 1, window, WINDOW))
        mid = tl.minimum(mid, end)
        # blocks whose last row still sees this block's first key are fully visible
        full_hi = tl.minimum((_band_end(start_n, window, WINDOW) // BLOCK_M) * BLOCK_M,
                             tl.cdiv(Lq, BLOCK_M) * BLOCK_M)
        n_full = tl.maximum(full_hi - mid, 0) // BLOCK_M
    else:
        end = Lq
        n_full = tl.cdiv(Lq - mid, BLOCK_M)
    return lo, mid, n_full, end


# --------------------------------------------------------------------------------------------
# q / k head-dim parts and the rotary embedding folded into their loads
# --------------------------------------------------------------------------------------------
# q and k tiles are handled as up to three column parts (t0, t1, t2) of widths (D0, D1, D2),
# a width 0 meaning "absent" (the variable then aliases t0 and is never used):
#   ROT == 0 (no rope): t0/t1 are ``_load_d``'s columns [0, D0) and [D0, D) (D1 = 0 without a
#                       split, D2 = 0).
#   ROT == R > 0:       t0/t1 are the first/second members of the R/2 rotated channel pairs
#                       (half-split: channels [0, R/2) and [R/2, R); INTERLEAVED: the even and the
#                       odd channels of [0, R), one contiguous load split in registers), both D0 = D1 =
#                       max(16, next_pow2(R/2)) wide; t2 is the pass-through tail [R, D), D2 wide
#                       (0 when R == D). Padding columns read as 0.
# A dot over the head dim is the sum of the dots over the parts (``_dot_nt``), so the rotated
# tiles never need to be put back in channel order. The rotation (``_rotate``) runs in fp32 on
# the loaded tile with the cos/sin values of its rows and is rounded back to the input dtype,
# as the unfused rotary op's output would be; gradients are rotated back by the transpose of
# the rotation (``_store_grad``) before they are stored.
# Tables: ``cos_base``/``sin_base`` point at the (batch, head) of the tile, rows are the tile's
# sequence positions (stride_tr), columns (stride_tc) the W = R (full width: one value per
# channel) or W = R/2 (HALF_TABLE: one value per pair) table entries.


@triton.jit
def _load_parts(base, row0, n_rows, stride_r, stride_c, D: tl.constexpr, D0: tl.constexpr,
                D1: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
                INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [row0, row0 + BLOCK_R) of an (n_rows, D) matrix as its head-dim parts (see above)."""
    if ROT == 0:
        t0, t1 = _load_d(base, row0, n_rows, stride_r, stride_c, D, D0, D1, BLOCK_R)
        t2 = t0
    else:
        if INTERLEAVED:
            # one contiguous (coalesced) load of the R rotated channels, split into even/odd
            x = _load_tile(base, row0, n_rows, ROT, stride_r, stride_c, BLOCK_R, 2 * D0)
            t0, t1 = tl.split(tl.reshape(x, [BLOCK_R, D0, 2]))
        else:
            t0 = _load_tile(base, row0, n_rows, ROT // 2, stride_r, stride_c, BLOCK_R, D0)
            t1 = _load_tile(base + (ROT // 2) * stride_c, row0, n_rows, ROT // 2, stride_r,
                            stride_c, BLOCK_R, D1)
        if D2 != 0:
            t2 = _load_tile(base + ROT * stride_c, row0, n_rows, D - ROT, stride_r, stride_c,
                            BLOCK_R, D2)
        else:
            t2 = t0
    return t0, t1, t2


@triton.jit
def _store_parts(base, t0, t1, t2, row0, n_rows, stride_r, stride_c, D: tl.constexpr,
                 D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
                 INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    """Inverse of ``_load_parts``."""
    if ROT == 0:
        _store_d(base, t0, t1, row0, n_rows, stride_r, stride_c, D, D0, D1, BLOCK_R)
    else:
        if INTERLEAVED:
            x = tl.reshape(tl.join(t0, t1), [BLOCK_R, 2 * D0])
            _store_tile(base, x, row0, n_rows, ROT, stride_r, stride_c, BLOCK_R, 2 * D0)
        else:
            _store_tile(base, t0, row0, n_rows, ROT // 2, stride_r, stride_c, BLOCK_R, D0)
            _store_tile(base + (ROT // 2) * stride_c, t1, row0, n_rows, ROT // 2, stride_r,
                        stride_c, BLOCK_R, D1)
        if D2 != 0:
            _store_tile(base + ROT * stride_c, t2, row0, n_rows, D - ROT, stride_r, stride_c,
                        BLOCK_R, D2)


@triton.jit
def _load_cos_sin(cos_base, sin_base, row0, n_rows, stride_tr, stride_tc, ROT: tl.constexpr,
                  INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """fp32 (c_a, s_a, c_b, s_b): the table values of the first and second pair members."""
    if HALF_TABLE:
        ca = _load_tile(cos_base, row0, n_rows, ROT // 2, stride_tr, stride_tc, BLOCK_R,
                        BLOCK_H).to(tl.float32)
        sa = _load_tile(sin_base, row0, n_rows, ROT // 2, stride_tr, stride_tc, BLOCK_R,
                        BLOCK_H).to(tl.float32)
        cb = ca
        sb = sa
    elif INTERLEAVED:
        c = _load_tile(cos_base, row0, n_rows, ROT, stride_tr, stride_tc, BLOCK_R, 2 * BLOCK_H)
        s = _load_tile(sin_base, row0, n_rows, ROT, stride_tr, stride_tc, BLOCK_R, 2 * BLOCK_H)
        ca, cb = tl.split(tl.reshape(c.to(tl.float32), [BLOCK_R, BLOCK_H, 2]))
        sa, sb = tl.split(tl.reshape(s.to(tl.float32), [BLOCK_R, BLOCK_H, 2]))
    else:
        ca = _load_tile(cos_base, row0, n_rows, ROT // 2, stride_tr, stride_tc, BLOCK_R,
                        BLOCK_H).to(tl.float32)
        sa = _load_tile(sin_base, row0, n_rows, ROT // 2, stride_tr, stride_tc, BLOCK_R,
                        BLOCK_H).to(tl.float32)
        cb = _load_tile(cos_base + (ROT // 2) * stride_tc, row0, n_rows, ROT // 2, stride_tr,
                        stride_tc, BLOCK_R, BLOCK_H).to(tl.float32)
        sb = _load_tile(sin_base + (ROT // 2) * stride_tc, row0, n_rows, ROT // 2, stride_tr,
                        stride_tc, BLOCK_R, BLOCK_H).to(tl.float32)
    return ca, sa, cb, sb


@triton.jit
def _rotate(xa, xb, ca, sa, cb, sb, TRANSPOSE: tl.constexpr):
    """The rotation of the pairs (xa, xb) in fp32 (ops/reference.py ``rotary``):
    forward a·c_a − b·s_a, b·c_b + a·s_b; TRANSPOSE (gradients) a·c_a + b·s_b, b·c_b − a·s_a."""
    xa = xa.to(tl.float32)
    xb = xb.to(tl.float32)
    if TRANSPOSE:
        ra = xa * ca + xb * sb
        rb = xb * cb - xa * sa
    else:
        ra = xa * ca - xb * sa
        rb = xb * cb + xa * sb
    return ra, rb


@triton.jit
def _load_qk(base, row0, n_rows, stride_r, stride_c, cos_base, sin_base, stride_tr, stride_tc,
             D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
             ROT: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
             BLOCK_R: tl.constexpr):
    """``_load_parts`` of a q or k tile, rotated (with ROT) in registers right after the load."""
    t0, t1, t2 = _load_parts(base, row0, n_rows, stride_r, stride_c, D, D0, D1, D2, ROT,
                             INTERLEAVED, BLOCK_R)
    if ROT != 0:
        ca, sa, cb, sb = _load_cos_sin(cos_base, sin_base, row0, n_rows, stride_tr, stride_tc,
                                       ROT, INTERLEAVED, HALF_TABLE, BLOCK_R, D0)
        r0, r1 = _rotate(t0, t1, ca, sa, cb, sb, False)
        t0 = r0.to(base.dtype.element_ty)
        t1 = r1.to(base.dtype.element_ty)
    return t0, t1, t2


@triton.jit
def _store_grad(base, g0, g1, g2, row0, n_rows, stride_r, stride_c, cos_base, sin_base,
                stride_tr, stride_tc, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                D2: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                HALF_TABLE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Stores the fp32 gradient parts of a q or k tile; with ROT they are gradients w.r.t. the
    rotated tile and go through the transpose of the rotation first (gradient w.r.t. the input)."""
    if ROT != 0:
        ca, sa, cb, sb = _load_cos_sin(cos_base, sin_base, row0, n_rows, stride_tr, stride_tc,
                                       ROT, INTERLEAVED, HALF_TABLE, BLOCK_R, D0)
        r0, r1 = _rotate(g0, g1, ca, sa, cb, sb, True)
        _store_parts(base, r0, r1, g2, row0, n_rows, stride_r, stride_c, D, D0, D1, D2, ROT,
                     INTERLEAVED, BLOCK_R)
    else:
        _store_parts(base, g0, g1, g2, row0, n_rows, stride_r, stride_c, D, D0, D1, D2, ROT,
                     INTERLEAVED, BLOCK_R)


@triton.jit
def _dot_nt(a0, a1, a2, b0, b1, b2, D1: tl.constexpr, D2: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a · bᵀ over the head dim: the sum of the dots of the parts."""
    r = _dot(a0, tl.trans(b0), PRECISION, UPCAST)
    if D1 != 0:
        r = _dot_acc(a1, tl.trans(b1), r, PRECISION, UPCAST)
    if D2 != 0:
        r = _dot_acc(a2, tl.trans(b2), r, PRECISION, UPCAST)
    return r


@triton.jit
def _atomic_add_dq(dq_base, ds, k0, k1, k2, row0, n_rows, D: tl.constexpr, D0: tl.constexpr,
                   D1: tl.constexpr, D2: tl.constexpr, ROT: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr):
    """dQA += ds · k per part into the contiguous fp32 (n_rows, D) rows at ``dq_base``. With ROT
    the buffer holds the parts side by side (columns [0, R/2), [R/2, R), [R, D), whatever the
    pairing): ``attention_dq_rope_cast_kernel`` rotates them back into channel order."""
    if ROT == 0:
        if D1 == 0:
            _atomic_add_tile(dq_base, _dot(ds, k0, PRECISION, UPCAST), row0, n_rows, D, D,
                             BLOCK_R, D0)
        else:
            _atomic_add_tile(dq_base, _dot(ds, k0, PRECISION, UPCAST), row0, n_rows, D0, D,
                             BLOCK_R, D0)
            _atomic_add_tile(dq_base + D0, _dot(ds, k1, PRECISION, UPCAST), row0, n_rows,
                             D - D0, D, BLOCK_R, D1)
    else:
        _atomic_add_tile(dq_base, _dot(ds, k0, PRECISION, UPCAST), row0, n_rows, ROT // 2, D,
                         BLOCK_R, D0)
        _atomic_add_tile(dq_base + ROT // 2, _dot(ds, k1, PRECISION, UPCAST), row0, n_rows,
                         ROT // 2, D, BLOCK_R, D1)
        if D2 != 0:
            _atomic_add_tile(dq_base + ROT, _dot(ds, k2, PRECISION, UPCAST), row0, n_rows,
                             D - ROT, D, BLOCK_R, D2)


@triton.jit
def _pair_ptrs(base, row0, col0, r, c, stride_r, stride_c):
    """Pointers of a (query, key) tile: the tile origin in int64 (row0 * stride_r can pass
    2**31 for a dense (Lq, Lk) matrix), the in-tile offsets ``r``/``c`` (broadcastable aranges)
    in int32, which keeps per-element address math cheap."""
    origin = tl.cast(row0, tl.int64) * stride_r + tl.cast(col0, tl.int64) * stride_c
    return base + origin + (r * stride_r + c * stride_c)


@triton.jit
def _replaced(rep_base, row0, col0, r, c, Lq, Lk, stride_rm, stride_rn, HAS_REPLACE: tl.constexpr):
    """The replace mask's tile (True: the score is replaced by the bias; out of range False), laid
    out like the score tile (see ``_scores``); without HAS_REPLACE nothing is loaded (0, unused)."""
    if HAS_REPLACE:
        ptrs = _pair_ptrs(rep_base, row0, col0, r, c, stride_rm, stride_rn)
        in_range = ((row0 + r) < Lq) & ((col0 + c) < Lk)
        rep = tl.load(ptrs, mask=in_range, other=0) != 0
    else:
        rep = 0
    return rep


@triton.jit
def _scores(qk, row0, col0, r, c, Lq, Lk, bias_base, stride_bm, stride_bn, rep, score_scale,
            IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr, MASK: tl.constexpr,
            HAS_REPLACE: tl.constexpr, BIAS_KEYS: tl.constexpr = False,
            WINDOW: tl.constexpr = False, window=0, docs=0):
    """Scale, bias and mask a tile of raw dot products ``qk``.

    Query index = row0 + r, key index = col0 + c, with ``r``/``c`` aranges shaped to broadcast
    against ``qk`` ((M, 1)/(1, N), or (1, M)/(N, 1) for the transposed tiles of the backward).
    Units: natural log with a float bias (score_scale = scale), log2 otherwise
    (score_scale = scale * log2(e)). Masked entries (bool False, and with MASK the padding keys
    and the causally hidden ones) are -inf. MASK=False is for tiles known to be fully visible.
    HAS_REPLACE (a float bias only): where ``rep`` (``_replaced``) holds, the score is the bias
    alone, where(rep, bias, s + bias). BIAS_KEYS: the bias does not vary over queries (stride 0
    there: a key-padding mask, (B, 1, 1, Lk) broadcast): one value per key is loaded, a vector
    broadcast against the tile, not a tile of repeated values. WINDOW (with IS_CAUSAL): the
    keys at or before row - window are masked too (a sliding window: key j visible to query i
    iff i - window < j <= i); WINDOW 2: the keys before row's chunk (``_band_lo``). WINDOW 3
    (documents, with or without IS_CAUSAL): the keys of other documents (``_same_document`` on
    the documents table ``docs``).
    """
    s = qk * score_scale
    if HAS_REPLACE:
        s = tl.where(rep, 0.0, s)
    if BIAS_KIND != 0:
        if BIAS_KEYS:
            b_ptrs = _pair_ptrs(bias_base, 0, col0, 0, c, 0, stride_bn)
            in_range = (col0 + c) < Lk
        else:
            b_ptrs = _pair_ptrs(bias_base, row0, col0, r, c, stride_bm, stride_bn)
            in_range = ((row0 + r) < Lq) & ((col0 + c) < Lk)
        if BIAS_KIND == 2:
            s += tl.load(b_ptrs, mask=in_range, other=0.0).to(tl.float32)
        else:
            s = tl.where(tl.load(b_ptrs, mask=in_range, other=0) != 0, s, float("-inf"))
    if MASK:
        cols = col0 + c
        keep = cols < Lk
        if IS_CAUSAL:
            keep = keep & (cols <= row0 + r)
            if WINDOW == 1 or WINDOW == 2:
                keep = keep & (cols >= _band_lo(row0 + r, window, WINDOW))
        if WINDOW == 3:
            keep = keep & _same_document(docs, row0 + r, cols, Lq, Lk)
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 alone (no libdevice: the same code on Triton 3.6, 3.9 and in the
    interpreter). |x| < 0.125: odd Taylor polynomial to x^9 (relative error < 1e-11 there, where
    (1 - e) / (1 + e) would cancel); else sign(x)·(1 - e) / (1 + e) with e = exp(-2|x|) <= 1,
    which never overflows (large |x| gives e = 0, tanh = ±1)."""
    x = x.to(tl.float32)
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * _LOG2E))
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0
                                                                  + x2 * (62.0 / 2835.0)))))
    return tl.where(ax < 0.125, small, tl.where(x < 0, -big, big))


@triton.jit
def _capped_scores(qk, row0, col0, r, c, Lq, Lk, bias_base, stride_bm, stride_bn, rep_base,
                   stride_rm, stride_rn, score_scale, cap, IS_CAUSAL: tl.constexpr,
                   BIAS_KIND: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                   HAS_REPLACE: tl.constexpr, BIAS_KEYS: tl.constexpr = False,
                   WINDOW: tl.constexpr = False, window=0, docs=0):
    """``_scores`` with the softcap (``SOFTCAP``) applied before the replace mask, the bias and
    the masks: (s, t, rep) with s = cap·t (+ bias, masks) and t = tanh(qk·score_scale); the
    launcher passes score_scale = scale / softcap and cap = softcap in the kernel's units (times
    log2(e) without a float bias). Without SOFTCAP: (``_scores``, qk, rep) with score_scale as
    usual (t unused). ``rep``: the replace mask's tile (``_replaced``; 0 without HAS_REPLACE).
    The backward's chain rule needs t and rep: dS/d(qk·scale) = (1 - t²)·(not rep)."""
    rep = _replaced(rep_base, row0, col0, r, c, Lq, Lk, stride_rm, stride_rn, HAS_REPLACE)
    if SOFTCAP:
        t = _tanh(qk * score_scale)
        s = _scores(t, row0, col0, r, c, Lq, Lk, bias_base, stride_bm, stride_bn, rep, cap,
                    IS_CAUSAL, BIAS_KIND, MASK, HAS_REPLACE, BIAS_KEYS, WINDOW, window, docs)
    else:
        t = qk
        s = _scores(qk, row0, col0, r, c, Lq, Lk, bias_base, stride_bm, stride_bn, rep,
                    score_scale, IS_CAUSAL, BIAS_KIND, MASK, HAS_REPLACE, BIAS_KEYS, WINDOW,
                    window, docs)
    return s, t, rep


@triton.jit
def _exp(x, NATURAL: tl.constexpr):
    """exp of a score difference in the kernel's units (see ``_scores``)."""
    if NATURAL:
        r = tl.exp2(x * _LOG2E)
    else:
        r = tl.exp2(x)
    return r


@triton.jit
def _probs(s, row_m, row_r, BIAS_KIND: tl.constexpr):
    """Backward recomputation of the softmax from the preprocess statistics; ``row_m``/``row_r``
    are already broadcast against ``s``. Dead rows have row_m = +inf, hence p = 0."""
    if BIAS_KIND == 2:
        p = tl.exp2((s - row_m) * _LOG2E - row_r)
    else:
        p = tl.exp2(s - row_m)
    return p


@triton.jit
def _mix32(x):
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 in which every input bit flips each
    output bit with probability ~1/2 (uint32 arithmetic wraps mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.cast(0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.cast(0xC2B2AE35, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _dropout_keep(seed, bh, row0, col0, offs_r, offs_c, drop_thresh, TRANSPOSED: tl.constexpr):
    """Dropout keep-mask of the score tile of queries ``row0 + offs_r`` and keys ``col0 + offs_c``
    of query head ``bh`` (= b * Hq + h): (queries, keys), or (keys, queries) with TRANSPOSED.

    16 random bits per score from a counter hash (uint32, wrapping): with s0/s1 the low/high
    words of the 64-bit ``seed``, a = mix(mix(s0 ^ bh·G) ^ s1) per head, r_i = mix(a + i·C) per
    query row, and the score (i, j) draws x = mix(r_i + j·G) (``_mix32``; G = 0x9E3779B9,
    C = 0x85EBCA77): a Weyl sequence over the keys of each row through a bijective mixer, so no
    two keys of a row share a draw. It is kept iff x >> 16 >= ``drop_thresh`` (= floor(p·2**16)).
    Element-wise in whatever layout the scores have: unlike a Philox draw shared by 8 keys, no
    interleave or transpose of the mask through shared memory (measured on the H100 at BERT's
    shape, RESULTS "Stop 20": 4.8 us of forward and 4.4 of backward per layer). The mask depends
    on (seed, bh, i, j) alone, not on the tiling, so the forward and every backward path draw the
    same one, and ``reference.dropout_keep`` repeats it bit for bit on the CPU."""
    s0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    s1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _mix32(s0 ^ (bh.to(tl.uint32) * tl.cast(0x9E3779B9, tl.uint32)))
    a = _mix32(a ^ s1)
    r = _mix32(a + (row0 + offs_r).to(tl.uint32) * tl.cast(0x85EBCA77, tl.uint32))
    c = (col0 + offs_c).to(tl.uint32) * tl.cast(0x9E3779B9, tl.uint32)
    if TRANSPOSED:
        x = _mix32(r[None, :] + c[:, None])
    else:
        x = _mix32(r[:, None] + c[None, :])
    return (x >> 16).to(tl.int32) >= drop_thresh
