"""The cos and sin tables a rotary site reads, and how the op gets them.

A `Table` is what a spelling matcher found where cos (or sin) goes: a node read at full width
(one value per channel, HF), at half width (one per channel pair), or one part of a complex node
(Meta's freqs_cis). `plan_table` turns it into a `TablePlan`: a full-width table proven to repeat
each value within a channel pair (cat((f, f), -1) for half-split pairs, f.repeat_interleave(2, -1)
for interleaved ones, under views, casts, cos/sin and scalar arithmetic) is read at half width
from f, with the ops between re-applied to f; any other table is passed whole.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .canon import canon, dtype, dtype_cast_target, known_equal, norm_dim, rank, same_value, shape, tensor_meta, value_key
from .graph_edit import NodeBuilder
from .indexing import is_last_dim, keeps_last_dim

COMPLEX_PART_DTYPE = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


@dataclass(frozen=True)
class Table:
    """Where the op's cos (or sin) comes from: `node` read at `width` ("full": one value per
    channel, "half": one per channel pair); `part` "real"/"imag" reads a complex node's part."""

    node: fx.Node
    width: str
    part: str | None = None

    @property
    def dtype(self) -> torch.dtype | None:
        dt = dtype(self.node)
        return COMPLEX_PART_DTYPE.get(dt) if self.part else dt


@dataclass
class TablePlan:
    """How the op's table is obtained: `source` read at `width`; either a complex node's `part`
    (view_as_real(source)[..., 0 / 1]), or a full-width table's `rebuild` chain (its views, casts,
    cos/sin...) re-applied to its half-width source in place of `full_base` = cat((f, f)) /
    f.repeat_interleave(2)."""

    key: Any
    width: str
    dtype: torch.dtype
    source: fx.Node
    part: str | None = None
    full_base: fx.Node | None = None
    rebuild: list[fx.Node] = field(default_factory=list)

    @property
    def bypassed(self) -> set[fx.Node]:
        """The full-width nodes that the op no longer reads (erased once dead)."""
        return set(self.rebuild) | ({self.full_base} if self.full_base is not None else set())

    def build(self, b: NodeBuilder, memo: dict) -> fx.Node:
        """Insert the nodes that produce the table; `memo` shares view_as_real(freqs) between the
        cos and sin of one op."""
        node = self.source
        if self.part is not None:
            if ("view_as_real", node) not in memo:
                memo[("view_as_real", node)] = b.function(torch.view_as_real, node)
            return b.function(operator.getitem, memo[("view_as_real", node)], (Ellipsis, 0 if self.part == "real" else 1))
        old_input = self.full_base
        for old in self.rebuild:  # bottom-up: each one re-applied to the half-width node below it
            half_input = node
            node = b.copy(old, lambda a, o=old_input, h=half_input: h if a is o else a)
            old_input = old
        return node


def plan_table(t: Table, interleaved: bool) -> TablePlan:
    if t.part is not None:
        return TablePlan(("part", t.part, value_key(t.node)), "half", t.dtype, t.node, part=t.part)
    if t.width == "full":
        half = _half_source(t.node, interleaved)
        if half is not None and isinstance(half[0], fx.Node) and tensor_meta(half[0]) is not None:
            f, base, chain = half
            return TablePlan(("half-of", value_key(t.node)), "half", t.dtype, f, full_base=base, rebuild=chain)
    return TablePlan(("as-is", value_key(t.node)), t.width, t.dtype, t.node)


def _half_source(table: fx.Node, interleaved: bool) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(f, base, chain) if `table` provably repeats f's values within each channel pair:
    base = cat((f, f), -1) (half-split) or f.repeat_interleave(2, -1) (interleaved), under a
    chain of pair-preserving ops (listed bottom-up)."""
    chain, node = [], table
    for _ in range(16):
        c = canon(node)
        if c is not None and c.name == "cat" and not interleaved:
            ts = c["tensors"]
            if isinstance(ts, (list, tuple)) and len(ts) == 2 and is_last_dim(c["dim"], rank(node)) and same_value(ts[0], ts[1]):
                return ts[0], node, chain[::-1]
        if c is not None and c.name == "repeat_interleave" and interleaved:
            if c["repeats"] == 2 and c["dim"] is not None and is_last_dim(c["dim"], rank(node)):
                return c["input"], node, chain[::-1]
        inp = _keeps_pair_values(node)
        if inp is None:
            return None
        chain.append(node)
        node = inp
    return None


_TABLE_UNARY = {torch.cos, torch.sin, "cos", "sin"}


def _keeps_pair_values(node: fx.Node) -> fx.Node | None:
    """The input of `node` if `node` maps a table whose channel pairs hold equal values to one
    whose pairs do too, keeping its last dim: a view on other dims, a dtype cast, cos/sin/neg,
    arithmetic with a Python scalar."""
    if node.op in ("call_function", "call_method") and node.target in _TABLE_UNARY:
        return node.args[0] if len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node) else None
    c = canon(node)
    inp = c.args.get("input") if c is not None else None
    if not isinstance(inp, fx.Node) or rank(inp) is None or rank(node) is None:
        return None
    if c.name == "unsqueeze":
        return inp if norm_dim(c["dim"], rank(node)) not in (None, rank(node) - 1) else None
    if c.name == "getitem":
        idx = c["index"] if isinstance(c["index"], tuple) else (c["index"],)
        if any(isinstance(e, fx.Node) and dtype(e) == torch.bool for e in idx):
            return None  # a mask may flatten the last dim away
        keeps = keeps_last_dim(idx, rank(inp)) and known_equal(shape(node)[-1], shape(inp)[-1])
        return inp if keeps else None
    if c.name in ("float", "half", "bfloat16", "to", "type_as"):
        return inp if dtype_cast_target(c) != "not-a-cast" else None
    if c.name == "neg":
        return inp
    if c.name in ("mul", "div", "add", "sub") and isinstance(c["other"], (int, float)) and c.args.get("alpha", 1) == 1:
        return inp
    return None


def trig_of(table: fx.Node) -> str | None:
    """"cos" / "sin" if the table is provably cos(...) / sin(...) (under views, casts, scalars and
    cat((f, f)) / repeat_interleave), else None."""
    node = table
    for _ in range(16):
        if node.op in ("call_function", "call_method") and node.target in _TABLE_UNARY:
            return "cos" if node.target in (torch.cos, "cos") else "sin"
        c = canon(node)
        if c is not None and c.name == "cat" and isinstance(c["tensors"], (list, tuple)) and len(c["tensors"]) == 2 \
                and same_value(*c["tensors"]):
            node = c["tensors"][0]
        elif c is not None and c.name == "repeat_interleave":
            node = c["input"]
        else:
            node = _keeps_pair_values(node)
        if not isinstance(node, fx.Node):
            return None
    return None
