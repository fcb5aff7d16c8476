"""Plain-torch reference implementations of the fused ops.

They define the semantics the Triton kernels must reproduce, and they are the CPU
kernels of the custom ops. Math runs in float32 (float64 when an input is float64);
results are cast to the output dtype at the end, as the kernels do.

Shapes (see `fuse_plugin.ops.attention` / `fuse_plugin.ops.rotary` for the op contracts):
  attention: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), Hq % Hkv == 0,
             bias broadcastable to (B, Hq, Lq, Lk); out (B, Hq, Lq, Dv), lse (B, Hq, Lq) fp32.
  rotary:    x (..., D); cos/sin broadcastable to x[..., :W] with W = rotary_dim (full width)
             or rotary_dim // 2 (half width: one value per channel pair).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.host import dropout_scale, dropout_threshold  # pure Python: imports no Triton


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


# --------------------------------------------------------------------------- attention


def _grouped(t: Tensor, groups: int) -> Tensor:
    """(B, Hq, L, X) → (B, Hkv, G, L, X): the q heads that share one kv head."""
    b, h, l, x = t.shape
    return t.reshape(b, h // groups, groups, l, x)


def causal_keep(lq: int, lk: int, device: torch.device, window: int = 0, chunk: int = 0) -> Tensor:
    """(Lq, Lk) bool, True where key j is visible to query i: j <= i (top-left aligned, as SDPA);
    with a sliding window also j > i - window; with chunks also j // chunk == i // chunk."""
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    if chunk:
        i, j = torch.arange(lq, device=device), torch.arange(lk, device=device)
        keep = keep & (i[:, None] // chunk == j[None, :] // chunk)
    return keep.triu(1 - window) if window else keep


def same_document(documents: Tensor) -> Tensor:
    """(B or 1, 1, L, L) bool, True where key j is in query i's document: documents[b, i] ==
    documents[b, j] (the op's documents, integer ids (B or 1, L))."""
    return (documents[:, :, None] == documents[:, None, :]).unsqueeze(1)


def softcapped(s: Tensor, softcap: float) -> tuple[Tensor, Tensor | None]:
    """(c·tanh(s/c), tanh(s/c)) for softcap c > 0 (Gemma 2, Grok); (s, None) for c = 0 (off)."""
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def attention_probs(q: Tensor, k: Tensor, bias: Tensor | None, is_causal: bool, scale: float,
                    softcap: float = 0.0, with_tanh: bool = False, replace: Tensor | None = None,
                    window: int = 0, chunk: int = 0, documents: Tensor | None = None):
    """Softmax weights P (B, Hkv, G, Lq, Lk) in the compute dtype and lse (B, Hq, Lq); with
    `with_tanh` also tanh(s/c) (B, Hq, Lq, Lk) of the softcap (None without one). The softcap
    acts on the scaled scores, before the bias and the masks: c·tanh(q·kᵀ·scale / c) + bias.
    `replace` (bool, broadcastable to (B, Hq, Lq, Lk), with a float bias): where True the score is
    the bias alone, where(replace, bias, s + bias). `window` (with is_causal): key j visible to
    query i iff i - window < j <= i; `chunk` (with is_causal): iff j // chunk == i // chunk, j <= i;
    `documents` (ids (B or 1, L), Lq == Lk; with or without is_causal): iff documents[b, i] ==
    documents[b, j], masked with -inf after the bias as the causal mask."""
    ct = compute_dtype(q, k, bias)
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    s = _grouped(q.to(ct), g) @ k.to(ct).unsqueeze(2).transpose(-1, -2) * scale
    s = s.reshape(b, hq, lq, lk)
    s, t = softcapped(s, softcap)
    if replace is not None:
        s = s.masked_fill(replace, 0.0)
    if bias is not None:
        if bias.dtype == torch.bool:
            s = s.masked_fill(~bias, float("-inf"))
        else:
            s = s + bias.to(ct)
    if is_causal:
        s = s.masked_fill(~causal_keep(lq, lk, q.device, window, chunk), float("-inf"))
    if documents is not None:
        s = s.masked_fill(~same_document(documents), float("-inf"))
    # softmax, not exp(s - lse): a row whose scores all sit near finfo.min (a padding mask over the
    # whole row) has lse == max in float32, and eager gives uniform weights there. A row masked
    # everywhere with -inf gives NaN, as eager.
    p = torch.softmax(s, dim=-1)
    if with_tanh:
        return _grouped(p, g), torch.logsumexp(s, dim=-1), t
    return _grouped(p, g), torch.logsumexp(s, dim=-1)


_U32 = 0xFFFFFFFF


def _mul32(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * m for a in [0, 2**32) (int64) and a 32-bit constant m,
    without int64 overflow: a = a_hi * 2**16 + a_lo, each partial product < 2**48."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_hi, p_lo = a_hi * m, a_lo * m
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _U32
    return high, low


def _mix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values (the kernels'
    ``_mix32``; products taken mod 2**32 by ``_mul32``)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)[1]
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)[1]
    return x ^ (x >> 16)


