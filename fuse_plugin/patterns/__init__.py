"""The graph rewrite: find attention and rotary subgraphs in a Dynamo FX graph and replace them.

`rewrite(gm)` runs on the graph Dynamo hands to a backend (before AOTAutograd), in place, and
returns a `Report`. Rotary runs first, so that attention sees the rotary ops feeding q and k; then
a rotary q+k pair that feeds only an attention is folded into it (`rope_attention`).

    attention.py       the attention recogniser (q·kᵀ, the chain to the softmax, w·v, GQA; replace)
    rope_attention.py  rotary_qk → attention becomes one rope_attention (rotation in the kernel)
    attention_bias.py  the scale and masks of the scores → scale, is_causal and one bias
    causal_mask.py     abstract interpreter over mask-building nodes: proves a mask causal
    rotary.py          the rotary recogniser (spellings, partial rotary, casts, q+k pairs; replace)
    rotary_tables.py   the cos/sin tables a rotary site reads (full width → half width)
    canon.py           one canonical Call per operation, metadata, SymInt-safe sizes, casts
    indexing.py        last-dim slices and indices, flatten of the last two dims
    graph_edit.py      new nodes with source lines and example values; erasing dead nodes
    report.py          what a rewrite did: fused sites and near misses
"""
from __future__ import annotations

import logging

from torch import fx
from torch._dynamo.utils import counters

from .. import settings
from .report import Miss, Report, Site

log = logging.getLogger(__name__)

__all__ = ["rewrite", "Report", "Site", "Miss"]


def rewrite(gm: fx.GraphModule) -> Report:
    from . import attention, rope_attention, rotary  # the pattern modules import the ops

    report = Report(graphs=1)
    rotary.rewrite(gm, report)
    attention.rewrite(gm, report)
    if settings.rope_attention_enabled():
        rope_attention.rewrite(gm, report)
    if report.sites:
        gm.graph.lint()
        gm.recompile()
    for kind in ("attention", "rotary", "rope_attention"):
        if report.count(kind):
            counters["fuse_plugin"][kind] += report.count(kind)
    for s in report.sites:
        log.info("fused %s at %s: %s", s.kind, s.source, s.detail)
    for m in report.misses:
        log.debug("not fused %s at %s: %s", m.kind, m.source, m.reason)
    return report
