"""Launches of the general Triton kernels (attention_fwd.py, attention_bwd.py): the families
``general`` (the forward; the atomic backward, in one launch where every key fits one block) and
``two_kernel`` (the atomic-free backward pair, deterministic by construction).

Each ``run_*`` takes an ``AttentionCall`` (call.py: validated tensors and kernel arguments) and
its tiles (``AttentionConfig``, chosen by the registry, registry.py) and returns the launcher's
outputs. Kernel arguments go by name, grouped as the kernels declare them: tensors, then each
tensor's strides (``args.strides``), then sizes and scalars, then constexprs; the call's inputs,
sizes and scalars that every kernel takes come from ``_inputs`` and its neighbours. A table or
heuristic config the GPU cannot hold is retried with fewer stages, then the smallest tiles
(``with_retry``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from triton.runtime.errors import OutOfResources

from . import host, key_range
from .attention_bwd import (
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
    attention_bwd_kernel,
    attention_bwd_preprocess_kernel,
    attention_dq_cast_kernel,
    attention_dq_rope_cast_kernel,
)
from .attention_config import SAFE_CONFIG, AttentionConfig, block_d, d_parts
from .attention_fwd import attention_fwd_kernel
from .args import KEY_ROWS, ROW_STATS, SCORES, remembered, strides
from .host import FLOAT_BIAS, cdiv, dot_precision, in_layout_of, inverse_order, layout_order, upcast_dot
from .launch import hint, is_tracing, launch

# --------------------------------------------------------------------------------------------
# Shared by the launches
# --------------------------------------------------------------------------------------------

_FAILED_CONFIGS: dict = {}


def with_retry(run, cfg: AttentionConfig, user_given: bool, variant: Optional[str] = None):
    """Runs ``run(cfg)``. A table/heuristic config the GPU cannot hold (shared memory, e.g. a
    table entry tuned with a bf16 bias meeting an fp32 one) is retried with fewer pipeline
    stages, then with the smallest tiles, with a warning, rather than failing the user's call;
    the working fallback is remembered (per ``variant``: the rope kernels, which hold more, keep
    their own memo so that they never downgrade the plain kernels). A config the user passed is
    never changed. Traced (kernels/launch.py) nothing runs yet: the launch is recorded once,
    with the fallback a failed eager launch left in the memo."""
    if user_given:
        return run(cfg)
    tries = [cfg] + [cfg._replace(num_stages=s) for s in range(cfg.num_stages - 1, 0, -1)]
    tries.append(SAFE_CONFIG)
    memo = cfg if variant is None else (variant, cfg)
    start = _FAILED_CONFIGS.get(memo, 0)
    if is_tracing():
        return run(tries[start])
    for i in range(start, len(tries)):
        try:
            result = run(tries[i])
        except OutOfResources as e:
            if i + 1 == len(tries):
                raise
            warnings.warn(f"fuse_plugin attention: config {tries[i]} does not fit this GPU "
                          f"({e}); trying {tries[i + 1]}", RuntimeWarning, stacklevel=3)
            continue
        if i:
            _FAILED_CONFIGS[memo] = i
        return result
    raise AssertionError("unreachable")


def group_split(programs: int, kv_group: int, device: torch.device) -> int:
    """How many programs share one GQA group in the atomic backward (1 on the CPU / without GQA).

    Measured on the H100 (bf16, causal; benchmarks/NOTES.md): splitting by 2 and 4 gained
    10-40% at every shape tried, also with 512 programs (causal key blocks are unequal work, and
    more, smaller programs even out the tail), and 8 added little over 4. So: up to 4, while the
    grid stays under 32 programs per SM."""
    sms = host.sm_count(device)
    if kv_group == 1 or sms is None:
        return 1
    split = 1
    while split < 4 and kv_group % (2 * split) == 0 and programs * 2 * split <= 32 * sms:
        split *= 2
    return split


def check_tile_offsets(tiles) -> None:
    """In-tile offsets are int32 (tile origins are int64; see ``_tile_ptrs_mask``/``_pair_ptrs``):
    the largest offset inside one tile must fit. Only absurd layouts (a row stride above
    ~2**31 / BLOCK) can fail this. ``tiles``: (name, row stride, col stride, rows, cols)."""
    for name, stride_r, stride_c, rows, cols in tiles:
        if abs(stride_r) * (rows - 1) + abs(stride_c) * (cols - 1) > 2**31 - 1:
            raise ValueError(
                f"{name}: strides ({stride_r}, {stride_c}) overflow int32 tile offsets")


def rope_parts(D: int, rotary_dim: int) -> tuple[int, int, int]:
    """Tile widths (D0, D1, D2) of the rope parts: the two pair members, the pass-through tail."""
    h = block_d(rotary_dim // 2)
    return h, h, (0 if rotary_dim == D else block_d(D - rotary_dim))


def qk_parts(D: int, split: bool, rc: dict) -> tuple[int, int, int]:
    if rc["ROT"]:
        return rope_parts(D, rc["ROT"])
    return (*d_parts(D, split), 0)


def _table_tiles(call, bm, bn):
    W = call.cos.shape[-1]
    return [("cos/sin (q)", call.scq[2], call.scq[3], bm, W),
            ("cos/sin (k)", call.sck[2], call.sck[3], bn, W)]


def _geometry(call, cfg):
    """((D0, D1, D2), (DV0, DV1), tiles): the head-dim parts a launch with ``cfg`` splits q/k and
    v into, and the (name, strides, rows, cols) of the input tiles it reads, for
    ``check_tile_offsets``."""
    q, k, v = call.q, call.k, call.v
    D, Dv = call.sizes[3], call.sizes[6]
    d0, d1, d2 = qk_parts(D, cfg.split_d, call.rc)
    dv0, dv1 = d_parts(Dv, cfg.split_d)
    bm, bn = cfg.block_m, cfg.block_n
    dcols = max(d0 + d1 + d2, D)
    tiles = [("q", *q.stride()[2:], bm, dcols), ("k", *k.stride()[2:], bn, dcols),
             ("v", *v.stride()[2:], bn, dv0 + dv1), ("bias", *call.sb[2:], bm, bn),
             ("replace", *call.sr[2:], bm, bn)] + _table_tiles(call, bm, bn)
    return (d0, d1, d2), (dv0, dv1), tiles


def sum_partials(parts: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """The GQA split's fp32 partials (split, ...) summed in a fixed order into ``into``'s dtype
    (eager: written into ``into``; traced: a new tensor laid out as ``into``, one Inductor
    reduction: the sum runs over the partials seen in ``into``'s memory order, so that its
    natural output is that layout and no copy follows)."""
    if is_tracing():
        order = layout_order(into)
        seen = parts.permute(0, *(1 + d for d in order))
        return seen.sum(0).to(into.dtype).permute(inverse_order(order))
    return into.copy_(parts.sum(0))


def _dots(q) -> dict:
    return dict(PRECISION=dot_precision(q), UPCAST_DOT=upcast_dot(q))


def _common(call) -> dict:
    """The constexprs every general kernel takes: the masks, the bias's form, the dots'."""
    # WINDOW: 0 none, 1 a sliding window, 2 chunks (attention_tiles._band_lo; its size: "window"),
    # 3 documents (the table "Docs": attention_tiles._doc_span)
    window = 3 if call.documents is not None else 2 if call.chunk else bool(call.window)
    return dict(IS_CAUSAL=call.is_causal, WINDOW=window, BIAS_KIND=call.kind,
                HAS_REPLACE=call.has_rep, BIAS_KEYS=call.bias_keys, **_dots(call.q))


def _inputs(call, with_v: bool = True) -> dict:
    """The call's input tensors by the kernels' names: Q, K, V (not with ``with_v`` False: the
    preprocess reads no V), Bias, Rep (the replace mask), Cos, Sin (the rope tables), Docs (the
    documents table, call.document_ranges; call.dummy, never read, without documents)."""
    if with_v:
        return {"Q": call.q, "K": call.k, "V": call.v, "Bias": call.bias_t, "Rep": call.rep_t,
                "Cos": call.cos, "Sin": call.sin, "Docs": call.doc_t}
    return {"Q": call.q, "K": call.k, "Bias": call.bias_t, "Rep": call.rep_t, "Cos": call.cos,
            "Sin": call.sin, "Docs": call.doc_t}


def _input_strides(call, with_v: bool = True) -> dict:
    """The strides of ``_inputs``: q, k, v, the bias (b), the replace mask (r), the rope tables
    as seen at the query rows (cq) and at the key rows (ck). Shared: unpack, never change."""
    return _input_stride_args(call.q.stride(), call.k.stride(), call.v.stride() if with_v else None,
                              tuple(call.sb), tuple(call.sr), tuple(call.scq), tuple(call.sck))


@remembered
def _input_stride_args(sq, sk, sv, sb, sr, scq, sck) -> dict:
    return {**strides("q", sq), **strides("k", sk, KEY_ROWS),
            **(strides("v", sv, KEY_ROWS) if sv is not None else {}),
            **strides("b", sb, SCORES), **strides("r", sr, SCORES),
            **strides("cq", scq), **strides("ck", sck, KEY_ROWS)}


def _sizes(call) -> dict:
    """The sizes every general kernel takes (head counts and dims: ints; lengths: SymInts
    under dynamic shapes; the sliding window or the chunk, 0 without; the documents table's batch
    stride, 0 without or when one row serves every batch)."""
    _, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    return {"Hq": Hq, "kv_group": Hq // Hkv, "Lq": Lq, "Lk": Lk, "window": call.chunk or call.window,
            "stride_docb": call.doc_stride, "D": D, "Dv": Dv}


def _address_reads(call, keys: dict) -> tuple:
    """The tables whose values bound the kernels' loops (launch.py ``address_reads``): the
    documents table, a padding mask's key range (``keys``: ``_key_range``'s arguments)."""
    return (("Docs",) if call.documents is not None else ()) + (
        ("KeyRange",) if keys["KEY_RANGE"] else ())


def _key_range(call, block_n: int) -> dict:
    """A per-key padding mask's live key range (kernels/key_range.py): KeyRange, its strides and
    KEY_RANGE (off: a dummy, never read)."""
    return key_range.args(call, block_n)


def _scores(call) -> dict:
    """The scores' scale and softcap (call.py: ``_softcap_args``)."""
    return {"score_scale": call.score_scale, "cap": call.cap}


