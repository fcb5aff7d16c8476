"""Attention recogniser: softmax(q·kᵀ·scale + mask)·v → `torch.ops.fuse_plugin.attention`.

In the style of Inductor's fuse_attention, but on the Dynamo graph and written as predicates
instead of traced patterns. From every softmax it walks

    scores = q · kᵀ                  `_product`: matmul / @ / Tensor.matmul / bmm / einsum /
                                     baddbmm(_, q, kᵀ, beta=0, alpha=s); kᵀ is transpose(-2,-1) /
                                     transpose(2,3) / .mT / permute(0,1,3,2) of k, or k given
                                     pre-transposed; constant factors on q or k fold into the scale.
                                     A 3-D product of q, k with batch and heads merged, viewed back
                                     as (B, H, Lq, Lk) (`_ScoresSide.split`), reads the 4-D q and k
    x = scores ∘ scale ∘ masks       `_chain`: * s, / s, + bias, - bias, masked_fill, where, casts,
                                     a softcap c·tanh(s / c) before the masks (`_softcap`), views
                                     of the batch dims (batch_views.py)
    w = softmax(x, dim=-1)           (dtype=, .float() before, .to()/.type_as() after)
    w = dropout(w)                   any constant p in [0, 1) and training flag (p > 0 in
                                     training: done by the op, with its own random mask)
    out = w · v                      `_weights_times_v`: matmul / bmm / einsum

and replaces `out` by `attention(q, k, v, bias, dropout_p, is_causal, scale, seed)[0]` (seed =
`torch.randint(...)` only with dropout; then the squeeze, permute
or cast that gives exactly the eager shape and dtype). The masks become one `bias`
(attention_bias.py): a causal mask proven from the graph (causal_mask.py: tril / triu of ones or
of a full, `arange` comparisons, a registered tril buffer sliced `[:T, :T]`) becomes `is_causal`;
-inf fills stay a bool mask; finite fills (finfo.min, -1e4, ...) and additive masks become a
float32 additive bias that reproduces eager's fully-masked rows (uniform weights with finite
fills, NaN with -inf), with the op's `replace` mask where a finite fill replaced the scores (so
that those scores are the bias alone, without gradient into q·kᵀ, also next to additive terms). GQA k/v repeated by HF `repeat_kv` or `repeat_interleave(n, 1)` are passed
un-repeated (`_unrepeat_kv`).

Matching changes nothing, as in Inductor's pattern_matcher: `match_attention` returns a plan
(`AttentionSite`) or why not, in stages that each return what they found or a reason:

    _weights_side      from the weights to w·v: casts, dropout, batch views
    _scores_side       the chain from q·kᵀ to the softmax, the regions its batch views make, the
                       canonical scores shape the op computes in
    _product_operands  q and k (the scale folded from them) and v, in the canonical shape
    _carry_masks       masks added in another region, carried to the canonical shape (batch_views):
                       detached nodes (graph_edit.detached), window-periodic where they allow it
    _sizes, _one_dtype q, k, v shapes and dtypes
    _masks             scale, is_causal and the bias parts (attention_bias.py); a window-periodic
                       carry that another mask does not fit is redone whole
    _gqa               one k/v head broadcast, or k/v un-repeated
    _site_nodes        the nodes the op takes over: none used elsewhere, no input written in between

`replace` builds the plan: the carried masks where the chain added them, the bias, the op. A near
miss, a site left to Inductor and an error while matching leave the graph as it was.

In-place writes: the op stands just before `out` and reads its inputs there, so an input written
in place (a static KV cache's `index_copy_` / slice assignment) is taken when no write into it lies
between the site's first read of it and the op (writes.py); in-place fills of the scores before the
softmax (`x.masked_fill_(m, v)`, `x += bias`) are chain ops like their out-of-place forms.

A matched site goes to our op unless the measured choice leaves it to Inductor (choice.py: the
site's decomposition, as stock compile runs it, measured faster for its class); such a site is
reported as left to Inductor, with the measurement. Every softmax that is not replaced is reported
as a miss with its reason; an unexpected error in one site is reported as a miss and leaves the
graph as it was (`rewrite`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import fx
from torch._dynamo.utils import counters

from ..inductor_attention import mark_as_stock
from ..ops import attention as _attention_op  # noqa: F401  (registers the op)
from . import bias_table, choice, sinks as sink_form
from .attention_bias import (ABSORBING, BiasTerm, CausalPart, MaskFill, build_bias, causal_or_bias, read_masks,
                             replace_mask)
from .batch_views import batch_view, carry_mask
from .bias_source import from_parameters
from .canon import (Call, broadcasts_to, call_of, device_of, dtype, example_value, float_cast_dtype, float_cast_input, fmt_shape,
                    is_identity, is_in_place_form, known_equal, mutates, norm_dim, same_shape, shape, shape_only_use, size_in_range,
                    tensor_meta, written)
from .causal_mask import constant_number, is_mask_value
from .graph_edit import NodeBuilder, detached, erase_dead, graph_fake_mode
from .report import Report
from .writes import graph_order, write_between

log = logging.getLogger(__name__)

KIND = "attention"
ATTENTION_OP = torch.ops.fuse_plugin.attention.default
SINKS_OP = torch.ops.fuse_plugin.attention_sinks.default
HEAD_DIM_RANGE = (16, 256)  # what the Triton kernels take (fuse_plugin/kernels/attention.py)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# =============================================================================== sites


@dataclass
class _Operand:
    """A tensor to pass to the op: `node` with view ops applied at build time [(method, *args)]."""

    node: fx.Node
    ops: tuple = ()

    def value(self):
        v = example_value(self.node)
        for m, *a in self.ops:
            v = getattr(v, m)(*a)
        return v


@dataclass
class AttentionSite:
    """One matched attention, a plan: what `replace` builds (the op, the masks carried across batch
    views) and which nodes it takes over. Its bias parts may read the detached nodes of `carried`."""

    softmax: fx.Node
    scores: fx.Node  # the q·kᵀ product
    output: fx.Node  # the ·v product whose uses the op takes over
    q: _Operand
    k: _Operand
    v: _Operand
    rank: int  # of the products (2, 3 or 4); lower ranks are unsqueezed to 4-D
    scale: float
    scale_nodes: list  # [(node, divide)]: run-time scale factors, applied to q
    bias_parts: list  # the mask parts the bias is built from (no CausalPart)
    is_causal: bool
    causal_note: str
    kv_groups: int
    softcap: float  # 0.0: none
    out_ops: tuple  # view ops on the op's output (einsum output order)
    matched: list  # the nodes from scores to output, erased when dead
    notes: list = field(default_factory=list)
    dropout_p: float = 0.0  # F.dropout(w, p, training=True) on the weights, done by the op
    safe: bool = False  # the softmax is _safe_softmax: rows whose every score is -inf give 0, not NaN
    carried: list = field(default_factory=list)  # [_CarriedMask]: masks carried across batch views, to build
    period: Optional[int] = None  # the bias is window-periodic over the batch (batch_views.carry_mask)
    cast: Optional[torch.dtype] = None  # q, k, v cast to it first: autocast ran both products in it
    sinks: Optional[fx.Node] = None  # the H sink logits of a softmax with a sink column (patterns/sinks.py)
    window: int = 0  # a causal sliding window proven from the masks (the op's window; mask_structure.py)
    chunk: int = 0  # causal chunks proven from the masks (the op's chunk; Llama 4's chunked attention)
    kv_repeated: bool = False  # an SDPA call's k/v were repeated for GQA before it (HF's repeat_kv)
    documents: Optional[fx.Node] = None  # document ids proven from the masks, (L,) or (B, L) (the op's documents)
    # the window's finite fill V where rows masked everywhere average v over all keys after the op
    # (attention_bias.window_beside_one_fill, `_average_dead_rows`)
    dead_average: Optional[float] = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the op computes in (q's, or autocast's `cast`)."""
        return self.cast or self.q.value().dtype


# =============================================================================== q·kᵀ and w·v


def _is_product(node: Any) -> bool:
    c = call_of(node)
    return c is not None and c.name in ("matmul", "bmm", "baddbmm", "einsum")


