"""Small helpers shared by the tests (imported as `helpers`; pytest puts tests/ on sys.path)."""
import os

import pytest
import torch

# Kernel tests run on the GPU when there is one, else on the CPU in Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Triton's interpreter runs our kernels on CPU tensors only where TRITON_INTERPRET=1 was set before
# triton was imported: conftest.py sets it on machines without a GPU (CI). On a GPU machine the
# kernels run compiled, on CUDA tensors, in the GPU tests instead.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER, reason="runs the Triton kernels on CPU tensors in Triton's interpreter, which is "
    "on only without a GPU (conftest.py); the GPU tests run the kernels on CUDA here")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (NaN if either holds a NaN)."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """got has no NaN (an element a kernel did not write reads NaN from the poisoned outputs) and
    is within ``tol`` relative error of want; where want is analytically zero (e.g. dq and dS
    with a single key), where a relative error means nothing, every |got| <= 1e-4."""
    assert not torch.isnan(got).any(), f"{name}: NaN (an element the kernel did not write?)"
    if want.abs().max() < 1e-9:
        worst = got.abs().max().item()
        assert worst <= 1e-4, f"{name}: expected zeros, got |x| up to {worst:.3g}"
        return
    err = rel_err(got, want)
    assert err <= tol, f"{name}: rel_err {err:.3g} > {tol:.1g}"


def op_listing(gm) -> str:
    """A compact, version-stable listing of an FX graph: one line per node, inputs as #index.

    Used by the graph-rewrite expect tests (the same text on torch 2.11 and 2.13)."""
    import torch.fx as fx

    from fuse_plugin.patterns.canon import canon, shape

    index: dict = {}
    lines = []

    def fmt(a):
        if isinstance(a, fx.Node):
            return f"#{index[a]}" if a in index else a.name
        if isinstance(a, (tuple, list)):
            inner = ", ".join(fmt(x) for x in a)
            return f"({inner})" if isinstance(a, tuple) else f"[{inner}]"
        if isinstance(a, slice):
            parts = ["" if x is None else fmt(x) for x in (a.start, a.stop, a.step)]
            return ":".join(parts if a.step is not None else parts[:2])
        if isinstance(a, float):
            return f"{a:.6g}"
        if isinstance(a, torch.dtype):
            return str(a).replace("torch.", "")
        return repr(a) if not callable(a) else getattr(a, "__name__", str(a))

    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "_log_api_usage_once":
            continue
        index[n] = len(index)
        if n.op == "placeholder":
            s = shape(n)
            desc = f"input {tuple(s) if s is not None else ''}".rstrip()
        elif n.op == "output":
            desc = f"output {fmt(n.args[0])}"
        else:
            c = canon(n)
            if c is not None:
                args = [fmt(v) for k, v in c.args.items()]
                desc = f"{c.name}({', '.join(args)})"
            else:
                target = n.target
                if isinstance(target, torch._ops.OpOverload):
                    name = f"{target.namespace}.{target._opname}"
                elif isinstance(target, torch._ops.OpOverloadPacket):
                    name = f"{target._qualified_op_name.replace('::', '.')}"
                else:
                    name = getattr(target, "__name__", str(target))
                args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()]
                desc = f"{name}({', '.join(args)})"
        lines.append(f"{index[n]} {desc}")
    return "\n".join(lines)


def capture(fn, *args, dynamic=None, **kwargs):
    """Trace fn(*args) with Dynamo; rewrite each graph. Returns (before, after, report): the op
    listings of the (first) graph before and after `fuse_plugin.patterns.rewrite`, and the report."""
    import copy

    import torch._dynamo

    from fuse_plugin.patterns import Report, rewrite

    graphs = []
    report = Report()

    def backend(gm, example_inputs):
        before = op_listing(gm)
        rewritten = copy.deepcopy(gm)
        report.extend(rewrite(rewritten))
        graphs.append((before, op_listing(rewritten)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args, **kwargs)
    torch._dynamo.reset()
    assert graphs, "Dynamo captured no graph"
    return graphs[0][0], graphs[0][1], report


def rewrite_aot_eager(gm, example_inputs):
    """A cheap test backend: our rewrite, then AOTAutograd with eager kernels (no C++ compile).

    It exercises what Inductor would get (fake tensors, autograd of the ops) in a fraction of the time."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    from fuse_plugin.patterns import rewrite

    rewrite(gm)

    def compiler(g, _):
        return make_boxed_func(g.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)


def poisoned_empty(shape, dtype, device, like=None):
    """kernels/host.py's ``empty`` with every element NaN (same layouts)."""
    from fuse_plugin.kernels.host import layout_like

    t = layout_like(like, dtype) if like is not None else torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan"))


def chosen_family(monkeypatch, direction, entry, q, bias=None, softcap=0.0, replace=None, config=None):
    """The kernel family the registry chooses for an attention call on q (as q, k and v) when the
    tuning table's entry for it is ``entry`` (an AttentionConfig)."""
    from fuse_plugin.kernels import registry
    from fuse_plugin.kernels.call import AttentionCall

    monkeypatch.setattr(registry, "table_config", lambda *a: entry)
    kw = dict(is_causal=False, scale=0.1, softcap=softcap, replace=replace, config=config)
    if direction == "fwd":
        call = AttentionCall.forward(q, q, q, bias, **kw)
    else:
        out = torch.zeros_like(q)
        call = AttentionCall.backward(out, q, q, q, bias, out, torch.zeros(q.shape[:3]), need_dbias=False,
                                      deterministic=False, **kw)
    return registry.choose(call)[0].name
