"""Host-side integer helpers for the launchers, and the dropout draw's threshold and scale (shared
by the kernels' launcher and the CPU reference, which must agree bit for bit).

triton.cdiv / triton.next_power_of_2 are constexpr functions in Triton >= 3.4: called from Python
they cost microseconds each (argument unwrapping), and an attention call made a dozen of them
(about 25 µs of its host time on the CPU here). These are the plain-Python equivalents.

Also the bias operand of the attention launchers (general and decode): its BIAS_KIND, tensor
and strides.
"""
import torch

from .launch import is_tracing

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
