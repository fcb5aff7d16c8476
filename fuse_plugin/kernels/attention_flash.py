"""PyTorch's flash-attention forward (FlashAttention-2, through ATen) as one more forward family.

    why_not(q, k, v, bias, ...) -> None or the reason it cannot run a call
    forward(q, k, v, is_causal, scale) -> out, lse

Why: issue 28 asks that the candidates include what SDPA would run, its flash and efficient
backends among them; the efficient kernels are a family (attention_efficient.py), and this is the
flash forward, measured per class by the choice table (``python -m fuse_plugin.tune --choices``)
and taken only where measured fastest, or forced (``declines``): no rule of its own. Its first
measurements (H100, torch 2.11, bf16, stop 39) found it slower than cuDNN's forward at HF Llama's
shapes: 8x512 tokens, GQA 16/4, D 64, causal 31.9 vs 23.0 us (SDPA's own pick there is cuDNN,
22.4), 1x128 5.8 vs our general forward's 3.9. Forward only: the op's backward reads its lse,
the natural-log logsumexp of our kernels and cuDNN's, and the backward families stay ours and
cuDNN's (SDPA's flash backward needs its forward's RNG state; measured 110.9 us at 8x512 against
cuDNN's 96.1 and our Gluon backward's 92.2).

What it runs (``why_not``): CUDA (capability 8.0 up), fp16 / bf16, D == Dv a multiple of 8 up to
256, GQA natively (query heads a multiple of the kv heads), no bias (the ATen op takes none), causal
only with Lq == Lk (its causal mask is bottom-right aligned, ours top-left: the same only there), no
dropout (the op's mask is a function of its own seed, which this kernel cannot draw), softcap,
replace mask, rope, window, chunks or documents, and flash attention enabled
(``torch.backends.cuda.enable_flash_sdp(False)`` turns this family off too).

Numerics: fp32 accumulation and a natural-log lse (B, Hq, Lq) fp32, as ours; always computed (the
ATen op has no switch), so the op's ``need_lse=False`` changes nothing here.

Layouts: ATen's op transposes q/k/v to (B, L, H, D) for the kernel (a copy of an input whose last
dim is not contiguous) and returns out (B, Hq, Lq, D) laid out (B, Lq, Hq, D), the op's own
layout, which is also what its meta function promises when Inductor traces the launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import attention_cudnn

aten = torch.ops.aten

MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)


def why_not(q, k, v, bias, *, is_causal: bool, capability: tuple[int, int], dropout: bool = False,
            softcap: bool = False, replace: bool = False, rope: bool = False) -> Optional[str]:
    """None when the flash forward computes this call exactly as the op specifies, else why not
    (module doc). Band features (window, chunks, documents) are refused by the registry."""
    if q.device.type != "cuda":
        return "not on CUDA"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash attention is disabled (torch.backends.cuda.enable_flash_sdp)"
    if tuple(capability) < MIN_CAPABILITY:
        return f"sm {capability[0]}{capability[1]} (FlashAttention-2 needs sm 80 or later)"
    return attention_cudnn.plain_problem(q, k, v, is_causal, MAX_HEAD_DIM, {
        "a bias": bias is not None, "dropout": dropout, "softcap": softcap, "a replace mask": replace,
        "rope": rope})


def forward(q, k, v, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, Lq, D) laid out (B, Lq, Hq, D) and lse (B, Hq, Lq) fp32 (natural log)."""
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, bool(is_causal), False, scale=float(scale))
    return res[0], res[1]
