"""Structure in a mask, read from how the graph builds it (issue 31): windows, chunks, documents.

Each reader takes one bool mask part of a score chain (attention_bias.MaskFill) and says what it
is, for every size, or None:

    window_of     hides exactly the keys j <= i - W of query i   (HF Mistral: kv > q - W)
    chunk_of      keeps exactly i // C == j // C                (Llama 4's chunked attention)
    documents_of  keeps exactly doc[..., i] == doc[..., j] for an integer tensor doc (sequences
                  packed in one row, each attending to itself: torchtitan, TRL packing)

A window beside a causal mask becomes the op's ``window`` argument, chunks beside one its ``chunk``,
documents (with or without a causal mask; ids (L,) or (B, L), ``documents_arg``) its ``documents``
(attention_bias.causal_or_bias, where that keeps eager's values); the kernels then skip the key
blocks they hide. `notes(parts)` names every structure left among the bias's parts, for explain:
a window, chunks or documents where they could not become the op's argument.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import fx

from .canon import call_of, dtype, is_identity, known_equal, shape, written
from .causal_mask import (Affine, Select, abstract_value, all_true, causal_source, constant_number, diff_args,
                          integer_affine, is_causal_mask)


def _is_keep_mask(p) -> bool:
    mask = getattr(p, "mask", None)
    return isinstance(mask, fx.Node) and dtype(mask) == torch.bool and hasattr(p, "masked_when")


def window_of(p, memo: dict) -> Optional[int]:
    """W when the part is a sliding window's lower bound: a bool mask that hides exactly the keys
    j <= i - W of query i (it keeps i - W < j); else None. With the causal mask beside it, query i
    sees the W keys i-W+1 .. i."""
    if not _is_keep_mask(p):
        return None
    v = abstract_value(p.mask, memo)
    if not isinstance(v, Select) or v.aff is None or not isinstance(v.a, bool) or v.a == v.b:
        return None
    s = v.aff.get(-1)  # aff = s·(j - i) + const
    if s not in (1, -1) or v.aff.get(-2) != -s or len(v.aff.coef) != 2:
        return None
    hidden_where_le = v.a == p.masked_when  # the part hides where aff <= 0 (else where aff > 0)
    # hidden: j - i <= t, the keys up to t before the diagonal
    if s == 1 and hidden_where_le:  # j - i + c <= 0
        t = -v.aff.const
    elif s == -1 and not hidden_where_le:  # -(j - i) + c > 0  <=>  j - i <= c - 1
        t = v.aff.const - 1
    else:
        return None  # hides keys from some diagonal on (causal-like), not a window
    return -t if t < 0 else None


def _keep_node(p) -> tuple:
    """(node, keep): the part's mask followed down through what does not change its values along
    the last two dims (expand, contiguous / clone / identity casts, size-1 dims added in front of
    them) and through negations; keep: True where node's True values are the kept scores."""
    node, keep, _ = _keep_walk(p)
    return node, keep


def _keep_walk(p) -> tuple:
    """``_keep_node`` and the size-1 dims inserted on the way, [pos] from the mask down (each pos
    counted from the right of the tensor it was inserted into)."""
    node, keep, inserted = p.mask, not p.masked_when, []
    while isinstance(node, fx.Node) and not written(node):
        c = call_of(node)
        if c is None:
            break
        if c.name in ("expand", "contiguous", "clone") or (c.name == "to" and is_identity(c)):
            node = c["input"]
        elif c.name in ("logical_not", "invert"):
            node, keep = c["input"], not keep
        else:
            lifted = _unit_inserted(node, leading=True)
            if lifted is None:
                break
            node = lifted[0]
            inserted.append(lifted[1])
    return node, keep, inserted


def _eq_operands(p) -> Optional[tuple]:
    """(a, b) when the part keeps exactly where a == b."""
    if not _is_keep_mask(p):
        return None
    node, keep = _keep_node(p)
    c = call_of(node) if isinstance(node, fx.Node) else None
    if not keep or c is None or c.name != "eq" or not isinstance(c["other"], fx.Node):
        return None
    return c["input"], c["other"]


def _index_of(node: Any, memo: dict) -> Optional[int]:
    """-2 or -1 when node's value is the query or key index itself (dims from the right)."""
    a = abstract_value(node, memo) if isinstance(node, fx.Node) else None
    if isinstance(a, Affine) and a.const == 0 and len(a.coef) == 1 and a.coef[0][1] == 1:
        return a.coef[0][0]
    return None


