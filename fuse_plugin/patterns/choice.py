"""Which implementation takes a matched attention site: our op, an SDPA call, or the site as it is.

The matcher (attention.py) finds a site; before anything is replaced, `decide` says which way it
goes. The decision is made once per site, while the graph compiles, from measurements: the
shipped choice table (kernels/choice_table.py, `python -m fuse_plugin.tune --choices`) holds, per
problem class (dtype, head dims, lengths, bias form, causal, dropout), the time of each of our
kernel families, of Inductor's decomposition and of SDPA, forward alone (inference) and forward +
backward (training). The fastest takes the site:

* our op (attention.replace);
* the site left as the user wrote it, for Inductor to fuse as stock compile does (its bmm + fused
  softmax + bmm);
* an SDPA call in its place (attention.replace(..., as_sdpa=True)), where the site can be one (no
  softcap or finite fill, attention.why_not_sdpa) -- e.g. timm's windows, whose fused path is
  SDPA, or dropout, which cuDNN runs faster than our kernels.

In a training step replayed as a CUDA graph, a site the table gives cuDNN's backward below that
family's own length rule becomes an SDPA call (``_replayed_step_rule``: measured in a model, CaiT's
class attention).

Where the class was not measured: a measured rule (``_rule``: Swin-T's windows, which our general
kernels ran at 0.46x stock compile, are left to Inductor) or else our op, as every family's own
rules were measured faster than the decomposition where they apply (RESULTS.md).

Off CUDA (``off_cuda``), every site is left as written: our ops run their plain-torch reference
there, opaque to Inductor, measured slower than stock compile (`FUSE_PLUGIN_CPU_SITES=ours`
rewrites them as on CUDA: the CPU test suite, the demo).

An SDPA call site (patterns/sdpa.py) is weighed against SDPA itself (`decide_sdpa`): it becomes our
op only where that was measured faster for its class, and stays SDPA where nothing was measured.
Where the call passes a dense mask that the rewrite reads as structure alone (HF's sdpa path under
torch.compile materialises its causal mask), the table's SDPA time (``is_causal``, SDPA's flash /
cuDNN kernels) is a lower bound for the call as written, which those kernels do not run (flash takes
no mask): our op wins ties up to ``MASKED_SDPA_TIE`` (H200: HF Llama 1x8192 with such a call, our
op trains 1.72x faster, the table's times being 1250 vs 1253 us).

Under PyTorch's `context_parallel(...)` (ops/context_parallel.py): a hand-written site is our op,
which the ring then runs over the whole sequence (as written, or as an SDPA call, it would see one
rank's shard), and an SDPA call site stays SDPA, which PyTorch's ring runs (measured faster than
ours, issue 32).

`FUSE_PLUGIN_SITE_CHOICE` (settings.site_choice): "ours" takes every site (CI's CPU tests),
"inductor" none, "sdpa" makes every hand-written site that can be one an SDPA call (the fuzzer's
check of that rewrite).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import settings
from ..kernels import choice_table
from .attention_bias import BiasTerm, MaskFill
from .canon import call_of, example_value, shape


@dataclass
class Decision:
    ours: bool  # the site is rewritten (else it is left as it is: to Inductor, or as SDPA)
    reason: str  # for explain / TORCH_LOGS; "" where there is nothing to say
    as_sdpa: bool = False  # rewritten into an SDPA call (measured faster than our op and Inductor)
    repeat_kv: bool = False  # that call with k/v repeated to the query heads, not enable_gqa (GQA)
    as_stock: bool = False  # left as stock compile has it: Inductor's own attention patterns may take
    # it too (inductor_attention.mark_as_stock; else they stay off in our compiles)


def _hint(n) -> int:
    if isinstance(n, torch.SymInt):
        return int(n.node.hint) if n.node.has_hint() else 0
    return int(n)


def _bias_form(site) -> str:
    """The class's bias name (choice_table.bias_form) for the site's mask parts."""
    parts = site.bias_parts
    if not parts:
        return "none"
    if site.period is not None:
        return "periodic"
    if all(isinstance(p, MaskFill) and p.value == float("-inf") for p in parts):
        return "bool"
    if all(_over_keys(p) for p in parts):
        return "keys"
    return "float"


def _over_keys(part) -> bool:
    """A part constant over the queries and heads (a padding mask): shape (B | 1, 1, 1, Lk)."""
    node = part.node if isinstance(part, BiasTerm) else part.mask
    s = shape(node)
    return s is not None and len(s) >= 2 and all(_hint(d) == 1 for d in s[-2:-1]) and \
        (len(s) < 3 or _hint(s[-3]) == 1)


def needs_grad(site) -> bool:
    """Does anything the op would read need a gradient, where autograd records the site (its
    output needs one: not under no_grad)? Training; else the op's forward may skip its
    logsumexp (attention._op_call)."""
    out = example_value(site.output)
    if isinstance(out, torch.Tensor) and not out.requires_grad:
        return False
    nodes = [site.q.node, site.k.node, site.v.node] + [
        p.node for p in site.bias_parts if isinstance(p, BiasTerm)]
    for n in nodes:
        v = example_value(n)
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    return False


def class_of(site) -> tuple[Optional[str], str, torch.device]:
    """(the site's class key, "fwd" or "train", its device)."""
    qv, kv, vv = site.q.value(), site.k.value(), site.v.value()
    while qv.dim() < 4:
        qv, kv, vv = qv.unsqueeze(0), kv.unsqueeze(0), vv.unsqueeze(0)
    key = choice_table.class_key(site.dtype, _hint(qv.shape[-1]), _hint(vv.shape[-1]), _hint(qv.shape[-2]),
                                 _hint(kv.shape[-2]), _bias_form(site), site.is_causal, bool(site.dropout_p))
    return key, "train" if needs_grad(site) else "fwd", qv.device


def ours_time(times: dict, mode: str, band=False) -> Optional[tuple[float, str]]:
    """(microseconds, families) of our op for a class: the forward's fastest family (inference:
    without the lse where measured faster, choice_table.infer_times), and in training plus the
    backward's fastest (the launchers choose each direction on its own).
    ``band``: the site has a sliding window, chunks or documents, which only some families run:
    True (those with registry's ``takes_window``) or {direction: the families that take this
    band, registry.band_runners}; the class is the causal one, and those families' causal time
    is an upper bound of the band's (its key blocks are a subset)."""
    fwd, bwd = times.get("fwd", {}), times.get("bwd", {})
    if mode == "fwd":  # an inference site's op skips the lse where that was measured faster
        fwd = choice_table.infer_times(times)
    if band:
        fwd, bwd = _band_families(fwd, "fwd", band), _band_families(bwd, "bwd", band)
    if not fwd or (mode == "train" and not bwd):
        return None
    f_name = min(fwd, key=fwd.get)
    if mode == "fwd":
        return fwd[f_name], f_name
    b_name = min(bwd, key=bwd.get)
    return fwd[f_name] + bwd[b_name], f"{f_name} + {b_name}"


def _band_families(times: dict, direction: str, band) -> dict:
    from ..kernels import registry

    if isinstance(band, dict):
        return {name: us for name, us in times.items() if name in band[direction]}
    return {name: us for name, us in times.items()
            if getattr(registry.FAMILIES[direction].get(name), "takes_window", False)}


def _band(site):
    """False without a band; else {direction: the families that take the site's band}."""
    from ..kernels import registry

    window, chunk = getattr(site, "window", 0), getattr(site, "chunk", 0)
    documents = getattr(site, "documents", None) is not None
    if not (window or chunk or documents):
        return False
    d = _hint(site.q.value().shape[-1])
    return {direction: registry.band_runners(direction, window, chunk, documents, d) for direction in ("fwd", "bwd")}


def decide(site) -> Decision:
    """Our op, an SDPA call or Inductor for a matched hand-written site (module doc)."""
    how = settings.site_choice()
    if how == "ours":
        return Decision(True, "")
    if how == "inductor":
        return Decision(False, f"left to Inductor ({settings.SITE_CHOICE}=inductor)")
    from .attention import why_not_sdpa  # (attention.py imports this module)

    if _context_parallel_on():
        return Decision(True, _OURS_UNDER_CP)
    no_sdpa = why_not_sdpa(site)
    if how in ("sdpa", "sdpa_repeat"):
        return Decision(True, f"as SDPA ({settings.SITE_CHOICE}={how})", as_sdpa=True,
                        repeat_kv=how == "sdpa_repeat" and site.kv_groups > 1) if no_sdpa is None \
            else Decision(True, f"our op: no SDPA call computes {no_sdpa}")
    off = off_cuda(site.q.value(), "to Inductor")
    if off is not None:
        return off
    windowed = _window_rule(site)
    if windowed is not None:
        return windowed
    key, mode, device = class_of(site)
    times = choice_table.lookup(device, key)
    if times is None and device.type == "cuda":
        rule = _rule(site)
        if rule is not None:
            return Decision(False, rule)
    band = _band(site)
    replayed = _replayed_step_rule(site, times, mode, key, sdpa_ok=no_sdpa is None and not band)
    if replayed is not None:
        return replayed
    return decide_from(times, mode, key, sdpa_ok=no_sdpa is None, band=band, gqa=site.kv_groups > 1)


# Off CUDA (issue 28, stop 57; benchmarks/cpu_sites.py on a 2-core CPU, torch 2.13.0, float32, every
# variant in one process, 12 interleaved rounds; RESULTS.md "Stop 57"): our ops run their plain-torch
# reference there, an opaque call that materialises the scores, where stock compile's Inductor
# fuses the site (or its attention patterns swap in SDPA's CPU flash kernel). Our ops against stock
# compile: the demo's Llama-style model (hidden 512, 2 layers) 0.78x / 0.79x at 1x512 (inference /
# training), 0.90x at 4x128; a ViT-S-style block pair at 4x197 0.92x / 0.90x; a causal block pair at
# 1x1024 0.62x / 0.53x; nn.MultiheadAttention at 8x197 0.95x / 0.84x. Every site left, with
# Inductor's patterns free to take it (inductor_attention.mark_as_stock): 0.99-1.04x.
_OFF_CUDA_RULE = ("left {how} by rule: on {device} our op runs its plain-torch reference, measured slower "
                  "than stock compile (a Llama-style model 0.78-0.90x, a causal block at 1k tokens 0.53-0.62x; "
                  "CPU, issue 28, stop 57; {switch}=ours rewrites it)")


def off_cuda(value, how: str = "as written") -> Optional[Decision]:
    """The decision for a site whose tensor ``value`` (an example value) is not on CUDA: left as
    it is (module doc; ``how`` says so in the reason: "to Inductor", "as SDPA", "as written"), as
    stock compile has it (``as_stock``: Inductor's own attention patterns may turn it into SDPA,
    as they do there), unless FUSE_PLUGIN_CPU_SITES=ours; None on CUDA or where the value is
    unknown."""
    if not isinstance(value, torch.Tensor) or value.device.type == "cuda" or settings.cpu_sites() == "ours":
        return None
    return Decision(False, _OFF_CUDA_RULE.format(how=how, device=value.device.type, switch=settings.CPU_SITES),
                    as_stock=True)


# Measured rules, for classes the choice table does not hold (on the GPU). Each says where it
# was measured. Swin-T's windows (issue 28, H100, torch 2.11, bf16, 2026-11-25): 49 tokens, head
# dim 32, a learned relative-position bias and the shift mask; the general kernels took 9.35 ms of
# a step whose whole stock-compiled GPU time was 5.59 ms: the model ran at 0.46x stock compile.
_WINDOW_RULE = ("left to Inductor by rule: windows of <= 64 tokens, head dim <= 32, with a float bias "
                "(Swin-T at 0.46x stock compile with our general kernels; issue 28, H100, 2026-11-25); "
                "the choice table decides once it measures this class")


# Sliding windows (issue 31, H200, torch 2.11, bf16, 2026-11-26, benchmarks/window.py): causal D 128,
# window 4096 at 16k / 32k tokens, forward + backward: our window kernels 5.9 / 11.4 ms (16 heads),
# SDPA with the band as a dense mask (cuDNN) 25.6 / 102.3 ms, SDPA is_causal (which computes
# another problem, the whole triangle) 7.0 / 27.4 ms; our causal kernels 10.4 / 40.8 ms, an upper
# bound of the window's for any window (its blocks are a subset), still below SDPA's band mask,
# whose cost does not depend on the window. Since stop 35 the Gluon kernels run the window (H100,
# 2026-11-27): 3.7 / 7.9 ms against SDPA's band 25.5 / 105.6. The rule holds only there: 16-bit,
# no dropout, from WINDOW_RULE_MIN_KEYS keys on; below, the usual choice (the causal class's
# measurements; for an SDPA call site, SDPA stays unless our op was measured faster).
WINDOW_RULE_MIN_KEYS = 16384
_WINDOW_MEASURED = ("a sliding window of {w} over {l} keys: the kernels skip the blocks it hides (measured "
                    "4.3-13x faster than SDPA with the band as a mask at 16k-32k tokens, bf16, H200 and H100)")


# A training step replayed as a CUDA graph (issue 28, H100, torch 2.11, bf16, stop 55; zoo.py
# cait_xxs24 training under reduce-overhead, 24 interleaved rounds of 5 steps after 3 untimed, all
# variants in one process). CaiT's class attention (1 query, 197 keys, head dim 48) measured alone,
# the table puts our op on cuDNN both ways (27.6 us a site, SDPA 28.4, our general kernels 29.6);
# in the model that choice ran at 0.9969 of fused+compile paired (faster in 1 round of 24), the sites
# as SDPA calls at 0.9990, our general kernels at 0.9997, fused+compile compiled twice at 1.0011.
# The 0.1 ms a step it lost is more than the 2 sites' whole time alone: below cuDNN's own backward
# rule (attention_cudnn.BWD_MIN_LEN queries), where only the table's isolated times put it, cuDNN's
# backward does not keep its lead inside a replayed training step. There the site becomes an SDPA
# call (the fastest alone but for cuDNN through our op, which it trails by 3%). Default mode has its
# own measured choice (the host's time a call, choice_table.host_bound_costs: our general kernels).
_REPLAYED_RULE = ("as SDPA by rule: training under CUDA graphs, {lq} queries (cuDNN's backward, which the table "
                  "measured fastest alone, {ours:.1f} vs SDPA {sdpa:.1f} us, trailed SDPA in the model below "
                  "{least} queries: CaiT-XXS24 0.9969 vs 0.9990 of fused+compile; issue 28, H100, stop 55; {key})")

# How far behind our op alone SDPA may be for the rule to take it: measured at 1.027 (CaiT's class
# attention); a class where SDPA alone trails further was not measured in a model.
REPLAYED_SDPA_WITHIN = 1.05


def _graph_replayed() -> bool:
    """Is the graph compiled for CUDA-graph replay (mode="reduce-overhead" or the option)? Both
    entry points rewrite under the compile's Inductor options (backend.py, autopatch.py)."""
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


def _replayed_step_rule(site, times: Optional[dict], mode: str, key: Optional[str],
                        sdpa_ok: bool) -> Optional[Decision]:
    """An SDPA call for a training site that the table gives cuDNN's backward below its own rule's
    length, in a graph replayed as a CUDA graph (see above); None where the rule does not apply."""
    from ..kernels import attention_cudnn

    if mode != "train" or not sdpa_ok or not times or site.kv_groups > 1 or not _graph_replayed():
        return None
    lq = _hint(site.q.value().shape[-2])
    bwd, sdpa = times.get("bwd", {}), times.get(choice_table.SDPA, {}).get("train")
    if lq >= attention_cudnn.BWD_MIN_LEN or not bwd or sdpa is None or min(bwd, key=bwd.get) != "cudnn":
        return None
    ours = ours_time(times, mode)
    if ours is None or sdpa > ours[0] * REPLAYED_SDPA_WITHIN:
        return None
    return Decision(True, _REPLAYED_RULE.format(lq=lq, ours=ours[0], sdpa=sdpa,
                                                least=attention_cudnn.BWD_MIN_LEN, key=key), as_sdpa=True)


def site_device(site) -> torch.device:
    return site.q.value().device


def _window_rule(site) -> Optional[Decision]:
    """Our op for a windowed site in the measured range (see above): on the GPU, 16-bit, no
    dropout, from WINDOW_RULE_MIN_KEYS keys on, the window shorter than the keys."""
    w = getattr(site, "window", 0)
    if not w or site_device(site).type != "cuda" or site.dtype not in (torch.float16, torch.bfloat16) \
            or site.dropout_p:
        return None
    lk = _hint(site.k.value().shape[-2])
    if w >= lk or lk < WINDOW_RULE_MIN_KEYS:
        return None
    return Decision(True, _WINDOW_MEASURED.format(w=w, l=lk))


# XCiT's cross-covariance attention (issue 28, H100, torch 2.11, bf16, 2026-11-27, class xcit-xca):
# 32 tokens (channels), head dim 196 (patches): only our general kernels run that head dim, at
# 0.34x / 0.29x Inductor's speed (fwd / train). Its other sizes (xcit_tiny/small/medium: 48-64
# channels a head; fp32) are not measured: left to Inductor, as they were before the rewrite matched
# them (stop 34).
_WIDE_HEAD_RULE = ("left to Inductor by rule: <= 64 tokens with a head dim above 128 (XCiT's attention over "
                   "channels: our kernels 0.29-0.34x Inductor at 32 tokens, head dim 196; issue 28, H100, "
                   "2026-11-27); the choice table decides once it measures this class")


def _rule(site) -> Optional[str]:
    """The measured rule that leaves an unmeasured site to Inductor, if one applies."""
    qv, kv = site.q.value(), site.k.value()
    short = _hint(qv.shape[-2]) <= 64 and _hint(kv.shape[-2]) <= 64
    if short and _hint(qv.shape[-1]) <= 32 and _bias_form(site) in ("float", "periodic"):
        return _WINDOW_RULE
    if short and _hint(qv.shape[-1]) > 128:
        return _WIDE_HEAD_RULE
    return None


def window_beside_padding(q_value, lk) -> bool:
    """May a window beside HF's eager padding (attention_bias.window_beside_one_fill) become the
    op's window, its rows masked everywhere averaged after the op? On the GPU only in the window
    rule's measured range (16-bit, from WINDOW_RULE_MIN_KEYS keys on): shorter, the average's cost
    next to the skipped blocks is not measured, and the band stays the dense bias it was before
    (stop 34). On the CPU (the op's reference) always."""
    if not isinstance(q_value, torch.Tensor) or q_value.device.type != "cuda":
        return True
    return q_value.dtype in (torch.float16, torch.bfloat16) and _hint(lk) >= WINDOW_RULE_MIN_KEYS


def decide_from(times: Optional[dict], mode: str, key: Optional[str], sdpa_ok: bool = False,
                band: bool = False, gqa: bool = False) -> Decision:
    """The decision for a hand-written site of a class measured as ``times``
    (choice_table.lookup; None: not measured) in ``mode`` ("fwd": inference, "train"): the
    fastest of our op, Inductor's decomposition and (``sdpa_ok``: the site can be one,
    attention.why_not_sdpa) an SDPA call. ``band``: see ours_time. ``gqa``: the site's k/v have
    fewer heads than q; its SDPA call may pass them with ``enable_gqa`` (the class's "sdpa" time)
    or repeated to the query heads first (its "sdpa_repeat" time), whichever was measured faster:
    in float32 SDPA's efficient kernel takes only the repeated call, enable_gqa falling to the math
    path (H100 llama-512-fp32: 229.6 us forward repeated, 767.9 with enable_gqa, Inductor 391.2,
    our op 506.6)."""
    inductor = (times or {}).get(choice_table.INDUCTOR, {}).get(mode)
    sdpa = (times or {}).get(choice_table.SDPA, {}).get(mode) if sdpa_ok else None
    repeated = (times or {}).get(choice_table.SDPA_REPEAT, {}).get(mode) if sdpa_ok and gqa else None
    ours = ours_time(times, mode, band) if times else None
    if ours is None or (inductor is None and sdpa is None and repeated is None):
        return Decision(True, "")
    us, families = ours
    others = {name: t for name, t in (("Inductor", inductor), ("SDPA", sdpa), (_REPEATED, repeated))
              if t is not None}
    best = min(others, key=others.get)
    if others[best] * NOISE >= us:  # (within the noise: our op, the default of a hand-written site)
        return _versus(ours, others[best], best, mode, key)
    where = f"{mode}, {key}"
    if best != "Inductor":
        t = others[best]
        return Decision(True, f"as {best}: measured {us / t:.2f}x faster ({t:.1f} vs {us:.1f} us for "
                              f"{families}" + "".join(f", {n} {o:.1f}" for n, o in others.items() if n != best)
                              + f"; {where})", as_sdpa=True, repeat_kv=best == _REPEATED)
    return _versus(ours, inductor, "Inductor", mode, key)


_REPEATED = "SDPA with k/v repeated"


# Measured times within this ratio are a tie, and a tie keeps the site's default: our op for a
# hand-written site, SDPA for an SDPA call. The table's medians (do_bench_cudagraph) repeat to
# about 1% between runs; the H200 re-measure of stop 26 (issue 28) put SDPA 1.00x "faster" than
# our op for the llama-8k class (1267.0 vs 1267.1 us), which without a margin would have flipped
# the e2e model's 8k sites, measured whole at 1.65x / 1.70x with our op, on that noise.
NOISE = 1.02

# Our op against SDPA at ``is_causal`` for a call that passed a dense mask instead: ours is taken
# up to this ratio (the llama-8k class: 344.1 vs 342.7 us forward, 1.004).
MASKED_SDPA_TIE = 1.03


def _dense_mask_dropped(site) -> bool:
    """Did the SDPA call pass an attn_mask that the plan keeps no part of (read as causal)?"""
    c = call_of(site.output)
    return c is not None and c.name == "sdpa" and c["attn_mask"] is not None and not site.bias_parts


# Rotary embeddings (issue 28/30, H100, torch 2.11, bf16, 2026-11-27). The rotate-half spelling
# (HF Llama's), shapes.py llama-train-4x2048, 12 layers, HF's sdpa path, its attention left as SDPA:
# compiled, our rotary op decomposes into the reference math (ops/rotary.py), which Inductor fuses
# worse than HF's own spelling: the rotary kernels took 1345 us of GPU a step against stock
# compile's 1028 (673 kernels against 661), and the model ran at 0.98x stock compile. Compiled,
# the op brings no kernel of its own, so left as written the site is what stock compile runs.
# The interleaved spelling (timm EVA-02-Ti, batch 64, 257 tokens, inference under CUDA graphs, its
# attention our op): left as written, Inductor fused the rotation, the class-token cat and the
# permute into one kernel of 313 us a step against 155 us with our op, and the model ran at 0.95x
# fused+compile against 1.06x with our op (zoo.py, plugin-fused vs plugin-fused@ROTARY_SITES=ours,
# 2026-11-27): interleaved sites stay our op where nothing needs a gradient. In training the other
# way round (the same model, training under CUDA graphs, H100, 2026-11-27, zoo.py plugin vs
# plugin@ROTARY_SITES=off, 7 interleaved rounds): left as written 10339 img/s (6228 us of GPU a
# step) against 9920 (6590 us) with our op, whose backward is one more pass that Inductor cannot
# fuse into the rotation's neighbours; fused+compile 9938. So an interleaved site that needs a
# gradient is left as written too.
_ROTARY_RULE = ("left as written by rule: compiled for CUDA with static shapes, our rotary op decomposes into "
                "math that Inductor fused slower than the eager rotate-half spelling (H100 Llama 4x2048 "
                "training: 1345 vs 1028 us of rotary kernels a step; issue 30, 2026-11-27)")
_ROTARY_TRAINING_RULE = ("left as written by rule: an interleaved rotary that needs a gradient, compiled for CUDA "
                         "with static shapes, measured faster as written (H100 EVA-02-Ti training: 6228 vs 6590 us "
                         "of GPU a step with our op; 2026-11-27)")


def decide_rotary(x_value, folding: bool, interleaved: bool = False, out_value=None) -> Decision:
    """Our rotary op or the site as written, for a rotary site rotating ``x_value`` (its example
    value) into ``out_value`` (the site's output's; None: unknown); ``folding``: the rewrite folds
    rotary q+k pairs into their attention (rope_attention), which needs our op in the graph first;
    ``interleaved``: the site rotates channel pairs (2i, 2i+1), measured faster as our op where
    nothing needs a gradient (inference) and slower where something does (see above; an unknown
    output counts as training). FUSE_PLUGIN_ROTARY_SITES (settings.rotary_sites)."""
    how = settings.rotary_sites()
    if how == "ours":
        return Decision(True, "")
    if how == "off":
        return Decision(False, f"left as written ({settings.ROTARY_SITES}=off)")
    off = off_cuda(x_value)
    if off is not None:
        return off
    if folding or not isinstance(x_value, torch.Tensor) or x_value.device.type != "cuda":
        return Decision(True, "")  # measured on CUDA only; off CUDA (CPU_SITES=ours) our kernels or the reference
    if any(not isinstance(s, int) for s in x_value.shape):
        return Decision(True, "")  # symbolic sizes: the op stays an opaque call running our kernel
    if interleaved:
        training = not isinstance(out_value, torch.Tensor) or out_value.requires_grad
        return Decision(False, _ROTARY_TRAINING_RULE) if training else Decision(True, "")
    return Decision(False, _ROTARY_RULE)


def decide_mha(query_value) -> Decision:
    """Our op or the call as written for an `nn.MultiheadAttention` site (patterns/mha.py) whose
    query's example value is ``query_value``: our op (as for a hand-written site: the call
    computes its weights explicitly), except where FUSE_PLUGIN_SITE_CHOICE=inductor or off CUDA."""
    how = settings.site_choice()
    if how == "ours":
        return Decision(True, "")
    if how == "inductor":
        return Decision(False, f"left as written ({settings.SITE_CHOICE}=inductor)")
    if _context_parallel_on():
        return Decision(True, _OURS_UNDER_CP)
    return off_cuda(query_value) or Decision(True, "")


def decide_sdpa(site) -> Decision:
    """Our op or SDPA for an SDPA call site (patterns/sdpa.py): our op only where it was measured
    faster than SDPA for the site's class; else the call stays as it is."""
    how = settings.site_choice()
    if how == "ours":
        return Decision(True, "")
    if how in ("inductor", "sdpa"):
        return Decision(False, f"left as SDPA ({settings.SITE_CHOICE}={how})")
    if _context_parallel_on():
        return Decision(False, _UNDER_CP)
    off = off_cuda(site.q.value(), "as SDPA")
    if off is not None:
        return off
    windowed = _window_rule(site)
    if windowed is not None:
        return windowed
    key, mode, device = class_of(site)
    return decide_sdpa_from(choice_table.lookup(device, key), mode, key, _dense_mask_dropped(site), _band(site),
                            getattr(site, "kv_repeated", False))


# An SDPA call under PyTorch's context_parallel(...) is ringed by PyTorch (its wrapper makes q/k/v
# sequence-sharded DTensors): measured faster than our ring over our op (issue 32, 2x H100, bf16,
# 2026-11-26, e2e Llama: ours 0.93 / 0.96 / 0.98x PyTorch's at 32k / 64k / 128k; both rings run the
# same cuDNN kernels, ours pays more transfer and merge), so the call stays SDPA there.
_UNDER_CP = ("left as SDPA: PyTorch's context parallelism rings it (measured 1.02-1.08x faster than our "
             "ring, 2 H100s, issue 32)")


# A hand-written site under context_parallel(...): PyTorch's context parallelism swaps SDPA only, so
# the site as written (for Inductor) or an SDPA call made of it would attend within each rank's shard
# alone; our op, routed to the ring (ops/context_parallel.route), attends over the whole sequence.
_OURS_UNDER_CP = ("our op, for the ring: PyTorch's context parallelism is on, and left as it is (or as an SDPA "
                  "call) the site would see only this rank's shard")


def _context_parallel_on() -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from ..ops.context_parallel import torch_context_parallel

    return torch_context_parallel() is not None


def decide_sdpa_from(times: Optional[dict], mode: str, key: Optional[str],
                     mask_dropped: bool = False, band: bool = False, kv_repeated: bool = False) -> Decision:
    """The decision for an SDPA call site of a class measured as ``times`` in ``mode``;
    ``mask_dropped``: the call passed a dense mask the plan reads as causal (module docstring);
    ``band``: see ours_time; ``kv_repeated``: the call's k/v were repeated for GQA before it, and
    SDPA is timed as such a call where the class holds that time (``sdpa_repeat``: in float32,
    HF's Llama 8x512 ran the efficient kernel at 342 us a call where enable_gqa's math path took
    683 and our op 524; H100, issue 30). A float32 class without that time leaves such a call as it
    is: its enable_gqa time is the math path's, slower than the call, so weighing our op against it
    would favour us wrongly. In bf16 / fp16 the flash and cuDNN kernels take enable_gqa and the
    repeat only adds copies (H100 llama-512: 22.5 vs 51.6 us), so the class's SDPA time is a lower
    bound of the call's and weighing against it can only keep SDPA too often."""
    sdpa = (times or {}).get(choice_table.SDPA, {}).get(mode)
    repeated = (times or {}).get(choice_table.SDPA_REPEAT, {}).get(mode) if kv_repeated else None
    if repeated is not None:
        sdpa = repeated
        key = f"{key}, SDPA timed with k/v repeated as the call passes them"
    elif kv_repeated and sdpa is not None and (key or "").startswith("fp32|"):
        return Decision(False, f"left as SDPA: the call repeats k/v and this class has no time for such a call; "
                               f"in float32 its enable_gqa time (the math path) is not what the call runs ({mode}, "
                               f"{key})")
    ours = ours_time(times, mode, band) if times else None
    if sdpa is None or ours is None:
        return Decision(False, f"left as SDPA: our op is not measured against it for this class ({mode}, {key})")
    if mask_dropped and sdpa < ours[0] <= sdpa * MASKED_SDPA_TIE:
        return Decision(True, f"{ours[0] / sdpa:.3f}x SDPA's is_causal time ({ours[1]} {ours[0]:.1f} vs "
                              f"{sdpa:.1f} us; {mode}, {key}), and the call passes a dense mask, which "
                              f"SDPA's flash kernels do not take")
    return _versus(ours, sdpa, "SDPA", mode, key, default_ours=False)


def _versus(ours: tuple, other: float, name: str, mode: str, key: Optional[str],
            default_ours: bool = True) -> Decision:
    """Our op against the measured alternative ``name`` (Inductor, SDPA): the faster one, the
    site's default (``default_ours``: our op; else the alternative) where they are within NOISE."""
    us, families = ours
    where = f"{mode}, {key}"
    if abs(us - other) <= (NOISE - 1) * min(us, other):
        if default_ours:
            return Decision(True, f"measured a tie with {name} within {NOISE - 1:.0%}, our op kept ({families} "
                                  f"{us:.1f} vs {other:.1f} us; {where})")
        return Decision(False, f"left as {name}: measured a tie within {NOISE - 1:.0%} ({other:.1f} vs {us:.1f} us "
                               f"for {families}; {where})")
    if other < us:
        left = "left to Inductor" if name == "Inductor" else "left as SDPA"
        return Decision(False, f"{left}: measured {us / other:.2f}x faster ({other:.1f} vs {us:.1f} us "
                               f"for {families}; {where})")
    return Decision(True, f"measured {other / us:.2f}x faster than {name} ({families} {us:.1f} vs "
                          f"{other:.1f} us; {where})")
