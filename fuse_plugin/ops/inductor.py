"""Inductor launches our kernels itself: each op decomposes into its Triton launches when compiled.

A plain custom op is opaque to Inductor: the compiled graph calls it through the dispatcher and
our Python launcher at every step (0.1-0.8 ms of host time per call on the H100 host, against
~25 us for SDPA). ``register(qualname, impl)`` gives an op a rule for FunctionalTensorMode, the
mode in which AOTAutograd traces the graph it hands to Inductor (the same hook
``torch.library.triton_op`` uses): where the rule applies, the op's own implementation runs
there with the launch interface in traced mode (kernels/launch.py), so the graph holds the
kernels' launches (``triton_kernel_wrapper_*`` nodes) plus the few torch ops of the launcher
(allocations, a GQA partial sum). The table lookup, the kernel family, tiles and grids are
decided once, when the graph compiles; at run time Inductor's generated code launches the
compiled kernels itself, as it launches its own. CUDA graphs (``mode="reduce-overhead"``),
``max-autotune`` and AOTInductor (which compiles the kernels into its package) take these
launches like any user-defined Triton kernel.

Where it does not apply the op stays one opaque node, exactly as before:
* not on CUDA (the CPU reference, or the kernels in Triton's interpreter: CI's path);
* data-dependent sizes (unbacked SymInts: no value to choose the kernels by). Dynamic shapes
  (SymInts with a hint) decompose: the launchers choose tiles by the hints, as for the shape the
  graph was traced with, and guard where correctness depends on a size and at the few family
  boundaries (``launch.hint``); the TMA and Gluon kernels, which long sequences take, keep
  static shapes, so there the op stays opaque, its host time small against its device time;
* ``torch.export`` (which keeps custom ops whole; AOTInductor decomposes them when it compiles
  the exported program);
* tensor subclasses other than fake / functional tensors;
* ``FUSE_PLUGIN_INDUCTOR_LAUNCH=0`` (the opaque op everywhere: for comparisons and debugging).
The eager behaviour of every op is unchanged: calls outside a compile never see this rule.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils._pytree import tree_leaves

from .. import settings

ENV = settings.INDUCTOR_LAUNCH
log = logging.getLogger(__name__)


def enabled() -> bool:
    """Decompose the ops for Inductor? (``FUSE_PLUGIN_INDUCTOR_LAUNCH``, default on; settings.py.)"""
    return settings.inductor_launch()


def _hinted(t: torch.Tensor) -> bool:
    """Is every size, stride and offset of t an int or a SymInt with a hint (dynamic shapes,
    not data-dependent)?"""
    return all(type(s) is int or (isinstance(s, torch.SymInt) and s.node.has_hint())
               for s in (*t.shape, *t.stride(), t.storage_offset()))


def why_not_decomposed(types, args, kwargs) -> Optional[str]:
    """None when the op may decompose into its launches here, else why it stays opaque."""
    if not enabled():
        return f"{ENV}=0"
    if not getattr(torch._functorch.config, "decompose_custom_triton_ops", True):
        return "torch.export keeps custom ops whole"
    from torch._subclasses.fake_tensor import FakeTensor

    if any(not issubclass(t, (FakeTensor, FunctionalTensor)) and t is not torch.Tensor
           for t in types):
        return "a tensor subclass"
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return "not on CUDA"
    if not all(_hinted(t) for t in tensors):
        return "data-dependent sizes or strides"
    return None


def register(qualname: str, impl: Callable) -> None:
    """Let ``qualname`` decompose into the launches of ``impl`` (its CUDA implementation, called
    with the op's arguments) when compiled; see the module docstring."""
    from ..kernels import launch

    def rule(mode, op, types, args, kwargs):
        why = why_not_decomposed(types, args, kwargs)
        if why is None:
            try:
                with mode, launch.tracing():
                    return impl(*args, **kwargs)
            except launch.Untraceable as e:
                # Launches traced before this one are dead nodes now (nothing reads their
                # outputs; our kernels never write the op's inputs): the graph drops them.
                why = str(e)
                warnings.warn(f"fuse_plugin: {op} stays an opaque op in this graph: {why}",
                              RuntimeWarning, stacklevel=2)
        log.debug("%s stays opaque: %s", op, why)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, rule)

