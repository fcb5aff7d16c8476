"""One rank of tests/test_distributed.py: every distributed scenario in one process group.

    python tests/distributed_worker.py RANK WORLD_SIZE STORE_FILE OUT_DIR [SCENARIO ...]

Joins a gloo group of WORLD_SIZE CPU processes (a FileStore at STORE_FILE: no port to pick), runs
each scenario (all by default) and writes OUT_DIR/rank{RANK}.json: {scenario: {"facts": {...}}
or {"error": traceback}}. The scenarios only measure (losses, relative errors, fused-site counts,
the placements the sharding rules saw, error messages); tests/test_distributed.py makes the
assertions, one test per scenario. One spawn of the group for all scenarios: starting the
processes and importing torch costs more than most scenarios.

The models are tiny Llama-style decoders (embedding → RMSNorm → q/k/v → HF rotate_half RoPE → GQA
attention with an HF-style additive causal mask → o_proj → gated MLP), fp32, compiled with the
plugin's rewrite and then, by default, AOTAutograd with eager kernels (the graph Inductor would
get, in seconds); FUSE_PLUGIN_DIST_BACKEND=fuse_plugin compiles with the real backend (Inductor on
the CPU: about a minute more on 2 cores). The reference is the same model in eager, in one
process, on the whole global batch.
"""
from __future__ import annotations

import copy
import math
import os
import sys

import torch
import torch.distributed as dist
from dist_harness import run_scenarios
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for fuse_plugin

import fuse_plugin  # noqa: E402

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 64, 64, 4, 2, 2
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 12, 3, 0.1


# =============================================================================== the model


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n):
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, l, d).reshape(b, h * n, l, d)


class Attention(nn.Module):
    """q/k/v → RoPE → GQA attention (repeat_kv) with an additive mask → o_proj. Head counts are
    read as -1 from the projections, so the same code runs on local shards and on DTensors."""

    def __init__(self):
        super().__init__()
        self.d, self.rep = DIM // HEADS, HEADS // KV_HEADS
        self.q_proj = nn.Linear(DIM, HEADS * self.d, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * self.d, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * self.d, bias=False)
        self.o_proj = nn.Linear(HEADS * self.d, DIM, bias=False)

    def forward(self, x, cos, sin, mask):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, -1, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, l, -1, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, l, -1, self.d).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.rep), repeat_kv(v, self.rep)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d) + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, l, -1)
        return self.o_proj(o)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(DIM), RMSNorm(DIM)
        self.attn = Attention()
        self.gate, self.up = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank and in the reference
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        d = DIM // HEADS
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, ids):
        b, l = ids.shape
        x = self.embed(ids)
        pos = torch.arange(l, device=ids.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None].expand(b, -1, -1), emb.sin()[None].expand(b, -1, -1)
        keep = pos[None, :] <= pos[:, None]
        mask = torch.where(keep, 0.0, torch.finfo(x.dtype).min)[None, None].expand(b, 1, l, l)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.head(self.norm(x))


def loss_of(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=g)


def reference_run():
    """Eager, one process, the whole global batch: per-step losses, first-step grads, final params."""
    model = Llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for ids in global_batch():
        loss = loss_of(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(t):
    """A DTensor's full value (plain tensors as they are)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


REPORTS: list = []  # the rewrite's Report of every graph compiled since the last compile_plugin


def _recording_rewrite(gm):
    from fuse_plugin.patterns import rewrite

    report = rewrite(gm)
    REPORTS.append(report)
    return report


def _rewrite_aot_eager(gm, example_inputs):
    """Our rewrite, then AOTAutograd with eager kernels (as tests/helpers.rewrite_aot_eager)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    _recording_rewrite(gm)
    compiler = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)


def compile_plugin(model, backend):
    """torch.compile with the plugin. backend "fuse_plugin": the real one (our rewrite, then
    Inductor, C++ compiles on the CPU: about 10-25 s per model here); "rewrite_aot_eager": our
    rewrite, then AOTAutograd with the ops' autograd and eager kernels: the graph Inductor would
    get (DTensor subclasses traced through, the ops on local shards) in a few seconds."""
    import fuse_plugin.backend

    torch._dynamo.reset()
    counters().clear()
    REPORTS.clear()
    fuse_plugin.backend.rewrite = _recording_rewrite  # the same rewrite, its reports kept
    if backend == "rewrite_aot_eager":
        return torch.compile(model, backend=_rewrite_aot_eager)
    if backend != "fuse_plugin":
        raise ValueError(f"FUSE_PLUGIN_DIST_BACKEND must be 'fuse_plugin' or 'rewrite_aot_eager', got {backend!r}")
    return torch.compile(model, backend="fuse_plugin")


