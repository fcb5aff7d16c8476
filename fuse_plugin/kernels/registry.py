"""The attention kernel families behind one registry: which implementation runs a call, and why.

A call of the launchers (kernels/attention.py) is described once by an ``AttentionCall``
(call.py). Each family says why it cannot run a call (``why_not``: None when it can), which
tiles it would run it with (``config``) and launches it (``run``). ``choose`` picks one:

1. **forced**: a ``config=`` of the launchers names its family (``AttentionConfig.kernel``,
   a ``SmallConfig``), or ``FUSE_PLUGIN_ATTENTION_FAMILY`` / ``forced(name)`` names one. It runs,
   or ``FamilyError`` lists every family's reason;
2. **measured**: where the shipped choice table (choice_table.py, ``python -m fuse_plugin.tune
   --choices``) measured the problem's class, the fastest family that can run it (in a graph
   compiled without CUDA graphs, each family's time at least its host time: choice_table.HOST_US);
3. **rules**: else the first family of ``PRIORITY`` that can run it. Each rule is a measurement
   (the figures are in the families' ``why_not`` and in benchmarks/RESULTS.md).

Families (direction; module that launches it):

==========  =====  ==========================================================================
cudnn       both   cuDNN's fused attention through ATen (attention_cudnn.py): plain problems,
                   from 512 (forward) / 160 (backward) tokens, where it was measured faster
decode      fwd    flash-decoding (attention_decode.py): Lq <= 16 against Lk >= 256
small       both   many small problems, whole tiles on chip (attention_small.py): Lq, Lk <= 128
efficient   both   PyTorch's memory-efficient (CUTLASS) kernels through ATen
                   (attention_efficient.py): float biases read through their strides; taken
                   only where the choice table measured it fastest
flash       fwd    PyTorch's flash forward (FlashAttention-2) through ATen (attention_flash.py):
                   plain problems, GQA natively; taken only where the choice table measured it
                   fastest
gluon       both   warp-specialised Hopper kernels (attention_hopper.py) where the tuning table
                   picks them; also a sliding window of >= 4096 keys at head dim 128 (measured)
tma         both   TMA kernels (attention_hopper.py) where the tuning table picks them (forward:
                   also where a Gluon entry cannot run)
tma_pair    bwd    the atomic-free pair with TMA tiles (attention_hopper.py), table-picked
two_kernel  bwd    the atomic-free pair (attention_general.py): deterministic mode, or where the
                   table picks it
general     both   the general kernels (attention_general.py): every problem
==========  =====  ==========================================================================

The tiles within a Triton family come from the tuning table (tuning.py via
``attention_config.table_config``: the table's entry for the problem's key, whose ``kernel``
says which of gluon / tma / tma_pair / two_kernel / general was measured fastest there), else
from the family's heuristic.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Optional

import torch

from . import attention_cudnn, attention_decode, attention_efficient, attention_flash, attention_general
from . import attention_hopper
from . import attention_small
from . import choice_table, host
from .attention_config import (GLUON_BWD_KERNELS, GLUON_FWD_KERNELS, PAIR_KERNELS, AttentionConfig,
                               backward_config, deterministic_backward_config, fit_smem,
                               forward_config, gluon_variant, rope_adjust, table_config,
                               tma_pair_fallback)
from .host import in_layout_of
from .launch import hint

_state = threading.local()
log = logging.getLogger(__name__)


class FamilyError(ValueError):
    """A forced family cannot run a call: the message lists every family's reason."""


# --------------------------------------------------------------------------------------------
# The families
# --------------------------------------------------------------------------------------------