def _floordiv(node: Any) -> Optional[tuple]:
    """(x, C) for x // C (operator / torch.floor_divide / div(rounding_mode="floor")), C an int."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    t, args, kwargs = node.target, node.args, node.kwargs
    if t in (operator.floordiv, torch.floor_divide, "floor_divide", "__floordiv__") and len(args) == 2:
        x, c = args
    elif t in (torch.div, "div") and len(args) == 2 and kwargs.get("rounding_mode") == "floor":
        x, c = args
    else:
        return None
    c = constant_number(c)
    return (x, c) if isinstance(c, int) and c > 0 else None


def chunk_of(p, memo: dict) -> Optional[int]:
    """C when the part keeps exactly the keys of the query's chunk, i // C == j // C; else None."""
    ops = _eq_operands(p)
    if ops is None:
        return None
    a, b = (_floordiv(x) for x in ops)
    if a is None or b is None or a[1] != b[1]:
        return None
    dims = {_index_of(a[0], memo), _index_of(b[0], memo)}
    return a[1] if dims == {-1, -2} else None


def _unit_inserted(node: Any, leading: bool = False) -> Optional[tuple]:
    """(base, pos) when node is base with one size-1 dim inserted at pos (-1 or -2, from the
    right of the result; ``leading``: at any pos before those two): unsqueeze, or basic indexing
    with one None and full slices."""
    if not isinstance(node, fx.Node):
        return None
    s, c = shape(node), call_of(node)
    if s is None or c is None or len(s) < 2:
        return None
    if c.name == "unsqueeze" and isinstance(c["dim"], int):
        pos = c["dim"] % len(s) - len(s)
        return (c["input"], pos) if _wanted(pos, leading) else None
    if c.name == "getitem" and isinstance(c["index"], tuple):
        idx = list(c["index"])
        if idx.count(None) != 1 or not all(i is None or i is Ellipsis or i == slice(None) for i in idx):
            return None
        if Ellipsis in idx:  # (..., None) or (..., None, :)
            after = idx[idx.index(Ellipsis) + 1:]
            pos = after.index(None) - len(after) if None in after else None
        else:
            pos = idx.index(None) - len(s)
        return (c["input"], pos) if pos is not None and _wanted(pos, leading) else None
    return None


def _wanted(pos: int, leading: bool) -> bool:
    return pos < -2 if leading else pos in (-1, -2)


def documents_of(p, memo: dict) -> Optional[fx.Node]:
    """The document-id tensor when the part keeps exactly doc[..., i] == doc[..., j]: an eq of one
    integer tensor lifted along the keys and along the queries, or looked up along them by
    advanced indexing (``_looked_up_ids``); else None."""
    ops = _eq_operands(p)
    if ops is None:
        return None
    return _ids_compared(ops) or _looked_up_ids(ops, memo, None, None)


def _looked_up_ids(ops: tuple, memo: dict, lq, lk) -> Optional[fx.Node]:
    """doc (B, L) when the eq's operands are doc[b, q] and doc[b, kv] by advanced indexing (HF
    masking_utils' packed-sequence function, transformers 5.17: ``_lookup``), rows along dim -4."""
    a, b = (_lookup(x, memo, lq, lk) for x in ops)
    if a is None or b is None or a[0] is not b[0] or {a[1], b[1]} != {-2, -1}:
        return None
    return a[0]


def _ids_compared(ops: tuple) -> Optional[fx.Node]:
    """doc when the eq's operands ``ops`` are one integer tensor lifted along the keys and along the
    queries (doc[..., :, None], doc[..., None, :] in either order), else None."""
    lifted = [_unit_inserted(x) for x in ops]
    if None in lifted or lifted[0][0] is not lifted[1][0] or {lifted[0][1], lifted[1][1]} != {-1, -2}:
        return None
    doc = lifted[0][0]
    dt = dtype(doc)
    if dt is None or dt.is_floating_point or dt.is_complex or dt == torch.bool or not shape(doc):
        return None
    return doc