def _dropout(call) -> dict:
    """The dropout draw's seed tensor, threshold and 1 / keep rate (call.py: ``dropout_args``)."""
    return {"Seed": call.seed, "drop_thresh": call.drop_thresh, "inv_keep": call.inv_keep}


def _rope_variant(call) -> Optional[str]:
    return "rope" if call.rc["ROT"] else None


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def run_forward(call, cfg: AttentionConfig, out_buf: torch.Tensor, lse: torch.Tensor):
    """The general forward (attention_fwd_kernel) into ``out_buf`` (B, Lq, Hq, Dv) and ``lse``."""
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    out = out_buf.transpose(1, 2)

    def run(cfg):
        (d0, d1, d2), (dv0, dv1), tiles = _geometry(call, cfg)
        bm, bn = cfg.block_m, cfg.block_n
        check_tile_offsets(tiles + [("out", *out.stride()[2:], bm, dv0 + dv1)])
        keys = _key_range(call, bn)
        launch(
            attention_fwd_kernel, (cdiv(Lq, bm) * B * Hq,),
            **_inputs(call), Out=out_buf, Lse=lse, Sinks=call.sink_t,
            **_input_strides(call), **strides("o", out), **strides("l", lse, ROW_STATS),
            **_sizes(call), **_scores(call), **_dropout(call),
            SCALE_POS=bool(call.scale >= 0), DROPOUT=call.dropout, SOFTCAP=call.softcapped,
            **_common(call),
            BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=dv0, DV1=dv1, D2=d2, **call.rc,
            SINKS=call.sinks is not None, **keys,
            writes=("Out", "Lse"), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            address_reads=_address_reads(call, keys),
        )

    with_retry(run, cfg, call.config is not None, _rope_variant(call))
    return out_buf.transpose(1, 2), lse  # (traced: the view of the buffer as written)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


