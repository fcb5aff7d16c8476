"""Compiled on a GPU: the ops decompose into kernels Inductor launches itself (ops/inductor.py), in
every compile mode, with Inductor's C++ wrapper and in an AOTInductor package, and the results
match eager.

These need a CUDA GPU (Inductor compiles and launches the Triton kernels); CI runs on the CPU,
where tests/test_inductor_launch.py checks the same traced graphs without running them.
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

import fuse_plugin
from fuse_plugin.demo import LlamaConfig, TinyLlama

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: Inductor compiles and launches the kernels (CI is CPU-only; "
           "tests/test_inductor_launch.py checks the traced graphs there)")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def as_accurate(got_err: float, eager_err: float) -> bool:
    """The compiled bf16 model is about as close to the fp32 reference as eager bf16 is."""
    return got_err <= max(2 * eager_err, 1e-2)


@pytest.fixture(autouse=True)
def default_settings(monkeypatch):
    """The users' defaults: rotary_qk + attention (the suite's conftest turns the rope fold on);
    every site our op, whose families the registry's rules choose (no choice table): these tests
    are of Inductor launching our Triton kernels, which the measured choice would otherwise give to
    SDPA or cuDNN at the tiny model's shapes (its 300 tokens are the table's 512-token class,
    where SDPA and cuDNN were measured fastest: an SDPA call or cuDNN's ATen op, no Triton launch)."""
    monkeypatch.setenv("FUSE_PLUGIN_ROPE_ATTENTION", "0")
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    monkeypatch.setenv("FUSE_PLUGIN_CHOICE_TABLE", "off")


