"""Host-side integer helpers for the launchers, and the dropout draw's threshold and scale (shared
by the kernels' launcher and the CPU reference, which must agree bit for bit).

triton.cdiv / triton.next_power_of_2 are constexpr functions in Triton >= 3.4: called from Python
they cost microseconds each (argument unwrapping), and an attention call made a dozen of them
(about 25 µs of its host time on the CPU here). These are the plain-Python equivalents.

Also the bias operand of the attention launchers (general and decode): its BIAS_KIND, tensor
and strides.
"""
from typing import Optional

import torch

from .launch import GRADIENT_BUFFER, is_tracing

NO_BIAS, BOOL_BIAS, FLOAT_BIAS = 0, 1, 2  # the kernels' BIAS_KIND


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def dropout_threshold(dropout_p: float) -> int:
    """A weight whose 16 random bits are below this is dropped (keep rate 1 - thresh / 2**16,
    within 2**-16 of 1 - p)."""
    return min(int(dropout_p * 2**16), 2**16 - 1)


def dropout_scale(dropout_p: float) -> float:
    """What kept weights are multiplied by: the exact inverse of the 16-bit keep rate (unbiased)."""
    return 2**16 / (2**16 - dropout_threshold(dropout_p))


def placeholder(q: torch.Tensor) -> torch.Tensor:
    """The tensor a launch passes for a pointer parameter it never reads (no bias, no rope
    tables, no dropout seed, ...): q itself in an eager launch (free); while tracing, one fresh
    element of q's dtype. Traced, Inductor realises each tensor argument of a user kernel on its
    own: where q is a view it cannot pass as one (q = a head-split view of a linear whose bias add
    is not yet computed: twins_svt_s's global attention), it copied q once per parameter that
    received it, nine copies of q before each forward launch and eight before each backward one."""
    if not is_tracing():
        return q
    return torch.empty((1,), dtype=q.dtype, device=q.device)


def layout_order(x: torch.Tensor) -> list:
    """x's dims from outermost to innermost in memory (by stride, ties in dim order), the last
    dim innermost: the order of ``layout_like``'s dense result. The identity (contiguous) unless x
    has at most 4 dims and a unit last stride."""
    n = x.dim()
    if n == 0 or n > 4 or x.stride(-1) != 1:
        return list(range(n))
    return sorted(range(n), key=lambda d: (d == n - 1, -x.stride(d), d))


def inverse_order(order: list) -> list:
    """The permutation that undoes ``t.permute(order)``."""
    return sorted(range(len(order)), key=order.__getitem__)


def layout_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised dense tensor of x's shape and ``dtype`` whose dims lie in memory in x's
    order (``layout_order``: x's own strides where x is dense; contiguous unless x has at most 4
    dims and a unit last stride). cuDNN's attention gradients follow the same rule (torch's
    ``alloc_with_matching_layout``). The outputs that mirror an input use it, in the real and the
    fake implementations alike: the rotations' outputs and the attention gradients dq/dk/dv.
    q/k/v are mostly head-split views of a projection ((B, L, H, D) in memory, seen
    transposed); a result laid out the same leaves the head merge after it a view, with no copy
    kernel (BERT on the H100: three 5 µs copies per layer and step while the gradients were
    contiguous)."""
    order, strides, step = layout_order(x), [0] * x.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(x.shape[d], 1)
    return torch.empty_strided(x.shape, strides, dtype=dtype, device=x.device)


def in_layout_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped as ``like``) laid out as ``layout_like(like, ...)``: t itself when its dims
    of size > 1 already lie in that order densely, else a copy (spelt as the copy op itself,
    ``aten._to_copy``, which also traces on fake CUDA tensors in a CPU build of torch)."""
    order = layout_order(like)
    permuted = t.permute(order)
    if permuted.is_contiguous():
        return t
    return torch.ops.aten._to_copy(permuted, memory_format=torch.contiguous_format).permute(
        inverse_order(order))


