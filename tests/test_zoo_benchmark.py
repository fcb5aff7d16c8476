"""benchmarks/zoo.py (the timm zoo table), its pure-Python parts on the CPU: the rows and their
order, the flags, the fused_attn switch, the table and ratio from a results list, --merge, a row
run in-process (eager variant: no compile), and --parallel's order (waves built at once, rows timed
one at a time) from timestamps. timm is not needed: the models here are stand-ins; only the check
that MODELS names exist in timm needs it."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPT = os.path.join(BENCH, "zoo.py")
sys.path.insert(0, BENCH)
import zoo  # noqa: E402

ZOO_TIMM = ["vit_small_patch16_224", "deit3_small_patch16_224", "eva02_tiny_patch14_224",
            "swin_tiny_patch4_window7_224", "beit_base_patch16_224", "pvt_v2_b0", "levit_128s",
            "xcit_nano_12_p16_224", "twins_svt_small", "cait_xxs24_224"]


def test_models_and_rows():
    assert list(zoo.MODELS.values()) == ZOO_TIMM
    # short names and timm names both select a model; unknown names are refused
    assert zoo.resolve_models("swin_t,levit_128s,cait_xxs24_224,tiny") == ["swin_t", "levit_128s", "cait_xxs24", "tiny"]
    with pytest.raises(ValueError, match="unknown model 'vit_huge'"):
        zoo.resolve_models("vit_s16,vit_huge")
    rows = zoo.rows_of(["vit_s16", "swin_t"], ["infer", "train"], ["default", "reduce-overhead"])
    assert len(rows) == 8 and rows[:3] == [("vit_s16", "infer", "default"), ("vit_s16", "infer", "reduce-overhead"),
                                           ("vit_s16", "train", "default")]
    # built and timed: default mode first, inference first, then the table's order
    order = zoo.build_order(rows)
    assert [r[2] for r in order] == ["default"] * 4 + ["reduce-overhead"] * 4
    assert [r[1] for r in order[:4]] == ["infer", "infer", "train", "train"]
    assert order[0] == ("vit_s16", "infer", "default") and order[1] == ("swin_t", "infer", "default")
    assert sorted(order) == sorted(rows)


def test_flags():
    args = zoo.parse([])
    assert args.models == list(zoo.MODELS) and args.tasks == ["infer", "train"]
    assert args.modes == ["default", "reduce-overhead"] and args.variants == ["compile", "fused+compile", "plugin"]
    assert (args.batch, args.steps, args.rounds, args.parallel) == (64, 10, 5, 0)
    tiny = zoo.parse(["--cpu", "--tiny", "--models", "tiny", "--rounds", "2"])
    assert (tiny.device, tiny.dtype, tiny.batch, tiny.steps, tiny.rounds, tiny.modes) == (
        "cpu", torch.float32, 2, 1, 2, ["default"])  # --tiny keeps what was given (rounds)
    for bad in (["--variants", "compile,sdpa"], ["--tasks", "eval"], ["--modes", "max-autotune"], ["--models", "x"]):
        with pytest.raises(SystemExit):
            zoo.parse(bad)


class _Attn(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused_attn = fused


class _ClassAttn(_Attn):
    pass


class _Talking(nn.Module):  # hand-written only, like CaiT's TalkingHeadAttn
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)


def test_set_fused_attn_on_every_module_that_has_it():
    model = nn.Sequential(nn.Sequential(_Attn(True), _Talking(), _Attn(False)),
                          nn.ModuleList([_ClassAttn(True), nn.Sequential(_ClassAttn(True))]))
    assert zoo.set_fused_attn(model, False) == {"_Attn": 2, "_ClassAttn": 2}
    assert [m.fused_attn for m in model.modules() if hasattr(m, "fused_attn")] == [False] * 4
    assert zoo.set_fused_attn(model, True) == {"_Attn": 2, "_ClassAttn": 2}
    assert all(m.fused_attn for m in model.modules() if hasattr(m, "fused_attn"))
    assert zoo.set_fused_attn(nn.Sequential(_Talking()), True) == {}  # no fused path (LeViT)
    tiny = zoo.create("tiny")
    assert zoo.set_fused_attn(tiny, True) == {"_TinyAttention": 2}
    x = torch.randn(2, 3, 32, 32)
    fused = tiny(x)
    zoo.set_fused_attn(tiny, False)
    torch.testing.assert_close(tiny(x), fused, atol=1e-5, rtol=1e-5)  # the two paths agree


def _cell(img_s, **kw):
    return {"img_s": img_s, "best_img_s": img_s * 1.1, "graphs": 1, "compile_s": 1.0, "max_abs": 0.0, "rel": 0.0, **kw}


def _rows():
    plugin = dict(attention=12, attention_left=2, rotary=0, max_abs=0.0312, rel=0.0021)
    return [
        {"model": "vit_s16", "task": "infer", "mode": "default", "fused_path": {"Attention": 12}, "recompiles": 0,
         "variants": {"compile": _cell(1000.0), "fused+compile": _cell(2000.0), "plugin": _cell(2100.0, **plugin)}},
        {"model": "levit_128s", "task": "train", "mode": "reduce-overhead", "fused_path": {}, "recompiles": 0,
         "variants": {"compile": _cell(800.0), "fused+compile": {"same_as": "compile", "why": "no fused path"},
                      "plugin": _cell(600.0, **plugin)}},
        {"model": "swin_t", "task": "train", "mode": "default", "fused_path": {"WindowAttention": 12},
         "recompiles": 0, "variants": {"compile": _cell(500.0), "fused+compile": {"error": "OOM"},
                                        "plugin": _cell(550.0, **plugin)}},
        {"model": "beit_b", "task": "infer", "mode": "default", "variants": {}, "error": "RuntimeError: no model"},
        {"model": "xcit_nano", "task": "infer", "mode": "default", "fused_path": {"XCA": 12}, "variants": {},
         "error": "not timed (--deadline)"},
    ]


def test_ratio_against_the_better_stock_variant():
    rows = _rows()
    assert zoo.ratio(rows[0]) == 1.05  # 2100 / max(1000, 2000)
    assert zoo.ratio(rows[1]) == 0.75  # no fused path: against compile alone (600 / 800)
    assert zoo.ratio(rows[2]) == 1.1  # fused+compile OOM: against the one left
    assert zoo.ratio(rows[3]) is None
    assert zoo.img_s(rows[1], "fused+compile") == 800.0


def test_rounds_rotate_and_the_paired_ratio():
    """Each round starts one variant later (common.round_order); the paired ratio is the median of
    the per-round ratios against the faster stock run of the same round (zoo.py and shapes.py)."""
    import common
    import shapes

    assert [common.round_order(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    results = {("r", "default", "compile"): 100.0, ("r", "default", "compile", "best"): 120.0,
               ("r", "default", "compile", "rounds"): [1.0, 1.2, 1.0],
               ("r", "default", "plugin"): 99.0, ("r", "default", "plugin", "best"): 125.0,
               ("r", "default", "plugin", "rounds"): [0.9, 1.25, 0.95]}
    line = shapes.table(results, ["r"], ["default"], ["compile", "plugin"])[-1]
    # medians 99 / 100; per round 1.0 / 0.9, 1.2 / 1.25, 1.0 / 0.95 -> median 1.053
    assert line == "| r | default | 100 (120) | 99 (125) | 0.99 (paired 1.05) |", line
    row = {"variants": {"compile": {"rounds_s": [2.0, 4.0, 2.0]}, "fused+compile": {"rounds_s": [1.0, 2.2, 1.0]},
                        "plugin": {"rounds_s": [1.0, 2.0, 1.25]}}}
    # per round: 1.0 / 1.0, 2.2 / 2.0, 1.0 / 1.25 -> sorted 0.8, 1.0, 1.1 -> median 1.0
    assert zoo.paired_ratio(row) == 1.0
    assert zoo.paired_ratio(row, "plugin-fused") is None
    row["variants"]["plugin"]["rounds_s"] = [1.0]  # rounds that do not pair up
    assert zoo.paired_ratio(row) is None


def test_warm_steps_run_untimed_before_each_timed_run(monkeypatch):
    """--warm-steps: each turn runs its untimed steps and a sync first, then --steps timed ones,
    and the timed wall covers only those (the steady state, not the first steps after another
    variant's turn); rows' workers get the flag too."""
    import time as _time

    calls, syncs = [], []
    monkeypatch.setattr(zoo, "sync", lambda device: syncs.append(len(calls)))
    args = zoo.parse(["--cpu", "--models", "tiny", "--steps", "2", "--warm-steps", "3"])
    assert args.warm_steps == 3 and zoo.parse([]).warm_steps == 0
    slow = iter([0.05] * 3 + [0.0] * 2)  # the three warm steps are slow, the timed ones not

    def step():
        calls.append(1)
        _time.sleep(next(slow))

    issued = []
    wall = zoo.timed_round(step, args, issued)
    assert len(calls) == 5 and syncs == [3, 5]  # warm steps, a sync, the timed steps, a sync
    assert wall < 0.05 and len(issued) == 1  # the warm steps' 0.15 s is not in the timed wall
    argv = zoo.worker_argv(args, ("tiny", "infer", "default"), "p")
    assert argv[argv.index("--warm-steps") + 1] == "3"
    assert "after 3 untimed" in zoo.header_of(args)


def test_shapes_runs_last_at_least_min_run():
    """shapes.py's steps per run: --steps, or more where the row's fastest variant ran them in
    less than --min-run-ms, so that every variant's run lasts at least that long."""
    import shapes

    assert shapes.run_steps(10, [0.2, 0.3], 0.05) == 10  # 200 ms already
    assert shapes.run_steps(10, [0.004, 0.005], 0.05) == 125  # the fastest: 4 ms for 10 steps
    assert shapes.run_steps(10, [0.004], 0.0) == 10  # off
    assert shapes.run_steps(10, [], 0.05) == 10  # nothing probed (every variant failed)


def test_shapes_times_short_rows_for_more_rounds():
    """shapes.py's rounds: --rounds, or more (at most MAX_ROUNDS) where that many rounds would
    time for less than --min-timing-s, so that one slow phase of the host cannot move a
    host-bound row's median."""
    import shapes

    assert shapes.run_rounds(5, 2.0, 3.0) == 5  # 10 s of rounds already
    assert shapes.run_rounds(5, 0.5, 3.0) == 6  # 6 rounds of 0.5 s
    assert shapes.run_rounds(5, 0.01, 3.0) == shapes.MAX_ROUNDS  # capped
    assert shapes.run_rounds(5, 0.01, 0.0) == 5  # off
    assert shapes.run_rounds(5, 0.0, 3.0) == 5  # nothing probed (every variant failed)
    assert shapes.run_rounds(30, 0.01, 3.0) == 30  # never fewer than asked


def test_table():
    variants = list(zoo.VARIANTS)
    lines = zoo.table(_rows(), variants)
    assert lines[0].startswith("| model | task | mode | fused path | compile | fused+compile | plugin | "
                               "plugin / best |")
    ncols = lines[0].count("|")
    assert all(line.count("|") == ncols for line in lines), lines  # every line has every column
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    assert cells[0] == ["vit_s16", "infer", "default", "Attention×12", "1000 (1100)", "2000 (2200)", "2100 (2310)",
                        "1.05", "12 / 2", "3.12e-02 (2.1e-03)", "1/1/1", "0"]
    assert cells[1][3:8] == ["none", "800 (880)", "= compile (no fused path)", "600 (660)", "0.75"]
    assert cells[2][5] == "OOM" and cells[2][7] == "1.10"
    assert cells[3][:5] == ["beit_b", "infer", "default", "?", "RuntimeError: no model"]
    assert cells[4][3:5] == ["XCA×12", "not timed (--deadline)"]


def test_merge_and_json(tmp_path):
    rows = _rows()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    args = zoo.parse(["--json", str(a), "--out", str(tmp_path / "a.md")])
    zoo.write_outputs("H1", rows[:2], ["compile", "plugin"], args)
    args.json = str(b)
    zoo.write_outputs("H1", rows[2:], ["compile", "fused+compile", "plugin"], args)
    assert json.loads(a.read_text())["rows"] == rows[:2]
    header, variants, merged = zoo.merge([str(a), str(b)])
    assert header == "H1" and variants == ["compile", "plugin", "fused+compile"] and merged == rows
    rerun = {**rows[3], "error": "rerun"}  # a row again: replaces the earlier one, in its place
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"header": "H2", "variants": ["compile"], "rows": [rerun]}))
    header, _, merged = zoo.merge([str(a), str(b), str(c)])
    assert header == "H1\nH2" and merged == rows[:3] + [rerun] + rows[4:]
    out = tmp_path / "all.md"
    zoo.main(["--merge", f"{a},{b}", "--out", str(out)])
    assert [line.split("|")[1].strip() for line in out.read_text().splitlines() if line.startswith("| ")][1:] == [
        "vit_s16", "levit_128s", "swin_t", "beit_b", "xcit_nano"]


