"""Switches of the rewrite, per thread (part of the FX-graph-cache key, see autopatch.uuid)."""
from __future__ import annotations

import contextlib
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


def key() -> str:
    """What of the settings changes the rewrite's output."""
    return f"enabled={rewrite_enabled()}"
