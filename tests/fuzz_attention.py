"""Differential fuzzer of the attention rewrite (issue 14): generated modules, compiled vs eager.

`make_case(seed)` draws one module from a seeded generator:

* spellings: inputs (B, H, L, D) or (B, L, H, D) transposed inside, or 3-D with batch and heads
  merged (`bmm`); q·kᵀ by matmul / @ .mT / permute / einsum / bmm; the scale on the scores
  (* or /), on q, split over q and k, or none; F.softmax / Tensor.softmax / torch.softmax /
  softmax(dtype=float32); eval dropout; GQA by repeat_interleave or repeat_kv expand+reshape;
  weights·v by matmul / einsum / bmm;
* masks: up to three, in any order, each drawn from causal (masked_fill of ~tril or of
  triu(ones, 1), where(j <= i, x, v) (or i >= j, one seed in three), + full(v).triu(1)), key
  padding (left padding, so with a causal mask whole rows go dead), a random (Lq, Lk) mask with fully masked rows, and a learned
  additive bias (a parameter: its gradient is compared too); bool ones as masked_fill / where /
  an additive 0-or-v tensor; values -inf, finfo.min, -1e9, -1e4 (additive ones: -inf and
  finfo.min only, see below);
* dtypes float32 (float64 in one case of six); shapes with Lq != Lk, Lq = 1 or Lk = 1, GQA;
* SDPA call sites (product "sdpa", one case in five of the 4-D ones): the masks drawn above built
  into one `attn_mask` (bool where every mask is a -inf keep mask, else float: the fills and
  terms applied to zeros, added to the scores by SDPA), or `is_causal=True` for a lone causal
  mask; `scale=` given or None, or folded into q (and k) with `scale=1`; GQA by `enable_gqa`,
  repeat_interleave or repeat_kv. Eager is SDPA's math backend (rows masked everywhere give 0;
  the CPU flash kernel's backward zeroes a float64 row biased by finfo.min everywhere, which its
  forward and the math give uniform weights); the rewrite runs with FUSE_PLUGIN_SITE_CHOICE=ours;
* bias tables: one case in seven of the non-mutants with a learned bias gathers it from a table
  parameter by an index buffer (LeViT's `table[:, idx]`, Swin's `table[idx.view(-1)].view(...)`
  when merged; negative indices too): the rewrite's fuse_plugin.table_gather (patterns/bias_table.py);
* sinks: one case in eleven of the other 4-D hand-written ones joins gpt-oss's sink column (a
  learned logit per head) to the scores before the softmax, with or without the max subtraction,
  and drops it after (patterns/sinks.py; the sinks' gradient is compared too);
* sliding windows: one case in thirteen of the non-mutants turns its first causal mask into a
  causal window of 1 to 3 keys (`where(j <= i and j > i - W, x, v)`), or gains one with -inf;
* chunks: one case in seventeen of the other non-mutants does the same with causal chunks of 2
  to 4 keys (`where(j <= i and j // C == i // C, x, v)`, Llama 4; the op's `chunk`);
* documents: one case in nineteen of the other 4-D non-mutants (made self-attention, Lk = Lq) adds
  a packed-documents mask from an integer id buffer (B, L), sorted or scattered ids:
  `masked_fill(~(doc[:, :, None] == doc[:, None, :])[:, None], v)`, the causal mask ANDed in one
  seed in two (the op's `documents`, patterns/mask_structure.documents_arg); one in five of those
  spells HF's packed sequences instead: positions restarting at random points, causal by position
  and documents where the position does not step by one, looked up by advanced indexing
  (mask_structure.packed_positions);
* the route: one case in seven of the others (seed % 7 == 2) is rewritten with
  FUSE_PLUGIN_SITE_CHOICE=sdpa, a hand-written site becoming an SDPA call where it can be one
  (patterns/attention._sdpa_call: masks folded into one attn_mask, eager's NaN rows restored, but
  not tested for where the bias is the learned one alone: patterns/bias_source.py); a GQA case of
  those with an even seed with FUSE_PLUGIN_SITE_CHOICE=sdpa_repeat, its k/v repeated to the query
  heads for the call instead of enable_gqa (what the choice takes in float32);
* mutants, which are not attention and must be left alone (0 fused sites in the rewrite's
  report): softmax over dim -2, weights changed before the product with v (scaled, squared,
  flipped, shifted), weights or scores also used elsewhere, a fill with 0 (not a mask value), a
  multiplicative mask, log_softmax. Positive variants where v or q is also used elsewhere.

`run_case(case)` compiles the module (our rewrite + AOTAutograd with eager kernels by default; the
real `backend="fuse_plugin"` with Inductor when FUSE_PLUGIN_FUZZ_BACKEND=inductor) and compares
with eager: outputs (rel 1e-5 in float32, NaN exactly where eager's are NaN) and the gradients of
every input and parameter (rel 1e-4). Where eager's gradient is NaN (a row whose every score is
-inf spreads NaN through the weights' backward), the gradient must be that of the module with
`aten._safe_softmax` (the row contributes nothing; SDPA's math path does this too), which is what
the op gives. Returns a `Result`; `wrong` lists what differs.

Additive masks of -1e9 / -1e4 are not drawn: on a row masked everywhere eager's own result then
depends on how score + mask rounds (score + -1e9 is a multiple of 64 in float32), so any other
evaluation order differs; fills of these values are drawn (they replace the scores).
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FMIN32 = torch.finfo(torch.float32).min
MUTANTS = ("softmax_dim", "weights_scaled", "weights_pow", "weights_flip", "weights_shift", "weights_used",
           "scores_used", "fill_zero", "mul_mask", "log_softmax")
POSITIVE_EXTRAS = ("v_used", "q_used")
# mutants drawn without a draw (make_case), outside MUTANTS' cycle: a learned factor on the scores
# that differs along the keys (h, 1, Lk), which cannot move to q as a per-row factor can
RULE_MUTANTS = ("row_key",)


@dataclass
class MaskStep:
    kind: str  # causal | pad | rand | bias
    spelling: str  # causal: fill_not_tril | fill_triu | where | add ; bool masks: fill | where | add ; bias: add
    value: float  # the mask value ("fmin" is resolved to the scores' dtype)


@dataclass
class Case:
    seed: int
    dtype: torch.dtype
    b: int
    h: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int
    layout: str  # bhld | blhd | merged
    product: str  # matmul | mT | permute | einsum | bmm | sdpa
    scale: str  # none | mul | div | q | qk | row_head | row_query (a learned factor per head / per query row)
    masks: list
    softmax: str  # F | method | torch | f32
    dropout: str  # none | eval
    gqa: str  # none | repeat_interleave | repeat_kv | enable_gqa (sdpa)
    pv: str  # matmul | einsum | bmm
    variant: str = "none"  # a mutant, a positive extra, or none
    route: str = "ours"  # ours | sdpa | sdpa_repeat (FUSE_PLUGIN_SITE_CHOICE for the rewrite)
    sinks: str = "none"  # none | cat | cat_max: gpt-oss's sink column (patterns/sinks.py)
    table: bool = False  # the learned biases gathered from a table by an index buffer (patterns/bias_table.py)

    @property
    def mutant(self) -> bool:
        return self.variant in MUTANTS + RULE_MUTANTS

    def describe(self) -> str:
        masks = " then ".join(f"{m.kind}:{m.spelling}({m.value:g})" for m in self.masks) or "no mask"
        return (f"seed={self.seed} {str(self.dtype)[6:]} B{self.b} H{self.h}/{self.hkv} Lq{self.lq} Lk{self.lk} "
                f"D{self.d} Dv{self.dv} {self.layout} {self.product} scale={self.scale} [{masks}] "
                f"softmax={self.softmax} dropout={self.dropout} gqa={self.gqa} pv={self.pv} variant={self.variant}"
                + (f" route={self.route}" if self.route != "ours" else "")
                + (f" sinks={self.sinks}" if self.sinks != "none" else "")
                + (" table" if self.table else ""))


def make_case(seed: int) -> Case:
    r = random.Random(seed)
    layout = r.choice(["bhld", "bhld", "blhd", "merged"])
    merged = layout == "merged"
    gqa = "none" if merged else r.choice(["none", "none", "repeat_interleave", "repeat_kv"])
    h = r.choice([1, 2, 4])
    hkv = h if gqa == "none" or h == 1 else r.choice([d for d in (1, 2) if h % d == 0 and d < h])
    if hkv == h:
        gqa = "none"
    lq = r.choice([1, 2, 4, 5, 8])
    lk = r.choice([lq, lq, 1, 3, 7])
    kinds = ["causal", "pad", "rand", "bias"] if not merged else ["causal", "rand", "bias"]
    masks = []
    for _ in range(r.choice([0, 1, 2, 2, 2, 3])):
        kind = r.choice(kinds)
        if kind == "bias":
            masks.append(MaskStep("bias", "add", 0.0))
            continue
        spellings = ["fill_not_tril", "fill_triu", "where", "add"] if kind == "causal" else ["fill", "where", "add"]
        spelling = r.choice(spellings)
        values = [-math.inf, FMIN32] if spelling == "add" else [-math.inf, FMIN32, -1e9, -1e4]
        masks.append(MaskStep(kind, spelling, r.choice(values)))
    variant = "none"
    u = r.random()
    if seed % 4 == 3:  # one case in four is a mutant, each kind once in 4 * len(MUTANTS) seeds
        variant = MUTANTS[(seed // 4) % len(MUTANTS)]
        if variant in ("fill_zero", "mul_mask") and not any(m.kind in ("pad", "rand") for m in masks):
            masks.append(MaskStep(r.choice(kinds[1:2]), "fill", -math.inf))  # the mutant changes a bool mask's use
        if variant == "mul_mask" and lk == 1:  # (one key: scores times a 0/1 mask is a factor per row,
            lk = 3  # which the rewrite moves to q, rightly: no longer a mutant)
    elif u < 0.15:
        variant = r.choice(POSITIVE_EXTRAS)
    case = Case(
        seed=seed, dtype=torch.float64 if r.random() < 1 / 6 else torch.float32,
        b=r.choice([1, 2]), h=h, hkv=hkv, lq=lq, lk=lk, d=r.choice([16, 32]), dv=r.choice([16, 24]),
        layout=layout, product="bmm" if merged else r.choice(["matmul", "mT", "permute", "einsum"]),
        scale=r.choice(["none", "mul", "div", "div", "q", "qk"]), masks=masks,
        softmax=r.choice(["F", "method", "torch", "f32"]), dropout=r.choice(["none", "none", "eval"]),
        gqa=gqa, pv="bmm" if merged else r.choice(["matmul", "matmul", "einsum"]), variant=variant,
    )
    # one case in five of the 4-D ones an SDPA call site (no further draw: the other cases stay as
    # they were drawn before SDPA sites were fuzzed)
    if not merged and not case.mutant and seed % 5 == 1:
        case.product = "sdpa"
        if gqa != "none" and seed % 10 == 1:
            case.gqa = "enable_gqa"
    elif seed % 7 == 2:  # (no draw either)
        case.route = "sdpa_repeat" if gqa != "none" and seed % 2 == 0 else "sdpa"
    # one case in thirteen: its causal `where` mask is a sliding window, keys i-W+1 .. i with W
    # 1 to 3 (HF Mistral's `kv > q - W` beside `kv <= q`; patterns/attention_bias.window_of); one in
    # seventeen of the others: causal chunks of C 2 to 4 keys (`j <= i and j // C == i // C`, Llama 4's
    # chunked attention; patterns/mask_structure.chunk_of, the op's `chunk`) (no draw)
    band = f"window{1 + seed % 3}" if seed % 13 == 6 else f"chunk{2 + seed % 3}" if seed % 17 == 9 else None
    if band is not None and not case.mutant:
        causal = [m for m in case.masks if m.kind == "causal"]
        if causal:
            causal[0].spelling = band
        else:
            case.masks.append(MaskStep("causal", band, -math.inf))
    # one case in nineteen of the other 4-D ones: packed documents (no draw), self-attention
    if band is None and not merged and not case.mutant and seed % 19 == 14:
        case.lk = case.lq
        spelling = "docs_positions" if seed % 5 == 0 else "docs_causal" if seed % 2 else "docs"
        case.masks.append(MaskStep("doc", spelling, FMIN32 if seed % 3 == 0 else -math.inf))
    # one case in eleven of the other 4-D ones has gpt-oss's sink column (no draw either)
    if not merged and not case.mutant and case.product != "sdpa" and case.route == "ours" and seed % 11 == 5:
        case.sinks = "cat_max" if seed % 2 else "cat"
    # one case in twenty-nine of the other hand-written 4-D self-attention ones: HF's eager mask,
    # causal & a window of 1 to 3 & the key padding in ONE finfo.min fill (its rows at left-padded
    # positions see no key: eager averages them over all keys; attention_bias.window_beside_one_fill)
    # instead of the drawn masks (no draw)
    if band is None and not merged and not case.mutant and case.product != "sdpa" and case.sinks == "none" \
            and not any(m.kind == "doc" for m in case.masks) and seed % 29 == 11:
        case.lk = case.lq
        case.masks = [MaskStep("causal", f"onefill{1 + seed % 3}", FMIN32)]
    # one case in twenty-three of the hand-written 4-D ones: the scores times a learned factor per
    # head (h, 1, 1) (timm XCiT's temperature) or per query row (1, h, Lq, 1) instead of the scale,
    # moved to q by the rewrite; in another one in twenty-three a factor per key (h, 1, Lk): a
    # mutant (no draw)
    if not merged and not case.mutant and case.product != "sdpa" and case.sinks == "none":
        if seed % 23 == 8:
            case.scale = "row_head" if seed % 2 else "row_query"
        elif seed % 23 == 20 and case.lk > 1:  # (one key: a factor per key is one per row)
            case.variant = "row_key"
    # one case in seven of the others with a learned bias gathers it from a table (no draw)
    if not case.mutant and seed % 7 == 4 and any(m.kind == "bias" for m in case.masks):
        case.table = True
    return case


# ------------------------------------------------------------------------------------------ module


class FuzzModule(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        g = torch.Generator().manual_seed(case.seed)
        self.biases = nn.ParameterList()
        for m in case.masks:
            if m.kind == "bias":
                shape = (case.lq, case.lk) if case.layout == "merged" else (1, case.h, case.lq, case.lk)
                if case.table:  # LeViT's table[:, idx] (4-D) / Swin's table[idx.view(-1)] (merged), n entries
                    n = 3 + case.seed % 5
                    shape = (n,) if case.layout == "merged" else (case.h, n)
                self.biases.append(nn.Parameter((torch.randn(*shape, generator=g) * 0.5).to(case.dtype)))
        if case.table:  # (negative indices too: they count from the end, as indexing does)
            self.register_buffer("index", torch.randint(-(3 + case.seed % 5), 3 + case.seed % 5,
                                                        (case.lq, case.lk), generator=g))
        self.safe = False  # aten._safe_softmax instead of softmax: the reference for NaN gradients
        if case.sinks != "none":
            self.sinks = nn.Parameter((torch.randn(case.h, generator=g) * 2).to(case.dtype))
        row = {"row_head": (case.h, 1, 1), "row_query": (1, case.h, case.lq, 1)}.get(case.scale)
        if case.variant == "row_key":
            row = (case.h, 1, case.lk)
        if row is not None:  # positive and negative factors, around the usual 1/sqrt(d)
            self.row = nn.Parameter((torch.randn(*row, generator=g) * 0.5 / math.sqrt(case.d)).to(case.dtype))
        if any(m.kind == "doc" for m in case.masks):  # document ids (B, L): sorted runs or scattered
            doc = torch.randint(0, 3, (case.b, case.lq), generator=g)
            self.register_buffer("doc", doc.sort(-1).values if case.seed % 4 < 2 else doc)
            # positions restarting at random points, from a random offset per row (docs_positions)
            idx = torch.arange(case.lq).expand(case.b, -1)
            starts = torch.rand(case.b, case.lq, generator=g) < 0.3
            starts[:, 0] = True
            first = torch.cummax(torch.where(starts, idx, 0), -1).values
            self.register_buffer("pos", idx - first + torch.randint(0, 4, (case.b, 1), generator=g))

    def _doc_keep(self, lq):
        if any(m.spelling == "docs_positions" for m in self.case.masks):
            # HF masking_utils' packed sequences (mask_structure.packed_positions): causal by position
            # and the documents where the position does not step by one, both by advanced indexing
            pos, b = self.pos, self.pos.shape[0]
            doc = (torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != 1).cumsum(-1)
            bi = torch.arange(b, device=pos.device)[:, None, None, None]
            qi = torch.arange(lq, device=pos.device)[None, None, :, None]
            ki = torch.arange(lq, device=pos.device)[None, None, None, :]
            keep = pos.new_ones((), dtype=torch.bool) & (pos[bi, ki] <= pos[bi, qi])
            return keep & (doc[bi, qi] == doc[bi, ki])
        keep = (self.doc[:, :, None] == self.doc[:, None, :])[:, None]
        if any(m.spelling == "docs_causal" for m in self.case.masks):
            keep = keep & torch.ones(lq, lq, dtype=torch.bool, device=keep.device).tril()
        return keep

    def _bias_values(self):
        """The learned biases, as the masks add them: gathered from their tables (case.table)."""
        if not self.case.table:
            return iter(self.biases)
        if self.case.layout == "merged":
            return iter(t[self.index.view(-1)].view(self.index.shape) for t in self.biases)
        return iter(t[:, self.index].unsqueeze(0) for t in self.biases)

    def _softmax(self, x, dim):
        c = self.case
        if self.safe:
            p = torch.ops.aten._safe_softmax(x.float() if c.softmax == "f32" else x, dim)
            return p.to(x.dtype) if c.softmax == "f32" else p
        if c.variant == "log_softmax":
            return F.log_softmax(x, dim=dim)
        if c.softmax == "F":
            return F.softmax(x, dim=dim)
        if c.softmax == "method":
            return x.softmax(dim)
        if c.softmax == "torch":
            return torch.softmax(x, dim=dim)
        return F.softmax(x, dim=dim, dtype=torch.float32).to(x.dtype)

    def _mask(self, x, m: MaskStep, pad_keep, rand_keep, bias):
        c = self.case
        lq, lk = x.shape[-2], x.shape[-1]
        value = torch.finfo(x.dtype).min if m.value == FMIN32 else m.value
        if m.kind == "bias":
            return x + bias
        if m.kind == "causal":
            if m.spelling == "fill_not_tril":
                return x.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=x.device).tril(), value)
            if m.spelling == "fill_triu":
                return x.masked_fill(torch.ones(lq, lk, device=x.device).triu(1).bool(), value)
            if m.spelling.startswith("onefill"):  # HF's eager builders: causal & window & padding, one fill
                w = int(m.spelling[len("onefill"):])
                if c.seed % 2:  # HF's 4-D indices
                    i = torch.arange(lq, device=x.device)[None, None, :, None]
                    j = torch.arange(lk, device=x.device)[None, None, None, :]
                    keep = (j <= i) & (j > i - w) & pad_keep
                else:  # the (Lq, Lk) band made 4-D after the AND (no draw)
                    i, j = torch.arange(lq, device=x.device)[:, None], torch.arange(lk, device=x.device)[None, :]
                    keep = ((j <= i) & (j > i - w))[None, None] & pad_keep
                return x + torch.where(keep, torch.zeros((), dtype=x.dtype, device=x.device), value)
            if m.spelling == "where" or m.spelling.startswith(("window", "chunk")):
                keep = torch.arange(lk, device=x.device)[None, :] <= torch.arange(lq, device=x.device)[:, None]
                if c.seed % 3 == 0:  # the query on the left (no draw): i >= j
                    keep = torch.arange(lq, device=x.device)[:, None] >= torch.arange(lk, device=x.device)[None, :]
                if m.spelling.startswith("window"):
                    w = int(m.spelling[len("window"):])
                    keep = keep & (torch.arange(lk, device=x.device)[None, :] > torch.arange(lq, device=x.device)[:, None] - w)
                if m.spelling.startswith("chunk"):
                    n = int(m.spelling[len("chunk"):])
                    keep = keep & (torch.arange(lk, device=x.device)[None, :] // n
                                   == torch.arange(lq, device=x.device)[:, None] // n)
                return torch.where(keep, x, value)
            return x + torch.full((lq, lk), value, dtype=x.dtype, device=x.device).triu(1)
        if m.kind == "doc":
            return x.masked_fill(~self._doc_keep(lq), value)
        keep = pad_keep if m.kind == "pad" else rand_keep
        if c.variant == "fill_zero":
            return x.masked_fill(~keep, 0.0)
        if c.variant == "mul_mask":
            return x * keep.to(x.dtype)
        if m.spelling == "fill":
            return x.masked_fill(~keep, value)
        if m.spelling == "where":
            return torch.where(keep, x, value)
        return x + torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, value)

    def _repeat(self, k, v):
        """k and v repeated over the query heads of their GQA group (repeat_interleave or repeat_kv)."""
        c = self.case
        n = c.h // c.hkv
        if c.gqa == "repeat_interleave":
            return k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
        b, hk, lk, _ = k.shape
        return (k[:, :, None].expand(b, hk, n, lk, k.shape[-1]).reshape(b, hk * n, lk, k.shape[-1]),
                v[:, :, None].expand(b, hk, n, lk, v.shape[-1]).reshape(b, hk * n, lk, v.shape[-1]))

    def _sdpa_mask(self, q, k, pad_keep, rand_keep):
        """The drawn masks as SDPA's one attn_mask (module doc), and is_causal."""
        c = self.case
        if [m.kind for m in c.masks] == ["causal"] and c.masks[0].value == -math.inf and c.seed % 2:
            return None, True
        if not c.masks:
            return None, False
        lq, lk = q.shape[-2], k.shape[-2]
        biases = self._bias_values()
        if all(m.kind != "bias" and m.value == -math.inf and m.spelling != "add" for m in c.masks):
            keep = torch.ones(lq, lk, dtype=torch.bool)
            for m in c.masks:
                if m.kind == "causal":
                    keep = keep & torch.ones(lq, lk, dtype=torch.bool).tril()
                    if m.spelling.startswith("window"):
                        keep = keep & ~torch.ones(lq, lk, dtype=torch.bool).tril(-int(m.spelling[len("window"):]))
                    if m.spelling.startswith("chunk"):
                        n = int(m.spelling[len("chunk"):])
                        keep = keep & (torch.arange(lk)[None, :] // n == torch.arange(lq)[:, None] // n)
                elif m.kind == "doc":
                    keep = keep & self._doc_keep(lq)
                else:
                    keep = keep & (pad_keep if m.kind == "pad" else rand_keep)
            return keep, False
        x = torch.zeros(lq, lk, dtype=q.dtype)
        for m in c.masks:
            x = self._mask(x, m, pad_keep, rand_keep, next(biases) if m.kind == "bias" else None)
        return x, False

    def _sdpa(self, q, k, v, pad_keep, rand_keep):
        c = self.case
        s = 1.0 / math.sqrt(c.d)
        scale = {"none": None, "mul": s, "div": s}.get(c.scale, 1.0)
        if c.scale == "q":
            q = q * s
        elif c.scale == "qk":
            q, k = q * math.sqrt(s), k * math.sqrt(s)
        mask, causal = self._sdpa_mask(q, k, pad_keep, rand_keep)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=c.gqa == "enable_gqa")

    def forward(self, q, k, v, pad_keep, rand_keep):
        c = self.case
        if c.layout == "blhd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if c.product == "sdpa":
            if c.gqa in ("repeat_interleave", "repeat_kv"):
                k, v = self._repeat(k, v)
            return self._finish(self._sdpa(q, k, v, pad_keep, rand_keep), q, v)
        if c.gqa != "none":
            k, v = self._repeat(k, v)
        s = 1.0 / math.sqrt(c.d)
        if c.scale == "q":
            q = q * s
        elif c.scale == "qk":
            q, k = q * math.sqrt(s), k * math.sqrt(s)
        if c.product == "matmul":
            x = torch.matmul(q, k.transpose(-2, -1))
        elif c.product == "mT":
            x = q @ k.mT
        elif c.product == "permute":
            x = q @ k.permute(0, 1, 3, 2)
        elif c.product == "einsum":
            x = torch.einsum("bhqd,bhkd->bhqk", q, k)
        else:
            x = torch.bmm(q, k.transpose(1, 2))
        if c.scale == "mul":
            x = x * s
        elif c.scale == "div":
            x = x / math.sqrt(c.d)
        elif c.scale.startswith("row"):
            x = x * self.row
        if c.variant == "row_key":
            x = x * self.row
        scores = x
        biases = self._bias_values()
        for m in c.masks:
            x = self._mask(x, m, pad_keep, rand_keep, next(biases) if m.kind == "bias" else None)
        if c.sinks != "none":  # softmax([scores, sink])[..., :-1], as HF gpt-oss
            col = self.sinks.reshape(1, -1, 1, 1).expand(x.shape[0], -1, x.shape[2], -1).to(x.dtype)
            x = torch.cat([x, col], dim=-1)
            if c.sinks == "cat_max":
                x = x - x.max(dim=-1, keepdim=True).values
            p = self._softmax(x, -1)[..., :-1]
        else:
            p = self._softmax(x, -2 if c.variant == "softmax_dim" else -1)
        if c.variant == "weights_scaled":
            p = p * 2.0
        elif c.variant == "weights_pow":
            p = p.pow(2)
        elif c.variant == "weights_flip":
            p = p.flip(-1)
        elif c.variant == "weights_shift":
            p = p + 0.01
        if c.dropout == "eval":
            p = F.dropout(p, 0.1, training=False)
        if c.pv == "einsum":
            out = torch.einsum("bhqk,bhkd->bhqd", p, v)
        elif c.pv == "bmm":
            out = torch.bmm(p, v)
        else:
            out = torch.matmul(p, v)
        if c.variant == "weights_used":
            return self._finish(out, q, v), p.sum(-1)
        if c.variant == "scores_used":
            return self._finish(out, q, v), scores.mean(-1)
        return self._finish(out, q, v)

    def _finish(self, out, q, v):
        """The heads merged back (blhd), with the positive extras' second output."""
        c = self.case
        if c.layout == "blhd":
            out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        if c.variant == "v_used":
            return out, v.sum(-2)
        if c.variant == "q_used":
            return out, q.mean(-1)
        return out


