"""Launches of the Hopper kernel families: ``tma`` (attention_fwd_tma.py, attention_bwd_tma.py:
tiles moved by TMA through host-side descriptors, dQ added by one TMA bulk reduction per query
block), ``tma_pair`` (the atomic-free backward pair with TMA tiles) and ``gluon`` (the
warp-specialised kernels of attention_fwd_gluon.py / attention_bwd_gluon.py).

They cover the plain problem only: no bias, dropout, softcap, replace mask or rope; fp16/bf16;
D = Dv in {64, 128} ({64, 128, 256} for the pair); 16-byte aligned layouts; compute capability
9.0 or newer (Gluon: sm_90 with the Triton it is written for). The tuning table picks them per
key (tuning.py); ``why_not_*`` say why one cannot run a call, the registry (registry.py) falls
back as the table's entry says.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
import triton
from triton.runtime.errors import OutOfResources

from . import attention_bwd_gluon as gluon_bwd
from . import attention_fwd_gluon as gluon_fwd
from . import host
from .attention_bwd_tma import (attention_bwd_dkdv_tma_kernel, attention_bwd_dq_tma_kernel,
                                attention_bwd_tma_kernel)
from .attention_config import AttentionConfig, gluon_bwd_variant, gluon_variant
from .attention_fwd_tma import attention_fwd_tma_kernel
from .attention_general import (group_split, new_grads, row_stats, run_backward_atomic,
                                sum_partials, with_retry)
from .args import strides
from .host import NO_BIAS, cdiv, dot_precision, in_layout_of, interpreted, upcast_dot
from .launch import (Desc, Untraceable, aligned16, descriptors_traceable, hint, is_tracing,
                     launch, python_ops_allowed, symbolic, tma_strides_ok)

TMA_DTYPES = (torch.float16, torch.bfloat16)
TMA_HEAD_DIMS = (64, 128)
TMA_PAIR_HEAD_DIMS = (64, 128, 256)

# The TMA forward's tuned D 128 tiles (H100, stop 9): where a Gluon table entry cannot run.
TMA_FORWARD_FALLBACK = AttentionConfig(128, 64, 4, 2, False, "tma")
# The tiles of a family forced by name (registry.forced) where the table picks another one: the
# H100 table's most frequent entries of each (attention_configs_sm90.json).
TMA_BACKWARD_DEFAULT = AttentionConfig(64, 128, 8, 2, False, "tma")
TMA_PAIR_DEFAULT = AttentionConfig(64, 64, 8, 2, False, "tma_pair", (128, 32, 8, 3))
GLUON_FORWARD_DEFAULT = AttentionConfig(128, 128, 4, 2, False, "gluon")
GLUON_BACKWARD_DEFAULT = AttentionConfig(64, 128, 8, 2, False, "gluon_lpt")

# Inductor finds a user kernel's writes in its Triton IR, whose write ops do not include the TMA
# reduction that adds the atomic TMA backward's dQ (torch 2.13): traced, that kernel would look
# as if it wrote no dQ (launch.py, ``writes``).
TMA_REDUCE_UNTRACEABLE = "Inductor cannot see its dQ TMA reduction as a write"

# Host time per call, traced (compiled, kernels/launch.py), H100 host (benchmarks/RESULTS.md,
# stop 13): a Gluon kernel launches from an opaque op (ops/gluon.py), 0.1-0.3 ms; a TMA kernel
# is an Inductor launch that first builds its host-side descriptors (``TensorDescriptor.
# from_tensor`` in Python, then encoded by the launcher), ~57 us per forward against ~20 for the
# general kernel's launch. Below this many forward FLOPs (~0.1 ms of forward, ~0.3 ms of
# backward at 300 TFLOP/s) the op's own device time cannot hide that, and a Gluon or TMA table
# entry yields to the general Triton kernels, unless the graph runs under CUDA graphs
# (mode="reduce-overhead"), whose replays cost no host time per kernel.
HOST_HEAVY_TRACED_MIN_FLOPS = 3.6e10

# Gluon configs that failed to launch (OutOfResources): not tried again.
_FAILED_GLUON: set = set()


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# Why a Hopper family cannot run a call
# --------------------------------------------------------------------------------------------


def why_not_host_heavy_traced(call, what: str) -> Optional[str]:
    """Why a traced launch takes no kernel with a costly launch path here (None: it may), see
    ``HOST_HEAVY_TRACED_MIN_FLOPS``; ``what`` names the cost."""
    if not is_tracing():
        return None
    from torch._inductor import config

    B, Hq, Lq, D, _, Lk, _ = call.sizes
    flops = 4 * B * Hq * Lq * Lk * D  # (a family boundary: a guard if dynamic)
    factor = 0.5 if call.is_causal else 1.0
    if flops * factor < HOST_HEAVY_TRACED_MIN_FLOPS and not config.triton.cudagraphs:
        return (f"compiled, {hint(flops) * factor:.2g} FLOPs are too few to cover the host time "
                f"of {what} (< {HOST_HEAVY_TRACED_MIN_FLOPS:.2g})")
    return None


def why_not_tma(call, head_dims=TMA_HEAD_DIMS) -> Optional[str]:
    """None when the TMA kernels cover this call, else why not (``out``: the forward's output or
    the backward's dout, the other tensor they read by TMA). Traced, also the host cost."""
    q, k, v = call.q, call.k, call.v
    D, Dv = call.sizes[3], call.sizes[6]
    if call.kind != NO_BIAS or call.dropout or call.rc["ROT"] or call.softcapped or call.has_rep:
        return "it takes no bias, dropout, softcap, replace mask or rope"
    if D != Dv or D not in head_dims:
        return f"it needs D == Dv in {head_dims}, got D={D}, Dv={Dv}"
    if q.dtype not in TMA_DTYPES or not (call.scale > 0):
        return f"it needs fp16/bf16 and a positive scale, got {q.dtype}, scale={call.scale}"
    if q.is_cuda and capability(q.device)[0] < 9:
        return "TMA needs compute capability 9.0 or newer"
    if is_tracing() and not descriptors_traceable():
        return "this torch takes no host-side TMA descriptors into compiled graphs"
    why_not = why_not_host_heavy_traced(call, "its descriptors")
    if why_not is not None:
        return why_not
    other = call.out if call.direction == "fwd" else call.dout
    tensors = (("q", q), ("k", k), ("v", v)) + ((("dout", other),) if other is not None else ())
    if is_tracing() and symbolic(*(t for _, t in tensors)):
        # Large problems, where an opaque op's host time is small against its device time.
        raise Untraceable("dynamic shapes: the TMA and Gluon kernels launch with static shapes")
    for name, t in tensors:
        # TMA: 16-byte aligned base and non-zero strides (the head-dim stride is 1, see
        # call.unit_last_stride; launch.tma_strides_ok says which strides of size-1 dims count).
        if not (aligned16(t) and tma_strides_ok(t)):
            return f"{name}'s address or strides {t.stride()} are not 16-byte multiples"
    return None


def why_not_gluon_traced(call) -> Optional[str]:
    """Why a traced launch takes no Gluon kernel here (None: it may), see above."""
    if is_tracing() and not python_ops_allowed():
        return ("AOTInductor / cpp_wrapper packages take Triton kernels only (the Gluon kernels "
                "launch from a Python op)")
    return why_not_host_heavy_traced(call, "its op")


def why_not_gluon_platform(call) -> Optional[str]:
    """None when the Gluon forward can run here: sm_90 with the Triton its Gluon code is written
    for (its problems are the TMA kernels': see ``why_not_tma``)."""
    q, k = call.q, call.k
    if not gluon_fwd.GLUON_AVAILABLE:  # (its why-not is None where a test switched Gluon off)
        return gluon_fwd._GLUON_WHY_NOT or "the Gluon kernels are switched off"
    if not q.is_cuda or capability(q.device) != (9, 0):
        return "it runs on sm_90 (Hopper) only"
    if max(q.shape[2], k.shape[2]) >= 2**31:
        return "TMA coordinates are 32-bit"
    return why_not_gluon_traced(call)


def why_not_gluon_bwd(call, cfg: AttentionConfig) -> Optional[str]:
    """None when the Gluon backward (attention_bwd_gluon.py) covers this call with ``cfg``'s
    variant, else why not. (Its own, thorough ``why_not_gluon_backward`` repeats these
    checks at ~0.1 ms of host time per call on the H100 host.)"""
    variant = gluon_bwd_variant(cfg)
    if variant not in gluon_bwd.VARIANTS:
        return f"it has no tiles {variant} (it has {sorted(gluon_bwd.VARIANTS)})"
    if call.need_dbias:
        return "it writes no dbias"
    why_not = why_not_tma(call)
    if why_not is not None:
        return why_not
    q, k = call.q, call.k
    if not gluon_bwd.GLUON_AVAILABLE or not triton.__version__.startswith(gluon_bwd._TESTED_TRITON):
        return f"the Gluon backward is written for Triton {'/'.join(gluon_bwd._TESTED_TRITON)}"
    if not q.is_cuda or capability(q.device) != (9, 0):
        return "it runs on sm_90 (Hopper) only"
    why_not = why_not_gluon_traced(call)
    if why_not is not None:
        return why_not
    if call.out.stride(-1) != 1 or max(q.shape[2], k.shape[2]) >= 2**31 or not math.isfinite(call.scale):
        return "out needs a unit last stride, lengths below 2**31 and a finite scale"
    return None


def gluon_failed(cfg: AttentionConfig) -> bool:
    return cfg in _FAILED_GLUON


# --------------------------------------------------------------------------------------------
# Launches
# --------------------------------------------------------------------------------------------


def _descriptor(t: torch.Tensor, block_rows: int) -> Desc:
    """Host-side TMA descriptor of a (B, H, L, D) tensor with [1, 1, block_rows, D] blocks (made
    by the launch interface: launch.descriptor, or Inductor when traced). The launches pass
    them positionally, as the kernels' leading parameters, in the kernels' order: an eager
    launch makes descriptors of its positional arguments only (launch.launch); every other
    argument goes by name."""
    return Desc(t, (1, 1, block_rows, t.shape[3]))


def _sizes(call) -> dict:
    """The sizes every TMA kernel takes (by the kernels' names)."""
    _, Hq, Lq, _, Hkv, Lk, _ = call.sizes
    return dict(Hq=Hq, kv_group=Hq // Hkv, Lq=Lq, Lk=Lk)


def _scales(call) -> dict:
    """The backward kernels' scales: the scores' (log2 units) and the softmax's."""
    return dict(score_scale=call.score_scale, sm_scale=call.scale)


def _consts(call, block_m: int, block_n: int) -> dict:
    """The constexprs every TMA kernel takes."""
    q = call.q
    return dict(D=call.sizes[3], IS_CAUSAL=call.is_causal, PRECISION=dot_precision(q),
                UPCAST_DOT=upcast_dot(q), BLOCK_M=block_m, BLOCK_N=block_n)


def run_forward_tma(call, cfg: AttentionConfig, out_layout):
    """The TMA forward into a contiguous (B, Hq, Lq, Dv) output, returned in the op's layout."""
    q, k, v = call.q, call.k, call.v
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    o = host.empty((B, Hq, Lq, Dv), q.dtype, q.device)
    lse = host.empty((B, Hq, Lq), torch.float32, q.device)

    def run(cfg):
        bm, bn = cfg.block_m, cfg.block_n
        launch(
            attention_fwd_tma_kernel, (cdiv(Lq, bm) * B * Hq,),
            # positional (see _descriptor): q_desc, k_desc, v_desc, o_desc
            _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(o, bm),
            Lse=lse, **strides("l", lse.stride()[:2], "bh"),
            **_sizes(call), qk_scale=call.scale * 1.4426950408889634,
            **_consts(call, bm, bn),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, writes=("o_desc", "Lse"))

    with_retry(run, cfg, call.config is not None, "tma")
    return out_layout(o), lse


def run_forward_gluon(call, cfg: AttentionConfig, out_layout):
    """The Gluon forward: traced, one opaque op (Inductor cannot compile Gluon); eager, launched.
    Returns None when its tiles do not fit this GPU (remembered; the caller chooses again)."""
    q, k, v = call.q, call.k, call.v
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    if is_tracing():
        o, lse = torch.ops.fuse_plugin.gluon_attention_forward(
            q, k, v, call.is_causal, float(call.scale), cfg.block_m, cfg.block_n, cfg.num_stages,
            cfg.kernel, window=call.window)
        return out_layout(o), lse
    # written by its TMA stores straight into the op's layout (B, Lq, Hq, Dv): no copy after it
    o = host.empty((B, Lq, Hq, Dv), q.dtype, q.device).transpose(1, 2)
    lse = host.empty((B, Hq, Lq), torch.float32, q.device)
    try:
        gluon_fwd.launch_forward_gluon(q, k, v, o, lse, call.is_causal, call.scale, gluon_variant(cfg),
                                       call.window)
    except OutOfResources as e:
        if call.config is not None:
            raise
        # Its tiles are fixed by its partitions: no smaller retry, another family instead.
        warnings.warn(f"fuse_plugin attention: config {cfg} does not fit this GPU ({e}); "
                      f"choosing another kernel family", RuntimeWarning, stacklevel=3)
        _FAILED_GLUON.add(cfg)
        return None
    return out_layout(o), lse


def run_backward_gluon(call, cfg: AttentionConfig):
    """The Gluon backward (it reads out and dout by their strides, copying a dout that TMA cannot
    read; its gradients come laid out as q, k, v)."""
    q, k, v = call.q, call.k, call.v
    variant = gluon_bwd_variant(cfg)
    if is_tracing():  # as in the forward: one opaque op
        grads = torch.ops.fuse_plugin.gluon_attention_backward(
            call.dout, q, k, v, call.out, call.lse, call.is_causal, float(call.scale), variant,
            call.group_split or 0, window=call.window)
    else:
        grads = gluon_bwd.attention_backward_gluon(
            call.dout, q, k, v, call.out, call.lse, is_causal=call.is_causal, scale=call.scale,
            variant=variant, group_split=call.group_split, window=call.window)
    return (*(in_layout_of(g, x) for g, x in zip(grads, call.inputs)), None)


def run_backward_tma(call, cfg: AttentionConfig):
    """The atomic TMA backward: attention_bwd_tma_kernel in place of the general atomic kernel
    (same buffers, GQA split and dQ cast: attention_general.run_backward_atomic)."""

    def tma_launch(call, cfg, stats, dk_out, dv_out, dk_strides, dv_strides, split, split_strides):
        q, k, v, dout = call.q, call.k, call.v, call.dout
        B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
        bm, bn = cfg.block_m, cfg.block_n
        delta, row_m, _, dqa = stats.get()
        launch(
            attention_bwd_tma_kernel, (cdiv(Lk, bn) * B * Hkv * split,),
            # positional (see _descriptor): q_desc, k_desc, v_desc, do_desc, dq_desc
            _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(dout, bm),
            _descriptor(dqa, bm),
            DQA=dqa, DK=dk_out, DV=dv_out, Delta=delta, RowM=row_m,
            **strides("dk", dk_strides[:3], "bhn"), **strides("dv", dv_strides[:3], "bhn"),
            **_sizes(call), Hkv=Hkv, **_scales(call),
            group_split=split, split_stride_dk=split_strides[0], split_stride_dv=split_strides[1],
            TMA_REDUCE=not interpreted(q), **_consts(call, bm, bn),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            writes=("dq_desc", "DQA", "DK", "DV"))

    return run_backward_atomic(call, cfg, tma_launch=tma_launch)


def run_backward_tma_pair(call, cfg: AttentionConfig):
    """The atomic-free TMA pair (attention_bwd_tma.py): dK/dV by attention_bwd_dkdv_tma_kernel
    (GQA groups shared out over ``group_split`` programs as in the atomic path, the fp32
    partials summed in a fixed order), then dQ by attention_bwd_dq_tma_kernel with
    ``cfg.dq_tile``. Returns (dq, dk, dv, None)."""
    q, k, v, dout = call.q, call.k, call.v, call.dout
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    g = new_grads(call)
    delta, row_m = row_stats(call)

    def run(cfg):
        bm, bn = cfg.block_m, cfg.block_n
        split = call.group_split or group_split(hint(B * Hkv * cdiv(Lk, bn)), Hq // Hkv, q.device)
        if Hq // Hkv % split:
            raise ValueError(f"group_split={split} does not divide the GQA group of {Hq // Hkv}")
        if split > 1:  # fp32 partials, split-major: (split * B, Hkv, Lk, D)
            dk_out = host.empty((split * B, Hkv, Lk, D), torch.float32, q.device)
            dv_out = host.empty((split * B, Hkv, Lk, D), torch.float32, q.device)
        else:
            dk_out, dv_out = g.dk, g.dv
        launch(
            attention_bwd_dkdv_tma_kernel, (cdiv(Lk, bn) * B * Hkv * split,),
            # positional (see _descriptor): q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc
            _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(dout, bm),
            _descriptor(dk_out, bn), _descriptor(dv_out, bn),
            Delta=delta, RowM=row_m,
            B=B, Hkv=Hkv, **_sizes(call), **_scales(call), group_split=split,
            **_consts(call, bm, bn),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, writes=("dk_desc", "dv_desc"))
        if split > 1:
            g.dk = sum_partials(dk_out.view(split, B, Hkv, Lk, D), g.dk)
            g.dv = sum_partials(dv_out.view(split, B, Hkv, Lk, D), g.dv)
        qm, qn, qw, qs = cfg.dq_tile or cfg[:4]
        launch(
            attention_bwd_dq_tma_kernel, (cdiv(Lq, qm) * B * Hq,),
            # positional (see _descriptor): q_desc, k_desc, v_desc, do_desc, dq_desc
            _descriptor(q, qm), _descriptor(k, qn), _descriptor(v, qn), _descriptor(dout, qm),
            _descriptor(g.dq, qm),
            Delta=delta, RowM=row_m,
            **_sizes(call), **_scales(call),
            **_consts(call, qm, qn),
            num_warps=qw, num_stages=qs, writes=("dq_desc",))

    with_retry(run, cfg, call.config is not None, "tma_pair")
    return g.dq, g.dk, g.dv, None
