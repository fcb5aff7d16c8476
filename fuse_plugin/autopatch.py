"""Automatic patch: plain `torch.compile(model)` rewrites after `import fuse_plugin`.

Installs an Inductor `pre_grad_custom_pass` (it runs on the Dynamo graph before AOTAutograd, so
before Inductor's own fuse_attention) that chains whatever pass the user had set, and a
`joint_custom_pre_pass` that keeps Inductor's fuse_attention patterns off in the compiles the plugin
rewrites (inductor_attention.py: the plugin owns attention there). Opt out with
`FUSE_PLUGIN_AUTOPATCH=0` before the import, `fuse_plugin.uninstall()`, or `fuse_plugin.disabled()`
around the call that compiles. torch 2.11 takes a single callable in the hook, so chaining is ours.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

from torch import fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import settings

_PACKAGE = Path(__file__).resolve().parent
_suppress = threading.local()


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of the package's code and launch tables: a change to a pattern, a launcher or the
    table invalidates cached graphs (which hold the launches the ops decomposed into)."""
    h = hashlib.sha256()
    for path in sorted([*_PACKAGE.rglob("*.py"), *_PACKAGE.rglob("*.json")]):
        h.update(path.relative_to(_PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def get_custom_graph_passes(hook: Any) -> tuple:
    """The passes held by an Inductor hook: torch 2.13 allows a list, torch 2.11 one callable."""
    if hook is None:
        return ()
    return tuple(hook) if isinstance(hook, (list, tuple)) else (hook,)


class FusePluginPass(CustomGraphPass):
    """Our rewrite, then the pass that was installed before us (if any)."""

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module if isinstance(graph, fx.Graph) else graph
        if (settings.rewrite_enabled() and not getattr(_suppress, "on", False) and gm is not None
                and not _inductor_subgraph_call()):
            from .patterns import rewrite

            rewrite(gm)
        for p in get_custom_graph_passes(self.chained):
            p(graph)

    def uuid(self) -> Any:
        parts = [_source_hash(), settings.key(), f"suppressed={getattr(_suppress, 'on', False)}"]
        for p in get_custom_graph_passes(self.chained):
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None  # an un-hashable chained pass: no caching, as Inductor would do
            parts.append(repr(u))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _inductor_subgraph_call() -> bool:
    """Is Inductor running the pre-grad passes on a subgraph of a higher-order op? torch 2.13's
    `_recursive_pre_grad_passes` (compile_fx.py) calls them on each subgraph first, then on the root.
    The root's rewrite walks the subgraphs itself, knowing which op holds each (a `cond` branch in
    training must be left alone, see patterns/__init__.py), so a call on a subgraph does nothing.
    Two frames of that function on the stack mean a subgraph; a torch without it: never."""
    depth, frame = 0, sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_recursive_pre_grad_passes" and code.co_filename.endswith("compile_fx.py"):
            depth += 1
        frame = frame.f_back
    return depth >= 2


def installed() -> bool:
    return isinstance(inductor_config.pre_grad_custom_pass, FusePluginPass)


def install() -> None:
    """Install the automatic patch (idempotent); keeps any pass already set, run after ours. Also
    sets the joint-graph pass that keeps Inductor's own attention patterns out of our compiles
    (inductor_attention.py)."""
    from .inductor_attention import AttentionGatePass

    if not installed():
        inductor_config.pre_grad_custom_pass = FusePluginPass(inductor_config.pre_grad_custom_pass)
    if not isinstance(inductor_config.joint_custom_pre_pass, AttentionGatePass):
        inductor_config.joint_custom_pre_pass = AttentionGatePass(inductor_config.joint_custom_pre_pass)


def uninstall() -> None:
    """Remove the automatic patch, restoring the passes that were set before it."""
    from .inductor_attention import AttentionGatePass

    current = inductor_config.pre_grad_custom_pass
    if isinstance(current, FusePluginPass):
        inductor_config.pre_grad_custom_pass = current.chained
    joint = inductor_config.joint_custom_pre_pass
    if isinstance(joint, AttentionGatePass):
        inductor_config.joint_custom_pre_pass = joint.chained


def install_from_env() -> None:
    if os.environ.get("FUSE_PLUGIN_AUTOPATCH", "1").strip().lower() not in ("0", "false", "no", "off"):
        install()


@contextlib.contextmanager
def suppressed():
    """The backend already rewrote the graph: the pre-grad pass must not run again."""
    old = getattr(_suppress, "on", False)
    _suppress.on = True
    try:
        yield
    finally:
        _suppress.on = old