def make_inputs(case: Case):
    """q, k, v (leaf tensors that require grad), the key padding keep mask (B, 1, 1, Lk) (left
    padding: batch 0 pads its first keys, so with a causal mask its first query rows are dead) and
    a random (B, 1, Lq, Lk) keep mask (3-D: (Lq, Lk)) with a row masked everywhere."""
    g = torch.Generator().manual_seed(case.seed + 1)
    if case.layout == "merged":
        shapes = [(case.b * case.h, case.lq, case.d), (case.b * case.h, case.lk, case.d), (case.b * case.h, case.lk, case.dv)]
    else:
        hk = case.hkv
        shapes = [(case.b, case.h, case.lq, case.d), (case.b, hk, case.lk, case.d), (case.b, hk, case.lk, case.dv)]
        if case.layout == "blhd":
            shapes = [(s[0], s[2], s[1], s[3]) for s in shapes]
    q, k, v = (torch.randn(*s, generator=g).to(case.dtype).requires_grad_() for s in shapes)
    pad = torch.ones(case.b, 1, 1, case.lk, dtype=torch.bool)
    pad[0, ..., : torch.randint(0, case.lk + 1, (), generator=g).item()] = False  # left padding
    if case.b > 1:
        pad[1, ..., case.lk - torch.randint(0, case.lk, (), generator=g).item():] = False  # right padding
    shape = (case.lq, case.lk) if case.layout == "merged" else (case.b, 1, case.lq, case.lk)
    rand = torch.rand(*shape, generator=g) > 0.35
    if case.lq > 1:
        rand[..., torch.randint(0, case.lq, (), generator=g).item(), :] = False
    return q, k, v, pad, rand


