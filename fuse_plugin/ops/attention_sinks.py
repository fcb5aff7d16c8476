"""`fuse_plugin::attention_sinks`: attention with a learned per-head sink logit (gpt-oss).

    out, lse = torch.ops.fuse_plugin.attention_sinks(q, k, v, attn_bias, dropout_p, is_causal,
                                                     scale, sinks, dropout_seed=None, replace=None,
                                                     window=0)

computes what HF gpt-oss's eager attention does: the softmax over the scores with one more
column, the head's sink logit, which is then dropped,

    p = softmax([q·kᵀ·scale + bias [causal], sinks[h]])[..., :-1];   out = p · v

Args: q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed as `fuse_plugin::attention`
(ops/attention.py: shapes, layouts, GQA, dropout); sinks (Hq,) float, in the scores' units (after
the scale). Returns out (B, Hq, Lq, Dv), laid out like the attention op's, and lse (B, Hq, Lq)
float32: the log of the softmax's denominator, the sink included. A row whose every key is masked
gives out 0 and lse = its sink (the sink takes all the weight), where plain attention gives NaN.

How: the sink only adds exp(sink) to each row's denominator, which the general forward kernel
adds in its epilogue (the row's running max and sum are there: m' = max(m, sink), l' = l·e^(m−m')
+ e^(sink−m'), the accumulator rescaled by e^(m−m')), so no pass over out follows the kernel (a
merge after the attention op's (out₀, lse₀) cost 3% of a gpt-oss 4k layer and 12% of a
window-128 one, H100: RESULTS stop 30); dropout scales the kept weights uniformly, so the same
holds. Other forward families take no sinks (registry). The backward is the attention op's with
this (out, lse): its kernels rebuild the weights as exp(s − lse), which is the sink-normalised p,
and take Δ = rowsum(dO ∘ O); the sink's gradient is dsinks[h] = −Σ_{b,i} exp(sinks[h] −
lse[b,h,i]) · Δ[b,h,i], from the preprocess kernel's Δ where the backward family ran it
(kernels/attention.py attention_backward's ``sinks``). On the CPU the reference
computes with the sink in its softmax, in the compute dtype (float64 stays exact), and returns
the sink's gradient itself (reference.attention_forward / attention_backward's ``sinks``).
replace: the attention op's replace mask (a finite fill next to additive terms), passed through;
window: the attention op's sliding window (with is_causal; gpt-oss's sliding layers), passed through
(the sink joins every row's softmax alike).
No softcap (the recogniser declines it). DTensors: ops/sharding.py (sinks follow
the heads).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.call import check_dropout, check_window
from . import _dispatch, inductor, reference
from .attention import (_LIB, _extra, _kernels, _runs_kernel, bias_4d, check_bias, check_replace, empty_out,
                        period_of, reduce_dbias, whole_bias)
from ..kernels.host import in_layout_of, layout_like

_LIB.define(
    "attention_sinks(Tensor q, Tensor k, Tensor v, Tensor? attn_bias, float dropout_p, bool is_causal, "
    "float scale, Tensor sinks, Tensor? dropout_seed=None, Tensor? replace=None, int window=0) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define(
    "attention_sinks_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? attn_bias, Tensor out, "
    "Tensor lse, Tensor sinks, float dropout_p, bool is_causal, float scale, Tensor? dropout_seed, "
    "bool need_dbias, Tensor? replace=None, int window=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,))


def check_sinks(sinks: Tensor, q: Tensor) -> None:
    if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(f"fuse_plugin::attention_sinks: sinks must be a 1-D tensor of the {q.shape[1]} query "
                         f"heads, got {tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise ValueError(f"fuse_plugin::attention_sinks: sinks must be floating point, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"fuse_plugin::attention_sinks: sinks on {sinks.device}, q on {q.device}")


def _checks(q, k, attn_bias, dropout_p, dropout_seed, sinks, replace=None, window=0, is_causal=True) -> None:
    check_dropout(dropout_p, dropout_seed, q)
    check_window(window, is_causal)
    check_bias(attn_bias, q, k)
    check_replace(replace, attn_bias, q, k)
    check_sinks(sinks, q)


def attention_sinks(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor], dropout_p: float,
                    is_causal: bool, scale: float, sinks: Tensor, dropout_seed: Optional[Tensor] = None,
                    replace: Optional[Tensor] = None, window: int = 0) -> tuple[Tensor, Tensor]:
    _checks(q, k, attn_bias, dropout_p, dropout_seed, sinks, replace, window, is_causal)
    if _runs_kernel(q, v):  # the general forward folds the sink into its softmax (kernels/attention.py)
        return _kernels().attention_forward(
            q, k, v, bias_4d(attn_bias, q, k), is_causal=is_causal, scale=scale, dropout_p=dropout_p,
            dropout_seed=dropout_seed, sinks=sinks, **_extra(0.0, replace, q, k, period=period_of(attn_bias, q),
                                                             window=window))
    # the reference, with the sink in its softmax in the compute dtype (float64 stays exact)
    P = period_of(attn_bias, q)
    bias = whole_bias(attn_bias, q, k) if P is not None else bias_4d(attn_bias, q, k)
    out, lse = reference.attention_forward(q, k, v, bias, is_causal, scale, dropout_p, dropout_seed, sinks=sinks,
                                           **_extra(0.0, replace, q, k, whole=P is not None, period=P,
                                                    window=window))
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse


@torch.library.register_fake("fuse_plugin::attention_sinks", lib=_LIB)
def _(q, k, v, attn_bias, dropout_p, is_causal, scale, sinks, dropout_seed=None, replace=None, window=0):
    _checks(q, k, attn_bias, dropout_p, dropout_seed, sinks, replace, window, is_causal)
    b, hq, lq, _ = q.shape
    return empty_out(q, v), q.new_empty((b, hq, lq), dtype=torch.float32)


def attention_sinks_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor],
                             out: Tensor, lse: Tensor, sinks: Tensor, dropout_p: float, is_causal: bool,
                             scale: float, dropout_seed: Optional[Tensor], need_dbias: bool,
                             replace: Optional[Tensor] = None, window: int = 0):
    """dq, dk, dv, dbias (empty unless need_dbias) and dsinks (sinks' shape and dtype)."""
    _checks(q, k, attn_bias, dropout_p, dropout_seed, sinks, replace, window, is_causal)
    bias = bias_4d(attn_bias, q, k)
    P = period_of(attn_bias, q)
    if _runs_kernel(q, v):
        dq, dk, dv, ds, dsinks = _kernels().attention_backward(
            dout, q, k, v, bias, out, lse, is_causal=is_causal, scale=scale, need_dbias=need_dbias,
            dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks,
            **_extra(0.0, replace, q, k, period=P, window=window))
    else:
        if P is not None:
            bias = whole_bias(attn_bias, q, k)
        dq, dk, dv, ds, dsinks = reference.attention_backward(
            dout, q, k, v, bias, is_causal, scale, need_dbias, dropout_p, dropout_seed, sinks=sinks,
            **_extra(0.0, replace, q, k, whole=P is not None, period=P, window=window))
        dq, dk, dv = in_layout_of(dq, q), in_layout_of(dk, k), in_layout_of(dv, v)
    return dq, dk, dv, reduce_dbias(ds, attn_bias, q, need_dbias), dsinks


@torch.library.register_fake("fuse_plugin::attention_sinks_backward", lib=_LIB)
def _(dout, q, k, v, attn_bias, out, lse, sinks, dropout_p, is_causal, scale, dropout_seed, need_dbias,
      replace=None, window=0):
    check_window(window, is_causal)
    dbias = attn_bias.new_empty(attn_bias.shape) if need_dbias else q.new_empty((0,))
    return (layout_like(q, q.dtype), layout_like(k, k.dtype), layout_like(v, v.dtype), dbias,
            sinks.new_empty(sinks.shape))


class _SinksFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, dropout_p, is_causal, scale, sinks, dropout_seed, replace, window):
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = torch.ops.fuse_plugin.attention_sinks.default(
                q, k, v, attn_bias, dropout_p, is_causal, scale, sinks, dropout_seed, *_opt(replace, window))
        ctx.save_for_backward(q, k, v, attn_bias, out, lse, sinks, dropout_seed, replace)
        ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.window = dropout_p, is_causal, scale, window
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, attn_bias, out, lse, sinks, dropout_seed, replace = ctx.saved_tensors
        if dout is None:
            return (None,) * 11
        need_dbias = attn_bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias, dsinks = torch.ops.fuse_plugin.attention_sinks_backward.default(
            dout, q, k, v, attn_bias, out, lse, sinks, ctx.dropout_p, ctx.is_causal, ctx.scale, dropout_seed,
            need_dbias, *_opt(replace, ctx.window))
        return dq, dk, dv, (dbias if need_dbias else None), None, None, None, dsinks, None, None, None


def _opt(replace: Optional[Tensor], window: int = 0) -> tuple:
    """The trailing replace and window arguments, only as far as one is given (graphs without them
    keep the short call)."""
    if window:
        return (replace, window)
    return (replace,) if replace is not None else ()


def _attention_sinks_autograd(q, k, v, attn_bias, dropout_p, is_causal, scale, sinks, dropout_seed=None,
                              replace=None, window=0):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_bias, sinks)):
        return _SinksFunction.apply(q, k, v, attn_bias, dropout_p, is_causal, scale, sinks, dropout_seed, replace,
                                    window)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fuse_plugin.attention_sinks.default(q, k, v, attn_bias, dropout_p, is_causal, scale,
                                                             sinks, dropout_seed, *_opt(replace, window))


_dispatch.register_with_backward(_LIB, "attention_sinks", attention_sinks, _attention_sinks_autograd,
                                 attention_sinks_backward)

# Compiled, the ops decompose into the attention kernels' launches and the merge (ops/inductor.py).
inductor.register("fuse_plugin::attention_sinks", attention_sinks)
inductor.register("fuse_plugin::attention_sinks_backward", attention_sinks_backward)
