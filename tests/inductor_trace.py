"""What Inductor receives from our ops, traced on a machine without a GPU (run by
test_inductor_launch.py in a subprocess: the kernels must be real Triton JIT functions, not the
interpreter's, so TRITON_INTERPRET is off here).

The CUDA path is traced with fake CUDA tensors and an H100 pretended to torch and Triton
(`fake_h100`): device properties, capability, name, the Triton target (for the Triton-IR write
analysis) and host-side TMA support. Nothing runs; every case makes AOTAutograd trace a small
graph that calls our ops and records the graph Inductor would compile.

    python tests/inductor_trace.py            # prints one JSON line per case
"""
from __future__ import annotations

import contextlib
import json
import operator
import os
import sys
from types import SimpleNamespace
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)
# The families by their own rules: the shipped choice table is measured per GPU and re-tuned, and
# would move these cases between families; "shipped_table" below traces with it.
os.environ["FUSE_PLUGIN_CHOICE_TABLE"] = "off"

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

import fuse_plugin  # noqa: E402,F401
from fuse_plugin.kernels import attention as attn  # noqa: E402
from fuse_plugin.kernels import attention_hopper as hopper  # noqa: E402

OPS = torch.ops.fuse_plugin
H100 = SimpleNamespace(multi_processor_count=132, name="NVIDIA H100 80GB HBM3", major=9, minor=0)


@contextlib.contextmanager
def fake_h100():
    import triton
    from triton.backends.compiler import GPUTarget

    driver = SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32),
                             get_current_device=lambda: 0,
                             utils=SimpleNamespace(
                                 get_device_properties=lambda i: {"max_shared_mem": 232448}))
    with mock.patch.object(torch.cuda, "get_device_properties", lambda i=None: H100), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda i=None: (9, 0)), \
            mock.patch.object(torch.cuda, "get_device_name", lambda i=None: H100.name), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(triton.runtime.driver, "_active", driver, create=True), \
            mock.patch("torch.utils._triton.has_triton_tensor_descriptor_host_tma", lambda: True), \
            mock.patch.object(torch.backends.cudnn, "is_available", lambda: False), \
            mock.patch.object(hopper.gluon_fwd, "GLUON_AVAILABLE", False), \
            mock.patch.object(hopper.gluon_bwd, "GLUON_AVAILABLE", False):
        # Neither cuDNN nor the Gluon kernels unless a case asks for them (cudnn_available, the
        # gluon cases): a CUDA build of torch has cuDNN without a GPU, Triton 3.6 has Gluon, and
        # either would take the plain problems from the families these cases check
        yield


