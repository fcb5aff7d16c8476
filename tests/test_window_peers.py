"""benchmarks/window_peers.py on the CPU: the r-normalised ratios from synthetic times, and a smoke
run end to end (our kernels in Triton's interpreter, JAX's XLA attention where JAX is installed;
FlexAttention has no CPU backward, which its row reports)."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import window_peers  # noqa: E402


def test_ratios_against_own_and_best_causal():
    res = {"a": {"causal": {"train": 10.0}, "window": {"train": 3.0}},
           "b": {"causal": {"train": 8.0}, "causal-x": {"train": 12.0}, "window": {"train": 2.0}},
           "c": {"error": "refused"},
           "d": {"causal": {"train": 5.0}, "window": {"error": "refused"}}}
    out = window_peers.ratios(res, 0.25)
    assert set(out) == {"a", "b"}  # c and d have no window time
    assert out["a"]["own"] == {"causal": pytest.approx(3.0 / 2.5)}
    assert out["b"]["own"] == {"causal": pytest.approx(1.0), "causal-x": pytest.approx(2.0 / 3.0)}
    # the best causal of the run is d's 5.0, although d's window did not run
    assert out["a"]["vs_best"] == pytest.approx(3.0 / 1.25) and out["b"]["vs_best"] == pytest.approx(2.0 / 1.25)


def test_smoke_run(tmp_path):
    js = tmp_path / "peers.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "window_peers.py"), "--cpu-smoke", "--configs", "gqa",
                        "--json", str(js)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(js.read_text())
    res = data["results"]["gqa-192"]
    ours = res["ours"]
    assert ours["causal"]["train"] > 0 and ours["window"]["train"] > 0 and "error" in ours["causal-gluon"]
    r_area = (64 * 192 - 64 * 63 // 2) / (192 * 193 // 2)
    assert data["ratios"]["gqa-192"]["ours"]["own"]["causal"] == pytest.approx(
        ours["window"]["train"] / (r_area * ours["causal"]["train"]))
    assert "error" in res["flex"] and "backward on CPU" in res["flex"]["error"]
    jax_row = res["xla-jax"]
    assert ("train" in jax_row.get("window", {})) or "jax" in json.dumps(jax_row).lower()


def test_the_floor_of_a_tile_with_fixed_costs():
    # no fixed cost: only the window's two partly visible blocks (34 visited for 32 live at W 4096)
    assert window_peers.floor_ratio(0, 16384, 4096) == pytest.approx(34 / 32)
    # a fixed cost weighs more the shorter the window's tiles are against the causal ones
    f16, f32 = window_peers.floor_ratio(10, 16384, 4096), window_peers.floor_ratio(10, 32768, 4096)
    assert 1.15 < f16 < f32 < 1.3
    assert f32 == pytest.approx((34 + 10) / 32 * 128 / 138)
