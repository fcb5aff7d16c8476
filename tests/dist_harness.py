"""The multi-process harness of the distributed tests (test_distributed, test_ring_attention,
test_context_parallel): a test spawns one worker process per rank (`spawn_ranks`); each worker
runs its scenarios in one gloo process group and writes what it measured (`run_scenarios`); each
test asserts one scenario on every rank (`facts`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import torch


def spawn_ranks(worker: str, world: int, out, timeout: float, what: str) -> dict:
    """Run `worker` on `world` ranks (gloo over a file store in `out`); {rank: {scenario: result}}.
    Fails the calling test (pytest.fail) on a timeout or a rank that wrote nothing."""
    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(world), str(out / "store"), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the {what} did not finish in {timeout:.0f} s")
    found = {}
    for r, (p, log) in enumerate(zip(procs, logs)):
        path = out / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no results (exit {p.returncode}); its output:\n{log[-5000:]}")
        found[r] = json.loads(path.read_text())
    return found


def facts(results: dict, scenario: str) -> list:
    """The scenario's facts from every rank (a rank's traceback fails the test)."""
    out = []
    for r, per_rank in results.items():
        res = per_rank[scenario]
        assert "error" not in res, f"rank {r}, scenario {scenario}:\n{res['error']}"
        out.append(res["facts"])
    return out


def run_scenarios(scenarios: dict, ctx: dict, rank: int, out_dir: str) -> None:
    """In a worker: run every scenario (name: fn(ctx) -> facts), a barrier after each, write
    rank{rank}.json ({name: {"facts" | "error", "wall_s"}}), close the group and exit."""
    import torch.distributed as dist

    results = {}
    for name, fn in scenarios.items():
        t0 = time.perf_counter()
        try:
            results[name] = {"facts": fn(ctx)}
        except Exception:  # noqa: BLE001 - reported by the test of that scenario
            results[name] = {"error": traceback.format_exc()}
        results[name]["wall_s"] = time.perf_counter() - t0
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo's threads have aborted it at exit)


def error_of(fn) -> dict:
    """What fn() raised, for a scenario to record and its test to judge: {"raised": the exception's
    type name or None, "message": its text}."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


def rel_err(a, b) -> float:
    """|a - b| / |b| (Frobenius norms, in float64)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full_problem(B, Hq, Hkv, L, D, seed=0):
    """Seeded float32 q (B, Hq, L, D), k and v (B, Hkv, L, D) and an output gradient (B, Hq, L, D)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (Hq, Hkv, Hkv))
    return q, k, v, torch.randn(B, Hq, L, D, generator=g)
