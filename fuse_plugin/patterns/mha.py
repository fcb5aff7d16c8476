"""`nn.MultiheadAttention` → projections around `fuse_plugin::attention`.

Dynamo keeps `F.multi_head_attention_forward` as one node (it does not trace into it), so the
attention inside is out of the softmax matcher's sight. With `need_weights=True` (the default, e.g.
SigLIP's attention-pooling head) that function computes the weights explicitly — baddbmm(mask, q·s,
kᵀ), softmax, dropout, bmm — and also returns them averaged over the heads; where the caller drops
them (`mha(q, k, v)[0]`), that is an attention we can replace:

    q, k, v = linear(query, W_q, b_q), linear(key, W_k, b_k), linear(value, W_v, b_v)   (L, N, E)
    q, k, v → (N, H, L, D);  out = attention(q, k, v, mask, dropout_p if training, False, D**-0.5)
    result = linear(out → (L, N, E), W_out, b_out)

Masks as F.multi_head_attention_forward reads them: `key_padding_mask` (N, S) and `attn_mask`
(L, S) or (N·H, L, S), bool (True = not attended) or float (added); bool ones alone become one
bool keep mask (rows masked everywhere: NaN, as in eager), any float one makes them all additive
(bool → -inf, as eager converts them).

Left as written (reported with the reason, `choice.decide_mha`): off CUDA, or with
FUSE_PLUGIN_SITE_CHOICE=inductor. Left alone (a near miss with the reason): the weights used,
unbatched inputs, bias_k / bias_v, add_zero_attn, separate projection weights, static k/v,
is_causal, a head dim outside the kernels'.
"""
from __future__ import annotations

import inspect
import logging
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from ..inductor_attention import mark_as_stock
from ..ops import attention as _attention_op  # noqa: F401  (registers the op)
from . import choice
from .canon import dtype, example_value, shape, size_in_range
from .graph_edit import NodeBuilder, erase_dead, graph_fake_mode
from .report import Report

log = logging.getLogger(__name__)

KIND = "attention"
ATTENTION_OP = torch.ops.fuse_plugin.attention.default
_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
HEAD_DIM_RANGE = (16, 256)


def _bound(node: fx.Node):
    try:
        b = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    b.apply_defaults()
    return b.arguments


def _is_mha(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.multi_head_attention_forward


def _output_user(node: fx.Node):
    """The getitem(node, 0) that takes the attention output, or why the node cannot be replaced
    (the weights, getitem 1, used)."""
    out = None
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1):
            return "the result of multi_head_attention_forward is used as a whole"
        if u.args[1] == 1 and u.users:
            return "the attention weights are used (need_weights=True and read)"
        if u.args[1] == 0:
            if out is not None:
                return "the attention output is read twice"
            out = u
    return out if out is not None else "the attention output is not used"


def _mask_kind(m) -> str | None:
    dt = dtype(m)
    if dt is None:
        return None
    return "bool" if dt == torch.bool else ("float" if dt.is_floating_point else None)


