"""The Gluon forward's kernels on a sliding window, each through the op's launcher (issue 31).

    python benchmarks/window_forward.py        (an H100 with Triton 3.6; about a minute)

Per problem (B 1, D 128, bf16, window 4096; MHA 16/16 and GQA 32/8 at 16k and 32k tokens): the
registry's pick (family, tiles, kernel), then forward ms (median of do_bench, the best of 2) of the
launcher with its own choice, with the per-tile Gluon kernel forced ("gluon", "gluon_pingpong"),
with the persistent kernel forced ("gluon_persistent"), and of the persistent kernel called
directly (attention_forward_gluon: no launcher, its output contiguous). The launcher rows differ
only by kernel; registry.GLUON_PERSISTENT_MIN_TILES comes from them (NOTES attempt 54).
"""
import torch
import triton

from fuse_plugin.kernels import registry
from fuse_plugin.kernels.call import AttentionCall
from fuse_plugin.kernels.attention import attention_forward
from fuse_plugin.kernels.attention_config import AttentionConfig
from fuse_plugin.kernels import attention_fwd_gluon as gf


def bench(fn):
    return min(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(2))


def main():
    for hq, hkv, L in ((16, 16, 16384), (16, 16, 32768), (32, 8, 16384), (32, 8, 32768)):
        q = torch.randn(1, hq, L, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, L, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, hkv, L, 128, device="cuda", dtype=torch.bfloat16)
        kw = dict(is_causal=True, scale=128 ** -0.5, window=4096)
        fam, cfg, why = registry.choose(AttentionCall.forward(q, k, v, None, **kw))
        row = [f"{hq}/{hkv} {L}: {fam.name} {cfg.kernel} {cfg[:4]} ({why[:50]})"]
        row.append(f"registry {bench(lambda: attention_forward(q, k, v, None, **kw)):.3f}")
        for kern in ("gluon", "gluon_pingpong", "gluon_persistent"):
            c = AttentionConfig(128, 128, 4, 2, False, kern)
            row.append(f"{kern} {bench(lambda: attention_forward(q, k, v, None, **kw, config=c)):.3f}")
        var = gf.resolve_variant(None, 128)._replace(persistent=True)
        row.append(f"direct-persistent {bench(lambda: gf.attention_forward_gluon(q, k, v, variant=var, **kw)):.3f}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
