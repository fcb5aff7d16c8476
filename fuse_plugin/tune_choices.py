"""Measure the choice table on the current GPU: per problem class, our kernel families and Inductor.

    python -m fuse_plugin.tune --choices [--out PATH] [--classes NAME,...] [--log FILE.jsonl] [--warm]

(``--warm``: compile and run every candidate once, untimed: a few such processes over disjoint
``--classes`` fill Triton's and Inductor's caches for the timed run, which then compiles nothing.)

For every class of ``CLASSES`` (the attention problems the shapes table, the timm zoo and the
kernel table meet, at the shape they meet them), on random inputs of that shape:

* each of our families that can run it (kernels/registry.py, ``why_not``; its rule is ignored),
  forced, forward and backward (with the bias's gradient where the bias is learned), timed with
  CUDA graphs (device time, median of ``triton.testing.do_bench_cudagraph``); each family's
  outputs and gradients are first compared with the general family's (relative error at most
  ``AGREE``), and a family that disagrees is left out of the table and reported;
* "inductor": the site's decomposition as models write it (q·kᵀ·scale, the bias or mask, softmax,
  dropout, ·v; k/v repeated for GQA), compiled by stock ``torch.compile``, forward under no_grad
  and forward + backward, timed the same way;
* "sdpa": ``F.scaled_dot_product_attention`` on the same problem (``enable_gqa`` for GQA, the
  bias as its ``attn_mask``; the backend torch picks), forward and forward + backward: what an
  SDPA call site runs when it is left as it is (patterns/sdpa.py weighs our op against it);
  "sdpa_repeat", for GQA classes: the same call with k/v repeated to the query heads first, as
  HF's sdpa path passes them with a mask (an SDPA call site that repeats k/v is weighed against it);
* "infer": the forward without the logsumexp of the families that can skip it (cuDNN's,
  PyTorch's efficient kernels), as an inference site calls the op (``infer_times``).

Writes kernels/attention_choices_sm<cc>.json (or ``--out``), replacing this GPU name's entries and
keeping other GPUs'; see kernels/choice_table.py for the format and how the entries are read.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import NamedTuple, Optional

AGREE = 2e-2  # bf16 families against the general one (both against the same inputs)
# The small family's configs tried per class and direction (attention_small.SmallConfig): units
# per program (a run-time argument: no recompile) x warps; the fastest is kept in the entry.
SMALL_PER_PROGRAM = (1, 2, 4, 8, 16)
SMALL_WARPS = (4, 8)


class Case(NamedTuple):
    shape: tuple  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    bias: str  # choice_table.bias_form names: none / keys / bool / float / periodic
    causal: bool = False
    dropout: float = 0.0
    period: int = 0  # windows, for "periodic"
    seen: str = ""
    dtype: str = "bfloat16"  # on the GPU (the CPU runs float32)


# name -> Case: what the benchmarks meet (bf16).
CLASSES = {
    "swin-s1-shifted": Case((4096, 3, 3, 49, 49, 32, 32), "periodic", period=64, seen="Swin-T stage 1, shifted"),
    "swin-s1": Case((4096, 3, 3, 49, 49, 32, 32), "float", seen="Swin-T stage 1 (rel. position bias)"),
    "twins-local": Case((4096, 2, 2, 49, 49, 32, 32), "none", seen="Twins-SVT windows, PVT stage 4"),
    # LeViT-128S: key dim 16, value dim 2 x 16 in its blocks (attn_ratio 2), 4 x 16 in its two
    # subsampling attentions (the blocks' classes had value dim 64 until stop 27: their sites
    # found no entry and ran unmeasured, 0.69x stock compile under CUDA graphs on an H100)
    "levit-s1": Case((64, 4, 4, 196, 196, 16, 32), "float", seen="LeViT-128S stage 1"),
    "levit-s2": Case((64, 6, 6, 49, 49, 16, 32), "float", seen="LeViT-128S stage 2"),
    "levit-s3": Case((64, 8, 8, 16, 16, 16, 32), "float", seen="LeViT-128S stage 3"),
    "levit-sub": Case((64, 8, 8, 49, 196, 16, 64), "float", seen="LeViT subsample attention"),
    "levit-sub2": Case((64, 16, 16, 16, 49, 16, 64), "float", seen="LeViT second subsample attention"),
    "vit-s": Case((64, 6, 6, 197, 197, 64, 64), "none", seen="ViT-S/16, DeiT-III-S"),
    "beit-b": Case((64, 12, 12, 197, 197, 64, 64), "float", seen="BEiT-B (rel. position bias)"),
    "eva02-ti": Case((64, 3, 3, 257, 257, 64, 64), "none", seen="EVA-02-Ti"),
    "pvt-s1": Case((64, 1, 1, 3136, 49, 32, 32), "none", seen="PVTv2-b0 stage 1 (spatial reduction)"),
    # stage 2 (784 queries over 49 keys, class q1024|k64) was in neither GPU's table at stop 36,
    # when PVTv2-b0 trained at 0.98x under CUDA graphs on an H200 (1.03x on an H100): measure it
    "pvt-s2": Case((64, 2, 2, 784, 49, 32, 32), "none", seen="PVTv2-b0 stage 2"),
    "pvt-s3": Case((64, 5, 5, 196, 49, 32, 32), "none", seen="PVTv2-b0 stage 3"),
    "class-attn": Case((64, 4, 4, 1, 197, 48, 48), "none", seen="CaiT / XCiT class attention"),
    # XCiT's cross-covariance attention: channels as the tokens (C/H = 32), the 196 patches as the
    # head dim; matched since stop 34 (its per-head temperature moves to q)
    "xcit-xca": Case((64, 4, 4, 32, 32, 196, 196), "none", seen="XCiT-nano XCA (channels attend)"),
    "llama-2k": Case((4, 16, 4, 2048, 2048, 64, 64), "none", causal=True, seen="Llama 4x2048 (shapes table)"),
    "llama-8k": Case((1, 16, 4, 8192, 8192, 64, 64), "none", causal=True, seen="e2e Llama 1x8192"),
    "bert": Case((32, 12, 12, 128, 128, 64, 64), "keys", dropout=0.1, seen="BERT-base training"),
    "bert-nodrop": Case((32, 12, 12, 128, 128, 64, 64), "keys", seen="BERT-base inference"),
    "llama-512": Case((8, 16, 4, 512, 512, 64, 64), "none", causal=True, seen="Llama 8x512 (shapes table)"),
    "llama-128": Case((1, 16, 4, 128, 128, 64, 64), "none", causal=True, seen="Llama 1x128 (shapes table)"),
    "llama-512-fp32": Case((8, 16, 4, 512, 512, 64, 64), "none", causal=True, dtype="float32",
                           seen="Llama 8x512 in float32 (shapes table, HF's default load dtype)"),
    # non-causal at length (the kernel table's full rows): our op runs cuDNN's forward, which with
    # its lse was 0.96 of SDPA's cuDNN call without one at D 64 (H100, stop 39); measured as classes,
    # an inference site weighs the op without the lse ("infer") against SDPA
    "full-d64-4k": Case((4, 32, 32, 4096, 4096, 64, 64), "none", seen="non-causal D64 4k (kernel table)"),
    "full-d128-4k": Case((4, 16, 16, 4096, 4096, 128, 128), "none", seen="non-causal D128 4k (kernel table)"),
    # attention dropout at length (the kernel table's dropout rows, benchmarks/attention.py --choice):
    # cuDNN's dropout ran 1.6-1.8x our kernels (issue 28); an SDPA call is the candidate that has it
    "drop-d64-4k": Case((4, 32, 32, 4096, 4096, 64, 64), "none", causal=True, dropout=0.1,
                        seen="causal D64 4k, attention dropout 0.1 (kernel table)"),
    "drop-d128-4k": Case((4, 16, 16, 4096, 4096, 128, 128), "none", causal=True, dropout=0.1,
                         seen="causal D128 4k, attention dropout 0.1 (kernel table)"),
    # Its inputs pad each row to a random length in [L/2, L] (inputs below: ~25% of keys padded),
    # which the general kernels skip (kernels/key_range.py, stop 32): re-measured with it (H100, stop
    # 37), our op is 1.23x / 1.25x SDPA (it was 0.86x / 0.92x before the skip, stop 28). A batch with
    # no padding at all gets no skip: by stop 28's times SDPA would be 1.09-1.17x faster there.
    "keys-4k": Case((4, 16, 16, 4096, 4096, 128, 128), "keys",
                    seen="D128 4k with a per-key (padding) bias (kernel table)"),
    "gpt2-drop": Case((8, 12, 12, 1024, 1024, 64, 64), "none", causal=True, dropout=0.1,
                      seen="GPT-2 small 8x1024, attention dropout 0.1 (HF's default attn_pdrop)"),
}


def inputs(case: Case, device, dtype):
    import torch

    B, Hq, Hkv, Lq, Lk, D, Dv = case.shape
    torch.manual_seed(0)
    q = torch.randn(B, Lq, Hq, D, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Lk, Hkv, D, device=device, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, Lk, Hkv, Dv, device=device, dtype=dtype).transpose(1, 2)
    learned = case.bias in ("float", "periodic")
    bias = mask = None
    if case.bias in ("float", "periodic"):
        bias = torch.randn(1, Hq, Lq, Lk, device=device, dtype=dtype)
    if case.bias == "periodic":
        mask = torch.where(torch.rand(case.period, Lq, Lk, device=device) < 0.3, -100.0, 0.0).to(dtype)
    if case.bias == "keys":
        keep = torch.arange(Lk, device=device)[None, :] < torch.randint(Lk // 2, Lk + 1, (B, 1), device=device)
        bias = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]
    return q, k, v, bias, mask, learned


def op_bias(case: Case, bias, mask):
    """The bias our op takes: the periodic sum (P, H, L, L) for Swin's windows, else the bias."""
    if case.bias == "periodic":
        return bias + mask[:, None]
    return bias