def bool_operand(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor as a kernel reads it: a same-strided uint8 view in eager calls; traced, the
    bool tensor itself (Triton loads ``*i1`` bytewise too; Inductor 2.11 cannot lower a
    ``view(torch.uint8)`` of a bool buffer it computed: "torch.bool is not supported by
    torch.iinfo")."""
    return t if is_tracing() else t.view(torch.uint8)


def bias_args(bias, dummy):
    """(BIAS_KIND, tensor, strides) of an attention bias: None, bool (read bytewise,
    ``bool_operand``) or floating point."""
    if bias is None:
        return NO_BIAS, dummy, (0, 0, 0, 0)
    if bias.dtype == torch.bool:
        return BOOL_BIAS, bool_operand(bias), bias.stride()
    if not bias.dtype.is_floating_point:
        raise ValueError(f"bias must be bool or floating point, got {bias.dtype}")
    return FLOAT_BIAS, bias, bias.stride()


def bias_over_keys(kind: int, strides) -> bool:
    """The kernels' BIAS_KEYS: a (B, Hq, Lq, Lk) bias whose query stride is 0 (a key-padding
    mask broadcast over the queries) is read one value per key, not as tiles of repeats. Only a
    literal 0 counts (a symbolic stride keeps the tile read, which is right for any stride)."""
    return kind != NO_BIAS and type(strides[2]) is int and strides[2] == 0


def gradient_buffer(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``layout_like(like, dtype)`` (the same shape and strides); while tracing, allocated as
    ``torch.empty`` in memory order and permuted to ``like``'s dims, the buffer kept on the view
    (launch.GRADIENT_BUFFER); a traced launch that writes the view is given the buffer itself
    (launch._record).

    Why not ``torch.empty_strided``: AOTAutograd's common-subexpression pass (``fx_graph_cse``,
    torch 2.11 and 2.13) merges identical ``empty_strided`` nodes (it spares only ``aten.empty``),
    so the dq, dk and dv of a self-attention (one shape, one layout) became one buffer, and
    Inductor, to keep the kernel's three writes apart, copied that uninitialised buffer into three
    new ones before every backward launch: an extra allocation, a copy kernel and its launch a
    site (twins_svt_s training's backward on an H100: 21 such kernels a step). A kernel writing a
    view would still be cloned (a mutation of a view), hence the buffer."""
    if not is_tracing():  # an eager launch: no graph, no CSE; the plain dense tensor
        return layout_like(like, dtype)
    order = layout_order(like)
    buf = torch.empty([like.shape[d] for d in order], dtype=dtype, device=like.device)
    if order == list(range(like.dim())):
        return buf
    view = buf.permute(inverse_order(order))
    setattr(view, GRADIENT_BUFFER, buf)
    return view


def empty(shape, dtype, device, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Allocation of every attention kernel output (one hook, so tests can poison it with NaN);
    with ``like`` (an input of the op), laid out as ``layout_like(like, dtype)``: the gradients
    (``gradient_buffer``)."""
    if like is not None:
        return gradient_buffer(like, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA device (None on the CPU), read once per device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNT.get(index)
    if sms is None:
        sms = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return sms


def interpreted(t: torch.Tensor) -> bool:
    """CPU tensors run the kernels in Triton's interpreter (see ops/_dispatch.py)."""
    return not t.is_cuda


def dot_precision(t: torch.Tensor) -> str:
    """The kernels' PRECISION: fp32 inputs follow the eager matmul setting (tf32 or not); the
    interpreter only knows "ieee"."""
    if t.dtype == torch.float32 and t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def upcast_dot(t: torch.Tensor) -> bool:
    """The kernels' UPCAST_DOT: the interpreter's tl.dot mishandles bf16 (attention_tiles._dot)."""
    return t.dtype == torch.bfloat16 and interpreted(t)
