"""Automatic patch: plain `torch.compile(model)` rewrites after `import fuse_plugin`.

Installs an Inductor `pre_grad_custom_pass` (it runs on the Dynamo graph before AOTAutograd, so
before Inductor's own fuse_attention) that chains whatever pass the user had set, and a
`joint_custom_pre_pass` that keeps Inductor's fuse_attention patterns off in the compiles the plugin
rewrites (inductor_attention.py: the plugin owns attention there). Opt out with
`FUSE_PLUGIN_AUTOPATCH=0` before the import, `fuse_plugin.uninstall()`, or `fuse_plugin.disabled()`
around the call that compiles. torch 2.11 takes a single callable in the hook, so chaining is ours
(the passes themselves: passes.py, inductor_attention.py).
"""
from __future__ import annotations

from torch._inductor import config as inductor_config

from . import settings
from .inductor_attention import AttentionGatePass
from .passes import FusePluginPass, suppressed  # noqa: F401  (suppressed: backend.py's, from here)


def installed() -> bool:
    return isinstance(inductor_config.pre_grad_custom_pass, FusePluginPass)


def install() -> None:
    """Install the automatic patch (idempotent); keeps any pass already set, run after ours. Also
    sets the joint-graph pass that keeps Inductor's own attention patterns out of our compiles
    (inductor_attention.py)."""
    if not installed():
        inductor_config.pre_grad_custom_pass = FusePluginPass(inductor_config.pre_grad_custom_pass)
    if not isinstance(inductor_config.joint_custom_pre_pass, AttentionGatePass):
        inductor_config.joint_custom_pre_pass = AttentionGatePass(inductor_config.joint_custom_pre_pass)


def uninstall() -> None:
    """Remove the automatic patch, restoring the passes that were set before it."""
    current = inductor_config.pre_grad_custom_pass
    if isinstance(current, FusePluginPass):
        inductor_config.pre_grad_custom_pass = current.chained
    joint = inductor_config.joint_custom_pre_pass
    if isinstance(joint, AttentionGatePass):
        inductor_config.joint_custom_pre_pass = joint.chained


def install_from_env() -> None:
    """At `import fuse_plugin`: install unless FUSE_PLUGIN_AUTOPATCH is off (settings.py)."""
    if settings.autopatch():
        install()
