"""Padding (issue 31): what skipping the key blocks a per-key padding mask hides is worth, kernels and
a whole BERT training step, skip on vs off (FUSE_PLUGIN_KEY_PADDING_SKIP; kernels/key_range.py), on one
GPU in one run.

    python benchmarks/padding.py [--lengths 512,1024,2048] [--batch 32] [--pad 0.4] [--mask float]
                                 [--model-family general] [--no-model] [--model-len 512] [--steps 10]
                                 [--rounds 5] [--out FILE.md]

(a) Kernels: bf16, B --batch, H 12, D 64, L in --lengths, right padding: row b keeps its first n_b keys,
    n_b uniform in [(1 - 2 pad) L, L] (--pad 0.4: ~40% of the keys are padding), the mask as HF builds
    it (--mask float: 0 / finfo.min, (B, 1, 1, L) broadcast over heads and queries; bool: keep-mask).
    Forward and backward device ms (CUDA graphs, `do_bench_cudagraph` medians, best of 2) of
      dense  our launchers, general family forced, skip off (every key block visited, the padded ones
             masked: the dense padding vector)
      skip   the same with the skip on (the key range computed per call, inside the timed region)
      sdpa   F.scaled_dot_product_attention with the same mask (timed without CUDA graphs: its autograd
             backward fails inside a capture, see documents.py)
    "live" = the share of (row, key block) pairs that overlap a row's live keys (the ideal skip/dense).
(b) Model: transformers BertForMaskedLM, BERT-base config, random weights in bf16, batch --batch x
    --model-len (512) tokens, lengths drawn as above, a training step (forward, cross-entropy, backward, fused AdamW)
    compiled with backend="fuse_plugin" (dynamic=False), skip on vs off: each variant its own model and
    compile (under its setting), then --rounds rounds in which the two take turns running --steps timed
    steps; tokens/s (padding included) is the median of the rounds. --model-family: the attention family
    both variants are held to ("general", the default, where the skip lives; "auto": the registry's
    choice, which may take another family for some calls). Then, under torch.profiler (5 steps, skip off),
    the share of the step's GPU kernel time spent in attention kernels (names holding "attention",
    "fmha" or "flash"), and the ceiling of the step's speed-up, 1 / (1 - share x live-saved), with
    live-saved = 1 - live (the attention time the skip could remove at best).
Prints the table last. First run on an H100 in stop 32 (RESULTS.md); its model rows were void then (the two
variants shared one Dynamo graph, mended by fuse_plugin/dynamo_cache.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.nn.functional as F
from common import emit, graph_ms, sdpa_autograd_ms, timed_run

import fuse_plugin  # noqa: F401  (registers the backend and torch.ops.fuse_plugin)
from fuse_plugin import settings
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.attention import attention_backward, attention_forward

HEADS, HEAD_DIM = 12, 64
ATTENTION_NAMES = ("attention", "fmha", "flash")


@contextlib.contextmanager
def skip(on: bool):
    """The switch for the calls (and compiles) inside."""
    old = os.environ.get(settings.KEY_PADDING_SKIP)
    os.environ[settings.KEY_PADDING_SKIP] = "on" if on else "off"
    try:
        yield
    finally:
        if old is None:
            del os.environ[settings.KEY_PADDING_SKIP]
        else:
            os.environ[settings.KEY_PADDING_SKIP] = old


def lengths(B: int, L: int, pad: float, seed: int = 0) -> torch.Tensor:
    """(B,) kept keys per row, uniform in [(1 - 2 pad) L, L] (mean (1 - pad) L)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(max(1, round((1 - 2 * pad) * L)), L + 1, (B,), device="cuda", generator=g)


def padding_mask(lens: torch.Tensor, L: int, form: str) -> torch.Tensor:
    """(B, 1, 1, L): bool keep, or bf16 0 / finfo.min (HF's additive mask)."""
    keep = (torch.arange(L, device="cuda")[None] < lens[:, None])[:, None, None]
    if form == "bool":
        return keep
    return torch.zeros(keep.shape, device="cuda", dtype=torch.bfloat16).masked_fill(
        ~keep, torch.finfo(torch.bfloat16).min)