def test_row_in_process_eager_and_no_fused_path(monkeypatch):
    args = zoo.parse(["--cpu", "--tiny", "--models", "tiny", "--variants", "eager"])
    row = zoo.run_row("tiny", "train", "default", args, lambda s: None)
    assert row["fused_path"] == {"_TinyAttention": 2} and row["recompiles"] == 0 and "error" not in row
    eager = row["variants"]["eager"]
    assert eager["max_abs"] == 0.0 and eager["graphs"] == 0 and eager["img_s"] > 0 and len(eager["rounds_s"]) == 1
    assert eager["cudagraph_skips"] == 0  # counted per variant (a reduce-overhead graph run without CUDA graphs)
    # each round's host issue time, taken before its sync: never more than its wall time
    assert len(eager["issue_s"]) == 1 and 0 < eager["issue_s"][0] <= eager["rounds_s"][0]
    assert re.fullmatch(r"\d+\.\d / \d+\.\d", zoo.issue_ms(row, "eager", args.steps))
    # a model with no fused_attn anywhere (LeViT): fused+compile is not built, the row says why
    monkeypatch.setattr(zoo, "create", lambda name: (torch.manual_seed(0), zoo.TinyViT(fused_path=False))[1])
    args.variants = ["eager", "fused+compile"]
    row = zoo.run_row("tiny", "infer", "default", args, lambda s: None)
    assert row["fused_path"] == {} and "error" not in row
    assert row["variants"]["fused+compile"] == {"same_as": "compile", "why": "no fused path"}
    assert zoo.img_s(row, "fused+compile") is None  # compile was not asked for: no number invented