def decomposition(case: Case, scale: float):
    """The site as models write it (timm / HF eager), for stock Inductor."""
    import torch
    import torch.nn.functional as F

    def site(q, k, v, bias, mask):
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, 1)
            v = v.repeat_interleave(group, 1)
        s = (q * scale) @ k.transpose(-2, -1)
        if case.bias in ("float", "periodic", "keys"):
            s = s + bias
        if case.bias == "periodic":
            H, L, S = s.shape[1:]
            s = (s.view(-1, case.period, H, L, S) + mask.unsqueeze(1).unsqueeze(0)).view(-1, H, L, S)
        if case.causal:
            L, S = s.shape[-2:]
            s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        p = s.softmax(dim=-1)
        if case.dropout:
            p = F.dropout(p, case.dropout, training=True)
        return p @ v

    return site


def _small_configs(direction: str, case: Case) -> list:
    """The SmallConfigs tried for the small family (a config given forces that family)."""
    import torch

    from .kernels import attention_small

    B, Hq, Hkv, Lq, Lk, D, Dv = case.shape
    d = attention_small.default_config(direction, B * Hkv, Lq, Lk, D, Dv, getattr(torch, case.dtype))
    rest = [attention_small.SmallConfig(p, w, d.num_stages) for w in SMALL_WARPS for p in SMALL_PER_PROGRAM]
    return [d] + [c for c in rest if c != d]


