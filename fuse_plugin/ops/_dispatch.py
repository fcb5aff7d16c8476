"""Which implementation an op runs on a given device.

CUDA tensors go to the Triton kernels. CPU tensors go to the plain-torch reference,
unless `FUSE_PLUGIN_CPU_KERNELS=triton` (settings.py): then the Triton kernels run in Triton's
interpreter (how CI tests the kernels without a GPU). The interpreter must be switched
on with `TRITON_INTERPRET=1` before triton is first imported.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .. import settings

_ENV = settings.CPU_KERNELS


def cpu_runs_triton() -> bool:
    if settings.cpu_kernels() == "reference":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":  # Triton's own switch, not ours
        raise RuntimeError(
            f"{_ENV}=triton runs the Triton kernels on the CPU in Triton's interpreter, "
            "which needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return True


def runs_triton(*tensors: torch.Tensor) -> bool:
    """True when an op on these tensors (same device) should launch its Triton kernel."""
    if any(t.dtype == torch.float64 for t in tensors):  # float64 stays on the exact reference
        return False
    device = tensors[0].device.type
    if device == "cuda":
        return True
    return device == "cpu" and cpu_runs_triton()


@contextlib.contextmanager
def cpu_kernels(choice: str):
    """Temporarily pick the CPU implementation: 'triton' (interpreter) or 'reference'."""
    old = os.environ.get(_ENV)
    os.environ[_ENV] = choice
    try:
        cpu_runs_triton()  # validate early, with a clear message
        yield
    finally:
        if old is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = old


def register_with_backward(lib, name: str, forward, forward_autograd, backward) -> None:
    """Register op ``name`` and its ``name_backward`` on ``lib``: each one's implementation for
    every backend (CompositeExplicitAutograd), the forward's autograd (``forward_autograd``), and
    for the backward op an autograd kernel that refuses to be differentiated (no double backward
    through attention) and otherwise dispatches below autograd."""
    backward_name = f"{name}_backward"

    def backward_autograd(*args, **kwargs):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values())):
            raise RuntimeError(f"fuse_plugin::{backward_name} is not differentiable (no double "
                               "backward through attention)")
        with torch._C._AutoDispatchBelowAutograd():
            return getattr(torch.ops.fuse_plugin, backward_name).default(*args, **kwargs)

    lib.impl(name, forward, "CompositeExplicitAutograd")
    lib.impl(name, forward_autograd, "Autograd")
    lib.impl(backward_name, backward, "CompositeExplicitAutograd")
    lib.impl(backward_name, backward_autograd, "Autograd")
