"""The kernel-family registry and the measured choice (kernels/registry.py, kernels/choice_table.py,
patterns/choice.py), on the CPU: each family's reasons, forcing a family, a choice read from a
table, sites left to Inductor (with eager's numbers, inference and training), the explain lines,
and the window-periodic bias the choice serves Swin with."""
import json

import pytest
import torch
from helpers import DEVICE, check_close
from torch._dynamo.utils import counters

import fuse_plugin
from fuse_plugin.kernels import attention as K
from fuse_plugin.kernels import choice_table, registry
from fuse_plugin.kernels.call import AttentionCall
from fuse_plugin.patterns import choice


def _call(Lq=64, Lk=64, D=32, bias=None, direction="fwd", dtype=torch.bfloat16, **kw):
    q = torch.randn(2, 4, Lq, D, dtype=dtype)
    k = torch.randn(2, 2, Lk, D, dtype=dtype)
    if direction == "fwd":
        return AttentionCall.forward(q, k, k, bias, is_causal=False, scale=0.2, **kw)
    out = torch.zeros_like(q)
    return AttentionCall.backward(out, q, k, k, bias, out, torch.zeros(2, 4, Lq), is_causal=False,
                                  scale=0.2, need_dbias=False, deterministic=False, **kw)


def test_each_family_says_why_it_cannot_run_a_problem():
    reasons = registry.reasons(_call())
    assert reasons["cudnn"] == "not on CUDA"
    assert reasons["decode"].startswith("Lq 64 > 16 or Lk 64 < 256")
    assert reasons["small"] is None and reasons["general"] is None
    long = registry.reasons(_call(Lq=200, Lk=300))
    assert long["small"] == "Lq 200 > 128" or "128" in long["small"]
    biased = registry.reasons(_call(bias=torch.zeros(2, 4, 64, 64)))
    assert biased["tma"] == "it takes no bias, dropout, softcap, replace mask or rope"
    bwd = registry.reasons(_call(direction="bwd"))
    assert set(bwd) == {"cudnn", "small", "efficient", "gluon", "tma", "tma_pair", "two_kernel", "general"}
    assert reasons["efficient"] == "not on CUDA"


def test_an_inference_forward_reads_the_times_without_the_lse(monkeypatch):
    """A class's "infer" times (the forward without the logsumexp) count for an inference call
    (need_lse=False) where faster, for the registry and the rewrite alike; a family skips the lse
    only where its class measured that faster (choice_table.lse_free)."""
    times = {"fwd": {"cudnn": 24.0, "general": 23.0, "efficient": 30.0}, "bwd": {"general": 90.0},
             "infer": {"cudnn": 22.0, "efficient": 31.0}, "sdpa": {"fwd": 22.5, "train": 118.0}}
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: times)
    assert choice_table.infer_times(times) == {"cudnn": 22.0, "general": 23.0, "efficient": 30.0}
    infer, train = _call(need_lse=False), _call()
    assert choice_table.measured(infer) == {"cudnn": 22.0, "general": 23.0, "efficient": 30.0}
    assert choice_table.measured(train) == times["fwd"]
    assert choice_table.lse_free(infer, "cudnn") and not choice_table.lse_free(train, "cudnn")
    assert not choice_table.lse_free(infer, "efficient")  # (measured slower without)
    assert not choice_table.lse_free(infer, "general")  # (not measured without)
    # the rewrite: an inference site weighs our op at 22.0 (cuDNN without the lse) against SDPA's 22.5
    d = choice.decide_from(times, "fwd", "k", sdpa_ok=True)
    assert d.ours and "cudnn 22.0 vs 22.5" in d.reason
    assert choice.ours_time(times, "train") == (23.0 + 90.0, "general + general")
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: None)
    assert choice_table.measured(infer) is None and not choice_table.lse_free(infer, "cudnn")


def test_rules_leave_the_small_family_to_measurements():
    """Where nothing is measured, the small family is not taken by a rule (it declines)."""
    family, _, why = registry.choose(_call())
    assert family.name == "general" and why == registry.FAMILIES["fwd"]["general"].rule


