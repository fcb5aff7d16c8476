"""benchmarks/current.py and benchmarks/chart.py (pure Python, no GPU): RESULTS.md's "Current
results" and the README's headlines match benchmarks/results/current.json; the JSON's figures agree
with the ratios the runs printed (a transcription check) and carry their provenance; the README
keeps the shape CI and a newcomer rely on; the chart's bars (its data, drawn only where matplotlib
is installed) and a zoo.py --json file taken in as the zoo's entry."""
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import chart  # noqa: E402
import current  # noqa: E402


@pytest.fixture(scope="module")
def data():
    return current.load()


def test_results_and_readme_match_the_json(data):
    assert current.check(data) == []


def test_check_sees_a_drifted_number(data):
    results = current.RESULTS.read_text()
    r = data["shapes"]["rows"][0]  # (its first shapes row, whatever the current run's numbers)
    cell = f"| {r['row']} | {r['mode']} | {r['compile'][0]} ({r['compile'][1]})"
    drifted = results.replace(cell, cell.replace(f"{r['compile'][0]} (", f"{r['compile'][0] + 1} ("), 1)
    assert drifted != results
    problems = current.check(data, {current.RESULTS: drifted})
    assert len(problems) == 1 and "RESULTS.md" in problems[0]


def test_the_figures_agree_with_the_recorded_ratios(data):
    for r in data["shapes"]["rows"]:
        assert abs(current.shapes_ratio(r) - r["recorded_ratio"]) <= 0.0051, r
    for r in data["e2e"]["rows"]:
        got = current.e2e_ratios(r)
        assert all(abs(got[t] - r["recorded_ratio"][t]) <= 0.0051 for t in ("train", "infer")), r
    groups = current.generate_groups(data)
    assert len(groups) == 16
    recorded = {(r["model"], r["prompt"], r["batch"], r["mode"], r["variant"]): r for r in data["generate"]["rows"]}
    for g in groups:
        key = (g["model"], g["prompt"], g["batch"], g["mode"])
        assert abs(g["plugin_over_best"] - recorded[key + ("plugin",)]["recorded_plugin_over_best_stock"]) <= 0.0051
        assert abs(g["floor_over_best"] - recorded[key + ("floor",)]["recorded_floor_over_best_stock"]) <= 0.0051
    assert abs(current.window_ratio(data) - data["window"]["e2e"]["recorded_ratio"]) <= 0.0051
    for r in data["kernels"]["rotary"]["rows"]:
        assert abs(r["ours"] / r["compiled"] - r["ours_over_compiled"]) <= 0.0051, r
        assert abs(r["ours"] / r["copy"] - r["ours_over_copy"]) <= 0.0051, r


def test_every_entry_has_its_provenance(data):
    entries = [*data["kernels"].values()] + [data[k] for k in ("shapes", "e2e", "window", "generate", "distributed")]
    for e in entries:
        p = e["provenance"]
        for field in ("stop", "date", "gpu", "torch", "triton", "command", "source"):
            assert p.get(field), (field, p)
        assert e["rows"] and e["unit"]
    zoo = data["zoo"]
    assert zoo["results"] is not None or (zoo["status"] == "not measured yet" and "zoo.py" in zoo["command"])


def test_results_md_opens_with_the_current_results_then_the_history():
    text = current.RESULTS.read_text()
    assert text.startswith("# Benchmark results\n")
    assert text.index(current.begin(current.SECTION)) < text.index("## Current results") < text.index(
        current.end(current.SECTION)) < text.index("\n# History\n") < text.index("## Foundation")
    for stop in range(12, 22):
        assert re.search(rf"^## .*[Ss]top {stop}\b", text, re.M), stop


