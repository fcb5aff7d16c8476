"""Dynamo's code cache keyed on the plugin's state (fuse_plugin/dynamo_cache.py).

Two instances of one class share Dynamo's cache (same code object, guards that pass); without the
stamp a second instance compiled inside `fuse_plugin.disabled()`, under another switch, or after
`uninstall()` ran the first one's graph (our op where the user opted out, or the reverse).
"""
import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import profile

import fuse_plugin
from fuse_plugin import dynamo_cache


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")  # on the CPU the choice would leave the site
    torch._dynamo.reset()
    was = fuse_plugin.installed()
    fuse_plugin.install()
    yield
    if not was:
        fuse_plugin.uninstall()
    torch._dynamo.reset()


Q = torch.randn(1, 2, 16, 16)


def runs_our_op(fn) -> bool:
    with profile() as prof:
        fn(Q, Q, Q)
    return any(e.name.startswith("fuse_plugin::") for e in prof.events())


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_disabled_is_honoured_for_a_second_instance():
    a = torch.compile(Attention())
    assert runs_our_op(a)
    before = graphs()
    with fuse_plugin.disabled():
        b = torch.compile(Attention())
        assert not runs_our_op(b)  # was: a's graph, our op
    assert graphs() == before + 1
    assert runs_our_op(a) and not runs_our_op(b)  # each keeps its own entry, outside disabled() too
    assert graphs() == before + 1  # and nothing recompiled


def test_reverse_order_and_same_state_reuses():
    with fuse_plugin.disabled():
        a = torch.compile(Attention())
        assert not runs_our_op(a)
    b = torch.compile(Attention())
    assert runs_our_op(b)
    before = graphs()
    c = torch.compile(Attention())  # the same state as b's compile: Dynamo's entry reused, as stock
    assert runs_our_op(c) and graphs() == before


def test_a_switch_changed_between_compiles(monkeypatch):
    a = torch.compile(Attention(), backend="fuse_plugin")
    assert runs_our_op(a)
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "inductor")
    b = torch.compile(Attention(), backend="fuse_plugin")
    assert not runs_our_op(b)


def test_the_backend_function_passed_itself(monkeypatch):
    from fuse_plugin.backend import fuse_plugin_backend

    a = torch.compile(Attention(), backend=fuse_plugin_backend)
    assert runs_our_op(a)
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "inductor")
    b = torch.compile(Attention(), backend=fuse_plugin_backend)
    assert not runs_our_op(b)


def test_uninstall_between_compiles():
    a = torch.compile(Attention())
    assert runs_our_op(a)
    fuse_plugin.uninstall()
    b = torch.compile(Attention())
    assert not runs_our_op(b)


def test_stock_wrappers_are_left_alone_without_the_patch():
    """Without the automatic patch, the Inductor wrapper compiles as stock whatever the switches:
    a switch change does not split Dynamo's cache then."""
    fuse_plugin.uninstall()
    a = torch.compile(Attention())
    assert not runs_our_op(a)
    before = graphs()
    with fuse_plugin.disabled():
        b = torch.compile(Attention())
        assert not runs_our_op(b)
    assert graphs() == before


def test_install_is_idempotent():
    call = torch._TorchCompileInductorWrapper.__call__
    dynamo_cache.install()
    assert torch._TorchCompileInductorWrapper.__call__ is call