def test_a_forced_family_runs_or_one_error_lists_every_reason(monkeypatch):
    with registry.forced("small"):
        assert registry.choose(_call())[0].name == "small"
    with registry.forced("decode"), pytest.raises(registry.FamilyError) as e:
        registry.choose(_call())
    text = str(e.value)
    assert "'decode' kernel family cannot run this problem (fwd B 2, H 4/2, Lq 64, Lk 64, D 32" in text
    for name in registry.FAMILIES["fwd"]:
        assert f"\n  {name}: " in text
    monkeypatch.setenv("FUSE_PLUGIN_ATTENTION_FAMILY", "small")
    assert registry.choose(_call())[0].name == "small"
    monkeypatch.setenv("FUSE_PLUGIN_ATTENTION_FAMILY", "fastest")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_ATTENTION_FAMILY='fastest' names no"):
        registry.choose(_call())
    with pytest.raises(ValueError, match="unknown attention kernel family"):
        registry.forced("fastest").__enter__()


def _table(tmp_path, entries: dict) -> str:
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"format": choice_table.FORMAT, "gpus": {"Some GPU": {"entries": entries}}}))
    return str(path)


def test_a_choice_read_from_the_table(tmp_path, monkeypatch):
    key = choice_table.class_key(torch.bfloat16, 32, 32, 64, 64, "none", False, False)
    assert key == "bf16|d32|dv32|q64|k64|none|full|nodrop"
    entry = {"fwd": {"small": 10.0, "general": 30.0}, "bwd": {"small": 50.0, "general": 40.0},
             "inductor": {"fwd": 20.0, "train": 45.0}, "small": {"fwd": [4, 4, 2]}}
    monkeypatch.setenv(choice_table.ENV, _table(tmp_path, {key: entry}))
    choice_table.clear_cache()
    try:
        times = choice_table.lookup(torch.device("cuda"), key)  # (no GPU needed to read a table)
        assert times["fwd"] == {"small": 10.0, "general": 30.0} and times["inductor"]["train"] == 45.0
        assert choice_table.lookup(torch.device("cpu"), key) is None  # measured on a GPU only
        monkeypatch.setattr(choice_table, "lookup", lambda device, k: times if k == key else None)
        family, cfg, why = registry.choose(_call())
        assert family.name == "small" and tuple(cfg) == (4, 4, 2)
        assert why == "measured: small 10.0 us, 3.00x faster than general (30.0 us)"
        family, _, why = registry.choose(_call(direction="bwd"))
        assert family.name == "general" and why.startswith("measured: general 40.0 us")
        # the rewrite's view: inference takes ours (10 vs 20), training Inductor (45 vs 10 + 40)
        assert choice.decide_from(times, "fwd", key).ours
        left = choice.decide_from(times, "train", key)
        assert not left.ours
        assert left.reason.startswith("left to Inductor: measured 1.11x faster (45.0 vs 50.0 us for "
                                      "small + general; train, bf16|d32")
        assert choice.decide_from(None, "train", key).ours  # not measured: ours
    finally:
        choice_table.clear_cache()


def test_a_compiled_graph_issued_by_the_host_weighs_each_family_by_its_host_time(monkeypatch):
    """Traced into a graph without CUDA graphs, a family's cost is the longer of its measured
    device time and its host time (choice_table.HOST_US): a family faster on the GPU but slower to
    issue loses where the host's time is the larger; eager calls and CUDA graphs (no host issue
    per call) keep the device times; the explain line says which time counted."""
    from torch._inductor import config

    from fuse_plugin.kernels.launch import tracing

    times = {"fwd": {"small": 30.0, "general": 20.0}}
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: times)
    monkeypatch.setattr(choice_table, "HOST_US", {"fwd": {"small": 10.0, "general": 50.0}})
    assert registry.choose(_call())[0].name == "general"  # eager: the GPU's times
    with tracing():
        family, _, why = registry.choose(_call())
        assert family.name == "small"
        assert why == "measured: small 30.0 us, 1.67x faster than general (50.0 us (host; 20.0 on the GPU))"
        with config.patch({"triton.cudagraphs": True}):
            assert registry.choose(_call())[0].name == "general"  # replayed: no host issue per call


