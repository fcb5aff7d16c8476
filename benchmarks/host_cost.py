"""The host's time for one attention call in a compiled graph, per implementation (issue 28).

    python benchmarks/host_cost.py [--shapes deit3,cait,vit_b] [--sites 8] [--calls 10] [--rounds 15]
                                   [--out FILE.md]

Why: the choice table holds device times (CUDA graphs), but a compiled graph in default mode
also spends the host's time issuing each call, and in a host-bound step (timm's small models in
training: deit3_s 22 ms of host against 9 ms of GPU a step, stop 49) that is what the step
costs. cuDNN and PyTorch's efficient / flash kernels run as ATen extern calls from Inductor's
generated code; our Triton families as Inductor launches (kernels/launch.py).

For each shape and task (inference: the forward; training: forward and backward), every
variant compiles a graph of ``--sites`` independent attention sites (hand-written, one q/k/v
each) once: ``inductor`` (the site left to Inductor, as stock compile fuses it), ``sdpa`` (an
`F.scaled_dot_product_attention` call in each site, stock compile: what timm's fused path runs),
and our op with each family forced (``FUSE_PLUGIN_ATTENTION_FAMILY``; flash is forward-only, so
its training backward is the normal choice). Each measurement keeps the GPU busy
(``torch.cuda._sleep``) while the host issues ``--calls`` calls of the graph, so the clock reads
the host alone; rounds interleave the variants; median of ``--rounds``. Reported: the host's us
per site per call (the graph's time over ``--sites``; the graph's own glue, equal in every variant
of a row, is included), and each family's difference to the ``general`` family, per site.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import common  # noqa: F401  (puts this tree's fuse_plugin on sys.path)
import torch
import torch.nn.functional as F
from common import switch_of

SHAPES = {  # name: (B, H, Lq, Lk, D), the sites of timm models at batch 64
    "deit3": (64, 6, 197, 197, 64),  # ViT-S/16, DeiT-III-S
    "cait": (64, 4, 1, 197, 48),  # CaiT-XXS24's class attention
    "vit_b": (64, 12, 197, 197, 64),  # BEiT-B / ViT-B
}
FAMILIES = ("general", "cudnn", "efficient", "flash")
DEVICE = "cuda"  # "cpu": a dry run of the builds (no timing)


def make_fn(tag: str, sdpa: bool):
    """A fresh code object per variant (Dynamo caches compiled code per code object)."""
    body = ("        o = F.scaled_dot_product_attention(q, k, v, scale=scale)\n" if sdpa else
            "        o = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v\n")
    src = (f"def sites_{tag}(qs, ks, vs, scale):\n    outs = []\n"
           f"    for q, k, v in zip(qs, ks, vs):\n{body}        outs.append(o)\n    return outs\n")
    scope = {"torch": torch, "F": F}
    exec(compile(src, f"<host_cost {tag}>", "exec"), scope)
    return scope[f"sites_{tag}"]


def build(variant: str, shape, task: str, sites: int):
    import fuse_plugin

    B, H, Lq, Lk, D = shape
    train = task == "train"
    mk = lambda L: [torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=train)  # noqa: E731
                    for _ in range(sites)]
    qs, ks, vs = mk(Lq), mk(Lk), mk(Lk)
    tag = f"{variant}_{task}_{'x'.join(map(str, shape))}".replace("-", "_")
    fn = make_fn(tag, variant == "sdpa")
    ours = variant not in ("inductor", "sdpa")
    compiled = torch.compile(fn, backend="fuse_plugin" if ours else "inductor", dynamic=False)
    grads = [torch.randn(B, H, Lq, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(sites)]

    def call():
        outs = compiled(qs, ks, vs, D ** -0.5)
        if train:
            torch.autograd.backward(outs, grads)

    # the switches as environment variables (common.switch_of): a backward compiled on autograd's
    # thread reads them too
    if ours:
        compiling = contextlib.ExitStack()
        compiling.enter_context(switch_of("plugin@SITE_CHOICE=ours"))
        compiling.enter_context(switch_of(f"plugin@ATTENTION_FAMILY={variant}"))
    else:
        compiling = fuse_plugin.disabled()
    with compiling:
        call()  # compiles
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return call


def host_us(call, calls: int) -> float:
    """The host's us for ``calls`` calls while the GPU sleeps (no launch waits for the GPU)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles: longer than the calls take to issue
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="deit3,cait")
    p.add_argument("--tasks", default="infer,train")
    p.add_argument("--sites", type=int, default=8)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    lines = [f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 | {args.sites} sites a graph, "
             f"{args.calls} calls a round, median of {args.rounds} rounds | host us per site per call",
             "", "| shape (B, H, Lq, Lk, D) | task | " + " | ".join(("inductor", "sdpa") + FAMILIES) +
             " | vs general, per site |", "|---" * (len(FAMILIES) + 5) + "|"]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for task in args.tasks.split(","):
            built = {}
            for variant in ("inductor", "sdpa") + FAMILIES:
                try:
                    built[variant] = build(variant, shape, task, args.sites)
                except Exception as e:  # a family that cannot run the shape: its reason, no row
                    print(f"{name} {task} {variant}: not built: {type(e).__name__}: {str(e)[:200]}", flush=True)
            times = {v: [] for v in built}
            for r in range(args.rounds):
                order = list(built) if r % 2 == 0 else list(built)[::-1]
                for v in order:
                    times[v].append(host_us(built[v], args.calls) / args.calls / args.sites)
            med = {v: statistics.median(t) for v, t in times.items()}
            base = med.get("general")
            cells = [f"{med[v]:.1f}" if v in med else "-" for v in ("inductor", "sdpa") + FAMILIES]
            diff = ", ".join(f"{v} {med[v] - base:+.1f}" for v in FAMILIES[1:] if v in med and base is not None)
            lines.append(f"| {name} {shape} | {task} | " + " | ".join(cells) + f" | {diff} |")
            print(lines[-1], flush=True)
            del built
            torch._dynamo.reset()
    text = "\n".join(lines)
    if args.out:
        open(args.out, "w").write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
