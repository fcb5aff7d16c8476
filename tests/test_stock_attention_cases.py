"""Every attention spelling stock Inductor fuses, fused by the plugin too, with parity (issue 14, item 6).

Our own restatement of the cases Inductor's attention fusion is built for: the 30 `_sfdp_pattern_N`
of torch/_inductor/fx_passes/fuse_attention.py and the `_test_sdpa_rewriter_*` cases of PyTorch's
test/inductor/test_fused_attention.py, each written here as a small function in the pattern's own
spelling (transposes or permutes, scale by mul or div, on the scores or on q, masks by add / where /
masked_fill, casts around the softmax, dropout where the pattern has one, extra outputs).

Differences from the originals, on purpose: float32 everywhere (the CPU parity bounds below are fp32
bounds; the fp16 casts of patterns 7-10 become casts to the input dtype, no-ops in float32), small
shapes, masks mostly passed as inputs (a float mask then gets its gradient checked too), and
pattern 28's non-contiguous inputs are leaves with transposed strides.

CI (fast): each case compiled with our rewrite followed by AOTAutograd and eager kernels
(helpers.rewrite_aot_eager), in inference (no grad, dropout off) and in training (grad of q, k, v
and of every float input): exactly one fused attention site (`counters["fuse_plugin"]["attention"]`),
output rel ≤ 1e-5 and gradients rel ≤ 1e-4 vs eager. Cases with dropout are checked for parity with
p = 0 in training, and with p > 0 for the fused count and for determinism (the same manual_seed gives
the same output and gradients, another seed another mask).

Slow (FUSE_PLUGIN_STOCK_CASES=1): each case compiled by stock torch.compile (Inductor, with the
plugin off: `fuse_plugin.disabled()`), reading `counters["inductor"]["fuse_attention"]`. It asserts
that the set of (case, mode) stock fuses equals the list below (so the list cannot go stale
silently) and that the plugin fuses each of them (but the known gap below). Caches off there: a
cache hit skips Inductor's pattern passes and their counter.

Stock Inductor's fusions, as found by that slow mode on 2026-11-24 with torch 2.13.0 (CPU, float32,
the shapes below; a number N is case `sfdp_N`, pattern N; fused = counters["inductor"]["fuse_attention"]
≥ 1). STOCK_FUSES is read from these lines:

    stock fuses (inference): 1 2 3 4 5 5_causal_inf 6 7 8 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25
    stock fuses (inference): 26 27 28 29 30 rewriter_5_zeros_bool rewriter_prev_13_clone rewriter_15_tril_keep
    stock fuses (inference): ckpt_sfdp_1 ckpt_sfdp_3 ckpt_sfdp_5_causal_inf
    stock fuses (training): 1 2 3 4 5_causal_inf 7 8 11 12 27 28 30 rewriter_5_zeros_bool rewriter_prev_13_clone
    stock fuses (training): ckpt_sfdp_1 ckpt_sfdp_3 ckpt_sfdp_5_causal_inf

and it fuses none of NEAR_MISSES (the weights returned too, a tensor scale, an int or a float-scalar
"mask"), of which ours fuses the last two, with parity.

(9 and 10, the scale on q with casts around the softmax, are not fused by stock in float32; in training
stock matches only the patterns above, and with dropout p = 0.3.)

The plugin fuses every case stock fuses. sfdp_19, GPT-2's `where(causal, s, finfo.min) + padding`, a finite fill
followed by an additive mask, is fused with the op's replace mask (patterns/attention_bias.py: in a
row masked everywhere eager mixes filled and added scores, which the op then computes as eager).
"""
import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers import rel_err, rewrite_aot_eager
from torch._dynamo.utils import counters

import torch._functorch.config
import torch._inductor.config

import fuse_plugin
from fuse_plugin import settings

B, H, L, D = 2, 2, 8, 16
DROPOUT_P = 0.3


def _randn(*shape):
    return torch.randn(*shape)


def bhld():  # (batch, heads, length, head dim)
    return [_randn(B, H, L, D) for _ in range(3)]


def blhd():  # (batch, length, heads, head dim): the permuting patterns
    return [_randn(B, L, H, D) for _ in range(3)]


