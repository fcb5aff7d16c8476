"""One rank of tests/test_context_parallel.py's compiled scenarios: a compiled model under PyTorch's
`context_parallel(...)` runs our op through the ring (fuse_plugin/ops/context_parallel.py, `route`).

    python tests/cp_compile_worker.py RANK WORLD_SIZE STORE_FILE OUT_DIR

Joins a gloo group of WORLD_SIZE CPU processes, runs every scenario and writes
OUT_DIR/rank{RANK}.json (tests/dist_harness.py). The scenarios only measure; the test file asserts.

The model: a tiny HF LlamaForCausalLM (2 layers, GQA 4/2 heads, head dim 16, fp32) on HF's eager
attention, which the plugin's rewrite turns into one `fuse_plugin::attention` call per layer
(is_causal, the mask proven causal). Its weights are scaled 5x from HF's init so that attention is
far from uniform and an attention over the wrong keys moves the loss (the control scenario shows by
how much). The reference is the same model run eagerly in one process on the whole batch.

Compiled with `compile_model` below: the rewrite, then `route` (what fuse_plugin's backend is to
call after its rewrite), then AOTAutograd with eager kernels ("rewrite_aot_eager"; no C++ compile,
a few seconds), recording the forward and backward graphs AOTAutograd produced. The scenario
"llama_inductor" compiles with the real backend instead, as a user does: torch.compile(model,
backend="fuse_plugin"), whose rewrite routes by itself (Inductor, C++ on the CPU: ~20 s cold).
"""
from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import error_of as _error_of, rel_err, run_scenarios

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for fuse_plugin

import fuse_plugin  # noqa: E402,F401
from fuse_plugin.ops import context_parallel as cp  # noqa: E402
from fuse_plugin.ops.ring_attention import shard_positions, shard_sequence  # noqa: E402

B, L, VOCAB, LAYERS = 2, 32, 128, 2
WINDOW = 5  # tiny Mistral's (chunks of L / 2W = 8 tokens at 2 ranks: it cuts adjacent chunks, hides farther ones)
IGNORE = -100
RING_FWD, RING_BWD = "fuse_plugin.ring_attention.default", "fuse_plugin.ring_attention_backward.default"


def tiny_llama(window=None):
    """A tiny HF Llama (eager attention), or with `window` a tiny Mistral with that sliding window;
    weights 5x HF's init (attention far from uniform)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = transformers.LlamaConfig(**common) if window is None else \
        transformers.MistralConfig(**common, sliding_window=window)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)
    return model


def batch(length=L):
    """ids, labels (the next token; IGNORE at the last position, so that each rank's loss reads only
    its own logits once sharded) and positions, full length."""
    ids = torch.randint(0, VOCAB, (B, length), generator=torch.Generator().manual_seed(1))
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels, torch.arange(length).repeat(B, 1)


def loss_of(logits, labels, count):
    """Sum of the tokens' cross-entropy over the GLOBAL count of predicted tokens: summed over the
    ranks, the loss (and the gradients) of the whole batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum") / count


class Compiles:
    """A rewrite_aot_eager backend (route on or off) that records what it compiled."""

    def __init__(self, routed=True):
        self.routed, self.calls, self.fw, self.bw = routed, [], [], []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        from fuse_plugin.patterns import rewrite

        rewrite(gm)
        self.calls.append(cp.route(gm) if self.routed else None)

        def keep(into):
            def compiler(g, _):
                into.append([str(n.target) for n in g.graph.nodes if n.op == "call_function"])
                return make_boxed_func(g.forward)
            return compiler

        return aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw))(gm, example_inputs)


def context(mesh, *buffers):
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh, buffers=list(buffers), buffer_seq_dims=[1] * len(buffers))


