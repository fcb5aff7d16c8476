"""GPU correctness check: opcheck on CUDA and kernel parity vs a float64 reference.

    python benchmarks/gpu_check.py [--out FILE] [--section NAME ...]

For every case: fresh random inputs (never zeros), the output memory poisoned with NaN before the
call (a NaN left in the result means an element was never written), forward and all gradients
compared with float64 eager math by ‖x − ref‖ / ‖ref‖. fp32 runs with TF32 off (the eager matmul's
default), so it must land ≲ 1e-5; fp16/bf16 ≲ 1e-2.
Prints a table and a PASS/FAIL line.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from common import emit

import fuse_plugin  # noqa: F401
from fuse_plugin.ops import reference

OPS = torch.ops.fuse_plugin
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def poison_allocator():
    """Fill freed cached blocks with NaN so that an unwritten output element shows up as NaN."""
    free = torch.cuda.mem_get_info()[0]
    n = min(free // 4, 2 << 30) // 4  # up to 2 GiB
    torch.empty(n, dtype=torch.float32, device="cuda").fill_(float("nan"))
    # the block goes back to PyTorch's cache and is handed out again to the outputs


def rel(a, b):
    """‖a − b‖ / ‖b‖; where the exact result is (near) zero — dq and dk when Lk = 1, say, since the
    softmax of one key is constant — relative to unit scale per element instead."""
    a, b = a.double(), b.double()
    denom = b.norm()
    if denom < 1e-6 * b.numel() ** 0.5:
        denom = torch.tensor(float(b.numel()) ** 0.5)
    return ((a - b).norm() / denom).item()


def ref_attention(q, k, v, bias, causal, scale):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


ATTENTION_CASES = [
    # B, Hq, Hkv, Lq, Lk, D, Dv, causal, bias
    (2, 4, 4, 1, 1, 64, 64, False, None),
    (2, 4, 2, 17, 17, 16, 16, True, None),
    (1, 4, 1, 33, 17, 80, 80, False, "float_b1"),
    (2, 8, 2, 1000, 1000, 128, 128, True, None),
    (1, 4, 4, 1000, 333, 96, 96, False, "bool"),
    (2, 4, 4, 257, 257, 256, 256, True, "float_1h"),
    (1, 8, 8, 512, 512, 64, 64, False, "float_grad"),
    (1, 2, 2, 77, 129, 160, 128, True, None),
    (2, 6, 3, 300, 300, 192, 192, False, None),
    (1, 4, 4, 64, 64, 32, 32, True, "float_b1"),
    # no-mask D 128 / D 64 at lengths where the table picks the Hopper (TMA / Gluon) kernels
    (1, 4, 2, 2048, 2048, 128, 128, False, None),
    (2, 4, 4, 1500, 1500, 64, 64, True, None),
    # no-mask D 256, where the table picks the atomic-free TMA pair (GQA; Lq != Lk)
    (2, 4, 2, 700, 700, 256, 256, True, None),
    (1, 4, 4, 300, 513, 256, 256, False, None),
]


def check_attention(dtype, case):
    b, hq, hkv, lq, lk, d, dv, causal, bias_kind = case
    dev = "cuda"
    q = torch.randn(b, hq, lq, d, device=dev, dtype=dtype, requires_grad=True)
    # k and v in the (B, L, H, D)-transposed layout HF models produce
    k = torch.randn(b, lk, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, lk, hkv, dv, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    bias = None
    if bias_kind == "float_b1":
        bias = torch.randn(b, 1, 1, lk, device=dev, dtype=dtype)
    elif bias_kind == "float_1h":
        bias = torch.randn(1, hq, lq, lk, device=dev, dtype=torch.float32)
    elif bias_kind == "float_grad":
        bias = torch.randn(1, hq, lq, lk, device=dev, dtype=dtype, requires_grad=True)
    elif bias_kind == "bool":
        bias = torch.rand(b, 1, lq, lk, device=dev) > 0.5
        bias[..., 0] = True
    scale = d**-0.5
    poison_allocator()
    out, lse = OPS.attention(q, k, v, bias, 0.0, causal, scale)
    dout = torch.randn_like(out)
    leaves = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    poison_allocator()
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rbias = ref_leaves[3] if len(ref_leaves) > 3 else (bias if bias is None or bias.dtype == torch.bool else bias.double())
    return compared(out, grads, ref_attention(*ref_leaves[:3], rbias, causal, scale), ref_leaves, dout)


def compared(out, grads, ref, ref_leaves, dout):
    """({out, dq, dk, dv[, dbias]: rel err}, any NaN): the op's output and gradients against the
    float64 reference's (its gradients taken here, w.r.t. ``ref_leaves``, for the same dout)."""
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    errs = {"out": rel(out, ref)}
    for name, g, rg in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        errs[name] = rel(g, rg)
    nan = any(torch.isnan(t).any().item() for t in (out, *grads))
    return errs, nan


