"""Tests of the rotary-embedding recogniser (fuse_plugin/patterns/rotary.py).

Expect tests show the Dynamo graph's op listing before and after the rewrite for every spelling
(regenerate with EXPECTTEST_ACCEPT=1); negative ones show it unchanged, with the reported reason.
Parity tests compile with `helpers.rewrite_aot_eager` (our rewrite + AOTAutograd, eager kernels)
and compare outputs and gradients with eager. Tables are random, so full-width cos/sin have
UNEQUAL halves: a rewrite that read only half of them would fail parity.
"""

import expecttest
import torch
from torch._dynamo.utils import counters

from helpers import capture, rel_err, rewrite_aot_eager
from fuse_plugin.patterns import rotary as rotary_patterns

B, H, HKV, S, D = 2, 4, 2, 8, 16


# ------------------------------------------------------------------------------------------------
# spellings (module level, as in the models they come from)
# ------------------------------------------------------------------------------------------------

def rotate_half(x):  # HF llama
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_chunk(x):  # flash-attn layers/rotary.py
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):  # GPT-J
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def hf_apply(q, k, cos, sin):  # HF apply_rotary_pos_emb, unsqueeze_dim=1
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def hf_float_wrapped(q, k, cos, sin):  # fp32 math, cast back (as several HF models do)
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(dtype), k_embed.to(dtype)


def hf_in_graph_tables(q, k, inv_freq, position_ids):  # HF rotary embedding module + apply
    freqs = (inv_freq[None, :, None] * position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * 1.0
    sin = emb.sin() * 1.0
    return hf_apply(q, k, cos.to(q.dtype), sin.to(q.dtype))


def single_chunk(x, cos, sin):
    return x * cos + rotate_half_chunk(x) * sin


def single_split(x, cos, sin):
    return rotate_half_split(x) * sin + cos * x


def explicit_halves(x, cos, sin):  # HF GPT-OSS: half-width cos/sin
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def partial_rotary_first(x, cos, sin):  # GPT-NeoX / Phi: rotary slice first
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x_rot = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)


def partial_pass_first(x, cos, sin):  # MLA-like: pass-through slice first
    p = x.shape[-1] - cos.shape[-1]
    x_pass, x_rot = x[..., :p], x[..., p:]
    x_rot = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat((x_pass, x_rot), dim=-1)


def gptj_apply(x, sin, cos):  # GPT-J: (B, S, H, D), half tables repeated per pair
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (x * cos) + (rotate_every_two(x) * sin)


def gptj_partial(x, sin, cos):  # GPT-J with rotary_dim < head_dim
    rd = 2 * cos.shape[-1]
    x_rot, x_pass = x[:, :, :, :rd], x[:, :, :, rd:]
    x_rot = gptj_apply(x_rot, sin, cos)
    return torch.cat([x_rot, x_pass], dim=-1)


def vllm_gptj(x, cos_sin):  # vLLM GPT-J style: explicit pairs, cos/sin from one cache
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def cohere_apply(q, k, cos, sin):  # HF Cohere: interleaved rotate_half, tables repeated per pair
    def rotate_half_interleaved(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([-x2, x1], dim=-1).flatten(-2)

    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    q_embed = (q * cos) + (rotate_half_interleaved(q) * sin)
    k_embed = (k * cos) + (rotate_half_interleaved(k) * sin)
    return q_embed, k_embed


def torchtune_rope(x, rope_cache):  # torchtune RotaryPositionalEmbeddings.forward
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out = x_out.flatten(3)
    return x_out.type_as(x)


def meta_apply(xq, xk, freqs_cis):  # Meta llama apply_rotary_emb
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    shape = [d if i == 1 or i == xq_.ndim - 1 else 1 for i, d in enumerate(xq_.shape)]
    freqs_cis = freqs_cis.view(*shape)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# --- near misses --------------------------------------------------------------------------------

def wrong_sign(x, cos, sin):
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat((x1, -x2), dim=-1) * sin


def swapped_halves_tables(x, cos, sin):  # the second half uses sin where cos belongs
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * sin + x1 * cos), dim=-1)


def swapped_trig(x, t, inv_freq):  # x·sin + rotate_half(x)·cos with in-graph tables
    emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
    return x * emb.sin() + rotate_half(x) * emb.cos()


def non_last_dim(x, cos, sin):  # rotate_half over the sequence dim
    h = x.shape[-2] // 2
    x1, x2 = x[..., :h, :], x[..., h:, :]
    return x * cos + torch.cat((-x2, x1), dim=-2) * sin


def rotate_used_elsewhere(x, cos, sin):
    r = rotate_half(x)
    return x * cos + r * sin, r