def test_readme_front_door():
    text = current.README.read_text()
    # .ci/run takes the test command from the first code block
    first_block = text.split("```")[1]
    assert "python -m pytest -q" in first_block and "python -m fuse_plugin demo" in first_block
    assert text.index("```") < text.index("## ")  # the commands come first
    assert "](docs/speedup.png)" in text and (ROOT / "docs" / "speedup.png").is_file()
    section = text.split("## Supported", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| |")]
    assert 0 < len(rows) <= 15
    for row in rows:
        for cell in row.strip("|").split("|"):
            assert len(cell.split()) <= 20, cell
    for link in ("docs/SUPPORTED.md", "docs/SETTINGS.md", "benchmarks/RESULTS.md#current-results"):
        assert link in text


def test_chart_bars(data):
    bars = chart.series(data)
    shapes = [b for b in bars if b["group"].startswith("Whole models")]
    assert len(shapes) == len(data["shapes"]["rows"]) == 24  # 12 rows x 2 modes (stop 43; one row stop 44's)
    assert {b["mode"] for b in shapes} == {"default", "reduce-overhead"}
    # every row at or above the best stock variant but one under CUDA graphs: ViT-S training 0.998
    # (paired 1.00, stop 43); Llama inference at 1 x 128 tokens under CUDA graphs read 0.88 (paired
    # 1.09) at stop 43 in runs of 10 steps (4 ms) and 1.14 (paired 1.14) re-timed at stop 44 in runs
    # of 115 steps (shapes.py --min-run-ms), the row recorded now
    below = {(b["label"], b["mode"]) for b in shapes if b["ratio"] < 1.0}
    assert below <= {("vit-train-64", "reduce-overhead")}, below
    assert min(b["ratio"] for b in shapes) >= 0.99
    long = [b for b in bars if b["group"].startswith("Long context")]
    assert [round(b["ratio"], 2) for b in long] == [round(current.e2e_median(data)[t], 2) for t in ("train", "infer")]
    zoo = [b for b in bars if b["group"].startswith("timm zoo")]
    assert len(zoo) == len(data["zoo"]["results"]["rows"]) == 40  # 20 default rows, 20 under CUDA graphs (stop 36: one run)
    assert data["zoo"]["provenance"]["gpu"] in zoo[0]["group"]  # not the shapes' GPU: said in the heading


def _zoo_json(tmp_path) -> Path:
    """A file as benchmarks/zoo.py --json writes it (through its own writer)."""
    import zoo

    rows = [
        {"model": "vit_s16", "task": "infer", "mode": "default", "fused_path": {"Attention": 12},
         "variants": {"compile": {"img_s": 1000.0, "best_img_s": 1010.0},
                      "fused+compile": {"img_s": 1500.0, "best_img_s": 1510.0},
                      "plugin": {"img_s": 1650.0, "best_img_s": 1660.0, "attention": 12, "attention_left": 0}}},
        {"model": "levit_128s", "task": "train", "mode": "reduce-overhead", "fused_path": {},
         "variants": {"compile": {"img_s": 800.0, "best_img_s": 810.0},
                      "fused+compile": {"same_as": "compile", "why": "no fused path"},
                      "plugin": {"img_s": 760.0, "best_img_s": 770.0, "attention": 4, "attention_left": 2}}},
    ]
    path = tmp_path / "zoo.json"
    header = ("NVIDIA H100 80GB HBM3 | bf16 | torch 2.11.0+cu130 | timm 1.0.29 | 2026-11-26 | batch 64 | img/s, "
              "median (best) of 5 interleaved runs of 10 steps")
    zoo.write_outputs(header, rows, list(zoo.VARIANTS), SimpleNamespace(out=None, json=str(path)))
    return path


def test_zoo_json_becomes_the_zoo_entry(data, tmp_path):
    taken = current.take_zoo(data, _zoo_json(tmp_path), "stop 22", "abc1234")
    p = taken["zoo"]["provenance"]
    assert (p["stop"], p["date"], p["gpu"], p["torch"], p["timm"], p["code"]) == (
        "stop 22", "2026-11-26", "NVIDIA H100 80GB HBM3", "2.11.0+cu130", "1.0.29", "abc1234")
    zoo_bars = [b for b in chart.series(taken) if b["group"].startswith("timm zoo")]
    assert [(b["label"], b["mode"], round(b["ratio"], 3)) for b in zoo_bars] == [
        ("vit_s16-infer", "default", 1.1), ("levit_128s-train", "reduce-overhead", 0.95)]
    section = current.zoo_section(taken)
    assert "| vit_s16 | infer | default | 1000 (1010) | 1500 (1510) | 1650 (1660) | 1.10 | 12 / 0 |" in section
    assert "| levit_128s | train | reduce-overhead | 800 (810) | = compile | 760 (770) | 0.95 | 4 / 2 |" in section
    # the JSON writer keeps everything (one row per line) and reads back equal
    out = tmp_path / "current.json"
    current.dump(taken, out)
    assert current.load(out) == json.loads(json.dumps(taken))


def test_chart_draws(data, tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib, which neither the package nor CI installs")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chart.py"), "--out", str(tmp_path / "c.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_a_merged_zoo_header_is_one_line():
    # zoo.py --merge keeps each file's header (a line each): shared fields once, then each line's own
    merged = "GPU | bf16 | 2026-12-07 | img/s, 30 runs of 2 steps\nGPU | bf16 | 2026-12-07 | img/s, 5 runs of 10 steps"
    assert current.merged_header(merged) == "GPU | bf16 | 2026-12-07 | img/s, 30 runs of 2 steps; img/s, 5 runs of 10 steps"
    assert current.merged_header("GPU | bf16 | one line") == "GPU | bf16 | one line"
