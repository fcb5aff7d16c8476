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
    """Fold rotary q+k pairs into their attention (`rope_attention`)? `FUSE_PLUGIN_ROPE_ATTENTION=0`
    keeps them as rotary_qk + attention (to compare the two)."""
    return os.environ.get("FUSE_PLUGIN_ROPE_ATTENTION", "1") != "0"


def key() -> str:
    """What of the settings changes the rewrite's output."""
    return f"enabled={rewrite_enabled()},rope_attention={rope_attention_enabled()}"
