"""GPU check (issue 14): attention logit softcapping in the kernels and Gemma 2 fused end to end, bf16.

Run on a CUDA machine from the repository root:   python tests/gpu_softcap_check.py
(about a minute on an H100, mostly the Inductor compile of the model). Prints one PASS/FAIL row per
check and exits 1 if any fails. Not collected by pytest (no test_ prefix). `--cpu`: a smoke test of
the script itself (tiny sizes, the ops' CPU reference).

Kernels (fuse_plugin.kernels.attention, eager launches, the shipped tuning table): bf16 q/k/v,
B 2, 8 query / 4 kv heads, D 64 and 128, L 1000 and 2048, causal or not, softcap 30 on scores
that reach several times the cap; the forward and dq/dk/dv (atomic backward, and the deterministic
pair once) against the float64 reference (ops/reference.py, the op's definition):
  rel err <= 1e-2 and no further from float64 than eager bf16 math is (2x). The table picks TMA or
  Gluon kernels for some of these keys without a softcap; with one the launcher must use the
  general kernels (a softcap-less kernel would be off by far more than 1e-2).
  One case adds a float bias (a padding mask) with its gradient.

Gemma 2 (transformers.Gemma2ForCausalLM from a config, no download; eager attention): hidden 512,
4 layers alternating sliding-window (window 128) and full attention, 8 heads / 4 kv heads of 64,
attn_logit_softcapping 50 (q/k projections scaled up so the scores reach it), final logit
softcapping 30; batch 2 x 512 tokens, left padding in row 0. bf16, compiled with
backend="fuse_plugin", trained 3 AdamW steps next to the same model in eager bf16 and in fp32:
  sites   every attention (softcap in the op) and rotary q+k pair fused, per compiled graph
  logits  step 1 logits no further from the fp32 model than eager bf16's (2x, or 1e-2)
  grads   the same for the gradient of every parameter (global relative error)
  losses  the 3 training losses within 1e-2 (relative) of eager bf16's
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("FUSE_PLUGIN_ROPE_ATTENTION", "0")  # the users' default: rotary_qk + attention

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuse_plugin  # noqa: E402,F401
from fuse_plugin.ops import reference  # noqa: E402
from gpu_checkpoint_check import as_accurate, header, rel, report, train_parity  # noqa: E402  (the same measures)

DEVICE = "cuda"
SOFTCAP = 30.0
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BATCH, SEQ, PAD, WINDOW = 4, 512, 8, 4, 64, 2, 512, 64, 128
KERNEL_SHAPES = [(64, 1000, True), (64, 2048, False), (128, 1000, False), (128, 2048, True)]


# ----------------------------------------------------------------------------- kernels


def eager_bf16(q, k, v, bias, causal, scale):
    """What eager bf16 code computes (Gemma 2's order), with autograd: the accuracy yardstick."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.tanh(q @ k.transpose(-2, -1) * scale / SOFTCAP) * SOFTCAP
    if bias is not None:
        s = s + bias
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def check_kernels(rows: list) -> None:
    from fuse_plugin.kernels import attention as attn

    run_kernels = DEVICE == "cuda"
    cases = [(d, L, c, False, False) for d, L, c in KERNEL_SHAPES]
    cases += [(64, 1000, True, True, False), (128, 1000, True, False, True)]  # float bias; deterministic pair
    if not run_kernels:
        cases = [(16, 40, True, False, False), (16, 40, False, True, False)]
    for D, L, causal, with_bias, deterministic in cases:
        torch.manual_seed(0)
        B, Hq, Hkv = 2, 8, 4
        # |q·kᵀ·scale| up to ~4x the cap: tanh saturates for many keys
        q = (3 * torch.randn(B, Hq, L, D, device=DEVICE)).to(torch.bfloat16)
        k = (3 * torch.randn(B, Hkv, L, D, device=DEVICE)).to(torch.bfloat16)
        v = torch.randn(B, Hkv, L, D, device=DEVICE).to(torch.bfloat16)
        scale = D ** -0.5 * 4.0
        bias = None
        if with_bias:
            bias = torch.zeros(B, 1, 1, L, device=DEVICE)
            # left padding of batch 0, filled as HF fills it: finfo(model dtype).min (float32 min would
            # round to -inf in bf16 and make those rows NaN in eager and here alike)
            bias[0, ..., : L // 8] = torch.finfo(torch.bfloat16).min
            bias = bias.to(torch.bfloat16)
        dout = torch.randn(B, Hq, L, D, device=DEVICE).to(torch.bfloat16)
        b4 = bias.expand(B, Hq, L, L) if bias is not None else None
        r = [t.double() for t in (q, k, v)]
        rb = b4.double() if b4 is not None else None
        want, _ = reference.attention_forward(*r, rb, causal, scale, softcap=SOFTCAP)
        wdq, wdk, wdv, wds = reference.attention_backward(dout.double(), *r, rb, causal, scale, with_bias,
                                                          softcap=SOFTCAP)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        e_out = eager_bf16(*leaves, bias, causal, scale)
        e_grads = torch.autograd.grad(e_out, leaves, dout)
        if run_kernels:
            out, lse = attn.attention_forward(q, k, v, b4, is_causal=causal, scale=scale, softcap=SOFTCAP)
            dq, dk, dv, ds = attn.attention_backward(dout, q, k, v, b4, out, lse, is_causal=causal, scale=scale,
                                                     need_dbias=with_bias, deterministic=deterministic,
                                                     softcap=SOFTCAP)
        else:
            out, lse = torch.ops.fuse_plugin.attention(q, k, v, b4, 0.0, causal, scale, softcap=SOFTCAP)
            dq, dk, dv, ds = torch.ops.fuse_plugin.attention_backward(
                dout, q, k, v, b4, out, lse, 0.0, causal, scale, None, with_bias, SOFTCAP)
        name = (f"kernel D={D} L={L} {'causal' if causal else 'full'}"
                + (" +bias" if with_bias else "") + (" deterministic" if deterministic else ""))
        got = [("out", out, want, e_out), ("dq", dq, wdq, e_grads[0]), ("dk", dk, wdk, e_grads[1]),
               ("dv", dv, wdv, e_grads[2])]
        parts, ok = [], True
        for n, x, w, e in got:
            err, e_err = rel(x, w), rel(e, w)
            good = bool(torch.isfinite(x).all()) and err <= 1e-2 and as_accurate(err, e_err)
            ok &= good
            parts.append(f"{n} {err:.1e} (eager bf16 {e_err:.1e})")
        if with_bias:  # dbias is dS summed to the bias's (B, 1, 1, L)
            err = rel(ds.sum_to_size(B, 1, 1, L), wds.sum_to_size(B, 1, 1, L))
            ok &= err <= 1e-2
            parts.append(f"dbias {err:.1e}")
        rows.append((name, ok, ", ".join(parts)))


# ----------------------------------------------------------------------------- Gemma 2


def make_gemma2():
    import transformers

    cfg = transformers.Gemma2Config(
        vocab_size=1000, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
        max_position_embeddings=SEQ, sliding_window=WINDOW, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # random init gives |scores| ~ 0.2: scale q/k so that the cap of 50 bites
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    return model.to(DEVICE)


def gemma_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :PAD] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE), "labels": labels.to(DEVICE),
            "use_cache": False}


def check_gemma2(rows: list) -> None:
    parity: list = []
    counting = train_parity("gemma2", make_gemma2(), gemma_inputs(), parity)
    expected = [{"attention": LAYERS, "rotary": 2 * LAYERS}]
    rows.append(("gemma2 sites", counting.graphs == expected, f"per graph {counting.graphs}, expected {expected}"))
    rows += parity


def main() -> int:
    global DEVICE, LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, PAD, WINDOW
    if "--cpu" in sys.argv:  # smoke test of the script: tiny, on the CPU (the ops' CPU reference)
        DEVICE, LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, PAD, WINDOW = "cpu", 2, 64, 4, 2, 16, 32, 4, 8
    if not header(DEVICE == "cpu"):
        return 1
    rows: list = []
    t0 = time.time()
    check_kernels(rows)
    t1 = time.time()
    check_gemma2(rows)
    print(f"(kernels {t1 - t0:.0f} s, gemma2 {time.time() - t1:.0f} s)")
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
