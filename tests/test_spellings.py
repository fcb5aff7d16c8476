"""Spellings of attention in real code (issue 14, deliverable 2), each with a positive expect test, a
near miss left alone, and a differential check (compiled with our rewrite + AOTAutograd against
eager: the output and the gradient of every input and parameter, rows masked everywhere included).

  1. shape-only uses of the scores     DistilBERT (HF ≤ 4.x): `(mask == 0).view(...).expand_as(scores)`;
                                       `scores.size(-1)` under dynamic shapes (a graph input, no use)
  2. 3-D softmax between views         MBart / PLBart: bmm → view 4-D + mask → view 3-D → softmax → bmm;
                                       masks on the merged (B·H) scores carried to 4-D
  3. aten._safe_softmax                rows whose every score is -inf give 0 (forward and backward);
                                       (`torch._safe_softmax` itself makes Dynamo break the graph there)
  4. broadcast MQA                     Falcon: k, v of one head broadcast over q's heads by the matmuls
  5. ALiBi                             BLOOM: baddbmm(alibi, q, kᵀ, beta=1) on merged heads, weights viewed
                                       3-D; Falcon: alibi.view(B, H, 1, -1), the weights viewed as they are
  6. differentiable bias from q, k     DeBERTa-v2's disentangled attention (a bias with its gradient)
                                       before a finite padding fill: the op's replace mask
  7. nn.MultiheadAttention             need_weights=True (the default) with the weights dropped (SigLIP's head)
  8. windowed attention, 5-D mask      timm Swin's shifted windows: view (B, nW, H, N, N) + mask, view back
                                       (timm is not installed here: the block is written the way timm writes it)

Regenerate the listings with EXPECTTEST_ACCEPT=1.
"""
import copy
import math

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fuse_plugin  # noqa: F401  (registers the ops)
from helpers import rel_err, rewrite_aot_eager
from models_plain import WindowAttention, shifted_window_mask, swin  # noqa: F401  (Swin's module)
from test_attention_patterns import rewrite_listing

B, H, L, D = 2, 4, 8, 16
FMIN = torch.finfo(torch.float32).min


def qkv(h=H, hkv=None, lq=L, lk=L):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, h, lq, D, generator=g), torch.randn(B, hkv or h, lk, D, generator=g),
            torch.randn(B, hkv or h, lk, D, generator=g))


def keep_keys(lk=L, masked_batch=None):
    """(B, Lk) bool, True = attend: the last 3 keys of batch 1 padded; `masked_batch`: every key of
    that batch padded (all its rows masked everywhere)."""
    keep = torch.ones(B, lk, dtype=torch.bool)
    keep[1, lk - 3:] = False
    if masked_batch is not None:
        keep[masked_batch] = False
    return keep


def additive(keep, dtype=torch.float32):
    """(B, 1, 1, Lk): 0 where kept, finfo(dtype).min where not (HF's padding mask)."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)[:, None, None, :]


def differential(fn, *inputs, fused: int, module=None, tol=1e-5, dynamic=None):
    """fn compiled (our rewrite + AOTAutograd, eager kernels) against eager: `fused` attention sites,
    the output (NaN where eager has NaN) and the gradient of every float input and parameter."""
    def prepare(ts):
        return [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                for t in ts]

    ref_in, our_in = prepare(inputs), prepare(inputs)
    ref_mod, our_mod = (module, copy.deepcopy(module)) if module is not None else (None, None)
    ref_fn = fn if module is None else (lambda *a: fn(ref_mod, *a))
    our_fn = fn if module is None else (lambda *a: fn(our_mod, *a))
    torch._dynamo.reset()
    counters.clear()
    ref = ref_fn(*ref_in)
    out = torch.compile(our_fn, backend=rewrite_aot_eager, dynamic=dynamic)(*our_in)
    torch._dynamo.reset()
    if isinstance(ref, tuple):  # a near miss that also returns something else: compare the attention output
        ref, out = ref[0], out[0]
    assert counters["fuse_plugin"]["attention"] == fused, dict(counters["fuse_plugin"])
    torch.testing.assert_close(out.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert rel_err(out[finite], ref[finite]) <= tol, rel_err(out[finite], ref[finite])
    g = torch.randn_like(ref).masked_fill(ref.isnan(), 0.0)
    (ref.nan_to_num() * g).sum().backward()
    (out.nan_to_num() * g).sum().backward()
    leaves = [(a, b) for a, b in zip(ref_in, our_in) if isinstance(a, torch.Tensor) and a.requires_grad]
    if module is not None:
        leaves += list(zip(ref_mod.parameters(), our_mod.parameters()))
    for a, b in leaves:
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.isfinite(a.grad).all() == torch.isfinite(b.grad).all()
            assert rel_err(b.grad, a.grad) <= 10 * tol, (a.shape, rel_err(b.grad, a.grad))


# =============================================================================== 1. shape-only uses


def distilbert(q, k, v, keep):  # HF DistilBERT ≤ 4.x MultiHeadSelfAttention
    bs, _, k_length, _ = k.shape
    q = q / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(2, 3))
    mask = (keep == 0).view(bs, 1, 1, k_length).expand_as(scores)
    scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))
    weights = F.dropout(F.softmax(scores, dim=-1), p=0.0, training=True)
    return torch.matmul(weights, v)


def expanded_mask_returned(q, k, v, keep):  # the expanded mask is also returned: it reads the scores' shape only,
    scores = q @ k.transpose(2, 3) * 0.25  # but keeps them alive, so the site is left
    mask = (keep == 0).view(B, 1, 1, -1).expand_as(scores)
    return F.softmax(scores.masked_fill(mask, FMIN), dim=-1) @ v, mask


def sizes_read(q, k, v):  # the scores' sizes read under dynamic shapes: symbols (graph inputs), no use of the scores
    scores = q @ k.transpose(-2, -1) * 0.25
    scores = scores.view(-1, scores.size(-2), scores.size(-1)).view(q.shape[0], q.shape[1], scores.size(-2), -1)
    return F.softmax(scores, dim=-1) @ v


# =============================================================================== 2. 3-D softmax between views


def mbart(q, k, v, mask):  # HF MBart / PLBart / Bart ≤ 4.x: heads merged for the bmms, 4-D for the mask
    b, h, lq, d = q.shape
    lk = k.shape[2]
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q * d ** -0.5, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2))
    w = w.view(b, h, lq, lk) + mask
    w = w.view(b * h, lq, lk)
    w = F.dropout(F.softmax(w, dim=-1), p=0.0, training=True)
    out = torch.bmm(w, v3)
    return out.view(b, h, lq, d).transpose(1, 2).reshape(b, lq, h * d)


def mbart_v_not_merged(q, k, v3, mask):  # v is a 3-D tensor of its own: no 4-D v for the op
    b, h, lq, d = q.shape
    w = torch.bmm(q.reshape(b * h, lq, d), k.reshape(b * h, -1, d).transpose(1, 2)) * 0.25
    w = (w.view(b, h, lq, -1) + mask).view(b * h, lq, -1)
    return torch.bmm(F.softmax(w, dim=-1), v3)


def masked_merged_baddbmm(q, k, v, bias3, keep):  # F.multi_head_attention_forward's spelling, on merged heads
    b, h, lq, d = q.shape
    s = torch.baddbmm(bias3, q.reshape(b * h, lq, d) * d ** -0.5, k.reshape(b * h, -1, d).transpose(-2, -1))
    s = s.view(b, h, lq, -1).masked_fill(~keep[:, None, None, :], float("-inf")).view(b * h, lq, -1)
    return torch.bmm(F.softmax(s, dim=-1), v.reshape(b * h, -1, d))


# =============================================================================== 3. _safe_softmax


def safe_aten(q, k, v, keep):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.ops.aten._safe_softmax.default(s, -1) @ v


def safe_dim_2(q, k, v, keep):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.ops.aten._safe_softmax.default(s, -2) @ v


# =============================================================================== 4. broadcast MQA


def falcon_mqa(q, k, v, mask):  # HF Falcon (multi_query=True): k, v of one head
    scores = q @ k.transpose(-1, -2)
    scores /= math.sqrt(q.shape[-1])
    return F.softmax(scores + mask, dim=-1, dtype=q.dtype) @ v


# =============================================================================== 5. ALiBi


def alibi_slopes(b, h, keep):
    """BLOOM's build_alibi_tensor: (B·H, 1, Lk)."""
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])
    m = keep.long()
    pos = ((m.cumsum(-1) - 1) * m)[:, None, :]
    return (slopes[..., None] * pos).reshape(b * h, 1, -1)


