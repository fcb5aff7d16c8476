"""Tiny attention code in plain torch, written the many ways real models write it.

`AttnSpec` names one spelling of attention (product, kᵀ, scale, mask, softmax, dropout, GQA, layout,
dtype; or a near miss that must stay unfused), `AttnModule(spec)` is that attention and
`make_inputs(spec)` its inputs; `compare_compiled(spec)` checks it compiled against eager. `Block` /
`TinyLlama` are small Llama-style decoders (embedding →
HF-style RoPE → GQA causal attention → gated MLP) for the end-to-end tests.

Used by tests/test_attention_patterns.py and tests/test_attention_hypothesis.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

from helpers import rel_err

PRODUCTS = ("matmul", "at", "method", "bmm", "einsum")
KTS = ("transpose", "transpose23", "mT", "permute", "pre", "permute0231")
SCALES = ("mul", "div_sqrt", "pow", "neg_pow", "q", "qk", "tensor", "none")
MASKS = (
    "none", "additive", "bias_grad", "hf_slice", "fill_eq0_inf", "fill_bool_min", "where_min", "where_inf",
    "causal_tril", "causal_tril_eq0", "causal_arange", "causal_triu_add", "causal_buffer", "causal_pad_inf",
    "causal_pad_min", "offset_causal",
)
SOFTMAXES = ("F", "torch", "method", "f32", "float", "module")
DROPOUTS = ("none", "p0", "eval", "train")
GQAS = ("none", "repeat_kv", "repeat_interleave")
LAYOUTS = ("bhld", "view_transpose", "permute")
NEGATIVES = (
    "none", "softmax_dim", "weights_used", "mask_5d", "scores_used", "fill_not_mask",
    "mul_by_tensor", "inplace_fill", "small_head",
)
# masks the recogniser must leave alone: none. (A finite causal fill followed by an additive padding
# mask, old HF GPT-2's "causal_pad_min", is fused with the op's replace mask: with left padding a
# padded query's row mixes filled scores, no gradient in eager, and added ones, with gradient.)
UNFUSED_MASKS: tuple = ()
# masks that make the recogniser emit is_causal
CAUSAL_MASKS = ("causal_tril", "causal_tril_eq0", "causal_arange", "causal_triu_add", "causal_buffer", "causal_pad_inf")


@dataclass(frozen=True)
class AttnSpec:
    product: str = "matmul"
    kt: str = "transpose"
    scale: str = "div_sqrt"
    mask: str = "none"
    softmax: str = "F"
    dropout: str = "none"
    gqa: str = "none"
    layout: str = "bhld"
    dtype: torch.dtype = torch.float32
    negative: str = "none"
    b: int = 2
    h: int = 4
    hkv: int = 2  # used when gqa != "none"
    lq: int = 8
    lk: int = 8
    d: int = 16
    dv: int = 16

    @property
    def kv_heads(self) -> int:
        return self.h if self.gqa == "none" else self.hkv

    def fused(self) -> bool:
        """Must the recogniser replace this attention?"""
        return self.negative == "none" and self.mask not in UNFUSED_MASKS

    def causal(self) -> bool:
        """Must the recogniser emit is_causal? (A 1×1 causal mask masks nothing.)"""
        return self.fused() and self.mask in CAUSAL_MASKS and self.lq > 1

    def valid(self) -> "AttnSpec":
        """The closest spec whose combination makes sense (shapes the spelling needs)."""
        s = self
        if s.mask in CAUSAL_MASKS + ("causal_pad_min",) and s.lk != s.lq:
            s = replace(s, lk=s.lq)
        if s.mask == "offset_causal" and s.lk <= s.lq:
            s = replace(s, lk=s.lq + 2)
        if s.kt == "pre":
            s = replace(s, gqa="none", product="matmul" if s.product == "bmm" else s.product)
        if s.kt == "permute0231":  # LeViT's k: (B, L, H, D) permuted to (B, H, D, L)
            s = replace(s, product="matmul", layout="bhld", gqa="none")
        if s.negative == "softmax_dim":
            s = replace(s, lk=s.lq)
        if s.negative in ("mask_5d", "scores_used", "weights_used", "inplace_fill") and s.product in ("bmm", "einsum"):
            s = replace(s, product="matmul")
        if s.negative in ("mask_5d", "fill_not_mask", "mul_by_tensor", "inplace_fill"):
            s = replace(s, mask="none")
        if s.negative == "small_head":  # below the kernel's head dims
            s = replace(s, d=8, dv=8)
        return s


class AttnModule(nn.Module):
    """One attention, spelled as `spec` says; forward(q, k, v, mask) with inputs from make_inputs."""

    def __init__(self, spec: AttnSpec):
        super().__init__()
        self.spec = spec
        if spec.mask == "causal_buffer":
            n = max(spec.lq, spec.lk) + 4
            self.register_buffer("causal", torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n), persistent=False)
        self.drop = nn.Dropout(0.0 if spec.dropout == "p0" else 0.1)
        self.softmax_module = nn.Softmax(dim=-1)
        if spec.dropout == "p0":
            self.train()
        elif spec.dropout == "eval":
            self.eval()

    # ------------------------------------------------------------------ pieces
    def heads(self, x, n):
        s = self.spec
        if s.layout == "view_transpose":  # (B, L, n*D) → (B, n, L, D)
            b, l, _ = x.shape
            return x.view(b, l, n, -1).transpose(1, 2)
        if s.layout == "permute":  # (B, L, n, D) → (B, n, L, D)
            return x.permute(0, 2, 1, 3)
        return x

    def repeat(self, x):
        s = self.spec
        n = s.h // s.hkv
        if s.gqa == "repeat_kv":
            b, h, l, d = x.shape
            return x[:, :, None, :, :].expand(b, h, n, l, d).reshape(b, h * n, l, d)
        if s.gqa == "repeat_interleave":
            return x.repeat_interleave(n, dim=1)
        return x

    def scores(self, q, k):
        s = self.spec
        d = q.size(-1)
        if s.scale == "q":
            q = q * (1.0 / math.sqrt(d))
        elif s.scale == "qk":
            q, k = q * d ** -0.25, k * d ** -0.25
        if s.product == "einsum":
            if s.kt == "pre":
                w = torch.einsum("bhqd,bhdk->bhqk", q, k)
            else:
                w = torch.einsum("bhqd,bhkd->bhqk", q, k)
        else:
            if s.kt == "pre":
                kt = k
            elif s.kt == "transpose":
                kt = k.transpose(-2, -1)
            elif s.kt == "transpose23":
                kt = k.transpose(2, 3) if k.dim() == 4 else k.transpose(1, 2)
            elif s.kt == "mT":
                kt = k.mT
            elif s.kt == "permute0231":
                kt = k.permute(0, 2, 3, 1)  # k given (B, L, H, D): (B, H, D, L), kᵀ of k.permute(0, 2, 1, 3)
            else:
                kt = k.permute(0, 1, 3, 2) if k.dim() == 4 else k.permute(0, 2, 1)
            if s.product == "matmul":
                w = torch.matmul(q, kt)
            elif s.product == "at":
                w = q @ kt
            elif s.product == "method":
                w = q.matmul(kt)
            else:
                w = torch.bmm(q, kt)
        if s.scale == "mul":
            w = w * (1.0 / math.sqrt(d))
        elif s.scale == "div_sqrt":
            w = w / math.sqrt(d)
        elif s.scale == "pow":
            w = w / d ** 0.5
        elif s.scale == "neg_pow":
            w = w * d ** -0.5
        elif s.scale == "tensor":
            w = w / torch.tensor(math.sqrt(d))
        return w

    def masked(self, w, mask):
        s = self.spec
        lq, lk = w.shape[-2], w.shape[-1]
        if s.negative == "mask_5d":
            return w + mask
        if s.negative == "fill_not_mask":
            return w.masked_fill(mask, 0.0)
        if s.negative == "mul_by_tensor":
            return w * mask
        if s.negative == "inplace_fill":
            w.masked_fill_(mask, float("-inf"))
            return w
        m = s.mask
        if m in ("additive", "bias_grad"):
            return w + mask
        if m == "hf_slice":
            return w + (mask[:, :, :, :lk] if w.dim() == 4 else mask[:, :, :lk])
        if m == "fill_eq0_inf":
            return w.masked_fill(mask == 0, float("-inf"))
        if m == "fill_bool_min":
            return w.masked_fill(mask, torch.finfo(w.dtype).min)
        if m == "where_min":
            return torch.where(mask, w, torch.finfo(w.dtype).min)
        if m == "where_inf":
            return torch.where(mask, w, float("-inf"))
        if m == "causal_tril":
            keep = torch.ones(lq, lk, dtype=torch.bool, device=w.device).tril()
            return w.masked_fill(~keep, float("-inf"))
        if m == "causal_tril_eq0":
            tril = torch.tril(torch.ones(lq, lk, device=w.device))
            return w.masked_fill(tril == 0, float("-inf"))
        if m == "causal_arange":  # as HF builds it
            keep = torch.arange(lk, device=w.device)[None, :] <= torch.arange(lq, device=w.device).view(-1, 1)
            return torch.where(keep, w, torch.finfo(w.dtype).min)
        if m == "causal_triu_add":
            return w + torch.full((lq, lk), torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device).triu(1)
        if m == "causal_buffer":  # GPT-2: a registered tril buffer sliced to [:T, :T]
            causal = self.causal[:, :, :lq, :lk] if w.dim() == 4 else self.causal[0, :, :lq, :lk]
            return w.masked_fill(~causal, float("-inf"))
        if m == "causal_pad_inf":
            keep = torch.ones(lq, lk, dtype=torch.bool, device=w.device).tril()
            return w.masked_fill(~keep, float("-inf")) + mask
        if m == "causal_pad_min":  # old HF GPT-2: where(causal, w, finfo.min) + padding
            keep = torch.ones(lq, lk, dtype=torch.bool, device=w.device).tril()
            w = torch.where(keep, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
            return w + mask
        if m == "offset_causal":  # bottom-right aligned (KV cache): not the op's is_causal
            keep = torch.arange(lk, device=w.device)[None, :] <= torch.arange(lq, device=w.device)[:, None] + (lk - lq)
            return w.masked_fill(~keep, float("-inf"))
        return w

    def weights(self, w, like):
        s = self.spec
        dim = -2 if s.negative == "softmax_dim" else -1
        if s.softmax == "F":
            p = F.softmax(w, dim=dim)
        elif s.softmax == "torch":
            p = torch.softmax(w, dim)
        elif s.softmax == "method":
            p = w.softmax(dim=dim)
        elif s.softmax == "f32":
            p = F.softmax(w, dim=dim, dtype=torch.float32).to(like.dtype)
        elif s.softmax == "float":
            p = F.softmax(w.float(), dim=dim).type_as(w)
        else:
            p = self.softmax_module(w) if dim == -1 else F.softmax(w, dim=dim)
        if s.dropout == "p0":
            p = self.drop(p)
        elif s.dropout == "eval":
            p = F.dropout(p, p=0.1, training=False)
        elif s.dropout == "train":
            p = F.dropout(p, p=0.1, training=True)
        return p

    def times_v(self, p, v):
        s = self.spec
        if s.product == "einsum":
            return torch.einsum("bhqk,bhkd->bhqd", p, v)
        if s.product == "matmul":
            return torch.matmul(p, v)
        if s.product == "at":
            return p @ v
        if s.product == "method":
            return p.matmul(v)
        return torch.bmm(p, v)

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, mask=None):
        s = self.spec
        q = self.heads(q, s.h)
        if s.kt != "permute0231":
            k = self.heads(k, s.kv_heads) if s.kt != "pre" else k
            k = self.repeat(k) if s.kt != "pre" else k
        v = self.repeat(self.heads(v, s.kv_heads))
        if s.product == "bmm":
            b, h = q.shape[0], q.shape[1]
            q, k, v = (t.reshape(b * h, t.shape[2], t.shape[3]) for t in (q, k, v))
        w = self.scores(q, k)
        scores = w
        w = self.masked(w, mask)
        p = self.weights(w, q)
        out = self.times_v(p, v)
        if s.product == "bmm":
            out = out.view(s.b, s.h, out.shape[1], out.shape[2])
        if s.negative == "weights_used":
            return out, p
        if s.negative == "scores_used":
            return out, scores
        return out


def make_inputs(spec: AttnSpec, seed: int = 0, requires_grad: bool = True) -> list:
    """q, k, v (in the spec's layout) and the mask argument (or None)."""
    s = spec
    g = torch.Generator().manual_seed(seed)
    hk = s.kv_heads

    def rnd(*shape):
        t = torch.randn(*shape, generator=g).to(s.dtype)
        return t.requires_grad_(requires_grad)

    def layout(n, l, d):
        if s.layout == "view_transpose":
            return rnd(s.b, l, n * d)
        if s.layout == "permute":
            return rnd(s.b, l, n, d)
        return rnd(s.b, n, l, d)

    q = layout(s.h, s.lq, s.d)
    if s.kt == "permute0231":
        k = rnd(s.b, s.lk, s.h, s.d)  # (B, L, H, D), permuted (0, 2, 3, 1) in the module
    elif s.kt == "pre":
        k = rnd(s.b, s.h, s.d, s.lk)  # kᵀ given (B, H, D, Lk)
    else:
        k = layout(hk, s.lk, s.d)
    v = layout(hk, s.lk, s.dv)
    mask = _make_mask(s, g)
    return [q, k, v, mask]


def _padding(s: AttnSpec, g, lk=None) -> torch.Tensor:
    """(B, Lk) bool, True = padded; the first key is never padded, batch 0 has no padding."""
    lk = lk or s.lk
    pad = torch.rand(s.b, lk, generator=g) < 0.3
    pad[:, 0] = False
    pad[0] = False
    return pad


def _make_mask(s: AttnSpec, g):
    m = s.mask

    def batch_mask(t):  # (B, 1, X, Lk) → (B*H, X, Lk) for the 3-D product
        if s.product == "bmm":
            return t.expand(s.b, s.h, t.shape[-2], t.shape[-1]).reshape(s.b * s.h, t.shape[-2], t.shape[-1])
        return t

    fmin = torch.finfo(s.dtype).min
    if s.negative == "mask_5d":
        return torch.randn(3, 1, 1, 1, s.lk, generator=g).to(s.dtype)
    if s.negative in ("fill_not_mask", "inplace_fill"):
        return torch.rand(s.lq, s.lk, generator=g) < 0.3
    if s.negative == "mul_by_tensor":
        return torch.rand(s.lq, s.lk, generator=g).to(s.dtype)
    if m in ("additive", "causal_pad_inf", "causal_pad_min"):
        pad = _padding(s, g)
        return batch_mask(torch.zeros(s.b, 1, 1, s.lk).masked_fill(pad[:, None, None, :], fmin).to(s.dtype))
    if m == "bias_grad":  # a learned position bias (T5 / ALiBi-like), gets a gradient
        shape = (s.b * s.h, s.lq, s.lk) if s.product == "bmm" else (1, s.h, s.lq, s.lk)
        return torch.randn(*shape, generator=g).to(s.dtype).requires_grad_(True)
    if m == "hf_slice":  # a (B, 1, Lq, Lmax) mask sliced to the key length
        lmax = s.lk + 3
        pad = _padding(s, g, lmax)
        t = torch.zeros(s.b, 1, s.lq, lmax).masked_fill(pad[:, None, None, :], fmin).to(s.dtype)
        return t if s.product != "bmm" else t.expand(s.b, s.h, s.lq, lmax).reshape(s.b * s.h, s.lq, lmax)
    if m == "fill_eq0_inf":
        keep = (~_padding(s, g)).long()[:, None, None, :]
        return batch_mask(keep)
    if m == "fill_bool_min":  # random masked positions, row 1 of batch 0 masked everywhere
        masked = torch.rand(s.b, 1, s.lq, s.lk, generator=g) < 0.4
        if s.lq > 1:
            masked[0, :, 1, :] = True
        masked[..., 0, 0] = False
        return batch_mask(masked)
    if m in ("where_min", "where_inf"):
        keep = torch.rand(s.b, 1, s.lq, s.lk, generator=g) > 0.4
        keep[..., 0] = True  # (a -inf row masked everywhere gives NaN in eager and in the op alike)
        if m == "where_min" and s.lq > 1:
            keep[0, :, 1, :] = False  # finfo.min: uniform weights, as eager
        return batch_mask(keep)
    return None


# =============================================================================== tiny decoders


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n):
    if n == 1:
        return x
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, l, d).reshape(b, h * n, l, d)


