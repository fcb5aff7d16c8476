"""Context parallelism over our attention op (issue 32): sequence-sharded DTensors run ring
attention, and compiled models run it under PyTorch's `context_parallel(...)`.

    context_parallel.register()        # once, idempotent (ops/sharding.register() calls it)
    out, lse = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, is_causal, scale)
    #   q (B, Hq, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv): DTensors, all placed (Shard(2),) on
    #   one 1-D mesh; out (B, Hq, L, Dv) and lse (B, Hq, L) come back as DTensors placed (Shard(2),)

    # a compiled model under PyTorch's context parallelism (HF eager attention, rewritten to our op):
    model = torch.compile(model, backend="fuse_plugin", options={"pre_grad_custom_pass": RoutePass()})
    with context_parallel(mesh, buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1]):
        loss_of(model(input_ids=input_ids, position_ids=position_ids).logits, labels).backward()
    # (route(gm) after the rewrite does the same in a backend of one's own; see "Compiled models")

1. DTensors. When `fuse_plugin::attention` receives q, k and v as DTensors sharded on their sequence
dim (placements exactly `(Shard(2),)`, the same 1-D DeviceMesh) with the arguments the ring takes
(attn_bias None, dropout_p 0, softcap 0, replace None, window 0, q and k of one global length L
divisible by the mesh size W), it computes the exact attention over the WHOLE sequence with our
kernels through the ring of ops/ring_attention.py, instead of refusing the placement:
  forward      each rank runs `ring_attention_forward` on its local shards (k/v blocks passed
               around the mesh's group, partial results merged by their logsumexp); out and lse
               are its rows of the global ones, wrapped as DTensors (Shard(2),): out in the op's
               memory layout ((B, L, Hq, Dv) underneath, globally and locally), lse float32.
  backward op  `fuse_plugin::attention_backward` (which the op's autograd calls with the saved
               DTensors) with q, k, v (Shard(2),) runs `ring_attention_backward` with the GLOBAL
               out/lse it is passed (each rank's rows of them): dq, dk, dv come back (Shard(2),),
               dbias an empty replicated tensor. dout, out and lse must be (Shard(2),) too, or
               Replicate() (then sliced to the rank's rows locally, as the sharding rules do).
  traced       (torch.compile: Dynamo's fake propagation, AOTAutograd) the handlers call the ring's
               opaque ops instead (below): the compiled graph holds one ring call each way.
Both are collectives over the mesh's group: every rank of the mesh must make the call.

Layout. A DTensor placed Shard(2) holds, by PyTorch's definition, the contiguous chunk r of W
along dim 2 (torch.chunk: tokens [r·L/W, (r+1)·L/W) on rank r), and outside PyTorch's context
parallelism the handlers run the ring with load_balanced=False: exact for causal attention in that
layout (top-left causal over the global positions; ring_attention.step_calls skips the blocks the
mask hides), but the causal work is uneven: rank W-1 computes W blocks, rank 0 one. PyTorch's
context parallelism balances it by storing the sequence in its head-tail order
(`_HeadTailLoadBalancer`: rank r holds chunks r and 2W-1-r of 2W) and still calling the result
Shard(2), and its own SDPA ring reads Shard(2) in that order while it is on. So do the handlers:
while PyTorch's context parallelism is on (`torch_context_parallel()`: `context_parallel(...)`
active, or its DTensor dispatcher enabled) and balancing (its `_cp_options.enable_load_balance`,
which `context_parallel(...)` sets to whether it sharded the buffers head-tail), the ring runs with
load_balanced=True, else contiguous. A DTensor's placement cannot tell the two orders apart: a
tensor sharded head-tail outside `context_parallel(...)` (`_context_parallel_shard` with a load
balancer, `ring_attention.shard_sequence(..., load_balanced=True)`) and wrapped as Shard(2) would get
the causal mask of the wrong positions; call `ring_attention(..., load_balanced=True)` on the local
tensors for it. Without is_causal the two layouts give the same result (every query sees every key).

How. DTensor runs an op through its sharding rule (ops/sharding.py) shard by shard, which cannot
express a ring (the rule may only choose placements; the computation stays one local op call).
DTensor also keeps a table of custom op handlers, `DTensor._op_dispatcher._custom_op_handlers`
({OpOverload: handler(op_call, args, kwargs)}), consulted before the rules: PyTorch's own context
parallelism registers its SDPA ring there (torch/distributed/tensor/experimental/_context_parallel/
_attention.py, `_sdpa_handler`: unwrap the DTensors, run the ring on the local tensors, wrap the
results with their specs). `register()` puts one handler per op there (attention.default and
attention_backward.default), from this one place. A handler that finds anything but the ring's case
runs DTensor's ordinary path itself (`_default`: the same unwrap, sharding propagation with the
rules, local call and wrap that DTensor's dispatcher does for an op without a handler), so every
other placement behaves exactly as before: replicated, batch and head shards run the op locally;
unsupported placements raise the rules' error naming the op, the argument and its placement
(DTensor wraps that ShardingError in a RuntimeError, as before).
Near misses raise here instead, a `ShardingError` naming the op, the placement and what the ring
does not take: q, k, v (Shard(2),) on a 1-D mesh with an attn_bias, dropout, softcap, replace or
window, q and k of different lengths (cross-attention), a length the mesh does not divide (or, in
the load-balanced order, an odd shard), a backward's dout/out/lse placed otherwise. The rules would
refuse these too, only with the message that the sequence dim cannot be sharded.

Cost: with the handlers in the table, every eager DTensor call of the two ops goes through Python:
the handler's check, then for the other placements DTensor's Python slow path instead of its C++
fast path (an OpInfo, the cached propagation, the wrap). Measured on the CPU host of the tests
(2 gloo ranks, a tiny head-sharded attention, min of 6 x 2000 calls): 268 us a call without the
handlers, 360 us with them, about 0.1 ms more. Compiled graphs pay it only while tracing (their
DTensor dispatch happens then).

PyTorch's `context_parallel(...)` swaps the handler table for a copy with its own SDPA handlers
while active and restores the table it captured when its module was imported. `register()` adds
ours to the live table and, when that module is loaded, to the table it restores, so enabling and
disabling PyTorch's context parallelism keeps them.

2. The ring as opaque ops. `fuse_plugin::ring_attention(q, k, v, is_causal, scale, group,
load_balanced) -> (out, lse)` and `fuse_plugin::ring_attention_backward(dout, q, k, v, out, lse,
is_causal, scale, group, load_balanced) -> (dq, dk, dv)` run `ring_attention_forward` /
`_backward` on local shards over the process group named `group` (ProcessGroup.group_name), with
fake implementations (the op's layouts: out (B, Hq, L, Dv) laid out (B, L, Hq, Dv), lse float32,
dq/dk/dv as q/k/v) and the autograd link (the forward's backward is the backward op). Dynamo
cannot trace the ring's point-to-point transfers ("P2P compilation is disabled": a graph break at
every transfer) and AOTAutograd cannot record them; inside a custom op they happen at run time and
the compiled graph keeps one call per attention each way, which Inductor runs as an extern kernel in
the graph's data order (every rank runs the same graph, so the collective calls match).

3. Compiled models under PyTorch's `context_parallel(...)`. PyTorch's context parallelism (torch
2.13, _attention.py) works by replacing `F.scaled_dot_product_attention` while active
(`_distribute_function`, "MONKEY_PATCH" mode: a wrapper makes q/k/v `DTensor.from_local(...,
[Shard(2)])`, calls SDPA, whose aten ops reach its DTensor handler `_sdpa_handler` and its ring of
traceable functional collectives, then `.to_local()`), after sharding the buffers in place in its
head-tail order. Under torch.compile Dynamo traces that wrapper (and guards on the patched function),
AOTAutograd desugars the DTensors and traces the ring's all-gather. Nothing else of the model is
touched: attention written out in matmul/softmax (HF's eager attention) runs on each rank's shard
alone, and so does our op after the rewrite (the rewritten graph calls `fuse_plugin::attention` on
plain local tensors): a silently wrong result. Hence `route(gm)`, run on the rewritten Dynamo graph
(before AOTAutograd):
  * PyTorch's context parallelism off: nothing changes (a guard is added, below).
  * on, via `context_parallel(mesh, ...)`: every call of `fuse_plugin::attention` on plain tensors
    becomes `fuse_plugin::ring_attention(q, k, v, is_causal, scale, <mesh's group>, <load_balanced>)`,
    the layout being PyTorch's (head-tail unless it could not balance), so the ring reads the tokens
    where `context_parallel` put them; rotary must see the global positions, i.e. position_ids
    sharded as a buffer beside the inputs (HF then builds the local causal mask, which the rewrite
    proves causal: is_causal, no bias). Like PyTorch's SDPA ring, it takes every attention of the
    graph for self-attention over the sharded sequence. A site the ring does not take raises a
    `ContextParallelError` at compile time naming the site and why (a mask or bias not proven causal,
    e.g. a padding mask; dropout, softcap; q and k of different lengths; rope_attention or
    attention_sinks; a mesh that is not 1-D or unknown: the dispatcher enabled without
    `context_parallel(mesh, ...)`), never the attention of a shard alone. Calls on DTensors are left
    to the handlers (1).
  * The guard: routing is decided at trace time, and nothing else a compiled graph reads changes
    when `context_parallel(...)` is entered (HF's eager attention never touches the patched SDPA),
    so Dynamo could reuse a graph across the two states whenever the shapes agree. `route` adds a
    Dynamo guard on the state (`_state_key()`: off, or the group and layout; a root lambda guard:
    2-3 us more per compiled call on the CPU host of the tests) to every graph that has one of our attention
    sites: a graph compiled in one state recompiles in the other (tested with equal local shapes).
    It needs Dynamo's tracing context (route called from a backend or a pre-grad pass); under
    context parallelism it raises without it, off it skips the guard (logged).
  * A sliding window (the op's `window`, e.g. HF Mistral's, proven by the rewrite) goes to the ring
    with the site: it skips the remote chunks the window hides (ring_attention.py, Masks).
How it runs: both entry points call `route_if_distributed` right after their rewrite (backend.py;
passes.FusePluginPass, which gives no cache key while context parallelism is on, so that an
AOTAutograd cache hit cannot skip the routing and its guard); with torch.distributed not
initialised nothing is walked and no guard is added. The choice (patterns/choice.py) sends every
hand-written site to our op while context parallelism is on, and leaves SDPA call sites to
PyTorch's ring (measured faster than ours). `RoutePass()` is `route` as an Inductor pre-grad pass,
for a backend of one's own; the tests' backend calls `rewrite(gm); route(gm)` (AOTAutograd with
eager kernels).

Not here: biases under the ring in compiled graphs (padding, documents; ring_attention takes a dense
bias sharded with the queries, but a graph's bias is built per rank over local positions), dropout,
softcap, cross-attention, uneven shards, meshes of more than one dim (a CP dim beside
DP/TP dims), rope_attention and attention_sinks sites under context parallelism (refused), PyTorch's
module-wrapper mode (`_context_parallel_shard` + `_enable_context_parallel_dispatcher()` +
`parallelize_module(..., _ContextParallel)`: no mesh to route plain-tensor sites to; refused), and
attention left unfused by the rewrite (a near miss) under `context_parallel(...)`, which runs on
each shard alone as in stock torch.compile: `route` sees only our ops.
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ..kernels.host import layout_like
from .ring_attention import ring_attention_backward, ring_attention_forward
from .sharding import ShardingError

__all__ = ["register", "unregister", "handlers", "SEQUENCE_DIM", "route", "RoutePass", "torch_context_parallel",
           "ContextParallelState"]

log = logging.getLogger(__name__)

SEQUENCE_DIM = 2  # of q, k, v, out, dout (B, H, L, D) and of lse (B, H, L)

_TAKES = ("attn_bias None, dropout_p 0, softcap 0, replace None and window 0, with q and k of one "
          "length divisible by the mesh size")


# ----------------------------------------------------------------------------- registration


def handlers() -> dict:
    """{OpOverload: handler}: what `register()` puts in DTensor's custom op handler table."""
    ops = torch.ops.fuse_plugin
    return {ops.attention.default: _attention_handler, ops.attention_backward.default: _attention_backward_handler}


