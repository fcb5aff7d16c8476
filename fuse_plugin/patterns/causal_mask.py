"""What the nodes that build a mask compute, for every size: the causal-mask prover.

A small abstract interpreter over the nodes that build masks and small constants. A value is

    Affine      an integer tensor const + Σ coef·index(dim) (dims counted from the right: -1 is the
                key index j, -2 the query index i), from `arange`, `cumsum` of ones, and sums,
                differences and integer multiples of those;
    Select      a tensor equal to `a` where `aff <= 0` and to `b` elsewhere (`aff` None: the
                constant `a`): tril / triu of ones or of a full, comparisons of aranges, masked_fill
                and where of such, the value of a registered tril buffer read at compile time;

through views, casts, indexing (basic, and integer index tensors on the leading dims), and
logic. `is_causal_mask(node, kind, Lq, Lk)` holds when the value is exactly the top-left causal
mask (key j visible to query i iff j - i <= 0), whatever the sizes; `constant_number(x)` is the
value of a 0-d tensor the graph builds from constants.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import fx

from .canon import call_of, dtype, example_value, is_in_place_form, known_equal, norm_dim, shape, written

# A fill value at or below this counts as "masked" (-1e4 of old BERT/GPT-2 code, -1e9, finfo.min, -inf).
MASK_VALUE_MAX = -1e4


@dataclass(frozen=True)
class Affine:
    """An integer tensor: const + Σ coef·index(dim), dims counted from the right (-1 = key j)."""

    coef: tuple[tuple[int, int], ...]
    const: int

    def get(self, dim: int) -> int:
        return dict(self.coef).get(dim, 0)


def affine(coef: dict, const: int) -> Affine:
    return Affine(tuple(sorted((d, c) for d, c in coef.items() if c != 0)), const)


def _affine_sum(x: Affine, y: Affine, sign: int = 1) -> Affine:
    coef = dict(x.coef)
    for d, c in y.coef:
        coef[d] = coef.get(d, 0) + sign * c
    return affine(coef, x.const + sign * y.const)


_KEY_MINUS_QUERY = affine({-1: 1, -2: -1}, 0)  # j - i: causal keeps key j for query i iff j - i <= 0


@dataclass(frozen=True)
class Select:
    """A tensor equal to `a` where `aff <= 0` and to `b` elsewhere; aff None: the constant `a`."""

    aff: Optional[Affine]
    a: Any
    b: Any


def flipped(value: Select) -> Select:
    """The same tensor with the predicate negated: over integers, aff <= 0 fails exactly where
    -aff + 1 <= 0 holds, so Select(aff, a, b) == Select(1 - aff, b, a)."""
    aff = value.aff
    return Select(affine({d: -c for d, c in aff.coef}, 1 - aff.const), value.b, value.a)


def _constant(v) -> Select:
    return Select(None, v, v)


def _without_unit_dims(value, node: fx.Node):
    """Drop index terms along dims of size 1 (the index there is always 0)."""
    s = shape(node)
    if value is None or s is None:
        return None
    aff = value if isinstance(value, Affine) else value.aff
    if aff is None:
        return value
    coef = {}
    for d, c in aff.coef:
        if -d > len(s):
            return None
        if not known_equal(s[d], 1):
            coef[d] = c
    new = affine(coef, aff.const)
    if isinstance(value, Affine):
        return new if new.coef else _constant(new.const)
    if not new.coef:
        return _constant(value.a if new.const <= 0 else value.b)
    return Select(new, value.a, value.b)


def _remap(value, mapping: dict[int, Optional[int]], shift: dict[int, int]):
    """Move index terms to new dims (`mapping`: old dim → new dim or None when the dim is indexed
    by a constant `shift[old]`); slicing from `start` shifts the index by start."""
    aff = value if isinstance(value, Affine) else value.aff
    if aff is None:
        return value
    coef, const = {}, aff.const
    for d, c in aff.coef:
        if d not in mapping:
            return None
        const += c * shift.get(d, 0)
        if mapping[d] is not None:
            coef[mapping[d]] = coef.get(mapping[d], 0) + c
    new = affine(coef, const)
    return new if isinstance(value, Affine) else Select(new, value.a, value.b)


def _index_map(index: Any, in_rank: int, out_rank: int):
    """For x[index] (basic indexing): (mapping, shift) of dims counted from the right."""
    items = list(index) if isinstance(index, tuple) else [index]
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if sum(1 for i in items if i is Ellipsis) > 1 or consumed > in_rank:
        return None
    expanded = []
    for i in items:
        if i is Ellipsis:
            expanded += [slice(None)] * (in_rank - consumed)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (in_rank - sum(1 for i in expanded if i is not None))
    mapping, shift, in_dim, out_dim = {}, {}, 0, 0
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        old = in_dim - in_rank
        if isinstance(i, bool) or not isinstance(i, (int, slice)):
            return None
        if isinstance(i, int):
            if i < 0:
                return None
            mapping[old], shift[old] = None, i
        else:
            start = 0 if i.start is None else i.start
            if not isinstance(start, int) or start < 0 or i.step not in (None, 1):
                return None
            mapping[old], shift[old] = out_dim - out_rank, start
            out_dim += 1
        in_dim += 1
    return (mapping, shift) if out_dim == out_rank else None


def _reshape_map(in_shape, out_shape):
    """Dims of a reshape that only adds or drops size-1 dims: old dim → new dim (from the right)."""
    ins = [(d - len(in_shape), s) for d, s in enumerate(in_shape) if not known_equal(s, 1)]
    outs = [(d - len(out_shape), s) for d, s in enumerate(out_shape) if not known_equal(s, 1)]
    if len(ins) != len(outs) or not all(known_equal(a[1], b[1]) for a, b in zip(ins, outs)):
        return None
    return {a[0]: b[0] for a, b in zip(ins, outs)}


def _buffer_value(node: fx.Node) -> Optional[torch.Tensor]:
    """The real value of a registered buffer (a get_attr, or a placeholder Dynamo lifted from a
    module's `_buffers` / a frozen `_parameters`): the value at compile time, which Dynamo does not
    guard on."""
    t = None
    if node.op == "get_attr":
        obj = node.graph.owning_module
        try:
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return None
        t = obj
    elif node.op == "placeholder":
        ga = node.meta.get("grapharg")
        src = getattr(ga, "source", None)
        if src is None:
            return None
        name = src.name() if callable(src.name) else src.name
        if "._buffers[" not in str(name) and "._parameters[" not in str(name):
            return None
        try:
            t = ga.example
        except Exception:  # noqa: BLE001
            return None
    if not isinstance(t, torch.Tensor) or isinstance(t, torch._subclasses.FakeTensor):
        return None
    if t.requires_grad or t.dim() < 2 or t.numel() > (1 << 24) or t.is_meta:
        return None
    return t


def _select_of_tensor(t: torch.Tensor) -> Optional[Select]:
    """A tensor whose every (..., N, M) slice is `a` on and below the diagonal and `b` above."""
    n, m = t.shape[-2], t.shape[-1]
    if n < 2 or m < 2:
        return None
    t = t.detach().cpu().reshape(-1, n, m)
    first = t[0]
    if not bool((t == first).all()):
        return None
    lower = torch.ones(n, m, dtype=torch.bool).tril()
    lo, hi = first[lower], first[~lower]
    a, b = lo[0].item(), hi[0].item()
    if a == b or not bool((lo == a).all()) or not bool((hi == b).all()):
        return None
    return Select(_KEY_MINUS_QUERY, a, b)


_CMP = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne}
_ARITH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_FULL = {torch.full: 1, torch.full_like: 1}  # position of the fill value
_ONES = {torch.ones: 1, torch.ones_like: 1, torch.zeros: 0, torch.zeros_like: 0}
_NEW = {"new_ones": 1, "new_zeros": 0}


def cast_value(v: Any, dt: torch.dtype) -> Any:
    if dt == torch.bool:
        return bool(v)
    try:
        return torch.tensor(v, dtype=dt).item()  # e.g. float32's finfo.min is -inf in float16
    except Exception:  # noqa: BLE001
        return None


def _elementwise(f, x: Select, y: Select) -> Optional[Select]:
    try:
        if x.aff is None:
            return Select(y.aff, f(x.a, y.a), f(x.a, y.b))
        if y.aff is None or y.aff == x.aff:
            return Select(x.aff, f(x.a, y.a), f(x.b, y.b if y.aff is not None else y.a))
    except Exception:  # noqa: BLE001
        return None
    return None


def _abstract_of(x: Any, memo: dict):
    if isinstance(x, fx.Node):
        return abstract_value(x, memo)
    if isinstance(x, (bool, int, float)):
        return _constant(x)
    return None


def _compare(name: str, x, y) -> Optional[Select]:
    """lt/le/gt/ge of integer affine indices as a predicate `aff <= 0`; else elementwise."""
    if isinstance(x, Affine) or isinstance(y, Affine):
        xa = x if isinstance(x, Affine) else (affine({}, x.a) if x.aff is None and isinstance(x.a, int) else None)
        ya = y if isinstance(y, Affine) else (affine({}, y.a) if y.aff is None and isinstance(y.a, int) else None)
        if xa is None or ya is None or name in ("eq", "ne"):
            return None
        diff = _affine_sum(xa, ya, -1)
        plus1 = affine(dict(diff.coef), diff.const + 1)
        return {
            "le": Select(diff, True, False),  # diff <= 0
            "lt": Select(plus1, True, False),  # diff < 0  ⟺  diff + 1 <= 0 (integers)
            "gt": Select(diff, False, True),
            "ge": Select(plus1, False, True),
        }[name]
    return _elementwise(_CMP[name], x, y)


def abstract_value(node: fx.Node, memo: dict):
    """The abstract value (Affine / Select) of a mask-building node, or None if unknown."""
    if node in memo:
        return memo[node]
    memo[node] = None  # cycles cannot happen in a DAG, but keep recursion cheap
    value = _abstract_value_uncached(node, memo)
    if value is not None and written(node):
        value = None  # changed in place later: its value at a use is not what the node computed
    if value is not None and isinstance(example_value(node), torch.Tensor):
        value = _decided(_without_unit_dims(value, node))
    memo[node] = value
    return value


def _decided(value):
    """A Select whose predicate `aff <= 0` holds everywhere or nowhere, from the signs alone
    (indices are >= 0): with every coefficient >= 0 and const > 0, aff > 0 everywhere (the
    constant b); with every coefficient <= 0 and const <= 0, aff <= 0 everywhere (the constant a).
    HF's `arange(L) + offset >= 0` over the query positions, always True, is one."""
    if not isinstance(value, Select) or value.aff is None:
        return value
    coefs = [c for _, c in value.aff.coef]
    if all(c >= 0 for c in coefs) and value.aff.const > 0:
        return _constant(value.b)
    if all(c <= 0 for c in coefs) and value.aff.const <= 0:
        return _constant(value.a)
    return value


def _abstract_value_uncached(node: fx.Node, memo: dict):
    if node.op in ("placeholder", "get_attr"):
        t = _buffer_value(node)
        return None if t is None else _select_of_tensor(t)
    if node.op not in ("call_function", "call_method"):
        return None
    t, args, kwargs = node.target, node.args, node.kwargs
    ev = example_value(node)
    if not isinstance(ev, torch.Tensor):
        return None
    # ------------------------------------------------------------------ tensors made from constants
    if node.op == "call_function":
        if t is torch.arange:
            nums = list(args) + [kwargs[k] for k in ("start", "end", "step") if k in kwargs]
            if len(nums) == 1:
                start, step = 0, 1
            elif len(nums) in (2, 3):
                start, step = nums[0], (nums[2] if len(nums) == 3 else 1)
            else:
                return None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, step)):
                return None
            if ev.dtype.is_floating_point or ev.dtype == torch.bool:
                return None
            return affine({-1: step}, start)
        if t in _FULL:
            v = args[_FULL[t]] if len(args) > _FULL[t] else kwargs.get("fill_value")
            return _constant(cast_value(v, ev.dtype)) if isinstance(v, (bool, int, float)) else None
        if t in _ONES:
            return _constant(cast_value(_ONES[t], ev.dtype))
        if t in (torch.tensor, torch.scalar_tensor, torch.as_tensor) and args:
            v = args[0]
            return _constant(cast_value(v, ev.dtype)) if isinstance(v, (bool, int, float)) else None
    if (node.op == "call_function" and t is torch.diff) or (node.op == "call_method" and t == "diff"):
        return _diff(node, memo)
    if (node.op == "call_function" and t is torch.cumsum) or (node.op == "call_method" and t == "cumsum"):
        x = _abstract_of(args[0], memo)
        d = args[1] if len(args) > 1 else kwargs.get("dim")
        s = shape(args[0])
        if not (isinstance(x, Select) and x.aff is None and isinstance(x.a, (bool, int))):
            return None
        dim = norm_dim(d, len(s)) if s is not None else None
        if dim is None:
            return None
        v = int(x.a)
        return _constant(0) if v == 0 else affine({dim - len(s): v}, v)  # c, 2c, 3c, ... along dim
    if node.op == "call_method" and t in _NEW:
        return _constant(cast_value(_NEW[t], ev.dtype))
    if node.op == "call_method" and t == "new_full" and len(args) >= 3 and isinstance(args[2], (bool, int, float)):
        return _constant(cast_value(args[2], ev.dtype))
    c = call_of(node)
    if c is None:
        return None
    name = c.name
    if is_in_place_form(node):
        return None
    # ------------------------------------------------------------------ views and casts
    if name in ("contiguous", "clone", "expand", "to", "float", "half", "bfloat16", "bool", "type_as"):
        x = _abstract_of(c["input"], memo)
        if x is None:
            return None
        src = example_value(c["input"])
        if isinstance(x, Affine):  # integer positions: keep them through int/float casts
            return x if ev.dtype != torch.bool else None
        if isinstance(src, torch.Tensor) and src.dtype != ev.dtype:
            a, b = cast_value(x.a, ev.dtype), cast_value(x.b, ev.dtype)
            return None if a is None or b is None else Select(x.aff, a, b)
        return x
    if name in ("view", "reshape", "unsqueeze", "flatten"):
        x = _abstract_of(c["input"], memo)
        in_s, out_s = shape(c["input"]), shape(node)
        if x is None or in_s is None or out_s is None:
            return None
        if isinstance(x, Select) and x.aff is None:
            return x
        m = _reshape_map(in_s, out_s)
        return None if m is None else _remap(x, m, {})
    if name == "getitem":
        x = _abstract_of(c["input"], memo)
        in_s = shape(c["input"])
        if x is None or in_s is None:
            return None
        if isinstance(c["index"], (tuple, list)) and any(isinstance(i, fx.Node) for i in c["index"]):
            return _gather(x, list(c["index"]), len(in_s), memo)
        im = _index_map(c["index"], len(in_s), ev.dim())
        if im is None:
            return None
        return x if isinstance(x, Select) and x.aff is None else _remap(x, *im)
    if name in ("tril", "triu"):
        x = _abstract_of(c["input"], memo)
        d = c["diagonal"]
        if not (isinstance(x, Select) and x.aff is None and isinstance(d, int)) or ev.dim() < 2:
            return None
        zero = cast_value(0, ev.dtype)
        if name == "tril":  # v where j - i <= d
            return Select(affine({-1: 1, -2: -1}, -d), x.a, zero)
        return Select(affine({-1: 1, -2: -1}, -(d - 1)), zero, x.a)  # v where j - i >= d
    # ------------------------------------------------------------------ arithmetic and logic
    if name in ("logical_not", "invert", "neg"):
        x = _abstract_of(c["input"], memo)
        if isinstance(x, Affine):
            return affine({d: -k for d, k in x.coef}, -x.const) if name == "neg" else None
        if x is None:
            return None
        if name == "neg":
            return Select(x.aff, -x.a, -x.b)
        if not isinstance(x.a, bool):
            return None
        return Select(x.aff, not x.a, not x.b)
    if name in ("and", "or", "add", "sub", "mul", "lt", "le", "gt", "ge", "eq", "ne"):
        if name in ("add", "sub") and c["alpha"] != 1:
            return None
        x, y = _abstract_of(c["input"], memo), _abstract_of(c["other"], memo)
        if x is None or y is None:
            return None
        if name in _CMP:
            return _compare(name, x, y)
        if isinstance(x, Affine) or isinstance(y, Affine):
            if name not in ("add", "sub"):
                if name == "mul":
                    k, a = (y, x) if isinstance(x, Affine) else (x, y)
                    if isinstance(a, Affine) and isinstance(k, Select) and k.aff is None and isinstance(k.a, int) and not isinstance(k.a, bool):
                        return affine({d: v * k.a for d, v in a.coef}, a.const * k.a)
                return None
            xa = x if isinstance(x, Affine) else (affine({}, x.a) if x.aff is None and isinstance(x.a, int) else None)
            ya = y if isinstance(y, Affine) else (affine({}, y.a) if y.aff is None and isinstance(y.a, int) else None)
            if xa is None or ya is None:
                return None
            return _affine_sum(xa, ya, 1 if name == "add" else -1)
        f = {"and": lambda p, q: bool(p) and bool(q), "or": lambda p, q: bool(p) or bool(q)}.get(name) or _ARITH[name]
        return _elementwise(f, x, y)
    if name in ("masked_fill", "where"):
        if name == "masked_fill":
            cond, on_true, on_false = c["mask"], c["value"], c["input"]
        else:
            cond, on_true, on_false = c["condition"], c["input"], c["other"]
        m, x, y = (_abstract_of(v, memo) for v in (cond, on_true, on_false))
        if not all(isinstance(v, Select) for v in (m, x, y)):
            return None
        if not isinstance(m.a, bool):
            return None
        if isinstance(example_value(node), torch.Tensor):
            dt = example_value(node).dtype
            x, y = (Select(v.aff, cast_value(v.a, dt), cast_value(v.b, dt)) for v in (x, y))
        xy = _elementwise(lambda p, q: (p, q), x, y)
        if xy is None:
            return None
        r = _elementwise(lambda p, pq: pq[0] if p else pq[1], m, xy)
        return r
    return None


