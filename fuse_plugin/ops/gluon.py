"""Internal ops that launch the warp-specialised Gluon kernels from a compiled graph.

    out, lse = torch.ops.fuse_plugin.gluon_attention_forward(q, k, v, is_causal, scale,
                                                             block_m, block_n, num_stages, kernel,
                                                             window=0)
    dq, dk, dv = torch.ops.fuse_plugin.gluon_attention_backward(dout, q, k, v, out, lse,
                                                               is_causal, scale, variant, group_split,
                                                               window=0)

When Inductor compiles a graph, the attention ops decompose into their Triton launches
(ops/inductor.py, kernels/launch.py); a Gluon kernel cannot be among them (Inductor re-emits a
user kernel's source under ``@triton.jit``). Where the table picks a Gluon kernel, the traced
launcher puts one of these ops in the graph instead: the rest of the graph stays Inductor's,
and the op's CUDA implementation launches the Gluon kernel(s) from Python. They are functional
(fresh outputs), CUDA only, and not differentiable: they only appear inside the attention ops'
decomposition, after autograd. The arguments are those the launcher chose (``AttentionConfig``
fields of a Gluon entry for the forward, a Gluon backward variant name and GQA group split,
0 = default, for the backward), and the sliding window (0 = none); the problem is one the
launcher checked the kernels cover.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("fuse_plugin", "FRAGMENT")
_LIB.define(
    "gluon_attention_forward(Tensor q, Tensor k, Tensor v, bool is_causal, float scale, "
    "int block_m, int block_n, int num_stages, str kernel, int window=0) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define(
    "gluon_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "bool is_causal, float scale, str variant, int group_split, int window=0) -> (Tensor, Tensor, Tensor)",
    # its gradients are laid out in the order of q, k, v's strides: held to the traced order
    tags=(torch.Tag.pt2_compliant_tag, torch.Tag.needs_fixed_stride_order))


def _forward(q, k, v, is_causal, scale, block_m, block_n, num_stages, kernel, window=0):
    # imported late: see TRITON_INTERPRET in _dispatch
    from ..kernels import attention_fwd_gluon as gluon_fwd
    from ..kernels.attention_config import AttentionConfig, gluon_variant

    B, Hq, Lq, _ = q.shape
    out = torch.empty((B, Lq, Hq, v.shape[-1]), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    cfg = AttentionConfig(block_m, block_n, 4, num_stages, False, kernel)
    gluon_fwd.launch_forward_gluon(q, k, v, out, lse, is_causal, scale, gluon_variant(cfg), window)
    return out, lse


def _backward(dout, q, k, v, out, lse, is_causal, scale, variant, group_split, window=0):
    from ..kernels import attention_bwd_gluon as gluon_bwd

    return gluon_bwd.attention_backward_gluon(
        dout, q, k, v, out, lse, is_causal=is_causal, scale=scale, variant=variant,
        group_split=group_split or None, window=window)


@torch.library.register_fake("fuse_plugin::gluon_attention_forward", lib=_LIB)
def _(q, k, v, is_causal, scale, block_m, block_n, num_stages, kernel, window=0):
    B, Hq, Lq, _ = q.shape
    return (q.new_empty((B, Lq, Hq, v.shape[-1])).transpose(1, 2),
            q.new_empty((B, Hq, Lq), dtype=torch.float32))


@torch.library.register_fake("fuse_plugin::gluon_attention_backward", lib=_LIB)
def _(dout, q, k, v, out, lse, is_causal, scale, variant, group_split, window=0):
    from ..kernels.host import layout_like  # the gradients are laid out as their inputs

    return layout_like(q, q.dtype), layout_like(k, k.dtype), layout_like(v, v.dtype)


_LIB.impl("gluon_attention_forward", _forward, "CUDA")
_LIB.impl("gluon_attention_backward", _backward, "CUDA")