def _tables() -> list[dict]:
    """The handler tables to keep ours in: DTensor's live one and, when PyTorch's context
    parallelism is loaded, the one it restores on leaving `context_parallel(...)`."""
    from torch.distributed.tensor import DTensor

    tables = [DTensor._op_dispatcher._custom_op_handlers]
    cp = sys.modules.get("torch.distributed.tensor.experimental._context_parallel._attention")
    saved = getattr(cp, "existing_custom_ops", None)
    if isinstance(saved, dict) and saved is not tables[0]:
        tables.append(saved)
    return tables


def register() -> bool:
    """Put the handlers in DTensor's table (idempotent). False (nothing done) without
    torch.distributed or DTensor."""
    if not torch.distributed.is_available():
        return False
    try:
        tables = _tables()
    except ImportError:  # pragma: no cover - a torch build without DTensor
        return False
    for table in tables:
        table.update(handlers())
    return True


def unregister() -> None:
    """Take the handlers out again (sequence-sharded calls then raise the rules' error)."""
    if not torch.distributed.is_available():
        return
    for table in _tables():
        for op, handler in handlers().items():
            if table.get(op) is handler:
                del table[op]


# ----------------------------------------------------------------------------- the handlers


@functools.lru_cache(maxsize=None)
def _schema(op_call) -> tuple[tuple[str, ...], dict]:
    """The op's argument names in order and their defaults (read once: building them from the
    schema costs tens of microseconds a call)."""
    args = op_call._schema.arguments
    return tuple(a.name for a in args), {a.name: a.default_value for a in args if a.has_default_value()}


