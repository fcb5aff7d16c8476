"""One attention call, validated once: the tensors every kernel family reads and the problem they pose.

``AttentionCall.forward(...)`` / ``AttentionCall.backward(...)`` check the launchers' inputs
(kernels/attention.py) once, bring q/k/v to unit last strides, and derive what the families
decide and launch by: the sizes, the bias's kind, strides and broadcast form, the replace mask,
the dropout draw's arguments, the softcap's scale, the rope tables. The registry
(registry.py) chooses a family from it; the family launches from it. Nothing here launches.

Sizes: ``B``, ``Lq`` and ``Lk`` stay SymInts under dynamic shapes (a family compares them where
its bound is a correctness or family boundary: a guard), the head counts and head dims are ints
(a guard each: a model's constants). ``hint(...)`` reads a SymInt without a guard (launch.hint).

A bias is either broadcastable to (B, Hq, Lq, Lk) (held as that view, stride 0 on broadcast dims)
or *window-periodic*: (P, ., ., Lk) with 1 < P < B and B % P == 0, batch b reading bias[b % P]
(Swin's shifted-window mask over B·nW windows; ops/attention.py). Held as a (P, Hq, Lq, Lk)
view; families that cannot read it by period get it materialised at (B, ...)
(``materialise_bias``), once, before their launch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from . import host
from .host import (FLOAT_BIAS, NO_BIAS, bias_args, bias_over_keys, dropout_scale, dropout_threshold,
                   placeholder)
from .launch import hint, is_tracing

DIRECTIONS = ("fwd", "bwd")


class Rope(NamedTuple):
    """The rotary embedding folded into the kernels (``rope=`` of the launchers): q and k are
    given un-rotated and each tile is rotated after its load (``fuse_plugin::rotary`` semantics:
    the first ``rotary_dim`` channels, half-split or interleaved pairs, in fp32, rounded to q's
    dtype). cos/sin: last dim ``rotary_dim`` (full width) or ``rotary_dim // 2`` (half width),
    at most 4-D and broadcastable to (B, Hq, Lq, W) and to (B, Hkv, Lk, W); any strides."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    rotary_dim: int


NO_ROPE = dict(ROT=0, INTERLEAVED=False, HALF_TABLE=False)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def bias_period(bias: Optional[torch.Tensor], B) -> Optional[int]:
    """P when ``bias`` is window-periodic over a batch of B (see module doc), else None."""
    if bias is None or bias.dim() != 4:
        return None
    P = bias.shape[0]
    if not isinstance(P, int) or P == 1:
        return None
    if isinstance(B, int) and P == B:
        return None
    return P


def check_inputs(q, k, v, bias) -> None:
    """The errors every family relies on (shapes, dtypes, head dims, the bias's broadcast)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (B, H, L, D)")
    if not (q.dtype == k.dtype == v.dtype) or \
            q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B or Dk != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if not (16 <= D <= 256 and 16 <= v.shape[3] <= 256):
        raise ValueError(f"head dims must be in [16, 256], got D={D}, Dv={v.shape[3]}")
    if Lq < 1 or Lk < 1:
        raise ValueError("sequence lengths must be >= 1")
    if bias is None:
        return
    P = bias_period(bias, B)
    rows = (B, Hq, Lq, Lk) if P is None else (P, Hq, Lq, Lk)
    if tuple(bias.shape) != rows or (P is not None and B % P):
        raise ValueError(f"bias must be broadcast to {(B, Hq, Lq, Lk)} (or be window-periodic: "
                         f"(P, {Hq}, {Lq}, {Lk}) with P dividing B), got {tuple(bias.shape)}")


def check_dropout(dropout_p: float, seed: Optional[torch.Tensor], q: torch.Tensor) -> None:
    """dropout_p in [0, 1) and, when > 0, a seed of one int64 on q's device: the errors the op
    (ops/attention.py), the launchers and the kernels' reference all raise, from here."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"fuse_plugin::attention: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return
    if seed is None:
        raise ValueError(
            "fuse_plugin::attention: dropout_p > 0 needs dropout_seed (one int64 on q's device, "
            "e.g. fuse_plugin.ops.attention.new_dropout_seed(q.device))")
    if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != q.device:
        raise ValueError(
            f"fuse_plugin::attention: dropout_seed must be one int64 on {q.device}, got "
            f"{seed.dtype} of shape {tuple(seed.shape)} on {seed.device}")


