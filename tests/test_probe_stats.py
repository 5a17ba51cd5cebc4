"""Percentiles: linear interpolation (numpy's default), None for no data."""

import random

import numpy
import pytest

from colocate.probe.stats import percentile, summary


def test_matches_numpy_linear_interpolation_on_random_data():
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 25, 101):
        data = [rng.uniform(0, 500) for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(data, q) == pytest.approx(float(numpy.percentile(data, q)), abs=1e-9)


def test_known_values():
    data = list(range(1, 26))  # 1..25
    assert percentile(data, 50) == 13
    assert percentile(data, 10) == pytest.approx(3.4)
    assert percentile(data, 99) == pytest.approx(24.76)
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input, even count


def test_empty_is_none_not_zero():
    assert percentile([], 50) is None
    assert summary([]) == {"p10": None, "p50": None, "p90": None, "p99": None, "n": 0}


def test_summary_rounds_and_counts():
    s = summary([1.234, 2.345, 3.456])
    assert s["n"] == 3 and s["p50"] == 2.35  # 2.345 rounds to 2.35 (binary: 2.3450000000000002)
    assert list(s) == ["p10", "p50", "p90", "p99", "n"]


@pytest.mark.parametrize("q", [-1, 100.5])
def test_rejects_out_of_range(q):
    with pytest.raises(ValueError, match="0..100"):
        percentile([1.0], q)