def reference(model, ids, labels, positions):
    """The single-process run: loss and {name: grad}."""
    ref = copy.deepcopy(model)
    loss = loss_of(ref(input_ids=ids, position_ids=positions).logits, labels, labels.ne(IGNORE).sum())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def cp_train_step(ctx, fn, model):
    """The compiled model under context_parallel(mesh, buffers=[ids, labels, positions]): loss of this
    rank's tokens, backward, gradients summed over the ranks. Returns facts against the reference."""
    from torch._dynamo.utils import counters

    mesh, ws, rank = ctx["mesh"], ctx["ws"], ctx["rank"]
    ids, labels, positions = batch()
    ref_loss, ref_grads = reference(model, ids, labels, positions)
    count = labels.ne(IGNORE).sum()
    for key in ("fuse_plugin", "graph_break", "stats"):
        counters[key].clear()
    t0 = time.perf_counter()
    with context(mesh, ids, labels, positions):
        layout_ok = torch.equal(positions[0], shard_positions(L // ws, rank, ws))  # PyTorch's head-tail order
        state = cp.torch_context_parallel()
        loss = loss_of(fn(input_ids=ids, position_ids=positions).logits, labels, count)
        loss.backward()
    seconds = time.perf_counter() - t0
    total = loss.detach().clone()
    dist.all_reduce(total)
    grad_errs, missing = {}, []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_errs[name] = rel_err(g, ref_grads[name])
    return {"loss": total.item(), "ref_loss": ref_loss.item(), "loss_rel_err": abs(total.item() - ref_loss.item())
            / abs(ref_loss.item()), "grad_rel_errs": grad_errs, "missing_grads": missing,
            "n_params": len(list(model.parameters())),
            "ref_grad_norms_min": min(g.norm().item() for g in ref_grads.values()),
            "layout_is_head_tail": layout_ok, "state": None if state is None else
            {"group": state.group_name, "load_balanced": state.load_balanced},
            "routed_counter": counters["fuse_plugin"]["ring_attention"],
            "graph_breaks": sum(counters["graph_break"].values()), "seconds": seconds}


def scenario_llama(ctx):
    """The compiled tiny Llama under context_parallel equals the single-process run (rewrite_aot_eager)."""
    torch._dynamo.reset()
    model = tiny_llama()
    backend = Compiles()
    facts = cp_train_step(ctx, torch.compile(model, backend=backend), model)
    facts.update(routed=backend.calls, compiles=len(backend.calls),
                 fw_ring=[sum(t == RING_FWD for t in g) for g in backend.fw],
                 bw_ring=[sum(t == RING_BWD for t in g) for g in backend.bw],
                 plain_attention_left=sum("fuse_plugin.attention" in t for g in backend.fw + backend.bw for t in g))
    return facts


def scenario_mistral_window(ctx):
    """A compiled tiny HF Mistral (sliding window 5, eager attention: the rewrite passes the window)
    under context_parallel equals the single-process run: the ring computes the window over the
    global positions, skipping the chunks it hides."""
    torch._dynamo.reset()
    model = tiny_llama(window=WINDOW)
    backend = Compiles()
    facts = cp_train_step(ctx, torch.compile(model, backend=backend), model)
    facts.update(fw_ring=[sum(t == RING_FWD for t in g) for g in backend.fw])
    return facts


def scenario_llama_inductor(ctx):
    """The same with the real backend, Inductor, as a user writes it: backend="fuse_plugin" (the
    backend routes right after its rewrite, backend.py; no option needed)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_llama()
    fn = torch.compile(model, backend="fuse_plugin")
    facts = cp_train_step(ctx, fn, model)
    # then outside context_parallel, the same local shapes (L/W tokens): the guard recompiles, and the
    # caches (keyed on the routed graph) do not hand back the routed one
    # (grad mode on as inside, else Dynamo's grad-mode guard alone would recompile; forward only)
    ids, labels, positions = batch(L // ctx["ws"])
    with torch.no_grad():
        ref = loss_of(model(input_ids=ids, position_ids=positions).logits, labels, B * (L // ctx["ws"] - 1))
    got = loss_of(fn(input_ids=ids, position_ids=positions).logits, labels, B * (L // ctx["ws"] - 1))
    facts["outside_after"] = {"loss_rel_err": abs(got.item() - ref.item()) / abs(ref.item()),
                              "routed_counter": counters["fuse_plugin"]["ring_attention"]}
    return facts


def scenario_llama_autopatch(ctx):
    """The same with plain torch.compile(model) after `import fuse_plugin` (the automatic patch: the
    rewrite and the routing run in our pre-grad pass, which under context_parallel gives no cache
    key so that a cache hit cannot skip them, passes.FusePluginPass.uuid)."""
    torch._dynamo.reset()
    model = tiny_llama()
    return cp_train_step(ctx, torch.compile(model), model)


def scenario_control(ctx):
    """The same compile without `route` under context_parallel: each rank's attention sees its own
    shard only, as before this change; the loss must move (the parity test can see a wrong ring)."""
    torch._dynamo.reset()
    model = tiny_llama()
    backend = Compiles(routed=False)
    with torch.no_grad():
        facts = cp_forward_loss(ctx, torch.compile(model, backend=backend), model)
    facts["compiles"] = len(backend.calls)
    return facts


def cp_forward_loss(ctx, fn, model):
    """The compiled model's loss under context_parallel, forward only, against the one-process run."""
    ids, labels, positions = batch()
    ref_loss = loss_of(model(input_ids=ids, position_ids=positions).logits, labels, labels.ne(IGNORE).sum())
    with context(ctx["mesh"], ids, labels, positions):
        loss = loss_of(fn(input_ids=ids, position_ids=positions).logits, labels, (B * (L - 1)))
    dist.all_reduce(loss)
    return {"loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}


def scenario_guards(ctx):
    """A graph compiled in one state is not reused in the other, even where the shapes agree (the
    local length under CP = the length outside), and each state's graph is reused when it returns:
    inside, outside, inside, outside gives two compiles (routed, then not), every call right."""
    mesh, ws = ctx["mesh"], ctx["ws"]
    torch._dynamo.reset()
    model = tiny_llama()
    backend = Compiles()
    fn = torch.compile(model, backend=backend)
    order, errs = ["inside", "outside", "inside", "outside"], []
    with torch.no_grad():
        for where in order:
            if where == "inside":  # global L tokens, L/W a rank
                ids, labels, positions = batch(L)
                ref = loss_of(model(input_ids=ids, position_ids=positions).logits, labels, B * (L - 1))
                with context(mesh, ids, labels, positions):
                    loss = loss_of(fn(input_ids=ids, position_ids=positions).logits, labels, B * (L - 1))
                dist.all_reduce(loss)
            else:  # L/W tokens, the same local shapes, not distributed
                ids, labels, positions = batch(L // ws)
                ref = loss_of(model(input_ids=ids, position_ids=positions).logits, labels, B * (L // ws - 1))
                loss = loss_of(fn(input_ids=ids, position_ids=positions).logits, labels, B * (L // ws - 1))
            errs.append(abs(loss.item() - ref.item()) / abs(ref.item()))
    return {"order": order, "loss_rel_errs": errs, "routed": backend.calls}


def scenario_sdpa_site(ctx):
    """The choice for an SDPA call site while context_parallel is on: left as SDPA, for PyTorch's
    ring (measured faster than ours), before the site is looked at; off again, the usual choice.
    (Compiling one here is not possible: PyTorch's ring has no CPU SDPA kernel.)"""
    from fuse_plugin.patterns import choice

    dummy = torch.arange(2 * ctx["ws"]).repeat(1, 1)
    before = choice._context_parallel_on()
    with context(ctx["mesh"], dummy):
        on = choice._context_parallel_on()
        decision = choice.decide_sdpa(None)  # (the rule reads nothing of the site)
        mine = choice.decide(_NoSdpaSite())  # a hand-written site: our op, for the ring
    return {"before": before, "on": on, "after": choice._context_parallel_on(), "ours": decision.ours,
            "as_sdpa": decision.as_sdpa, "reason": decision.reason, "hand_written_ours": mine.ours,
            "hand_written_as_sdpa": mine.as_sdpa, "hand_written_reason": mine.reason}


class _NoSdpaSite:
    """A stand-in for a matched site: `choice.decide` takes the context-parallel rule before it
    reads anything of the site."""


def scenario_refusals(ctx):
    """Attention sites the ring does not take, compiled under context_parallel: the compile fails
    with a ContextParallelError naming the site and what it has (no local attention computed)."""
    mesh, ws = ctx["mesh"], ctx["ws"]
    ops = torch.ops.fuse_plugin
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g) for h in (4, 2, 2))
    bias = torch.randn(1, 1, 8, 8, generator=g)
    cases = {
        "bias": lambda: ops.attention(q, k, v, bias, 0.0, False, 0.25),
        "dropout": lambda: ops.attention(q, k, v, None, 0.1, True, 0.25, torch.tensor(7)),
        "cross-attention": lambda: ops.attention(q, k[:, :, :4], v[:, :, :4], None, 0.0, False, 0.25),
    }
    facts = {}
    dummy = torch.arange(2 * ws).repeat(1, 1)
    with context(mesh, dummy):
        for name, fn in cases.items():
            torch._dynamo.reset()
            facts[name] = _error_of(lambda: torch.compile(fn, backend=Compiles())())
        # a padding mask: HF turns it into a bias, which the ring does not take
        torch._dynamo.reset()
        model = tiny_llama()
        ids, _, positions = batch(L // ws)
        attention_mask = torch.ones_like(ids)
        attention_mask[0, :3] = 0
        with torch.no_grad():
            facts["hf padding mask"] = _error_of(lambda: torch.compile(model, backend=Compiles())(
                input_ids=ids, position_ids=positions, attention_mask=attention_mask))
    return facts


def scenario_dtensor_compiled(ctx):
    """fuse_plugin::attention compiled on q/k/v DTensors placed Shard(2): the DTensor handlers put
    the ring's opaque ops in the graph (AOTAutograd) and the call equals the single-process op,
    forward and backward; outside context parallelism in the contiguous order, under
    context_parallel(...) in its load-balanced one (from_local of load-balanced shards)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh, ws, rank = ctx["mesh"], ctx["ws"], ctx["rank"]
    g = torch.Generator().manual_seed(4)
    Lg = 16
    q, k, v = (torch.randn(1, h, Lg, 16, generator=g) for h in (4, 2, 2))
    dout = torch.randn(1, 4, Lg, 16, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = torch.ops.fuse_plugin.attention(*ref, None, 0.0, True, 0.25)
    ref_out.backward(dout)

    def attend(q, k, v):
        return torch.ops.fuse_plugin.attention(q, k, v, None, 0.0, True, 0.25)

    facts = {}
    for where in ("outside", "inside"):
        torch._dynamo.reset()
        graphs = Compiles(routed=False)
        fn = torch.compile(attend, backend=graphs)
        if where == "outside":
            mine = [distribute_tensor(t.clone(), mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
            out, _ = fn(*mine)
            out.backward(distribute_tensor(dout, mesh, [Shard(2)]))
            got = [out.full_tensor()] + [m.grad.full_tensor() for m in mine]
            want = [ref_out] + [r.grad for r in ref]
        else:
            shard = lambda t: shard_sequence(t, rank, ws, dim=2, load_balanced=True)  # noqa: E731
            with context(mesh, torch.arange(Lg).repeat(1, 1)):
                mine = [DTensor.from_local(shard(t), mesh, [Shard(2)], run_check=False).detach().requires_grad_()
                        for t in (q, k, v)]
                out, _ = fn(*mine)
                out.backward(DTensor.from_local(shard(dout), mesh, [Shard(2)], run_check=False))
            got = [out.to_local()] + [m.grad.to_local() for m in mine]
            want = [shard(ref_out)] + [shard(r.grad) for r in ref]
        facts[where] = {"rel_errs": [rel_err(a, b) for a, b in zip(got, want)],
                        "fw_ring": [sum(t == RING_FWD for t in gr) for gr in graphs.fw],
                        "bw_ring": [sum(t == RING_BWD for t in gr) for gr in graphs.bw]}
    return facts


def scenario_opcheck(ctx):
    """torch.library.opcheck of the ring's opaque ops over the 2 ranks (schema, fake implementation
    against the real one: shapes, strides, dtypes; autograd registration; AOT dispatch), GQA, the op's
    memory layout for q/k/v, causal load-balanced and not causal."""
    name = ctx["mesh"].get_group().group_name
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 8, h, 16, generator=g).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    facts = {}
    for causal, balanced in ((True, True), (False, False)):
        r = torch.library.opcheck(torch.ops.fuse_plugin.ring_attention.default, (q, k, v, causal, 0.25, name, balanced))
        facts[f"forward causal={causal} load_balanced={balanced}"] = r
    out, lse = torch.ops.fuse_plugin.ring_attention(q, k, v, True, 0.25, name, True)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, True, 0.25, name, True)
    facts["backward"] = torch.library.opcheck(torch.ops.fuse_plugin.ring_attention_backward.default, args)
    return facts


def main():
    rank, ws, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws)
    from torch.distributed.device_mesh import init_device_mesh

    ctx = {"rank": rank, "ws": ws, "mesh": init_device_mesh("cpu", (ws,))}
    scenarios = {"llama": scenario_llama, "control": scenario_control, "guards": scenario_guards,
                 "refusals": scenario_refusals, "sdpa_site": scenario_sdpa_site, "mistral_window": scenario_mistral_window, "dtensor_compiled": scenario_dtensor_compiled,
                 "opcheck": scenario_opcheck}
    if os.environ.get("FUSE_PLUGIN_CP_INDUCTOR", "1") != "0":
        scenarios["llama_inductor"] = scenario_llama_inductor
        scenarios["llama_autopatch"] = scenario_llama_autopatch
    run_scenarios(scenarios, ctx, rank, out_dir)


if __name__ == "__main__":
    main()
