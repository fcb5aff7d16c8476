"""The named backend: `torch.compile(model, backend="fuse_plugin")`.

Rewrites the Dynamo graph (before AOTAutograd, so the ops' registered autograd gives training),
then hands it to Inductor's `compile_fx` with the usual `mode=` / `options=` of the inductor backend,
with Inductor's own attention patterns off (inductor_attention.py).
"""
from __future__ import annotations

from typing import Any

import torch

from . import autopatch, settings
from .kernels import static_launch
from .kernels.launch import STATIC_LAUNCH_OPTION
from .patterns import rewrite

NAME = "fuse_plugin"
_ENTRY_POINT_GROUP = "torch_dynamo_backends"


def fuse_plugin_backend(gm: torch.fx.GraphModule, example_inputs: list, *, mode: str | None = None, options: dict[str, Any] | None = None):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    config_patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        config_patches.update(list_mode_options(mode))
    config_patches.update(options or {})
    if (settings.static_launch() and hasattr(torch._inductor.config, STATIC_LAUNCH_OPTION)
            and not config_patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs)
            and not holds_user_triton_kernel(gm)):
        # our traced kernels through Inductor's static launcher too (settings.static_launch); not
        # under CUDA graphs, whose replay launches nothing from the host; an option the user gave wins
        config_patches.setdefault(STATIC_LAUNCH_OPTION, True)
    if config_patches.get(STATIC_LAUNCH_OPTION) and settings.static_launch_workers():
        static_launch.install()  # the option also for our kernels a compile worker builds
    from torch._inductor import config

    if settings.rewrite_enabled():
        # under the compile's options, as the automatic patch's pass runs inside compile_fx: the
        # choice reads whether the graph is replayed as a CUDA graph (patterns/choice.py)
        with config.patch(config_patches):
            rewrite(gm)
            if torch.distributed.is_available():  # under PyTorch's context_parallel(...): our sites to the ring
                from .ops.context_parallel import route_if_distributed

                route_if_distributed(gm)

    from .inductor_attention import AttentionGatePass

    # Our pre-grad pass (idle here, see below) carries the cache key of our code and settings, which
    # Inductor's and AOTAutograd's caches must see even with the automatic patch off, and it marks
    # the compile as ours (inductor_attention.owns_attention); a pass the user gave runs after it.
    pre_grad = config_patches.get("pre_grad_custom_pass", config.pre_grad_custom_pass)
    if not isinstance(pre_grad, autopatch.FusePluginPass):
        config_patches["pre_grad_custom_pass"] = autopatch.FusePluginPass(pre_grad)
    # Inductor's own attention patterns stay off in this compile (what we left is not attention).
    joint = config_patches.get("joint_custom_pre_pass", config.joint_custom_pre_pass)
    if not isinstance(joint, AttentionGatePass):
        config_patches["joint_custom_pre_pass"] = AttentionGatePass(joint)
    # The graph is rewritten already: keep the automatic pre-grad pass from running again.
    with autopatch.suppressed():
        return compile_fx(gm, example_inputs, config_patches=config_patches)


def holds_user_triton_kernel(gm: torch.fx.GraphModule) -> bool:
    """Does the Dynamo graph launch a Triton kernel of the user's (a `wrap_triton` / `@triton.jit`
    call, or a `torch.library.triton_op` not ours)? Inductor's option for launching user kernels
    statically would take theirs too, and its launcher has no type for some of their arguments
    (torch 2.13 raises a KeyError mid-compile on a TMA descriptor), so such a graph keeps
    Triton's launcher for every user kernel, ours included."""
    from torch._higher_order_ops.triton_kernel_wrap import (
        triton_kernel_wrapper_functional,
        triton_kernel_wrapper_mutation,
    )

    try:
        from torch._library.triton import triton_ops_to_kernels
    except ImportError:  # a torch without triton_op's registry: its ops cannot be told apart
        triton_ops_to_kernels = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (triton_kernel_wrapper_mutation, triton_kernel_wrapper_functional):
            return True
        name = getattr(node.target, "_schema", None) and node.target._schema.name  # "ns::op"
        if name and name in triton_ops_to_kernels and not name.startswith(NAME + "::"):
            return True
    return False


def _entry_point_declared() -> bool:
    """Does an installed distribution declare `fuse_plugin` in the `torch_dynamo_backends` group?
    (`pip install` of this package does, through pyproject.toml; a source tree on PYTHONPATH does not.)"""
    from importlib.metadata import entry_points

    try:
        return NAME in entry_points(group=_ENTRY_POINT_GROUP).names
    except Exception:  # a broken distribution's metadata: treat as absent, we register ourselves
        return False


def register_name() -> None:
    """Make `backend="fuse_plugin"` resolve when the package was imported without its entry point
    (a source tree on PYTHONPATH, a vendored copy).

    Dynamo's registry (torch/_dynamo/backends/registry.py, the same on torch 2.11 and 2.13) keeps
    names in `_BACKENDS` (name -> entry point or None) and loaded functions in `_COMPILER_FNS`;
    `register_backend` raises "duplicate name" for a name already loaded, and `lookup_backend` calls
    `register_backend(entry_point.load(), name)` itself when it resolves an entry point — and that
    load imports this package. So we register only when no entry point declares the name (else
    Dynamo's own lookup would find ours loaded and fail on the duplicate), and never twice."""
    from torch._dynamo.backends import registry

    if NAME in registry._COMPILER_FNS or _entry_point_declared():
        return
    registry.register_backend(compiler_fn=fuse_plugin_backend, name=NAME)
