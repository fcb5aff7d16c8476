"""`fuse_plugin::rotary`, `fuse_plugin::rotary_qk` and their backward ops.

    out = torch.ops.fuse_plugin.rotary(x, cos, sin, interleaved, rotary_dim)

rotates the first `rotary_dim` (R, even) channels of x's last dim; channels [R:] pass through.
  x (..., D), any strides; cos/sin broadcastable to x.shape[:-1] + (W,) with W = R (full width:
  one value per channel, as HF's `cat((freqs, freqs))` tables) or W = R // 2 (half width: one
  value per channel pair, as flash-attn's tables).
  interleaved=False: half-split pairs (i, i + R/2) — HF `rotate_half`, GPT-NeoX;
  interleaved=True:  adjacent pairs (2j, 2j + 1) — GPT-J `rotate_every_two`, Meta's complex rope.
Per pair (a, b) with the cos/sin values (c1, s1) of its first and (c2, s2) of its second channel:
  out_a = a·c1 − b·s1,  out_b = b·c2 + a·s2       (the eager `x·cos + rotate_half(x)·sin`).
Math in float32; the output is dense with x's dims in x's memory order where x has a unit last
stride (x's own strides where x is dense: the `(B, L, H, D)` memory of HF's
`q.view(B, L, H, D).transpose(1, 2)`, read and written as two sequential streams, as Inductor
lays out its fused rope), else it is contiguous (`output_like`, kernels/host.layout_like);
its dtype is the one the eager expression gives (`promote_types(x, cos, sin)`). `rotary_qk` does q and k in one launch. Gradients flow to x and,
for learned frequencies, to cos/sin.

Compiled by Inductor (ops/inductor.py), the ops decompose into the reference math (the same
fp32 computation, rounded once), which Inductor fuses into its own pointwise kernels, with the
table computation and the neighbouring views where it can: a rope is pointwise, so Inductor's
kernel moves the same bytes as ours (benchmarks/RESULTS.md: ours 0.99-1.12x compiled), while its
launch takes a handful of arguments where ours takes ~60 (host time per compiled call on the H100
host, stop 12: our kernel launched by Inductor 37 us, Inductor's HF rope 26; decomposed, 32 vs
21 in a later run: this spelling of the math still costs Inductor more than HF's, NOTES.md
attempt 18). The Triton kernel serves eager calls and opaque graphs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import launch
from ..kernels.host import layout_like as output_like  # the output's layout: see the docstring
from . import _dispatch, inductor, reference


def _kernels():
    from ..kernels import rotary as kernels  # imported late: see TRITON_INTERPRET in _dispatch

    return kernels


def out_dtype(x: Tensor, cos: Tensor, sin: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _as_4d(t: Tensor) -> Tensor:
    """(..., D) → (A, B, C, D): pad leading dims with 1s, or merge the extra leading ones."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.flatten(0, t.dim() - 4)
    return t