def trace(fn, *args) -> fx.GraphModule:
    """The forward graph AOTAutograd hands to the compiler for fn(*args) (inference)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import TracingContext, tracing

    from torch.fx.experimental.proxy_tensor import make_fx

    graphs = []

    def compiler(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    mode = args[0].fake_mode
    with tracing(TracingContext(mode)):
        graph = make_fx(lambda *xs: list(fn(*xs)))(*args)  # the ops as called (opaque nodes)
        aot_module_simplified(graph, list(args), fw_compiler=compiler)
    gm = graphs[0]
    gm.graph.eliminate_dead_code()
    return gm


def clones_inductor_keeps(gm: fx.GraphModule) -> list:
    """"kernel.arg" of each buffer Inductor would still copy before a launch: on a copy of the
    graph, AOTAutograd's common-subexpression pass (which the training graphs go through) then
    Inductor's reinplacing, which drops a clone only where nothing else holds the buffer.
    Identical ``empty_strided`` outputs merged by the first were copied by the second
    (host.gradient_buffer)."""
    import copy
    import inspect

    from torch._functorch.compile_utils import fx_graph_cse
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater

    g = copy.deepcopy(gm)
    g.graph = fx_graph_cse(g.graph)
    g.recompile()
    # torch 2.11's FakeTensorUpdater takes the graph, 2.13's the GraphModule (pytorch PR 159523)
    takes_gm = "gm" in inspect.signature(FakeTensorUpdater.__init__).parameters
    if "fake_tensor_updater" in inspect.signature(reinplace_inplaceable_ops).parameters:
        reinplace_inplaceable_ops(FakeTensorUpdater(g if takes_gm else g.graph), g.graph)
    else:  # (older torch: the graph alone)
        reinplace_inplaceable_ops(g.graph)
    left = []
    for n in g.graph.find_nodes(op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_functional):
        kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        left += [f"{getattr(kernel, 'fn', kernel).__name__}.{c}" for c in n.kwargs["tensors_to_clone"]]
    return sorted(left)


def summary(gm: fx.GraphModule) -> dict:
    """Kernels launched (name, clones), opaque ops left, and whether outputs are kernel results."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    launches, opaque, cloned_inputs, direct_descriptor_reads, copies, cudnn, efficient = [], [], [], [], [], [], []
    windows = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            name = getattr(kernel, "fn", kernel).__name__
            clones = list(n.kwargs["tensors_to_clone"])
            launches.append([name, sorted(clones), sorted(n.kwargs["tma_descriptor_metadata"])])
            for arg in n.kwargs["tma_descriptor_metadata"]:
                # a read through a descriptor must be a fresh view (launch._fresh_view)
                src = n.kwargs["kwargs"][arg]
                if arg not in clones and src.target is not torch.ops.aten.as_strided.default:
                    direct_descriptor_reads.append(f"{name}.{arg}")
            for c in clones:  # a clone of anything but a fresh buffer would copy an input
                src = n.kwargs["kwargs"][c]  # (zeroed buffers: a kernel's atomic accumulator)
                while src.op == "call_function" and src.target is torch.ops.aten.permute.default:
                    src = src.args[0]  # a gradient written through a descriptor of its view
                if not (src.op == "call_function" and src.target in (
                        torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                        torch.ops.aten.empty_like.default, torch.ops.aten.zero.default,
                        torch.ops.aten.zeros.default)
                        or src.target is operator.getitem):
                    cloned_inputs.append(f"{name}.{c}")
        elif str(n.target).startswith("fuse_plugin."):
            opaque.append(str(n.target))
            if "gluon" in str(n.target):  # the sliding window it launches with (0: none)
                i = [a.name for a in n.target._schema.arguments].index("window")
                windows.append(n.kwargs.get("window", n.args[i] if len(n.args) > i else 0))
        elif "cudnn_attention" in str(n.target):  # kernels/attention_cudnn.py
            cudnn.append(str(n.target).split(".")[1])
        elif "efficient_attention" in str(n.target):  # kernels/attention_efficient.py
            efficient.append(str(n.target).split(".")[1])
        elif n.target is torch.ops.aten.clone.default or (
                n.target is torch.ops.aten._to_copy.default  # a copy, not a cast
                and n.kwargs.get("dtype") in (None, n.args[0].meta["val"].dtype)):
            copies.append(n.name)
    outs = [a for a in fx.node.map_arg(gm.graph.output_node().args[0], lambda x: x)
            if isinstance(a, fx.Node)] if hasattr(gm.graph, "output_node") else []
    empty_outputs = [a.name for a in outs if a.op == "call_function"
                     and a.target is torch.ops.aten.empty.memory_format]
    return dict(launches=launches, opaque=opaque, cloned_inputs=cloned_inputs,
                clones_kept=clones_inductor_keeps(gm) if launches else [],
                empty_outputs=empty_outputs, direct_descriptor_reads=direct_descriptor_reads,
                copies=copies, cudnn=cudnn, efficient=efficient, gluon_windows=windows)


def fake(mode, *shape, dtype=torch.bfloat16, device="cuda"):
    with mode:
        return torch.randn(*shape, dtype=dtype, device=device)


