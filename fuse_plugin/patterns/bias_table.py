"""A trained bias table read through an index: its gather becomes `fuse_plugin::table_gather`.

LeViT's attention biases (``table[:, idx]``, table (H, N)) and the relative-position tables of
Swin and BEiT (``table[idx.view(-1)]``, table (M, H), then viewed and permuted) build an attention
site's bias by gathering a learned table. Autograd's gradient of that gather, compiled, adds in
bf16 with contended atomics: up to 1.8 ms of GPU per site and step on an H100, where the
op's float32 scatter-add takes ~10 us (ops/table_gather.py has the figures). The rewrite puts
the op in place of such a gather when the site is trained, whatever the site's decision (our op,
an SDPA call or Inductor): the values are the same, only the gradient's kernel changes.

What counts (`find`): from each additive bias term of the site, back through views, permutes,
casts and copies of one tensor, a ``getitem`` whose
  * source is a parameter that requires grad (a float table; not a DTensor: the op's sharding
    rule takes Replicate() only, and a sharded table's gather stays as it is), and
  * index is ``(:, ..., :, idx)`` (full slices, then one integer tensor of static shape: int64 or
    int32, not bool), or ``idx`` alone;
under no_grad (or a frozen table) nothing changes: the forward is the same either way. SDPA call
sites (patterns/sdpa.py) get the same for their ``attn_mask`` (timm's BEiT on its default fused
path passes its gathered table there).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from .. import settings
from .attention_bias import BiasTerm
from .bias_source import _name, _parameter
from .canon import example_value
from .graph_edit import NodeBuilder

# methods and functions of one tensor that move or copy values (a gather's way to a bias term)
_THROUGH = {"view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "expand", "contiguous", "clone",
            "flatten", "float", "to", "type", "bfloat16", "half"}
_MAX_STEPS = 16


@dataclass
class Gather:
    node: fx.Node  # the getitem
    table: fx.Node
    index: fx.Node
    dim: int


def _static(v) -> bool:
    return isinstance(v, torch.Tensor) and all(type(s) is int for s in v.shape)


def _is_dtensor(v) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (no torch.distributed)
        return False
    return isinstance(v, DTensor)


def as_gather(node: fx.Node) -> Optional[Gather]:
    """The gather of a trained table by an integer index that ``node`` is, if it is one."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    table, key = node.args
    if not isinstance(table, fx.Node) or table.op != "placeholder" or not _parameter(table):
        return None
    tv = example_value(table)
    if not isinstance(tv, torch.Tensor) or not tv.is_floating_point() or not tv.requires_grad \
            or _is_dtensor(tv) or not _static(tv):
        return None
    key = key if isinstance(key, tuple) else (key,)
    *lead, index = key
    if not all(isinstance(s, slice) and s == slice(None) for s in lead) or len(lead) >= tv.dim():
        return None
    iv = example_value(index) if isinstance(index, fx.Node) else None
    if iv is None or not _static(iv) or iv.dtype not in (torch.int64, torch.int32) or iv.device != tv.device:
        return None
    if not _static(example_value(node)):
        return None
    return Gather(node, table, index, len(lead))


def find(site, trained: bool) -> list[Gather]:
    """The gathers of trained tables that build the site's additive bias terms (module doc);
    none unless ``trained`` (choice.needs_grad)."""
    if not trained:
        return []
    found = []
    for part in site.bias_parts:
        if not isinstance(part, BiasTerm):
            continue
        n = part.node
        for _ in range(_MAX_STEPS):
            g = as_gather(n)
            if g is not None:
                found.append(g)
                break
            if n.op not in ("call_function", "call_method") or _name(n) not in _THROUGH:
                break
            inputs = [a for a in n.all_input_nodes if isinstance(example_value(a), torch.Tensor)]
            if len(inputs) != 1:
                break
            n = inputs[0]
    return found


def replace(gm: fx.GraphModule, gathers: list[Gather], fake_mode=None) -> int:
    """Put ``fuse_plugin::table_gather`` in place of each gather still in the graph; the count."""
    done = 0
    for g in gathers:
        if g.node.graph is not gm.graph or g.node.target is not operator.getitem or not g.node.users:
            continue  # (replaced already through another site, or erased)
        b = NodeBuilder(gm.graph, g.node, g.node, fake_mode)
        new = b.function(torch.ops.fuse_plugin.table_gather.default, g.table, g.index, g.dim)
        g.node.replace_all_uses_with(new)
        gm.graph.erase_node(g.node)
        done += 1
    return done


DETAIL = "bias table gathered by fuse_plugin.table_gather (its gradient added in float32)"


def gathers_of(site) -> list[Gather]:
    """`find` for a matched site (hand-written or an SDPA call), before anything is replaced;
    none with FUSE_PLUGIN_SITE_CHOICE=inductor (every site left as it is) or off CUDA, where the
    op is an opaque call and the gradient it mends is unmeasured (choice.off_cuda)."""
    from . import choice  # (choice's module imports nothing of this one; kept late like attention's)

    if settings.site_choice() == "inductor" or choice.off_cuda(site.q.value()) is not None:
        return []
    return find(site, choice.needs_grad(site))


def swap(gm: fx.GraphModule, gathers: list[Gather], ctx: dict) -> str:
    """`replace`, after the site's decision was carried out; the report's words ("" for none)."""
    return f"; {DETAIL}" if replace(gm, gathers, ctx.get("fake_mode")) else ""
