"""Dynamo's code cache and our switches: a graph compiled under one state of the plugin is not reused
under another.

Dynamo caches compiled code per code object, and a second `torch.compile` of another instance of
the same class finds the first one's entry: its guards (on the inputs, not on the module object)
pass, and the backends match by equality (`_TorchCompileInductorWrapper.__eq__`: the same mode and
options; `_TorchCompileWrapper.__eq__`: the same compiler and kwargs). Nothing of the plugin's
state is guarded. Measured on torch 2.13 (tests/test_dynamo_cache.py): a model compiled by plain
`torch.compile` after `import fuse_plugin`, then a second instance compiled inside
`fuse_plugin.disabled()`, ran our op in the second - the opt-out ignored; likewise a switch
(FUSE_PLUGIN_SITE_CHOICE, ...) changed between two compiles, or `fuse_plugin.uninstall()`.

So each backend wrapper that can run our rewrite is stamped, at its first compile, with the state
it compiled under (`settings.key()`; for the Inductor wrapper also whether the automatic patch is
installed, without which it compiles as stock), and two such wrappers are equal only where their
stamps equal the state now (the state a compile now would see). A wrapper not yet stamped stands
for the state now. A compiled object's own entries stay its own (Dynamo compares a backend with
itself by identity first): as documented, the state that counts is that of the call that compiles.
"""
from __future__ import annotations

import torch

from . import settings

_NAME = "fuse_plugin"  # backend.NAME (backend.py imports this module's users)


def _inductor_state() -> str:
    from . import autopatch

    return f"autopatch,{settings.key()}" if autopatch.installed() else "stock"


def _backend_state() -> str:
    return settings.key()


def _kinds():
    """(wrapper class, whether an instance can run our rewrite, the state it would compile under)."""
    out = []
    inductor = getattr(torch, "_TorchCompileInductorWrapper", None)
    if inductor is not None:
        out.append((inductor, lambda w: True, _inductor_state))
    wrapper = getattr(torch, "_TorchCompileWrapper", None)
    if wrapper is not None:
        out.append((wrapper, lambda w: getattr(w, "compiler_name", None) == _NAME, _backend_state))
    return out


def install() -> None:
    """Stamp and compare the wrappers (idempotent; at `import fuse_plugin`)."""
    for cls, ours, state in _kinds():
        if getattr(cls, "_fuse_plugin_stamped", False):
            continue
        _patch(cls, ours, state)


def _patch(cls, ours, state) -> None:
    call, eq = cls.__call__, cls.__eq__

    def __call__(self, *args, **kwargs):
        if ours(self) and getattr(self, "_fuse_plugin_state", None) is None:
            self._fuse_plugin_state = state()
        return call(self, *args, **kwargs)

    def __eq__(self, other):
        same = eq(self, other)
        if same is not True or not ours(self):
            return same
        now = state()
        return all(getattr(w, "_fuse_plugin_state", now) == now for w in (self, other))

    __call__.__wrapped__, __eq__.__wrapped__ = call, eq
    cls.__call__, cls.__eq__ = __call__, __eq__
    cls._fuse_plugin_stamped = True
