"""Launch parameters of the attention kernels: what a call runs with, chosen once per shape.

``AttentionConfig`` names a kernel family and its tiles (``KERNEL_VARIANTS``); ``table_config``
gives a problem its tuned table entry (tuning.py, the shipped H100 table) or, on a miss, the
heuristic tiles of its family (``forward_config``, ``backward_config``,
``deterministic_backward_config``), trimmed to the GPU's shared memory (``fit_smem``,
``smem_estimate``). Which family may actually run a given call (TMA, Gluon, decode, the
general kernels) is decided by the launchers in attention.py, which fall back from a table
entry to the heuristic tiles of a family that applies. Nothing here launches or autotunes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton

from . import attention_bwd_gluon as gluon_bwd
from . import attention_fwd_gluon as gluon_fwd
from . import tuning
from .host import BOOL_BIAS as _BOOL_BIAS
from .host import FLOAT_BIAS as _FLOAT_BIAS
from .host import NO_BIAS as _NO_BIAS
from .host import next_pow2 as _next_pow2

# Values of the BIAS_KIND constexpr.
_MASK_NAMES = {_NO_BIAS: "none", _BOOL_BIAS: "bool", _FLOAT_BIAS: "float"}


class AttentionConfig(NamedTuple):
    """Launch parameters of one kernel family (pass as ``config=`` to override the table).

    Forward: ``block_m`` query rows per program, ``block_n`` keys per loop step. Backward
    (default, atomic path): ``block_n`` keys per program (dK/dV stay in registers), ``block_m``
    queries per loop step; the deterministic backward reads them the same way in both kernels.
    ``split_d``: compute a non-power-of-2 head dim as two power-of-2 parts (see module doc).
    ``kernel``: the Triton kernel variant these tiles are for (``KERNEL_VARIANTS``): the family
    (registry.py, where each is described) and, for Gluon, its form. "general" and "tma" take
    both directions; "two_kernel" and "tma_pair" are backward only ("tma_pair": the dK/dV
    kernel's tiles, and ``dq_tile`` = (block_m, block_n, num_warps, num_stages) of its dQ kernel,
    the same tiles when None); "gluon" / "gluon_pingpong" (forward: ``block_m`` = 2 consumer
    warpgroups x 64 or 128 rows, ``block_n`` 64 or 128, ``num_stages`` K/V buffers;
    "gluon_persistent": the ping-pong tiles in the persistent kernel, one program per SM) and "gluon" /
    "gluon_lpt" (backward: one of attention_bwd_gluon.VARIANTS). A config given by the caller
    forces its family (an error when it cannot run the call); a table entry is the measured pick
    for its key, which the registry falls back from where the family cannot run the call."""

    block_m: int  # query rows per tile (power of 2, >= 16)
    block_n: int  # key rows per tile (power of 2, >= 16)
    num_warps: int
    num_stages: int
    split_d: bool = False
    kernel: str = "general"
    # "tma_pair" only: (block_m, block_n, num_warps, num_stages) of its dQ kernel.
    dq_tile: Optional[tuple] = None

    @property
    def tma(self) -> bool:
        return self.kernel == "tma"


KERNEL_VARIANTS = ("general", "tma", "two_kernel", "tma_pair", "gluon", "gluon_pingpong",
                   "gluon_persistent", "gluon_lpt")
GLUON_FWD_KERNELS = ("gluon", "gluon_pingpong", "gluon_persistent")
GLUON_BWD_KERNELS = ("gluon", "gluon_lpt")
KERNELS_OF = {"fwd": ("general", "tma", "gluon", "gluon_pingpong", "gluon_persistent"),
               "bwd": ("general", "tma", "two_kernel", "tma_pair", "gluon", "gluon_lpt")}
# The atomic-free backward pairs (deterministic by construction).
PAIR_KERNELS = ("two_kernel", "tma_pair")


def block_d(d: int) -> int:
    return max(16, _next_pow2(d))


def d_parts(d: int, split: bool) -> tuple[int, int]:
    """Head-dim tile widths (D0, D1): one power of 2 >= d (D1 = 0), or with ``split`` two powers
    of 2 covering d with less padding, e.g. 80 -> (64, 16), 96 -> (64, 32), 160 -> (128, 32),
    192 -> (128, 64). A split that saves nothing (d a power of 2, 112 -> 64 + 64) is not made."""
    p = block_d(d)
    if split and d != p and d > 16:
        lo = p // 2
        hi = block_d(d - lo)
        if lo + hi < p:
            return lo, hi
    return p, 0


# Heuristic tiles (a table miss) as (block_m, block_n, warps, stages), by the largest head-dim
# block they serve (D and Dv rounded up to a power of two). fp32 has its own rows: with ieee
# precision its dots run on FMA units with register-held operands and need smaller tiles. The
# 16-bit rows at D <= 128 are the general kernels' tuned winners at D 64 and 128 (H100, tune
# --plan full, stop 9), also what a TMA / Gluon table entry falls back to for dropout, rope or a
# bias; ``fit_smem`` trims them on GPUs with less shared memory.
_HEURISTIC_TILES = {
    # the forward
    "fwd": {torch.float32: {64: (64, 32, 8, 2), 128: (32, 64, 8, 2), 256: (32, 32, 8, 1)},
            None: {128: (64, 64, 4, 3), 256: (128, 32, 8, 2)}},
    # the atomic backward: block_n keys stay resident with two fp32 block_n x D accumulators,
    # so large head dims get fewer keys per program
    "bwd": {torch.float32: {64: (32, 32, 8, 1), 128: (16, 32, 4, 1), 256: (16, 32, 8, 1)},
            None: {128: (64, 128, 8, 2), 256: (32, 64, 8, 1)}},
}


def _heuristic_config(direction: str, D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """``_HEURISTIC_TILES``'s row for this problem; 16-bit rows split D where it is not a power
    of two (``d_parts``)."""
    d = max(block_d(D), block_d(Dv))
    fp32 = dtype == torch.float32
    tiles = _HEURISTIC_TILES[direction][torch.float32 if fp32 else None]
    row = tiles[min(b for b in tiles if d <= b)]
    return AttentionConfig(*row) if fp32 else AttentionConfig(*row, d_parts(max(D, Dv), True)[1] != 0)


def forward_config(D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """Heuristic forward tiles (a table miss)."""
    return _heuristic_config("fwd", D, Dv, dtype)


def backward_config(D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """Heuristic tiles of the atomic backward (a table miss)."""
    return _heuristic_config("bwd", D, Dv, dtype)


def deterministic_backward_config(D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """Tiles of the two atomic-free backward kernels (picked from sm_90 compiles as the largest
    tiles without register spills; above D 128 the H100's fastest, NOTES.md attempt 13, which
    spill a little). Also what a table "tma_pair" entry falls back to."""
    d = max(block_d(D), block_d(Dv))
    if dtype == torch.float32:
        if d <= 64:
            return AttentionConfig(32, 32, 8, 1)
        if d <= 128:
            return AttentionConfig(16, 32, 4, 1)
        return AttentionConfig(16, 32, 8, 1)
    if d <= 64:
        return AttentionConfig(64, 64, 8, 2)
    if d <= 128:
        return AttentionConfig(32, 64, 8, 2)
    return AttentionConfig(64, 64, 8, 2)


def tma_pair_fallback(D: int, Dv: int, dtype: torch.dtype) -> AttentionConfig:
    """What a table "tma_pair" entry runs where the TMA pair cannot (a mask, dropout, rope,
    another head dim, a layout): the general atomic-free pair with its deterministic tiles (the
    tuner's fill step writes the same for mask keys)."""
    return deterministic_backward_config(D, Dv, dtype)._replace(kernel="two_kernel")


# Smallest tiles, for the retry after a table/heuristic config failed to launch (shared memory).
SAFE_CONFIG = AttentionConfig(32, 32, 4, 1)


def smem_limit(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    try:
        return triton.runtime.driver.active.utils.get_device_properties(
            device.index if device.index is not None else torch.cuda.current_device()
        )["max_shared_mem"]
    except Exception:  # pragma: no cover - driver without the query
        return None


def smem_estimate(direction: str, cfg: AttentionConfig, D: int, Dv: int, elt: int,
                  bias_elt: int) -> int:
    """Rough shared memory of a launch: the pipelined tiles (num_stages copies) plus the
    resident ones. Used to shrink heuristic stages on small-shared-memory GPUs and by the tuner
    to prune candidates; the launch itself is the final judge."""
    d0, d1 = d_parts(D, cfg.split_d)
    v0, v1 = d_parts(Dv, cfg.split_d)
    dp, dvp = d0 + d1, v0 + v1
    bm, bn, st = cfg.block_m, cfg.block_n, max(1, cfg.num_stages)
    if direction == "fwd" and cfg.kernel in GLUON_FWD_KERNELS:
        return gluon_fwd._smem_bytes(gluon_variant(cfg), max(dp, dvp), elt)
    if direction == "bwd" and cfg.kernel in GLUON_BWD_KERNELS:
        variant = gluon_bwd.VARIANTS.get(gluon_bwd_variant(cfg))
        return gluon_bwd.smem_bytes_estimate(variant, max(dp, dvp), elt) if variant else 2**30
    if direction == "fwd":
        resident = bm * dp * elt
        streamed = bn * (dp + dvp) * elt + bm * bn * bias_elt
        if cfg.tma:  # TMA copies land in shared memory; P stays in registers (+ barriers)
            return resident + st * streamed + 1024
        return resident + st * streamed + bm * bn * elt
    if cfg.kernel == "tma_pair":  # TMA copies in shared memory: resident + stages x streamed
        qm, qn, _, qs = cfg.dq_tile or cfg[:4]
        return max(bn + st * bm, qm + max(1, qs) * qn) * (dp + dvp) * elt + 1024
    resident = bn * (dp + dvp) * elt
    if cfg.tma:  # Q/dO copies in shared memory, the fp32 dQ tile of the TMA reduction, dS
        return resident + st * bm * (dp + dvp) * elt + bm * dp * 4 + bm * bn * elt + 4096
    streamed = bm * (dp + dvp) * elt + bm * bn * bias_elt + 8 * bm
    return resident + st * streamed + 2 * bm * bn * elt


def fit_smem(direction, cfg, D, Dv, elt, bias_elt, device) -> AttentionConfig:
    limit = smem_limit(device)
    if limit is None:
        return cfg
    while cfg.num_stages > 1 and smem_estimate(direction, cfg, D, Dv, elt, bias_elt) > limit:
        cfg = cfg._replace(num_stages=cfg.num_stages - 1)
    return cfg


# Short keys: with every key in one block the atomic backward is one launch (ONE_KEY_BLOCK in
# attention_bwd.py: no preprocess kernel, no fp32 dQ buffer, no cast). 64 x 128 tiles, 8 warps,
# measured on the H100 (bf16, stop 18, device us) against the table's two-block tiles: BERT
# (32, 12, 128, 64) padding mask + dropout 57.3 vs 65.3, without dropout 37.9 vs 49.4; Llama
# (8, 16/4, 128, 64) causal 23.6 vs 29.0; (8, 16, 128, 128) causal 21.8 vs 45.1; (16, 8, 100, 96)
# 13.6 vs 13.9. Programs are one per KV head (and GQA share), each looping over the query
# blocks: bounded to Lq <= 256, where that loop stays short.
_ONE_BLOCK_TILES = (64, 128, 8, 2)
_ONE_BLOCK_MAX_LK, _ONE_BLOCK_MAX_LQ = 128, 256


def _one_key_block_config(D: int, Dv: int, dtype: torch.dtype, Lq: int,
                          Lk: int) -> Optional[AttentionConfig]:
    """The one-launch backward's tiles where they apply (16-bit, head dims <= 128, short keys),
    else None."""
    if dtype == torch.float32 or max(block_d(D), block_d(Dv)) > 128 \
            or not 0 < Lk <= _ONE_BLOCK_MAX_LK or Lq > _ONE_BLOCK_MAX_LQ:
        return None
    return AttentionConfig(*_ONE_BLOCK_TILES, d_parts(max(D, Dv), True)[1] != 0)


def table_config(direction: str, q: torch.Tensor, D: int, Dv: int, causal: bool, kind: int,
                 Lq: int, Lk: int, bias_elt: int) -> AttentionConfig:
    """Table entry for this GPU and problem, else the heuristic (never autotuned); a backward
    with short keys takes the one-launch tiles (``_one_key_block_config``) on the GPU."""
    if q.is_cuda and direction == "bwd":
        one = _one_key_block_config(D, Dv, q.dtype, Lq, Lk)
        if one is not None:
            return fit_smem(direction, one, D, Dv, q.element_size(), bias_elt, q.device)
    if q.is_cuda:
        entry = tuning.lookup(direction, q.device, q.dtype, D, Dv, causal, _MASK_NAMES[kind], Lq, Lk)
        if entry is not None:
            return AttentionConfig(*entry)
    heuristic = forward_config if direction == "fwd" else backward_config
    return fit_smem(direction, heuristic(D, Dv, q.dtype), D, Dv, q.element_size(), bias_elt,
                    q.device)


def gluon_variant(cfg: AttentionConfig) -> "gluon_fwd.GluonFwdVariant":
    persistent = cfg.kernel == "gluon_persistent"
    return gluon_fwd.GluonFwdVariant(cfg.block_m // 2, cfg.block_n, cfg.num_stages,
                                     cfg.kernel == "gluon_pingpong" or persistent, persistent=persistent)


def gluon_bwd_variant(cfg: AttentionConfig) -> str:
    """The Gluon backward's variant name of a config (attention_bwd_gluon.VARIANTS)."""
    lpt = "l" if cfg.kernel == "gluon_lpt" else ""
    return f"m{cfg.block_m}n{cfg.block_n}s{cfg.num_stages}x{lpt}"


def rope_adjust(direction: str, cfg: AttentionConfig, dtype: torch.dtype, rc: dict) -> AttentionConfig:
    """The plain kernels' table/heuristic config, adjusted where the rope variant (more live
    registers: the table tiles, the rotation) spilled in local sm_90 compiles (Triton 3.9, ptxas
    -v) and the change removed or cut the spills. Not timed on a GPU yet. ``rc``: the launch's
    rope constexprs (ROT, INTERLEAVED, HALF_TABLE)."""
    if not rc["ROT"]:
        return cfg
    if direction == "fwd":
        if dtype == torch.float32:  # ieee dots keep the rotated key tile in registers
            return cfg._replace(block_n=min(cfg.block_n, 32))
        if rc["INTERLEAVED"] and cfg.num_warps < 8:  # 64x64 / 4 warps: ~1 KB of spills
            return cfg._replace(num_warps=8)
    elif direction == "bwd" and rc["INTERLEAVED"]:  # 64x128: ~0.9 KB of spills, 64x64: ~0.25
        return cfg._replace(block_n=min(cfg.block_n, 64))
    return cfg