class Block(nn.Module):
    """A Llama-style decoder layer: RMSNorm → q/k/v → RoPE (rotate_half) → GQA attention with a
    causal mask → o_proj → RMSNorm → gated MLP."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.d, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, dim, bias=False)
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.gate, self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cos, sin, mask=None):
        b, l, _ = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(b, l, self.h, self.d).transpose(1, 2)
        k = self.k_proj(h).view(b, l, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(h).view(b, l, self.hkv, self.d).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.h // self.hkv), repeat_kv(v, self.h // self.hkv)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d)
        if mask is not None:  # HF: an additive (B, 1, Lq, Lmax) mask sliced to the key length
            w = w + mask[:, :, :, : k.shape[-2]]
        else:
            causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
            w = w.masked_fill(~causal, float("-inf"))
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, l, -1)
        x = x + self.o_proj(o)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """embedding → RoPE tables → `layers` Blocks → norm → logits. mask_style 'tril' builds the
    causal mask from tril(ones) in each layer; 'hf' builds one additive causal mask from arange
    comparisons (as HF does) shared by every layer."""

    def __init__(self, vocab=64, dim=64, heads=4, kv_heads=2, layers=2, mask_style="tril"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.mask_style = mask_style
        d = dim // heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, ids):
        b, l = ids.shape
        x = self.embed(ids)
        pos = torch.arange(l, device=ids.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None].expand(b, -1, -1), emb.sin()[None].expand(b, -1, -1)
        mask = None
        if self.mask_style == "hf":
            keep = torch.arange(l, device=ids.device)[None, :] <= pos[:, None]
            mask = torch.where(keep, 0.0, torch.finfo(x.dtype).min)[None, None].expand(b, 1, l, l)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.head(self.norm(x))


# =============================================================================== compiled vs eager

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _clone(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]


def compare_compiled(spec: AttnSpec, seed: int = 0):
    """Compile AttnModule(spec) with our rewrite + AOTAutograd (eager kernels) and compare with
    eager: outputs and every input gradient (NaN where eager has NaN). Returns the rewrite's
    Report, so callers can check what was fused."""
    from fuse_plugin.patterns import Report, rewrite

    report = Report()

    def backend(gm, example_inputs):
        report.extend(rewrite(gm))
        compiler = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)

    torch._dynamo.reset()
    module = AttnModule(spec)
    inputs = make_inputs(spec, seed)
    inputs2 = _clone(inputs)
    ref = module(*inputs)
    out = torch.compile(module, backend=backend)(*inputs2)
    refs, outs = (ref if isinstance(ref, tuple) else (ref,)), (out if isinstance(out, tuple) else (out,))
    tol = TOL[spec.dtype]
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
        if spec.dropout == "train":
            continue  # random: nothing to compare values with
        assert torch.equal(o.isnan(), r.isnan()), "NaN pattern"
        err = rel_err(o.nan_to_num(), r.nan_to_num())
        assert err <= tol, f"output rel err {err:.2e} > {tol:.0e}"
    if spec.dropout != "train":
        grads = [torch.randn_like(r) for r in refs]
        torch.autograd.backward(refs, grads)
        torch.autograd.backward(outs, grads)
        for i, (a, b) in enumerate(zip(inputs, inputs2)):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                err = rel_err(b.grad.nan_to_num(), a.grad.nan_to_num())
                assert err <= tol, f"gradient of input {i}: rel err {err:.2e} > {tol:.0e}"
    return report


# =============================================================================== timm Swin windows
# (here, not in test_spellings.py, so that the GPU suite can import them without expecttest)


class WindowAttention(nn.Module):
    """timm's swin_transformer.WindowAttention (fused_attn off): a learned relative position bias
    (1, H, N, N), and for shifted windows the window mask (nW, N, N) added on a 5-D view."""

    def __init__(self, dim=64, num_heads=4, window=4):
        super().__init__()
        self.num_heads, self.window = num_heads, window
        self.scale = (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, num_heads) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)

    def _get_rel_pos_bias(self):
        n = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        attn = F.dropout(attn.softmax(dim=-1), p=0.0, training=self.training)
        x = (attn @ v).transpose(1, 2).reshape(b_, n, -1)
        return self.proj(x)


def shifted_window_mask(size=8, window=4, shift=2):
    """timm's attention mask of a shifted-window block: (nW, N, N), 0 or -100."""
    img = torch.zeros(1, size, size, 1)
    cnt = 0
    for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
        for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            img[:, hs, ws, :] = cnt
            cnt += 1
    win = img.view(1, size // window, window, size // window, window, 1).permute(0, 1, 3, 2, 4, 5)
    win = win.reshape(-1, window * window)
    mask = win.unsqueeze(1) - win.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


def swin(m, x, mask):  # x: (B·nW, N, C) windows
    return m(x, mask)
