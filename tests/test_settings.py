"""fuse_plugin/settings.py: every switch parsed one way (the spellings, the errors that name the
switch), the cache key covering what changes a compiled graph, the switch table documented in one
place and matching the switches the repo reads, and the package reading them only through settings."""
import os
import re
import sys
from pathlib import Path

import pytest

import fuse_plugin
from fuse_plugin import autopatch, settings
from fuse_plugin.ops import _dispatch, inductor

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fuse_plugin"

BOOLEANS = [  # (switch, reader, default)
    (settings.AUTOPATCH, settings.autopatch, True),
    (settings.INDUCTOR_LAUNCH, settings.inductor_launch, True),
    (settings.ROPE_ATTENTION, settings.rope_attention_enabled, False),
    (settings.STATIC_LAUNCH, settings.static_launch, True),
    (settings.STATIC_LAUNCH_WORKERS, settings.static_launch_workers, True),
]
ALL_SWITCHES = (settings.AUTOPATCH, settings.INDUCTOR_LAUNCH, settings.ROPE_ATTENTION, settings.CPU_KERNELS,
                settings.ATTENTION_TABLE, settings.CHOICE_TABLE, settings.ATTENTION_FAMILY, settings.SITE_CHOICE,
                settings.STATIC_LAUNCH, settings.STATIC_LAUNCH_WORKERS, settings.CPU_SITES)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for env in ALL_SWITCHES:
        monkeypatch.delenv(env, raising=False)


@pytest.mark.parametrize("env, read, default", BOOLEANS)
def test_booleans_take_one_set_of_spellings(monkeypatch, env, read, default):
    assert read() is default  # unset
    for blank in ("", "  "):
        monkeypatch.setenv(env, blank)
        assert read() is default
    for value in ("1", "true", "True", "ON", "yes", " Yes "):
        monkeypatch.setenv(env, value)
        assert read() is True, value
    for value in ("0", "false", "FALSE", "off", "No", " no\n"):
        monkeypatch.setenv(env, value)
        assert read() is False, value
    for bad in ("2", "maybe", "enabled", "-1", "y", "t"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=f"{env} must be one of 1, true, on, yes, 0, false, off, no"):
            read()


def test_every_previously_valid_spelling_keeps_its_meaning(monkeypatch):
    """INDUCTOR_LAUNCH took 0/1/true/false/on/off/yes/no; AUTOPATCH was off for 0/false/no/off
    (any case); ROPE_ATTENTION was on for "1" and off unset or "0"."""
    for value, on in (("0", False), ("1", True), ("false", False), ("true", True), ("off", False),
                      ("on", True), ("no", False), ("yes", True)):
        monkeypatch.setenv(settings.INDUCTOR_LAUNCH, value)
        assert inductor.enabled() is on
    for value in ("0", "false", "no", "off", "OFF", " False "):
        monkeypatch.setenv(settings.AUTOPATCH, value)
        assert settings.autopatch() is False
    monkeypatch.setenv(settings.ROPE_ATTENTION, "1")
    assert settings.rope_attention_enabled()
    monkeypatch.setenv(settings.ROPE_ATTENTION, "0")
    assert not settings.rope_attention_enabled()


def test_inductor_launch_error_names_the_switch(monkeypatch):
    monkeypatch.setenv(settings.INDUCTOR_LAUNCH, "maybe")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_INDUCTOR_LAUNCH"):
        inductor.enabled()
    monkeypatch.setenv(settings.INDUCTOR_LAUNCH, "0")
    assert inductor.why_not_decomposed((), (), {}) == "FUSE_PLUGIN_INDUCTOR_LAUNCH=0"


def test_autopatch_switch_at_import(monkeypatch):
    try:
        fuse_plugin.uninstall()
        monkeypatch.setenv(settings.AUTOPATCH, "Off")
        autopatch.install_from_env()
        assert not fuse_plugin.installed()
        monkeypatch.setenv(settings.AUTOPATCH, "sometimes")
        with pytest.raises(ValueError, match="FUSE_PLUGIN_AUTOPATCH must be one of"):
            autopatch.install_from_env()
        monkeypatch.setenv(settings.AUTOPATCH, "yes")
        autopatch.install_from_env()
        assert fuse_plugin.installed()
    finally:
        fuse_plugin.install()


