"""The plugin owns attention in the graphs it compiles: Inductor's own attention replacement is off there.

Inductor rewrites attention-like chains of the joint graph into `aten._scaled_dot_product_*`
(torch/_inductor/fx_passes/fuse_attention.py, the "sfdp" patterns, registered lazily into
`joint_graph.patterns` and applied with Inductor's other joint-graph patterns). Those patterns ignore
integer arguments when they match, so `softmax(q @ kᵀ * s, dim=-2) @ v` (a softmax over the queries,
which is not attention) becomes SDPA and the compiled result differs from eager (rel 0.36 on torch
2.13 CPU). Our rewrite runs first, on the Dynamo graph, and replaces every attention it can prove; what
it left alone it left for a reason, so in a compile of ours nothing else may turn it into attention.

torch 2.11 and 2.13 have no switch for these patterns alone (`config.pattern_matcher` turns off every
pattern pass, pad_mm and the misc patterns included), so each sfdp entry's `extra_check` gets wrapped
in `_Gate`, which refuses the match while the compile is ours (`owns_attention`) and defers to
Inductor's own check otherwise: stock compiles (no plugin, or inside `fuse_plugin.disabled()`) keep
Inductor's behaviour. A site the rewrite proved to be attention and left as stock compile has it
(a `choice.Decision` with ``as_stock``: off CUDA, patterns/choice.off_cuda) is marked
(`mark_as_stock`: a key in the node's ``meta["custom"]``, which AOTAutograd copies onto every node
it traces from it); a match that takes a marked node passes the gate, so that such a site compiles
as in a stock compile (nn.MultiheadAttention in inference on the CPU: 0.93x stock compile with the
gate shut, benchmarks/cpu_sites.py, stop 57).

The entries are registered lazily, per device, right before the joint-graph passes run, so the
wrapping happens in our `joint_custom_pre_pass` (it runs after that lazy init and before the
patterns), installed by the automatic patch and by the backend. This module imports passes.py (our
pre-grad pass) and nothing of autopatch.py or backend.py, which import it.
"""
from __future__ import annotations

from typing import Any

from torch import fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import settings
from .passes import FusePluginPass, chained_uuid, get_custom_graph_passes, lowering_key, source_hash

_SFDP_MODULE = "torch._inductor.fx_passes.fuse_attention"


def owns_attention() -> bool:
    """Is the compile in progress ours? Both entry points compile with our pre-grad pass set in
    Inductor's config (the automatic patch globally, the backend through config_patches), and the
    rewrite is on (not inside `fuse_plugin.disabled()`). Read at match time, inside the compile."""
    return settings.rewrite_enabled() and isinstance(inductor_config.pre_grad_custom_pass, FusePluginPass)


# The key `mark_as_stock` sets in a node's meta["custom"] (a dict AOTAutograd copies onto the nodes
# it traces from that node: torch.fx.proxy._COPY_META_FIELDS).
AS_STOCK = "fuse_plugin_as_stock"


def mark_as_stock(node: fx.Node) -> None:
    """Let Inductor's attention patterns take the site ``node`` belongs to (its softmax, or an
    nn.MultiheadAttention call), as in a stock compile (module docstring)."""
    node.meta["custom"] = {**(node.meta.get("custom") or {}), AS_STOCK: True}


def _as_stock(match) -> bool:
    return any((n.meta.get("custom") or {}).get(AS_STOCK) for n in getattr(match, "nodes", ()))


class _Gate:
    """An sfdp pattern's extra_check, refused while the plugin owns the compile, except on a site
    left as stock compile has it (`mark_as_stock`)."""

    def __init__(self, check):
        self.check = check

    def __call__(self, match) -> Any:
        if owns_attention() and not _as_stock(match):
            return False
        return self.check(match)


def _defined_in_fuse_attention(fn: Any) -> bool:
    return getattr(fn, "__module__", None) == _SFDP_MODULE


def is_sfdp_entry(entry: Any) -> bool:
    """One of fuse_attention.py's replacements? torch 2.13 names its entries (`_sfdp_pattern_N_...`);
    on both versions `register_replacement`'s check closes over the traced `search_fn` and the
    pattern's `extra_check`, which fuse_attention.py defines."""
    name = getattr(entry, "pattern_name", None)
    if isinstance(name, str) and name.startswith("_sfdp_pattern"):
        return True
    check = getattr(entry, "extra_check", None)
    if _defined_in_fuse_attention(check):
        return True
    code, cells = getattr(check, "__code__", None), getattr(check, "__closure__", None) or ()
    if code is None:
        return False
    for var, cell in zip(code.co_freevars, cells):
        if var in ("search_fn", "extra_check"):
            try:
                if _defined_in_fuse_attention(cell.cell_contents):
                    return True
            except ValueError:  # an empty cell
                pass
    return False


def gate_inductor_attention() -> int:
    """Wrap every sfdp entry registered so far (idempotent); returns how many are gated in all."""
    from torch._inductor.fx_passes import joint_graph

    gated = 0
    for entries in joint_graph.patterns.patterns.values():
        for entry in entries:
            if isinstance(entry.extra_check, _Gate):
                gated += 1
            elif is_sfdp_entry(entry):
                entry.extra_check = _Gate(entry.extra_check)
                gated += 1
    return gated


class AttentionGatePass(CustomGraphPass):
    """Inductor's `joint_custom_pre_pass` in our compiles: gates the sfdp entries (see the module
    docstring), then runs the pass that was set before us (torch 2.11 takes one callable)."""

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        gate_inductor_attention()
        for p in get_custom_graph_passes(self.chained):
            p(graph)

    def uuid(self) -> Any:
        return chained_uuid([source_hash(), lowering_key(), "attention-gate"], self.chained)
