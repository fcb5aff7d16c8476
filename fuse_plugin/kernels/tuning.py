"""Launch-configuration table of the attention kernels (``kernels/attention.py``).

A table ships with the package per compute capability (``attention_configs_sm90.json`` for
Hopper) and holds one entry set per GPU name it was tuned on. A lookup takes the entry set of
the running GPU's name, else the first one of its compute capability (an H200 uses the H100's
table), else nothing: the kernels then use their heuristic tiles. Nothing is autotuned at a
user's call; ``python -m fuse_plugin.tune`` regenerates a table on the current GPU.

Keys (``make_key``)::

    fwd|bf16|d128|causal|none|n4096
    kernel | dtype | head-dim bucket | full/causal | mask kind | sequence bucket

* head-dim bucket: max(D, Dv) rounded up to one of ``D_BUCKETS`` (80 and 96 have their own
  buckets: they can run as split 64+16 / 64+32 head dims).
* mask kind: ``none``, ``bool`` (keep-mask) or ``float`` (additive bias).
* sequence bucket: max(Lq, Lk) rounded up to one of ``SEQ_BUCKETS``; the top bucket also covers
  longer sequences.

An entry is ``[block_m, block_n, num_warps, num_stages, split_d, source]`` where source says how
it was obtained (``tuned``, ``from:<key>`` for a copy of a tuned sibling, ``heuristic``),
optionally followed by the kernel family when it is not the general one
(``AttentionConfig.kernel``): ``"tma"``, the Hopper TMA kernels (only on keys they cover: no mask,
fp16/bf16, d64/d128), ``"two_kernel"``, the atomic-free backward pair (backward keys only),
``"tma_pair"``, that pair with TMA tiles (no-mask fp16/bf16 backward keys of d64/d128/d256),
followed by its dQ kernel's ``[block_m, block_n, num_warps, num_stages]``, or
``"gluon"`` / ``"gluon_pingpong"`` (forward) and ``"gluon"`` / ``"gluon_lpt"`` (backward),
the warp-specialised Gluon kernels (the TMA kernels' keys).
Short sequences: the tuner's smallest bucket is n1024 (its representative shapes have N = 1024),
and below ``SHORT_SEQ`` other tiles win (ViT's 197 tokens: the n1024 entries' TMA forward takes
45 us where a general 64x32 tile takes 26, cuDNN 26). Optional keys with the bucket ``n256``
(``optional_keys``), measured with ``benchmarks/tiles.py`` (source ``"measured"``), take
precedence for max(Lq, Lk) <= ``SHORT_SEQ``; a problem without one uses its n1024 entry.
Set ``FUSE_PLUGIN_ATTENTION_TABLE`` to a JSON path to use another table file, or to ``off`` to
use the heuristic tiles only.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch

from .. import settings

FORMAT = 1
KERNELS = ("fwd", "bwd")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
D_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256)
SEQ_BUCKETS = (1024, 4096, 16384)
SHORT_SEQ = 256  # optional entries for max(Lq, Lk) <= this (see the module docstring)
MASKS = ("none", "bool", "float")
ENV = "FUSE_PLUGIN_ATTENTION_TABLE"


def d_bucket(d: int, dv: int) -> int:
    x = max(d, dv)
    for b in D_BUCKETS:
        if x <= b:
            return b
    raise ValueError(f"head dim {x} above {D_BUCKETS[-1]}")


def seq_bucket(lq: int, lk: int) -> int:
    x = max(lq, lk)
    for b in SEQ_BUCKETS:
        if x <= b:
            return b
    return SEQ_BUCKETS[-1]


def make_key(kernel: str, dtype: str, dbucket: int, causal: bool, mask: str, sbucket: int) -> str:
    return f"{kernel}|{dtype}|d{dbucket}|{'causal' if causal else 'full'}|{mask}|n{sbucket}"


def parse_key(key: str) -> dict:
    kernel, dtype, d, causal, mask, n = key.split("|")
    return dict(kernel=kernel, dtype=dtype, dbucket=int(d[1:]), causal=causal == "causal",
                mask=mask, sbucket=int(n[1:]))


def all_keys() -> list[str]:
    """Every key the dispatcher can ask for."""
    return [make_key(k, dt, d, c, m, n) for k in KERNELS for dt in DTYPE_NAMES.values()
            for d in D_BUCKETS for c in (False, True) for m in MASKS for n in SEQ_BUCKETS]


def optional_keys() -> list[str]:
    """Keys a table may hold besides ``all_keys``: the short-sequence bucket."""
    return [make_key(k, dt, d, c, m, SHORT_SEQ) for k in KERNELS for dt in DTYPE_NAMES.values()
            for d in D_BUCKETS for c in (False, True) for m in MASKS]


def table_path(cc: tuple[int, int]) -> Path:
    return Path(__file__).with_name(f"attention_configs_sm{cc[0]}{cc[1]}.json")


def load_table(path) -> Optional[dict]:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        return None
    return table


# The optional 7th element of an entry (AttentionConfig.kernel when not "general").
ENTRY_KERNELS = ("tma", "two_kernel", "tma_pair", "gluon", "gluon_pingpong", "gluon_lpt")


def _tile(values) -> Optional[tuple]:
    """(block_m, block_n, num_warps, num_stages) when well-formed, else None."""
    try:
        bm, bn, w, s = (int(x) for x in values)
    except (TypeError, ValueError):
        return None
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0  # noqa: E731
    return (bm, bn, w, s) if pow2(bm) and pow2(bn) and w in (1, 2, 4, 8, 16) and s >= 1 else None


def entry_to_config(entry) -> Optional[tuple]:
    """(block_m, block_n, num_warps, num_stages, split_d, kernel, dq_tile) of a well-formed
    entry (``dq_tile`` None but for "tma_pair"), else None."""
    if not isinstance(entry, (list, tuple)) or not 6 <= len(entry) <= 8:
        return None
    tile = _tile(entry[:4])
    try:
        split = bool(int(entry[4]))
    except (TypeError, ValueError):
        return None
    kernel = entry[6] if len(entry) >= 7 else "general"
    if tile is None or (len(entry) >= 7 and kernel not in ENTRY_KERNELS):
        return None
    dq_tile = None
    if len(entry) == 8:
        ok = kernel == "tma_pair" and isinstance(entry[7], (list, tuple)) and len(entry[7]) == 4
        dq_tile = _tile(entry[7]) if ok else None
        if dq_tile is None:
            return None
    return (*tile, split, kernel, dq_tile)


def tma_key(key: str) -> bool:
    """Whether the TMA kernels cover a key's problems (see attention_hopper.why_not_tma)."""
    p = parse_key(key)
    return p["dtype"] in ("fp16", "bf16") and p["mask"] == "none" and p["dbucket"] in (64, 128)