def integer_affine(x, memo):
    """The abstract value of an integer index tensor as an Affine, else None."""
    if not isinstance(x, fx.Node) or dtype(x) is None or dtype(x).is_floating_point or dtype(x) == torch.bool:
        return None
    a = abstract_value(x, memo)
    if isinstance(a, Select) and a.aff is None and is_number(a.a):
        return affine({}, int(a.a))
    return a if isinstance(a, Affine) else None


def _gather(x, index: list, in_rank: int, memo):
    """x[i0, i1, ...] with integer index tensors for the leading dims (advanced indexing): the
    affine index of x evaluated at the (affine) index tensors."""
    if len(index) > in_rank or not all(isinstance(i, fx.Node) for i in index):
        return None
    aff = x if isinstance(x, Affine) else x.aff
    if aff is None:
        return x
    trailing = in_rank - len(index)
    coef, const = {}, aff.const
    for d, c in aff.coef:
        pos = d + in_rank  # from the left
        if pos >= len(index):  # a trailing dim, not indexed: stays the same from the right
            coef[d] = coef.get(d, 0) + c
            continue
        v = integer_affine(index[pos], memo)
        if v is None or v.const < 0 or any(vc < 0 for _, vc in v.coef):
            return None  # (a negative index would wrap around)
        for vd, vc in v.coef:
            coef[vd - trailing] = coef.get(vd - trailing, 0) + c * vc
        const += c * v.const
    new = affine(coef, const)
    return new if isinstance(x, Affine) else Select(new, x.a, x.b)


