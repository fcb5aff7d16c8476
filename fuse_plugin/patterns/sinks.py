"""Attention sinks: the softmax over the scores and one more column, the head's sink logit, which
is dropped after the softmax (HF gpt-oss's eager attention):

    sinks = module.sinks.reshape(1, -1, 1, 1).expand(B, -1, Lq, -1)      # (B, H, Lq, 1)
    c = torch.cat([scores, sinks], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values                           # optional: a no-op for softmax
    w = F.softmax(c, dim=-1)[..., :-1]                                     # then dropout, casts, w · v

`read(softmax)` gives the form's parts (or None where the softmax is not of this form, or the
reason it cannot be taken): the scores, the (H,) sink logits and the nodes between. The attention
matcher (patterns/attention.py) then matches scores → … → softmax → w · v as for any site, from
the scores and from the dropped column, and replaces it with `fuse_plugin::attention_sinks`.
Reads the graph only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import fx

from .canon import call_of, float_cast_dtype, is_identity, known_equal, norm_dim, shape


@dataclass
class SinkForm:
    scores: fx.Node  # the scores before the cat (B, H, Lq, Lk)
    cat: fx.Node  # the node that reads the scores
    sinks: fx.Node  # a tensor of the H sink logits, any shape of H elements (ops: reshape(-1))
    dropped: fx.Node  # w[..., :-1]: the weights the site goes on with
    nodes: list  # cat, max, .values, sub, softmax, casts, slice: taken over with the site


def _is_max_values(node: fx.Node, of: fx.Node) -> bool:
    """node = of.max(dim=-1, keepdim=True).values (torch.max / Tensor.max, then [0] or .values)."""
    c = call_of(node)
    if c is None or c.name != "getitem" or c["index"] != 0:
        return False
    m = c["input"]
    if not isinstance(m, fx.Node) or not (
            (m.op == "call_method" and m.target == "max") or (m.op == "call_function" and m.target is torch.max)):
        return False
    args, kwargs = list(m.args), dict(m.kwargs)
    src = args.pop(0) if args else kwargs.pop("input", None)
    dim = args.pop(0) if args else kwargs.pop("dim", None)
    keepdim = args.pop(0) if args else kwargs.pop("keepdim", False)
    r = len(shape(of) or ())
    return src is of and isinstance(dim, int) and r > 0 and norm_dim(dim, r) == r - 1 and keepdim is True


def _sink_column(col: fx.Node, s: tuple) -> Union[fx.Node, str]:
    """The tensor of H sink logits that `col` (B, H, Lq, 1) broadcasts (through expands and float
    casts), or why not."""
    base = col
    while isinstance(base, fx.Node) and (_is_cast(base) or getattr(call_of(base), "name", None) == "expand"):
        base = call_of(base)["input"]
    if base is not col and not known_equal((shape(base) or (0,))[-1], 1):
        base = col
    bs = shape(base)
    if bs is None or len(bs) != 4 or not known_equal(bs[-1], 1):
        return f"the column joined to the scores is not one value per head ({_fmt(bs)})"
    if not (known_equal(bs[0], 1) and known_equal(bs[2], 1) and known_equal(bs[1], s[1])):
        return f"the column joined to the scores {_fmt(bs)} is not one value per head (1, {s[1]}, 1, 1)"
    return base


def _is_cast(node: fx.Node) -> bool:
    c = call_of(node)
    return c is not None and (float_cast_dtype(c) is not None or is_identity(c))


def _fmt(s) -> str:
    return "no shape" if s is None else str(tuple(s))


def _drops_last(node: fx.Node, lk_plus_1) -> bool:
    """node = w[..., :-1] (or w[:, :, :, :Lk]) over the last dim of 4-D weights."""
    c = call_of(node)
    if c is None or c.name != "getitem":
        return False
    idx = c["index"]
    if not isinstance(idx, tuple) or not idx:
        return False
    last = idx[-1]
    if not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1):
        return False
    head = idx[:-1]
    if head != (Ellipsis,) and not (len(head) == 3 and all(h == slice(None) for h in head)):
        return False
    return last.stop == -1 or (isinstance(last.stop, int) and known_equal(lk_plus_1, last.stop + 1))


def read(softmax: fx.Node) -> Optional[Union[SinkForm, str]]:
    """The sink form around `softmax` (module docstring), None if it is not one, or why it is one
    the op cannot take."""
    c = call_of(softmax)
    x = c["input"]
    if not isinstance(x, fx.Node):
        return None
    nodes = []
    cx = call_of(x)
    if cx is not None and cx.name == "sub" and isinstance(cx["other"], fx.Node) and cx["alpha"] == 1:
        if _is_max_values(cx["other"], cx["input"]):
            nodes += [x, cx["other"], cx["other"].args[0]]
            x = cx["input"]
            cx = call_of(x)
    if cx is None or cx.name != "cat":
        return None
    tensors, s = cx["tensors"], shape(x)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or s is None or len(s) != 4:
        return None
    if norm_dim(cx["dim"], 4) != 3:
        return None
    w, casts = softmax, []
    while len(w.users) == 1 and _is_cast(next(iter(w.users))):  # casts of the weights before the slice
        w = next(iter(w.users))
        casts.append(w)
    users = list(w.users)
    if len(users) != 1 or not _drops_last(users[0], s[3]):
        return None  # a softmax over a cat that does not drop the last column: not this form
    scores, col = tensors
    ss = shape(scores) if isinstance(scores, fx.Node) else None
    if ss is None or len(ss) != 4 or not isinstance(col, fx.Node):
        return "the scores joined to the sink column are not 4-D"
    sinks = _sink_column(col, ss)
    if isinstance(sinks, str):
        return sinks
    return SinkForm(scores, x, sinks, users[0], [x] + nodes + [softmax] + casts + [users[0]])