class _Grads:
    """The backward's output buffers: dq/dk/dv laid out as the op's inputs (host.layout_like,
    as the op's fake says) and the fp32 dbias when asked for: (B, Hq, Lq, Lk), or
    ``dbias_shape``."""

    def __init__(self, call, dbias_shape=None):
        B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
        q_in, k_in, v_in = call.inputs
        dev = call.q.device
        self.dq = host.empty((B, Hq, Lq, D), call.q.dtype, dev, q_in)
        self.dk = host.empty((B, Hkv, Lk, D), call.k.dtype, dev, k_in)
        self.dv = host.empty((B, Hkv, Lk, Dv), call.v.dtype, dev, v_in)
        shape = (B, Hq, Lq, Lk) if dbias_shape is None else dbias_shape
        self.dbias = host.empty(shape, torch.float32, dev) if call.need_dbias else None

    def ds_args(self, dummy):
        """(DS tensor, its strides): dbias, or ``dummy`` (call.dummy) and zero strides (never
        written)."""
        if self.dbias is None:
            return dummy, (0, 0, 0, 0)
        return self.dbias, self.dbias.stride()


class _RowStats:
    """The preprocess kernel's outputs (Delta, RowM, RowR and the zeroed fp32 dQ accumulator of
    the atomic path), launched once by the paths that read them."""

    def __init__(self, call, atomic: bool):
        self.call, self.atomic, self.done = call, atomic, None

    def get(self):
        if self.done is not None:
            return self.done
        call = self.call
        out, dout, lse = call.out, call.dout, call.lse
        B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
        dev = call.q.device
        delta = host.empty((B, Hq, Lq), torch.float32, dev)
        row_m = host.empty((B, Hq, Lq), torch.float32, dev)
        row_r = host.empty((B, Hq, Lq), torch.float32, dev) if call.kind == FLOAT_BIAS else row_m
        dqa = host.empty((B, Hq, Lq, D), torch.float32, dev) if self.atomic else delta
        one = qk_parts(D, False, call.rc)
        pre_m = 64
        launch(
            attention_bwd_preprocess_kernel, (cdiv(Lq, pre_m) * B * Hq,),
            Out=out, DO=dout, Lse=lse, Delta=delta, RowM=row_m, RowR=row_r, DQA=dqa,
            **_inputs(call, with_v=False),
            **strides("o", out), **strides("do", dout), **strides("l", lse, ROW_STATS),
            **_input_strides(call, with_v=False),
            **_sizes(call), **_scores(call),
            ZERO_DQ=self.atomic, SOFTCAP=call.softcapped, **_common(call),
            BLOCK_M=pre_m, BLOCK_N=32, BLOCK_D=block_d(D), BLOCK_DV=block_d(Dv),
            D0=one[0], D1=one[1], D2=one[2], **call.rc,
            num_warps=4, num_stages=1,
            writes=("Delta", "RowM") + (("RowR",) if call.kind == FLOAT_BIAS else ())
            + (("DQA",) if self.atomic else ()),
        )
        self.done = (delta, row_m, row_r, dqa)
        call.delta = delta  # (the sinks' gradient reads it: kernels/attention.py)
        return self.done