def check_window(window: int, is_causal: bool) -> None:
    """window: an int >= 0 (0 = none); a window > 0 comes with is_causal (query i sees keys
    i - window + 1 .. i)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"fuse_plugin::attention: window must be an int >= 0 (0 = none), got {window!r}")
    if window and not is_causal:
        raise ValueError(f"fuse_plugin::attention: window={window} needs is_causal=True (a sliding window "
                         "bounds the keys a causal query sees: i - window < j <= i)")


def check_chunk(chunk: int, is_causal: bool, window: int = 0) -> None:
    """chunk: an int >= 0 (0 = none); a chunk > 0 comes with is_causal and no window (query i sees
    the keys of its chunk up to itself: i // chunk == j // chunk, j <= i; Llama 4's chunked attention)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"fuse_plugin::attention: chunk must be an int >= 0 (0 = none), got {chunk!r}")
    if chunk and not is_causal:
        raise ValueError(f"fuse_plugin::attention: chunk={chunk} needs is_causal=True (query i sees keys j with "
                         "j // chunk == i // chunk and j <= i)")
    if chunk and window:
        raise ValueError(f"fuse_plugin::attention: chunk={chunk} and window={window} together (one band at a time)")


def check_documents(documents: Optional[torch.Tensor], q, k, window: int = 0, chunk: int = 0) -> None:
    """documents: None, or integer ids (B, L) (or (1, L): one row for every batch) on q's device,
    for self-attention (Lq == Lk == L), with or without is_causal, not with a window or chunks:
    query i sees key j only where documents[b, i] == documents[b, j] (sequences packed in one row,
    each attending to itself). Any integer values, in any order: a document need not be contiguous."""
    if documents is None:
        return
    what = "fuse_plugin::attention: documents"
    if not isinstance(documents, torch.Tensor):
        raise ValueError(f"{what} must be a tensor of integer ids, got {type(documents).__name__}")
    if documents.dtype.is_floating_point or documents.dtype.is_complex or documents.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer ids (int32 or int64), got {documents.dtype}")
    B, Lq, Lk = q.shape[0], q.shape[2], k.shape[2]
    if Lq != Lk:
        raise ValueError(f"{what} need self-attention (Lq == Lk: queries and keys share the ids), got Lq={Lq}, "
                         f"Lk={Lk}")
    if documents.dim() != 2 or documents.shape[0] not in (1, B) or documents.shape[1] != Lq:
        raise ValueError(f"{what} must be (B, L) = ({B}, {Lq}) (or (1, {Lq})), got {tuple(documents.shape)}")
    if documents.device != q.device:
        raise ValueError(f"{what} are on {documents.device}, q on {q.device}")
    if window or chunk:
        raise ValueError(f"{what} with window={window} / chunk={chunk} (one band at a time)")


def check_sink_logits(sinks: Optional[torch.Tensor], q) -> None:
    """sinks: None, or one floating logit per query head, (Hq,), on q's device (the sinks op's
    forward; ops/attention_sinks.py)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1] \
            or not sinks.dtype.is_floating_point or sinks.device != q.device:
        raise ValueError(f"attention_forward: sinks must be a floating (Hq,) = ({q.shape[1]},) tensor on "
                         f"{q.device}, got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                         f"{tuple(getattr(sinks, 'shape', ()))}")


def document_ranges(documents: torch.Tensor) -> torch.Tensor:
    """The documents table the kernels read: (B', L, 2) int32 contiguous, row i = [lo, hi), the
    first position of i's document and one past its last (documents (B', L), any integer ids).

    lo names the document (its first position: one per distinct id), so two positions share a
    document iff their lo agree (``_same_document``); [lo, hi) holds every position of it, exactly
    the document where it is contiguous, a superset where it is not (``_doc_span``). On the
    device with plain ops, no host sync (O(L log L) per row): a stable sort of the ids, each run
    of equal ids' first and last sorted places by searchsorted, their original positions (the
    stable sort keeps them in order: the run's first is the least), scattered back to i."""
    ids = documents.long()
    sorted_ids, perm = torch.sort(ids, dim=-1, stable=True)
    first = torch.searchsorted(sorted_ids, sorted_ids, side="left")
    last = torch.searchsorted(sorted_ids, sorted_ids, side="right") - 1
    spans = torch.stack([perm.gather(-1, first), perm.gather(-1, last) + 1], -1).to(torch.int32)
    table = torch.empty_like(spans)
    return table.scatter_(1, perm.unsqueeze(-1).expand_as(spans), spans)


