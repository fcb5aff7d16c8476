"""Canonical view of Dynamo FX nodes, so that patterns read like the math.

A Dynamo graph spells one operation many ways: `q @ k` is `operator.matmul`, `torch.matmul`
or the method `Tensor.matmul`; `x / s` is `operator.truediv` or `torch.div`; `F.softmax(x, -1)`
and `x.softmax(dim=-1)` differ in where the dim sits. `canon(node)` maps every spelling to one
`Call(name, args)` with the arguments bound by name (defaults filled in), e.g.

    canon(node) == Call("softmax", {"input": <node>, "dim": -1, "dtype": None})

Shapes and dtypes come from `node.meta["example_value"]` (fake tensors Dynamo recorded).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx

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
    "dropout": (("input", _NO_DEFAULT), ("p", 0.5), ("training", True), ("inplace", False)),
    "transpose": (("input", _NO_DEFAULT), ("dim0", _NO_DEFAULT), ("dim1", _NO_DEFAULT)),
    "permute": (("input", _NO_DEFAULT), ("*dims", ())),
    "view": (("input", _NO_DEFAULT), ("*shape", ())),
    "reshape": (("input", _NO_DEFAULT), ("*shape", ())),
    "expand": (("input", _NO_DEFAULT), ("*sizes", ())),
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


# --------------------------------------------------------------------------- metadata


def example_value(node: Any) -> Any:
    """The fake value Dynamo recorded for a node (a constant for a non-node)."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


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


def users_outside(nodes: set[fx.Node], keep: set[fx.Node]) -> list[fx.Node]:
    """Nodes of `nodes` (other than those in `keep`) whose value is used outside `nodes`."""
    return [n for n in nodes if n not in keep and any(u not in nodes for u in n.users)]


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
