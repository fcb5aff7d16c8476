"""Tests of the attention recogniser (fuse_plugin/patterns/attention.py).

* ExpectTests: the op listing of the Dynamo graph before and after the rewrite, and the report,
  for each spelling the recogniser must match and each near miss it must leave alone
  (regenerate with EXPECTTEST_ACCEPT=1).
* Parity: compiled (our rewrite + AOTAutograd with eager kernels) against eager, outputs and all
  gradients, for each spelling in fp32 and a sample in fp16/bf16; dynamic sequence length.
* End to end: a tiny Llama-style decoder trains 3 steps with the backend and matches eager; it
  compiles with fullgraph=True and a dynamic sequence length without recompiling.
"""
import copy
import math
import re

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fuse_plugin  # noqa: F401  (registers the ops)
from helpers import capture, rel_err, rewrite_aot_eager
from models_plain import AttnModule, AttnSpec, TinyLlama, _clone, compare_compiled, make_inputs

B, H, L, D = 2, 4, 8, 16
FMIN = torch.finfo(torch.float32).min


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def qkv(lq=L, lk=L, h=H, hkv=None):
    return randn(B, h, lq, D), randn(B, hkv or h, lk, D), randn(B, hkv or h, lk, D)


def padding_mask(lk=L, value=FMIN):
    """(B, 1, 1, Lk) additive: the last keys of batch 1 masked."""
    m = torch.zeros(B, 1, 1, lk)
    m[1, ..., lk - 3:] = value
    return m


def _normalise_symbols(text: str) -> str:
    """SymInt names (s0, s77, ...) differ between torch versions: number them by first use."""
    names: dict = {}
    return re.sub(r"\bs\d+\b", lambda m: names.setdefault(m.group(0), f"S{len(names)}"), text)


def rewrite_listing(fn, *args, dynamic=None) -> str:
    """Op listing before and after the rewrite, and what the report says about attention."""
    before, after, report = capture(fn, *args, dynamic=dynamic)
    lines = [f"fused: {s.detail}" for s in report.sites if s.kind == "attention"]
    lines += [f"not fused: {m.reason}" for m in report.misses if m.kind == "attention"]
    if before == after:
        text = f"{before}\n--- after: unchanged ---\n" + "\n".join(lines)
    else:
        text = f"{before}\n--- after ---\n{after}\n--- report ---\n" + "\n".join(lines)
    return _normalise_symbols(text)


def repeat_kv(x, n):
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, l, d).reshape(b, h * n, l, d)


