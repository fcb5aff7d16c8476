"""benchmarks/host_sites.py (host time per attention site), its pure-Python parts on the CPU: the
flags, a variant's switch set only while it compiles, the block's attention spelled as timm's
(the plugin's pattern matches it), and the table's per-site arithmetic from recorded rounds."""
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import host_sites  # noqa: E402


def test_flags():
    args = host_sites.parse([])
    assert args.sites == [8, 32] and args.tasks == ["infer", "train"]
    assert args.variants == list(host_sites.VARIANTS) and (args.rounds, args.steps) == (30, 2)
    assert (args.device, args.dtype) == ("cuda", torch.bfloat16)
    cpu = host_sites.parse(["--cpu", "--sites", "1", "--variants", "compile,plugin@STATIC_LAUNCH=off"])
    assert (cpu.device, cpu.dtype, cpu.sites, cpu.variants) == ("cpu", torch.float32, [1],
                                                                 ["compile", "plugin@STATIC_LAUNCH=off"])
    for bad in (["--variants", "compile,sdpa"], ["--tasks", "eval"]):
        with pytest.raises(SystemExit):
            host_sites.parse(bad)


def test_switch_is_set_only_while_a_variant_compiles(monkeypatch):
    monkeypatch.delenv("FUSE_PLUGIN_SITE_CHOICE", raising=False)
    with host_sites.switch_of("plugin@SITE_CHOICE=ours"):
        assert os.environ["FUSE_PLUGIN_SITE_CHOICE"] == "ours"
    assert "FUSE_PLUGIN_SITE_CHOICE" not in os.environ
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "auto")
    with host_sites.switch_of("plugin@SITE_CHOICE=inductor"), host_sites.switch_of("compile"):
        assert os.environ["FUSE_PLUGIN_SITE_CHOICE"] == "inductor"
    assert os.environ["FUSE_PLUGIN_SITE_CHOICE"] == "auto"


def test_block_is_attention():
    """The block's hand-written attention equals SDPA's (what the plugin's pattern stands for)."""
    torch.manual_seed(0)
    block = host_sites.Block(64, 2)
    x = torch.randn(3, 49, 64)
    q, k, v = block.qkv(x).reshape(3, 49, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    expected = x + block.proj(attn.transpose(1, 2).reshape(3, 49, 64))
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_table_per_site_arithmetic():
    """Per task and N: issue / wall µs a step (median over rounds of --steps steps), and for a
    plugin variant its fused sites and (its issue - compile's) / N."""
    def row(variant, sites, issue, wall, fused=0):
        return dict(task="train", sites=sites, variant=variant, fused=fused, issue=issue, wall=wall)

    rows = [row("compile", 8, [0.002, 0.004, 0.003], [0.004, 0.004, 0.004]),
            row("plugin", 8, [0.0046, 0.0046, 0.0046], [0.005, 0.005, 0.005], fused=8)]
    lines = host_sites.table(rows, steps=2)
    assert lines[0] == "| task | sites | compile | plugin |"
    # compile: median issue 3 ms over 2 steps = 1500 µs; plugin 2300 µs: +100 µs a site over 8 sites
    assert lines[3] == "| train | 8 | 1500 / 2000 | 2300 / 2500; 8; +100.0 |"


def test_global_block_is_attention():
    """``kv_tokens``: queries from every token, keys and values from the first ``kv_tokens`` only
    (Twins-SVT's global sub-sampled attention), equal to SDPA on those."""
    torch.manual_seed(0)
    block = host_sites.Block(64, 2, kv_tokens=7)
    x = torch.randn(3, 20, 64)
    q = block.q(x).reshape(3, 20, 2, 32).transpose(1, 2)
    k, v = block.kv(x[:, :7]).reshape(3, 7, 2, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    expected = x + block.proj(attn.transpose(1, 2).reshape(3, 20, 64))
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_tokens", [0, 7])
def test_every_block_is_a_site_of_ours(kv_tokens):
    """The plugin's pattern matches every block of both forms (else the benchmark would time
    stock compile twice)."""
    import fuse_plugin

    torch.manual_seed(0)
    report = fuse_plugin.explain(host_sites.model_of(3, 64, 2, kv_tokens), torch.randn(2, 20, 64))
    assert report.count("attention") == 3, str(report)


def test_kv_tokens_flag():
    assert host_sites.parse(["--tokens", "3136", "--kv-tokens", "49"]).kv_tokens == 49
    assert host_sites.parse([]).kv_tokens == 0
    for bad in (["--kv-tokens", "49"], ["--kv-tokens", "-1"]):  # not fewer than --tokens 49; negative
        with pytest.raises(SystemExit):
            host_sites.parse(bad)


def test_a_variant_that_compiles_no_graph_is_refused(monkeypatch):
    """A variant Dynamo runs without compiling (its recompile limit reached: stop 44's first call
    timed eager against eager in its later cells) raises instead of being timed."""
    monkeypatch.setattr(host_sites.torch, "compile", lambda model, **kwargs: model)
    args = host_sites.parse(["--cpu", "--sites", "1", "--tokens", "8", "--batch", "2"])
    with pytest.raises(RuntimeError, match="compiled no graph"):
        host_sites.build("compile", 1, "infer", args)


def test_measure_makes_room_for_every_variant(monkeypatch):
    """Every variant of a cell compiles the same code object: measure() raises Dynamo's
    recompile limit (default 8) to 64 at least."""
    config = torch._dynamo.config
    knob = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(config, knob, 8)
    args = host_sites.parse(["--cpu", "--tasks", "infer"])
    args.tasks = []  # nothing to build: only the setting
    assert host_sites.measure(args) == [] and getattr(config, knob) >= 64
