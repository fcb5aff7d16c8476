"""HF transformers integration for users who do not compile:

    fuse_plugin.register_hf()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fuse_plugin")

registers our attention op as a transformers `AttentionInterface` (with SDPA's mask builder, so a
causal model without padding passes no mask at all and runs `is_causal`).
"""
from __future__ import annotations

import torch

from .api import attention

NAME = "fuse_plugin"


def fuse_plugin_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Same contract as transformers' ``sdpa_attention_forward`` (what ``register_hf`` registers).

    Args:
        module: the attention module (its ``training`` and ``is_causal`` are read).
        query: (B, Hq, L, D); key, value: (B, Hkv, S, D) and (B, Hkv, S, Dv), un-repeated (the op
            does GQA natively).
        attention_mask: None, or HF's 4-D mask (B or 1, 1, L, ≥ S), bool (True = attend) or
            additive float; a bool mask becomes finfo.min fills as HF's eager path masks.
        dropout: applied only while ``module.training``. scaling: the factor of q·kᵀ (None:
            1/sqrt(D)). is_causal: None reads ``module.is_causal``; used only without a mask.
        position_bias: T5's additive bias, added to the mask.

    Returns:
        (out, None): out (B, L, Hq, Dv) contiguous, and no attention weights.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='fuse_plugin' does not support softcap")
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and kv_len > q_len:  # as SDPA's path does: top-left causal over the first q_len keys
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        position_bias = None if position_bias is None else position_bias[..., :q_len]
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[2]]
        if mask.dtype == torch.bool:
            # HF's eager path masks with finfo.min, so a row with no visible key (a left-padded query)
            # gets uniform weights instead of the NaN a -inf mask gives.
            mask = torch.zeros((), dtype=query.dtype, device=mask.device).masked_fill(~mask, torch.finfo(query.dtype).min)
    if position_bias is not None:
        if mask is None:
            mask = position_bias
        else:
            mask = position_bias + mask
    p = dropout if module.training else 0.0
    out = attention(query, key, value, attn_mask=mask, dropout_p=p, is_causal=is_causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_hf() -> None:
    """Register ``attn_implementation="fuse_plugin"`` with transformers (needs transformers ≥ 5).

    After it, ``AutoModel*.from_pretrained(..., attn_implementation="fuse_plugin")`` (or
    ``model.set_attn_implementation("fuse_plugin")``) runs every attention of an HF model through
    ``fuse_plugin.attention`` without compiling, with SDPA's mask builder (a causal model without
    padding passes no mask and runs ``is_causal``). Idempotent.

    Args: none.

    Returns:
        None. Shapes at each call: q (B, Hq, L, D), k/v (B, Hkv, S, D) in, (B, L, Hq, Dv) out
        (``fuse_plugin_attention_forward``).

    Raises:
        ImportError: transformers ≥ 5 is not installed.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fuse_plugin.register_hf() needs transformers >= 5 installed") from e
    AttentionInterface.register(NAME, fuse_plugin_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