def keep_mask_bl():  # DistilBERT: 1 = attend, 0 = padding; every row keeps key 0
    m = torch.ones(B, L, dtype=torch.long)
    m[0, -3:] = 0
    m[1, 2] = 0
    return m


def causal_bool():
    return torch.ones(L, L, dtype=torch.bool).tril().view(1, 1, L, L)


def float_mask():
    return _randn(B, 1, L, L)


# --- the cases: one function per pattern, written as the math ----------------------------------
# Each takes (tensors..., *, p, training). p and training only matter where the pattern drops out.


def sfdp_1(q, k, v, *, p, training):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def sfdp_2(q, k, v, *, p, training):
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def sfdp_3(q, k, v, *, p, training):
    w = torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1)
    return F.dropout(w, p=p, training=training).matmul(v)


def sfdp_4(q, k, v, *, p, training):
    w = torch.matmul(q, k.transpose(-2, -1)).mul(0.4).softmax(dim=-1)
    return F.dropout(w, p=p, training=training).matmul(v)


def sfdp_5(q, k, v, mask, *, p, training):
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1)
    return w @ v


def sfdp_5_causal_inf(q, k, v, *, p, training):  # the rewriter test: a -inf causal mask built inside
    keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    mask = torch.zeros(keep.shape).masked_fill(keep.logical_not(), -float("inf"))
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def sfdp_6(q, k, v, mask, *, p, training):
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1)
    return torch.dropout(w, p, training) @ v


def sfdp_7(q, k, v, *, p, training):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).to(torch.float32)
    w = torch.dropout(torch.softmax(s, dim=-1), p, training).to(q.dtype)
    return w @ v.to(w.dtype)


def sfdp_8(q, k, v, *, p, training):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).to(torch.float32)
    w = torch.softmax(s, dim=-1).to(q.dtype)
    return w @ v.to(w.dtype)


def sfdp_9(q, k, v, *, p, training):  # scale on q
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    q = q / math.sqrt(q.size(-1))
    s = (q @ k.transpose(-2, -1)).to(torch.float32)
    w = torch.dropout(torch.softmax(s, dim=-1), p, training).to(q.dtype)
    return w @ v.to(w.dtype)


def sfdp_10(q, k, v, *, p, training):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    q = q / math.sqrt(q.size(-1))
    w = torch.softmax((q @ k.transpose(-2, -1)).to(torch.float32), dim=-1).to(q.dtype)
    return w @ v.to(w.dtype)


def sfdp_11(q, k, v, *, p, training):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def sfdp_12(q, k, v, *, p, training):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    w = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1)
    return F.dropout(w, p=p, training=training).matmul(v)


def sfdp_13(q, k, v, *, p, training):  # 3-D, no scale
    w = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
    return torch.bmm(F.dropout(w, p=p, training=training), v)


def sfdp_14(q, k, v, mask, *, p, training):  # BERT
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    return (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1).matmul(v)


def _distilbert_fill(scores, keep):
    bs, k_len = scores.size(0), scores.size(-1)
    hidden = (keep == 0).view((bs, 1, 1, k_len)).expand_as(scores)
    return scores.masked_fill(hidden, torch.full((), -float("inf"), dtype=scores.dtype))


def sfdp_15(q, k, v, keep, *, p, training):  # DistilBERT
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)).div(math.sqrt(q.size(-1)))
    return torch.softmax(_distilbert_fill(scores, keep), dim=-1) @ v


def sfdp_16(q, k, v, mask, *, p, training):  # BERT with dropout
    q0 = q
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    w = (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1)
    return F.dropout(w, p, training=training).to(dtype=q0.dtype).matmul(v)


def sfdp_17(q, k, v, keep, *, p, training):  # DistilBERT with dropout
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)).div(math.sqrt(q.size(-1)))
    w = torch.softmax(_distilbert_fill(scores, keep), dim=-1)
    return F.dropout(w, p, training=training) @ v


def _gpt2_scores(q, k, causal):
    s = torch.matmul(q, k.permute(0, 1, 3, 2))
    s = s.div(torch.full([], math.sqrt(q.size(-1)), dtype=s.dtype))
    return torch.where(causal, s, torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype))


