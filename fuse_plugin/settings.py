"""Switches of the rewrite, per thread (part of the FX-graph-cache key, see autopatch.uuid)."""
from __future__ import annotations

import contextlib
import os
import threading

_state = threading.local()


def rewrite_enabled() -> bool:
    return getattr(_state, "disabled", 0) == 0


@contextlib.contextmanager
def disabled():
    """No rewrite while this is active: `with fuse_plugin.disabled(): compiled(x)` around the first
    call of a compiled model (the call that compiles) leaves its graphs as the user wrote them."""
    _state.disabled = getattr(_state, "disabled", 0) + 1
    try:
        yield
    finally:
        _state.disabled -= 1


def rope_attention_enabled() -> bool:
    """Fold rotary q+k pairs into their attention (`rope_attention`)? Off unless
    `FUSE_PLUGIN_ROPE_ATTENTION=1`: on the H100 the folded kernel still runs about 2x slower than
    rotary_qk + attention (benchmarks/RESULTS.md), so the unfused pair is the default."""
    return os.environ.get("FUSE_PLUGIN_ROPE_ATTENTION", "0") == "1"


def key() -> str:
    """What of the settings changes the compiled graph: the rewrite's switches, whether the ops
    decompose into their launches (ops/inductor.py) and the launch-config table they read."""
    return (f"enabled={rewrite_enabled()},rope_attention={rope_attention_enabled()},"
            f"inductor_launch={os.environ.get('FUSE_PLUGIN_INDUCTOR_LAUNCH', '1')},"
            f"table={os.environ.get('FUSE_PLUGIN_ATTENTION_TABLE', '')}")