def test_choices(monkeypatch):
    assert settings.site_choice() == "auto" and settings.cpu_kernels() == "reference"
    monkeypatch.setenv(settings.SITE_CHOICE, " Inductor ")
    assert settings.site_choice() == "inductor"
    monkeypatch.setenv(settings.SITE_CHOICE, "sometimes")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_SITE_CHOICE must be one of auto, ours, inductor"):
        settings.site_choice()
    assert settings.cpu_sites() == "auto"
    monkeypatch.setenv(settings.CPU_SITES, " OURS")
    assert settings.cpu_sites() == "ours"
    monkeypatch.setenv(settings.CPU_SITES, "always")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_CPU_SITES must be one of auto, ours"):
        settings.cpu_sites()
    monkeypatch.setenv(settings.CPU_KERNELS, "REFERENCE")
    assert settings.cpu_kernels() == "reference" and not _dispatch.cpu_runs_triton()
    monkeypatch.setenv(settings.CPU_KERNELS, "cuda")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_CPU_KERNELS must be one of reference, triton"):
        _dispatch.cpu_runs_triton()
    monkeypatch.setenv(settings.CPU_KERNELS, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _dispatch.cpu_runs_triton()


def test_tables_and_family(monkeypatch):
    for env, read in ((settings.ATTENTION_TABLE, settings.attention_table),
                      (settings.CHOICE_TABLE, settings.choice_table)):
        assert read() is None  # the shipped table
        monkeypatch.setenv(env, "")
        assert read() is None
        monkeypatch.setenv(env, "OFF")
        assert read() == "off"
        monkeypatch.setenv(env, "/tmp/My Table.json")
        assert read() == "/tmp/My Table.json"  # a path as given
    assert settings.attention_family() is None
    monkeypatch.setenv(settings.ATTENTION_FAMILY, "Auto")
    assert settings.attention_family() is None
    monkeypatch.setenv(settings.ATTENTION_FAMILY, " General ")
    assert settings.attention_family() == "general"


def test_attention_family_does_not_import_the_kernels(tmp_path):
    """settings.py stands alone (no import of the package): loaded by its path, reading the family
    imports nothing of fuse_plugin.kernels."""
    import subprocess

    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('s', {str(PACKAGE / 'settings.py')!r})\n"
            "s = importlib.util.module_from_spec(spec); spec.loader.exec_module(s)\n"
            "print(s.attention_family(), [m for m in sys.modules if m.startswith('fuse_plugin')])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, settings.ATTENTION_FAMILY: "small"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["small", "[]"]


def test_key_covers_what_changes_a_compiled_graph(monkeypatch):
    base = settings.key()
    for env, value in ((settings.ROPE_ATTENTION, "1"), (settings.INDUCTOR_LAUNCH, "off"),
                       (settings.ATTENTION_TABLE, "off"), (settings.CHOICE_TABLE, "/x.json"),
                       (settings.ATTENTION_FAMILY, "general"), (settings.SITE_CHOICE, "ours"),
                       (settings.CPU_SITES, "ours")):
        monkeypatch.setenv(env, value)
        assert settings.key() != base, env
        monkeypatch.delenv(env)
        assert settings.key() == base
    with fuse_plugin.disabled():
        assert settings.key() != base
    # spellings of one value are one key; run-time and import-time switches are not in it
    monkeypatch.setenv(settings.INDUCTOR_LAUNCH, "YES")
    monkeypatch.setenv(settings.ROPE_ATTENTION, "false")
    monkeypatch.setenv(settings.CPU_KERNELS, "reference")
    monkeypatch.setenv(settings.AUTOPATCH, "1")
    assert settings.key() == base
    p = autopatch.FusePluginPass()  # the pass's cache key follows
    monkeypatch.setenv(settings.SITE_CHOICE, "inductor")
    other = p.uuid()
    monkeypatch.delenv(settings.SITE_CHOICE)
    assert p.uuid() != other


def test_both_passes_key_the_caches_on_what_the_traced_launches_read(monkeypatch):
    """The joint pass's uuid carries the settings and the family registry.forced holds this thread
    to, as the pre-grad pass's does: torch 2.11 hashes the joint pass but not a pre-grad pass that
    runs before the cache lookup, and a launch-only switch (the padding skip) left the FX graph as
    it was, so a second compile under the other value got the first one's launches (stop 33)."""
    from fuse_plugin.inductor_attention import AttentionGatePass
    from fuse_plugin.kernels import registry

    for p in (autopatch.FusePluginPass(), AttentionGatePass()):
        base = p.uuid()
        monkeypatch.setenv(settings.KEY_PADDING_SKIP, "on")
        assert p.uuid() != base
        monkeypatch.delenv(settings.KEY_PADDING_SKIP)
        with registry.forced("general"):
            assert p.uuid() != base
        assert p.uuid() == base


def _table_rows(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("| FUSE_")]


def test_switch_tables_list_every_switch_the_repo_reads():
    """Every FUSE_PLUGIN_* name in the code (package, tests, benchmarks) has a row in settings.py's
    tables, and docs/SETTINGS.md holds the same rows."""
    used = set()
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        used |= set(re.findall(r"\bFUSE_PLUGIN_[A-Z_]*[A-Z]\b", path.read_text()))
    rows = _table_rows(settings.__doc__)
    documented = {row.split("|")[1].strip() for row in rows}
    assert used <= documented, sorted(used - documented)
    assert {getattr(settings, n) for n in ("AUTOPATCH", "INDUCTOR_LAUNCH", "ROPE_ATTENTION", "CPU_KERNELS",
                                           "ATTENTION_TABLE", "CHOICE_TABLE", "ATTENTION_FAMILY",
                                           "SITE_CHOICE")} <= documented
    assert _table_rows((ROOT / "docs" / "SETTINGS.md").read_text()) == rows


# The one read of a switch allowed outside settings.py: cpu_kernels() saves the value it overrides.
ALLOWED_READS = {("ops/_dispatch.py", "old = os.environ.get(_ENV)")}


def test_the_package_reads_switches_only_through_settings():
    """No module of the package reads a FUSE_PLUGIN_ switch (by name, or through an ENV constant
    holding one) from the environment itself. Other variables (Triton's TRITON_INTERPRET, the
    tuner's FUSE_TUNE_DEVICE) are not switches of the plugin."""
    reads = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "settings.py":
            continue
        for line in path.read_text().splitlines():
            if (re.search(r"os\.environ\.get|os\.getenv|os\.environ\[[^\]]+\](?!\s*=)|in os\.environ", line)
                    and re.search(r"FUSE_PLUGIN_|\b_?ENV\b", line)):
                reads.add((path.relative_to(PACKAGE).as_posix(), line.strip()))
    assert reads <= ALLOWED_READS, sorted(reads - ALLOWED_READS)


def test_static_launch_reaches_inductor_only_through_the_named_backend(monkeypatch):
    """FUSE_PLUGIN_STATIC_LAUNCH (default on): the named backend compiles with Inductor's
    static_launch_user_defined_triton_kernels (an option the user passed wins); off, under CUDA
    graphs, or in a graph holding a Triton kernel of the user's: the option is left as Inductor
    has it. The switch keys the caches (settings.key)."""
    import torch
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation
    from torch._inductor import compile_fx as cfx

    from fuse_plugin import backend

    if not hasattr(torch._inductor.config, backend.STATIC_LAUNCH_OPTION):
        pytest.skip(f"this torch has no Inductor option {backend.STATIC_LAUNCH_OPTION}")
    seen = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, config_patches: seen.append(config_patches))
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    theirs = torch.fx.symbolic_trace(torch.nn.ReLU())  # a user's kernel launch (never run here)
    with theirs.graph.inserting_before(theirs.graph.output_node()):
        theirs.graph.call_function(triton_kernel_wrapper_mutation, (),
                                   dict(kernel_idx=0, constant_args_idx=0, grid=[(1, 1, 1)],
                                        tma_descriptor_metadata={}, kwargs={}))
    on = settings.key()
    with settings.disabled():  # the rewrite is not what is tested here
        backend.fuse_plugin_backend(gm, [])
        backend.fuse_plugin_backend(gm, [], options={backend.STATIC_LAUNCH_OPTION: False})
        backend.fuse_plugin_backend(gm, [], mode="reduce-overhead")
        backend.fuse_plugin_backend(theirs, [])
        monkeypatch.setenv(settings.STATIC_LAUNCH, "off")
        backend.fuse_plugin_backend(gm, [])
    assert [c.get(backend.STATIC_LAUNCH_OPTION) for c in seen] == [True, False, None, None, None]
    assert backend.holds_user_triton_kernel(theirs) and not backend.holds_user_triton_kernel(gm)
    assert settings.key() != on


def test_a_user_triton_op_keeps_triton_launcher(monkeypatch):
    """A torch.library.triton_op of the user's in the graph counts as their kernel (it becomes a
    launch when AOTAutograd decomposes it); our own ops do not."""
    import torch

    from fuse_plugin import backend

    triton_lib = pytest.importorskip("torch._library.triton", reason="a torch without triton_op")
    if not hasattr(triton_lib, "triton_ops_to_kernels"):
        pytest.skip("this torch keeps no registry of triton_op names")
    monkeypatch.setitem(triton_lib.triton_ops_to_kernels, "aten::relu", [])  # stands in for theirs
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.relu.default(x))
    assert backend.holds_user_triton_kernel(gm)
    monkeypatch.delitem(triton_lib.triton_ops_to_kernels, "aten::relu")
    assert not backend.holds_user_triton_kernel(gm)
    ours = torch.fx.Graph()  # a call of our op (never run here), even were it named a triton_op
    ours.call_function(torch.ops.fuse_plugin.attention.default, ())
    monkeypatch.setitem(triton_lib.triton_ops_to_kernels, "fuse_plugin::attention", [])
    assert not backend.holds_user_triton_kernel(torch.fx.GraphModule(torch.nn.Module(), ours))
