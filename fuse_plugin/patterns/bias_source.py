"""Where an attention bias comes from: learned parameters, through ops that keep them finite.

A hand-written site rewritten into an SDPA call (attention._sdpa_call) must give eager's NaN in a
row whose every score is -inf, where SDPA gives 0; it tests every row of the bias for that and
writes NaN into the output there: one more pass over the output per call (BEiT-B's 12 sites:
3.5% of the model's inference step on an H100, issue 28). A bias computed from parameters alone
(a relative-position bias table gathered by an integer index buffer, viewed, permuted, summed:
BEiT, Swin's table, LeViT's attention biases in training) is -inf in a whole row only where the
parameters themselves are -inf (or overflow float16 / the sum): `from_parameters` says when a
bias is such, and the test is left out there.

What counts (`from_parameters`): the bias node and every node it is computed from are
  * placeholders holding an ``nn.Parameter`` (Dynamo's graph argument) or an integer tensor
    (an index buffer),
  * views, gathers and copies (`_KEEPING`), dtype casts to bfloat16 / float32 / float64, sums
    and differences of such terms and products with finite numbers;
anything else (an input mask, a buffer of floats, a constant, another op) keeps the test.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx

from .canon import example_value

# methods and functions that move, gather or copy values (never make -inf from finite ones)
_KEEPING = {"view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "expand", "contiguous", "clone",
            "flatten", "repeat", "index_select", "gather", "narrow", "__getitem__", "getitem", "float", "to",
            "type", "bfloat16", "add", "sub", "mul", "neg", "__add__", "__sub__", "__mul__", "__neg__"}
_FINITE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_MAX_NODES = 64


def _name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    return getattr(t, "__name__", str(t)).split(".")[-1]


def _parameter(node: fx.Node) -> bool:
    arg = node.meta.get("grapharg")
    return isinstance(getattr(arg, "example", None), torch.nn.Parameter)


def _scalars_finite(node: fx.Node) -> bool:
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, float) and not math.isfinite(a):
            return False
    return True


def from_parameters(node: fx.Node) -> bool:
    """Is ``node`` computed from parameters (and integer index tensors) by the ops of the module
    doc only?"""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _MAX_NODES:
            return False
        v = example_value(n)
        integer = isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.is_complex()
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype not in _FINITE_DTYPES:
            return False  # (float16: a finite parameter can overflow in a cast or a sum)
        if integer:  # (an index, however computed: never -inf itself)
            continue
        if n.op == "placeholder":
            if not _parameter(n):
                return False
            continue
        if n.op not in ("call_function", "call_method") or _name(n) not in _KEEPING:
            return False
        if n.target is operator.getitem and not isinstance(v, torch.Tensor):
            return False
        if not _scalars_finite(n):
            return False
        todo.extend(n.all_input_nodes)
    return True