class Family:
    """One implementation of the attention forward and/or backward."""

    name = ""
    directions: tuple = ("fwd", "bwd")
    periodic_bias = False  # reads a window-periodic bias by its period (call.py)
    rule = ""  # why it is taken when it is the first that can run a call (the priority list)

    takes_window = False  # runs a sliding window (Gluon: that only), chunks, documents (``call.window``, ``chunk``, ``documents``)
    takes_sinks = False  # folds sink logits into its forward's softmax (``call.sinks``); else merged after it

    def why_not(self, call) -> Optional[str]:
        """Why this family cannot run ``call`` (None: it can): the features it lacks, then its
        own checks (``cannot``)."""
        if call.window and not self.takes_window:
            return "it takes no sliding window (the general kernels do)"
        if call.chunk and not self.takes_window:
            return "it takes no chunks (the general kernels do)"
        if call.documents is not None and not self.takes_window:
            return "it takes no documents (the general kernels do)"
        return self.cannot(call)

    def cannot(self, call) -> Optional[str]:
        """The family's own reasons (see ``why_not``)."""
        raise NotImplementedError

    def declines(self, call) -> Optional[str]:
        """Why its rule does not take ``call`` where nothing was measured, though it could run
        it (None: it takes it). A measurement (choice_table.py) overrides this."""
        return None

    def config(self, call):
        return None

    def run(self, call, cfg, out_layout):
        """Forward: (out, lse); backward: (dq, dk, dv, dbias of the general kernels' (B, Hq, Lq,
        Lk) shape or of ``call.dbias_shape``, or None)."""
        raise NotImplementedError


def _entry(call) -> AttentionConfig:
    """The tiles a Triton family starts from: a config the caller gave, else the tuning table's
    entry for the call's key (or the heuristic), once per call."""
    if isinstance(call.config, AttentionConfig):
        return call.config
    entry = getattr(call, "_table_entry", None)
    if entry is None:
        B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
        entry = table_config(call.direction, call.q, D, Dv, call.is_causal, call.kind, hint(Lq),
                             hint(Lk), call.bias_elt)
        call._table_entry = entry
    return entry


def _not_picked(call, kernels: tuple, what: str) -> Optional[str]:
    """Why the tuning table's entry does not pick one of ``kernels`` here (None: it does)."""
    kernel = _entry(call).kernel
    return None if kernel in kernels else f"the tuning table picks {kernel!r} for this key, not {what}"


class Cudnn(Family):
    name = "cudnn"
    rule = (f"cuDNN, measured faster from {attention_cudnn.FWD_MIN_LEN} (forward) / "
            f"{attention_cudnn.BWD_MIN_LEN} (backward) tokens")

    def declines(self, call):
        least = attention_cudnn.FWD_MIN_LEN if call.direction == "fwd" else attention_cudnn.BWD_MIN_LEN
        # A family boundary: with dynamic shapes a guard (a recompile across it), so that a graph
        # traced at one length does not keep the slower family at another (launch.hint).
        if call.q.shape[2] < least or call.k.shape[2] < least:
            return f"measured slower than ours below {least} tokens"
        return None

    def cannot(self, call):
        q, k = call.q, call.k
        if q.device.type != "cuda":
            return "not on CUDA"
        return attention_cudnn.why_not(
            q, k, call.v, call.bias, is_causal=call.is_causal,
            capability=attention_hopper.capability(q.device), dropout=call.dropout,
            softcap=call.softcapped, replace=call.has_rep, rope=call.rope is not None,
            need_dbias=call.need_dbias, deterministic=call.deterministic and call.direction == "bwd")

    def run(self, call, cfg, out_layout):
        if call.direction == "fwd":
            # with its lse unless the class measured the inference call faster without (skipping
            # it measured 1-4% slower on causal D80/D96/D128/GQA rows, <= 1.5% faster on others;
            # H100, stop 28; SDPA's inference call, which skips it, 3% faster at D64 full 4k, stop 39)
            o, lse = attention_cudnn.forward(call.q, call.k, call.v, call.is_causal, call.scale,
                                             need_lse=not choice_table.lse_free(call, self.name))
            return out_layout(o), lse
        grads = attention_cudnn.backward(call.dout, call.q, call.k, call.v, call.out, call.lse,
                                         call.is_causal, call.scale)
        # cuDNN's gradients follow q/k/v's stride order: mostly the fake's layout already (and
        # as they are when traced: host.in_layout_of)
        return (*(in_layout_of(g, x) for g, x in zip(grads, call.inputs)), None)


