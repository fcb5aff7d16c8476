"""Attention over a KV cache (issue 15) and in-place writes around attention (issue 14's in-place fills).

The rewrite places the fused op just before the output it replaces; it reads its inputs there. A tensor
written in place (a static cache's `index_copy_`, `cache[:, :, pos] = k`, `copy_`, a `masked_fill_` on the
scores) is fused when the order of the writes and the reads makes that read the values eager read
(fuse_plugin/patterns/writes.py), and left alone otherwise:

* plain torch, each spelling compiled against eager (outputs and the caches it writes):
  static caches written by `index_copy_`, slice assignment, the in-place op's result, with GQA
  `repeat_kv` over the buffer, written after the whole attention; a dynamic cache by `torch.cat`;
  near misses left untouched: a cache written after the product with k (before the product with v),
  a copy of the cache taken before the write and read after it (the copy inside a `.clone()` of kᵀ
  and inside `repeat_kv`, which the op would bypass); a clone the op reads as its own input is fused
  (it reads the clone, as eager does);
* in-place fills of the scores before the softmax (`masked_fill_`, `+=`, two in a row) fused, a fill
  after the softmax read and a mask written between its read and the op left alone;
* Lq ≠ Lk: the op's `is_causal` is top-left aligned; a bottom-right causal mask (what decode needs)
  stays a bias, a top-left one becomes is_causal, with arange, tril and a sliced tril buffer;
* HF `generate` (greedy, left-padded batch, fp32) with tiny Llama and Qwen2 (2 layers, hidden 64):
  static and dynamic caches, a sliding-window static cache (Mistral), HF's own decode compile
  (`compile_config`), and one run through the real backend (Inductor): every attention fused in
  every prefill and decode graph, one graph per cache regime (not per token), tokens equal eager's.
"""
import copy

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fuse_plugin  # noqa: F401  (registers the ops and the backend)
from helpers import capture, rel_err, rewrite_aot_eager

B, H, LQ, LMAX, D = 2, 4, 3, 8, 16


def repeat_kv(x, n):
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, l, d).reshape(b, h * n, l, d)


