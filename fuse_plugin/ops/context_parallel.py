"""Sequence-sharded DTensors run ring attention (issue 32, second part).

    context_parallel.register()        # once, idempotent (ops/sharding.register() calls it)
    out, lse = torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, is_causal, scale)
    #   q (B, Hq, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv): DTensors, all placed (Shard(2),) on
    #   one 1-D mesh; out (B, Hq, L, Dv) and lse (B, Hq, L) come back as DTensors placed (Shard(2),)

When `fuse_plugin::attention` receives q, k and v as DTensors sharded on their sequence dim
(placements exactly `(Shard(2),)`, the same 1-D DeviceMesh) with the arguments the ring takes
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
Both are collectives over the mesh's group: every rank of the mesh must make the call.

Layout. A DTensor placed Shard(2) holds, by PyTorch's definition, the contiguous chunk r of W
along dim 2 (torch.chunk: tokens [r·L/W, (r+1)·L/W) on rank r), so the handlers run the ring with
load_balanced=False: exact for causal attention in that layout (top-left causal over the global
positions; ring_attention.step_calls skips the blocks the mask hides), but the causal work is
uneven: rank W-1 computes W blocks, rank 0 one. PyTorch's context parallelism balances it by
storing the sequence in its head-tail order (`_HeadTailLoadBalancer`: rank r holds chunks r and
2W-1-r of 2W) and still calling the result Shard(2): a DTensor's placement cannot tell that order
from the plain one, so a tensor sharded that way (`context_parallel(...)`, `_context_parallel_shard`
with a load balancer, or `ring_attention.shard_sequence(..., load_balanced=True)`) and wrapped as a
Shard(2) DTensor would silently get the causal mask of the wrong positions here. For the balanced
layout call `ring_attention(..., load_balanced=True)` on the local tensors; without is_causal the
two layouts give the same result (every query sees every key).

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
window, q and k of different lengths (cross-attention), a length the mesh does not divide, a
backward's dout/out/lse placed otherwise, or a call traced by torch.compile (the ring's
point-to-point transfers run eagerly only). The rules would refuse these too, only with the
message that the sequence dim cannot be sharded.

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

Not here (issue 32, later parts): the load-balanced layout on DTensors (an opt-in, e.g. under
`context_parallel(...)`, which already shards in that order), meshes of more than one dim (a CP dim
beside DP/TP dims), masks and biases under the ring, dropout, cross-attention, uneven shards,
torch.compile of sequence-sharded DTensors, the other attention ops (attention_sinks,
rope_attention).
"""
from __future__ import annotations

import functools
import sys

import torch

from .ring_attention import ring_attention_backward, ring_attention_forward
from .sharding import ShardingError

__all__ = ["register", "unregister", "handlers", "SEQUENCE_DIM"]

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
    from torch.distributed._functional_collectives import _are_we_tracing

    def placed(name):
        t = values[name]
        return f" (placement {tuple(t.placements)})" if hasattr(t, "placements") else ""

    for name, on, what in (("attn_bias", values.get("attn_bias") is not None, "the ring takes no bias or mask yet"),
                           ("replace", values.get("replace") is not None, "the ring takes no replace mask"),
                           ("dropout_p", bool(values.get("dropout_p")), "dropout is not drawn across shards"),
                           ("softcap", bool(values.get("softcap")), "the ring takes no softcap yet"),
                           ("window", bool(values.get("window")), "the ring takes no sliding window yet")):
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
    if _are_we_tracing():
        raise _refuse(op, values, "the call is being traced (torch.compile): the ring's point-to-point transfers "
                                  "run eagerly only, so call the op on sequence-sharded DTensors outside compiled code")


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
    out, lse = ring_attention_forward(q, k, v, is_causal=values["is_causal"], scale=values["scale"],
                                      group=mesh.get_group(), load_balanced=False)
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
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, is_causal=values["is_causal"],
                                         scale=values["scale"], group=mesh.get_group(), load_balanced=False)
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