def attention_pair(q, k, v, dout, bias=None, is_causal=True, need_dbias=False, p=0.0, seed=None,
                   replace=None, window=0, chunk=0, documents=None):
    scale = q.shape[-1] ** -0.5
    extra = {} if replace is None else {"replace": replace}
    if window:
        extra["window"] = window
    if chunk:
        extra["chunk"] = chunk
    if documents is not None:
        extra["documents"] = documents
    out, lse = OPS.attention(q, k, v, bias, p, is_causal, scale, dropout_seed=seed, **extra)
    dq, dk, dv, db = OPS.attention_backward(dout, q, k, v, bias, out, lse, p, is_causal, scale,
                                            seed, need_dbias, **extra)
    return (out, dq, dk, dv) + ((db,) if need_dbias else ())


def attention_case(B, Hq, Hkv, L, D, dtype=torch.bfloat16, mask=None, need_dbias=False, p=0.0,
                   is_causal=True, device="cuda", replace=False, window=0, chunk=0, documents=False):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    q = fake(mode, B, Hq, L, D, dtype=dtype, device=device)
    k = fake(mode, B, Hkv, L, D, dtype=dtype, device=device)
    v = fake(mode, B, Hkv, L, D, dtype=dtype, device=device)
    dout = fake(mode, B, Hq, L, D, dtype=dtype, device=device)
    extra = []
    if mask == "float":
        extra.append(fake(mode, B, 1, L, L, dtype=dtype, device=device))
    elif mask == "bool":
        with mode:
            extra.append(torch.ones(B, 1, 1, L, dtype=torch.bool, device=device))
    if p:
        with mode:
            extra.append(torch.zeros((), dtype=torch.int64, device=device))
    if replace:  # a replace mask (next to a float mask), broadcast over heads and queries
        with mode:
            extra.append(torch.ones(B, 1, 1, L, dtype=torch.bool, device=device))
    if documents:  # document ids (B, L)
        with mode:
            extra.append(torch.zeros(B, L, dtype=torch.int64, device=device))

    def fn(q, k, v, dout, *extra):
        bias = extra[0] if mask else None
        seed = extra[1 if mask else 0] if p else None
        docs = extra[-1] if documents else None
        rep = extra[-2 if documents else -1] if replace else None
        return attention_pair(q, k, v, dout, bias, is_causal, need_dbias, p, seed, rep, window, chunk, docs)

    return trace(fn, q, k, v, dout, *extra)


def sinks_case(window=128):
    """gpt-oss's sink logits (attention_sinks and its backward; a sliding window): the general
    forward folds the sinks in (its Sinks argument), the backward is the attention op's kernels and
    the sinks' gradient torch math beside them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    q, dout = (fake(mode, 1, 16, 1000, 64) for _ in range(2))
    k, v = (fake(mode, 1, 2, 1000, 64) for _ in range(2))
    sinks = fake(mode, 16)

    def fn(q, k, v, dout, sinks):
        out, lse = OPS.attention_sinks(q, k, v, None, 0.0, True, 0.125, sinks, None, None, window)
        grads = OPS.attention_sinks_backward(dout, q, k, v, None, out, lse, sinks, 0.0, True, 0.125, None,
                                             False, None, window)
        return (out,) + tuple(g for g in grads if g.numel())

    return trace(fn, q, k, v, dout, sinks)


def small_case(p=0.0):
    """The small family (forced: by no rule of its own it is taken only where measured) on Swin's
    shifted windows: 8 windows of 49 tokens, 3 heads of 32, a window-periodic float bias
    (4, 3, 49, 49) with its gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fuse_plugin.kernels import registry

    mode = FakeTensorMode()
    q, k, v, dout = (fake(mode, 8, 3, 49, 32) for _ in range(4))
    bias = fake(mode, 4, 3, 49, 49, dtype=torch.float32)
    extra = []
    if p:
        with mode:
            extra.append(torch.zeros((), dtype=torch.int64, device="cuda"))

    def fn(q, k, v, dout, bias, *seed):
        return attention_pair(q, k, v, dout, bias, is_causal=False, need_dbias=True, p=p,
                              seed=seed[0] if p else None)

    with registry.forced("small"):
        return trace(fn, q, k, v, dout, bias, *extra)