def _product(node: fx.Node, heads: Optional[tuple] = None, with_input: bool = False) -> Union[tuple, str]:
    """The q·kᵀ product: (q, k, constant scale folded from q and k, run-time factors [(node,
    divide)] on q or k). With `heads` = (B, H), the product is 3-D over merged batch and heads
    (`batch_views`): q and kᵀ are read from the 4-D tensors they were merged from. `with_input`: a
    baddbmm's input is taken as a bias (beta=1) by the caller."""
    c = call_of(node)
    factor = 1.0
    runtime: list = []
    if c.name == "einsum":
        terms = _einsum_terms(c)
        if terms is None:
            return f"einsum {c['equation']!r} is not a two-operand batched q·kᵀ"
        (ta, tb), to, (a, b) = terms
        batch, (i, j) = to[:-2], to[-2:]
        contracted = [t for t in ta if t not in to]
        if len(contracted) != 1 or sorted(ta) != sorted(batch + [i] + contracted) or sorted(tb) != sorted(batch + [j] + contracted):
            return f"einsum {c['equation']!r} is not q·kᵀ over the last dim with the key dim last"
        q, k = _permuted(a, ta, batch + [i] + contracted), _permuted(b, tb, batch + [j] + contracted)
    else:
        if c.name == "baddbmm":  # beta·input + alpha·(q·kᵀ); with beta = 0 the input is ignored
            if constant_number(c["beta"]) != 0 and not with_input:
                return f"baddbmm with beta={c['beta']} adds its input to the scores"
            alpha = _scale_factor(c["alpha"])
            if alpha is None or alpha[0] != "const":
                return f"baddbmm with a run-time alpha ({_describe(c['alpha'])})"
            a, b, factor = c["batch1"], c["batch2"], alpha[1]
        else:
            a, b = c["input"], c["other"] if c.name == "matmul" else c["mat2"]
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or shape(a) is None or shape(b) is None:
            return "q·kᵀ operands have no shape metadata"
        if len(shape(a)) < 2 or len(shape(b)) < 2:
            return "q·kᵀ operands are not matrices"
        kt, f = _strip_const_factors(b)
        kt, runtime = _strip_runtime_factors(kt)
        kt, f2 = _strip_const_factors(kt)
        factor *= f * f2
        k = _k_from_kt(kt)
        a, fa = _strip_const_factors(a)
        a, rq = _strip_runtime_factors(a)
        factor *= fa
        runtime += rq
        q = _Operand(a)
    if heads is not None:
        q, k = _merged_operand(q, heads), _merged_operand(k, heads)
        if q is None or k is None:
            return ("the scores are computed with batch and heads merged and split again, but the product's operands "
                    "are not 4-D q and k with those merged")
    if not q.ops:
        qn, f = _strip_const_factors(q.node)
        q, factor = _Operand(qn), factor * f
    if not k.ops:
        kn, f = _strip_const_factors(k.node)
        k, factor = _Operand(kn), factor * f
    return q, k, factor, runtime


def _strip_runtime_factors(node: Any) -> tuple[Any, list]:
    """(x, [(t, divide)]) for node = x * t or x / t with t a run-time 0-d float (DeBERTa-v2's
    `kᵀ / scale.to(dtype)`, scale = sqrt(tensor(d) * f)): the factor scales every score, so it goes
    to q with the other run-time scales."""
    out = []
    while True:
        c = call_of(node)
        if c is None or is_in_place_form(node) or written(node) or c.name not in ("mul", "div"):
            return node, out
        a, b = c["input"], c["other"]
        if c.name == "div" and c["rounding_mode"] is not None:
            return node, out
        fb = _scale_factor(b)
        fa = _scale_factor(a) if c.name == "mul" else None
        if fb is not None and fb[0] == "node" and isinstance(a, fx.Node) and _scale_factor(a) is None:
            out.append((fb[1], c.name == "div"))
            node = a
        elif fa is not None and fa[0] == "node" and isinstance(b, fx.Node) and fb is None:
            out.append((fa[1], False))
            node = b
        else:
            return node, out


def _einsum_terms(c: Call):
    """(input subscripts, output subscripts, operands) of a 2-operand explicit einsum, with a
    leading '...' expanded to one token per dim; None otherwise."""
    eq = c["equation"]
    ops = c["operands"]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if not isinstance(eq, str) or "->" not in eq or len(ops) != 2:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or not all(isinstance(o, fx.Node) for o in ops):
        return None

    def tokens(sub: str, rank: Optional[int]):
        if sub.startswith("..."):
            rest = list(sub[3:])
            if rank is None or "." in rest:
                return None
            return [f".{i}" for i in range(rank - len(rest))] + rest
        if "." in sub or not sub.isalpha():
            return None
        return list(sub)

    ranks = [len(shape(o)) if shape(o) is not None else None for o in ops]
    t_in = [tokens(s, r) for s, r in zip(ins, ranks)]
    t_out = tokens(out, len(shape(c.node)) if shape(c.node) is not None else None)
    if any(t is None for t in t_in) or t_out is None:
        return None
    if any(len(set(t)) != len(t) for t in t_in + [t_out]) or any(len(t) != r for t, r in zip(t_in, ranks)):
        return None
    return t_in, t_out, ops


def _permuted(node: fx.Node, have: list, want: list) -> _Operand:
    perm = tuple(have.index(t) for t in want)
    return _Operand(node, ()) if perm == tuple(range(len(perm))) else _Operand(node, (("permute", *perm),))


def _k_from_kt(kt: fx.Node) -> _Operand:
    """k (…, Lk, D) from the product's second operand kᵀ (…, D, Lk): the input of a transpose of
    the last two dims (or ``mT``), else kᵀ itself transposed back. A permute or transpose of other
    dims is such a kᵀ (LeViT: k (B, L, H, D) permuted (0, 2, 3, 1)); it is not read as a transpose
    of its input's last two dims (pytorch#195320 did, and computed with the wrong k)."""
    r = len(shape(kt))
    c = call_of(kt)
    while c is not None and is_identity(c) and not written(kt):
        kt = c["input"]
        c = call_of(kt)
    if c is not None and not written(kt):
        if c.name == "transpose":
            dims = {norm_dim(c["dim0"], r), norm_dim(c["dim1"], r)}
            if dims == {r - 2, r - 1}:
                return _Operand(c["input"])
        if c.name == "permute":
            dims = tuple(norm_dim(d, r) for d in c["dims"])
            if dims == tuple(range(r - 2)) + (r - 1, r - 2):
                return _Operand(c["input"])
        if c.name == "getattr" and (c["name"] == "mT" or (c["name"] == "T" and r == 2)):
            return _Operand(c["input"])
    return _Operand(kt, (("transpose", -2, -1),))  # k given pre-transposed


def _merged_operand(x: _Operand, heads: tuple) -> Optional[_Operand]:
    """The 4-D operand the 3-D operand x was merged from (`_merged_from`); for kᵀ given
    pre-transposed, k."""
    if x.ops not in ((), (("transpose", -2, -1),)):
        return None
    merged = _merged_from(x.node, heads)
    if merged is None:
        return None
    if not x.ops:
        return _Operand(merged)
    return _k_from_kt(merged)


def _merged_from(x: fx.Node, heads: tuple) -> Optional[fx.Node]:
    """The 4-D x4 (B, H, L, D) when x is x4.reshape(B·H, L, D), under a float cast (the op computes
    in float32 whatever it reads); (B, H) = heads."""
    x = float_cast_input(x) or x
    c = call_of(x)
    if c is None or c.name not in ("view", "reshape") or written(x) or not isinstance(c["input"], fx.Node):
        return None
    s4, s3 = shape(c["input"]), shape(x)
    if s4 is None or s3 is None or len(s4) != 4 or len(s3) != 3:
        return None
    return c["input"] if same_shape(s4[:2], heads) and same_shape(s4[2:], s3[1:]) else None


def _weights_times_v(w: fx.Node, u: fx.Node) -> Union[tuple, str]:
    """For u = w·v: (v operand, view ops on the op's output)."""
    c = call_of(u)
    if c.name == "einsum":
        terms = _einsum_terms(c)
        if terms is None or terms[2][0] is not w or terms[2][1] is w:
            return f"einsum {c['equation']!r} is not a two-operand weights·v"
        (tw, tv), to, (_, v) = terms
        batch, (i, j) = tw[:-2], tw[-2:]
        rest = [t for t in tv if t not in tw]
        if len(rest) != 1 or sorted(tv) != sorted(batch + [j] + rest) or sorted(to) != sorted(batch + [i] + rest):
            return f"einsum {c['equation']!r} is not weights·v over the key dim"
        have = batch + [i] + rest
        perm = tuple(have.index(t) for t in to)
        out_ops = () if perm == tuple(range(len(perm))) else (("permute", *perm),)
        return _permuted(v, tv, batch + [j] + rest), out_ops
    if c.name == "baddbmm":
        return "the product with v is a baddbmm"
    a, v = c["input"], c["other"] if c.name == "matmul" else c["mat2"]
    if a is not w or v is w or not isinstance(v, fx.Node):
        return "the attention weights are not the first operand of the product with v"
    return _Operand(v), ()