def cache_inputs(hkv=H, lq=LQ):
    """q, the new k/v, the k/v buffers, the positions written, an additive (B, 1, Lq, LMAX) mask over
    the whole buffer (the unfilled tail and one left-padded key hidden)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, lq, D, generator=g)
    kn, vn = torch.randn(B, hkv, lq, D, generator=g), torch.randn(B, hkv, lq, D, generator=g)
    kc, vc = torch.randn(B, hkv, LMAX, D, generator=g), torch.randn(B, hkv, LMAX, D, generator=g)
    pos = torch.arange(2, 2 + lq)
    mask = torch.zeros(B, 1, lq, LMAX)
    mask[..., 2 + lq:] = torch.finfo(torch.float32).min
    mask[0, ..., 0] = torch.finfo(torch.float32).min
    return [q, kn, vn, kc, vc, pos, mask]


def attend(q, k, v, mask):
    return F.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v


# --------------------------------------------------------------------------- the cache spellings


def static_index_copy(q, kn, vn, kc, vc, pos, mask):  # HF StaticLayer.update
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return attend(q, kc, vc, mask)


def static_slice_assign(q, kn, vn, kc, vc, pos, mask):  # HF's fallback where index_copy_ is missing
    kc[:, :, pos] = kn
    vc[:, :, pos] = vn
    return attend(q, kc, vc, mask)


def static_slice_copy(q, kn, vn, kc, vc, pos, mask):  # a copy_ into a view of the buffer
    kc[:, :, 2:2 + LQ].copy_(kn)
    vc[:, :, 2:2 + LQ].copy_(vn)
    return attend(q, kc, vc, mask)


def static_result_of_write(q, kn, vn, kc, vc, pos, mask):  # the in-place op's own result read
    return attend(q, kc.index_copy_(2, pos, kn), vc.index_copy_(2, pos, vn), mask)


def static_gqa(q, kn, vn, kc, vc, pos, mask):  # repeat_kv over the whole buffer, after the write
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return attend(q, repeat_kv(kc, 2), repeat_kv(vc, 2), mask)


def written_after_attention(q, kn, vn, kc, vc, pos, mask):  # the cache updated once the attention is done
    out = attend(q, kc, vc, mask)
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return out


def read_of_a_clone(q, kn, vn, kc, vc, pos, mask):  # the op's own input is the copy: it reads the copy
    k_old, v_old = kc.clone(), vc.clone()
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return attend(q, k_old, v_old, mask)


def dynamic_cat(q, kn, vn, kc, vc, pos, mask):  # HF DynamicLayer.update
    k = torch.cat([kc[:, :, :2], kn], dim=-2)
    v = torch.cat([vc[:, :, :2], vn], dim=-2)
    return attend(q, k, v, mask[..., :2 + LQ])


# near misses: the eager read comes before a write the op (at the output) would see


def written_after_read(q, kn, vn, kc, vc, pos, mask):  # the product with k reads the old cache
    s = q @ kc.transpose(-2, -1) * 0.25 + mask
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return F.softmax(s, dim=-1) @ vc


def stale_clone_of_kt(q, kn, vn, kc, vc, pos, mask):  # kᵀ copied before the write (the op would read kc)
    kt = kc.transpose(-2, -1).clone()
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return F.softmax(q @ kt * 0.25 + mask, dim=-1) @ vc


def stale_repeat_kv(q, kn, vn, kc, vc, pos, mask):  # repeat_kv's copy taken before the write
    k = repeat_kv(kc, 2)
    kc.index_copy_(2, pos, kn)
    vc.index_copy_(2, pos, vn)
    return attend(q, k, repeat_kv(vc, 2), mask)


GQA = {static_gqa, stale_repeat_kv}
FUSED = [static_index_copy, static_slice_assign, static_slice_copy, static_result_of_write, static_gqa,
         written_after_attention, read_of_a_clone, dynamic_cat]
UNTOUCHED = [written_after_read, stale_clone_of_kt, stale_repeat_kv]


def check_compiled(fn, args, fused: int) -> list:
    """fn compiled (our rewrite + AOTAutograd, eager kernels) against eager: `fused` attention sites,
    the output and every argument it writes equal. Returns the report's near-miss reasons."""
    _, _, report = capture(fn, *[a.clone() for a in args])
    assert report.count("attention") == fused, [m.reason for m in report.misses]
    eager_args, compiled_args = [a.clone() for a in args], [a.clone() for a in args]
    torch._dynamo.reset()
    ref = fn(*eager_args)
    out = torch.compile(fn, backend=rewrite_aot_eager, fullgraph=True)(*compiled_args)
    assert rel_err(out, ref) <= 1e-6, f"{fn.__name__}: rel err {rel_err(out, ref):.2e}"
    for a, e in zip(compiled_args, eager_args):
        assert torch.equal(a, e), f"{fn.__name__}: an argument it writes differs from eager's"
    return [m.reason for m in report.misses if m.kind == "attention"]


@pytest.mark.parametrize("fn", FUSED, ids=lambda f: f.__name__)
def test_cache_spelling_fused(fn):
    check_compiled(fn, cache_inputs(hkv=2 if fn in GQA else H), fused=1)


@pytest.mark.parametrize("fn", UNTOUCHED, ids=lambda f: f.__name__)
def test_cache_near_miss_untouched(fn):
    (reason,) = check_compiled(fn, cache_inputs(hkv=2 if fn in GQA else H), fused=0)
    assert "written in place by index_copy_ after the attention first reads it" in reason, reason


def test_decode_one_query_over_static_buffer():
    """Lq = 1 (decode) against the whole buffer, the mask hiding the unfilled tail: a bias, fused."""
    args = cache_inputs(lq=1)
    check_compiled(static_index_copy, args, fused=1)
    _, _, report = capture(static_index_copy, *[a.clone() for a in args])
    assert "is_causal" not in report.sites[0].detail and "additive mask" in report.sites[0].detail


# --------------------------------------------------------------------------- in-place fills of the scores