def efficient_case(periodic: bool):
    """PyTorch's efficient kernels as a family (forced: taken only where measured) on Swin's
    windows: 8 windows of 49 tokens, 3 heads of 32, a learned (1, 3, 49, 49) relative-position
    bias or the shifted windows' periodic (4, 3, 49, 49) one, with its gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fuse_plugin.kernels import registry

    mode = FakeTensorMode()
    q, k, v, dout = (fake(mode, 8, 3, 49, 32) for _ in range(4))
    bias = fake(mode, 4 if periodic else 1, 3, 49, 49)

    def fn(q, k, v, dout, bias):
        return attention_pair(q, k, v, dout, bias, is_causal=False, need_dbias=True)

    with registry.forced("efficient"):
        return trace(fn, q, k, v, dout, bias)


def decode_case(B=2, Hq=16, Hkv=4, Lq=1, Lk=1024, D=64, mask="float"):
    """A KV-cache decode step (Lq 1 against a static buffer, HF's 4-D float mask): the decode
    kernels (attention_decode.py) in the forward, the general backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    q, dout = fake(mode, B, Hq, Lq, D), fake(mode, B, Hq, Lq, D)
    k, v = fake(mode, B, Hkv, Lk, D), fake(mode, B, Hkv, Lk, D)
    with mode:
        bias = torch.zeros(B, 1, Lq, Lk, dtype=torch.bfloat16, device="cuda") if mask == "float" \
            else torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device="cuda")

    def fn(q, k, v, dout, bias):
        return attention_pair(q, k, v, dout, bias, is_causal=False)

    return trace(fn, q, k, v, dout, bias)


def rope_attention_case():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    q, k, v = fake(mode, 1, 8, 500, 64), fake(mode, 1, 2, 500, 64), fake(mode, 1, 2, 500, 64)
    dout = fake(mode, 1, 8, 500, 64)
    cos, sin = fake(mode, 1, 1, 500, 64), fake(mode, 1, 1, 500, 64)

    def fn(q, k, v, dout, cos, sin):
        out, lse = OPS.rope_attention(q, k, v, cos, sin, False, 64, None, 0.0, True, 0.125)
        g = OPS.rope_attention_backward(dout, q, k, v, cos, sin, False, 64, None, out, lse, 0.0,
                                        True, 0.125, None, False, False)
        return out, g[0], g[1], g[2]

    return trace(fn, q, k, v, dout, cos, sin)


