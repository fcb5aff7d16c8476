"""Rotary-embedding recogniser: `x·cos + rotate(x)·sin` and its kin → `fuse_plugin::rotary`.

Spellings recognised (one small matcher each; all produce a `Core`, completed into a `RotarySite`):

  rotate-sum   x*cos + rotate(x)*sin (operands in any order), full-width cos/sin, rotate(x) one of
                 cat((-x2, x1), -1)                  halves x[..., :D//2] / x[..., D//2:],
                                                     x.chunk(2, -1) or torch.split(x, D//2, -1)
                 stack((-x2, x1), -1).flatten(-2)    x1 = x[..., ::2], x2 = x[..., 1::2]: interleaved
                                                     (GPT-J rotate_every_two, Cohere/GLM)
  halves       cat((x1*c - x2*s, x2*c + x1*s), -1)   half-width c/s (GPT-OSS, vLLM NeoX)
               stack((x1*c - x2*s, x2*c + x1*s), -1).flatten(-2)   interleaved, pairs by
                                                     x[..., ::2] or x.reshape(..., -1, 2)[..., 0/1]
                                                     (torchtune, vLLM GPT-J)
  complex      view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs).flatten(-2)
                                                     (Meta llama: the op gets view_as_real(freqs)
                                                     [..., 0] / [..., 1] as half-width cos / sin)

and around any core:
  partial      cat((rotate(x[..., :R]), x[..., R:]), -1) → one op on x with rotary_dim=R. With the
               pass-through slice FIRST (cat((x[..., :P], rotate(x[..., P:]))), MLA) the op, which
               rotates the FIRST R channels, cannot absorb the cat: the rotated slice x[..., P:] goes
               to the op as a view (the op takes any strides) and the cat is kept.
  casts        a lossless leading cast (`x.float()`) is dropped when the op's output dtype
               promote(x, cos, sin) is still the eager one (the op computes in fp32 anyway); one
               trailing cast (`.to(dtype)`, `.type_as(x)`) is absorbed: the op's output is cast to the
               eager dtype only where the two differ. Results are the eager values, shapes and dtypes.
  tables       a full-width table proven to repeat each value within a channel pair (built as
               cat((f, f), -1) for half-split, f.repeat_interleave(2, -1) for interleaved, under
               views/casts/cos/sin/scalar ops) is replaced by f with the same ops re-applied (half
               width); any other table is passed whole. The full-width nodes die and are erased.
  q and k      two sites rotated by the same tables (same nodes, or structurally equal pure views of
               them) become one `fuse_plugin::rotary_qk` plus two getitems.

Left to eager, with the reason in the report: learned tables (requires_grad); tables that are
provably cos(...) where sin belongs and vice versa (with opaque graph inputs a swap cannot be seen,
and x*A + rotate(x)*B is then fused as written, which is the eager value); cos/sin of different
shapes or broadcasting beyond x; a sign, order or split that is not a rotation (cat((x1, -x2)),
slices not at D/2, a rotation over another dim, even/odd pairs joined by cat as DeepSeek's
interleave variant does); an intermediate used outside the expression.

A symbolic head dim (dynamic=True) is accepted: evenness is guarded on its hint, and rotary_dim
is passed as a `sym_size` node.

Counting: one report site (and one `counters["fuse_plugin"]["rotary"]` increment) per rotated
tensor, so a q+k pair fused into one `rotary_qk` counts 2.

Every candidate start (a cat/stack of a negated slice and another slice, a cat/stack of
(sub, add) of products, a view_as_real of a complex product) that is not replaced gets a
`report.missed` with the reason; anything unexpected while matching or replacing one site becomes
a miss too (and a log line), the graph left valid: never a failed compile.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from .canon import (broadcasts_to, canon, dtype, even_size, example_value, float_cast_input, forget_value_keys,
                    is_call, known_equal, rank, same_shape, same_value, shape, sole_user, tensor_meta)
from .graph_edit import NodeBuilder, erase_dead, graph_fake_mode
from .writes import write_between
from .indexing import LastDimSlice, is_last_dim, last_dim_index, last_dim_slice, merges_last_two
from .rotary_tables import COMPLEX_PART_DTYPE, Table, TablePlan, plan_table, trig_of

log = logging.getLogger(__name__)

KIND = "rotary"
_ROTARY = torch.ops.fuse_plugin.rotary.default
_ROTARY_QK = torch.ops.fuse_plugin.rotary_qk.default
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Miss(Exception):
    """A candidate that is not a rotary site; the message is the reason shown to the user."""


def require(cond: Any, reason: str) -> None:
    if not cond:
        raise Miss(reason)


# =============================================================================== data


@dataclass
class Core:
    """What a spelling matcher recognises: `out` = `x` rotated over its whole last dim."""

    x: fx.Node
    cos: Table
    sin: Table
    interleaved: bool
    out: fx.Node
    spelling: str
    interior: set[fx.Node]  # computation nodes: must not be used outside the expression
    inputs: set[fx.Node]  # input-side views of x (slices, chunks): erased once dead


@dataclass
class RotarySite:
    """A replaceable site: `out` (dtype `out_dtype`) = rotary(x, cos, sin, interleaved, rotary_dim)."""

    x: fx.Node
    cos: "TablePlan"
    sin: "TablePlan"
    interleaved: bool
    rotary_dim: Any  # int, or a size node / SymInt (dynamic head dim)
    out: fx.Node
    out_dtype: torch.dtype
    interior: set[fx.Node]
    erasable: set[fx.Node]
    anchor: fx.Node
    spelling: str
    notes: list[str] = field(default_factory=list)

    @property
    def rotary_dim_value(self) -> Any:
        return example_value(self.rotary_dim)


# =============================================================================== channel pairs


@dataclass(frozen=True)
class Pairs:
    """x1 / x2 are the first / second members of the channel pairs of `x`'s whole last dim."""

    x: fx.Node
    interleaved: bool
    nodes: frozenset  # the nodes that split x


