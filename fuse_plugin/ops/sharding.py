"""DTensor sharding rules for every `fuse_plugin` op (registered on import).

Called on DTensors (eagerly, e.g. through `register_hf()`, or traced by torch.compile with tensor
parallelism), an op runs once per rank on the local shards, and its outputs are DTensors again.
That is right only for some placements; these are the ones each op takes, on every mesh dim:

  attention, attention_backward, rope_attention, rope_attention_backward, gluon_attention_*
    Replicate  every tensor replicated.
    batch      q, k, v (dout, out, lse) Shard(0); attn_bias (and cos/sin) Shard on their batch
               dim when it is not broadcast (size > 1), else Replicate. A window-periodic
               attn_bias / replace ((P, ...), batch b reading row b % P) refuses a batch shard.
    heads      q, k, v (dout, out, lse) Shard(1): q heads and kv heads together. Hq and Hkv must
               both be divisible by the number of shards, so that shard r holds the kv heads
               [r·Hkv/n, (r+1)·Hkv/n) and exactly the q heads of their GQA groups (q head h reads
               kv head h // (Hq/Hkv), globally and locally alike). attn_bias and cos/sin: Shard
               on their head dim when it is not broadcast, else Replicate.
    A gradient of a broadcast (replicated) bias or cos/sin table is a Partial sum: each rank
    holds the sum over its own shard. Empty outputs (a gradient nobody asked for) are replicated.
    dropout_p > 0 only when replicated: the dropout mask is a function of the seed and the local
    indices, so on shards it would repeat on every rank instead of being drawn independently.
    softcap (attention, attention_backward): a scalar applied to every score alike, so any of
    these placements takes it as it is (it is one of the cache key's non-tensor arguments).
    replace (attention, attention_backward): a bool mask broadcast to the scores like attn_bias,
    and placed like it (Shard on the batch / head dim it holds, else Replicate).
    documents (attention, attention_backward): ids (B, L) or (1, L), Shard(0) with a batch shard
    where they hold the batch, else Replicate (every head reads the same ids).
  sequence (attention, attention_backward only): q, k, v (dout, out, lse) all Shard(2) on a 1-D
    mesh, no bias / dropout / softcap / replace / window: not a rule but DTensor custom handlers
    (ops/context_parallel.py, registered here) that run ring attention over the shards
    (ops/ring_attention.py) in plain contiguous Shard(2) order; eager only.
  attention_sinks, attention_sinks_backward: as attention; sinks (Hq,) Shard(0) with the heads,
    Replicate with the batch; its gradient likewise, a Partial sum over batch shards.

  rotary, rotary_backward, rotary_qk, rotary_qk_backward (pointwise over every leading dim)
    Replicate, or x (q and k, their gradients) Shard(d) on one leading dim d (batch, heads or
    sequence; never the channel dim, whose pairs span it) with cos/sin sharded on the same
    (right-aligned) dim where they are not broadcast there, else Replicate. So a sequence-
    sharded x needs sequence-sharded tables (the positions of its own shard).

A replicated input where the rule wants a shard is fine: DTensor takes the rank's chunk, a local
slice (a backward's incoming gradient often arrives replicated). Anything else (Partial inputs,
a shard of an unsupported dim, arguments that disagree, a dim sharded over two mesh dims, uneven
heads, _StridedShard) raises `ShardingError` naming the op,
the argument, its placement and what the op takes. The rules return only the placements the
inputs have (or a local slice of them), never one that DTensor would reach by communicating:
DTensor picks the cheapest listed strategy and silently redistributes the inputs to reach it (an
all-gather of a sequence-sharded q to Replicate, say), which these rules never let it do.

Registered with `torch.distributed.tensor.experimental.register_sharding`; its default cache
key leaves out the float/bool arguments, so the key is widened to every non-tensor argument
(the rules read dropout_p and the need_* flags).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["ShardingError", "registered_ops"]


class ShardingError(ValueError):
    """A DTensor placement an op cannot run on locally (raised instead of any redistribution)."""


_REGISTERED: list[str] = []


def registered_ops() -> list[str]:
    """The ops (qualified names) that have a sharding rule (empty without torch.distributed)."""
    return list(_REGISTERED)


# ----------------------------------------------------------------------------- placements


def _spec_types():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import Partial

    return DTensorSpec, Replicate, Shard, Partial


def _is_spec(x) -> bool:
    return isinstance(x, _spec_types()[0])


def _shard_dim(p) -> Optional[int]:
    """d for a plain Shard(d) (not _StridedShard), else None."""
    _, _, Shard, _ = _spec_types()
    return p.dim if type(p) is Shard else None


def _is_replicate(p) -> bool:
    return type(p) is _spec_types()[1]


class _Rule:
    """One op's rule. `roles` maps each tensor argument's name to how it follows the op's frame:

      "main"   the frame's own tensors (q, k, v, dout, out, lse; x, grad): sharded like the lead;
      "bcast"  tensors broadcast to the frame, right-aligned (attn_bias, cos, sin): sharded like
               the lead on a dim they hold (size > 1), Replicate where they broadcast (size 1 or
               absent);
      "scalar" a seed: always Replicate;
      "heads"  a 1-D tensor over the q heads (sinks): Shard(0) with the heads, else Replicate;
      "rows"   a (B, L) tensor over the batch (documents): Shard(0) with the batch where it holds
               it (B > 1), else Replicate.

    A mesh dim's mode is None (replicated) or a frame dim as a negative index. Attention-like ops
    (`frame` = 4: the (B, H, L, D) frame) shard at -4 (batch) or -3 (heads); their "main" tensors
    are left-aligned to it (lse is (B, H, L)). Rotary ops (`frame` None) shard at any leading
    dim of the lead tensor; everything is right-aligned to it.
    """

    def __init__(self, op: str, names: Sequence[str], roles: dict[str, str], lead: str, outputs: Callable,
                 frame: Optional[int] = None, head_args: Sequence[str] = (), dropout_arg: Optional[str] = None):
        self.op, self.names, self.roles, self.lead = op, list(names), roles, lead
        self.outputs, self.frame = outputs, frame
        self.head_args, self.dropout_arg = list(head_args), dropout_arg

    def __call__(self, *args, **kwargs):
        values = dict(zip(self.names, args))
        values.update(kwargs)
        lead = values[self.lead]
        tensors = {n: v for n, v in values.items() if _is_spec(v)}
        unknown = [n for n in tensors if n not in self.roles]
        if unknown:  # pragma: no cover - a schema this rule does not know
            raise ShardingError(f"fuse_plugin::{self.op}: no sharding role for argument(s) {unknown}")
        modes = [self._mode(m, tensors) for m in range(lead.mesh.ndim)]
        sharded = [d for d in modes if d is not None]
        if len(set(sharded)) != len(sharded):
            raise ShardingError(
                f"fuse_plugin::{self.op}: the op's {self._mains()} are sharded on one dim over several mesh dims "
                f"(modes per mesh dim {modes}; {self.lead!r} is {tuple(lead.placements)}), which is not supported "
                f"(the shard order would have to agree on every argument); shard each dim over one mesh dim")
        for m, mode in enumerate(modes):
            for name, spec in tensors.items():
                self._check(m, mode, name, spec)
        if self.dropout_arg is not None and values.get(self.dropout_arg, 0.0) and sharded:
            raise ShardingError(
                f"fuse_plugin::{self.op}: dropout_p={values[self.dropout_arg]} with the op's {self._mains()} "
                f"sharded ({self.lead!r} is {tuple(lead.placements)}): dropout needs Replicate() placements (the "
                f"mask is drawn from the seed and the local indices, so every shard would repeat the same mask)")
        self._check_heads(modes, values, lead.mesh)
        self._check_periodic(modes, values)
        strategies = []
        for mode in dict.fromkeys(modes):  # one strategy per distinct mode
            ins = [self._want(mode, n, v) if _is_spec(v) else None for n, v in values.items()]
            strategies.append((list(self.outputs(self, mode, values)), ins))
        return strategies

    # ---------------------------------------------------------------- pieces
    def error(self, arg: str, placement, mesh_dim: int, why: str) -> ShardingError:
        return ShardingError(
            f"fuse_plugin::{self.op}: argument {arg!r} has placement {placement!r} on mesh dim {mesh_dim}, which the "
            f"op cannot run on shard by shard ({why}). Supported on each mesh dim: {self.supported()}. "
            f"Redistribute the inputs explicitly (DTensor.redistribute) to one of these.")

    def supported(self) -> str:
        if self.frame is None:
            return (f"Replicate() everywhere, or {self.lead!r} (and the other rotated tensors) Shard(d) on one "
                    f"leading dim d (not the channel dim) with cos/sin sharded on the same right-aligned dim "
                    f"where they are not broadcast (else Replicate())")
        return ("Replicate() everywhere, or q, k, v (and dout, out, lse) all Shard(0) (batch) or all Shard(1) "
                "(heads, Hq and Hkv divisible by the shard count), with attn_bias/cos/sin sharded on that "
                "dim where they are not broadcast (else Replicate()) and seeds Replicate()")

    def _mode(self, m: int, tensors: dict) -> Optional[int]:
        """Mesh dim m's mode, from the "main" tensors sharded there (they must agree)."""
        mode, by = None, None
        for name, spec in tensors.items():
            if self.roles[name] != "main" or _is_replicate(spec.placements[m]):
                continue
            this = self._mode_of(m, name, spec)
            if mode is None:
                mode, by = this, name
            elif this != mode:
                raise self.error(name, spec.placements[m], m, f"{by!r} is {tensors[by].placements[m]!r} there: the "
                                 f"op's tensors must be sharded on the same dim")
        return mode

    def _mode_of(self, m: int, name: str, spec) -> int:
        p = spec.placements[m]
        d = _shard_dim(p)
        if d is None:
            raise self.error(name, p, m, "only Replicate() and Shard(d) can be: a Partial sum or a strided "
                             "shard cannot go through the op's math shard by shard")
        if self.frame is None:
            if d == spec.ndim - 1:
                raise self.error(name, p, m, "the last dim holds the rotated channel pairs")
            return d - spec.ndim
        if d not in (0, 1):
            raise self.error(name, p, m, "only the batch and head dims are independent across shards: the "
                             "sequence and head_dim dims mix in the softmax and the dot products")
        return d - self.frame

    def _want(self, mode: Optional[int], name: str, spec):
        """The placement that argument `name` must have on a mesh dim in `mode`."""
        _, Replicate, Shard, _ = _spec_types()
        role = self.roles[name]
        if mode is None or role == "scalar":
            return Replicate()
        if role == "heads":
            return Shard(0) if mode == 1 - self.frame else Replicate()
        if role == "rows":
            return Shard(0) if mode == -self.frame and spec.shape[0] > 1 else Replicate()
        if role == "main":
            return Shard((self.frame if self.frame is not None else spec.ndim) + mode)
        return Shard(spec.ndim + mode) if _holds(spec, mode) else Replicate()

    def _check(self, m: int, mode: Optional[int], name: str, spec) -> None:
        want, got = self._want(mode, name, spec), spec.placements[m]
        if type(got) is type(want) and got == want:
            return
        if _is_replicate(got) and _shard_dim(want) is not None:
            return  # DTensor takes this rank's chunk of the replicated tensor: a local slice, no communication
        if self.roles[name] == "scalar":
            why = "a seed must be Replicate()"
        elif mode is None:
            why = (f"the op's {self._mains()} are all Replicate() there, so {name!r} would have to be "
                   f"communicated (gathered or reduced) in full to every rank")
        else:
            why = (f"the op's {self._mains()} are {self._say(mode)} there, so {name!r} must be {want!r}"
                   + (" as it broadcasts over that dim" if _is_replicate(want) else ""))
        raise self.error(name, got, m, why)

    def _mains(self) -> str:
        return "/".join(n for n, r in self.roles.items() if r == "main")

    def _say(self, mode: int) -> str:
        if self.frame is not None:
            return f"Shard({self.frame + mode}) ({'batch' if mode == -self.frame else 'heads'})"
        return f"sharded on their dim {mode} (counted from the end)"

    def _check_heads(self, modes, values, mesh) -> None:
        """Even head shards: each shard holds whole GQA groups (q heads with their kv head)."""
        if self.frame is None:
            return
        n = 1
        for m, mode in enumerate(modes):
            if mode == 1 - self.frame:
                n *= mesh.size(m)
        if n == 1:
            return
        for name in self.head_args:
            spec = values.get(name)
            if _is_spec(spec) and spec.shape[1] % n:
                raise ShardingError(
                    f"fuse_plugin::{self.op}: argument {name!r} has {spec.shape[1]} heads sharded over {n} ranks: "
                    f"the q heads and the kv heads must both be divisible by the number of shards, so that each "
                    f"shard holds whole GQA groups")


    def _check_periodic(self, modes, values) -> None:
        """A window-periodic attn_bias / replace ((P, ...) with 1 < P < B: batch b reads row
        b % P, ops/attention.py) cannot follow a batch shard: a shard's rows are not its own
        batches' windows."""
        if self.frame is None or -self.frame not in modes:
            return
        B = values[self.lead].shape[0]
        for name in ("attn_bias", "replace"):
            spec = values.get(name)
            if _is_spec(spec) and spec.ndim == 4 and spec.shape[0] not in (1, B):
                raise ShardingError(
                    f"fuse_plugin::{self.op}: argument {name!r} is window-periodic ({spec.shape[0]} rows for "
                    f"a batch of {B}: batch b reads row b % {spec.shape[0]}), which a batch shard cannot "
                    f"follow; shard the heads instead, or replicate")


