"""Percentiles of a list of milliseconds.

Linear interpolation between closest ranks (numpy's default, "type 7"), so p50 of an
even-sized list is the mean of the two middle values and p99 of 25 samples lies between
the two largest. An empty list has no percentiles: ``None``, shown as ``n/a``, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

PERCENTILES = ("p10", "p50", "p90", "p99")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summary(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{"p10", "p50", "p90", "p99", "n"}`` for one segment, rounded to 0.01 ms."""
    data = [float(v) for v in values]
    out: dict[str, float | int | None] = {}
    for name in PERCENTILES:
        p = percentile(data, float(name[1:]))
        out[name] = None if p is None else round(p, 2)
    out["n"] = len(data)
    return out