def _unrepeat_kv(x: _Operand) -> Optional[tuple[fx.Node, int]]:
    """(k, n) when x is k (B, Hkv, L, D) with every head repeated n times in a row — HF repeat_kv
    (`k[:, :, None].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)`) or
    `k.repeat_interleave(n, dim=1)` — so head h reads kv head h // n, as the op's GQA does."""
    if x.ops or shape(x.node) is None or len(shape(x.node)) != 4:
        return None
    node = x.node
    out = shape(node)
    c = call_of(node)
    if c is None or written(node):
        return None
    if c.name == "repeat_interleave":
        src, n = c["input"], c["repeats"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(src, fx.Node) or shape(src) is None:
            return None
        if c["dim"] is None or norm_dim(c["dim"], 4) != 1:
            return None
        s = shape(src)
        if len(s) == 4 and same_shape(out, (s[0], s[1] * n, s[2], s[3])):
            return src, n
        return None
    if c.name in ("reshape", "view", "flatten"):
        e = c["input"]
        ce = call_of(e)
        if c.name == "flatten" and not (norm_dim(c["start_dim"], 5) == 1 and norm_dim(c["end_dim"], 5) == 2):
            return None
        if ce is None or ce.name != "expand" or written(e):
            return None
        g = ce["input"]
        cg = call_of(g)
        es = shape(e)
        if cg is None or es is None or len(es) != 5 or written(g):
            return None
        if cg.name == "unsqueeze" and norm_dim(cg["dim"], 5) == 2:
            src = cg["input"]
        elif cg.name == "getitem":
            src = cg["input"]
            idx = cg["index"]
            idx = idx if isinstance(idx, tuple) else (idx,)
            if sum(i is None for i in idx) != 1 or not all(
                i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in idx
            ):
                return None
        else:
            return None
        s = shape(src) if isinstance(src, fx.Node) else None
        gs = shape(g)
        if s is None or len(s) != 4 or not same_shape(gs, (s[0], s[1], 1, s[2], s[3])):
            return None
        n = es[2]
        if not isinstance(n, int):
            return None
        if same_shape(es, (s[0], s[1], n, s[2], s[3])) and same_shape(out, (s[0], s[1] * n, s[2], s[3])):
            return src, n
    return None


# =============================================================================== the chain from q·kᵀ to the softmax


def _chain(x: fx.Node, softmax: fx.Node, after: list) -> Union[tuple, str]:
    """Walk from the softmax input down to the q·kᵀ product: (product, ops top-down, nodes).
    `after`: the casts after the softmax, which may read a chain node's dtype (`.type_as(scores)`)."""
    ops, nodes, user = [], [], softmax
    written_node, writes = None, []  # in-place writes into written_node still to walk, latest first
    while True:
        if x is not written_node:
            r = _writes_before_read(x, user, after)
            if isinstance(r, str):
                return r
            if r:  # walk the writes (latest first) as chain ops, then x itself
                written_node, writes = x, r
        if x is written_node and writes:
            x = writes.pop(0)
        elif x is not written_node and len([u for u in x.users if not (u in after and _dtype_only_user(u, x))
                                            and not _shape_use_in_chain(u, x, nodes)]) != 1:
            return f"the scores feeding the softmax ({x.name}) are also used elsewhere"
        if _is_product(x):
            return x, ops, nodes
        viewed = batch_view(x)
        if viewed is not None and _reaches_product(viewed):
            nodes.append(x)
            ops.append(("batch_view", x))
            user, x = x, viewed
            continue
        c = call_of(x)
        if c is None:
            return f"softmax input is not q·kᵀ (with scale/mask): found {_describe(x)}"
        nodes.append(x)
        name = c.name
        if float_cast_dtype(c) is not None or is_identity(c):
            ops.append(("cast",))
            nxt = c["input"]
        elif name in ("mul", "div"):
            a, b = c["input"], c["other"]
            if name == "div" and c["rounding_mode"] is not None:
                return f"division with rounding_mode={c['rounding_mode']!r}"
            fb = _scale_factor(b) or _row_factor(b, a, x)
            fa = (_scale_factor(a) or _row_factor(a, b, x)) if name == "mul" else None
            if fb is not None and isinstance(a, fx.Node) and _scale_factor(a) is None:
                ops.append(("scale", fb, name == "div"))
                nxt = a
            elif fa is not None and isinstance(b, fx.Node):
                ops.append(("scale", fa, False))
                nxt = b
            else:
                return f"the scores are multiplied by a tensor ({_describe(x)}), not a scale"
        elif name in ("add", "sub"):
            a, b = c["input"], c["other"]
            if c["alpha"] != 1:
                return f"{name} with alpha={c['alpha']}"
            if name == "sub":
                if not isinstance(a, fx.Node) or not _reaches_product(a):
                    return "the scores are subtracted from a tensor"
                chain_in, other = a, b
            elif isinstance(a, fx.Node) and _reaches_product(a):
                chain_in, other = a, b
            elif isinstance(b, fx.Node) and _reaches_product(b):
                chain_in, other = b, a
            else:
                return f"softmax input is not q·kᵀ (with scale/mask): found {_describe(x)}"
            if constant_number(other) is not None:
                ops.append(("const",))  # adding a constant does not change a softmax
            elif isinstance(other, fx.Node) and isinstance(example_value(other), torch.Tensor):
                ops.append(("add", _unexpanded(other), name == "sub"))
            else:
                return f"the scores get {_describe(other)} added"
            nxt = chain_in
        elif name == "tanh":
            ops.append(("tanh",))  # a softcap, read by `_softcap`
            nxt = c["input"]
        elif name == "masked_fill":
            v = constant_number(c["value"])
            if v is None:
                return f"masked_fill with a non-constant value ({_describe(c['value'])})"
            ops.append(("fill", _unexpanded(c["mask"]), True, float(v)))
            nxt = c["input"]
        elif name == "where":
            cond, a, b = c["condition"], c["input"], c["other"]
            va, vb = constant_number(a), constant_number(b)
            if vb is not None and isinstance(a, fx.Node):
                ops.append(("fill", _unexpanded(cond), False, float(vb)))
                nxt = a
            elif va is not None and isinstance(b, fx.Node):
                ops.append(("fill", _unexpanded(cond), True, float(va)))
                nxt = b
            else:
                return "torch.where between the scores and a tensor, not a constant mask value"
        else:
            return f"softmax input is not q·kᵀ (with scale/mask): found {_describe(x)}"
        if not isinstance(nxt, fx.Node):
            return f"softmax input is not q·kᵀ: {_describe(x)} has no tensor input"
        user, x = x, nxt


def _writes_before_read(x: fx.Node, user: fx.Node, after: list) -> Union[list, str]:
    """The in-place writes into the scores x that the chain reads through `user` (`x.masked_fill_(m, v)`,
    `x.mul_(s)`, `x += bias` before `softmax(x)`), latest first: eager applies them in graph order
    before the read, as the out-of-place ops would be. [] when x is not written; why not, when a
    write comes after the read, is not a chain op on x itself, or its result is read elsewhere."""
    writers = [u for u in x.users if mutates(u, x)]
    if not writers:
        return []
    readers = [u for u in x.users if u not in writers and not (u in after and _dtype_only_user(u, x))]
    if readers != ([] if user in writers else [user]):
        return f"the scores feeding the softmax ({x.name}) are also used elsewhere"
    order = graph_order(x.graph)
    late = [w.name for w in writers if order[w] > order[user]]
    if late:
        return f"{x.name} is changed in place ({', '.join(late)}) after the softmax chain reads it ({user.name})"
    earlier = sorted((w for w in writers if w is not user), key=order.get, reverse=True)
    for w in earlier:
        c = call_of(w)
        if not is_in_place_form(w) or c is None or c["input"] is not x:
            return f"{x.name} is changed in place by {_describe(w)}, not by a mask fill or scale of the scores"
        if w.users:
            return f"the result of {_describe(w)} is also used elsewhere"
    return earlier


def _reaches_product(x: fx.Node, depth: int = 16) -> bool:
    """Does x lead (through chain ops) to a matmul/bmm/einsum? Tells the scores from the bias."""
    if depth == 0:
        return False
    if _is_product(x):
        return True
    if batch_view(x) is not None:
        return _reaches_product(batch_view(x), depth - 1)
    c = call_of(x)
    if c is None or c.name not in _CHAIN_OPS:
        return False
    if c.name == "where":
        cands = [c["input"], c["other"]]
    else:
        cands = [c["input"]] + ([c["other"]] if c.name in ("mul", "add") else [])
    return any(isinstance(n, fx.Node) and _reaches_product(n, depth - 1) for n in cands)


def _shape_use_in_chain(u: fx.Node, x: fx.Node, chain: list) -> bool:
    """u reads only x's shape and goes away with the attention: `m.expand_as(x)` feeding only the
    chain (a mask: the op is given m, which broadcasts the same). (Sizes read under dynamic shapes
    are no use of x in a Dynamo graph: they are symbols, graph inputs.)"""
    return shape_only_use(u, x) == "expand_as" and bool(u.users) and all(n in chain for n in u.users)


def _unexpanded(mask: Any) -> Any:
    """m for mask = m.expand_as(s): the op broadcasts m itself (DistilBERT's
    `(mask == 0).view(...).expand_as(scores)`); the expand_as dies with the scores."""
    c = call_of(mask)
    if c is not None and c.name == "expand_as" and isinstance(c["input"], fx.Node) and not written(mask):
        return c["input"]
    return mask


_CHAIN_OPS = ("mul", "div", "add", "sub", "masked_fill", "where", "float", "half", "bfloat16", "to", "type_as", "contiguous",
              "clone", "tanh")


def _softcap(ops: list) -> Union[float, str]:
    """The softcap c of the chain ops (top-down, as `_chain` lists them), 0.0 without a tanh.

    Gemma 2 / Grok: `c * tanh(s / c)` on the scaled scores s, before the masks. Positive constant
    factors distribute over the masks and the bias, so every const scale above the tanh (the
    "multiply back") multiplies the cap and every one below scales the scores inside it: the
    scores are A·tanh(B·qk) = cap·tanh(qk·scale / cap) with cap = A and scale = A·B, which is
    the product of all the factors, what `read_masks` computes anyway. So `tanh(s / c) * c`,
    `c * tanh(s * (1 / c))`, `tanh(s / a) * b` (cap b, scores scaled by b / a) and a bare
    `tanh(s)` (cap 1) are all softcaps. Not one (refused): a tanh over masked, biased or shifted
    scores (it squashes the mask: -inf becomes -c, a visible key), a run-time factor after the
    tanh (the op takes a constant cap), two tanhs."""
    at = [i for i, op in enumerate(ops) if op[0] == "tanh"]
    if not at:
        return 0.0
    if len(at) > 1:
        return "tanh applied to the scores twice (a softcap of a softcap)"
    i = at[0]
    if any(op[0] not in ("scale", "cast", "batch_view") for op in ops[i + 1:]):
        return ("the softcap (tanh) is applied after a mask, a bias or a constant shift of the scores, "
                "not to the scaled scores alone")
    cap = 1.0
    for op in ops[:i]:
        if op[0] != "scale":
            continue
        (how, f), divide = op[1], op[2]
        if how != "const":
            return f"the softcapped scores are multiplied by a run-time value ({_describe(f)}), not a constant cap"
        cap = cap / f if divide else cap * f
    if not (cap > 0 and math.isfinite(cap)):
        return f"softcap with a cap of {cap:g} (the op takes a positive one)"
    return cap


def _scale_factor(x: Any) -> Optional[tuple[str, Any]]:
    """('const', float) for a number or a constant 0-d tensor; ('node', node) for a symbolic number
    (under dynamic shapes) or a 0-d float tensor computed at run time (a learned temperature)."""
    v = constant_number(x)
    if v is not None:
        return ("const", float(v))
    if isinstance(x, fx.Node):
        ev = example_value(x)
        if isinstance(ev, (torch.SymInt, torch.SymFloat)):
            return ("node", x)
        if isinstance(ev, torch.Tensor) and ev.dim() == 0 and ev.dtype.is_floating_point:
            return ("node", x)
    return None


def _row_factor(t: Any, scores: Any, out: fx.Node) -> Optional[tuple[str, Any]]:
    """('node', t) where `scores * t` scales each query row by its own run-time factor: t a float
    tensor of the scores' dtype, 1 along the keys, broadcasting to the scores without growing them
    (timm XCiT's learned per-head temperature, (H, 1, 1)). Such a factor is the same on every key of
    a row, so it moves to q (`replace` multiplies q by it, as the 0-d factors); `match_attention`
    checks that q has the scores' leading dims (`_row_factor_fits`)."""
    if not isinstance(t, fx.Node) or not isinstance(scores, fx.Node):
        return None
    ts, ss, out = shape(t), shape(scores), shape(out)
    if ts is None or ss is None or out is None or len(ts) == 0 or len(ts) > len(ss):
        return None
    if dtype(t) is None or not dtype(t).is_floating_point or dtype(t) != dtype(scores):
        return None
    if not known_equal(ts[-1], 1) or not same_shape(out, ss) or not broadcasts_to(ts, ss) or _reaches_product(t):
        return None
    return ("node", t)


def _row_factor_fits(scale_nodes: list, sc: "_ScoresSide") -> Optional[str]:
    """Why a per-row factor (`_row_factor`) cannot move to q, or None: the scores must be the
    product's own (no heads merged and split again, no 5-D windows) and the factor must broadcast
    to their canonical shape, whose leading dims and rows are q's."""
    rows = [n for n, _ in scale_nodes if shape(n)]
    if not rows:
        return None
    if sc.split is not None or sc.rank == 5 or any(op[0] == "batch_view" for op in sc.ops):
        return "a per-row factor on scores seen through a batch view (taken on plain scores only)"
    for n in rows:
        if not broadcasts_to(shape(n), sc.canonical):
            return f"a per-row factor of shape {fmt_shape(shape(n))} on scores {fmt_shape(sc.canonical)}"
    return None


def _strip_const_factors(node: Any) -> tuple[Any, float]:
    """(x, c) for node = x * c / ... with constant c (scale applied to q or k before the product)."""
    factor = 1.0
    while True:
        c = call_of(node)
        if c is None or is_in_place_form(node) or written(node):
            return node, factor
        if c.name == "mul":
            a, b = c["input"], c["other"]
            fa, fb = _scale_factor(a), _scale_factor(b)
            if fb is not None and fb[0] == "const" and isinstance(a, fx.Node) and fa is None:
                node, factor = a, factor * fb[1]
                continue
            if fa is not None and fa[0] == "const" and isinstance(b, fx.Node) and fb is None:
                node, factor = b, factor * fa[1]
                continue
        elif c.name == "div" and c["rounding_mode"] is None:
            fb = _scale_factor(c["other"])
            if fb is not None and fb[0] == "const" and fb[1] != 0 and isinstance(c["input"], fx.Node):
                node, factor = c["input"], factor / fb[1]
                continue
        return node, factor


def _dtype_only_user(u: fx.Node, x: fx.Node) -> bool:
    """u reads only x's dtype: `w.type_as(x)` / `w.to(x)` with x as the reference."""
    c = call_of(u)
    if c is None or c["input"] is x:
        return False
    if c.name == "type_as":
        return c["other"] is x
    return c.name == "to" and x in c["args"] and float_cast_dtype(c) is not None


def _describe(x: Any) -> str:
    if not isinstance(x, fx.Node):
        return repr(x)
    c = call_of(x)
    if c is not None:
        return f"{c.name} ({x.name})"
    if x.op in ("call_function", "call_method"):
        return f"{getattr(x.target, '__name__', x.target)} ({x.name})"
    return f"{x.op} {x.name}"


# =============================================================================== match


def match_attention(softmax: fx.Node) -> Union[AttentionSite, str]:
    """The attention around `softmax` as a plan for `replace`, or why it is not one we can replace.
    Reads the graph and changes nothing: masks carried across batch views are detached nodes
    (`_CarriedMask`) until `replace` builds them."""
    x = _softmax_input(softmax)
    if isinstance(x, str):
        return x
    form = sink_form.read(softmax)  # softmax([scores, sink])[..., :-1] (gpt-oss), else None
    if isinstance(form, str):
        return form
    ws = _weights_side(softmax if form is None else form.dropped)
    if isinstance(ws, str):
        return ws
    sc = _scores_side(x if form is None else form.scores, softmax if form is None else form.cat, ws.between)
    if isinstance(sc, str):
        return sc
    if form is not None and sc.softcap:
        return "sinks next to a softcap (the sinks op has none)"
    o = _product_operands(sc, ws)
    if isinstance(o, str):
        return o
    carry = _carry_masks(sc, periodic=True)
    if isinstance(carry, str):
        return carry
    sizes = _sizes(o, sc, ws.pv)
    if isinstance(sizes, str):
        return sizes
    o = _one_dtype(o, (sc.product, ws.pv))
    if isinstance(o, str):
        return o
    # (the sinks op takes no chunks or documents: they stay a bias; documents on 4-D scores only)
    masks = _masks(sc, carry, sizes, chunks=form is None, documents=form is None and sc.rank == 4,
                   dead_rows=form is None and sc.rank == 4 and not sc.softcap and not ws.dropout_p
                   and call_of(softmax).name == "softmax"
                   # (the rows' average reads all of k and v: not under context parallelism's shards)
                   and not choice._context_parallel_on() and choice.window_beside_padding(o.q.value(), sizes.lk))
    if isinstance(masks, str):
        return masks
    if sc.rank == 5 and (masks.bias_parts or masks.carry.carried):
        return "a mask on 5-D scores (taken without masks only: the op's biases are 4-D)"
    kv = _gqa(o, sizes, sc.rank)
    if isinstance(kv, str):
        return kv
    k, v, groups = kv
    scale_nodes = o.runtime_scale + masks.scale_nodes
    why = _row_factor_fits(masks.scale_nodes, sc)
    if why is not None:
        return why
    inputs = [o.q.node, k.node, v.node] + [n for n, _ in scale_nodes] + [_part_node(p) for p in masks.bias_parts]
    if masks.documents is not None:
        inputs.append(masks.documents)
    if form is not None:
        inputs.append(form.sinks)
    matched = _site_nodes(sc, softmax, ws, inputs, form.nodes if form is not None else ())
    if isinstance(matched, str):
        return matched
    why = _head_dims(sizes)
    if why is not None:
        return why
    return AttentionSite(
        softmax=softmax, scores=sc.product, output=ws.pv, q=o.q, k=k, v=v, rank=sc.rank,
        scale=o.qk_scale * masks.scale, scale_nodes=scale_nodes, bias_parts=masks.bias_parts,
        is_causal=masks.is_causal, causal_note=masks.causal_note, kv_groups=groups, softcap=sc.softcap,
        out_ops=o.out_ops, matched=matched, notes=masks.notes, dropout_p=ws.dropout_p,
        safe=call_of(softmax).name == "safe_softmax", carried=masks.carry.carried, period=masks.carry.period,
        cast=o.cast, sinks=form.sinks if form is not None else None, window=masks.window, chunk=masks.chunk,
        documents=masks.documents, dead_average=masks.dead_average,
    )


def _softmax_input(softmax: fx.Node) -> Union[fx.Node, str]:
    """The softmax's input, or why the softmax is not over the last dim of a tensor."""
    c = call_of(softmax)
    x = c["input"]
    s = shape(x)
    if not isinstance(x, fx.Node) or s is None:
        return "softmax input has no shape metadata"
    dim = norm_dim(c["dim"], len(s)) if s else None
    if dim is None or dim != len(s) - 1:
        return f"softmax over dim {c['dim']}, not the last dim"
    return x


# ------------------------------------------------------------------------------- weights side


@dataclass
class _WeightsSide:
    """From the weights to w·v: `w` as multiplied with v, the casts, dropout and batch views between
    the softmax and the product `pv`, and the product's v operand and output view ops."""

    w: fx.Node
    between: list
    dropout_p: float
    pv: fx.Node
    v: _Operand
    out_ops: tuple


def _weights_side(softmax: fx.Node) -> Union[_WeightsSide, str]:
    """The weights side of `softmax` (each node the sole user of the one before, none written in
    place, up to a product with v: `_weights_times_v`), or why not."""
    w, between, dropout_p = softmax, [], 0.0
    while True:
        users = list(w.users)
        if len(users) != 1:
            return "attention weights are used elsewhere (e.g. returned with output_attentions=True)"
        if written(w):
            return f"attention weights {w.name} are changed in place"
        u = users[0]
        if _is_product(u):
            break
        cu = call_of(u)
        if cu is not None and cu.name == "dropout":
            dropout_p = _dropout_p(cu, dropout_p)
            if isinstance(dropout_p, str):
                return dropout_p
        elif cu is None or not (float_cast_dtype(cu) is not None or is_identity(cu) or batch_view(u) is w):
            return f"softmax output feeds {_describe(u)}, not a product with v"
        between.append(u)
        w = u
    r = _weights_times_v(w, u)
    return r if isinstance(r, str) else _WeightsSide(w, between, dropout_p, u, *r)


def _dropout_p(c: Call, before: float) -> Union[float, str]:
    """The dropout probability on the weights after the dropout call `c` (`before`: an earlier
    dropout's, kept where c drops nothing: p = 0 or not training), or why the op cannot do it."""
    p, training = c["p"], c["training"]
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return "dropout with a non-constant p or training flag"
    if p == 0 or not training:
        return before
    if before:
        return "two dropouts on the attention weights"
    if not 0 < p < 1:
        return f"dropout p={p} (the op takes 0 <= p < 1)"
    return float(p)


# ------------------------------------------------------------------------------- scores side


@dataclass
class _ScoresSide:
    """From q·kᵀ to the softmax: the `product`, the chain `ops` (top-down as `_chain` lists them, a
    baddbmm's input last) with their `nodes` and `regions` (the shape of the scores where each op
    acts), the softcap (0.0: none), and `split`: the 4-D (B, H, Lq, Lk) view of a product over
    merged batch and heads, if the chain has one."""

    product: fx.Node
    ops: list
    nodes: list
    regions: list
    softcap: float
    with_input: bool  # a baddbmm adds its input (the last chain op)
    split: Optional[tuple]

    @property
    def canonical(self) -> tuple:
        """The shape of the scores the op computes: `split`, or the product's."""
        return self.split if self.split is not None else shape(self.product)

    @property
    def rank(self) -> int:
        return len(self.canonical)


def _scores_side(x: fx.Node, softmax: fx.Node, between: list) -> Union[_ScoresSide, str]:
    """The scores side of `softmax` from its input x (`_chain`, `_softcap`, no narrowing cast, a
    baddbmm's input, `_regions`), or why not."""
    r = _chain(x, softmax, between)
    if isinstance(r, str):
        return r
    product, ops, nodes = r
    softcap = _softcap(ops)
    if isinstance(softcap, str):
        return softcap
    narrowed = _narrowing_cast([product] + list(reversed(nodes)) + [softmax])
    if narrowed is not None:
        return narrowed
    added = _baddbmm_input(product)
    if isinstance(added, str):
        return added
    ops, nodes = ops + added, nodes + [product] * len(added)
    regions = _regions(ops, nodes, product)
    if isinstance(regions, str):
        return regions
    ps = shape(product)
    split = next((reg for reg in reversed(regions) if len(ps) == 3 and len(reg) == 4
                  and known_equal(reg[0] * reg[1], ps[0]) and same_shape(reg[2:], ps[1:])), None)
    return _ScoresSide(product, ops, nodes, regions, softcap, bool(added), split)


def _baddbmm_input(product: fx.Node) -> Union[list, str]:
    """[("add", input, False)] for baddbmm(input, q, kᵀ, beta=1, alpha), whose input is added to the
    scores (BLOOM's ALiBi); [] for another product (a baddbmm with beta=0 ignores its input); or
    why not."""
    c = call_of(product)
    if c.name != "baddbmm" or constant_number(c["beta"]) == 0:
        return []
    if constant_number(c["beta"]) != 1:
        return f"baddbmm with beta={c['beta']} scales the bias it adds"
    if tensor_meta(c["input"]) is None:
        return "the baddbmm input has no tensor metadata"
    return [("add", c["input"], False)]


def _regions(ops: list, nodes: list, product: fx.Node) -> Union[list, str]:
    """The shape of the scores where each chain op acts (a batch view changes it for the ops above
    it), or why a chain op broadcasts the scores to another shape."""
    regions, region = [], shape(product)
    for op, n in reversed(list(zip(ops, nodes))):
        if op[0] == "batch_view":
            region = shape(n)
        regions.append(region)
    regions.reverse()
    for n, reg in zip(nodes, regions):
        if not same_shape(shape(n), reg):
            return f"mask broadcasts the scores from {fmt_shape(reg)} to {fmt_shape(shape(n))}"
    return regions


# ------------------------------------------------------------------------------- operands


@dataclass
class _Operands:
    """q, k, v for the op, the view ops on its output, the constant scale folded from q and k and
    the run-time factors [(node, divide)] on them."""

    q: _Operand
    k: _Operand
    v: _Operand
    out_ops: tuple
    qk_scale: float
    runtime_scale: list
    cast: Optional[torch.dtype] = None  # autocast's: the dtype both products ran in (`_one_dtype`)


def _product_operands(sc: _ScoresSide, ws: _WeightsSide) -> Union[_Operands, str]:
    """q and k of the product (`_product`) and v (`_v_in_canonical`), read in the canonical shape,
    or why not."""
    r = _product(sc.product, heads=sc.split[:2] if sc.split is not None else None, with_input=sc.with_input)
    if isinstance(r, str):
        return r
    q, k, qk_scale, runtime_scale = r
    if sc.rank not in (2, 3, 4, 5):
        return f"scores of rank {sc.rank} (only 2-D to 5-D attention)"
    r = _v_in_canonical(sc, ws)
    if isinstance(r, str):
        return r
    v, out_ops = r
    return _Operands(q, k, v, out_ops, qk_scale, runtime_scale)


def _v_in_canonical(sc: _ScoresSide, ws: _WeightsSide) -> Union[tuple, str]:
    """(v, view ops on the op's output): w·v's, or where the weights are multiplied with v over
    merged (batch, heads) and the scores are split, v from the 4-D tensor it was merged from and
    the output flattened back; or why not."""
    ss, wv = sc.canonical, shape(ws.w)
    if same_shape(wv, ss):
        return ws.v, ws.out_ops
    if not (sc.split is not None and len(wv) == 3 and known_equal(wv[0], shape(sc.product)[0])
            and same_shape(wv[1:], ss[2:]) and not ws.v.ops and not ws.out_ops):
        return f"the weights are multiplied with v as {fmt_shape(wv)}, not as the scores {fmt_shape(ss)}"
    v4 = _merged_from(ws.v.node, ss[:2])
    if v4 is None:
        return "the weights are multiplied with v over merged (batch, heads), but v is no view of a 4-D tensor"
    return _Operand(v4), (("flatten", 0, 1),)


@dataclass
class _Sizes:
    """What the op reads off q, k and v: lengths, head dims, q's heads (dim 1) and whether one k/v
    head is broadcast over them by the products (`_broadcast_mqa`)."""

    lq: Any
    lk: Any
    d: Any
    dv: Any
    heads: Any
    mqa: bool


def _sizes(o: _Operands, sc: _ScoresSide, pv: fx.Node) -> Union[_Sizes, str]:
    """The sizes of q, k, v, or why their shapes do not make attention with the canonical scores
    and the output pv."""
    try:
        qv, kv, vv = o.q.value(), o.k.value(), o.v.value()
    except Exception as e:  # noqa: BLE001
        return f"cannot read q/k/v shapes: {e}"
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv)):
        return "q/k/v have no tensor metadata"
    ss, rank = sc.canonical, sc.rank
    if not (qv.dim() == kv.dim() == vv.dim() == rank):
        return f"q, k, v ranks {qv.dim()}, {kv.dim()}, {vv.dim()} differ from the scores' {rank}"
    batch = tuple(qv.shape[:-2])
    lq, d = qv.shape[-2], qv.shape[-1]
    lk, dv = kv.shape[-2], vv.shape[-1]
    mqa = rank == 4 and _broadcast_mqa(qv.shape, kv.shape, vv.shape)
    shapes = f"{fmt_shape(qv.shape)}, {fmt_shape(kv.shape)}, {fmt_shape(vv.shape)}"
    if not mqa and not (same_shape(kv.shape[:-2], batch) and same_shape(vv.shape[:-2], batch)):
        return f"q, k, v batch dims differ: {shapes}"
    if not (known_equal(kv.shape[-1], d) and known_equal(vv.shape[-2], lk)):
        return f"q, k, v shapes do not fit attention: {shapes}"
    if not same_shape(ss, batch + (lq, lk)):
        return f"scores {fmt_shape(ss)} are not q·kᵀ of q {fmt_shape(qv.shape)}, k {fmt_shape(kv.shape)}"
    pv_shape = batch + (lq, dv)
    if o.out_ops and o.out_ops[0][0] == "flatten":
        pv_shape = (pv_shape[0] * pv_shape[1],) + pv_shape[2:]
    elif o.out_ops:
        pv_shape = tuple(pv_shape[i] for i in o.out_ops[0][1:])
    if not same_shape(shape(pv), pv_shape):
        return f"output {fmt_shape(shape(pv))} is not weights·v {fmt_shape(pv_shape)}"
    return _Sizes(lq, lk, d, dv, qv.shape[1] if rank == 4 else None, mqa)


