"""The gradient of a trained bias table's gather: stock compile against fuse_plugin.table_gather (GPU).

    python benchmarks/table_gather.py

LeViT's `table[:, idx]` (tables of its three stages: 14x14, 7x7, 4x4 positions), the same at 12
heads, Swin-T's 7x7 window index; each also read in Swin's / BEiT's dim-0 form `table[idx.view(-1)]`.
Prints GPU us per forward + backward (the profiler's kernel times, so host time is left out) and the
gradient's max error against float64 (relative to its largest entry), for: stock compile
(`inductor`), a padded gather (each entry's reads listed, no atomics; needs the index's values),
the op decomposed by Inductor and opaque (FUSE_PLUGIN_INDUCTOR_LAUNCH=0), the dim-0 form stock and
with the op, a one-hot matmul, and aten's float32 index_add_. RESULTS.md, stop 29.
"""
import torch, torch.nn.functional as F
from triton.testing import do_bench

dev = "cuda"


def levit_idx(R):
    pos = torch.stack(torch.meshgrid(torch.arange(R), torch.arange(R), indexing="ij")).flatten(1)
    rel = (pos[..., :, None] - pos[..., None, :]).abs()
    return (rel[0] * R + rel[1]).to(dev), R * R


def swin_idx(W):
    coords = torch.stack(torch.meshgrid(torch.arange(W), torch.arange(W), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (W - 1)
    return (rel[..., 0] * (2 * W - 1) + rel[..., 1]).to(dev), (2 * W - 1) ** 2


def padded(idx, N):
    """(N, maxc) positions of each table entry in idx.flatten(), padded with len (a zero slot)."""
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=N)
    maxc = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    j = torch.arange(maxc, device=dev)
    pos = starts[:, None] + j[None, :]
    valid = j[None, :] < counts[:, None]
    out = torch.where(valid, order[pos.clamp(max=flat.numel() - 1)], flat.numel())
    return out, maxc


class PaddedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, idx, pad):  # table (H, N), idx (Lq, Lk)
        ctx.save_for_backward(pad)
        ctx.n = idx.numel()
        return table[:, idx]

    @staticmethod
    def backward(ctx, g):
        (pad,) = ctx.saved_tensors
        H = g.shape[0]
        gf = F.pad(g.reshape(H, -1).float(), (0, 1))  # a zero at index n
        return gf[:, pad].sum(-1).to(g.dtype), None, None


def onehot_bwd(g, oh):
    return (g.reshape(g.shape[0], -1) @ oh)


def kernel_us(f, n=20):
    from common import kernel_times
    return sum(kernel_times(f, n, warm=3).values()) / 1000.0  # ms


do_bench = lambda f, warmup=0, rep=0: kernel_us(f)
rows = []
for name, H, (idx, N) in [("levit-s1", 4, levit_idx(14)), ("levit-s2", 6, levit_idx(7)), ("levit-s3", 8, levit_idx(4)),
                          ("swin-s1", 3, swin_idx(7)), ("beit-ish", 12, levit_idx(14))]:
    table = torch.randn(H, N, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(H, *idx.shape, device=dev, dtype=torch.bfloat16)
    ref = torch.zeros(H, N, dtype=torch.float64, device=dev).index_put_((slice(None), idx.flatten()) if False else
                                                                          (torch.arange(H, device=dev)[:, None], idx.flatten()[None, :].expand(H, -1)),
                                                                          g.double().reshape(H, -1), accumulate=True)
    comp = torch.compile(lambda t: t[:, idx])
    pad, maxc = padded(idx, N)
    comp_pad = torch.compile(lambda t: PaddedGather.apply(t, idx, pad))
    oh = F.one_hot(idx.flatten(), N).to(torch.bfloat16)

    def run(f):
        table.grad = None
        f(table).backward(g)
        return table.grad

    import os
    import fuse_plugin  # noqa
    dim_ = 1
    os.environ["FUSE_PLUGIN_INDUCTOR_LAUNCH"] = "1"
    comp_op = torch.compile(lambda t: torch.ops.fuse_plugin.table_gather(t, idx, 1))
    res = {}
    for vname, f in [("inductor", comp), ("padded", comp_pad), ("op-decomp", comp_op)]:
        gr = run(f).double()
        err = ((gr - ref).abs().max() / ref.abs().max()).item()
        ms = do_bench(lambda: run(f), warmup=20, rep=200)
        res[vname] = (ms, err)
    os.environ["FUSE_PLUGIN_INDUCTOR_LAUNCH"] = "0"
    torch._dynamo.reset()
    comp_op2 = torch.compile(lambda t: torch.ops.fuse_plugin.table_gather(t, idx, 1))
    gr = run(comp_op2).double()
    res["op-opaque"] = (do_bench(lambda: run(comp_op2)), ((gr - ref).abs().max() / ref.abs().max()).item())
    os.environ["FUSE_PLUGIN_INDUCTOR_LAUNCH"] = "1"
    # Swin's form: table (M, H)[idx.view(-1)] -> (L*L, H)
    tableT = table.detach().t().contiguous().requires_grad_()
    compT = torch.compile(lambda t: t[idx.view(-1)])
    compT_op = torch.compile(lambda t: torch.ops.fuse_plugin.table_gather(t, idx.view(-1), 0))
    gT = g.reshape(H, -1).t().contiguous()
    def runT(f):
        tableT.grad = None
        f(tableT).backward(gT)
        return tableT.grad
    for vname, f in [("dim0-inductor", compT), ("dim0-op", compT_op)]:
        gr = runT(f).double().t()
        res[vname] = (do_bench(lambda: runT(f)), ((gr - ref).abs().max() / ref.abs().max()).item())
    gr = onehot_bwd(g, oh).double()
    res["onehot-mm"] = (do_bench(lambda: onehot_bwd(g, oh), warmup=20, rep=200),
                        ((gr - ref).abs().max() / ref.abs().max()).item())
    z = torch.zeros(H, N, device=dev, dtype=torch.float32)
    res["index_add"] = (do_bench(lambda: z.index_add_(1, idx.flatten(), g.reshape(H, -1).float()), warmup=20, rep=200), 0.0)
    rows.append((name, H, tuple(idx.shape), N, maxc, res))
print("GPU us per fwd+bwd (profiler kernel sum) and max rel err vs float64")
print(f"{'site':10} {'H':>3} {'N':>4} {'maxc':>4} " + " ".join(f"{k:>14}" for k in rows[0][5]))
for name, H, shp, N, maxc, res in rows:
    print(f"{name:10} {H:3} {N:4} {maxc:4} " + " ".join(f"{v[0]*1000:7.1f} {v[1]:.0e}" for v in res.values()))