WINDOW_CASES = [
    # B, Hq, Hkv, L, D, window, bias, deterministic: the sliding window (issue 31) on the general
    # kernels, through the op and its autograd; edge sizes (a window of 1, past the length)
    (2, 4, 2, 17, 64, 5, None, False),
    (1, 4, 4, 49, 32, 1, None, False),
    (1, 8, 2, 1000, 128, 300, None, False),
    (1, 8, 2, 1000, 128, 300, None, True),
    (2, 4, 4, 513, 80, 700, None, False),
    (1, 4, 4, 300, 96, 64, "float_grad", False),
    (1, 4, 2, 777, 256, 129, None, False),
    (1, 16, 4, 4096, 128, 1024, None, False),
]


def check_window(dtype, case):
    b, hq, hkv, L, d, w, bias_kind, deterministic = case
    dev = "cuda"
    q = torch.randn(b, hq, L, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, L, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, L, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    bias = torch.randn(1, hq, L, L, device=dev, dtype=dtype, requires_grad=True) if bias_kind else None
    scale = d**-0.5
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        poison_allocator()
        out, _ = OPS.attention(q, k, v, bias, 0.0, True, scale, None, 0.0, None, w)
        dout = torch.randn_like(out)
        leaves = [q, k, v] + ([bias] if bias is not None else [])
        poison_allocator()
        grads = torch.autograd.grad(out, leaves, dout)
    finally:
        torch.use_deterministic_algorithms(old)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    i = torch.arange(L, device=dev)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    rb = ref_leaves[3] if bias is not None else 0.0
    rb = torch.where(band, rb, float("-inf")) if bias is not None else torch.where(band, 0.0, float("-inf")).double()
    return compared(out, grads, ref_attention(*ref_leaves[:3], rb, False, scale), ref_leaves, dout)


DROPOUT_CASES = [
    # B, Hq, Hkv, Lq, Lk, D, causal, bias, p, deterministic
    (2, 8, 2, 1000, 1000, 128, True, None, 0.1, False),
    (1, 4, 4, 257, 300, 64, False, "float", 0.3, True),
    (2, 4, 2, 17, 33, 96, True, None, 0.5, False),
    (1, 4, 4, 129, 129, 256, True, "float", 0.2, False),
]


def check_dropout(dtype, case):
    """Dropout in the kernels vs the float64 reference drawing the same mask from the same seed."""
    b, hq, hkv, lq, lk, d, causal, bias_kind, p, deterministic = case
    dev = "cuda"
    q = torch.randn(b, hq, lq, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, lk, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, lk, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    bias = torch.randn(b, 1, lq, lk, device=dev, dtype=dtype, requires_grad=True) if bias_kind else None
    seed = torch.randint(0, 2**62, (), dtype=torch.int64, device=dev)
    scale = d**-0.5
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    poison_allocator()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, _ = OPS.attention(q, k, v, bias, p, causal, scale, seed)
        dout = torch.randn_like(out)
        poison_allocator()
        grads = torch.autograd.grad(out, leaves, dout)
    finally:
        torch.use_deterministic_algorithms(False)
    r = [t.detach().double() for t in (q, k, v)]
    rb = bias.detach().double().expand(b, hq, lq, lk) if bias is not None else None
    ref, _ = reference.attention_forward(*r, rb, causal, scale, p, seed)
    rdq, rdk, rdv, rds = reference.attention_backward(dout.double(), *r, rb, causal, scale, bias is not None, p, seed)
    errs = {"out": rel(out, ref), "dq": rel(grads[0], rdq), "dk": rel(grads[1], rdk), "dv": rel(grads[2], rdv)}
    if bias is not None:
        errs["dbias"] = rel(grads[3], rds.sum(1, keepdim=True))
    nan = any(torch.isnan(t).any().item() for t in (out, *grads))
    return errs, nan


def dropout_statistics():
    """Keep rate of the kernels' own mask (read back through the op: q = k = 0, v = identity) and
    unbiasedness (128 heads with the same q, k, v are 128 dropout samples of one attention)."""
    dev, p = "cuda", 0.2
    b, h, lq, lk = 4, 16, 1024, 256
    q, k = torch.zeros(b, h, lq, 16, device=dev), torch.zeros(b, h, lk, 16, device=dev)
    v = torch.eye(lk, device=dev).expand(b, h, lk, lk)
    out, _ = OPS.attention(q, k, v, None, p, False, 1.0, torch.tensor(12345, device=dev))
    expected = 1 - reference.dropout_threshold(p) / 2**16  # the exact keep rate (1 - p within 2**-16)
    keep = (out.double() * lk * expected).round()
    n = keep.numel()
    rate = keep.mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    ok_rate = abs(rate - expected) < 5 * sigma and bool(((keep == 0) | (keep == 1)).all())
    heads, L, d = 128, 256, 64
    x = [torch.randn(1, 1, L, d, device=dev, dtype=torch.bfloat16).expand(1, heads, L, d).contiguous() for _ in range(3)]
    want, _ = OPS.attention(*(t[:, :1] for t in x), None, 0.0, True, d**-0.5)
    got, _ = OPS.attention(*x, None, p, True, d**-0.5, torch.tensor(777, device=dev))
    samples = got[0].double()
    z = (samples.mean(0) - want[0, 0].double()) / (samples.std(0) / heads**0.5).clamp_min(1e-12)
    zmax = z[1:].abs().max().item()  # row 0 sees one key: its weight is 1 or 0, fine but degenerate
    ok_bias = zmax < 6
    lines = [
        "",
        "dropout statistics (the kernels' own draws):",
        f"  keep rate at p={p} over {n} weights: {rate:.6f} (expected {expected:.6f}, 5 sigma = {5 * sigma:.1e})  "
        f"{'ok' if ok_rate else 'FAIL'}",
        f"  unbiased output: max |z| of the mean of {heads} dropout samples vs no dropout = {zmax:.2f} (< 6)  "
        f"{'ok' if ok_bias else 'FAIL'}",
    ]
    return lines, ok_rate and ok_bias


def ref_rope(x, cos, sin, interleaved, rd):
    x, cos, sin = x.double(), cos.double(), sin.double()
    if cos.shape[-1] == rd // 2:
        rep = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat((t, t), -1))
        cos, sin = rep(cos), rep(sin)
    xr = x[..., :rd]
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., ::2]), -1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., rd // 2 :], xr[..., : rd // 2]), -1)
    return torch.cat((xr * cos + rot * sin, x[..., rd:]), -1)