def check_softcap(softcap: float) -> None:
    """softcap: a finite number >= 0 (0 = off)."""
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"fuse_plugin::attention: softcap must be a finite number >= 0 (0 = off), got {softcap}")


def dropout_args(dropout_p: float, seed: Optional[torch.Tensor], q: torch.Tensor, dummy: torch.Tensor):
    """(Seed, drop_thresh, inv_keep, DROPOUT) kernel arguments; see ``_dropout_keep``. ``dummy``:
    the Seed without dropout (host.placeholder)."""
    check_dropout(dropout_p, seed, q)
    if dropout_p == 0.0:
        return dummy, 0, 1.0, False
    return seed, dropout_threshold(dropout_p), dropout_scale(dropout_p), True


def score_scale(kind: int, scale: float) -> float:
    """Natural units with a float bias (kernels/attention.py's Numerics), log2 units otherwise."""
    return scale if kind == FLOAT_BIAS else scale * 1.4426950408889634


def _softcap_args(kind: int, scale: float, softcap: float) -> tuple[float, float, bool]:
    """(score_scale, cap, SOFTCAP) kernel arguments. With a softcap c the kernels compute
    t = tanh(qk · scale / c) and the score cap · t, cap = c in the kernel's units (see
    ``score_scale``); the backward multiplies dS by 1 - t² (``_capped_scores``)."""
    check_softcap(softcap)
    if not softcap:
        return score_scale(kind, scale), 1.0, False
    return scale / softcap, score_scale(kind, 1.0) * softcap, True


def _replace_args(replace: Optional[torch.Tensor], kind: int, q: torch.Tensor, bias_shape, dummy):
    """(tensor, strides, HAS_REPLACE) kernel arguments of the replace mask: a same-strided uint8
    view of the bool mask, or ``dummy`` and zero strides without one (never read then)."""
    if replace is None:
        return dummy, (0, 0, 0, 0), False
    if replace.dtype != torch.bool:
        raise ValueError(f"replace must be a bool tensor, got {replace.dtype}")
    if kind != FLOAT_BIAS:
        raise ValueError("replace needs a floating-point bias (the value a replaced score takes)")
    if tuple(replace.shape) != tuple(bias_shape):
        raise ValueError(f"replace must be broadcast to {tuple(bias_shape)}, got {tuple(replace.shape)}")
    if replace.device != q.device:
        raise ValueError(f"replace is on {replace.device}, q on {q.device}")
    return host.bool_operand(replace), replace.stride(), True