def off_center_slices(x, cos, sin):
    x1, x2 = x[..., :6], x[..., 6:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def different_x(x, y, cos, sin):
    return y * cos + rotate_half(x) * sin


def tables_broadcast_x(x, cos, sin):  # cos/sin carry a batch dim that x lacks
    return x * cos + rotate_half(x) * sin


def learned_frequencies(x, t, inv_freq):
    emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

def qk(dtype=torch.float32, d=D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, d, generator=g).to(dtype)
    k = torch.randn(B, HKV, S, d, generator=g).to(dtype)
    return q, k


def tables(*shape):
    """Random tables (not real angles): full-width ones have unequal halves."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def inv_freq(d=D):
    return 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def positions():
    return torch.arange(S, dtype=torch.float32)


def freqs_cis():
    angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq())
    return torch.polar(torch.ones_like(angles), angles)


def reasons(report):
    return "\n".join(m.reason for m in report.misses)


def details(report):
    return "\n".join(s.detail for s in report.sites)


def check_parity(test, fn, *args, grad_args=None, tol=1e-5, grad_tol=None, dynamic_dims=()):
    """Compiled (rewrite + AOTAutograd, eager kernels) vs eager: outputs and grads of the float
    inputs listed in grad_args (indices; default: the first)."""
    grad_args = (0,) if grad_args is None else grad_args

    def leaves():
        out = [a.detach().clone().requires_grad_(i in grad_args) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        for i, dim in dynamic_dims:
            torch._dynamo.mark_dynamic(out[i], dim)
        return out

    torch._dynamo.reset()
    counters.clear()
    eager_in, comp_in = leaves(), leaves()
    expected = fn(*eager_in)
    actual = torch.compile(fn, backend=rewrite_aot_eager)(*comp_in)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for e, a in zip(expected, actual):
        test.assertEqual(a.shape, e.shape)
        test.assertEqual(a.dtype, e.dtype)
        test.assertLessEqual(rel_err(a, e), tol)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(e.shape, generator=g, dtype=torch.float32).to(e.dtype) for e in expected]
    sum((w * e.float()).sum() for w, e in zip(weights, expected)).backward()
    sum((w * a.float()).sum() for w, a in zip(weights, actual)).backward()
    for i in grad_args:
        test.assertEqual(comp_in[i].grad.dtype, eager_in[i].grad.dtype)
        test.assertLessEqual(rel_err(comp_in[i].grad, eager_in[i].grad), grad_tol or tol)
    fused = counters["fuse_plugin"]["rotary"]
    torch._dynamo.reset()
    return fused


class TestRotaryRewrite(expecttest.TestCase):
    # --------------------------------------------------------------------------------------- HF
    def test_hf_slices_qk_pair(self):
        q, k = qk()
        cos, sin = tables(B, S, D)
        before, after, report = capture(hf_apply, q, k, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 8, 16)
1 input (2, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 2, 8, 16)
4 unsqueeze(#0, 1)
5 unsqueeze(#1, 1)
6 mul(#2, #4)
7 getitem(#2, (Ellipsis, :8))
8 getitem(#2, (Ellipsis, 8:))
9 neg(#8)
10 cat((#9, #7), -1)
11 mul(#10, #5)
12 add(#6, #11, 1)
13 mul(#3, #4)
14 getitem(#3, (Ellipsis, :8))
15 getitem(#3, (Ellipsis, 8:))
16 neg(#15)
17 cat((#16, #14), -1)
18 mul(#17, #5)
19 add(#13, #18, 1)
20 output (#12, #19)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 16)
1 input (2, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 2, 8, 16)
4 unsqueeze(#0, 1)
5 unsqueeze(#1, 1)
6 fuse_plugin.rotary_qk(#2, #3, #4, #5, False, 16)
7 getitem(#6, 0)
8 getitem(#6, 1)
9 output (#7, #8)""")
        self.assertExpectedInline(details(report), """\
rotate_half; rotary_dim=16; full-width cos/sin; q+k in one rotary_qk
rotate_half; rotary_dim=16; full-width cos/sin; q+k in one rotary_qk""")
        self.assertEqual(check_parity(self, hf_apply, q, k, cos, sin, grad_args=(0, 1)), 2)

    def test_hf_float_wrapped_bf16(self):
        q, k = qk(torch.bfloat16)
        cos, sin = tables(B, S, D)  # fp32 tables, bf16 q/k
        before, after, report = capture(hf_float_wrapped, q, k, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (2, 2, 8, 16)
2 input (2, 8, 16)
3 input (2, 8, 16)
4 float(#0)
5 float(#1)
6 unsqueeze(#2, 1)
7 unsqueeze(#3, 1)
8 mul(#4, #6)
9 getitem(#4, (Ellipsis, :8))
10 getitem(#4, (Ellipsis, 8:))
11 neg(#10)
12 cat((#11, #9), -1)
13 mul(#12, #7)
14 add(#8, #13, 1)
15 mul(#5, #6)
16 getitem(#5, (Ellipsis, :8))
17 getitem(#5, (Ellipsis, 8:))
18 neg(#17)
19 cat((#18, #16), -1)
20 mul(#19, #7)
21 add(#15, #20, 1)
22 to(#14, (bfloat16))
23 to(#21, (bfloat16))
24 output (#22, #23)""")
        self.assertExpectedInline(after, """\
0 input (2, 4, 8, 16)
1 input (2, 2, 8, 16)
2 input (2, 8, 16)
3 input (2, 8, 16)
4 unsqueeze(#2, 1)
5 unsqueeze(#3, 1)
6 fuse_plugin.rotary_qk(#0, #1, #4, #5, False, 16)
7 getitem(#6, 0)
8 getitem(#6, 1)
9 to(#7, (bfloat16))
10 to(#8, (bfloat16))
11 output (#9, #10)""")
        self.assertEqual(check_parity(self, hf_float_wrapped, q, k, cos, sin, grad_args=(0, 1), tol=1e-2), 2)

    def test_hf_bf16_x_fp32_tables_promotes(self):
        q, k = qk(torch.bfloat16)
        cos, sin = tables(B, S, D)
        _, after, _ = capture(hf_apply, q, k, cos, sin)
        self.assertIn("fuse_plugin.rotary_qk", after)
        # eager promotes to fp32; the op's output dtype is promote(x, cos, sin): same, exact math
        self.assertEqual(check_parity(self, hf_apply, q, k, cos, sin, grad_args=(0, 1), grad_tol=1e-2), 2)

    def test_hf_in_graph_tables_use_half_width(self):
        q, k = qk()
        position_ids = torch.arange(S).expand(B, S)
        before, after, report = capture(hf_in_graph_tables, q, k, inv_freq(), position_ids)
        self.assertExpectedInline(before, """\
0 input (8,)
1 input (2, 8)
2 input (2, 4, 8, 16)
3 input (2, 2, 8, 16)
4 getitem(#0, (None, :, None))
5 getitem(#1, (:, None, :))
6 float(#5)
7 mul(#4, #6)
8 transpose(#7, 1, 2)
9 cat((#8, #8), -1)
10 cos(#9)
11 mul(#10, 1)
12 sin(#9)
13 mul(#12, 1)
14 to(#11, (float32))
15 to(#13, (float32))
16 unsqueeze(#14, 1)
17 unsqueeze(#15, 1)
18 mul(#2, #16)
19 getitem(#2, (Ellipsis, :8))
20 getitem(#2, (Ellipsis, 8:))
21 neg(#20)
22 cat((#21, #19), -1)
23 mul(#22, #17)
24 add(#18, #23, 1)
25 mul(#3, #16)
26 getitem(#3, (Ellipsis, :8))
27 getitem(#3, (Ellipsis, 8:))
28 neg(#27)
29 cat((#28, #26), -1)
30 mul(#29, #17)
31 add(#25, #30, 1)
32 output (#24, #31)""")
        self.assertExpectedInline(after, """\
0 input (8,)
1 input (2, 8)
2 input (2, 4, 8, 16)
3 input (2, 2, 8, 16)
4 getitem(#0, (None, :, None))
5 getitem(#1, (:, None, :))
6 float(#5)
7 mul(#4, #6)
8 transpose(#7, 1, 2)
9 cos(#8)
10 mul(#9, 1)
11 to(#10, (float32))
12 unsqueeze(#11, 1)
13 sin(#8)
14 mul(#13, 1)
15 to(#14, (float32))
16 unsqueeze(#15, 1)
17 fuse_plugin.rotary_qk(#2, #3, #12, #16, False, 16)
18 getitem(#17, 0)
19 getitem(#17, 1)
20 output (#18, #19)""")
        self.assertEqual(check_parity(self, hf_in_graph_tables, q, k, inv_freq(), position_ids, grad_args=(0, 1)), 2)

    def test_hf_dynamic_seq_len(self):
        q, k = qk()
        cos, sin = tables(B, S, D)
        fused = check_parity(self, hf_apply, q, k, cos, sin, grad_args=(0, 1),
                             dynamic_dims=((0, 2), (1, 2), (2, 1), (3, 1)))
        self.assertEqual(fused, 2)

    def test_hf_dynamic_all_dims(self):
        # dynamic=True: the head dim is symbolic too (the op gets its rotary_dim from a size node)
        q, k = qk()
        cos, sin = tables(B, S, D)
        _, after, _ = capture(hf_apply, q, k, cos, sin, dynamic=True)
        self.assertIn("fuse_plugin.rotary_qk", after)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(hf_apply, backend=rewrite_aot_eager, dynamic=True)
        for d in (D, 2 * D):
            q, k = qk(d=d)
            cos, sin = tables(B, S, d)
            for e, a in zip(hf_apply(q, k, cos, sin), compiled(q, k, cos, sin)):
                self.assertLessEqual(rel_err(a, e), 1e-5)
        self.assertEqual(counters["fuse_plugin"]["rotary"], 2)  # one graph for both head dims
        torch._dynamo.reset()

    def test_chunk(self):
        x = qk()[0]
        cos, sin = tables(S, D)
        before, after, report = capture(single_chunk, x, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 mul(#0, #1)
4 chunk(#0, 2, -1)
5 getitem(#4, 0)
6 getitem(#4, 1)
7 neg(#6)
8 cat((#7, #5), -1)
9 mul(#8, #2)
10 add(#3, #9, 1)
11 output (#10)""")
        self.assertExpectedInline(after, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 fuse_plugin.rotary(#0, #1, #2, False, 16)
4 output (#3)""")
        self.assertEqual(check_parity(self, single_chunk, x, cos, sin), 1)

    def test_split_operands_swapped(self):
        x = qk()[0]
        cos, sin = tables(S, D)
        before, after, report = capture(single_split, x, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 split(#0, 8, -1)
4 getitem(#3, 0)
5 getitem(#3, 1)
6 neg(#5)
7 cat((#6, #4), -1)
8 mul(#7, #1)
9 mul(#2, #0)
10 add(#8, #9, 1)
11 output (#10)""")
        self.assertExpectedInline(after, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 fuse_plugin.rotary(#0, #2, #1, False, 16)
4 output (#3)""")
        self.assertEqual(check_parity(self, single_split, x, cos, sin), 1)

    def test_explicit_halves_half_width(self):
        x = qk()[0]
        cos, sin = tables(B, 1, S, D // 2)
        before, after, report = capture(explicit_halves, x, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (2, 1, 8, 8)
2 input (2, 1, 8, 8)
3 chunk(#0, 2, -1)
4 getitem(#3, 0)
5 getitem(#3, 1)
6 mul(#4, #1)
7 mul(#5, #2)
8 sub(#6, #7, 1)
9 mul(#5, #1)
10 mul(#4, #2)
11 add(#9, #10, 1)
12 cat((#8, #11), -1)
13 output (#12)""")
        self.assertExpectedInline(after, """\
0 input (2, 4, 8, 16)
1 input (2, 1, 8, 8)
2 input (2, 1, 8, 8)
3 fuse_plugin.rotary(#0, #1, #2, False, 16)
4 output (#3)""")
        self.assertEqual(check_parity(self, explicit_halves, x, cos, sin), 1)

    # ---------------------------------------------------------------------------------- partial
    def test_partial_rotary_first(self):
        x = qk()[0]
        cos, sin = tables(S, 8)
        before, after, report = capture(partial_rotary_first, x, cos, sin)
        self.assertExpectedInline(before, """\
0 input (8, 8)
1 input (2, 4, 8, 16)
2 input (8, 8)
3 getitem(#1, (Ellipsis, :8))
4 getitem(#1, (Ellipsis, 8:))
5 mul(#3, #0)
6 getitem(#3, (Ellipsis, :4))
7 getitem(#3, (Ellipsis, 4:))
8 neg(#7)
9 cat((#8, #6), -1)
10 mul(#9, #2)
11 add(#5, #10, 1)
12 cat((#11, #4), -1)
13 output (#12)""")
        self.assertExpectedInline(after, """\
0 input (8, 8)
1 input (2, 4, 8, 16)
2 input (8, 8)
3 fuse_plugin.rotary(#1, #0, #2, False, 8)
4 output (#3)""")
        self.assertExpectedInline(details(report), """rotate_half; rotary_dim=8; full-width cos/sin; partial: rotary_dim=8 of 16""")
        self.assertEqual(check_parity(self, partial_rotary_first, x, cos, sin), 1)

    def test_partial_pass_first_keeps_cat(self):
        x = qk()[0]
        cos, sin = tables(S, 8)
        before, after, report = capture(partial_pass_first, x, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 8)
2 input (8, 8)
3 getitem(#0, (Ellipsis, :8))
4 getitem(#0, (Ellipsis, 8:))
5 mul(#4, #1)
6 getitem(#4, (Ellipsis, :4))
7 getitem(#4, (Ellipsis, 4:))
8 neg(#7)
9 cat((#8, #6), -1)
10 mul(#9, #2)
11 add(#5, #10, 1)
12 cat((#3, #11), -1)
13 output (#12)""")
        self.assertExpectedInline(after, """\
0 input (2, 4, 8, 16)
1 input (8, 8)
2 input (8, 8)
3 getitem(#0, (Ellipsis, :8))
4 getitem(#0, (Ellipsis, 8:))
5 fuse_plugin.rotary(#4, #1, #2, False, 8)
6 cat((#3, #5), -1)
7 output (#6)""")
        self.assertExpectedInline(details(report), """rotate_half; rotary_dim=8; full-width cos/sin; pass-through first: the rotated slice is passed as a view, the cat kept""")
        self.assertEqual(check_parity(self, partial_pass_first, x, cos, sin), 1)

    # ------------------------------------------------------------------------------ interleaved
    def test_gptj_rotate_every_two(self):
        x = qk()[0].transpose(1, 2).contiguous()  # (B, S, H, D)
        sin, cos = tables(B, S, D // 2)
        before, after, report = capture(gptj_apply, x, sin, cos)
        self.assertExpectedInline(before, """\
0 input (2, 8, 8)
1 input (2, 8, 8)
2 input (2, 8, 4, 16)
3 getitem(#0, (:, :, None, :))
4 repeat_interleave(#3, 2, 3)
5 getitem(#1, (:, :, None, :))
6 repeat_interleave(#5, 2, 3)
7 mul(#2, #6)
8 getitem(#2, (:, :, :, ::2))
9 getitem(#2, (:, :, :, 1::2))
10 neg(#9)
11 stack((#10, #8), -1)
12 flatten(#11, -2, -1)
13 mul(#12, #4)
14 add(#7, #13, 1)
15 output (#14)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 8)
1 input (2, 8, 8)
2 input (2, 8, 4, 16)
3 getitem(#0, (:, :, None, :))
4 getitem(#1, (:, :, None, :))
5 fuse_plugin.rotary(#2, #4, #3, True, 16)
6 output (#5)""")
        self.assertEqual(check_parity(self, gptj_apply, x, sin, cos), 1)

    def test_gptj_partial(self):
        x = qk()[0].transpose(1, 2).contiguous()
        sin, cos = tables(B, S, 4)
        before, after, report = capture(gptj_partial, x, sin, cos)
        self.assertExpectedInline(before, """\
0 input (2, 8, 4)
1 input (2, 8, 4, 16)
2 input (2, 8, 4)
3 getitem(#1, (:, :, :, :8))
4 getitem(#1, (:, :, :, 8:))
5 getitem(#2, (:, :, None, :))
6 repeat_interleave(#5, 2, 3)
7 getitem(#0, (:, :, None, :))
8 repeat_interleave(#7, 2, 3)
9 mul(#3, #8)
10 getitem(#3, (:, :, :, ::2))
11 getitem(#3, (:, :, :, 1::2))
12 neg(#11)
13 stack((#12, #10), -1)
14 flatten(#13, -2, -1)
15 mul(#14, #6)
16 add(#9, #15, 1)
17 cat([#16, #4], -1)
18 output (#17)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 4)
1 input (2, 8, 4, 16)
2 input (2, 8, 4)
3 getitem(#2, (:, :, None, :))
4 getitem(#0, (:, :, None, :))
5 fuse_plugin.rotary(#1, #4, #3, True, 8)
6 output (#5)""")
        self.assertEqual(check_parity(self, gptj_partial, x, sin, cos), 1)

    def test_vllm_gptj_explicit_pairs(self):
        x = qk()[0].transpose(1, 2).contiguous()  # (B, S, H, D)
        cos_sin = torch.cat(tables(B, S, D // 2), dim=-1)
        before, after, report = capture(vllm_gptj, x, cos_sin)
        self.assertExpectedInline(before, """\
0 input (2, 8, 16)
1 input (2, 8, 4, 16)
2 chunk(#0, 2, -1)
3 getitem(#2, 0)
4 getitem(#2, 1)
5 unsqueeze(#3, -2)
6 unsqueeze(#4, -2)
7 getitem(#1, (Ellipsis, ::2))
8 getitem(#1, (Ellipsis, 1::2))
9 mul(#7, #5)
10 mul(#8, #6)
11 sub(#9, #10, 1)
12 mul(#8, #5)
13 mul(#7, #6)
14 add(#12, #13, 1)
15 stack((#11, #14), -1)
16 flatten(#15, -2, -1)
17 output (#16)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 16)
1 input (2, 8, 4, 16)
2 chunk(#0, 2, -1)
3 getitem(#2, 0)
4 getitem(#2, 1)
5 unsqueeze(#3, -2)
6 unsqueeze(#4, -2)
7 fuse_plugin.rotary(#1, #5, #6, True, 16)
8 output (#7)""")
        self.assertEqual(check_parity(self, vllm_gptj, x, cos_sin), 1)

    def test_cohere_interleaved_rotate_half(self):
        q, k = qk()
        cos, sin = tables(B, S, D)
        before, after, report = capture(cohere_apply, q, k, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 8, 16)
1 input (2, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 2, 8, 16)
4 getitem(#0, (Ellipsis, :8))
5 repeat_interleave(#4, 2, -1)
6 unsqueeze(#5, 1)
7 getitem(#1, (Ellipsis, :8))
8 repeat_interleave(#7, 2, -1)
9 unsqueeze(#8, 1)
10 mul(#2, #6)
11 getitem(#2, (Ellipsis, ::2))
12 getitem(#2, (Ellipsis, 1::2))
13 neg(#12)
14 stack([#13, #11], -1)
15 flatten(#14, -2, -1)
16 mul(#15, #9)
17 add(#10, #16, 1)
18 mul(#3, #6)
19 getitem(#3, (Ellipsis, ::2))
20 getitem(#3, (Ellipsis, 1::2))
21 neg(#20)
22 stack([#21, #19], -1)
23 flatten(#22, -2, -1)
24 mul(#23, #9)
25 add(#18, #24, 1)
26 output (#17, #25)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 16)
1 input (2, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 2, 8, 16)
4 getitem(#0, (Ellipsis, :8))
5 getitem(#1, (Ellipsis, :8))
6 unsqueeze(#4, 1)
7 unsqueeze(#5, 1)
8 fuse_plugin.rotary_qk(#2, #3, #6, #7, True, 16)
9 getitem(#8, 0)
10 getitem(#8, 1)
11 output (#9, #10)""")
        self.assertEqual(check_parity(self, cohere_apply, q, k, cos, sin, grad_args=(0, 1)), 2)

    def test_torchtune_reshape_pairs(self):
        x = qk()[0].transpose(1, 2).contiguous()
        cache = torch.stack(tables(S, D // 2), dim=-1)
        before, after, report = capture(torchtune_rope, x, cache)
        self.assertExpectedInline(before, """\
0 input (2, 8, 4, 16)
1 input (8, 8, 2)
2 float(#0)
3 reshape(#2, (2, 8, 4, -1, 2))
4 view(#1, (-1, 8, 1, 8, 2))
5 getitem(#3, (Ellipsis, 0))
6 getitem(#4, (Ellipsis, 0))
7 mul(#5, #6)
8 getitem(#3, (Ellipsis, 1))
9 getitem(#4, (Ellipsis, 1))
10 mul(#8, #9)
11 sub(#7, #10, 1)
12 getitem(#3, (Ellipsis, 1))
13 getitem(#4, (Ellipsis, 0))
14 mul(#12, #13)
15 getitem(#3, (Ellipsis, 0))
16 getitem(#4, (Ellipsis, 1))
17 mul(#15, #16)
18 add(#14, #17, 1)
19 stack([#11, #18], -1)
20 flatten(#19, 3, -1)
21 type_as(#20, #0)
22 output (#21)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 4, 16)
1 input (8, 8, 2)
2 view(#1, (-1, 8, 1, 8, 2))
3 getitem(#2, (Ellipsis, 0))
4 getitem(#2, (Ellipsis, 1))
5 fuse_plugin.rotary(#0, #3, #4, True, 16)
6 output (#5)""")
        self.assertEqual(check_parity(self, torchtune_rope, x, cache), 1)

    def test_torchtune_bf16(self):
        x = qk(torch.bfloat16)[0].transpose(1, 2).contiguous()
        cache = torch.stack(tables(S, D // 2), dim=-1)
        self.assertEqual(check_parity(self, torchtune_rope, x, cache, tol=1e-2), 1)

    def test_meta_complex_qk_pair(self):
        xq, xk = (t.transpose(1, 2).contiguous() for t in qk())
        before, after, report = capture(meta_apply, xq, xk, freqs_cis())
        self.assertExpectedInline(before, """\
0 input (2, 8, 4, 16)
1 input (2, 8, 2, 16)
2 input (8, 8)
3 float(#0)
4 reshape(#3, (2, 8, 4, -1, 2))
5 view_as_complex(#4)
6 float(#1)
7 reshape(#6, (2, 8, 2, -1, 2))
8 view_as_complex(#7)
9 view(#2, (1, 8, 1, 8))
10 mul(#5, #9)
11 view_as_real(#10)
12 flatten(#11, 3, -1)
13 mul(#8, #9)
14 view_as_real(#13)
15 flatten(#14, 3, -1)
16 type_as(#12, #0)
17 type_as(#15, #1)
18 output (#16, #17)""")
        self.assertExpectedInline(after, """\
0 input (2, 8, 4, 16)
1 input (2, 8, 2, 16)
2 input (8, 8)
3 view(#2, (1, 8, 1, 8))
4 view_as_real(#3)
5 getitem(#4, (Ellipsis, 0))
6 getitem(#4, (Ellipsis, 1))
7 fuse_plugin.rotary_qk(#0, #1, #5, #6, True, 16)
8 getitem(#7, 0)
9 getitem(#7, 1)
10 output (#8, #9)""")
        self.assertEqual(check_parity(self, meta_apply, xq, xk, freqs_cis(), grad_args=(0, 1)), 2)

    # ------------------------------------------------------------------------------- near misses
    def assert_untouched(self, fn, *args):
        before, after, report = capture(fn, *args)
        self.assertEqual(after, before)
        self.assertEqual(report.sites, [])
        return before, report

    def test_wrong_sign(self):
        x = qk()[0]
        before, report = self.assert_untouched(wrong_sign, x, *tables(S, D))
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 getitem(#0, (Ellipsis, :8))
4 getitem(#0, (Ellipsis, 8:))
5 mul(#0, #1)
6 neg(#4)
7 cat((#3, #6), -1)
8 mul(#7, #2)
9 add(#5, #8, 1)
10 output (#9)""")
        self.assertExpectedInline(reasons(report), """wrong sign: rotate_half is cat((-x2, x1)), here the second operand is negated""")

    def test_cos_sin_swapped_in_one_half(self):
        x = qk()[0]
        before, report = self.assert_untouched(swapped_halves_tables, x, *tables(S, D // 2))
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 8)
2 input (8, 8)
3 chunk(#0, 2, -1)
4 getitem(#3, 0)
5 getitem(#3, 1)
6 mul(#4, #1)
7 mul(#5, #2)
8 sub(#6, #7, 1)
9 mul(#5, #2)
10 mul(#4, #1)
11 add(#9, #10, 1)
12 cat((#8, #11), -1)
13 output (#12)""")
        self.assertExpectedInline(reasons(report), """the second part is not x2*cos + x1*sin with the first part's x1, x2, cos, sin (cos/sin swapped?)""")

    def test_cos_sin_swapped_trig(self):
        x = qk()[0]
        before, report = self.assert_untouched(swapped_trig, x, positions(), inv_freq())
        self.assertExpectedInline(before, """\
0 input (8,)
1 input (8,)
2 input (2, 4, 8, 16)
3 outer(#0, #1)
4 cat((#3, #3), -1)
5 sin(#4)
6 mul(#2, #5)
7 getitem(#2, (Ellipsis, :8))
8 getitem(#2, (Ellipsis, 8:))
9 neg(#8)
10 cat((#9, #7), -1)
11 cos(#4)
12 mul(#10, #11)
13 add(#6, #12, 1)
14 output (#13)""")
        self.assertExpectedInline(reasons(report), """cos/sin swapped: x is multiplied by a sin(...) table and its rotation by a cos(...) table""")

    def test_non_last_dim(self):
        x = qk()[0]
        cos, sin = tables(S, 1)
        before, report = self.assert_untouched(non_last_dim, x, cos, sin)
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 1)
2 input (8, 1)
3 getitem(#0, (Ellipsis, :4, :))
4 getitem(#0, (Ellipsis, 4:, :))
5 mul(#0, #1)
6 neg(#4)
7 cat((#6, #3), -2)
8 mul(#7, #2)
9 add(#5, #8, 1)
10 output (#9)""")
        self.assertExpectedInline(reasons(report), """the cat is not on the last dim""")

    def test_rotate_half_used_elsewhere(self):
        x = qk()[0]
        before, report = self.assert_untouched(rotate_used_elsewhere, x, *tables(S, D))
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 getitem(#0, (Ellipsis, :8))
4 getitem(#0, (Ellipsis, 8:))
5 neg(#4)
6 cat((#5, #3), -1)
7 mul(#0, #1)
8 mul(#6, #2)
9 add(#7, #8, 1)
10 output (#9, #6)""")
        self.assertExpectedInline(reasons(report), """rotate_half(x) is not used (only) as rotate_half(x) * sin""")

    def test_slices_not_at_half(self):
        x = qk()[0]
        before, report = self.assert_untouched(off_center_slices, x, *tables(S, D))
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 getitem(#0, (Ellipsis, :6))
4 getitem(#0, (Ellipsis, 6:))
5 mul(#0, #1)
6 neg(#4)
7 cat((#6, #3), -1)
8 mul(#7, #2)
9 add(#5, #8, 1)
10 output (#9)""")
        self.assertExpectedInline(reasons(report), """the halves are not split at D/2 (split at 6 of 16)""")

    def test_different_x(self):
        x, y = qk(d=D)[0], qk(d=D)[0] + 1
        before, report = self.assert_untouched(different_x, x, y, *tables(S, D))
        self.assertExpectedInline(before, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (2, 4, 8, 16)
3 input (8, 16)
4 mul(#0, #1)
5 getitem(#2, (Ellipsis, :8))
6 getitem(#2, (Ellipsis, 8:))
7 neg(#6)
8 cat((#7, #5), -1)
9 mul(#8, #3)
10 add(#4, #9, 1)
11 output (#10)""")
        self.assertExpectedInline(reasons(report), """x * cos multiplies a different tensor than the one rotate_half rotates""")

    def test_tables_that_broadcast_x(self):
        x = qk()[0][0]  # (H, S, D)
        before, report = self.assert_untouched(tables_broadcast_x, x, *tables(B, 1, S, D))
        self.assertExpectedInline(reasons(report), """cos/sin (2, 1, 8, 16) do not broadcast to x (4, 8, 16) channel-wise""")

    def test_learned_frequencies(self):
        x = qk()[0]
        freq = torch.nn.Parameter(inv_freq())
        before, report = self.assert_untouched(learned_frequencies, x, positions(), freq)
        self.assertExpectedInline(before, """\
0 input (8,)
1 input (8,)
2 input (2, 4, 8, 16)
3 outer(#0, #1)
4 cat((#3, #3), -1)
5 cos(#4)
6 mul(#2, #5)
7 getitem(#2, (Ellipsis, :8))
8 getitem(#2, (Ellipsis, 8:))
9 neg(#8)
10 cat((#9, #7), -1)
11 sin(#4)
12 mul(#10, #11)
13 add(#6, #12, 1)
14 output (#13)""")
        self.assertExpectedInline(reasons(report), """cos requires grad (learned frequencies): left to eager""")

    # ------------------------------------------------------------------------------- robustness
    def test_unrelated_cat_not_reported(self):
        def fn(a, b):
            return torch.cat((a, -b), dim=0) * 2

        _, _, report = capture(fn, torch.randn(3, 4), torch.randn(3, 4))
        self.assertEqual(report.misses, [])

    def test_matcher_error_becomes_miss(self):
        x = qk()[0]
        cos, sin = tables(S, D)
        original = rotary_patterns.complete

        def broken(core):
            raise RuntimeError("boom")

        rotary_patterns.complete = broken
        try:
            before, report = self.assert_untouched(single_chunk, x, cos, sin)
        finally:
            rotary_patterns.complete = original
        self.assertExpectedInline(reasons(report), """internal error while matching: RuntimeError: boom""")

    def test_replace_error_leaves_graph_valid(self):
        x = qk()[0]
        cos, sin = tables(S, D)
        original = rotary_patterns._ROTARY
        rotary_patterns._ROTARY = torch.ops.aten.sym_size.int  # fails on these arguments
        try:
            before, report = self.assert_untouched(single_chunk, x, cos, sin)
        finally:
            rotary_patterns._ROTARY = original
        self.assertEqual(len(report.misses), 1)
        self.assertIn("internal error while replacing", report.misses[0].reason)

    def test_counter_counts_each_rotated_tensor(self):
        # a q+k pair fused into one rotary_qk counts 2 (one per rotated tensor)
        q, k = qk()
        cos, sin = tables(B, S, D)
        torch._dynamo.reset()
        counters.clear()
        torch.compile(hf_apply, backend=rewrite_aot_eager)(q, k, cos, sin)
        self.assertEqual(counters["fuse_plugin"]["rotary"], 2)
        torch.compile(single_chunk, backend=rewrite_aot_eager)(q, *tables(S, D))
        self.assertEqual(counters["fuse_plugin"]["rotary"], 3)
        torch._dynamo.reset()

    def test_rotation_of_a_rotation(self):
        def twice(x, cos, sin):
            y = x * cos + rotate_half(x) * sin
            return y * cos + rotate_half(y) * sin

        x = qk()[0]
        cos, sin = tables(S, D)
        _, after, _ = capture(twice, x, cos, sin)
        self.assertExpectedInline(after, """\
0 input (2, 4, 8, 16)
1 input (8, 16)
2 input (8, 16)
3 fuse_plugin.rotary(#0, #1, #2, False, 16)
4 fuse_plugin.rotary(#3, #1, #2, False, 16)
5 output (#4)""")
        self.assertEqual(check_parity(self, twice, x, cos, sin), 2)


if __name__ == "__main__":
    expecttest.run_tests()
