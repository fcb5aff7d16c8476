"""PyTorch's memory-efficient attention (CUTLASS, through ATen) as one more family of the op.

    why_not(q, k, v, bias, ...) -> None or the reason it cannot run a call
    forward(q, k, v, bias, is_causal, scale, period, need_lse) -> out, lse
    backward(dout, q, k, v, bias, out, lse, is_causal, scale, need_dbias, period) -> dq, dk, dv, dS

Why: the kernel table of issue 28 (H200, torch 2.11, bf16, 2026-11-26; RESULTS.md) found SDPA's
*efficient* backend, forced, 1.8x faster than our fastest family on Swin-T's stage-1 windows in
inference (B·H 12288 problems of 49 tokens, head dim 32, a learned (1, H, 49, 49) bias): 0.182
vs 0.330 ms, and SDPA's own pick for that call (cuDNN) 3.5x slower than both. An SDPA call left
as it is therefore does not reach it; as a family of the op it is one more candidate that the
choice table measures per class (``python -m fuse_plugin.tune --choices``). It is taken only
where measured fastest, or forced (``declines``): no rule of its own.

What it runs (``why_not``): CUDA, fp16 / bf16 / fp32, head dims multiples of 8 (its aligned
kernels) up to 256, as many key/value heads as query heads (it has no GQA: k/v would be
repeated), static sizes, a float bias of q's dtype or none (a bool mask would be converted: not
the same numbers where a whole row is masked), causal (top-left, as ours), no dropout (the op's
mask is a function of its own seed, which this kernel cannot draw), softcap, replace mask, rope,
window, and not in deterministic mode (its backward adds dQ with atomics).

The bias: its kernels read an additive bias through its strides, which must be multiples of 16
elements (SDPA pads its mask the same way): a bias whose strides are is read as it is (0 where
broadcast, so a (1, H, L, L) relative-position bias is never repeated per window batch); any
other is copied once into a padded buffer of its un-broadcast shape (a window-periodic bias
(P, H, L, L), Swin's shifted windows, is materialised over the batch there: this kernel reads a
bias by batch index only). dS comes back in q's dtype at the bias view's full size; the launcher
sums it in fp32 to its ``dbias_shape`` (the broadcast and periodic dims; call.sum_dbias).

Numerics: fp32 accumulation, natural-log logsumexp, as ours (the backward reads either family's
lse: its (B, H, Lq) is padded to the kernel's 32-row blocks). A row whose every score is -inf
(a float bias of -inf on a whole row; HF's and timm's masks are finite) gets what SDPA's efficient
backend gives it (0, where eager softmax and our other families give NaN; not yet checked on a
GPU here); every other row is eager's to fp32 rounding (tests/test_attention_efficient.py).

Layouts: out (B, Hq, Lq, Dv) laid out (B, Lq, Hq, Dv), the op's own. Its gradients are asked
for with q/k/v laid out (B, L, H, D) (``out_layout``: a copy of an input that is not): ATen's
kernel then returns them in that layout, which is also what its meta function promises when
Inductor traces the launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import host

aten = torch.ops.aten

ALIGN = 16  # elements: the bias's strides (SDPA's pad_bias and the meta of its backward use 16)
LSE_ROWS = 32  # the kernel's logsumexp rows are padded to a multiple of this
MAX_HEAD_DIM = 256


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def why_not(q, k, v, bias, *, is_causal: bool, dropout: bool = False, softcap: bool = False,
            replace: bool = False, rope: bool = False, window: int = 0,
            deterministic: bool = False) -> Optional[str]:
    """None when PyTorch's efficient kernel runs this call exactly as the op specifies, else why
    not (module doc)."""
    if q.device.type != "cuda":
        return "not on CUDA"
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "memory-efficient attention is disabled (torch.backends.cuda.enable_mem_efficient_sdp)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{q.dtype}"
    D, Dv = q.shape[-1], v.shape[-1]
    if D % 8 or Dv % 8 or max(D, Dv) > MAX_HEAD_DIM:
        return f"head dims {D}/{Dv} (multiples of 8 up to {MAX_HEAD_DIM})"
    if q.shape[1] != k.shape[1]:
        return "GQA (it would repeat k/v)"
    if not _static(*q.shape, *k.shape):
        return "symbolic sizes (dynamic shapes)"
    if bias is not None:
        if bias.dtype == torch.bool:
            return "a bool mask (it adds a float bias only)"
        if bias.dtype != q.dtype:
            return f"a {bias.dtype} bias with {q.dtype} inputs"
    for what, on in (("dropout", dropout), ("softcap", softcap), ("a replace mask", replace),
                     ("rope", rope), ("a sliding window", bool(window)),
                     ("deterministic mode", deterministic)):
        if on:
            return what
    return None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_bias(bias: torch.Tensor, B: int, period: Optional[int]) -> torch.Tensor:
    """``bias`` as a (B, Hq, Lq, Lk) view whose strides are multiples of ``ALIGN``: itself when
    they are, else one copy of its un-broadcast part (a window-periodic (P, ...) bias: over the
    whole batch) into a buffer padded to ``ALIGN`` keys (module doc)."""
    _, H, Lq, Lk = bias.shape
    if period is None and bias.stride(-1) == 1 and all(s % ALIGN == 0 for s in bias.stride()[:-1]):
        return bias.expand(B, H, Lq, Lk)
    src = bias
    for d in range(1, 3):  # heads and queries broadcast: kept at 1 (read with stride 0)
        if bias.stride(d) == 0:
            src = src.narrow(d, 0, 1)
    if period is not None:  # batch b reads bias[b % P]: materialised over the batch
        src = src.unsqueeze(0).expand(B // period, *src.shape).reshape(B, *src.shape[1:])
    elif bias.stride(0) == 0:
        src = src.narrow(0, 0, 1)
    padded = aten.constant_pad_nd(src, [0, _aligned(Lk) - Lk], 0.0)
    return padded.narrow(-1, 0, Lk).expand(B, H, Lq, Lk)  # (narrow: also on fake CUDA tensors)


def forward(q, k, v, bias, is_causal: bool, scale: float, period: Optional[int] = None,
            need_lse: bool = True):
    """out (B, Hq, Lq, Dv) laid out (B, Lq, Hq, Dv) and lse (B, Hq, Lq) fp32 (natural log);
    ``need_lse`` False: the kernel computes no lse (SDPA's inference call: Swin-T's stage-1
    windows 0.173 vs 0.181 ms with it, H100) and the returned one is uninitialised."""
    B, H, Lq, _ = q.shape
    b = None if bias is None else aligned_bias(bias, B, period)
    res = aten._scaled_dot_product_efficient_attention(q, k, v, b, bool(need_lse), 0.0, bool(is_causal),
                                                       scale=float(scale))
    if not need_lse:
        return res[0], host.empty((B, H, Lq), torch.float32, q.device)
    # its lse is padded to 32-row blocks: the op's is (B, Hq, Lq) contiguous
    return res[0], aten._to_copy(res[1].narrow(2, 0, Lq), memory_format=torch.contiguous_format)


def backward(dout, q, k, v, bias, out, lse, is_causal: bool, scale: float, need_dbias: bool,
             period: Optional[int] = None):
    """dq, dk, dv laid out as q/k/v, which the caller gives laid out (B, L, H, D)
    (kernels/attention.out_layout: the layout the kernel's meta promises for its gradients), and
    dS (B, Hq, Lq, Lk) in q's dtype, which the launcher sums in fp32 (call.sum_dbias), or None."""
    B, H, Lq, _ = q.shape
    b = None if bias is None else aligned_bias(bias, B, period)
    lse = aten.constant_pad_nd(lse, [0, -(-Lq // LSE_ROWS) * LSE_ROWS - Lq], 0.0)
    seed = torch.empty((), dtype=torch.long, device=q.device)  # read only with dropout
    dq, dk, dv, ds = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, b, out, lse, seed, seed, 0.0,
        [True, True, True, bool(need_dbias and b is not None)], bool(is_causal), scale=float(scale))
    return dq, dk, dv, (ds if need_dbias else None)