def bloom(q, k, v, alibi, mask, beta=1.0):  # HF BLOOM: baddbmm(alibi) on merged heads, view 4-D, view back 3-D
    b, h, lq, d = q.shape
    q3 = q.reshape(b * h, -1, d)
    k3 = k.reshape(b * h, -1, d).transpose(-1, -2)
    v3 = v.reshape(b * h, -1, d)
    s = alibi.baddbmm(batch1=q3, batch2=k3, beta=beta, alpha=1 / math.sqrt(d))
    w = s.view(b, h, lq, -1) + mask
    p = F.dropout(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), p=0.0, training=True)
    out = torch.bmm(p.view(b * h, lq, -1), v3)
    return out.view(b, h, lq, d)


def bloom_beta2(q, k, v, alibi, mask):
    return bloom(q, k, v, alibi, mask, beta=2.0)


def falcon_alibi(q, k, v, alibi, mask):  # HF Falcon (alibi=True): a 4-D view of the alibi, the weights viewed as they are
    b, h, lq, d = q.shape
    s = (q @ k.transpose(-1, -2)).view(b, h, lq, -1)
    logits = s + alibi.view(b, h, 1, -1)
    logits *= 1 / math.sqrt(d)
    p = F.dropout(F.softmax(logits + mask, dim=-1, dtype=q.dtype), p=0.0, training=True)
    return (p.view(b, h, lq, -1) @ v).flatten(0, 1)


# =============================================================================== 6. DeBERTa-v2


def deberta(q, k, v, pos_q, pos_k, keep, fill_last=True):
    """HF DeBERTa-v2's DisentangledSelfAttention: q·kᵀ/scale plus content→position and position→content
    terms made from q and k (a bias with a gradient into q and k), on merged heads; then the padding fill."""
    b, h, l, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, l, d) for t in (q, k, v))
    scale = torch.sqrt(torch.tensor(d, dtype=torch.float) * 3)
    s = torch.bmm(q3, k3.transpose(-1, -2) / scale.to(dtype=q3.dtype))
    c2p = torch.bmm(q3, pos_k.transpose(-1, -2))  # (B·H, L, P)
    p2c = torch.bmm(k3, pos_q.transpose(-1, -2)).transpose(-1, -2)
    rel = c2p[..., :l] / scale + p2c[..., :l, :] / scale
    keep4 = keep[:, None, :, None] & keep[:, None, None, :]
    fmin = torch.finfo(q.dtype).min
    if fill_last:
        s = (s + rel).view(-1, h, l, l).masked_fill(~keep4, fmin)
    else:  # the term added after the fill (a row masked everywhere mixes filled and added scores)
        s = s.view(-1, h, l, l).masked_fill(~keep4, fmin) + rel.view(-1, h, l, l)
    p = F.dropout(F.softmax(s, dim=-1), p=0.0, training=True)
    out = torch.bmm(p.view(-1, l, l), v3)
    return out.view(-1, h, l, d)


def deberta_add_after_fill(q, k, v, pos_q, pos_k, keep):
    return deberta(q, k, v, pos_q, pos_k, keep, fill_last=False)


# =============================================================================== 7. nn.MultiheadAttention


def mha_head(m, probe, x, key_padding_mask):  # SigLIP's attention-pooling head: weights returned, dropped
    return m(probe, x, x, key_padding_mask=key_padding_mask)[0]


def mha_weights_used(m, probe, x, key_padding_mask):
    out, w = m(probe, x, x, key_padding_mask=key_padding_mask)
    return out + w.sum()


def new_mha():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.0)
    return m.train()


# =============================================================================== 8. Swin windows


class WindowAttentionFlatMask(WindowAttention):
    """Near miss: the window mask added on a view that also flattens (N, N): not a view of the batch dims."""

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1) + self._get_rel_pos_bias()
        attn = attn.view(-1, mask.shape[0], self.num_heads, n * n) + mask.view(1, mask.shape[0], 1, n * n)
        attn = attn.view(-1, self.num_heads, n, n).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b_, n, -1))


def swin_flat_mask(m, x, mask):
    return WindowAttentionFlatMask.forward(m, x, mask)


# =============================================================================== 9. XCiT cross-covariance attention


