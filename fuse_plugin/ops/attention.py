"""`fuse_plugin::attention` and its backward op.

    out, lse = torch.ops.fuse_plugin.attention(q, k, v, attn_bias, dropout_p, is_causal, scale,
                                               dropout_seed=None, softcap=0.0, replace=None,
                                               window=0, need_lse=True, chunk=0,
                                               documents=None)

computes softmax(q·kᵀ·scale + bias [causal]) · v (with softcap c > 0:
softmax(c·tanh(q·kᵀ·scale / c) + bias [causal]) · v, Gemma 2's and Grok's logit softcapping,
applied to the scaled scores before the bias and the masks; 0 = off) with
  q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), Hq a multiple of Hkv (GQA: q head h
  reads kv head h // (Hq // Hkv); the kernels never materialise repeated K/V);
  attn_bias None or broadcastable to (B, Hq, Lq, Lk): bool (True = keep) or additive float; or
  window-periodic: 4-D with a leading dim P, 1 < P < B, dividing B, the rest broadcastable to
  (Hq, Lq, Lk): batch b reads attn_bias[b % P] (Swin's shifted-window mask over B·nW windows, the
  rewrite's form for it: no copy per window batch; its gradient has the bias's own shape);
  is_causal top-left aligned like SDPA's `is_causal`: key j is visible to query i iff j <= i,
  also when Lq != Lk (so with Lq > Lk every row still sees key 0; a KV-cache decode step
  wants bottom-right alignment and must pass an explicit mask instead);
  window (with is_causal; 0 = none) a sliding window: key j is visible to query i iff
  i - window < j <= i (HF's `sliding_window`, Mistral / Gemma 2 / gpt-oss), so each row sees at
  most `window` keys. The kernels skip the key blocks it hides (the work follows the band, not
  the square), where the same window as a bias would cost the whole causal triangle;
  chunk (with is_causal, not with a window; 0 = none) chunked attention (Llama 4): key j is visible
  to query i iff j // chunk == i // chunk and j <= i; the kernels skip the key blocks outside each
  query block's chunks, as for the window;
  documents (None, or integer ids (B, L) or (1, L), any values in any order; self-attention only,
  Lq == Lk; with or without is_causal, not with a window or chunks) packed sequences: key j is
  visible to query i iff documents[b, j] == documents[b, i] (torchtitan / TRL packing). The
  kernels skip the key blocks no query of a block can see (kernels/call.py document_ranges).
Outputs: out (B, Hq, Lq, Dv) in q's dtype, laid out (B, Lq, Hq, Dv) in memory (a transposed
view, as SDPA's flash/cuDNN outputs: the usual head merge `out.transpose(1, 2).reshape(B, Lq, -1)`
is then a view, no copy), lse (B, Hq, Lq) float32 contiguous (natural log).
lse is not differentiable. need_lse=False says that no backward will read this call's lse
(inference; the rewrite passes it where no input of the site needs a gradient): a family that
pays for the lse then skips it, as SDPA does under no_grad (PyTorch's efficient kernels: Swin-T's
stage-1 windows 0.172 vs 0.181 ms, H100), and the lse returned is unspecified. Under autograd (an input needs a gradient) it is ignored:
the lse is always computed for the backward. The backward op's dq/dk/dv are dense with their dims in q/k/v's memory
order where those have a unit last stride, else contiguous (kernels/host.layout_like: the head
merge of a gradient is then a view too).

Dropout: with dropout_p > 0 the attention weights are dropped with probability dropout_p and the
kept ones scaled by 1/(1 - dropout_p), as `F.dropout` would do after the softmax (lse stays that
of the undropped softmax). The draw has 16 bits per weight, so the drop rate is dropout_p rounded
down to a multiple of 2**-16 and the scale is the exact inverse of that keep rate (unbiased). The mask is a pure function of `dropout_seed` (one int64 tensor on q's
device, from `new_dropout_seed`, i.e. from torch's RNG, so `torch.manual_seed` makes it
repeatable): the backward redraws the same mask, and the CPU reference draws it bit for bit like
the kernels (reference.dropout_keep). dropout_p > 0 without a seed is an error.

Replace: `replace` None, or a bool tensor broadcastable to (B, Hq, Lq, Lk) next to a float
attn_bias: where it is True the score is REPLACED by the bias instead of having the bias added,

    s = where(replace, attn_bias, q·kᵀ·scale [softcapped] + attn_bias)     [then causal]

so a replaced score takes exactly the bias's value and no gradient flows into q or k from it,
while the bias's gradient is dS everywhere (also where replaced: there s is the bias itself).
This is what a finite masked_fill / where of the scores next to additive terms computes
(patterns/attention_bias.py builds the bias by replaying the chain's masks on zero scores and
the mask as the union of the fill masks). Only the general Triton kernels take it, as softcap.

Window, chunk and documents: only the general Triton kernels take them (kernels/registry.py: every other family says
why not); the CPU reference masks the band. The rewrite passes it where it proves a causal
sliding-window mask (patterns/mask_structure.py), instead of an (Lq, Lk) bias.

Softcap: the general Triton kernels (forward, atomic and deterministic backward) take it; the
TMA and Gluon kernels do not, and the launcher never picks them for a softcapped call
(kernels/attention.py, ``_softcap_config``). `rope_attention` has no softcap: the rope folding
leaves a softcapped attention alone (patterns/rope_attention.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.call import (check_chunk, check_documents, check_dropout, check_softcap,  # (imports no Triton kernel)
                            check_window)
from ..kernels.host import in_layout_of, layout_like
from . import _dispatch, inductor, reference


def _kernels():
    from ..kernels import attention as kernels  # imported late: see TRITON_INTERPRET in _dispatch

    return kernels


def _runs_kernel(q: Tensor, v: Tensor) -> bool:
    """The Triton kernels take head dims 16..256 (tl.dot needs 16); smaller ones use the reference."""
    return _dispatch.runs_triton(q) and 16 <= q.shape[-1] <= 256 and 16 <= v.shape[-1] <= 256


def check_replace(replace: Optional[Tensor], attn_bias: Optional[Tensor], q: Tensor, k: Tensor) -> None:
    """The replace mask is bool, broadcastable to the scores, on q's device, next to a float bias."""
    if replace is None:
        return
    if replace.dtype != torch.bool:
        raise ValueError(f"fuse_plugin::attention: replace must be a bool tensor, got {replace.dtype}")
    if attn_bias is None or not attn_bias.dtype.is_floating_point:
        raise ValueError("fuse_plugin::attention: replace needs a floating-point attn_bias (the value a replaced "
                         f"score takes), got {None if attn_bias is None else attn_bias.dtype}")
    check_bias(replace, q, k, "replace")
    P, R = period_of(attn_bias, q), period_of(replace, q)
    if R is not None and R != P or P is not None and replace.dim() == 4 and replace.shape[0] not in (1, P):
        raise ValueError(f"fuse_plugin::attention: replace {tuple(replace.shape)} and attn_bias "
                         f"{tuple(attn_bias.shape)} differ in their window period")
    if replace.device != q.device:
        raise ValueError(f"fuse_plugin::attention: replace is on {replace.device}, q on {q.device}")