def sfdp_18(q, k, v, causal, *, p, training):  # GPT-2: returns the permuted key and value too
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    w = _gpt2_scores(q, k, causal).softmax(dim=-1)
    return F.dropout(w, p, training=training).matmul(v), k, v


def sfdp_19(q, k, v, causal, mask, *, p, training):  # GPT-2 with padding
    s = _gpt2_scores(q, k, causal) + mask
    w = s.softmax(dim=-1).type(v.dtype)
    return F.dropout(w, p, training=training).matmul(v)


def sfdp_20(q, k, v, keep, *, p, training):  # DistilBERT (transformers 4.44): scale on q
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    q = q.div(math.sqrt(q.size(-1)))
    w = torch.softmax(_distilbert_fill(q @ k.transpose(-2, -1), keep), dim=-1)
    return F.dropout(w, p, training=training) @ v


def _t5_scores(q, k):
    return torch.matmul(q, k.permute(0, 1, 3, 2))


def sfdp_21(q, k, v, bias, *, p, training):  # T5: no scale, additive position bias
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    s = (_t5_scores(q, k) + bias).type_as(q)
    return s.float().softmax(dim=-1).type_as(q).matmul(v)


def sfdp_22(q, k, v, bias, *, p, training):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    s = (_t5_scores(q, k) + bias).type_as(q)
    return s.float().softmax(dim=-1).type_as(q).matmul(v), k, v


def sfdp_23(q, k, v, *, p, training):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    s = _t5_scores(q, k).float().type_as(q)
    return s.float().softmax(dim=-1).type_as(q).matmul(v), k, v


def sfdp_24(q, k, v, mask, *, p, training):  # MBart: merged heads, a 4-D mask between 3-D views
    bs, nh, lq, d = q.shape
    q3 = q.view(bs * nh, -1, d)
    k3, v3 = k.reshape(bs * nh, -1, d), v.reshape(bs * nh, -1, d)
    s = torch.bmm(q3, k3.transpose(1, 2))
    s = (s.view(bs, nh, lq, -1) + mask).view(bs * nh, lq, -1)
    w = F.softmax(s, dim=-1)
    return torch.bmm(w, v3).view(bs, nh, lq, d)


def sfdp_25(q, k, v, bias, *, p, training):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    w = (_t5_scores(q, k) + bias).float().softmax(dim=-1).type_as(q)
    return F.dropout(w, p, training=training).matmul(v)


def sfdp_26(q, k, v, bias, *, p, training):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    w = (_t5_scores(q, k) + bias).float().softmax(dim=-1).type_as(q)
    return F.dropout(w, p, training=training).matmul(v), k, v


def sfdp_27(q, k, v, *, p, training):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    w = _t5_scores(q, k).float().softmax(dim=-1).type_as(q)
    return F.dropout(w, p, training=training).matmul(v), k, v


sfdp_28 = sfdp_4  # Visformer: pattern 4 on non-contiguous q, k, v (see the inputs)


def sfdp_29(q, k, v, mask, *, p, training):  # SDPA's math decomposition: sqrt of the scale on q and k
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    root = 1.0 / math.sqrt(math.sqrt(q.size(-1)))
    q = torch.ops.aten.mul.Scalar(q, root)
    kt = torch.ops.aten.mul.Scalar(k.transpose(-2, -1), root)
    return torch.ops.aten._safe_softmax(q @ kt + mask, -1) @ v


def sfdp_30(q, k, v, *, p, training):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    root = 1.0 / math.sqrt(math.sqrt(q.size(-1)))
    q = torch.ops.aten.mul.Scalar(q, root)
    kt = torch.ops.aten.mul.Scalar(k.transpose(-2, -1), root)
    return torch.ops.aten._safe_softmax(q @ kt, -1) @ v


# --- variants from the rewriter tests ----------------------------------------------------------


def rewriter_5_zeros_bool(q, k, v, *, p, training):  # a bool mask of zeros added (pytorch#100318)
    none = torch.zeros(q.size(-2), k.size(-2), dtype=torch.bool)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + none, dim=-1) @ v