ROTARY_CASES = [
    # B, H, L, D, rotary_dim, interleaved, width
    (2, 4, 17, 64, 64, False, "full"),
    (2, 4, 1, 128, 128, False, "half"),
    (1, 8, 1000, 80, 32, False, "full"),
    (2, 4, 33, 64, 64, True, "half"),
    (1, 2, 257, 96, 96, True, "full"),
]


def check_rotary(dtype, case):
    b, h, l, d, rd, inter, width = case
    x = torch.randn(b, l, h, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    w = rd if width == "full" else rd // 2
    cos = torch.randn(b, 1, l, w, device="cuda", dtype=dtype)
    sin = torch.randn(b, 1, l, w, device="cuda", dtype=dtype)
    k = torch.randn(b, l, max(1, h // 2), d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    poison_allocator()
    qo, ko = OPS.rotary_qk(x, k, cos, sin, inter, rd)
    g_q, g_k = torch.randn_like(qo), torch.randn_like(ko)
    poison_allocator()
    dq, dk = torch.autograd.grad((qo, ko), (x, k), (g_q, g_k))
    xr, kr = x.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = ref_rope(xr, cos, sin, inter, rd), ref_rope(kr, cos, sin, inter, rd)
    rdq, rdk = torch.autograd.grad((rq, rk), (xr, kr), (g_q.double(), g_k.double()))
    errs = {"out": max(rel(qo, rq), rel(ko, rk)), "dq": rel(dq, rdq), "dk": rel(dk, rdk)}
    nan = any(torch.isnan(t).any().item() for t in (qo, ko, dq, dk))
    return errs, nan


ROPE_ATTENTION_CASES = [
    # B, Hq, Hkv, L, D, rotary_dim, interleaved, width, causal, bias, deterministic
    (2, 8, 2, 1000, 128, 128, False, "half", True, None, False),  # Llama
    (2, 8, 2, 1000, 128, 128, False, "full", True, "float_b1", True),  # HF full-width tables, padding mask
    (1, 4, 4, 333, 80, 32, False, "full", True, None, False),  # GPT-NeoX-style partial rotary
    (2, 4, 1, 257, 64, 64, True, "half", False, "bool", False),  # Meta / GPT-J pairs
    (1, 4, 2, 129, 256, 64, True, "full", True, None, False),  # partial interleaved, wide head
    (2, 4, 4, 1, 64, 64, False, "half", False, None, False),
]


def check_rope_attention(dtype, case):
    """rope_attention (rotation folded into the kernels) vs float64 rotate-then-attend."""
    b, hq, hkv, l, d, rd, inter, width, causal, bias_kind, det = case
    dev = "cuda"
    q = torch.randn(b, l, hq, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, l, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, l, hkv, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    w = rd if width == "full" else rd // 2
    angle = 100 * torch.rand(b, 1, l, w, device=dev, dtype=torch.float64)  # independent per channel at full width
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    bias = None
    if bias_kind == "float_b1":
        bias = torch.zeros(b, 1, 1, l, device=dev, dtype=dtype)
        bias[0, ..., : l // 4] = torch.finfo(dtype).min
    elif bias_kind == "bool":
        bias = torch.rand(b, 1, l, l, device=dev) > 0.5
        bias[..., 0] = True
    scale = d**-0.5
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(det)
    try:
        poison_allocator()
        out, _ = OPS.rope_attention(q, k, v, cos, sin, inter, rd, bias, 0.0, causal, scale)
        dout = torch.randn_like(out)
        poison_allocator()
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(old)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rq, rk = ref_rope(leaves[0], cos, sin, inter, rd), ref_rope(leaves[1], cos, sin, inter, rd)
    rbias = bias if bias is None or bias.dtype == torch.bool else bias.double()
    ref = ref_attention(rq, rk, leaves[2], rbias, causal, scale)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errs = {"out": rel(out, ref)}
    for name, g, rg in zip(["dq", "dk", "dv"], grads, ref_grads):
        errs[name] = rel(g, rg)
    nan = any(torch.isnan(t).any().item() for t in (out, *grads))
    return errs, nan


def run_opchecks():
    dev = "cuda"
    results = []
    q = torch.randn(2, 4, 33, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 17, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 17, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(2, 1, 33, 17, device=dev, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 33, 4, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    kx = torch.randn(2, 33, 2, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, 1, 33, 64, device=dev), torch.randn(1, 1, 33, 64, device=dev)
    out, lse = OPS.attention(q, k, v, bias, 0.0, True, 0.125)
    seed = torch.tensor(2024, dtype=torch.int64, device=dev)
    dout, dlse = OPS.attention(q, k, v, bias, 0.3, True, 0.125, seed)
    samples = [
        ("attention", OPS.attention.default, (q, k, v, bias, 0.0, True, 0.125)),
        ("attention (dropout)", OPS.attention.default, (q, k, v, bias, 0.3, True, 0.125, seed)),
        ("attention_backward (dropout)", OPS.attention_backward.default,
         (torch.randn_like(dout), q.detach(), k.detach(), v.detach(), bias.detach(), dout.detach(), dlse, 0.3, True, 0.125, seed, True)),
        ("attention (fp32, no bias)", OPS.attention.default, (q.float().detach().requires_grad_(), k.float(), v.float(), None, 0.0, False, 0.125)),
        ("attention_backward", OPS.attention_backward.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), bias.detach(), out.detach(), lse, 0.0, True, 0.125, None, True)),
        ("rotary", OPS.rotary.default, (x, cos, sin, False, 64)),
        ("rotary_backward", OPS.rotary_backward.default, (torch.randn(2, 4, 33, 64, device=dev), cos[..., :16], sin[..., :16], True, 32, torch.bfloat16)),
        ("rotary_qk", OPS.rotary_qk.default, (x, kx, cos, sin, True, 64)),
        ("rotary_qk_backward", OPS.rotary_qk_backward.default, (torch.randn(2, 4, 33, 64, device=dev), torch.randn(2, 2, 33, 64, device=dev), cos, sin, False, 64, torch.float32, torch.bfloat16)),
    ]
    xq = torch.randn(2, 33, 4, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    xk = torch.randn(2, 33, 2, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    xv = torch.randn(2, 33, 2, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    hc, hs = cos[..., :16].bfloat16(), sin[..., :16].bfloat16()
    rbias = torch.randn(2, 1, 33, 33, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rargs = (xq, xk, xv, hc, hs, True, 32, rbias, 0.0, True, 0.125)
    rout, rlse = OPS.rope_attention(*rargs)
    samples += [
        ("rope_attention", OPS.rope_attention.default, rargs),
        ("rope_attention_backward", OPS.rope_attention_backward.default,
         (torch.randn_like(rout), xq.detach(), xk.detach(), xv.detach(), hc, hs, True, 32, rbias.detach(), rout.detach(), rlse,
          0.0, True, 0.125, None, True, False)),
    ]
    for name, op, args in samples:
        try:
            torch.library.opcheck(op, args)
            results.append((name, "pass"))
        except Exception as e:  # report, keep going
            results.append((name, f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    return results


def parity_section(title, case_header, width, cases, check, columns):
    """One table of parity rows: every case in every dtype, errors per column, ok/FAIL per row."""
    lines = ["", title, f"  {'dtype':9} {case_header:{width}} " + " ".join(f"{c:>8}" for c in columns) + "  result"]
    ok = True
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for case in cases:
            label = f"  {str(dtype)[6:]:9} {' '.join(map(str, case)):{width}}"
            try:
                errs, nan = check(dtype, case)
            except Exception as e:
                lines.append(f"{label} ERROR {type(e).__name__}: {str(e)[:100]}")
                ok = False
                continue
            good = not nan and all(e <= TOL[dtype] for e in errs.values())
            ok &= good
            cols = " ".join(f"{errs[n]:8.1e}" if n in errs else f"{'-':>8}" for n in columns)
            lines.append(f"{label} {cols}  {'ok' if good else 'FAIL' + (' (NaN)' if nan else '')}")
    return lines, ok


def opcheck_section():
    lines, ok = ["", "opcheck on CUDA:"], True
    for name, res in run_opchecks():
        lines.append(f"  {name:28} {res}")
        ok &= res == "pass"
    return lines, ok


PARITY = {
    "attention": ("attention parity vs float64 (rel err; fp32 with TF32 off):", "B Hq Hkv Lq Lk D Dv causal bias",
                  42, ATTENTION_CASES, check_attention, ("out", "dq", "dk", "dv", "dbias")),
    "rotary": ("rotary (q+k launch) parity vs float64:", "B H L D rd interleaved width",
               36, ROTARY_CASES, check_rotary, ("out", "dq", "dk")),
    "rope": ("rope_attention (rotation in the attention kernels) parity vs float64:",
             "B Hq Hkv L D rd interleaved width causal bias deterministic", 62, ROPE_ATTENTION_CASES,
             check_rope_attention, ("out", "dq", "dk", "dv")),
    "window": ("sliding window (the op's window) vs float64 with the band as a mask:",
               "B Hq Hkv L D window bias deterministic", 40, WINDOW_CASES, check_window,
               ("out", "dq", "dk", "dv", "dbias")),
    "dropout": ("attention with dropout vs float64 reference drawing the same mask (same seed):",
                "B Hq Hkv Lq Lk D causal bias p deterministic", 44, DROPOUT_CASES, check_dropout,
                ("out", "dq", "dk", "dv", "dbias")),
}
SECTIONS = {"opcheck": opcheck_section, **{name: (lambda spec=spec: parity_section(*spec)) for name, spec in PARITY.items()},
            "dropout_stats": dropout_statistics}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS),
                        help="run only these sections (repeatable; e.g. one per process to compile in parallel)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    import triton

    lines = [
        f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{time.strftime('%Y-%m-%d')} | sections: {', '.join(args.section or SECTIONS)}",
    ]
    ok = True
    for name in args.section or SECTIONS:
        section_lines, section_ok = SECTIONS[name]()
        lines += section_lines
        ok &= section_ok
    lines += ["", f"gpu_check: {'PASS' if ok else 'FAIL'}"]
    emit(lines, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