def new_dropout_seed(device: torch.device) -> Tensor:
    """A fresh dropout seed drawn from torch's generator of `device` (so torch.manual_seed fixes
    the dropout mask)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def period_of(attn_bias: Optional[Tensor], q: Tensor) -> Optional[int]:
    """P when attn_bias is window-periodic over q's batch (see the module doc), else None."""
    if attn_bias is None or attn_bias.dim() != 4:
        return None
    P, B = attn_bias.shape[0], q.shape[0]
    if not isinstance(P, int) or P == 1 or (isinstance(B, int) and P == B):
        return None
    return P


def check_bias(attn_bias: Optional[Tensor], q: Tensor, k: Tensor, what: str = "attn_bias") -> None:
    """The bias (or replace mask) broadcasts to the scores, or is window-periodic."""
    if attn_bias is None:
        return
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    P = period_of(attn_bias, q)
    fits = attn_bias.dim() <= 4 and all(
        b == 1 or b == t for b, t in zip(reversed(attn_bias.shape[-3:]), reversed(scores[1:])))
    if P is not None:
        fits = fits and q.shape[0] % P == 0
    elif attn_bias.dim() == 4:
        fits = fits and attn_bias.shape[0] in (1, scores[0])
    if not fits:
        raise ValueError(f"fuse_plugin::attention: {what} of shape {tuple(attn_bias.shape)} does not broadcast "
                         f"to the scores {scores} (nor is it window-periodic: (P, ...) with P dividing the batch)")