class XCA(nn.Module):
    """timm's xcit.XCA (fused_attn off): attention over channels (q, k, v are (B, H, C/H, N)), the
    scores multiplied by a learned per-head temperature (H, 1, 1) after the product."""

    def __init__(self, dim=64, num_heads=4, per_key=False):
        super().__init__()
        self.num_heads = num_heads
        self.temperature = nn.Parameter(torch.rand(num_heads, 1, 1) + 0.5)
        self.key_factor = nn.Parameter(torch.rand(num_heads, 1, dim // num_heads) + 0.5) if per_key else None
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 4, 1).unbind(0)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * (self.temperature if self.key_factor is None else self.key_factor)
        x = attn.softmax(dim=-1) @ v
        return self.proj(x.permute(0, 3, 1, 2).reshape(b, n, c))


def xca(m, x):
    return m(x)


# =============================================================================== 10. HF's eager window with padding


def hf_window_padding(q, k, v, pad):  # masking_utils' eager mask: causal & window & padding, one finfo.min fill
    i = torch.arange(L)[None, None, :, None]
    j = torch.arange(L)[None, None, None, :]
    keep = (j <= i) & (j > i - 3) & pad[:, None, None, :]
    return (q @ k.transpose(-2, -1) / math.sqrt(D) + torch.where(keep, torch.tensor(0.0), FMIN)).softmax(-1) @ v


def hf_window_padding_two_fills(q, k, v, pad):  # near miss: the padding a second fill (one value per key unproved)
    i = torch.arange(L)[None, None, :, None]
    j = torch.arange(L)[None, None, None, :]
    s = q @ k.transpose(-2, -1) / math.sqrt(D) + torch.where((j <= i) & (j > i - 3), torch.tensor(0.0), FMIN)
    return s.masked_fill(~pad[:, None, None, :], FMIN).softmax(-1) @ v


# =============================================================================== expect tests


MHA = new_mha()
torch.manual_seed(0)
SWIN = WindowAttention()
torch.manual_seed(0)
XCIT, XCIT_PER_KEY = XCA(), XCA(per_key=True)


class SpellingExpectTests(expecttest.TestCase):
    maxDiff = None

    def test_distilbert_expand_as_scores(self):
        self.assertExpectedInline(rewrite_listing(distilbert, *qkv(), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 div(#1, 4, None)
5 transpose(#0, 2, 3)
6 matmul(#4, #5)
7 eq(#2, 0)
8 view(#7, (2, 1, 1, 8))
9 expand_as(#8, #6)
10 tensor(-3.40282e+38)
11 masked_fill(#6, #9, #10)
12 softmax(#11, -1, 3, None)
13 dropout(#12, 0, True, False)
14 matmul(#13, #3)
15 output (#14)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 eq(#2, 0)
5 view(#4, (2, 1, 1, 8))
6 where(#5, -3.40282e+38, 0)
7 fuse_plugin.attention(#1, #0, #3, #6, 0, False, 0.25, replace=#5, need_lse=False)
8 getitem(#7, 0)
9 contiguous(#8)
10 output (#9)
--- report ---
fused: scale=0.25, bias: float mask, replace mask (finite fill)""")

    def test_negative_expanded_mask_also_returned(self):
        self.assertExpectedInline(rewrite_listing(expanded_mask_returned, *qkv(), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, 2, 3)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 eq(#2, 0)
8 view(#7, (2, 1, 1, -1))
9 expand_as(#8, #6)
10 masked_fill(#6, #9, -3.40282e+38)
11 softmax(#10, -1, 3, None)
12 matmul(#11, #3)
13 output (#12, #9)
--- after: unchanged ---
not fused: the scores feeding the softmax (scores) are also used elsewhere""")

    def test_sizes_of_scores_read_dynamic(self):
        self.assertExpectedInline(rewrite_listing(sizes_read, *qkv(), dynamic=True), """\
0 input
1 input
2 input
3 input
4 input (S0, S1, S2, S3)
5 input (S0, S1, S2, S3)
6 input (S0, S1, S2, S3)
7 transpose(#4, -2, -1)
8 matmul(#5, #7)
9 mul(#8, 0.25)
10 view(#9, (-1, #2, #2))
11 view(#10, (#0, #1, #2, -1))
12 softmax(#11, -1, 3, None)
13 matmul(#12, #6)
14 output (#13)
--- after ---
0 input
1 input
2 input
3 input
4 input (S0, S1, S2, S3)
5 input (S0, S1, S2, S3)
6 input (S0, S1, S2, S3)
7 fuse_plugin.attention(#5, #4, #6, None, 0, False, 0.25, need_lse=False)
8 getitem(#7, 0)
9 contiguous(#8)
10 output (#9)
--- report ---
fused: scale=0.25""")

    def test_mbart_3d_softmax_between_views(self):
        self.assertExpectedInline(rewrite_listing(mbart, *qkv(), additive(keep_keys())), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 1, 1, 8)
4 mul(#0, 0.25)
5 reshape(#4, (8, -1, 16))
6 reshape(#1, (8, -1, 16))
7 reshape(#2, (8, -1, 16))
8 transpose(#6, 1, 2)
9 bmm(#5, #8)
10 view(#9, (2, 4, 8, 8))
11 add(#10, #3, 1)
12 view(#11, (8, 8, 8))
13 softmax(#12, -1, 3, None)
14 dropout(#13, 0, True, False)
15 bmm(#14, #7)
16 view(#15, (2, 4, 8, 16))
17 transpose(#16, 1, 2)
18 reshape(#17, (2, 8, 64))
19 output (#18)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 1, 1, 8)
4 fuse_plugin.attention(#0, #1, #2, #3, 0, False, 0.25, need_lse=False)
5 getitem(#4, 0)
6 flatten(#5, 0, 1)
7 view(#6, (2, 4, 8, 16))
8 transpose(#7, 1, 2)
9 reshape(#8, (2, 8, 64))
10 output (#9)
--- report ---
fused: scale=0.25, bias: additive mask""")

    def test_negative_mbart_v_not_merged(self):
        self.assertExpectedInline(rewrite_listing(mbart_v_not_merged, *qkv()[:2], torch.randn(B * H, L, D), additive(keep_keys())), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (8, 8, 16)
4 reshape(#0, (8, 8, 16))
5 reshape(#1, (8, -1, 16))
6 transpose(#5, 1, 2)
7 bmm(#4, #6)
8 mul(#7, 0.25)
9 view(#8, (2, 4, 8, -1))
10 add(#9, #2, 1)
11 view(#10, (8, 8, -1))
12 softmax(#11, -1, 3, None)
13 bmm(#12, #3)
14 output (#13)
--- after: unchanged ---
not fused: the weights are multiplied with v over merged (batch, heads), but v is no view of a 4-D tensor""")

    def test_masked_baddbmm_on_merged_heads(self):
        self.assertExpectedInline(rewrite_listing(masked_merged_baddbmm, *qkv(), torch.randn(B * H, L, L), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8, 8)
3 input (2, 8)
4 input (2, 4, 8, 16)
5 reshape(#0, (8, 8, 16))
6 mul(#5, 0.25)
7 reshape(#1, (8, -1, 16))
8 transpose(#7, -2, -1)
9 baddbmm(#2, #6, #8, 1, 1)
10 view(#9, (2, 4, 8, -1))
11 getitem(#3, (:, None, None, :))
12 invert(#11)
13 masked_fill(#10, #12, -inf)
14 view(#13, (8, 8, -1))
15 softmax(#14, -1, 3, None)
16 reshape(#4, (8, -1, 16))
17 bmm(#15, #16)
18 output (#17)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 8, 8)
3 input (2, 8)
4 input (2, 4, 8, 16)
5 unflatten(#2, 0, (2, 4))
6 getitem(#3, (:, None, None, :))
7 invert(#6)
8 where(#7, -inf, #5)
9 fuse_plugin.attention(#0, #1, #4, #8, 0, False, 0.25, need_lse=False)
10 getitem(#9, 0)
11 flatten(#10, 0, 1)
12 output (#11)
--- report ---
fused: scale=0.25, bias: float mask""")

    def test_aten_safe_softmax(self):
        self.assertExpectedInline(rewrite_listing(safe_aten, *qkv(), keep_keys(masked_batch=0)), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 getitem(#2, (:, None, None, :))
8 invert(#7)
9 masked_fill(#6, #8, -inf)
10 safe_softmax(#9, -1, None)
11 matmul(#10, #3)
12 output (#11)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 getitem(#2, (:, None, None, :))
5 fuse_plugin.attention(#1, #0, #3, #4, 0, False, 0.25)
6 getitem(#5, 0)
7 getitem(#5, 1)
8 isneginf(#7)
9 unsqueeze(#8, -1)
10 isnan(#6)
11 and_(#9, #10)
12 where(#11, 0, #6)
13 output (#12)
--- report ---
fused: scale=0.25, bias: bool mask, _safe_softmax: rows masked everywhere give 0""")

    def test_negative_safe_softmax_dim_2(self):
        self.assertExpectedInline(rewrite_listing(safe_dim_2, *qkv(), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -2, -1)
5 matmul(#1, #4)
6 mul(#5, 0.25)
7 getitem(#2, (:, None, None, :))
8 invert(#7)
9 masked_fill(#6, #8, -inf)
10 safe_softmax(#9, -2, None)
11 matmul(#10, #3)
12 output (#11)
--- after: unchanged ---
not fused: softmax over dim -2, not the last dim""")

    def test_falcon_broadcast_mqa(self):
        self.assertExpectedInline(rewrite_listing(falcon_mqa, *qkv(hkv=1), additive(keep_keys())), """\
0 input (2, 1, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 1, 8, 16)
4 transpose(#0, -1, -2)
5 matmul(#1, #4)
6 itruediv(#5, 4)
7 add(#6, #2, 1)
8 softmax(#7, -1, 3, float32)
9 matmul(#8, #3)
10 output (#9)
--- after ---
0 input (2, 1, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 1, 8, 16)
4 fuse_plugin.attention(#1, #0, #3, #2, 0, False, 0.25, need_lse=False)
5 getitem(#4, 0)
6 contiguous(#5)
7 output (#6)
--- report ---
fused: scale=0.25, bias: additive mask, GQA: k/v un-repeated (4 q heads per kv head)""")

    def test_negative_mqa_v_with_all_heads(self):
        self.assertExpectedInline(rewrite_listing(falcon_mqa, qkv()[0], qkv(hkv=1)[1], qkv()[2], additive(keep_keys())), """\
0 input (2, 1, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 1, 1, 8)
3 input (2, 4, 8, 16)
4 transpose(#0, -1, -2)
5 matmul(#1, #4)
6 itruediv(#5, 4)
7 add(#6, #2, 1)
8 softmax(#7, -1, 3, float32)
9 matmul(#8, #3)
10 output (#9)
--- after: unchanged ---
not fused: q, k, v batch dims differ: (2, 4, 8, 16), (2, 1, 8, 16), (2, 4, 8, 16)""")

    def test_bloom_alibi_baddbmm(self):
        self.assertExpectedInline(rewrite_listing(bloom, *qkv(), alibi_slopes(B, H, keep_keys()), additive(keep_keys())), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 1, 8)
4 input (2, 1, 1, 8)
5 reshape(#0, (8, -1, 16))
6 reshape(#1, (8, -1, 16))
7 transpose(#6, -1, -2)
8 reshape(#2, (8, -1, 16))
9 baddbmm(#3, #5, #7, 1, 0.25)
10 view(#9, (2, 4, 8, -1))
11 add(#10, #4, 1)
12 softmax(#11, -1, 3, float32)
13 to(#12, (float32))
14 dropout(#13, 0, True, False)
15 view(#14, (8, 8, -1))
16 bmm(#15, #8)
17 view(#16, (2, 4, 8, 16))
18 output (#17)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 1, 8)
4 input (2, 1, 1, 8)
5 unflatten(#3, 0, (2, 4))
6 add(#5, #4, 1)
7 fuse_plugin.attention(#0, #1, #2, #6, 0, False, 0.25, need_lse=False)
8 getitem(#7, 0)
9 flatten(#8, 0, 1)
10 view(#9, (2, 4, 8, 16))
11 output (#10)
--- report ---
fused: scale=0.25, bias: float mask""")

    def test_falcon_alibi_view(self):
        self.assertExpectedInline(rewrite_listing(falcon_alibi, *qkv(), alibi_slopes(B, H, keep_keys()), additive(keep_keys())), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 1, 8)
3 input (2, 1, 1, 8)
4 input (2, 4, 8, 16)
5 transpose(#1, -1, -2)
6 matmul(#0, #5)
7 view(#6, (2, 4, 8, -1))
8 view(#2, (2, 4, 1, -1))
9 add(#7, #8, 1)
10 imul(#9, 0.25)
11 add(#10, #3, 1)
12 softmax(#11, -1, 3, float32)
13 dropout(#12, 0, True, False)
14 view(#13, (2, 4, 8, -1))
15 matmul(#14, #4)
16 flatten(#15, 0, 1)
17 output (#16)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (8, 1, 8)
3 input (2, 1, 1, 8)
4 input (2, 4, 8, 16)
5 view(#2, (2, 4, 1, -1))
6 mul(#5, 0.25)
7 add(#6, #3, 1)
8 fuse_plugin.attention(#0, #1, #4, #7, 0, False, 0.25, need_lse=False)
9 getitem(#8, 0)
10 flatten(#9, 0, 1)
11 output (#10)
--- report ---
fused: scale=0.25, bias: float mask""")

    def test_negative_bloom_beta_2(self):
        self.assertExpectedInline(rewrite_listing(bloom_beta2, *qkv(), alibi_slopes(B, H, keep_keys()), additive(keep_keys())), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 1, 8)
4 input (2, 1, 1, 8)
5 reshape(#0, (8, -1, 16))
6 reshape(#1, (8, -1, 16))
7 transpose(#6, -1, -2)
8 reshape(#2, (8, -1, 16))
9 baddbmm(#3, #5, #7, 2, 0.25)
10 view(#9, (2, 4, 8, -1))
11 add(#10, #4, 1)
12 softmax(#11, -1, 3, float32)
13 to(#12, (float32))
14 dropout(#13, 0, True, False)
15 view(#14, (8, 8, -1))
16 bmm(#15, #8)
17 view(#16, (2, 4, 8, 16))
18 output (#17)
--- after: unchanged ---
not fused: baddbmm with beta=2.0 scales the bias it adds""")

    def test_deberta_bias_before_fill(self):  # the op's replace mask: attention_bias.replace_mask
        self.assertExpectedInline(rewrite_listing(deberta, *qkv(), torch.randn(B * H, 2 * L, D), torch.randn(B * H, 2 * L, D), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 16, 16)
4 input (8, 16, 16)
5 input (2, 8)
6 reshape(#0, (8, 8, 16))
7 reshape(#1, (8, 8, 16))
8 reshape(#2, (8, 8, 16))
9 tensor(16, dtype=float32)
10 mul(#9, 3)
11 sqrt(#10)
12 transpose(#7, -1, -2)
13 to(#11, (float32))
14 div(#12, #13, None)
15 bmm(#6, #14)
16 transpose(#3, -1, -2)
17 bmm(#6, #16)
18 transpose(#4, -1, -2)
19 bmm(#7, #18)
20 transpose(#19, -1, -2)
21 getitem(#17, (Ellipsis, :8))
22 div(#21, #11, None)
23 getitem(#20, (Ellipsis, :8, :))
24 div(#23, #11, None)
25 add(#22, #24, 1)
26 getitem(#5, (:, None, :, None))
27 getitem(#5, (:, None, None, :))
28 and_(#26, #27)
29 add(#15, #25, 1)
30 view(#29, (-1, 4, 8, 8))
31 invert(#28)
32 masked_fill(#30, #31, -3.40282e+38)
33 softmax(#32, -1, 3, None)
34 dropout(#33, 0, True, False)
35 view(#34, (-1, 8, 8))
36 bmm(#35, #8)
37 view(#36, (-1, 4, 8, 16))
38 output (#37)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 16, 16)
4 input (8, 16, 16)
5 input (2, 8)
6 reshape(#0, (8, 8, 16))
7 reshape(#1, (8, 8, 16))
8 tensor(16, dtype=float32)
9 mul(#8, 3)
10 sqrt(#9)
11 to(#10, (float32))
12 transpose(#3, -1, -2)
13 bmm(#6, #12)
14 transpose(#4, -1, -2)
15 bmm(#7, #14)
16 transpose(#15, -1, -2)
17 getitem(#13, (Ellipsis, :8))
18 div(#17, #10, None)
19 getitem(#16, (Ellipsis, :8, :))
20 div(#19, #10, None)
21 add(#18, #20, 1)
22 getitem(#5, (:, None, :, None))
23 getitem(#5, (:, None, None, :))
24 and_(#22, #23)
25 unflatten(#21, 0, (2, 4))
26 invert(#24)
27 div(#0, #11, None)
28 where(#26, -3.40282e+38, #25)
29 fuse_plugin.attention(#27, #1, #2, #28, 0, False, 1, replace=#26, need_lse=False)
30 getitem(#29, 0)
31 flatten(#30, 0, 1)
32 view(#31, (-1, 4, 8, 16))
33 output (#32)
--- report ---
fused: scale=1, run-time scale applied to q, bias: float mask, replace mask (finite fill)""")

    def test_deberta_term_after_fill(self):  # the replace mask too, the term added after the fill
        self.assertExpectedInline(rewrite_listing(deberta_add_after_fill, *qkv(), torch.randn(B * H, 2 * L, D), torch.randn(B * H, 2 * L, D), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 16, 16)
4 input (8, 16, 16)
5 input (2, 8)
6 reshape(#0, (8, 8, 16))
7 reshape(#1, (8, 8, 16))
8 reshape(#2, (8, 8, 16))
9 tensor(16, dtype=float32)
10 mul(#9, 3)
11 sqrt(#10)
12 transpose(#7, -1, -2)
13 to(#11, (float32))
14 div(#12, #13, None)
15 bmm(#6, #14)
16 transpose(#3, -1, -2)
17 bmm(#6, #16)
18 transpose(#4, -1, -2)
19 bmm(#7, #18)
20 transpose(#19, -1, -2)
21 getitem(#17, (Ellipsis, :8))
22 div(#21, #11, None)
23 getitem(#20, (Ellipsis, :8, :))
24 div(#23, #11, None)
25 add(#22, #24, 1)
26 getitem(#5, (:, None, :, None))
27 getitem(#5, (:, None, None, :))
28 and_(#26, #27)
29 view(#15, (-1, 4, 8, 8))
30 invert(#28)
31 masked_fill(#29, #30, -3.40282e+38)
32 view(#25, (-1, 4, 8, 8))
33 add(#31, #32, 1)
34 softmax(#33, -1, 3, None)
35 dropout(#34, 0, True, False)
36 view(#35, (-1, 8, 8))
37 bmm(#36, #8)
38 view(#37, (-1, 4, 8, 16))
39 output (#38)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (8, 16, 16)
4 input (8, 16, 16)
5 input (2, 8)
6 reshape(#0, (8, 8, 16))
7 reshape(#1, (8, 8, 16))
8 tensor(16, dtype=float32)
9 mul(#8, 3)
10 sqrt(#9)
11 to(#10, (float32))
12 transpose(#3, -1, -2)
13 bmm(#6, #12)
14 transpose(#4, -1, -2)
15 bmm(#7, #14)
16 transpose(#15, -1, -2)
17 getitem(#13, (Ellipsis, :8))
18 div(#17, #10, None)
19 getitem(#16, (Ellipsis, :8, :))
20 div(#19, #10, None)
21 add(#18, #20, 1)
22 getitem(#5, (:, None, :, None))
23 getitem(#5, (:, None, None, :))
24 and_(#22, #23)
25 invert(#24)
26 view(#21, (-1, 4, 8, 8))
27 div(#0, #11, None)
28 where(#25, -3.40282e+38, 0)
29 add(#28, #26, 1)
30 fuse_plugin.attention(#27, #1, #2, #29, 0, False, 1, replace=#25, need_lse=False)
31 getitem(#30, 0)
32 flatten(#31, 0, 1)
33 view(#32, (-1, 4, 8, 16))
34 output (#33)
--- report ---
fused: scale=1, run-time scale applied to q, bias: float mask, replace mask (finite fill)""")

    def test_mha_dead_weights(self):
        self.assertExpectedInline(rewrite_listing(lambda *a: mha_head(MHA, *a), torch.randn(B, 1, 64), torch.randn(B, L, 64), ~keep_keys()), """\
0 input (2, 8)
1 input (2, 1, 64)
2 input (2, 8, 64)
3 input (192, 64)
4 input (192,)
5 input (64, 64)
6 input (64,)
7 zeros_like(#0, dtype=float32)
8 masked_fill_(#7, #0, -inf)
9 transpose(#1, 1, 0)
10 transpose(#2, 1, 0)
11 multi_head_attention_forward(#9, #10, #10, 64, 4, #3, #4, None, None, False, 0, #5, #6, training=True, key_padding_mask=#8, need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)
12 getitem(#11, 0)
13 transpose(#12, 1, 0)
14 output (#13)
--- after ---
0 input (2, 8)
1 input (2, 1, 64)
2 input (2, 8, 64)
3 input (192, 64)
4 input (192,)
5 input (64, 64)
6 input (64,)
7 zeros_like(#0, dtype=float32)
8 masked_fill_(#7, #0, -inf)
9 transpose(#1, 1, 0)
10 transpose(#2, 1, 0)
11 chunk(#3, 3, 0)
12 getitem(#11, 0)
13 getitem(#11, 1)
14 getitem(#11, 2)
15 chunk(#4, 3, 0)
16 getitem(#15, 0)
17 getitem(#15, 1)
18 getitem(#15, 2)
19 linear(#9, #12, #16)
20 unflatten(#19, -1, (4, 16))
21 permute(#20, (1, 2, 0, 3))
22 linear(#10, #13, #17)
23 unflatten(#22, -1, (4, 16))
24 permute(#23, (1, 2, 0, 3))
25 linear(#10, #14, #18)
26 unflatten(#25, -1, (4, 16))
27 permute(#26, (1, 2, 0, 3))
28 unsqueeze(#8, 1)
29 unsqueeze(#28, 1)
30 fuse_plugin.attention(#21, #24, #27, #29, 0, False, 0.25)
31 getitem(#30, 0)
32 permute(#31, (2, 0, 1, 3))
33 flatten(#32, 2, -1)
34 linear(#33, #5, #6)
35 transpose(#34, 1, 0)
36 output (#35)
--- report ---
fused: nn.MultiheadAttention (4 heads of 16), scale=0.25, bias: additive mask""")

    def test_negative_mha_weights_used(self):
        self.assertExpectedInline(rewrite_listing(lambda *a: mha_weights_used(MHA, *a), torch.randn(B, 1, 64), torch.randn(B, L, 64), ~keep_keys()), """\
0 input (2, 8)
1 input (2, 1, 64)
2 input (2, 8, 64)
3 input (192, 64)
4 input (192,)
5 input (64, 64)
6 input (64,)
7 zeros_like(#0, dtype=float32)
8 masked_fill_(#7, #0, -inf)
9 transpose(#1, 1, 0)
10 transpose(#2, 1, 0)
11 multi_head_attention_forward(#9, #10, #10, 64, 4, #3, #4, None, None, False, 0, #5, #6, training=True, key_padding_mask=#8, need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)
12 getitem(#11, 0)
13 getitem(#11, 1)
14 transpose(#12, 1, 0)
15 sum(#13)
16 add(#14, #15, 1)
17 output (#16)
--- after: unchanged ---
not fused: the attention weights are used (need_weights=True and read)""")

    def test_swin_shifted_window_5d_mask(self):
        self.assertExpectedInline(rewrite_listing(lambda *a: swin(SWIN, *a), torch.randn(B * 4, 16, 64), shifted_window_mask()), """\
0 input (8, 16, 64)
1 input (192, 64)
2 input (192,)
3 input (49, 4)
4 input (16, 16)
5 input (4, 16, 16)
6 input (64, 64)
7 input (64,)
8 linear(#0, #1, #2)
9 reshape(#8, (8, 16, 3, 4, -1))
10 permute(#9, (2, 0, 3, 1, 4))
11 unbind(#10, 0)
12 getitem(#11, 0)
13 getitem(#11, 1)
14 getitem(#11, 2)
15 mul(#12, 0.25)
16 transpose(#13, -2, -1)
17 matmul(#15, #16)
18 view(#4, (-1))
19 getitem(#3, #18)
20 view(#19, (16, 16, -1))
21 permute(#20, (2, 0, 1))
22 contiguous(#21)
23 unsqueeze(#22, 0)
24 add(#17, #23, 1)
25 view(#24, (-1, 4, 4, 16, 16))
26 unsqueeze(#5, 1)
27 unsqueeze(#26, 0)
28 add(#25, #27, 1)
29 view(#28, (-1, 4, 16, 16))
30 softmax(#29, -1, None)
31 dropout(#30, 0, True, False)
32 matmul(#31, #14)
33 transpose(#32, 1, 2)
34 reshape(#33, (8, 16, -1))
35 linear(#34, #6, #7)
36 output (#35)
--- after ---
0 input (8, 16, 64)
1 input (192, 64)
2 input (192,)
3 input (49, 4)
4 input (16, 16)
5 input (4, 16, 16)
6 input (64, 64)
7 input (64,)
8 linear(#0, #1, #2)
9 reshape(#8, (8, 16, 3, 4, -1))
10 permute(#9, (2, 0, 3, 1, 4))
11 unbind(#10, 0)
12 getitem(#11, 0)
13 getitem(#11, 1)
14 getitem(#11, 2)
15 view(#4, (-1))
16 fuse_plugin.table_gather(#3, #15, 0)
17 view(#16, (16, 16, -1))
18 permute(#17, (2, 0, 1))
19 contiguous(#18)
20 unsqueeze(#19, 0)
21 unsqueeze(#5, 1)
22 unsqueeze(#21, 0)
23 flatten(#22, 0, 1)
24 add(#20, #23, 1)
25 fuse_plugin.attention(#12, #13, #14, #24, 0, False, 0.25)
26 getitem(#25, 0)
27 transpose(#26, 1, 2)
28 reshape(#27, (8, 16, -1))
29 linear(#28, #6, #7)
30 output (#29)
--- report ---
fused: scale=0.25, bias: float mask, window-periodic (4 windows); bias table gathered by fuse_plugin.table_gather (its gradient added in float32)""")

    def test_negative_swin_mask_on_flattened_scores(self):
        self.assertExpectedInline(rewrite_listing(lambda *a: swin_flat_mask(SWIN, *a), torch.randn(B * 4, 16, 64), shifted_window_mask()), """\
0 input (8, 16, 64)
1 input (192, 64)
2 input (192,)
3 input (49, 4)
4 input (16, 16)
5 input (4, 16, 16)
6 input (64, 64)
7 input (64,)
8 linear(#0, #1, #2)
9 reshape(#8, (8, 16, 3, 4, -1))
10 permute(#9, (2, 0, 3, 1, 4))
11 unbind(#10, 0)
12 getitem(#11, 0)
13 getitem(#11, 1)
14 getitem(#11, 2)
15 mul(#12, 0.25)
16 transpose(#13, -2, -1)
17 matmul(#15, #16)
18 view(#4, (-1))
19 getitem(#3, #18)
20 view(#19, (16, 16, -1))
21 permute(#20, (2, 0, 1))
22 contiguous(#21)
23 unsqueeze(#22, 0)
24 add(#17, #23, 1)
25 view(#24, (-1, 4, 4, 256))
26 view(#5, (1, 4, 1, 256))
27 add(#25, #26, 1)
28 view(#27, (-1, 4, 16, 16))
29 softmax(#28, -1, None)
30 matmul(#29, #14)
31 transpose(#30, 1, 2)
32 reshape(#31, (8, 16, -1))
33 linear(#32, #6, #7)
34 output (#33)
--- after: unchanged ---
not fused: softmax input is not q·kᵀ (with scale/mask): found view (view_4)""")


    def test_xcit_temperature_per_head_scales_q(self):
        self.assertExpectedInline(rewrite_listing(lambda x: xca(XCIT, x), torch.randn(B, 20, 64)), """\
0 input (2, 20, 64)
1 input (192, 64)
2 input (192,)
3 input (4, 1, 1)
4 input (64, 64)
5 input (64,)
6 linear(#0, #1, #2)
7 reshape(#6, (2, 20, 3, 4, 16))
8 permute(#7, (2, 0, 3, 4, 1))
9 unbind(#8, 0)
10 getitem(#9, 0)
11 getitem(#9, 1)
12 getitem(#9, 2)
13 normalize(#10, dim=-1)
14 normalize(#11, dim=-1)
15 transpose(#14, -2, -1)
16 matmul(#13, #15)
17 mul(#16, #3)
18 softmax(#17, -1, None)
19 matmul(#18, #12)
20 permute(#19, (0, 3, 1, 2))
21 reshape(#20, (2, 20, 64))
22 linear(#21, #4, #5)
23 output (#22)
--- after ---
0 input (2, 20, 64)
1 input (192, 64)
2 input (192,)
3 input (4, 1, 1)
4 input (64, 64)
5 input (64,)
6 linear(#0, #1, #2)
7 reshape(#6, (2, 20, 3, 4, 16))
8 permute(#7, (2, 0, 3, 4, 1))
9 unbind(#8, 0)
10 getitem(#9, 0)
11 getitem(#9, 1)
12 getitem(#9, 2)
13 normalize(#10, dim=-1)
14 normalize(#11, dim=-1)
15 mul(#13, #3)
16 fuse_plugin.attention(#15, #14, #12, None, 0, False, 1)
17 getitem(#16, 0)
18 permute(#17, (0, 3, 1, 2))
19 reshape(#18, (2, 20, 64))
20 linear(#19, #4, #5)
21 output (#20)
--- report ---
fused: scale=1, run-time scale applied to q (a factor per query row)""")

    def test_negative_xcit_factor_per_key(self):  # a factor that differs along the keys cannot move to q
        self.assertExpectedInline(rewrite_listing(lambda x: xca(XCIT_PER_KEY, x), torch.randn(B, 20, 64)), """\
0 input (2, 20, 64)
1 input (192, 64)
2 input (192,)
3 input (4, 1, 16)
4 input (64, 64)
5 input (64,)
6 linear(#0, #1, #2)
7 reshape(#6, (2, 20, 3, 4, 16))
8 permute(#7, (2, 0, 3, 4, 1))
9 unbind(#8, 0)
10 getitem(#9, 0)
11 getitem(#9, 1)
12 getitem(#9, 2)
13 normalize(#10, dim=-1)
14 normalize(#11, dim=-1)
15 transpose(#14, -2, -1)
16 matmul(#13, #15)
17 mul(#16, #3)
18 softmax(#17, -1, None)
19 matmul(#18, #12)
20 permute(#19, (0, 3, 1, 2))
21 reshape(#20, (2, 20, 64))
22 linear(#21, #4, #5)
23 output (#22)
--- after: unchanged ---
not fused: the scores are multiplied by a tensor (mul (attn)), not a scale""")


    def test_hf_window_beside_padding(self):
        self.assertExpectedInline(rewrite_listing(hf_window_padding, *qkv(), keep_keys()), """\
0 input (2, 8)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 4, 8, 16)
4 arange(8)
5 getitem(#4, (None, None, :, None))
6 arange(8)
7 getitem(#6, (None, None, None, :))
8 le(#7, #5)
9 sub(#5, 3, 1)
10 gt(#7, #9)
11 and_(#8, #10)
12 getitem(#0, (:, None, None, :))
13 and_(#11, #12)
14 transpose(#1, -2, -1)
15 matmul(#2, #14)
16 div(#15, 4, None)
17 tensor(0)
18 where(#13, #17, -3.40282e+38)
19 add(#16, #18, 1)
20 softmax(#19, -1, None)
21 matmul(#20, #3)
22 output (#21)
--- after ---
0 input (2, 8)
1 input (2, 4, 8, 16)
2 input (2, 4, 8, 16)
3 input (2, 4, 8, 16)
4 getitem(#0, (:, None, None, :))
5 where(#4, 0, -3.40282e+38)
6 logical_not(#4)
7 fuse_plugin.attention(#2, #1, #3, #5, 0, True, 0.25, replace=#6, window=3)
8 getitem(#7, 0)
9 getitem(#7, 1)
10 _average_dead_rows(#8, #9, #2, #1, #3, 0.25)
11 output (#10)
--- report ---
fused: scale=0.25, is_causal (arange comparison), bias: float mask, replace mask (finite fill), sliding window 3 (proved: query i sees keys from i-2; arange comparison): the kernels skip the key blocks it hides; rows masked everywhere (fill -3.40282e+38) average v over all keys after the op, as eager""")

    def test_negative_hf_window_beside_padding_two_fills(self):
        self.assertExpectedInline(rewrite_listing(hf_window_padding_two_fills, *qkv(), keep_keys()), """\
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 arange(8)
5 getitem(#4, (None, None, :, None))
6 arange(8)
7 getitem(#6, (None, None, None, :))
8 transpose(#0, -2, -1)
9 matmul(#1, #8)
10 div(#9, 4, None)
11 le(#7, #5)
12 sub(#5, 3, 1)
13 gt(#7, #12)
14 and_(#11, #13)
15 tensor(0)
16 where(#14, #15, -3.40282e+38)
17 add(#10, #16, 1)
18 getitem(#2, (:, None, None, :))
19 invert(#18)
20 masked_fill(#17, #19, -3.40282e+38)
21 softmax(#20, -1, None)
22 matmul(#21, #3)
23 output (#22)
--- after ---
0 input (2, 4, 8, 16)
1 input (2, 4, 8, 16)
2 input (2, 8)
3 input (2, 4, 8, 16)
4 arange(8)
5 getitem(#4, (None, None, :, None))
6 arange(8)
7 getitem(#6, (None, None, None, :))
8 le(#7, #5)
9 sub(#5, 3, 1)
10 gt(#7, #9)
11 and_(#8, #10)
12 tensor(0)
13 where(#11, #12, -3.40282e+38)
14 getitem(#2, (:, None, None, :))
15 invert(#14)
16 where(#15, -3.40282e+38, #13)
17 fuse_plugin.attention(#1, #0, #3, #16, 0, False, 0.25, replace=#15, need_lse=False)
18 getitem(#17, 0)
19 contiguous(#18)
20 output (#19)
--- report ---
fused: scale=0.25, bias: float mask, replace mask (finite fill), causal mask (arange comparison) kept in the bias with its own values: is_causal's -inf masking would change rows masked everywhere, sliding window 3 (proved: query i sees keys from i-2; arange comparison), kept in the bias""")


# =============================================================================== differential


def _pos():
    g = torch.Generator().manual_seed(3)
    return torch.randn(B * H, 2 * L, D, generator=g), torch.randn(B * H, 2 * L, D, generator=g)


def _alibi(keep):
    return alibi_slopes(B, H, keep)


# (function, inputs, attention sites fused). keep_keys(masked_batch=0): batch 0 has no key left, so
# every one of its rows is masked everywhere (uniform weights with finite fills, zeros with
# _safe_softmax); -inf masks are only partial here (NaN rows are tests/test_masked_rows.py's).
DIFFERENTIAL = [
    ("distilbert", distilbert, lambda: (*qkv(), keep_keys(masked_batch=0)), 1),
    ("expanded_mask_returned", expanded_mask_returned, lambda: (*qkv(), keep_keys()), 0),
    ("mbart", mbart, lambda: (*qkv(), additive(keep_keys(masked_batch=0))), 1),
    ("mbart_cross", mbart, lambda: (*qkv(lq=5, lk=11), additive(keep_keys(lk=11))), 1),
    ("mbart_v_not_merged", mbart_v_not_merged, lambda: (*qkv()[:2], torch.randn(B * H, L, D), additive(keep_keys())), 0),
    ("masked_baddbmm", masked_merged_baddbmm, lambda: (*qkv(), torch.randn(B * H, L, L), keep_keys()), 1),
    ("aten_safe_softmax", safe_aten, lambda: (*qkv(), keep_keys(masked_batch=0)), 1),
    ("safe_softmax_dim_2", safe_dim_2, lambda: (*qkv(), keep_keys()), 0),
    ("falcon_mqa", falcon_mqa, lambda: (*qkv(hkv=1), additive(keep_keys(masked_batch=0))), 1),
    ("mqa_v_all_heads", falcon_mqa, lambda: (qkv()[0], qkv(hkv=1)[1], qkv()[2], additive(keep_keys())), 0),
    ("bloom", bloom, lambda: (*qkv(), _alibi(keep_keys(masked_batch=0)), additive(keep_keys(masked_batch=0))), 1),
    ("falcon_alibi", falcon_alibi, lambda: (*qkv(), _alibi(keep_keys()), additive(keep_keys(masked_batch=0))), 1),
    ("bloom_beta_2", bloom_beta2, lambda: (*qkv(), _alibi(keep_keys()), additive(keep_keys())), 0),
    # DeBERTa-v2: its bias (from q and k terms, with their gradients) before a finite padding fill,
    # and the term added after the fill: the op's replace mask (attention_bias.replace_mask)
    ("deberta", deberta, lambda: (*qkv(), *_pos(), keep_keys(masked_batch=0)), 1),
    ("deberta_term_after_fill", deberta_add_after_fill, lambda: (*qkv(), *_pos(), keep_keys(masked_batch=0)), 1),
]


@pytest.mark.parametrize("fn, make, fused", [c[1:] for c in DIFFERENTIAL], ids=[c[0] for c in DIFFERENTIAL])
def test_differential(fn, make, fused):
    differential(fn, *make(), fused=fused)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("fn, make", [(bloom, lambda: (*qkv(), _alibi(keep_keys()), additive(keep_keys()))),
                                      (falcon_mqa, lambda: (*qkv(hkv=1), additive(keep_keys()))),
                                      (mbart, lambda: (*qkv(), additive(keep_keys())))], ids=["bloom", "falcon_mqa", "mbart"])
def test_differential_half(fn, make, dtype):
    differential(fn, *(t.to(dtype) for t in make()), fused=1, tol=1e-2)  # (no row masked everywhere)


def test_differential_sizes_read_dynamic():
    differential(sizes_read, *qkv(), fused=1, dynamic=True)


KPM = keep_keys().logical_not()  # key_padding_mask: True = not attended (partial: no row masked everywhere)


@pytest.mark.parametrize("fn, make, fused", [
    (mha_head, lambda: (torch.randn(B, 1, 64), torch.randn(B, L, 64), KPM), 1),
    (mha_head, lambda: (torch.randn(B, 3, 64), torch.randn(B, L, 64), None), 1),
    (mha_weights_used, lambda: (torch.randn(B, 1, 64), torch.randn(B, L, 64), KPM), 0),
    (lambda m, p, x, am: m(p, x, x, attn_mask=am)[0],
     lambda: (torch.randn(B, 3, 64), torch.randn(B, L, 64), torch.zeros(B * 4, 3, L).masked_fill(KPM[:, None, :].repeat_interleave(4, 0), float("-inf"))), 1),
    (lambda m, p, x, am: m(p, x, x, attn_mask=am)[0],
     lambda: (torch.randn(B, 3, 64), torch.randn(B, L, 64), torch.triu(torch.ones(3, L, dtype=torch.bool), 1)), 1),
], ids=["mha_pooling_head", "mha_no_mask", "mha_weights_used", "mha_3d_float_mask", "mha_2d_bool_mask"])
def test_differential_mha(fn, make, fused):
    differential(fn, *make(), fused=fused, module=new_mha())


@pytest.mark.parametrize("fn, fused", [(swin, 1), (swin_flat_mask, 0)], ids=["swin_5d_mask", "swin_flat_mask"])
def test_differential_swin(fn, fused):
    torch.manual_seed(0)
    differential(fn, torch.randn(B * 4, 16, 64), shifted_window_mask(), fused=fused, module=WindowAttention())


@pytest.mark.parametrize("per_key, fused", [(False, 1), (True, 0)], ids=["xcit", "xcit_factor_per_key"])
def test_differential_xcit(per_key, fused):  # the temperature's gradient included
    torch.manual_seed(0)
    differential(xca, torch.randn(B, 20, 64), fused=fused, module=XCA(per_key=per_key))


def test_safe_softmax_rows_masked_everywhere_are_zero():
    """aten._safe_softmax: the fused result is exactly 0 in the rows with no key (eager's semantics),
    with zero gradients into those rows of q, and finite ones elsewhere."""
    q, k, v = (t.requires_grad_() for t in qkv())
    keep = keep_keys(masked_batch=0)
    torch._dynamo.reset()
    out = torch.compile(safe_aten, backend=rewrite_aot_eager)(q, k, v, keep)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0
    out.sum().backward()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0])) and torch.isfinite(k.grad).all()


def test_mha_dropout_in_the_kernel_is_repeatable():
    """nn.MultiheadAttention(dropout=0.2) in training: fused with the dropout in the op; the same
    torch.manual_seed gives the same output, another seed another one."""
    m = nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.2).train()
    probe, x = torch.randn(B, 3, 64), torch.randn(B, L, 64)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda p, x: m(p, x, x)[0], backend=rewrite_aot_eager)
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outs.append(compiled(probe, x))
    assert counters["fuse_plugin"]["attention"] == 1
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


# =============================================================================== a seeded differential fuzzer

import os  # noqa: E402
import random  # noqa: E402


def _fuzz_case(seed: int):
    """One random attention in one of the spellings above: shapes (Lq ≠ Lk where the spelling allows),
    padding with rows masked everywhere (finite fills and additive masks; -inf bool masks keep key 0,
    but under _safe_softmax), float32 or a half dtype."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lq, lk = rnd.randint(1, 12), rnd.randint(1, 12)
    keep = torch.rand(B, lk, generator=g) > rnd.choice([0.2, 0.5])
    if rnd.random() < 0.5:
        keep[rnd.randrange(B)] = False  # a batch with no key: its rows are masked everywhere
    partial = keep.clone()
    partial[:, 0] = True  # -inf masks: at least key 0 left
    dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16])
    t = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    additive_ = lambda keep: additive(keep, dtype)  # noqa: E731  (finfo.min of the dtype, as HF builds it)
    q, k, v = t(B, H, lq, D), t(B, H, lk, D), t(B, H, lk, D)
    name = rnd.choice(["distilbert", "mbart", "masked_baddbmm", "safe", "falcon_mqa", "bloom", "falcon_alibi",
                       "deberta"])
    if name == "distilbert":
        fn, args = distilbert, (q, k, v, keep)
    elif name == "mbart":
        fn, args = mbart, (q, k, v, additive_(keep))
    elif name == "masked_baddbmm":
        fn, args = masked_merged_baddbmm, (q, k, v, t(B * H, lq, lk), partial)
    elif name == "safe":
        fn, args = safe_aten, (q, k, v, keep)
    elif name == "falcon_mqa":
        fn, args = falcon_mqa, (q, k[:, :1], v[:, :1], additive_(keep))
    elif name == "bloom":
        fn, args = bloom, (q, k, v, alibi_slopes(B, H, keep), additive_(keep))
    elif name == "falcon_alibi":
        fn, args = falcon_alibi, (q, k, v, alibi_slopes(B, H, keep), additive_(keep))
    else:  # self attention only
        keep = keep[:, :lq] if lq <= lk else torch.cat([keep, keep.new_ones(B, lq - lk)], 1)
        fn, args = deberta, (q, t(B, H, lq, D), t(B, H, lq, D), t(B * H, 2 * lq, D), t(B * H, 2 * lq, D), keep)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    return name, fn, args, (1e-5 if dtype == torch.float32 else 1e-2)


FUZZ_CASES = int(os.environ.get("FUSE_PLUGIN_SPELLING_FUZZ", "16"))


@pytest.mark.parametrize("seed", range(FUZZ_CASES))
def test_spelling_fuzz(seed):
    """Compiled vs eager, output and every gradient, on random cases of the spellings (16 in CI;
    FUSE_PLUGIN_SPELLING_FUZZ=500 for more). Every case must fuse (1 site) and agree."""
    name, fn, args, tol = _fuzz_case(seed)
    differential(fn, *args, fused=1, tol=tol)


# =============================================================================== the output's layout


def attention_then_view(q, k, v):
    """The op lays its output out (B, L, H, D) (ops/attention.py); `.view(B·H, L, D)` of eager's
    contiguous w·v needs eager's strides, so the rewrite must give them back there."""
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return (w @ v).view(-1, q.shape[2], v.shape[3]) * 2


def test_view_of_the_output_gets_eager_layout():
    differential(attention_then_view, *qkv(), fused=1)
