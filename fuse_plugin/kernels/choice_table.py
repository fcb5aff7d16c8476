"""The measured choice among implementations, per problem class: which one is fastest, and by how much.

The registry (registry.py) chooses a kernel family for each call; the rewrite (patterns/choice.py)
chooses, for each matched attention site, between our op and leaving the site to Inductor (the
decomposition the matcher saw, which Inductor fuses as stock compile does). Both read this table
first: where the problem's class was measured on this GPU, the fastest candidate that can run the
problem wins; elsewhere their rules apply.

A table ships per compute capability (``attention_choices_sm<cc>.json``), one entry set per GPU
name it was measured on (a lookup takes the running GPU's own set, and for a class it lacks the
first other set of its capability that has it), written by ``python -m fuse_plugin.tune --choices`` (tune.py). An entry::

    "<class key>": {"shape": [B, Hq, Hkv, Lq, Lk, D, Dv],
                    "fwd": {"<family>": us}, "bwd": {"<family>": us},
                    "inductor": {"fwd": us, "train": us}, "sdpa": {"fwd": us, "train": us},
                    "source": "measured <date>",
                    "small": {"fwd": [units per program, warps, stages], "bwd": [...]}}

"fwd" / "bwd": each of our families that can run the class, forward and backward (the latter with
the gradient of a float bias where the class has one: "periodic", "float"); "inductor": the
site's decomposition compiled by stock Inductor, forward alone (inference) and forward +
backward (training); "sdpa": `F.scaled_dot_product_attention` on the class's problem, the backend
torch picks (what an SDPA call site runs when it is left as it is; ``enable_gqa`` for GQA), likewise;
"sdpa_repeat" (GQA classes, optional): the same with k/v repeated to the query heads first, as HF's
sdpa path calls it with a mask; "infer" (optional): the forward of the families that can skip the
logsumexp (cuDNN's, PyTorch's efficient kernels) without it, as an inference site calls the op
(need_lse=False): cuDNN skips it in inference calls only where its "infer" time is below its "fwd"
time (``lse_free``), the efficient kernels always (measured faster on Swin's windows, stop 28), and
inference calls are chosen by each family's faster time of the two (``measured``). Device times (CUDA
graphs), median. "small": the small family's config
measured fastest (attention_small.SmallConfig), which it then runs the class with. The class key
(``class_key``)
is ``dtype|d<D>|dv<Dv>|q<Lq>|k<Lk>|<bias>|<causal>|<dropout>``: D and Dv rounded up to a power of
two (16 at least); Lq and Lk rounded up to a power of two (1 at least) up to ``MAX_CLASS_LEN``,
longer lengths are one bucket ("long"); bias "none", "keys" (a per-key vector: padding), "bool",
"float", "periodic" (a window-periodic float bias); "causal" / "full"; "drop" / "nodrop". Times
are for the class's measured shape; only their ratios are used. ``FUSE_PLUGIN_CHOICE_TABLE`` names another
table file, or ``off`` for none.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch

from .. import settings
from .host import BOOL_BIAS, FLOAT_BIAS, NO_BIAS, next_pow2
from .launch import hint

FORMAT = 1
ENV = "FUSE_PLUGIN_CHOICE_TABLE"
MAX_CLASS_LEN = 16384  # Lq / Lk buckets (powers of two) above this are one ("long")
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
INDUCTOR = "inductor"
SDPA = "sdpa"
SDPA_REPEAT = "sdpa_repeat"  # GQA classes: the SDPA call with k/v repeated first (tune_choices.sdpa_times)
INFER = "infer"  # the forward without the logsumexp, of the families that can skip it (tune_choices.infer_times)


def _len_bucket(n: int) -> str:
    return "long" if n > MAX_CLASS_LEN else str(max(1, next_pow2(n)))


def class_key(dtype: torch.dtype, D: int, Dv: int, Lq: int, Lk: int, bias: str, causal: bool,
              dropout: bool) -> Optional[str]:
    """The class of a problem (module doc), None for a dtype the table does not hold."""
    if dtype not in DTYPES:
        return None
    return (f"{DTYPES[dtype]}|d{max(16, next_pow2(D))}|dv{max(16, next_pow2(Dv))}|"
            f"q{_len_bucket(Lq)}|k{_len_bucket(Lk)}|{bias}|{'causal' if causal else 'full'}|"
            f"{'drop' if dropout else 'nodrop'}")


def bias_form(kind: int, keys: bool, periodic: bool) -> str:
    """The class's bias name for a bias of BIAS_KIND ``kind``."""
    if kind == NO_BIAS:
        return "none"
    if periodic:
        return "periodic"
    if keys:
        return "keys"
    return "bool" if kind == BOOL_BIAS else "float" if kind == FLOAT_BIAS else "none"


