"""Canonical view of Dynamo FX nodes, so that patterns read like the math.

A Dynamo graph spells one operation many ways: `q @ k` is `operator.matmul`, `torch.matmul`
or the method `Tensor.matmul`; `x / s` is `operator.truediv` or `torch.div`; `F.softmax(x, -1)`
and `x.softmax(dim=-1)` differ in where the dim sits. `canon(node)` maps every spelling to one
`Call(name, args)` with the arguments bound by name (defaults filled in), e.g.

    canon(node) == Call("softmax", {"input": <node>, "dim": -1, "dtype": None})

`call_of(node)` also names the spellings op listings leave alone (and/or, clone, swapaxes and
the in-place forms of the arithmetic a mask chain uses); `written(node)` says whether a user
changes a node in place.

Shapes and dtypes come from `node.meta["example_value"]` (fake tensors Dynamo recorded); sizes
may be SymInts, compared with `known_equal` / `same_shape`, which never add a guard. Casts:
`dtype_cast_target`, `float_cast_input`, `is_identity`. `same_value(a, b)`: two nodes provably
holding the same value (one pure op written twice).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

_NO_DEFAULT = object()
_VARARGS = "*"  # marks a parameter that takes the remaining positional args (view(*shape))

# Canonical name → parameters in order, (name, default). Methods bind `self` to the first one.
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "matmul": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "bmm": (("input", _NO_DEFAULT), ("mat2", _NO_DEFAULT)),
    "baddbmm": (("input", _NO_DEFAULT), ("batch1", _NO_DEFAULT), ("batch2", _NO_DEFAULT), ("beta", 1), ("alpha", 1)),
    "einsum": (("equation", _NO_DEFAULT), ("*operands", ())),
    "mul": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "div": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT), ("rounding_mode", None)),
    "add": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT), ("alpha", 1)),
    "sub": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT), ("alpha", 1)),
    "neg": (("input", _NO_DEFAULT),),
    "pow": (("input", _NO_DEFAULT), ("exponent", _NO_DEFAULT)),
    "eq": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "ne": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "lt": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "le": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "gt": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "ge": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "logical_not": (("input", _NO_DEFAULT),),
    "invert": (("input", _NO_DEFAULT),),
    "softmax": (("input", _NO_DEFAULT), ("dim", None), ("dtype", None)),
    # torch._safe_softmax / aten._safe_softmax: softmax, but 0 (not NaN) in rows whose every input is -inf
    "safe_softmax": (("input", _NO_DEFAULT), ("dim", _NO_DEFAULT), ("dtype", None)),
    "dropout": (("input", _NO_DEFAULT), ("p", 0.5), ("training", True), ("inplace", False)),
    "transpose": (("input", _NO_DEFAULT), ("dim0", _NO_DEFAULT), ("dim1", _NO_DEFAULT)),
    "permute": (("input", _NO_DEFAULT), ("*dims", ())),
    "view": (("input", _NO_DEFAULT), ("*shape", ())),
    "reshape": (("input", _NO_DEFAULT), ("*shape", ())),
    "expand": (("input", _NO_DEFAULT), ("*sizes", ())),
    "expand_as": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "contiguous": (("input", _NO_DEFAULT),),
    "to": (("input", _NO_DEFAULT), ("*args", ())),
    "type_as": (("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "float": (("input", _NO_DEFAULT),),
    "half": (("input", _NO_DEFAULT),),
    "bfloat16": (("input", _NO_DEFAULT),),
    "masked_fill": (("input", _NO_DEFAULT), ("mask", _NO_DEFAULT), ("value", _NO_DEFAULT)),
    "where": (("condition", _NO_DEFAULT), ("input", _NO_DEFAULT), ("other", _NO_DEFAULT)),
    "cat": (("tensors", _NO_DEFAULT), ("dim", 0)),
    "stack": (("tensors", _NO_DEFAULT), ("dim", 0)),
    "chunk": (("input", _NO_DEFAULT), ("chunks", _NO_DEFAULT), ("dim", 0)),
    "split": (("input", _NO_DEFAULT), ("split_size_or_sections", _NO_DEFAULT), ("dim", 0)),
    "unsqueeze": (("input", _NO_DEFAULT), ("dim", _NO_DEFAULT)),
    "flatten": (("input", _NO_DEFAULT), ("start_dim", 0), ("end_dim", -1)),
    "repeat_interleave": (("input", _NO_DEFAULT), ("repeats", _NO_DEFAULT), ("dim", None)),
    "getitem": (("input", _NO_DEFAULT), ("index", _NO_DEFAULT)),
    "getattr": (("input", _NO_DEFAULT), ("name", _NO_DEFAULT)),
    "view_as_complex": (("input", _NO_DEFAULT),),
    "view_as_real": (("input", _NO_DEFAULT),),
    "tril": (("input", _NO_DEFAULT), ("diagonal", 0)),
    "triu": (("input", _NO_DEFAULT), ("diagonal", 0)),
    "bool": (("input", _NO_DEFAULT),),
    "tanh": (("input", _NO_DEFAULT),),
    # F.scaled_dot_product_attention (patterns/sdpa.py)
    "sdpa": (("query", _NO_DEFAULT), ("key", _NO_DEFAULT), ("value", _NO_DEFAULT), ("attn_mask", None),
             ("dropout_p", 0.0), ("is_causal", False), ("scale", None), ("enable_gqa", False)),
}

# call_function targets whose canonical name is not simply their __name__.
_FUNCTION_NAMES: dict[Callable, str] = {
    operator.matmul: "matmul",
    operator.mul: "mul",
    operator.truediv: "div",
    operator.add: "add",
    operator.sub: "sub",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.getitem: "getitem",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.invert: "invert",
    getattr: "getattr",
    torch.true_divide: "div",
    torch.multiply: "mul",
    torch.subtract: "sub",
    torch.negative: "neg",
    torch._safe_softmax: "safe_softmax",
    torch.ops.aten._safe_softmax.default: "safe_softmax",
    torch.ops.aten._safe_softmax: "safe_softmax",
    torch._C._nn.scaled_dot_product_attention: "sdpa",
    F.scaled_dot_product_attention: "sdpa",
}
# Method spellings that are another name for a canonical op.
_METHOD_ALIASES = {"__matmul__": "matmul", "__mul__": "mul", "__truediv__": "div", "__add__": "add",
                   "__sub__": "sub", "__neg__": "neg", "__getitem__": "getitem", "true_divide": "div",
                   "multiply": "mul", "subtract": "sub", "negative": "neg", "masked_fill_": None,
                   "bitwise_not": "invert", "__invert__": "invert",
                   # torch 2.11's Dynamo records `mask == 0` as the dunder itself
                   "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
                   "__ge__": "ge", "__pow__": "pow"}
# Extra positional parameters of particular functions (F.softmax's `_stacklevel` sits before dtype).
_FUNCTION_SIGNATURE_OVERRIDES: dict[Callable, tuple[tuple[str, Any], ...]] = {
    F.softmax: (("input", _NO_DEFAULT), ("dim", None), ("_stacklevel", 3), ("dtype", None)),
}
_TORCH_MODULES = (torch, torch.nn.functional, torch.Tensor, torch.functional)
_TENSOR_DUNDERS: dict[Callable, str] = {
    getattr(torch.Tensor, d): a for d, a in _METHOD_ALIASES.items() if a and d.startswith("__") and hasattr(torch.Tensor, d)
}


@dataclass(frozen=True)
class Call:
    """One operation in canonical form: `name` and its arguments bound by parameter name."""

    name: str
    args: dict[str, Any]
    node: fx.Node

    def __getitem__(self, key: str) -> Any:
        return self.args[key]


def _name_of(node: fx.Node) -> str | None:
    if node.op == "call_method":
        name = _METHOD_ALIASES.get(node.target, node.target)
        return name if name in SIGNATURES else None
    if node.op != "call_function":
        return None
    target = node.target
    if target in _FUNCTION_NAMES:
        return _FUNCTION_NAMES[target]
    if target in _TENSOR_DUNDERS:  # torch.Tensor.__eq__ and friends, called as functions
        return _TENSOR_DUNDERS[target]
    name = getattr(target, "__name__", None)
    if name in SIGNATURES and any(getattr(m, name, None) is target for m in _TORCH_MODULES):
        return name
    return None


def _bind(name: str, params: tuple[tuple[str, Any], ...], args: tuple, kwargs: dict) -> dict[str, Any] | None:
    bound: dict[str, Any] = {}
    args = list(args)
    for pname, default in params:
        if pname.startswith(_VARARGS):
            rest = tuple(args)
            args = []
            # view(2, 3) and view((2, 3)) are the same call
            if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
                rest = tuple(rest[0])
            key = pname[1:]
            bound[key] = rest if rest else tuple(kwargs.pop(key, kwargs.pop("size", default)) or ())
            continue
        if args:
            bound[pname] = args.pop(0)
        elif pname in kwargs:
            bound[pname] = kwargs.pop(pname)
        elif name == "softmax" and pname == "input" and "self" in kwargs:
            bound[pname] = kwargs.pop("self")
        elif default is _NO_DEFAULT:
            return None
        else:
            bound[pname] = default
    if name == "to":  # to(dtype) / to(other) / to(device, dtype) / to(dtype=...)
        bound["args"] = tuple(bound["args"]) + tuple(kwargs.values())
        kwargs = {}
    kwargs.pop("_stacklevel", None)
    if args or kwargs:
        return None  # an argument we don't model: treat the node as unknown
    return bound


def canon(node: Any) -> Call | None:
    """The canonical Call of an FX node, or None if it is not an operation we model."""
    if not isinstance(node, fx.Node):
        return None
    name = _name_of(node)
    if name is None:
        return None
    params = _FUNCTION_SIGNATURE_OVERRIDES.get(node.target, SIGNATURES[name]) if node.op == "call_function" else SIGNATURES[name]
    bound = _bind(name, params, node.args, dict(node.kwargs))
    return None if bound is None else Call(name, bound, node)


def is_call(node: Any, *names: str) -> Call | None:
    """canon(node) if its name is one of `names`, else None."""
    c = canon(node)
    return c if c is not None and c.name in names else None


# --------------------------------------------------------------------------- spellings beyond canon
# (kept out of `canon`, so that op listings name every node as the graph spells it)

# In-place operators and methods, with the out-of-place op `call_of` names them after (None: not modelled).
_IN_PLACE_OPERATORS = {
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    operator.iand: None, operator.ior: None, operator.ixor: None, operator.ifloordiv: None,
    operator.imod: None, operator.ipow: None, operator.imatmul: None, operator.ilshift: None,
    operator.irshift: None,
}
_IN_PLACE_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "masked_fill_": "masked_fill"}
_AND_FUNCTIONS = {operator.and_, torch.logical_and, torch.bitwise_and}
_OR_FUNCTIONS = {operator.or_, torch.logical_or, torch.bitwise_or}
_AND_METHODS = {"__and__", "logical_and", "bitwise_and"}
_OR_METHODS = {"__or__", "logical_or", "bitwise_or"}
_TRANSPOSE_ALIASES = {"swapaxes", "swapdims"}


def call_of(node: Any) -> Optional[Call]:
    """canon(node), plus and/or, clone, swapaxes, `x.type(dtype)` (as `to`) and the in-place forms
    of add/sub/mul/div/masked_fill (named like their out-of-place op; `is_in_place_form(node)`
    tells them apart)."""
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


def is_in_place_form(node: fx.Node) -> bool:
    """`x += y`, `x.add_(y)`, `x.masked_fill_(m, v)`...: an in-place spelling `call_of` names after its
    out-of-place op."""
    return (node.op == "call_method" and node.target in _IN_PLACE_METHODS) or (
        node.op == "call_function" and node.target in _IN_PLACE_OPERATORS
    )


# --------------------------------------------------------------------------- in-place writes


def mutates(user: fx.Node, node: fx.Node) -> bool:
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


def written(node: Any, allowed: Optional[fx.Node] = None) -> bool:
    """Is `node`'s value changed in place by one of its users (other than `allowed`)?"""
    return isinstance(node, fx.Node) and any(u is not allowed and mutates(u, node) for u in node.users)


