"""The choice-table tuner (fuse_plugin/tune_choices.py) on the CPU: every step it runs on the GPU
(our families forced and checked against the general one, the small family's configs, Inductor's
decomposition compiled in inference and training), on a tiny class in Triton's interpreter and
Inductor's CPU backend; times are only checked for their form here."""
import json
import os

import pytest
import torch

from fuse_plugin import tune_choices
from fuse_plugin.kernels import choice_table
from fuse_plugin.ops import cpu_kernels
from helpers import INTERPRETER


@pytest.fixture
def tiny(monkeypatch):
    if not INTERPRETER:
        pytest.skip("the tiny class runs in Triton's interpreter, on only without a GPU; on a GPU "
                    "`python -m fuse_plugin.tune --choices` is this run at full size")
    monkeypatch.setattr(tune_choices, "SMALL_PER_PROGRAM", (1, 4))
    monkeypatch.setattr(tune_choices, "SMALL_WARPS", (4,))
    with cpu_kernels("triton"):
        yield tune_choices.Case((4, 2, 1, 9, 9, 16, 16), "periodic", period=2, seen="a tiny Swin")


def test_a_class_is_measured_like_on_the_gpu(tiny):
    logged = []
    entry = tune_choices.measure_class("tiny", tiny, logged.append, device="cpu")
    assert set(entry["fwd"]) == {"small", "general"}  # the families that take a periodic GQA bias
    assert set(entry["bwd"]) == {"small", "general", "two_kernel"}
    assert all(t > 0 for t in list(entry["fwd"].values()) + list(entry["bwd"].values()))
    assert set(entry["inductor"]) == {"fwd", "train"} and min(entry["inductor"].values()) > 0
    assert set(entry["sdpa"]) == {"fwd", "train"} and min(entry["sdpa"].values()) > 0
    # GQA (2 query heads over 1): SDPA timed also as a call with k/v repeated (HF's sdpa path)
    assert set(entry["sdpa_repeat"]) == {"fwd", "train"} and min(entry["sdpa_repeat"].values()) > 0
    assert len(entry["small"]["fwd"]) == 3 and entry["small"]["fwd"][0] in (1, 4)
    assert not [r for r in logged if "error" in r or "disagrees" in r], logged
    line = tune_choices.summary({"k": dict(entry, name="tiny")}).splitlines()[1]
    assert line.startswith("tiny | ") and line.count("|") == 6


def test_a_family_that_disagrees_is_left_out(tiny, monkeypatch):
    """A wrong family (here: the small one's forward made to return zeros) is not entered."""
    from fuse_plugin.kernels import attention_small

    real = attention_small.forward

    def wrong(q, k, v, bias, **kw):
        real(q, k, v, bias, **kw)
        (kw.get("out") if kw.get("out") is not None else kw["out_buf"]).zero_()

    monkeypatch.setattr(attention_small, "forward", wrong)
    logged = []
    entry = tune_choices.measure_class("tiny", tiny, logged.append, device="cpu")
    assert "small" not in entry["fwd"] and "general" in entry["fwd"]
    assert any(r.get("disagrees") and r["family"] == "small" for r in logged)