# ------------------------------------------------------------------------------------------ running


@dataclass
class Result:
    case: Case
    fused: int
    misses: list
    wrong: list = field(default_factory=list)
    seconds: float = 0.0


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """‖a − b‖ / ‖b‖, with ‖b‖ counted as at least `floor` per element (RMS): a gradient that is
    exactly 0 in eager (one key, or rows the fills cover) and ~1e-6 from a kernel's rounding is
    not a wrong result."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(floor * max(b.numel(), 1) ** 0.5)).item()


def _clone_inputs(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


def _grads(module, inputs):
    return [t.grad for t in inputs[:3]] + [p.grad for p in module.parameters()]


def run_case(case: Case) -> Result:
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    from fuse_plugin.patterns import Report, rewrite

    t0 = time.perf_counter()
    report = Report()
    inductor = os.environ.get("FUSE_PLUGIN_FUZZ_BACKEND", "aot_eager") == "inductor"

    def backend(gm, example_inputs):
        if inductor:
            from fuse_plugin.backend import fuse_plugin_backend

            report.extend(rewrite(copy.deepcopy(gm)))  # what the backend's own rewrite will do
            return fuse_plugin_backend(gm, example_inputs)
        report.extend(rewrite(gm))
        compiler = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)

    eager = FuzzModule(case)
    ours_m, safe_m = copy.deepcopy(eager), copy.deepcopy(eager)
    safe_m.safe = True
    inputs = list(make_inputs(case))
    ours_in, safe_in = _clone_inputs(inputs), _clone_inputs(inputs)
    torch._dynamo.reset()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # SDPA cases: its exact math (the CPU flash kernel's backward
        ref = eager(*inputs)  # drops float64 rows biased by finfo.min, which its forward keeps)
    old = os.environ.get("FUSE_PLUGIN_SITE_CHOICE")
    # every site to our op (nothing is measured here), or with the "sdpa" route each hand-written one
    # that can be to an SDPA call
    os.environ["FUSE_PLUGIN_SITE_CHOICE"] = case.route
    try:
        out = torch.compile(ours_m, backend=backend)(*ours_in)
    finally:
        os.environ.pop("FUSE_PLUGIN_SITE_CHOICE") if old is None else os.environ.update(FUSE_PLUGIN_SITE_CHOICE=old)
    safe = safe_m(*safe_in)
    refs, outs, safes = (x if isinstance(x, tuple) else (x,) for x in (ref, out, safe))
    kinds = ("attention", "sdpa")
    res = Result(case, sum(report.count(k) for k in kinds), [m.reason for m in report.misses if m.kind in kinds])
    # float64 to 1e-10, unless eager's softmax runs in float32 (softmax(dtype=float32))
    tol_out, tol_grad = (1e-10, 1e-9) if case.dtype == torch.float64 and case.softmax != "f32" else (1e-5, 1e-4)
    floor = 0.1  # RMS of an output or gradient counted as at least this (float32: absolute 1e-5 near 0)
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o.shape != r.shape or o.dtype != r.dtype:
            res.wrong.append(f"output {i}: {tuple(o.shape)} {o.dtype}, eager {tuple(r.shape)} {r.dtype}")
            continue
        if not torch.equal(o.isnan(), r.isnan()):
            res.wrong.append(f"output {i}: NaN at {int(o.isnan().sum())} places, eager at {int(r.isnan().sum())}")
        err = _rel(o.nan_to_num(), r.nan_to_num(), floor)
        if err > tol_out:
            res.wrong.append(f"output {i}: rel err {err:.2e}")
    g = torch.Generator().manual_seed(case.seed + 2)
    grads = [torch.randn(r.shape, generator=g).to(r.dtype) for r in refs]
    torch.autograd.backward(refs, grads)
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(safes, grads)
    names = ["dq", "dk", "dv"] + [f"d(bias {i})" for i in range(len(list(eager.parameters())))]
    for name, a, b, s in zip(names, _grads(eager, inputs), _grads(ours_m, ours_in), _grads(safe_m, safe_in)):
        if a is None or b is None:
            if (a is None) != (b is None):
                res.wrong.append(f"{name}: None in one of eager / compiled")
            continue
        # fused: where eager's gradient is NaN, the op's (the dead row adds nothing); unfused: eager's
        expected = torch.where(a.isnan(), s, a) if res.fused else a
        if not torch.equal(b.isnan(), expected.isnan()):
            res.wrong.append(f"{name}: NaN at {int(b.isnan().sum())} places, expected at {int(expected.isnan().sum())}")
        err = _rel(b.nan_to_num(), expected.nan_to_num(), floor)
        if err > tol_grad:
            res.wrong.append(f"{name}: rel err {err:.2e}")
    if case.mutant and res.fused:
        res.wrong.append(f"mutant {case.variant} was fused ({res.fused} site(s))")
    torch._dynamo.reset()
    res.seconds = time.perf_counter() - t0
    return res


def run_many(seeds, log=print) -> dict:
    """Run the cases of `seeds`; a summary dict (cases, fused, mutants, wrong results, seconds)."""
    t0 = time.perf_counter()
    results = [run_case(make_case(s)) for s in seeds]
    wrong = [r for r in results if r.wrong]
    for r in wrong:
        log(f"WRONG {r.case.describe()}: {'; '.join(r.wrong)}")
    mutants = [r for r in results if r.case.mutant]
    positives = [r for r in results if not r.case.mutant]
    summary = dict(
        cases=len(results),
        positives=len(positives),
        positives_fused=sum(r.fused > 0 for r in positives),
        mutants=len(mutants),
        mutants_untouched=sum(r.fused == 0 for r in mutants),
        wrong=len(wrong),
        seconds=round(time.perf_counter() - t0, 1),
    )
    reasons: dict = {}
    for r in positives:
        if not r.fused:
            for m in r.misses:
                reasons[m] = reasons.get(m, 0) + 1
    summary["refusals"] = reasons
    return summary


if __name__ == "__main__":  # python tests/fuzz_attention.py [N] [first seed]
    import sys

    import fuse_plugin  # noqa: F401

    n = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("FUSE_PLUGIN_FUZZ", "500"))
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(run_many(range(first, first + n)))
