"""In-place writes and the order of reads: may a replacement read a tensor where it stands?

Dynamo records an in-place op (`cache.index_copy_(2, pos, k)`, `cache[:, :, pos] = k`,
`cache.copy_(new)`, `x.masked_fill_(m, v)`) as a node that reads and writes the tensor of its first
argument (or of `out=`); later reads of that tensor are reads of the node that held it (the cache's
placeholder) or of the in-place node itself, and the graph order is the program order. So what a
node holds at a point of the graph is what the last write before that point left there.

A fused op stands just before the output it replaces and reads its inputs there; eager read them
along the way, from the first op of the site that touched them (`first_read`: a `k.transpose`, the
`repeat_kv` copy of a cache, the q·kᵀ product). The op reads what eager read when no write into the
storage of an input (through any alias: a view, the in-place node's own result) lies between that
first read and the op (`write_between`). A static KV cache is written before the attention reads
it, so the op placed after the write reads the written buffer, as eager does; a cache written after
the product with k but before the product with v, or a copy of the cache taken before the write
and then read (eager reads the old values, the op would read the buffer) are refused.

Aliases are read off the nodes' fake values (Dynamo keeps views as views of one fake storage,
deep copies of the graph included); a value without a storage (a tensor subclass) may alias
anything.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from .canon import example_value, mutates


def graph_order(graph: fx.Graph) -> dict:
    """Each node's position in the graph (the program order)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def storage_of(node: fx.Node) -> Optional[StorageWeakRef]:
    """The storage of the node's value (None: not a plain tensor, or unknown)."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # noqa: BLE001  (tensor subclasses, sparse / nested layouts)
        return None


def may_alias(target: fx.Node, x: fx.Node) -> bool:
    """May a write into target's tensor change x's value? (The same node, one storage, or unknown.)"""
    xv = example_value(x)
    if xv is not None and not isinstance(xv, torch.Tensor):
        return False  # a SymInt, a number: nothing writes into it
    if target is x:
        return True
    st, sx = storage_of(target), storage_of(x)
    if st is None or sx is None:
        return not (example_value(target) is not None and not isinstance(example_value(target), torch.Tensor))
    return st == sx


def written_by(node: fx.Node) -> list:
    """The nodes whose tensors `node` writes into (in-place ops, setitem, `out=`)."""
    return [a for a in node.all_input_nodes if mutates(node, a)]


def first_read(operand: fx.Node, entries: Iterable[fx.Node], stops: Iterable[fx.Node], site: Iterable[fx.Node],
               order: dict) -> Optional[fx.Node]:
    """The first node (in graph order) through which a site reads `operand`.

    `entries`: the site's inputs from outside (the non-matched inputs of its nodes: a `k.transpose`,
    a repeat_kv reshape); the site reads the operand through the entries computed from it, along
    the nodes the matcher passed over (views, casts, copies), not through another operand of the
    op (`stops`: the attention of an earlier layer leads to this layer's q, not to its mask). None
    when no such path exists (`write_between` also takes the site's own nodes that read it)."""
    stops = set(stops) - {operand}
    site = set(site)
    limit = max((order[n] for n in site if n in order), default=-1)
    # the descendants of the operand up to the site
    below, stack = set(), [operand]
    while stack:
        x = stack.pop()
        for u in x.users:
            if u not in below and u in order and order[u] <= limit and u not in site and u not in stops:
                below.add(u)
                stack.append(u)
    on_path, stack = set(), [e for e in entries if e in below]
    while stack:
        x = stack.pop()
        if x in on_path:
            continue
        on_path.add(x)
        stack.extend(i for i in x.all_input_nodes if i in below)
    return min(on_path, key=order.get) if on_path else None


def write_between(operands: Iterable[fx.Node], site_nodes: list, at: fx.Node, order: dict,
                  op: str = "the attention") -> Optional[str]:
    """Why an op placed just before `at` would not read what the site's nodes read of `operands`:
    a write into one of them between the site's first read of it and `at`. None when there is none."""
    site = set(n for n in site_nodes if n in order)
    entries = {i for n in site for i in n.all_input_nodes if i not in site}
    operands = list(dict.fromkeys(o for o in operands if isinstance(o, fx.Node)))
    nodes = list(at.graph.nodes)
    for x in operands:
        through = first_read(x, entries, operands, site, order)
        direct = [u for u in x.users if u in site]  # the site's own nodes reading x
        first = min(direct + ([through] if through is not None else []), key=order.get, default=at)
        for w in nodes[order[first]:order[at]]:
            if any(may_alias(t, x) for t in written_by(w)):
                return (f"{x.name} (an input of {op}) is written in place by {w.name} after {op} first reads it "
                        f"({first.name}): the fused op, placed at the output, would read the new values")
    return None


def written_since(nodes: Iterable[fx.Node], begin: fx.Node, at: fx.Node) -> bool:
    """Is one of `nodes` (maybe) written in place at or after `begin` and before `at`?"""
    order = graph_order(at.graph)
    if begin not in order or at not in order:
        return True
    ordered = list(at.graph.nodes)
    nodes = [n for n in nodes if isinstance(n, fx.Node)]
    return any(may_alias(t, x) for w in ordered[order[begin]:order[at]] for t in written_by(w) for x in nodes)