def run_backward_atomic(call, cfg: AttentionConfig, tma_launch=None):
    """The atomic backward: one program per key block (dK/dV in registers, dQ added atomically to
    an fp32 buffer, then scaled and cast), in ONE launch where every key fits one block
    (``ONE_KEY_BLOCK``: the kernel takes the row statistics from out/lse and stores dQ itself).
    ``tma_launch(call, cfg, stats, dk_out, dv_out, dk_strides, dv_strides, split, split_strides)``
    replaces the general kernel's launch (the TMA family, attention_hopper.py). Returns
    (dq, dk, dv, dbias)."""
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    dev = call.q.device
    g = _Grads(call)
    stats = _RowStats(call, atomic=True)
    one_block = False  # the last run took the one-launch form (ONE_KEY_BLOCK)

    def run(cfg):
        nonlocal one_block
        split = call.group_split or group_split(hint(B * Hkv * cdiv(Lk, cfg.block_n)), Hq // Hkv, dev)
        if Hq // Hkv % split:
            raise ValueError(f"group_split={split} does not divide the GQA group of {Hq // Hkv}")
        if split > 1:  # fp32 partials, summed below (sum_partials)
            dk_out = host.empty((split, B, Hkv, Lk, D), torch.float32, dev)
            dv_out = host.empty((split, B, Hkv, Lk, Dv), torch.float32, dev)
            dk_strides, dv_strides = dk_out.stride()[1:], dv_out.stride()[1:]
            split_strides = (dk_out.stride(0), dv_out.stride(0))
        else:
            dk_out, dv_out = g.dk, g.dv
            dk_strides, dv_strides, split_strides = g.dk.stride(), g.dv.stride(), (0, 0)
        if tma_launch is not None:
            tma_launch(call, cfg, stats, dk_out, dv_out, dk_strides, dv_strides, split, split_strides)
        else:
            one_block = _launch_atomic(call, cfg, g, stats, dk_out, dv_out, dk_strides, dv_strides,
                                       split, split_strides)
        if split > 1:
            g.dk, g.dv = sum_partials(dk_out, g.dk), sum_partials(dv_out, g.dv)

    with_retry(run, cfg, call.config is not None, _rope_variant(call))
    if one_block:
        return g.dq, g.dk, g.dv, g.dbias
    return _cast_dq(call, g, stats.get()[3]), g.dk, g.dv, g.dbias


def _launch_atomic(call, cfg, g, stats, dk_out, dv_out, dk_strides, dv_strides, split, split_strides):
    """attention_bwd_kernel; returns whether it ran in its one-launch form."""
    q, dout, out, lse = call.q, call.dout, call.out, call.lse
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    # All keys in one block: each program owns its query heads' dQ rows (a correctness
    # condition: with dynamic shapes, a guard on Lk).
    one_block = bool(cdiv(Lk, cfg.block_n) == 1)
    if one_block:
        delta = row_m = row_r = dqa = lse  # unused
        dq_out = g.dq
    else:
        delta, row_m, row_r, dqa = stats.get()
        dq_out = dqa  # unused (a graph keeps no unwritten dq buffer)
    (d0, d1, d2), (dv0, dv1), tiles = _geometry(call, cfg)
    bm, bn = cfg.block_m, cfg.block_n
    check_tile_offsets(tiles + [("dout", *dout.stride()[2:], bm, dv0 + dv1), ("dbias", Lk, 1, bm, bn),
                                ("out", *out.stride()[2:], bm, dv0 + dv1),
                                ("dq", *g.dq.stride()[2:], bm, max(d0 + d1 + d2, D))])
    ds_t, ds_strides = g.ds_args(call.dummy)
    keys = _key_range(call, bn)  # (never with one key block: it needs two)
    launch(
        attention_bwd_kernel, (cdiv(Lk, bn) * B * Hkv * split,),
        **_inputs(call), DO=dout, DQA=dqa, DK=dk_out, DV=dv_out, DS=ds_t, Delta=delta, RowM=row_m,
        RowR=row_r, Out=out, Lse=lse, DQ=dq_out,
        **_input_strides(call), **strides("do", dout), **strides("dk", dk_strides, KEY_ROWS),
        **strides("dv", dv_strides, KEY_ROWS), **strides("ds", ds_strides, SCORES),
        **strides("o", out), **strides("l", lse, ROW_STATS), **strides("dq", dq_out),
        **_sizes(call), Hkv=Hkv, **_scores(call), sm_scale=call.scale, **_dropout(call),
        group_split=split, split_stride_dk=split_strides[0], split_stride_dv=split_strides[1],
        ONE_KEY_BLOCK=one_block, NEED_DS=call.need_dbias, DROPOUT=call.dropout,
        SOFTCAP=call.softcapped, **_common(call),
        BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=dv0, DV1=dv1, D2=d2, **call.rc, **keys,
        writes=("DQ" if one_block else "DQA", "DK", "DV") + (("DS",) if call.need_dbias else ()),
        address_reads=_address_reads(call, keys),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return one_block


def _cast_dq(call, g, dqa):
    """dQ from the fp32 accumulator: scaled, cast (and, with rope, rotated back)."""
    q = call.q
    B, Hq, Lq, D = q.shape
    if call.rc["ROT"]:
        one = qk_parts(D, False, call.rc)
        cast_m = 32
        launch(attention_dq_rope_cast_kernel, (cdiv(Lq, cast_m) * B * Hq,),
               DQA=dqa, DQ=g.dq, Cos=call.cos, Sin=call.sin,
               **strides("dq", g.dq), **strides("cq", call.scq),
               Hq=Hq, Lq=Lq, sm_scale=call.scale,
               D=D, D0=one[0], D2=one[2], BLOCK_M=cast_m, **call.rc, num_warps=4, writes=("DQ",))
        return g.dq
    if is_tracing():
        # What attention_dq_cast_kernel computes, as torch ops, laid out as the fake says:
        # Inductor fuses the scale, the cast and the layout into one pointwise kernel.
        return in_layout_of((dqa * call.scale).to(q.dtype), call.inputs[0])
    n = g.dq.numel()
    launch(attention_dq_cast_kernel, (cdiv(n, 1024),), DQA=dqa, DQ=g.dq, numel=n,
           **strides("dq", g.dq), Hq=Hq, Lq=Lq, D=D, sm_scale=call.scale,
           BLOCK=1024, num_warps=4, writes=("DQ",))
    return g.dq


def run_backward_pair(call, cfg: AttentionConfig):
    """The atomic-free pair: dK/dV by attention_bwd_dkdv_kernel (one program per key block),
    then dQ (and dbias) by attention_bwd_dq_kernel (one per query block), both after the
    preprocess. Returns (dq, dk, dv, dbias)."""
    q, k, v, dout, out = call.q, call.k, call.v, call.dout, call.out
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    g = _Grads(call)
    delta, row_m, row_r, _ = _RowStats(call, atomic=False).get()
    one = qk_parts(D, False, call.rc)
    bm, bn, bdv = cfg.block_m, cfg.block_n, block_d(Dv)
    dcols = max(sum(one), D)
    # out/dout/dq are read with BLOCK_M rows, dk/dv with BLOCK_N rows (dbias is contiguous).
    check_tile_offsets([("q", *q.stride()[2:], bm, dcols), ("k", *k.stride()[2:], bn, dcols),
                        ("v", *v.stride()[2:], bn, bdv), ("out", *out.stride()[2:], bm, bdv),
                        ("bias", *call.sb[2:], bm, bn), ("replace", *call.sr[2:], bm, bn),
                        ("dbias", Lk, 1, bm, bn)]
                       + _table_tiles(call, bm, bn))
    stats = dict(Delta=delta, RowM=row_m, RowR=row_r, **_key_range(call, bn))
    scalars = dict(_sizes(call), **_scores(call), sm_scale=call.scale, **_dropout(call))
    consts = dict(_common(call), DROPOUT=call.dropout, SOFTCAP=call.softcapped, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_DV=bdv, D0=one[0], D1=one[1], D2=one[2], **call.rc,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch(
        attention_bwd_dkdv_kernel, (cdiv(Lk, bn) * B * Hkv,),
        **_inputs(call), DO=dout, DK=g.dk, DV=g.dv, **stats,
        **_input_strides(call), **strides("do", dout), **strides("dk", g.dk, KEY_ROWS),
        **strides("dv", g.dv, KEY_ROWS),
        **scalars, Hkv=Hkv,
        **consts, writes=("DK", "DV"),
        address_reads=_address_reads(call, stats),
    )
    ds_t, ds_strides = g.ds_args(call.dummy)
    launch(
        attention_bwd_dq_kernel, (cdiv(Lq, bm) * B * Hq,),
        **_inputs(call), DO=dout, DQ=g.dq, DS=ds_t, **stats,
        **_input_strides(call), **strides("do", dout), **strides("dq", g.dq),
        **strides("ds", ds_strides, SCORES),
        **scalars,
        NEED_DS=call.need_dbias, **consts, writes=("DQ",) + (("DS",) if call.need_dbias else ()),
        address_reads=_address_reads(call, stats),
    )
    return g.dq, g.dk, g.dv, g.dbias


def row_stats(call):
    """(delta, row_m): the preprocess's row statistics for a backward that reads them but keeps
    no fp32 dQ buffer (the TMA pair)."""
    delta, row_m, _, _ = _RowStats(call, atomic=False).get()
    return delta, row_m


def new_grads(call, dbias_shape=None) -> _Grads:
    return _Grads(call, dbias_shape)