def counters():
    from torch._dynamo.utils import counters as c

    return c["fuse_plugin"]


def sites():
    """Fused sites summed over the compiled graphs, the graphs rewritten, and the near misses."""
    c = counters()
    out = {k: int(c[k]) for k in ("attention", "rotary", "rope_attention")}
    out["graphs"] = len(REPORTS)
    out["misses"] = [f"{m.kind}: {m.reason}" for r in REPORTS for m in r.misses]
    return out


def train(fn, params_of, batch_of, ws):
    """STEPS SGD steps of fn; the loss averaged over ranks (each rank's loss is the mean over its
    equal share of the global batch, so the average is the global-batch loss)."""
    losses, first_grads = [], None
    opt = torch.optim.SGD(params_of(), lr=LR)
    for ids in global_batch():
        local = batch_of(ids)
        loss = loss_of(fn(local), local)
        opt.zero_grad()
        loss.backward()
        if first_grads is None:
            first_grads = {n: full(p.grad).clone() for n, p in named(params_of)}
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / ws)
    return losses, first_grads


def named(params_of):
    return params_of.__self__.named_parameters() if hasattr(params_of, "__self__") else params_of()


def compare(losses, grads, params, ref):
    ref_losses, ref_grads, ref_params = ref
    facts = {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_rel_err": max(rel_err(full(p), ref_params[n]) for n, p in params.items()),
    }
    if grads is not None:
        facts["grad_rel_err"] = max(rel_err(g, ref_grads[n]) for n, g in grads.items())
    return facts


def clean_names(named_params):
    """Parameter names without the wrappers' prefixes (DDP's module., compile's _orig_mod.)."""
    out = {}
    for n, p in named_params:
        for prefix in ("_orig_mod.", "module."):
            n = n.replace(prefix, "")
        out[n] = p
    return out


# =============================================================================== scenarios


