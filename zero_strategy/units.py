"""How byte counts are shown to people: GiB (2**30 bytes), in one format everywhere.

One unit, so a reader never converts between lines (the estimate, the examples and the
start-up line all say GiB).  The ZeRO paper writes decimal GB (10**9 bytes); PAPER_GB_NOTE
says how to compare.
"""
from __future__ import annotations

import math

GIB = 2**30

# 1 GiB = 1.0737 GB; the example is the paper's Table 1 (7.5B parameters, N = 64, stage 3).
PAPER_GB_NOTE = ("Sizes are GiB (2^30 bytes). The ZeRO paper's GB are 10^9 bytes: GiB x 1.0737 = GB\n"
                 "(its Table 1's 1.88 GB, for 7.5B parameters at N = 64 in stage 3, is 1.75 GiB here).")


def gib_number(num_bytes: float) -> str:
    """The number of GiB, with two decimals, or more below 1 GiB so that three
    significant digits show (0.218, 0.00163): a small model's states are not '0.00'."""
    value = num_bytes / GIB
    decimals = 2
    if 0 < abs(value) < 1:
        decimals = min(12, max(2, 2 - math.floor(math.log10(abs(value)))))
    return f"{value:,.{decimals}f}"


def gib(num_bytes: float) -> str:
    """'1.75 GiB'."""
    return f"{gib_number(num_bytes)} GiB"


__all__ = ["GIB", "PAPER_GB_NOTE", "gib", "gib_number"]