def writes_an_input(node: fx.Node) -> bool:
    """Does `node` change one of its inputs in place?"""
    return any(isinstance(a, fx.Node) and mutates(node, a) for a in node.all_input_nodes)


# --------------------------------------------------------------------------- metadata


def example_value(node: Any) -> Any:
    """The fake value Dynamo recorded for a node (a constant for a non-node)."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def device_of(node: fx.Node) -> torch.device:
    """The device of node's example value (the CPU when it has no tensor value)."""
    value = example_value(node)
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


def tensor_meta(node: Any) -> torch.Tensor | None:
    v = example_value(node)
    return v if isinstance(v, torch.Tensor) else None


def shape(node: Any) -> tuple | None:
    t = tensor_meta(node)
    return None if t is None else tuple(t.shape)


def rank(node: Any) -> int | None:
    t = tensor_meta(node)
    return None if t is None else t.dim()


def dtype(node: Any) -> torch.dtype | None:
    t = tensor_meta(node)
    return None if t is None else t.dtype


def norm_dim(dim: Any, ndim: int) -> int | None:
    """A dim as a non-negative int, or None if it is not a valid plain int."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        return None
    return dim % ndim


def sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def shape_only_use(user: fx.Node, node: fx.Node) -> Optional[str]:
    """How `user` reads nothing of `node` but its shape, if it does: 'expand_as' for
    `y.expand_as(node)` (y ≠ node). None for any other use. (Sizes are constants in a Dynamo
    graph, or symbols lifted to graph inputs under dynamic shapes: no use of the tensor.)"""
    c = canon(user)
    if c is not None and c.name == "expand_as" and c["other"] is node and c["input"] is not node:
        return "expand_as"
    return None


# --------------------------------------------------------------------------- sizes (ints or SymInts)


def known_true(cond: Any) -> bool:
    """True when a (possibly symbolic) condition holds for every size; never adds a guard."""
    if isinstance(cond, bool):
        return cond
    try:
        return bool(statically_known_true(cond))
    except Exception:  # noqa: BLE001  (an expression sympy cannot decide)
        return False


def known_equal(a: Any, b: Any) -> bool:
    """a == b for ints or SymInts, True only when provable for every size (adds no guard)."""
    try:
        return known_true(a == b)
    except Exception:  # noqa: BLE001
        return False


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def broadcasts_to(s: tuple | None, target: tuple) -> bool:
    """A tensor of shape s broadcasts to `target` without growing it."""
    return s is not None and len(s) <= len(target) and all(
        known_equal(d, 1) or known_equal(d, t) for d, t in zip(reversed(s), reversed(target))
    )


def even_size(d: Any) -> bool:
    """d % 2 == 0. A symbolic size is checked on its hint and guarded (the compiled graph then
    holds for even sizes only, and Dynamo recompiles for an odd one)."""
    if isinstance(d, int):
        return d % 2 == 0
    from torch.fx.experimental import symbolic_shapes

    try:
        if statically_known_true(d % 2 == 0):
            return True
        guard = getattr(symbolic_shapes, "guard_or_false", bool)  # bool(SymBool) guards on the hint as well
        return bool(guard(d % 2 == 0))
    except Exception:  # noqa: BLE001  (unbacked: undecidable)
        return False


def size_in_range(v: Any, lo: int, hi: int) -> bool:
    """lo <= v <= hi; for a symbolic size this guards on the range (a recompile if it leaves it),
    as a kernel needs it for every size the compiled graph sees."""
    if isinstance(v, int):
        return lo <= v <= hi
    try:
        return bool(v >= lo) and bool(v <= hi)
    except Exception:  # noqa: BLE001  (data-dependent size)
        return False


def fmt_shape(s) -> str:
    return "(" + ", ".join(str(x) for x in s) + ")" if s is not None else "?"


# --------------------------------------------------------------------------- casts


def dtype_cast_target(call: Call) -> torch.dtype | None | str:
    """For a pure dtype cast (`.float()`, `.to(torch.bfloat16)`, `.type_as(t)`, `.to(t)`), the
    dtype it casts to (read from the node's value); 'not-a-cast' for any other call, e.g. a
    `.to(device)` or `.to(dtype, copy=True)`."""
    if call.name in ("float", "half", "bfloat16", "type_as"):
        return dtype(call.node)
    if call.name == "to":
        args = call["args"]
        if all(isinstance(a, (torch.dtype, fx.Node)) for a in args) and len(args) == 1:
            if isinstance(args[0], fx.Node) and tensor_meta(args[0]) is None:
                return "not-a-cast"
            src, dst = tensor_meta(call["input"]), tensor_meta(call.node)
            if src is not None and dst is not None and src.device != dst.device:
                return "not-a-cast"
            return dtype(call.node)
    return "not-a-cast"


def float_cast_dtype(call: Call) -> Optional[torch.dtype]:
    """The floating dtype a pure cast casts to, else None."""
    if call.name not in ("float", "half", "bfloat16", "type_as", "to"):
        return None
    t = dtype_cast_target(call)
    return t if isinstance(t, torch.dtype) and t.is_floating_point else None


def float_cast_input(node: Any) -> Optional[fx.Node]:
    """x when node = x cast to a floating dtype (`x.float()`, `x.to(torch.bfloat16)`, `x.type_as(t)`)
    and nothing writes into node in place; else None."""
    c = call_of(node)
    if c is None or float_cast_dtype(c) is None or not isinstance(c["input"], fx.Node) or written(node):
        return None
    return c["input"]


def is_identity(call: Call) -> bool:
    """An op that leaves values (and dtype, device) as they are: contiguous, clone, a `.to` that
    changes nothing."""
    if call.name in ("contiguous", "clone"):
        return True
    if call.name == "to":  # .to(device) to the device it is on, .to(own dtype)
        src, dst = example_value(call["input"]), example_value(call.node)
        return (
            isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
            and src.dtype == dst.dtype and src.device == dst.device
        )
    return False


# --------------------------------------------------------------------------- one value spelled twice

# ops whose result depends only on their arguments: two such nodes with equal arguments are equal
_PURE = {"getitem", "unsqueeze", "view", "reshape", "flatten", "to", "float", "half", "bfloat16", "type_as",
         "view_as_real", "view_as_complex", "contiguous", "transpose", "permute", "expand",
         "repeat_interleave", "cat", "stack", "chunk", "split", "neg", "mul", "add", "sub", "div"}
_VALUE_KEYS: dict = {}  # value_key memo, emptied by forget_value_keys() at the start and end of a rewrite


def value_key(a: Any, depth: int = 0) -> Any:
    """A hashable key, equal for two nodes that provably hold the same value (the same node, or the
    same pure op of equal arguments: `c[..., 0]` written twice)."""
    if isinstance(a, fx.Node):
        if (a, depth) in _VALUE_KEYS:
            return _VALUE_KEYS[(a, depth)]
        c = canon(a)
        if c is None or c.name not in _PURE or depth > 12:
            key = ("node", a)
        else:
            key = (c.name,) + tuple((k, value_key(v, depth + 1)) for k, v in c.args.items())
        _VALUE_KEYS[(a, depth)] = key
        return key
    if isinstance(a, slice):
        return ("slice", value_key(a.start, depth), value_key(a.stop, depth), value_key(a.step, depth))
    if isinstance(a, (tuple, list, torch.Size)):
        return (type(a).__name__,) + tuple(value_key(v, depth) for v in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, value_key(v, depth)) for k, v in a.items())
    try:
        hash(a)
        return (type(a).__name__, a)  # 2 and 2.0 (and True) are different arguments
    except TypeError:
        return ("id", id(a))


def same_value(a: Any, b: Any) -> bool:
    return a is b or value_key(a) == value_key(b)


def forget_value_keys() -> None:
    """Empty value_key's memo (the graph is about to change)."""
    _VALUE_KEYS.clear()