def match(node: fx.Node):
    """(bound arguments, output getitem) or a reason."""
    a = _bound(node)
    if a is None:
        return "multi_head_attention_forward with arguments we do not know"
    out = _output_user(node)
    if isinstance(out, str):
        return out
    q, k, v = a["query"], a["key"], a["value"]
    if not all(isinstance(t, fx.Node) and shape(t) is not None and len(shape(t)) == 3 for t in (q, k, v)):
        return "unbatched (2-D) or unknown query/key/value"
    for name in ("bias_k", "bias_v", "static_k", "static_v", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        if a[name] is not None:
            return f"multi_head_attention_forward with {name}"
    if a["add_zero_attn"] is not False or a["use_separate_proj_weight"] is not False:
        return "add_zero_attn or separate projection weights"
    if a["is_causal"] is not False:
        return "is_causal=True (the mask is then a hint that F.multi_head_attention_forward reads its own way)"
    if not isinstance(a["dropout_p"], (int, float)) or not isinstance(a["training"], bool):
        return "dropout with a non-constant p or training flag"
    p = float(a["dropout_p"]) if a["training"] else 0.0
    if not 0 <= p < 1:
        return f"dropout p={p} (the op takes 0 <= p < 1)"
    e, h = a["embed_dim_to_check"], a["num_heads"]
    if not isinstance(e, int) or not isinstance(h, int) or h <= 0 or e % h:
        return "embed dim or head count not constant ints"
    if not isinstance(a["in_proj_weight"], fx.Node) or shape(a["in_proj_weight"]) != (3 * e, e):
        return "in_proj_weight is not a (3E, E) tensor"
    if not (isinstance(shape(q)[2], int) and shape(q)[2] == e):
        return "query's last dim is not the embed dim"
    if dtype(q) not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"dtype {dtype(q)}"
    if not size_in_range(e // h, *HEAD_DIM_RANGE):
        return f"head dim {e // h} outside the kernel's [{HEAD_DIM_RANGE[0]}, {HEAD_DIM_RANGE[1]}]"
    kpm, am = a["key_padding_mask"], a["attn_mask"]
    if kpm is not None and (not isinstance(kpm, fx.Node) or _mask_kind(kpm) is None or len(shape(kpm)) != 2):
        return "key_padding_mask that is not a (N, S) bool or float tensor"
    if am is not None and (not isinstance(am, fx.Node) or _mask_kind(am) is None or len(shape(am)) not in (2, 3)):
        return "attn_mask that is not a 2-D or 3-D bool or float tensor"
    return a, out, p


def replace(gm: fx.GraphModule, node: fx.Node, a: dict, out: fx.Node, p: float, fake_mode) -> str:
    b = NodeBuilder(gm.graph, node, node, fake_mode)
    e, h = a["embed_dim_to_check"], a["num_heads"]
    d = e // h
    try:
        ws = b.method("chunk", a["in_proj_weight"], 3)
        ws = [b.function(operator.getitem, ws, i) for i in range(3)]
        bs = [None] * 3
        if a["in_proj_bias"] is not None:
            bs = b.method("chunk", a["in_proj_bias"], 3)
            bs = [b.function(operator.getitem, bs, i) for i in range(3)]
        heads = []
        for x, w, bias in zip((a["query"], a["key"], a["value"]), ws, bs):
            y = b.function(F.linear, x, w, bias)  # (L, N, E)
            y = b.method("unflatten", y, -1, (h, d))  # (L, N, H, D)
            heads.append(b.method("permute", y, 1, 2, 0, 3))  # (N, H, L, D)
        q4, k4, v4 = heads
        mask, kind = _mask(b, a, h, dtype(a["query"]))
        seed = ()
        if p:
            seed = (b.factory(a["query"], torch.randint, 0, 2**62, (), dtype=torch.int64,
                              device=example_value(a["query"]).device),)
        op = b.function(ATTENTION_OP, q4, k4, v4, mask, p, False, 1.0 / math.sqrt(d), *seed)
        o = b.function(operator.getitem, op, 0)  # (N, H, L, D)
        o = b.method("flatten", b.method("permute", o, 2, 0, 1, 3), 2)  # (L, N, E)
        res = b.function(F.linear, o, a["out_proj_weight"], a["out_proj_bias"])
    except Exception:
        b.rollback()
        raise
    out.replace_all_uses_with(res)
    erase_dead(gm.graph, [out, node] + [u for u in node.users], with_dead_inputs=False)
    parts = [f"nn.MultiheadAttention ({h} heads of {d})", f"scale={1 / math.sqrt(d):.6g}"]
    if kind:
        parts.append(f"bias: {kind}")
    if p:
        parts.append(f"dropout p={p:g} in the kernel")
    return ", ".join(parts)


def _mask(b: NodeBuilder, a: dict, h: int, qdtype):
    """The op's attn_bias from key_padding_mask and attn_mask, as F.multi_head_attention_forward
    combines them; (node or None, description)."""
    parts = []  # (node broadcasting to (N, H, L, S), kind)
    kpm, am = a["key_padding_mask"], a["attn_mask"]
    if kpm is not None:
        parts.append((b.method("unsqueeze", b.method("unsqueeze", kpm, 1), 1), _mask_kind(kpm)))  # (N, 1, 1, S)
    if am is not None:
        if len(shape(am)) == 3:  # (N·H, L, S), as F.multi_head_attention_forward requires → (N, H, L, S)
            am = b.method("unflatten", am, 0, (-1, h))
        parts.append((am, _mask_kind(am)))
    if not parts:
        return None, ""
    if all(k == "bool" for _, k in parts):
        keep = None
        for m, _ in parts:
            kept = b.function(torch.logical_not, m)
            keep = kept if keep is None else b.function(torch.logical_and, keep, kept)
        return keep, "bool mask"
    bias = None
    fdt = torch.float64 if qdtype == torch.float64 else torch.float32
    for m, k in parts:
        if k == "bool":
            t = b.function(torch.where, m, b.factory(m, torch.scalar_tensor, float("-inf"), dtype=fdt,
                                                     device=example_value(m).device), 0.0)
        else:
            t = m
        bias = t if bias is None else b.function(operator.add, bias, t)
    return bias, "additive mask"


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    nodes = [n for n in gm.graph.nodes if _is_mha(n)]
    if not nodes:
        return
    fake_mode = graph_fake_mode(gm)
    for n in nodes:
        try:
            r = match(n)
            if isinstance(r, str):
                report.missed(KIND, n, r)
                continue
            decision = choice.decide_mha(example_value(r[0]["query"]))
            if not decision.ours:
                if decision.as_stock:
                    mark_as_stock(n)
                report.left_as_is(KIND, n, decision.reason)
                continue
            detail = replace(gm, n, *r, fake_mode)
            report.replaced(KIND, n, detail)
        except Exception as e:  # noqa: BLE001  (never break compile: leave this site as it was)
            log.warning("fuse_plugin: nn.MultiheadAttention at %s left unfused after an internal error", n.name,
                        exc_info=True)
            report.missed(KIND, n, f"internal error, left unfused: {type(e).__name__}: {e}")
