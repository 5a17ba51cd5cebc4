"""demo-spot's arithmetic (colocate/scaling/spot_day.py): the preemption rate its source gives, pod lives,
the day's bill three ways, cut streams apart from failures, the fallback against its cap, the
verdicts. Pure and fast; the demo itself runs in tests/test_sandbox_spot.py."""

from __future__ import annotations

import random

import pytest

from colocate.scaling import spot_day
from colocate.scaling.day import Prices, Served

PRICES = Prices(pod_per_hr=0.6, api_per_1m=0.3)


def test_the_rate_is_the_traces_count_over_its_hours_and_lives_are_exponential_at_it():
    assert pytest.approx(0.468, abs=0.001) == spot_day.PREEMPTIONS_PER_HOUR
    assert "202 preemptions in 431.2 hours" in spot_day.PREEMPTION_SOURCE
    rng = random.Random(7)
    lives = [spot_day.lifetime_h(rng) for _ in range(20000)]
    assert sum(lives) / len(lives) == pytest.approx(1 / spot_day.PREEMPTIONS_PER_HOUR, rel=0.05)
    assert spot_day.lifetime_h(rng, 0.0) == float("inf")


def test_quantiles_are_nearest_rank():
    assert spot_day.quantile([], 0.5) is None
    assert spot_day.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert spot_day.quantile(list(map(float, range(1, 101))), 0.99) == 99.0


def served(backend: str, ok: bool = True, cut: bool = False, tokens: int = 100, ttft: float | None = 50.0,
           home: str = "a") -> Served:
    return Served(1.0, home, ok, "a", backend, tokens, 80.0, None if ok else "x", ttft_ms=ttft, cut=cut)


def day(market: str, rows: list[Served], pods: float, price: float) -> dict:
    d = spot_day.Day(market, tuple(rows), {"a": [(0.0, 1), (pods, 0)]}, price, preemptions=2, replaced=2)
    return spot_day.day_figures(d, PRICES, per=1000, max_pods=2, cap_usd_per_cell=20.0)


def test_a_cut_stream_is_counted_apart_from_the_failed_and_ttft_is_the_pods_alone():
    rows = [served("pod-0"), served("pod-1", ttft=500.0), served("fallback", ttft=9000.0),
            served("pod-0", ok=False, cut=True), served("-", ok=False, ttft=None)]
    f = day("interruptible", rows, 10.0, 0.21)
    assert (f["requests"], f["failed"], f["cut"]) == (5, 1, 1)
    assert f["ttft_ms"] == {"p50": 50.0, "p99": 500.0, "n": 2}  # the fallback's 9 s is not the pods'
    assert f["fallback"]["share"] == 0.25  # 1 of the 4 answered (the cut one began at a pod)
    # 100 tokens x 1000 on the API at $0.30 per 1M; 10 pod-hours at $0.21
    assert f["cost"] == {"autoscaled": 2.13, "pods": 2.1, "fallback": 0.03, "fixed": 28.8, "api": 0.15}


def test_the_verdicts_hold_or_fail_on_each_done_when_figure():
    od = day("ondemand", [served("pod-0", ttft=100.0)] * 10, 10.0, 0.6)
    good = day("interruptible", [served("pod-0", ttft=110.0)] * 10, 10.0, 0.21)
    out = spot_day.report({"ondemand": od, "interruptible": good}, PRICES, 1000)
    assert out["cost_ratio"] == 0.35 and out["ttft_p99_ratio"] == 1.1
    assert [ok for ok, _ in spot_day.verdicts(out)] == [True, True, True, True]
    slow = day("interruptible", [served("pod-0", ttft=130.0)] * 9 + [served("fallback", tokens=10**6)], 10.0, 0.21)
    out = spot_day.report({"ondemand": od, "interruptible": slow}, PRICES, 1000)
    # $300 of the day's fallback ($0.30 of the requests sent): within the cap scaled as the spend is
    # ($20 x 1000), over $20 itself (said); the bill far over 0.55x; p99 1.3x
    assert [ok for ok, _ in spot_day.verdicts(out)] == [False, True, True, False]
    assert "against $20 itself over in a" in spot_day.verdicts(out)[2][1]
    # $30,000 of the day's ($30 sent): over the Worker's cap as it counted it
    over = day("interruptible", [served("pod-0", ttft=100.0)] * 9 + [served("fallback", tokens=10**8)], 10.0, 0.21)
    out = spot_day.report({"ondemand": od, "interruptible": over}, PRICES, 1000)
    assert [ok for ok, _ in spot_day.verdicts(out)][2] is False
    failed = day("interruptible", [served("pod-0", ttft=100.0)] * 9 + [served("-", ok=False, ttft=None)], 10.0, 0.21)
    out = spot_day.report({"ondemand": od, "interruptible": failed}, PRICES, 1000)
    assert [ok for ok, _ in spot_day.verdicts(out)] == [True, False, True, True]


def test_back_in_service_runs_from_each_preemption_to_its_index_serving_again():
    preempted = [(1.0, "a", 0), (1.5, "b", 1), (2.0, "a", 1), (5.0, "a", 0), (23.9, "b", 0)]
    replaced = [
        (1.2, 1.7, "a", (0,)),  # a's pod 0: found at its next pass, served 42 min after it went
        (1.1, 1.6, "b", (0,)),  # another index of b: not pod 1's
        (2.1, 3.0, "a", (1,)),  # a's pod 1, alone
        (4.0, 4.5, "a", (0,)),  # decided before a's second preemption of pod 0: not its replacement
        (5.5, 6.0, "a", (0, 1)),  # ...this one is
        (3.0, 3.4, "b", (0, 1)),  # b's pod 1, in one update with pod 0
    ]
    assert spot_day.back_in_service(preempted, replaced) == [42.0, 114.0, 60.0, 60.0]  # b's 23.9: the day ended
    assert spot_day.back_in_service([], replaced) == []


def test_the_days_figures_give_the_back_in_service_quantiles():
    d = spot_day.Day("interruptible", (served("pod-0"),), {"a": [(0.0, 1), (10.0, 0)]}, 0.21, preemptions=3,
                     replaced=3, back_min=(25.0, 30.0, 90.0))
    f = spot_day.day_figures(d, PRICES, per=1000, max_pods=2, cap_usd_per_cell=20.0)
    assert f["back_in_service_min"] == {"p50": 30.0, "p90": 90.0, "n": 3}
    assert day("ondemand", [served("pod-0")], 10.0, 0.6)["back_in_service_min"] == {"p50": None, "p90": None, "n": 0}
