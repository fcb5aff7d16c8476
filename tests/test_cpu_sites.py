"""Off CUDA every matched site is left as stock compile has it (patterns/choice.off_cuda).

Our ops run their plain-torch reference there, measured 0.53-0.95x stock compile on the CPU
(benchmarks/cpu_sites.py, RESULTS.md stop 57), so by default the rewrite leaves hand-written
attention, rotary embeddings, nn.MultiheadAttention and SDPA calls as they are, and lets Inductor's
own attention patterns take what it left, as in a stock compile (inductor_attention.mark_as_stock).
The suite runs with FUSE_PLUGIN_CPU_SITES=ours (conftest.py); these tests set the default back.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import fuse_plugin
from fuse_plugin import settings
from fuse_plugin.demo import LlamaConfig, TinyLlama
from fuse_plugin.patterns import choice

OFF_CUDA = "on cpu our op runs its plain-torch reference"


@pytest.fixture
def default(monkeypatch):
    """The users' defaults, on the CPU."""
    for name in (settings.CPU_SITES, settings.SITE_CHOICE, settings.ROTARY_SITES):
        monkeypatch.delenv(name, raising=False)


class Attention(nn.Module):
    """timm's hand-written attention (the spelling Inductor's own patterns take)."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1)) * self.scale
        return self.proj((a.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class Mixed(nn.Module):
    """A hand-written attention, an nn.MultiheadAttention and an SDPA call."""

    def __init__(self):
        super().__init__()
        self.attn, self.mha = Attention(), nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.mha(x, x, x)[0]
        q = x.unflatten(-1, (4, 16)).transpose(1, 2)
        return x + F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


def _report(fn, *args):
    return fuse_plugin.explain(fn, *args)


def test_every_kind_of_site_is_left_on_the_cpu(default):
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(2, 9, 64)
    report = _report(model, x)
    assert report.count("attention") == 0 and report.count("sdpa") == 0, report
    left = [m for m in report.left if OFF_CUDA in m.reason]
    assert sorted(m.kind for m in left) == ["attention", "attention", "sdpa"], report
    assert any(m.reason.startswith("left to Inductor by rule") for m in left), report  # the hand-written one
    assert any(m.reason.startswith("left as SDPA by rule") for m in left), report
    llama = TinyLlama(LlamaConfig())
    report = _report(llama, torch.randint(0, 1000, (2, 16)))
    assert report.count("attention") == 0 and report.count("rotary") == 0, report
    assert sorted(m.kind for m in report.left) == ["attention"] * 2 + ["rotary"] * 4, report
    assert all(OFF_CUDA in m.reason and settings.CPU_SITES in m.reason for m in report.left), report


@pytest.mark.parametrize("switch, value, fused", [
    (settings.CPU_SITES, "ours", {"attention": 2}),  # as on CUDA: the SDPA call stays (nothing measured)
    (settings.SITE_CHOICE, "ours", {"attention": 2, "sdpa": 1}),  # an explicit choice wins
    (settings.SITE_CHOICE, "inductor", {}),  # and leaves nn.MultiheadAttention too
])
def test_the_switches_still_decide(default, monkeypatch, switch, value, fused):
    monkeypatch.setenv(switch, value)
    report = _report(Mixed(), torch.randn(2, 9, 64))
    assert {k: report.count(k) for k in ("attention", "sdpa") if report.count(k)} == fused, report
    assert all(OFF_CUDA not in m.reason for m in report.left), report


def test_rotary_switch_wins_over_the_cpu_rule(default, monkeypatch):
    monkeypatch.setenv(settings.ROTARY_SITES, "ours")
    report = _report(TinyLlama(LlamaConfig()), torch.randint(0, 1000, (2, 16)))
    assert report.count("rotary") == 4 and report.count("attention") == 0, report


def test_a_cuda_site_is_not_ruled_off(default):
    with FakeTensorMode():
        cuda, cpu = torch.empty(2, 4, 8, 16, device="cuda"), torch.empty(2, 4, 8, 16)
    assert choice.off_cuda(cuda) is None and choice.off_cuda(None) is None
    ruled = choice.off_cuda(cpu, "to Inductor")
    assert ruled is not None and not ruled.ours and ruled.as_stock
    assert ruled.reason.startswith("left to Inductor by rule: " + OFF_CUDA)


def _inductor_code(model, x, backend: str, train: bool) -> str:
    """``backend``: "inductor" (stock: the plugin switched off), "fuse_plugin", or "autopatch"
    (plain torch.compile with the plugin imported)."""
    torch._dynamo.reset()
    fn = torch.compile(model, backend="inductor" if backend == "autopatch" else backend)

    def run():
        out = fn(x)
        if train:
            out.sum().backward()
        return out

    if backend == "inductor":
        with fuse_plugin.disabled():
            _, codes = run_and_get_code(run)
    else:
        _, codes = run_and_get_code(run)
    code = "\n".join(codes)
    code = re.sub(r"# AOT ID: \['\d+_", "# AOT ID: ['N_", code)  # the graph's ordinal in this process
    return re.sub(r"/tmp/\S+", "PATH", code)


@pytest.mark.parametrize("train, entry", [(False, "fuse_plugin"), (False, "autopatch"), (True, "fuse_plugin")],
                         ids=["inference", "inference-autopatch", "training"])
def test_left_sites_compile_to_stock_code(default, train, entry):
    """The plugin's Inductor code equals stock compile's: nothing rewritten, and Inductor's own
    attention patterns take what they take in a stock compile (in inference, SDPA's kernel for
    the hand-written attention and nn.MultiheadAttention), where the gate would otherwise refuse
    them in our compiles."""
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(2, 9, 64, requires_grad=train)
    if not train:
        model.eval()
    ctx = torch.enable_grad() if train else torch.no_grad()
    # compiled here, not read from a cache (a cache hit runs no pattern pass: nothing to count)
    with ctx, torch._inductor.config.patch({"force_disable_caches": True}):
        counters.clear()
        stock = _inductor_code(model, x, "inductor", train)
        taken_by_stock = counters["inductor"]["fuse_attention"]
        counters.clear()
        ours = _inductor_code(model, x, entry, train)
        taken_in_ours = counters["inductor"]["fuse_attention"]
        left = {k: counters["fuse_plugin"][k] for k in ("attention", "attention_left", "sdpa_left")}
    assert left == {"attention": 0, "attention_left": 2, "sdpa_left": 1}, left  # the rewrite ran, and left them
    # the gate let them through (in inference; in training stock's patterns take none of these
    # sites on the CPU, torch 2.13)
    assert taken_in_ours == taken_by_stock and (taken_by_stock >= 1 or train)
    assert "fuse_plugin" not in ours and len(stock) > 2000
    assert ours == stock


def test_the_gate_stays_shut_on_sites_left_for_other_reasons(default, monkeypatch):
    """FUSE_PLUGIN_SITE_CHOICE=inductor leaves the sites unmarked: Inductor's patterns stay off in
    our compile (inductor_attention.py: what the rewrite left it left for a reason)."""
    monkeypatch.setenv(settings.SITE_CHOICE, "inductor")
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 9, 64)
    with torch.no_grad():
        counters.clear()
        out = torch.compile(model, backend="fuse_plugin")(x)
        assert counters["fuse_plugin"]["attention_left"] == 1
        assert counters["inductor"]["fuse_attention"] == 0
        torch.testing.assert_close(out, model(x))


def test_demo_says_it_rewrites_on_the_cpu(default, capsys):
    from fuse_plugin import demo

    assert demo.run(["--seq", "8", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert f"the demo rewrites them with {settings.CPU_SITES}=ours" in out and "2 attention" in out, out


def test_the_cpu_benchmark_times_the_three_ways(tmp_path):
    """benchmarks/cpu_sites.py on its smallest row, one round: stock compile, the plugin leaving the
    site, and the plugin with FUSE_PLUGIN_CPU_SITES=ours fusing it (the table of RESULTS.md stop 57)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != settings.CPU_SITES}  # the users' default
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "cpu_sites.py"), "--rows", "mha-infer-8x197",
                        "--rounds", "1", "--warm", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["sites"]["compile"] == {}
    assert row["sites"]["plugin"] == {"attention_left": 1}
    assert row["sites"]["plugin@CPU_SITES=ours"] == {"attention": 1}
    assert all(len(t) == 1 and t[0] > 0 for t in row["rounds_s"].values())
    assert "| mha-infer-8x197 |" in r.stdout