class ExpectTests(expecttest.TestCase):
    maxDiff = None

    # ------------------------------------------------------------------ products and kᵀ
    def test_matmul_transpose_div_sqrt(self):
        def f(q, k, v):
            w = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            return torch.matmul(F.softmax(w, dim=-1), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 div(#4, 4, None)
6 softmax(#5, -1, 3, None)
7 matmul(#6, #2)
8 output (#7)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#1, #0, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")

    def test_at_transpose23_mul(self):
        def f(q, k, v):
            w = q @ k.transpose(2, 3) * 0.125
            return torch.softmax(w, -1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, 2, 3)
4 matmul(#1, #3)
5 mul(#4, 0.125)
6 softmax(#5, -1, None)
7 matmul(#6, #2)
8 output (#7)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#1, #0, #2, None, 0, False, 0.125, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.125""")

    def test_method_mT_neg_pow_softmax_f32(self):
        def f(q, k, v):
            w = q.matmul(k.mT) * q.size(-1) ** -0.5
            w = w.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            return w.matmul(v)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 getattr(#1, 'mT')
4 matmul(#0, #3)
5 mul(#4, 0.25)
6 softmax(#5, -1, float32)
7 to(#6, (float32))
8 matmul(#7, #2)
9 output (#8)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")

    def test_permute_scale_split_over_q_and_k(self):
        def f(q, k, v):
            d = q.size(-1)
            w = torch.matmul(q * d ** -0.25, k.permute(0, 1, 3, 2) * d ** -0.25)
            w = F.softmax(w.float(), dim=-1).type_as(w)
            return torch.matmul(w, v)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 mul(#0, 0.5)
4 permute(#1, (0, 1, 3, 2))
5 mul(#4, 0.5)
6 matmul(#3, #5)
7 float(#6)
8 softmax(#7, -1, 3, None)
9 type_as(#8, #6)
10 matmul(#9, #2)
11 output (#10)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")

    def test_k_pre_transposed(self):
        def f(q, kt, v):  # kt: (B, H, D, Lk)
            return F.softmax(q @ kt / q.size(-1) ** 0.5, dim=-1) @ v

        q, k, v = qkv()
        self.assertExpectedInline(rewrite_listing(f, q, k.transpose(-2, -1).contiguous(), v), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 16, 8)
2 input (2, 4, 8, 16)
3 matmul(#0, #1)
4 div(#3, 4, None)
5 softmax(#4, -1, 3, None)
6 matmul(#5, #2)
7 output (#6)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 16, 8)
2 input (2, 4, 8, 16)
3 transpose(#1, -2, -1)
4 fuse_plugin.attention(#0, #3, #2, None, 0, False, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25""")

    def test_bmm_3d(self):
        def f(q, k, v):
            b, h, l, d = q.shape
            q3, k3, v3 = q.reshape(b * h, l, d), k.reshape(b * h, l, d), v.reshape(b * h, l, d)
            w = torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d)
            return torch.bmm(w.softmax(dim=-1), v3).view(b, h, l, d)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 reshape(#0, (8, 8, 16))
4 reshape(#1, (8, 8, 16))
5 reshape(#2, (8, 8, 16))
6 transpose(#4, 1, 2)
7 bmm(#3, #6)
8 div(#7, 4, None)
9 softmax(#8, -1, None)
10 bmm(#9, #5)
11 view(#10, (2, 4, 8, 16))
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 reshape(#0, (8, 8, 16))
4 reshape(#1, (8, 8, 16))
5 reshape(#2, (8, 8, 16))
6 unsqueeze(#3, 0)
7 unsqueeze(#4, 0)
8 unsqueeze(#5, 0)
9 fuse_plugin.attention(#6, #7, #8, None, 0, False, 0.25, need_lse=False)
10 getitem(#9, 0)
11 squeeze(#10, 0)
12 contiguous(#11)
13 view(#12, (2, 4, 8, 16))
14 output (#13)
--- report ---
fused: scale=0.25, 3-D""")

    def test_baddbmm_merged_heads_split_again(self):
        def f(q, k, v, mask):  # HF GPT-2 with reorder_and_upcast_attn=True
            b, h, lq, d = q.shape
            lk = k.shape[-2]
            w = torch.empty(b * h, lq, lk, dtype=torch.float32)
            q3, kt3 = q.reshape(-1, lq, d), k.transpose(-1, -2).reshape(-1, d, lk)
            w = torch.baddbmm(w, q3.float(), kt3.float(), beta=0, alpha=0.25)
            w = w.reshape(b, h, lq, lk) + mask
            return torch.matmul(F.softmax(w, dim=-1).type(v.dtype), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv(), padding_mask()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 empty(8, 8, 8, dtype=float32)
5 reshape(#0, (-1, 8, 16))
6 transpose(#1, -1, -2)
7 reshape(#6, (-1, 16, 8))
8 float(#5)
9 float(#7)
10 baddbmm(#4, #8, #9, 0, 0.25)
11 reshape(#10, (2, 4, 8, 8))
12 add(#11, #2, 1)
13 softmax(#12, -1, 3, None)
14 type(#13, float32)
15 matmul(#14, #3)
16 output (#15)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 fuse_plugin.attention(#0, #1, #3, #2, 0, False, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, bias: additive mask""")

    def test_bmm_merged_heads_split_again(self):
        def f(q, k, v):  # scores of (B·H, L, D) views, split back into (B, H) for the 4-D rest
            b, h, l, d = q.shape
            w = torch.bmm(q.view(b * h, l, d), k.view(b * h, l, d).transpose(1, 2)).view(b, h, l, l)
            return torch.matmul(torch.softmax(w / 4.0, dim=-1), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 view(#0, (8, 8, 16))
4 view(#1, (8, 8, 16))
5 transpose(#4, 1, 2)
6 bmm(#3, #5)
7 view(#6, (2, 4, 8, 8))
8 div(#7, 4, None)
9 softmax(#8, -1, None)
10 matmul(#9, #2)
11 output (#10)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")

    def test_einsum(self):
        def f(q, k, v):
            w = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
            return torch.einsum("bhqk,bhkd->bhqd", w.softmax(-1), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 einsum('bhqd,bhkd->bhqk', (#0, #1))
4 mul(#3, 0.25)
5 softmax(#4, -1, None)
6 einsum('bhqk,bhkd->bhqd', (#5, #2))
7 output (#6)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")

    def test_scale_tensor_and_no_scale(self):
        def f(q, k, v):
            w = q @ k.transpose(-2, -1) / torch.tensor(4.0)
            return F.softmax(w, dim=-1) @ v

        def t5(q, k, v):  # T5: no scale
            return F.softmax(q @ k.transpose(3, 2), dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 tensor(4)
6 div(#4, #5, None)
7 softmax(#6, -1, 3, None)
8 matmul(#7, #2)
9 output (#8)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#1, #0, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")
        self.assertExpectedInline(rewrite_listing(t5, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, 3, 2)
4 matmul(#1, #3)
5 softmax(#4, -1, 3, None)
6 matmul(#5, #2)
7 output (#6)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#1, #0, #2, None, 0, False, 1, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=1""")

    def test_learned_temperature_scales_q(self):
        def f(q, k, v, temperature):  # a 0-d tensor known only at run time: applied to q
            return F.softmax(q @ k.transpose(-2, -1) * temperature, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(), torch.tensor(0.3)), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input ()
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, #2)
7 softmax(#6, -1, 3, None)
8 matmul(#7, #3)
9 output (#8)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input ()
3 input (2, 4, 8, 16)
4 mul(#1, #2)
5 fuse_plugin.attention(#4, #0, #3, None, 0, False, 1, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=1, run-time scale applied to q""")

    # ------------------------------------------------------------------ masks
    def test_additive_padding_mask(self):
        def f(q, k, v, mask):
            w = q @ k.transpose(-2, -1) / math.sqrt(D) + mask
            return F.softmax(w, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(), padding_mask()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 div(#5, 4, None)
7 add(#6, #2, 1)
8 softmax(#7, -1, 3, None)
9 matmul(#8, #3)
10 output (#9)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 fuse_plugin.attention(#1, #0, #3, #2, 0, False, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, bias: additive mask""")

    def test_hf_padding_mask_given_per_key(self):
        """HF's BERT-style padding mask (transformers' sdpa/eager mask functions): the query term
        `(arange(L) + 0 >= 0)` is True everywhere, so the (B, 1, L, L) mask is the padding row
        broadcast; the op is given where(pad, 0, min) at (B, 1, 1, L), which the kernels read one
        value per key."""
        def f(q, k, v, attention_mask):
            qi = (torch.arange(L) + 0)[None, None, :, None]
            ki = torch.arange(L)[None, None, None, :]
            bi = torch.arange(B)[:, None, None, None]
            keep = qi.new_ones((), dtype=torch.bool) & (qi >= 0)
            keep = keep & attention_mask.to(torch.bool)[bi, ki]
            mask = torch.where(keep.expand(B, -1, L, L), torch.zeros(()), torch.finfo(torch.float32).min)
            w = q @ k.transpose(-2, -1) * 0.25 + mask
            return F.softmax(w, dim=-1) @ v

        pad = torch.ones(B, L, dtype=torch.long)
        pad[1, 5:] = 0
        _, after, report = capture(f, *qkv(), pad)
        op = [line for line in after.splitlines() if "fuse_plugin.attention" in line][0]
        bias = re.search(r"attention\(#\d+, #\d+, #\d+, #(\d+)", op).group(1)
        line = [x for x in after.splitlines() if x.startswith(f"{bias} ")][0]
        self.assertTrue(line.startswith(f"{bias} where("), line)
        self.assertIn("additive mask, per key", report.sites[0].detail)
        x = qkv()
        got = torch.compile(f, backend=rewrite_aot_eager)(*x, pad)  # same values as eager
        torch._dynamo.reset()
        torch.testing.assert_close(got, f(*x, pad))

    def test_hf_padding_mask_near_miss_keeps_the_full_mask(self):
        """Near miss: `arange(L) >= 1` is False on query 0, so the mask varies over the queries:
        the op is given the (B, 1, L, L) mask itself."""
        def f(q, k, v, attention_mask):
            qi = torch.arange(L)[None, None, :, None]
            keep = (qi >= 1) & attention_mask.to(torch.bool)[:, None, None, :]
            mask = torch.where(keep.expand(B, -1, L, L), torch.zeros(()), torch.finfo(torch.float32).min)
            w = q @ k.transpose(-2, -1) * 0.25 + mask
            return F.softmax(w, dim=-1) @ v

        _, _, report = capture(f, *qkv(), torch.ones(B, L, dtype=torch.long))
        self.assertEqual(len(report.sites), 1)
        self.assertIn("bias: additive mask", report.sites[0].detail)
        self.assertNotIn("per key", report.sites[0].detail)

        def g(q, k, v, query_mask):  # constant over the keys: narrower, but not per key
            keep = query_mask.to(torch.bool)[:, None, :, None]
            mask = torch.where(keep.expand(B, -1, L, L), torch.zeros(()), torch.finfo(torch.float32).min)
            w = q @ k.transpose(-2, -1) * 0.25 + mask
            return F.softmax(w, dim=-1) @ v

        before, after, report = capture(g, *qkv(), torch.ones(B, L, dtype=torch.long))
        self.assertNotIn("per key", report.sites[0].detail)
        self.assertEqual(before.count(" where("), after.count(" where("))  # no node left behind

    def test_hf_sliced_mask(self):
        def f(q, k, v, causal_mask):
            w = torch.matmul(q, k.transpose(2, 3)) * 0.25
            w = w + causal_mask[:, :, :, : k.shape[-2]]
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(w, v)

        mask = torch.randn(B, 1, L, L + 4)
        self.assertExpectedInline(rewrite_listing(f, *qkv(), mask), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 12)
3 input (2, 4, 8, 16)
4 transpose(#0, 2, 3)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 getitem(#2, (:, :, :, :8))
8 add(#6, #7, 1)
9 softmax(#8, -1, 3, float32)
10 to(#9, (float32))
11 matmul(#10, #3)
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 12)
3 input (2, 4, 8, 16)
4 getitem(#2, (:, :, :, :8))
5 fuse_plugin.attention(#1, #0, #3, #4, 0, False, 0.25, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=0.25, bias: additive mask""")

    def test_masked_fill_eq0_inf_is_bool_mask(self):
        def f(q, k, v, mask):
            w = q @ k.transpose(-2, -1) * 0.25
            w = w.masked_fill(mask == 0, float("-inf"))
            return F.softmax(w, dim=-1) @ v

        mask = torch.ones(B, 1, 1, L, dtype=torch.long)
        self.assertExpectedInline(rewrite_listing(f, *qkv(), mask), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 eq(#2, 0)
8 masked_fill(#6, #7, -inf)
9 softmax(#8, -1, 3, None)
10 matmul(#9, #3)
11 output (#10)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 eq(#2, 0)
5 logical_not(#4)
6 fuse_plugin.attention(#1, #0, #3, #5, 0, False, 0.25, need_lse=False)
7 getitem(#6, 0)
8 contiguous(#7)
9 output (#8)
--- report ---
fused: scale=0.25, bias: bool mask""")

    def test_masked_fill_finfo_min_is_float_mask(self):
        def f(q, k, v, masked):
            w = q @ k.transpose(-2, -1) * 0.25
            w = w.masked_fill(masked, torch.finfo(w.dtype).min)
            return F.softmax(w, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(), torch.zeros(B, 1, L, L, dtype=torch.bool)), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 masked_fill(#6, #2, -3.40282e+38)
8 softmax(#7, -1, 3, None)
9 matmul(#8, #3)
10 output (#9)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 8)
3 input (2, 4, 8, 16)
4 where(#2, -3.40282e+38, 0)
5 fuse_plugin.attention(#1, #0, #3, #4, 0, False, 0.25, replace=#2, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=0.25, bias: float mask, replace mask (finite fill)""")

    def test_where_finfo_min_and_where_inf(self):
        def f(q, k, v, keep):
            w = torch.where(keep, q @ k.transpose(-2, -1) * 0.25, torch.finfo(q.dtype).min)
            return F.softmax(w, dim=-1) @ v

        def g(q, k, v, keep):
            w = torch.where(keep, q @ k.transpose(-2, -1) * 0.25, float("-inf"))
            return F.softmax(w, dim=-1) @ v

        keep = torch.ones(B, 1, L, L, dtype=torch.bool)
        self.assertExpectedInline(rewrite_listing(f, *qkv(), keep), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 where(#2, #6, -3.40282e+38)
8 softmax(#7, -1, 3, None)
9 matmul(#8, #3)
10 output (#9)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 8)
3 input (2, 4, 8, 16)
4 where(#2, 0, -3.40282e+38)
5 logical_not(#2)
6 fuse_plugin.attention(#1, #0, #3, #4, 0, False, 0.25, replace=#5, need_lse=False)
7 getitem(#6, 0)
8 contiguous(#7)
9 output (#8)
--- report ---
fused: scale=0.25, bias: float mask, replace mask (finite fill)""")
        self.assertExpectedInline(rewrite_listing(g, *qkv(), keep), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 where(#2, #6, -inf)
8 softmax(#7, -1, 3, None)
9 matmul(#8, #3)
10 output (#9)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 8, 8)
3 input (2, 4, 8, 16)
4 fuse_plugin.attention(#1, #0, #3, #2, 0, False, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, bias: bool mask""")

    # ------------------------------------------------------------------ causal masks → is_causal
    def test_causal_tril_ones(self):
        def f(q, k, v):
            l = q.shape[2]
            causal = torch.tril(torch.ones(l, l))
            w = (q @ k.transpose(-2, -1) * 0.25).masked_fill(causal == 0, float("-inf"))
            return F.softmax(w, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 ones(8, 8)
4 tril(#3, 0)
5 transpose(#1, -2, -1)
6 matmul(#0, #5)
7 mul(#6, 0.25)
8 eq(#4, 0)
9 masked_fill(#7, #8, -inf)
10 softmax(#9, -1, 3, None)
11 matmul(#10, #2)
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, True, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25, is_causal (tril/triu mask)""")

    def test_causal_arange_hf_style(self):
        def f(q, k, v):
            lq, lk = q.shape[2], k.shape[2]
            keep = torch.arange(lk)[None, :] <= torch.arange(lq).view(-1, 1)
            mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)[None, None]
            w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
            return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 arange(8)
4 getitem(#3, (None, :))
5 arange(8)
6 view(#5, (-1, 1))
7 le(#4, #6)
8 where(#7, 0, -3.40282e+38)
9 getitem(#8, (None, None))
10 transpose(#1, 2, 3)
11 matmul(#0, #10)
12 mul(#11, 0.25)
13 add(#12, #9, 1)
14 softmax(#13, -1, 3, float32)
15 to(#14, (float32))
16 matmul(#15, #2)
17 output (#16)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, True, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25, is_causal (arange comparison)""")

    def test_causal_triu_of_full(self):
        def f(q, k, v):
            l = q.shape[2]
            mask = torch.full((l, l), float("-inf")).triu(1)
            return F.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 full((8, 8), -inf)
4 triu(#3, 1)
5 transpose(#1, -2, -1)
6 matmul(#0, #5)
7 mul(#6, 0.25)
8 add(#7, #4, 1)
9 softmax(#8, -1, 3, None)
10 matmul(#9, #2)
11 output (#10)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#0, #1, #2, None, 0, True, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25, is_causal (tril/triu mask)""")

    def test_causal_registered_buffer_sliced(self):
        class GPT2Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16), persistent=False)

            def forward(self, q, k, v):
                t = q.shape[2]
                w = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(k.size(-1)))
                w = w.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
                return F.softmax(w, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(GPT2Attention(), *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (1, 1, 16, 16)
3 input (2, 4, 8, 16)
4 transpose(#1, -2, -1)
5 matmul(#0, #4)
6 mul(#5, 0.25)
7 getitem(#2, (:, :, :8, :8))
8 eq(#7, 0)
9 masked_fill(#6, #8, -inf)
10 softmax(#9, -1, 3, None)
11 matmul(#10, #3)
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (1, 1, 16, 16)
3 input (2, 4, 8, 16)
4 fuse_plugin.attention(#0, #1, #3, None, 0, True, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, is_causal (registered tril buffer, value read at compile time)""")

    def test_causal_buffer_not_tril_is_a_bool_mask(self):
        class Banded(nn.Module):
            def __init__(self):
                super().__init__()
                band = torch.ones(16, 16).tril() - torch.ones(16, 16).tril(-3)
                self.register_buffer("bias", band.view(1, 1, 16, 16), persistent=False)

            def forward(self, q, k, v):
                t = q.shape[2]
                w = (q @ k.transpose(-2, -1) * 0.25).masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
                return F.softmax(w, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(Banded(), *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (1, 1, 16, 16)
3 input (2, 4, 8, 16)
4 transpose(#1, -2, -1)
5 matmul(#0, #4)
6 mul(#5, 0.25)
7 getitem(#2, (:, :, :8, :8))
8 eq(#7, 0)
9 masked_fill(#6, #8, -inf)
10 softmax(#9, -1, 3, None)
11 matmul(#10, #3)
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (1, 1, 16, 16)
3 input (2, 4, 8, 16)
4 getitem(#2, (:, :, :8, :8))
5 eq(#4, 0)
6 logical_not(#5)
7 fuse_plugin.attention(#0, #1, #3, #6, 0, False, 0.25, need_lse=False)
8 getitem(#7, 0)
9 contiguous(#8)
10 output (#9)
--- report ---
fused: scale=0.25, bias: bool mask""")

    def test_causal_with_padding(self):
        def inf_fill(q, k, v, mask):  # causal filled with -inf: is_causal, padding as the bias
            l = q.shape[2]
            keep = torch.ones(l, l, dtype=torch.bool).tril()
            w = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")) + mask
            return F.softmax(w, dim=-1) @ v

        def gpt2(q, k, v, mask):  # finfo.min fill + additive padding: the op's replace mask (test_replace_mask.py)
            l = q.shape[2]
            keep = torch.ones(l, l, dtype=torch.bool).tril()
            w = q @ k.transpose(-2, -1) * 0.25
            w = torch.where(keep, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype)) + mask
            return F.softmax(w, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(inf_fill, *qkv(), padding_mask()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 ones(8, 8, dtype=bool)
5 tril(#4, 0)
6 transpose(#1, -2, -1)
7 matmul(#0, #6)
8 mul(#7, 0.25)
9 invert(#5)
10 masked_fill(#8, #9, -inf)
11 add(#10, #2, 1)
12 softmax(#11, -1, 3, None)
13 matmul(#12, #3)
14 output (#13)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 fuse_plugin.attention(#0, #1, #3, #2, 0, True, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, is_causal (tril/triu mask), bias: additive mask""")
        self.assertExpectedInline(rewrite_listing(gpt2, *qkv(), padding_mask()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 ones(8, 8, dtype=bool)
5 tril(#4, 0)
6 transpose(#1, -2, -1)
7 matmul(#0, #6)
8 mul(#7, 0.25)
9 full([], -3.40282e+38, dtype=float32)
10 where(#5, #8, #9)
11 add(#10, #2, 1)
12 softmax(#11, -1, 3, None)
13 matmul(#12, #3)
14 output (#13)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 ones(8, 8, dtype=bool)
5 tril(#4, 0)
6 where(#5, 0, -3.40282e+38)
7 add(#6, #2, 1)
8 logical_not(#5)
9 fuse_plugin.attention(#0, #1, #3, #7, 0, False, 0.25, replace=#8, need_lse=False)
10 getitem(#9, 0)
11 contiguous(#10)
12 output (#11)
--- report ---
fused: scale=0.25, bias: float mask, replace mask (finite fill), causal mask (tril/triu mask) kept in the bias with its own values: is_causal's -inf masking would change rows masked everywhere""")

    def test_bottom_right_causal_is_not_is_causal(self):
        def f(q, k, v):  # a KV-cache step: query i sees keys <= i + (Lk - Lq)
            lq, lk = q.shape[2], k.shape[2]
            keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(lq=4, lk=8)), """\
0 input (2, 4, 4, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 arange(8)
4 getitem(#3, (None, :))
5 arange(4)
6 getitem(#5, (:, None))
7 add(#6, 4, 1)
8 le(#4, #7)
9 transpose(#1, -2, -1)
10 matmul(#0, #9)
11 mul(#10, 0.25)
12 invert(#8)
13 masked_fill(#11, #12, -inf)
14 softmax(#13, -1, 3, None)
15 matmul(#14, #2)
16 output (#15)
--- after ---
0 input (2, 4, 4, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 arange(8)
4 getitem(#3, (None, :))
5 arange(4)
6 getitem(#5, (:, None))
7 add(#6, 4, 1)
8 le(#4, #7)
9 fuse_plugin.attention(#0, #1, #2, #8, 0, False, 0.25, need_lse=False)
10 getitem(#9, 0)
11 contiguous(#10)
12 output (#11)
--- report ---
fused: scale=0.25, bias: bool mask""")

    def test_t5_position_bias(self):
        class T5Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.rel = nn.Embedding(32, H)

            def forward(self, q, k, v, mask):
                lq = q.shape[2]
                rel = torch.arange(lq)[None, :] - torch.arange(lq)[:, None]
                position_bias = self.rel(rel.clamp(-15, 15) + 16).permute(2, 0, 1).unsqueeze(0) + mask
                scores = torch.matmul(q, k.transpose(3, 2))
                scores += position_bias
                w = F.softmax(scores.float(), dim=-1).type_as(scores)
                w = F.dropout(w, p=0.1, training=self.training)
                return torch.matmul(w, v)

        self.assertExpectedInline(rewrite_listing(T5Attention().eval(), *qkv(), padding_mask()), """\
0 input (2, 4, 8, 16)
1 input (32, 4)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 input (2, 4, 8, 16)
5 arange(8)
6 getitem(#5, (None, :))
7 arange(8)
8 getitem(#7, (:, None))
9 sub(#6, #8, 1)
10 clamp(#9, -15, 15)
11 add(#10, 16, 1)
12 embedding(#11, #1, None, None, 2, False, False)
13 permute(#12, (2, 0, 1))
14 unsqueeze(#13, 0)
15 add(#14, #2, 1)
16 transpose(#3, 3, 2)
17 matmul(#0, #16)
18 iadd(#17, #15)
19 float(#18)
20 softmax(#19, -1, 3, None)
21 type_as(#20, #18)
22 dropout(#21, 0.1, False, False)
23 matmul(#22, #4)
24 output (#23)
--- after ---
0 input (2, 4, 8, 16)
1 input (32, 4)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 input (2, 4, 8, 16)
5 arange(8)
6 getitem(#5, (None, :))
7 arange(8)
8 getitem(#7, (:, None))
9 sub(#6, #8, 1)
10 clamp(#9, -15, 15)
11 add(#10, 16, 1)
12 embedding(#11, #1, None, None, 2, False, False)
13 permute(#12, (2, 0, 1))
14 unsqueeze(#13, 0)
15 add(#14, #2, 1)
16 fuse_plugin.attention(#0, #3, #4, #15, 0, False, 1)
17 getitem(#16, 0)
18 contiguous(#17)
19 output (#18)
--- report ---
fused: scale=1, bias: additive mask""")

    # ------------------------------------------------------------------ dropout, GQA, layouts
    def test_dropout_p0_and_eval(self):
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.drop = nn.Dropout(0.0)

            def forward(self, q, k, v):
                w = self.drop(F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1))
                return F.dropout(w, 0.1, training=False) @ v

        self.assertExpectedInline(rewrite_listing(M().train(), *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 mul(#4, 0.25)
6 softmax(#5, -1, 3, None)
7 dropout(#6, 0, True, False)
8 dropout(#7, 0.1, False, False)
9 matmul(#8, #2)
10 output (#9)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#1, #0, #2, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25""")

    def test_gqa_repeat_kv(self):
        def f(q, k, v):
            k, v = repeat_kv(k, 2), repeat_kv(v, 2)
            w = torch.matmul(q, k.transpose(2, 3)) * 0.25
            return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv(hkv=2)), """\
0 input (2, 2, 8, 16)
1 input (2, 2, 8, 16)
2 input (2, 4, 8, 16)
3 getitem(#0, (:, :, None, :, :))
4 expand(#3, (2, 2, 2, 8, 16))
5 reshape(#4, (2, 4, 8, 16))
6 getitem(#1, (:, :, None, :, :))
7 expand(#6, (2, 2, 2, 8, 16))
8 reshape(#7, (2, 4, 8, 16))
9 transpose(#5, 2, 3)
10 matmul(#2, #9)
11 mul(#10, 0.25)
12 softmax(#11, -1, 3, float32)
13 to(#12, (float32))
14 matmul(#13, #8)
15 output (#14)
--- after ---
0 input (2, 2, 8, 16)
1 input (2, 2, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#2, #0, #1, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25, GQA: k/v un-repeated (2 q heads per kv head)""")

    def test_gqa_repeat_interleave(self):
        def f(q, k, v):
            k, v = k.repeat_interleave(2, dim=1), torch.repeat_interleave(v, 2, dim=1)
            return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(hkv=2)), """\
0 input (2, 2, 8, 16)
1 input (2, 2, 8, 16)
2 input (2, 4, 8, 16)
3 repeat_interleave(#0, 2, 1)
4 repeat_interleave(#1, 2, 1)
5 transpose(#3, -2, -1)
6 matmul(#2, #5)
7 mul(#6, 0.25)
8 softmax(#7, -1, 3, None)
9 matmul(#8, #4)
10 output (#9)
--- after ---
0 input (2, 2, 8, 16)
1 input (2, 2, 8, 16)
2 input (2, 4, 8, 16)
3 fuse_plugin.attention(#2, #0, #1, None, 0, False, 0.25, need_lse=False)
4 getitem(#3, 0)
5 contiguous(#4)
6 output (#5)
--- report ---
fused: scale=0.25, GQA: k/v un-repeated (2 q heads per kv head)""")

    def test_layouts_view_transpose_and_permute(self):
        def f(x, y, z):  # x: (B, L, H*D); y, z: (B, L, H, D)
            b, l, _ = x.shape
            q = x.view(b, l, H, D).transpose(1, 2)
            k, v = y.permute(0, 2, 1, 3), z.permute(0, 2, 1, 3).contiguous()
            o = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v
            return o.transpose(1, 2).reshape(b, l, H * D)

        self.assertExpectedInline(rewrite_listing(f, randn(B, L, H * D), randn(B, L, H, D), randn(B, L, H, D)), """\
0 input (2, 8, 64)
1 input (2, 8, 4, 16)
2 input (2, 8, 4, 16)
3 view(#0, (2, 8, 4, 16))
4 transpose(#3, 1, 2)
5 permute(#1, (0, 2, 1, 3))
6 permute(#2, (0, 2, 1, 3))
7 contiguous(#6)
8 transpose(#5, -2, -1)
9 matmul(#4, #8)
10 mul(#9, 0.25)
11 softmax(#10, -1, 3, None)
12 matmul(#11, #7)
13 transpose(#12, 1, 2)
14 reshape(#13, (2, 8, 64))
15 output (#14)
--- after ---
0 input (2, 8, 64)
1 input (2, 8, 4, 16)
2 input (2, 8, 4, 16)
3 view(#0, (2, 8, 4, 16))
4 transpose(#3, 1, 2)
5 permute(#1, (0, 2, 1, 3))
6 permute(#2, (0, 2, 1, 3))
7 contiguous(#6)
8 fuse_plugin.attention(#4, #5, #7, None, 0, False, 0.25, need_lse=False)
9 getitem(#8, 0)
10 transpose(#9, 1, 2)
11 reshape(#10, (2, 8, 64))
12 output (#11)
--- report ---
fused: scale=0.25""")

    # ------------------------------------------------------------------ dynamic shapes
    def test_dynamic_sequence_length(self):
        def f(q, k, v):
            l = q.shape[2]
            keep = torch.ones(l, l, dtype=torch.bool).tril()
            w = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~keep, float("-inf"))
            return F.softmax(w, dim=-1) @ v

        q, k, v = qkv()
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        self.assertExpectedInline(rewrite_listing(f, q, k, v), """\
0 input
1 input (2, 4, S0, 16)
2 input
3 input (2, 4, S0, 16)
4 input (2, 4, S0, 16)
5 ones(#0, #0, dtype=bool)
6 tril(#5, 0)
7 transpose(#3, -2, -1)
8 matmul(#1, #7)
9 div(#8, 4, None)
10 invert(#6)
11 masked_fill(#9, #10, -inf)
12 softmax(#11, -1, 3, None)
13 matmul(#12, #4)
14 output (#13)
--- after ---
0 input
1 input (2, 4, S0, 16)
2 input
3 input (2, 4, S0, 16)
4 input (2, 4, S0, 16)
5 fuse_plugin.attention(#1, #3, #4, None, 0, True, 0.25, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=0.25, is_causal (tril/triu mask)""")

    def test_dynamic_all_dims_symbolic_scale(self):
        def f(q, k, v):
            return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(), dynamic=True), """\
0 input
1 input
2 input
3 input
4 input (S0, S1, S2, S3)
5 input (S0, S1, S2, S3)
6 input (S0, S1, S2, S3)
7 transpose(#4, -2, -1)
8 matmul(#5, #7)
9 _sym_sqrt(#3)
10 div(#8, #9, None)
11 softmax(#10, -1, 3, None)
12 matmul(#11, #6)
13 output (#12)
--- after ---
0 input
1 input
2 input
3 input
4 input (S0, S1, S2, S3)
5 input (S0, S1, S2, S3)
6 input (S0, S1, S2, S3)
7 _sym_sqrt(#3)
8 div(#5, #7, None)
9 fuse_plugin.attention(#8, #4, #6, None, 0, False, 1, need_lse=False)
10 getitem(#9, 0)
11 contiguous(#10)
12 output (#11)
--- report ---
fused: scale=1, run-time scale applied to q""")

    # ------------------------------------------------------------------ must not rewrite
    def test_negative_softmax_not_last_dim(self):
        def f(q, k, v):
            return F.softmax(q @ k.transpose(-2, -1), dim=-2) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 softmax(#4, -2, 3, None)
6 matmul(#5, #2)
7 output (#6)
--- after: unchanged ---
not fused: softmax over dim -2, not the last dim""")

    def test_k_permuted_0231(self):
        def f(q, k, v):  # k (B, L, H, D) permuted (0, 2, 3, 1): kᵀ given (pytorch#195320 misread it)
            return F.softmax(q @ k.permute(0, 2, 3, 1) * 0.25, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, randn(B, H, L, D), randn(B, L, H, D), randn(B, H, L, D)), """\
0 input (2, 8, 4, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 permute(#0, (0, 2, 3, 1))
4 matmul(#1, #3)
5 mul(#4, 0.25)
6 softmax(#5, -1, 3, None)
7 matmul(#6, #2)
8 output (#7)
--- after ---
0 input (2, 8, 4, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 permute(#0, (0, 2, 3, 1))
4 transpose(#3, -2, -1)
5 fuse_plugin.attention(#1, #4, #2, None, 0, False, 0.25, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=0.25""")

    def test_k_transposed_other_dims(self):
        def f(q, k, v):  # k (B, D, H, L): transpose(1, 2) gives kᵀ (B, H, D, L), taken as given
            return F.softmax(q @ k.transpose(1, 2), dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, randn(B, H, L, D), randn(B, D, H, L), randn(B, H, L, D)), """\
0 input (2, 16, 4, 8)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, 1, 2)
4 matmul(#1, #3)
5 softmax(#4, -1, 3, None)
6 matmul(#5, #2)
7 output (#6)
--- after ---
0 input (2, 16, 4, 8)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, 1, 2)
4 transpose(#3, -2, -1)
5 fuse_plugin.attention(#1, #4, #2, None, 0, False, 1, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=1""")

    def test_negative_baddbmm_scales_its_input(self):
        def f(q, k, v, bias):  # beta=0.5: the baddbmm input is a scaled bias (beta=1, ALiBi: tests/test_spellings.py)
            b, h, l, d = q.shape
            w = torch.baddbmm(bias, q.reshape(-1, l, d), k.reshape(-1, l, d).transpose(1, 2), beta=0.5, alpha=0.25)
            return torch.matmul(F.softmax(w.view(b, h, l, l), dim=-1), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv(), randn(B * H, L, L)), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8, 8)
3 input (2, 4, 8, 16)
4 reshape(#0, (-1, 8, 16))
5 reshape(#1, (-1, 8, 16))
6 transpose(#5, 1, 2)
7 baddbmm(#2, #4, #6, 0.5, 0.25)
8 view(#7, (2, 4, 8, 8))
9 softmax(#8, -1, 3, None)
10 matmul(#9, #3)
11 output (#10)
--- after: unchanged ---
not fused: baddbmm with beta=0.5 scales the bias it adds""")

    def test_negative_merged_product_of_3d_inputs(self):
        def f(q3, k3, v):  # 3-D q, k that are no view of 4-D tensors: nothing to pass as 4-D q and k
            w = torch.bmm(q3, k3.transpose(1, 2)).view(B, H, L, L)
            return torch.matmul(F.softmax(w, dim=-1), v)

        self.assertExpectedInline(rewrite_listing(f, randn(B * H, L, D), randn(B * H, L, D), randn(B, H, L, D)), """\
0 input (8, 8, 16)
1 input (8, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, 1, 2)
4 bmm(#1, #3)
5 view(#4, (2, 4, 8, 8))
6 softmax(#5, -1, 3, None)
7 matmul(#6, #2)
8 output (#7)
--- after: unchanged ---
not fused: the scores are computed with batch and heads merged and split again, but the product's operands are not 4-D q and k with those merged""")

    def test_mask_on_merged_scores_is_carried(self):
        def f(q, k, v, bias3):  # a (B·H, L, L) bias added before the split: viewed as (B, H, L, L)
            b, h, l, d = q.shape
            w = torch.bmm(q.reshape(b * h, l, d), k.reshape(b * h, l, d).transpose(1, 2)) + bias3
            return torch.matmul(F.softmax(w.view(b, h, l, l), dim=-1), v)

        self.assertExpectedInline(rewrite_listing(f, *qkv(), randn(B * H, L, L)), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8, 8)
3 input (2, 4, 8, 16)
4 reshape(#0, (8, 8, 16))
5 reshape(#1, (8, 8, 16))
6 transpose(#5, 1, 2)
7 bmm(#4, #6)
8 add(#7, #2, 1)
9 view(#8, (2, 4, 8, 8))
10 softmax(#9, -1, 3, None)
11 matmul(#10, #3)
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8, 8)
3 input (2, 4, 8, 16)
4 unflatten(#2, 0, (2, 4))
5 fuse_plugin.attention(#0, #1, #3, #4, 0, False, 1, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=1, bias: additive mask""")

    def test_negative_weights_returned(self):
        def f(q, k, v):  # output_attentions=True
            w = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
            return w @ v, w

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 mul(#4, 0.25)
6 softmax(#5, -1, 3, None)
7 matmul(#6, #2)
8 output (#7, #6)
--- after: unchanged ---
not fused: attention weights are used elsewhere (e.g. returned with output_attentions=True)""")

    def test_negative_mask_broadcasts_scores(self):
        def f(q, k, v, mask):  # (3, 1, 1, 1, Lk) turns the (B, H, Lq, Lk) scores 5-D
            return F.softmax(q @ k.transpose(-2, -1) + mask, dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv(), randn(3, 1, 1, 1, L)), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (3, 1, 1, 1, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 add(#5, #2, 1)
7 softmax(#6, -1, 3, None)
8 matmul(#7, #3)
9 output (#8)
--- after: unchanged ---
not fused: mask broadcasts the scores from (2, 4, 8, 8) to (3, 2, 4, 8, 8)""")

    def test_five_d_windows(self):
        """(B, W, H, L, D) q/k/v (timm Twins' locally-grouped windows): batch and windows merged
        into the op's batch (flatten, a view here), the output unflattened."""
        def f(q, k, v):
            return ((q * 0.25) @ k.transpose(-2, -1)).softmax(dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *(randn(2, 3, H, L, D) for _ in range(3))), """\
0 input (2, 3, 4, 8, 16)
1 input (2, 3, 4, 8, 16)
2 input (2, 3, 4, 8, 16)
3 mul(#0, 0.25)
4 transpose(#1, -2, -1)
5 matmul(#3, #4)
6 softmax(#5, -1, None)
7 matmul(#6, #2)
8 output (#7)
--- after ---
0 input (2, 3, 4, 8, 16)
1 input (2, 3, 4, 8, 16)
2 input (2, 3, 4, 8, 16)
3 flatten(#0, 0, 1)
4 flatten(#1, 0, 1)
5 flatten(#2, 0, 1)
6 fuse_plugin.attention(#3, #4, #5, None, 0, False, 0.25, need_lse=False)
7 getitem(#6, 0)
8 unflatten(#7, 0, (2, 3))
9 contiguous(#8)
10 output (#9)
--- report ---
fused: scale=0.25""")

    def test_negative_five_d_with_a_mask(self):
        """5-D scores with a mask: left alone (the op's biases are 4-D)."""
        def f(q, k, v, mask):
            return ((q @ k.transpose(-2, -1)) + mask).softmax(dim=-1) @ v

        self.assertExpectedInline(rewrite_listing(f, *(randn(2, 3, H, L, D) for _ in range(3)),
                                                  randn(3, 1, L, L)), """\
0 input (2, 3, 4, 8, 16)
1 input (2, 3, 4, 8, 16)
2 input (3, 1, 8, 8)
3 input (2, 3, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 add(#5, #2, 1)
7 softmax(#6, -1, None)
8 matmul(#7, #3)
9 output (#8)
--- after: unchanged ---
not fused: a mask on 5-D scores (taken without masks only: the op's biases are 4-D)""")

    def test_dropout_in_training(self):
        """p > 0 in training: the op drops inside the kernel, with a seed drawn from torch's RNG."""
        def f(q, k, v):
            w = F.dropout(F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1), p=0.1, training=True)
            return w @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 mul(#4, 0.25)
6 softmax(#5, -1, 3, None)
7 dropout(#6, 0.1, True, False)
8 matmul(#7, #2)
9 output (#8)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 randint(0, 4611686018427387904, (), dtype=int64, device=device(type='cpu'))
4 fuse_plugin.attention(#1, #0, #2, None, 0.1, False, 0.25, #3, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, dropout p=0.1 in the kernel""")

    def test_negative_dropout_p1(self):
        """p = 1 drops everything: not what the op takes (0 <= p < 1), left to eager."""
        def f(q, k, v):
            w = F.dropout(F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1), p=1.0, training=True)
            return w @ v

        self.assertExpectedInline(rewrite_listing(f, *qkv()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 mul(#4, 0.25)
6 softmax(#5, -1, 3, None)
7 dropout(#6, 1, True, False)
8 matmul(#7, #2)
9 output (#8)
--- after: unchanged ---
not fused: dropout p=1.0 (the op takes 0 <= p < 1)""")

    def test_in_place_fill_and_negative_non_mask_fill(self):
        def in_place(q, k, v, m):  # masked_fill_ writes the scores before the softmax reads them (tests/test_kv_cache.py)
            w = q @ k.transpose(-2, -1)
            w.masked_fill_(m, float("-inf"))
            return F.softmax(w, dim=-1) @ v

        def zero_fill(q, k, v, m):  # filling with 0 is not masking
            return F.softmax((q @ k.transpose(-2, -1)).masked_fill(m, 0.0), dim=-1) @ v

        m = torch.zeros(L, L, dtype=torch.bool)
        self.assertExpectedInline(rewrite_listing(in_place, *qkv(), m), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 masked_fill_(#5, #2, -inf)
7 softmax(#5, -1, 3, None)
8 matmul(#7, #3)
9 output (#8)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8)
3 input (2, 4, 8, 16)
4 logical_not(#2)
5 fuse_plugin.attention(#1, #0, #3, #4, 0, False, 1, need_lse=False)
6 getitem(#5, 0)
7 contiguous(#6)
8 output (#7)
--- report ---
fused: scale=1, bias: bool mask""")
        self.assertExpectedInline(rewrite_listing(zero_fill, *qkv(), m), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 masked_fill(#5, #2, 0)
7 softmax(#6, -1, 3, None)
8 matmul(#7, #3)
9 output (#8)
--- after: unchanged ---
not fused: masked_fill/where with value 0, not a mask value (<= -10000 or -inf)""")

    def test_negative_head_dim_outside_kernel_range(self):
        def f(q, k, v):
            return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

        q = randn(B, H, L, 8)
        self.assertExpectedInline(rewrite_listing(f, q, q.clone(), q.clone()), """\
0 input (2, 4, 8, 8)
1 input (2, 4, 8, 8)
2 input (2, 4, 8, 8)
3 transpose(#0, -2, -1)
4 matmul(#1, #3)
5 softmax(#4, -1, 3, None)
6 matmul(#5, #2)
7 output (#6)
--- after: unchanged ---
not fused: head dim D=8 outside the kernel's [16, 256]""")


# =============================================================================== parity


def check_parity(spec: AttnSpec):
    spec = spec.valid()
    report = compare_compiled(spec)
    assert (report.count("attention") > 0) == spec.fused(), str(report)
    assert any("is_causal (" in site.detail for site in report.sites) == spec.causal(), str(report)


PARITY_SPECS = [
    AttnSpec(product="matmul", kt="transpose", scale="div_sqrt"),
    AttnSpec(product="at", kt="transpose23", scale="mul", softmax="torch"),
    AttnSpec(product="method", kt="mT", scale="neg_pow", softmax="method"),
    AttnSpec(product="bmm", kt="transpose23", scale="pow", mask="causal_tril"),
    AttnSpec(product="einsum", scale="qk", mask="additive"),
    AttnSpec(product="matmul", kt="permute", scale="q", softmax="f32", mask="hf_slice"),
    AttnSpec(kt="pre", scale="tensor", softmax="float", mask="bias_grad"),
    AttnSpec(scale="none", mask="fill_eq0_inf", softmax="module"),
    AttnSpec(mask="fill_bool_min"),  # a row masked everywhere: uniform weights, no gradient into q·kᵀ
    AttnSpec(mask="where_min", layout="view_transpose"),
    AttnSpec(mask="where_inf", layout="permute"),
    AttnSpec(mask="causal_tril_eq0", gqa="repeat_kv"),
    AttnSpec(mask="causal_arange", gqa="repeat_interleave", softmax="f32"),
    AttnSpec(mask="causal_triu_add", dropout="p0"),
    AttnSpec(mask="causal_buffer", dropout="eval", lq=6, lk=6),
    AttnSpec(mask="causal_pad_inf", product="einsum"),
    AttnSpec(mask="causal_pad_min"),
    AttnSpec(mask="offset_causal", lq=3, lk=7),
    AttnSpec(lq=5, lk=11, dv=32, mask="additive"),  # cross attention, Dv != D
    AttnSpec(lq=1, lk=9, mask="additive", gqa="repeat_kv"),  # one query (decode)
    AttnSpec(dtype=torch.float16, mask="causal_arange", softmax="f32", gqa="repeat_kv"),
    AttnSpec(dtype=torch.float16, mask="fill_bool_min", product="bmm"),
    AttnSpec(dtype=torch.bfloat16, mask="additive", softmax="float", product="einsum"),
    AttnSpec(dtype=torch.bfloat16, mask="causal_buffer", layout="view_transpose", scale="qk"),
    AttnSpec(kt="permute0231", mask="additive"),  # LeViT's k: kᵀ given as a permute of (B, L, H, D)
    # near misses: unchanged, and still equal to eager
    AttnSpec(dropout="train"),
    AttnSpec(negative="softmax_dim"),
    AttnSpec(negative="weights_used"),
    AttnSpec(negative="mask_5d"),
    AttnSpec(negative="scores_used"),
    AttnSpec(negative="small_head"),
]


@pytest.mark.parametrize("spec", PARITY_SPECS, ids=lambda s: f"{s.product}-{s.kt}-{s.scale}-{s.mask}-{s.softmax}-{s.dropout}-{s.gqa}-{s.layout}-{str(s.dtype)[6:]}-{s.negative}")
def test_parity(spec):
    check_parity(spec)


def _gpt2_upcast_and_reordered(q, k, v, mask):  # HF GPT-2, reorder_and_upcast_attn=True
    b, h, lq, d = q.shape
    lk = k.shape[-2]
    w = torch.empty(b * h, lq, lk, dtype=torch.float32)
    q3, kt3 = q.reshape(-1, lq, d), k.transpose(-1, -2).reshape(-1, d, lk)
    w = torch.baddbmm(w, q3.float(), kt3.float(), beta=0, alpha=0.25)
    w = w.reshape(b, h, lq, lk) + mask
    return torch.matmul(F.softmax(w, dim=-1).type(v.dtype), v)


def _bmm_merged_heads(q, k, v, mask):
    b, h, lq, d = q.shape
    w = torch.bmm(q.reshape(b * h, lq, d), k.reshape(b * h, -1, d).transpose(1, 2)) / 4.0
    return torch.matmul(F.softmax(w.view(b, h, lq, -1) + mask, dim=-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fn", [_gpt2_upcast_and_reordered, _bmm_merged_heads], ids=["baddbmm", "bmm"])
def test_merged_heads_product_parity(fn, dtype):
    """Scores over merged (batch, heads), split again: fused, outputs and gradients equal eager."""
    torch.manual_seed(0)
    inputs = [randn(B, H, L, D, dtype=dtype).requires_grad_() for _ in range(3)] + [padding_mask().to(dtype)]
    inputs2 = _clone(inputs)
    torch._dynamo.reset()
    counters.clear()
    ref, out = fn(*inputs), torch.compile(fn, backend=rewrite_aot_eager)(*inputs2)
    assert counters["fuse_plugin"]["attention"] == 1
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert out.dtype == ref.dtype and rel_err(out, ref) <= tol
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for a, b in zip(inputs[:3], inputs2[:3]):
        assert rel_err(b.grad, a.grad) <= tol


def test_fully_masked_rows_keep_eager_semantics():
    """finfo.min fills: a row masked everywhere gets uniform weights (and no gradient into q, k);
    -inf fills: NaN, as eager."""
    spec = AttnSpec(mask="fill_bool_min").valid()
    q, k, v, masked = make_inputs(spec)
    masked = masked.clone()
    masked[0, :, 2, :] = True
    out = torch.compile(AttnModule(spec), backend=rewrite_aot_eager)(q, k, v, masked)
    torch.testing.assert_close(out[0, :, 2], v[0].mean(dim=1).detach().expand_as(out[0, :, 2]), rtol=1e-5, atol=1e-6)

    def inf(q, k, v, masked):
        return F.softmax((q @ k.transpose(-2, -1)).masked_fill(masked, float("-inf")), dim=-1) @ v

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(inf, backend=rewrite_aot_eager)(q, k, v, masked)
    assert counters["fuse_plugin"]["attention"] == 1
    assert out[0, :, 2].isnan().all() and not out[1].isnan().any()


@pytest.mark.parametrize("mask", ["none", "causal_tril", "additive"])
def test_dynamic_sequence_length_no_recompile(mask):
    spec = AttnSpec(mask=mask, gqa="repeat_kv")
    module = AttnModule(spec)
    cnt = CompileCounterWithBackend(rewrite_aot_eager)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend=cnt, fullgraph=True)
    for length in (6, 9, 13):
        s = AttnSpec(mask=mask, gqa="repeat_kv", lq=length, lk=length)
        inputs = make_inputs(s, seed=length)
        inputs2 = _clone(inputs)
        for t in inputs2[:3]:
            torch._dynamo.mark_dynamic(t, 2)
        if inputs2[3] is not None:
            torch._dynamo.mark_dynamic(inputs2[3], 3)
        ref = module(*inputs)
        out = compiled(*inputs2)
        assert rel_err(out, ref) <= 1e-5
        out.backward(torch.ones_like(out))
        ref.backward(torch.ones_like(ref))
        for a, b in zip(inputs[:3], inputs2[:3]):
            assert rel_err(b.grad, a.grad) <= 1e-5
    assert cnt.frame_count == 1
    assert counters["fuse_plugin"]["attention"] == 1


def test_dynamic_all_dims_symbolic_scale_parity():
    """dynamic=True: the scale 1/sqrt(D) is a SymFloat; it scales q (so nothing specialises on D)."""

    def f(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v

    cnt = CompileCounterWithBackend(rewrite_aot_eager)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend=cnt, dynamic=True)
    for b, h, l, d in ((2, 4, 8, 16), (3, 2, 5, 32), (2, 3, 11, 24)):
        inputs = [torch.randn(b, h, l, d, requires_grad=True) for _ in range(3)]
        inputs2 = _clone(inputs)
        ref, out = f(*inputs), compiled(*inputs2)
        assert rel_err(out, ref) <= 1e-5
        ref.sum().backward()
        out.sum().backward()
        for a, c in zip(inputs, inputs2):
            assert rel_err(c.grad, a.grad) <= 1e-5
    assert cnt.frame_count == 1
    assert counters["fuse_plugin"]["attention"] == 1


def test_internal_error_leaves_the_site_unfused(monkeypatch):
    """An unexpected error while replacing one site: reported as a miss, graph left as it was."""
    from fuse_plugin.patterns import attention

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(attention, "build_bias", boom)

    def f(q, k, v, mask):
        return F.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v

    args = (*qkv(), padding_mask())
    before, after, report = capture(f, *args)
    assert before == after
    assert report.count("attention") == 0
    assert [m.reason for m in report.misses] == ["internal error, left unfused: RuntimeError: boom"]
    torch._dynamo.reset()
    assert rel_err(torch.compile(f, backend=rewrite_aot_eager)(*args), f(*args)) == 0


# =============================================================================== end to end


def test_tiny_llama_trains_like_eager():
    """3 SGD steps of a tiny decoder (embedding → RoPE → GQA causal attention → MLP) with the
    real backend (Inductor on the CPU): the loss of each step matches eager; attention is fused."""
    torch.manual_seed(0)
    eager = TinyLlama(layers=1)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fuse_plugin")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.5)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 64, (2, 12))
    losses = []
    for _ in range(3):
        step = []
        for m, opt in ((eager, opt_e), (compiled, opt_c)):
            logits = m(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step.append(loss.item())
        losses.append(step)
    for e, c in losses:
        assert abs(e - c) <= 1e-5 * abs(e), losses
    assert losses[-1][0] < losses[0][0]  # it does train
    assert counters["fuse_plugin"]["attention"] == 1
    assert counters["fuse_plugin"]["rope_attention"] == 1  # its rotary q+k folded in


@pytest.mark.parametrize("mask_style", ["tril", "hf"])
def test_tiny_llama_fullgraph_dynamic_no_recompile(mask_style):
    torch.manual_seed(0)
    model = TinyLlama(layers=2, mask_style=mask_style).eval()
    cnt = CompileCounterWithBackend(rewrite_aot_eager)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    with torch.no_grad():
        for length in (7, 10, 15):
            ids = torch.randint(0, 64, (2, length))
            torch._dynamo.mark_dynamic(ids, 1)
            assert rel_err(compiled(ids), model(ids)) <= 1e-5
    assert cnt.frame_count == 1
    assert counters["fuse_plugin"]["attention"] == 2
    assert counters["fuse_plugin"]["rope_attention"] == 2


def test_inductor_backend_forward_backward():
    """The real backend (Inductor on the CPU): causal GQA attention, outputs and gradients."""
    spec = AttnSpec(mask="causal_arange", gqa="repeat_kv", softmax="f32").valid()
    module = AttnModule(spec)
    torch._dynamo.reset()
    counters.clear()
    inputs = make_inputs(spec)
    inputs2 = _clone(inputs)
    ref = module(*inputs)
    out = torch.compile(module, backend="fuse_plugin")(*inputs2)
    assert counters["fuse_plugin"]["attention"] == 1
    assert rel_err(out, ref) <= 1e-5
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for a, b in zip(inputs[:3], inputs2[:3]):
        assert rel_err(b.grad, a.grad) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("padding", [False, True])
def test_transformers_eager_attention(arch, padding):
    """HF models with attn_implementation="eager" (tiny configs): every attention is fused and the
    output equals eager everywhere, left-padded rows included. Counts only: HF's graphs change
    between versions."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model_cls, sites = transformers.LlamaModel, 2
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        model_cls, sites = transformers.GPT2Model, 2
    else:
        cfg = transformers.T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=64, num_layers=1, num_heads=4)
        model_cls, sites = transformers.T5Model, 3  # encoder self, decoder self, decoder cross
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    ids = torch.randint(1, 64, (2, 8))
    kwargs = {"input_ids": ids, "use_cache": False}
    if arch == "t5":
        kwargs["decoder_input_ids"] = ids
    if padding:
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[0, :3] = 0  # left padding: rows masked everywhere
        kwargs["attention_mask"] = mask
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        ref = model(**kwargs).last_hidden_state
        out = torch.compile(model, backend=rewrite_aot_eager)(**kwargs).last_hidden_state
    assert counters["fuse_plugin"]["attention"] == sites
    assert counters["fuse_plugin"]["rope_attention"] == (sites if arch == "llama" else 0)
    assert rel_err(out, ref) <= 1e-5


def test_five_d_windows_parity_in_training():
    """Twins' locally-grouped attention as timm writes it: qkv of (B, W, L, 3, H, D) permuted to
    5-D q/k/v (B, W, H, L, D), scaled q, softmax, · v, then the heads merged back: outputs and the
    input's and the projection's gradients equal eager's (float64)."""
    from helpers import rewrite_aot_eager
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    B, W, L, Hh, Dh = 2, 4, 9, 2, 16
    proj = torch.nn.Linear(Hh * Dh, 3 * Hh * Dh).double()

    def f(x):
        qkv = proj(x).reshape(B, W, L, 3, Hh, Dh).permute(3, 0, 1, 4, 2, 5)
        q, k, v = qkv.unbind(0)
        attn = (q * Dh ** -0.5) @ k.transpose(-2, -1)
        out = attn.softmax(dim=-1) @ v
        return out.transpose(2, 3).reshape(B, W, L, Hh * Dh)

    x = torch.randn(B, W, L, Hh * Dh, dtype=torch.float64, requires_grad=True)
    want = f(x)
    want_g = torch.autograd.grad(want.square().sum(), (x, proj.weight))
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(f, backend=rewrite_aot_eager)(x)
    got_g = torch.autograd.grad(got.square().sum(), (x, proj.weight))
    assert counters["fuse_plugin"]["attention"] == 1
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
