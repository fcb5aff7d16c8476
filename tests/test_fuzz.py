"""The differential fuzzer (tests/fuzz_attention.py) in CI: a fast seeded subset.

By default FAST_CASES generated cases (seeds 0..FAST_CASES-1, about 25 s on 2 cores) run; the slow
mode runs more: `FUSE_PLUGIN_FUZZ=500 python -m pytest -q tests/test_fuzz.py` (seeds from
FUSE_PLUGIN_FUZZ_SEED, default 0), or `python tests/fuzz_attention.py 500`. With
FUSE_PLUGIN_FUZZ_BACKEND=inductor the cases compile with the real backend (Inductor on the CPU,
much slower). Every case must equal eager (outputs, gradients of the inputs and parameters), and
every mutant must be left alone.
"""
import os

import pytest

import fuse_plugin  # noqa: F401  (registers the ops)
from fuzz_attention import MUTANTS, make_case, run_case, run_many

FAST_CASES = 80
N = int(os.environ.get("FUSE_PLUGIN_FUZZ", FAST_CASES))
FIRST = int(os.environ.get("FUSE_PLUGIN_FUZZ_SEED", 0))

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning")


def test_generator_covers_the_cases_that_matter():
    """The fast subset holds every mutant kind, each mask kind and value (sliding windows of 1-3 keys,
    causal chunks, packed documents and HF's one-fill window with padding too; per-head and per-row
    factors on the scores and the per-key mutant), both orders of causal and
    padding, fully masked rows (left padding meeting a causal mask), Lq != Lk, Lq = 1, GQA, 3-D
    bmm, float64: so that a pass of the subset means something."""
    cases = [make_case(s) for s in range(FAST_CASES)]
    assert {c.variant for c in cases} >= set(MUTANTS)
    steps = [m for c in cases for m in c.masks]
    assert {m.kind for m in steps} == {"causal", "pad", "rand", "bias", "doc"}
    assert {m.spelling for m in steps if m.kind == "doc"} == {"docs", "docs_causal"}  # (the op's documents)
    causal = {m.spelling for m in steps if m.kind == "causal"}
    assert causal >= {"fill_not_tril", "fill_triu", "where", "add", "window1", "window2", "window3"}
    assert any(s.startswith("chunk") for s in causal)  # causal chunks (Llama 4) too
    # HF's eager mask: causal & window & padding in one finfo.min fill (its rows with no key averaged)
    assert any(s.startswith("onefill") for s in causal)
    assert all(s.startswith(("chunk", "onefill")) for s in causal - {"fill_not_tril", "fill_triu", "where", "add",
                                                                     "window1", "window2", "window3"})
    # a learned factor per head / query row on the scores (XCiT), and the per-key mutant
    assert {"row_head", "row_query"} <= {c.scale for c in cases} and any(c.variant == "row_key" for c in cases)
    assert {m.value for m in steps if m.kind != "bias"} >= {float("-inf"), -1e9, -1e4}
    orders = {tuple(m.kind for m in c.masks if m.kind in ("causal", "pad")) for c in cases}
    assert ("causal", "pad") in orders and ("pad", "causal") in orders
    assert any(c.lq != c.lk for c in cases) and any(c.lq == 1 for c in cases)
    assert any(c.gqa != "none" for c in cases) and any(c.layout == "merged" for c in cases)
    assert any(str(c.dtype) == "torch.float64" for c in cases)


def test_dead_rows_occur():
    """A causal mask with left padding hides every key from batch 0's first queries: the fuzzer's
    inputs do produce such rows (NaN with -inf masks) in fused cases."""
    from fuzz_attention import FuzzModule, make_inputs

    seen = 0
    for s in range(FAST_CASES):
        c = make_case(s)
        if c.mutant or not c.masks:
            continue
        out = FuzzModule(c)(*make_inputs(c))
        out = out[0] if isinstance(out, tuple) else out
        seen += bool(out.isnan().any())
    assert seen >= 5


def test_fuzz_compiled_equals_eager():
    """N generated cases: 0 wrong results, every mutant untouched, and most attention fused (the
    rest refused with a reason, e.g. a finite fill next to an additive mask)."""
    lines = []
    summary = run_many(range(FIRST, FIRST + N), log=lines.append)
    print(summary)
    assert summary["wrong"] == 0, "\n".join(lines)
    assert summary["mutants_untouched"] == summary["mutants"] > 0
    assert summary["positives_fused"] >= 0.6 * summary["positives"], summary


def test_a_case_reports_a_wrong_result(monkeypatch):
    """The comparison is live: a rewrite that breaks the weights (times 1.01) is caught."""
    import torch

    from fuse_plugin.patterns import attention

    real = attention.ATTENTION_OP

    def skewed(q, k, v, *args, **kwargs):
        out, lse = real(q, k, v, *args, **kwargs)
        return out * 1.01, lse

    monkeypatch.setattr(attention, "ATTENTION_OP", skewed)
    case = next(c for c in map(make_case, range(100)) if not c.mutant and c.dtype == torch.float32)
    res = run_case(case)
    assert res.fused == 1 and any("output 0" in w for w in res.wrong), res
