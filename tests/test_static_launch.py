"""kernels/static_launch.py on the CPU: which compiled kernels the parent compiles again for
Inductor's static launcher, and that a failure leaves the worker's results (the GPU test
test_compiled_gpu.py::test_static_launch_when_compile_workers_build_our_kernels runs it)."""
from types import SimpleNamespace

import pytest
import torch

import fuse_plugin  # noqa: F401  (imports the kernel modules whose names launch.ours reads)
from fuse_plugin.kernels import launch, static_launch

pytest.importorskip("triton")


class StaticTritonCompileResult:  # the name the check reads where is_statically_launchable is missing
    pass


class TritonCompileResult:
    pass


def autotuner(name="attention_fwd_kernel", results=(TritonCompileResult(),), heuristic="USER_AUTOTUNE"):
    return SimpleNamespace(fn=SimpleNamespace(__name__=name), heuristic_type=SimpleNamespace(name=heuristic),
                           compile_results=list(results), inductor_meta={})


@pytest.fixture
def option_on(monkeypatch):
    from torch._inductor import config

    monkeypatch.setenv("FUSE_PLUGIN_STATIC_LAUNCH_WORKERS", "on")
    with config.patch({launch.STATIC_LAUNCH_OPTION: True, "cpp_wrapper": False}):
        yield


def reload():
    return None


def test_ours_by_name():
    assert launch.ours(autotuner("attention_small_bwd_kernel"))
    assert launch.ours(SimpleNamespace(inductor_meta={"kernel_name": "attention_fwd_kernel_12"}))
    assert not launch.ours(autotuner("my_kernel"))
    assert not launch.ours(SimpleNamespace(inductor_meta={}))


def test_recompiled_only_where_a_worker_built_our_kernel_under_the_option(option_on):
    assert static_launch.why_not_recompile(autotuner(), reload) is None
    assert "this process" in static_launch.why_not_recompile(autotuner(), None)
    assert "not a user kernel" in static_launch.why_not_recompile(autotuner(heuristic="POINTWISE"), reload)
    assert "not a kernel of ours" in static_launch.why_not_recompile(autotuner("my_kernel"), reload)
    assert "already static" in static_launch.why_not_recompile(
        autotuner(results=[StaticTritonCompileResult()]), reload)
    assert "no compile results" in static_launch.why_not_recompile(autotuner(results=[]), reload)


def test_nothing_recompiled_without_the_switch(option_on, monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_STATIC_LAUNCH_WORKERS", "off")
    assert "STATIC_LAUNCH_WORKERS is off" in static_launch.why_not_recompile(autotuner(), reload)


def test_nothing_recompiled_without_the_option(monkeypatch):
    from torch._inductor import config

    monkeypatch.setenv("FUSE_PLUGIN_STATIC_LAUNCH_WORKERS", "on")
    with config.patch({launch.STATIC_LAUNCH_OPTION: False}):
        assert "off" in static_launch.why_not_recompile(autotuner(), reload)


def test_a_failed_or_non_static_recompile_leaves_the_workers_results():
    tuner = autotuner()
    before = tuner.compile_results

    def fails():
        raise RuntimeError("no cubin")

    assert not static_launch.recompile_in_parent(tuner, fails)
    still_triton = autotuner()
    assert not static_launch.recompile_in_parent(tuner, lambda: still_triton)
    assert tuner.compile_results is before
    fresh = autotuner(results=[StaticTritonCompileResult()])
    assert static_launch.recompile_in_parent(tuner, lambda: fresh)
    assert tuner.compile_results is fresh.compile_results


def test_install_wraps_precompile_once():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    static_launch.install()
    wrapped = CachingAutotuner.precompile
    static_launch.install()
    assert CachingAutotuner.precompile is wrapped
    assert getattr(wrapped, "__wrapped__", None) is not None


def test_compiled_kernels_of_ours_reads_only_autotuners():
    import types

    module = types.ModuleType("generated")
    module.attention_fwd_kernel_0 = autotuner()  # not Inductor's CachingAutotuner
    module.x = 3
    assert static_launch.compiled_kernels_of_ours([module]) == []