def test_host_times_break_ties_by_the_gpu_and_assume_the_worst_where_unmeasured():
    costs = choice_table.host_bound_costs({"small": 3.7, "general": 8.0, "tma": 9.0, "cudnn": 5.0}, "fwd")
    host = choice_table.HOST_US["fwd"]
    assert costs["small"] == costs["general"] == host["general"]  # both issue one launch of ours
    assert costs["tma"] == max(host.values())  # its host time unmeasured: the worst measured
    assert costs["cudnn"] == host["cudnn"] > host["general"]
    assert choice_table.fastest_first(costs, {"small": 3.7, "general": 8.0})[:2] == ["small", "general"]
    big = choice_table.host_bound_costs({"cudnn": 900.0, "general": 1000.0}, "bwd")
    assert choice_table.fastest_first(big, {}) == ["cudnn", "general"]  # the GPU's time is the larger


def test_the_shipped_table_takes_our_kernels_for_class_attention_in_default_mode():
    """CaiT's class attention (one query against 197 keys, head dim 48; H100, stop 49): cuDNN is
    1 us faster on the GPU both ways, our kernels cheaper to issue; in default mode (the host's
    time the larger) the choice takes ours, as CaiT-XXS24 training measured it faster (0.976 of
    stock compile's host time a step against cuDNN's 1.036); under CUDA graphs cuDNN (the site in
    training an SDPA call by rule: test_a_replayed_training_step_takes_sdpa_below_cudnns_backward_rule)."""
    entries = choice_table.entries_of(choice_table.path_for((9, 0)), "NVIDIA H100 80GB HBM3")
    entry = entries[choice_table.class_key(torch.bfloat16, 48, 48, 1, 197, "none", False, False)]
    for direction in ("fwd", "bwd"):
        device = entry[direction]
        assert min(device, key=device.get) == "cudnn"
        costs = choice_table.host_bound_costs(device, direction)
        assert choice_table.fastest_first(costs, device)[0] == "general", (direction, costs)


def _class_attention_times() -> dict:
    """The shipped H100 entry of CaiT's class attention as ``choice_table.lookup`` gives it."""
    entries = choice_table.entries_of(choice_table.path_for((9, 0)), "NVIDIA H100 80GB HBM3")
    return entries[choice_table.class_key(torch.bfloat16, 48, 48, 1, 197, "none", False, False)]


def _class_attention(q, k, v):
    """CaiT's class attention as timm writes it: one query (the class token) over every token."""
    return ((q * 0.25) @ k.transpose(-2, -1)).softmax(-1) @ v


def _sites_of(fn, *args):
    from fuse_plugin.patterns import attention

    sites = []

    def backend(gm, example_inputs):
        sites.extend(attention.match_attention(n) for n in gm.graph.nodes if attention._is_softmax(n))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return sites


