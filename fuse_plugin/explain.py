"""`fuse_plugin.explain(model, *args)`: what the rewrite would do to a model, without our kernels."""
from __future__ import annotations

import copy

import torch

from .patterns import Report, rewrite


def explain(model_or_fn, *args, **kwargs) -> Report:
    """Trace `model_or_fn(*args, **kwargs)` with Dynamo and rewrite a copy of every graph it
    captures; return the Report (replaced sites and near misses, with source lines).

    The call itself runs the original graphs eagerly: no Inductor compile, no fused kernel. A
    graph break yields several graphs; the report covers them all."""
    report = Report()

    def collect(gm: torch.fx.GraphModule, example_inputs):
        # Rewrite a copy so that what runs is the graph as the user wrote it.
        report.extend(rewrite(copy.deepcopy(gm)))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model_or_fn, backend=collect)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return report