class Decode(Family):
    name = "decode"
    directions = ("fwd",)
    rule = (f"a decode step (Lq <= {attention_decode.DECODE_MAX_LQ} against Lk >= "
            f"{attention_decode.DECODE_MIN_LK}): keys split across programs")

    def cannot(self, call):
        if call.rope is not None or call.dropout or call.softcapped or call.has_rep:
            return "it takes no rope, dropout, softcap or replace mask"
        Lq, Lk = call.sizes[2], call.sizes[5]
        # the family's bounds, compared as sizes (a guard each under dynamic shapes)
        if not (Lq <= attention_decode.DECODE_MAX_LQ and Lk >= attention_decode.DECODE_MIN_LK):
            return (f"Lq {hint(Lq)} > {attention_decode.DECODE_MAX_LQ} or Lk {hint(Lk)} < "
                    f"{attention_decode.DECODE_MIN_LK} (not a decode step)")
        return None

    def run(self, call, cfg, out_layout):
        out_buf, lse = _forward_buffers(call)
        return attention_decode.attention_decode_forward(
            call.q, call.k, call.v, call.bias, is_causal=call.is_causal, scale=call.scale,
            out_buf=out_buf, lse=lse)


class Small(Family):
    name = "small"
    periodic_bias = True
    rule = ""  # none: see declines

    def cannot(self, call):
        return attention_small.why_not(
            call.q, call.k, call.v, call.bias, dropout=call.dropout, softcap=call.softcapped,
            replace=call.has_rep, rope=call.rope is not None, need_dbias=call.need_dbias,
            deterministic=call.deterministic and call.direction == "bwd", direction=call.direction)

    def declines(self, call):
        # taken where the choice table measured it fastest (or forced), by no rule of its own
        return "taken only where measured faster (choice table) or forced"

    def config(self, call):
        if isinstance(call.config, attention_small.SmallConfig):
            return call.config
        measured = choice_table.small_config(call)
        # else None: the family's default (attention_small.default_config)
        return attention_small.SmallConfig(*measured) if measured else None

    def run(self, call, cfg, out_layout):
        q, k, v = call.q, call.k, call.v
        extra = dict(dropout_p=call.dropout_p, dropout_seed=call.dropout_seed, config=cfg)
        if call.direction == "fwd":
            out_buf, lse = _forward_buffers(call)
            attention_small.forward(q, k, v, call.bias, is_causal=call.is_causal, scale=call.scale,
                                    out_buf=out_buf, lse=lse, **extra)
            return out_buf.transpose(1, 2), lse
        g = attention_general.new_grads(call, dbias_shape=call.dbias_shape())
        attention_small.backward(call.dout, q, k, v, call.bias, call.out, call.lse,
                                 is_causal=call.is_causal, scale=call.scale, dq=g.dq, dk=g.dk,
                                 dv=g.dv, dbias=g.dbias, **extra)
        return g.dq, g.dk, g.dv, g.dbias


class Efficient(Family):
    name = "efficient"
    periodic_bias = True  # materialised over the batch into its own aligned buffer
    rule = ""  # none: see declines

    def cannot(self, call):
        return attention_efficient.why_not(
            call.q, call.k, call.v, call.bias, is_causal=call.is_causal, dropout=call.dropout,
            softcap=call.softcapped, replace=call.has_rep, rope=call.rope is not None,
            window=call.window or call.chunk, deterministic=call.deterministic and call.direction == "bwd")

    def declines(self, call):
        # taken where the choice table measured it fastest (or forced), by no rule of its own
        return "taken only where measured faster (choice table) or forced"

    def run(self, call, cfg, out_layout):
        if call.direction == "fwd":
            return attention_efficient.forward(call.q, call.k, call.v, call.bias, call.is_causal,
                                               call.scale, call.period, call.need_lse)
        q, k, v = (out_layout(t) for t in (call.q, call.k, call.v))  # (B, L, H, D): module doc
        dq, dk, dv, dbias = attention_efficient.backward(
            call.dout, q, k, v, call.bias, call.out, call.lse, call.is_causal, call.scale,
            call.need_dbias, call.period)
        return (*(in_layout_of(g, x) for g, x in zip((dq, dk, dv), call.inputs)), dbias)


