"""Kernel arguments by name, for the launches (launch.py).

Every launch passes its kernel's arguments by keyword, in the groups the kernel declares them:
tensors, then each tensor's strides, then sizes and scalars, then constexprs. A name the kernel
does not have, or one given twice, fails the launch (``launch.bind`` traced; Triton's launcher
or interpreter eagerly, by the parameter left without a value) instead of quietly running with
one stride in another's place.

The attention kernels name a tensor's strides ``stride_<prefix><dim>``, one letter per dim:
``b`` batch, ``h`` head, ``m`` query row, ``n`` key row, ``d`` head-dim channel. ``strides``
spells them from the tensor (or its strides) and the dims' letters below.

Host time: an eager launch by name costs more than one by position (the keywords are merged
into dicts on the way and matched to the parameters one by one: the backward has 109). The names
are interned (``_names``) and the stride dicts remembered per layout (``remembered``), which
cuts what the naming adds by about a third. Traced launches (a compiled graph) pay it once,
when the graph compiles.
"""
from __future__ import annotations

import functools
import sys

import torch

QUERY_ROWS = "bhmd"  # q, out, dout, dq; a rope table as seen at the query rows
KEY_ROWS = "bhnd"  # k, v, dk, dv; a rope table as seen at the key rows
SCORES = "bhmn"  # a bias, the replace mask, dS (dbias)
ROW_STATS = "bhm"  # lse


_NAMES: dict = {}


def _names(form: str, prefix: str, dims) -> tuple:
    """The argument names, made once and interned: Triton's launcher binds a keyword argument
    by identity with its parameter's name first (a fresh string of the same text costs a
    string comparison with every parameter: ~80 us for the backward's 109 on a CPU here)."""
    key = (form, prefix, dims)
    try:
        return _NAMES[key]
    except KeyError:
        names = _NAMES[key] = tuple(sys.intern(form.format(prefix=prefix, dim=d)) for d in dims)
        return names


def _named(form: str, prefix: str, dims, values) -> dict:
    return dict(zip(_names(form, prefix, dims), values, strict=True))


def remembered(fn):
    """``fn`` memoised on its arguments (strides, names: the same few layouts come back call
    after call), and called as it is where they are not hashable (symbolic strides, traced with
    dynamic shapes). Its results are shared: unpack them (``**``), never change them."""
    cached = functools.lru_cache(maxsize=1024)(fn)

    @functools.wraps(fn)
    def call(*args):
        try:
            return cached(*args)
        except TypeError:  # an unhashable argument (a SymInt)
            return fn(*args)

    return call


@remembered
def _stride_args(prefix: str, values: tuple, dims: str) -> dict:
    return _named("stride_{prefix}{dim}", prefix, dims, values)


def strides(prefix: str, x, dims: str = QUERY_ROWS) -> dict:
    """``{"stride_<prefix><dim>": stride}`` for each letter of ``dims``, the strides of ``x`` (a
    tensor, or its strides), one per dim: ``strides("k", k, KEY_ROWS)`` gives stride_kb,
    stride_kh, stride_kn and stride_kd. Shared (``remembered``): unpack it, never change it."""
    return _stride_args(prefix, x.stride() if isinstance(x, torch.Tensor) else tuple(x), dims)


def indexed(prefix: str, values) -> dict:
    """``{"<prefix>0": values[0], "<prefix>1": values[1], ...}``: arguments numbered by dim
    (the rotary kernel's strides, ``q_sx0`` ...)."""
    values = tuple(values)
    return _named("{prefix}{dim}", prefix, range(len(values)), values)


def prefixed(prefix: str, **values) -> dict:
    """``{"<prefix><key>": value}`` for each keyword: ``prefixed("q", _ptr=x)`` gives
    ``{"q_ptr": x}`` (the rotary kernel's per-side arguments)."""
    return _named("{prefix}{dim}", prefix, tuple(values), tuple(values.values()))
