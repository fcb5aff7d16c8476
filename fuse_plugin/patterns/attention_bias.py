"""The scale and masks between q·kᵀ and the softmax, as the op takes them: a scale, is_causal,
one bias and, next to a finite fill, a replace mask.

`read_masks` reads the ops of a score chain (from `attention._chain`, bottom-up: ("scale",
factor, divide), ("add", bias, subtract), ("fill", mask, masked_when, value), and ("cast",),
("const",), ("split_batch",), which change nothing here) into mask parts:

    BiasTerm     an additive bias (times the constant scales applied after it)
    MaskFill     masked_fill / where with a mask value (<= MASK_VALUE_MAX or -inf)
    CausalPart   a part proven to be the top-left causal mask (`causal_mask.is_causal_mask`)

`causal_or_bias` decides whether the causal part can become `is_causal` (or refuses the chain),
and notes the structure of the other parts (mask_structure.py: windows, chunks, documents);
`build_bias` emits one bias for the rest: -inf fills as a bool mask, anything else as an additive
bias that replays the chain's masks, in eager's order, on zero scores, so that every score a fill
replaces gets exactly eager's value there (the fill value, plus the terms added after it), and the
sum of the terms elsewhere. With a finite fill, `replace_mask` gives the op its `replace` argument:
the union of the fill masks, the scores some fill replaced. The op then computes

    s = where(replace, bias, q·kᵀ·scale + bias)

which is eager's chain exactly: a replaced score is the bias's value and sends no gradient into q
or k (eager's fill cuts it), the bias gets dS everywhere, and autograd of the replayed graph ops
(where / add / neg / mul on the terms) gives each term eager's gradient (0 where a later fill
overwrote it, dS where it was added after the fill or where no fill holds).

Fully masked rows, the cases (eager semantics, which the rewrite keeps):
  * -inf fills / bool masks / additive -inf: NaN output; eager's fill backward gives dq 0 and
    leaves dk finite, which the op's backward does too (a row whose lse is -inf adds nothing);
  * finite fills (finfo.min, -1e9, -1e4, different ones mixed, with -inf ones): softmax over the
    fill values themselves (uniform over the largest), no gradient into q·kᵀ: the replace mask;
  * additive masks only: softmax of score + mask, with gradient (the op adds the bias the same way);
  * a finite fill together with additive terms, in either order: the replace mask too. Eager's
    row then mixes filled scores (no gradient into q·kᵀ; the fill value plus the terms added
    after the fill, which get their gradient) and scores with terms added (gradient into both);
    the op computes each score as eager does, whatever the terms hold at run time (a learned
    bias, or itself a mask of -inf / finfo.min). DeBERTa-v2 (its relative-position bias added
    before the finfo.min padding fill) and GPT-2 / Inductor's sfdp_19 (where(causal, s,
    finfo.min), then the additive padding mask) are fused this way. (Without the replace mask,
    an additive term that is itself a mask was wrong in rows masked everywhere: the differential
    fuzzer's seeds 196, 405 and 453 of stop 14.)
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import fx

from .canon import (broadcasts_to, call_of, device_of, dtype, example_value, fmt_shape, is_identity, known_equal,
                    known_true, same_shape, shape, written)
from .causal_mask import (MASK_VALUE_MAX, Select, abstract_value, all_true, cast_value, causal_source,
                          constant_number, is_causal_mask, is_mask_value)
from .graph_edit import NodeBuilder, precedes
from .mask_structure import notes as structure_notes
from .mask_structure import band_of, documents_arg
from .writes import written_since

dtype_of = dtype  # (build_bias has a `dtype` argument)

@dataclass
class BiasTerm:
    """An additive bias term: node (negated: subtracted), times the constant scales after it."""

    node: fx.Node
    negate: bool = False
    scale: float = 1.0


@dataclass
class MaskFill:
    """Scores set to `value` where mask == masked_when (masked_fill: True; where(c, x, v): False)."""

    mask: fx.Node
    masked_when: bool
    value: float
    scale: float = 1.0  # constant scales applied after the fill (eager's value is value * scale)


@dataclass
class CausalPart:
    """A mask part proven to be the top-left causal mask."""

    value: float  # the fill value of the causal mask (-inf or a finite mask value)
    source: str


MaskPart = Union[BiasTerm, MaskFill, CausalPart]


@dataclass
class ScoreMasks:
    """The scale and masks of a chain: `raw` has one part per chain op; `split` the same with
    causal parts split off (`CausalPart`). `scale_nodes`: [(node, divide)], run-time factors."""

    scale: float
    scale_nodes: list
    raw: list
    split: list
    lq: Any = None  # the query and key lengths (ints or SymInts)
    lk: Any = None


def read_masks(ops: list, scores_shape, lq, lk) -> Union[ScoreMasks, str]:
    """Read the chain ops bottom-up (from the product to the softmax)."""
    scale, scale_nodes, raw, split = 1.0, [], [], []
    memo: dict = {}
    for op in reversed(ops):
        kind = op[0]
        if kind in ("cast", "const", "split_batch"):
            continue
        if kind == "scale":
            (how, f), divide = op[1], op[2]
            if how == "const":
                if f == 0:
                    return "the scores are scaled by 0"
                factor = 1.0 / f if divide else f
                if factor <= 0:
                    return f"negative scale {factor:g}"
                scale *= factor
                # (x + b)·c = x·c + b·c: the terms and fill values so far are scaled too
                for t in {id(t): t for t in raw + split if isinstance(t, (BiasTerm, MaskFill))}.values():
                    t.scale *= factor
            else:
                if raw:
                    return "a run-time scale is applied after the mask"
                scale_nodes.append((f, divide))
            continue
        if kind == "add":
            node, negate = op[1], op[2]
            if not broadcasts_to(shape(node), scores_shape):
                return f"mask of shape {fmt_shape(shape(node))} does not broadcast to the scores {fmt_shape(scores_shape)}"
            if dtype(node) is None or dtype(node).is_complex:
                return f"mask of dtype {dtype(node)}"
            term = BiasTerm(node, negate)
            raw.append(term)
            split.extend(_bias_term_parts(term, lq, lk, memo))
            continue
        if kind == "fill":
            mask, masked_when, value = op[1], op[2], op[3]
            if not is_mask_value(value):
                return f"masked_fill/where with value {value:g}, not a mask value (<= {MASK_VALUE_MAX:g} or -inf)"
            if dtype(mask) != torch.bool:
                return "masked_fill/where mask is not a bool tensor"
            if not broadcasts_to(shape(mask), scores_shape):
                return f"mask of shape {fmt_shape(shape(mask))} does not broadcast to the scores {fmt_shape(scores_shape)}"
            parts = _bool_mask_parts(mask, masked_when, value, lq, lk, memo)
            raw.append(MaskFill(mask, masked_when, value))
            split.extend(parts)
    return ScoreMasks(scale, scale_nodes, raw, split, lq, lk)


def _bool_mask_parts(mask: Any, masked_when: bool, value: float, lq, lk, memo) -> list:
    """A bool mask as parts: [] if it masks nothing, [CausalPart] if it is the causal mask; an
    AND of keep masks (OR of masked masks) with a causal part splits into the causal part and the
    rest; anything else stays one MaskFill."""
    if not isinstance(mask, fx.Node) or dtype(mask) != torch.bool:
        return [MaskFill(mask, masked_when, value)]
    if is_causal_mask(mask, "masked" if masked_when else "keep", lq, lk):
        return [CausalPart(value, causal_source(mask))]
    a = abstract_value(mask, memo)
    if isinstance(a, Select) and a.aff is None and isinstance(a.a, bool) and a.a != masked_when:
        return []  # keeps everything
    c = call_of(mask)
    parts = None
    if c is not None and not written(mask):
        if (c.name == "and" and not masked_when) or (c.name == "or" and masked_when):
            parts = _bool_mask_parts(c["input"], masked_when, value, lq, lk, memo) + _bool_mask_parts(
                c["other"], masked_when, value, lq, lk, memo
            )
        elif c.name in ("logical_not", "invert"):
            parts = _bool_mask_parts(c["input"], not masked_when, value, lq, lk, memo)
        elif c.name in ("expand", "contiguous", "clone") or (c.name == "to" and is_identity(c)) \
                or _leading_ones_view(mask, c):
            parts = _bool_mask_parts(c["input"], masked_when, value, lq, lk, memo)
    if parts is not None and any(isinstance(p, CausalPart) for p in parts):
        return parts
    return [MaskFill(mask, masked_when, value)]


def _leading_ones_view(node: fx.Node, c) -> bool:
    """`node` is its input with size-1 dims put in front (`m[None, None]`, `m.unsqueeze(0)`,
    `m.view(1, 1, L, S)` of an (L, S) mask): the same mask under broadcasting, so an AND inside it
    splits as it would outside (`((j <= i) & (j > i - W))[None, None] & pad`)."""
    if c.name not in ("getitem", "unsqueeze", "view", "reshape"):
        return False
    if c.name == "getitem":  # only new axes and whole slices (an index tensor could reorder)
        index = c["index"] if isinstance(c["index"], tuple) else (c["index"],)
        if not all(i is None or i is Ellipsis or i == slice(None) for i in index):
            return False
    x = c["input"]
    si, so = shape(x) if isinstance(x, fx.Node) else None, shape(node)
    if si is None or so is None or len(so) < len(si):
        return False
    extra = len(so) - len(si)
    return same_shape(so[extra:], si) and all(known_equal(n, 1) for n in so[:extra])


def _bias_term_parts(term: BiasTerm, lq, lk, memo) -> list:
    """An additive mask term as parts: causal parts, `where(keep, 0, fill)` as bool masks."""
    if term.negate or term.scale != 1.0:
        return [term]
    node = term.node
    if is_causal_mask(node, "additive", lq, lk):
        a = abstract_value(node, memo)
        return [CausalPart(float(a.b), causal_source(node))]
    c = call_of(node)
    if c is None or written(node):
        return [term]
    if c.name == "where":
        cond, a, b = c["condition"], c["input"], c["other"]
        va, vb = constant_number(a), constant_number(b)
        ev = example_value(node)
        if dtype(cond) == torch.bool and isinstance(ev, torch.Tensor) and va is not None and vb is not None:
            va, vb = cast_value(va, ev.dtype), cast_value(vb, ev.dtype)
            if va == 0 and is_mask_value(vb):
                return _bool_mask_parts(cond, False, float(vb), lq, lk, memo)
            if vb == 0 and is_mask_value(va):
                return _bool_mask_parts(cond, True, float(va), lq, lk, memo)
    if c.name in ("expand", "contiguous", "clone") or is_identity(c):
        inner = _bias_term_parts(BiasTerm(c["input"]), lq, lk, memo)
        if any(isinstance(p, CausalPart) for p in inner):
            return inner
    return [term]


def _finite_fill(p: MaskPart) -> bool:
    return isinstance(p, MaskFill) and p.value != -math.inf


def causal_or_bias(m: ScoreMasks, chunks: bool = True, documents: bool = True,
                   dead_rows: bool = False) -> Union[tuple[list, bool, str, list, int, int, Any, Optional[float]], str]:
    """(the parts left for the bias, is_causal, how the causal mask was found, notes, window,
    chunk, documents: the id node or None, dead_average: the fill whose rows masked everywhere
    are averaged after the op, or None), or why the chain is refused.

    A causal part becomes is_causal (the op's -inf causal masking, applied after the bias) only
    where that keeps eager's value of every score it hides:
      * it is the only mask: every row keeps key 0, no row is masked everywhere, so its fill value
        (-inf or finite) changes nothing;
      * it fills -inf and no finite fill is among the other parts: the hidden scores stay -inf in
        eager whatever comes after (-inf + bias = -inf; a later -inf fill), whereas a later finite
        fill would overwrite them (a row whose visible keys it all fills then spreads its weights
        over those hidden keys too). (With a finite fill only before it, is_causal after the
        replace mask would be exact too; not taken: the causal mask then stays in the bias.)
    Otherwise the causal mask stays in the bias with its own value (still fused, not is_causal;
    its positions are then among the replace mask's where it is a fill, `replace_mask`).

    A sliding window beside it (mask_structure.window_of: the part hides exactly the keys
    j <= i - W) becomes the op's ``window`` by the same argument: where the causal part and the window are the only masks and Lq <= Lk, every
    row keeps its own key i, so no row is masked everywhere and their fill values (finfo.min
    in HF's builders) change nothing; where both fill -inf beside other parts without a finite
    fill, the hidden scores stay -inf whatever comes after. Either way the kernels then skip the
    key blocks the window hides instead of reading them from a bias. Chunks beside it
    (mask_structure.chunk_of: the part keeps exactly i // C == j // C; Llama 4) become the op's
    ``chunk`` by the same argument (every row keeps its own key: i // C == i // C); not with
    ``chunks`` False (the sinks op takes none: they stay in the bias, as other masks).

    Documents (mask_structure.documents_arg: the part keeps exactly doc[i] == doc[j], ids (L,) or
    (B, L)) become the op's ``documents`` (the kernels mask them with -inf after the bias and skip
    the key blocks outside each query block's documents) where no band was taken and
    (``_documents``) either they are the only mask besides a causal one, Lq == Lk (every row keeps
    its own key under both, so fill values change nothing), or the part fills -inf and no other
    part (causal ones included) has a finite fill; not with ``documents`` False (the sinks op
    takes none, a site whose scores are not 4-D).

    With ``dead_rows`` (the caller can fix rows after the op), a window beside other parts of one
    absorbing fill (HF's eager padding) is taken too: ``window_beside_one_fill``."""
    causal = [p for p in m.split if isinstance(p, CausalPart)]
    rest = [p for p in m.split if not isinstance(p, CausalPart)]
    parts, is_causal, source, notes, window, dead_average = m.raw, False, "", [], 0, None
    memo: dict = {}
    # the bands beside a causal mask: (part, ("window", W) or ("chunk", C))
    windows = [(p, band_of(p, memo)) for p in rest] if causal else []
    windows = [(p, w) for p, w in windows if w is not None and (chunks or w[0] != "chunk")]
    if causal and not rest:
        parts, is_causal, source = [], True, causal[0].source
    elif causal and all(p.value == -math.inf for p in causal) and not any(_finite_fill(p) for p in rest):
        parts, is_causal, source = rest, True, causal[0].source
        if len(windows) == 1 and windows[0][0].value == -math.inf:
            window = windows[0][1]
            parts = [p for p in rest if p is not windows[0][0]]
    elif causal and len(rest) == 1 and len(windows) == 1 and _rows_keep_own_key(m.lq, m.lk):
        parts, is_causal, source, window = [], True, causal[0].source, windows[0][1]
    elif causal and dead_rows and (beside := window_beside_one_fill(m, memo)) is not None:
        band, dead_average = beside
        windows = [(p, w) for p, w in windows if p is band]
        parts, is_causal, source, window = [p for p in rest if p is not band], True, causal[0].source, windows[0][1]
    elif causal:
        notes.append(f"causal mask ({causal[0].source}) kept in the bias with its own values: "
                     "is_causal's -inf masking would change rows masked everywhere")
    chunk, docs = 0, None
    if not window and documents:
        taken = _documents(m, rest, memo)
        if taken is not None:
            part, (docs, with_causal) = taken
            parts = [p for p in (rest if is_causal or not causal else m.split) if p is not part]
            if not is_causal and causal:  # (only when the documents are the one other part: exact)
                parts, is_causal, source = [], True, causal[0].source
                notes = [n for n in notes if not n.startswith("causal mask (")]
            elif not is_causal and with_causal:  # the causal mask ANDed into the part: exact likewise
                is_causal, source = True, with_causal
            notes.append(f"documents (ids from {docs.name}: query i sees keys j with doc[j] == doc[i]), passed to "
                         "the op: the kernels skip the key blocks outside each query block's documents")
            notes += structure_notes([p for p in rest if p is not part])
            return parts, is_causal, source, notes, 0, 0, docs, None
    if window:
        part = windows[0][0]
        kind, window = window
        if kind == "chunk":
            chunk, window = window, 0
            notes.append(f"chunks of {chunk} (proved: query i sees keys j with j // {chunk} == i // {chunk}, "
                         "j <= i): the kernels skip the key blocks outside each query's chunk")
        else:
            notes.append(f"sliding window {window} (proved: query i sees keys from i-{window - 1}; "
                         f"{causal_source(part.mask)}): the kernels skip the key blocks it hides"
                         + (f"; rows masked everywhere (fill {dead_average:g}) average v over all keys after "
                            "the op, as eager" if dead_average is not None else ""))
        notes += structure_notes([p for p in rest if p is not part])
    else:
        notes += structure_notes(rest)
    return parts, is_causal, source, notes, window, chunk, None, dead_average


# A finite mask value at or below this absorbs every score: s + V == V in float32 (its ulp at 1e30
# is 7.6e22), bfloat16 and float64 for any |s| < 1e22, so a row it masks everywhere is uniform in
# eager. finfo.min of float32, bfloat16 and float64 qualifies; float16's (-65504) does not.
ABSORBING = -1e30


def window_beside_one_fill(m: ScoreMasks, memo: dict) -> Optional[tuple[MaskFill, float]]:
    """(the window's part, the fill value V) for a causal mask and a sliding window beside other
    mask parts (HF's padding), all from ONE fill of one value V that absorbs the scores
    (ABSORBING), Lq <= Lk; None otherwise. HF's eager builders give this:
    `where(causal & window & padding, 0, finfo.min)` added once.

    Then every hidden score of eager is exactly V: a row with a visible key gives its hidden keys
    weight 0, as the op's -inf causal and window masking does; a row with none (a query at a padded
    position) has Lk equal scores, and eager averages v over ALL Lk keys, window or not. The op
    skips the keys the window hides, so such rows are fixed after it (attention.py's
    `_average_dead_rows`, which `replace` adds where the site's ``dead_average`` is V). Two fills
    (or a fill and an additive term) could sum to -inf or leave scores unequal: not taken here."""
    if len(m.raw) != 1 or getattr(m.raw[0], "scale", 1.0) != 1.0 or getattr(m.raw[0], "negate", False):
        return None
    causal = [p for p in m.split if isinstance(p, CausalPart)]
    rest = [p for p in m.split if not isinstance(p, CausalPart)]
    if len(causal) != 1 or not rest or not all(isinstance(p, MaskFill) for p in rest):
        return None
    values = {causal[0].value, *(p.value for p in rest)}
    if len(values) != 1:
        return None
    value = values.pop()
    if not (math.isfinite(value) and value <= ABSORBING) or not _rows_keep_own_key(m.lq, m.lk):
        return None
    windows = [p for p in rest if (band_of(p, memo) or ("",))[0] == "window"]
    return (windows[0], value) if len(windows) == 1 else None


def _documents(m: ScoreMasks, rest: list, memo: dict) -> Optional[tuple]:
    """(the part, (the id node, the causal source of a part that ANDs documents with the causal
    mask, or None)) of a documents mask the op can take (``causal_or_bias``), else None: one such
    part among the non-causal ones, and either it is the only one (with Lq == Lk: every row keeps
    its own key under the documents and the causal mask, so no fill value matters) or it fills
    -inf and no other part fills a finite value (the hidden scores stay -inf whatever comes
    after, as with the op's -inf masking after the bias)."""
    found = [(p, documents_arg(p, memo, m.lq, m.lk)) for p in rest]
    found = [(p, d) for p, d in found if d is not None]
    if len(found) != 1:
        return None
    part = found[0][0]
    if len(rest) == 1 and known_equal(m.lq, m.lk):
        return found[0]
    finite = [p for p in m.split if p is not part and (
        _finite_fill(p) or (isinstance(p, CausalPart) and p.value != -math.inf))]
    if part.value == -math.inf and not finite:
        return found[0]
    return None


def _rows_keep_own_key(lq, lk) -> bool:
    """Lq <= Lk for every size: with top-left causal masking every query row i keeps key i."""
    if lq is None or lk is None:
        return False
    if known_equal(lq, lk):
        return True
    try:
        return known_true(lq <= lk)
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------- building the bias


def build_bias(b: NodeBuilder, parts: list, memo: dict, dtype: torch.dtype = torch.float32
               ) -> tuple[Optional[fx.Node], str]:
    """One attn_bias for the mask parts left: (node or None, description).

    Only -inf fills: one bool keep mask. One additive term: that tensor. Otherwise the parts are
    replayed in eager's order on zero scores, in `dtype` (float32; float64 for float64 scores):
    a fill writes its own value (times the scales after it) where its mask holds, a term is added.
    Where a fill replaced the scores, the bias is exactly eager's value there."""
    if not parts:
        return None, ""
    key = tuple(
        ("t", p.node, p.negate, p.scale) if isinstance(p, BiasTerm) else ("f", p.mask, p.masked_when, p.value, p.scale)
        for p in parts
    ) + (dtype,)
    if key in memo and precedes(memo[key][0], b.before) and not written_since(
            [p.node if isinstance(p, BiasTerm) else p.mask for p in parts], memo[key][0], b.before):
        return memo[key]
    fills = [p for p in parts if isinstance(p, MaskFill)]
    if len(fills) == len(parts) and all(p.value == -math.inf for p in fills):
        keep = None
        for p in fills:
            k = p.mask if not p.masked_when else _negated(b, p.mask)
            keep = k if keep is None else b.function(torch.logical_and, keep, k)
        result = (keep, "bool mask")
    elif len(parts) == 1 and isinstance(parts[0], BiasTerm) and not parts[0].negate and parts[0].scale == 1.0 and dtype_of(parts[0].node).is_floating_point:
        term = parts[0].node
        narrow = unbroadcast(b, term, memo)
        result = (term, "additive mask") if narrow is None else (narrow, _narrowed(shape(narrow)))
    else:
        bias = None
        for p in parts:
            if isinstance(p, BiasTerm):
                t = p.node
                if not dtype_of(t).is_floating_point or (bias is not None and dtype_of(t) != dtype_of(bias)):
                    t = b.method("to", t, dtype if bias is None else dtype_of(bias))
                if p.negate:
                    t = b.function(operator.neg, t)
                if p.scale != 1.0:
                    t = b.function(operator.mul, t, p.scale)
                bias = t if bias is None else b.function(operator.add, bias, t)
            else:
                value = cast_value(cast_value(p.value, dtype) * p.scale, dtype)
                fill = value
                if dtype != torch.get_default_dtype():  # where(m, number, number) takes the default dtype
                    fill = b.factory(p.mask, torch.scalar_tensor, value, dtype=dtype, device=device_of(p.mask))
                other = 0.0 if bias is None else bias
                if bias is not None and dtype_of(bias) != dtype:
                    other = b.method("to", bias, dtype)
                args = (p.mask, fill, other) if p.masked_when else (p.mask, other, fill)
                bias = b.function(torch.where, *args)
        result = (bias, "float mask")
    memo[key] = result
    return result


def _narrowed(s: tuple) -> str:
    """How a narrowed additive mask reads: one value per key (constant over the queries), or its
    narrower shape (HF's causal + window mask loses only its batch broadcast)."""
    if len(s) < 2 or known_equal(s[-2], 1):
        return "additive mask, per key"
    return f"additive mask, narrowed to {fmt_shape(s)}"


def unbroadcast(b: NodeBuilder, node: fx.Node, memo: dict) -> Optional[fx.Node]:
    """The same values as ``node`` with its broadcast dims left at size 1, when ``node`` is a
    pointwise mask whose inputs vary over fewer dims than it has and the narrower form keeps the
    key dim (the kernels read a bias constant over the queries one value per key,
    kernels/host.bias_over_keys); None otherwise, and then the graph is left as it was.

    HF's BERT-style padding mask is the case: ``where(((arange(Lq) >= 0)[q] & pad[b, k])
    .expand(B, 1, Lq, Lk), 0, finfo.min)`` is ``where(pad[b, k], 0, finfo.min)`` (B, 1, 1, Lk)
    broadcast, since the query term is True everywhere (causal_mask.abstract_value). The op
    broadcasts the bias itself. Seen through: ``expand``, ``contiguous``/``clone``/identity
    ``to``, ``&`` with an operand proven all-True; at the top, ``where(mask, a, b)`` with 0-d or
    number branches is rebuilt on the narrower mask (the only node made, once it is known to
    be kept)."""
    s = shape(node)
    c = call_of(node)
    if s is None or c is None or written(node):
        return None
    if c.name == "where" and _is_scalar(c["input"]) and _is_scalar(c["other"]):
        small = _narrower(c["condition"], memo)  # the branches broadcast without widening
        if small is None or not _keeps_keys(shape(small), s):
            return None
        return b.function(torch.where, small, c["input"], c["other"])  # (dtype from a and b)
    small = _narrower(node, memo)
    return small if small is not None and _keeps_keys(shape(small), s) else None


def _keeps_keys(t: Optional[tuple], s: tuple) -> bool:
    """t broadcasts to s, is narrower somewhere, and keeps s's last (key) dim."""
    return (t is not None and len(t) > 0 and broadcasts_to(t, s) and known_equal(t[-1], s[-1])
            and not (len(t) == len(s) and all(known_equal(x, y) for x, y in zip(t, s))))


def _is_scalar(x: Any) -> bool:
    """A number, or a tensor of no dims (it broadcasts without widening)."""
    if isinstance(x, (int, float)) or constant_number(x) is not None:
        return True
    s = shape(x) if isinstance(x, fx.Node) else None
    return s is not None and len(s) == 0


def _narrower(node: Any, memo: dict) -> Optional[fx.Node]:
    """An existing node holding node's values at a shape that broadcasts to node's (through
    expands, identity copies and ``& True``), or None. Makes no node."""
    if not isinstance(node, fx.Node) or written(node):
        return None
    c = call_of(node)
    if c is None:
        return None
    if c.name in ("expand", "contiguous", "clone") or is_identity(c):
        x = c["input"]
        if isinstance(x, fx.Node) and not written(x):
            return _narrower(x, memo) or x
    elif c.name == "and" and dtype_of(node) == torch.bool:
        x, y = c["input"], c["other"]
        for keep, other in ((x, y), (y, x)):
            if all_true(keep, memo) and isinstance(other, fx.Node) and dtype_of(other) == torch.bool \
                    and not written(other):
                return _narrower(other, memo) or other
    return None


def _negated(b: NodeBuilder, mask: fx.Node) -> fx.Node:
    """~mask, reusing x when mask is ~x."""
    c = call_of(mask)
    if (c is not None and c.name in ("logical_not", "invert") and dtype(c["input"]) == torch.bool and not written(mask)
            and not written_since([c["input"]], mask, b.before)):  # x read where the op stands: unchanged since ~x
        return c["input"]
    return b.function(torch.logical_not, mask)


def replace_mask(b: NodeBuilder, parts: list, memo: dict) -> Optional[fx.Node]:
    """The op's `replace` for the mask parts left: the scores some masked_fill/where replaced (the
    OR of the fill masks, each as "where it fills"), when a fill is finite; None otherwise.

    With -inf fills only, nothing is needed: a replaced score is -inf either way (the bias holds
    -inf there, and s + -inf is -inf), and its weight, hence every gradient through it, is 0."""
    fills = [p for p in parts if isinstance(p, MaskFill)]
    if not any(_finite_fill(p) for p in fills):
        return None
    key = ("replace",) + tuple((p.mask, p.masked_when) for p in fills)
    if key in memo and precedes(memo[key], b.before) and not written_since([p.mask for p in fills], memo[key],
                                                                            b.before):
        return memo[key]
    replaced = None
    for p in fills:
        m = p.mask if p.masked_when else _negated(b, p.mask)
        replaced = m if replaced is None else b.function(torch.logical_or, replaced, m)
    memo[key] = replaced
    return replaced
