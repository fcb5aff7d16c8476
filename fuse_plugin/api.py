"""Public functions with SDPA-like and flash-attn-like signatures; they check their input and call the ops."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .ops import attention as _attention_op  # noqa: F401  (registers the ops)
from .ops import rotary as _rotary_op

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def _check_tensor(name: str, t, ndim: int | None, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {tuple(t.shape)}")


def _check_same(names: tuple[str, ...], tensors: tuple[Tensor, ...], attr: str) -> None:
    values = [getattr(t, attr) for t in tensors]
    if any(v != values[0] for v in values):
        got = ", ".join(f"{n}: {v}" for n, v in zip(names, values))
        raise ValueError(f"{'/'.join(names)} must have the same {attr}, got {got}")


def _broadcasts_to(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax(q·kᵀ·scale + mask [causal]) · v, like `F.scaled_dot_product_attention`.

    Runs the Triton kernels on CUDA (the CPU reference elsewhere) and has a backward for every
    floating-point input (q, k, v and an additive mask). GQA is native: k/v are never repeated.

    Args:
        q: (B, Hq, Lq, D), float16 / bfloat16 / float32 / float64; D ≤ 256.
        k: (B, Hkv, Lk, D), q's dtype and device; Hq a multiple of Hkv (GQA / MQA).
        v: (B, Hkv, Lk, Dv), q's dtype and device; Dv ≤ 256 (may differ from D).
        attn_mask: None, or broadcastable to (B, Hq, Lq, Lk): bool (True = attend) or an additive
            float bias (its gradient is returned too). May be combined with ``is_causal``.
        dropout_p: in [0, 1): attention weights dropped inside the kernels, by a mask drawn from
            torch's RNG (``torch.manual_seed`` repeats it); applied in training and eval alike, as
            SDPA does.
        is_causal: key j visible to query i iff j ≤ i, top-left aligned as SDPA's (also when
            Lq ≠ Lk: a KV-cache decode step needs an explicit mask).
        scale: the factor of q·kᵀ; None: 1/sqrt(D).

    Returns:
        out (B, Hq, Lq, Dv) in q's dtype, laid out (B, Lq, Hq, Dv) in memory like SDPA's
        flash/cuDNN outputs, so ``out.transpose(1, 2).reshape(B, Lq, Hq * Dv)`` is a view.

    Raises:
        TypeError / ValueError naming the argument, for shapes, dtypes or devices that do not fit.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4, "(B, H, L, D)")
    _check_same(("q", "k", "v"), (q, k, v), "dtype")
    _check_same(("q", "k", "v"), (q, k, v), "device")
    b, hq, lq, d = q.shape
    _, hkv, lk, _ = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"q, k, v must share the batch size B: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"k must have shape (B, Hkv, Lk, D) with q's head dim D={d}, got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have shape (B, Hkv, Lk, Dv) = ({b}, {hkv}, {lk}, Dv) like k, got {tuple(v.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's head count Hq={hq} must be a multiple of k/v's head count Hkv={hkv}")
    if d > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be at most {MAX_HEAD_DIM}: q/k have D={d}, v has Dv={v.shape[-1]}")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOATS:
            raise TypeError(f"attn_mask must be bool or a float dtype, got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on q's device {q.device}, got {attn_mask.device}")
        if not _broadcasts_to(tuple(attn_mask.shape), (b, hq, lq, lk)):
            raise ValueError(
                f"attn_mask must be broadcastable to (B, Hq, Lq, Lk) = {(b, hq, lq, lk)}, got {tuple(attn_mask.shape)}"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    # Like SDPA, dropout_p > 0 drops whether or not the module is training; a fresh seed per call
    # (the op checks dropout_p's range).
    seed = _attention_op.new_dropout_seed(q.device) if 0 < dropout_p < 1 else None
    out, _ = torch.ops.fuse_plugin.attention(
        q, k, v, attn_mask, float(dropout_p), bool(is_causal), float(scale), dropout_seed=seed
    )
    return out


def _rotary_dim(x: Tensor, cos: Tensor, rotary_dim: int | None) -> int:
    d, w = x.shape[-1], cos.shape[-1]
    if rotary_dim is None:
        # full-width tables (HF) cover the whole head; narrower ones are half width (flash-attn)
        if w != d and 2 * w > d:
            raise ValueError(
                f"cos/sin last dim W={w} must be D={d} (full width) or at most D/2={d // 2} (half width); "
                "pass rotary_dim for a partial rotary with full-width tables"
            )
        rotary_dim = d if w == d else 2 * w
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim must be an even int in (0, D={d}], got {rotary_dim}")
    if w not in (rotary_dim, rotary_dim // 2):
        raise ValueError(
            f"cos/sin last dim must be rotary_dim={rotary_dim} (full width) or {rotary_dim // 2} (half width), got {w}"
        )
    return rotary_dim


def _check_tables(xs: tuple[tuple[str, Tensor], ...], cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int | None) -> int:
    for name, t in xs:
        _check_tensor(name, t, None, "(..., D)")
        if t.dim() < 1:
            raise ValueError(f"{name} must have shape (..., D), got a 0-d tensor")
    _check_tensor("cos", cos, None, "(..., W)")
    _check_tensor("sin", sin, None, "(..., W)")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    _check_same(tuple(n for n, _ in xs) + ("cos", "sin"), tuple(t for _, t in xs) + (cos, sin), "device")
    x0 = xs[0][1]
    if any(t.shape[-1] != x0.shape[-1] for _, t in xs):
        raise ValueError("q and k must have the same head dim D")
    rd = _rotary_dim(x0, cos, rotary_dim)
    for name, t in xs:
        if not _broadcasts_to(tuple(cos.shape[:-1]), tuple(t.shape[:-1])):
            raise ValueError(
                f"cos/sin of shape {tuple(cos.shape)} must broadcast to {name}'s leading dims "
                f"{tuple(t.shape[:-1])} + (W,) (align them like the eager `{name} * cos`)"
            )
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    return rd


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, rotary_dim: int | None = None) -> Tensor:
    """Rotary embedding of x's last dim: ``x·cos + rotate(x)·sin`` on its first rotary_dim channels.

    Args:
        x: (..., D), any float dtype and memory layout (e.g. HF's (B, H, L, D) or flash-attn's
            (B, L, H, D)).
        cos, sin: (..., W), the same shape, broadcasting against x like the eager ``x * cos``
            (for x (B, L, H, D) pass (L, 1, W)); W = rotary_dim (full-width tables, HF) or
            rotary_dim / 2 (half width, flash-attn).
        interleaved: False rotates halves (NeoX / HF ``rotate_half``); True rotates adjacent pairs
            (GPT-J).
        rotary_dim: how many leading channels rotate (even, ≤ D); None: D for full-width tables,
            2·W for half-width ones. Channels past it pass through.

    Returns:
        x's shape, dtype promote(x, cos, sin) as eager; dense, its dims in x's memory order where x
        has a unit last stride (HF's transposed q/k stay (B, L, H, D) in memory), else contiguous.
    """
    rd = _check_tables((("x", x),), cos, sin, interleaved, rotary_dim)
    return _rotary_op.rotary(x, cos, sin, interleaved, rd)


def apply_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, rotary_dim: int | None = None) -> tuple[Tensor, Tensor]:
    """``apply_rotary`` of q and of k in one kernel launch (cos/sin read once per position).

    Args:
        q: (..., D), e.g. (B, Hq, L, D).
        k: (..., D), e.g. (B, Hkv, L, D): its head count may differ from q's (GQA), its head dim
            may not.
        cos, sin, interleaved, rotary_dim: as for ``apply_rotary``; the tables broadcast against
            both q and k.

    Returns:
        (q_rot, k_rot): each of its input's shape and layout, dtype promote(x, cos, sin).
    """
    rd = _check_tables((("q", q), ("k", k)), cos, sin, interleaved, rotary_dim)
    return _rotary_op.rotary_qk(q, k, cos, sin, interleaved, rd)