def _bind(op_call, args: tuple, kwargs: dict) -> dict:
    """{argument name: value} of a call, the schema's defaults filled in (DTensor passes the
    arguments as the call gave them, trailing defaults left out)."""
    names, defaults = _schema(op_call)
    values = dict(defaults)
    values.update(zip(names, args))
    values.update(kwargs)
    return values


@functools.lru_cache(maxsize=None)
def _types():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def _ring_mesh(values: dict, names=("q", "k", "v")):
    """The mesh when every tensor in `names` is a DTensor placed exactly (Shard(2),) on one 1-D
    mesh (the ring's case), else None."""
    DTensor, _, Shard = _types()
    mesh = None
    for name in names:
        t = values[name]
        if not isinstance(t, DTensor) or len(t.placements) != 1 or t.ndim != 4:
            return None
        p = t.placements[0]
        if type(p) is not Shard or p.dim != SEQUENCE_DIM or (mesh is not None and t.device_mesh != mesh):
            return None
        mesh = t.device_mesh
    return mesh


def _refuse(op: str, values: dict, why: str) -> ShardingError:
    return ShardingError(
        f"fuse_plugin::{op}: q, k, v are placed {tuple(values['q'].placements)} (sequence-sharded) on a 1-D mesh, "
        f"which runs ring attention, but {why}. The ring takes {_TAKES}. Redistribute the inputs explicitly "
        f"(DTensor.redistribute) to Shard(0) (batch), Shard(1) (heads) or Replicate() for this call.")


