"""Flash-attention forward and backward kernels (Triton, FA2-style): the launchers.

This module holds what the ops call (``attention_forward``, ``attention_backward``): validate the
call once (call.py), choose its kernel family (registry.py), launch it. The general kernels live
in attention_fwd.py / attention_bwd.py (launched by attention_general.py), their shared device
helpers in attention_tiles.py, the other families in attention_hopper.py (TMA, Gluon),
attention_decode.py, attention_small.py and attention_cudnn.py; tiles (``AttentionConfig``, the
table lookup and heuristics) in attention_config.py. Everything below describes the kernels as
a whole.

Shapes and layouts
------------------
* ``q``: (B, Hq, Lq, D), ``k``: (B, Hkv, Lk, D), ``v``: (B, Hkv, Lk, Dv), with ``Hq % Hkv == 0``.
  GQA/MQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``; K/V are never repeated.
  Any strides are accepted (e.g. ``x.view(B, L, H, D).transpose(1, 2)``); a tensor is copied
  only when its last-dim stride is not 1.
* ``bias``: None, or a (B, Hq, Lq, Lk) tensor (usually an ``.expand`` view with 0 strides, which
  are read as they are), or a window-periodic (P, Hq, Lq, Lk) one (P divides B, batch b reads
  bias[b % P]: Swin's shifted-window mask; call.py). A bool bias keeps True and masks False; a
  float bias is added in fp32 after scaling: ``s = (q @ k^T) * scale + bias``.
* ``is_causal``: top-left aligned (as SDPA): key j is visible to query i iff ``j <= i``.
* ``chunk`` (with ``is_causal``, not with a window; 0: none): chunked attention (Llama 4), key j
  visible to query i iff ``j // chunk == i // chunk`` and ``j <= i``: the same machinery as the
  window below (``_band_lo`` / ``_band_end``: the band's first key per row), the kernels skip every
  key block outside a query block's chunks.
* ``documents`` (None, or integer ids (B, L) or (1, L); self-attention, Lq == Lk; with or without
  ``is_causal``, not with a window or chunks): packed sequences, key j visible to query i iff
  ``documents[b, j] == documents[b, i]``. The launch turns the ids into a (B, L, 2) int32 table
  of each position's document span (``call.document_ranges``, on the device, no sync); the
  general kernels (``WINDOW`` 3) reduce a block's spans to the blocks it may meet
  (``_doc_span``: exact for contiguous documents, a superset otherwise), skip the rest and mask
  every visited tile by ``lo[i] == lo[j]`` (``_same_document``).
* ``window`` (with ``is_causal``; 0: none): a sliding window, key j visible to query i iff
  ``i - window < j <= i`` (HF's ``sliding_window``). The general kernels (forward, both backward
  paths) find each block's live range from the sizes alone (``_key_blocks`` / ``_query_blocks``
  in attention_tiles.py) and skip every block the window hides; the edge blocks are masked
  under the ``WINDOW`` constexpr (off: the same kernels as without it). Other families say
  why not (registry.py).
* Outputs: ``out`` (B, Hq, Lq, Dv) in q's dtype, laid out (B, Lq, Hq, Dv) in memory (a
  transposed view, see ``out_layout``), ``lse`` (B, Hq, Lq) fp32 contiguous (natural-log
  logsumexp of the scaled, biased, masked scores of each row). ``dout`` is read through its
  strides (unit last stride).
* Backward: ``dq``/``dk``/``dv`` shaped/typed as q/k/v, dense, their dims in q/k/v's memory
  order where those have a unit last stride, else contiguous (``host.layout_like``, as the op's
  fake and as cuDNN's gradients: the head merge of a gradient is then a view); optional
  ``dbias`` is the fp32 gradient dS of the scores summed to ``call.dbias_shape()``: the bias's
  un-broadcast shape (1 where its view has stride 0, P for a window-periodic bias; the caller
  reduces it further to the bias's own shape).
* Dropout (``dropout_p > 0``, ``dropout_seed`` one int64 on the device): each weight P[b,h,i,j]
  is kept iff its 16 bits of a counter hash of (seed, b*Hq + h, i, j) (``_dropout_keep``,
  element-wise in the scores' layout) reach floor(p * 2**16); kept weights are scaled by the inverse
  of that keep rate (1/(1-p) to within 2**-16). The row sum and ``lse`` are of the undropped
  softmax. Forward and backward draw the same mask; ``reference.dropout_keep`` reproduces it bit
  for bit. Nothing of size Lq * Lk is stored.
* Softcap (``softcap`` c > 0, Gemma 2 / Grok): the scores are c·tanh(q·kᵀ·scale / c), then the
  bias and the masks. The general kernels (forward, atomic and atomic-free backward, preprocess)
  take it as the ``SOFTCAP`` constexpr (``_capped_scores``: tanh from exp2 alone, the same on
  every Triton and in the interpreter); the backward multiplies dS by 1 - tanh² for dq/dk (dbias
  is the gradient of the capped scores). The TMA and Gluon kernels have no softcap: a table entry
  naming one yields to the general kernels for a softcapped call, a user config raises
  (``_softcap_config``).
* Replace mask (``replace``, bool (B, Hq, Lq, Lk), any strides, 0 where broadcast; with a float
  bias only): where it holds, the score is the bias alone, ``where(replace, bias, s + bias)``
  (s after the softcap), and dS reaches dq/dk only where it does not (dbias is dS everywhere).
  The general kernels (forward, both backward paths, the preprocess's exact recomputation) read
  it bytewise (``host.bool_operand``) under the ``HAS_REPLACE`` constexpr (off: the same kernels as without it);
  the TMA and Gluon kernels have none (``_softcap_config`` keeps them out, as for a softcap).

Numerics
--------
Scores are accumulated in fp32 (fp32 inputs use tf32 or ieee dots like an eager matmul would).
The softmax is online (running max ``m`` and sum ``l``) with ``exp2``. Without a float bias,
log2(e) is folded into the score scale so each score costs one fused multiply-add. With a float
bias the scores stay in natural units and are converted only after subtracting the row max: a
bias of ``finfo.min`` times log2(e) would overflow to -inf and turn an eager "uniform" row into a
masked one.

A row whose every score is -inf yields what eager softmax yields in the forward pass: NaN
output and ``lse = -inf``. In the backward pass such a row contributes nothing (its dq and dS
rows are 0 and dk/dv are not poisoned), where eager autograd would spread NaN to all of dk/dv.

The backward recomputes ``p = exp(s - lse)``. When |lse| is huge (e.g. a whole row biased with
``finfo.min``), fp32 ``lse`` has lost ``log(l)`` entirely (-3.4e38 + 3 == -3.4e38) and ``p``
would come out as 1 instead of 1/Lk. The preprocess kernel therefore recomputes the exact
(row max, log2 row sum) pair for blocks whose |lse| exceeds ``_LSE_EXACT_LIMIT``; in normal
attention that branch never runs.

Speed
-----
* Masks only where needed: the key loop of the forward (and the query loop of the backward) is
  split into blocks that are fully visible (no causal or length mask math at all) and the few
  diagonal / last-partial blocks that need the mask.
* Padding: under a per-key padding mask (``BIAS_KEYS``: a bias with query stride 0, no dbias
  asked, no window/chunks/documents, Lk >= ``key_range.MIN_KEYS``) the general kernels read the
  live key range [k_lo, k_hi) of each (batch[, head]) from a small int32 table computed per call
  on the device (kernels/key_range.py, ``KEY_RANGE``) and skip the key blocks outside it: the
  forward's and dQ's key loops, the dK/dV programs' query loops (their blocks store zeros).
  Exact: a hidden key's weight is 0 wherever its row sees a visible key (key_range.py).
  ``FUSE_PLUGIN_KEY_PADDING_SKIP=off`` keeps every block (settings.py).
* Head dims that are not a power of 2 can be split (``AttentionConfig.split_d``) into two
  power-of-2 parts, e.g. 80 = 64 + 16 and 96 = 64 + 32, each its own ``tl.dot``, instead of
  padding the head dim to 128.
* Backward, default: ONE kernel per key block (``attention_bwd_kernel``) computes dK and dV in
  registers and adds each query block's dQ contribution with fp32 atomics into a zeroed buffer
  (5 matmuls per block pair instead of 7); ``attention_dq_cast_kernel`` scales and casts it.
  With short keys (Lk <= 128, Lq <= 256, 16-bit, D <= 128: ``_one_key_block_config``) every
  key is in one block, so each program owns whole dQ rows: the kernel takes the row statistics
  from out/lse and stores dQ itself (``ONE_KEY_BLOCK``), and the whole backward is one launch
  (BERT's 128 tokens: 56 vs 63 us on the H100, and two launches fewer on the host).
  The atomics make dQ's summation order vary from run to run, so when
  ``torch.are_deterministic_algorithms_enabled()`` the atomic-free pair
  ``attention_bwd_dkdv_kernel`` + ``attention_bwd_dq_kernel`` runs instead.
* Which kernel family runs a call (cuDNN, decode, small problems, the Hopper TMA / Gluon kernels,
  the atomic-free pair, the general kernels) and with which tiles is chosen once per call in
  one place, the registry (registry.py): forced by a ``config=``, measured (choice_table.py, the
  tuning table tuning.py), or by its rules. Nothing is autotuned at a user's call.

No buffer grows with Lq * Lk (except the dbias output itself when asked for).

Rotary embedding folded in (``rope=Rope(cos, sin, interleaved, rotary_dim)``)
--------------------------------------------------------------------------------
q and k are passed UN-rotated. Every q/k tile is split into the two members of its R/2 rotated
channel pairs (half-split: columns [0, R/2) and [R/2, R); interleaved: even and odd columns, one
contiguous load split in registers) and the pass-through tail [R, D); the pair tiles are rotated in fp32
with the cos/sin rows of their positions and rounded to the input dtype (what the unfused rotary
op stores), and q·kᵀ is the sum of the dots of the parts, so nothing is put back in channel
order. Each program rotates its resident tile once and every streamed tile after its load (the
forward's key tiles, the backward's query tiles). Backward: dK/dQ are accumulated w.r.t. the
rotated tiles and rotated back by the transpose of the rotation before the store; the atomic path
keeps the fp32 dQ accumulator in part order and ``attention_dq_rope_cast_kernel`` rotates it back.
Pair tiles are max(16, next_pow2(R/2)) wide and the tail max(16, next_pow2(D - R)) (padding
columns read as 0): R/2 and D - R powers of 2 pad nothing (Llama: D = R = 128, two 64-wide tiles).
cos/sin: any tables at most 4-D broadcastable to (B, Hq, Lq, W) and (B, Hkv, Lk, W), read
through their strides (stride 0 where broadcast); W = R or R/2 (one value per pair).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import host, registry
from .attention_config import AttentionConfig
from .call import AttentionCall, Rope
from .host import layout_like

__all__ = ["AttentionConfig", "Rope", "attention_forward", "attention_backward", "out_layout"]


def out_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, L, D) laid out as the forward's output is: (B, L, H, D) in memory, seen
    transposed (SDPA's flash and cuDNN outputs have the same layout). Models merge the heads
    with ``out.transpose(1, 2).reshape(B, L, H * D)``, which is then a view: no copy kernel
    (and its launch) after every attention, and the backward's dout arrives with the same
    strides, which the Triton kernels read as they are. A copy unless t has it already."""
    if t.transpose(1, 2).is_contiguous():
        return t
    return _contiguous(t.transpose(1, 2)).transpose(1, 2)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, spelt as the copy op itself (``aten._to_copy``), which, unlike clone,
    also traces on fake CUDA tensors in a CPU build of torch (tests/inductor_trace.py)."""
    if t.is_contiguous():
        return t
    return torch.ops.aten._to_copy(t, memory_format=torch.contiguous_format)


def _user_config(config):
    """A caller's config as its NamedTuple (a plain tuple is an ``AttentionConfig``)."""
    if config is None or hasattr(config, "_fields"):
        cfg = config
    else:
        cfg = AttentionConfig(*config)
    if isinstance(cfg, AttentionConfig) and cfg.dq_tile is not None:
        cfg = cfg._replace(dq_tile=tuple(cfg.dq_tile))
    return cfg


