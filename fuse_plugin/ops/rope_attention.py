"""`fuse_plugin::rope_attention`: the rotary embedding of q and k folded into attention.

    out, lse = torch.ops.fuse_plugin.rope_attention(
        q, k, v, cos, sin, interleaved, rotary_dim, attn_bias, dropout_p, is_causal, scale)

is by definition

    q_rot, k_rot = torch.ops.fuse_plugin.rotary_qk(q, k, cos, sin, interleaved, rotary_dim)
    out, lse = torch.ops.fuse_plugin.attention(q_rot, k_rot, v, attn_bias, dropout_p, is_causal, scale)

with the contracts of those two ops (ops/rotary.py, ops/attention.py): q (B, Hq, Lq, D), k (B, Hkv,
Lk, D), v (B, Hkv, Lk, Dv) of one dtype; cos/sin broadcastable to q's and to k's leading dims +
(W,), W = rotary_dim (full width) or rotary_dim // 2 (half width). The rotated q/k must keep q's
dtype (promote(q, cos, sin) == q.dtype, which the recogniser checks before it fuses); anything
else is refused. Gradients flow to q, k, v (w.r.t. the UN-rotated q and k), an additive bias and,
for learned frequencies, cos/sin.

Where the attention op runs its Triton kernels (CUDA, or the CPU under the interpreter: head dims
16..256, no float64), the kernels run with the rotation folded in: each q/k tile is rotated in
registers right after its load, so rotated q/k never exist in memory; the backward rotates its
dQ/dK back by the transpose of the rotation before storing them (kernels/attention.py). Everywhere
else (the CPU reference, float64, head dims the kernels do not take) the op runs exactly the
definition above: the rotary op's implementation, then the attention op's. A backward that needs
the gradient of cos/sin runs the definition too (it needs dL/dq_rot, which the fused kernels never
materialise).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.host import in_layout_of, layout_like
from . import _dispatch, attention, inductor, reference
from . import rotary as rotary_ops


def _kernels():
    from ..kernels import attention as kernels  # imported late: see TRITON_INTERPRET in _dispatch

    return kernels


def _check(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("fuse_plugin::rope_attention: q, k, v must be 4-D (B, H, L, D)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"fuse_plugin::rope_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    rotated = rotary_ops.out_dtype(q, cos, sin)
    if rotated != q.dtype:
        raise ValueError(
            f"fuse_plugin::rope_attention: rotating {q.dtype} q/k by {cos.dtype}/{sin.dtype} tables gives "
            f"{rotated} (the eager promotion), not q's dtype; use rotary_qk and attention instead"
        )
    if not isinstance(rotary_dim, int):
        return  # a symbolic head dim (fake tensors): checked when the op runs
    d = q.shape[-1]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"fuse_plugin::rope_attention: rotary_dim={rotary_dim} must be even and in [2, {d}]")
    w = cos.shape[-1]
    if w not in (rotary_dim, rotary_dim // 2) or sin.shape[-1] != w:
        raise ValueError(
            f"fuse_plugin::rope_attention: cos/sin last dims {w}, {sin.shape[-1]} must be rotary_dim={rotary_dim} "
            f"or rotary_dim // 2"
        )


def fused(q: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Does the op run the kernels with the rotation folded in (else the definition)?"""
    return attention._runs_kernel(q, v) and _dispatch.runs_triton(q, cos, sin) and cos.dim() <= 4 and sin.dim() <= 4


def _rope(cos, sin, interleaved, rotary_dim):
    return _kernels().Rope(cos, sin, bool(interleaved), int(rotary_dim))


def _rotated(q, k, cos, sin, interleaved, rotary_dim):
    return rotary_ops._rotate_qk(q, k, cos, sin, interleaved, rotary_dim, False, q.dtype, k.dtype)


def _rope_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    rotary_dim: int,
    attn_bias: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: float,
    dropout_seed: Optional[Tensor] = None,
    window: int = 0,
) -> tuple[Tensor, Tensor]:
    attention.check_dropout(dropout_p, dropout_seed, q)
    attention.check_window(window, is_causal)
    _check(q, k, v, cos, sin, rotary_dim)
    if fused(q, v, cos, sin):
        bias = attention.bias_4d(attn_bias, q, k)
        return _kernels().attention_forward(
            q, k, v, bias, is_causal=is_causal, scale=scale, rope=_rope(cos, sin, interleaved, rotary_dim),
            dropout_p=dropout_p, dropout_seed=dropout_seed, window=window,
        )
    q_rot, k_rot = _rotated(q, k, cos, sin, interleaved, rotary_dim)
    return attention.forward_impl(q_rot, k_rot, v, attn_bias, is_causal, scale, dropout_p, dropout_seed,
                                  window=window)


rope_attention = torch.library.custom_op("fuse_plugin::rope_attention", _rope_attention, mutates_args=())


