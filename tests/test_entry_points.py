"""The three ways in: the named backend, the automatic patch (and its opt-outs), explain / logging."""
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin import autopatch
from fuse_plugin.ops import reference


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v


def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 5, 16, generator=g) for _ in range(3)]


@pytest.fixture
def op_calls(monkeypatch):
    """Counts executions of the attention op's CPU kernel (what compiled code actually runs)."""
    calls = []
    real = reference.attention_forward
    monkeypatch.setattr(reference, "attention_forward", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.fixture(autouse=True)
def fresh():
    counters.clear()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    fuse_plugin.install()


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_backend_is_an_entry_point_without_importing_fuse_plugin():
    r = run_python("import sys, torch; print('fuse_plugin' in torch._dynamo.list_backends(), 'fuse_plugin' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]


def test_named_backend_rewrites_and_accepts_inductor_options(op_calls):
    q, k, v = inputs()
    out = torch.compile(attn, backend="fuse_plugin", options={"force_disable_caches": True})(q, k, v)
    assert torch.allclose(out, attn(q, k, v), atol=1e-6)
    assert counters["fuse_plugin"]["attention"] == 1 and op_calls
    with pytest.raises(Exception, match="no_such_option"):
        torch._dynamo.reset()
        torch.compile(attn, backend="fuse_plugin", options={"no_such_option": 1})(q, k, v)


def test_autopatch_rewrites_plain_torch_compile_and_opts_out(op_calls):
    q, k, v = inputs()
    assert fuse_plugin.installed()
    with torch._inductor.config.patch(force_disable_caches=True):  # the pass runs on a cache miss only
        torch.compile(attn)(q, k, v)
    assert counters["fuse_plugin"]["attention"] == 1 and len(op_calls) == 1
    torch._dynamo.reset()
    op_calls.clear()
    torch.compile(attn)(q, k, v)  # from the FX graph cache, or compiled again: our op either way
    assert len(op_calls) == 1

    # disabled() around the compiling call: the graph stays as written. The FX graph cache must not
    # hand back the rewritten graph compiled above (the pass's uuid includes the switch).
    torch._dynamo.reset()
    op_calls.clear()
    fused_so_far = counters["fuse_plugin"]["attention"]
    with fuse_plugin.disabled():
        out = torch.compile(attn)(q, k, v)
    assert not op_calls and counters["fuse_plugin"]["attention"] == fused_so_far
    assert torch.allclose(out, attn(q, k, v), atol=1e-6)

    torch._dynamo.reset()
    fuse_plugin.uninstall()
    assert not fuse_plugin.installed()
    torch.compile(attn)(q, k, v)
    assert not op_calls


def test_autopatch_chains_the_pass_the_user_had_set():
    seen = []

    class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            # runs after ours: the attention is already our op
            seen.append(any("fuse_plugin" in str(n.target) for n in graph.nodes))

        def uuid(self):
            return "user-pass-v1"

    fuse_plugin.uninstall()
    from torch._inductor import config

    config.pre_grad_custom_pass = UserPass()
    try:
        fuse_plugin.install()
        assert isinstance(config.pre_grad_custom_pass, autopatch.FusePluginPass)
        with config.patch(force_disable_caches=True):
            torch.compile(attn)(*inputs())
        assert seen == [True]
        fuse_plugin.uninstall()
        assert isinstance(config.pre_grad_custom_pass, UserPass)  # restored
    finally:
        config.pre_grad_custom_pass = None


def test_pass_uuid_tracks_the_settings():
    p = autopatch.FusePluginPass()
    on = p.uuid()
    with fuse_plugin.disabled():
        assert p.uuid() != on
    assert p.uuid() == on
    assert autopatch.FusePluginPass(chained=lambda g: None).uuid() is None  # an un-hashable chained pass


def test_env_opt_out_before_import():
    r = run_python("import fuse_plugin; print(fuse_plugin.installed())", FUSE_PLUGIN_AUTOPATCH="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_explain_lists_sites_and_near_misses_with_source_lines():
    def model(q, k, v):
        fused = attn(q, k, v)
        weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # weights returned: must stay
        return fused + (weights @ v), weights

    report = fuse_plugin.explain(model, *inputs())
    assert report.count("attention") == 1
    assert [m.reason for m in report.misses] == [
        "attention weights are used elsewhere (e.g. returned with output_attentions=True)"
    ]
    text = str(report)
    assert "test_entry_points.py" in report.sites[0].source and "test_entry_points.py" in report.misses[0].source
    assert "not fused" in text and "scale=0.25" in text
    assert counters["fuse_plugin"]["attention"] == 1


def test_torch_logs_shows_the_rewrite():
    code = (
        "import torch, fuse_plugin\n"
        "f = lambda q, k, v: torch.softmax(q @ k.mT * 0.25, -1) @ v\n"
        "x = torch.randn(1, 2, 4, 16)\n"
        "torch.compile(f, backend='fuse_plugin')(x, x, x)\n"
    )
    r = run_python(code, TORCH_LOGS="+fuse_plugin")
    assert r.returncode == 0, r.stderr
    assert "fused attention" in r.stderr