def model_pair(**cfg):
    """The same weights twice: fp32 (the reference) and bf16 (what gets compiled)."""
    cfg = LlamaConfig(**{**dict(vocab=1000, hidden=256, layers=2, heads=4, kv_heads=2, mlp=512), **cfg})
    torch.manual_seed(0)
    ref = TinyLlama(cfg).cuda()
    model = TinyLlama(cfg).cuda().to(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    return ref, model


def generated_code(fn, *args):
    from torch._inductor.utils import run_and_get_code

    out, code = run_and_get_code(fn, *args)
    return out, "\n".join(code)


def assert_launched_by_inductor(code: str):
    """Our attention kernels appear as Inductor launches, the rotary math as Inductor's own
    kernels; no opaque attention/rotary op call is left (the Gluon kernels' internal ops are the
    one allowed exception)."""
    import re

    assert "attention_fwd" in code
    calls = set(re.findall(r"torch\.ops\.fuse_plugin\.(\w+)", code))
    assert calls <= {"gluon_attention_forward", "gluon_attention_backward"}, calls


@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune"])
def test_compiled_model_matches_eager(mode):
    ref, model = model_pair()
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fuse_plugin", mode=mode)
    with torch.no_grad():
        expected, eager = ref(ids), model(ids)
        out, code = generated_code(compiled, ids)
        for _ in range(3):  # CUDA graphs record, then replay
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(ids)
    assert_launched_by_inductor(code)
    assert as_accurate(rel(out, expected), rel(eager, expected)), (rel(out, expected), rel(eager, expected))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_training_matches_eager(mode):
    ref, model = model_pair()
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fuse_plugin", mode=mode)

    def grads(m, fn):
        for p in m.parameters():
            p.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        fn(ids).float().pow(2).mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    expected, eager = grads(ref, ref), grads(model, model)
    for _ in range(3):
        got = grads(model, compiled)
    for g, b, e in zip(got, eager, expected):
        assert as_accurate(rel(g, e), rel(b, e)), (rel(g, e), rel(b, e))


def test_static_launch_launches_our_kernels_statically(monkeypatch):
    """FUSE_PLUGIN_STATIC_LAUNCH (default on): every kernel of the compiled graph, ours included,
    goes through Inductor's static CUDA launcher (its strict mode raises on any kernel that would
    bypass it), and inference and training match eager."""
    from torch._inductor import config

    from fuse_plugin.kernels.launch import STATIC_LAUNCH_OPTION

    strict = next((n for n in ("strict_static_triton_launcher", "strict_static_cuda_launcher")
                   if hasattr(config, n)), None)
    if strict is None or not hasattr(config, STATIC_LAUNCH_OPTION):
        pytest.skip(f"this torch {torch.__version__} has no static launch of user kernels to check")
    monkeypatch.setenv("FUSE_PLUGIN_STATIC_LAUNCH", "on")
    ref, model = model_pair()
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    torch._dynamo.reset()
    with config.patch({strict: True, "force_disable_caches": True}):
        compiled = torch.compile(model, backend="fuse_plugin")
        with torch.no_grad():
            out, code = generated_code(compiled, ids)
            expected, eager = ref(ids), model(ids)
        assert_launched_by_inductor(code)
        assert as_accurate(rel(out, expected), rel(eager, expected))

        def grads(m, fn):
            for p in m.parameters():
                p.grad = None
            fn(ids).float().pow(2).mean().backward()
            return [p.grad.clone() for p in m.parameters()]

        got, eager, expected = grads(model, compiled), grads(model, model), grads(ref, ref)
    for g, b, e in zip(got, eager, expected):
        assert as_accurate(rel(g, e), rel(b, e)), (rel(g, e), rel(b, e))


def test_static_launch_when_compile_workers_build_our_kernels():
    """With Inductor's compile workers warm (its default once warmed up), the workers compile our
    kernels, and their config lacks the option the named backend sets: without
    kernels/static_launch.py every kernel of ours came back for Triton's launcher (twins_svt_s
    training, stop 45). In a fresh process, under FUSE_PLUGIN_STATIC_LAUNCH_WORKERS=on (the mend,
    on by default): each of our compiled kernels is statically launched, and the
    compiled step matches eager."""
    from torch._inductor import config

    from fuse_plugin.kernels.launch import STATIC_LAUNCH_OPTION

    if not hasattr(config, STATIC_LAUNCH_OPTION):
        pytest.skip(f"this torch {torch.__version__} has no static launch of user kernels to check")
    child = os.path.join(os.path.dirname(__file__), "static_launch_child.py")
    proc = subprocess.run([sys.executable, child], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("skip:"):
        pytest.skip(proc.stdout.strip())
    kernels = [line.split() for line in proc.stdout.splitlines() if line.startswith("ours ")]
    assert kernels, proc.stdout
    assert all(k[3] == "True" for k in kernels), proc.stdout
    # the workers compiled them (else this test proves nothing), and the parent compiled them again
    assert int(proc.stdout.split("recompiled ")[1].split()[0]) > 0, proc.stdout
    err = float(proc.stdout.split("rel_err ")[1].split()[0])
    assert err < 2e-2, proc.stdout


@contextlib.contextmanager
def cudnn_family_off():
    """The user's switch for cuDNN attention, which turns our cuDNN family off too."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_gluon_kernels_under_compile():
    """Where the table picks the Gluon kernels (D 128 no mask, sm_90 + Triton 3.6), the compiled
    graph calls them through their internal ops and matches the eager op."""
    from fuse_plugin.kernels.attention_hopper import why_not_gluon_platform
    from fuse_plugin.kernels.call import AttentionCall

    probe = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    why = why_not_gluon_platform(AttentionCall.forward(probe, probe, probe, None, is_causal=True,
                                                       scale=1.0))
    if why:
        pytest.skip(f"no Gluon kernels here: {why}")
    # large enough that a compiled graph takes the Gluon kernels (_HOST_HEAVY_TRACED_MIN_FLOPS)
    q = torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)

    def f(q, k, v):
        out = fuse_plugin.attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), dout), out

    torch._dynamo.reset()
    # cuDNN's attention takes this plain problem otherwise (kernels/attention_cudnn.py); the
    # switch is no part of the compile caches' keys, so they are off (a graph cached with cuDNN
    # on would come back)
    with cudnn_family_off(), torch._inductor.config.patch(force_disable_caches=True):
        (got, out), code = generated_code(torch.compile(f), q, k, v)
        (expected, out_eager) = f(q, k, v)
    assert "gluon_attention_forward" in code and "gluon_attention_backward" in code
    assert rel(out, out_eager) < 1e-2
    for g, e in zip(got, expected):
        assert rel(g, e) < 1e-2


def test_dynamic_shapes_launch_the_kernels_and_match_eager():
    """Dynamic shapes: the ops still decompose into Inductor's launches (tiles chosen by the
    traced length's hint, kernels/launch.hint; guards at the family bounds), inference and
    training match eager at lengths the graph was not traced with, and lengths within one
    family region share one graph."""
    from torch._dynamo.utils import counters

    ref, model = model_pair()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fuse_plugin", dynamic=True)
    with torch.no_grad():
        for i, n in enumerate((300, 257, 1000, 100, 77)):
            ids = torch.randint(0, 1000, (2, n), device="cuda")
            out, code = generated_code(compiled, ids) if i == 0 else (compiled(ids), None)
            if code is not None:
                assert_launched_by_inductor(code)
            assert as_accurate(rel(out, ref(ids)), rel(model(ids), ref(ids))), n
    # a graph per family region the lengths fall in: below cuDNN's forward bound (512 tokens:
    # 300, 257, 100, 77) and above it (1000); tiles never add one (chosen by the hint)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])

    def grads(m, fn, ids):
        for p in m.parameters():
            p.grad = None
        fn(ids).float().pow(2).mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fuse_plugin", dynamic=True)
    for n in (300, 211):
        ids = torch.randint(0, 1000, (2, n), device="cuda")
        expected, eager, got = grads(ref, ref, ids), grads(model, model, ids), grads(model, compiled, ids)
        for g, b, e in zip(got, eager, expected):
            assert as_accurate(rel(g, e), rel(b, e)), (n, rel(g, e), rel(b, e))


_CHILD = os.path.join(os.path.dirname(__file__), "aoti_child.py")


def child(*args, **env):
    """tests/aoti_child.py in a process of its own; (returncode, stdout, stderr)."""
    env = {**os.environ, "FUSE_PLUGIN_ROPE_ATTENTION": "0", **env}
    proc = subprocess.run([sys.executable, _CHILD, *map(str, args)], capture_output=True,
                          text=True, timeout=600, env=env)
    return proc.returncode, proc.stdout, proc.stderr[-3000:]


def reported_error(stdout: str) -> float:
    return float(stdout.split("rel_err")[-1])


def test_aot_inductor_package_holds_the_kernels(tmp_path):
    """torch.export + AOTInductor of a block calling our ops: the package loads and matches eager
    in a process that never imports fuse_plugin (so the kernels are in it, not Python-only
    custom ops). A plain nn.Linear's package is loaded first, as a control of the machine."""
    control = tmp_path / "plain.pt2"
    rc, out, err = child("compile-plain", control)
    assert rc == 0, err
    rc, out, err = child("load", control)
    if rc < 0:
        pytest.skip(f"AOTInductor packages do not load on this machine: the package of a plain "
                    f"nn.Linear kills the loader (signal {-rc}) without fuse_plugin involved")
    assert rc == 0, err
    path = tmp_path / "ours.pt2"
    rc, out, err = child("compile-ours", path)
    assert rc == 0, err
    rc, out, err = child("load", path)
    assert rc == 0, err
    assert reported_error(out) < 1e-2


def test_cpp_wrapper_launches_the_kernels():
    """Inductor's C++ wrapper (the code generator AOTInductor uses) launches our kernels, leaves
    no opaque call of our ops, and matches eager."""
    rc, out, err = child("cpp-wrapper")
    assert rc == 0, err
    assert reported_error(out) < 1e-2