@pytest.mark.parametrize("lq, grad, replayed, as_sdpa", [
    (1, True, True, True),  # CaiT-XXS24 training under CUDA graphs: SDPA by rule
    (1, True, False, False),  # default mode: the table (our op)
    (1, False, True, False),  # inference: the table (our op)
    (160, True, True, False),  # at cuDNN's own backward rule's length: the table
])
def test_a_replayed_training_step_takes_sdpa_below_cudnns_backward_rule(monkeypatch, lq, grad, replayed, as_sdpa):
    """Measured in a model (H100, stop 55): CaiT's class attention, whose table entry gives our op
    cuDNN both ways (27.6 us alone, SDPA 28.4), ran CaiT-XXS24 training under CUDA graphs at 0.9969
    of fused+compile; as SDPA calls 0.9990. Under CUDA graphs a training site the table gives cuDNN's
    backward below its rule's length becomes an SDPA call; default mode, inference and longer
    queries keep the table's choice."""
    from torch._inductor import config

    times = _class_attention_times()
    q = torch.randn(2, 4, lq, 48, requires_grad=grad)
    k, v = (torch.randn(2, 4, 197, 48, requires_grad=grad) for _ in range(2))
    (site,) = _sites_of(_class_attention, q, k, v)
    key, mode, _ = choice.class_of(site)
    assert mode == ("train" if grad else "fwd")
    assert choice.decide(site) == choice.Decision(True, "")  # the CPU: no table
    monkeypatch.setattr(choice, "class_of", lambda s: (key, mode, torch.device("cuda")))
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: times)
    with config.patch({"triton.cudagraphs": replayed}):
        d = choice.decide(site)
    assert d.ours and d.as_sdpa == as_sdpa, d
    if as_sdpa:
        assert d.reason.startswith("as SDPA by rule: training under CUDA graphs, 1 queries"), d.reason
        assert "27.6 vs SDPA 28.4 us" in d.reason and "stop 55" in d.reason
    else:
        assert not d.reason.startswith("as SDPA by rule"), d.reason
    # where SDPA alone trails our op by more than measured, the rule leaves the table's choice
    slower = dict(times, sdpa={"fwd": 99.0, "train": 27.6 * choice.REPLAYED_SDPA_WITHIN + 1})
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: slower)
    with config.patch({"triton.cudagraphs": True}):
        assert not choice.decide(site).as_sdpa


def test_the_backend_rewrites_under_the_compiles_options(monkeypatch):
    """backend="fuse_plugin" rewrites the Dynamo graph before compile_fx applies the mode's options:
    it rewrites under them, so that the choice sees CUDA graphs (mode="reduce-overhead") as the
    automatic patch's pass (inside compile_fx) does; end to end on the CPU, with the class's table
    entry for any device, the class attention trains as an SDPA call with eager's numbers."""
    from torch._inductor import config

    from fuse_plugin import backend as backend_module

    seen = []
    rewrite = backend_module.rewrite

    def recording(gm):
        seen.append(config.triton.cudagraphs)
        return rewrite(gm)

    monkeypatch.setattr(backend_module, "rewrite", recording)
    times = _class_attention_times()
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: times)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 48, requires_grad=True)
    k, v = (torch.randn(2, 4, 197, 48, requires_grad=True) for _ in range(2))
    want = _class_attention(q, k, v)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    for mode, sdpa in (("reduce-overhead", 1), (None, 0)):
        counters.clear()
        torch._dynamo.reset()
        got = torch.compile(_class_attention, backend="fuse_plugin", mode=mode)(q, k, v)
        got.sum().backward()
        assert seen[-1] is (mode == "reduce-overhead")
        assert counters["fuse_plugin"]["attention"] == 1
        assert counters["fuse_plugin"]["attention_as_sdpa"] == sdpa, mode
        check_close("out", got, want, 1e-5)
        for name, t, g in zip(("dq", "dk", "dv"), (q, k, v), want_grads):
            check_close(name, t.grad, g, 1e-4)
            t.grad = None
    assert config.triton.cudagraphs is False  # the options stay the compile's


def test_the_shipped_table_leaves_xcit_cross_covariance_to_inductor(tmp_path, monkeypatch):
    """XCiT's XCA sites (32 channels as tokens, the 196 patches as the head dim; H100, stop 34):
    only our general kernels run head dim 196, at a third of Inductor's speed: both modes go to
    Inductor, by the shipped H100 entry."""
    key = choice_table.class_key(torch.bfloat16, 196, 196, 32, 32, "none", False, False)
    shipped = json.loads(choice_table.path_for((9, 0)).read_text())["gpus"]["NVIDIA H100 80GB HBM3"]["entries"]
    assert shipped[key]["name"] == "xcit-xca"
    monkeypatch.setenv(choice_table.ENV, _table(tmp_path, {key: shipped[key]}))
    choice_table.clear_cache()
    try:
        times = choice_table.lookup(torch.device("cuda"), key)
        for mode in ("fwd", "train"):
            d = choice.decide_from(times, mode, key, sdpa_ok=True)
            assert not d.ours and d.reason.startswith("left to Inductor: measured"), (mode, d)
    finally:
        choice_table.clear_cache()


