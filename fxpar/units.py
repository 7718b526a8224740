"""Units shown to people: byte counts in binary units. Imports nothing of fxpar, so plain-data
modules (:mod:`fxpar.plan_data`) and the solver can both print sizes.

>>> fmt_bytes(3 * 2**30), fmt_bytes(1536), fmt_bytes(12)
('3.00 GiB', '1.50 KiB', '12 B')
"""

from __future__ import annotations

__all__ = ["fmt_bytes"]


def fmt_bytes(n: float) -> str:
    """Human-readable bytes, binary units: ``fmt_bytes(3 * 2**30) == '3.00 GiB'``."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