def scenario_ddp(ctx):
    """DDP over the batch, compiled with the plugin (rotary q/k and attention fused separately:
    the default)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["FUSE_PLUGIN_ROPE_ATTENTION"] = "0"
    model = Llama()
    fn = compile_plugin(DDP(model), ctx["backend"])
    rank, ws = ctx["rank"], ctx["ws"]
    per = GLOBAL_BATCH // ws
    losses, _ = train(fn, model.parameters, lambda ids: ids[rank * per:(rank + 1) * per], ws)
    facts = compare(losses, None, clean_names(model.named_parameters()), ctx["ref"])
    facts["sites"], facts["backend"] = sites(), ctx["backend"]
    return facts


def scenario_fsdp2(ctx):
    """FSDP2: fully_shard on each block and on the root, then torch.compile with the plugin (the
    rope folded into attention: rope_attention)."""
    from torch.distributed.fsdp import fully_shard

    os.environ["FUSE_PLUGIN_ROPE_ATTENTION"] = "1"
    model = Llama()
    for block in model.layers:
        fully_shard(block, mesh=ctx["mesh"])
    fully_shard(model, mesh=ctx["mesh"])
    fn = compile_plugin(model, ctx["backend"])
    rank, ws = ctx["rank"], ctx["ws"]
    per = GLOBAL_BATCH // ws
    losses, _ = train(fn, model.parameters, lambda ids: ids[rank * per:(rank + 1) * per], ws)
    facts = compare(losses, None, clean_names(model.named_parameters()), ctx["ref"])
    facts["sites"], facts["backend"] = sites(), ctx["backend"]
    facts["param_placements"] = sorted({str(p.placements) for p in model.parameters()})
    return facts


class RuleLog:
    """Records the placements each fuse_plugin op's sharding rule is called with (DTensor in)
    and what it returns (DTensor out)."""

    def __init__(self):
        from torch.distributed.tensor import DTensor

        self.prop = DTensor._op_dispatcher.sharding_propagator
        self.saved = {}
        self.calls = []

    def __enter__(self):
        for op, fn in list(self.prop.op_strategy_funcs.items()):
            if op.namespace == "fuse_plugin":
                self.saved[op] = fn
                self.prop.op_strategy_funcs[op] = self._wrap(op, fn)
        return self

    def _wrap(self, op, fn):
        def logged(schema):
            strategy = fn(schema)
            first = strategy.strategies[0]
            outs = first.output_specs if isinstance(first.output_specs, tuple) else (first.output_specs,)
            ins = [s.strategies[0].output_spec for s in schema.args_strategy]  # the inputs' specs
            self.calls.append({
                "op": op.name(),
                "in": [str(s.placements) for s in ins],
                "out": [str(s.placements) if s is not None else None for s in outs],
                "shape0": list(ins[0].shape),
            })
            return strategy

        return logged

    def __exit__(self, *exc):
        self.prop.op_strategy_funcs.update(self.saved)
        _clear_sharding_cache()


def _clear_sharding_cache():
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    for attr in ("propagate_op_sharding",):
        fn = getattr(prop, attr, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def tp_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {
        # cos, sin and the mask enter the attention as replicated DTensors (x stays plain: the
        # column-parallel projections take it as replicated)
        "attn": PrepareModuleInput(input_layouts=(None, Replicate(), Replicate(), Replicate()),
                                   desired_input_layouts=(None, Replicate(), Replicate(), Replicate()),
                                   use_local_output=False),
        # q/k/v sharded by output column = by head: DTensors Shard(-1), then Shard(1) as (B, H, L, D)
        "attn.q_proj": ColwiseParallel(use_local_output=False),
        "attn.k_proj": ColwiseParallel(use_local_output=False),
        "attn.v_proj": ColwiseParallel(use_local_output=False),
        "attn.o_proj": RowwiseParallel(),
    }


def scenario_tp(ctx):
    """Tensor parallelism: q/k/v column-parallel, o row-parallel (heads sharded 2 ways), compiled
    with the plugin; the whole global batch on every rank."""
    from torch.distributed.tensor.parallel import parallelize_module

    os.environ["FUSE_PLUGIN_ROPE_ATTENTION"] = "1"
    model = Llama()
    for block in model.layers:
        parallelize_module(block, ctx["mesh"], tp_plan())
    fn = compile_plugin(model, ctx["backend"])
    with RuleLog() as log:
        losses, grads = train(fn, model.parameters, lambda ids: ids, ctx["ws"])
    facts = compare(losses, grads, clean_names(model.named_parameters()), ctx["ref"])
    facts["sites"], facts["backend"] = sites(), ctx["backend"]
    facts["rule_calls"] = log.calls
    return facts


def scenario_hf_tp_eager(ctx):
    """The register_hf() path, not compiled: an HF Llama with attn_implementation="fuse_plugin",
    its attention projections tensor-parallel (q/k/v column-parallel as DTensors, o row-parallel),
    run under implicit_replication (HF's cos/sin are plain tensors); logits and gradients against
    the same model with eager attention in one process."""
    import transformers
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fuse_plugin.register_hf()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fuse_plugin")
    ours.load_state_dict(ref.state_dict())
    plan = {"self_attn.q_proj": ColwiseParallel(use_local_output=False),
            "self_attn.k_proj": ColwiseParallel(use_local_output=False),
            "self_attn.v_proj": ColwiseParallel(use_local_output=False),
            "self_attn.o_proj": RowwiseParallel()}
    for layer in ours.model.layers:
        parallelize_module(layer, ctx["mesh"], plan)
    ids = global_batch()[0]
    with RuleLog() as log, implicit_replication():
        logits = ours(ids, use_cache=False).logits
        loss_of(logits, ids).backward()
    expected = ref(ids, use_cache=False).logits
    loss_of(expected, ids).backward()
    grads = {n: rel_err(full(p.grad), q.grad) for (n, p), (_, q) in zip(ours.named_parameters(),
                                                                     ref.named_parameters())}
    return {"logits_rel_err": rel_err(logits, expected), "grad_rel_err": max(grads.values()),
            "rule_calls": log.calls}


def _dt(t, mesh, placement, grad=False):
    from torch.distributed.tensor import distribute_tensor

    out = distribute_tensor(t.detach().clone(), mesh, [placement])
    return out.requires_grad_(grad)


def scenario_eager_ops(ctx):
    """Each op called eagerly on DTensors (forward and backward) against the op on the full tensors."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = ctx["mesh"]
    ops = torch.ops.fuse_plugin
    B, Hq, Hkv, L, D = 2, 4, 2, 8, 16
    g = torch.Generator().manual_seed(2)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = rnd(B, Hq, L, D), rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
    bias = rnd(B, 1, L, L)  # per batch row, broadcast over heads: Shard(0) or Replicate as the rule says
    cos, sin = rnd(1, 1, L, D), rnd(1, 1, L, D)
    cases = {}

    def check(name, fn, inputs, placements):
        """fn(*inputs) on full tensors vs on DTensors placed as given; the outputs' sum of squares
        is backpropagated, so every differentiable input's gradient is compared."""
        ref_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        ref_out = fn(*ref_in)
        ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
        sum(o.float().square().sum() for o in ref_out if o.is_floating_point()).backward()
        dt_in = [_dt(t, mesh, p, t.is_floating_point()) for t, p in zip(inputs, placements)]
        out = fn(*dt_in)
        out = out if isinstance(out, tuple) else (out,)
        sum(o.float().square().sum() for o in out if o.is_floating_point()).backward()
        cases[name] = {
            "out_placements": [str(o.placements) for o in out],
            "out_rel_err": max(rel_err(full(o), r) for o, r in zip(out, ref_out)),
            "grad_rel_err": max(rel_err(full(d.grad), r.grad) for d, r in zip(dt_in, ref_in)),
            "grad_placements": [str(d.grad.placements) for d in dt_in],
        }

    attn = lambda q, k, v, b: ops.attention(q, k, v, b, 0.0, False, D ** -0.5)  # noqa: E731
    causal = lambda q, k, v: ops.attention(q, k, v, None, 0.0, True, D ** -0.5)  # noqa: E731
    check("attention heads GQA causal", causal, [q, k, v], [Shard(1)] * 3)
    check("attention heads, bias broadcast over heads (dbias Partial)", attn, [q, k, v, bias],
          [Shard(1)] * 3 + [Replicate()])
    check("attention batch, per-row bias", attn, [q, k, v, bias], [Shard(0)] * 4)
    check("attention replicated", attn, [q, k, v, bias], [Replicate()] * 4)
    sinks = rnd(Hq)
    sink_op = lambda q, k, v, b, s: ops.attention_sinks(q, k, v, b, 0.0, True, D ** -0.5, s)  # noqa: E731
    check("attention_sinks heads (sinks with them)", sink_op, [q, k, v, bias, sinks],
          [Shard(1)] * 3 + [Replicate(), Shard(0)])
    check("attention_sinks batch (dsinks Partial)", sink_op, [q, k, v, bias, sinks], [Shard(0)] * 4 + [Replicate()])
    rope = lambda q, k, v, c, s: ops.rope_attention(q, k, v, c, s, False, D, None, 0.0, True, D ** -0.5)  # noqa: E731
    check("rope_attention heads, learned tables (dcos Partial)", rope, [q, k, v, cos, sin],
          [Shard(1)] * 3 + [Replicate()] * 2)
    check("rope_attention batch", rope, [q, k, v, cos, sin], [Shard(0)] * 3 + [Replicate()] * 2)
    cos_l, sin_l = rnd(1, 1, L, D), rnd(1, 1, L, D)
    rot = lambda x, c, s: ops.rotary(x, c, s, False, D)  # noqa: E731
    check("rotary sequence, tables sharded alike", rot, [q, cos_l, sin_l], [Shard(2)] * 3)
    check("rotary sequence, replicated tables sliced locally", rot, [q, cos_l, sin_l],
          [Shard(2), Replicate(), Replicate()])
    check("rotary batch", rot, [q, cos_l, sin_l], [Shard(0), Replicate(), Replicate()])
    check("rotary_qk heads", lambda q, k, c, s: ops.rotary_qk(q, k, c, s, True, D), [q, k, cos_l, sin_l],
          [Shard(1), Shard(1), Replicate(), Replicate()])
    check("rotary_qk sequence", lambda q, k, c, s: ops.rotary_qk(q, k, c, s, False, D), [q, k, cos_l, sin_l],
          [Shard(2)] * 4)
    return cases


def scenario_errors(ctx):
    """Placements an op cannot take: each must raise, naming the op, the argument and the placement
    (recorded here; the test checks the messages)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = ctx["mesh"]
    ops = torch.ops.fuse_plugin
    B, L, D = 2, 8, 16
    q, k = torch.randn(B, 4, L, D), torch.randn(B, 2, L, D)
    cos = torch.randn(1, 1, L, D)
    out = {}

    def expect_error(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            out[name] = {"raised": type(e).__name__, "message": str(e)}
        else:
            out[name] = {"raised": None, "message": ""}

    def dt(t, p):
        return _dt(t, mesh, p)

    # (q, k and v all sequence-sharded run ring attention: tests/test_context_parallel.py)
    expect_error("attention q sequence-sharded", lambda: ops.attention(
        dt(q, Shard(2)), dt(k, Replicate()), dt(k, Replicate()), None, 0.0, True, 0.25))
    expect_error("attention k batch while q heads", lambda: ops.attention(
        dt(q, Shard(1)), dt(k, Shard(0)), dt(k, Shard(1)), None, 0.0, True, 0.25))
    expect_error("rotary x replicated, tables sharded (a gather)", lambda: ops.rotary(
        dt(q, Replicate()), dt(cos, Shard(2)), dt(cos, Shard(2)), False, D))
    partial_q = DTensor.from_local(q, mesh, [Partial()], run_check=False)
    expect_error("attention q Partial", lambda: ops.attention(
        partial_q, dt(k, Replicate()), dt(k, Replicate()), None, 0.0, True, 0.25))
    expect_error("attention kv heads not divisible", lambda: ops.attention(
        dt(torch.randn(B, 6, L, D), Shard(1)), dt(torch.randn(B, 3, L, D), Shard(1)),
        dt(torch.randn(B, 3, L, D), Shard(1)), None, 0.0, True, 0.25))
    seed = torch.tensor(7, dtype=torch.int64)
    expect_error("attention dropout on shards", lambda: ops.attention(
        dt(q, Shard(1)), dt(k, Shard(1)), dt(k, Shard(1)), None, 0.1, True, 0.25, seed))
    expect_error("attention bias sharded on its query dim", lambda: ops.attention(
        dt(q, Shard(1)), dt(k, Shard(1)), dt(k, Shard(1)), dt(torch.randn(B, 1, L, L), Shard(2)), 0.0, False, 0.25))
    expect_error("rotary channel dim sharded", lambda: ops.rotary(
        dt(q, Shard(3)), dt(cos, Replicate()), dt(cos, Replicate()), False, D))
    expect_error("rotary tables sharded on another dim", lambda: ops.rotary(
        dt(q, Shard(0)), dt(cos, Shard(2)), dt(cos, Shard(2)), False, D))
    expect_error("rotary_qk q and k on different dims", lambda: ops.rotary_qk(
        dt(q, Shard(1)), dt(k, Shard(2)), dt(cos, Replicate()), dt(cos, Replicate()), False, D))
    # the same placements that raised are fine once redistributed by hand (the error says how)
    ok = ops.attention(dt(q, Shard(2)).redistribute(mesh, [Shard(1)]), dt(k, Shard(1)), dt(k, Shard(1)),
                       None, 0.0, True, 0.25)[0]
    out["explicit redistribute works"] = {"placements": str(ok.placements),
                                          "rel_err": rel_err(ok.full_tensor(),
                                                             ops.attention(q, k, k, None, 0.0, True, 0.25)[0])}
    return out


SCENARIOS = {"eager_ops": scenario_eager_ops, "errors": scenario_errors, "hf_tp_eager": scenario_hf_tp_eager,
             "ddp": scenario_ddp, "fsdp2": scenario_fsdp2, "tp": scenario_tp}


def main():
    rank, ws, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    names = sys.argv[5:] or list(SCENARIOS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws)
    from torch.distributed.device_mesh import init_device_mesh

    ctx = {"rank": rank, "ws": ws, "mesh": init_device_mesh("cpu", (ws,)), "ref": reference_run(),
           "backend": os.environ.get("FUSE_PLUGIN_DIST_BACKEND", "rewrite_aot_eager")}
    run_scenarios({name: SCENARIOS[name] for name in names}, ctx, rank, out_dir)


if __name__ == "__main__":
    main()
