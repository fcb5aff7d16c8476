"""benchmarks/common.py's parallel runner (zoo.py and shapes.py --parallel, --prepass) with a stand-in
worker, no torch compile: rows build at once, time one at a time, each on its GPU of the round-robin
(CUDA_VISIBLE_DEVICES as a machine of two GPUs would give), a deadline reports the rows it cuts, and
the pre-pass never runs more than N commands at once."""
import json
import os
import sys
import time

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import common  # noqa: E402

WORKER = """
import json, os, sys, time
sys.path.insert(0, {bench!r})
import common
prefix, build_s = sys.argv[1], float(sys.argv[2])
time.sleep(build_s)
common.wait_for_turn(prefix, 0.5)
t0 = time.time()
time.sleep(0.2)
with open(prefix + ".json", "w") as f:
    json.dump({{"gpu_env": os.environ.get("CUDA_VISIBLE_DEVICES"), "threads": os.environ["OMP_NUM_THREADS"],
               "timed": [t0, time.time()]}}, f)
"""

PREPASS = """
import os, sys, time
d = sys.argv[1]
open(os.path.join(d, "run%d" % os.getpid()), "w").close()
n = len([f for f in os.listdir(d) if f.startswith("run")])
open(os.path.join(d, "max"), "a").write("%d\\n" % n)
time.sleep(0.3)
os.remove(os.path.join(d, "run%d" % os.getpid()))
"""


def _worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER.format(bench=BENCH))
    return str(path)


def test_waves_time_one_row_at_a_time_spread_over_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "visible_gpus", lambda: ["0", "1"])
    worker, seen = _worker(tmp_path), []
    done = common.run_waves(["a", "b", "c"], lambda row, prefix: [sys.executable, worker, prefix, "0.3"], 2,
                            float("inf"), lambda row, why: {"error": why}, lambda d: seen.append(len(d)),
                            name=str)
    assert sorted(done) == ["a", "b", "c"] and seen == [1, 2, 3]
    # round-robin over the GPUs by the row's place in the order; the result says which
    assert [done[r]["gpu_env"] for r in "abc"] == ["0", "1", "0"] == [done[r]["gpu"] for r in "abc"]
    assert all(done[r]["threads"] == str(max(1, (os.cpu_count() or 1) // 2)) for r in "abc")
    spans = sorted(done[r]["timed"] for r in "abc")
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # never two rows timed side by side


def test_a_deadline_reports_the_rows_it_cuts(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "visible_gpus", lambda: [])
    worker = _worker(tmp_path)
    t0 = time.perf_counter()
    done = common.run_waves(["fast", "slow", "later"],
                            lambda row, prefix: [sys.executable, worker, prefix, "0.1" if row == "fast" else "30"],
                            2, t0 + 4, lambda row, why: {"error": why}, name=str)
    assert time.perf_counter() - t0 < 20
    # a wave times only once all its rows are built: the deadline came first
    assert done["fast"] == {"error": "not timed (--deadline)"}
    assert done["slow"] == {"error": "not built (--deadline)"}
    assert done["later"] == {"error": "not built (--deadline)"}


def test_prepass_runs_at_most_n_at_once(tmp_path, capsys):
    script = tmp_path / "cell.py"
    script.write_text(PREPASS)
    common.prepass([[sys.executable, str(script), str(tmp_path)]] * 5, 2, time.perf_counter() + 60)
    peaks = [int(x) for x in (tmp_path / "max").read_text().split()]
    assert len(peaks) == 5 and max(peaks) <= 2
    assert "5 of 5 cells compiled" in capsys.readouterr().out


def test_the_kernel_tables_prepass_slices_its_rows(monkeypatch):
    """attention.py --choice --prepass N: N --warm processes over consecutive slices of the rows,
    run through common.prepass (GPU spread, the limit)."""
    import attention

    seen = []
    monkeypatch.setattr(attention, "prepass", lambda argvs, n, deadline: seen.append((argvs, n, deadline)))
    t0 = time.perf_counter()
    attention.warm_prepass(3, 10, 100)
    (argvs, n, deadline), = seen
    assert n == 3 and t0 + 99 < deadline < time.perf_counter() + 101
    assert [a[-3:] for a in argvs] == [["--warm", "--rows", r] for r in ("0:3", "3:7", "7:10")]