def live_share(lens: torch.Tensor, L: int, block: int = 128) -> float:
    """The share of (row, key block) pairs a row's live keys [0, n) overlap (block 128: the forward's
    usual key tile)."""
    blocks = -(-L // block)
    return ((-(-lens // block)).sum() / (blocks * lens.numel())).item()


def timed_ours(q, k, v, mask, on: bool) -> dict:
    B, H, L, _ = q.shape
    bias = mask.expand(B, H, L, L)
    kw = dict(is_causal=False, scale=q.shape[-1] ** -0.5)
    with registry.forced("general"), skip(on):
        out, lse = attention_forward(q, k, v, bias, **kw)
        dout = torch.randn_like(out)
        return {"fwd": graph_ms(lambda: attention_forward(q, k, v, bias, **kw)),
                "bwd": graph_ms(lambda: attention_backward(dout, q, k, v, bias, out, lse, need_dbias=False, **kw))}


def check(lens, L, form) -> dict:
    """Skip on vs off, and both against float64, at the first row of the table (max abs error over the
    reference's max |x|)."""
    torch.manual_seed(0)
    B = lens.numel()
    q, k, v = (torch.randn(B, 2, L, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = padding_mask(lens, L, form)
    bias = mask.expand(B, 2, L, L)
    kw = dict(is_causal=False, scale=HEAD_DIM ** -0.5)
    got = {}
    with registry.forced("general"):
        for on in (True, False):
            with skip(on):
                out, lse = attention_forward(q, k, v, bias, **kw)
                dout = torch.ones_like(out)
                got[on] = (out,) + attention_backward(dout, q, k, v, bias, out, lse, need_dbias=False, **kw)[:3]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * kw["scale"]
    s = s.masked_fill(~mask, float("-inf")) if form == "bool" else s + mask.double()
    out64 = torch.softmax(s, -1) @ v64
    want = (out64,) + torch.autograd.grad(out64, (q64, k64, v64), torch.ones_like(out64))
    errs = {}
    for n, a, b, w in zip(("out", "dq", "dk", "dv"), got[True], got[False], want):
        errs[f"{n} skip"] = ((a.double() - w).abs().max() / w.abs().max()).item()
        errs[f"{n} on-off"] = ((a.double() - b.double()).abs().max() / w.abs().max()).item()
    return errs


# ------------------------------------------------------------------------------------------ model


def bert_step(lens, on: bool, family, seq_len: int):
    """(step, model): a compiled BertForMaskedLM training step, compiled under the switch ``on``
    (its own Dynamo graph: the cache is keyed on the switch, fuse_plugin/dynamo_cache.py)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(max_position_embeddings=max(512, seq_len))
    model = BertForMaskedLM._from_config(config, attn_implementation="eager")
    model = model.to(device="cuda", dtype=torch.bfloat16).train()
    fn = torch.compile(model, backend="fuse_plugin", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    B = lens.numel()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 30522, (B, seq_len), device="cuda", generator=g)
    mask = (torch.arange(seq_len, device="cuda")[None] < lens[:, None]).long()

    def step():
        logits = fn(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.flatten(0, -2).float(), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with _held(family), skip(on):
        for _ in range(3):  # compile, warm up
            step()
    torch.cuda.synchronize()
    return step, model


def _held(family):
    return registry.forced(family) if family != "auto" else contextlib.nullcontext()


def attention_share(step, n: int = 5) -> tuple[float, float, float]:
    """(attention GPU us per step, all kernels' GPU us per step, share) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / n
    attn = sum(e.device_time for e in kernels if any(a in e.name.lower() for a in ATTENTION_NAMES)) / n
    return attn, total, attn / max(total, 1e-9)


def model_rows(args, lens) -> list[str]:
    family, seq_len = args.model_family, args.model_len
    steps = {on: bert_step(lens, on, family, seq_len) for on in (False, True)}
    times = {on: [] for on in steps}
    for _ in range(args.rounds):
        for on, (step, _) in steps.items():
            with _held(family), skip(on):
                times[on].append(timed_run(step, args.steps))
    tokens = lens.numel() * seq_len * args.steps
    tps = {on: tokens / sorted(ts)[len(ts) // 2] for on, ts in times.items()}
    share = {}
    for on, (step, _) in steps.items():
        with _held(family), skip(on):
            share[on] = attention_share(step)
    live = live_share(lens, seq_len)
    ceiling = 1 / (1 - share[False][2] * (1 - live))
    return [f"BERT-base MLM training step, bf16, batch {lens.numel()} x {seq_len}, "
            f"{1 - lens.float().mean().item() / seq_len:.0%} padding, family {family}, "
            f"median of {args.rounds} interleaved rounds of {args.steps} steps", "",
            "| variant | tokens/s | attention GPU us/step | all kernels us/step | attention share |",
            "|---|---|---|---|---|"] + [
        f"| {'skip' if on else 'dense'} | {tps[on]:.0f} | {share[on][0]:.0f} | {share[on][1]:.0f} | "
        f"{share[on][2]:.1%} |" for on in (False, True)] + [
        "", f"step speed-up skip / dense {tps[True] / tps[False]:.3f}; attention time saved "
        f"{1 - share[True][0] / max(share[False][0], 1e-9):.1%} (ideal 1 - live = {1 - live:.1%}); ceiling "
        f"1 / (1 - share x (1 - live)) = {ceiling:.3f}"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,1024,2048", help="kernel rows' L, comma-separated")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pad", type=float, default=0.4, help="mean share of padding keys (at most 0.5)")
    p.add_argument("--mask", choices=("float", "bool"), default="float")
    p.add_argument("--model-family", default="general", help="'general' (default) or 'auto'")
    p.add_argument("--no-model", action="store_true", help="kernels only")
    p.add_argument("--model-len", type=int, default=512, help="the BERT rows' tokens per sequence")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 0 < args.pad <= 0.5:
        p.error("--pad must be in (0, 0.5]")
    Ls = [int(x) for x in args.lengths.split(",")]

    errs = check(lengths(4, Ls[0], args.pad), Ls[0], args.mask)
    ok = all(e <= 2e-2 for e in errs.values())
    print("check (bf16, skip on and off vs float64, max err / max |ref|):",
          ", ".join(f"{n} {e:.1e}" for n, e in errs.items()), "PASS" if ok else "FAIL", flush=True)

    lines = [f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, B {args.batch}, H {HEADS}, "
             f"D {HEAD_DIM}, right padding ({args.mask} mask, ~{args.pad:.0%} of keys) | device ms (ours: CUDA "
             "graphs, median, best of 2; sdpa: do_bench)", "",
             "| L | padding | live | dense fwd / bwd | skip fwd / bwd | sdpa fwd / bwd | skip / dense (fwd+bwd) "
             "| skip vs sdpa |", "|---|---|---|---|---|---|---|---|"]
    for L in Ls:
        lens = lengths(args.batch, L, args.pad)
        q, k, v = (torch.randn(args.batch, HEADS, L, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        mask = padding_mask(lens, L, args.mask)
        dense, on, sdpa = timed_ours(q, k, v, mask, False), timed_ours(q, k, v, mask, True), sdpa_autograd_ms(q, k, v, mask)
        tot = {n: t["fwd"] + t["bwd"] for n, t in (("dense", dense), ("skip", on), ("sdpa", sdpa))}
        lines.append(f"| {L} | {1 - lens.float().mean().item() / L:.0%} | {live_share(lens, L):.2f} | "
                     f"{dense['fwd']:.3f} / {dense['bwd']:.3f} | {on['fwd']:.3f} / {on['bwd']:.3f} | "
                     f"{sdpa['fwd']:.3f} / {sdpa['bwd']:.3f} | {tot['skip'] / tot['dense']:.3f} | "
                     f"{tot['sdpa'] / tot['skip']:.2f}x |")
        print(lines[-1], flush=True)
    if not args.no_model:
        lines += [""] + model_rows(args, lengths(args.batch, args.model_len, args.pad, seed=1))
    emit(lines, args.out)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