def test_the_written_table_is_read_back(tmp_path, monkeypatch):
    """An entry in the file's format is found by its class key (choice_table.lookup)."""
    case = tune_choices.CLASSES["swin-s1-shifted"]
    key = choice_table.class_key(torch.bfloat16, case.shape[5], case.shape[6], case.shape[3],
                                 case.shape[4], case.bias, case.causal, bool(case.dropout))
    entry = {"fwd": {"small": 1.0}, "bwd": {"small": 2.0}, "inductor": {"fwd": 3.0, "train": 4.0},
             "small": {"fwd": [4, 4, 2]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": choice_table.FORMAT, "gpus": {"H": {"entries": {key: entry}}}}))
    monkeypatch.setenv(choice_table.ENV, str(path))
    choice_table.clear_cache()
    try:
        got = choice_table.lookup(torch.device("cuda"), key)
        assert got["fwd"] == {"small": 1.0} and got["small"]["fwd"] == [4, 4, 2]
    finally:
        choice_table.clear_cache()
    assert os.path.basename(str(choice_table.path_for((9, 0)))) == "attention_choices_sm90.json"


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/attention.py as a module (benchmarks/ on the path, for its `common` import)."""
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    spec = importlib.util.spec_from_file_location("attention_bench", os.path.join(root, "benchmarks", "attention.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "attention_bench", module)
    spec.loader.exec_module(module)
    return module


def test_the_kernel_choice_table_runs(tiny, bench, monkeypatch):
    """benchmarks/attention.py --choice, one tiny row on the CPU (no SDPA columns there): every
    family that can run the row timed, the chosen one named, the ratio column filled."""
    monkeypatch.setattr(bench, "CONFIRM_BELOW", float("inf"))  # every pair of two re-timed
    lines, data = bench.choice_table(log=lambda *a: None, cases=[("tiny", tiny)], device="cpu")
    assert data[0]["chosen"] == {"fwd": "general", "bwd": "general"}  # nothing measured: the rules
    assert {"chosen", "chosen-infer", "general", "small", "inductor"} <= set(data[0]["ms"])
    cells = lines[-1].split("|")
    assert cells[1].strip() == "tiny" and len(cells) == 9 and cells[5].count("/") == 2
    # the site's decision (CPU: no table, our op) against the fastest, inference (the op without
    # its logsumexp, as an inference site calls it) and training
    assert data[0]["site"]["fwd"]["impl"] == "chosen-infer" and data[0]["site"]["train"]["impl"] == "chosen"
    assert set(data[0]["site_vs_fastest"]) == {"fwd", "train"} and cells[7].count("/") == 1
    # a site under CONFIRM_BELOW of the fastest (CPU wall times: likely) is re-timed against it
    d = data[0]
    assert set(d["retimed"]) == {m for m in ("fwd", "train")  # (Inductor's calls are not kept to re-time)
                                 if d["fastest"][m] not in ("inductor", d["site"][m]["impl"])}
    for mode, r in data[0]["retimed"].items():
        assert set(r["ms"]) == {data[0]["site"][mode]["impl"], data[0]["fastest"][mode]}
        assert abs(data[0]["site_vs_fastest"][mode] - r["ms"][data[0]["fastest"][mode]]
                   / r["ms"][data[0]["site"][mode]["impl"]]) < 1e-9
    # current.py takes the JSON as RESULTS' kernel-table rows
    import current

    row, = current.choice_rows([{"rows": data}])
    assert row["row"] == "tiny" and row["chosen"] == "general / general" and len(row["site_vs_fastest"]) == 2
    assert row["site_infer"].startswith("chosen-infer ") and row["site_train"].startswith("chosen ")
    # a re-timed pair shows its re-timed ms beside the first
    retimed = {**d, "ms": {"chosen": [1.0, 2.0], "chosen-infer": [0.9, None], "sdpa": [0.8, 2.0, 2.5]},
               "site": {"fwd": {"impl": "chosen-infer", "ms": 0.9}, "train": {"impl": "chosen", "ms": 3.0}},
               "fastest": {"fwd": "sdpa", "train": "sdpa"}, "site_vs_fastest": {"fwd": 0.97, "train": 0.99},
               "retimed": {"train": {"first": 0.83, "ms": {"chosen": 2.6, "sdpa": 2.57}}}}
    row, = current.choice_rows([{"rows": [retimed]}])
    assert row["site_train"] == "chosen 2.600 (re-timed; first 3.000)"
    assert row["fastest_train"] == "sdpa 2.570 (re-timed; first 2.500)" and row["fastest_infer"] == "sdpa 0.800"
    assert row["site_vs_fastest"] == [0.97, 0.99]


def test_confirm_retimes_the_pair_alternately(bench, monkeypatch):
    """attention._confirm: the site and the fastest re-timed in interleaved rounds, medians; None
    where one of them has no timed calls (Inductor's)."""
    order, times = [], {"a": iter([5.0, 1.0, 2.0]), "b": iter([3.0, 3.0, 9.0])}

    def thunk(name):
        return lambda: order.append(name)
    monkeypatch.setattr(bench, "_device_ms", lambda fn: (fn(), next(times[order[-1]]))[1])
    got = bench._confirm({"a": {"fwd": thunk("a")}, "b": {"infer": thunk("b"), "train": thunk("b")}},
                         ("a", "b"), "fwd", rounds=3)
    assert got == {"a": 2.0, "b": 3.0} and order == ["a", "b"] * 3
    assert bench._confirm({"a": {"fwd": thunk("a")}, "b": {"infer": thunk("b")}}, ("a", "b"), "train") is None
    assert bench._confirm({"a": {"fwd": thunk("a")}}, ("a", "inductor"), "fwd") is None