def attention_forward(q, k, v, bias, *, is_causal: bool, scale: float, config=None,
                      rope: Optional[Rope] = None, dropout_p: float = 0.0,
                      dropout_seed: Optional[torch.Tensor] = None, softcap: float = 0.0,
                      replace: Optional[torch.Tensor] = None, window: int = 0,
                      need_lse: bool = True, chunk: int = 0,
                      documents: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None):
    """Returns ``(out, lse)``; see the module docstring for shapes and semantics.

    Args:
        q, k, v: (B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv); Hq a multiple of Hkv.
        bias: None, a (B, Hq, Lq, Lk) view (stride 0 where broadcast), bool keep-mask or float,
            or a window-periodic (P, Hq, Lq, Lk) one.
        config: tiles that force their family (``AttentionConfig``, an
            ``attention_small.SmallConfig``); None: the registry chooses.
        rope: q and k are un-rotated and rotated in registers after each load.
        dropout_p, dropout_seed: weights dropped by the draw of ``_dropout_keep`` under the seed
            (one int64 on q's device), the kept ones scaled by 1/(1-p); lse is undropped.
        softcap: c > 0: the scores are c·tanh(q·kᵀ·scale / c) before the bias and the masks.
        replace: bool, (B, Hq, Lq, Lk), next to a float bias: the scores where it holds are the
            bias alone.
        window: with is_causal, a sliding window: query i sees keys i - window + 1 .. i (0:
            none). The kernels skip the key blocks it hides (the general and Gluon families).
        chunk: with is_causal (no window), chunked attention: query i sees the keys of its
            chunk, j // chunk == i // chunk, up to itself (0: none; the general family only).
        documents: integer ids (B, L) or (1, L) (Lq == Lk): query i sees the keys of its own
            document only (None: none; the general family only).
        sinks: (Hq,) floating sink logits (gpt-oss; ops/attention_sinks.py): each one joins its
            head's every row's softmax denominator, as a key whose value is 0 would (None: none);
            the general forward folds them into its epilogue, another family's output is merged
            with them after it (``merge_sinks``); lse then includes them.
        need_lse: False (inference: no backward will read it) lets a family that computes the
            logsumexp at a cost skip it (the efficient family; the Triton kernels write it
            anyway, cuDNN too: measured no faster without): the returned lse is then unspecified.
    Returns:
        out (B, Hq, Lq, Dv) in q's dtype, laid out (B, Lq, Hq, Dv); lse (B, Hq, Lq) fp32."""
    call = AttentionCall.forward(q, k, v, bias, is_causal=is_causal, scale=scale,
                                 config=_user_config(config), rope=rope, dropout_p=dropout_p,
                                 dropout_seed=dropout_seed, softcap=softcap, replace=replace,
                                 window=window, need_lse=need_lse, chunk=chunk, documents=documents,
                                 sinks=sinks)
    if call.empty:
        B, Hq, Lq, _, _, _, Dv = call.sizes
        out = host.empty((B, Lq, Hq, Dv), q.dtype, q.device).transpose(1, 2)
        return out, host.empty((B, Hq, Lq), torch.float32, q.device)
    family, cfg, _ = registry.choose(call)
    if not family.periodic_bias:
        call.materialise_bias()
    if call.sinks is None or family.takes_sinks:
        return family.run(call, cfg, out_layout)
    call.sinks = None  # the family runs the plain problem; the sink is merged after it
    out, lse = family.run(call, cfg, out_layout)
    return merge_sinks(out, lse, sinks)


