"""Flash-attention forward and backward kernels (Triton, FA2-style): the launchers.

The kernels live in attention_fwd.py (forward) and attention_bwd.py (backward: preprocess, atomic
path, deterministic path), their shared device helpers in attention_tiles.py, the TMA, Gluon and
decode families in attention_*_tma.py, attention_*_gluon.py and attention_decode.py, their tiles
(``AttentionConfig``, the table lookup and heuristics) in attention_config.py; this module holds
what the ops call (``attention_forward``, ``attention_backward``): the checks, which family runs a
call, and the launches. Everything below describes the kernels as a whole.

Shapes and layouts
------------------
* ``q``: (B, Hq, Lq, D), ``k``: (B, Hkv, Lk, D), ``v``: (B, Hkv, Lk, Dv), with ``Hq % Hkv == 0``.
  GQA/MQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``; K/V are never repeated.
  Any strides are accepted (e.g. ``x.view(B, L, H, D).transpose(1, 2)``); a tensor is copied
  only when its last-dim stride is not 1.
* ``bias``: None, or a (B, Hq, Lq, Lk) tensor (usually an ``.expand`` view with 0 strides, which
  are read as they are). A bool bias keeps True and masks False; a float bias is added in fp32
  after scaling: ``s = (q @ k^T) * scale + bias``.
* ``is_causal``: top-left aligned (as SDPA): key j is visible to query i iff ``j <= i``.
* Outputs: ``out`` (B, Hq, Lq, Dv) in q's dtype, laid out (B, Lq, Hq, Dv) in memory (a
  transposed view, see ``out_layout``), ``lse`` (B, Hq, Lq) fp32 contiguous (natural-log
  logsumexp of the scaled, biased, masked scores of each row). ``dout`` is read through its
  strides (unit last stride).
* Backward: ``dq``/``dk``/``dv`` shaped/typed as q/k/v, dense, their dims in q/k/v's memory
  order where those have a unit last stride, else contiguous (``host.layout_like``, as the op's
  fake and as cuDNN's gradients: the head merge of a gradient is then a view); optional
  ``dbias`` is the fp32 (B, Hq, Lq, Lk) gradient dS of the scores (the caller reduces it to the
  bias's shape).
* cuDNN: plain problems where cuDNN's fused attention was measured faster than these kernels
  (no bias, dropout, softcap, replace or rope; fp16/bf16, D <= 128, sm 90; forward from 512
  tokens, backward from 160, fed our out and lse) run it instead (attention_cudnn.py), unless
  a config is given.
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
* Hopper TMA kernels (attention_fwd_tma.py, attention_bwd_tma.py) for the plain case (no bias,
  dropout or rope; fp16/bf16; D = Dv in {64, 128}; 16-byte aligned layouts): tiles moved by TMA
  through host-side tensor descriptors, and in the backward each query block's dQ share added by
  one TMA bulk reduction. A table entry ending in ``"tma"`` (``AttentionConfig.kernel``) picks
  them per key; on the H100 they win the D 128 forward and the D 64 backward.
* Warp-specialised Gluon kernels (attention_fwd_gluon.py, attention_bwd_gluon.py; sm_90 with
  Triton 3.6, the TMA kernels' problems): a TMA producer warp and two wgmma consumer warpgroups,
  the softmax of one tile overlapping the matmuls of the next (FA3's design, written by hand:
  Triton 3.6's automatic warp specialisation crashes on these kernels). Table entries ending in
  ``"gluon"`` / ``"gluon_pingpong"`` / ``"gluon_lpt"`` pick them; on the H100 they win the D 128
  forward and the D 64/128 backward (0.87-1.07x cuDNN at D 128, N >= 4k; RESULTS.md, stop 10).
* A table entry ending in ``"two_kernel"`` runs the atomic-free backward pair outside
  deterministic mode too: it beats the atomic kernel at D 256, where the atomic kernel's fp32
  dQ additions (BLOCK_M x 256 per key block) and its registers dominate. Its TMA form
  (``"tma_pair"``, attention_bwd_tma.py: tiles by TMA, each kernel its own tiles, query blocks
  streamed in order so that L2 serves them) is what the H100 table picks for the plain D 256
  backward (1.1-1.2x FA2 at N = 4k; RESULTS.md, stop 11).
* Decode (``_forward_family``: Lq <= 16 against Lk >= 256, no rope / dropout / softcap /
  replace mask / user config): the flash-decoding kernels of attention_decode.py (keys split across programs, one
  GQA group's rows per tile, key blocks the mask removes never read), same outputs and
  numerics; the backward is the general one either way.
* Launch parameters come from a per-GPU table shipped with the package (``tuning.py``,
  regenerated by ``python -m fuse_plugin.tune``); a lookup miss uses ``_forward_config`` /
  ``_backward_config``. Nothing is autotuned at a user's call.

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

import functools
import math
import warnings
from typing import NamedTuple, Optional

import torch
import triton
from triton.runtime.errors import OutOfResources

from . import attention_cudnn
from . import attention_bwd_gluon as gluon_bwd
from . import attention_fwd_gluon as gluon_fwd
from .launch import (Desc, Untraceable, aligned16, descriptors_traceable, hint, is_tracing,
                     launch, python_ops_allowed, symbolic, tma_strides_ok)
from .attention_bwd import (
    attention_bwd_preprocess_kernel,
    attention_bwd_kernel,
    attention_dq_cast_kernel,
    attention_dq_rope_cast_kernel,
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
)
from .attention_bwd_tma import (
    attention_bwd_dkdv_tma_kernel,
    attention_bwd_dq_tma_kernel,
    attention_bwd_tma_kernel,
)
from .attention_decode import attention_decode_forward
from .attention_fwd import attention_fwd_kernel
from .attention_fwd_tma import attention_fwd_tma_kernel
from . import host
from .host import in_layout_of, inverse_order, layout_like, layout_order
from .attention_config import (  # noqa: F401  (some only re-exported: tune.py, tests)
    _GLUON_BWD_KERNELS,
    _GLUON_KERNELS,
    _KERNELS_OF,
    _PAIR_KERNELS,
    _SAFE_CONFIG,
    KERNEL_VARIANTS,
    AttentionConfig,
    _backward_config,
    _block_d,
    _d_parts,
    _deterministic_backward_config,
    _fit_smem,
    _forward_config,
    _gluon_bwd_variant,
    _gluon_variant,
    _pick_config,
    _smem_estimate,
    _smem_limit,
    _tma_pair_fallback,
)
from .host import FLOAT_BIAS as _FLOAT_BIAS
from .host import NO_BIAS as _NO_BIAS
from .host import bias_args as _bias_args
from .host import bias_over_keys as _bias_over_keys
from .host import cdiv as _cdiv
from .host import dropout_scale, dropout_threshold

__all__ = ["AttentionConfig", "Rope", "attention_forward", "attention_backward"]

# --------------------------------------------------------------------------------------------
# Outputs and the launch retry
# --------------------------------------------------------------------------------------------


def _empty(shape, dtype, device, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Allocation of every kernel output (one hook, so tests can poison it with NaN); with
    ``like`` (an input of the op), laid out as ``host.layout_like(like, dtype)``: the gradients."""
    if like is not None:
        return layout_like(like, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


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


_FAILED_CONFIGS: dict = {}


def _launch(run, cfg: AttentionConfig, user_given: bool, variant: Optional[str] = None):
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
    tries.append(_SAFE_CONFIG)
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


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


_SM_COUNT: dict = {}


def _group_split(programs: int, kv_group: int, device: torch.device) -> int:
    """How many programs share one GQA group in the atomic backward (1 on the CPU / without GQA).

    Measured on the H100 (bf16, causal; benchmarks/NOTES.md): splitting by 2 and 4 gained
    10-40% at every shape tried, also with 512 programs (causal key blocks are unequal work, and
    more, smaller programs even out the tail), and 8 added little over 4. So: up to 4, while the
    grid stays under 32 programs per SM."""
    if kv_group == 1 or device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNT.get(index)
    if sms is None:
        sms = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    split = 1
    while split < 4 and kv_group % (2 * split) == 0 and programs * 2 * split <= 32 * sms:
        split *= 2
    return split


def _dot_precision(t: torch.Tensor) -> str:
    # fp32 inputs follow the eager matmul setting; the interpreter only knows "ieee".
    if t.dtype == torch.float32 and t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _interpreted(t: torch.Tensor) -> bool:
    """CPU tensors run in Triton's interpreter (see ops/_dispatch.py)."""
    return not t.is_cuda


def _upcast_dot(t: torch.Tensor) -> bool:
    # The interpreter's tl.dot mishandles bf16 (see _dot).
    return t.dtype == torch.bfloat16 and _interpreted(t)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dims(q, k, v) -> tuple:
    """(B, Hq, Lq, D, Hkv, Lk, Dv). Under dynamic shapes the batch and the lengths may stay
    SymInts (launch.hint); the head counts and head dims become ints (a guard each: they are a
    model's constants, and the kernels take them as compile-time constants or decide by them)."""
    B, Hq, Lq, D = q.shape
    return B, int(Hq), Lq, int(D), int(k.shape[1]), k.shape[2], int(v.shape[3])


def _check_inputs(q, k, v, bias) -> None:
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
    if bias is not None and tuple(bias.shape) != (B, Hq, Lq, Lk):
        raise ValueError(f"bias must be broadcast to {(B, Hq, Lq, Lk)}, got {tuple(bias.shape)}")


def _check_config(cfg: AttentionConfig, kernel: str) -> None:
    for blk in (cfg.block_m, cfg.block_n) + tuple(cfg.dq_tile or ())[:2]:
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"block sizes must be powers of 2 >= 16 (tl.dot, tl.arange): {cfg}")
    if cfg.dq_tile is not None and (cfg.kernel != "tma_pair" or len(cfg.dq_tile) != 4):
        raise ValueError(f"config {cfg}: dq_tile is (block_m, block_n, num_warps, num_stages) "
                         "of the 'tma_pair' kernel's dQ kernel")
    if cfg.kernel not in KERNEL_VARIANTS:
        raise ValueError(f"config kernel must be one of {KERNEL_VARIANTS}, got {cfg.kernel!r}")
    if cfg.kernel not in _KERNELS_OF[kernel]:
        raise ValueError(f"config {cfg}: {cfg.kernel!r} is not a {kernel} kernel; the "
                         f"{kernel} runs one of {_KERNELS_OF[kernel]}")
    if kernel == "fwd" and cfg.kernel in _GLUON_KERNELS and (cfg.block_m not in (128, 256)
                                                             or cfg.block_n not in (64, 128)):
        raise ValueError(f"config {cfg}: the Gluon forward takes block_m 128 or 256 (two "
                         "warpgroups of 64 or 128 rows) and block_n 64 or 128")


