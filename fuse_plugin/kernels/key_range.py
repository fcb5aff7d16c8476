"""The live key range of a per-key padding mask (issue 31, "padding"): which key blocks the general
kernels may skip.

A padding mask (BERT's attention mask, left padding in generation) is a bias broadcast over the
queries: (B, 1, 1, Lk) or (B, Hq, Lq, Lk) with query stride 0, read one value per key by the
kernels (``BIAS_KEYS``, host.bias_over_keys). Its visible keys of a (batch[, head]) row lie in
[k_lo, k_hi): the first visible key and one past the last. ``key_ranges`` computes that table on
the device with plain torch ops (no host sync; traced into Inductor graphs with the launches);
the kernels (``KEY_RANGE`` constexpr) intersect their key-block ranges with it: the forward and
the dQ loops visit only key blocks overlapping [k_lo, k_hi), the dK/dV programs of a key block
outside it visit no query block and store zeros. Blocks straddling an edge keep the exact masking
(the bias itself is still read and applied).

Hidden keys: a bool mask's False; a float (additive) bias's -inf or anything <= finfo(dtype).min
(HF's mask value). A row with no visible key gets the full range [0, Lk), so such rows (NaN for
a bool mask, eager's uniform average for a finfo.min bias) come out as they did without skipping.

Exactness. Where a query row sees a visible key, a hidden key's weight exp(s + bias - m) is 0 in
fp32: m >= the visible key's score, and bias <= finfo.min (-3.4e38 for fp32/bf16) sends the
exponent far below fp32's underflow (~-104). For fp16's finfo.min (-65504) it is 0 unless the
hidden key's raw score exceeds the row max by more than ~65000 (never, for attention scores).
The online softmax then gets the same max and the same sums (a fully hidden block adds exact
zeros, and a row whose first blocks were hidden-only has its running sums rescaled by
exp(min - m) = 0 once a visible key arrives), so skipping changes nothing; the backward's p, and
so dS, dK, dV, are exactly 0 at hidden keys. Causal: a query row i < k_lo sees only hidden keys
(all of them j <= i < k_lo); under a finfo.min bias such a row is eager's uniform average over
them, so the kernels skip below k_lo only for query blocks whose first row is >= k_lo, and a
dK/dV program of a key block below k_lo still visits the query rows < k_lo. Keys from k_hi on are
never seen by such rows (j > i), so they are skipped for every row.

Not taken (``args`` says off): a bias gradient is wanted (dS of hidden keys is not 0 for a learned
bias), a sliding window, chunks or documents (a window may hide every visible key of a row, which
then falls back on the hidden ones), a window-periodic bias, keys too short to skip a block
(``MIN_KEYS``), and the switch ``FUSE_PLUGIN_KEY_PADDING_SKIP=off`` (settings.key_padding_skip).
By default (``auto``) only where measured faster (``AUTO_MIN_KEYS``, ``AUTO_MIN_WORK``).
"""
from __future__ import annotations

import torch

from .host import NO_BIAS
from .launch import hint

# With the switch ``on``: from two key blocks of 128 on there is a whole block a padded row can
# skip; below, nothing can be skipped (the default, ``auto``, waits for AUTO_MIN_KEYS).
MIN_KEYS = 256

# The default ("auto"): where the skip was measured faster in both directions (H100, torch 2.11,
# bf16, benchmarks/padding.py, 2026-11-27, B 32, H 12, D 64, ~35% right padding, general family,
# skip / dense device ms): L 512: forward 0.119 / 0.105 (slower: the table's small kernels cost
# more than the skipped blocks), backward 0.323 / 0.363; L 1024: 0.297 / 0.357 and 0.911 / 1.223;
# L 2048: 1.051 / 1.334 and 3.223 / 4.438. So from 1024 keys, and no smaller a problem than the
# smallest measured win (B x Hq x Lq x Lk), where the fixed cost of the table could outweigh it.
AUTO_MIN_KEYS = 1024
AUTO_MIN_WORK = 32 * 12 * 1024 * 1024


def key_ranges(bias: torch.Tensor) -> torch.Tensor:
    """(B', H', 2) int32 contiguous: row [b, h] = [k_lo, k_hi) of the keys of ``bias`` (a
    (B, Hq, Lq, Lk) view with query stride 0, bool keep-mask or float additive) that are
    visible (module doc); [0, Lk) where none is. B' is 1 where the bias has batch stride 0 and H'
    1 where it has head stride 0 (one row then serves every batch / head), else B and Hq."""
    rows = bias.select(2, 0)  # (B, Hq, Lk): the query dim is broadcast
    if _broadcast(rows.stride(0)):
        rows = rows.narrow(0, 0, 1)
    if _broadcast(rows.stride(1)):
        rows = rows.narrow(1, 0, 1)
    if rows.dtype == torch.bool:
        visible = rows
    else:
        # not (<= min): -inf and finfo.min are hidden, a NaN stays visible (it reaches the output);
        # logical_not, not ~: bitwise_not of a fake CUDA bool fails in a CPU build of torch
        visible = torch.logical_not(rows <= torch.finfo(rows.dtype).min)
    # argmax takes the first maximum (documented, and so in Inductor's lowering): the first visible
    # key, and from the flipped row the last. No factory (arange): the trace builds on fake CUDA
    # tensors in a CPU build of torch too (tests/inductor_trace.py).
    Lk = rows.shape[-1]
    live = visible.to(torch.int32)
    lo = live.argmax(-1)
    hi = Lk - live.flip(-1).argmax(-1)
    none = live.amax(-1) == 0
    lo = torch.where(none, 0, lo)
    hi = torch.where(none, Lk, hi)
    return torch.stack([lo, hi], -1).to(torch.int32)


def _broadcast(stride) -> bool:
    """A literal 0 stride (a symbolic one keeps the dim: right for any stride)."""
    return type(stride) is int and stride == 0


def wanted(call, block_n: int) -> bool:
    """Does the call take the key range (module doc: when not)? ``block_n``: the launch's key
    tile (at least two key blocks, or nothing can be skipped)."""
    from .. import settings

    if call.kind == NO_BIAS or not call.bias_keys or call.need_dbias or call.banded:
        return False
    if call.period is not None:
        return False
    how = settings.key_padding_skip()
    if how == "off":
        return False
    B, Hq, Lq, _, _, Lk, _ = (hint(s) for s in call.sizes)  # a speed choice only: both forms are exact
    if how == "auto" and (Lk < AUTO_MIN_KEYS or B * Hq * Lq * Lk < AUTO_MIN_WORK):
        return False
    return Lk >= MIN_KEYS and Lk > block_n


def args(call, block_n: int) -> dict:
    """The kernels' key-range arguments: ``KeyRange`` (the table, cached on the call; call.dummy,
    never read, when off), its batch and head strides (0 where one row serves all) and
    ``KEY_RANGE``."""
    if not wanted(call, block_n):
        return dict(KeyRange=call.dummy, stride_krb=0, stride_krh=0, KEY_RANGE=False)
    table = getattr(call, "_key_range", None)
    if table is None:
        table = call._key_range = key_ranges(call.bias)
    return dict(KeyRange=table, stride_krb=table.stride(0) if table.shape[0] > 1 else 0,
                stride_krh=table.stride(1) if table.shape[1] > 1 else 0, KEY_RANGE=True)
