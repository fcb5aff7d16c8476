"""The named backend: `torch.compile(model, backend="fuse_plugin")`.

Rewrites the Dynamo graph (before AOTAutograd, so the ops' registered autograd gives training),
then hands it to Inductor's `compile_fx` with the usual `mode=` / `options=` of the inductor backend.
"""
from __future__ import annotations

from typing import Any

import torch

from . import autopatch, settings
from .patterns import rewrite


def fuse_plugin_backend(gm: torch.fx.GraphModule, example_inputs: list, *, mode: str | None = None, options: dict[str, Any] | None = None):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    config_patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        config_patches.update(list_mode_options(mode))
    config_patches.update(options or {})
    if settings.rewrite_enabled():
        rewrite(gm)
    if "pre_grad_custom_pass" not in config_patches and not autopatch.installed():
        # Our pass (idle here, see below) carries the cache key of our code and settings, which
        # Inductor's and AOTAutograd's caches must see even with the automatic patch off.
        from torch._inductor import config

        config_patches["pre_grad_custom_pass"] = autopatch.FusePluginPass(config.pre_grad_custom_pass)
    # The graph is rewritten already: keep the automatic pre-grad pass from running again.
    with autopatch.suppressed():
        return compile_fx(gm, example_inputs, config_patches=config_patches)