def documents_arg(p, memo: dict, lq, lk) -> Optional[tuple]:
    """(ids, causal source or None): the id tensor the op can take as its ``documents`` for a part
    that keeps exactly doc[i] == doc[j] (``documents_of``), or that AND the top-left causal mask
    (one ``and`` of the two under the same lifts: then how the causal mask was proven); else None
    (the part then stays in the bias). Ids (L,) (one row for every batch) or (B', L), L the query
    and the key length, and a 2-D one's rows along the scores' batch dim (dim -4 of the mask as it
    meets the 4-D scores: eager broadcasts right-aligned, so (B', L, L) unlifted would meet the
    heads) unless B' is 1. Strict: any other form keeps the bias."""
    if not _is_keep_mask(p):
        return None
    node, keep, inserted = _keep_walk(p)
    if keep and not inserted:
        packed = packed_positions(node, memo, lq, lk)
        ms = shape(p.mask)
        if packed is not None and ms is not None and len(ms) == 4:
            return packed
    c = call_of(node) if isinstance(node, fx.Node) and keep else None
    causal = None
    if c is not None and c.name == "and" and not written(node):
        for eq, other in ((c["input"], c["other"]), (c["other"], c["input"])):
            if isinstance(other, fx.Node) and is_causal_mask(other, "keep", lq, lk):
                c, causal = call_of(eq) if isinstance(eq, fx.Node) else None, causal_source(other)
                break
    if c is None or c.name != "eq" or not isinstance(c["other"], fx.Node):
        return None
    ms = shape(p.mask)
    looked_up = _looked_up_ids((c["input"], c["other"]), memo, lq, lk)
    if looked_up is not None:  # 4-D, rows along dim -4 by construction
        return (looked_up, causal) if not inserted and ms is not None and len(ms) == 4 else None
    doc = _ids_compared((c["input"], c["other"]))
    s = shape(doc) if doc is not None else None
    if s is None or ms is None or len(ms) > 4 or len(s) not in (1, 2):
        return None
    if not (known_equal(s[-1], lq) and known_equal(s[-1], lk)):
        return None
    if len(s) == 2 and not known_equal(s[0], 1):
        where = -3  # the rows' dim in the eq (and the and), (B', L, L)
        for pos in reversed(inserted):  # the size-1 dims inserted above it, bottom up
            where -= where <= pos
        if where != -4:
            return None
    return doc, causal


# ------------------------------------------------------------------ HF's packed sequences (positions)


def packed_positions(node: Any, memo: dict, lq, lk) -> Optional[tuple]:
    """(doc, causal source) when ``node`` (a keep mask, 4-D) is HF masking_utils' mask for
    sequences packed in one row and told apart by their positions (no attention mask;
    ``find_packed_sequence_indices`` and its and-ed mask functions):

        doc  = cumsum(diff(pos, dim=-1, prepend=pos[..., :1] - 1) != 1, -1)        (B', L)
        keep = [all-True &] (pos_e[b, kv] <= pos_e[b, q]) & (doc[b, q] == doc[b, kv])

    each value looked up by advanced indexing (b = arange(B) at dim -4, q / kv = arange(L) (+ 0)
    at dims -2 / -1), pos_e = pos or pos.expand(B, -1), casts to the device between. Exact as
    documents + top-left causal: doc's ids change exactly where the next position is not the last
    plus one, so inside a document positions rise by one per token, and there pos[kv] <= pos[q]
    iff kv <= q. Else None."""
    conjuncts = _and_terms(node)
    if conjuncts is None:
        return None
    conjuncts = [x for x in conjuncts if not all_true(x, memo)]
    if len(conjuncts) != 2:
        return None
    doc = pos = None
    for a, b in (conjuncts, conjuncts[::-1]):
        doc, pos = _lookup_eq(a, memo, lq, lk), _lookup_le(b, memo, lq, lk)
        if doc is not None and pos is not None:
            break
    if doc is None or pos is None:
        return None
    base = _expand_base(pos)
    if _positions_of(doc) is not base:
        return None
    return doc, f"positions {base.name} rising by one inside each document (HF's packed sequences)"


def _and_terms(node: Any) -> Optional[list]:
    """The operands of an and-chain (through identity casts), or None when node is not one."""
    c = call_of(node) if isinstance(node, fx.Node) and not written(node) else None
    if c is None or c.name != "and":
        return None
    out = []
    for x in (c["input"], c["other"]):
        x = _through_identity(x)
        inner = _and_terms(x)
        out += inner if inner is not None else [x]
    return out


def _through_identity(x: Any) -> Any:
    while isinstance(x, fx.Node) and not written(x):
        c = call_of(x)
        if c is None or not is_identity(c):  # contiguous, clone, a .to that changes nothing
            return x
        x = c["input"]
    return x


def _lookup(x: Any, memo: dict, lq, lk) -> Optional[tuple]:
    """(T, dim) for x = T[b, i] (advanced indexing): T 2-D (B, L) integer, b = arange(B) at dim -4
    of the 4-D result, i = arange(L) at dim -2 (queries, L = lq) or -1 (keys, L = lk)."""
    c = call_of(x) if isinstance(x, fx.Node) else None
    if c is None or c.name != "getitem" or not isinstance(c["index"], tuple) or len(c["index"]) != 2:
        return None
    t, (bi, si) = c["input"], c["index"]
    ts, xs = shape(t), shape(x)
    dt = dtype(t)
    if ts is None or xs is None or len(ts) != 2 or len(xs) != 4 or dt is None or dt.is_floating_point \
            or dt.is_complex or dt == torch.bool:
        return None
    b, i = integer_affine(bi, memo), integer_affine(si, memo)
    bs, ss = shape(bi), shape(si)
    if b is None or i is None or bs is None or ss is None or len(bs) != 4 or len(ss) != 4:
        return None
    if b.const != 0 or b.coef != ((-4, 1),) or not known_equal(bs[0], ts[0]):
        return None  # b must walk T's rows one by one
    if i.const != 0 or len(i.coef) != 1 or i.coef[0][1] != 1 or i.coef[0][0] not in (-2, -1):
        return None
    dim = i.coef[0][0]
    n = lq if dim == -2 else lk
    if not known_equal(ss[dim], ts[1]) or (n is not None and not known_equal(ts[1], n)):
        return None
    return t, dim