def fill_in_place(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * 0.25
    s.masked_fill_(~keep, -1e9)
    return F.softmax(s, dim=-1) @ v


def two_writes_in_place(q, k, v, keep, bias):
    s = q @ k.transpose(-2, -1)
    s.mul_(0.25)
    s += bias
    s.masked_fill_(~keep, float("-inf"))
    return F.softmax(s, dim=-1) @ v


def fill_result_read(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * 0.25
    return F.softmax(s.masked_fill_(~keep, -1e9), dim=-1) @ v


def fill_after_softmax(q, k, v, keep):  # near miss: the softmax read the scores before the fill
    s = q @ k.transpose(-2, -1) * 0.25
    w = F.softmax(s, dim=-1)
    s.masked_fill_(~keep, -1e9)
    return w @ v


def mask_written_after_its_read(q, k, v, keep):  # near miss: the op would read the mask after the write
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(keep, -1e9)
    w = F.softmax(s, dim=-1)
    keep.fill_(False)
    return w @ v


def negated_mask_written_after_its_read(q, k, v, keep):  # ~keep is a new tensor: the op reads it, not keep
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
    w = F.softmax(s, dim=-1)
    keep.fill_(True)
    return w @ v


def fill_inputs(bias: bool = False):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, 8, D, generator=g) for _ in range(3))
    keep = torch.ones(B, 1, 1, 8, dtype=torch.bool)
    keep[0, ..., :3] = False  # left padding
    keep[1, ..., 5] = False
    return [q, k, v, keep] + ([torch.randn(B, H, 8, 8, generator=g)] if bias else [])


class InPlaceFills(expecttest.TestCase):
    maxDiff = None

    def test_masked_fill_in_place_before_the_softmax(self):
        reasons = check_compiled(fill_in_place, fill_inputs(), fused=1)
        self.assertEqual(reasons, [])
        _, after, report = capture(fill_in_place, *fill_inputs())
        self.assertNotIn("masked_fill_", after)
        self.assertExpectedInline(report.sites[0].detail, """scale=0.25, bias: float mask, replace mask (finite fill)""")

    def test_two_writes_in_place_and_the_result_read(self):
        check_compiled(two_writes_in_place, fill_inputs(bias=True), fused=1)
        check_compiled(fill_result_read, fill_inputs(), fused=1)

    def test_near_miss_fill_after_the_softmax(self):
        (reason,) = check_compiled(fill_after_softmax, fill_inputs(), fused=0)
        self.assertExpectedInline(reason, """s is changed in place (masked_fill_) after the softmax chain reads it (w)""")

    def test_negated_mask_written_after_its_read(self):
        check_compiled(negated_mask_written_after_its_read, fill_inputs(), fused=1)

    def test_near_miss_mask_written_before_the_op_reads_it(self):
        (reason,) = check_compiled(mask_written_after_its_read, fill_inputs(), fused=0)
        self.assertExpectedInline(reason, """l_keep_ (an input of the attention) is written in place by fill_ after the attention first reads it (s): the fused op, placed at the output, would read the new values""")


# --------------------------------------------------------------------------- Lq != Lk: causal alignment


def bottom_right_arange(q, k, v):  # decode's alignment: query i sees keys j <= i + (Lk - Lq)
    lq, lk = q.shape[-2], k.shape[-2]
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(j > i, float("-inf")), dim=-1) @ v


def bottom_right_tril(q, k, v):
    lq, lk = q.shape[-2], k.shape[-2]
    keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), dim=-1) @ v


def top_left_arange(q, k, v):  # the op's own alignment: query i sees keys j <= i
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(j > i, float("-inf")), dim=-1) @ v


