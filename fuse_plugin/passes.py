"""Our passes in Inductor's hooks, and what they share.

`FusePluginPass` is the `pre_grad_custom_pass` of our compiles: the rewrite (patterns/) on the
Dynamo graph, before AOTAutograd. The automatic patch sets it globally (autopatch.py), the backend
per compile (backend.py, where the graph is rewritten already and the pass is idle: `suppressed`).
inductor_attention.py's `AttentionGatePass` is the `joint_custom_pre_pass` beside it. torch 2.11
takes a single callable in these hooks, so each of our passes runs the pass that was set before it
(`chained`), and its cache key (`uuid`) covers that pass's too.

The modules stand in one line: passes ← inductor_attention ← autopatch, backend (no import back).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import settings

_PACKAGE = Path(__file__).resolve().parent
_suppress = threading.local()


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of the package's code and launch tables: a change to a pattern, a launcher or the
    table invalidates cached graphs (which hold the launches the ops decomposed into)."""
    h = hashlib.sha256()
    for path in sorted([*_PACKAGE.rglob("*.py"), *_PACKAGE.rglob("*.json")]):
        h.update(path.relative_to(_PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def lowering_key() -> str:
    """What decides the graph Inductor compiles besides its input graph: the settings
    (settings.key(): the rewrite's switches, and what the ops' launches read when traced, e.g. the
    padding skip, the tables, the family) and the family ``registry.forced`` holds this thread to.
    Both our passes put it in their uuid: the compile caches (AOTAutograd's and Inductor's FX
    graph cache) must not hand a graph traced under other settings to this compile. torch 2.11
    hashes the joint pass's uuid but, where the pre-grad pass runs before the lookup, not the
    pre-grad pass's (measured: a BERT compiled with the padding skip on, after the same model
    with it off in one process, ran the off graph's launches; H100, stop 33)."""
    from .kernels import registry

    return f"{settings.key()},forced={registry.forced_family()}"


def get_custom_graph_passes(hook: Any) -> tuple:
    """The passes held by an Inductor hook: torch 2.13 allows a list, torch 2.11 one callable."""
    if hook is None:
        return ()
    return tuple(hook) if isinstance(hook, (list, tuple)) else (hook,)


def chained_uuid(parts: list, chained: Any) -> Optional[str]:
    """The cache key of one of our passes: its own ``parts`` and the uuid of each pass it chains;
    None (no caching, as Inductor does) when a chained pass has no uuid."""
    parts = list(parts)
    for p in get_custom_graph_passes(chained):
        u = p.uuid() if hasattr(p, "uuid") else None
        if u is None:
            return None
        parts.append(repr(u))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


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
            if settings.static_launch_workers():  # a user's static-launch option, also for our
                from .kernels import static_launch  # kernels the compile workers build

                static_launch.install()
            if torch.distributed.is_available():  # under PyTorch's context_parallel(...): to the ring
                from .ops.context_parallel import route_if_distributed

                route_if_distributed(gm)
        for p in get_custom_graph_passes(self.chained):
            p(graph)

    def uuid(self) -> Any:
        if _context_parallel_on():
            # None: this pass then runs before AOTAutograd's cache lookup (Inductor's "early" timing),
            # so a cache hit cannot skip the routing to the ring and the Dynamo guard it installs
            return None
        return chained_uuid([source_hash(), lowering_key(), f"suppressed={getattr(_suppress, 'on', False)}"],
                            self.chained)


def _context_parallel_on() -> bool:
    """Is PyTorch's context_parallel(...) active (ops/context_parallel.torch_context_parallel)?"""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from .ops.context_parallel import torch_context_parallel

    return torch_context_parallel() is not None


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


@contextlib.contextmanager
def suppressed():
    """The backend already rewrote the graph: the pre-grad pass must not run again."""
    old = getattr(_suppress, "on", False)
    _suppress.on = True
    try:
        yield
    finally:
        _suppress.on = old