def device_us(fn) -> float:
    """Median device microseconds of fn, under CUDA graphs where it captures (else events); off
    the GPU, wall microseconds of one call."""
    import torch
    import triton

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)
    fn()
    torch.cuda.synchronize()
    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception:  # noqa: BLE001  (a path that does not capture: timed with events)
        return 1e3 * triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure_class(name: str, case: Case, log, timed: bool = True, device: str = "cuda") -> Optional[dict]:
    """The entry of one class (choice_table's format). ``device`` "cpu": the same steps in Triton's
    interpreter and Inductor's CPU backend (tests: tiny classes, times only checked for form)."""
    import torch

    from .kernels import attention as K
    from .kernels import registry
    from .kernels.call import AttentionCall
    from .ops.attention import bias_4d, new_dropout_seed

    dev, dt = torch.device(device), getattr(torch, case.dtype) if device == "cuda" else torch.float32
    B, Hq, Hkv, Lq, Lk, D, Dv = case.shape
    scale = D ** -0.5
    q, k, v, bias, mask, learned = inputs(case, dev, dt)
    b4 = bias_4d(op_bias(case, bias, mask), q, k)
    seed = new_dropout_seed(dev) if case.dropout else None
    kw = dict(is_causal=case.causal, scale=scale, dropout_p=case.dropout, dropout_seed=seed)
    entry = {"shape": list(case.shape), "seen": case.seen, "fwd": {}, "bwd": {}, "inductor": {},
             "source": f"measured {time.strftime('%Y-%m-%d')}"}
    results = {}
    for direction in ("fwd", "bwd"):
        if direction == "fwd":
            call = AttentionCall.forward(q, k, v, b4, **kw)
        else:
            out, lse = K.attention_forward(q, k, v, b4, **kw)
            dout = torch.randn_like(out)
            call = AttentionCall.backward(dout, q, k, v, b4, out, lse, need_dbias=learned, **kw)
        for fam, why in registry.reasons(call).items():
            if why is not None:
                continue
            configs = _small_configs(direction, case) if fam == "small" else [None]
            for cfg in configs:
                with registry.forced(None if cfg is not None else fam):
                    if direction == "fwd":
                        fn = lambda: K.attention_forward(q, k, v, b4, config=cfg, **kw)  # noqa: E731
                    else:
                        fn = lambda: K.attention_backward(dout, q, k, v, b4, out, lse,  # noqa: E731
                                                          need_dbias=learned, config=cfg, **kw)
                    try:
                        got = fn()
                        us = round(device_us(fn), 2) if timed else 0.0
                    except Exception as e:  # noqa: BLE001
                        log({"class": name, "family": fam, "config": cfg, "direction": direction,
                             "error": repr(e)[:300]})
                        continue
                if us < entry[direction].get(fam, float("inf")):
                    results[(direction, fam)] = got
                    entry[direction][fam] = us
                    if cfg is not None:
                        entry.setdefault("small", {})[direction] = list(cfg)
    _check_agreement(name, results, entry, bool(case.dropout), log)
    entry["infer"] = infer_times(entry["fwd"], q, k, v, b4, kw, timed)
    entry["inductor"] = inductor_times(case, scale, q, k, v, bias, mask, learned, timed)
    entry["sdpa"] = sdpa_times(case, scale, q, k, v, op_bias(case, bias, mask), learned, timed)
    if q.shape[1] != k.shape[1]:
        entry["sdpa_repeat"] = sdpa_times(case, scale, q, k, v, op_bias(case, bias, mask), learned, timed,
                                          repeat_kv=True)
    return entry