def bias_4d(attn_bias: Optional[Tensor], q: Tensor, k: Tensor, period: Optional[int] = None) -> Optional[Tensor]:
    """The bias (or the replace mask) as a (B, Hq, Lq, Lk) view, or (P, Hq, Lq, Lk) for a
    window-periodic one (``period``: the bias's, for its replace mask): broadcast dims get stride
    0, nothing is copied."""
    if attn_bias is None:
        return None
    P = period or period_of(attn_bias, q)
    return attn_bias.expand(P if P is not None else q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def whole_bias(attn_bias: Optional[Tensor], q: Tensor, k: Tensor, period: Optional[int] = None) -> Optional[Tensor]:
    """The bias as (B, Hq, Lq, Lk): a window-periodic one (``period``: the bias's, for its
    replace mask) repeated over the batch (a copy), any other one as its broadcast view (the
    reference's form)."""
    P = period or period_of(attn_bias, q)
    if P is None:
        return bias_4d(attn_bias, q, k)
    B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return bias_4d(attn_bias, q, k, P).unsqueeze(0).expand(B // P, P, H, Lq, Lk).reshape(B, H, Lq, Lk)


# The two ops are defined with torch.library's low-level API rather than torch.library.custom_op:
# custom_op's generic Python wrappers (re-binding arguments against the schema, the output-aliasing
# check, the dynamo-disable frame, its generic autograd.Function) cost about 200 us per forward
# call on the H100 host, eight times SDPA's whole call, which made short attentions host-bound
# (RESULTS.md, stop 10). Same schema, pt2_compliant tag, fake implementations and autograd
# (a plain autograd.Function around the backward op) as custom_op would register.
_LIB = torch.library.Library("fuse_plugin", "FRAGMENT")
_LIB.define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_bias, float dropout_p, bool is_causal, "
    "float scale, Tensor? dropout_seed=None, float softcap=0.0, Tensor? replace=None, int window=0, "
    "bool need_lse=True, int chunk=0, Tensor? documents=None) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define(
    "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? attn_bias, Tensor out, "
    "Tensor lse, float dropout_p, bool is_causal, float scale, Tensor? dropout_seed, "
    "bool need_dbias, float softcap=0.0, Tensor? replace=None, int window=0, int chunk=0, "
    "Tensor? documents=None) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,))


def attention(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor], dropout_p: float,
              is_causal: bool, scale: float, dropout_seed: Optional[Tensor] = None,
              softcap: float = 0.0, replace: Optional[Tensor] = None, window: int = 0,
              need_lse: bool = True, chunk: int = 0, documents: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Triton kernel on CUDA (and on the CPU under the interpreter); the reference otherwise."""
    check_dropout(dropout_p, dropout_seed, q)
    check_softcap(softcap)
    check_window(window, is_causal)
    check_chunk(chunk, is_causal, window)
    check_documents(documents, q, k, window, chunk)
    check_bias(attn_bias, q, k)
    check_replace(replace, attn_bias, q, k)
    return forward_impl(q, k, v, attn_bias, is_causal, scale, dropout_p, dropout_seed, softcap, replace, window,
                        need_lse, chunk, documents)


def _extra(softcap: float, replace: Optional[Tensor], q: Tensor, k: Tensor, whole: bool = False,
           period: Optional[int] = None, window: int = 0, chunk: int = 0,
           documents: Optional[Tensor] = None) -> dict:
    """softcap, replace, window, chunk and documents for the kernels / the reference, only when
    on: calls without them stay as they were. ``whole``: a window-periodic replace mask repeated
    to (B, ...) (the reference)."""
    extra = {"softcap": softcap} if softcap else {}
    if window:
        extra["window"] = window
    if chunk:
        extra["chunk"] = chunk
    if documents is not None:
        extra["documents"] = documents
    if replace is not None:
        extra["replace"] = (whole_bias if whole else bias_4d)(replace, q, k, period)
    return extra


def forward_impl(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor], is_causal: bool, scale: float,
                 dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None, softcap: float = 0.0,
                 replace: Optional[Tensor] = None, window: int = 0, need_lse: bool = True, chunk: int = 0,
                 documents: Optional[Tensor] = None):
    """The op's computation (also the second half of `rope_attention`'s unfused path)."""
    bias = bias_4d(attn_bias, q, k)
    extra = _extra(softcap, replace, q, k, period=period_of(attn_bias, q), window=window, chunk=chunk,
                   documents=documents)
    if _runs_kernel(q, v):
        if not need_lse:
            extra["need_lse"] = False
        return _kernels().attention_forward(
            q, k, v, bias, is_causal=is_causal, scale=scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
            **extra)
    if period_of(attn_bias, q) is not None:  # the reference reads (B, ...) biases
        bias = whole_bias(attn_bias, q, k)
        extra = _extra(softcap, replace, q, k, whole=True, period=period_of(attn_bias, q), window=window,
                       chunk=chunk, documents=documents)
    out, lse = reference.attention_forward(q, k, v, bias, is_causal, scale, dropout_p, dropout_seed, **extra)
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse  # the kernels' layout


def empty_out(q: Tensor, v: Tensor) -> Tensor:
    """An uninitialised output of the op for q and v: (B, Hq, Lq, Dv) laid out (B, Lq, Hq, Dv)."""
    b, hq, lq, _ = q.shape
    return q.new_empty((b, lq, hq, v.shape[-1])).transpose(1, 2)


@torch.library.register_fake("fuse_plugin::attention", lib=_LIB)
def _(q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed=None, softcap=0.0, replace=None, window=0,
      need_lse=True, chunk=0, documents=None):
    check_dropout(dropout_p, dropout_seed, q)
    check_softcap(softcap)
    check_window(window, is_causal)
    check_chunk(chunk, is_causal, window)
    check_documents(documents, q, k, window, chunk)
    check_bias(attn_bias, q, k)
    check_replace(replace, attn_bias, q, k)
    b, hq, lq, _ = q.shape
    return empty_out(q, v), q.new_empty((b, hq, lq), dtype=torch.float32)


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor],
                       out: Tensor, lse: Tensor, dropout_p: float, is_causal: bool, scale: float,
                       dropout_seed: Optional[Tensor], need_dbias: bool, softcap: float = 0.0,
                       replace: Optional[Tensor] = None, window: int = 0,
                       chunk: int = 0, documents: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns dq, dk, dv and dbias (attn_bias's shape and dtype; an empty tensor unless need_dbias)."""
    check_dropout(dropout_p, dropout_seed, q)
    check_softcap(softcap)
    check_window(window, is_causal)
    check_chunk(chunk, is_causal, window)
    check_documents(documents, q, k, window, chunk)
    check_replace(replace, attn_bias, q, k)
    return backward_impl(dout, q, k, v, attn_bias, out, lse, is_causal, scale, need_dbias, dropout_p, dropout_seed,
                         softcap, replace, window, chunk, documents)


def backward_impl(dout, q, k, v, attn_bias, out, lse, is_causal, scale, need_dbias, dropout_p=0.0, dropout_seed=None,
                  softcap=0.0, replace=None, window=0, chunk=0, documents=None):
    bias = bias_4d(attn_bias, q, k)
    extra = _extra(softcap, replace, q, k, period=period_of(attn_bias, q), window=window, chunk=chunk,
                   documents=documents)
    if _runs_kernel(q, v):
        dq, dk, dv, ds = _kernels().attention_backward(
            dout, q, k, v, bias, out, lse, is_causal=is_causal, scale=scale, need_dbias=need_dbias,
            dropout_p=dropout_p, dropout_seed=dropout_seed, **extra,
        )
    else:
        if period_of(attn_bias, q) is not None:  # the reference reads (B, ...) biases
            bias = whole_bias(attn_bias, q, k)
            extra = _extra(softcap, replace, q, k, whole=True, period=period_of(attn_bias, q), window=window,
                           chunk=chunk, documents=documents)
        dq, dk, dv, ds = reference.attention_backward(
            dout, q, k, v, bias, is_causal, scale, need_dbias, dropout_p, dropout_seed, **extra
        )
        # Each gradient laid out as its input (host.layout_like), as the fake says (the
        # kernels allocate them so).
        dq, dk, dv = in_layout_of(dq, q), in_layout_of(dk, k), in_layout_of(dv, v)
    return dq, dk, dv, reduce_dbias(ds, attn_bias, q, need_dbias)


def reduce_dbias(ds: Optional[Tensor], attn_bias: Optional[Tensor], q: Tensor, need_dbias: bool) -> Tensor:
    """dS ((B, Hq, Lq, Lk), or already partly summed by the kernels) summed to the bias's shape
    (a window-periodic bias: over the B // P batches of each window too) and cast to its dtype;
    empty unless need_dbias."""
    if not need_dbias:
        return q.new_empty((0,))
    P = period_of(attn_bias, q)
    if P is not None and ds.shape[0] != P:
        ds = ds.view(ds.shape[0] // P, P, *ds.shape[1:]).sum(0)
    return ds.sum_to_size(attn_bias.shape).to(attn_bias.dtype).contiguous()


@torch.library.register_fake("fuse_plugin::attention_backward", lib=_LIB)
def _(dout, q, k, v, attn_bias, out, lse, dropout_p, is_causal, scale, dropout_seed, need_dbias, softcap=0.0,
      replace=None, window=0, chunk=0, documents=None):
    check_softcap(softcap)
    check_window(window, is_causal)
    check_chunk(chunk, is_causal, window)
    check_documents(documents, q, k, window, chunk)
    check_replace(replace, attn_bias, q, k)
    dbias = attn_bias.new_empty(attn_bias.shape) if need_dbias else q.new_empty((0,))
    return layout_like(q, q.dtype), layout_like(k, k.dtype), layout_like(v, v.dtype), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed, softcap, replace, window, chunk, documents = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, attn_bias, out, lse, dropout_seed, replace, documents)
    ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.softcap = dropout_p, is_causal, scale, softcap
    ctx.window, ctx.chunk = window, chunk
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    q, k, v, attn_bias, out, lse, dropout_seed, replace, documents = ctx.saved_tensors
    if dout is None:
        return (None,) * 13
    need_dbias = attn_bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = torch.ops.fuse_plugin.attention_backward.default(
        dout, q, k, v, attn_bias, out, lse, ctx.dropout_p, ctx.is_causal, ctx.scale, dropout_seed, need_dbias,
        **_tail(ctx.softcap, replace, ctx.window, chunk=ctx.chunk, documents=documents))
    return (dq, dk, dv, (dbias if need_dbias else None)) + (None,) * 9


def _tail(softcap: float, replace: Optional[Tensor], window: int = 0, need_lse: bool = True, chunk: int = 0,
          documents: Optional[Tensor] = None) -> dict:
    """The trailing (softcap, replace, window, need_lse, chunk, documents) arguments of a call, as keywords,
    only those that are not their default, so that graphs without them keep the op's old call.
    (need_lse is the forward's alone.)"""
    tail: dict = {}
    if softcap:
        tail["softcap"] = softcap
    if replace is not None:
        tail["replace"] = replace
    if window:
        tail["window"] = window
    if not need_lse:
        tail["need_lse"] = False
    if chunk:
        tail["chunk"] = chunk
    if documents is not None:
        tail["documents"] = documents
    return tail


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed, softcap, replace, window, chunk,
                documents):
        # (no need_lse: the backward reads the lse)
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = torch.ops.fuse_plugin.attention.default(
                q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed,
                **_tail(softcap, replace, window, chunk=chunk, documents=documents))
        _setup_context(ctx, (q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed, softcap, replace,
                             window, chunk, documents), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


def _attention_autograd(q, k, v, attn_bias, dropout_p, is_causal, scale, dropout_seed=None, softcap=0.0,
                        replace=None, window=0, need_lse=True, chunk=0, documents=None):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            attn_bias is not None and attn_bias.requires_grad)):
        return _AttentionFunction.apply(q, k, v, attn_bias, dropout_p, is_causal, scale,
                                        dropout_seed, softcap, replace, window, chunk, documents)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fuse_plugin.attention.default(q, k, v, attn_bias, dropout_p, is_causal,
                                                       scale, dropout_seed,
                                                       **_tail(softcap, replace, window, need_lse, chunk,
                                                               documents))


_dispatch.register_with_backward(_LIB, "attention", attention, _attention_autograd, attention_backward)

# Compiled, the ops decompose into their kernel launches (ops/inductor.py).
inductor.register("fuse_plugin::attention", attention)
inductor.register("fuse_plugin::attention_backward", attention_backward)
