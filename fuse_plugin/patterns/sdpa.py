"""SDPA call sites: `F.scaled_dot_product_attention` in the Dynamo graph, read as the attention it is.

Most attention code people run does not spell attention out: HF transformers' default
`attn_implementation="sdpa"`, timm's fused path, diffusers, torchtune and nanoGPT call SDPA. A call

    out = sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)

is read as a plan for our op (attention.AttentionSite, built by attention.replace):

* q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), any strides (a (B, L, H, D) projection
  seen transposed). k/v repeated for GQA before the call (HF's `repeat_kv`, `repeat_interleave`:
  attention._unrepeat_kv) are read un-repeated, as with `enable_gqa=True`.
* attn_mask: bool (True = attend) or additive float, broadcast to the scores however it is: the
  op's bias as it is (a bool mask proven top-left causal becomes `is_causal`; a float mask keeps
  its gradient); `is_causal` as it is (SDPA's is top-left, as ours); `scale=None`: 1/sqrt(D).
* Rows whose every key is masked: 0, what SDPA gives (torch 2.11 and 2.13: its math backend's
  `_safe_softmax`); our op's lse is -inf there and the rewrite puts 0 in those rows (wherever a
  mask stays in the bias, or the band it became can leave a row no key: `_band_empties_rows`).
* dropout_p > 0: the op drops weights with its own random mask (a different draw from SDPA's, as
  for hand-written dropout); its backward redraws the same one.

A matched call becomes our op only where our op was measured faster than SDPA for its class
(choice.decide_sdpa); otherwise it stays SDPA and `explain` says why. `FUSE_PLUGIN_SITE_CHOICE=ours`
takes every site (CI's CPU tests), `FUSE_PLUGIN_SDPA_SITES=off` leaves SDPA calls unread.
"""
from __future__ import annotations

import math
from typing import Any, Union

import torch
from torch import fx

import logging

from .. import settings
from . import attention, bias_table, choice
from .attention import HEAD_DIM_RANGE, AttentionSite, _autocast_dtype, _Operand, _unrepeat_kv
from .attention_bias import causal_or_bias, read_masks
from .canon import call_of, dtype, example_value, fmt_shape, known_equal, same_shape, shape, size_in_range
from .causal_mask import constant_number
from .graph_edit import graph_fake_mode
from .report import Report
from .writes import graph_order, write_between

log = logging.getLogger(__name__)

KIND = "sdpa"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_sdpa(node: Any) -> bool:
    c = call_of(node)
    return c is not None and c.name == "sdpa"