class SlicedTrilBuffer(torch.nn.Module):  # GPT-2: bias[:, :, Lk - Lq : Lk, :Lk]
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16))

    def forward(self, q, k, v):
        lq, lk = q.shape[-2], k.shape[-2]
        s = q @ k.transpose(-2, -1) * 0.25
        return F.softmax(torch.where(self.bias[:, :, lk - lq:lk, :lk], s, torch.finfo(s.dtype).min), dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_shapes", "dynamic_shapes"])
@pytest.mark.parametrize("lq", [1, 3, 8])
@pytest.mark.parametrize("fn", [bottom_right_arange, bottom_right_tril, top_left_arange, SlicedTrilBuffer()],
                         ids=["bottom_right_arange", "bottom_right_tril", "top_left_arange", "sliced_tril_buffer"])
def test_causal_alignment_with_fewer_queries(fn, lq, dynamic):
    """Lk = 8 keys: a bottom-right mask is is_causal only where it is also top-left (Lq = Lk, static
    shapes), else a bias; a top-left one is is_causal for Lq > 1 (for Lq = 1 the prover drops the unit
    query dim and keeps the mask as a bias). Every case fused and equal to eager."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, lq, D, generator=g)
    k, v = torch.randn(B, H, 8, D, generator=g), torch.randn(B, H, 8, D, generator=g)
    _, _, report = capture(fn, q, k, v, dynamic=dynamic)
    (site,) = report.sites
    # bottom-right with Lq = Lk is top-left too; with dynamic shapes its offset Lk - Lq is symbolic (kept as a bias)
    causal = (fn is top_left_arange and lq > 1) or (lq == 8 and not dynamic)
    assert ("is_causal" in site.detail) == causal, site.detail
    torch._dynamo.reset()
    out = torch.compile(fn, backend=rewrite_aot_eager, dynamic=dynamic)(q, k, v)
    assert rel_err(out, fn(q, k, v)) <= 1e-6


# --------------------------------------------------------------------------- HF generate

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]'): the generate tests need it"
)

VOCAB, PROMPT, NEW_TOKENS, LAYERS = 96, 7, 6, 2


def _config(cls, **extra):
    """2 layers, hidden 64, 4 heads of 16, GQA with 2 kv heads (tests/models/test_hf_models.py's decoders)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    return cls(**{**common, **extra})


def _model(name: str):
    cls, cfg = {
        "llama": (transformers.LlamaForCausalLM, _config(transformers.LlamaConfig)),
        "qwen2": (transformers.Qwen2ForCausalLM, _config(transformers.Qwen2Config)),
        # a sliding window shorter than prompt + new tokens: the static cache rolls once full
        "mistral_sliding": (transformers.MistralForCausalLM, _config(transformers.MistralConfig, sliding_window=9)),
    }[name]
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation="eager").eval()


def _prompt():
    """Two prompts, the first left-padded by 3 tokens."""
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, cache: str, **kw):
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        return model.generate(**_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                              **extra, **kw)


class CountingBackend:
    """Our rewrite + AOTAutograd (eager kernels), recording the attention sites fused per compiled
    graph. It survives HF's deep copy of a CompileConfig (the same object, so the counts are seen)."""

    def __init__(self):
        self.graphs: list[int] = []

    def __deepcopy__(self, memo):
        return self

    def __call__(self, gm, example_inputs, **_mode):
        before = counters["fuse_plugin"]["attention"]
        compiled = rewrite_aot_eager(gm, example_inputs)
        self.graphs.append(counters["fuse_plugin"]["attention"] - before)
        return compiled


# graphs compiled in one generate (5 decode steps): the prefill, then one decode graph per cache regime
GRAPHS = {
    "static": 2,  # prefill, decode (static shapes throughout)
    "dynamic": 3,  # prefill, the first decode step, then one decode graph with the cache length dynamic
}


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_fuses_prefill_and_decode(family, cache):
    """model.forward compiled (HF's documented static-cache recipe): every attention fused in every graph,
    no graph per decoded token, tokens equal eager's."""
    eager = _model(family)
    ref = _generate(eager, cache)
    model = copy.deepcopy(eager)
    backend = CountingBackend()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    out = _generate(model, cache)
    assert backend.graphs == [LAYERS] * GRAPHS[cache], f"attention fused per graph: {backend.graphs}"
    assert out.shape == (2, PROMPT + NEW_TOKENS) and torch.equal(out, ref)