def test_kernel_diffs_name_what_a_route_adds_to_a_step():
    """--profile's diffs: per kernel (us, count) a step, each variant against the fused path's."""
    from common import kernel_diff

    fused = {"gemm": (100.0, 4.0), "flash_fwd": (10.0, 2.0), "softmax": (0.4, 1.0)}
    ours = {"gemm": (100.5, 4.0), "cudnn_fwd": (12.0, 2.0), "copy": (55.0, 2.0), "softmax": (0.2, 1.0)}
    text = kernel_diff(fused, ours, "cait train ro plugin - fused+compile")
    lines = text.splitlines()
    assert lines[0] == ("[diff] cait train ro plugin - fused+compile: GPU +57.3 us/step; "
                        "kernels differing by >= 1 us (3, largest 3):")
    # largest first, a kernel only one side runs included; below 1 us (gemm, softmax) left out
    assert [line.split()[-1] for line in lines[1:]] == ["copy", "cudnn_fwd", "flash_fwd"]
    assert "+55.0 us (x0.0 -> x2.0) copy" in lines[1] and "-10.0 us (x2.0 -> x0.0) flash_fwd" in lines[3]
    logged = []
    zoo.log_kernel_diffs({"compile": fused, "fused+compile": fused, "plugin": ours}, "row", logged.append)
    assert [line.splitlines()[0].split(":")[0] for line in logged] == [
        "[diff] row compile - fused+compile", "[diff] row plugin - fused+compile"]
    logged.clear()
    zoo.log_kernel_diffs({"plugin": ours}, "row", logged.append)  # no stock variant profiled: nothing to diff
    assert logged == []


