"""benchmarks/generate.py --parallel (the generate table in one device hold, issue 15): a process
per row, all rows built before any is timed, the rows timed one at a time, one table in the rows'
own order. Checked on the CPU with the eager variant only (no compile: a few seconds)."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]'): "
                    "benchmarks/generate.py needs it")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "generate.py")


def test_parallel_rows_build_first_then_time_one_at_a_time(tmp_path):
    out = tmp_path / "table.md"
    r = subprocess.run([sys.executable, SCRIPT, "--cpu", "--tiny", "--parallel", "--batches", "2,1",
                        "--variants", "eager", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = r.stdout
    def stamp(line):
        return float(re.search(r"t = ([0-9.]+)", line).group(1))

    built = stamp(next(line for line in log.splitlines() if line.startswith("all rows built")))
    timing = [stamp(line) for line in log.splitlines() if "timing from t = " in line]
    done = [stamp(line) for line in log.splitlines() if line.startswith("row tiny")]
    # no row times before every row is built; each row times after the previous one is done
    assert len(timing) == 2 and min(timing) >= built, (built, timing)
    assert sorted(timing) == timing and timing[1] >= done[0], (timing, done)
    # timed smallest first, each row's worker exits cleanly
    assert log.index("--- row tiny 16 x 1 (exit 0)") < log.index("--- row tiny 16 x 2 (exit 0)")
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny")]
    # the table in the order the rows were asked for (batches 2, then 1), eager equal to itself
    assert [row.split("|")[3].strip() for row in rows] == ["2", "1"], rows
    assert [row.split("|")[9].strip() for row in rows] == ["2/2", "1/1"], rows