def match_sdpa(node: fx.Node) -> Union[AttentionSite, str]:
    """The plan for the SDPA call `node`, or why it cannot be our op. Touches no graph."""
    c = call_of(node)
    flags = _flags(c)
    if isinstance(flags, str):
        return flags
    dropout_p, is_causal, scale, enable_gqa = flags
    q, k, v = (_Operand(c[name]) if isinstance(c[name], fx.Node) else None for name in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return "q, k or v is not a tensor of the graph"
    cast = _autocast_dtype([getattr(example_value(x.node), "dtype", None) for x in (q, k, v)], (node,))
    sizes = _sizes(q, k, v, node, cast)
    if isinstance(sizes, str):
        return sizes
    B, Hq, Lq, D, Hkv, Lk, Dv = sizes
    groups, repeated = 1, False
    if enable_gqa:
        if not isinstance(Hq, int) or not isinstance(Hkv, int) or Hkv == 0 or Hq % Hkv:
            return f"enable_gqa with {Hq} query heads over {Hkv} kv heads"
        groups = Hq // Hkv
    elif not known_equal(Hq, Hkv):
        return f"{Hq} query heads against {Hkv} kv heads without enable_gqa (SDPA would refuse it)"
    else:
        uk, uv = _unrepeat_kv(k), _unrepeat_kv(v)
        if uk is not None and uv is not None and uk[1] == uv[1] and known_equal(shape(uk[0])[1], shape(uv[0])[1]):
            k, v, groups, repeated = _Operand(uk[0]), _Operand(uv[0]), uk[1], True
    masks = _masks(c["attn_mask"], is_causal, (B, Hq, Lq, Lk), Lq, Lk)
    if isinstance(masks, str):
        return masks
    bias_parts, is_causal, causal_note, notes, window, chunk, documents, _ = masks  # (no dead rows: dead_rows off)
    inputs = [q.node, k.node, v.node] + [p.node if hasattr(p, "node") else p.mask for p in bias_parts]
    if documents is not None:
        inputs.append(documents)
    why = write_between(inputs, [node], node, graph_order(node.graph))  # read where the call stands
    if why is not None:
        return why
    return AttentionSite(
        softmax=node, scores=node, output=node, q=q, k=k, v=v, rank=4,
        scale=scale if scale is not None else 1.0 / math.sqrt(D), scale_nodes=[],
        bias_parts=bias_parts, is_causal=is_causal, causal_note=causal_note, kv_groups=groups,
        softcap=0.0, out_ops=(), matched=[node], notes=["an SDPA call"] + notes, dropout_p=dropout_p,
        safe=bool(bias_parts) or _band_empties_rows(Lq, Lk, window, chunk, documents), cast=cast, window=window,
        chunk=chunk, documents=documents,
        kv_repeated=repeated)


def _band_empties_rows(Lq, Lk, window: int, chunk: int, documents) -> bool:
    """Can the band the mask became (top-left causal with a window, chunks or documents) leave a
    query row no key? Then SDPA gives 0 there and our op NaN, so the rewrite zeroes those rows (as
    for a mask kept in the bias). Only with more queries than keys: row i sees keys
    max(0, i - W + 1)..min(i, Lk - 1) with a window (none from row Lk + W - 1 on), its chunk's from
    C * (i // C) (none once that passes Lk); with Lq == Lk every row keeps its own key. Symbolic
    lengths count as possible (found by tests/fuzz_attention.py, seed 14956: Lq 5, Lk 3, W 2)."""
    if not (window or chunk or documents is not None):
        return False
    if not isinstance(Lq, int) or not isinstance(Lk, int):
        return True
    if documents is not None and Lq != Lk:
        return True
    if window and Lq >= Lk + window:
        return True
    return bool(chunk) and chunk * ((Lq - 1) // chunk) >= Lk


def _flags(c) -> Union[tuple, str]:
    """(dropout_p, is_causal, scale or None, enable_gqa) as constants, or why not."""
    dropout_p = constant_number(c["dropout_p"])
    if dropout_p is None or not 0.0 <= dropout_p < 1.0:
        return f"dropout_p={c['dropout_p']!r} (a constant in [0, 1) is taken)"
    if not isinstance(c["is_causal"], bool) or not isinstance(c["enable_gqa"], bool):
        return "is_causal / enable_gqa not constant"
    scale = c["scale"]
    if scale is not None:
        scale = constant_number(scale)
        if scale is None or not math.isfinite(scale):
            return f"scale={c['scale']!r} (a constant is taken)"
    return float(dropout_p), c["is_causal"], scale, c["enable_gqa"]


def _sizes(q: _Operand, k: _Operand, v: _Operand, node: fx.Node, cast=None) -> Union[tuple, str]:
    """(B, Hq, Lq, D, Hkv, Lk, Dv) of 4-D q/k/v of one dtype (or any, autocast casting them to
    `cast`), or why not."""
    vals = [example_value(x.node) for x in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in vals):
        return "q/k/v have no tensor metadata"
    qv, kv, vv = vals
    if not (qv.dim() == kv.dim() == vv.dim() == 4):
        return f"q, k, v of ranks {qv.dim()}, {kv.dim()}, {vv.dim()} (4-D (B, H, L, D) is taken)"
    if cast is None and (not (qv.dtype == kv.dtype == vv.dtype) or qv.dtype not in _DTYPES):
        return f"q, k, v dtypes {qv.dtype}, {kv.dtype}, {vv.dtype}"
    B, Hq, Lq, D = qv.shape
    Bk, Hkv, Lk, Dk = kv.shape
    if not (known_equal(Bk, B) and known_equal(Dk, D) and same_shape(vv.shape[:3], kv.shape[:3])):
        return f"q, k, v shapes do not fit attention: {fmt_shape(qv.shape)}, {fmt_shape(kv.shape)}, {fmt_shape(vv.shape)}"
    Dv = vv.shape[3]
    for name, val in (("D", D), ("Dv", Dv)):
        if not size_in_range(val, *HEAD_DIM_RANGE):
            return f"head dim {name}={val} outside the kernel's [{HEAD_DIM_RANGE[0]}, {HEAD_DIM_RANGE[1]}]"
    out = example_value(node)
    if not isinstance(out, torch.Tensor) or not same_shape(out.shape, (B, Hq, Lq, Dv)):
        return "the call's output is not (B, Hq, Lq, Dv)"
    return B, Hq, Lq, D, Hkv, Lk, Dv


def _masks(mask: Any, is_causal: bool, scores: tuple, Lq, Lk) -> Union[tuple, str]:
    """(bias parts, is_causal, how causal was found, notes) of attn_mask (attention_bias), or why
    not. A bool mask is a keep mask (a -inf fill where False), a float one an additive term."""
    if mask is None:
        return [], is_causal, "is_causal=True" if is_causal else "", [], 0, 0, None, None
    if is_causal:
        return "attn_mask and is_causal=True together (SDPA refuses them)"
    if not isinstance(mask, fx.Node) or dtype(mask) is None:
        return "attn_mask is not a tensor of the graph"
    if dtype(mask) == torch.bool:
        op = ("fill", mask, False, -math.inf)
    elif dtype(mask).is_floating_point:
        op = ("add", mask, False)
    else:
        return f"attn_mask of dtype {dtype(mask)}"
    r = read_masks([op], scores, Lq, Lk)
    if isinstance(r, str):
        return r
    return causal_or_bias(r)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    """Every SDPA call in gm: our op where the choice takes it (choice.decide_sdpa), else left as
    it is; each reported (fused, left with the measurement, or not read with the reason)."""
    if not settings.sdpa_sites():
        return
    calls = [n for n in gm.graph.nodes if is_sdpa(n) and not n.meta.get(attention.EMITTED)]
    ctx: dict = {"fake_mode": graph_fake_mode(gm)}
    for node in calls:
        try:
            site = match_sdpa(node)
            if isinstance(site, str):
                report.missed(KIND, node, site)
                continue
            decision = choice.decide_sdpa(site)
            gathers = bias_table.gathers_of(site)  # (a gathered table as attn_mask: BEiT's fused path)
            if not decision.ours:
                report.left_as_is(KIND, node, decision.reason + bias_table.swap(gm, gathers, ctx))
                continue
            detail = attention.replace(gm, site, ctx) + bias_table.swap(gm, gathers, ctx)
            report.replaced(KIND, node, detail + (f"; {decision.reason}" if decision.reason else ""))
        except Exception as e:  # noqa: BLE001  (never break compile: leave this call as it was)
            log.warning("fuse_plugin: SDPA call %s left as it is after an internal error", node.name, exc_info=True)
            report.missed(KIND, node, f"internal error, left as it is: {type(e).__name__}: {e}")