def test_generate_sliding_window_static_cache():
    """Mistral with a window of 9 over 7 + 6 tokens: the static sliding cache writes by index_copy_ until it
    is full, then rolls and copies back (copy_); prefill and both decode regimes fused."""
    eager = _model("mistral_sliding")
    ref = _generate(eager, "static")
    model = copy.deepcopy(eager)
    backend = CountingBackend()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    out = _generate(model, "static")
    assert backend.graphs == [LAYERS] * 3, f"attention fused per graph: {backend.graphs}"
    assert torch.equal(out, ref)


def test_generate_with_hf_compile_config():
    """HF's own decode compile (`compile_config`, static cache; prefill runs eagerly): one decode graph."""
    from transformers import CompileConfig

    eager = _model("llama")
    ref = _generate(eager, "static", disable_compile=True)
    model = copy.deepcopy(eager)
    backend = CountingBackend()
    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # HF compiles on CUDA only unless told (a private flag in 5.x)
    torch._dynamo.reset()
    out = _generate(model, "static", compile_config=config)
    assert backend.graphs == [LAYERS], f"attention fused per graph: {backend.graphs}"
    assert torch.equal(out, ref)


def test_generate_through_the_backend():
    """`backend="fuse_plugin"` (Inductor on the CPU), static cache, left padding."""
    eager = _model("llama")
    ref = _generate(eager, "static")
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend="fuse_plugin")
    out = _generate(model, "static")
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["fuse_plugin"]["attention"] == 2 * LAYERS
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- rotary: the same order rule


def _rotate_half(x):
    return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)


def rotary_input_written_between_its_reads(q, k, cos, sin):  # near miss for q: q·cos reads q before the write
    q_cos = q * cos
    q.mul_(2)
    return q_cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_input_written_before_the_attention(q, k, v, cos, sin):  # the fold into the attention would read 2q
    qe, ke = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q.mul_(2)
    return F.softmax(qe @ ke.transpose(-2, -1) * 0.25, dim=-1) @ v


def _rotary_inputs(n):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(B, H, 8, D, generator=g) for _ in range(n)] + [torch.randn(8, D, generator=g) for _ in range(2)]


def test_rotary_input_written_between_its_reads():
    """The rotary op stands at its output and reads x there: q written between `q * cos` and
    `rotate_half(q)` is not a rotation of one tensor, left alone; k is fused."""
    args = _rotary_inputs(2)
    _, _, report = capture(rotary_input_written_between_its_reads, *[a.clone() for a in args])
    assert report.count("rotary") == 1, report
    (miss,) = [m.reason for m in report.misses if m.kind == "rotary"]
    assert "l_q_ (an input of the rotary) is written in place by mul_" in miss, miss
    eager_args, compiled_args = [a.clone() for a in args], [a.clone() for a in args]
    torch._dynamo.reset()
    ref = rotary_input_written_between_its_reads(*eager_args)
    out = torch.compile(rotary_input_written_between_its_reads, backend=rewrite_aot_eager)(*compiled_args)
    assert all(rel_err(o, r) <= 1e-6 for o, r in zip(out, ref))
    assert torch.equal(compiled_args[0], eager_args[0])


def test_rope_fold_refused_when_q_is_written_before_the_attention(monkeypatch):
    """rope_attention would rotate the un-rotated q inside the attention, after `q.mul_(2)`: not folded
    (rotary and attention stay fused separately), equal to eager."""
    monkeypatch.setenv("FUSE_PLUGIN_ROPE_ATTENTION", "1")
    args = _rotary_inputs(3)
    _, _, report = capture(rotary_input_written_before_the_attention, *[a.clone() for a in args])
    assert (report.count("rotary"), report.count("attention"), report.count("rope_attention")) == (2, 1, 0), report
    (miss,) = [m.reason for m in report.misses if m.kind == "rope_attention"]
    assert "l_q_ (an input of the rotary) is written in place by mul_" in miss, miss
    eager_args, compiled_args = [a.clone() for a in args], [a.clone() for a in args]
    torch._dynamo.reset()
    ref = rotary_input_written_before_the_attention(*eager_args)
    out = torch.compile(rotary_input_written_before_the_attention, backend=rewrite_aot_eager)(*compiled_args)
    assert rel_err(out, ref) <= 1e-6
