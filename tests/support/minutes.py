"""Tests whose assertions count one minute's requests (rpm windows, minute buckets)."""

from __future__ import annotations

import time


def fresh_minute(need_s: float) -> None:
    """Return with at least ``need_s`` left in this UTC minute (a bounded wait of at most
    ``need_s``), so a minute that ends mid-test cannot split the counts it asserts on."""
    left = 60 - time.time() % 60
    if left < need_s:
        time.sleep(left + 0.2)