@rope_attention.register_fake
def _(q, k, v, cos, sin, interleaved, rotary_dim, attn_bias, dropout_p, is_causal, scale, dropout_seed=None,
      window=0):
    attention.check_dropout(dropout_p, dropout_seed, q)
    attention.check_window(window, is_causal)
    _check(q, k, v, cos, sin, rotary_dim)
    b, hq, lq, _ = q.shape
    return attention.empty_out(q, v), q.new_empty((b, hq, lq), dtype=torch.float32)


def _rope_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    rotary_dim: int,
    attn_bias: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    dropout_seed: Optional[Tensor],
    need_dbias: bool,
    need_dtables: bool,
    window: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk (w.r.t. the un-rotated q, k), dv, dbias (empty unless need_dbias), dcos, dsin (empty
    unless need_dtables)."""
    attention.check_dropout(dropout_p, dropout_seed, q)
    empty = q.new_empty((0,))
    if fused(q, v, cos, sin) and not need_dtables:
        bias = attention.bias_4d(attn_bias, q, k)
        dq, dk, dv, ds = _kernels().attention_backward(
            dout, q, k, v, bias, out, lse, is_causal=is_causal, scale=scale, need_dbias=need_dbias,
            rope=_rope(cos, sin, interleaved, rotary_dim), dropout_p=dropout_p, dropout_seed=dropout_seed,
            window=window,
        )
        return dq, dk, dv, attention.reduce_dbias(ds, attn_bias, q, need_dbias), empty, empty.clone()
    q_rot, k_rot = _rotated(q, k, cos, sin, interleaved, rotary_dim)
    dq_rot, dk_rot, dv, dbias = attention.backward_impl(
        dout, q_rot, k_rot, v, attn_bias, out, lse, is_causal, scale, need_dbias, dropout_p, dropout_seed,
        window=window,
    )
    dq, dk = rotary_ops._rotate_qk(dq_rot, dk_rot, cos, sin, interleaved, rotary_dim, True, q.dtype, k.dtype)
    dq, dk = in_layout_of(dq, q), in_layout_of(dk, k)  # laid out as the fake says
    dcos, dsin = empty, empty.clone()
    if need_dtables:
        parts = [reference.rotary_cos_sin_grads(g, x, cos, sin, interleaved, rotary_dim) for g, x in ((dq_rot, q), (dk_rot, k))]
        dcos = (parts[0][0] + parts[1][0]).contiguous()
        dsin = (parts[0][1] + parts[1][1]).contiguous()
    return dq, dk, dv, dbias, dcos, dsin


rope_attention_backward = torch.library.custom_op("fuse_plugin::rope_attention_backward", _rope_attention_backward,
                                                  mutates_args=())


@rope_attention_backward.register_fake
def _(dout, q, k, v, cos, sin, interleaved, rotary_dim, attn_bias, out, lse, dropout_p, is_causal, scale,
      dropout_seed, need_dbias, need_dtables, window=0):
    dbias = attn_bias.new_empty(attn_bias.shape) if need_dbias else q.new_empty((0,))
    dcos = cos.new_empty(cos.shape) if need_dtables else q.new_empty((0,))
    dsin = sin.new_empty(sin.shape) if need_dtables else q.new_empty((0,))
    return (layout_like(q, q.dtype), layout_like(k, k.dtype), layout_like(v, v.dtype), dbias, dcos,
            dsin)


def _setup_context(ctx, inputs, output):
    q, k, v, cos, sin, interleaved, rotary_dim, attn_bias, dropout_p, is_causal, scale, dropout_seed, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cos, sin, attn_bias, out, lse, dropout_seed)
    ctx.interleaved, ctx.rotary_dim = interleaved, rotary_dim
    ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.window = dropout_p, is_causal, scale, window
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    q, k, v, cos, sin, attn_bias, out, lse, dropout_seed = ctx.saved_tensors
    if dout is None:
        return (None,) * 13
    need_dbias = attn_bias is not None and ctx.needs_input_grad[7]
    need_dtables = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
    dq, dk, dv, dbias, dcos, dsin = rope_attention_backward(
        dout, q, k, v, cos, sin, ctx.interleaved, ctx.rotary_dim, attn_bias, out, lse, ctx.dropout_p,
        ctx.is_causal, ctx.scale, dropout_seed, need_dbias, need_dtables, ctx.window,
    )
    return (
        dq, dk, dv,
        dcos if ctx.needs_input_grad[3] else None,
        dsin if ctx.needs_input_grad[4] else None,
        None, None,
        dbias if need_dbias else None,
        None, None, None, None, None,
    )


rope_attention.register_autograd(_backward, setup_context=_setup_context)


# Compiled, the ops decompose into their kernel launches (ops/inductor.py).
inductor.register("fuse_plugin::rope_attention", _rope_attention)
inductor.register("fuse_plugin::rope_attention_backward", _rope_attention_backward)