def merge_sinks(out, lse, sinks):
    """(out, lse) of the softmax with one more column per row, the head's sink logit, from a family's
    (out₀, lse₀) without it: lse = logaddexp(lse₀, sink), out = out₀·exp(lse₀ − lse) (0 where every key
    was masked: out₀ is NaN there), written into out₀'s storage (its layout). One pass over out:
    measured 3% of a gpt-oss 4k layer (H100), paid only where the family that runs the problem
    fastest does not fold the sink in (the general forward does)."""
    merged = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    w = torch.exp(lse - merged).unsqueeze(-1)
    out.copy_(torch.where(w > 0, out.float() * w, 0.0))
    return out, merged


def attention_backward(dout, q, k, v, bias, out, lse, *, is_causal: bool, scale: float,
                       need_dbias: bool, config=None, deterministic: Optional[bool] = None,
                       rope: Optional[Rope] = None, dropout_p: float = 0.0,
                       dropout_seed: Optional[torch.Tensor] = None,
                       group_split: Optional[int] = None, softcap: float = 0.0,
                       replace: Optional[torch.Tensor] = None, window: int = 0, chunk: int = 0,
                       documents: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None):
    """Returns ``(dq, dk, dv, dbias_or_None)`` (with ``sinks``, also ``dsinks``); see the module
    docstring.

    Args (besides ``attention_forward``'s):
        dout, out, lse: the forward's output gradient, output and logsumexp.
        need_dbias: return dbias, the fp32 gradient of the scores summed to the bias's
            un-broadcast shape (``AttentionCall.dbias_shape``).
        deterministic: default ``torch.are_deterministic_algorithms_enabled()``: no atomics.
        group_split: (atomic path and "tma_pair", default ``attention_general.group_split``)
            share each GQA group's query heads out over that many programs, whose fp32 dK/dV
            partials are then summed.
        sinks: the forward's sink logits (lse includes them): their gradient is returned too,
            dsinks[h] = -sum_{b,i} exp(sinks[h] - lse[b,h,i]) * Delta[b,h,i] with Delta = rowsum(dO*O),
            read from the preprocess kernel where the family ran it (no pass over dO and O), else
            computed (``sink_gradient``). The kernels need nothing else: their weights exp(s - lse)
            are the sink-normalised ones.
    With ``rope``, q and k are the un-rotated inputs and dq/dk the gradients w.r.t. them; with
    ``softcap``, dbias is the gradient of the softcapped scores (dq/dk go on through the
    softcap); with ``replace``, dbias is dS everywhere, dq/dk take none of it where it holds."""
    call = AttentionCall.backward(dout, q, k, v, bias, out, lse, is_causal=is_causal, scale=scale,
                                  need_dbias=need_dbias, config=_user_config(config),
                                  deterministic=deterministic, rope=rope, dropout_p=dropout_p,
                                  dropout_seed=dropout_seed, group_split=group_split,
                                  softcap=softcap, replace=replace, window=window, chunk=chunk,
                                  documents=documents)
    if call.empty:
        q_in, k_in, v_in = call.inputs
        grads = (layout_like(q_in, q.dtype), layout_like(k_in, k.dtype), layout_like(v_in, v.dtype),
                 host.empty(call.dbias_shape(), torch.float32, q.device) if need_dbias else None)
        return grads if sinks is None else grads + (torch.zeros_like(sinks),)
    family, cfg, _ = registry.choose(call)
    target = call.dbias_shape()
    if not family.periodic_bias:
        call.materialise_bias()
    dq, dk, dv, dbias = family.run(call, cfg, out_layout)
    if dbias is not None and (tuple(dbias.shape) != tuple(target) or dbias.dtype != torch.float32):
        dbias = call.reduce_dbias(dbias, target)
    if sinks is None:
        return dq, dk, dv, dbias
    return dq, dk, dv, dbias, sink_gradient(dout, out, lse, sinks, call.delta)


def sink_gradient(dout, out, lse, sinks, delta=None):
    """dsinks[h] = -sum_{b,i} exp(sinks[h] - lse[b,h,i]) * Delta[b,h,i], Delta = rowsum(dO*O) (given,
    or computed from dout and out), in sinks' dtype."""
    if delta is None:
        delta = (dout.float() * out.float()).sum(-1)
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)