def _check_tile_offsets(tiles) -> None:
    """In-tile offsets are int32 (tile origins are int64; see ``_tile_ptrs_mask``/``_pair_ptrs``):
    the largest offset inside one tile must fit. Only absurd layouts (a row stride above
    ~2**31 / BLOCK) can fail this. ``tiles``: (name, row stride, col stride, rows, cols)."""
    for name, stride_r, stride_c, rows, cols in tiles:
        if abs(stride_r) * (rows - 1) + abs(stride_c) * (cols - 1) > 2**31 - 1:
            raise ValueError(
                f"{name}: strides ({stride_r}, {stride_c}) overflow int32 tile offsets")


def _score_scale(kind: int, scale: float) -> float:
    # Natural units with a float bias (see module docstring), log2 units otherwise.
    return scale if kind == _FLOAT_BIAS else scale * 1.4426950408889634


def _softcap_args(kind: int, scale: float, softcap: float) -> tuple[float, float, bool]:
    """(score_scale, cap, SOFTCAP) kernel arguments. With a softcap c the kernels compute
    t = tanh(qk · scale / c) and the score cap · t, cap = c in the kernel's units (see
    ``_score_scale``); the backward multiplies dS by 1 - t² (``_capped_scores``)."""
    if not softcap:
        return _score_scale(kind, scale), 1.0, False
    if not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap}")
    return scale / softcap, _score_scale(kind, 1.0) * softcap, True


# Kernel families that take a softcap: the general forward and both general backward paths.
_SOFTCAP_KERNELS = {"fwd": ("general",), "bwd": ("general", "two_kernel")}


def _softcap_config(kernel: str, cfg: AttentionConfig, user_given: bool, D: int, Dv: int,
                    q: torch.Tensor, bias_elt: int, what: str = "softcap") -> AttentionConfig:
    """The config a softcapped call (or one with a replace mask: ``what``) runs with: the TMA and
    Gluon kernels have neither, so a table entry naming one of them yields to the general
    kernels' heuristic tiles (a "tma_pair" entry to the general atomic-free pair) and a user
    config naming one raises."""
    if cfg.kernel in _SOFTCAP_KERNELS[kernel]:
        return cfg
    if user_given:
        raise ValueError(f"config {cfg} asks for the {cfg.kernel!r} {kernel} kernel, which has no "
                         f"{what} (kernels with one: {_SOFTCAP_KERNELS[kernel]})")
    if kernel == "bwd" and cfg.kernel == "tma_pair":
        return _tma_pair_fallback(D, Dv, q.dtype)
    heuristic = _forward_config if kernel == "fwd" else _backward_config
    return _fit_smem(kernel, heuristic(D, Dv, q.dtype), D, Dv, q.element_size(), bias_elt,
                     q.device)


def _replace_args(replace: Optional[torch.Tensor], kind: int, q: torch.Tensor, bias_shape):
    """(tensor, strides, HAS_REPLACE) kernel arguments of the replace mask: a same-strided uint8
    view of the bool mask, or q and zero strides without one (never read then)."""
    if replace is None:
        return q, (0, 0, 0, 0), False
    if replace.dtype != torch.bool:
        raise ValueError(f"replace must be a bool tensor, got {replace.dtype}")
    if kind != _FLOAT_BIAS:
        raise ValueError("replace needs a floating-point bias (the value a replaced score takes)")
    if tuple(replace.shape) != tuple(bias_shape):
        raise ValueError(f"replace must be broadcast to {tuple(bias_shape)}, got {tuple(replace.shape)}")
    if replace.device != q.device:
        raise ValueError(f"replace is on {replace.device}, q on {q.device}")
    return host.bool_operand(replace), replace.stride(), True