class Attn(torch.nn.Module):
    """Hand-written attention with a learned bias, as timm writes it."""

    def __init__(self, heads=2, length=10):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(1, heads, length, length))

    def forward(self, q, k, v):
        return ((q * 0.3) @ k.transpose(-2, -1) + self.bias).softmax(-1) @ v


@pytest.mark.parametrize("site_choice, fused, left", [("ours", 1, 0), ("inductor", 0, 1)])
def test_sites_left_to_inductor_give_eager_numbers(monkeypatch, site_choice, fused, left):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", site_choice)
    torch.manual_seed(0)
    model = Attn()
    q, k, v = (torch.randn(2, 2, 10, 16, requires_grad=True) for _ in range(3))
    want = model(q, k, v)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in (q, k, v, model.bias)]
    for t in (q, k, v, model.bias):
        t.grad = None
    counters.clear()
    torch._dynamo.reset()
    got = torch.compile(model, backend="fuse_plugin")(q, k, v)
    got.sum().backward()
    assert counters["fuse_plugin"]["attention"] == fused
    assert counters["fuse_plugin"]["attention_left"] == left
    check_close("out", got, want, 1e-5)
    for name, t, g in zip(("dq", "dk", "dv", "dbias"), (q, k, v, model.bias), want_grads):
        check_close(name, t.grad, g, 1e-4)
    report = fuse_plugin.explain(model, q, k, v)
    assert len(report.left) == left and report.count("attention") == fused
    if left:
        assert "left as they are by measurement" in str(report)
        assert "left      attention" in str(report) or "\nleft " in str(report)
        assert report.left[0].reason == "left to Inductor (FUSE_PLUGIN_SITE_CHOICE=inductor)"


def test_bad_site_choice(monkeypatch):
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "sometimes")
    with pytest.raises(ValueError, match="FUSE_PLUGIN_SITE_CHOICE must be one of auto, ours, inductor, sdpa"):
        fuse_plugin.settings.site_choice()


# --------------------------------------------------------------------------- window-periodic bias