def _holds(spec, mode: int) -> bool:
    """Does a broadcast tensor have frame dim `mode` (negative, right-aligned) at full size?"""
    return spec.ndim >= -mode and spec.shape[mode] > 1


# ----------------------------------------------------------------------------- outputs


def _out(rule: _Rule, mode: Optional[int], like):
    """An output sharded like the frame's "main" tensor `like` (the same shape or, lse, its left part)."""
    _, Replicate, Shard, _ = _spec_types()
    if mode is None:
        return Replicate()
    return Shard((rule.frame if rule.frame is not None else like.ndim) + mode)


def _grad_of(mode: Optional[int], spec, needed: bool):
    """The gradient of a broadcast input: sharded like it, a Partial sum where it was replicated
    (each rank sums over its own shard of the dim it broadcasts over); empty ones replicated."""
    _, Replicate, Shard, Partial = _spec_types()
    if not needed or not _is_spec(spec) or mode is None:
        return Replicate()
    return Shard(spec.ndim + mode) if _holds(spec, mode) else Partial()


def _attention_outputs(rule, mode, v):
    return [_out(rule, mode, v["q"]), _out(rule, mode, v["q"])]  # out (B, Hq, Lq, Dv), lse (B, Hq, Lq)


def _attention_backward_outputs(rule, mode, v):
    bias = v.get("attn_bias")
    grads = [_out(rule, mode, v[n]) for n in ("q", "k", "v")]
    return grads + [_grad_of(mode, bias, bool(v.get("need_dbias", False)))]