def _rope_args(rope: Optional[Rope], q, k, dummy):
    """(cos, sin, q-view table strides, k-view table strides, constexprs) of a launch; ``dummy``
    for both without rope. cos and sin are read with one set of strides: tables whose broadcast
    views differ in strides are materialised (small: no head dim, usually)."""
    if rope is None:
        return dummy, dummy, (0, 0, 0, 0), (0, 0, 0, 0), dict(NO_ROPE)
    cos, sin, interleaved, R = rope
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if not isinstance(R, int) or R <= 0 or R % 2 or R > D:
        raise ValueError(f"rotary_dim={R} must be even and in [2, {D}]")
    W = cos.shape[-1]
    if W not in (R, R // 2) or sin.shape[-1] != W:
        raise ValueError(f"cos/sin last dim {W} must be rotary_dim={R} or rotary_dim//2={R // 2}")
    if cos.dim() > 4 or sin.dim() > 4:
        raise ValueError("cos/sin must have at most 4 dims")
    for t in (cos, sin):
        if t.device != q.device or not t.dtype.is_floating_point:
            raise ValueError(f"cos/sin must be float tensors on {q.device}")

    def views(c, s):
        return (c.expand(B, Hq, Lq, W), s.expand(B, Hq, Lq, W),
                c.expand(B, Hkv, Lk, W), s.expand(B, Hkv, Lk, W))

    cq, sq, ck, sk = views(cos, sin)
    if cq.stride() != sq.stride() or ck.stride() != sk.stride():
        cos, sin = (t.contiguous() for t in torch.broadcast_tensors(cos, sin))
        cq, sq, ck, sk = views(cos, sin)
    consts = dict(ROT=R, INTERLEAVED=bool(interleaved), HALF_TABLE=W != R)
    return cos, sin, cq.stride(), ck.stride(), consts


def sum_dbias(ds: torch.Tensor, target: tuple, B) -> torch.Tensor:
    """dS of the scores, (B, Hq, Lq, Lk), summed in fp32 to ``target`` (the launchers'
    ``dbias_shape``): a window-periodic target (P, ...) sums the B // P batches of each window,
    then every dim where the target has 1. A family's fp32 dS is summed as it is; a 16-bit one
    (PyTorch's efficient kernels write dS in q's dtype) accumulates in fp32."""
    acc = {} if ds.dtype == torch.float32 else {"dtype": torch.float32}
    P = target[0]
    if P != 1 and ds.shape[0] != P:
        ds = ds.view(B // P, P, *ds.shape[1:]).sum(0, **acc)
    if ds.dtype == torch.float32:
        return ds.sum_to_size(target)
    dims = [d for d, (t, n) in enumerate(zip(target, ds.shape)) if t == 1 and n != 1]
    return ds.sum(dims, keepdim=True, dtype=torch.float32) if dims else ds.float()


@dataclass
class AttentionCall:
    """A validated forward or backward call (see module doc). Built by ``forward`` / ``backward``."""

    direction: str  # "fwd" | "bwd"
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: Optional[torch.Tensor]
    is_causal: bool
    scale: float
    dropout_p: float
    dropout_seed: Optional[torch.Tensor]
    softcap: float
    replace: Optional[torch.Tensor]
    rope: Optional[Rope]
    config: Any = None  # a config the caller gave (names its family), else None
    window: int = 0  # sliding window (with is_causal): query i sees keys i - window + 1 .. i
    need_lse: bool = True  # forward: False lets a family skip the logsumexp (inference; lse unspecified)
    chunk: int = 0  # chunked attention (with is_causal): query i sees keys j, j // chunk == i // chunk, j <= i
    documents: Optional[torch.Tensor] = None  # ids (B or 1, L): query i sees keys j of its document
    sinks: Optional[torch.Tensor] = None  # forward: (Hq,) sink logits joining each row's softmax (gpt-oss)
    # backward only
    dout: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    need_dbias: bool = False
    deterministic: bool = False
    group_split: Optional[int] = None
    inputs: tuple = ()  # q, k, v as the caller gave them: the gradients' layouts
    # derived (``_derive``)
    sizes: tuple = ()  # (B, Hq, Lq, D, Hkv, Lk, Dv)
    period: Optional[int] = None  # the bias's window period (module doc), None otherwise
    dbias_target: tuple = ()  # ``dbias_shape()``
    kind: int = NO_BIAS
    bias_t: Any = None
    sb: tuple = (0, 0, 0, 0)
    rep_t: Any = None
    sr: tuple = (0, 0, 0, 0)
    has_rep: bool = False
    seed: Any = None
    drop_thresh: int = 0
    inv_keep: float = 1.0
    dropout: bool = False
    score_scale: float = 1.0
    cap: float = 1.0
    softcapped: bool = False
    dummy: Any = None  # what a launch passes for a pointer it never reads (host.placeholder)
    cos: Any = None
    sin: Any = None
    scq: tuple = (0, 0, 0, 0)
    sck: tuple = (0, 0, 0, 0)
    rc: dict = field(default_factory=lambda: dict(NO_ROPE))
    doc_t: Any = None  # the documents table (document_ranges), dummy without documents (never read)
    doc_stride: int = 0  # its batch stride (0: one row for every batch, or none)
    sink_t: Any = None  # the sinks, contiguous (the kernel reads them as fp32); dummy without sinks (never read)
    delta: Any = None  # backward: rowsum(dO * O) (B, Hq, Lq) fp32, where a path's preprocess computed it

    # ------------------------------------------------------------------ construction

    @classmethod
    def forward(cls, q, k, v, bias, *, is_causal, scale, config=None, rope=None, dropout_p=0.0,
                dropout_seed=None, softcap=0.0, replace=None, window=0,
                need_lse=True, chunk=0, documents=None, sinks=None) -> "AttentionCall":
        check_inputs(q, k, v, bias)
        check_window(window, is_causal)
        check_chunk(chunk, is_causal, window)
        check_documents(documents, q, k, window, chunk)
        check_sink_logits(sinks, q)
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        call = cls("fwd", q, k, v, bias, bool(is_causal), scale, dropout_p, dropout_seed, softcap,
                   replace, rope, config, window=window, need_lse=bool(need_lse), chunk=chunk,
                   documents=documents, sinks=sinks)
        return call._derive()

    @classmethod
    def backward(cls, dout, q, k, v, bias, out, lse, *, is_causal, scale, need_dbias, config=None,
                 deterministic=None, rope=None, dropout_p=0.0, dropout_seed=None, group_split=None,
                 softcap=0.0, replace=None, window=0, chunk=0, documents=None) -> "AttentionCall":
        check_inputs(q, k, v, bias)
        check_window(window, is_causal)
        check_chunk(chunk, is_causal, window)
        check_documents(documents, q, k, window, chunk)
        inputs = (q, k, v)
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        dout = unit_last_stride(dout)  # the forward's layout (out_layout): read by its strides
        B, Hq, Lq, _ = q.shape
        Dv = v.shape[3]
        if tuple(dout.shape) != (B, Hq, Lq, Dv) or tuple(out.shape) != (B, Hq, Lq, Dv) \
                or tuple(lse.shape) != (B, Hq, Lq):
            raise ValueError("dout/out/lse shapes do not match q and v")
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        call = cls("bwd", q, k, v, bias, bool(is_causal), scale, dropout_p, dropout_seed, softcap,
                   replace, rope, config, window=window, chunk=chunk, documents=documents, dout=dout,
                   out=out, lse=lse,
                   need_dbias=bool(need_dbias),
                   deterministic=bool(deterministic), group_split=group_split, inputs=inputs)
        return call._derive()

    def _derive(self) -> "AttentionCall":
        q, k, v = self.q, self.k, self.v
        B, Hq, Lq, D = q.shape
        # head counts and dims are a model's constants: ints (a guard each under dynamic shapes)
        self.sizes = (B, int(Hq), Lq, int(D), int(k.shape[1]), k.shape[2], int(v.shape[3]))
        self.period = bias_period(self.bias, B)
        self.dbias_target = () if self.bias is None else tuple(
            1 if st == 0 else n for n, st in zip(self.bias.shape, self.bias.stride()))
        # every pointer parameter a launch of this call never reads gets this (host.placeholder)
        self.dummy = placeholder(q)
        self.cos, self.sin, self.scq, self.sck, self.rc = _rope_args(self.rope, q, k, self.dummy)
        self._derive_bias()
        self.seed, self.drop_thresh, self.inv_keep, self.dropout = dropout_args(
            self.dropout_p, self.dropout_seed, q, self.dummy)
        self.score_scale, self.cap, self.softcapped = _softcap_args(self.kind, self.scale, self.softcap)
        self.sink_t = self.dummy if self.sinks is None else self.sinks.contiguous()  # (fp32 on load: no cast kernel)
        if self.documents is None:
            self.doc_t, self.doc_stride = self.dummy, 0
        else:
            self.doc_t = document_ranges(self.documents)
            self.doc_stride = self.doc_t.stride(0) if self.doc_t.shape[0] > 1 else 0
        return self

    def _derive_bias(self) -> None:
        B, Hq, Lq, _, _, Lk, _ = self.sizes
        self.kind, self.bias_t, self.sb = bias_args(self.bias, self.dummy)
        shape = (B, Hq, Lq, Lk) if self.period is None else (self.period, Hq, Lq, Lk)
        self.rep_t, self.sr, self.has_rep = _replace_args(self.replace, self.kind, self.q, shape,
                                                          self.dummy)

    def materialise_bias(self) -> None:
        """A window-periodic bias (and its replace mask) as a (B, Hq, Lq, Lk) tensor, for the
        families that read the bias by batch index only. A copy of the scores' size."""
        if self.period is None:
            return
        B, Hq, Lq, _, _, Lk, _ = self.sizes
        P = self.period

        def whole(t):
            return t.unsqueeze(0).expand(B // P, P, Hq, Lq, Lk).reshape(B, Hq, Lq, Lk)

        self.bias = whole(self.bias)
        if self.replace is not None:
            self.replace = whole(self.replace)
        self.period = None
        self._derive_bias()

    def dbias_shape(self) -> tuple:
        """The shape of the bias's gradient as the launchers return it: the bias view's, with 1
        where it has stride 0 (broadcast), P rows for a window-periodic bias."""
        return self.dbias_target

    def reduce_dbias(self, ds: torch.Tensor, target: tuple) -> torch.Tensor:
        """dS of the scores, (B, Hq, Lq, Lk), summed to ``target`` (``dbias_shape``) in fp32; see
        ``sum_dbias``."""
        return sum_dbias(ds, target, self.sizes[0])

    # ------------------------------------------------------------------ what families read

    @property
    def traced(self) -> bool:
        """Inside an Inductor trace (launch.tracing): launches become graph nodes."""
        return is_tracing()

    @property
    def banded(self) -> bool:
        """A window, chunks or documents: the kernels skip the blocks they hide (WINDOW)."""
        return bool(self.window or self.chunk or self.documents is not None)

    @property
    def bias_elt(self) -> int:
        return 0 if self.kind == NO_BIAS else self.bias_t.element_size()

    @property
    def bias_keys(self) -> bool:
        """The kernels' BIAS_KEYS (host.bias_over_keys)."""
        return bias_over_keys(self.kind, self.sb)

    @property
    def empty(self) -> bool:
        """No (batch, head) problem at all."""
        B, Hq = self.sizes[:2]
        return B * Hq == 0

    def flops(self) -> float:
        """Forward FLOPs (4·B·Hq·Lq·Lk·D, half with causal, the band's share with a window), by
        the sizes' hints (documents: as without them, an upper bound: their area is in the ids)."""
        B, Hq, Lq, D, _, Lk, _ = self.sizes
        f = 4.0 * hint(B) * Hq * hint(Lq) * hint(Lk) * D
        if self.window or self.chunk:
            area = window_area(hint(Lq), hint(Lk), self.window, self.chunk)
            return f * area / (hint(Lq) * hint(Lk))
        return f * (0.5 if self.is_causal else 1.0)

    def describe(self) -> str:
        """The problem in a few words (errors, logs)."""
        B, Hq, Lq, D, Hkv, Lk, Dv = self.sizes
        parts = [f"{self.direction} B {hint(B)}", f"H {Hq}/{Hkv}", f"Lq {hint(Lq)}", f"Lk {hint(Lk)}",
                 f"D {D}" + (f"/{Dv}" if Dv != D else ""), str(self.q.dtype).replace("torch.", "")]
        if self.kind != NO_BIAS:
            parts.append("bool mask" if self.kind == host.BOOL_BIAS else "float bias")
            if self.period is not None:
                parts.append(f"window-periodic ({self.period})")
        for on, what in ((self.is_causal, "causal"), (self.window, f"window {self.window}"),
                         (self.chunk, f"chunks of {self.chunk}"),
                         (self.documents is not None, "documents"), (self.sinks is not None, "sinks"),
                         (self.dropout, "dropout"),
                         (self.softcapped, "softcap"), (self.has_rep, "replace mask"),
                         (self.rope is not None, "rope"), (self.need_dbias, "dbias"),
                         (self.deterministic and self.direction == "bwd", "deterministic")):
            if on:
                parts.append(what)
        return ", ".join(parts)


def window_area(Lq: int, Lk: int, window: int, chunk: int = 0) -> int:
    """How many (query, key) pairs a causal sliding window (or chunks) leave visible (top-left
    aligned: key j visible to query i iff i - window < j <= i, resp. (i // chunk) * chunk <= j <=
    i; j < Lk)."""
    total = 0
    for i in range(Lq):  # closed form per row; Lq is at most a few 100k
        first = (i // chunk) * chunk if chunk else max(i - window + 1, 0)
        total += max(0, min(i, Lk - 1) - first + 1)
    return total