def _periodic(B=6, P=3, H=2, L=9, D=16, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    rel = torch.randn(1, H, L, L, dtype=dtype, device=device, requires_grad=True)
    mask = torch.where(torch.rand(P, 1, L, L, device=device) < 0.3, -100.0, 0.0).to(dtype)
    return q, k, v, rel, mask


def test_op_window_periodic_bias_matches_repeated_bias():
    """attn_bias (P, ...) with P | B: batch b reads row b % P, gradient in the bias's shape."""
    q, k, v, rel, mask = _periodic()
    bias = rel + mask  # (P, H, L, L)
    out, _ = torch.ops.fuse_plugin.attention(q, k, v, bias, 0.0, False, 0.25)
    out.sum().backward()
    got = [t.grad.clone() for t in (q, k, v, rel)]
    for t in (q, k, v, rel):
        t.grad = None
    whole = bias.unsqueeze(0).expand(2, 3, 2, 9, 9).reshape(6, 2, 9, 9)
    want = ((q @ k.transpose(-2, -1)) * 0.25 + whole).softmax(-1) @ v
    want.sum().backward()
    check_close("out", out, want, 1e-5)
    for name, g, t in zip(("dq", "dk", "dv", "drel"), got, (q, k, v, rel)):
        check_close(name, g, t.grad, 1e-4)
    with pytest.raises(ValueError, match="nor is it window-periodic"):
        torch.ops.fuse_plugin.attention(q, k, v, torch.zeros(4, 2, 9, 9), 0.0, False, 0.25)


@pytest.mark.parametrize("family", ["general", "small"])
def test_kernels_read_a_periodic_bias(family):
    """The kernels (on the CPU in Triton's interpreter): the general family gets the bias
    materialised, the small one reads it by period; dbias comes back summed over each window's
    batches."""
    q, k, v, rel, mask = _periodic(device=DEVICE)
    bias = (rel + mask).detach()
    with registry.forced(family):
        out, lse = K.attention_forward(q.detach(), k.detach(), v.detach(), bias, is_causal=False, scale=0.25)
        dout = torch.randn_like(out)
        dq, dk, dv, dbias = K.attention_backward(dout, q.detach(), k.detach(), v.detach(), bias, out, lse,
                                                 is_causal=False, scale=0.25, need_dbias=True)
    whole = bias.unsqueeze(0).expand(2, 3, 2, 9, 9).reshape(6, 2, 9, 9).double().requires_grad_(True)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = ((q64 @ k64.transpose(-2, -1)) * 0.25 + whole).softmax(-1) @ v64
    want.backward(dout.double())
    check_close("out", out, want, 1e-5)
    for name, g, t in (("dq", dq, q64), ("dk", dk, k64), ("dv", dv, v64)):
        check_close(name, g, t.grad, 1e-5)
    assert dbias.shape == (3, 2, 9, 9)
    check_close("dbias", dbias, whole.grad.view(2, 3, 2, 9, 9).sum(0), 1e-5)


def test_windows_left_to_inductor_by_rule_where_unmeasured(monkeypatch):
    """Swin's windows (<= 64 tokens, head dim <= 32, a float bias): on the GPU, with no table entry,
    the measured rule leaves them to Inductor (the general kernels ran Swin-T at 0.46x stock); a
    table entry decides instead; longer windows and the CPU take our op."""
    from models_plain import WindowAttention, shifted_window_mask, swin

    torch.manual_seed(0)
    SWIN = WindowAttention()

    from fuse_plugin.patterns import attention

    sites = []

    def backend(gm, example_inputs):
        sites.extend(attention.match_attention(n) for n in gm.graph.nodes if attention._is_softmax(n))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x, m: swin(SWIN, x, m), backend=backend)(torch.randn(8, 16, 64), shifted_window_mask())
    (site,) = sites
    assert choice._rule(site) == choice._WINDOW_RULE
    assert choice.decide(site).ours  # the CPU: no rule, no table
    key, mode, _ = choice.class_of(site)
    monkeypatch.setattr(choice, "class_of", lambda s: (key, mode, torch.device("cuda")))
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: None)
    assert choice.decide(site) == choice.Decision(False, choice._WINDOW_RULE)
    measured = {"fwd": {"small": 1.0}, "bwd": {"small": 2.0}, "inductor": {"fwd": 2.0, "train": 5.0}}
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: measured)
    assert choice.decide(site).ours  # the table: ours 1 + 2 < Inductor's 5


@pytest.mark.parametrize("tokens, wide, ruled", [(48, 196, True), (32, 196, True), (96, 196, False), (48, 64, False)])
def test_wide_heads_over_few_tokens_left_to_inductor_where_unmeasured(monkeypatch, tokens, wide, ruled):
    """XCiT's attention over channels (<= 64 tokens, head dim > 128): unmeasured on the GPU, left to
    Inductor by rule (its measured class ran our kernels at 0.29-0.34x Inductor), as it ran before
    the rewrite matched it; longer or narrower problems keep the usual choice."""
    from fuse_plugin.patterns import attention

    sites = []

    def backend(gm, example_inputs):
        sites.extend(attention.match_attention(n) for n in gm.graph.nodes if attention._is_softmax(n))
        return gm.forward

    q, k, v = (torch.randn(2, 4, tokens, wide) for _ in range(3))
    torch._dynamo.reset()
    torch.compile(lambda q, k, v: (q @ k.transpose(-2, -1)).softmax(-1) @ v, backend=backend)(q, k, v)
    (site,) = sites
    assert (choice._rule(site) == choice._WIDE_HEAD_RULE) == ruled
    key, mode, _ = choice.class_of(site)
    monkeypatch.setattr(choice, "class_of", lambda s: (key, mode, torch.device("cuda")))
    monkeypatch.setattr(choice_table, "lookup", lambda device, k: None)
    assert choice.decide(site).ours != ruled


def test_window_beside_padding_only_in_the_measured_range_on_the_gpu():
    """A window beside HF's eager padding becomes the op's on the CPU always; on the GPU only where
    the window rule was measured (16-bit, 16k keys and up): shorter, the band stays a dense bias."""
    assert choice.window_beside_padding(torch.empty(1, 1, 8, 16), 8)
    for dtype, lk, taken in ((torch.bfloat16, 16384, True), (torch.bfloat16, 4096, False),
                             (torch.float32, 32768, False)):
        assert choice.window_beside_padding(_CudaLike(dtype), lk) == taken, (dtype, lk)