def _sinks_backward_outputs(rule, mode, v):
    """dq, dk, dv, dbias and dsinks: with the heads Shard(0), over batch shards a Partial sum."""
    _, Replicate, Shard, Partial = _spec_types()
    dsinks = Replicate() if mode is None else Shard(0) if mode == 1 - rule.frame else Partial()
    return _attention_backward_outputs(rule, mode, v) + [dsinks]


def _rope_attention_backward_outputs(rule, mode, v):
    tables = bool(v.get("need_dtables", False))
    return _attention_backward_outputs(rule, mode, v) + [_grad_of(mode, v["cos"], tables),
                                                        _grad_of(mode, v["sin"], tables)]


def _like(*names):
    """Outputs shaped like the named inputs (the rotated tensors; the gluon backward's grads)."""
    return lambda rule, mode, v: [_out(rule, mode, v[n]) for n in names]


# ----------------------------------------------------------------------------- the ops


def _arg_names(op) -> list[str]:
    return [a.name for a in op._schema.arguments]


def _rules() -> dict[str, _Rule]:
    attn = dict(q="main", k="main", v="main", attn_bias="bcast", dropout_seed="scalar", replace="bcast")
    rope = dict(attn, cos="bcast", sin="bcast")
    docs = dict(attn, documents="rows")  # (attention and its backward only)
    bwd = dict(dout="main", out="main", lse="main")
    qkv = ("q", "k", "v")
    rot = dict(cos="bcast", sin="bcast")
    specs = {  # name: (roles, lead, outputs, frame, head args, dropout arg)
        "attention": (docs, "q", _attention_outputs, 4, qkv, "dropout_p"),
        "attention_backward": (dict(docs, **bwd), "q", _attention_backward_outputs, 4, qkv, "dropout_p"),
        "attention_sinks": (dict(attn, sinks="heads"), "q", _attention_outputs, 4, qkv, "dropout_p"),
        "attention_sinks_backward": (dict(attn, sinks="heads", **bwd), "q", _sinks_backward_outputs, 4, qkv,
                                     "dropout_p"),
        "rope_attention": (rope, "q", _attention_outputs, 4, qkv, "dropout_p"),
        "rope_attention_backward": (dict(rope, **bwd), "q", _rope_attention_backward_outputs, 4, qkv, "dropout_p"),
        "gluon_attention_forward": (dict(q="main", k="main", v="main"), "q", _attention_outputs, 4, qkv, None),
        "gluon_attention_backward": (dict(bwd, q="main", k="main", v="main"), "q", _like(*qkv), 4, qkv, None),
        # the ring (ops/context_parallel.py) runs over each rank's local sequence shards with its own
        # group: on DTensors replicated, batch- or head-sharded (a CP group beside TP), not Shard(2)
        "ring_attention": (dict(q="main", k="main", v="main"), "q", _attention_outputs, 4, qkv, None),
        "ring_attention_backward": (dict(bwd, q="main", k="main", v="main"), "q", _like(*qkv), 4, qkv, None),
        "rotary": (dict(rot, x="main"), "x", _like("x"), None, (), None),
        "rotary_backward": (dict(rot, grad="main"), "grad", _like("grad"), None, (), None),
        "rotary_qk": (dict(rot, q="main", k="main"), "q", _like("q", "k"), None, (), None),
        "rotary_qk_backward": (dict(rot, grad_q="main", grad_k="main"), "grad_q", _like("grad_q", "grad_k"),
                               None, (), None),
    }
    return {name: _Rule(name, _arg_names(_op(name)), *spec) for name, spec in specs.items()}