def diff_args(node: fx.Node) -> tuple:
    """(x, n, dim, prepend, append) of a torch.diff(x, ...) or x.diff(...) node."""
    c_args = list(node.args)
    x = c_args[0]
    n = c_args[1] if len(c_args) > 1 else node.kwargs.get("n", 1)
    d = c_args[2] if len(c_args) > 2 else node.kwargs.get("dim", -1)
    prepend = c_args[3] if len(c_args) > 3 else node.kwargs.get("prepend")
    append = c_args[4] if len(c_args) > 4 else node.kwargs.get("append")
    return x, n, d, prepend, append


def _diff(node: fx.Node, memo):
    """torch.diff(x, dim=-1, prepend=p) of an affine x: the constant step (HF's packed-sequence
    check on arange position ids)."""
    x, n, d, prepend, append = diff_args(node)
    xs = shape(x)
    xa = integer_affine(x, memo)
    if n != 1 or append is not None or xs is None or xa is None or norm_dim(d, len(xs)) != len(xs) - 1:
        return None
    step = xa.get(-1)
    if prepend is not None:  # first element: x[..., 0] - prepend
        pa = integer_affine(prepend, memo)
        if pa is None:
            return None
        first = _affine_sum(affine({k: v for k, v in xa.coef if k != -1}, xa.const), pa, -1)
        if first.coef or first.const != step:
            return None
    return _constant(step)


