"""GPU check (issue 14): the attention op's replace mask in the kernels and DeBERTa-v2 fused end to end, bf16.

Run on a CUDA machine from the repository root:   python tests/gpu_replace_check.py
(under two minutes on an H100, mostly the Triton compiles and the Inductor compile of the model).
Prints one PASS/FAIL row per check and exits 1 if any fails. Not collected by pytest (no test_
prefix). `--cpu`: a smoke test of the script itself (tiny sizes, the ops' CPU reference).

The op computes s = where(replace, bias, q·kᵀ·scale + bias): where a finite masked_fill / where
replaced the scores, the score is the (float32) bias alone, with no gradient into q·kᵀ; the bias's
gradient is dS everywhere (patterns/attention_bias.py builds bias and mask from the model's chain).

Kernels (fuse_plugin.kernels.attention, eager launches, the shipped tuning table): bf16 q/k/v,
B 2, 8 query / 4 kv heads, D 64 and 128, L 1000 and 2048, a float32 bias (B, 1, L, L) with its
gradient and a bool replace mask (B, 1, L, L), in the two orders the matcher meets:
  deberta  a learned bias, then the padding fill over queries and keys with finfo.min (batch 0's
           last L/8 queries and keys padded: those query rows are replaced everywhere, uniform
           weights and dq exactly 0);
  gpt2     where(causal, s, finfo.min), then the additive padding mask (batch 0 left-padded by
           L/8: its first rows mix replaced scores and added ones, with gradient) and a learned
           term after it;
the forward and dq/dk/dv/dbias (atomic backward, and the deterministic pair once) against the
float64 reference (ops/reference.py, the op's definition): rel err <= 1e-2 and no further from
float64 than eager bf16 math is (2x). The table picks TMA or Gluon kernels for some of these
keys without a bias; with a replace mask the launcher must use the general kernels.

DeBERTa-v2 (transformers.DebertaV2ForMaskedLM from a config, no download; eager attention): hidden
256, 2 layers, 4 heads of 64, relative attention (c2p, p2c: a bias from q and k, with its
gradient, added before the finfo.min padding fill); batch 2 x 512 tokens, right padding of 64 in
row 0. bf16, compiled with backend="fuse_plugin", trained 3 AdamW steps next to the same model in
eager bf16 and in fp32:
  sites   every attention fused (2, over the compiled graphs)
  logits  step 1 logits no further from the fp32 model than eager bf16's (2x, or 1e-2)
  grads   the same for the gradient of every parameter (global relative error)
  losses  the 3 training losses within 1e-2 (relative) of eager bf16's
"""
from __future__ import annotations

import os
import sys
import time

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuse_plugin  # noqa: E402,F401
from fuse_plugin.ops import reference  # noqa: E402
from gpu_checkpoint_check import as_accurate, header, rel, report, train_parity  # noqa: E402  (the same measures)

DEVICE = "cuda"
LAYERS, HIDDEN, HEADS, BATCH, SEQ, PAD = 2, 256, 4, 2, 512, 64
# (D, L, order, deterministic backward)
KERNEL_CASES = [(64, 1000, "deberta", False), (64, 2048, "gpt2", False), (128, 1000, "gpt2", False),
                (128, 2048, "deberta", False), (128, 1000, "deberta", True)]


# ----------------------------------------------------------------------------- kernels


def problem(B, L, order):
    """(bias float32 (B, 1, L, L), replace bool (B, 1, L, L), the query rows replaced everywhere):
    what the matcher builds for the model's chain (the masks replayed on zero scores)."""
    fmin = torch.finfo(torch.float32).min
    g = torch.Generator(device=DEVICE).manual_seed(1)
    learned = 2 * torch.randn(B, 1, L, L, device=DEVICE, generator=g)
    pad = L // 8
    if order == "deberta":  # s + learned, then masked_fill(~(keep_q & keep_k), finfo.min)
        keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
        keep[0, L - pad:] = False
        replace = ~(keep[:, None, :, None] & keep[:, None, None, :])
        bias = learned.masked_fill(replace, fmin)
        dead_rows = (0, slice(L - pad, L))
    else:  # where(causal, s, finfo.min) + padding (finfo.min on batch 0's first keys) + learned
        causal = torch.ones(L, L, dtype=torch.bool, device=DEVICE).tril()
        padding = torch.zeros(B, 1, 1, L, device=DEVICE)
        padding[0, ..., :pad] = fmin
        replace = ~causal.expand(B, 1, L, L)
        bias = torch.where(replace, fmin, 0.0) + padding + learned
        dead_rows = None
    return bias.contiguous(), replace.contiguous(), dead_rows