def rewriter_prev_13_clone(q, k, v, *, p, training):  # a clone between softmax and · v
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def rewriter_15_tril_keep(q, k, v, *, p, training):  # DistilBERT with its keep mask built in the graph
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    keep = torch.ones(q.size(0), k.size(-2), dtype=torch.bool).tril()
    scores = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    return torch.matmul(F.softmax(_distilbert_fill(scores, keep), dim=-1), v)


def checkpointed(fn):
    """The rewriter tests run cases 1-10 under activation checkpointing too (reentrant)."""
    def inner(*args, p, training):
        return torch.utils.checkpoint.checkpoint(functools.partial(fn, p=p, training=training), *args,
                                                 use_reentrant=True)
    return inner


# --- near misses: the rewriter tests' cases stock leaves alone -----------------------------------


def weights_returned(q, k, v, *, p, training):  # the weights are an output: not attention's alone
    w = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1)
    return w.matmul(v), w


def tensor_factor_div(q, k, v, factor, *, p, training):  # a scale per (batch·head) row block, a tensor
    return torch.matmul(q, k.transpose(-2, -1)).div(factor.detach()).softmax(dim=-1).matmul(v)


def tensor_factor_mul(q, k, v, factor, *, p, training):
    return torch.matmul(q, k.transpose(-2, -1)).mul(factor.detach()).softmax(dim=-1).matmul(v)


def int_mask(q, k, v, mask, *, p, training):  # an integer tensor added to the scores
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def scalar_mask(q, k, v, *, p, training):  # a Python float added to the scores: a shift, no mask
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + 2.0, dim=-1) @ v


def _noncontiguous_bhld():  # (B, H, D, L) storage read as (B, H, L, D): leaves with odd strides
    return [_randn(B, H, D, L).transpose(-2, -1) for _ in range(3)]


def _t5_bias():
    return _randn(1, H, L, L)


# name -> (function, inputs, has dropout)
CASES = {
    "sfdp_1": (sfdp_1, bhld, False),
    "sfdp_2": (sfdp_2, bhld, False),
    "sfdp_3": (sfdp_3, bhld, True),
    "sfdp_4": (sfdp_4, bhld, True),
    "sfdp_5": (sfdp_5, lambda: bhld() + [float_mask()], False),
    "sfdp_5_causal_inf": (sfdp_5_causal_inf, bhld, False),
    "sfdp_6": (sfdp_6, lambda: bhld() + [float_mask()], True),
    "sfdp_7": (sfdp_7, blhd, True),
    "sfdp_8": (sfdp_8, blhd, False),
    "sfdp_9": (sfdp_9, blhd, True),
    "sfdp_10": (sfdp_10, blhd, False),
    "sfdp_11": (sfdp_11, blhd, False),
    "sfdp_12": (sfdp_12, blhd, True),
    "sfdp_13": (sfdp_13, lambda: [_randn(B * H, L, D) for _ in range(3)], True),
    "sfdp_14": (sfdp_14, lambda: blhd() + [float_mask()], False),
    "sfdp_15": (sfdp_15, lambda: blhd() + [keep_mask_bl()], False),
    "sfdp_16": (sfdp_16, lambda: blhd() + [float_mask()], True),
    "sfdp_17": (sfdp_17, lambda: blhd() + [keep_mask_bl()], True),
    "sfdp_18": (sfdp_18, lambda: blhd() + [causal_bool()], True),
    "sfdp_19": (sfdp_19, lambda: bhld() + [causal_bool(), float_mask()], True),
    "sfdp_20": (sfdp_20, lambda: blhd() + [keep_mask_bl()], True),
    "sfdp_21": (sfdp_21, lambda: blhd() + [_t5_bias()], False),
    "sfdp_22": (sfdp_22, lambda: blhd() + [_t5_bias()], False),
    "sfdp_23": (sfdp_23, blhd, False),
    "sfdp_24": (sfdp_24, lambda: bhld() + [_randn(B, 1, L, L)], False),
    "sfdp_25": (sfdp_25, lambda: blhd() + [_t5_bias()], True),
    "sfdp_26": (sfdp_26, lambda: blhd() + [_t5_bias()], True),
    "sfdp_27": (sfdp_27, blhd, True),
    "sfdp_28": (sfdp_28, _noncontiguous_bhld, True),
    "sfdp_29": (sfdp_29, lambda: blhd() + [float_mask()], False),
    "sfdp_30": (sfdp_30, blhd, False),
    "rewriter_5_zeros_bool": (rewriter_5_zeros_bool, bhld, False),
    "rewriter_prev_13_clone": (rewriter_prev_13_clone, bhld, False),
    "rewriter_15_tril_keep": (rewriter_15_tril_keep, blhd, False),
    "ckpt_sfdp_1": (checkpointed(sfdp_1), bhld, False),
    "ckpt_sfdp_3": (checkpointed(sfdp_3), bhld, True),
    "ckpt_sfdp_5_causal_inf": (checkpointed(sfdp_5_causal_inf), bhld, False),
}