def symbolic_case(L: int, B: int = 2, Hq: int = 8, Hkv: int = 2, D: int = 64, is_causal=True,
                  Lq=None, mask=None, p=0.0, all_dynamic=False, dtype=torch.bfloat16) -> dict:
    """Dynamic shapes: the keys' length (and the queries', unless ``Lq`` is given) a SymInt with
    hint L, as Dynamo makes it for a dimension it has seen change (``all_dynamic``: the batch,
    head counts and head dim too). The summary adds the guards the trace added (what Dynamo
    would recompile on)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()

    def sym(name, n):
        return env.create_symintnode(env.create_symbol(n, ConstantSource(name)), hint=n)

    length = sym("L", L)
    symbol = str(length.node.expr)  # (before the trace: a guard pinning it would replace it)
    lq = length if Lq is None else Lq
    if all_dynamic:  # torch.compile(dynamic=True): every dim but those of size 0/1 a SymInt
        B, Hq, Hkv, D = sym("B", B), sym("Hq", Hq), sym("Hkv", Hkv), sym("D", D)
    mode = FakeTensorMode(shape_env=env)
    with mode:
        q = torch.randn(B, lq, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(B, length, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
                for _ in range(2))
        dout = torch.randn(B, Hq, lq, D, device="cuda", dtype=dtype)
        extra = []
        if mask == "bool":  # a padding mask, as BERT's
            extra.append(torch.ones(B, 1, 1, length, dtype=torch.bool, device="cuda"))
        elif mask == "float":  # a materialised float mask with its gradient, and a replace mask
            extra.append(torch.randn(B, 1, lq, length, dtype=dtype, device="cuda"))
            extra.append(torch.zeros(B, 1, lq, length, dtype=torch.bool, device="cuda"))
        if p:
            extra.append(torch.zeros((), dtype=torch.int64, device="cuda"))

    def fn(q, k, v, dout, *extra):
        bias = extra[0] if mask else None
        replace = extra[1] if mask == "float" else None
        seed = extra[-1] if p else None
        return attention_pair(q, k, v, dout, bias, is_causal, mask == "float", p=p, seed=seed,
                              replace=replace)

    return dict(summary(trace(fn, q, k, v, dout, *extra)), guards=[str(g.expr) for g in env.guards],
                length=symbol)


def symbolic_rope_case(L: int) -> dict:
    """The rope fold (rope_attention) under dynamic shapes, q/k/v head-split views of their
    projections (GQA 8/2: the backward sums the split's dK/dV partials)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    length = env.create_symintnode(env.create_symbol(L, ConstantSource("L")), hint=L)
    symbol = str(length.node.expr)
    with FakeTensorMode(shape_env=env):
        q = torch.randn(1, length, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, length, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        dout = torch.randn(1, 8, length, 64, device="cuda", dtype=torch.bfloat16)
        cos, sin = (torch.randn(1, 1, length, 64, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))

    def fn(q, k, v, dout, cos, sin):
        out, lse = OPS.rope_attention(q, k, v, cos, sin, False, 64, None, 0.0, True, 0.125)
        g = OPS.rope_attention_backward(dout, q, k, v, cos, sin, False, 64, None, out, lse, 0.0,
                                        True, 0.125, None, False, False)
        return out, g[0], g[1], g[2]

    return dict(summary(trace(fn, q, k, v, dout, cos, sin)), guards=[str(g.expr) for g in env.guards],
                length=symbol)


SYMBOLIC_CASES = {
    "symbolic_100": lambda: symbolic_case(100),  # one key block: the one-launch backward
    "symbolic_1000": lambda: symbolic_case(1000),
    "symbolic_bert": lambda: symbolic_case(128, B=4, Hq=12, Hkv=12, is_causal=False, mask="bool",
                                           p=0.1),
    "symbolic_decode": lambda: symbolic_case(1000, Lq=1, is_causal=False),  # a KV-cache step
    "symbolic_tma": lambda: symbolic_case(16384, B=4, Hq=16, Hkv=16, D=128),  # TMA: opaque
    "symbolic_all": lambda: symbolic_case(300, all_dynamic=True),
    "symbolic_rope": lambda: symbolic_rope_case(500),
    # fp32, D 80 (split head dim), a float mask with dbias and a replace mask, dropout
    "symbolic_float_mask": lambda: symbolic_case(700, D=80, mask="float", p=0.1,
                                                 dtype=torch.float32),
}


CASES = {
    # general forward, atomic backward with the GQA split (fp32 partials summed by Inductor)
    "gqa_d64_n1000": lambda: attention_case(2, 16, 4, 1000, 64),
    # TMA forward (table), general backward (the table's Gluon entry cannot run on Triton 3.9)
    "d64_n4000": lambda: attention_case(2, 16, 16, 4000, 64),
    # the same table entries, but too small to hide the descriptors' host time: general kernels
    "d64_n2000": lambda: attention_case(2, 16, 16, 2000, 64),
    # the atomic-free TMA pair backward (table, D 256)
    "d256_tma_pair": lambda: attention_case(2, 4, 2, 4000, 256),
    # additive mask with its gradient; bool mask; dropout; head dim split 64 + 16; fp32
    "float_mask_dbias": lambda: attention_case(1, 4, 4, 300, 64, mask="float", need_dbias=True,
                                               is_causal=False),
    "bool_mask": lambda: attention_case(2, 4, 2, 257, 128, mask="bool"),
    # a replace mask next to the float mask (a finite fill with additive terms), D 128 (where a
    # TMA table entry may stand: general kernels only)
    "replace_mask": lambda: attention_case(1, 4, 4, 300, 128, mask="float", need_dbias=True,
                                           is_causal=False, replace=True),
    "dropout": lambda: attention_case(1, 4, 4, 129, 64, p=0.1),
    # a sliding window (issue 31) where the TMA / cuDNN families would take the causal problem:
    # the general kernels, the window an int argument of each launch
    "window": lambda: attention_case(1, 16, 4, 4000, 128, window=512),
    # chunked attention (issue 31, Llama 4): the same kernels, the chunk their int "window" argument
    "chunk": lambda: attention_case(1, 16, 4, 4000, 128, chunk=1024),
    # packed documents (issue 31): the same kernels, the ids' span table (sort, searchsorted: torch
    # ops Inductor compiles beside them) their "Docs" argument
    "documents": lambda: attention_case(2, 16, 4, 4000, 128, documents=True),
    # gpt-oss's sinks, folded into the general forward (ops/attention_sinks.py)
    "sinks": sinks_case,
    # BERT's attention (128 tokens: one key block): the one-launch backward
    "one_key_block": lambda: attention_case(32, 12, 12, 128, 64, mask="bool", p=0.1,
                                            is_causal=False),
    "d80": lambda: attention_case(1, 4, 4, 200, 80),
    "fp32": lambda: attention_case(1, 2, 2, 100, 64, dtype=torch.float32),
    "rope_attention": rope_attention_case,
    # flash-decoding forward (Lq 1, 1024 keys), float and bool masks
    "decode": decode_case,
    "small_swin": small_case,
    "small_dropout": lambda: small_case(p=0.1),
    "efficient_relpos": lambda: efficient_case(False),
    "efficient_shifted": lambda: efficient_case(True),
    "decode_bool": lambda: decode_case(B=1, Hq=12, Hkv=4, Lq=4, Lk=300, D=128, mask="bool"),
    # never decomposed: CPU tensors (the reference; CI's interpreter path)
    "cpu": lambda: attention_case(1, 2, 2, 40, 64, dtype=torch.float32, device="cpu"),
}


def head_merge_case(L: int) -> dict:
    """A model's use of the op: q/k/v split from one (B, L, 3, H, D) projection, the output's
    heads merged by transpose + reshape, dout arriving as the merged gradient's view."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    B, H, D = 2, 6, 64
    qkv, dmerged = fake(mode, B, L, 3, H, D), fake(mode, B, L, H * D)

    def fn(qkv, dmerged):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out, lse = OPS.attention(q, k, v, None, 0.0, False, 0.125)
        merged = out.transpose(1, 2).reshape(B, L, H * D)
        dout = dmerged.view(B, L, H, D).transpose(1, 2)
        dq, dk, dv, _ = OPS.attention_backward(dout, q, k, v, None, out, lse, 0.0, False, 0.125,
                                               None, False)
        return merged, torch.stack([dq, dk, dv], 2)

    return summary(trace(fn, qkv, dmerged))


def head_split_grads_case(L: int, D: int = 64) -> dict:
    """BERT's and Llama's use of the op: q, k, v each a head-split view of its own projection
    (dense, (B, L, H, D) in memory), and the backward's gradients merged back by transpose +
    reshape for the projections' backward (the op's gradients are laid out as q/k/v)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    B, H = 2, 6
    xs = [fake(mode, B, L, H * D) for _ in range(3)]
    dmerged = fake(mode, B, L, H * D)

    def fn(xq, xk, xv, dmerged):
        q, k, v = (x.view(B, L, H, D).transpose(1, 2) for x in (xq, xk, xv))
        out, lse = OPS.attention(q, k, v, None, 0.0, False, 0.125)
        dout = dmerged.view(B, L, H, D).transpose(1, 2)
        grads = OPS.attention_backward(dout, q, k, v, None, out, lse, 0.0, False, 0.125, None, False)
        return [g.transpose(1, 2).reshape(B, L, H * D) for g in grads[:3]]

    return summary(trace(fn, *xs, dmerged))


def q_view_copies_case() -> dict:
    """How many buffers Inductor's lowering makes of q for one forward launch where q is a view it
    cannot pass as it is: the head-split view of a pointwise result not yet computed (twins_svt_s's
    global attention: a linear's bias add). Inductor realises each tensor argument of a user kernel
    on its own, so every parameter that received q (the never-read pointers too) got a copy: 9
    before host.placeholder, 1 (q's own) after. Lowered (GraphLowering.run) on the fake H100; the
    buffers are counted by the add among their origins."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    B, H, D, Lq, Lk = 8, 2, 32, 196, 49
    args = [fake(mode, B, Lq, H * D), fake(mode, B, Lk, H * D), fake(mode, H * D)]
    copies = []

    def fn(x, xs, b):
        q = (x + b).reshape(B, Lq, H, D).permute(0, 2, 1, 3)
        k = xs.view(B, Lk, H, D).transpose(1, 2)
        return list(OPS.attention(q, k, k, None, 0.0, False, D ** -0.5))

    def lower(gm, inputs):
        with config.patch({"compile_threads": 1}):
            post_grad_passes(gm, True)
            graph = GraphLowering(gm, example_inputs=inputs)
            with V.set_graph_handler(graph):
                graph.run(*inputs)
        copies.extend(b.get_name() for b in graph.buffers
                      if type(b).__name__ == "ComputedBuffer" and "add" in {str(o) for o in b.origins})
        return make_boxed_func(gm.forward)

    with tracing(TracingContext(mode)):
        aot_module_simplified(make_fx(fn)(*args), args, fw_compiler=lower, decompositions=select_decomp_table())
    return dict(q_copies=len(copies))


@contextlib.contextmanager
def cudnn_available():
    """cuDNN present, as on the H100 (a CPU build of torch has none): the cuDNN family may run."""
    with mock.patch.object(torch.backends.cudnn, "is_available", lambda: True):
        yield


CUDNN_CASES = {
    # plain, long enough for both directions (GQA, causal); the forward's q is contiguous, so its
    # output is copied into the op's layout once
    "cudnn": lambda: attention_case(2, 16, 4, 1024, 64),
    # ViT's length: our forward, cuDNN's backward
    "cudnn_bwd": lambda: attention_case(2, 6, 6, 197, 64, is_causal=False),
    # what cuDNN does not take: a bias, dropout, D 256, Lq != Lk with causal; and switched off
    "cudnn_refused_bias": lambda: attention_case(1, 4, 4, 1024, 64, mask="float", is_causal=False),
    "cudnn_refused_dropout": lambda: attention_case(1, 4, 4, 1024, 64, p=0.1),
    "cudnn_d256": lambda: attention_case(1, 4, 4, 1024, 256),
}


def run_case(name: str) -> dict:
    if name in CUDNN_CASES or name in ("cudnn_off", "head_merge_cudnn"):
        with fake_h100(), cudnn_available():
            if name == "head_merge_cudnn":
                return head_merge_case(200)
            if name == "cudnn_off":
                with mock.patch.object(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False):
                    return summary(CUDNN_CASES["cudnn"]())
            return summary(CUDNN_CASES[name]())
    with fake_h100():
        if name in ("head_merge", "head_merge_tma"):  # TMA: 4000 tokens, over the threshold
            return head_merge_case(200 if name == "head_merge" else 4000)
        if name in ("head_split_grads", "head_split_grads_atomic"):  # one key block / two
            return head_split_grads_case(128 if name == "head_split_grads" else 200)
        if name == "q_view_copies":
            return q_view_copies_case()
        if name == "head_split_grads_tma":  # the TMA pair: gradients written through descriptors
            return head_split_grads_case(4000, D=256)
        if name == "deterministic":
            with mock.patch.object(torch, "are_deterministic_algorithms_enabled", lambda: True):
                return summary(attention_case(1, 8, 2, 600, 64))
        if name in ("gluon", "gluon_small", "gluon_window", "gluon_window_narrow"):
            # As on an H100 with Triton 3.6 (the platform checks pass), what is left is the traced
            # rule: a large problem keeps its Gluon kernels as opaque ops, a small one does not.
            from fuse_plugin.kernels import attention_hopper as hopper

            def fwd(call):
                return hopper.why_not_gluon_traced(call)

            def bwd(call, cfg):
                return hopper.why_not_gluon_traced(call)

            shape = {"gluon": (1, 16, 4, 4096, 128), "gluon_small": (2, 8, 2, 1024, 128),
                     "gluon_window": (1, 16, 4, 8192, 128), "gluon_window_narrow": (1, 16, 4, 8192, 128)}[name]
            # a sliding window: in the Gluon kernels' measured range (4096), and narrower (512)
            window = {"gluon_window": 4096, "gluon_window_narrow": 512}.get(name, 0)
            with mock.patch.object(hopper, "why_not_gluon_platform", fwd), \
                    mock.patch.object(hopper, "why_not_gluon_bwd", bwd):
                return summary(attention_case(*shape, is_causal=True, window=window))
        if name == "d64_n2000_cudagraphs":  # CUDA graphs replay without host time: TMA again
            from torch._inductor import config

            with config.patch({"triton.cudagraphs": True}):
                return summary(CASES["d64_n2000"]())
        if name in ("static_launch", "static_launch_tma"):  # Inductor's static launcher for user
            from torch._inductor import config  # kernels (FUSE_PLUGIN_STATIC_LAUNCH): no TMA descriptors

            with config.patch({"static_launch_user_defined_triton_kernels": True}):
                return summary(CASES["d64_n2000" if name == "static_launch" else "d64_n4000"]())
        if name == "chained_tma":  # one forward's output read by the next one's descriptor
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode()
            q, k, v = (fake(mode, 2, 16, 4000, 64) for _ in range(3))

            def chain(q, k, v):
                for _ in range(2):
                    q = OPS.attention(q, k, v, None, 0.0, True, 0.125)[0]
                return (q,)

            return summary(trace(chain, q, k, v))
        if name == "untraceable":  # a kernel whose writes the analysis misses: the op stays whole
            from fuse_plugin.kernels import launch

            real = launch._check_writes

            def flaky(kernel, *a, **kw):  # the backward's second launch "cannot be traced"
                if kernel.__name__ == "attention_bwd_kernel":
                    raise launch.Untraceable("test")
                return real(kernel, *a, **kw)

            with mock.patch.object(launch, "_check_writes", flaky):
                return summary(attention_case(1, 4, 4, 100, 64))
        if name == "disabled":
            with mock.patch.dict(os.environ, {"FUSE_PLUGIN_INDUCTOR_LAUNCH": "0"}):
                return summary(attention_case(1, 4, 4, 100, 64))
        if name == "export":  # torch.export keeps custom ops whole (AOTInductor decomposes later)
            with mock.patch.object(torch._functorch.config, "decompose_custom_triton_ops", False):
                return summary(attention_case(1, 4, 4, 100, 64))
        if name == "shipped_table":  # BERT's attention (no dropout) with the shipped table: what it measured fastest
            with mock.patch.dict(os.environ):
                del os.environ["FUSE_PLUGIN_CHOICE_TABLE"]
                return summary(attention_case(32, 12, 12, 128, 64, mask="bool", is_causal=False))
        if name in SYMBOLIC_CASES:
            return SYMBOLIC_CASES[name]()
        return summary(CASES[name]())


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore") if "-v" not in sys.argv else None
    sys.argv = [a for a in sys.argv if a != "-v"]
    names = sys.argv[1:] or [*CASES, "deterministic", "gluon", "gluon_small", "gluon_window", "gluon_window_narrow",
                             "d64_n2000_cudagraphs", "static_launch", "static_launch_tma", "chained_tma", "head_merge",
                             "head_merge_tma", "head_split_grads", "head_split_grads_atomic",
                             "head_split_grads_tma", "q_view_copies", "untraceable", "shipped_table",
                             "disabled", "export", *SYMBOLIC_CASES, *CUDNN_CASES, "cudnn_off",
                             "head_merge_cudnn"]
    for name in names:
        try:
            result = run_case(name)
        except Exception as e:  # reported, not raised: the test names the failing case
            result = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"case": name, **result}), flush=True)