def _one_dtype(o: _Operands, products: tuple) -> Union[_Operands, str]:
    """o with q, k, v of one dtype the op takes: as they are, or without their float casts where
    the dtypes differ (`_strip_cast`), or cast to the 16-bit dtype both `products` ran in under
    autocast (`_autocast_dtype`); or why not."""
    dtypes = [x.value().dtype for x in (o.q, o.k, o.v)]
    cast = _autocast_dtype(dtypes, products)
    if cast is not None:
        return dataclasses.replace(o, cast=cast)
    if len(set(dtypes)) > 1:
        o = dataclasses.replace(o, q=_strip_cast(o.q), k=_strip_cast(o.k), v=_strip_cast(o.v))
        dtypes = [x.value().dtype for x in (o.q, o.k, o.v)]
        if len(set(dtypes)) > 1:
            return f"q, k, v dtypes differ: {', '.join(map(str, dtypes))}"
    if dtypes[0] not in _DTYPES:
        return f"dtype {dtypes[0]} (the op takes fp16, bf16, fp32, fp64)"
    return o


def _autocast_dtype(dtypes: list, products: tuple) -> Optional[torch.dtype]:
    """The dtype autocast ran q·kᵀ and w·v in, where it cast wider q, k, v down (None: it did
    not). Without autocast a product's dtype is its operands' (mixed dtypes raise), so products
    of one 16-bit dtype over a wider operand are autocast's: HF Llama under
    ``torch.autocast(dtype=bfloat16)`` has fp32 q, k (its rotary promotes them with fp32
    cos/sin), bf16 v, and bf16 products. The op then takes q, k, v cast to that dtype, as the
    products did (its scores and softmax stay fp32; autocast rounds the scores to bf16)."""
    out = {dtype(p) for p in products}
    if len(out) != 1:
        return None
    (low,) = out
    if low not in (torch.float16, torch.bfloat16):
        return None
    if not all(d in _DTYPES and d.itemsize >= low.itemsize for d in dtypes):
        return None
    return low if any(d != low for d in dtypes) else None