_WEYL_KEY, _WEYL_ROW = 0x9E3779B9, 0x85EBCA77


def dropout_keep(seed: int, shape: tuple[int, int, int, int], dropout_p: float, device=None) -> Tensor:
    """(B, Hq, Lq, Lk) bool keep-mask of the attention kernels' dropout (kernels/attention_tiles.py,
    ``_dropout_keep``): with s0/s1 the low/high 32 bits of the seed, a = mix(mix(s0 ^ bh·G) ^ s1)
    for head bh = b * Hq + h, r_i = mix(a + i·C), x_ij = mix(r_i + j·G) (uint32, wrapping); score
    (i, j) is kept iff x_ij >> 16 >= floor(p * 2**16)."""
    b, hq, lq, lk = shape
    kw = dict(dtype=torch.int64, device=device)
    s0, s1 = int(seed) & _U32, (int(seed) >> 32) & _U32
    bh = torch.arange(b * hq, **kw).view(b, hq, 1, 1)
    a = _mix32(_mix32(s0 ^ _mul32(bh, _WEYL_KEY)[1]) ^ s1)
    r = _mix32((a + _mul32(torch.arange(lq, **kw).view(1, 1, lq, 1), _WEYL_ROW)[1]) & _U32)
    x = _mix32((r + _mul32(torch.arange(lk, **kw).view(1, 1, 1, lk), _WEYL_KEY)[1]) & _U32)
    return (x >> 16) >= dropout_threshold(dropout_p)


def _dropped(x: Tensor, dropout_p: float, seed: Tensor | None, shape: tuple) -> Tensor:
    """x (B, Hkv, G, Lq, Lk) with the dropout mask applied and kept entries scaled by the inverse
    of the exact keep rate (1/(1-p) to within 2**-16)."""
    if dropout_p == 0.0:
        return x
    if seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed tensor")
    keep = dropout_keep(int(seed.reshape(()).item()), shape, dropout_p, x.device).view(x.shape)
    return torch.where(keep, x * dropout_scale(dropout_p), 0.0)


def _with_sinks(p: Tensor, lse: Tensor, sinks: Tensor, g: int) -> tuple[Tensor, Tensor]:
    """Weights and lse with each row's sink logit in the softmax's denominator (its column
    dropped): p · exp(lse − lse'), lse' = logaddexp(lse, sink); rows masked everywhere give 0."""
    ct = p.dtype
    lse_sink = torch.logaddexp(lse.to(ct), sinks.to(ct).view(1, -1, 1))
    p = p.masked_fill(p.isnan().all(-1, keepdim=True), 0.0)
    return p * _grouped(torch.exp(lse.to(ct) - lse_sink).unsqueeze(-1), g), lse_sink


