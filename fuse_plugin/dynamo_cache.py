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

import os

import torch
from torch._inductor import config as inductor_config

from . import settings
from .passes import FusePluginPass

_NAME = "fuse_plugin"  # backend.NAME (backend.py imports this module's users)


def _switches() -> tuple:
    """A cheap fingerprint of everything ``settings.key()`` reads: the rewrite's on/off state of
    this thread and the raw values of the FUSE_PLUGIN_* variables. The state is compared at each
    Dynamo cache lookup that meets another compiled object's entry (every call of a layer
    compiled on its own beside others of its class): settings.key() cost ~10 us there, the whole
    comparison with this memo ~4 us (CI's CPU, torch 2.13), against ~1 us for torch's own."""
    data = getattr(os.environ, "_data", None)  # (os.environ.get encodes every name: ~1 us each)
    if _ENCODED and isinstance(data, dict):
        values = tuple(map(data.get, _ENCODED))
    else:
        values = tuple(map(os.environ.get, _NAMES))
    return settings.rewrite_enabled(), values


_NAMES = tuple(getattr(settings, n) for n in dir(settings)
               if n.isupper() and isinstance(getattr(settings, n), str) and getattr(settings, n).startswith("FUSE_PLUGIN_"))
# POSIX: os.environ keeps its values in ``_data`` under the names encoded (CPython); elsewhere the
# plain lookup
_ENCODED = tuple(os.fsencode(n) for n in _NAMES) if os.name == "posix" else ()
_memo: dict = {}


def _key() -> str:
    fp = _switches()
    key = _memo.get(fp)
    if key is None:
        if len(_memo) > 64:
            _memo.clear()
        key = _memo[fp] = settings.key()
    return key


def _inductor_state() -> str:
    # autopatch.installed(), inline
    return f"autopatch,{_key()}" if isinstance(inductor_config.pre_grad_custom_pass, FusePluginPass) else "stock"


def _backend_state() -> str:
    return _key()


def _kinds():
    """(wrapper class, whether an instance can run our rewrite, the state it would compile under)."""
    out = []
    inductor = getattr(torch, "_TorchCompileInductorWrapper", None)
    if inductor is not None:
        out.append((inductor, lambda w: True, _inductor_state))
    wrapper = getattr(torch, "_TorchCompileWrapper", None)
    if wrapper is not None:
        from .backend import fuse_plugin_backend

        out.append((wrapper, lambda w: getattr(w, "compiler_name", None) == _NAME
                    or getattr(w, "compiler_fn", None) is fuse_plugin_backend, _backend_state))
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
