"""Host-side integer helpers for the launchers.

triton.cdiv / triton.next_power_of_2 are constexpr functions in Triton >= 3.4: called from Python
they cost microseconds each (argument unwrapping), and an attention call made a dozen of them
(about 25 µs of its host time on the CPU here). These are the plain-Python equivalents.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