def attention_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, is_causal: bool, scale: float,
                      dropout_p: float = 0.0, dropout_seed: Tensor | None = None,
                      softcap: float = 0.0, replace: Tensor | None = None,
                      sinks: Tensor | None = None, window: int = 0, chunk: int = 0,
                      documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
    p, lse = attention_probs(q, k, bias, is_causal, scale, softcap, replace=replace, window=window, chunk=chunk,
                             documents=documents)
    if sinks is not None:
        p, lse = _with_sinks(p, lse, sinks, q.shape[1] // k.shape[1])
    p = _dropped(p, dropout_p, dropout_seed, tuple(lse.shape) + (k.shape[2],))
    out = p @ v.to(p.dtype).unsqueeze(2)
    b, hq, lq = lse.shape
    out = out.reshape(b, hq, lq, v.shape[-1]).to(q.dtype)
    return out.contiguous(), lse.float().contiguous()


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, is_causal: bool, scale: float, need_dbias: bool,
    dropout_p: float = 0.0, dropout_seed: Tensor | None = None, softcap: float = 0.0,
    replace: Tensor | None = None, sinks: Tensor | None = None, window: int = 0, chunk: int = 0,
    documents: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dq, dk, dv (input dtypes) and dS (B, Hq, Lq, Lk) in the compute dtype when need_dbias
    (the gradient of the bias, i.e. of the final scores, also where `replace` holds; dq/dk get
    none from the replaced scores). `sinks` (Hq,): each row's softmax has one more column, the
    head's sink logit, dropped after it (ops/attention_sinks.py); then dsinks (Hq,) is returned
    fifth."""
    p, lse, t = attention_probs(q, k, bias, is_causal, scale, softcap, with_tanh=True,
                                replace=replace, window=window, chunk=chunk,
                                documents=documents)  # (B, Hkv, G, Lq, Lk)
    dead = p.isnan().all(-1, keepdim=True)  # (not lse == -inf: lse also overflows there for a float64
    # row biased by float64's finfo.min, whose weights are uniform)
    ct = p.dtype
    g = q.shape[1] // k.shape[1]
    # A row whose every score is -inf (lse = -inf) has NaN weights in the forward, as eager. In the
    # backward it contributes nothing, as in the kernels: its dS row is 0, so its dq row is 0 and it
    # adds nothing to dk, dv or dbias. (Eager's masked_fill(-inf) also gives dq 0 and a finite dk
    # there, the fill's backward dropping the NaN; its dv is NaN everywhere, which we do not copy.)
    p = p.masked_fill(dead, 0.0)
    if sinks is not None:  # the sink's exp joins each row's denominator
        p, lse_sink = _with_sinks(p, lse, sinks, g)
    do = _grouped(dout.to(ct), g)
    vv = v.to(ct).unsqueeze(2)
    # With dropout, out = P' v with P' = mask * P / (1 - p): dv = P'^T dO, dP = mask * dP' / (1 - p).
    shape = tuple(lse.shape) + (k.shape[2],)
    dv = (_dropped(p, dropout_p, dropout_seed, shape).transpose(-1, -2) @ do).sum(2)
    dp = _dropped(do @ vv.transpose(-1, -2), dropout_p, dropout_seed, shape)
    delta = (p * dp).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dbias = ds.reshape(lse.shape + (k.shape[2],)) if need_dbias else None
    if replace is not None:  # a replaced score does not depend on q·kᵀ
        ds = ds.masked_fill(_grouped(replace.expand(shape), g), 0.0)
    if t is not None:  # d(c·tanh(x/c))/dx = 1 - tanh²(x/c)
        ds = ds * _grouped(1 - t * t, g)
    dq = (ds @ k.to(ct).unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ _grouped(q.to(ct), g)).sum(2) * scale
    b, hq, lq, d = q.shape
    dq = dq.reshape(b, hq, lq, d)
    if sinks is not None:  # d/dsink = -Σ p_sink · Δ (ops/attention_sinks.py)
        p_sink = torch.exp(sinks.to(ct).view(1, -1, 1) - lse_sink).reshape(delta.shape[:-1])
        dsinks = -(p_sink * delta.squeeze(-1)).reshape(b, hq, lq).sum((0, 2))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, dsinks.to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


# --------------------------------------------------------------------------- rotary


def _split_pairs(t: Tensor, interleaved: bool, width: int) -> tuple[Tensor, Tensor]:
    """The two members of each rotated channel pair among t[..., :width]."""
    if interleaved:
        return t[..., 0:width:2], t[..., 1:width:2]
    half = width // 2
    return t[..., :half], t[..., half:width]


def _join_pairs(a: Tensor, b: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)


def _cos_sin_pairs(cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int, ct: torch.dtype):
    """(c1, c2, s1, s2): the cos/sin values for the first and second member of each pair."""
    cos, sin = cos.to(ct), sin.to(ct)
    if cos.shape[-1] == rotary_dim // 2:  # half width: one value per pair
        return cos, cos, sin, sin
    c1, c2 = _split_pairs(cos, interleaved, rotary_dim)
    s1, s2 = _split_pairs(sin, interleaved, rotary_dim)
    return c1, c2, s1, s2


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int, backward: bool = False, out_dtype: torch.dtype | None = None) -> Tensor:
    """Forward: out = x·cos + rotate(x)·sin on x[..., :rotary_dim]; the tail passes through.

    backward=True applies the transpose of that linear map (the gradient w.r.t. x)."""
    ct = compute_dtype(x, cos, sin)
    out_dtype = out_dtype or torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    xf = x.to(ct)
    x1, x2 = _split_pairs(xf, interleaved, rotary_dim)
    c1, c2, s1, s2 = _cos_sin_pairs(cos, sin, interleaved, rotary_dim, ct)
    if backward:
        o1, o2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        o1, o2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    rotated = _join_pairs(o1, o2, interleaved)
    out = torch.cat((rotated, xf[..., rotary_dim:]), dim=-1) if rotary_dim < x.shape[-1] else rotated
    return out.to(out_dtype).contiguous()


def rotary_cos_sin_grads(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """Gradients w.r.t. cos and sin (learned frequencies), reduced to their own shapes."""
    ct = compute_dtype(grad, x, cos, sin)
    g1, g2 = _split_pairs(grad.to(ct), interleaved, rotary_dim)
    x1, x2 = _split_pairs(x.to(ct), interleaved, rotary_dim)
    # out1 = x1·c1 − x2·s1 ; out2 = x2·c2 + x1·s2
    dc1, dc2, ds1, ds2 = g1 * x1, g2 * x2, -g1 * x2, g2 * x1
    if cos.shape[-1] == rotary_dim // 2:
        dcos, dsin = dc1 + dc2, ds1 + ds2
    else:
        dcos, dsin = _join_pairs(dc1, dc2, interleaved), _join_pairs(ds1, ds2, interleaved)
    return dcos.sum_to_size(cos.shape).to(cos.dtype), dsin.sum_to_size(sin.shape).to(sin.dtype)