def _tables_4d(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin as stride-0 views with x's leading dims, in the kernel's 4-D layout."""
    shape = (*x.shape[:-1], cos.shape[-1])
    return _as_4d(cos.expand(shape)), _as_4d(sin.expand(shape))


def _runs_kernel(*tensors: Tensor) -> bool:
    """The Triton kernel, or (CPU reference, and compiled: see the module docstring) the math."""
    return _dispatch.runs_triton(*tensors) and not launch.is_tracing()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int, backward: bool, dtype: torch.dtype) -> Tensor:
    out = output_like(x, dtype)
    if _runs_kernel(x, cos, sin):
        c4, s4 = _tables_4d(x, cos, sin)
        _kernels().rotary_forward(
            _as_4d(x), c4, s4, interleaved=interleaved, rotary_dim=rotary_dim, backward=backward, out_dtype=dtype,
            out=_as_4d(out),
        )
        return out
    return out.copy_(reference.rotary(x, cos, sin, interleaved, rotary_dim, backward=backward, out_dtype=dtype))


def _rotate_qk(q, k, cos, sin, interleaved, rotary_dim, backward, q_dtype, k_dtype) -> tuple[Tensor, Tensor]:
    qo, ko = output_like(q, q_dtype), output_like(k, k_dtype)
    if _runs_kernel(q, k, cos, sin):
        cq, sq = _tables_4d(q, cos, sin)
        ck, sk = _tables_4d(k, cos, sin)
        _kernels().rotary_qk_forward(
            _as_4d(q), _as_4d(k), cq, sq, ck, sk, interleaved=interleaved, rotary_dim=rotary_dim,
            backward=backward, q_out_dtype=q_dtype, k_out_dtype=k_dtype, q_out=_as_4d(qo), k_out=_as_4d(ko),
        )
        return qo, ko
    return (
        qo.copy_(reference.rotary(q, cos, sin, interleaved, rotary_dim, backward=backward, out_dtype=q_dtype)),
        ko.copy_(reference.rotary(k, cos, sin, interleaved, rotary_dim, backward=backward, out_dtype=k_dtype)),
    )


# --------------------------------------------------------------------------- single tensor


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int) -> Tensor:
    return _rotate(x, cos, sin, interleaved, rotary_dim, False, out_dtype(x, cos, sin))


rotary = torch.library.custom_op("fuse_plugin::rotary", _rotary, mutates_args=())


@rotary.register_fake
def _(x, cos, sin, interleaved, rotary_dim):
    return output_like(x, out_dtype(x, cos, sin))


def _rotary_backward_impl(grad: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int,
                          x_dtype: torch.dtype) -> Tensor:
    """The gradient w.r.t. x: the transpose of the rotation (by −θ when cos/sin halves agree)."""
    return _rotate(grad, cos, sin, interleaved, rotary_dim, True, x_dtype)


rotary_backward = torch.library.custom_op("fuse_plugin::rotary_backward", _rotary_backward_impl, mutates_args=())


@rotary_backward.register_fake
def _(grad, cos, sin, interleaved, rotary_dim, x_dtype):
    return output_like(grad, x_dtype)


def _tables_need_grad(ctx) -> bool:
    return ctx.needs_input_grad[1] or ctx.needs_input_grad[2]


def _rotary_setup_context(ctx, inputs, output):
    x, cos, sin, interleaved, rotary_dim = inputs
    ctx.interleaved, ctx.rotary_dim, ctx.x_dtype = interleaved, rotary_dim, x.dtype
    # x is kept alive only for learned frequencies (dcos = g·x needs it).
    ctx.save_for_backward(cos, sin, x if _tables_need_grad(ctx) else None)


def _rotary_backward(ctx, grad):
    cos, sin, x = ctx.saved_tensors
    dx = rotary_backward(grad, cos, sin, ctx.interleaved, ctx.rotary_dim, ctx.x_dtype) if ctx.needs_input_grad[0] else None
    dcos = dsin = None
    if x is not None:
        dcos, dsin = reference.rotary_cos_sin_grads(grad, x, cos, sin, ctx.interleaved, ctx.rotary_dim)
    return dx, dcos, dsin, None, None


rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


# --------------------------------------------------------------------------- q and k together


def _rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """q and k (which may differ in head count) rotated by the same tables, in one launch."""
    return _rotate_qk(q, k, cos, sin, interleaved, rotary_dim, False, out_dtype(q, cos, sin), out_dtype(k, cos, sin))


rotary_qk = torch.library.custom_op("fuse_plugin::rotary_qk", _rotary_qk, mutates_args=())


@rotary_qk.register_fake
def _(q, k, cos, sin, interleaved, rotary_dim):
    return output_like(q, out_dtype(q, cos, sin)), output_like(k, out_dtype(k, cos, sin))


def _rotary_qk_backward_impl(
    grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int,
    q_dtype: torch.dtype, k_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    return _rotate_qk(grad_q, grad_k, cos, sin, interleaved, rotary_dim, True, q_dtype, k_dtype)


rotary_qk_backward = torch.library.custom_op("fuse_plugin::rotary_qk_backward", _rotary_qk_backward_impl,
                                             mutates_args=())


@rotary_qk_backward.register_fake
def _(grad_q, grad_k, cos, sin, interleaved, rotary_dim, q_dtype, k_dtype):
    return output_like(grad_q, q_dtype), output_like(grad_k, k_dtype)


def _rotary_qk_setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved, rotary_dim = inputs
    ctx.interleaved, ctx.rotary_dim, ctx.q_dtype, ctx.k_dtype = interleaved, rotary_dim, q.dtype, k.dtype
    learned = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.save_for_backward(cos, sin, q if learned else None, k if learned else None)
    ctx.set_materialize_grads(False)


def _rotary_qk_backward(ctx, grad_q, grad_k):
    cos, sin, q, k = ctx.saved_tensors
    # An unused output's gradient arrives as None (materialize_grads is off).
    dq = dk = None
    if grad_q is not None and grad_k is not None:
        dq, dk = rotary_qk_backward(grad_q, grad_k, cos, sin, ctx.interleaved, ctx.rotary_dim, ctx.q_dtype, ctx.k_dtype)
    else:
        if grad_q is not None:
            dq = rotary_backward(grad_q, cos, sin, ctx.interleaved, ctx.rotary_dim, ctx.q_dtype)
        if grad_k is not None:
            dk = rotary_backward(grad_k, cos, sin, ctx.interleaved, ctx.rotary_dim, ctx.k_dtype)
    dcos = dsin = None
    if q is not None:
        parts = [
            reference.rotary_cos_sin_grads(g, x, cos, sin, ctx.interleaved, ctx.rotary_dim)
            for g, x in ((grad_q, q), (grad_k, k))
            if g is not None
        ]
        if parts:
            dcos = sum(p[0] for p in parts)
            dsin = sum(p[1] for p in parts)
    return dq, dk, dcos, dsin, None, None


rotary_qk.register_autograd(_rotary_qk_backward, setup_context=_rotary_qk_setup_context)


# Compiled, each op decomposes into its kernel launch (ops/inductor.py).
for _name, _impl in (("rotary", _rotary), ("rotary_backward", _rotary_backward_impl),
                     ("rotary_qk", _rotary_qk), ("rotary_qk_backward", _rotary_qk_backward_impl)):
    inductor.register(f"fuse_plugin::{_name}", _impl)