def _dropout_args(dropout_p: float, seed: Optional[torch.Tensor], q: torch.Tensor):
    """(Seed, drop_thresh, inv_keep, DROPOUT) kernel arguments; see ``_dropout_keep``."""
    if dropout_p == 0.0:
        return q, 0, 1.0, False
    if not 0.0 < dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed tensor (one int64 on q's device)")
    if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != q.device:
        raise ValueError(f"dropout_seed must be one int64 on {q.device}, got {seed.dtype} "
                         f"{tuple(seed.shape)} on {seed.device}")
    return seed, dropout_threshold(dropout_p), dropout_scale(dropout_p), True


def _bias_elt(bias_t, kind) -> int:
    return 0 if kind == _NO_BIAS else bias_t.element_size()


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


_NO_ROPE = dict(ROT=0, INTERLEAVED=False, HALF_TABLE=False)


def _rope_parts(D: int, rotary_dim: int) -> tuple[int, int, int]:
    """Tile widths (D0, D1, D2) of the rope parts: the two pair members, the pass-through tail."""
    h = _block_d(rotary_dim // 2)
    return h, h, (0 if rotary_dim == D else _block_d(D - rotary_dim))


def _rope_args(rope: Optional[Rope], q, k):
    """(cos, sin, q-view table strides, k-view table strides, constexprs) of a launch; dummies
    without rope. cos and sin are read with one set of strides: tables whose broadcast views
    differ in strides are materialised (small: no head dim, usually)."""
    if rope is None:
        return q, q, (0, 0, 0, 0), (0, 0, 0, 0), dict(_NO_ROPE)
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


def _rope_adjust(kernel: str, cfg: AttentionConfig, dtype: torch.dtype, consts: dict) -> AttentionConfig:
    """The plain kernels' table/heuristic config, adjusted where the rope variant (more live
    registers: the table tiles, the rotation) spilled in local sm_90 compiles (Triton 3.9, ptxas
    -v) and the change removed or cut the spills. Not timed on a GPU yet."""
    if not consts["ROT"]:
        return cfg
    if kernel == "fwd":
        if dtype == torch.float32:  # ieee dots keep the rotated key tile in registers
            return cfg._replace(block_n=min(cfg.block_n, 32))
        if consts["INTERLEAVED"] and cfg.num_warps < 8:  # 64x64 / 4 warps: ~1 KB of spills
            return cfg._replace(num_warps=8)
    elif kernel == "bwd" and consts["INTERLEAVED"]:  # 64x128: ~0.9 KB of spills, 64x64: ~0.25
        return cfg._replace(block_n=min(cfg.block_n, 64))
    return cfg


def _qk_parts(D: int, split: bool, consts: dict) -> tuple[int, int, int]:
    if consts["ROT"]:
        return _rope_parts(D, consts["ROT"])
    return (*_d_parts(D, split), 0)


def _table_tiles(scq, sck, bm, bn, W):
    return [("cos/sin (q)", scq[2], scq[3], bm, W), ("cos/sin (k)", sck[2], sck[3], bn, W)]


_TMA_DTYPES = (torch.float16, torch.bfloat16)
_TMA_HEAD_DIMS = (64, 128)
_TMA_PAIR_HEAD_DIMS = (64, 128, 256)


def _tma_ineligible(q, k, v, out, kind, rope_consts, dropout, scale, D, Dv,
                    head_dims=_TMA_HEAD_DIMS, is_causal: bool = False) -> Optional[str]:
    """None when the TMA kernels cover this problem, else why not (attention_fwd_tma.py; ``out``
    is the forward's output or the backward's dout, the other tensor they read by TMA).
    Traced, also ``_host_heavy_traced_ineligible``."""
    if kind != _NO_BIAS or dropout or rope_consts["ROT"]:
        return "it takes no bias, dropout or rope"
    if D != Dv or D not in head_dims:
        return f"it needs D == Dv in {head_dims}, got D={D}, Dv={Dv}"
    if q.dtype not in _TMA_DTYPES or not (scale > 0):
        return f"it needs fp16/bf16 and a positive scale, got {q.dtype}, scale={scale}"
    if q.is_cuda and _capability(q.device)[0] < 9:
        return "TMA needs compute capability 9.0 or newer"
    if is_tracing() and not descriptors_traceable():
        return "this torch takes no host-side TMA descriptors into compiled graphs"
    why_not = _host_heavy_traced_ineligible(q, k, is_causal, "its descriptors")
    if why_not is not None:
        return why_not
    if is_tracing() and symbolic(q, k, v, out):
        # Large problems, where an opaque op's host time is small against its device time.
        raise Untraceable("dynamic shapes: the TMA and Gluon kernels launch with static shapes")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        # TMA: 16-byte aligned base and non-zero strides (the head-dim stride is 1, see
        # _unit_last_stride; launch.tma_strides_ok says which strides of size-1 dims count).
        if not (aligned16(t) and tma_strides_ok(t)):
            return f"{name}'s address or strides {t.stride()} are not 16-byte multiples"
    return None


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def _gluon_platform_ineligible(q, k, is_causal: bool = False) -> Optional[str]:
    """None when the Gluon forward (attention_fwd_gluon.py) can run here, else why not: sm_90 with
    the Triton its Gluon code is written for. (Its problems are the TMA kernels': the caller
    checks ``_tma_ineligible`` too.) Traced, see ``_gluon_traced_ineligible``."""
    if not gluon_fwd.GLUON_AVAILABLE:
        return gluon_fwd._GLUON_WHY_NOT
    if not q.is_cuda or _capability(q.device) != (9, 0):
        return "it runs on sm_90 (Hopper) only"
    if max(q.shape[2], k.shape[2]) >= 2**31:
        return "TMA coordinates are 32-bit"
    return _gluon_traced_ineligible(q, k, is_causal)


# Host time per call, traced (compiled, kernels/launch.py), H100 host (benchmarks/RESULTS.md,
# stop 13): a Gluon kernel launches from an opaque op (ops/gluon.py), 0.1-0.3 ms; a TMA kernel
# is an Inductor launch that first builds its host-side descriptors (``TensorDescriptor.
# from_tensor`` in Python, then encoded by the launcher), ~57 us per forward against ~20 for the
# general kernel's launch. Below this many forward FLOPs (~0.1 ms of forward, ~0.3 ms of
# backward at 300 TFLOP/s) the op's own device time cannot hide that, and a Gluon or TMA table
# entry yields to the general Triton kernels, unless the graph runs under CUDA graphs
# (mode="reduce-overhead"), whose replays cost no host time per kernel.
_HOST_HEAVY_TRACED_MIN_FLOPS = 3.6e10


def _host_heavy_traced_ineligible(q, k, is_causal: bool, what: str) -> Optional[str]:
    """Why a traced launch takes no kernel with a costly launch path here (None: it may), see
    above; ``what`` names the cost."""
    if not is_tracing():
        return None
    from torch._inductor import config

    B, Hq, Lq, D = q.shape
    flops = 4 * B * Hq * Lq * k.shape[2] * D  # (a family boundary: a guard if dynamic)
    if flops * (0.5 if is_causal else 1.0) < _HOST_HEAVY_TRACED_MIN_FLOPS \
            and not config.triton.cudagraphs:
        return (f"compiled, {hint(flops) * (0.5 if is_causal else 1.0):.2g} FLOPs are too few "
                f"to cover the host time of {what} (< {_HOST_HEAVY_TRACED_MIN_FLOPS:.2g})")
    return None


def _gluon_traced_ineligible(q, k, is_causal: bool) -> Optional[str]:
    """Why a traced launch takes no Gluon kernel here (None: it may), see above."""
    if is_tracing() and not python_ops_allowed():
        return ("AOTInductor / cpp_wrapper packages take Triton kernels only (the Gluon kernels "
                "launch from a Python op)")
    return _host_heavy_traced_ineligible(q, k, is_causal, "its op")


def _gluon_bwd_ineligible(q, k, v, out, dout, kind, rope_consts, dropout, is_causal, scale, D,
                         Dv) -> Optional[str]:
    """None when the Gluon backward (attention_bwd_gluon.py) covers this problem, else why not:
    the TMA kernels' problems on sm_90 with the Triton it is written for. (Its own, thorough
    ``gluon_backward_ineligible`` repeats what this launcher has checked already; it costs
    ~0.1 ms of host time per call on the H100 host.)"""
    why_not = _tma_ineligible(q, k, v, dout, kind, rope_consts, dropout, scale, D, Dv,
                              is_causal=is_causal)
    if why_not is not None:
        return why_not
    if not gluon_bwd.GLUON_AVAILABLE or not triton.__version__.startswith(gluon_bwd._TESTED_TRITON):
        return f"the Gluon backward is written for Triton {'/'.join(gluon_bwd._TESTED_TRITON)}"
    if not q.is_cuda or _capability(q.device) != (9, 0):
        return "it runs on sm_90 (Hopper) only"
    why_not = _gluon_traced_ineligible(q, k, is_causal)
    if why_not is not None:
        return why_not
    if out.stride(-1) != 1 or max(q.shape[2], k.shape[2]) >= 2**31 or not math.isfinite(scale):
        return "out needs a unit last stride, lengths below 2**31 and a finite scale"
    return None


# Inductor finds a user kernel's writes in its Triton IR, whose write ops do not include the TMA
# reduction that adds the atomic TMA backward's dQ (torch 2.13): traced, that kernel would look
# as if it wrote no dQ (launch.py, ``writes``).
_TMA_REDUCE_UNTRACEABLE = "Inductor cannot see its dQ TMA reduction as a write"

# The TMA forward's tuned D 128 tiles (H100, stop 9): where a Gluon table entry cannot run.
_TMA_FORWARD_FALLBACK = AttentionConfig(128, 64, 4, 2, False, "tma")


def _tma_descriptor(t: torch.Tensor, block_rows: int) -> Desc:
    """Host-side TMA descriptor of a (B, H, L, D) tensor with [1, 1, block_rows, D] blocks (made
    by the launch interface: launch.descriptor, or Inductor when traced)."""
    return Desc(t, (1, 1, block_rows, t.shape[3]))


def _launch_fwd_tma(q, k, v, out, lse, is_causal, scale, cfg):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    bm, bn = cfg.block_m, cfg.block_n
    grid = (_cdiv(Lq, bm) * B * Hq,)
    launch(
        attention_fwd_tma_kernel, grid,
        _tma_descriptor(q, bm), _tma_descriptor(k, bn), _tma_descriptor(v, bn),
        _tma_descriptor(out, bm), lse, *lse.stride()[:2], Hq, Hq // Hkv, Lq, Lk,
        scale * 1.4426950408889634, D=D, IS_CAUSAL=bool(is_causal), BLOCK_M=bm, BLOCK_N=bn,
        PRECISION=_dot_precision(q), UPCAST_DOT=_upcast_dot(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, writes=("o_desc", "Lse"))


def _sum_partials(parts: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """The GQA split's fp32 partials (split, ...) summed in a fixed order into ``into``'s dtype
    (eager: written into ``into``; traced: a new tensor laid out as ``into``, one Inductor
    reduction: the sum runs over the partials seen in ``into``'s memory order, so that its
    natural output is that layout and no copy follows)."""
    if is_tracing():
        order = layout_order(into)
        seen = parts.permute(0, *(1 + d for d in order))
        return seen.sum(0).to(into.dtype).permute(inverse_order(order))
    return into.copy_(parts.sum(0))


def _launch_bwd_tma_pair(q, k, v, dout, dq, dk, dv, delta, row_m, is_causal, scale, score_scale,
                         cfg, group_split):
    """The atomic-free TMA pair (attention_bwd_tma.py): dK/dV by attention_bwd_dkdv_tma_kernel
    (GQA groups shared out over ``group_split`` programs as in the atomic path, the fp32
    partials summed in a fixed order), then dQ by attention_bwd_dq_tma_kernel with
    ``cfg.dq_tile``. Returns (dk, dv) (new tensors when traced with a GQA split)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    bm, bn = cfg.block_m, cfg.block_n
    dots = dict(PRECISION=_dot_precision(q), UPCAST_DOT=_upcast_dot(q))
    split = group_split or _group_split(hint(B * Hkv * _cdiv(Lk, bn)), Hq // Hkv, q.device)
    if Hq // Hkv % split:
        raise ValueError(f"group_split={split} does not divide the GQA group of {Hq // Hkv}")
    if split > 1:  # fp32 partials, split-major: (split * B, Hkv, Lk, D)
        dk_out = _empty((split * B, Hkv, Lk, D), torch.float32, q.device)
        dv_out = _empty((split * B, Hkv, Lk, D), torch.float32, q.device)
    else:
        dk_out, dv_out = dk, dv
    launch(
        attention_bwd_dkdv_tma_kernel, (_cdiv(Lk, bn) * B * Hkv * split,),
        _tma_descriptor(q, bm), _tma_descriptor(k, bn), _tma_descriptor(v, bn),
        _tma_descriptor(dout, bm), _tma_descriptor(dk_out, bn), _tma_descriptor(dv_out, bn),
        delta, row_m, B, Hq, Hkv, Hq // Hkv, Lq, Lk, score_scale, scale, split, D=D,
        IS_CAUSAL=bool(is_causal), **dots, BLOCK_M=bm, BLOCK_N=bn, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, writes=("dk_desc", "dv_desc"))
    if split > 1:
        dk = _sum_partials(dk_out.view(split, B, Hkv, Lk, D), dk)
        dv = _sum_partials(dv_out.view(split, B, Hkv, Lk, D), dv)
    qm, qn, qw, qs = cfg.dq_tile or cfg[:4]
    launch(
        attention_bwd_dq_tma_kernel, (_cdiv(Lq, qm) * B * Hq,),
        _tma_descriptor(q, qm), _tma_descriptor(k, qn), _tma_descriptor(v, qn),
        _tma_descriptor(dout, qm), _tma_descriptor(dq, qm), delta, row_m,
        Hq, Hq // Hkv, Lq, Lk, score_scale, scale, D=D, IS_CAUSAL=bool(is_causal), **dots,
        BLOCK_M=qm, BLOCK_N=qn, num_warps=qw, num_stages=qs, writes=("dq_desc",))
    return dk, dv


# The decode family (attention_decode.py): at most this many query rows, at least this many keys.
DECODE_MAX_LQ = 16
DECODE_MIN_LK = 256


def _cudnn_family(direction: str, q, k, v, bias, **flags) -> bool:
    """Does cuDNN's attention run this call (attention_cudnn.py: plain problems where it was
    measured faster than our kernels)? Never for a user-given config."""
    if q.device.type != "cuda":
        return False
    return attention_cudnn.family(direction, q, k, v, bias, capability=_capability(q.device),
                                  **flags) == "cudnn"


def _forward_family(Lq: int, Lk: int, user_config: bool, rope: bool, dropout: bool,
                    softcap: bool, replace: bool = False) -> str:
    """Which forward kernel family a call runs: "decode" (attention_decode.py: flash-decoding,
    the keys split across programs, a whole GQA group's rows in one tile, masked key blocks not
    read) for a few query rows against many keys, the KV-cache decode step; "general" (the
    table's kernels) otherwise, and always with a user-given config, rope, dropout, softcap or a
    replace mask, which the decode kernels do not take."""
    if user_config or rope or dropout or softcap or replace:
        return "general"
    return "decode" if Lq <= DECODE_MAX_LQ and Lk >= DECODE_MIN_LK else "general"


def attention_forward(q, k, v, bias, *, is_causal: bool, scale: float,
                      config: Optional[AttentionConfig] = None, rope: Optional[Rope] = None,
                      dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None,
                      softcap: float = 0.0, replace: Optional[torch.Tensor] = None):
    """Returns ``(out, lse)``; see the module docstring for shapes and semantics. With ``rope``
    (a ``Rope``), q and k are un-rotated and rotated in registers after each load. With
    ``dropout_p > 0`` the weights are dropped by the draw of ``_dropout_keep`` under
    ``dropout_seed`` (one int64 on q's device) and the kept ones scaled by 1/(1-p); lse is of the
    undropped scores. With ``softcap`` c > 0 the scores are c·tanh(q·kᵀ·scale / c) before the
    bias and the masks (general kernels only: ``_softcap_config``). With ``replace`` (bool,
    (B, Hq, Lq, Lk), a float bias) the scores where it holds are the bias alone (general
    kernels only)."""
    _check_inputs(q, k, v, bias)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    B, Hq, Lq, D, Hkv, Lk, Dv = _dims(q, k, v)
    if config is None and B * Hq and _cudnn_family(
            "fwd", q, k, v, bias, is_causal=is_causal, dropout=dropout_p != 0.0, softcap=softcap != 0.0,
            replace=replace is not None, rope=rope is not None):
        o, lse = attention_cudnn.forward(q, k, v, is_causal, scale)
        return out_layout(o), lse
    # The output buffer, (B, Lq, Hq, Dv) (see ``out_layout``): the general kernel writes it
    # through the strides of its transpose; the TMA and Gluon kernels write a contiguous
    # (B, Hq, Lq, Dv) tensor, copied into this layout (the copy the model's head merge would
    # have made, so none is added; they are picked for large problems only when compiled).
    out_buf = _empty((B, Lq, Hq, Dv), q.dtype, q.device)
    out = out_buf.transpose(1, 2)
    lse = _empty((B, Hq, Lq), torch.float32, q.device)
    if B * Hq == 0:
        return out, lse
    # The family by the sizes themselves (with dynamic shapes, a guard at each boundary: few
    # recompiles, and no graph keeps a slower family at other lengths); the tiles within it
    # by their hints (launch.hint: no guard at every table bucket).
    Lq_h, Lk_h = hint(Lq), hint(Lk)
    if _forward_family(Lq, Lk, config is not None, rope is not None, dropout_p != 0.0,
                       softcap != 0.0, replace is not None) == "decode":
        _bias_args(bias, q)  # the same errors as the general path
        return attention_decode_forward(q, k, v, bias, is_causal=is_causal, scale=scale,
                                        out_buf=out_buf, lse=lse)
    cos, sin, scq, sck, rc = _rope_args(rope, q, k)
    kind, bias_t, sb = _bias_args(bias, q)
    rep_t, sr, has_rep = _replace_args(replace, kind, q, (B, Hq, Lq, Lk))
    seed, drop_thresh, inv_keep, dropout = _dropout_args(dropout_p, dropout_seed, q)
    user_given = config is not None
    cfg = AttentionConfig(*config) if user_given else _pick_config(
        "fwd", q, D, Dv, is_causal, kind, Lq_h, Lk_h, _bias_elt(bias_t, kind))
    _check_config(cfg, "fwd")
    score_scale, cap, softcapped = _softcap_args(kind, scale, softcap)
    if softcapped:
        cfg = _softcap_config("fwd", cfg, user_given, D, Dv, q, _bias_elt(bias_t, kind))
    if has_rep:
        cfg = _softcap_config("fwd", cfg, user_given, D, Dv, q, _bias_elt(bias_t, kind), "replace mask")
    tma_checked = None  # (_tma_ineligible's answer,) once asked: a Gluon entry asks it first
    if cfg.kernel in _GLUON_KERNELS:
        tma_checked = (_tma_ineligible(q, k, v, out, kind, rc, dropout, scale, D, Dv,
                                       is_causal=is_causal),)
        why_not = tma_checked[0] or _gluon_platform_ineligible(q, k, is_causal)
        if why_not is None and ("gluon", cfg) not in _FAILED_CONFIGS:
            if is_tracing():  # Inductor cannot compile Gluon: its launch stays one opaque op
                o, lse = torch.ops.fuse_plugin.gluon_attention_forward(
                    q, k, v, bool(is_causal), float(scale), cfg.block_m, cfg.block_n,
                    cfg.num_stages, cfg.kernel)
                return out_layout(o), lse
            try:
                o = _empty((B, Hq, Lq, Dv), q.dtype, q.device)
                gluon_fwd.launch_forward_gluon(q, k, v, o, lse, is_causal, scale,
                                               _gluon_variant(cfg))
                return out_layout(o), lse
            except OutOfResources as e:
                if user_given:
                    raise
                # Its tiles are fixed by its partitions: no smaller retry, the TMA kernel instead.
                warnings.warn(f"fuse_plugin attention: config {cfg} does not fit this GPU ({e}); "
                              f"using {_TMA_FORWARD_FALLBACK}", RuntimeWarning, stacklevel=2)
                _FAILED_CONFIGS[("gluon", cfg)] = 1
        if user_given:
            raise ValueError(f"config {cfg} asks for the Gluon forward kernel, but {why_not}")
        cfg = _TMA_FORWARD_FALLBACK  # the TMA kernel if it applies, else as below
    if cfg.tma:
        why_not = tma_checked[0] if tma_checked else \
            _tma_ineligible(q, k, v, out, kind, rc, dropout, scale, D, Dv, is_causal=is_causal)
        if why_not is None:
            o = _empty((B, Hq, Lq, Dv), q.dtype, q.device)
            _launch(lambda c: _launch_fwd_tma(q, k, v, o, lse, is_causal, scale, c), cfg,
                    user_given, "tma")
            return out_layout(o), lse
        if user_given:
            raise ValueError(f"config {cfg} asks for the TMA forward kernel, but {why_not}")
        # A TMA table entry for a problem it does not cover (dropout, rope, a layout): the
        # general kernel's heuristic tiles (the tuned general winners of these keys on the H100).
        cfg = _fit_smem("fwd", _forward_config(D, Dv, q.dtype), D, Dv, q.element_size(), 0,
                        q.device)
    if not user_given:
        cfg = _rope_adjust("fwd", cfg, q.dtype, rc)

    def run_general(cfg):
        d0, d1, d2 = _qk_parts(D, cfg.split_d, rc)
        dv0, dv1 = _d_parts(Dv, cfg.split_d)
        bm, bn = cfg.block_m, cfg.block_n
        dcols = max(d0 + d1 + d2, D)
        _check_tile_offsets([("q", *q.stride()[2:], bm, dcols),
                             ("k", *k.stride()[2:], bn, dcols),
                             ("v", *v.stride()[2:], bn, dv0 + dv1),
                             ("out", *out.stride()[2:], bm, dv0 + dv1), ("bias", *sb[2:], bm, bn),
                             ("replace", *sr[2:], bm, bn)]
                            + _table_tiles(scq, sck, bm, bn, cos.shape[-1]))
        grid = (_cdiv(Lq, bm) * B * Hq,)
        launch(
            attention_fwd_kernel, grid, q, k, v, bias_t, rep_t, out_buf, lse, cos, sin,
            *q.stride(), *k.stride(), *v.stride(), *sb, *sr, *out.stride(), *lse.stride(), *scq,
            *sck,
            Hq, Hq // Hkv, Lq, Lk, score_scale, seed, drop_thresh, inv_keep, cap, D, Dv,
            IS_CAUSAL=bool(is_causal), BIAS_KIND=kind, SCALE_POS=bool(scale >= 0),
            DROPOUT=dropout, SOFTCAP=softcapped, HAS_REPLACE=has_rep,
            BIAS_KEYS=_bias_over_keys(kind, sb),
            PRECISION=_dot_precision(q), UPCAST_DOT=_upcast_dot(q),
            BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=dv0, DV1=dv1, D2=d2, **rc,
            writes=("Out", "Lse"),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch(run_general, cfg, user_given, "rope" if rc["ROT"] else None)
    return out_buf.transpose(1, 2), lse  # (traced: the view of the buffer as written)


def attention_backward(dout, q, k, v, bias, out, lse, *, is_causal: bool, scale: float,
                       need_dbias: bool, config: Optional[AttentionConfig] = None,
                       deterministic: Optional[bool] = None, rope: Optional[Rope] = None,
                       dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None,
                       group_split: Optional[int] = None, softcap: float = 0.0,
                       replace: Optional[torch.Tensor] = None):
    """Returns ``(dq, dk, dv, dbias_or_None)``; see the module docstring. ``deterministic``
    (default: ``torch.are_deterministic_algorithms_enabled()``) picks the atomic-free kernels.
    With ``rope``, q and k are the un-rotated inputs and dq/dk the gradients w.r.t. them.
    ``group_split`` (atomic path and "tma_pair", default ``_group_split``) shares each GQA
    group's query heads out over that many programs, whose fp32 dK/dV partials are then
    summed. ``softcap``: as in ``attention_forward``; dbias is the gradient of the softcapped
    scores (dq/dk go on through the softcap). ``replace``: as in ``attention_forward``; dbias is
    dS everywhere, dq/dk take none of it where the mask holds."""
    _check_inputs(q, k, v, bias)
    # dq/dk/dv are laid out as the op's inputs (host.layout_like), as the op's fake says.
    q_in, k_in, v_in = inputs = (q, k, v)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    dout = _unit_last_stride(dout)  # the forward's layout (out_layout): read by its strides
    B, Hq, Lq, D, Hkv, Lk, Dv = _dims(q, k, v)
    if tuple(dout.shape) != (B, Hq, Lq, Dv) or tuple(out.shape) != (B, Hq, Lq, Dv) \
            or tuple(lse.shape) != (B, Hq, Lq):
        raise ValueError("dout/out/lse shapes do not match q and v")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if config is None and B * Hq and _cudnn_family(
            "bwd", q, k, v, bias, is_causal=is_causal, dropout=dropout_p != 0.0, softcap=softcap != 0.0,
            replace=replace is not None, rope=rope is not None, need_dbias=need_dbias,
            deterministic=deterministic):
        grads = attention_cudnn.backward(dout, q, k, v, out, lse, is_causal, scale)
        # cuDNN's gradients follow q/k/v's stride order: mostly the fake's layout already (and
        # as they are when traced: host.in_layout_of)
        return (*(in_layout_of(g, x) for g, x in zip(grads, inputs)), None)
    dev = q.device
    if B * Hq == 0:
        return (_empty((B, Hq, Lq, D), q.dtype, dev, q_in),
                _empty((B, Hkv, Lk, D), k.dtype, dev, k_in),
                _empty((B, Hkv, Lk, Dv), v.dtype, dev, v_in),
                _empty((B, Hq, Lq, Lk), torch.float32, dev) if need_dbias else None)

    cos, sin, scq, sck, rc = _rope_args(rope, q, k)
    kind, bias_t, sb = _bias_args(bias, q)
    rep_t, sr, has_rep = _replace_args(replace, kind, q, (B, Hq, Lq, Lk))
    seed, drop_thresh, inv_keep, dropout = _dropout_args(dropout_p, dropout_seed, q)
    user_given = config is not None
    if user_given:
        cfg = AttentionConfig(*config)
        if cfg.dq_tile is not None:
            cfg = cfg._replace(dq_tile=tuple(cfg.dq_tile))
    else:
        # speed-only: by the sizes' hints (launch.hint)
        cfg = _pick_config("bwd", q, D, Dv, is_causal, kind, hint(Lq), hint(Lk),
                           _bias_elt(bias_t, kind))
    _check_config(cfg, "bwd")
    score_scale, cap, softcapped = _softcap_args(kind, scale, softcap)
    if softcapped:
        cfg = _softcap_config("bwd", cfg, user_given, D, Dv, q, _bias_elt(bias_t, kind))
    if has_rep:
        cfg = _softcap_config("bwd", cfg, user_given, D, Dv, q, _bias_elt(bias_t, kind), "replace mask")
    use_tma_pair = False
    if cfg.kernel == "tma_pair":
        why_not = "it writes no dbias" if need_dbias else \
            _tma_ineligible(q, k, v, dout, kind, rc, dropout, scale, D, Dv, _TMA_PAIR_HEAD_DIMS,
                            is_causal)
        if why_not is None:
            use_tma_pair = True
        elif user_given:
            raise ValueError(f"config {cfg} asks for the TMA backward pair, but {why_not}")
        else:  # the general pair (or, with rope, the atomic kernel: below)
            cfg = _tma_pair_fallback(D, Dv, q.dtype)
    if not user_given and not use_tma_pair:
        if cfg.kernel == "two_kernel" and rc["ROT"] and not deterministic:
            # Tuned on plain problems: rope keeps the atomic kernel's heuristic tiles.
            cfg = _fit_smem("bwd", _backward_config(D, Dv, q.dtype), D, Dv, q.element_size(),
                            _bias_elt(bias_t, kind), dev)
        elif deterministic and (cfg.kernel != "two_kernel" or rc["ROT"]):
            cfg = _deterministic_backward_config(D, Dv, q.dtype)
    if cfg.kernel in _GLUON_BWD_KERNELS and not deterministic:
        variant = _gluon_bwd_variant(cfg)
        if variant not in gluon_bwd.VARIANTS:
            why_not = f"it has no tiles {variant} (it has {sorted(gluon_bwd.VARIANTS)})"
        elif need_dbias:
            why_not = "it writes no dbias"
        else:
            why_not = _gluon_bwd_ineligible(q, k, v, out, dout, kind, rc, dropout, is_causal,
                                            scale, D, Dv)
        if why_not is None:  # it reads out and dout contiguous
            out_c, dout_c = _contiguous(out), _contiguous(dout)
        if why_not is None and is_tracing():  # as in the forward: one opaque op
            grads = torch.ops.fuse_plugin.gluon_attention_backward(
                dout_c, q, k, v, out_c, lse, bool(is_causal), float(scale), variant,
                group_split or 0)
        elif why_not is None:
            grads = gluon_bwd.attention_backward_gluon(dout_c, q, k, v, out_c, lse,
                                                       is_causal=is_causal, scale=scale,
                                                       variant=variant, group_split=group_split)
        if why_not is None:  # contiguous gradients
            return (*(in_layout_of(g, x) for g, x in zip(grads, inputs)), None)
        if user_given:
            raise ValueError(f"config {cfg} asks for the Gluon backward kernel, but {why_not}")
        cfg = _fit_smem("bwd", _backward_config(D, Dv, q.dtype), D, Dv, q.element_size(),
                        _bias_elt(bias_t, kind), dev)
    # The atomic-free pairs are deterministic by construction; a table or user config may pick
    # them.
    deterministic = deterministic or cfg.kernel in _PAIR_KERNELS
    dq = _empty((B, Hq, Lq, D), q.dtype, dev, q_in)
    dk = _empty((B, Hkv, Lk, D), k.dtype, dev, k_in)
    dv = _empty((B, Hkv, Lk, Dv), v.dtype, dev, v_in)
    dbias = _empty((B, Hq, Lq, Lk), torch.float32, dev) if need_dbias else None
    use_tma = False
    if cfg.tma and not deterministic:
        why_not = "it writes no dbias" if need_dbias else \
            _tma_ineligible(q, k, v, dout, kind, rc, dropout, scale, D, Dv, is_causal=is_causal)
        if why_not is None and is_tracing():
            why_not = _TMA_REDUCE_UNTRACEABLE
        if why_not is None:
            use_tma = True
        elif user_given:
            raise ValueError(f"config {cfg} asks for the TMA backward kernel, but {why_not}")
        else:  # as in the forward: the general kernel's heuristic tiles
            cfg = _fit_smem("bwd", _backward_config(D, Dv, q.dtype), D, Dv, q.element_size(), 0,
                            dev)
    if not user_given and not deterministic:
        cfg = _rope_adjust("bwd", cfg, q.dtype, rc)
    common = dict(IS_CAUSAL=bool(is_causal), BIAS_KIND=kind, HAS_REPLACE=has_rep,
                  BIAS_KEYS=_bias_over_keys(kind, sb),
                  PRECISION=_dot_precision(q), UPCAST_DOT=_upcast_dot(q))
    # The atomic-free kernels and the preprocess read q/k whole (one tile) or as the rope parts.
    one = _qk_parts(D, False, rc)
    W = cos.shape[-1]

    stats = {}  # the preprocess kernel's outputs, launched once by the paths that read them

    def preprocess():
        if stats:
            return stats["delta"], stats["row_m"], stats["row_r"], stats["dqa"]
        delta = _empty((B, Hq, Lq), torch.float32, dev)
        row_m = _empty((B, Hq, Lq), torch.float32, dev)
        row_r = _empty((B, Hq, Lq), torch.float32, dev) if kind == _FLOAT_BIAS else row_m
        # fp32 dQ accumulator of the atomic path, zeroed by the preprocess kernel.
        dqa = _empty((B, Hq, Lq, D), torch.float32, dev) if not deterministic else delta
        pre_m = 64
        launch(
            attention_bwd_preprocess_kernel, (_cdiv(Lq, pre_m) * B * Hq,),
            out, dout, lse, delta, row_m, row_r, q, k, bias_t, rep_t, dqa, cos, sin,
            *out.stride(), *dout.stride(), *lse.stride(), *q.stride(), *k.stride(), *sb, *sr,
            *scq, *sck,
            Hq, Hq // Hkv, Lq, Lk, D, Dv, score_scale, cap, ZERO_DQ=not deterministic,
            SOFTCAP=softcapped, **common,
            BLOCK_M=pre_m, BLOCK_N=32, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv),
            D0=one[0], D1=one[1], D2=one[2], **rc,
            num_warps=4, num_stages=1,
            writes=("Delta", "RowM") + (("RowR",) if kind == _FLOAT_BIAS else ())
            + (() if deterministic else ("DQA",)),
        )
        stats.update(delta=delta, row_m=row_m, row_r=row_r, dqa=dqa)
        return delta, row_m, row_r, dqa

    ds_t = dbias if need_dbias else q
    ds_strides = dbias.stride() if need_dbias else (0, 0, 0, 0)
    if use_tma_pair:
        delta, row_m, _, _ = preprocess()
        dk, dv = _launch(lambda c: _launch_bwd_tma_pair(q, k, v, dout, dq, dk, dv, delta, row_m,
                                                        is_causal, scale, score_scale, c,
                                                        group_split),
                         cfg, user_given, "tma_pair")
        return dq, dk, dv, None

    if not deterministic:
        one_block = False  # the last run took the one-launch form (ONE_KEY_BLOCK)

        def run_atomic(cfg):
            nonlocal dk, dv  # replaced by the summed partials when traced (_sum_partials)
            split = group_split or _group_split(hint(B * Hkv * _cdiv(Lk, cfg.block_n)), Hq // Hkv,
                                                dev)
            if Hq // Hkv % split:
                raise ValueError(f"group_split={split} does not divide the GQA group of {Hq // Hkv}")
            if split > 1:
                dk_out = _empty((split, B, Hkv, Lk, D), torch.float32, dev)
                dv_out = _empty((split, B, Hkv, Lk, Dv), torch.float32, dev)
                dk_strides, dv_strides = dk_out.stride()[1:], dv_out.stride()[1:]
                split_strides = (dk_out.stride(0), dv_out.stride(0))
            else:
                dk_out, dv_out, dk_strides, dv_strides, split_strides = dk, dv, dk.stride(), dv.stride(), (0, 0)
            if use_tma:
                bm, bn = cfg.block_m, cfg.block_n
                delta, row_m, _, dqa = preprocess()
                launch(
                    attention_bwd_tma_kernel, (_cdiv(Lk, bn) * B * Hkv * split,),
                    _tma_descriptor(q, bm), _tma_descriptor(k, bn), _tma_descriptor(v, bn),
                    _tma_descriptor(dout, bm), _tma_descriptor(dqa, bm), dqa, dk_out, dv_out,
                    delta, row_m, *dk_strides[:3], *dv_strides[:3], Hq, Hkv, Hq // Hkv, Lq, Lk,
                    score_scale, scale, split, *split_strides, D=D, IS_CAUSAL=bool(is_causal),
                    TMA_REDUCE=not _interpreted(q), PRECISION=common["PRECISION"],
                    UPCAST_DOT=common["UPCAST_DOT"], BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    writes=("dq_desc", "DQA", "DK", "DV"))
            else:
                run_general(cfg, split, dk_out, dv_out, dk_strides, dv_strides, split_strides)
            if split > 1:
                dk, dv = _sum_partials(dk_out, dk), _sum_partials(dv_out, dv)

        def run_general(cfg, split, dk_out, dv_out, dk_strides, dv_strides, split_strides):
            nonlocal one_block
            # All keys in one block: each program owns its query heads' dQ rows, so the kernel
            # takes the statistics from out/lse and stores dQ itself (no preprocess, no fp32
            # buffer, no cast: one launch). Otherwise the preprocess's buffers. (A correctness
            # condition: with dynamic shapes, a guard on Lk.)
            one_block = bool(_cdiv(Lk, cfg.block_n) == 1)
            if one_block:
                delta = row_m = row_r = dqa = lse  # unused
                dq_out = dq
            else:
                delta, row_m, row_r, dqa = preprocess()
                dq_out = dqa  # unused (a graph keeps no unwritten dq buffer)
            d0, d1, d2 = _qk_parts(D, cfg.split_d, rc)
            dv0, dv1 = _d_parts(Dv, cfg.split_d)
            bm, bn = cfg.block_m, cfg.block_n
            dcols = max(d0 + d1 + d2, D)
            _check_tile_offsets([("q", *q.stride()[2:], bm, dcols),
                                 ("k", *k.stride()[2:], bn, dcols),
                                 ("v", *v.stride()[2:], bn, dv0 + dv1),
                                 ("dout", *dout.stride()[2:], bm, dv0 + dv1),
                                 ("bias", *sb[2:], bm, bn), ("replace", *sr[2:], bm, bn),
                                 ("dbias", Lk, 1, bm, bn), ("out", *out.stride()[2:], bm, dv0 + dv1),
                                 ("dq", *dq.stride()[2:], bm, dcols)]
                                + _table_tiles(scq, sck, bm, bn, W))
            launch(
                attention_bwd_kernel, (_cdiv(Lk, bn) * B * Hkv * split,), q, k, v, bias_t, rep_t, dout, dqa, dk_out, dv_out, ds_t, delta, row_m, row_r, cos, sin, out, lse, dq_out,
                *q.stride(), *k.stride(), *v.stride(), *sb, *sr, *dout.stride(), *dk_strides,
                *dv_strides, *ds_strides, *scq, *sck, *out.stride(), *lse.stride(), *dq_out.stride(),
                Hq, Hkv, Hq // Hkv, Lq, Lk, score_scale, scale, seed, drop_thresh, inv_keep,
                split, *split_strides, cap,
                D, Dv, ONE_KEY_BLOCK=one_block, NEED_DS=bool(need_dbias), DROPOUT=dropout,
                SOFTCAP=softcapped, **common,
                BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=dv0, DV1=dv1, D2=d2, **rc,
                writes=("DQ" if one_block else "DQA", "DK", "DV") + (("DS",) if need_dbias else ()),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        _launch(run_atomic, cfg, user_given, "rope" if rc["ROT"] else None)
        if one_block:
            return dq, dk, dv, dbias
        dqa = stats["dqa"]
        if rc["ROT"]:
            cast_m = 32
            launch(
                attention_dq_rope_cast_kernel, (_cdiv(Lq, cast_m) * B * Hq,), dqa, dq, cos, sin, *dq.stride(), *scq, Hq, Lq, scale, D,
                D0=one[0], D2=one[2], BLOCK_M=cast_m, **rc, num_warps=4, writes=("DQ",))
        elif is_tracing():
            # What attention_dq_cast_kernel computes, as torch ops, laid out as the fake says:
            # Inductor fuses the scale, the cast and the layout into one pointwise kernel.
            dq = in_layout_of((dqa * scale).to(q.dtype), q_in)
        else:
            n = dq.numel()
            launch(attention_dq_cast_kernel, (_cdiv(n, 1024),), dqa, dq, n, *dq.stride(), Hq, Lq,
                   D, scale, BLOCK=1024, num_warps=4, writes=("DQ",))
        return dq, dk, dv, dbias

    delta, row_m, row_r, _ = preprocess()
    bm, bn, bdv = cfg.block_m, cfg.block_n, _block_d(Dv)
    dcols = max(sum(one), D)
    # out/dout/dq are read with BLOCK_M rows, dk/dv with BLOCK_N rows (dbias is contiguous).
    _check_tile_offsets([("q", *q.stride()[2:], bm, dcols), ("k", *k.stride()[2:], bn, dcols),
                         ("v", *v.stride()[2:], bn, bdv), ("out", *out.stride()[2:], bm, bdv),
                         ("bias", *sb[2:], bm, bn), ("replace", *sr[2:], bm, bn),
                         ("dbias", Lk, 1, bm, bn)]
                        + _table_tiles(scq, sck, bm, bn, W))
    consts = dict(common, BLOCK_M=bm, BLOCK_N=bn, BLOCK_DV=bdv, D0=one[0], D1=one[1], D2=one[2],
                  **rc, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch(
        attention_bwd_dkdv_kernel, (_cdiv(Lk, bn) * B * Hkv,), q, k, v, bias_t, rep_t, dout, dk, dv, delta, row_m, row_r, cos, sin,
        *q.stride(), *k.stride(), *v.stride(), *sb, *sr, *dout.stride(), *dk.stride(), *dv.stride(),
        *scq, *sck, Hq, Hkv, Hq // Hkv, Lq, Lk, D, Dv, score_scale, scale, seed, drop_thresh,
        inv_keep, cap, DROPOUT=dropout, SOFTCAP=softcapped, **consts, writes=("DK", "DV"),
    )
    launch(
        attention_bwd_dq_kernel, (_cdiv(Lq, bm) * B * Hq,), q, k, v, bias_t, rep_t, dout, dq, ds_t, delta, row_m, row_r, cos, sin,
        *q.stride(), *k.stride(), *v.stride(), *sb, *sr, *dout.stride(), *dq.stride(), *ds_strides,
        *scq, *sck, Hq, Hq // Hkv, Lq, Lk, D, Dv, score_scale, scale, seed, drop_thresh,
        inv_keep, cap, NEED_DS=bool(need_dbias), DROPOUT=dropout, SOFTCAP=softcapped, **consts,
        writes=("DQ",) + (("DS",) if need_dbias else ()),
    )
    return dq, dk, dv, dbias