# name -> (function, inputs, expected fused sites of ours): stock fuses none of them.
NEAR_MISSES = {
    "weights_returned": (weights_returned, bhld, 0),
    # ours: a tensor factor per head (H, 1, 1) is one per query row: moved to q (XCiT's temperature,
    # stop 34), fused; one that differs along the keys (H, 1, L) is not a scale: left alone
    "tensor_factor_div": (tensor_factor_div, lambda: bhld() + [_randn(H, 1, 1).abs() + 1], 1),
    "tensor_factor_mul": (tensor_factor_mul, lambda: bhld() + [_randn(H, 1, 1)], 1),
    "tensor_factor_per_key": (tensor_factor_mul, lambda: bhld() + [_randn(H, 1, L)], 0),
    # ours: an integer bias is promoted like eager does, a constant shift is a constant bias: fused
    "int_mask": (int_mask, lambda: bhld() + [torch.randint(-3, 3, (B, H, L, L), dtype=torch.int32)], 1),
    "scalar_mask": (scalar_mask, bhld, 1),
}


def _stock_fuses_from_docstring() -> set:
    found = set()
    for line in __doc__.splitlines():
        m = re.match(r"\s*stock fuses \((inference|training)\):(.*)", line)
        if m:
            found |= {(f"sfdp_{n}" if n[0].isdigit() else n, m.group(1)) for n in m.group(2).split()}
    return found


# (case, mode) pairs stock Inductor fuses: the module docstring's list (the slow mode re-derives it).
STOCK_FUSES = _stock_fuses_from_docstring()

# --- running a case ----------------------------------------------------------------------------


def inputs(name, training):
    torch.manual_seed(sum(map(ord, name)))
    args = (CASES[name] if name in CASES else NEAR_MISSES[name])[1]()
    if training:
        args = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    return args


def bound(name, p, training):
    return functools.partial((CASES[name] if name in CASES else NEAR_MISSES[name])[0], p=p, training=training)


def outputs(result):
    return list(result) if isinstance(result, tuple) else [result]


def run(fn, args, training, seed=0):
    """Outputs, and in training the gradients of every input that requires one (for a fixed cotangent)."""
    torch.manual_seed(seed)
    outs = outputs(fn(*args))
    if not training:
        return outs, []
    g = torch.Generator().manual_seed(123)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for a in leaves:
        a.grad = None
    loss.backward()  # not autograd.grad: reentrant checkpointing refuses it
    return [o.detach() for o in outs], [a.grad for a in leaves]


def assert_parity(got_out, got_grads, want_out, want_grads):
    assert len(got_out) == len(want_out) and len(got_grads) == len(want_grads)
    for got, want in zip(got_out, want_out):
        assert rel_err(got, want) <= 1e-5
    for got, want in zip(got_grads, want_grads):
        assert (got is None) == (want is None)  # a detached input gets none on both sides
        assert want is None or rel_err(got, want) <= 1e-4


