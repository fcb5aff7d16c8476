"""Rotary folded into attention: `rotary_qk` → `attention` → one `fuse_plugin::rope_attention`.

Runs after the rotary and attention recognisers. For every `fuse_plugin.attention` node whose q and
k are the rotated outputs of one rotary op — the two getitems of a `rotary_qk`, or two `rotary`
nodes with the same cos/sin, pairing and rotary_dim — it emits `rope_attention` on the UN-rotated
q and k plus the tables, so the kernels rotate the q/k tiles in registers after loading them and
the rotated tensors are never written to memory. The rotary op and its getitems are erased.

Between a rotated output and the attention there may be (each node used once, by the next):
  * a permute/transpose of the leading dims (`q.transpose(1, 2)` after rotating (B, L, H, D), as
    GPT-J and Meta's llama do): applied to the un-rotated x and, unsqueezed to x's rank, to the
    tables (a table that broadcast against x broadcasts against the permuted x the same way); q
    and k must be permuted alike (the op takes one pair of tables);
  * ops that change nothing (`contiguous`, a cast to the dtype it already has).
HF's GQA `repeat_kv` needs nothing here: the attention recogniser already passes k un-repeated.

Left as rotary + attention (reported as a `rope_attention` miss, for `explain`): a rotated q or k
that has another user (returned, written to a KV cache, read by another attention), rotated tensors
that change dtype (promote(x, cos, sin) != x's dtype: the op keeps q's dtype), q and k rotated by
different ops/tables or permuted differently, a run-time scale or a zero-filled row fix applied to
q by the attention rewrite (q is then no longer the rotary output).

Counting: the rotary sites stay counted as rotary (`counters["fuse_plugin"]["rotary"]`, two per
q+k pair) and the attention as attention; each fused pair adds one `rope_attention` report site and
`counters["fuse_plugin"]["rope_attention"] += 1`.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Union

import torch
from torch import fx

from ..ops import rope_attention as _rope_attention_op  # noqa: F401  (registers the op)
from .canon import call_of, dtype, example_value, float_cast_input, is_identity, known_equal, norm_dim, rank, written
from .graph_edit import NodeBuilder, erase_dead, graph_fake_mode
from .report import Report
from .writes import graph_order, write_between

log = logging.getLogger(__name__)

KIND = "rope_attention"
ATTENTION_OP = torch.ops.fuse_plugin.attention.default
ROPE_ATTENTION_OP = torch.ops.fuse_plugin.rope_attention.default
ROTARY_QK_OP = torch.ops.fuse_plugin.rotary_qk.default
ROTARY_OP = torch.ops.fuse_plugin.rotary.default


@dataclass
class _Rotated:
    """One attention input traced back to the rotary op that produced it."""

    x: fx.Node  # the un-rotated tensor
    op: fx.Node  # the rotary / rotary_qk node
    out: fx.Node  # the node holding the rotated tensor (the rotary node, or a getitem of rotary_qk)
    chain: list  # nodes from `out` (excluded) to the attention's argument (included)
    perm: tuple  # the permutation of x's dims the chain applies


def _single_use(node: fx.Node, user: fx.Node) -> bool:
    return len(node.users) == 1 and user in node.users and not written(node)


def _perm_of(node: fx.Node) -> Union[tuple, str, None]:
    """The permutation a permute/transpose node applies (last dim kept), None for a no-op node."""
    c = call_of(node)
    r = rank(node)
    if c is None or r is None:
        return "not a view"
    if c.name == "permute":
        dims = tuple(norm_dim(d, r) for d in c["dims"])
    elif c.name == "transpose":
        dims = list(range(r))
        i, j = norm_dim(c["dim0"], r), norm_dim(c["dim1"], r)
        if i is None or j is None:
            return "transpose of unknown dims"
        dims[i], dims[j] = dims[j], dims[i]
        dims = tuple(dims)
    elif is_identity(c):
        return None
    elif float_cast_input(node) is not None and dtype(node) == dtype(float_cast_input(node)):
        return None
    else:
        return f"{c.name} ({node.name})"
    if None in dims or dims[-1] != r - 1:
        return f"{c.name} moves the head dim"
    return dims


def _is_rotary_out(node: fx.Node) -> bool:
    """A rotary node, or a getitem of a rotary_qk node (both called with positional arguments)."""
    if node.op != "call_function":
        return False
    if node.target is ROTARY_OP:
        return not node.kwargs
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and node.args[0].target is ROTARY_QK_OP and not node.args[0].kwargs)


def _trace(arg: fx.Node, attention: fx.Node) -> Union[_Rotated, str, None]:
    """The rotary op behind the attention argument `arg`; None when there is none (nothing to
    report), a reason when there is one that cannot be folded in."""
    if rank(arg) is None:
        return None
    chain, node = [], arg
    while not _is_rotary_out(node):
        if node.op not in ("call_function", "call_method") or isinstance(_perm_of(node), str):
            return None
        nxt = call_of(node)["input"]
        if not isinstance(nxt, fx.Node):
            return None
        chain.append(node)
        node = nxt
    perm = tuple(range(rank(arg)))  # arg = x.permute(perm): composed from x outwards
    for n in reversed(chain):
        p = _perm_of(n)
        if p is not None:
            perm = tuple(perm[i] for i in p)
    out = node
    op = out if out.target is ROTARY_OP else out.args[0]
    x = op.args[0] if op.target is ROTARY_OP else op.args[out.args[1]]
    name = "q" if arg is attention.args[0] else "k"
    outwards = chain[::-1]  # from the rotary output to the attention's argument
    for n, u in zip([out] + outwards, outwards + [attention]):
        if not _single_use(n, u):
            return f"the rotated {name} is also used elsewhere (e.g. returned, or a KV cache)"
    return _Rotated(x, op, out, chain, perm)


def _tables(op: fx.Node) -> tuple:
    """(cos, sin, interleaved, rotary_dim) of a rotary / rotary_qk node."""
    return tuple(op.args[1:]) if op.target is ROTARY_OP else tuple(op.args[2:])


@dataclass
class RopeSite:
    attention: fx.Node
    q: _Rotated
    k: _Rotated
    detail: str


def match(attention: fx.Node) -> Union[RopeSite, str, None]:
    """The rotary op folded into `attention`; None when q/k are not rotary outputs at all."""
    q_arg, k_arg = attention.args[0], attention.args[1]
    if not isinstance(q_arg, fx.Node) or not isinstance(k_arg, fx.Node):
        return None
    q, k = _trace(q_arg, attention), _trace(k_arg, attention)
    if q is None and k is None:
        return None
    for r in (q, k):
        if isinstance(r, str):
            return r
    if attention.kwargs.get("softcap") or len(attention.args) > 8:
        return "the attention has a softcap, which rope_attention does not take"
    if attention.kwargs.get("replace") is not None:
        return "the attention has a replace mask (a finite fill), which rope_attention does not take"
    if attention.kwargs.get("chunk"):
        return "the attention is chunked, which rope_attention does not take"
    if attention.kwargs.get("documents") is not None:
        return "the attention has documents, which rope_attention does not take"
    if q is None or k is None:
        return f"only {'q' if k is None else 'k'} comes from a rotary op"
    if q_arg in attention.args[2:] or k_arg in attention.args[2:] or q_arg is k_arg:
        return "the rotated q or k is also another input of the attention"
    if q.op.target is ROTARY_QK_OP:
        if q.op is not k.op or {q.out.args[1], k.out.args[1]} != {0, 1}:
            return "q and k are not the two outputs of one rotary_qk"
        if len(q.op.users) != 2:
            return "the rotary_qk has other users"
        spelled = "rotary_qk"
    else:
        if k.op.target is not ROTARY_OP or q.op is k.op:
            return "q and k are not rotated by one rotary op or two alike"
        (qc, qs, qi, qr), (kc, ks, ki, kr) = _tables(q.op), _tables(k.op)
        if (qc, qs, qi) != (kc, ks, ki) or not known_equal(example_value(qr), example_value(kr)):
            return "q and k are rotated by different tables or settings"
        spelled = "two rotary ops"
    if q.perm != k.perm:
        return f"q and k are permuted differently after the rotation ({q.perm} vs {k.perm})"
    for r, name in ((q, "q"), (k, "k")):
        if dtype(r.out) != dtype(r.x):
            promoted, own = (str(dtype(n)).replace("torch.", "") for n in (r.out, r.x))
            return f"the rotated {name} is {promoted}, not {name}'s {own} (tables promote it)"
    cos, sin = _tables(q.op)[:2]
    if any(rank(t) is None or rank(t) > rank(q.x) for t in (cos, sin)):
        return "cos/sin of unknown rank or of a higher rank than q"
    # the fold reads x and the tables at the attention, where the rotary op read them before
    site_nodes = list(dict.fromkeys([q.op, k.op, q.out, k.out] + q.chain + k.chain + [attention]))
    why = write_between([q.x, k.x, cos, sin], site_nodes, attention, graph_order(attention.graph), "the rotary")
    if why is not None:
        return why
    detail = f"{spelled} folded into the attention kernel"
    if q.perm != tuple(range(len(q.perm))):
        detail += f" (q/k and tables permuted {q.perm})"
    return RopeSite(attention, q, k, detail)


def replace(gm: fx.GraphModule, site: RopeSite, fake_mode) -> None:
    a = site.attention
    b = NodeBuilder(gm.graph, a, a, fake_mode)
    cos, sin, interleaved, rotary_dim = _tables(site.q.op)
    perm = site.q.perm
    try:
        xq, xk = site.q.x, site.k.x
        if perm != tuple(range(len(perm))):
            xq, xk = b.method("permute", xq, *perm), b.method("permute", xk, *perm)
            tables = []
            for t in (cos, sin):
                for _ in range(rank(site.q.x) - rank(t)):
                    t = b.method("unsqueeze", t, 0)
                tables.append(b.method("permute", t, *perm))
            cos, sin = tables
        v, rest = a.args[2], a.args[3:]  # bias, dropout_p, is_causal, scale[, dropout_seed]
        kwargs = {n: x for n, x in a.kwargs.items() if n != "need_lse"}  # (rope_attention has none)
        new = b.function(ROPE_ATTENTION_OP, xq, xk, v, cos, sin, interleaved, rotary_dim, *rest, **kwargs)
    except Exception:
        b.rollback()
        raise
    a.replace_all_uses_with(new)
    dead = [a, site.q.out, site.k.out, site.q.op, site.k.op] + site.q.chain + site.k.chain
    erase_dead(gm.graph, dead)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    """Fold every foldable rotary op into the attention it feeds (in place)."""
    attentions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ATTENTION_OP]
    if not attentions:
        return
    fake_mode = graph_fake_mode(gm)
    for a in attentions:
        try:
            site = match(a)
            if site is None:
                continue
            if isinstance(site, str):
                report.missed(KIND, a, f"rotary kept separate: {site}")
                continue
            replace(gm, site, fake_mode)
            report.replaced(KIND, a, site.detail)
        except Exception as e:  # noqa: BLE001  (never break compile: leave rotary + attention as they are)
            log.warning("fuse_plugin: rope not folded into the attention at %s after an internal error", a.name, exc_info=True)
            report.missed(KIND, a, f"internal error, rotary kept separate: {type(e).__name__}: {e}")
