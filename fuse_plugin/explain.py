"""`fuse_plugin.explain(model, *args)`: what the rewrite would do to a model, without our kernels."""
from __future__ import annotations

import copy

import torch

from .patterns import Report, rewrite


def explain(model_or_fn, *args, **kwargs) -> Report:
    """Trace ``model_or_fn(*args, **kwargs)`` with Dynamo and rewrite a copy of every graph it
    captures: what the plugin would fuse, and why it would not.

    The call itself runs the original graphs eagerly: no Inductor compile, no fused kernel. A
    graph break yields several graphs; the report covers them all. ``torch._dynamo.reset()`` is
    called before and after (compiled code cached by Dynamo is dropped).

    Args:
        model_or_fn: an ``nn.Module`` or a function, as for ``torch.compile``.
        *args, **kwargs: the inputs of one call (e.g. ``input_ids`` (B, L) for an HF model), any
            shapes the model takes; the report is for the graphs these shapes trace.

    Returns:
        A ``patterns.Report``; ``print(report)`` gives one line per site: ``fused`` (``sites``:
        kind "attention" / "rotary" / "rope_attention", source line, detail), ``left`` (``left``:
        matched, left to stock Inductor, measured faster there) and ``not fused`` (``misses``: a
        candidate not rewritten, and the reason); ``report.count("attention")`` counts fused sites.
    """
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