def _check_ring_arguments(op: str, values: dict, mesh) -> None:
    """The near misses: what q, k, v (Shard(2),) come with that the ring does not take."""
    def placed(name):
        t = values[name]
        return f" (placement {tuple(t.placements)})" if hasattr(t, "placements") else ""

    for name, on, what in (("attn_bias", values.get("attn_bias") is not None, "the ring takes no bias or mask yet"),
                           ("replace", values.get("replace") is not None, "the ring takes no replace mask"),
                           ("dropout_p", bool(values.get("dropout_p")), "dropout is not drawn across shards"),
                           ("softcap", bool(values.get("softcap")), "the ring takes no softcap yet"),
                           ("window", bool(values.get("window")), "the ring takes no sliding window on DTensors yet"),
                           ("chunk", bool(values.get("chunk")), "the ring takes no chunks"),
                           ("documents", values.get("documents") is not None, "the ring takes no documents")):
        if on:
            raise _refuse(op, values, f"{name}={_say(values[name])}{placed(name)} is given ({what})")
    q, k = values["q"], values["k"]
    if q.shape[SEQUENCE_DIM] != k.shape[SEQUENCE_DIM]:
        raise _refuse(op, values, f"q has {q.shape[SEQUENCE_DIM]} tokens and k {k.shape[SEQUENCE_DIM]} (the ring "
                                  f"is self-attention: q and k/v sharded alike; cross-attention is not supported)")
    if q.shape[SEQUENCE_DIM] % mesh.size():
        raise _refuse(op, values, f"its {q.shape[SEQUENCE_DIM]} tokens do not split evenly over the mesh's "
                                  f"{mesh.size()} ranks (Shard(2) then gives the ranks different lengths; the ring "
                                  f"needs every rank to hold as many tokens)")
    if values["is_causal"] and _load_balanced() and (q.shape[SEQUENCE_DIM] // mesh.size()) % 2:
        raise _refuse(op, values, f"PyTorch's context_parallel(...) is active with its load-balanced (head-tail) "
                                  f"order, whose shards hold two chunks of equal length, and a shard here has "
                                  f"{q.shape[SEQUENCE_DIM] // mesh.size()} tokens (odd)")


def _say(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<{type(value).__name__} {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def _local_rows(op: str, values: dict, name: str, mesh) -> torch.Tensor:
    """This rank's rows of a backward input (dout, out, lse) that must follow q: its local tensor
    when (Shard(2),), its local slice when Replicate() (no communication), else a ShardingError."""
    DTensor, Replicate, Shard = _types()
    t = values[name]
    if isinstance(t, DTensor) and t.device_mesh == mesh and len(t.placements) == 1:
        p = t.placements[0]
        if type(p) is Shard and p.dim == SEQUENCE_DIM:
            return t._local_tensor
        if type(p) is Replicate and t.shape[SEQUENCE_DIM] % mesh.size() == 0:
            n = t.shape[SEQUENCE_DIM] // mesh.size()
            return t._local_tensor.narrow(SEQUENCE_DIM, mesh.get_local_rank() * n, n)
    got = tuple(t.placements) if isinstance(t, DTensor) else f"a plain {type(t).__name__}"
    raise _refuse(op, values, f"argument {name!r} is {got}: with q, k, v sequence-sharded it must be (Shard(dim=2),) "
                              f"on the same mesh, or Replicate() (then sliced locally)")


def _wrap(local: torch.Tensor, mesh, placement):
    """A DTensor of `local` placed (placement,) on `mesh`; its global shape and stride from the
    local ones (even shards), as DTensor.from_local computes them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    shape, stride = compute_global_tensor_info(local, mesh, [placement])
    spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor._op_dispatcher.wrap(local, spec)


def _attention_handler(op_call, args: tuple, kwargs: dict):
    """fuse_plugin::attention on DTensors: the ring for q, k, v (Shard(2),), else DTensor's own path."""
    values = _bind(op_call, args, kwargs)
    mesh = _ring_mesh(values)
    if mesh is None:
        return _default(op_call, args, kwargs)
    _check_ring_arguments("attention", values, mesh)
    q, k, v = (values[n]._local_tensor for n in ("q", "k", "v"))
    if _tracing():  # the opaque op: the graph keeps one call, the transfers run inside it
        out, lse = torch.ops.fuse_plugin.ring_attention.default(
            q, k, v, bool(values["is_causal"]), float(values["scale"]), mesh.get_group().group_name, _load_balanced())
    else:
        out, lse = ring_attention_forward(q, k, v, is_causal=values["is_causal"], scale=values["scale"],
                                          group=mesh.get_group(), load_balanced=_load_balanced())
    seq = _types()[2](SEQUENCE_DIM)
    return _wrap(out, mesh, seq), _wrap(lse, mesh, seq)


def _attention_backward_handler(op_call, args: tuple, kwargs: dict):
    """fuse_plugin::attention_backward on DTensors: the ring backward for q, k, v (Shard(2),)
    (with the global out/lse's rows), else DTensor's own path. dbias: empty, replicated."""
    values = _bind(op_call, args, kwargs)
    mesh = _ring_mesh(values)
    if mesh is None:
        return _default(op_call, args, kwargs)
    _check_ring_arguments("attention_backward", values, mesh)
    dout, out, lse = (_local_rows("attention_backward", values, n, mesh) for n in ("dout", "out", "lse"))
    q, k, v = (values[n]._local_tensor for n in ("q", "k", "v"))
    if _tracing():
        dq, dk, dv = torch.ops.fuse_plugin.ring_attention_backward.default(
            dout, q, k, v, out, lse, bool(values["is_causal"]), float(values["scale"]), mesh.get_group().group_name,
            _load_balanced())
    else:
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, is_causal=values["is_causal"],
                                             scale=values["scale"], group=mesh.get_group(),
                                             load_balanced=_load_balanced())
    _, Replicate, Shard = _types()
    seq = Shard(SEQUENCE_DIM)
    return (_wrap(dq, mesh, seq), _wrap(dk, mesh, seq), _wrap(dv, mesh, seq),
            _wrap(q.new_empty((0,)), mesh, Replicate()))


def _default(op_call, args: tuple, kwargs: dict):
    """What DTensor's dispatcher does for an op without a custom handler: unwrap the local
    tensors, propagate the sharding through the op's rule (its errors wrapped the same way),
    redistribute where the rule says (a local slice of a replicated input, for our rules), run
    the op on the local tensors, wrap the results with the rule's output specs."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    op_info.output_sharding = dispatcher._propagate_op_sharding_dispatch_slow_path(
        op_call, args, kwargs, op_info, try_cache=True)
    local_results = dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)
    return dispatcher.wrap(local_results, op_info.output_sharding.output_spec)


def _tracing() -> bool:
    """Is this call traced (Dynamo's fake propagation, AOTAutograd, make_fx)? Then the handlers
    call the ring's opaque ops instead of running it."""
    from torch.distributed._functional_collectives import _are_we_tracing

    return _are_we_tracing()


def _load_balanced() -> bool:
    """How a Shard(2) DTensor's tokens are ordered: PyTorch's load-balanced (head-tail) order while
    its context parallelism is on and balancing (`context_parallel(...)` sharded the buffers so, and
    its own SDPA ring reads Shard(2) so), else the plain contiguous chunks."""
    state = torch_context_parallel()
    return state is not None and state.load_balanced


# ----------------------------------------------------------------------------- PyTorch's context parallelism

_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
_SDPA = torch._C._nn.scaled_dot_product_attention  # F.scaled_dot_product_attention when not patched


@dataclass(frozen=True)
class ContextParallelState:
    """PyTorch's context parallelism while it is on.

    mesh          the context-parallel DeviceMesh (None where PyTorch keeps it in module hooks only:
                  `_enable_context_parallel_dispatcher()` with parallelize_module(..., _ContextParallel))
    group_name    its process group's name ("" without a mesh)
    load_balanced the buffers were sharded in the head-tail order (`_cp_options.enable_load_balance`;
                  context_parallel(...) turns it off when the length does not divide by 2·W)"""

    mesh: Any
    group_name: str
    load_balanced: bool

    def key(self) -> tuple:
        return (self.group_name, self.load_balanced, self.mesh is None)


def torch_context_parallel() -> Optional[ContextParallelState]:
    """The state of PyTorch's context parallelism now, or None when it is off.

    On: `context_parallel(mesh, ...)` is active (it replaces F.scaled_dot_product_attention by a
    wrapper that makes q/k/v Shard(2) DTensors on `mesh`; the mesh is read from that wrapper), or its
    DTensor dispatcher is enabled alone (`_enable_context_parallel_dispatcher()`: SDPA's handlers in
    DTensor's table; no mesh known). Nothing is imported: without PyTorch's module loaded it is off."""
    cp = sys.modules.get(_CP_MODULE)
    if cp is None:
        return None
    fn = torch.nn.functional.scaled_dot_product_attention
    if fn is not _SDPA and fn in getattr(cp, "_replaced_functions", ()):
        mesh = _closure_value(fn, "device_mesh")
        name = mesh.get_group().group_name if mesh is not None and mesh.ndim == 1 else ""
        return ContextParallelState(mesh, name, _balancing(cp))
    handler = getattr(cp, "_sdpa_handler", None)
    if handler is not None and _types()[0]._op_dispatcher._custom_op_handlers.get(_flash_op()) is handler:
        return ContextParallelState(None, "", _balancing(cp))
    return None


def _balancing(cp) -> bool:
    return bool(getattr(getattr(cp, "_cp_options", None), "enable_load_balance", False))


@functools.lru_cache(maxsize=None)
def _flash_op():
    return torch.ops.aten._scaled_dot_product_flash_attention.default


def _closure_value(fn, name: str):
    """The value of the free variable `name` of the function `fn` (None if it has none)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None or name not in code.co_freevars:
        return None
    return cells[code.co_freevars.index(name)].cell_contents


def _state_key() -> Optional[tuple]:
    """What a compiled graph's routing depends on: None when PyTorch's context parallelism is off,
    else its group and layout. The guard of `route` compares it (the off case costs an identity
    test and two dict lookups)."""
    state = torch_context_parallel()
    return None if state is None else state.key()


# ----------------------------------------------------------------------------- the ring as opaque ops
#
# The ring's transfers (batch_isend_irecv) cannot be traced: Dynamo breaks the graph there ("P2P
# compilation is disabled") and AOTAutograd cannot record them. Wrapped in custom ops with fake
# implementations, the ring stays ONE call in a compiled graph: Dynamo and AOTAutograd see its
# shapes only, Inductor calls it as an extern kernel in the graph's data order (every rank runs the
# same graph, so the collective calls match), and the transfers happen at run time inside it.
# The group travels as its name (custom ops take no ProcessGroup).

_GROUPS: dict = {}


def _group(name: str):
    if name not in _GROUPS:
        from torch.distributed.distributed_c10d import _resolve_process_group

        _GROUPS[name] = _resolve_process_group(name)
    return _GROUPS[name]


def _like(t: Tensor, fake: Tensor) -> Tensor:
    """t with exactly the strides its fake implementation promised (a copy only where they differ,
    e.g. in a dim of size 1)."""
    if t.stride() == fake.stride():
        return t
    return torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=t.device).copy_(t)


def _out_like(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out, lse) of the ring for q and v: out (B, Hq, L, Dv) laid out (B, L, Hq, Dv) (the op's
    layout), lse (B, Hq, L) float32."""
    b, hq, lq, _ = q.shape
    return q.new_empty((b, lq, hq, v.shape[-1])).transpose(1, 2), q.new_empty((b, hq, lq), dtype=torch.float32)


@torch.library.custom_op("fuse_plugin::ring_attention", mutates_args=())
def _ring_attention_op(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, group: str,
                       load_balanced: bool, window: int = 0) -> tuple[Tensor, Tensor]:
    """ops/ring_attention.py's `ring_attention_forward` over the group named `group`: this rank's
    (out, lse) of attention over the whole sequence from its shards q, k, v (B, H, L/W, D);
    `window` the sliding window (0: none; with is_causal)."""
    out, lse = ring_attention_forward(q, k, v, is_causal=is_causal, scale=scale, group=_group(group),
                                      load_balanced=load_balanced, window=window)
    fake_out, fake_lse = _out_like(q, v)
    return _like(out, fake_out), _like(lse, fake_lse)


@_ring_attention_op.register_fake
def _(q, k, v, is_causal, scale, group, load_balanced, window=0):
    return _out_like(q, v)


@torch.library.custom_op("fuse_plugin::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                is_causal: bool, scale: float, group: str,
                                load_balanced: bool, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """`ring_attention_backward` over the group named `group`: dq, dk, dv laid out as q, k, v."""
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale,
                                         group=_group(group), load_balanced=load_balanced, window=window)
    return _like(dq, layout_like(q, q.dtype)), _like(dk, layout_like(k, k.dtype)), _like(dv, layout_like(v, v.dtype))


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale, group, load_balanced, window=0):
    return layout_like(q, q.dtype), layout_like(k, k.dtype), layout_like(v, v.dtype)


def _ring_setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, group, load_balanced, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (is_causal, scale, group, load_balanced, window)
    ctx.mark_non_differentiable(lse)


def _ring_backward_formula(ctx, dout, _dlse):
    # (dout is never None: autograd materialises zeros, so every rank runs the collective backward)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fuse_plugin.ring_attention_backward.default(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_ring_attention_op.register_autograd(_ring_backward_formula, setup_context=_ring_setup_context)


# ----------------------------------------------------------------------------- compiled graphs: route

_ATTENTION = "fuse_plugin::attention"
_NOT_UNDER_CP = ("fuse_plugin::rope_attention", "fuse_plugin::attention_sinks")


class ContextParallelError(ShardingError):
    """An attention site the ring cannot run while PyTorch's context parallelism is on (raised when
    the graph compiles, instead of computing the attention of each rank's shard alone)."""


def _target_name(node) -> str:
    """"namespace::op" of a call of an op (its overload, or the packet as user code calls it), else ""."""
    if node.op != "call_function":
        return ""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return ""


def _value(node):
    if hasattr(node, "meta"):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def _sites(gm) -> list:
    """(graph module, node) of every call of our attention ops, in gm and its subgraphs."""
    from torch import fx

    out = []
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            out += [(sub, n) for n in sub.graph.nodes if _target_name(n) in (_ATTENTION, *_NOT_UNDER_CP)]
    return out


def _site_refusal(node, values: dict, why: str) -> ContextParallelError:
    where = node.meta.get("stack_trace", "").strip().splitlines()[-2:] if hasattr(node, "meta") else []
    at = f" (at {' / '.join(s.strip() for s in where)})" if where else ""
    return ContextParallelError(
        f"fuse_plugin: PyTorch's context_parallel(...) is active, so the attention site {node.name!r} "
        f"({_target_name(node)}){at} must run over the whole sequence as ring attention (every rank holds one "
        f"shard of q, k and v), but {why}. The ring takes {_TAKES} (PyTorch's SDPA ring takes no mask either). "
        f"Run this model outside context_parallel(...); computing the attention of each rank's shard alone "
        f"would be wrong.")


def route_if_distributed(gm) -> int:
    """`route` where context parallelism can be on or come on: torch.distributed initialised (a
    DeviceMesh, which context_parallel(...) needs, requires it). Elsewhere nothing is walked and no
    guard is added (a model compiled before init_process_group and run under context_parallel
    later is not guarded; stock compile does not guard that either). Called by both entry points
    right after the rewrite (backend.py, passes.FusePluginPass)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return route(gm)


def route(gm) -> int:
    """Route the attention sites of a rewritten graph to the ring while PyTorch's context
    parallelism is on; returns how many were routed. Run it on the graph the rewrite produced
    (before AOTAutograd), inside the compile (backend or pre-grad pass), see the module doc."""
    sites = _sites(gm)
    if not sites:
        return 0
    state = torch_context_parallel()
    _install_guard(state)
    if state is None:
        return 0
    from torch.distributed.tensor import DTensor

    routed, changed = 0, set()
    for sub, node in sites:
        q_val = _value(node.args[0]) if node.args else None
        if isinstance(q_val, DTensor):
            continue  # DTensor q/k/v: the DTensor handlers above run the ring (traced: the opaque op)
        if _target_name(node) != _ATTENTION:
            raise _site_refusal(node, {}, "this op (rotary folded into attention, or attention sinks) has no ring")
        values = _bind(torch.ops.fuse_plugin.attention.default, node.args, node.kwargs)
        _check_site(node, values, state)
        is_causal, scale = values["is_causal"], values["scale"]
        with sub.graph.inserting_before(node):
            new = sub.graph.call_function(
                torch.ops.fuse_plugin.ring_attention.default,
                (values["q"], values["k"], values["v"], bool(is_causal) if isinstance(is_causal, bool) else is_causal,
                 float(scale) if isinstance(scale, (int, float)) else scale, state.group_name, state.load_balanced,
                 int(values.get("window") or 0)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        sub.graph.erase_node(node)
        changed.add(sub)
        routed += 1
    for sub in changed:
        sub.graph.lint()
        sub.recompile()
    if routed:
        from torch._dynamo.utils import counters

        counters["fuse_plugin"]["ring_attention"] += routed
        log.info("routed %d attention site(s) to ring attention over group %s (%s order)", routed, state.group_name,
                 "load-balanced" if state.load_balanced else "contiguous")
    return routed


def _check_site(node, values: dict, state: ContextParallelState) -> None:
    """What a plain-tensor attention site must be for the ring under `state` (else raise)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if state.mesh is None:
        raise _site_refusal(node, values, "its mesh is unknown (PyTorch's context-parallel dispatcher is enabled "
                                          "without context_parallel(mesh, ...), which alone names the mesh)")
    if state.mesh.ndim != 1:
        raise _site_refusal(node, values, f"its mesh has {state.mesh.ndim} dims (the ring runs over a 1-D mesh)")
    for name, on, what in (("attn_bias", values.get("attn_bias") is not None, "a mask or bias, not proven causal"),
                           ("replace", values.get("replace") is not None, "a replace mask"),
                           ("dropout_p", bool(values.get("dropout_p")), "dropout"),
                           ("softcap", bool(values.get("softcap")), "a softcap"),
                           ("chunk", bool(values.get("chunk")), "chunked attention"),
                           ("documents", values.get("documents") is not None, "documents")):
        if on:
            raise _site_refusal(node, values, f"the site has {what} ({name}={_say(_value(values[name]))})")
    q, k = _value(values["q"]), _value(values["k"])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4):
        raise _site_refusal(node, values, "q and k are not 4-D tensors with example values")
    lq, lk = q.shape[SEQUENCE_DIM], k.shape[SEQUENCE_DIM]
    if not statically_known_true(lq == lk):
        raise _site_refusal(node, values, f"q has {lq} tokens here and k {lk} (the ring is self-attention over "
                                          f"shards of one sequence; cross-attention or a KV cache is not supported)")
    if values["is_causal"] and state.load_balanced and statically_known_true(lq % 2 == 1):
        raise _site_refusal(node, values, f"a rank's shard holds {lq} tokens, odd, where the load-balanced order "
                                          f"holds two chunks of equal length")


# The guard: a graph compiled while the state was S is reused only while it is S. Routing decides at
# trace time (a routed graph runs the ring, an unrouted one the attention of a rank's shard alone),
# and nothing else the graph reads changes when context_parallel(...) is entered (eager attention
# never touches F.scaled_dot_product_attention, which Dynamo would guard). Dynamo takes the guard from
# the backend: guards added to the tracing context while the backend runs are built with the rest
# (torch 2.13: convert_frame builds CheckFunctionManager after the backend returns).


@functools.lru_cache(maxsize=None)
def _guard_create_fn(expected):
    """One create function per state (Dynamo dedups a guard by its source and create function)."""

    def fuse_plugin_context_parallel(builder, guard):
        builder.guard_manager.root.add_lambda_guard(
            lambda _: _state_key() == expected,
            [f"fuse_plugin: PyTorch's context parallelism is {'off' if expected is None else expected}"], None)

    return fuse_plugin_context_parallel


def _install_guard(state: Optional[ContextParallelState]) -> bool:
    """Guard the graph being compiled on the state of PyTorch's context parallelism. Required while it
    is on (raises if it cannot be installed: a routed graph must not run outside it, nor an unrouted
    one inside); off, best effort (logged when it fails, e.g. outside Dynamo)."""
    expected = None if state is None else state.key()
    try:
        from torch._dynamo.source import GlobalStateSource
        from torch._guards import Guard, TracingContext

        ctx = TracingContext.try_get()
        if ctx is None or ctx.guards_context is None:
            raise RuntimeError("no Dynamo tracing context (not called from a torch.compile backend)")
        ctx.guards_context.dynamo_guards.add(Guard(GlobalStateSource(), _guard_create_fn(expected)))
        return True
    except Exception as e:  # noqa: BLE001 - reported below
        if state is not None:
            raise RuntimeError(f"fuse_plugin: cannot guard the compiled graph on PyTorch's context parallelism "
                               f"({type(e).__name__}: {e}); refusing to route it (run the rewrite and route from "
                               f"a torch.compile backend)") from e
        log.debug("no context-parallel guard on this graph: %s", e)
        return False


def _custom_graph_pass_base():
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        return CustomGraphPass
    except ImportError:  # pragma: no cover
        return object


class RoutePass(_custom_graph_pass_base()):
    """`route` as an Inductor pre-grad pass (it runs on the rewritten Dynamo graph, before
    AOTAutograd): torch.compile(model, backend="fuse_plugin", options={"pre_grad_custom_pass":
    RoutePass()}) routes without a change to the backend, which runs a user's pre-grad pass after its
    own (idle) one. `chained`: a pass to run after it.

    No uuid, on purpose: torch 2.13 runs pre-grad passes that have one AFTER the AOTAutograd cache
    lookup (aot_module_simplified, "late" timing), so a cache hit would skip `route` and with it the
    Dynamo guard it adds, which no cache replays. Without a uuid the passes run before the lookup
    ("early"; Inductor logs once that the pre-grad pass cache is bypassed) and the caches key on the
    routed graph, whose ring calls name the group and the layout."""

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph) -> None:
        gm = getattr(graph, "owning_module", graph)
        if gm is not None:
            route(gm)
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Any:
        return None
