"""Index expressions on a tensor's last dim, whatever way the graph spells them.

`x[..., a:b:c]`, `x[:, :, a:b:c]` (every other dim kept whole) are one `last_dim_slice`; `x[..., k]`
one `last_dim_index`; `x.flatten(-2)` and the view/reshape that does the same, `merges_last_two`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .canon import canon, example_value, is_call, norm_dim, rank, same_shape, shape, tensor_meta

_FULL = slice(None, None, None)


@dataclass(frozen=True)
class LastDimSlice:
    """`base[..., start:stop:step]` with the bounds normalised to 0 <= start, stop <= D."""

    base: fx.Node
    start: Any
    stop: Any
    step: int
    stop_arg: Any  # the stop as written in the graph (an int or a size node)


def _index_entries(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    c = is_call(node, "getitem")
    if c is None or not isinstance(c["input"], fx.Node) or tensor_meta(c["input"]) is None:
        return None
    idx = c["index"]
    return c["input"], (idx if isinstance(idx, tuple) else (idx,))


def _last_dim_entry(idx: tuple, ndim: int) -> Any:
    """The index entry that applies to the last dim when every other dim is kept whole, or
    `slice(None)` if the index leaves the last dim untouched and keeps every dim; else None."""
    if any(e is None or isinstance(e, (fx.Node, torch.Tensor)) for e in idx):
        return None
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        before, after = idx[:at], idx[at + 1:]
        if len(after) > 1 or any(e != _FULL for e in before):
            return None
        return after[0] if after else _FULL
    if len(idx) > ndim or any(e != _FULL for e in idx[:-1]):
        return None
    return idx[-1] if len(idx) == ndim else _FULL


def last_dim_slice(node: Any) -> LastDimSlice | None:
    """`x[..., a:b:c]` (or `x[:, :, a:b:c]`) on the last dim only."""
    got = _index_entries(node) if isinstance(node, fx.Node) else None
    if got is None:
        return None
    base, idx = got
    ndim = rank(base)
    entry = _last_dim_entry(idx, ndim)
    if not isinstance(entry, slice):
        return None
    d = shape(base)[-1]
    step = 1 if entry.step is None else example_value(entry.step)
    if not isinstance(step, int) or step <= 0:
        return None

    def norm(v, default):
        v = default if v is None else example_value(v)
        if isinstance(v, int) and not isinstance(v, bool):
            if v < 0:
                v += d
            if isinstance(d, int):
                v = max(0, min(v, d))
        return v

    return LastDimSlice(base, norm(entry.start, 0), norm(entry.stop, d), step, entry.stop if entry.stop is not None else d)


def last_dim_index(node: Any) -> tuple[fx.Node, int] | None:
    """`x[..., k]` with an int k: (x, k)."""
    got = _index_entries(node) if isinstance(node, fx.Node) else None
    if got is None:
        return None
    base, idx = got
    entry = _last_dim_entry(idx, rank(base))
    if isinstance(entry, int) and not isinstance(entry, bool):
        d = shape(base)[-1]
        return base, (entry % d if isinstance(d, int) else entry)
    return None


def is_last_dim(dim: Any, ndim: int | None) -> bool:
    return ndim is not None and norm_dim(dim, ndim) == ndim - 1


def keeps_last_dim(idx: tuple, ndim: int) -> bool:
    """An index that leaves the last dim whole and last (x[:, None, :], x[0], cos[pos_ids])."""
    if Ellipsis in idx:
        after = idx[idx.index(Ellipsis) + 1:]
        return not after or (len(after) == 1 and after[0] == _FULL)
    consumed = [e for e in idx if e is not None]
    if len(consumed) < ndim:
        return True
    return len(consumed) == ndim and idx[-1] is not None and isinstance(idx[-1], slice) and idx[-1] == _FULL


def merges_last_two(node: fx.Node, inp: fx.Node) -> bool:
    """node == inp.flatten(-2) (a flatten, or a view/reshape to inp.shape[:-2] + (a*b,))."""
    si, so = shape(inp), shape(node)
    if si is None or so is None or len(so) != len(si) - 1 or len(si) < 2:
        return False
    c = canon(node)
    if c is None or c["input"] is not inp:
        return False
    if c.name == "flatten":
        return norm_dim(c["start_dim"], len(si)) == len(si) - 2 and norm_dim(c["end_dim"], len(si)) == len(si) - 1
    if c.name in ("view", "reshape"):
        return same_shape(so, si[:-2] + (si[-2] * si[-1],))
    return False
