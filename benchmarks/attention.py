"""Attention speed on the GPU: our op vs SDPA's flash (FA2), cuDNN and efficient backends, one run.

    python benchmarks/attention.py [--quick] [--out FILE.md]
    python benchmarks/attention.py --choice [--out FILE.md] [--json FILE]

``--choice``: the never-slower table (``choice_table``). Per row, in device time (CUDA graphs, median
of do_bench_cudagraph), forward and backward: the family our op chooses (no forcing), every family
that can run the row forced (the best named), SDPA's backends, and for the small-problem rows the
site's decomposition compiled by stock Inductor (tune_choices.decomposition); then the chosen
family's speed over the fastest of all (fwd, bwd, fwd + bwd). Rows: the quick grid (bf16, D 64/128,
causal and not, N 4k), D 80/96/256 causal, GQA, an additive (B,1,N,N) bias, dropout 0.1, and the
small problems the timm zoo and BERT meet (tune_choices.CLASSES). Where the site reads under
``CONFIRM_BELOW`` of the fastest implementation, the two are re-timed alternately (``_confirm``:
the median of ``CONFIRM_ROUNDS`` rounds each) and that ratio is the row's: the fastest of 10-15
single timings is biased low by their noise. The JSON keeps the first ratio ("retimed").

TFLOP/s from the median of `triton.testing.do_bench`, the best of ``REPEATS`` such medians for every
implementation alike (the GPU host's Python speed varies by up to 2x within a run, and rows near the
host-bound limit, N = 1k, swing with it; NOTES.md stop 11): fwd = 4·B·H·N²·D (×0.5 causal),
bwd = 2.5×fwd.
Main grid: bf16 and fp16, D 64 and 128, causal and not, N 1k/4k/16k with B·N = 16k and H·D = 2048.
Extra rows: D 80/96/256, GQA (Hq/Hkv = 4, 8) against SDPA `enable_gqa=True`, dropout p = 0.1 (`--dropout-only`), an additive (B,1,N,N)
bias against cuDNN/efficient (flash takes no mask). Also peak memory of ours at N = 4k and 16k and
the first-call time (kernel compile, no tuning). Prints a markdown table (and writes it to --out).

Rope + attention table (`--rope-only` runs just it): bf16, D128, causal, GQA 16/4 (Llama), N 2k and
8k with B·N = 16k, RoPE on q and k then attention, as ms (median) forward and forward+backward:
`rope_attention` (the rotation in the attention kernels, half-width tables as the recogniser passes
HF's) vs our `rotary_qk` op then our `attention` op vs the eager HF expression (rotate_half,
repeat_kv, matmul, fp32 softmax) compiled by stock `torch.compile` vs the HF rope compiled + SDPA
(`enable_gqa`, the backend torch picks). Also our attention op alone on q, k rotated beforehand (off
the clock): rope at zero cost, so "pair / alone" is the most any fold of rope into attention can
gain over the pair.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Optional

import torch
from common import emit, prepass
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fuse_plugin

OPS = torch.ops.fuse_plugin
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def flops(b, h, n_q, n_k, d, causal, mode):
    f = 4 * b * h * n_q * n_k * d * (0.5 if causal else 1.0)
    return f * 2.5 if mode == "bwd" else f


REPEATS = 2


def bench_ms(fn):
    return min(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
               for _ in range(REPEATS))


def make_inputs(b, hq, hkv, n, d, dtype, bias):
    q = torch.randn(b, hq, n, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.randn(b, 1, n, n, device="cuda", dtype=dtype) if bias else None
    return q, k, v, mask


def ours(q, k, v, mask, causal, dropout_p=0.0):
    seed = torch.randint(0, 2**62, (), dtype=torch.int64, device=q.device) if dropout_p else None
    return OPS.attention(q, k, v, mask, dropout_p, causal, q.shape[-1] ** -0.5, seed)[0]


def ours_dropout(p):
    return lambda q, k, v, mask, causal: ours(q, k, v, mask, causal, p)


def sdpa(backend, dropout_p=0.0):
    def run(q, k, v, mask, causal):
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                                  enable_gqa=q.shape[1] != k.shape[1])

    return run


def time_impl(fn, q, k, v, mask, causal):
    """(fwd ms, bwd ms) or None where the implementation refuses the case."""
    try:
        out = fn(q, k, v, mask, causal)
        dout = torch.randn_like(out)
        fwd = bench_ms(lambda: fn(q, k, v, mask, causal))
        out = fn(q, k, v, mask, causal)
        bwd = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        return fwd, bwd
    except RuntimeError as e:  # e.g. a backend that does not support the shape
        return None if "No available kernel" in str(e) or "not support" in str(e).lower() else _raise(e)


def _raise(e):
    raise e


def row(label, b, hq, hkv, n, d, dtype, causal, bias, impls):
    q, k, v, mask = make_inputs(b, hq, hkv, n, d, dtype, bias)
    cells = []
    for name, fn in impls.items():
        t = time_impl(fn, q, k, v, mask, causal)
        if t is None:
            cells.append("—")
        else:
            f_tf = flops(b, hq, n, n, d, causal, "fwd") / t[0] / 1e9
            b_tf = flops(b, hq, n, n, d, causal, "bwd") / t[1] / 1e9
            cells.append(f"{f_tf:.0f} / {b_tf:.0f}")
    del q, k, v, mask
    torch.cuda.empty_cache()
    return f"| {label} | " + " | ".join(cells) + " |"


def dropout_rows(p=0.1):
    """Training with attention dropout: ours (the counter-hash mask in the kernels) vs SDPA's backends with dropout_p."""
    impls = {"ours": ours_dropout(p), **{name: sdpa(name, p) for name in BACKENDS}}
    out = []
    for d, causal in ((64, True), (128, True), (128, False)):
        out.append(row(f"bf16 D{d} {'causal' if causal else 'full'} N4k dropout p={p} (B4 H{2048 // d})",
                       4, 2048 // d, 2048 // d, 4096, d, torch.bfloat16, causal, False, impls))
        print(out[-1], flush=True)
    return out


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rope_attention(q, k, v, cos, sin, sdpa=False):
    """HF's apply_rotary_pos_emb + eager_attention_forward (or SDPA), cos/sin (B, N, D) full width."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    if sdpa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b, hkv, n, d = k.shape
    g = q.shape[1] // hkv
    k = k[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
    v = v[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
    w = torch.matmul(q, k.transpose(2, 3)) * d**-0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    w = w.masked_fill(~causal, float("-inf"))
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


def rope_row(n, d=128, hq=16, hkv=4, dtype=torch.bfloat16):
    """One row of the rope + attention table: (fwd ms / fwd+bwd ms) per implementation."""
    b = 16384 // n
    torch._dynamo.reset()  # each row compiles its own static-shape graphs
    q = torch.randn(b, hq, n, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, requires_grad=True)
    freqs = torch.arange(n, device="cuda", dtype=torch.float32)[:, None] * 10000 ** (
        -torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    half_cos, half_sin = freqs.cos().to(dtype)[None, None], freqs.sin().to(dtype)[None, None]  # (1, 1, N, D/2)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype)[None].expand(b, n, d), emb.sin().to(dtype)[None].expand(b, n, d)
    scale = d**-0.5
    stock = torch.compile(hf_rope_attention)
    stock_sdpa = torch.compile(lambda *a: hf_rope_attention(*a, sdpa=True))
    # The rotation done beforehand, off the clock: attention alone is what any fold of rope into
    # attention could at best cost (rope at zero cost), so pair / alone bounds its speed-up.
    with torch.no_grad():
        q_rot, k_rot = (t.detach().requires_grad_() for t in OPS.rotary_qk(q, k, half_cos, half_sin, False, d))
    impls = {  # name: (function, the inputs its gradients are taken for)
        "rope_attention": (lambda: OPS.rope_attention(q, k, v, half_cos, half_sin, False, d, None, 0.0, True,
                                                      scale)[0], (q, k, v)),
        "rotary_qk + attention": (lambda: OPS.attention(*OPS.rotary_qk(q, k, half_cos, half_sin, False, d), v, None,
                                                        0.0, True, scale)[0], (q, k, v)),
        "attention alone (q, k rotated beforehand)": (lambda: OPS.attention(q_rot, k_rot, v, None, 0.0, True,
                                                                            scale)[0], (q_rot, k_rot, v)),
        "compiled HF eager": (lambda: stock(q, k, v, cos, sin), (q, k, v)),
        "compiled HF rope + SDPA": (lambda: stock_sdpa(q, k, v, cos, sin), (q, k, v)),
    }
    cells, ms = [], {}
    for name, (fn, inputs) in impls.items():
        try:
            with fuse_plugin.disabled():  # stock torch.compile: no rewrite while these compile
                out = fn()
                dout = torch.randn_like(out)
                torch.autograd.grad(out, inputs, dout)
            fwd = bench_ms(fn)
            both = bench_ms(lambda: torch.autograd.grad(fn(), inputs, dout))
            ms[name] = (fwd, both)
            cells.append(f"{fwd:.2f} / {both:.2f}")
        except torch.OutOfMemoryError:
            cells.append("OOM")
        torch.cuda.empty_cache()
    pair, alone = ms.get("rotary_qk + attention"), ms.get("attention alone (q, k rotated beforehand)")
    bound = f"{pair[0] / alone[0]:.3f} / {pair[1] / alone[1]:.3f}" if pair and alone else "-"
    cells.append(bound)
    return list(impls), f"| bf16 D{d} causal GQA {hq}/{hkv} N{n // 1024}k (B{b}) | " + " | ".join(cells) + " |"


def rope_table(ns=(2048, 8192)):
    lines = []
    for n in ns:
        names, line = rope_row(n)
        torch.cuda.empty_cache()
        if not lines:
            lines = ["rope + attention, ms (median): fwd / fwd+bwd; the last column is the most any fold can"
                     " gain over the pair (pair / attention alone)", "",
                     "| case | " + " | ".join(names) + " | fold ceiling |", "|" + "---|" * (len(names) + 2)]
        lines.append(line)
        print(line, flush=True)
    return lines


# --------------------------------------------------------------------------- the choice table


_WARM_ONLY = False  # --warm: each implementation runs once (its kernels compile), nothing is timed


def _device_ms(fn) -> float:
    """Median device ms of fn under CUDA graphs (tune_choices.device_us); with --warm one call."""
    from fuse_plugin.tune_choices import device_us

    if _WARM_ONLY:
        fn()
        torch.cuda.synchronize()
        return 1.0
    return device_us(fn) / 1e3


def warm_prepass(n: int, rows: int, limit: float = 300) -> None:
    """--prepass N: the table's rows in N slices, each run once (--warm) by its own process at the
    same time (common.prepass: spread over the visible GPUs, cores / N compile threads each), so
    that the kernels' compiles (Triton's and Inductor's on-disk caches) happen in parallel before
    the timed pass, which then runs one process alone, as every timing here must."""
    import sys

    bounds = [round(i * rows / n) for i in range(n + 1)]
    prepass([[sys.executable, __file__, "--choice", "--warm", "--rows", f"{a}:{b}"]
             for a, b in zip(bounds, bounds[1:]) if b > a], n, time.perf_counter() + limit)


def _choice_cases(quick_grid=True):
    """(label, tune_choices.Case) rows of the choice table."""
    from fuse_plugin.tune_choices import CLASSES, Case

    rows = []
    for d in (64, 128):
        for causal in (False, True):
            rows.append((f"D{d} {'causal' if causal else 'full'} N4k", Case((4, 2048 // d, 2048 // d, 4096, 4096, d, d), "none", causal)))
    for d in (80, 96, 256):
        h = max(1, 2048 // d)
        rows.append((f"D{d} causal N4k", Case((4, h, h, 4096, 4096, d, d), "none", True)))
    rows.append(("D128 causal N4k GQA 16/4", Case((4, 16, 4, 4096, 4096, 128, 128), "none", True)))
    rows.append(("D128 keys bias N4k", Case((4, 16, 16, 4096, 4096, 128, 128), "keys")))
    for d in (64, 128):
        rows.append((f"D{d} causal N4k dropout 0.1", Case((4, 2048 // d, 2048 // d, 4096, 4096, d, d), "none", True, 0.1)))
    seen = {c for _, c in rows}
    rows += [(name, case) for name, case in CLASSES.items()
             if case._replace(seen="", period=case.period) not in seen]  # (a class that is a row above: once)
    return rows


def choice_row(label, case, log, device="cuda"):
    """One row of the choice table: {implementation: (fwd ms, bwd ms)} and the chosen family's."""
    from fuse_plugin.kernels import attention as K
    from fuse_plugin.kernels import registry
    from fuse_plugin.kernels.call import AttentionCall
    from fuse_plugin.ops.attention import bias_4d, new_dropout_seed
    from fuse_plugin import tune_choices as tc

    B, Hq, Hkv, Lq, Lk, D, Dv = case.shape
    scale = D ** -0.5
    dtype = getattr(torch, case.dtype) if device == "cuda" else torch.float32
    q, k, v, bias, mask, learned = tc.inputs(case, torch.device(device), dtype)
    op_bias = tc.op_bias(case, bias, mask)
    b4 = bias_4d(op_bias, q, k)
    seed = new_dropout_seed(q.device) if case.dropout else None
    kw = dict(is_causal=case.causal, scale=scale, dropout_p=case.dropout, dropout_seed=seed)
    out, lse = K.attention_forward(q, k, v, b4, **kw)
    dout = torch.randn_like(out)
    fwd = lambda: K.attention_forward(q, k, v, b4, **kw)  # noqa: E731
    bwd = lambda: K.attention_backward(dout, q, k, v, b4, out, lse, need_dbias=learned, **kw)  # noqa: E731
    times, chosen, thunks = {}, {}, {}
    infer = lambda: K.attention_forward(q, k, v, b4, need_lse=False, **kw)  # noqa: E731
    for direction, fn in (("fwd", fwd), ("bwd", bwd)):
        call = AttentionCall.forward(q, k, v, b4, **kw) if direction == "fwd" else \
            AttentionCall.backward(dout, q, k, v, b4, out, lse, need_dbias=learned, **kw)
        chosen[direction] = registry.choose(call)[0].name
        times.setdefault("chosen", [None, None])[direction == "bwd"] = _device_ms(fn)
        thunks.setdefault("chosen", {})[direction] = fn
        if direction == "fwd":  # the op as an inference site calls it: no logsumexp (need_lse=False)
            times["chosen-infer"] = [_device_ms(infer), None]
            thunks["chosen-infer"] = {"fwd": infer}
        for fam, why in registry.reasons(call).items():
            if why is None:
                run = _forced(fam, fn)
                try:
                    times.setdefault(fam, [None, None])[direction == "bwd"] = _device_ms(run)
                    thunks.setdefault(fam, {})[direction] = run
                except Exception as e:  # noqa: BLE001
                    log(f"{label}: {fam} {direction} failed: {e!r:.200}")
    # SDPA's backends (k/v repeated for GQA by enable_gqa; a window-periodic bias materialised
    # inside the timed call, as timm's fused path and tune_choices.sdpa_times build it), and SDPA
    # as a call site runs it: the backend torch picks ("sdpa")
    for name in (*BACKENDS, None) if device == "cuda" else ():
        key = f"sdpa-{name}" if name else "sdpa"
        t = _sdpa_times(name, q, k, v, op_bias, case, scale, learned, thunks=thunks.setdefault(key, {}))
        if t is not None:
            times[key] = list(t)
    if Hq != Hkv and device == "cuda":  # GQA: SDPA on k/v repeated first (HF's repeat_kv; in float32
        t = _sdpa_times(None, q, k, v, op_bias, case, scale, learned, repeat=True,  # only it runs efficient)
                        thunks=thunks.setdefault("sdpa-repeat", {}))
        if t is not None:
            times["sdpa-repeat"] = list(t)
    if max(Lq, Lk) <= 512:  # Inductor's decomposition materialises the scores: small rows only
        ind = tc.inductor_times(case, scale, q, k, v, bias, mask, learned)
        times["inductor"] = [ind["fwd"] / 1e3, (ind["train"] - ind["fwd"]) / 1e3]
    return times, chosen, thunks


def _forced(fam, fn):
    """fn run with our op's family forced to ``fam`` (registry.forced)."""
    from fuse_plugin.kernels import registry

    def run():
        with registry.forced(fam):
            return fn()
    return run


def _sdpa_times(name, q, k, v, bias, case, scale, learned, repeat=False, thunks=None):
    """SDPA's (fwd ms, bwd ms, train ms) on the row's problem with backend ``name`` (None: torch
    picks); GQA by enable_gqa, or (``repeat``) k/v repeated to the query heads inside the timed
    call, as attention._sdpa_call(repeat_kv=True) emits it; None where no backend takes it.
    ``thunks`` (a dict): given the timed calls, "infer" (the no_grad forward) and "train"."""
    from fuse_plugin.ops.attention import whole_bias

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    b = None if bias is None else bias.detach().requires_grad_(learned)
    group = q.shape[1] // k.shape[1]
    gqa = group > 1 and not repeat

    def mask(b):
        return whole_bias(b, q, k) if b is not None and case.bias == "periodic" else b

    def kv(k, v):
        if not repeat or group == 1:
            return k, v
        return tuple(x[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2) for x in (k, v))

    def fwd():
        with sdpa_kernel(BACKENDS[name]) if name else contextlib.nullcontext():
            return F.scaled_dot_product_attention(leaves[0], *kv(*leaves[1:]), attn_mask=mask(b),
                                                  dropout_p=case.dropout, is_causal=case.causal, scale=scale,
                                                  enable_gqa=gqa)
    def infer():  # as a model in eval under no_grad: tensors that need no gradient (SDPA picks its
        with sdpa_kernel(BACKENDS[name]) if name else contextlib.nullcontext():  # backend by requires_grad)
            return F.scaled_dot_product_attention(q, *kv(k, v), attn_mask=mask(bias), dropout_p=case.dropout,
                                                  is_causal=case.causal, scale=scale, enable_gqa=gqa)
    try:
        with torch.no_grad():  # no autograd graph kept alive: one alive made the captured backward
            out = infer()      # sync with the default stream and fail its capture (H200, 2026-11-26)
            f = _device_ms(infer)
        dout = torch.randn_like(out)
        grads = leaves + ([b] if learned else [])
        train = lambda: torch.autograd.grad(fwd(), grads, dout)  # noqa: E731
        t = _device_ms(train)
        if thunks is not None:
            thunks.update(infer=_no_grad(infer), train=train)
        # bwd: training minus the forward with grad (SDPA's backend and its lse can differ from
        # inference's: Swin's default backend is cuDNN there and efficient in training); the
        # training total is kept as measured
        return f, t - _device_ms(fwd), t
    except RuntimeError as e:
        if "No available kernel" in str(e) or "not support" in str(e).lower():
            return None
        raise


def _no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


CONFIRM_BELOW = 0.99  # a site this far or more under the fastest implementation is re-timed (_confirm)
CONFIRM_ROUNDS = 5


def _mode_ms(th: dict, mode: str) -> float:
    """One timing of an implementation's ``thunks`` (choice_row) in ``mode``: "fwd" its inference
    forward (SDPA's under no_grad), "train" forward + backward (SDPA's as one call)."""
    if mode == "fwd":
        return _device_ms(th.get("infer", th.get("fwd")))
    return _device_ms(th["train"]) if "train" in th else _device_ms(th["fwd"]) + _device_ms(th["bwd"])


def _confirm(thunks: dict, names, mode: str, rounds: int = CONFIRM_ROUNDS) -> Optional[dict]:
    """{name: median ms} of ``names`` re-timed in ``rounds`` interleaved rounds (mode: _mode_ms),
    or None where one of them has no timed calls here (Inductor's; a family that failed).

    Why: the fastest of a row is the least of 10-15 single timings, each with its own 1-3% of
    run-to-run noise (minutes apart on a GPU whose clocks drift), so the least is biased low and
    a site that runs the same kernel as the fastest can read 0.96 of it (levit-sub2, stop 39: the
    small family 7.5 vs 7.2 us, the same kernel with and without its lse). The site and the fastest
    alone, timed alternately, are the fair pair."""
    def timed(th):
        return ("infer" in th or "fwd" in th) if mode == "fwd" else ("train" in th or {"fwd", "bwd"} <= set(th))
    if not all(timed(thunks.get(n) or {}) for n in names):
        return None
    samples = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            samples[n].append(_mode_ms(thunks[n], mode))
    return {n: statistics.median(s) for n, s in samples.items()}


def site_decisions(case, device="cuda"):
    """What a hand-written site of this row's problem gets, per mode ("fwd": inference, "train"):
    patterns/choice.decide_from over the shipped choice table's entry for the row's class (None:
    not measured; then our op, the op's own family choice), as the rewrite decides it."""
    from fuse_plugin.kernels import choice_table as ct
    from fuse_plugin.patterns.choice import decide_from

    B, Hq, Hkv, Lq, Lk, D, Dv = case.shape
    key = ct.class_key(getattr(torch, case.dtype), D, Dv, Lq, Lk, case.bias, case.causal, bool(case.dropout))
    times = ct.lookup(torch.device(device), key)
    # every row's site can be an SDPA call (no softcap or finite fill: attention.why_not_sdpa)
    return {mode: decide_from(times, mode, key, sdpa_ok=True, gqa=Hq != Hkv) for mode in ("fwd", "train")}


def _train_ms(t) -> float:
    """Forward + backward of one implementation's [fwd, bwd(, train)] ms (SDPA's: as measured)."""
    return t[2] if len(t) > 2 else t[0] + t[1]


def site_times(times, decisions):
    """(implementation, ms) per mode of the site's decision: our op (its chosen families), an SDPA
    call (the backend torch picks; k/v repeated for it where the decision says so) or Inductor's
    decomposition."""
    out = {}
    for mode, dec in decisions.items():
        name = ("chosen" if dec.ours and not dec.as_sdpa else "sdpa-repeat" if dec.repeat_kv
                else "sdpa" if dec.as_sdpa else "inductor")
        if name == "chosen" and mode == "fwd" and "chosen-infer" in times:
            name = "chosen-infer"  # an inference site's op computes no logsumexp (attention._op_call)
        t = times.get(name)
        if t is None or t[0] is None or (mode == "train" and t[1] is None):
            name, t = "chosen", times["chosen"]  # (not measured here: what the op runs)
        out[mode] = (name, t[0] if mode == "fwd" else _train_ms(t))
    return out


def choice_table(log=print, cases=None, device="cuda", on_row=None):
    """The choice table's rows (markdown) and their numbers (for --json). Two views per row: the
    op's families (what `fuse_plugin::attention` runs when called: chosen vs fastest of all), and
    the site (what the rewrite does with a hand-written site of that problem, from the shipped
    table: our op, an SDPA call or the site left to Inductor) against the fastest implementation,
    inference (fwd) and training (fwd + bwd of one implementation, our op's families mixed)."""
    lines = ["| row | chosen fwd / bwd | best family fwd / bwd (ms) | fastest other (ms) | chosen vs fastest fwd / bwd / both "
             "| site: infer / train (ms) | site vs fastest infer / train |",
             "|---|---|---|---|---|---|---|"]
    data = []
    for label, case in cases or _choice_cases():
        times, chosen, thunks = choice_row(label, case, log, device)
        decisions = site_decisions(case, device)
        site = site_times(times, decisions)
        ours = {k: v for k, v in times.items()
                if k not in ("chosen", "chosen-infer") and not k.startswith("sdpa") and k != "inductor"}
        best = [min((v[i], k) for k, v in ours.items() if v[i] is not None) for i in (0, 1)]
        every = {k: v for k, v in times.items() if k not in ("chosen", "chosen-infer")}
        fastest = [min((v[i], k) for k, v in every.items() if v[i] is not None) for i in (0, 1)]
        c = times["chosen"]
        both = (fastest[0][0] + fastest[1][0]) / (c[0] + c[1])
        train = min((_train_ms(v), k) for k, v in every.items() if None not in v[:2])
        site_vs = [fastest[0][0] / site["fwd"][1], train[0] / site["train"][1]]
        retimed = {}  # a site under CONFIRM_BELOW of the fastest: the pair re-timed alternately (_confirm)
        for i, (mode, best_name) in enumerate((("fwd", fastest[0][1]), ("train", train[1]))):
            if site_vs[i] < CONFIRM_BELOW and site[mode][0] != best_name:
                got = _confirm(thunks, (site[mode][0], best_name), mode)
                if got is not None:
                    retimed[mode] = {"first": site_vs[i], "ms": got}
                    site_vs[i] = got[best_name] / got[site[mode][0]]
        note = {m: f", re-timed: {r['first']:.2f} first" for m, r in retimed.items()}
        lines.append(f"| {label} | {chosen['fwd']} {c[0]:.3f} / {chosen['bwd']} {c[1]:.3f} | "
                     f"{best[0][1]} {best[0][0]:.3f} / {best[1][1]} {best[1][0]:.3f} | "
                     f"{fastest[0][1]} {fastest[0][0]:.3f} / {fastest[1][1]} {fastest[1][0]:.3f} | "
                     f"{fastest[0][0] / c[0]:.2f} / {fastest[1][0] / c[1]:.2f} / {both:.2f} | "
                     f"{site['fwd'][0]} {site['fwd'][1]:.3f} / {site['train'][0]} {site['train'][1]:.3f} | "
                     f"{site_vs[0]:.2f} ({fastest[0][1]}{note.get('fwd', '')}) / "
                     f"{site_vs[1]:.2f} ({train[1]}{note.get('train', '')}) |")
        log(lines[-1])
        data.append({"row": label, "shape": list(case.shape), "bias": case.bias, "causal": case.causal,
                     "dropout": case.dropout, "chosen": chosen, "ms": times,
                     "site": {m: {"impl": site[m][0], "ms": site[m][1], "reason": decisions[m].reason}
                              for m in site}, "site_vs_fastest": {"fwd": site_vs[0], "train": site_vs[1]},
                     "fastest": {"fwd": fastest[0][1], "train": train[1]}, "retimed": retimed})
        if on_row is not None:  # (main: the table so far written out, so that a call cut by its limit keeps it)
            on_row(lines, data)
        if device == "cuda":
            torch.cuda.empty_cache()
    return lines, data


def peak_memory_gb(n, d=128, dtype=torch.bfloat16):
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v, _ = make_inputs(b, h, h, n, d, dtype, False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = ours(q, k, v, None, True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="N = 4k only, fewer extra rows")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rope-only", action="store_true", help="only the rope + attention table")
    parser.add_argument("--dropout-only", action="store_true", help="only the dropout rows")
    parser.add_argument("--choice", action="store_true", help="the never-slower table (module doc)")
    parser.add_argument("--json", default=None, help="with --choice: every number as JSON")
    parser.add_argument("--rows", default=None, help="with --choice: a slice of its rows, START:STOP (one device "
                                                     "call each when the whole table does not fit one)")
    parser.add_argument("--warm", action="store_true", help="with --choice: run every implementation once, time "
                                                            "nothing (compiles only; no table)")
    parser.add_argument("--prepass", type=int, default=0, metavar="N",
                        help="with --choice: first N processes in parallel each --warm a slice of the rows")
    parser.add_argument("--prepass-limit", type=float, default=300, metavar="S",
                        help="--prepass: end the pre-pass after S seconds")
    args = parser.parse_args()
    if args.choice:
        import json

        global _WARM_ONLY
        _WARM_ONLY = args.warm
        if args.prepass:
            warm_prepass(args.prepass, len(_choice_cases()), args.prepass_limit)

        head = [f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
                f"{time.strftime('%Y-%m-%d')} | device ms (CUDA graphs, median); bf16", ""]
        cases = _choice_cases()
        if args.rows:
            start, stop = (int(x) if x else None for x in args.rows.split(":"))
            cases = cases[start:stop]
        def write(lines, data):
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"head": head[0], "rows": data}, f, indent=1)
        lines, data = choice_table(cases=cases, on_row=None if args.warm else write)
        if args.warm:
            return
        emit(head + lines, args.out)
        return
    if args.rope_only:
        emit([f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
              f"{time.strftime('%Y-%m-%d')}", ""] + rope_table(), args.out)
        return

    t0 = time.perf_counter()
    q, k, v, _ = make_inputs(1, 2, 2, 128, 128, torch.bfloat16, False)
    out = ours(q, k, v, None, True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    first_call = time.perf_counter() - t0

    impls = {"ours": ours, **{name: sdpa(name) for name in BACKENDS}}
    header = "| case | " + " | ".join(f"{n} fwd / bwd" for n in impls) + " |"
    lines = [
        f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{time.strftime('%Y-%m-%d')} | TFLOP/s (best of {REPEATS} medians of do_bench), fwd = 4·B·H·N²·D (×0.5 causal), bwd = 2.5× fwd",
        "",
        header,
        "|" + "---|" * (len(impls) + 1),
    ]
    if args.dropout_only:
        emit(lines + dropout_rows(), args.out)
        return
    ns = [4096] if args.quick else [1024, 4096, 16384]
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for causal in (False, True):
                for n in ns:
                    b, h = 16384 // n, 2048 // d
                    label = f"{str(dtype)[6:]} D{d} {'causal' if causal else 'full'} N{n // 1024}k (B{b} H{h})"
                    lines.append(row(label, b, h, h, n, d, dtype, causal, False, impls))
                    print(lines[-1], flush=True)
    extra_n = 4096
    for d in (80, 96, 256):
        b, h = 16384 // extra_n, max(1, 2048 // d)
        lines.append(row(f"bf16 D{d} causal N4k (B{b} H{h})", b, h, h, extra_n, d, torch.bfloat16, True, False, impls))
        print(lines[-1], flush=True)
    for groups in (4, 8):
        hq = 2048 // 128
        lines.append(row(f"bf16 D128 causal N4k GQA {hq}/{hq // groups}", 4, hq, hq // groups, extra_n, 128, torch.bfloat16, True, False, impls))
        print(lines[-1], flush=True)
    lines.append(row("bf16 D128 bias (B,1,N,N) N4k (B4 H16)", 4, 16, 16, extra_n, 128, torch.bfloat16, False, True, impls))
    print(lines[-1], flush=True)
    lines += dropout_rows()
    m4, m16 = peak_memory_gb(4096), peak_memory_gb(16384)
    lines += [
        "",
        f"peak extra memory of ours, fwd+bwd, bf16 D128 causal, B·N = 16k: N=4k {m4:.3f} GB, N=16k {m16:.3f} GB "
        "(inputs, outputs and grads are the same size at both N: no Lq·Lk buffer)",
        f"first call (kernel compile, no tuning), fwd+bwd bf16 D128 causal: {first_call:.1f} s",
        "",
    ] + rope_table()
    emit(lines, args.out)


if __name__ == "__main__":
    main()
