"""Attention recogniser: softmax(q·kᵀ·scale + mask)·v → `torch.ops.fuse_plugin.attention`.

In the style of Inductor's fuse_attention, but on the Dynamo graph and written as predicates
instead of traced patterns. From every softmax it walks

    scores = q · kᵀ                  `_product`: matmul / @ / Tensor.matmul / bmm / einsum; kᵀ is
                                     transpose(-2,-1) / transpose(2,3) / .mT / permute(0,1,3,2) of k,
                                     or k given pre-transposed; constant factors on q or k fold
                                     into the scale
    x = scores ∘ scale ∘ masks       `_chain`: * s, / s, + bias, - bias, masked_fill, where, casts
    w = softmax(x, dim=-1)           (dtype=, .float() before, .to()/.type_as() after)
    w = dropout(w)                   only p == 0 or training=False
    out = w · v                      `_weights_times_v`: matmul / bmm / einsum

and replaces `out` by `attention(q, k, v, bias, 0.0, is_causal, scale)[0]` (then the squeeze, permute
or cast that gives exactly the eager shape and dtype). The masks become one `bias`
(`_mask_components`, `_build_bias`): a causal mask proven from the graph (`_is_causal_mask`: tril /
triu of ones or of a full, `arange` comparisons, a registered tril buffer sliced `[:T, :T]`)
becomes `is_causal`; -inf fills stay a bool mask; finite fills (finfo.min, -1e4, ...) and additive
masks become a float32 additive bias that reproduces eager's fully-masked rows (uniform weights
with finite fills, NaN with -inf). GQA k/v repeated by HF `repeat_kv` or `repeat_interleave(n, 1)`
are passed un-repeated (`_unrepeat_kv`).

Every softmax that is not replaced is reported as a miss with its reason; an unexpected error in
one site is reported as a miss and leaves the graph as it was (`rewrite`).
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops import attention as _attention_op  # noqa: F401  (registers the op)
from .canon import SIGNATURES, Call, _bind, canon, dtype, dtype_cast_target, example_value, norm_dim, shape
from .report import Report

log = logging.getLogger(__name__)

KIND = "attention"
ATTENTION_OP = torch.ops.fuse_plugin.attention.default
# A fill value at or below this counts as "masked" (-1e4 of old BERT/GPT-2 code, -1e9, finfo.min, -inf).
MASK_VALUE_MAX = -1e4
# The additive value a finite fill becomes: it swallows any score in float32, as finfo.min does
# in eager, so a row masked everywhere still gets uniform weights.
FLOAT_MASK_VALUE = torch.finfo(torch.float32).min
HEAD_DIM_RANGE = (16, 256)  # what the Triton kernels take (fuse_plugin/kernels/attention.py)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# =============================================================================== graph helpers


def _known(cond: Any) -> bool:
    """True when a (possibly symbolic) condition holds for every size; never adds a guard."""
    if isinstance(cond, bool):
        return cond
    try:
        return bool(statically_known_true(cond))
    except Exception:  # noqa: BLE001
        return False


def _same(a: Any, b: Any) -> bool:
    return _known(a == b)


def _same_shape(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _in_range(v: Any, lo: int, hi: int) -> bool:
    """lo <= v <= hi; for a symbolic size this guards on the range (a recompile if it leaves it),
    as the kernel needs it for every size the compiled graph sees."""
    if isinstance(v, int):
        return lo <= v <= hi
    try:
        return bool(v >= lo) and bool(v <= hi)
    except Exception:  # noqa: BLE001  (data-dependent size)
        return False


def _fmt_shape(s) -> str:
    return "(" + ", ".join(str(x) for x in s) + ")" if s is not None else "?"


_IN_PLACE_OPERATORS = {
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    operator.iand: None, operator.ior: None, operator.ixor: None, operator.ifloordiv: None,
    operator.imod: None, operator.ipow: None, operator.imatmul: None, operator.ilshift: None,
    operator.irshift: None,
}
_IN_PLACE_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "masked_fill_": "masked_fill"}


def _mutates(user: fx.Node, node: fx.Node) -> bool:
    """Does `user` write into `node` (an in-place op, setitem, `out=`)?"""
    if user.kwargs.get("out") is node:
        return True
    first = user.args[0] if user.args else None
    if user.op == "call_method":
        t = str(user.target)
        if t.startswith("__i") and t.endswith("__"):  # x.__iadd__(y)
            return first is node
        return first is node and t.endswith("_") and not t.startswith("_")
    if user.op != "call_function":
        return False
    t = user.target
    if t in _IN_PLACE_OPERATORS or t is operator.setitem:
        return first is node
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable and node in user.args
    if t in (operator.and_, operator.or_, operator.not_) or getattr(t, "__module__", None) in ("operator", "_operator"):
        return False
    name = getattr(t, "__name__", "")
    return first is node and name.endswith("_") and not name.startswith("_")


def _written(node: Any, allowed: Optional[fx.Node] = None) -> bool:
    """Is `node`'s value changed in place by one of its users (other than `allowed`)?"""
    return isinstance(node, fx.Node) and any(u is not allowed and _mutates(u, node) for u in node.users)


def _is_in_place(node: fx.Node) -> bool:
    return any(isinstance(a, fx.Node) and _mutates(node, a) for a in node.all_input_nodes)


# Spellings `canon` does not model (kept here so canon's names stay exactly what others read).
_AND_FUNCTIONS = {operator.and_, torch.logical_and, torch.bitwise_and}
_OR_FUNCTIONS = {operator.or_, torch.logical_or, torch.bitwise_or}
_AND_METHODS = {"__and__", "logical_and", "bitwise_and"}
_OR_METHODS = {"__or__", "logical_or", "bitwise_or"}
_TRANSPOSE_ALIASES = {"swapaxes", "swapdims"}


def _call(node: Any) -> Optional[Call]:
    """canon(node), plus and/or, clone, swapaxes and the in-place forms of the chain ops (named
    like their out-of-place op; `_in_place(node)` tells them apart)."""
    c = canon(node)
    if c is not None or not isinstance(node, fx.Node):
        return c
    args, kwargs = node.args, dict(node.kwargs)
    name = None
    if node.op == "call_function":
        t = node.target
        if t in _AND_FUNCTIONS:
            name = "and"
        elif t in _OR_FUNCTIONS:
            name = "or"
        elif _IN_PLACE_OPERATORS.get(t):
            name = _IN_PLACE_OPERATORS[t]
        elif t is torch.clone:
            name = "clone"
        elif t in (torch.swapaxes, torch.swapdims):
            name = "transpose"
    elif node.op == "call_method":
        t = node.target
        if t in _AND_METHODS:
            name = "and"
        elif t in _OR_METHODS:
            name = "or"
        elif t in _IN_PLACE_METHODS:
            name = _IN_PLACE_METHODS[t]
        elif t == "clone":
            name = "clone"
        elif t in _TRANSPOSE_ALIASES:
            name = "transpose"
        elif t == "type" and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
            return Call("to", {"input": args[0], "args": (args[1],)}, node)
    if name is None:
        return None
    if name in ("and", "or"):
        params = (("input", None), ("other", None))
    elif name == "clone":
        kwargs.pop("memory_format", None)
        params = (("input", None),)
    else:
        params = SIGNATURES[name]
    bound = _bind(name, params, args, kwargs)
    return None if bound is None else Call(name, bound, node)


def _in_place(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _IN_PLACE_METHODS) or (
        node.op == "call_function" and node.target in _IN_PLACE_OPERATORS
    )


def _cast_dtype(c: Call) -> Optional[torch.dtype]:
    """The floating dtype a pure float cast casts to, else None."""
    if c.name not in ("float", "half", "bfloat16", "type_as", "to"):
        return None
    t = dtype_cast_target(c)
    return t if isinstance(t, torch.dtype) and t.is_floating_point else None


