"""The custom ops (namespace `fuse_plugin`), registered on import.

    torch.ops.fuse_plugin.attention / attention_backward   (ops/attention.py)
    torch.ops.fuse_plugin.attention_sinks / _backward       (ops/attention_sinks.py)
    torch.ops.fuse_plugin.rotary / rotary_backward          (ops/rotary.py)
    torch.ops.fuse_plugin.rotary_qk / rotary_qk_backward
    torch.ops.fuse_plugin.rope_attention / rope_attention_backward   (ops/rope_attention.py)
    torch.ops.fuse_plugin.gluon_attention_forward / _backward      (ops/gluon.py; internal)
    torch.ops.fuse_plugin.table_gather / _backward          (ops/table_gather.py: a learned bias table)

Each has a DTensor sharding rule (ops/sharding.py), so the ops also run on DTensors; table_gather's
takes Replicate() inputs only (the rewrite leaves a DTensor table's gather as it is).

Compiled by Inductor, the ops decompose into their kernels' launches (ops/inductor.py).
"""
from . import attention, attention_sinks, gluon, rope_attention, rotary, table_gather  # noqa: F401  (registration)
from ._dispatch import cpu_kernels
from .sharding import register as _register_sharding

_register_sharding()  # DTensor rules for every op above (a no-op without torch.distributed)

__all__ = ["attention", "rotary", "rope_attention", "cpu_kernels"]