def path_for(cc: tuple[int, int]) -> Path:
    return Path(__file__).with_name(f"attention_choices_sm{cc[0]}{cc[1]}.json")


@functools.lru_cache(maxsize=None)
def _entries(device_index: int, env: Optional[str]) -> dict:
    if env == "off":
        return {}
    try:
        name = torch.cuda.get_device_name(device_index)
    except (RuntimeError, AssertionError):  # no GPU (a table named by the switch, fake tensors)
        name = ""
    if env:
        return entries_of(env, name)
    try:
        cc = torch.cuda.get_device_capability(device_index)
    except (RuntimeError, AssertionError):  # no GPU: fake CUDA tensors in a CPU build, no table
        return {}
    return entries_of(path_for(cc), name)


def entries_of(path, gpu_name: str) -> dict:
    """The entries a GPU named ``gpu_name`` reads from a table file: its own set's, and for each
    class its set lacks, the entry of the first other set that has it (file order); {} without a
    table. (A set measured for a few classes alone then adds to the others instead of hiding them.)"""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        return {}
    gpus = table.get("gpus") or {}
    merged: dict = {}
    for name, entry_set in reversed(list(gpus.items())):  # the earlier sets win among the others
        if name != gpu_name and isinstance(entry_set, dict):
            merged.update(entry_set.get("entries") or {})
    merged.update((gpus.get(gpu_name) or {}).get("entries") or {})
    return merged


def clear_cache() -> None:
    _entries.cache_clear()
    _entry.cache_clear()


def lookup(device: torch.device, key: Optional[str]) -> Optional[dict]:
    """The entry measured for the class ``key`` on ``device`` ({"fwd": {family: us}, "bwd":
    {family: us}, "inductor" / "sdpa": {"fwd": us, "train": us}, "small": {...}}, each part
    possibly empty), or None. Built once per (GPU, class, table): an eager call reads it for its
    family (``measured``) and again for cuDNN's lse (``lse_free``); callers do not change it."""
    if key is None or device.type != "cuda":
        return None
    return _entry(device.index if device.index is not None else 0, key, settings.choice_table())


@functools.lru_cache(maxsize=None)
def _entry(index: int, key: str, env: Optional[str]) -> Optional[dict]:
    entry = _entries(index, env).get(key)
    if not isinstance(entry, dict):
        return None
    out = {"small": entry.get("small") if isinstance(entry.get("small"), dict) else {}}
    for part in ("fwd", "bwd", INDUCTOR, SDPA, SDPA_REPEAT, INFER):
        times = entry.get(part)
        out[part] = {k: float(v) for k, v in times.items() if isinstance(v, (int, float)) and v > 0} \
            if isinstance(times, dict) else {}
    return out if any(out[p] for p in ("fwd", "bwd", INDUCTOR, SDPA)) else None


def key_of_call(call) -> Optional[str]:
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    return class_key(call.q.dtype, D, Dv, hint(Lq), hint(Lk),
                     bias_form(call.kind, call.bias_keys, call.period is not None),
                     call.is_causal, call.dropout)


# The host's time of one call of a family in a compiled graph's default mode (no CUDA graphs),
# us: what a step spends issuing it where the GPU waits for the host (timm's small models in
# training are host-bound: deit3_s 17-22 ms of host against 9 ms of GPU a step, H100, stop 49).
# Measured by benchmarks/host_cost.py (H100, torch 2.11, stop 49; RESULTS 'Stop 49'): the host's
# time per site of a compiled graph of 4 attention sites (64 x 6 x 197 x 64, bf16) with each
# family forced. Forward: that time of the family's call (a launch of ours through Inductor
# 46.3, cuDNN's ATen op 58.7, the efficient kernels' 48.1, the flash forward's 51.0). Backward:
# the forward's launch (46.3, a lower bound of ours: the backward launches at least one kernel
# as large) plus what each ATen family measured above ours in training, less its forward's share
# (cuDNN +29.6, the efficient kernels +161.9). Families not here (the TMA and Gluon kernels)
# count at the direction's largest (``host_us``); the Gluon kernels' host cost also has a rule of
# its own (attention_hopper.why_not_host_heavy_traced).
HOST_US = {"fwd": {"general": 46.3, "small": 46.3, "decode": 46.3, "cudnn": 58.7, "efficient": 48.1,
                   "flash": 51.0},
           "bwd": {"general": 46.3, "small": 46.3, "two_kernel": 46.3, "cudnn": 75.9, "efficient": 208.2}}


def host_us(family: str, direction: str) -> float:
    """``HOST_US``'s time for a family; a family it lacks (the TMA and Gluon kernels: a launch
    with TMA descriptors, or an eager one, unmeasured) at the largest of the direction's, so that
    the host's time never moves a choice to a family whose host cost nobody measured."""
    host = HOST_US.get(direction, {})
    return host.get(family, max(host.values(), default=0.0))


