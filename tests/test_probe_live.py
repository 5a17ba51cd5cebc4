"""The live view's pure part: merging a window's histograms and judging them (colocate/probe/live.py)."""

from __future__ import annotations

import random

import pytest

from colocate import catalogue
from colocate.probe import live
from colocate.probe.budgets import Budget
from colocate.probe.stats import percentile as exact

EDGES = live.DEFAULT_EDGES
M = 29_000_000  # a minute index (ms / 60000)


def enc(values) -> str:
    counts = [0] * (len(EDGES) + 1)
    for v in values:
        counts[live.bucket_of(v, EDGES)] += 1
    return ",".join(f"{k}:{c}" for k, c in enumerate(counts) if c)


def width_at(ms: float) -> float:
    lo, hi = live.bounds(live.bucket_of(ms, EDGES), EDGES)
    return hi - lo


def requests(minute, colo, pod, n, upstream=(60, 80), total_extra=2, state=0.0):
    rng = random.Random(minute * 7 + n)
    ups = [rng.uniform(*upstream) for _ in range(n)]
    return [[minute, colo, pod, "state", enc([state] * n)], [minute, colo, pod, "upstream", enc(ups)],
            [minute, colo, pod, "fallback", enc([0] * n)], [minute, colo, pod, "total", enc([u + total_extra for u in ups])]]


def sync(minute, state_colo, worker_colo, values):
    return [minute, state_colo, worker_colo, "sync", enc(values)]


def doc(minutes, **kw):
    return {"since": (M - 5) * 60000, "now": (M + 5) * 60000, "edges": list(EDGES), "minutes": minutes,
            "hours": kw.pop("hours", []), "region": "apac-jp", "generation": "apac-jp.g1", **kw}


JP = catalogue.region("apac-jp")


def test_percentiles_match_exact_ones_within_a_bucket():
    rng = random.Random(1)
    for values in ([rng.uniform(60, 100) for _ in range(400)], [rng.expovariate(1 / 40) for _ in range(250)], [12.5, 13, 250]):
        counts = live.decode(enc(values), len(EDGES) + 1)
        for q in (10, 50, 90, 99):
            want = exact(values, q)
            data = sorted(values)
            pos = (len(data) - 1) * q / 100
            tol = max(width_at(data[int(pos)]), width_at(data[min(len(data) - 1, int(pos) + 1)]))
            assert abs(live.percentile(counts, q, EDGES) - want) <= tol


def test_matches_the_worker_edges_formula():
    assert len(EDGES) == 40 and EDGES[0] == 0.25 and EDGES[-1] == 60000
    assert all(1.37 < b / a < 1.38 for a, b in zip(EDGES, EDGES[1:], strict=False))


def test_a_healthy_window_holds_every_check_with_shares_per_pod():
    rows = (requests(M, "NRT", "0", 300) + requests(M, "NRT", "1", 100) + requests(M + 1, "NRT", "0", 50)
            + [sync(M, "NRT", "NRT", [3, 4, 5] * 20), sync(M + 1, "NRT", "NRT", [3, 4] * 10)])
    rows.append([M + 1, "NRT", "fallback", "total", enc([400] * 10)])
    r = live.build(doc(rows), JP, ["AP-JP-1", "AP-JP-1"], [Budget("state", 25), Budget("state_rtt", 40)])
    assert r.ok, r.violations
    assert r.requests == 460
    assert r.backends == {"pod-0": 350, "pod-1": 100, "fallback": 10}
    assert [p["share"] for p in r.pods] == [round(350 / 460, 4), round(100 / 460, 4), round(10 / 460, 4)]
    assert r.segments["state"]["p50"] == 0 and r.segments["state"]["n"] == 450
    assert 55 <= r.segments["upstream"]["p50"] <= 85
    assert 2.5 <= r.segments["sync"]["p50"] <= 6
    assert r.placement.ran.colo == "NRT" and r.placement.state.colo == "NRT"
    out = live.to_json(r)
    assert set(out["segments"]) == {"state", "upstream", "fallback", "total", "sync"}
    assert set(out["segments"]["sync"]) == {"p10", "p50", "p90", "p99", "n"}
    assert "OK: all checks hold" in live.table(r)


