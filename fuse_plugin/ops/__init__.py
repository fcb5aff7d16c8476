"""The custom ops (namespace `fuse_plugin`), registered on import.

    torch.ops.fuse_plugin.attention / attention_backward   (ops/attention.py)
    torch.ops.fuse_plugin.rotary / rotary_backward          (ops/rotary.py)
    torch.ops.fuse_plugin.rotary_qk / rotary_qk_backward
"""
from . import attention, rotary  # noqa: F401  (registration)
from ._dispatch import cpu_kernels

__all__ = ["attention", "rotary", "cpu_kernels"]