def _gqa(o: _Operands, sizes: _Sizes, rank: int) -> Union[tuple, str]:
    """(k, v, q heads per kv head): k/v of one head broadcast over q's heads (Falcon: GQA of one
    group), or un-repeated (`_unrepeat_kv`); else as they are, with 1; or why not."""
    if sizes.mqa:
        if not isinstance(sizes.heads, int):
            return "k/v of one head broadcast over a symbolic number of q heads"
        return o.k, o.v, sizes.heads
    if rank == 4:
        uk, uv = _unrepeat_kv(o.k), _unrepeat_kv(o.v)
        if uk is not None and uv is not None and uk[1] == uv[1] and known_equal(shape(uk[0])[1], shape(uv[0])[1]):
            return _Operand(uk[0]), _Operand(uv[0]), uk[1]
    return o.k, o.v, 1


def _head_dims(sizes: _Sizes) -> Optional[str]:
    """Why the head dims are not the kernels' (None: they are)."""
    for name, val in (("D", sizes.d), ("Dv", sizes.dv)):
        if not size_in_range(val, *HEAD_DIM_RANGE):
            return f"head dim {name}={val} outside the kernel's [{HEAD_DIM_RANGE[0]}, {HEAD_DIM_RANGE[1]}]"
    return None


# ------------------------------------------------------------------------------- masks