def kernel_covers(kernel: str, key: str) -> bool:
    """Whether an entry of kernel family ``kernel`` may serve ``key``."""
    if kernel == "tma":
        return tma_key(key)
    if kernel == "two_kernel":
        return parse_key(key)["kernel"] == "bwd"
    if kernel == "tma_pair":
        p = parse_key(key)
        return p["kernel"] == "bwd" and p["dtype"] in ("fp16", "bf16") and p["mask"] == "none" \
            and p["dbucket"] in (64, 128, 256)
    if kernel == "gluon":
        return tma_key(key)
    if kernel == "gluon_pingpong":
        return tma_key(key) and parse_key(key)["kernel"] == "fwd"
    if kernel == "gluon_lpt":
        return tma_key(key) and parse_key(key)["kernel"] == "bwd"
    return True


def select_gpu(table: dict, name: str) -> Optional[dict]:
    gpus = table.get("gpus") or {}
    if name in gpus:
        return gpus[name]
    return next(iter(gpus.values()), None)


@functools.lru_cache(maxsize=None)
def _entries(device_index: int, env: Optional[str]) -> Optional[dict]:
    if env == "off":
        return None
    cc = torch.cuda.get_device_capability(device_index)
    table = load_table(env if env else table_path(cc))
    if table is None:
        return None
    gpu = select_gpu(table, torch.cuda.get_device_name(device_index))
    return None if gpu is None else gpu.get("entries")


def lookup(kernel: str, device: torch.device, dtype: torch.dtype, d: int, dv: int, causal: bool,
           mask: str, lq: int, lk: int) -> Optional[tuple]:
    """The table's config for this problem on ``device`` (a CUDA device), or None."""
    if dtype not in DTYPE_NAMES:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    entries = _entries(index, settings.attention_table())
    if not entries:
        return None
    dt, db = DTYPE_NAMES[dtype], d_bucket(d, dv)
    entry = entries.get(make_key(kernel, dt, db, causal, mask, SHORT_SEQ)) if max(lq, lk) <= SHORT_SEQ else None
    if entry is None:
        entry = entries.get(make_key(kernel, dt, db, causal, mask, seq_bucket(lq, lk)))
    return None if entry is None else entry_to_config(entry)


def clear_cache() -> None:
    _entries.cache_clear()