def test_model_names_exist_in_timm():
    timm = pytest.importorskip("timm", reason="timm is not installed (the zoo's models come from it)")
    missing = [name for name in ZOO_TIMM if name not in timm.list_models()]
    assert not missing, missing


def test_parallel_waves_build_first_then_time_one_row_at_a_time(tmp_path):
    """4 rows (tiny x infer, train x default, reduce-overhead), eager only, --parallel 2: two waves."""
    js = tmp_path / "zoo.json"
    r = subprocess.run([sys.executable, SCRIPT, "--cpu", "--models", "tiny", "--variants", "eager", "--batch", "2",
                        "--steps", "1", "--rounds", "1", "--parallel", "2", "--json", str(js)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    log = r.stdout.splitlines()

    def stamps(prefix):
        return [float(re.search(r"t = ([0-9.]+)", line).group(1)) for line in log if line.startswith(prefix)]

    started, built = stamps("wave "), stamps("wave ")
    started, built = started[0::2], built[1::2]  # each wave: "building ... from t", "all rows built ... t"
    timing, done = stamps("  timing from t"), stamps("row tiny")
    assert len(started) == len(built) == 2 and len(timing) == len(done) == 4, r.stdout
    # within a wave, no row times before every row of it is built; rows time one after another
    assert min(timing[:2]) >= built[0] and min(timing[2:]) >= built[1], (built, timing)
    assert all(t >= d for t, d in zip(timing[1:], done)), (timing, done)
    # the second wave starts building only when the first wave's rows are done
    assert started[1] >= max(done[:2]), (started, done)
    # timed in build order (default mode first), each worker exiting cleanly
    assert re.findall(r"^--- row (tiny \S+ \S+) \(exit 0\)", r.stdout, re.M) == [
        "tiny infer default", "tiny train default", "tiny infer reduce-overhead", "tiny train reduce-overhead"]
    # the JSON in the table's order, every row timed
    rows = json.loads(js.read_text())["rows"]
    assert [(row["task"], row["mode"]) for row in rows] == [("infer", "default"), ("infer", "reduce-overhead"),
                                                            ("train", "default"), ("train", "reduce-overhead")]
    assert all(row["variants"]["eager"]["img_s"] > 0 and row["recompiles"] == 0 for row in rows)
