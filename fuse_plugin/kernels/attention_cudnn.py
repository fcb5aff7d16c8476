"""cuDNN's fused attention (through ATen) as one more family behind the launch interface.

    family("fwd" | "bwd", q, k, v, bias, ...) -> "cudnn" or None   (once per shape)
    forward(q, k, v, is_causal, scale) -> out, lse
    backward(dout, q, k, v, out, lse, is_causal, scale) -> dq, dk, dv

Why: measured on the H100 (cuDNN 9.19, torch 2.11, bf16; RESULTS.md, stop 17), cuDNN's backward
fed *our* forward's out and lse (same natural-log logsumexp, to 1e-6) is 5-25% faster than our
best backward on plain problems from ~200 keys up (ViT (64, 6, 197, 64): 91.6 vs 110.3 us; GQA
16/4 at 4x2048: 322 vs 393; 1x8192: 939 vs 1048), with the same errors against float64; its
forward is 20-25% faster at 2k tokens, ~4% at 8k, even at 512 and slower below (1x128: 6.4 vs
4.0 us). Where it wins, the op runs it, so that importing the plugin never makes a plain
attention slower than SDPA would be; our kernels keep everything cuDNN does not take or loses.

Plain means (``why_not``): a CUDA device of capability 9.0 (where it was measured), fp16/bf16,
D == Dv, D % 8 == 0, D <= 256, no bias (with one it was measured only at 128 keys, where ours
wins), no dropout (the op's mask is a function of its own seed, which cuDNN cannot draw), no
softcap, replace mask, rope or dbias, causal only with Lq == Lk (both top-left then), not in
deterministic mode, and cuDNN attention enabled (``torch.backends.cuda.enable_cudnn_sdp(False)``
turns this family off too). ``FWD_MIN_LEN`` / ``BWD_MIN_LEN`` are where it starts to win.

Layouts: cuDNN writes out and the gradients in q's / k's / v's stride order. The launcher
(attention.py) returns the op's documented output layout ((B, Lq, Hq, Dv) in memory; the usual
q, a (B, L, H, D) view, gives it directly, any other q costs one copy). The gradients are used
as cuDNN lays them out when Inductor traces the launch (the graph then holds their real strides;
a head merge of a q-ordered dq is a view) and made contiguous, as the op's fake promises, in
eager calls.

The switch is read when a graph compiles and is no part of the compile caches' keys: a graph
cached with cuDNN on still calls cuDNN after ``enable_cudnn_sdp(False)`` (same results).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import host

aten = torch.ops.aten

FWD_MIN_LEN = 512  # Lq and Lk: cuDNN's forward ties ours at 512 and wins from there up
BWD_MIN_LEN = 160  # Lq and Lk: its backward wins from ViT's 197 keys up; ours at <= 128
# D 256 too: the kernel table of 2026-11-25 (issue 28, H100, bf16, causal): cuDNN 573 / 336
# TFLOP/s forward / backward against our 346 / 235.
MAX_HEAD_DIM = 256
CAPABILITY = (9, 0)


def why_not(q, k, v, bias, *, is_causal: bool, capability: tuple[int, int], dropout: bool = False,
            softcap: bool = False, replace: bool = False, rope: bool = False,
            need_dbias: bool = False, deterministic: bool = False) -> Optional[str]:
    """None when cuDNN can run this attention exactly as our kernels would, else why not."""
    if q.device.type != "cuda":
        return "not on CUDA"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp)"
    if not torch.backends.cudnn.is_available():
        return "no cuDNN"
    if tuple(capability) != CAPABILITY:
        return f"measured on sm {CAPABILITY[0]}{CAPABILITY[1]} only"
    return plain_problem(q, k, v, is_causal, MAX_HEAD_DIM, {
        "a bias": bias is not None, "dropout": dropout, "softcap": softcap, "a replace mask": replace,
        "rope": rope, "dbias": need_dbias, "deterministic mode": deterministic})


def plain_problem(q, k, v, is_causal: bool, max_head_dim: int, features: dict) -> Optional[str]:
    """Why an ATen kernel for plain problems (cuDNN's, the flash forward: attention_flash.py)
    cannot run a call (None: it can): a dtype other than fp16 / bf16, head dims unequal, not
    multiples of 8 or above ``max_head_dim``, one of ``features`` ({what: present}), or causal
    with Lq != Lk (their causal masks are aligned otherwise than the op's top-left one)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype}"
    D, Dv = q.shape[-1], v.shape[-1]
    if D != Dv or D % 8 or D > max_head_dim:
        return f"head dims {D}/{Dv} (equal, multiples of 8 up to {max_head_dim})"
    for what, on in features.items():
        if on:
            return what
    if is_causal and q.shape[2] != k.shape[2]:
        return "causal with Lq != Lk"
    return None


def family(direction: str, q, k, v, bias, **flags) -> Optional[str]:
    """"cudnn" where cuDNN runs this call (eligible and at least ``*_MIN_LEN`` long), else None."""
    least = FWD_MIN_LEN if direction == "fwd" else BWD_MIN_LEN
    # A family boundary: with dynamic shapes a guard (a recompile across it), so that a graph
    # traced at one length does not keep the slower family at another (launch.hint).
    if q.shape[2] < least or k.shape[2] < least:
        return None
    return "cudnn" if why_not(q, k, v, bias, **flags) is None else None


def forward(q, k, v, is_causal: bool, scale: float, need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, Lq, Dv) in q's stride order and lse (B, Hq, Lq) fp32 (natural log); without
    ``need_lse`` (an inference call where the choice table measured it faster:
    choice_table.lse_free) cuDNN computes none and the returned lse is uninitialised."""
    res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, bool(need_lse), 0.0, bool(is_causal), False,
                                                   scale=float(scale))
    if not need_lse:
        return res[0], host.empty(tuple(q.shape[:3]), torch.float32, q.device)
    lse = res[1]
    return res[0], lse.view(lse.shape[:3])


def backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """dq, dk, dv in q's / k's / v's stride order."""
    B, H, L = lse.shape
    # read only with dropout (ATen's run_cudnn_SDP_bprop); one element, not 0-d: Inductor lowers
    # an empty tensor with dims to no kernel, a 0-d one to a fill kernel of its own (one launch
    # per site in a compiled backward: 12 in DeiT-III-S's, H100 wrapper, stop 49)
    seed = torch.empty((1,), dtype=torch.long, device=q.device)
    return aten._scaled_dot_product_cudnn_attention_backward(
        # (contiguous: the other families read an lse through its strides, cuDNN's as it is laid out)
        dout, q, k, v, out, lse.contiguous().view(B, H, L, 1), seed, seed, None, None, None, q.shape[2],
        k.shape[2], 0.0, bool(is_causal), scale=float(scale))