def test_a_split_is_flagged_on_the_latest_minute_with_segment_and_colo():
    rows = requests(M, "NRT", "0", 100) + [sync(M, "NRT", "NRT", [4] * 30)]
    rows += requests(M + 1, "NRT", "0", 100) + [sync(M + 1, "IAD", "NRT", [170, 175, 180] * 10)]
    r = live.build(doc(rows), JP, ["AP-JP-1"], [Budget("state_rtt", 40)])
    assert not r.ok
    state = [v for v in r.violations if v["kind"] == "placement"]
    assert len(state) == 1 and state[0]["part"] == "state"
    msg = state[0]["message"]
    assert "state object runs in IAD" in msg and "segment sync (state_rtt), state colo IAD" in msg
    assert r.placement.state.seen == {"NRT": 30, "IAD": 30}
    iad = next(s for s in r.state_colos if s["colo"] == "IAD")
    assert iad["latest"] and iad["status"] == "out_of_region" and iad["floor_ms"]["NRT"] > 100
    # the whole window's sync p50 sits between the two; the budget is judged on it
    assert "FAIL:" in live.table(r)


def test_after_the_fix_the_split_clears_and_stays_as_a_note():
    rows = requests(M, "NRT", "0", 100) + [sync(M, "IAD", "NRT", [175] * 30)]
    rows += requests(M + 1, "NRT", "0", 100) + [sync(M + 1, "NRT", "NRT", [4] * 300)]
    r = live.build(doc(rows), JP, ["AP-JP-1"], [Budget("state_rtt", 40)])
    assert r.ok, r.violations
    assert any("answered from IAD (out of region)" in n for n in r.notes)


def test_the_worker_out_of_region_fails_and_names_the_colo():
    rows = requests(M, "IAD", "0", 50) + [sync(M, "NRT", "IAD", [170] * 10)]
    r = live.build(doc(rows), JP, ["AP-JP-1"])
    assert not r.ok
    assert r.violations[0]["part"] == "ran" and "Worker runs in IAD" in r.violations[0]["message"]
    assert "Worker colo IAD" in r.violations[0]["message"]


def test_budgets_on_live_segments_only_and_no_traffic_judges_nothing():
    rows = requests(M, "NRT", "0", 100, upstream=(300, 320)) + [sync(M, "NRT", "NRT", [4] * 30)]
    r = live.build(doc(rows), JP, ["AP-JP-1"], [Budget("upstream", 100), Budget("e2e", 500), Budget("pod_rtt", 10)])
    assert [v["segment"] for v in r.violations] == ["upstream"]
    assert sum("not checked live" in n for n in r.notes) == 2
    empty = live.build(doc([]), JP, ["AP-JP-1"], [Budget("state", 25)])
    assert empty.ok and empty.requests == 0 and "nothing to judge" in empty.verdict
    assert empty.segments["total"]["p50"] is None


def test_hours_and_minutes_merge():
    rows = requests(M, "NRT", "0", 10)
    hours = [[M // 60 - 200, "NRT", "0", "total", enc([70] * 40)]]
    r = live.build(doc(rows, hours=hours), JP, ["AP-JP-1"])
    assert r.requests == 50


def test_bad_rows_name_the_field():
    with pytest.raises(live.LiveDataError, match="minutes row"):
        live.build(doc([[M, "NRT", "0", "bogus", ""]]), JP)
    with pytest.raises(live.LiveDataError, match="histogram part '99:1'"):
        live.build(doc([[M, "NRT", "0", "total", "99:1"]]), JP)


def test_parse_since():
    assert live.parse_since("1h", 10_000_000) == 10_000_000 - 3_600_000
    assert live.parse_since("30m", 10_000_000) == 10_000_000 - 1_800_000
    assert live.parse_since("90", 10_000_000) == 10_000_000 - 90_000
    for bad in ("", "1x", "-1h", "0m", "h"):
        with pytest.raises(ValueError):
            live.parse_since(bad, 0)