def _lookup_pair(x: Any, name: str, memo: dict, lq, lk) -> Optional[tuple]:
    """(T, dim of the left operand) for x = name(T[b, i], T[b, j]) with one operand looked up along
    the queries and the other along the keys."""
    c = call_of(_through_identity(x)) if isinstance(x, fx.Node) else None
    if c is None or c.name != name or not isinstance(c["other"], fx.Node):
        return None
    a, b = _lookup(c["input"], memo, lq, lk), _lookup(c["other"], memo, lq, lk)
    if a is None or b is None or a[0] is not b[0] or {a[1], b[1]} != {-2, -1}:
        return None
    return a[0], a[1]


def _lookup_eq(x: Any, memo: dict, lq, lk) -> Optional[fx.Node]:
    found = _lookup_pair(x, "eq", memo, lq, lk)
    return found[0] if found is not None else None


def _lookup_le(x: Any, memo: dict, lq, lk) -> Optional[fx.Node]:
    """T for x = T[b, kv] <= T[b, q] (or T[b, q] >= T[b, kv])."""
    for name, left in (("le", -1), ("ge", -2)):
        found = _lookup_pair(x, name, memo, lq, lk)
        if found is not None and found[1] == left:
            return found[0]
    return None


def _expand_base(x: fx.Node) -> fx.Node:
    c = call_of(x)
    while c is not None and c.name == "expand" and not written(x):
        x = c["input"]
        c = call_of(x)
    return x


def _positions_of(doc: fx.Node) -> Optional[fx.Node]:
    """pos when doc = cumsum(diff(pos, dim=-1, prepend=<one element along it>) != 1, -1)."""
    if written(doc) or doc.op not in ("call_function", "call_method"):
        return None
    if doc.target not in (torch.cumsum, "cumsum"):
        return None
    args = list(doc.args)
    dim = args[1] if len(args) > 1 else doc.kwargs.get("dim")
    ne = args[0]
    ds = shape(doc)
    if ds is None or dim not in (-1, len(ds) - 1) or doc.kwargs.get("dtype") is not None:
        return None
    c = call_of(ne) if isinstance(ne, fx.Node) else None
    if c is None or c.name != "ne" or constant_number(c["other"]) != 1 or written(ne):
        return None
    d = c["input"]
    if not isinstance(d, fx.Node) or written(d) or d.op not in ("call_function", "call_method") \
            or d.target not in (torch.diff, "diff"):
        return None
    pos, n, ddim, prepend, append = diff_args(d)
    ps = shape(pos) if isinstance(pos, fx.Node) else None
    if ps is None or n != 1 or append is not None or ddim not in (-1, len(ps) - 1) or len(ps) != len(ds):
        return None
    pre = shape(prepend) if isinstance(prepend, fx.Node) else None
    if pre is None or len(pre) != len(ps) or not known_equal(pre[-1], 1):
        return None  # the diff must keep L entries: one prepended along the last dim
    return pos


def band_of(p, memo: dict) -> Optional[tuple]:
    """("window", W) or ("chunk", C) for a part that is a sliding window's lower bound or chunks,
    else None: the bands the op takes beside a causal mask (attention_bias.causal_or_bias)."""
    w = window_of(p, memo)
    if w is not None:
        return ("window", w)
    c = chunk_of(p, memo)
    return ("chunk", c) if c is not None else None


def notes(parts: list) -> list[str]:
    """explain's words for every structure among the mask parts left for the bias."""
    memo: dict = {}
    found = []
    for p in parts:
        band = band_of(p, memo)
        if band is not None and band[0] == "window":
            w = band[1]
            found.append(f"sliding window {w} (proved: query i sees keys from i-{w - 1}; {causal_source(p.mask)})")
            continue
        if band is not None:
            c = band[1]
            found.append(f"chunks of {c} (proved: query i sees keys j with j // {c} == i // {c})")
            continue
        doc = documents_of(p, memo)
        if doc is not None:
            found.append(f"documents (ids from {doc.name}: query i sees keys j with doc[j] == doc[i])")
    why = {"chunks": ": the op takes chunks beside a causal mask, and not with sinks",
           "documents": (": the op takes documents of ids (L,) or (B, L), alone or beside masks that fill -inf, not "
                         "beside a window, chunks or sinks")}
    return [f"{what}, kept in the bias" + why.get(what.split(" ")[0], "") for what in found]