def _replicated_only(name: str, outputs: int):
    """A rule for an op that runs on Replicate() inputs only (table_gather: the rewrite never puts
    it on DTensors; a user's call on shards gets this error, not a redistribution)."""

    def rule(*args, **kwargs):
        _, Replicate, _, _ = _spec_types()
        specs = [(i, a) for i, a in enumerate(args) if _is_spec(a)]
        for i, spec in specs:
            for m, p in enumerate(spec.placements):
                if not _is_replicate(p):
                    raise ShardingError(f"fuse_plugin::{name}: argument {i} has placement {p!r} on mesh dim {m}; "
                                        f"the op runs on Replicate() inputs only. Redistribute the inputs "
                                        f"explicitly (DTensor.redistribute)")
        return [([Replicate()] * outputs, [Replicate() if _is_spec(a) else None for a in args])]

    return rule


_REPLICATED_ONLY = {"table_gather": 1, "table_gather_backward": 1}


def _op(name: str):
    return getattr(torch.ops.fuse_plugin, name).default


def _schema_info(op):
    """Every argument from the first non-tensor one on goes into DTensor's sharding cache key."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    args = op._schema.arguments
    first = next((i for i, a in enumerate(args) if not _is_tensor_type(a.type)), len(args))
    kwargs = [a.name for a in args if a.kwarg_only and not _is_tensor_type(a.type)]
    return RuntimeSchemaInfo(static_argnum=first, static_kwargkey=kwargs or None, needs_pytree=True)


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def register() -> None:
    """Register every rule with DTensor (idempotent). No-op without torch.distributed."""
    if _REGISTERED or not torch.distributed.is_available():
        return
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # pragma: no cover - a torch build without DTensor
        return
    from . import context_parallel  # noqa: F401  (defines the ring's ops, which have rules here)

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, rule in _rules().items():
        op = _op(name)
        register_sharding(op)(rule)
        if hasattr(propagator, "op_to_schema_info"):
            propagator.op_to_schema_info[op] = _schema_info(op)
        _REGISTERED.append(f"fuse_plugin::{name}")
    for name, outputs in _REPLICATED_ONLY.items():
        op = _op(name)
        register_sharding(op)(_replicated_only(name, outputs))
        if hasattr(propagator, "op_to_schema_info"):
            propagator.op_to_schema_info[op] = _schema_info(op)
        _REGISTERED.append(f"fuse_plugin::{name}")
    from .context_parallel import register as register_ring

    register_ring()  # Shard(2) q/k/v of attention and its backward: ring attention
