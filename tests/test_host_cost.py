"""benchmarks/host_cost.py (the host's time of one attention call per implementation), its CPU
parts: the sites' two spellings compute the same attention, and a variant's switches are set only
while its graph compiles, with every site given to our op."""
import os
import sys

import torch
from torch._dynamo.utils import counters

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import host_cost  # noqa: E402


def test_the_two_spellings_are_one_attention():
    torch.manual_seed(0)
    qs, ks, vs = ([torch.randn(2, 3, L, 16) for _ in range(2)] for L in (5, 7, 7))
    written, sdpa = host_cost.make_fn("w", False), host_cost.make_fn("s", True)
    assert written.__code__ is not sdpa.__code__
    for a, b in zip(written(qs, ks, vs, 0.25), sdpa(qs, ks, vs, 0.25)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_family_is_forced_only_while_its_graph_compiles(monkeypatch):
    monkeypatch.setattr(host_cost, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.delenv("FUSE_PLUGIN_ATTENTION_FAMILY", raising=False)
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "auto")
    torch._dynamo.reset()
    counters.clear()
    call = host_cost.build("general", (1, 2, 3, 5, 16), "train", sites=2)
    call()
    assert "FUSE_PLUGIN_ATTENTION_FAMILY" not in os.environ
    assert os.environ["FUSE_PLUGIN_SITE_CHOICE"] == "auto"
    assert counters["fuse_plugin"]["attention"] == 2, dict(counters["fuse_plugin"])  # both sites ours