@dataclass
class _CarriedMask:
    """A mask added in another region of the chain, carried to the canonical scores: its view ops
    (batch_views.carry_mask) as detached nodes `views` (graph_edit.detached), the last the carried
    mask; `replace` builds them just before `at`, the chain node that adds the mask."""

    mask: fx.Node
    at: fx.Node
    views: list


@dataclass
class _Carry:
    """The chain ops with the masks of other regions `carried`, and their window period (None: the
    bias is not window-periodic)."""

    ops: list
    carried: list
    period: Optional[int]


def _carry_masks(sc: _ScoresSide, periodic: bool) -> Union[_Carry, str]:
    """The chain ops with the masks added in other regions carried to the canonical scores, or why
    one cannot be. With `periodic`, masks that allow it become window-periodic (batch_views); where
    they disagree on the period, all are carried whole."""
    ss = sc.canonical
    plans = {}
    for i, (op, reg) in enumerate(zip(sc.ops, sc.regions)):
        if op[0] not in ("add", "fill") or same_shape(reg, ss):
            continue
        how = carry_mask(shape(op[1]), reg, ss, periodic)
        if isinstance(how, str):
            return how
        plans[i] = how
    periods = {p for _, p in plans.values() if p is not None}
    if len(periods) > 1:  # two window counts: carried whole
        return _carry_masks(sc, periodic=False)
    ops, carried = list(sc.ops), []
    for i, (how, _) in plans.items():
        if how:
            carried.append(_carried_mask(ops[i][1], how, sc.nodes[i]))
            ops[i] = (ops[i][0], carried[-1].views[-1]) + tuple(ops[i][2:])
    return _Carry(ops, carried, periods.pop() if periods else None)


def _carried_mask(mask: fx.Node, how: list, at: fx.Node) -> _CarriedMask:
    """`mask` carried by the view ops `how` [(method, *args)], as detached nodes."""
    gm = at.graph.owning_module
    fake_mode = graph_fake_mode(gm) if gm is not None else None
    views, m = [], mask
    for meth, *a in how:
        m = detached("call_method", meth, (m, *a), mask, fake_mode)
        views.append(m)
    return _CarriedMask(mask, at, views)


@dataclass
class _Masks:
    """The scale and masks of the chain as the op takes them (attention_bias.causal_or_bias), and
    the carry they were read from."""

    scale: float
    scale_nodes: list  # [(node, divide)]
    bias_parts: list
    is_causal: bool
    causal_note: str
    notes: list
    window: int
    chunk: int
    documents: Optional[fx.Node]
    dead_average: Optional[float]  # see AttentionSite
    carry: _Carry


def _masks(sc: _ScoresSide, carry: _Carry, sizes: _Sizes, chunks: bool = True,
           documents: bool = True, dead_rows: bool = False) -> Union[_Masks, str]:
    """The chain's masks read (attention_bias.read_masks, causal_or_bias), or why not. A
    window-periodic carry that another mask does not fit (one per image) is redone whole.
    ``dead_rows``: the site can take a window beside other parts of one absorbing fill, its rows
    masked everywhere fixed after the op (attention_bias.window_beside_one_fill)."""
    r = _read_masks(carry, sc.canonical, sizes)
    if isinstance(r, str) and carry.period is not None:
        carry = _carry_masks(sc, periodic=False)
        if isinstance(carry, str):
            return carry
        r = _read_masks(carry, sc.canonical, sizes)
    if isinstance(r, str):
        return r
    # (documents only from masks of the scores' own region: not carried across batch views)
    plain = carry.period is None and not carry.carried
    r2 = causal_or_bias(r, chunks, documents and plain, dead_rows and plain)
    if isinstance(r2, str):
        return r2
    return _Masks(r.scale, r.scale_nodes, *r2, carry)


def _read_masks(carry: _Carry, ss: tuple, sizes: _Sizes):
    """read_masks of the carried chain ops, on the scores of one window period where it has one."""
    scores = ss if carry.period is None else (carry.period,) + tuple(ss[1:])
    return read_masks([op for op in carry.ops if op[0] not in ("tanh", "batch_view")], scores, sizes.lq, sizes.lk)


def _part_node(p: Any) -> Any:
    """The tensor a bias part reads."""
    return p.node if isinstance(p, BiasTerm) else p.mask


# ------------------------------------------------------------------------------- the site's nodes


def _site_nodes(sc: _ScoresSide, softmax: fx.Node, ws: _WeightsSide, inputs: list, extra=()) -> Union[list, str]:
    """The nodes from the product to w·v, which the op takes over, or why it cannot: one is also
    used outside the site, or one of the op's `inputs` is written in place after the site first
    reads it (the op stands just before w·v: writes.write_between). `extra`: the nodes between the
    scores and the weights of a sink form (patterns/sinks.py)."""
    matched = list(dict.fromkeys([sc.product] + list(reversed(sc.nodes)) + list(extra) + [softmax] + ws.between
                                 + [ws.pv]))
    for n in matched:
        if n is not ws.pv and any(u not in matched and not _shape_use_in_chain(u, n, matched) for u in n.users):
            return f"{n.name} is also used outside the attention"
    why = write_between(inputs, matched, ws.pv, graph_order(softmax.graph))
    return matched if why is None else why


def _broadcast_mqa(q: tuple, k: tuple, v: tuple) -> bool:
    """k and v (B, 1, Lk, D) next to q (B, H, Lq, D): one kv head broadcast over q's heads by the
    matmuls (Falcon's multi-query attention), i.e. GQA with a single kv head."""
    return (known_equal(k[1], 1) and known_equal(v[1], 1) and not known_equal(q[1], 1)
            and known_equal(k[0], q[0]) and known_equal(v[0], q[0]))


def _narrowing_cast(nodes: list) -> Optional[str]:
    """Why the chain (product → softmax, the softmax's own dtype= last) is refused, if a cast in it
    narrows the scores' float dtype (float64 → float32, float32 → float16, ...): eager then rounds
    the scores and masks (finfo.min of float64 becomes -inf in float32, turning uniform rows
    into NaN ones), which the op, computing in the wider dtype, would not."""
    widest = None
    for n in nodes:
        dt = dtype(n)
        if dt is None or not dt.is_floating_point:
            continue
        if widest is not None and dt.itemsize < widest.itemsize:
            return f"the scores are cast from {widest} down to {dt} before the softmax ({n.name})"
        if widest is None or dt.itemsize > widest.itemsize:
            widest = dt
    return None