class _CudaLike(torch.Tensor):
    """A meta tensor that says it is on CUDA (choice.window_beside_padding reads device and dtype)."""

    @staticmethod
    def __new__(cls, dtype):
        return torch.Tensor._make_subclass(cls, torch.empty(0, dtype=dtype, device="meta"))

    @property
    def device(self):
        return torch.device("cuda")


def test_a_gpu_set_measured_for_some_classes_adds_to_the_others(tmp_path):
    """entries_of: the running GPU's own set first; a class it lacks comes from the first other set
    that has it (a set tuned for one class on another GPU hides nothing)."""
    path = tmp_path / "choices.json"
    a = {"fwd": {"general": 1.0}}
    b = {"fwd": {"general": 2.0}}
    c = {"fwd": {"general": 3.0}}
    path.write_text(json.dumps({"format": choice_table.FORMAT, "gpus": {
        "GPU A": {"entries": {"k1": a, "k2": a}}, "GPU B": {"entries": {"k2": b, "k3": b}},
        "GPU C": {"entries": {"k3": c}}}}))
    assert choice_table.entries_of(path, "GPU C") == {"k1": a, "k2": a, "k3": c}
    assert choice_table.entries_of(path, "GPU B") == {"k1": a, "k2": b, "k3": b}
    assert choice_table.entries_of(path, "Other") == {"k1": a, "k2": a, "k3": b}
    assert choice_table.entries_of(tmp_path / "missing.json", "GPU A") == {}


def test_a_band_site_is_timed_by_the_families_that_run_bands():
    """A sliding window or chunks (issue 31) reach the choice as the causal class; only the
    families with ``takes_window`` run a band, so our op's time is theirs, not cuDNN's."""
    times = {"fwd": {"cudnn": 10.0, "general": 30.0}, "bwd": {"cudnn": 20.0, "two_kernel": 50.0},
             "inductor": {"fwd": 25.0, "train": 60.0}}
    assert choice.ours_time(times, "fwd") == (10.0, "cudnn")
    assert choice.ours_time(times, "fwd", band=True) == (30.0, "general")
    assert choice.ours_time(times, "train", band=True) == (80.0, "general + two_kernel")
    assert choice.decide_from(times, "fwd", "k").ours
    left = choice.decide_from(times, "fwd", "k", band=True)
    assert not left.ours and "30.0 us for general" in left.reason
    # no family that runs bands was measured: a hand-written site keeps our op, an SDPA call stays
    only_cudnn = {"fwd": {"cudnn": 10.0}, "bwd": {"cudnn": 20.0}, "inductor": {"fwd": 25.0}, "sdpa": {"fwd": 12.0}}
    assert choice.ours_time(only_cudnn, "fwd", band=True) is None
    assert choice.decide_from(only_cudnn, "fwd", "k", band=True).ours
    assert not choice.decide_sdpa_from(only_cudnn, "fwd", "k", band=True).ours
    # the Gluon kernels run a window only in their measured range (registry.band_runners)
    gluon = {"fwd": {"gluon": 5.0, "general": 30.0}, "bwd": {"gluon": 10.0, "general": 50.0}}
    assert registry.band_runners("bwd", 4096, 0, False, 128) == {"gluon", "general", "two_kernel"}
    for window, d, want in ((4096, 128, (15.0, "gluon + gluon")), (128, 128, (80.0, "general + general")),
                            (4096, 64, (80.0, "general + general"))):
        band = {x: registry.band_runners(x, window, 0, False, d) for x in ("fwd", "bwd")}
        assert choice.ours_time(gluon, "train", band) == want
    chunks = {x: registry.band_runners(x, 0, 4096, False, 128) for x in ("fwd", "bwd")}
    assert choice.ours_time(gluon, "train", chunks) == (80.0, "general + general")