def _is_transparent(c: Call) -> bool:
    """An op that leaves values (and dtype, device) as they are."""
    if c.name in ("contiguous", "clone"):
        return True
    if c.name == "to":  # .to(device) to the device it is on, .to(own dtype)
        src, dst = example_value(c["input"]), example_value(c.node)
        return (
            isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
            and src.dtype == dst.dtype and src.device == dst.device
        )
    return False


def _number(x: Any) -> Optional[Union[int, float]]:
    """A Python number, or the value of a 0-d tensor the graph makes from constants."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, fx.Node) and isinstance(example_value(x), torch.Tensor) and example_value(x).dim() == 0:
        a = _abstract(x, {})
        if isinstance(a, _Sel) and a.aff is None and isinstance(a.a, (int, float)) and not isinstance(a.a, bool):
            return a.a
    return None


def _scale_factor(x: Any) -> Optional[tuple[str, Any]]:
    """('const', float) for a number or a constant 0-d tensor; ('node', node) for a symbolic number
    (under dynamic shapes) or a 0-d float tensor computed at run time (a learned temperature)."""
    v = _number(x)
    if v is not None:
        return ("const", float(v))
    if isinstance(x, fx.Node):
        ev = example_value(x)
        if isinstance(ev, (torch.SymInt, torch.SymFloat)):
            return ("node", x)
        if isinstance(ev, torch.Tensor) and ev.dim() == 0 and ev.dtype.is_floating_point:
            return ("node", x)
    return None


def _strip_const_factors(node: Any) -> tuple[Any, float]:
    """(x, c) for node = x * c / ... with constant c (scale applied to q or k before the product)."""
    factor = 1.0
    while True:
        c = _call(node)
        if c is None or _in_place(node) or _written(node):
            return node, factor
        if c.name == "mul":
            a, b = c["input"], c["other"]
            fa, fb = _scale_factor(a), _scale_factor(b)
            if fb is not None and fb[0] == "const" and isinstance(a, fx.Node) and fa is None:
                node, factor = a, factor * fb[1]
                continue
            if fa is not None and fa[0] == "const" and isinstance(b, fx.Node) and fb is None:
                node, factor = b, factor * fa[1]
                continue
        elif c.name == "div" and c["rounding_mode"] is None:
            fb = _scale_factor(c["other"])
            if fb is not None and fb[0] == "const" and fb[1] != 0 and isinstance(c["input"], fx.Node):
                node, factor = c["input"], factor / fb[1]
                continue
        return node, factor


# =============================================================================== mask values
#
# A small abstract interpreter over the nodes that build a mask, enough to prove a mask causal
# for every size: a value is an affine function of the (query i, key j) indices (`_Aff`, from
# `arange`) or a select between two constants on a predicate `aff <= 0` (`_Sel`: tril/triu of a
# full, comparisons of aranges, the value of a registered tril buffer).


@dataclass(frozen=True)
class _Aff:
    """An integer tensor: const + Σ coef·index(dim), dims counted from the right (-1 = key j)."""

    coef: tuple[tuple[int, int], ...]
    const: int

    def get(self, dim: int) -> int:
        return dict(self.coef).get(dim, 0)


def _aff(coef: dict, const: int) -> _Aff:
    return _Aff(tuple(sorted((d, c) for d, c in coef.items() if c != 0)), const)


def _aff_add(x: _Aff, y: _Aff, sign: int = 1) -> _Aff:
    coef = dict(x.coef)
    for d, c in y.coef:
        coef[d] = coef.get(d, 0) + sign * c
    return _aff(coef, x.const + sign * y.const)


_KEY_MINUS_QUERY = _aff({-1: 1, -2: -1}, 0)  # j - i: causal keeps key j for query i iff j - i <= 0


@dataclass(frozen=True)
class _Sel:
    """A tensor equal to `a` where `aff <= 0` and to `b` elsewhere; aff None: the constant `a`."""

    aff: Optional[_Aff]
    a: Any
    b: Any


def _const(v) -> _Sel:
    return _Sel(None, v, v)


def _norm(value, node: fx.Node):
    """Drop index terms along dims of size 1 (the index there is always 0)."""
    s = shape(node)
    if value is None or s is None:
        return None
    aff = value if isinstance(value, _Aff) else value.aff
    if aff is None:
        return value
    coef = {}
    for d, c in aff.coef:
        if -d > len(s):
            return None
        if not _same(s[d], 1):
            coef[d] = c
    new = _aff(coef, aff.const)
    if isinstance(value, _Aff):
        return new if new.coef else _const(new.const)
    if not new.coef:
        return _const(value.a if new.const <= 0 else value.b)
    return _Sel(new, value.a, value.b)


def _remap(value, mapping: dict[int, Optional[int]], shift: dict[int, int]):
    """Move index terms to new dims (`mapping`: old dim → new dim or None when the dim is indexed
    by a constant `shift[old]`); slicing from `start` shifts the index by start."""
    aff = value if isinstance(value, _Aff) else value.aff
    if aff is None:
        return value
    coef, const = {}, aff.const
    for d, c in aff.coef:
        if d not in mapping:
            return None
        const += c * shift.get(d, 0)
        if mapping[d] is not None:
            coef[mapping[d]] = coef.get(mapping[d], 0) + c
    new = _aff(coef, const)
    return new if isinstance(value, _Aff) else _Sel(new, value.a, value.b)


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
    ins = [(d - len(in_shape), s) for d, s in enumerate(in_shape) if not _same(s, 1)]
    outs = [(d - len(out_shape), s) for d, s in enumerate(out_shape) if not _same(s, 1)]
    if len(ins) != len(outs) or not all(_same(a[1], b[1]) for a, b in zip(ins, outs)):
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


def _sel_of_tensor(t: torch.Tensor) -> Optional[_Sel]:
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
    return _Sel(_KEY_MINUS_QUERY, a, b)


_CMP = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne}
_ARITH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_FULL = {torch.full: 1, torch.full_like: 1}  # position of the fill value
_ONES = {torch.ones: 1, torch.ones_like: 1, torch.zeros: 0, torch.zeros_like: 0}
_NEW = {"new_ones": 1, "new_zeros": 0}


def _cast_value(v: Any, dt: torch.dtype) -> Any:
    if dt == torch.bool:
        return bool(v)
    try:
        return torch.tensor(v, dtype=dt).item()  # e.g. float32's finfo.min is -inf in float16
    except Exception:  # noqa: BLE001
        return None


def _elementwise(f, x: _Sel, y: _Sel) -> Optional[_Sel]:
    try:
        if x.aff is None:
            return _Sel(y.aff, f(x.a, y.a), f(x.a, y.b))
        if y.aff is None or y.aff == x.aff:
            return _Sel(x.aff, f(x.a, y.a), f(x.b, y.b if y.aff is not None else y.a))
    except Exception:  # noqa: BLE001
        return None
    return None


def _as_abstract(x: Any, memo: dict):
    if isinstance(x, fx.Node):
        return _abstract(x, memo)
    if isinstance(x, (bool, int, float)):
        return _const(x)
    return None


def _compare(name: str, x, y) -> Optional[_Sel]:
    """lt/le/gt/ge of integer affine indices as a predicate `aff <= 0`; else elementwise."""
    if isinstance(x, _Aff) or isinstance(y, _Aff):
        xa = x if isinstance(x, _Aff) else (_aff({}, x.a) if x.aff is None and isinstance(x.a, int) else None)
        ya = y if isinstance(y, _Aff) else (_aff({}, y.a) if y.aff is None and isinstance(y.a, int) else None)
        if xa is None or ya is None or name in ("eq", "ne"):
            return None
        diff = _aff_add(xa, ya, -1)
        plus1 = _aff(dict(diff.coef), diff.const + 1)
        return {
            "le": _Sel(diff, True, False),  # diff <= 0
            "lt": _Sel(plus1, True, False),  # diff < 0  ⟺  diff + 1 <= 0 (integers)
            "gt": _Sel(diff, False, True),
            "ge": _Sel(plus1, False, True),
        }[name]
    return _elementwise(_CMP[name], x, y)


def _abstract(node: fx.Node, memo: dict):
    """The abstract value (_Aff / _Sel) of a mask-building node, or None if unknown."""
    if node in memo:
        return memo[node]
    memo[node] = None  # cycles cannot happen in a DAG, but keep recursion cheap
    value = _abstract_uncached(node, memo)
    if value is not None and _written(node):
        value = None  # changed in place later: its value at a use is not what the node computed
    if value is not None and isinstance(example_value(node), torch.Tensor):
        value = _norm(value, node)
    memo[node] = value
    return value


def _abstract_uncached(node: fx.Node, memo: dict):
    if node.op in ("placeholder", "get_attr"):
        t = _buffer_value(node)
        return None if t is None else _sel_of_tensor(t)
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
            return _aff({-1: step}, start)
        if t in _FULL:
            v = args[_FULL[t]] if len(args) > _FULL[t] else kwargs.get("fill_value")
            return _const(_cast_value(v, ev.dtype)) if isinstance(v, (bool, int, float)) else None
        if t in _ONES:
            return _const(_cast_value(_ONES[t], ev.dtype))
        if t in (torch.tensor, torch.scalar_tensor, torch.as_tensor) and args:
            v = args[0]
            return _const(_cast_value(v, ev.dtype)) if isinstance(v, (bool, int, float)) else None
    if (node.op == "call_function" and t is torch.diff) or (node.op == "call_method" and t == "diff"):
        return _diff(node, memo)
    if (node.op == "call_function" and t is torch.cumsum) or (node.op == "call_method" and t == "cumsum"):
        x = _as_abstract(args[0], memo)
        d = args[1] if len(args) > 1 else kwargs.get("dim")
        s = shape(args[0])
        if not (isinstance(x, _Sel) and x.aff is None and isinstance(x.a, (bool, int))):
            return None
        dim = norm_dim(d, len(s)) if s is not None else None
        if dim is None:
            return None
        v = int(x.a)
        return _const(0) if v == 0 else _aff({dim - len(s): v}, v)  # c, 2c, 3c, ... along dim
    if node.op == "call_method" and t in _NEW:
        return _const(_cast_value(_NEW[t], ev.dtype))
    if node.op == "call_method" and t == "new_full" and len(args) >= 3 and isinstance(args[2], (bool, int, float)):
        return _const(_cast_value(args[2], ev.dtype))
    c = _call(node)
    if c is None:
        return None
    name = c.name
    if _in_place(node):
        return None
    # ------------------------------------------------------------------ views and casts
    if name in ("contiguous", "clone", "expand", "to", "float", "half", "bfloat16", "bool", "type_as"):
        x = _as_abstract(c["input"], memo)
        if x is None:
            return None
        src = example_value(c["input"])
        if isinstance(x, _Aff):  # integer positions: keep them through int/float casts
            return x if ev.dtype != torch.bool else None
        if isinstance(src, torch.Tensor) and src.dtype != ev.dtype:
            a, b = _cast_value(x.a, ev.dtype), _cast_value(x.b, ev.dtype)
            return None if a is None or b is None else _Sel(x.aff, a, b)
        return x
    if name in ("view", "reshape", "unsqueeze", "flatten"):
        x = _as_abstract(c["input"], memo)
        in_s, out_s = shape(c["input"]), shape(node)
        if x is None or in_s is None or out_s is None:
            return None
        if isinstance(x, _Sel) and x.aff is None:
            return x
        m = _reshape_map(in_s, out_s)
        return None if m is None else _remap(x, m, {})
    if name == "getitem":
        x = _as_abstract(c["input"], memo)
        in_s = shape(c["input"])
        if x is None or in_s is None:
            return None
        if isinstance(c["index"], (tuple, list)) and any(isinstance(i, fx.Node) for i in c["index"]):
            return _gather(x, list(c["index"]), len(in_s), memo)
        im = _index_map(c["index"], len(in_s), ev.dim())
        if im is None:
            return None
        return x if isinstance(x, _Sel) and x.aff is None else _remap(x, *im)
    if name in ("tril", "triu"):
        x = _as_abstract(c["input"], memo)
        d = c["diagonal"]
        if not (isinstance(x, _Sel) and x.aff is None and isinstance(d, int)) or ev.dim() < 2:
            return None
        zero = _cast_value(0, ev.dtype)
        if name == "tril":  # v where j - i <= d
            return _Sel(_aff({-1: 1, -2: -1}, -d), x.a, zero)
        return _Sel(_aff({-1: 1, -2: -1}, -(d - 1)), zero, x.a)  # v where j - i >= d
    # ------------------------------------------------------------------ arithmetic and logic
    if name in ("logical_not", "invert", "neg"):
        x = _as_abstract(c["input"], memo)
        if isinstance(x, _Aff):
            return _aff({d: -k for d, k in x.coef}, -x.const) if name == "neg" else None
        if x is None:
            return None
        if name == "neg":
            return _Sel(x.aff, -x.a, -x.b)
        if not isinstance(x.a, bool):
            return None
        return _Sel(x.aff, not x.a, not x.b)
    if name in ("and", "or", "add", "sub", "mul", "lt", "le", "gt", "ge", "eq", "ne"):
        if name in ("add", "sub") and c["alpha"] != 1:
            return None
        x, y = _as_abstract(c["input"], memo), _as_abstract(c["other"], memo)
        if x is None or y is None:
            return None
        if name in _CMP:
            return _compare(name, x, y)
        if isinstance(x, _Aff) or isinstance(y, _Aff):
            if name not in ("add", "sub"):
                if name == "mul":
                    k, a = (y, x) if isinstance(x, _Aff) else (x, y)
                    if isinstance(a, _Aff) and isinstance(k, _Sel) and k.aff is None and isinstance(k.a, int) and not isinstance(k.a, bool):
                        return _aff({d: v * k.a for d, v in a.coef}, a.const * k.a)
                return None
            xa = x if isinstance(x, _Aff) else (_aff({}, x.a) if x.aff is None and isinstance(x.a, int) else None)
            ya = y if isinstance(y, _Aff) else (_aff({}, y.a) if y.aff is None and isinstance(y.a, int) else None)
            if xa is None or ya is None:
                return None
            return _aff_add(xa, ya, 1 if name == "add" else -1)
        f = {"and": lambda p, q: bool(p) and bool(q), "or": lambda p, q: bool(p) or bool(q)}.get(name) or _ARITH[name]
        return _elementwise(f, x, y)
    if name in ("masked_fill", "where"):
        if name == "masked_fill":
            cond, on_true, on_false = c["mask"], c["value"], c["input"]
        else:
            cond, on_true, on_false = c["condition"], c["input"], c["other"]
        m, x, y = (_as_abstract(v, memo) for v in (cond, on_true, on_false))
        if not all(isinstance(v, _Sel) for v in (m, x, y)):
            return None
        if not isinstance(m.a, bool):
            return None
        if isinstance(example_value(node), torch.Tensor):
            dt = example_value(node).dtype
            x, y = (_Sel(v.aff, _cast_value(v.a, dt), _cast_value(v.b, dt)) for v in (x, y))
        xy = _elementwise(lambda p, q: (p, q), x, y)
        if xy is None:
            return None
        r = _elementwise(lambda p, pq: pq[0] if p else pq[1], m, xy)
        return r
    return None


def _int_abstract(x, memo):
    """The abstract value of an integer index tensor as an _Aff, else None."""
    if not isinstance(x, fx.Node) or dtype(x) is None or dtype(x).is_floating_point or dtype(x) == torch.bool:
        return None
    a = _abstract(x, memo)
    if isinstance(a, _Sel) and a.aff is None and _is_number(a.a):
        return _aff({}, int(a.a))
    return a if isinstance(a, _Aff) else None


def _gather(x, index: list, in_rank: int, memo):
    """x[i0, i1, ...] with integer index tensors for the leading dims (advanced indexing): the
    affine index of x evaluated at the (affine) index tensors."""
    if len(index) > in_rank or not all(isinstance(i, fx.Node) for i in index):
        return None
    aff = x if isinstance(x, _Aff) else x.aff
    if aff is None:
        return x
    trailing = in_rank - len(index)
    coef, const = {}, aff.const
    for d, c in aff.coef:
        pos = d + in_rank  # from the left
        if pos >= len(index):  # a trailing dim, not indexed: stays the same from the right
            coef[d] = coef.get(d, 0) + c
            continue
        v = _int_abstract(index[pos], memo)
        if v is None or v.const < 0 or any(vc < 0 for _, vc in v.coef):
            return None  # (a negative index would wrap around)
        for vd, vc in v.coef:
            coef[vd - trailing] = coef.get(vd - trailing, 0) + c * vc
        const += c * v.const
    new = _aff(coef, const)
    return new if isinstance(x, _Aff) else _Sel(new, x.a, x.b)


def _diff(node: fx.Node, memo):
    """torch.diff(x, dim=-1, prepend=p) of an affine x: the constant step (HF's packed-sequence
    check on arange position ids)."""
    c_args = list(node.args)  # torch.diff(x, ...) and x.diff(...) alike
    x = c_args[0]
    n = c_args[1] if len(c_args) > 1 else node.kwargs.get("n", 1)
    d = c_args[2] if len(c_args) > 2 else node.kwargs.get("dim", -1)
    prepend = c_args[3] if len(c_args) > 3 else node.kwargs.get("prepend")
    append = c_args[4] if len(c_args) > 4 else node.kwargs.get("append")
    xs = shape(x)
    xa = _int_abstract(x, memo)
    if n != 1 or append is not None or xs is None or xa is None or norm_dim(d, len(xs)) != len(xs) - 1:
        return None
    step = xa.get(-1)
    if prepend is not None:  # first element: x[..., 0] - prepend
        pa = _int_abstract(prepend, memo)
        if pa is None:
            return None
        first = _aff_add(_aff({k: v for k, v in xa.coef if k != -1}, xa.const), pa, -1)
        if first.coef or first.const != step:
            return None
    return _const(step)


def _is_causal_mask(node: fx.Node, kind: str, lq, lk) -> bool:
    """Is `node` (broadcast to the scores' last two dims (Lq, Lk)) exactly the top-left causal mask,
    for every size? kind: 'keep' (True = attend), 'masked' (True = masked out), 'additive'
    (0 = attend, a mask value <= MASK_VALUE_MAX or -inf = masked)."""
    s = shape(node)
    if s is None or len(s) < 2 or not (_same(s[-2], lq) and _same(s[-1], lk)):
        return False
    value = _abstract(node, {})
    if not isinstance(value, _Sel) or value.aff != _KEY_MINUS_QUERY:
        return False
    visible, hidden = value.a, value.b  # values at j <= i and at j > i
    if kind == "keep":
        return isinstance(visible, bool) and visible is True and hidden is False
    if kind == "masked":
        return isinstance(visible, bool) and visible is False and hidden is True
    return _is_number(visible) and visible == 0 and _is_mask_value(hidden)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_mask_value(v) -> bool:
    return _is_number(v) and (v == -math.inf or v <= MASK_VALUE_MAX)


# =============================================================================== match


@dataclass
class _Operand:
    """A tensor to pass to the op: `node` with view ops applied at build time [(method, *args)]."""

    node: fx.Node
    ops: tuple = ()

    def value(self):
        v = example_value(self.node)
        for m, *a in self.ops:
            v = getattr(v, m)(*a)
        return v


@dataclass
class _Term:
    """An additive bias term: node (negated: subtracted), times the constant scales after it."""

    node: fx.Node
    negate: bool = False
    scale: float = 1.0


@dataclass
class _Fill:
    """Scores set to `value` where mask == masked_when (masked_fill: True; where(c, x, v): False)."""

    mask: fx.Node
    masked_when: bool
    value: float
    causal: bool = False  # the mask is the causal mask (which never hides a whole row)


@dataclass
class _Causal:
    value: float  # the fill value of the causal mask (-inf or a finite mask value)
    source: str


Component = Union[_Term, _Fill, _Causal]


@dataclass
class AttentionSite:
    """One matched attention: what `replace` needs to emit the op."""

    softmax: fx.Node
    scores: fx.Node  # the q·kᵀ product
    output: fx.Node  # the ·v product whose uses the op takes over
    q: _Operand
    k: _Operand
    v: _Operand
    rank: int  # of the products (2, 3 or 4); lower ranks are unsqueezed to 4-D
    scale: float
    scale_nodes: list  # [(node, divide)]: run-time scale factors, applied to q
    components: list  # remaining mask components (no _Causal)
    is_causal: bool
    causal_note: str
    kv_groups: int
    out_ops: tuple  # view ops on the op's output (einsum output order)
    matched: list  # the nodes from scores to output, erased when dead
    notes: list = field(default_factory=list)


def _is_product(node: Any) -> bool:
    c = _call(node)
    return c is not None and c.name in ("matmul", "bmm", "einsum")


def _einsum_terms(c: Call):
    """(input subscripts, output subscripts, operands) of a 2-operand explicit einsum, with a
    leading '...' expanded to one token per dim; None otherwise."""
    eq = c["equation"]
    ops = c["operands"]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if not isinstance(eq, str) or "->" not in eq or len(ops) != 2:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or not all(isinstance(o, fx.Node) for o in ops):
        return None

    def tokens(sub: str, rank: Optional[int]):
        if sub.startswith("..."):
            rest = list(sub[3:])
            if rank is None or "." in rest:
                return None
            return [f".{i}" for i in range(rank - len(rest))] + rest
        if "." in sub or not sub.isalpha():
            return None
        return list(sub)

    ranks = [len(shape(o)) if shape(o) is not None else None for o in ops]
    t_in = [tokens(s, r) for s, r in zip(ins, ranks)]
    t_out = tokens(out, len(shape(c.node)) if shape(c.node) is not None else None)
    if any(t is None for t in t_in) or t_out is None:
        return None
    if any(len(set(t)) != len(t) for t in t_in + [t_out]) or any(len(t) != r for t, r in zip(t_in, ranks)):
        return None
    return t_in, t_out, ops


def _permuted(node: fx.Node, have: list, want: list) -> _Operand:
    perm = tuple(have.index(t) for t in want)
    return _Operand(node, ()) if perm == tuple(range(len(perm))) else _Operand(node, (("permute", *perm),))


def _k_from_kt(kt: fx.Node) -> Union[_Operand, str]:
    """k (…, Lk, D) from the product's second operand kᵀ (…, D, Lk)."""
    r = len(shape(kt))
    c = _call(kt)
    while c is not None and _is_transparent(c) and not _written(kt):
        kt = c["input"]
        c = _call(kt)
    if c is not None and not _written(kt):
        if c.name == "transpose":
            dims = {norm_dim(c["dim0"], r), norm_dim(c["dim1"], r)}
            if dims == {r - 2, r - 1}:
                return _Operand(c["input"])
            return f"k operand is transpose({c['dim0']}, {c['dim1']}) of k, not a transpose of its last two dims"
        if c.name == "permute":
            dims = tuple(norm_dim(d, r) for d in c["dims"])
            if dims == tuple(range(r - 2)) + (r - 1, r - 2):
                return _Operand(c["input"])
            return f"k operand is permute{tuple(c['dims'])} of k, not a transpose of its last two dims"
        if c.name == "getattr" and (c["name"] == "mT" or (c["name"] == "T" and r == 2)):
            return _Operand(c["input"])
    return _Operand(kt, (("transpose", -2, -1),))  # k given pre-transposed


def _product(node: fx.Node) -> Union[tuple, str]:
    """The q·kᵀ product: (q, k, constant scale folded from q and k)."""
    c = _call(node)
    if c.name == "einsum":
        terms = _einsum_terms(c)
        if terms is None:
            return f"einsum {c['equation']!r} is not a two-operand batched q·kᵀ"
        (ta, tb), to, (a, b) = terms
        batch, (i, j) = to[:-2], to[-2:]
        contracted = [t for t in ta if t not in to]
        if len(contracted) != 1 or sorted(ta) != sorted(batch + [i] + contracted) or sorted(tb) != sorted(batch + [j] + contracted):
            return f"einsum {c['equation']!r} is not q·kᵀ over the last dim with the key dim last"
        q, k = _permuted(a, ta, batch + [i] + contracted), _permuted(b, tb, batch + [j] + contracted)
        factor = 1.0
    else:
        a, b = c["input"], c["other"] if c.name == "matmul" else c["mat2"]
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or shape(a) is None or shape(b) is None:
            return "q·kᵀ operands have no shape metadata"
        if len(shape(a)) < 2 or len(shape(b)) < 2:
            return "q·kᵀ operands are not matrices"
        kt, factor = _strip_const_factors(b)
        k = _k_from_kt(kt)
        if isinstance(k, str):
            return k
        q = _Operand(a)
    if not q.ops:
        qn, f = _strip_const_factors(q.node)
        q, factor = _Operand(qn), factor * f
    if not k.ops:
        kn, f = _strip_const_factors(k.node)
        k, factor = _Operand(kn), factor * f
    return q, k, factor


def _weights_times_v(w: fx.Node, u: fx.Node) -> Union[tuple, str]:
    """For u = w·v: (v operand, view ops on the op's output)."""
    c = _call(u)
    if c.name == "einsum":
        terms = _einsum_terms(c)
        if terms is None or terms[2][0] is not w or terms[2][1] is w:
            return f"einsum {c['equation']!r} is not a two-operand weights·v"
        (tw, tv), to, (_, v) = terms
        batch, (i, j) = tw[:-2], tw[-2:]
        rest = [t for t in tv if t not in tw]
        if len(rest) != 1 or sorted(tv) != sorted(batch + [j] + rest) or sorted(to) != sorted(batch + [i] + rest):
            return f"einsum {c['equation']!r} is not weights·v over the key dim"
        have = batch + [i] + rest
        perm = tuple(have.index(t) for t in to)
        out_ops = () if perm == tuple(range(len(perm))) else (("permute", *perm),)
        return _permuted(v, tv, batch + [j] + rest), out_ops
    a, v = c["input"], c["other"] if c.name == "matmul" else c["mat2"]
    if a is not w or v is w or not isinstance(v, fx.Node):
        return "the attention weights are not the first operand of the product with v"
    return _Operand(v), ()


def _unrepeat_kv(x: _Operand) -> Optional[tuple[fx.Node, int]]:
    """(k, n) when x is k (B, Hkv, L, D) with every head repeated n times in a row — HF repeat_kv
    (`k[:, :, None].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)`) or
    `k.repeat_interleave(n, dim=1)` — so head h reads kv head h // n, as the op's GQA does."""
    if x.ops or shape(x.node) is None or len(shape(x.node)) != 4:
        return None
    node = x.node
    out = shape(node)
    c = _call(node)
    if c is None or _written(node):
        return None
    if c.name == "repeat_interleave":
        src, n = c["input"], c["repeats"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(src, fx.Node) or shape(src) is None:
            return None
        if c["dim"] is None or norm_dim(c["dim"], 4) != 1:
            return None
        s = shape(src)
        if len(s) == 4 and _same_shape(out, (s[0], s[1] * n, s[2], s[3])):
            return src, n
        return None
    if c.name in ("reshape", "view", "flatten"):
        e = c["input"]
        ce = _call(e)
        if c.name == "flatten" and not (norm_dim(c["start_dim"], 5) == 1 and norm_dim(c["end_dim"], 5) == 2):
            return None
        if ce is None or ce.name != "expand" or _written(e):
            return None
        g = ce["input"]
        cg = _call(g)
        es = shape(e)
        if cg is None or es is None or len(es) != 5 or _written(g):
            return None
        if cg.name == "unsqueeze" and norm_dim(cg["dim"], 5) == 2:
            src = cg["input"]
        elif cg.name == "getitem":
            src = cg["input"]
            idx = cg["index"]
            idx = idx if isinstance(idx, tuple) else (idx,)
            if sum(i is None for i in idx) != 1 or not all(
                i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in idx
            ):
                return None
        else:
            return None
        s = shape(src) if isinstance(src, fx.Node) else None
        gs = shape(g)
        if s is None or len(s) != 4 or not _same_shape(gs, (s[0], s[1], 1, s[2], s[3])):
            return None
        n = es[2]
        if not isinstance(n, int):
            return None
        if _same_shape(es, (s[0], s[1], n, s[2], s[3])) and _same_shape(out, (s[0], s[1] * n, s[2], s[3])):
            return src, n
    return None


def _dtype_only_user(u: fx.Node, x: fx.Node) -> bool:
    """u reads only x's dtype: `w.type_as(x)` / `w.to(x)` with x as the reference."""
    c = _call(u)
    if c is None or c["input"] is x:
        return False
    if c.name == "type_as":
        return c["other"] is x
    return c.name == "to" and x in c["args"] and _cast_dtype(c) is not None


def _chain(x: fx.Node, softmax: fx.Node, after: list) -> Union[tuple, str]:
    """Walk from the softmax input down to the q·kᵀ product: (product, ops top-down, nodes).
    `after`: the casts after the softmax, which may read a chain node's dtype (`.type_as(scores)`)."""
    ops, nodes, user = [], [], softmax
    while True:
        if _written(x, allowed=user if _in_place(user) else None):
            writers = [u.name for u in x.users if u is not user and _mutates(u, x)]
            return f"{x.name} is changed in place ({', '.join(writers)}) before the softmax reads it"
        if len([u for u in x.users if not (u in after and _dtype_only_user(u, x))]) != 1:
            return f"the scores feeding the softmax ({x.name}) are also used elsewhere"
        if _is_product(x):
            return x, ops, nodes
        c = _call(x)
        if c is None:
            return f"softmax input is not q·kᵀ (with scale/mask): found {_describe(x)}"
        nodes.append(x)
        name = c.name
        if _cast_dtype(c) is not None or _is_transparent(c):
            ops.append(("cast",))
            nxt = c["input"]
        elif name in ("mul", "div"):
            a, b = c["input"], c["other"]
            if name == "div" and c["rounding_mode"] is not None:
                return f"division with rounding_mode={c['rounding_mode']!r}"
            fb = _scale_factor(b)
            fa = _scale_factor(a) if name == "mul" else None
            if fb is not None and isinstance(a, fx.Node) and _scale_factor(a) is None:
                ops.append(("scale", fb, name == "div"))
                nxt = a
            elif fa is not None and isinstance(b, fx.Node):
                ops.append(("scale", fa, False))
                nxt = b
            else:
                return f"the scores are multiplied by a tensor ({_describe(x)}), not a scale"
        elif name in ("add", "sub"):
            a, b = c["input"], c["other"]
            if c["alpha"] != 1:
                return f"{name} with alpha={c['alpha']}"
            if name == "sub":
                if not isinstance(a, fx.Node) or not _reaches_product(a):
                    return "the scores are subtracted from a tensor"
                chain_in, other = a, b
            elif isinstance(a, fx.Node) and _reaches_product(a):
                chain_in, other = a, b
            elif isinstance(b, fx.Node) and _reaches_product(b):
                chain_in, other = b, a
            else:
                return f"softmax input is not q·kᵀ (with scale/mask): found {_describe(x)}"
            if _number(other) is not None:
                ops.append(("const",))  # adding a constant does not change a softmax
            elif isinstance(other, fx.Node) and isinstance(example_value(other), torch.Tensor):
                ops.append(("add", other, name == "sub"))
            else:
                return f"the scores get {_describe(other)} added"
            nxt = chain_in
        elif name == "masked_fill":
            v = _number(c["value"])
            if v is None:
                return f"masked_fill with a non-constant value ({_describe(c['value'])})"
            ops.append(("fill", c["mask"], True, float(v)))
            nxt = c["input"]
        elif name == "where":
            cond, a, b = c["condition"], c["input"], c["other"]
            va, vb = _number(a), _number(b)
            if vb is not None and isinstance(a, fx.Node):
                ops.append(("fill", cond, False, float(vb)))
                nxt = a
            elif va is not None and isinstance(b, fx.Node):
                ops.append(("fill", cond, True, float(va)))
                nxt = b
            else:
                return "torch.where between the scores and a tensor, not a constant mask value"
        else:
            return f"softmax input is not q·kᵀ (with scale/mask): found {_describe(x)}"
        if not isinstance(nxt, fx.Node):
            return f"softmax input is not q·kᵀ: {_describe(x)} has no tensor input"
        user, x = x, nxt


def _reaches_product(x: fx.Node, depth: int = 16) -> bool:
    """Does x lead (through chain ops) to a matmul/bmm/einsum? Tells the scores from the bias."""
    if depth == 0:
        return False
    if _is_product(x):
        return True
    c = _call(x)
    if c is None or c.name not in _CHAIN_OPS:
        return False
    if c.name == "where":
        cands = [c["input"], c["other"]]
    else:
        cands = [c["input"]] + ([c["other"]] if c.name in ("mul", "add") else [])
    return any(isinstance(n, fx.Node) and _reaches_product(n, depth - 1) for n in cands)


_CHAIN_OPS = ("mul", "div", "add", "sub", "masked_fill", "where", "float", "half", "bfloat16", "to", "type_as", "contiguous", "clone")


def _describe(x: Any) -> str:
    if not isinstance(x, fx.Node):
        return repr(x)
    c = _call(x)
    if c is not None:
        return f"{c.name} ({x.name})"
    if x.op in ("call_function", "call_method"):
        return f"{getattr(x.target, '__name__', x.target)} ({x.name})"
    return f"{x.op} {x.name}"


def _bool_components(mask: Any, masked_when: bool, value: float, lq, lk, memo) -> list:
    """A bool mask as components: [] if it masks nothing, [_Causal] if it is the causal mask; an
    AND of keep masks (OR of masked masks) with a causal part splits into the causal part and the
    rest; anything else stays one _Fill."""
    if not isinstance(mask, fx.Node) or dtype(mask) != torch.bool:
        return [_Fill(mask, masked_when, value)]
    if _is_causal_mask(mask, "masked" if masked_when else "keep", lq, lk):
        return [_Causal(value, _causal_source(mask))]
    a = _abstract(mask, memo)
    if isinstance(a, _Sel) and a.aff is None and isinstance(a.a, bool) and a.a != masked_when:
        return []  # keeps everything
    c = _call(mask)
    parts = None
    if c is not None and not _written(mask):
        if (c.name == "and" and not masked_when) or (c.name == "or" and masked_when):
            parts = _bool_components(c["input"], masked_when, value, lq, lk, memo) + _bool_components(
                c["other"], masked_when, value, lq, lk, memo
            )
        elif c.name in ("logical_not", "invert"):
            parts = _bool_components(c["input"], not masked_when, value, lq, lk, memo)
        elif c.name in ("expand", "contiguous", "clone") or (c.name == "to" and _is_transparent(c)):
            parts = _bool_components(c["input"], masked_when, value, lq, lk, memo)
    if parts is not None and any(isinstance(p, _Causal) for p in parts):
        return parts
    return [_Fill(mask, masked_when, value)]


def _causal_source(node: fx.Node) -> str:
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


def _term_components(term: _Term, lq, lk, memo) -> list:
    """An additive mask term as components: causal parts, `where(keep, 0, fill)` as bool masks."""
    if term.negate or term.scale != 1.0:
        return [term]
    node = term.node
    if _is_causal_mask(node, "additive", lq, lk):
        a = _abstract(node, memo)
        return [_Causal(float(a.b), _causal_source(node))]
    c = _call(node)
    if c is None or _written(node):
        return [term]
    if c.name == "where":
        cond, a, b = c["condition"], c["input"], c["other"]
        va, vb = _number(a), _number(b)
        ev = example_value(node)
        if dtype(cond) == torch.bool and isinstance(ev, torch.Tensor) and va is not None and vb is not None:
            va, vb = _cast_value(va, ev.dtype), _cast_value(vb, ev.dtype)
            if va == 0 and _is_mask_value(vb):
                return _bool_components(cond, False, float(vb), lq, lk, memo)
            if vb == 0 and _is_mask_value(va):
                return _bool_components(cond, True, float(va), lq, lk, memo)
    if c.name in ("expand", "contiguous", "clone") or _is_transparent(c):
        inner = _term_components(_Term(c["input"]), lq, lk, memo)
        if any(isinstance(p, _Causal) for p in inner):
            return inner
    return [term]


def _broadcasts(s, target) -> bool:
    return s is not None and len(s) <= len(target) and all(
        _same(d, 1) or _same(d, t) for d, t in zip(reversed(s), reversed(target))
    )


@dataclass
class _Masks:
    """The scale and masks of a chain: `raw` has one component per chain op; `split` the same
    with causal parts split off (`_Causal`)."""

    scale: float
    scale_nodes: list
    raw: list
    split: list


def _mask_components(ops: list, scores_shape, lq, lk) -> Union[_Masks, str]:
    """Read the chain ops bottom-up (from the product to the softmax)."""
    scale, scale_nodes, raw, split = 1.0, [], [], []
    memo: dict = {}
    for op in reversed(ops):
        kind = op[0]
        if kind in ("cast", "const"):
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
                for t in {id(t): t for t in raw + split if isinstance(t, _Term)}.values():
                    t.scale *= factor
            else:
                if raw:
                    return "a run-time scale is applied after the mask"
                scale_nodes.append((f, divide))
            continue
        if kind == "add":
            node, negate = op[1], op[2]
            if not _broadcasts(shape(node), scores_shape):
                return f"mask of shape {_fmt_shape(shape(node))} does not broadcast to the scores {_fmt_shape(scores_shape)}"
            if dtype(node) is None or dtype(node).is_complex:
                return f"mask of dtype {dtype(node)}"
            term = _Term(node, negate)
            raw.append(term)
            split.extend(_term_components(term, lq, lk, memo))
            continue
        if kind == "fill":
            mask, masked_when, value = op[1], op[2], op[3]
            if not _is_mask_value(value):
                return f"masked_fill/where with value {value:g}, not a mask value (<= {MASK_VALUE_MAX:g} or -inf)"
            if dtype(mask) != torch.bool:
                return "masked_fill/where mask is not a bool tensor"
            if not _broadcasts(shape(mask), scores_shape):
                return f"mask of shape {_fmt_shape(shape(mask))} does not broadcast to the scores {_fmt_shape(scores_shape)}"
            parts = _bool_components(mask, masked_when, value, lq, lk, memo)
            raw.append(_Fill(mask, masked_when, value, causal=len(parts) == 1 and isinstance(parts[0], _Causal)))
            split.extend(parts)
    return _Masks(scale, scale_nodes, raw, split)


def _causal_or_bias(m: _Masks) -> tuple[list, bool, str, list]:
    """(components, is_causal, how the causal mask was found, notes).

    A causal part becomes is_causal unless that changes eager's result: the op masks with -inf,
    so a causal mask filled with a finite value (finfo.min) may only go when it is the only mask.
    With another mask as well, a row whose visible keys that mask hides entirely gets, in eager,
    uniform weights over every key holding the same finfo.min; is_causal would give weights over
    the visible keys only. Then the causal mask stays in the bias (still fused, not is_causal)."""
    causal = [p for p in m.split if isinstance(p, _Causal)]
    rest = [p for p in m.split if not isinstance(p, _Causal)]
    if not causal:
        return m.raw, False, "", []
    if not rest or all(p.value == -math.inf for p in causal):
        return rest, True, causal[0].source, []
    note = (f"causal mask ({causal[0].source}) kept in the bias: its fill is finite and another mask "
            "applies, so the op's -inf causal masking would change rows masked everywhere")
    return m.raw, False, "", [note]


def match_attention(softmax: fx.Node) -> Union[AttentionSite, str]:
    """The attention around `softmax`, or why it is not one we can replace."""
    c = _call(softmax)
    x = c["input"]
    s = shape(x)
    if not isinstance(x, fx.Node) or s is None:
        return "softmax input has no shape metadata"
    dim = norm_dim(c["dim"], len(s)) if s else None
    if dim is None or dim != len(s) - 1:
        return f"softmax over dim {c['dim']}, not the last dim"
    # ---------------------------------------------------------------- output side: w → w·v
    w, between = softmax, []
    while True:
        users = list(w.users)
        if len(users) != 1:
            return "attention weights are used elsewhere (e.g. returned with output_attentions=True)"
        if _written(w):
            return f"attention weights {w.name} are changed in place"
        u = users[0]
        if _is_product(u):
            break
        cu = _call(u)
        if cu is not None and cu.name == "dropout":
            p, training = cu["p"], cu["training"]
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                return "dropout with a non-constant p or training flag"
            if p != 0 and training:
                return "dropout p>0 in training: kernel has no dropout yet"
        elif cu is None or not (_cast_dtype(cu) is not None or _is_transparent(cu)):
            return f"softmax output feeds {_describe(u)}, not a product with v"
        between.append(u)
        w = u
    pv = u
    r = _weights_times_v(w, pv)
    if isinstance(r, str):
        return r
    v, out_ops = r
    # ---------------------------------------------------------------- input side: scores → softmax
    r = _chain(x, softmax, between)
    if isinstance(r, str):
        return r
    scores, ops, chain_nodes = r
    r = _product(scores)
    if isinstance(r, str):
        return r
    q, k, qk_scale = r
    ss = shape(scores)
    rank = len(ss)
    if rank not in (2, 3, 4):
        return f"scores of rank {rank} (only 2-D, 3-D and 4-D attention)"
    for n in chain_nodes + [x]:
        if not _same_shape(shape(n), ss):
            return f"mask broadcasts the scores from {_fmt_shape(ss)} to {_fmt_shape(shape(n))}"
    # ---------------------------------------------------------------- shapes and dtypes
    try:
        qv, kv, vv = q.value(), k.value(), v.value()
    except Exception as e:  # noqa: BLE001
        return f"cannot read q/k/v shapes: {e}"
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv)):
        return "q/k/v have no tensor metadata"
    if not (qv.dim() == kv.dim() == vv.dim() == rank):
        return f"q, k, v ranks {qv.dim()}, {kv.dim()}, {vv.dim()} differ from the scores' {rank}"
    batch = tuple(qv.shape[:-2])
    lq, d = qv.shape[-2], qv.shape[-1]
    lk, dv = kv.shape[-2], vv.shape[-1]
    if not (_same_shape(kv.shape[:-2], batch) and _same_shape(vv.shape[:-2], batch)):
        return f"q, k, v batch dims differ: {_fmt_shape(qv.shape)}, {_fmt_shape(kv.shape)}, {_fmt_shape(vv.shape)}"
    if not (_same(kv.shape[-1], d) and _same(vv.shape[-2], lk)):
        return f"q, k, v shapes do not fit attention: {_fmt_shape(qv.shape)}, {_fmt_shape(kv.shape)}, {_fmt_shape(vv.shape)}"
    if not _same_shape(ss, batch + (lq, lk)):
        return f"scores {_fmt_shape(ss)} are not q·kᵀ of q {_fmt_shape(qv.shape)}, k {_fmt_shape(kv.shape)}"
    pv_shape = batch + (lq, dv)
    if out_ops:
        pv_shape = tuple(pv_shape[i] for i in out_ops[0][1:])
    if not _same_shape(shape(pv), pv_shape):
        return f"output {_fmt_shape(shape(pv))} is not weights·v {_fmt_shape(pv_shape)}"
    qd, kd, vd = qv.dtype, kv.dtype, vv.dtype
    if not (qd == kd == vd):
        q, k, v = (_strip_cast(t) for t in (q, k, v))
        qd, kd, vd = (t.value().dtype for t in (q, k, v))
        if not (qd == kd == vd):
            return f"q, k, v dtypes differ: {qd}, {kd}, {vd}"
    if qd not in _DTYPES:
        return f"dtype {qd} (the op takes fp16, bf16, fp32, fp64)"
    # ---------------------------------------------------------------- scale and masks
    r = _mask_components(ops, ss, lq, lk)
    if isinstance(r, str):
        return r
    comps, is_causal, causal_note, notes = _causal_or_bias(r)
    scale, scale_nodes = r.scale, r.scale_nodes
    # ---------------------------------------------------------------- GQA
    groups = 1
    if rank == 4:
        uk, uv = _unrepeat_kv(k), _unrepeat_kv(v)
        if uk is not None and uv is not None and uk[1] == uv[1] and _same(shape(uk[0])[1], shape(uv[0])[1]):
            k, v, groups = _Operand(uk[0]), _Operand(uv[0]), uk[1]
    matched = list(dict.fromkeys([scores] + list(reversed(chain_nodes)) + [softmax] + between + [pv]))
    for n in matched:
        if n is not pv and any(u not in matched for u in n.users):
            return f"{n.name} is also used outside the attention"
    inputs = [q.node, k.node, v.node] + [n for n, _ in scale_nodes]
    inputs += [p.node if isinstance(p, _Term) else p.mask for p in comps]
    for n in inputs:
        if _written(n):
            return f"{n.name} (an input of the attention) is changed in place"
    for name, val in (("D", d), ("Dv", dv)):
        if not _in_range(val, *HEAD_DIM_RANGE):
            return f"head dim {name}={val} outside the kernel's [{HEAD_DIM_RANGE[0]}, {HEAD_DIM_RANGE[1]}]"
    return AttentionSite(
        softmax=softmax, scores=scores, output=pv, q=q, k=k, v=v, rank=rank,
        scale=qk_scale * scale, scale_nodes=scale_nodes, components=comps,
        is_causal=is_causal, causal_note=causal_note, kv_groups=groups,
        out_ops=out_ops, matched=matched, notes=notes,
    )


