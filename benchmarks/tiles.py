"""GPU time of our attention kernels per tile and kernel family against SDPA's backends, at the
short-sequence shapes of whole-model rows (benchmarks/shapes.py): where the table's short bucket
(kernels/tuning.py, ``SHORT_SEQ``; entries with source "measured") comes from.

    python benchmarks/tiles.py [NAME_PREFIX,...]   (e.g. vit,bert)

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``): device time only,
as under mode="reduce-overhead". "table pick" is what an eager call takes from the table; a
failed config prints why (a family that does not cover the problem, shared memory).
"""
import sys
import warnings

import torch
import triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import common  # noqa: F401  (this tree's fuse_plugin)
import fuse_plugin  # noqa: F401
warnings.filterwarnings("ignore")
from fuse_plugin.kernels import attention as ka
from fuse_plugin.kernels.attention import AttentionConfig as C
from fuse_plugin.ops.attention import new_dropout_seed

def t(fn):
    try:
        fn(); torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3
    except Exception as e:
        return f"x({type(e).__name__}: {str(e)[:60]})"

SHAPES = {  # name: B, Hq, Hkv, L, D, causal, mask, p
    "vit 64x6x197 d64": (64, 6, 6, 197, 64, False, None, 0.0),
    "bert 32x12x128 d64 mask": (32, 12, 12, 128, 64, False, "float", 0.0),
    "bert 32x12x128 d64 mask p0.1": (32, 12, 12, 128, 64, False, "float", 0.1),
    "llama 1x16/4x128 causal": (1, 16, 4, 128, 64, True, None, 0.0),
    "llama 8x16/4x512 causal": (8, 16, 4, 512, 64, True, None, 0.0),
}
FWD = [None, C(64, 64, 4, 3), C(64, 128, 4, 2), C(128, 64, 8, 2), C(128, 128, 8, 2), C(32, 64, 4, 3),
       C(64, 32, 4, 3), C(128, 32, 4, 3), C(32, 32, 4, 2), C(64, 64, 4, 2), C(128, 64, 4, 3),
       C(64, 128, 4, 2, False, "tma"), C(128, 128, 8, 2, False, "tma"), C(128, 64, 4, 2, False, "gluon"),
       C(128, 128, 4, 2, False, "gluon"), C(256, 128, 4, 2, False, "gluon_pingpong")]
BWD = [None, C(64, 128, 8, 2), C(64, 64, 4, 2), C(64, 64, 4, 3), C(32, 64, 4, 3), C(64, 32, 4, 2),
       C(128, 64, 8, 2), C(128, 32, 8, 2), C(64, 64, 8, 3), C(32, 32, 8, 2), C(128, 128, 8, 2), C(32, 64, 4, 2), C(32, 128, 8, 2), C(16, 64, 4, 2),
       C(32, 32, 4, 2), C(16, 128, 8, 2), C(64, 64, 8, 2), C(32, 64, 8, 2), C(64, 128, 8, 2, False, "gluon_lpt"),
       C(64, 128, 8, 2, False, "gluon"), C(64, 64, 8, 2, False, "two_kernel"), C(64, 64, 8, 2, False, "tma_pair")]
dt = torch.bfloat16
only = sys.argv[1].split(",") if len(sys.argv) > 1 else None  # name prefixes
for name, (B, Hq, Hkv, L, D, causal, mask, p) in SHAPES.items():
    if only and not any(name.startswith(o) for o in only):
        continue
    torch.manual_seed(0)
    q = torch.randn(B, L, Hq, D, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt).transpose(1, 2)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt).transpose(1, 2)
    bias = (torch.randn(B, 1, 1, L, device="cuda", dtype=dt).expand(B, Hq, L, L)) if mask else None
    seed = new_dropout_seed(q.device) if p else None
    s = D ** -0.5
    out, lse = ka.attention_forward(q, k, v, bias, is_causal=causal, scale=s, dropout_p=p, dropout_seed=seed)
    dout = torch.randn_like(out)
    print(f"\n## {name}: GPU us (CUDA graph replay, median)")
    res = []
    for cfg in FWD:
        res.append(("fwd", cfg, t(lambda: ka.attention_forward(q, k, v, bias, is_causal=causal, scale=s, config=cfg, dropout_p=p, dropout_seed=seed))))
    for cfg in BWD:
        res.append(("bwd", cfg, t(lambda: ka.attention_backward(dout, q, k, v, bias, out, lse, is_causal=causal, scale=s, need_dbias=False, config=cfg, dropout_p=p, dropout_seed=seed))))
    for kind in ("fwd", "bwd"):
        ok = [(c, x) for kk, c, x in res if kk == kind and isinstance(x, float)]
        ok.sort(key=lambda cx: cx[1])
        dflt = [x for kk, c, x in res if kk == kind and c is None][0]
        print(f"  ours {kind}: table pick {dflt if isinstance(dflt, str) else f'{dflt:.1f}'}; best: " + ", ".join(f"{x:.1f} {tuple(c)[:4] + ((c.kernel,) if c and c.kernel != 'general' else ()) if c else 'table'}" for c, x in ok[:5]))
        bad = [(c, x) for kk, c, x in res if kk == kind and not isinstance(x, float)]
        if bad: print("    failed:", "; ".join(f"{tuple(c) if c else 'table'} {x}" for c, x in bad[:4]))
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    kw = dict(attn_mask=bias[:, :1] if mask else None, is_causal=causal, scale=s, dropout_p=p, enable_gqa=Hq != Hkv)
    for be in ("cudnn", "flash", "efficient"):
        bk = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[be]
        def f():
            with sdpa_kernel(bk):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        def fb():
            with sdpa_kernel(bk):
                o = F.scaled_dot_product_attention(qg, kg, vg, **kw)
            torch.autograd.grad(o, (qg, kg, vg), dout)
        a, b = t(f), t(fb)
        bw = f"{b - a:.1f}" if isinstance(a, float) and isinstance(b, float) else str(b)[:50]
        print(f"  sdpa {be:9}: fwd {a if isinstance(a, str) else f'{a:.1f}'}  bwd(fwd+bwd - fwd) {bw}")
