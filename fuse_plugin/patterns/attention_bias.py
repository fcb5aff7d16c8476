"""The scale and masks between q·kᵀ and the softmax, as the op takes them: a scale, is_causal,
and one bias.

`read_masks` reads the ops of a score chain (from `attention._chain`, bottom-up: ("scale",
factor, divide), ("add", bias, subtract), ("fill", mask, masked_when, value), and ("cast",),
("const",), ("split_batch",), which change nothing here) into mask parts:

    BiasTerm     an additive bias (times the constant scales applied after it)
    MaskFill     masked_fill / where with a mask value (<= MASK_VALUE_MAX or -inf)
    CausalPart   a part proven to be the top-left causal mask (`causal_mask.is_causal_mask`)

`causal_or_bias` decides whether the causal part can become `is_causal`; `build_bias` emits one
bias for the rest: -inf fills as a bool mask, anything else as a float32 additive bias that
reproduces eager's fully-masked rows (uniform weights with finite fills, NaN with -inf), with
`zero_filled_rows` keeping the gradient of such rows what eager's is.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import fx

from .canon import broadcasts_to, call_of, dtype, example_value, fmt_shape, is_identity, shape, written
from .causal_mask import (MASK_VALUE_MAX, Select, abstract_value, cast_value, causal_source, constant_number,
                          is_causal_mask, is_mask_value)
from .graph_edit import NodeBuilder, precedes

# The additive value a finite fill becomes: it swallows any score in float32, as finfo.min does
# in eager, so a row masked everywhere still gets uniform weights.
FLOAT_MASK_VALUE = torch.finfo(torch.float32).min


@dataclass
class BiasTerm:
    """An additive bias term: node (negated: subtracted), times the constant scales after it."""

    node: fx.Node
    negate: bool = False
    scale: float = 1.0


@dataclass
class MaskFill:
    """Scores set to `value` where mask == masked_when (masked_fill: True; where(c, x, v): False)."""

    mask: fx.Node
    masked_when: bool
    value: float
    causal: bool = False  # the mask is the causal mask (which never hides a whole row)


@dataclass
class CausalPart:
    """A mask part proven to be the top-left causal mask."""

    value: float  # the fill value of the causal mask (-inf or a finite mask value)
    source: str


MaskPart = Union[BiasTerm, MaskFill, CausalPart]


@dataclass
class ScoreMasks:
    """The scale and masks of a chain: `raw` has one part per chain op; `split` the same with
    causal parts split off (`CausalPart`). `scale_nodes`: [(node, divide)], run-time factors."""

    scale: float
    scale_nodes: list
    raw: list
    split: list


def read_masks(ops: list, scores_shape, lq, lk) -> Union[ScoreMasks, str]:
    """Read the chain ops bottom-up (from the product to the softmax)."""
    scale, scale_nodes, raw, split = 1.0, [], [], []
    memo: dict = {}
    for op in reversed(ops):
        kind = op[0]
        if kind in ("cast", "const", "split_batch"):
            continue
        if kind == "scale":
            (how, f), divide = op[1], op[2]
            if how == "const":
                if f == 0:
                    return "the scores are scaled by 0"
                factor = 1.0 / f if divide else f
                if factor <= 0:
                    return f"negative scale {factor:g}"
                scale *= factor
                # (x + b)·c = x·c + b·c: the terms so far are scaled too (fills stay fills)
                for t in {id(t): t for t in raw + split if isinstance(t, BiasTerm)}.values():
                    t.scale *= factor
            else:
                if raw:
                    return "a run-time scale is applied after the mask"
                scale_nodes.append((f, divide))
            continue
        if kind == "add":
            node, negate = op[1], op[2]
            if not broadcasts_to(shape(node), scores_shape):
                return f"mask of shape {fmt_shape(shape(node))} does not broadcast to the scores {fmt_shape(scores_shape)}"
            if dtype(node) is None or dtype(node).is_complex:
                return f"mask of dtype {dtype(node)}"
            term = BiasTerm(node, negate)
            raw.append(term)
            split.extend(_bias_term_parts(term, lq, lk, memo))
            continue
        if kind == "fill":
            mask, masked_when, value = op[1], op[2], op[3]
            if not is_mask_value(value):
                return f"masked_fill/where with value {value:g}, not a mask value (<= {MASK_VALUE_MAX:g} or -inf)"
            if dtype(mask) != torch.bool:
                return "masked_fill/where mask is not a bool tensor"
            if not broadcasts_to(shape(mask), scores_shape):
                return f"mask of shape {fmt_shape(shape(mask))} does not broadcast to the scores {fmt_shape(scores_shape)}"
            parts = _bool_mask_parts(mask, masked_when, value, lq, lk, memo)
            raw.append(MaskFill(mask, masked_when, value, causal=len(parts) == 1 and isinstance(parts[0], CausalPart)))
            split.extend(parts)
    return ScoreMasks(scale, scale_nodes, raw, split)


def _bool_mask_parts(mask: Any, masked_when: bool, value: float, lq, lk, memo) -> list:
    """A bool mask as parts: [] if it masks nothing, [CausalPart] if it is the causal mask; an
    AND of keep masks (OR of masked masks) with a causal part splits into the causal part and the
    rest; anything else stays one MaskFill."""
    if not isinstance(mask, fx.Node) or dtype(mask) != torch.bool:
        return [MaskFill(mask, masked_when, value)]
    if is_causal_mask(mask, "masked" if masked_when else "keep", lq, lk):
        return [CausalPart(value, causal_source(mask))]
    a = abstract_value(mask, memo)
    if isinstance(a, Select) and a.aff is None and isinstance(a.a, bool) and a.a != masked_when:
        return []  # keeps everything
    c = call_of(mask)
    parts = None
    if c is not None and not written(mask):
        if (c.name == "and" and not masked_when) or (c.name == "or" and masked_when):
            parts = _bool_mask_parts(c["input"], masked_when, value, lq, lk, memo) + _bool_mask_parts(
                c["other"], masked_when, value, lq, lk, memo
            )
        elif c.name in ("logical_not", "invert"):
            parts = _bool_mask_parts(c["input"], not masked_when, value, lq, lk, memo)
        elif c.name in ("expand", "contiguous", "clone") or (c.name == "to" and is_identity(c)):
            parts = _bool_mask_parts(c["input"], masked_when, value, lq, lk, memo)
    if parts is not None and any(isinstance(p, CausalPart) for p in parts):
        return parts
    return [MaskFill(mask, masked_when, value)]


def _bias_term_parts(term: BiasTerm, lq, lk, memo) -> list:
    """An additive mask term as parts: causal parts, `where(keep, 0, fill)` as bool masks."""
    if term.negate or term.scale != 1.0:
        return [term]
    node = term.node
    if is_causal_mask(node, "additive", lq, lk):
        a = abstract_value(node, memo)
        return [CausalPart(float(a.b), causal_source(node))]
    c = call_of(node)
    if c is None or written(node):
        return [term]
    if c.name == "where":
        cond, a, b = c["condition"], c["input"], c["other"]
        va, vb = constant_number(a), constant_number(b)
        ev = example_value(node)
        if dtype(cond) == torch.bool and isinstance(ev, torch.Tensor) and va is not None and vb is not None:
            va, vb = cast_value(va, ev.dtype), cast_value(vb, ev.dtype)
            if va == 0 and is_mask_value(vb):
                return _bool_mask_parts(cond, False, float(vb), lq, lk, memo)
            if vb == 0 and is_mask_value(va):
                return _bool_mask_parts(cond, True, float(va), lq, lk, memo)
    if c.name in ("expand", "contiguous", "clone") or is_identity(c):
        inner = _bias_term_parts(BiasTerm(c["input"]), lq, lk, memo)
        if any(isinstance(p, CausalPart) for p in inner):
            return inner
    return [term]


def causal_or_bias(m: ScoreMasks) -> tuple[list, bool, str, list]:
    """(the parts left for the bias, is_causal, how the causal mask was found, notes).

    A causal part becomes is_causal unless that changes eager's result: the op masks with -inf,
    so a causal mask filled with a finite value (finfo.min) may only go when it is the only mask.
    With another mask as well, a row whose visible keys that mask hides entirely gets, in eager,
    uniform weights over every key holding the same finfo.min; is_causal would give weights over
    the visible keys only. Then the causal mask stays in the bias (still fused, not is_causal)."""
    causal = [p for p in m.split if isinstance(p, CausalPart)]
    rest = [p for p in m.split if not isinstance(p, CausalPart)]
    if not causal:
        return m.raw, False, "", []
    if not rest or all(p.value == -math.inf for p in causal):
        return rest, True, causal[0].source, []
    note = (f"causal mask ({causal[0].source}) kept in the bias: its fill is finite and another mask "
            "applies, so the op's -inf causal masking would change rows masked everywhere")
    return m.raw, False, "", [note]


# --------------------------------------------------------------------------- building the bias


def build_bias(b: NodeBuilder, parts: list, memo: dict) -> tuple[Optional[fx.Node], str]:
    """One attn_bias for the mask parts left: (node or None, description)."""
    if not parts:
        return None, ""
    key = tuple(
        ("t", p.node, p.negate, p.scale) if isinstance(p, BiasTerm) else ("f", p.mask, p.masked_when, p.value)
        for p in parts
    )
    if key in memo and precedes(memo[key][0], b.before):
        return memo[key]
    fills = [p for p in parts if isinstance(p, MaskFill)]
    if len(fills) == len(parts) and all(p.value == -math.inf for p in fills):
        keep = None
        for p in fills:
            k = p.mask if not p.masked_when else _negated(b, p.mask)
            keep = k if keep is None else b.function(torch.logical_and, keep, k)
        result = (keep, "bool mask")
    elif len(parts) == 1 and isinstance(parts[0], BiasTerm) and not parts[0].negate and parts[0].scale == 1.0 and dtype(parts[0].node).is_floating_point:
        result = (parts[0].node, "additive mask")
    else:
        bias = None
        for p in parts:
            if isinstance(p, BiasTerm):
                t = p.node
                if not dtype(t).is_floating_point or (bias is not None and dtype(t) != torch.float32):
                    t = b.method("to", t, torch.float32)
                if p.negate:
                    t = b.function(operator.neg, t)
                if p.scale != 1.0:
                    t = b.function(operator.mul, t, p.scale)
                bias = t if bias is None else b.function(operator.add, bias, t)
            else:
                fill = -math.inf if p.value == -math.inf else FLOAT_MASK_VALUE
                if bias is None:
                    args = (p.mask, fill, 0.0) if p.masked_when else (p.mask, 0.0, fill)
                else:
                    if dtype(bias) != torch.float32:
                        bias = b.method("to", bias, torch.float32)
                    args = (p.mask, fill, bias) if p.masked_when else (p.mask, bias, fill)
                bias = b.function(torch.where, *args)
        result = (bias, "float mask")
    memo[key] = result
    return result


def _negated(b: NodeBuilder, mask: fx.Node) -> fx.Node:
    """~mask, reusing x when mask is ~x."""
    c = call_of(mask)
    if c is not None and c.name in ("logical_not", "invert") and dtype(c["input"]) == torch.bool and not written(mask):
        return c["input"]
    return b.function(torch.logical_not, mask)


def zero_filled_rows(b: NodeBuilder, q: fx.Node, parts: list) -> fx.Node:
    """q with the rows zeroed whose every score a finite masked_fill/where replaces.

    Eager gives such a row uniform weights and no gradient into q·kᵀ (the fill replaces the
    scores). The op adds the fill as a bias instead: the same weights, but a gradient through
    q·kᵀ. A zero q row has the same forward (its scores are all the fill value) and no gradient."""
    fills = [p for p in parts if isinstance(p, MaskFill)]
    if all(p.value == -math.inf or p.causal for p in fills):
        return q  # -inf everywhere: NaN, as eager; a causal fill leaves key 0 to every row
    replaced = None
    for p in fills:
        m = p.mask if p.masked_when else _negated(b, p.mask)
        replaced = m if replaced is None else b.function(torch.logical_or, replaced, m)
    full_rows = b.method("all", replaced, -1, True)
    return b.function(torch.where, full_rows, 0.0, q)