def infer_times(fwd: dict, q, k, v, b4, kw, timed: bool = True) -> dict:
    """{family: us} of the inference forward without the logsumexp (need_lse=False) of the
    families among ``fwd`` (those that ran the class) that can skip it: PyTorch's efficient kernels
    (through the launcher, forced), cuDNN's (its ATen call without the lse: the family itself
    skips it only where this measured it faster, choice_table.lse_free)."""
    from .kernels import attention as K
    from .kernels import attention_cudnn, registry

    out = {}
    for fam, fn in (("efficient", lambda: K.attention_forward(q, k, v, b4, need_lse=False, **kw)),
                    ("cudnn", lambda: attention_cudnn.forward(q, k, v, kw["is_causal"], kw["scale"], need_lse=False))):
        if fam not in fwd:
            continue
        with registry.forced(fam):
            fn()
            out[fam] = round(device_us(fn), 2) if timed else 0.0
    return out


def _check_agreement(name, results, entry, dropout: bool, log) -> None:
    """Drop a family whose outputs differ from the general family's (dropout: not compared, the
    families draw their own masks where they have one)."""
    for direction in ("fwd", "bwd"):
        ref = results.get((direction, "general")) or results.get((direction, "two_kernel"))
        if ref is None:
            continue
        for (d, fam), got in results.items():
            if d != direction or got is ref:
                continue
            errs = [_rel(a, b) for a, b in zip(got, ref) if a is not None and b is not None
                    and a.shape == b.shape]
            if errs and max(errs) > AGREE and not dropout:
                entry[direction].pop(fam, None)
                log({"class": name, "family": fam, "direction": direction, "disagrees": max(errs)})


def inductor_times(case, scale, q, k, v, bias, mask, learned, timed: bool = True) -> dict:
    import torch

    import fuse_plugin

    site = decomposition(case, scale)
    torch._dynamo.reset()  # a fresh cache for every class: no recompile limit is reached
    with fuse_plugin.disabled():
        fwd = torch.compile(site, dynamic=False)
        train = torch.compile(site, dynamic=False)
        out = {}
        bench = device_us if timed else (lambda fn: (fn(), 0.0)[1])
        with torch.no_grad():
            out["fwd"] = round(bench(lambda: fwd(q, k, v, bias, mask)), 2)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        b = bias.detach().requires_grad_(learned) if bias is not None else None
        grads_of = leaves + ([b] if learned else [])
        dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], device=q.device, dtype=q.dtype)

        def step():
            o = train(*leaves, b, mask)
            return torch.autograd.grad(o, grads_of, dout)

        out["train"] = round(bench(step), 2)
    return out


