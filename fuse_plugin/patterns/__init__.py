"""The graph rewrite: find attention and rotary subgraphs in a Dynamo FX graph and replace them.

`rewrite(gm)` runs on the graph Dynamo hands to a backend (before AOTAutograd), in place, and on
every subgraph its higher-order ops hold (activation checkpointing, invoke_subgraph, cond, ...),
and returns a `Report` (sites name the subgraph they are in). Rotary runs first, so that attention sees the rotary ops feeding q and k; then
a rotary q+k pair that feeds only an attention is folded into it (`rope_attention`).

    mha.py             nn.MultiheadAttention (one F.multi_head_attention_forward node) → projections + attention
    batch_views.py     views of the scores' batch dims between q·kᵀ and the softmax; masks carried across them
    attention.py       the attention recogniser (q·kᵀ, the chain to the softmax, w·v, GQA; replace)
    sdpa.py            F.scaled_dot_product_attention calls read as attention sites (our op where measured faster)
    choice.py          our op or the site left as it is (to Inductor / as SDPA), from the measured choice table
    rope_attention.py  rotary_qk → attention becomes one rope_attention (rotation in the kernel)
    attention_bias.py  the scale and masks of the scores → scale, is_causal, one bias (+ replace mask)
    causal_mask.py     abstract interpreter over mask-building nodes: proves a mask causal
    rotary.py          the rotary recogniser (spellings, partial rotary, casts, q+k pairs; replace)
    rotary_tables.py   the cos/sin tables a rotary site reads (full width → half width)
    canon.py           one canonical Call per operation, metadata, SymInt-safe sizes, casts
    indexing.py        last-dim slices and indices, flatten of the last two dims
    graph_edit.py      new nodes with source lines and example values; erasing dead nodes
    writes.py          in-place writes and the order of reads (KV caches, in-place fills): may an op
                       placed at the output read its inputs there
    report.py          what a rewrite did: fused sites and near misses
"""
from __future__ import annotations

import logging

import torch
from torch import fx
from torch._dynamo.utils import counters

from .. import settings
from .report import Miss, Report, Site

log = logging.getLogger(__name__)

__all__ = ["rewrite", "Report", "Site", "Miss"]


def rewrite(gm: fx.GraphModule) -> Report:
    """Rewrite `gm` and every subgraph its higher-order ops hold (see `subgraphs`), in place."""
    report = Report(graphs=1)
    _rewrite_tree(gm, report, "", set())
    for kind in ("attention", "sdpa", "rotary", "rope_attention"):
        if report.count(kind):
            counters["fuse_plugin"][kind] += report.count(kind)
    for m in report.left:
        counters["fuse_plugin"][f"{m.kind}_left"] += 1
    for s in report.sites:
        log.info("fused %s at %s%s: %s", s.kind, s.source, f" [in {s.graph}]" if s.graph else "", s.detail)
    for m in report.left:
        log.info("left %s at %s%s: %s", m.kind, m.source, f" [in {m.graph}]" if m.graph else "", m.reason)
    for m in report.misses:
        log.debug("not fused %s at %s%s: %s", m.kind, m.source, f" [in {m.graph}]" if m.graph else "", m.reason)
    return report


def _rewrite_graph(gm: fx.GraphModule, report: Report) -> None:
    from . import attention, mha, rope_attention, rotary, sdpa  # the pattern modules import the ops

    fused = len(report.sites)
    mha.rewrite(gm, report)  # nn.MultiheadAttention: one node in Dynamo's graph (patterns/mha.py)
    rotary.rewrite(gm, report)
    attention.rewrite(gm, report)
    sdpa.rewrite(gm, report)
    if settings.rope_attention_enabled():
        rope_attention.rewrite(gm, report)
    if len(report.sites) > fused:
        gm.graph.lint()
        gm.recompile()


# The higher-order ops whose subgraphs are walked. Their bodies run as ordinary graphs, forward and
# backward (AOTAutograd traces through them; checkpointing recomputes its body in the backward, with
# the random ops' seeds replayed), so our ops with their autograd behave there as at top level.
_WALKED_HOPS = frozenset({"tag_activation_checkpoint", "wrap_activation_checkpoint", "invoke_subgraph", "wrap"})
# Walked only where nothing needs a gradient: `cond`'s backward is itself a cond, which requires both
# branches' gradients in the same layout (stride order); our ops' backward gives contiguous
# gradients where the other branch's matmul backward may give transposed ones, and the compile
# would fail ("The sorted order of strides of the two branches' output doesn't match").
_INFERENCE_ONLY_HOPS = frozenset({"cond"})
# Left without a word: flex attention's score_mod / mask_mod are per-element functions that Inductor
# inlines into its kernel (nothing of ours can go there).
_QUIET_HOPS = frozenset({"flex_attention", "flex_attention_backward"})


def _needs_grad(node: fx.Node) -> bool:
    """Does the op's result require a gradient (unknown counts as yes)?"""
    value = node.meta.get("example_value")
    if value is None:
        return True
    leaves = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def subgraphs(gm: fx.GraphModule, report: Report | None = None):
    """The GraphModules that the higher-order ops of `gm` call, as (attribute, op name, module).

    Dynamo lifts each subgraph (activation checkpointing's `tag_activation_checkpoint` body, the body
    of `invoke_subgraph` / `torch.compiler.nested_compile_region`, `cond`'s branches, ...) into a
    GraphModule attribute that the op reads through a get_attr node. Their nodes carry
    `example_value` like the top-level graph's (both are built by Dynamo's tracer), which is what
    the matchers read; a node without it makes a matcher refuse, never guess. Subgraphs of ops not
    walked (see _WALKED_HOPS) are reported as near misses of kind "subgraph"."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        op = node.target.name()
        held: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), held.append)
        subs = [(a.target, _get_attr(gm, a.target)) for a in held if a.op == "get_attr"]
        subs = [(attr, sub) for attr, sub in subs if isinstance(sub, fx.GraphModule)]
        if not subs or op in _QUIET_HOPS:
            continue
        if op in _INFERENCE_ONLY_HOPS and _needs_grad(node):
            if report is not None:
                report.missed("subgraph", node, f"{op} in training: its backward needs both branches' gradients "
                                                f"in one layout, which the ops' backward does not promise; left alone")
            continue
        if op not in _WALKED_HOPS | _INFERENCE_ONLY_HOPS:
            if report is not None:
                report.missed("subgraph", node, f"the subgraph(s) of {op} are not walked (not known to be safe)")
            continue
        for attr, sub in subs:
            yield attr, op, sub


def _get_attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _rewrite_tree(gm: fx.GraphModule, report: Report, where: str, seen: set[int]) -> None:
    """Rewrite gm, then each subgraph once (a body called by several ops, e.g. a nested compile
    region used by every layer, is one module: rewritten once, counted once), depth first."""
    report.where = where
    _rewrite_graph(gm, report)
    for attr, op, sub in list(subgraphs(gm, report)):
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        report.walked_subgraphs += 1
        _rewrite_tree(sub, report, f"{where} > {attr} ({op})" if where else f"{attr} ({op})", seen)
    report.where = where
