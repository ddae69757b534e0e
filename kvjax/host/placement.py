"""Placing requests on data-parallel ranks.

Policy (least loaded): a request goes to the rank with the fewest unfinished
requests (waiting + running) at its arrival; ties go to the lowest rank. Every
process computes the same placement from the same all-gathered loads.
"""

from __future__ import annotations

from collections.abc import Sequence


def least_loaded(loads: Sequence[int]) -> int:
    """Index of the smallest load (the lowest index among equals)."""
    if not loads:
        raise ValueError("loads must name at least one rank, got an empty sequence")
    return min(range(len(loads)), key=lambda d: (loads[d], d))