def _strip_cast(x: _Operand) -> _Operand:
    """x without a float cast on it (q.float() @ k.float().mT: the op computes in float32 anyway)."""
    uncast = float_cast_input(x.node) if not x.ops else None
    return x if uncast is None else _Operand(uncast)


# =============================================================================== replace


def _needs_eager_strides(output: fx.Node) -> bool:
    """Does a use of the attention output depend on its strides? The op lays its output out
    (B, L, H, D) (ops/attention.py), where eager's w·v is contiguous: fine for every op a model
    applies to it except `view` (which needs compatible strides) and a graph output, whose
    strides a subgraph must keep (both branches of a `cond` return the same layout) and a caller
    may read. Those get the eager layout back by a copy."""
    for u in output.users:
        if u.op == "output":
            return True
        if (u.op == "call_method" and u.target == "view") or u.target in (torch.Tensor.view,
                                                                          torch.ops.aten.view.default):
            return True
    return False


def _finite_mask_values(part) -> bool:
    """Can the bias part put a finite mask value (<= MASK_VALUE_MAX, e.g. HF's finfo.min) on a
    score? A causal part of finite value, or an additive term built in the graph from such a
    constant (`full(min).triu(1)`, `zeros.masked_fill(~keep, min)`, `(1 - mask) * min`: a
    constant among the arguments of the ops that make it, a few ops deep). A term of unknown
    values (an input, a parameter) is not counted."""
    if isinstance(part, CausalPart):
        return part.value != -math.inf
    if not isinstance(part, BiasTerm):
        return False
    todo, seen = [(part.node, 0)], set()
    while todo:
        node, depth = todo.pop()
        if node in seen or depth > 6 or node.op not in ("call_function", "call_method"):
            continue
        seen.add(node)
        for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, fx.Node):
                todo.append((a, depth + 1))
            elif isinstance(a, (int, float)) and not isinstance(a, bool) and a != -math.inf and is_mask_value(a):
                return True
    return False


def why_not_sdpa(site: AttentionSite) -> Optional[str]:
    """Why `site` cannot become an SDPA call computing what eager does (None: it can): SDPA has no
    softcap and no replace mask (a finite fill next to other terms), and its causal mask and
    window-periodic bias are built at static sizes."""
    if site.softcap:
        return "a softcap"
    if site.sinks is not None:
        return "sinks"
    if site.window:
        return "a sliding window (SDPA takes one only as a dense mask, which our op skips)"
    if site.chunk:
        return "chunks (SDPA takes them only as a dense mask, which our op skips)"
    if site.documents is not None:
        return "documents (SDPA takes them only as a dense mask, which our op skips)"
    if any(isinstance(p, MaskFill) and p.value != -math.inf for p in site.bias_parts):
        return "a finite fill (the op's replace mask)"
    values = [site.q.value(), site.k.value()]
    finite = [p for p in site.bias_parts if _finite_mask_values(p)]
    if any(isinstance(p, BiasTerm) for p in finite) or (finite and len(site.bias_parts) > 1):
        # A row whose every visible score carries finfo.min: eager (and SDPA's MATH backend) average
        # it, but SDPA drops it, on the CPU (torch 2.13's flash backward gives it 0; the fuzzer's
        # seeds 1073 and 2452) and on CUDA (the efficient and cuDNN backends: output 0.44 off
        # MATH's, dq 0; H100, torch 2.11, stop 33). A finite causal part alone never makes such a
        # row (every row keeps key 0 and its own key): only beside another part that can hide
        # keys. Finite fills are refused above; a float bias of unknown values is not.
        return ("a finite mask value (SDPA's backward drops rows masked by a finite value "
                "everywhere)")
    if any(not isinstance(n, int) for t in values for n in t.shape):
        return "dynamic shapes"
    return None


def replace(gm: fx.GraphModule, site: AttentionSite, ctx: dict, as_sdpa: bool = False,
            repeat_kv: bool = False) -> str:
    """Build the plan `site`: the carried masks, then the op (with `as_sdpa`: an SDPA call, see
    `_sdpa_call`; `repeat_kv`: a GQA site's k/v repeated for it); it takes over the uses of the
    output, and the dead matched nodes are erased. Returns the detail for the report."""
    b = NodeBuilder(gm.graph, site.output, site.softmax, ctx.get("fake_mode"))
    try:
        bias_parts = _build_carried(b, site)
        q = _build_operand(b, site.q)
        for node, divide in site.scale_nodes:
            q = b.function(operator.truediv if divide else operator.mul, q, node)
        k, v = _build_operand(b, site.k), _build_operand(b, site.v)
        if site.cast is not None:
            q, k, v = (b.method("to", t, site.cast) for t in (q, k, v))
        for _ in range(4 - site.rank):
            q, k, v = (b.method("unsqueeze", t, 0) for t in (q, k, v))
        if site.rank == 5:  # (B, W, H, L, D), Twins' windows: batch and windows merged (a view where they can be)
            q, k, v = (b.method("flatten", t, 0, 1) for t in (q, k, v))
        bias_dtype = torch.float64 if dtype(site.scores) == torch.float64 else torch.float32
        memo = ctx.setdefault("bias_memo", {})
        bias, bias_kind = build_bias(b, bias_parts, memo, bias_dtype)
        replaced = None if as_sdpa else replace_mask(b, bias_parts, memo)
        if as_sdpa:
            out = _sdpa_call(b, site, q, k, v, bias, repeat_kv)
        else:
            out = _op_call(b, site, q, k, v, bias, replaced)
        for _ in range(4 - site.rank):
            out = b.method("squeeze", out, 0)
        if site.rank == 5:
            out = b.method("unflatten", out, 0, tuple(example_value(site.scores).shape[:2]))
        for m, *a in site.out_ops:
            out = b.method(m, out, *a)
        want = example_value(site.output)
        if b.fake_mode is not None:
            got = example_value(out)
            if got.dtype != want.dtype:
                out = b.method("to", out, want.dtype)
                got = example_value(out)
            if not same_shape(tuple(got.shape), tuple(want.shape)):
                raise RuntimeError(f"replacement has shape {tuple(got.shape)}, eager {tuple(want.shape)}")
            if _needs_eager_strides(site.output) and want.is_contiguous() and not got.is_contiguous():
                out = b.method("contiguous", out)
        elif dtype(q) is not None and want is not None and dtype(q) != want.dtype:
            out = b.method("to", out, want.dtype)
    except Exception:
        b.rollback()
        raise
    site.output.replace_all_uses_with(out)
    # an in-place op among the matched nodes writes only into the matched scores: erased with them
    erase_dead(gm.graph, site.matched, with_dead_inputs=True)
    parts = [f"scale={site.scale:.6g}"]
    if site.scale_nodes:
        rows = any(shape(n) for n, _ in site.scale_nodes)
        parts.append("run-time scale applied to q" + (" (a factor per query row)" if rows else ""))
    if site.is_causal:
        parts.append(f"is_causal ({site.causal_note})")
    if bias is not None:
        parts.append(f"bias: {bias_kind}" + (f", window-periodic ({site.period} windows)" if site.period else ""))
    if replaced is not None:
        parts.append("replace mask (finite fill)")
    if site.kv_groups > 1:
        parts.append(f"GQA: k/v repeated for the SDPA call ({site.kv_groups} q heads per kv head)" if as_sdpa
                     and repeat_kv else f"GQA: k/v un-repeated ({site.kv_groups} q heads per kv head)")
    if site.sinks is not None:
        parts.append("sinks (a logit per head in the softmax, dropped after it)")
    if site.dropout_p:
        parts.append(f"dropout p={site.dropout_p:g} " + ("in SDPA" if as_sdpa else "in the kernel"))
    if site.softcap:
        parts.append(f"softcap={site.softcap:g}")
    if site.rank < 4:
        parts.append(f"{site.rank}-D")
    if site.safe:
        parts.append("_safe_softmax: rows masked everywhere give 0")
    if as_sdpa:
        parts.append("an SDPA call in its place")
    parts += site.notes
    return ", ".join(parts)


def _op_call(b: NodeBuilder, site: AttentionSite, q, k, v, bias, replaced) -> fx.Node:
    """Our op's output for the site (dropout's seed drawn, the softcap and replace mask passed)."""
    seed = ()
    if site.dropout_p:
        # A fresh seed per call from torch's RNG: the op's forward and backward draw the same mask.
        seed = (b.factory(site.q.node, torch.randint, 0, 2**62, (), dtype=torch.int64,
                          device=device_of(site.q.node)),)
    extra = {"softcap": float(site.softcap)} if site.softcap else {}
    if replaced is not None:  # scores a finite fill replaced are the bias alone (attention_bias.py)
        extra["replace"] = replaced
    if site.window:  # a causal sliding window: the kernels skip the key blocks it hides
        extra["window"] = site.window
    if site.chunk:  # causal chunks: likewise the key blocks outside each query's chunk
        extra["chunk"] = site.chunk
    if site.documents is not None:  # ids (L,) or (B, L): the key blocks outside each query block's documents
        docs = site.documents
        extra["documents"] = b.method("unsqueeze", docs, 0) if len(shape(docs)) == 1 else docs
    if not site.safe and site.dead_average is None and not choice.needs_grad(site):
        # inference: no backward reads the lse (under autograd the op computes it regardless)
        extra["need_lse"] = False
    if site.sinks is not None:  # match_attention took no softcap with sinks
        sinks = b.method("reshape", site.sinks, -1)
        rep = {"replace": replaced} if replaced is not None else {}
        if site.window:
            rep["window"] = site.window
        op = b.function(SINKS_OP, q, k, v, bias, site.dropout_p, site.is_causal, float(site.scale), sinks, *seed,
                        **rep)
    else:
        op = b.function(ATTENTION_OP, q, k, v, bias, site.dropout_p, site.is_causal, float(site.scale), *seed,
                        **extra)
    out = b.function(operator.getitem, op, 0)
    if site.safe:  # _safe_softmax / SDPA: 0 in the rows whose every score is -inf
        out = _zero_dead_rows(b, op, out)
    if site.dead_average is not None:
        out = b.function(_average_dead_rows, out, b.function(operator.getitem, op, 1), q, k, v, float(site.scale))
    return out