def host_bound_costs(times: dict, direction: str) -> dict:
    """{family: us} of a call in a compiled graph without CUDA graphs: the longer of its measured
    device time and its host time (``host_us``). A step pays for each call at least the time the
    host takes to issue it and at least the GPU's; the choice then differs from the device times'
    only where the host's time is the larger: small problems (CaiT's class attention, Lq 1 against
    197 keys: cuDNN 5.9 us against our 6.7 on the GPU, 58.7 against 46.3 on the host; our
    kernels there made CaiT-XXS24 training 0.976 of stock compile's host time a step, cuDNN's
    1.036, H100, stop 49). Ties (families all below their host time) go to the faster on the
    GPU (``fastest_first``)."""
    return {name: max(us, host_us(name, direction)) for name, us in times.items()}


def fastest_first(costs: dict, device: dict) -> list:
    """The family names of ``costs`` ({family: us}), the cheapest first, ties by ``device`` time."""
    return sorted(costs, key=lambda name: (costs[name], device.get(name, costs[name])))


def _issued_by_host(call) -> bool:
    """Is the call traced into a compiled graph that the host issues call by call (not replayed
    as a CUDA graph)?"""
    if not call.traced:
        return False
    from torch._inductor import config

    return not config.triton.cudagraphs


def measured(call, host: bool = True) -> Optional[dict]:
    """Our families' measured times for a launcher call's class and direction (registry.choose),
    or None where the class was not measured; for an inference forward (need_lse=False) each
    family at the faster of its times with and without the logsumexp. Traced into a graph that
    the host issues call by call (default mode), each time is at least the family's host time
    (``host_bound_costs``), unless ``host`` is False (the device times alone)."""
    costs, device = costs_and_device(call)
    return costs if host else device


def costs_and_device(call) -> tuple[Optional[dict], Optional[dict]]:
    """(``measured(call)``, ``measured(call, host=False)``) from one lookup of the class: what
    the registry ranks the families by, and their device times (ties, ``describe``)."""
    times = lookup(call.q.device, key_of_call(call))
    if call.direction == "fwd" and not call.need_lse:
        device = infer_times(times)
    else:
        device = (times or {}).get(call.direction) or {}
    if not device:
        return None, None
    return (host_bound_costs(device, call.direction) if _issued_by_host(call) else device), device


def infer_times(times: Optional[dict]) -> dict:
    """{family: us} of an inference forward for a class's ``times`` (lookup): the "fwd" time, or
    the "infer" one (no logsumexp) where that is faster."""
    fwd, infer = (times or {}).get("fwd", {}), (times or {}).get(INFER, {})
    return {name: min(us, infer.get(name, us)) for name, us in fwd.items()}


def lse_free(call, family: str) -> bool:
    """Does ``family`` run this inference forward (need_lse=False) without the logsumexp? Where
    the call's class measured it faster so; else it computes the lse anyway (cuDNN: skipping it
    measured 1-4% slower on causal D80 / D96 / D128 / GQA rows, H100, stop 28)."""
    if call.direction != "fwd" or call.need_lse:
        return False
    times = lookup(call.q.device, key_of_call(call)) or {}
    fwd, infer = times.get("fwd", {}).get(family), times.get(INFER, {}).get(family)
    return fwd is not None and infer is not None and infer < fwd


def small_config(call) -> Optional[tuple]:
    """The small family's config measured fastest for the call's class and direction (the
    entry's "small": {"fwd": [units per program, warps, stages], "bwd": [...]}), or None."""
    times = lookup(call.q.device, key_of_call(call))
    cfg = (times or {}).get("small", {}).get(call.direction)
    return tuple(int(x) for x in cfg) if isinstance(cfg, list) and len(cfg) == 3 else None


def describe(us: dict, chosen: str, device: Optional[dict] = None) -> str:
    """``measured: small 45.2 us, 2.10x faster than inductor (95.0 us)``: the choice and its
    runner-up; where a cost is the host's time (``host_bound_costs``: ``device`` holds the GPU's),
    ``46.3 us (host; 6.7 on the GPU)``."""
    def cost(name: str) -> str:
        gpu = (device or {}).get(name)
        host = gpu is not None and gpu < us[name]
        return f"{us[name]:.1f} us" + (f" (host; {gpu:.1f} on the GPU)" if host else "")

    others = sorted((v, k) for k, v in us.items() if k != chosen)
    text = f"measured: {chosen} {cost(chosen)}"
    if others:
        v, k = others[0]
        text += f", {v / us[chosen]:.2f}x faster than {k} ({cost(k)})"
    return text
