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


# An install without numpy, simulated: the import system finds no numpy module; warnings are errors.
_NO_NUMPY = """
import importlib.machinery, sys, warnings
_find = importlib.machinery.PathFinder.find_spec.__func__
def find_spec(cls, name, path=None, target=None):
    if name == "numpy" or name.startswith("numpy."):
        return None
    return _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
warnings.simplefilter("error")
import MODULE
print("numpy" in sys.modules)
"""


def test_import_without_numpy_does_not_warn():
    """torch warns at its import when numpy is missing ("Failed to initialize NumPy": the near miss,
    which also shows the simulation takes numpy away); `import fuse_plugin`, which imports torch, does
    not warn (nothing of the plugin uses numpy)."""
    torch_alone = run_python(_NO_NUMPY.replace("MODULE", "torch"))
    assert torch_alone.returncode != 0 and "Failed to initialize NumPy" in torch_alone.stderr
    r = run_python(_NO_NUMPY.replace("MODULE", "fuse_plugin"))
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


# --- the backend name without the entry point (a source tree on PYTHONPATH, no pip install) ---

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMPILE_BY_NAME = """
import sys, torch
from importlib.metadata import entry_points
print("entry_point", "fuse_plugin" in entry_points(group="torch_dynamo_backends").names)
IMPORT
from torch._dynamo.utils import counters
def f(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v
q, k, v = [torch.randn(1, 2, 5, 16) for _ in range(3)]
out = torch.compile(f, backend="fuse_plugin")(q, k, v)
print("fused", counters["fuse_plugin"]["attention"], "close", torch.allclose(out, f(q, k, v), atol=1e-5))
import fuse_plugin
print("from", fuse_plugin.__file__.startswith(sys.argv[1]))
"""


def _without_entry_point(tmp_path) -> dict:
    """An environment where no installed distribution declares the entry point: a `fuse-plugin`
    dist-info without entry_points.txt first on sys.path shadows the installed one (importlib.metadata
    keeps the first distribution of a name), as in a source tree whose package was never installed."""
    dist = tmp_path / "fuse_plugin-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fuse-plugin\nVersion: 0.0.0\n")
    path = os.pathsep.join([str(tmp_path), _ROOT])
    return {"PYTHONPATH": path, "FUSE_PLUGIN_AUTOPATCH": "0"}


def test_import_registers_the_backend_name_without_the_entry_point(tmp_path):
    code = _COMPILE_BY_NAME.replace("IMPORT", "import fuse_plugin")
    r = subprocess.run([sys.executable, "-c", code, _ROOT], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **_without_entry_point(tmp_path)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["entry_point", "False", "fused", "1", "close", "True", "from", "True"], r.stdout


def test_without_the_entry_point_and_without_import_the_name_is_unknown(tmp_path):
    """The near miss: nothing registers the name unless the package is imported."""
    code = _COMPILE_BY_NAME.replace("IMPORT", "")
    r = subprocess.run([sys.executable, "-c", code, _ROOT], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **_without_entry_point(tmp_path)}, cwd=tmp_path)
    assert r.returncode != 0 and "InvalidBackend" in r.stderr, (r.stdout, r.stderr[-2000:])


def test_entry_point_and_import_do_not_clash():
    """With the entry point installed: resolving the name loads the entry point, which imports the
    package (whose import must then not register the name, or Dynamo's registry would raise
    "duplicate name"); and importing first, then resolving, also works."""
    code = _COMPILE_BY_NAME.replace("IMPORT", "")
    r = run_python(code.replace("sys.argv[1]", repr(_ROOT)), PYTHONPATH=_ROOT)
    if "entry_point False" in r.stdout:
        pytest.skip("the package is not pip-installed here: no entry point to clash with")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fused 1 close True" in r.stdout, r.stdout
    code = _COMPILE_BY_NAME.replace("IMPORT", "import fuse_plugin")
    r = run_python(code.replace("sys.argv[1]", repr(_ROOT)), PYTHONPATH=_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fused 1 close True" in r.stdout, r.stdout


def test_demo_runs_from_a_source_tree_without_the_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fuse_plugin", "demo", "--seq", "8", "--batch", "1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**{k: v for k, v in os.environ.items() if k != "FUSE_PLUGIN_CPU_SITES"},
                            **_without_entry_point(tmp_path)})  # (as a user runs it: the suite's switch unset)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 attention" in r.stdout and "(OK, tolerance" in r.stdout, r.stdout[-2000:]
    assert "FUSE_PLUGIN_CPU_SITES=ours" in r.stdout, r.stdout[-2000:]  # it says why it rewrites on the CPU


def test_benchmarks_import_this_tree_from_a_source_tree(tmp_path):
    """`python benchmarks/<script>.py` without PYTHONPATH and without the entry point: common.py puts
    the tree on sys.path (imports only: `--help` exits after the imports and the argument parser)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(_without_entry_point(tmp_path), PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", "shapes.py"), "--help"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-3000:]