def _average_dead_rows(out, lse, q, k, v, scale: float):
    """``out`` with eager's values and gradients in the rows a window beside one absorbing fill
    masks everywhere (attention_bias.window_beside_one_fill; shapes: out (B, Hq, Lq, Dv), lse (B,
    Hq, Lq), q (B, Hq, Lq, D), k / v (B, Hkv, Lk, D / Dv)). Every score of such a row is the fill
    in eager, so its weights are 1 / Lk on every key: the output is v's mean over the keys, and the
    gradients are those of uniform weights: dq_i = scale / Lk · Σ_j (dout_i · (v_j − v̄)) k_j, and
    likewise into k; into v, dout_i / Lk. With M = Σ_j (v_j − v̄) k_jᵀ (v detached), the row
    v̄ + scale / Lk · (M q_i − (M q_i).detach()) has exactly that value and those gradients. The
    op's lse tells the rows: a row with a visible key has lse >= its largest score, one without
    has lse ~ the fill (or -inf, or NaN where the kernels skipped every key). O(B·H·L·D·Dv) extra work,
    two small products beside the attention; the op's own rows there get no gradient."""
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[-2]
    vbar = v.mean(dim=-2, keepdim=True)  # (B, Hkv, 1, Dv)
    m = (v - vbar).detach().transpose(-2, -1) @ k  # (B, Hkv, Dv, D)
    qg = q.reshape(B, Hkv, (Hq // Hkv) * Lq, q.shape[-1])
    mq = (qg @ m.transpose(-2, -1)).reshape(B, Hq, Lq, -1) * (scale / Lk)
    avg = vbar.repeat_interleave(Hq // Hkv, dim=1) + (mq - mq.detach())
    # (every fill taken is <= ABSORBING, and a live row's lse is far above: not fill / 2, which for
    # float64's finfo.min is -inf in the lse's float32)
    dead = torch.logical_not(lse >= ABSORBING / 2).unsqueeze(-1)
    return torch.where(dead, avg.to(out.dtype), out)


# SDPA calls the rewrite itself emits (an SDPA call site's rewrite leaves them alone)
EMITTED = "fuse_plugin_emitted"


def _sdpa_call(b: NodeBuilder, site: AttentionSite, q, k, v, bias, repeat_kv: bool = False) -> fx.Node:
    """An SDPA call computing the site as eager does (where it was measured fastest, choice.py):
    the bias as its attn_mask (a window-periodic one repeated over the batch; a float one in q's
    dtype, as SDPA takes it), a causal mask next to a bias folded into it (SDPA takes one or the
    other), k/v un-repeated with enable_gqa, or (``repeat_kv``) repeated to the query heads as HF's
    repeat_kv does (in float32 only that call reaches the efficient kernel; choice.decide_from).
    Rows masked everywhere: eager's NaN (SDPA gives 0),
    unless the site was a _safe_softmax or its bias is learned parameters alone (bias_source.py:
    -inf on a whole row only where they are); their gradients are SDPA's (finite where eager's are
    NaN).
    Dropout draws SDPA's own mask. The extra work (the periodic bias's copy, timed with SDPA in
    the table; the dead-row test, one read of the mask) is small beside the attention."""
    qv, kv = example_value(q), example_value(k)
    causal = site.is_causal
    if bias is not None and site.period:
        bias = b.method("repeat", bias, qv.shape[0] // site.period, 1, 1, 1)
    if bias is not None and causal:
        keep = b.method("tril", b.factory(site.q.node, torch.ones, qv.shape[-2], kv.shape[-2], dtype=torch.bool,
                                          device=device_of(site.q.node)))
        bias = (b.function(torch.logical_and, bias, keep) if dtype(bias) == torch.bool
                else b.function(torch.where, keep, bias, -math.inf))
        causal = False
    if bias is not None and dtype(bias) != torch.bool and dtype(bias) != qv.dtype:
        bias = b.method("to", bias, qv.dtype)
    gqa = site.kv_groups > 1
    if gqa and repeat_kv:  # (B, Hkv, L, D) -> (B, Hkv * groups, L, D), head h reading kv head h // groups
        k, v = (b.method("flatten", b.method("expand", b.method("unsqueeze", t, 2), -1, -1, site.kv_groups, -1, -1),
                         1, 2) for t in (k, v))
        gqa = False
    out = b.function(torch.nn.functional.scaled_dot_product_attention, q, k, v, attn_mask=bias,
                     dropout_p=site.dropout_p, is_causal=causal, scale=float(site.scale),
                     enable_gqa=gqa)
    out.meta[EMITTED] = True
    if bias is not None and not site.safe and not _learned_bias(site):  # eager: NaN in rows whose every
        # score is masked (a bias of parameters alone is -inf on a whole row only where they are)
        dead = (b.function(torch.logical_not, b.method("any", bias, -1, True)) if dtype(bias) == torch.bool
                else b.method("all", b.function(torch.isneginf, bias), -1, True))
        out = b.function(torch.where, dead, math.nan, out)
    return out


def _learned_bias(site: AttentionSite) -> bool:
    """Is every part of the site's bias computed from parameters alone (bias_source.py)?"""
    return bool(site.bias_parts) and site.period is None and all(
        isinstance(p, BiasTerm) and from_parameters(p.node) for p in site.bias_parts)


def _zero_dead_rows(b: NodeBuilder, op: fx.Node, out: fx.Node) -> fx.Node:
    """``out`` with 0 where a row's every score is -inf (what `_safe_softmax` and SDPA give; the op
    gives NaN there, eager softmax's value): the rows whose lse is -inf and whose output is NaN.
    Not lse alone: the fp32 lse of a float64 row biased by float64's finfo.min is -inf too, while
    the row is not masked (its weights are uniform, its output finite)."""
    lse = b.function(operator.getitem, op, 1)
    dead = b.function(operator.and_, b.method("unsqueeze", b.function(torch.isneginf, lse), -1),
                      b.function(torch.isnan, out))
    return b.function(torch.where, dead, 0.0, out)


def _build_carried(b: NodeBuilder, site: AttentionSite) -> list:
    """Build the masks carried across batch views, each just before the chain node that adds it;
    returns the site's bias parts reading the built masks instead of the detached ones."""
    built: dict = {}
    for c in site.carried:
        built.update(b.sibling(c.mask, before=c.at).build(c.views))
    out = []
    for p in site.bias_parts:
        if isinstance(p, BiasTerm) and p.node in built:
            p = dataclasses.replace(p, node=built[p.node])
        elif isinstance(p, MaskFill) and p.mask in built:
            p = dataclasses.replace(p, mask=built[p.mask])
        out.append(p)
    return out


def _build_operand(b: NodeBuilder, x: _Operand) -> fx.Node:
    """The node holding operand x: its node with its view ops applied."""
    n = x.node
    for m, *args in x.ops:
        n = b.method(m, n, *args)
    return n


# =============================================================================== entry point


def _is_softmax(node: fx.Node) -> bool:
    c = call_of(node)
    return c is not None and c.name in ("softmax", "safe_softmax")


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    """Replace every attention in gm (in place); report each softmax as replaced or missed."""
    softmaxes = [n for n in gm.graph.nodes if _is_softmax(n)]
    if not softmaxes:
        return
    ctx: dict = {"fake_mode": graph_fake_mode(gm)}
    for sm in softmaxes:
        if getattr(sm, "_erased", False):
            continue
        try:
            site = match_attention(sm)
            if isinstance(site, str):
                report.missed(KIND, sm, site)
                continue
            decision = choice.decide(site)
            gathers = bias_table.gathers_of(site)
            if not decision.ours:
                if decision.as_stock:
                    mark_as_stock(sm)
                report.left_as_is(KIND, sm, decision.reason + bias_table.swap(gm, gathers, ctx))
                continue
            detail = replace(gm, site, ctx, as_sdpa=decision.as_sdpa, repeat_kv=decision.repeat_kv) \
                + bias_table.swap(gm, gathers, ctx)
            report.replaced(KIND, sm, detail + (f"; {decision.reason}" if decision.reason else ""))
            if decision.as_sdpa:  # counted among the replaced too ("attention")
                counters["fuse_plugin"]["attention_as_sdpa"] += 1
        except Exception as e:  # noqa: BLE001  (never break compile: leave this site as it was)
            log.warning("fuse_plugin: attention at %s left unfused after an internal error", sm.name, exc_info=True)
            report.missed(KIND, sm, f"internal error, left unfused: {type(e).__name__}: {e}")