class Flash(Family):
    name = "flash"
    directions = ("fwd",)
    rule = ""  # none: see declines

    def cannot(self, call):
        q = call.q
        if q.device.type != "cuda":
            return "not on CUDA"
        return attention_flash.why_not(
            q, call.k, call.v, call.bias, is_causal=call.is_causal,
            capability=attention_hopper.capability(q.device), dropout=call.dropout,
            softcap=call.softcapped, replace=call.has_rep, rope=call.rope is not None)

    def declines(self, call):
        # taken where the choice table measured it fastest (or forced), by no rule of its own
        return "taken only where measured faster (choice table) or forced"

    def run(self, call, cfg, out_layout):
        o, lse = attention_flash.forward(call.q, call.k, call.v, call.is_causal, call.scale)
        return out_layout(o), lse


def _gluon_band(call) -> Optional[str]:
    """Why the Gluon kernels cannot run the call's band (None: they can): chunks or documents (a
    sliding window they run: ``_gluon_window``)."""
    if call.chunk:
        return "it takes no chunks (the general kernels do)"
    if call.documents is not None:
        return "it takes no documents (the general kernels do)"
    return None


# The Gluon kernels took the sliding window where it was measured (stop 35, H100, bf16, benchmarks/
# window.py): head dim 128, window 4096, 16k-32k keys, forward + backward 0.64-0.70x the general
# kernels' time. A narrower window (gpt-oss's 128) or another head dim is not measured with them:
# the general kernels keep it, as before.
GLUON_WINDOW_MIN = 4096
GLUON_WINDOW_HEAD_DIMS = (128,)


def _gluon_window_measured(window: int, head_dim: int) -> bool:
    return window >= GLUON_WINDOW_MIN and head_dim in GLUON_WINDOW_HEAD_DIMS


def _gluon_window_declines(call) -> Optional[str]:
    """Why the rule leaves the call's sliding window to the general kernels (None: it does not)."""
    if call.window and not _gluon_window_measured(call.window, call.sizes[3]):
        return (f"a sliding window under {GLUON_WINDOW_MIN} keys or at a head dim other than "
                f"{GLUON_WINDOW_HEAD_DIMS[0]} is not measured with the Gluon kernels (the general kernels run it)")
    return None


def band_runners(direction: str, window: int, chunk: int, documents: bool, head_dim: int) -> frozenset:
    """The families of ``direction`` that run a band (a sliding window, chunks, documents) and take
    it by their rules: those with ``takes_window``, the Gluon kernels only for a window in their
    measured range. What the site choice times our op's band by."""
    names = {name for name, f in FAMILIES[direction].items() if f.takes_window}
    if chunk or documents or not _gluon_window_measured(window, head_dim):
        names.discard("gluon")
    return frozenset(names)


# The persistent Gluon forward (one program per SM walking the tiles; kernel "gluon_persistent")
# against the per-tile one on a sliding window (H100, bf16, D 128, window 4096, 2026-11-27, both
# through the op's launcher, benchmarks/window_forward.py): forward 0.98-0.99x at 4096
# and 8192 query tiles of 128 rows (B x Hq x Lq / 128: 32 heads at 16k, 16 and 32 heads at 32k),
# 1.08x at 2048 (16 heads at 16k). Causal without a window it ran 0.99-1.38x the per-tile kernel
# (whose launch order gives the long tiles first): taken for windows from this many tiles only.
GLUON_PERSISTENT_MIN_TILES = 4096


