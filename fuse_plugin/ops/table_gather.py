"""`fuse_plugin::table_gather`: a learned table read through an integer index, with a fast gradient.

    out = torch.ops.fuse_plugin.table_gather(table, index, dim)

is ``table.index_select(dim, index.flatten()).unflatten(dim, index.shape)``: the spelling
``table[:, idx]`` (dim 1: LeViT's attention biases, table (H, N), idx (Lq, Lk) → (H, Lq, Lk)) or
``table[idx.view(-1)]`` (dim 0: Swin's / BEiT's relative-position tables, (M, H) → (L·L, H)).
  table: float (any dims); index: int64 or int32, any shape, values in [-n, n) with n =
  table.shape[dim] (negative ones count from the end, as indexing does);
  dim: 0 <= dim < table.dim(). The output has table's dtype and a fresh contiguous layout.

Why an op: the gradient of such a gather adds each output's gradient into its table entry, and a
relative-position table is read many times per entry (LeViT-128S stage 1: 38416 reads of 196
entries per head, up to 676 per entry). Autograd's index_put with accumulate, as Inductor compiles
it for a bf16 table, adds in bf16 with contended atomics: 742 us of GPU for one LeViT stage-1
bias and 1.8 ms at 12 heads (H100, bf16, 2026-11-26, `benchmarks/table_gather.py`, benchmarks/
RESULTS.md "Stop 29"), with 3e-2 relative error against float64. ``table_gather_backward`` adds
in float32 (an accumulating ``index_put_``, as Inductor compiles ``index_add``; float64 for a
float64 table) and rounds once: 9.8 us there, 2e-3 error (bf16's rounding of the result). The
rewrite (patterns/bias_table.py) puts this op in place of the gather that builds an attention
site's bias when the table is trained.

Compiled by Inductor, both ops decompose into their torch ops (ops/inductor.py): the forward's
gather is fused by Inductor where the bias is read; the backward is one float32 scatter.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import inductor


def check(table: Tensor, index: Tensor, dim: int) -> None:
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fuse_plugin.table_gather: index must be int64 or int32, got {index.dtype}")
    if not 0 <= dim < table.dim():
        raise ValueError(f"fuse_plugin.table_gather: dim {dim} is out of range for a table of {table.dim()} dims")
    if not table.is_floating_point():
        raise ValueError(f"fuse_plugin.table_gather: the table must be a float tensor, got {table.dtype}")
    if index.device != table.device:
        raise ValueError(f"fuse_plugin.table_gather: index on {index.device}, table on {table.device}")


def _out_shape(table_shape, index_shape, dim: int) -> list:
    return [*table_shape[:dim], *index_shape, *table_shape[dim + 1:]]


def _flat_index(index: Tensor, n: int) -> Tensor:
    """index flattened, its negative values counted from the end (``table[:, -1]``'s meaning)."""
    flat = index.reshape(-1)
    return torch.where(flat < 0, flat + n, flat)


def _table_gather(table: Tensor, index: Tensor, dim: int) -> Tensor:
    check(table, index, dim)
    flat = _flat_index(index, table.shape[dim])
    return table.index_select(dim, flat).view(_out_shape(table.shape, index.shape, dim))


table_gather = torch.library.custom_op("fuse_plugin::table_gather", _table_gather, mutates_args=())


@table_gather.register_fake
def _(table, index, dim):
    check(table, index, dim)
    return table.new_empty(_out_shape(table.shape, index.shape, dim))


def _table_gather_backward(grad: Tensor, index: Tensor, dim: int, table_shape: list[int],
                           table_dtype: torch.dtype) -> Tensor:
    """d table: each entry the sum of the gradients of the outputs that read it, added in float32
    (float64 for a float64 table) and rounded once."""
    flat = grad.reshape([*table_shape[:dim], index.numel(), *table_shape[dim + 1:]])
    acc = torch.promote_types(table_dtype, torch.float32)
    out = grad.new_zeros(table_shape, dtype=acc)
    # index_put_ counts negative indices from the end itself (index_add_ does not), so the backward
    # needs no normalised index: with one, AOTAutograd's partitioner saved the forward's (which
    # Inductor then wrote to memory, one kernel per site a step: Swin-T's 12, stop 48) instead of
    # the index as given, and the forward's normalisation stays fused into its gather.
    indices = [None] * dim + [index.reshape(-1)]  # (None: the dims before dim, all of them)
    return torch.ops.aten.index_put_(out, indices, flat.to(acc), True).to(table_dtype)


table_gather_backward = torch.library.custom_op("fuse_plugin::table_gather_backward", _table_gather_backward,
                                                mutates_args=())


@table_gather_backward.register_fake
def _(grad, index, dim, table_shape, table_dtype):
    return grad.new_empty(table_shape, dtype=table_dtype)


def _setup_context(ctx, inputs, output):
    table, index, dim = inputs
    ctx.save_for_backward(index)
    ctx.dim, ctx.table_shape, ctx.table_dtype = dim, list(table.shape), table.dtype


def _backward(ctx, grad):
    (index,) = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None
    return torch.ops.fuse_plugin.table_gather_backward(grad, index, ctx.dim, ctx.table_shape, ctx.table_dtype), \
        None, None


table_gather.register_autograd(_backward, setup_context=_setup_context)
inductor.register("fuse_plugin::table_gather", _table_gather)
inductor.register("fuse_plugin::table_gather_backward", _table_gather_backward)