def sdpa_times(case, scale, q, k, v, bias, learned, timed: bool = True, repeat_kv: bool = False) -> dict:
    """F.scaled_dot_product_attention on the class's problem: forward (no_grad) and forward +
    backward, in microseconds; {} where SDPA takes no such problem. A window-periodic bias is
    materialised (B, H, Lq, Lk) inside the timed call, as timm's fused path and a hand-written
    site rewritten into SDPA (patterns/attention._sdpa_call) build it. GQA: ``enable_gqa``, or with
    ``repeat_kv`` k/v repeated to the query heads inside the timed call (HF's ``repeat_kv``, what
    its sdpa path passes with a mask): the backends differ (in float32 the efficient kernel takes
    the repeated call and not enable_gqa, which falls to the math path: 2x slower, H100)."""
    import torch
    import torch.nn.functional as F

    from .ops.attention import whole_bias

    periodic = bias is not None and case.bias == "periodic"
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    b = None if bias is None else bias.detach().requires_grad_(learned)
    group = q.shape[1] // k.shape[1]
    kw = dict(dropout_p=case.dropout, is_causal=case.causal, scale=scale, enable_gqa=group > 1 and not repeat_kv)
    bench = device_us if timed else (lambda fn: (fn(), 0.0)[1])
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], device=q.device, dtype=q.dtype)
    grads_of = leaves + ([b] if learned else [])

    def call(q, k, v, b):
        mask = whole_bias(b, q, k) if periodic else b
        if repeat_kv and group > 1:
            k, v = (x[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

    try:
        # Inference on tensors that need no gradient, as a model's in eval under no_grad: SDPA
        # picks its backend by requires_grad even under no_grad (a learned bias that requires
        # grad keeps cuDNN out: BEiT-B measured 154 us here, where timm's eval ran cuDNN's 130)
        with torch.no_grad():
            fwd = bench(lambda: call(q, k, v, bias))
        train = bench(lambda: torch.autograd.grad(call(*leaves, b), grads_of, dout))
    except RuntimeError:  # (no backend takes it)
        return {}
    return {"fwd": round(fwd, 2), "train": round(train, 2)}


def main(args) -> int:
    import torch

    from .kernels import choice_table

    names = args.classes.split(",") if args.classes else list(CLASSES)
    gpu = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    path = Path(args.out) if args.out else choice_table.path_for(cc)
    log_f = open(args.log, "a") if args.log else None

    def log(rec):
        print(json.dumps(rec), flush=True)
        if log_f:
            log_f.write(json.dumps(rec) + "\n")

    if args.warm:  # compile and run everything once (fills Triton's and Inductor's caches)
        for name in names:
            t0 = time.time()
            measure_class(name, CLASSES[name], log, timed=False)
            log({"class": name, "warmed_s": round(time.time() - t0, 1)})
        return 0
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if table.get("format") != choice_table.FORMAT:
        table = {"format": choice_table.FORMAT, "gpus": {}}
    # --classes: the other classes this GPU has keep their entries
    entries = dict(table["gpus"].get(gpu, {}).get("entries", {})) if args.classes else {}
    for name in names:
        case = CLASSES[name]
        t0 = time.time()
        entry = measure_class(name, case, log)
        key = choice_table.class_key(getattr(torch, case.dtype), case.shape[5], case.shape[6], case.shape[3],
                                     case.shape[4], case.bias, case.causal, bool(case.dropout))
        entries[key] = dict(entry, name=name)
        log({"class": name, "key": key, "s": round(time.time() - t0, 1), **{
            p: entry[p] for p in ("fwd", "bwd", "inductor")}})
        # Written after every class: a run cut short by its time limit keeps what it measured.
        table["gpus"][gpu] = {"torch": torch.__version__, "entries": entries}
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(summary(entries))
    print(f"wrote {len(entries)} classes for {gpu} to {path}")
    return 0


def summary(entries: dict) -> str:
    """One line per class: fastest forward, backward, Inductor's and SDPA's, and the speed of ours
    over each (inference / training)."""
    rows = ["class | fwd best (us) | bwd best (us) | inductor fwd / train (us) | infer / train: ours vs inductor"
            " | sdpa fwd / train (us) | ours vs sdpa"]
    for key, e in entries.items():
        f, b, ind, sd = e.get("fwd", {}), e.get("bwd", {}), e.get("inductor", {}), e.get("sdpa", {})
        fb = min(f, key=f.get) if f else None
        bb = min(b, key=b.get) if b else None
        ours_f = f[fb] if fb else math.inf
        ours_t = ours_f + (b[bb] if bb else math.inf)
        rows.append(f"{e.get('name', key)} | {fb} {ours_f:.1f} | {bb} {b.get(bb, math.inf):.1f} | "
                    f"{ind.get('fwd', math.nan):.1f} / {ind.get('train', math.nan):.1f} | "
                    f"{ind.get('fwd', math.nan) / ours_f:.2f}x / {ind.get('train', math.nan) / ours_t:.2f}x | "
                    f"{sd.get('fwd', math.nan):.1f} / {sd.get('train', math.nan):.1f} | "
                    f"{sd.get('fwd', math.nan) / ours_f:.2f}x / {sd.get('train', math.nan) / ours_t:.2f}x")
    return "\n".join(rows)