def _strip_cast(x: _Operand) -> _Operand:
    """x without a float cast on it (q.float() @ k.float().mT: the op computes in float32 anyway)."""
    if x.ops:
        return x
    c = _call(x.node)
    if c is not None and _cast_dtype(c) is not None and isinstance(c["input"], fx.Node) and not _written(x.node):
        return _Operand(c["input"])
    return x


# =============================================================================== replace


class _Builder:
    """Inserts nodes before `anchor` with example values computed under the graph's fake mode."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node, meta_from: fx.Node, fake_mode):
        self.graph = gm.graph
        self.anchor = anchor
        self.meta_from = meta_from
        self.fake_mode = fake_mode
        self.created: list[fx.Node] = []

    def _eval(self, node: fx.Node):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
        # The mode the inputs' fake tensors belong to (a deep-copied graph has its own copy, which
        # is not the one of the tracing context that detect_fake_mode would find first).
        modes = {id(t.fake_mode): t.fake_mode for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch._subclasses.FakeTensor)}
        mode = next(iter(modes.values())) if len(modes) == 1 else self.fake_mode if not modes else None
        if mode is None:
            return None
        with mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)

    def add(self, op: str, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs or {})
        self.created.append(node)
        for key in ("stack_trace", "nn_module_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        val = self._eval(node)
        if val is not None:
            node.meta["example_value"] = val
        return node

    def method(self, name: str, *args) -> fx.Node:
        return self.add("call_method", name, args)

    def function(self, target, *args, **kwargs) -> fx.Node:
        return self.add("call_function", target, args, kwargs)

    def operand(self, x: _Operand) -> fx.Node:
        n = x.node
        for m, *a in x.ops:
            n = self.method(m, n, *a)
        return n

    def rollback(self) -> None:
        for n in reversed(self.created):
            if not n.users:
                self.graph.erase_node(n)
        self.created.clear()


def _fake_mode(gm: fx.GraphModule):
    vals = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [v for v in vals if isinstance(v, torch.Tensor)]
    return torch._guards.detect_fake_mode(vals) if vals else None


def _negated(b: _Builder, mask: fx.Node) -> fx.Node:
    """~mask, reusing x when mask is ~x."""
    c = _call(mask)
    if c is not None and c.name in ("logical_not", "invert") and dtype(c["input"]) == torch.bool and not _written(mask):
        return c["input"]
    return b.function(torch.logical_not, mask)


def _build_bias(b: _Builder, comps: list, memo: dict) -> tuple[Optional[fx.Node], str]:
    """One attn_bias for the remaining mask components: (node or None, description)."""
    if not comps:
        return None, ""
    key = tuple(
        ("t", p.node, p.negate, p.scale) if isinstance(p, _Term) else ("f", p.mask, p.masked_when, p.value)
        for p in comps
    )
    if key in memo and _precedes(memo[key][0], b.anchor):
        return memo[key]
    fills = [p for p in comps if isinstance(p, _Fill)]
    if len(fills) == len(comps) and all(p.value == -math.inf for p in fills):
        keep = None
        for p in fills:
            k = p.mask if not p.masked_when else _negated(b, p.mask)
            keep = k if keep is None else b.function(torch.logical_and, keep, k)
        result = (keep, "bool mask")
    elif len(comps) == 1 and isinstance(comps[0], _Term) and not comps[0].negate and comps[0].scale == 1.0 and dtype(comps[0].node).is_floating_point:
        result = (comps[0].node, "additive mask")
    else:
        bias = None
        for p in comps:
            if isinstance(p, _Term):
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


def _zero_filled_rows(b: _Builder, q: fx.Node, comps: list) -> fx.Node:
    """q with the rows zeroed whose every score a finite masked_fill/where replaces.

    Eager gives such a row uniform weights and no gradient into q·kᵀ (the fill replaces the
    scores). The op adds the fill as a bias instead: the same weights, but a gradient through
    q·kᵀ. A zero q row has the same forward (its scores are all the fill value) and no gradient."""
    fills = [p for p in comps if isinstance(p, _Fill)]
    if all(p.value == -math.inf or p.causal for p in fills):
        return q  # -inf everywhere: NaN, as eager; a causal fill leaves key 0 to every row
    replaced = None
    for p in fills:
        m = p.mask if p.masked_when else _negated(b, p.mask)
        replaced = m if replaced is None else b.function(torch.logical_or, replaced, m)
    full_rows = b.method("all", replaced, -1, True)
    return b.function(torch.where, full_rows, 0.0, q)


def _precedes(a: fx.Node, b: fx.Node) -> bool:
    """Is a (still in the graph) before b?"""
    if getattr(a, "_erased", False) or a.graph is not b.graph:
        return False
    n = a
    while n.op != "root":
        if n is b:
            return True
        n = n.next
    return False


def replace(gm: fx.GraphModule, site: AttentionSite, ctx: dict) -> str:
    """Emit the op for `site`, take over the uses of its output, erase the dead matched nodes.
    Returns the detail for the report."""
    b = _Builder(gm, site.output, site.softmax, ctx.get("fake_mode"))
    try:
        q = b.operand(site.q)
        for node, divide in site.scale_nodes:
            q = b.function(operator.truediv if divide else operator.mul, q, node)
        q = _zero_filled_rows(b, q, site.components)
        k, v = b.operand(site.k), b.operand(site.v)
        for _ in range(4 - site.rank):
            q, k, v = (b.method("unsqueeze", t, 0) for t in (q, k, v))
        bias, bias_kind = _build_bias(b, site.components, ctx.setdefault("bias_memo", {}))
        op = b.function(ATTENTION_OP, q, k, v, bias, 0.0, site.is_causal, float(site.scale))
        out = b.function(operator.getitem, op, 0)
        for _ in range(4 - site.rank):
            out = b.method("squeeze", out, 0)
        for m, *a in site.out_ops:
            out = b.method(m, out, *a)
        want = example_value(site.output)
        if b.fake_mode is not None:
            got = example_value(out)
            if got.dtype != want.dtype:
                out = b.method("to", out, want.dtype)
                got = example_value(out)
            if not _same_shape(tuple(got.shape), tuple(want.shape)):
                raise RuntimeError(f"replacement has shape {tuple(got.shape)}, eager {tuple(want.shape)}")
        elif dtype(q) is not None and want is not None and dtype(q) != want.dtype:
            out = b.method("to", out, want.dtype)
    except Exception:
        b.rollback()
        raise
    site.output.replace_all_uses_with(out)
    _erase_dead(gm.graph, list(reversed(site.matched)))
    parts = [f"scale={site.scale:.6g}"]
    if site.scale_nodes:
        parts.append("run-time scale applied to q")
    if site.is_causal:
        parts.append(f"is_causal ({site.causal_note})")
    if bias is not None:
        parts.append(f"bias: {bias_kind}")
    if site.kv_groups > 1:
        parts.append(f"GQA: k/v un-repeated ({site.kv_groups} q heads per kv head)")
    if site.rank < 4:
        parts.append(f"{site.rank}-D")
    parts += site.notes
    return ", ".join(parts)


def _erase_dead(graph: fx.Graph, roots: list) -> None:
    """Erase `roots` (the matched nodes: an in-place op among them writes only into the matched
    scores) and then their inputs that have no users left (pure ops only)."""
    ours = set(roots)
    work = list(roots)
    while work:
        n = work.pop(0)
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method", "get_attr"):
            continue
        if n not in ours and (n.is_impure() or _is_in_place(n)):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(inputs)


# =============================================================================== entry point


def _is_softmax(node: fx.Node) -> bool:
    c = _call(node)
    return c is not None and c.name == "softmax"


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    """Replace every attention in gm (in place); report each softmax as replaced or missed."""
    softmaxes = [n for n in gm.graph.nodes if _is_softmax(n)]
    if not softmaxes:
        return
    ctx: dict = {"fake_mode": _fake_mode(gm)}
    for sm in softmaxes:
        if getattr(sm, "_erased", False):
            continue
        try:
            site = match_attention(sm)
            if isinstance(site, str):
                report.missed(KIND, sm, site)
                continue
            detail = replace(gm, site, ctx)
            report.replaced(KIND, sm, detail)
        except Exception as e:  # noqa: BLE001  (never break compile: leave this site as it was)
            log.warning("fuse_plugin: attention at %s left unfused after an internal error", sm.name, exc_info=True)
            report.missed(KIND, sm, f"internal error, left unfused: {type(e).__name__}: {e}")
