"""`python -m fuse_plugin demo`: a Llama-style model written the way HF's eager code writes it,
compiled with the plugin: what was fused, parity with eager, and (on a GPU) speed and memory.

The model is plain torch (no download): token embedding → per layer RMSNorm, rotary embedding by
`rotate_half`, GQA attention with `repeat_kv`, `* scaling`, an additive causal mask sliced to the
key length and a float32 softmax; SwiGLU MLP. `attn="sdpa"` swaps the attention for
`F.scaled_dot_product_attention` (HF's sdpa path) as the comparison point.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from . import settings


@dataclass
class LlamaConfig:
    vocab: int = 1000
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 256
    rope_theta: float = 10000.0
    attn: str = "eager"  # "eager" (the unfused HF spelling) or "sdpa"


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.hidden // cfg.heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.cfg.attn == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
        else:
            n_rep = self.cfg.heads // self.cfg.kv_heads
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
            w = w + mask[:, :, :, : k.shape[-2]]
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            w = F.dropout(w, p=0.0, training=self.training)
            out = torch.matmul(w, v)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.gate = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.down = nn.Linear(cfg.mlp, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        head_dim = cfg.hidden // cfg.heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, x, position_ids):
        # HF LlamaRotaryEmbedding: cat((freqs, freqs)) tables in float32, cast to the activations' dtype
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, input_ids):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        cos, sin = self.rotary(x, position_ids)
        mask = torch.full((s, s), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------- the demo


def _train_step(model, opt, ids):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _measure(make_model, ids, steps: int):
    """Train-step time (ms, median of `steps`) and peak memory (GB) on CUDA."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for _ in range(3):  # compile + warm-up
        _train_step(model, opt, ids)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _train_step(model, opt, ids)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 1e9


def run(argv=None) -> int:
    import fuse_plugin

    parser = argparse.ArgumentParser(prog="python -m fuse_plugin demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 64 on CPU, 8192 on CUDA)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 2 on CPU, 1 on CUDA)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    if cuda:
        cfg = LlamaConfig(vocab=32000, hidden=1024, layers=4, heads=16, kv_heads=4, mlp=2816)
        dtype = torch.bfloat16
    else:
        cfg, dtype = LlamaConfig(), torch.float32
    # On a GPU the default is a long sequence: there attention dominates and fusing it pays most
    # (at short sequences and small batches the ops' host overhead still shows, see RESULTS.md).
    seq = args.seq or (8192 if cuda else 64)
    batch = args.batch or (1 if cuda else 2)
    ids = torch.randint(0, cfg.vocab, (batch, seq), device=device)

    def make(attn="eager"):
        torch.manual_seed(0)
        m = TinyLlama(LlamaConfig(**{**cfg.__dict__, "attn": attn})).to(device)
        return m.to(dtype) if dtype != torch.float32 else m

    print(f"fuse_plugin demo: Llama-style model, {cfg.layers} layers, hidden {cfg.hidden}, "
          f"{cfg.heads}/{cfg.kv_heads} heads, batch {batch}, seq {seq}, {dtype}, on {device}")
    model = make()
    switches = {}
    if not cuda and settings.cpu_sites() == "auto":
        # On the CPU the plugin leaves every site as written (patterns/choice.off_cuda); the demo
        # shows the rewrite and its parity all the same.
        switches = {settings.CPU_SITES: "ours"}
        print(f"(on the CPU the plugin leaves these sites as written, its ops there being a plain-torch "
              f"reference slower than stock compile; the demo rewrites them with {settings.CPU_SITES}=ours)")
    with mock.patch.dict(os.environ, switches):
        print(fuse_plugin.explain(model, ids))
        with torch.no_grad():
            ref = model(ids).float()
            torch._dynamo.reset()
            got = torch.compile(model, backend="fuse_plugin")(ids).float()
    err = ((got - ref).norm() / ref.norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"\nparity, compiled vs eager logits: rel err {err:.2e} ({'OK' if err <= tol else 'FAIL'}, tolerance {tol:g})")
    if not cuda:
        print("speed and memory comparison needs CUDA: run this on a GPU machine to see it.")
        return 0 if err <= tol else 1

    rows = []
    variants = [
        ("eager (eager attention)", lambda: make()),
        ("torch.compile (eager attention)", lambda: _compiled(make(), None)),
        ("torch.compile (sdpa attention)", lambda: _compiled(make("sdpa"), None)),
        ("fuse_plugin (eager attention)", lambda: _compiled(make(), "fuse_plugin")),
    ]
    for name, mk in variants:
        torch._dynamo.reset()
        try:
            ms, gb = _measure(mk, ids, steps=10)
            rows.append((name, f"{ms:8.1f}", f"{batch * seq / ms * 1e3:10.0f}", f"{gb:6.2f}"))
        except torch.OutOfMemoryError:
            rows.append((name, "     OOM", "", ""))
        torch.cuda.empty_cache()
    print(f"\ntraining step (fwd+bwd+AdamW), {torch.cuda.get_device_name()}:")
    print(f"{'variant':34} {'ms/step':>8} {'tokens/s':>10} {'peak GB':>7}")
    for r in rows:
        print(f"{r[0]:34} {r[1]:>8} {r[2]:>10} {r[3]:>7}")
    return 0 if err <= tol else 1


def _compiled(model, backend):
    if backend is None:  # stock torch.compile: the automatic patch is kept off while it compiles
        return _FirstCallDisabled(torch.compile(model))
    return torch.compile(model, backend=backend)


class _FirstCallDisabled:
    """Compiles on the first call inside `fuse_plugin.disabled()`, so the stock path stays stock."""

    def __init__(self, fn):
        self.fn, self.first = fn, True

    def __call__(self, *args):
        if self.first:
            import fuse_plugin

            self.first = False
            with fuse_plugin.disabled():
                return self.fn(*args)
        return self.fn(*args)

    def parameters(self):
        return self.fn.parameters()
