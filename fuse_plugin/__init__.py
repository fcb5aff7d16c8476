"""fuse_plugin: a torch.compile plugin that replaces unfused attention and rotary-embedding
subgraphs with fused custom ops (Triton kernels on CUDA).

Three ways in:
  torch.compile(model, backend="fuse_plugin")      # the named backend (entry point, or registered
                                                    # by `import fuse_plugin` where there is none)
  import fuse_plugin; torch.compile(model)          # automatic patch (FUSE_PLUGIN_AUTOPATCH=0 opts out)
  fuse_plugin.explain(model, *inputs)               # what would be fused, and why not

The ops: fuse_plugin.attention, apply_rotary, apply_rotary_qk (api.py), torch.ops.fuse_plugin.*.
Switches (environment variables): settings.py.
"""
from __future__ import annotations

import warnings as _warnings

with _warnings.catch_warnings():
    # torch warns when it is imported without numpy installed ("Failed to initialize NumPy"; its
    # tensor <-> ndarray conversions need it). Nothing here uses numpy, so an install without it
    # is complete: imported through us, torch's import stays quiet about it.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch as _torch  # noqa: F401

from . import ops  # noqa: F401  (registers torch.ops.fuse_plugin.*)
from .api import apply_rotary, apply_rotary_qk, attention
from .autopatch import install, installed, uninstall
from .explain import explain
from .hf import register_hf
from .settings import disabled

__all__ = [
    "attention",
    "apply_rotary",
    "apply_rotary_qk",
    "explain",
    "disabled",
    "install",
    "uninstall",
    "installed",
    "register_hf",
]
__version__ = "0.1.0"

from .autopatch import install_from_env as _install_from_env
from .backend import register_name as _register_name
from .dynamo_cache import install as _key_dynamo_cache

_install_from_env()
_key_dynamo_cache()  # a graph compiled under one state of the plugin is not reused under another
_register_name()  # backend="fuse_plugin" without the entry point (source tree on PYTHONPATH)