def eager_bf16(q, k, v, bias, replace, scale):
    """What eager bf16 code computes (bf16 scores, the float32 masks promote them), with autograd."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * scale
    s = torch.where(replace, bias, s + bias)
    return torch.softmax(s, -1).to(q.dtype) @ v


def check_kernels(rows: list) -> None:
    from fuse_plugin.kernels import attention as attn

    run_kernels = DEVICE == "cuda"
    cases = KERNEL_CASES if run_kernels else [(16, 40, "deberta", False), (16, 40, "gpt2", True)]
    for D, L, order, deterministic in cases:
        torch.manual_seed(0)
        B, Hq, Hkv = 2, 8, 4
        q = torch.randn(B, Hq, L, D, device=DEVICE).to(torch.bfloat16)
        k = torch.randn(B, Hkv, L, D, device=DEVICE).to(torch.bfloat16)
        v = torch.randn(B, Hkv, L, D, device=DEVICE).to(torch.bfloat16)
        scale = D ** -0.5
        bias, replace, dead = problem(B, L, order)
        dout = torch.randn(B, Hq, L, D, device=DEVICE).to(torch.bfloat16)
        b4, r4 = bias.expand(B, Hq, L, L), replace.expand(B, Hq, L, L)
        r = [t.double() for t in (q, k, v)]
        want, _ = reference.attention_forward(*r, b4.double(), False, scale, replace=r4)
        wdq, wdk, wdv, wds = reference.attention_backward(dout.double(), *r, b4.double(), False, scale, True,
                                                          replace=r4)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        e_out = eager_bf16(*leaves, replace, scale)
        e_grads = torch.autograd.grad(e_out, leaves, dout)
        if run_kernels:
            out, lse = attn.attention_forward(q, k, v, b4, is_causal=False, scale=scale, replace=r4)
            dq, dk, dv, ds = attn.attention_backward(dout, q, k, v, b4, out, lse, is_causal=False, scale=scale,
                                                     need_dbias=True, deterministic=deterministic, replace=r4)
        else:
            out, lse = torch.ops.fuse_plugin.attention(q, k, v, bias, 0.0, False, scale, replace=replace)
            dq, dk, dv, ds = torch.ops.fuse_plugin.attention_backward(
                dout, q, k, v, bias, out, lse, 0.0, False, scale, None, True, 0.0, replace)
        name = f"kernel D={D} L={L} {order}" + (" deterministic" if deterministic else "")
        got = [("out", out, want, e_out), ("dq", dq, wdq, e_grads[0]), ("dk", dk, wdk, e_grads[1]),
               ("dv", dv, wdv, e_grads[2])]
        parts, ok = [], True
        for n, x, w, e in got:
            err, e_err = rel(x, w), rel(e, w)
            good = bool(torch.isfinite(x).all()) and err <= 1e-2 and as_accurate(err, e_err)
            ok &= good
            parts.append(f"{n} {err:.1e} (eager bf16 {e_err:.1e})")
        # dbias: dS summed to the bias's (B, 1, L, L) (the op's own reduction off the GPU path)
        got_db = ds.sum_to_size(B, 1, L, L)
        err, e_err = rel(got_db, wds.sum_to_size(B, 1, L, L)), rel(e_grads[3], wds.sum_to_size(B, 1, L, L))
        ok &= bool(torch.isfinite(got_db).all()) and err <= 1e-2 and as_accurate(err, e_err)
        parts.append(f"dbias {err:.1e} (eager bf16 {e_err:.1e})")
        if dead is not None:  # query rows replaced everywhere: no gradient into q at all
            zero = bool((dq[dead[0], :, dead[1]] == 0).all())
            ok &= zero
            parts.append(f"dq of rows replaced everywhere {'exactly 0' if zero else 'NOT 0'}")
        rows.append((name, ok, ", ".join(parts)))


# ----------------------------------------------------------------------------- DeBERTa-v2


def make_deberta():
    import transformers

    cfg = transformers.DebertaV2Config(
        vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, relative_attention=True, pos_att_type=["p2c", "c2p"],
        max_relative_positions=256, position_buckets=64, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.DebertaV2ForMaskedLM._from_config(cfg, attn_implementation="eager")
    return model.to(DEVICE)


def deberta_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ - PAD:] = 0  # right padding: row 0's padded queries are masked everywhere
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE), "labels": labels.to(DEVICE)}


def check_deberta(rows: list) -> None:
    parity: list = []
    counting = train_parity("deberta", make_deberta(), deberta_inputs(), parity)
    fused = sum(g["attention"] for g in counting.graphs)
    rows.append(("deberta sites", fused == LAYERS, f"{fused} attention fused over the graphs {counting.graphs}, "
                                                   f"expected {LAYERS}"))
    rows += parity


def main() -> int:
    global DEVICE, LAYERS, HIDDEN, HEADS, SEQ, PAD
    if "--cpu" in sys.argv:  # smoke test of the script: tiny, on the CPU (the ops' CPU reference)
        DEVICE, LAYERS, HIDDEN, HEADS, SEQ, PAD = "cpu", 2, 64, 4, 32, 4
    if not header(DEVICE == "cpu"):
        return 1
    rows: list = []
    t0 = time.time()
    check_kernels(rows)
    t1 = time.time()
    check_deberta(rows)
    print(f"(kernels {t1 - t0:.0f} s, deberta {time.time() - t1:.0f} s)")
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
