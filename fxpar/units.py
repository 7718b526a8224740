"""Units shown to people: byte counts in binary units, seconds, dtype names. Imports nothing
of fxpar, so plain-data modules (:mod:`fxpar.plan_data`) and the solver can both print them.

>>> fmt_bytes(3 * 2**30), fmt_bytes(1536), fmt_bytes(12)
('3.00 GiB', '1.50 KiB', '12 B')
>>> fmt_time(0.0125), fmt_time(3e-6), fmt_time(0)
('12.5 ms', '3 us', '0 s')
"""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_time", "dtype_name"]


def fmt_bytes(n: float) -> str:
    """Human-readable bytes, binary units: ``fmt_bytes(3 * 2**30) == '3.00 GiB'``."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(t: float) -> str:
    """Seconds with 3 significant digits in s, ms, us or ns: ``fmt_time(0.0125) == '12.5 ms'``."""
    if t == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


def dtype_name(dtype) -> str:
    """``torch.float32`` → ``"float32"``."""
    return str(dtype).removeprefix("torch.")