def _persistent_for_window(call, cfg: AttentionConfig) -> AttentionConfig:
    """The Gluon forward's tiles for the call: a sliding window over enough query tiles runs them in
    the persistent kernel (measured above); a config the caller gave is kept as it is."""
    if not call.window or call.config is not None:
        return cfg
    B, Hq, Lq, D, Hkv, Lk, Dv = call.sizes
    if hint(B) * hint(Hq) * -(-hint(Lq) // cfg.block_m) < GLUON_PERSISTENT_MIN_TILES:
        return cfg
    persistent = cfg._replace(kernel="gluon_persistent")  # its O staging buffer must fit beside the ring
    return persistent if attention_hopper.gluon_fwd.variant_fits(gluon_variant(persistent), D) else cfg


def _gluon_window(call) -> Optional[str]:
    """Why not the call's sliding window (with Lq <= Lk only); asked after the TMA checks, which
    refuse symbolic lengths."""
    if not call.window:
        return None
    return attention_hopper.gluon_fwd.why_not_window(call.sizes[2], call.sizes[5], call.is_causal, call.window)


class GluonForward(Family):
    name = "gluon"
    directions = ("fwd",)
    rule = "the tuning table's pick (warp-specialised Hopper kernel)"
    takes_window = True  # a sliding window only (_gluon_band)

    def cannot(self, call):
        if attention_hopper.gluon_failed(self.config(call)):
            return "its tiles did not fit this GPU"
        return (_gluon_band(call) or attention_hopper.why_not_tma(call)
                or attention_hopper.why_not_gluon_platform(call) or _gluon_window(call))

    def declines(self, call):
        return _not_picked(call, GLUON_FWD_KERNELS, "a Gluon kernel") or _gluon_window_declines(call)

    def config(self, call):
        entry = _entry(call)
        if entry.kernel not in GLUON_FWD_KERNELS:
            entry = attention_hopper.GLUON_FORWARD_DEFAULT
        return _persistent_for_window(call, entry)

    def run(self, call, cfg, out_layout):
        result = attention_hopper.run_forward_gluon(call, cfg, out_layout)
        if result is None:  # its tiles did not fit (remembered): choose again
            family, cfg, _ = choose(call)
            return family.run(call, cfg, out_layout)
        return result


class GluonBackward(Family):
    name = "gluon"
    directions = ("bwd",)
    rule = GluonForward.rule
    takes_window = True  # a sliding window only (_gluon_band)

    def cannot(self, call):
        if call.deterministic:
            return "deterministic mode (it adds dQ with atomics)"
        return (_gluon_band(call) or attention_hopper.why_not_gluon_bwd(call, self.config(call))
                or _gluon_window(call))

    def declines(self, call):
        return _not_picked(call, GLUON_BWD_KERNELS, "a Gluon kernel") or _gluon_window_declines(call)

    def config(self, call):
        entry = _entry(call)
        return entry if entry.kernel in GLUON_BWD_KERNELS else attention_hopper.GLUON_BACKWARD_DEFAULT

    def run(self, call, cfg, out_layout):
        return attention_hopper.run_backward_gluon(call, cfg)


class Tma(Family):
    name = "tma"
    rule = "the tuning table's pick (TMA tiles)"

    def cannot(self, call):
        if call.direction == "fwd":
            return attention_hopper.why_not_tma(call)
        if call.deterministic:
            return "deterministic mode (it adds dQ with atomics)"
        if call.need_dbias:
            return "it writes no dbias"
        why = attention_hopper.why_not_tma(call)
        if why is None and call.traced:
            why = attention_hopper.TMA_REDUCE_UNTRACEABLE
        return why

    def declines(self, call):
        # the forward is also what a Gluon entry falls back to
        kernels = ("tma",) + (GLUON_FWD_KERNELS if call.direction == "fwd" else ())
        return _not_picked(call, kernels, "the TMA kernel")

    def config(self, call):
        entry = _entry(call)
        if entry.kernel == "tma":
            return entry
        return attention_hopper.TMA_FORWARD_FALLBACK if call.direction == "fwd" else \
            attention_hopper.TMA_BACKWARD_DEFAULT

    def run(self, call, cfg, out_layout):
        if call.direction == "fwd":
            return attention_hopper.run_forward_tma(call, cfg, out_layout)
        return attention_hopper.run_backward_tma(call, cfg)


class TmaPair(Family):
    name = "tma_pair"
    directions = ("bwd",)
    rule = "the tuning table's pick (atomic-free pair, TMA tiles)"

    def cannot(self, call):
        if call.need_dbias:
            return "it writes no dbias"
        return attention_hopper.why_not_tma(call, attention_hopper.TMA_PAIR_HEAD_DIMS)

    def declines(self, call):
        return _not_picked(call, ("tma_pair",), "the TMA pair")

    def config(self, call):
        entry = _entry(call)
        return entry if entry.kernel == "tma_pair" else attention_hopper.TMA_PAIR_DEFAULT

    def run(self, call, cfg, out_layout):
        return attention_hopper.run_backward_tma_pair(call, cfg)


class TwoKernel(Family):
    name = "two_kernel"
    directions = ("bwd",)
    takes_window = True
    rule = "deterministic mode, or the tuning table's pick (atomic-free pair)"

    def cannot(self, call):
        return None

    def declines(self, call):
        if call.deterministic:
            return None
        why = _not_picked(call, PAIR_KERNELS, "the atomic-free pair")
        if why is None and call.rope is not None:
            return "with rope the atomic kernel runs (the pair was tuned on plain problems)"
        return why

    def config(self, call):
        entry = _entry(call)
        D, Dv = call.sizes[3], call.sizes[6]
        if call.config is not None:
            return entry
        if entry.kernel == "two_kernel" and call.rope is None:
            return entry
        if entry.kernel == "tma_pair":
            return tma_pair_fallback(D, Dv, call.q.dtype)
        return deterministic_backward_config(D, Dv, call.q.dtype)

    def run(self, call, cfg, out_layout):
        return attention_general.run_backward_pair(call, cfg)


class General(Family):
    name = "general"
    takes_window = True
    takes_sinks = True
    rule = "the general kernels (every problem)"

    def cannot(self, call):
        if call.direction == "bwd" and call.deterministic:
            return "deterministic mode (it adds dQ with atomics)"
        return None

    def declines(self, call):
        if call.direction == "bwd" and _entry(call).kernel in PAIR_KERNELS and call.rope is None:
            return f"the tuning table picks {_entry(call).kernel!r} for this key"
        return None

    def config(self, call):
        entry = _entry(call)
        if call.config is not None:
            return entry
        D, Dv = call.sizes[3], call.sizes[6]
        if entry.kernel != "general":
            heuristic = forward_config if call.direction == "fwd" else backward_config
            entry = fit_smem(call.direction, heuristic(D, Dv, call.q.dtype), D, Dv,
                             call.q.element_size(), call.bias_elt, call.q.device)
        return rope_adjust(call.direction, entry, call.q.dtype, call.rc)

    def run(self, call, cfg, out_layout):
        if call.direction == "fwd":
            out_buf, lse = _forward_buffers(call)
            return attention_general.run_forward(call, cfg, out_buf, lse)
        return attention_general.run_backward_atomic(call, cfg)


def _forward_buffers(call):
    """The forward's output buffer (B, Lq, Hq, Dv) (see attention.out_layout) and lse."""
    B, Hq, Lq, _, _, _, Dv = call.sizes
    dev = call.q.device
    return (host.empty((B, Lq, Hq, Dv), call.q.dtype, dev),
            host.empty((B, Hq, Lq), torch.float32, dev))


FAMILIES = {"fwd": {}, "bwd": {}}
for _f in (Cudnn(), Decode(), Small(), Efficient(), Flash(), GluonForward(), GluonBackward(), Tma(), TmaPair(),
           TwoKernel(), General()):
    for _d in _f.directions:
        FAMILIES[_d][_f.name] = _f
# The rules' order: the first family that can run a call takes it (where nothing was measured).
PRIORITY = {"fwd": ("cudnn", "decode", "small", "efficient", "flash", "gluon", "tma", "general"),
            "bwd": ("cudnn", "small", "efficient", "gluon", "tma_pair", "tma", "two_kernel", "general")}
NAMES = tuple(dict.fromkeys(PRIORITY["fwd"] + PRIORITY["bwd"]))

# --------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def forced(name: Optional[str]):
    """Every call inside runs family ``name`` (None: the normal choice); one that it cannot run
    raises ``FamilyError``. A direction without that family chooses as usual."""
    if name is not None and name not in NAMES:
        raise ValueError(f"unknown attention kernel family {name!r}; families: {', '.join(NAMES)}")
    old = getattr(_state, "forced", None)
    _state.forced = name
    try:
        yield
    finally:
        _state.forced = old


def forced_family() -> Optional[str]:
    """The family ``forced`` holds this thread to (None: none); part of the compile caches' key
    (passes.lowering_key): it decides the launches a traced op decomposes into."""
    return getattr(_state, "forced", None)


def _forced_name(call) -> Optional[str]:
    cfg = call.config
    if isinstance(cfg, attention_small.SmallConfig):
        return "small"
    if cfg is not None:
        kernel = AttentionConfig(*cfg).kernel
        if call.direction == "bwd" and call.deterministic and kernel in ("general", "tma"):
            return "two_kernel"  # the atomic-free form of the user's tiles
        return "gluon" if kernel in GLUON_FWD_KERNELS + GLUON_BWD_KERNELS else kernel
    from .. import settings

    name = forced_family() or settings.attention_family()
    if name is not None and name not in NAMES:
        raise ValueError(f"{settings.ATTENTION_FAMILY}={name!r} names no attention kernel family; "
                         f"families: {', '.join(NAMES)} (or auto)")
    return name if name is not None and name in FAMILIES[call.direction] else None


def reasons(call) -> dict:
    """Every family of the call's direction and why it cannot run the call (None: it can)."""
    return {name: f.why_not(call) for name, f in FAMILIES[call.direction].items()}


def explain(call) -> str:
    """The family ``choose`` takes for ``call`` and why, then every family's reason."""
    family, _, why = choose(call)
    rows = []
    for name, f in FAMILIES[call.direction].items():
        reason = f.why_not(call) or f.declines(call)
        rows.append(f"  {name}: {'chosen' if f is family else reason or 'could run it'}")
    return f"{call.describe()}: {family.name} ({why})\n" + "\n".join(rows)


def choose(call):
    """(family, its config, why) for ``call``: forced, measured, or by the rules (module doc).
    Traced (a compile), the choice is logged (TORCH_LOGS="+fuse_plugin")."""
    family, cfg, why = _choose(call)
    if call.traced:
        log.info("attention %s: %s (%s)", call.describe(), family.name, why)
    return family, cfg, why


def _choose(call):
    families = FAMILIES[call.direction]
    if isinstance(call.config, AttentionConfig):
        check_config(call.config, call.direction)
    name = _forced_name(call)
    if name is not None:
        family = families[name]
        why_not = family.why_not(call)
        if why_not is not None:
            lines = "\n".join(f"  {n}: {r or 'can run it'}" for n, r in reasons(call).items())
            raise FamilyError(f"fuse_plugin attention: the {name!r} kernel family cannot run this "
                              f"problem ({call.describe()}): {why_not}. Every family:\n{lines}")
        return family, family.config(call), "forced"
    measured, device = choice_table.costs_and_device(call)
    if measured:
        for name in choice_table.fastest_first(measured, device):
            family = families.get(name)
            if family is not None and family.why_not(call) is None:
                return family, family.config(call), choice_table.describe(measured, name, device)
    for name in PRIORITY[call.direction]:
        family = families[name]
        # the rule first: it is cheap (the table's pick), and a Hopper family's checks may stop a
        # traced launch (launch.Untraceable under dynamic shapes) where another family takes it
        if family.declines(call) is None and family.why_not(call) is None:
            return family, family.config(call), family.rule
    raise AssertionError("the general family runs every problem")


def check_config(cfg: AttentionConfig, direction: str) -> None:
    """A user-given config's errors (block sizes, its kernel for this direction)."""
    from .attention_config import KERNEL_VARIANTS, KERNELS_OF

    for blk in (cfg.block_m, cfg.block_n) + tuple(cfg.dq_tile or ())[:2]:
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"block sizes must be powers of 2 >= 16 (tl.dot, tl.arange): {cfg}")
    if cfg.dq_tile is not None and (cfg.kernel != "tma_pair" or len(cfg.dq_tile) != 4):
        raise ValueError(f"config {cfg}: dq_tile is (block_m, block_n, num_warps, num_stages) "
                         "of the 'tma_pair' kernel's dQ kernel")
    if cfg.kernel not in KERNEL_VARIANTS:
        raise ValueError(f"config kernel must be one of {KERNEL_VARIANTS}, got {cfg.kernel!r}")
    if cfg.kernel not in KERNELS_OF[direction]:
        raise ValueError(f"config {cfg}: {cfg.kernel!r} is not a {direction} kernel; the "
                         f"{direction} runs one of {KERNELS_OF[direction]}")
    if direction == "fwd" and cfg.kernel in GLUON_FWD_KERNELS and (cfg.block_m not in (128, 256)
                                                                  or cfg.block_n not in (64, 128)):
        raise ValueError(f"config {cfg}: the Gluon forward takes block_m 128 or 256 (two "
                         "warpgroups of 64 or 128 rows) and block_n 64 or 128")
