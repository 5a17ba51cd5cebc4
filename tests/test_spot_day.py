"""demo-spot's arithmetic (colocate/scaling/spot_day.py): the preemption rate its source gives, pod lives,
the day's bill three ways, cut streams apart from failures, the fallback against its cap, the
verdicts. Pure and fast; the demo itself runs in tests/test_sandbox_spot.py."""

from __future__ import annotations

import dataclasses
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
    pairs = spot_day.replacements(preempted, replaced)
    assert pairs[1] == (1.5, 3.0, 3.4)
    assert spot_day.back_in_service(pairs) == [42.0, 114.0, 60.0, 60.0]  # b's 23.9: the day ended
    assert spot_day.replacements([], replaced) == []
    # the same pairs, to the hour each replacement began (a's pod 0 at the next pass, b's pod 1 behind an
    # update) and from then until it served
    assert spot_day.waited_to_replace(pairs) == [12.0, 90.0, 6.0, 30.0]
    assert spot_day.replace_took(pairs) == [30.0, 24.0, 54.0, 30.0]


def test_the_days_figures_give_each_replacements_quantiles():
    d = spot_day.Day("interruptible", (served("pod-0"),), {"a": [(0.0, 1), (10.0, 0)]}, 0.21, preemptions=3,
                     replaced=3, replacements=((1.0, 1.0, 1.5), (2.0, 2.5, 3.0), (3.0, 4.0, 4.25)))
    f = spot_day.day_figures(d, PRICES, per=1000, max_pods=2, cap_usd_per_cell=20.0)
    assert f["back_in_service_min"] == {"p50": 60.0, "p90": 75.0, "n": 3}
    assert f["waited_to_replace_min"] == {"p50": 30.0, "p90": 60.0, "n": 3}
    assert f["replace_took_min"] == {"p50": 30.0, "p90": 30.0, "n": 3}
    none = {"p50": None, "p90": None, "n": 0}
    od = day("ondemand", [served("pod-0")], 10.0, 0.6)
    assert od["back_in_service_min"] == od["waited_to_replace_min"] == od["replace_took_min"] == none


def test_requests_held_by_a_sandbox_swap_are_set_apart_in_ttft():
    rows = [served("pod-0", ttft=100.0)] * 98 + [dataclasses.replace(served("pod-0", ttft=2000.0), held=True)] * 2
    f = day("interruptible", rows, 10.0, 0.21)
    assert f["ttft_ms"]["p99"] == 2000.0 and f["ttft_ms"]["n"] == 100
    assert f["ttft_ms_unheld"] == {"p50": 100.0, "p99": 100.0, "n": 98}
    od = day("ondemand", [served("pod-0", ttft=90.0)] * 100, 10.0, 0.6)
    out = spot_day.report({"ondemand": od, "interruptible": f}, PRICES, 1000)
    assert out["ttft_p99_ratio"] == pytest.approx(22.222, abs=0.001) and out["ttft_p99_ratio_unheld"] == 1.111
    assert spot_day.verdicts(out)[3][0] is False  # the verdict stays on every request
    line = spot_day.held_line(out)
    assert line is not None and line.startswith("2 of the interruptible day's requests on pods (0 on demand)")
    assert "100 ms against 90 ms: 1.11 x" in line
    assert spot_day.held_line(spot_day.report({"ondemand": od, "interruptible": od}, PRICES, 1000)) is None


def test_a_request_is_held_when_its_wait_for_a_first_token_meets_a_hold_of_its_home_or_answering_cell():
    from colocate.sandbox.spot_demo import mark_held

    class Clock:  # a 24 s day from t0 = 1000: hour h is sent at 1000 + h
        t0, day_s = 1000.0, 24.0

    rows = [Served(2.0, "a", True, "a", "pod-0", ttft_ms=500.0),  # 1002.0 to 1002.5: meets a's hold
            Served(2.0, "b", True, "b", "pod-0", ttft_ms=500.0),  # the same moment in b: no hold there
            Served(3.0, "b", True, "a", "pod-0", ttft_ms=100.0),  # answered by a, after its hold
            Served(1.0, "b", True, "a", "pod-0", ttft_ms=None, e2e_ms=1500.0),  # no first token: its whole wait
            Served(5.0, "c", False, None, None, ttft_ms=None, e2e_ms=10.0)]  # failed, no cell
    out = mark_held(rows, {"a": [(1002.4, 1002.9)], "c": []}, Clock())
    assert [s.held for s in out] == [True, False, False, True, False]
    assert out[1] is rows[1]


def test_a_replacements_boot_is_slept_short_by_the_median_update_the_cloud_would_overlap_with_it():
    from colocate.sandbox.spot_demo import KeeperDeployer, UpdateTimer

    class Clock:  # 1 second of the day is 1 ms of wall time: the 20-minute boot is 1.2 s
        def hours(self) -> float:
            return 0.0

        def wall(self, day_seconds: float) -> float:
            return day_seconds / 1000

    class Inner:
        def __init__(self):
            self.calls = []

        def replace(self, indices, replaced):
            self.calls.append(tuple(indices))

    class Biller:
        def rent(self, cell, n):
            return (cell, n)

        def rented(self, renting):
            pass

    slept: list[float] = []
    timer, inner = UpdateTimer(), Inner()
    keeper = KeeperDeployer(inner, "a", Clock(), Biller(), lambda line: None, timer, sleep=slept.append)
    assert timer.estimate() == 0.0
    keeper.replace([0], {})  # nothing measured yet: the whole boot, then the update
    assert slept == [1.2] and inner.calls == [(0,)] and len(timer.took) == 1
    timer.took[:] = [0.3, 0.5, 0.1]
    keeper.replace([1], {})
    assert slept[1] == pytest.approx(0.9)  # short by the median update, 0.3 s
    timer.took[:] = [5.0]  # an update longer than the boot: no sleep at all
    keeper.replace([0], {})
    assert slept[2] == 0.0 and keeper.replaced == 3 and [d[3] for d in keeper.done] == [(0,), (1,), (0,)]
