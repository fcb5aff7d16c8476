"""Views of the scores that reshape only their batch dims, and masks carried across them.

Real code moves the scores between ranks on the way to the softmax, keeping the last two dims
(Lq, Lk) as they are:

    MBart / PLBart   bmm (B·H, Lq, Lk) → view (B, H, Lq, Lk) + mask → view (B·H, Lq, Lk) → softmax → bmm
    BLOOM            baddbmm(alibi (B·H, 1, Lk), q, kᵀ) → view (B, H, Lq, Lk) + mask → softmax → view → bmm
    DeBERTa-v2       bmm + disentangled bias (B·H, Lq, Lk) → view (B, H, Lq, Lk) → masked_fill → ...
    Swin             (B·nW, H, N, N) + rel. bias → view (B, nW, H, N, N) + window mask → view back

`batch_view(node)`: the input of such a view. The attention then runs in one canonical shape
(the 4-D shape q and k come in); a mask added in another "region" of the chain is carried over to
it by `carry_mask`: the view ops that make it broadcast to the canonical scores exactly as it
broadcast to the region's (a mask whose broadcast dims are merged with others is expanded first:
a copy of the mask's size, not of the scores'). Where the merged dims of the canonical batch are
broadcast first and full after (Swin's window mask (1, nW, 1, N, N) over (B, nW, H, N, N), the
batch b·nW + w reading window w), `carry_mask(..., periodic=True)` flattens it instead, to
(nW, 1, N, N): the op's window-periodic bias (batch b reads row b % nW, ops/attention.py), with
no copy per image.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from torch import fx

from .canon import call_of, known_equal, shape, written


def batch_view(node: Any) -> Optional[fx.Node]:
    """x when node = x.view(...) / x.reshape(...) and the two share their last two dims (only the
    leading dims are split, merged or left as they are)."""
    c = call_of(node)
    if c is None or c.name not in ("view", "reshape") or written(node) or not isinstance(c["input"], fx.Node):
        return None
    s, p = shape(node), shape(c["input"])
    if s is None or p is None or len(s) < 3 or len(p) < 3:
        return None
    if not (known_equal(s[-1], p[-1]) and known_equal(s[-2], p[-2])):
        return None
    return c["input"] if known_equal(_prod(s[:-2]), _prod(p[:-2])) else None


def _prod(dims) -> Any:
    out = 1
    for d in dims:
        out = out * d
    return out


def groups(src: tuple, dst: tuple) -> Optional[list[tuple[range, range]]]:
    """The row-major correspondence of two batch shapes with the same number of elements: a list of
    (src dims, dst dims) whose products are equal, each as small as it can be; None when it cannot
    be read without a guard (symbolic sizes that do not line up)."""
    out, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        i0, j0 = i, j
        if i < len(src) and j < len(dst) and known_equal(src[i], dst[j]):
            out.append((range(i, i + 1), range(j, j + 1)))
            i, j = i + 1, j + 1
            continue
        # grow the shorter side until the products meet (ints only: symbolic sizes must line up 1:1)
        a, b = 1, 1
        while True:
            if not all(isinstance(x, int) for x in (a, b)):
                return None
            if a == b and (i > i0 or j > j0) and a != 1:
                break
            if a <= b and i < len(src):
                if not isinstance(src[i], int):
                    return None
                a, i = a * src[i], i + 1
            elif j < len(dst):
                if not isinstance(dst[j], int):
                    return None
                b, j = b * dst[j], j + 1
            elif i < len(src):
                if not isinstance(src[i], int):
                    return None
                a, i = a * src[i], i + 1
            else:
                break
        if a != b:
            return None
        out.append((range(i0, i), range(j0, j)))
    return out


def carry_mask(mask_shape: tuple, region: tuple, canonical: tuple, periodic: bool = False
               ) -> Union[tuple[list, Optional[int]], str]:
    """(view ops [(method, *args)], period) that turn a mask broadcasting to the scores of shape
    `region` into one broadcasting to the same scores viewed as `canonical` (both end in (Lq, Lk)),
    or why not. Per group of batch dims (`groups`): left as they are, flattened and unflattened, or
    (broadcast dims merged with others) expanded first. Sizes are ints or one -1 per unflatten.

    The period is None, but with `periodic` where the group of the canonical batch dim (dim 0)
    merges broadcast dims followed by full ones (ints): those are flattened to P rows without an
    expand (the window-periodic form, module doc), and the period is P."""
    n = len(region)
    if len(mask_shape) > n:
        return f"a mask of rank {len(mask_shape)} on scores of rank {n}"
    m = (1,) * (n - len(mask_shape)) + tuple(mask_shape)
    if not all(known_equal(d, 1) or known_equal(d, r) for d, r in zip(m, region)):
        return f"a mask of shape {tuple(mask_shape)} does not broadcast to the scores {tuple(region)}"
    rb, cb = region[:-2], canonical[:-2]
    gs = groups(rb, cb)
    if gs is None:
        return f"cannot line up the batch dims {rb} with {cb}"
    ops: list = [("reshape",) + m] if len(mask_shape) < n else []
    if any(not isinstance(d, int) for d in m[:-2]) and len(mask_shape) < n:
        return "a symbolic size in a mask of lower rank than the scores"
    expand = [-1] * n
    tail: list = []
    period = None
    for r, c in reversed(gs):
        ones = all(known_equal(m[i], 1) for i in r)
        full = all(known_equal(m[i], rb[i]) for i in r)
        if periodic and not ones and not full and c == range(0, 1) and _ones_then_full(m, rb, r):
            period = 1
            for i in r:
                period *= m[i]
            tail.append(("flatten", r.start, r.stop - 1))
            continue
        if not ones and not full:  # broadcast dims merged with others: expand them (a copy of the mask)
            for i in r:
                if known_equal(m[i], 1):
                    if not isinstance(rb[i], int):
                        return "a symbolic batch size in a mask that must be expanded"
                    expand[i] = rb[i]
        sizes = (1,) * len(c) if ones else tuple(cb[j] for j in c)
        if len(r) == 1 and len(c) == 1:
            continue
        symbolic = [k for k, d in enumerate(sizes) if not isinstance(d, int)]
        if len(symbolic) > 1:
            return "more than one symbolic size in one group of a carried mask"
        sizes = tuple(-1 if k in symbolic else d for k, d in enumerate(sizes))
        if len(r) > 1:
            tail.append(("flatten", r.start, r.stop - 1))
        if len(c) != 1:
            tail.append(("unflatten", r.start, sizes))
    if any(e != -1 for e in expand):
        ops.append(("expand",) + tuple(expand))
    return ops + tail, period


def _ones_then_full(m: tuple, rb: tuple, r: range) -> bool:
    """In the dims r: broadcast (size 1) ones, then full ones (int sizes), at least one of each."""
    k = next((i for i in r if not known_equal(m[i], 1)), r.stop)
    return (r.start < k < r.stop and all(isinstance(m[i], int) and known_equal(m[i], rb[i]) for i in range(k, r.stop)))