# --------------------------------------------------------------------------- what the values say


def all_true(x: Any, memo: dict) -> bool:
    """A bool tensor proven True everywhere (HF's ``new_ones((), dtype=torch.bool)``, ``arange(L) >= 0``)."""
    if not isinstance(x, fx.Node) or dtype(x) != torch.bool:
        return False
    a = abstract_value(x, memo)
    return isinstance(a, Select) and a.aff is None and a.a is True


def is_causal_mask(node: fx.Node, kind: str, lq, lk) -> bool:
    """Is `node` (broadcast to the scores' last two dims (Lq, Lk)) exactly the top-left causal mask,
    for every size? kind: 'keep' (True = attend), 'masked' (True = masked out), 'additive'
    (0 = attend, a mask value <= MASK_VALUE_MAX or -inf = masked)."""
    s = shape(node)
    if s is None or len(s) < 2 or not (known_equal(s[-2], lq) and known_equal(s[-1], lk)):
        return False
    value = abstract_value(node, {})
    if isinstance(value, Select) and value.aff is not None and value.aff != _KEY_MINUS_QUERY:
        value = flipped(value)  # (i >= j, i[:, None] >= i[None, :]: i - j + 1 <= 0 selects the hidden keys)
    if not isinstance(value, Select) or value.aff != _KEY_MINUS_QUERY:
        return False
    visible, hidden = value.a, value.b  # values at j <= i and at j > i
    if kind == "keep":
        return isinstance(visible, bool) and visible is True and hidden is False
    if kind == "masked":
        return isinstance(visible, bool) and visible is False and hidden is True
    return is_number(visible) and visible == 0 and is_mask_value(hidden)


def causal_source(node: fx.Node) -> str:
    """How a causal mask was proven (for the report)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr") and _buffer_value(n) is not None:
            return "registered tril buffer, value read at compile time"
        stack.extend(n.all_input_nodes)
    names = {getattr(n.target, "__name__", str(n.target)) for n in seen if n.op != "placeholder"}
    if "arange" in names:
        return "arange comparison"
    return "tril/triu mask"


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_mask_value(v) -> bool:
    return is_number(v) and (v == -math.inf or v <= MASK_VALUE_MAX)


def constant_number(x: Any) -> Optional[Union[int, float]]:
    """A Python number, or the value of a 0-d tensor the graph makes from constants."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, fx.Node) and isinstance(example_value(x), torch.Tensor) and example_value(x).dim() == 0:
        a = abstract_value(x, {})
        if isinstance(a, Select) and a.aff is None and isinstance(a.a, (int, float)) and not isinstance(a.a, bool):
            return a.a
    return None