def fused_sites(fn, args, training):
    """How many attention sites our rewrite fuses in fn (rewrite + AOTAutograd + eager kernels)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=rewrite_aot_eager, fullgraph=True)
    result = run(compiled, args, training)
    return counters["fuse_plugin"]["attention"], compiled, result


def stock_fuses(name, training):
    """Does stock Inductor (plugin off) rewrite this case into SDPA?"""
    p = DROPOUT_P if name in CASES and CASES[name][2] else 0.0
    fn = bound(name, p, training)
    args = inputs(name, training)
    torch._dynamo.reset()
    counters.clear()
    # no cache: a cache hit skips the pattern passes, and with them the counter
    with fuse_plugin.disabled(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        run(torch.compile(fn, backend="inductor", fullgraph=True), args, training)
    torch._dynamo.reset()
    return counters["inductor"]["fuse_attention"] >= 1


MODES = ["inference", "training"]


@pytest.mark.parametrize("name,mode", [pytest.param(name, mode, id=f"{name}-{mode}")
                                       for name in CASES for mode in MODES])
def test_fused_with_parity(name, mode):
    """One site fused; outputs and all gradients equal eager's. Dropout cases run with p = 0 here."""
    training = mode == "training"
    fn = bound(name, 0.0, training)
    args = inputs(name, training)
    want_out, want_grads = run(fn, args, training)
    sites, _, (got_out, got_grads) = fused_sites(fn, args, training)
    assert sites == 1, f"{name} ({mode}): {sites} attention sites fused"
    assert_parity(got_out, got_grads, want_out, want_grads)


@pytest.mark.parametrize("name", NEAR_MISSES)
@pytest.mark.parametrize("mode", MODES)
def test_near_miss(name, mode):
    """Stock leaves these alone; ours fuses what it can prove (NEAR_MISSES' count), always with parity."""
    training = mode == "training"
    fn = bound(name, 0.0, training)
    args = inputs(name, training)
    want_out, want_grads = run(fn, args, training)
    sites, _, (got_out, got_grads) = fused_sites(fn, args, training)
    assert sites == NEAR_MISSES[name][2]
    assert_parity(got_out, got_grads, want_out, want_grads)


DROPOUT_CASES = [name for name, (_, _, has_dropout) in CASES.items() if has_dropout]


@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_dropout_fused_and_deterministic(name):
    """p > 0 in training: one site fused, the dropout inside it; the same seed gives the same output
    and gradients, another seed another output."""
    fn = bound(name, DROPOUT_P, True)
    args = inputs(name, True)
    sites, compiled, first = fused_sites(fn, args, True)
    assert sites == 1
    again = run(compiled, args, True)
    other = run(compiled, args, True, seed=1)
    for a, b in zip(first[0] + first[1], again[0] + again[1]):
        assert torch.equal(a, b)
    assert not torch.equal(first[0][0], other[0][0])
    # the dropped output is not the undropped one (the dropout was not lost in the rewrite)
    plain = run(bound(name, 0.0, True), args, True)
    assert not torch.allclose(first[0][0], plain[0][0])


def test_stock_list_names_known_cases():
    """The docstring's list parses to known cases, and every case stock fuses is either checked as
    fused by test_fused_with_parity or a known gap (xfail strict there)."""
    assert len(STOCK_FUSES) == 52
    assert {name for name, _ in STOCK_FUSES} <= set(CASES)


@pytest.mark.skipif(not settings.boolean("FUSE_PLUGIN_STOCK_CASES", False),
                    reason="slow (stock Inductor compiles every case): set FUSE_PLUGIN_STOCK_CASES=1")
def test_plugin_fuses_what_stock_fuses():
    """Re-derives STOCK_FUSES from stock Inductor and checks the plugin fuses each of those cases."""
    found = set()
    for name in CASES:
        for mode in MODES:
            if stock_fuses(name, mode == "training"):
                found.add((name, mode))
    ours = set()
    for name, mode in sorted(found):
        training = mode == "training"
        p = DROPOUT_P if CASES[name][2] else 0.0
        if fused_sites(bound(name, p, training), inputs(name, training), training)[0] >= 1:
            ours.add((name, mode))
    misses = {(name, mode) for name in NEAR_MISSES for mode in MODES if stock_fuses(name, mode == "training")}
    assert not misses, f"stock Inductor now fuses near misses {sorted(misses)}"
    print("stock fuses:", sorted(found))
    print("stock fuses, plugin not:", sorted(found - ours))
    assert found == STOCK_FUSES, f"stock Inductor now fuses {sorted(found)}; update STOCK_FUSES"
    assert not found - ours, "stock fuses, the plugin does not"