def _chunk_part(node: fx.Node) -> tuple[fx.Node, int] | None:
    """`x.chunk(2, -1)[i]` / `torch.split(x, D//2, -1)[i]`: (the chunk/split node, i)."""
    c = is_call(node, "getitem")
    if c is None or not isinstance(c["index"], int) or is_call(c["input"], "chunk", "split") is None:
        return None
    return c["input"], c["index"]


def _split_in_two_halves(split: fx.Node) -> fx.Node | None:
    """x if `split` cuts x's last dim into two equal halves, else None."""
    c = canon(split)
    x = c["input"]
    if not isinstance(x, fx.Node) or shape(x) is None or not is_last_dim(c["dim"], rank(x)):
        return None
    d = shape(x)[-1]
    if c.name == "chunk":
        ok = c["chunks"] == 2 and even_size(d)
    else:
        size = c["split_size_or_sections"]
        sizes = [example_value(s) for s in size] if isinstance(size, (list, tuple)) else [example_value(size)] * 2
        ok = len(sizes) == 2 and known_equal(sizes[0], sizes[1]) and known_equal(sizes[0], d // 2) and even_size(d)
    return x if ok else None


def _splits_into_pairs(xs: fx.Node, x: fx.Node) -> bool:
    """xs = x.reshape(*x.shape[:-1], D/2, 2)."""
    sx, sxs = shape(x), shape(xs)
    return sxs is not None and same_shape(sxs, sx[:-1] + (sx[-1] // 2, 2)) and even_size(sx[-1])


def channel_pairs(x1: Any, x2: Any) -> Pairs:
    """The tensor whose channel pairs (x1[j], x2[j]) are, or Miss. Accepted splits:
    half-split x[..., :h] / x[..., h:], x.chunk(2, -1), torch.split(x, h, -1) (h = D/2);
    interleaved x[..., ::2] / x[..., 1::2] and xs[..., 0] / xs[..., 1] of xs = x.reshape(..., -1, 2)."""
    s1, s2 = last_dim_slice(x1), last_dim_slice(x2)
    if s1 is not None and s2 is not None:
        require(same_value(s1.base, s2.base), "the two halves are slices of different tensors")
        d = shape(s1.base)[-1]
        nodes = frozenset({x1, x2})
        if s1.step == s2.step == 1:
            require(s1.start == 0 and known_equal(s1.stop, s2.start) and known_equal(s2.stop, d),
                    "the slices are not the first and second half of the last dim in that order")
            require(known_equal(s1.stop, d // 2) and even_size(d), f"the halves are not split at D/2 (split at {s1.stop} of {d})")
            return Pairs(s1.base, False, nodes)
        if s1.step == s2.step == 2:
            require(s1.start == 0 and s2.start == 1 and known_equal(s1.stop, d) and known_equal(s2.stop, d),
                    "the strided slices are not x[..., ::2] and x[..., 1::2] in that order")
            return Pairs(s1.base, True, nodes)
        raise Miss("the two slices are neither halves nor even/odd channels")
    c1, c2 = _chunk_part(x1) if isinstance(x1, fx.Node) else None, _chunk_part(x2) if isinstance(x2, fx.Node) else None
    if c1 is not None and c2 is not None:
        require(same_value(c1[0], c2[0]), "the two halves come from different chunk/split calls")
        require((c1[1], c2[1]) == (0, 1), "the chunk/split parts are not [0] and [1] in that order")
        x = _split_in_two_halves(c1[0])
        require(x is not None, "the chunk/split does not cut the last dim into two equal halves")
        return Pairs(x, False, frozenset({x1, x2, c1[0], c2[0]}))
    i1, i2 = last_dim_index(x1), last_dim_index(x2)
    if i1 is not None and i2 is not None:
        require(same_value(i1[0], i2[0]), "the pair members index different tensors")
        require((i1[1], i2[1]) == (0, 1), "the pair members are not [..., 0] and [..., 1] in that order")
        xs = i1[0]
        c = is_call(xs, "reshape", "view")
        x = c["input"] if c is not None else None
        require(isinstance(x, fx.Node) and shape(x) is not None, "the pairs are not a reshape of a tensor")
        require(_splits_into_pairs(xs, x), "the reshape does not split the last dim into (D/2, 2) pairs")
        return Pairs(x, True, frozenset({x1, x2, i2[0], xs}))
    raise Miss("the operands are not the two halves (or even/odd channels) of one tensor")


# =============================================================================== spellings


def _operands(node: Any, name: str) -> tuple[Any, Any] | None:
    """(a, b) if node is `a <name> b` (mul, add, sub with alpha 1)."""
    c = is_call(node, name)
    if c is None or c.args.get("alpha", 1) != 1:
        return None
    return c["input"], c["other"]


def _two_tensors(node: fx.Node) -> tuple[Any, Any] | None:
    c = is_call(node, "cat", "stack")
    if c is None or not isinstance(c["tensors"], (list, tuple)) or len(c["tensors"]) != 2:
        return None
    return tuple(c["tensors"])


def _joined_on_last_dim(node: fx.Node) -> tuple[bool, fx.Node]:
    """For cat((a, b), -1): (False, cat); for stack((a, b), -1).flatten(-2): (True, the flatten).
    Miss when the join is on another dim or a stack is not merged back."""
    c = canon(node)
    if c.name == "cat":
        require(is_last_dim(c["dim"], rank(node)), "the cat is not on the last dim")
        return False, node
    require(is_last_dim(c["dim"], rank(node)), "the stack is not on a new last dim")
    flat = sole_user(node)
    require(flat is not None and merges_last_two(flat, node), "the stack is not flattened back into the last dim")
    return True, flat


def is_rotate_start(node: fx.Node) -> bool:
    """A cat/stack of a negated slice and another slice: the start of rotate_half."""
    ts = _two_tensors(node)
    if ts is None or not all(isinstance(t, fx.Node) for t in ts):
        return False
    negs = [is_call(t, "neg") for t in ts]
    if not any(negs):
        return False
    parts = [n["input"] if n is not None else t for n, t in zip(negs, ts)]
    return all(is_call(p, "getitem") is not None for p in parts)


def match_rotate(start: fx.Node) -> tuple[Pairs, fx.Node, set[fx.Node]]:
    """rotate_half(x) = cat((-x2, x1), -1) or rotate_every_two(x) = stack((-x2, x1), -1).flatten(-2):
    (x's pairs, the node holding rotate(x), its computation nodes)."""
    first, second = _two_tensors(start)
    neg = is_call(first, "neg")
    if neg is None:
        raise Miss("wrong sign: rotate_half is cat((-x2, x1)), here the second operand is negated")
    interleaved, rot = _joined_on_last_dim(start)
    pairs = channel_pairs(second, neg["input"])
    require(pairs.interleaved == interleaved,
            "stack/flatten of half-split slices (or cat of even/odd channels): not a rotation")
    return pairs, rot, {first, start, rot}


def match_rotate_sum(start: fx.Node) -> Core:
    """out = x*cos + rotate(x)*sin (operands in any order)."""
    pairs, rot, nodes = match_rotate(start)
    m_rot = sole_user(rot)
    ab = _operands(m_rot, "mul") if m_rot is not None else None
    require(ab is not None and rot in ab, "rotate_half(x) is not used (only) as rotate_half(x) * sin")
    sin = ab[1] if ab[0] is rot else ab[0]
    out = sole_user(m_rot)
    terms = _operands(out, "add") if out is not None else None
    require(terms is not None and m_rot in terms, "rotate_half(x) * sin is not added to x * cos")
    m_x = terms[1] if terms[0] is m_rot else terms[0]
    xc = _operands(m_x, "mul")
    require(xc is not None, "rotate_half(x) * sin is added to something that is not x * cos")
    if same_value(xc[0], pairs.x):
        cos = xc[1]
    elif same_value(xc[1], pairs.x):
        cos = xc[0]
    else:
        raise Miss("x * cos multiplies a different tensor than the one rotate_half rotates")
    require(isinstance(cos, fx.Node) and isinstance(sin, fx.Node), "cos/sin are not tensors")
    spelling = "rotate_every_two" if pairs.interleaved else "rotate_half"
    return Core(pairs.x, Table(cos, "full"), Table(sin, "full"), pairs.interleaved, out, spelling,
                nodes | {m_rot, m_x, out}, set(pairs.nodes))


def is_halves_start(node: fx.Node) -> bool:
    """A cat/stack of a difference and a sum of products: the start of the explicit-halves form."""
    ts = _two_tensors(node)
    if ts is None:
        return False
    kinds = sorted(canon(t).name if canon(t) is not None else "" for t in ts)
    if kinds != ["add", "sub"]:
        return False
    return all(_operands(p, "mul") is not None for t in ts for p in (canon(t)["input"], canon(t)["other"]))


def _products(o: fx.Node, name: str) -> tuple[tuple, tuple]:
    p, q = _operands(o, name)
    return _operands(p, "mul"), _operands(q, "mul")


def match_halves(start: fx.Node) -> Core:
    """out = join(x1*c - x2*s, x2*c + x1*s) with join cat on the last dim (half-split halves) or
    stack(..., -1).flatten(-2) (interleaved pairs); c, s half-width."""
    o1, o2 = _two_tensors(start)
    require(is_call(o1, "sub") is not None, "the first part is not x1*cos - x2*sin (sum and difference swapped)")
    interleaved, out = _joined_on_last_dim(start)
    (p1, p2), (q1, q2) = _products(o1, "sub")
    found = None
    for x1, c in ((p1, p2), (p2, p1)):
        for x2, s in ((q1, q2), (q2, q1)):
            try:
                found = channel_pairs(x1, x2), x1, c, x2, s
                break
            except Miss as e:
                reason = str(e)
        if found:
            break
    if found is None:
        raise Miss(f"x1*cos - x2*sin: {reason}")
    pairs, x1, c, x2, s = found
    require(pairs.interleaved == interleaved,
            "even/odd channel pairs joined by cat (or halves by stack): the output's channel order is "
            "not the input's, which the op cannot express")
    r, t = _products(o2, "add")

    def is_product(m, a, b):
        return (same_value(m[0], a) and same_value(m[1], b)) or (same_value(m[1], a) and same_value(m[0], b))

    require(any(is_product(m, x2, c) for m in (r, t)) and any(is_product(m, x1, s) for m in (r, t)),
            "the second part is not x2*cos + x1*sin with the first part's x1, x2, cos, sin (cos/sin swapped?)")
    require(isinstance(c, fx.Node) and isinstance(s, fx.Node), "cos/sin are not tensors")
    interior = {o1, o2, start, out} | {canon(o1)["input"], canon(o1)["other"], canon(o2)["input"], canon(o2)["other"]}
    inputs = set(pairs.nodes)
    for m in (r, t):  # the second part's own copies of x1, x2, c, s (structurally equal nodes)
        inputs |= {a for a in m if isinstance(a, fx.Node) and a not in (c, s)}
    return Core(pairs.x, Table(c, "half"), Table(s, "half"), interleaved, out,
                "halves" + (" (interleaved)" if interleaved else ""), interior, inputs)


def _complex_product(node: fx.Node) -> tuple[fx.Node, Any] | None:
    """view_as_real(view_as_complex(xs) * freqs): (the view_as_complex node, freqs)."""
    c = is_call(node, "view_as_real")
    ab = _operands(c["input"], "mul") if c is not None else None
    if ab is None:
        return None
    for a, f in (ab, ab[::-1]):
        if is_call(a, "view_as_complex") is not None:
            return a, f
    return None


def is_complex_start(node: fx.Node) -> bool:
    return _complex_product(node) is not None


def match_complex(start: fx.Node) -> Core:
    """out = view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs).flatten(-2) (Meta llama)."""
    xc, freqs = _complex_product(start)
    xs = canon(xc)["input"]
    c = is_call(xs, "reshape", "view")
    x = c["input"] if c is not None else None
    require(isinstance(x, fx.Node) and shape(x) is not None, "view_as_complex of something that is not x.reshape(..., -1, 2)")
    require(_splits_into_pairs(xs, x), "the reshape does not split the last dim into (D/2, 2) pairs")
    require(isinstance(freqs, fx.Node) and dtype(freqs) in COMPLEX_PART_DTYPE, "freqs is not a complex tensor")
    out = sole_user(start)
    require(out is not None and merges_last_two(out, start), "view_as_real(...) is not flattened back into the last dim")
    product = canon(start)["input"]
    return Core(x, Table(freqs, "half", "real"), Table(freqs, "half", "imag"), True, out, "complex",
                {product, start, out}, {xs, xc})


STARTS: tuple[tuple[Callable[[fx.Node], bool], Callable[[fx.Node], Core]], ...] = (
    (is_rotate_start, match_rotate_sum),
    (is_halves_start, match_halves),
    (is_complex_start, match_complex),
)


# =============================================================================== completing a site


def _is_lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src in (torch.float16, torch.bfloat16) and dst in (torch.float32, torch.float64)) or (
        src == torch.float32 and dst == torch.float64)


def _promote(*dts: torch.dtype) -> torch.dtype:
    out = dts[0]
    for d in dts[1:]:
        out = torch.promote_types(out, d)
    return out


def _strip_cast(x: fx.Node, tables: tuple[torch.dtype, torch.dtype], eager: torch.dtype) -> fx.Node:
    """x's input if x is a lossless cast (`.float()`) that leaves the op's output dtype (and compute
    precision) as eager has them: the op computes in fp32 whatever it reads."""
    src = float_cast_input(x)
    if src is None or dtype(src) not in _FLOATS or not _is_lossless(dtype(src), dtype(x)):
        return x
    return src if _promote(dtype(src), *tables) == eager else x


def _sole_cast_user(node: fx.Node) -> fx.Node | None:
    user = sole_user(node)
    return user if user is not None and float_cast_input(user) is node and dtype(user) in _FLOATS else None


def _check_tables(core: Core) -> None:
    x = tensor_meta(core.x)
    for name, t in (("cos", core.cos), ("sin", core.sin)):
        v = tensor_meta(t.node)
        require(v is not None, f"{name} is not a tensor")
        require(not v.requires_grad, f"{name} requires grad (learned frequencies): left to eager")
        require(t.dtype in _FLOATS, f"{name} is not a float tensor ({v.dtype})")
        require(v.device == x.device, f"{name} is on {v.device}, x on {x.device}")
    require(same_shape(shape(core.cos.node), shape(core.sin.node)), "cos and sin have different shapes")
    d = shape(core.x)[-1]
    width = d if core.cos.width == "full" else d // 2
    if core.cos.width == "half":
        require(known_equal(shape(core.cos.node)[-1], d // 2) and even_size(d),
                f"cos/sin last dim {shape(core.cos.node)[-1]} is not one value per channel pair ({d} channels)")
    table, x_shape = shape(core.cos.node), shape(core.x)
    require(known_equal(table[-1], width) and broadcasts_to(table, x_shape[:-1] + (width,)),
            f"cos/sin {tuple(shape(core.cos.node))} do not broadcast to x {tuple(shape(core.x))} channel-wise")


def _private(interior: set[fx.Node], out: fx.Node) -> None:
    for n in sorted(interior, key=lambda n: n.name):
        if n is not out and any(u not in interior for u in n.users):
            raise Miss(f"the intermediate {n.name} ({canon(n).name if canon(n) else n.target}) is also used outside the rotary expression")


def complete(core: Core) -> RotarySite:
    """Turn a recognised core into a replaceable site: checks, casts, partial rotary, tables."""
    require(dtype(core.x) in _FLOATS, f"x is not a float tensor ({dtype(core.x)})")
    _check_tables(core)
    require(core.cos.part is not None or (trig_of(core.cos.node) != "sin" and trig_of(core.sin.node) != "cos"),
            "cos/sin swapped: x is multiplied by a sin(...) table and its rotation by a cos(...) table")
    require(same_shape(shape(core.out), shape(core.x)), "the result's shape is not x's (cos/sin broadcast x)")
    _private(core.interior, core.out)
    cos, sin = plan_table(core.cos, core.interleaved), plan_table(core.sin, core.interleaved)
    eager = dtype(core.out)
    tables = (cos.dtype, sin.dtype)
    interior, erasable = set(core.interior), set(core.inputs)
    notes: list[str] = []

    x = _strip_cast(core.x, tables, eager)
    if x is not core.x:
        erasable.add(core.x)
    rotary_dim: Any = shape(core.x)[-1]
    out, out_dtype = core.out, eager

    cast = _sole_cast_user(core.out)
    rotated = cast or core.out
    joined = sole_user(rotated)
    prefix = last_dim_slice(x)
    partial = None
    if prefix is not None:
        whole = prefix.base
        whole_in = _strip_cast(whole, tables, eager)  # the op reads the whole tensor: x[..., :R] and the tail
        partial = _partial_join(joined, rotated, prefix, {whole, whole_in})
    if partial is not None and (cast is None or dtype(cast) == dtype(joined)):
        erasable |= {x, partial} | ({whole} if whole_in is not whole else set())
        x = whole_in
        rotary_dim = prefix.stop_arg
        out, out_dtype = joined, dtype(joined)
        interior |= {joined} | ({cast} if cast is not None else set())
        notes.append(f"partial: rotary_dim={prefix.stop} of {shape(x)[-1]}")
    elif cast is not None:
        interior.add(cast)
        out, out_dtype = cast, dtype(cast)
    if partial is None and joined is not None and _pass_first(joined, rotated, core.x):
        notes.append("pass-through first: the rotated slice is passed as a view, the cat kept")
    require(dtype(x) in _FLOATS, f"x is not a float tensor ({dtype(x)})")
    require(_promote(dtype(x), *tables) == eager, "the op's output dtype would differ from eager's")
    return RotarySite(x, cos, sin, core.interleaved, rotary_dim, out, out_dtype, interior, erasable,
                      core.out, core.spelling, notes)


def _partial_join(joined: fx.Node | None, rotated: fx.Node, prefix: LastDimSlice, wholes: set[fx.Node]) -> fx.Node | None:
    """The pass-through slice if `joined` = cat((rotated, whole[..., R:]), -1) for x = whole[..., :R],
    with `whole` one of `wholes` (the sliced tensor, or the tensor the op reads if that differs by a
    lossless cast: the tail's values are then the same)."""
    if joined is None or prefix.step != 1 or prefix.start != 0:
        return None
    ts = _two_tensors(joined)
    if ts is None or canon(joined).name != "cat" or ts[0] is not rotated or not is_last_dim(canon(joined)["dim"], rank(joined)):
        return None
    tail = last_dim_slice(ts[1])
    whole = prefix.base
    if tail is None or tail.step != 1 or not known_equal(tail.start, prefix.stop) or not known_equal(tail.stop, shape(whole)[-1]):
        return None
    return ts[1] if any(same_value(tail.base, w) for w in wholes) else None


def _pass_first(joined: fx.Node, rotated: fx.Node, x: fx.Node) -> bool:
    ts = _two_tensors(joined)
    return ts is not None and canon(joined).name == "cat" and ts[1] is rotated and last_dim_slice(x) is not None


# =============================================================================== replacing


def _rotary_dim_node(b: NodeBuilder, site: RotarySite, x: fx.Node) -> Any:
    """The op's rotary_dim argument: an int, or a size node for a symbolic head dim."""
    r = site.rotary_dim
    if isinstance(r, fx.Node) or isinstance(example_value(r), int):
        return example_value(r) if not isinstance(r, fx.Node) else r
    require(known_equal(r, shape(x)[-1]), "symbolic rotary_dim that is not x's last dim")
    return b.function(torch.ops.aten.sym_size.int, x, rank(x) - 1)


def _casted(b: NodeBuilder, node: fx.Node, to: torch.dtype) -> fx.Node:
    return node if dtype(node) == to else b.method("to", node, to)


def _detail(site: RotarySite, extra: str = "") -> str:
    r = site.rotary_dim_value
    parts = [site.spelling, f"rotary_dim={r}", f"{site.cos.width}-width cos/sin"] + site.notes
    return "; ".join(parts + ([extra] if extra else []))


def replace(graph: fx.Graph, sites: list[RotarySite], done: dict[fx.Node, fx.Node], fake_mode=None) -> None:
    """Insert one op for `sites` (one site: rotary; two: rotary_qk) before the last site's result,
    point every user at it and erase what died. Graph untouched if building the new nodes fails.
    `done` maps the results replaced so far to their new nodes (a site may read one: rot(rot(x)))."""
    for s in sites:
        s.x = done.get(s.x, s.x)
        for plan in (s.cos, s.sin):
            plan.source = done.get(plan.source, plan.source)
        needed = [s.x, s.out, s.cos.source, s.sin.source, *s.cos.rebuild, *s.sin.rebuild, s.rotary_dim]
        require(all(getattr(n, "graph", graph) is graph and not getattr(n, "_erased", False) for n in needed),
                "overlaps a rotary site replaced before it")
    order = {n: i for i, n in enumerate(graph.nodes)}
    at = max((s.out for s in sites), key=order.get)
    first = sites[0]
    # the op reads x and the tables' sources at `at`: no in-place write into them since the sites read them
    site_nodes = [n for s in sites for n in (*s.interior, s.out)]
    why = write_between([s.x for s in sites] + [first.cos.source, first.sin.source], site_nodes, at, order, "the rotary")
    require(why is None, why)
    b = NodeBuilder(graph, at, first.anchor, fake_mode)
    try:
        memo: dict = {}
        cos, sin = first.cos.build(b, memo), first.sin.build(b, memo)
        rd = _rotary_dim_node(b, first, first.x)
        if len(sites) == 1:
            outs = [b.function(_ROTARY, first.x, cos, sin, first.interleaved, rd)]
        else:
            pair = b.function(_ROTARY_QK, sites[0].x, sites[1].x, cos, sin, first.interleaved, rd)
            outs = [b.sibling(s.anchor).function(operator.getitem, pair, i) for i, s in enumerate(sites)]
        outs = [_casted(b.sibling(s.anchor), o, s.out_dtype) for s, o in zip(sites, outs)]
    except Exception:
        b.rollback()
        raise
    for s, o in zip(sites, outs):
        s.out.replace_all_uses_with(o)
        done[s.out] = o
    dead: set[fx.Node] = set()
    for s in sites:
        dead |= s.interior | s.erasable | {s.out} | s.cos.bypassed | s.sin.bypassed
    erase_dead(graph, dead)


def _can_pair(a: RotarySite, b: RotarySite, order: dict) -> bool:
    if a.cos.key != b.cos.key or a.sin.key != b.sin.key or a.interleaved != b.interleaved:
        return False
    if not known_equal(a.rotary_dim_value, b.rotary_dim_value):
        return False
    early, late = sorted((a, b), key=lambda s: order[s.out])
    # the pair's op sits before the later result: the earlier result's users must all come after it
    return all(order[u] > order[late.out] for u in early.out.users)


# =============================================================================== driver


def find_sites(gm: fx.GraphModule, report) -> list[RotarySite]:
    sites, claimed = [], set()
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        for is_start, match in STARTS:
            try:
                if not is_start(node):
                    continue
                site = complete(match(node))
                require(not ((site.interior | {site.out}) & claimed), "overlaps another rotary site")
                claimed |= site.interior | {site.out}
                sites.append(site)
            except Miss as e:
                report.missed(KIND, node, str(e))
            except Exception as e:  # noqa: BLE001  (never fail a compile over a pattern)
                log.warning("rotary: error while matching at %s", node.name, exc_info=True)
                report.missed(KIND, node, f"internal error while matching: {type(e).__name__}: {e}")
            break
    return sites


def group_pairs(graph: fx.Graph, sites: list[RotarySite]) -> list[list[RotarySite]]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups, used = [], set()
    for i, a in enumerate(sites):
        if i in used:
            continue
        used.add(i)
        for j in range(i + 1, len(sites)):
            if j not in used and _can_pair(a, sites[j], order):
                used.add(j)
                groups.append([a, sites[j]])
                break
        else:
            groups.append([a])
    return groups


def rewrite(gm: fx.GraphModule, report) -> None:
    """Replace every rotary site of `gm` (in place); record sites and near misses in `report`."""
    from .. import settings
    from .choice import decide_rotary

    forget_value_keys()
    graph, done, fake_mode = gm.graph, {}, graph_fake_mode(gm)
    folding = settings.rope_attention_enabled()
    try:
        for group in group_pairs(graph, find_sites(gm, report)):
            decision = decide_rotary(example_value(group[0].x), folding, group[0].interleaved,
                                     example_value(group[0].out))
            if not decision.ours:  # left as written (patterns/choice.py): reported, graph untouched
                for s in group:
                    report.left_as_is(KIND, s.anchor, decision.reason)
                continue
            if len(group) == 2:
                try:
                    replace(graph, group, done, fake_mode)
                except Exception:  # noqa: BLE001  (fall back to one op per tensor)
                    log.debug("rotary: q+k pair failed, trying one at a time", exc_info=True)
                else:
                    for s in group:
                        report.replaced(KIND, s.anchor, _detail(s, "q+k in one rotary_qk"))
                    continue
            for s in group:
                _replace_one(graph, s, report, done, fake_mode)
    finally:
        forget_value_keys()


def _replace_one(graph: fx.Graph, site: RotarySite, report, done: dict, fake_mode) -> None:
    try:
        replace(graph, [site], done, fake_mode)
    except Miss as e:
        report.missed(KIND, site.anchor, str(e))
    except Exception as e:  # noqa: BLE001  (never fail a compile over a pattern)
        log.warning("rotary: error while replacing at %s", site.anchor.name, exc_info=True)
        report.missed(KIND, site.anchor, f"internal error while replacing: {type(e).__name__}: {e}")
    else:
        report.replaced(KIND, site.anchor, _detail(site))
