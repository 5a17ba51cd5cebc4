"""The live view's pure part: merging a window's histograms and judging them (colocate/probe/live.py)."""

from __future__ import annotations

import random

import pytest

from colocate.cell import catalogue
from colocate.probe import live
from colocate.probe.budgets import Budget
from colocate.probe.histogram import DEFAULT_BUCKETS, Buckets, Histogram, HistogramError
from colocate.probe.stats import percentile as exact

M = 29_000_000  # a minute index (ms / 60000)


def enc(values) -> str:
    return Histogram.of(values).encode()


def requests(minute, colo, pod, n, upstream=(60, 80), total_extra=2, state=0.0):
    rng = random.Random(minute * 7 + n)
    ups = [rng.uniform(*upstream) for _ in range(n)]
    return [[minute, colo, pod, "state", enc([state] * n)], [minute, colo, pod, "upstream", enc(ups)],
            [minute, colo, pod, "fallback", enc([0] * n)], [minute, colo, pod, "total", enc([u + total_extra for u in ups])]]


def sync(minute, state_colo, worker_colo, values):
    return [minute, state_colo, worker_colo, "sync", enc(values)]


def doc(minutes, **kw):
    return {"since": (M - 5) * 60000, "now": (M + 5) * 60000, "minutes": minutes,
            "hours": kw.pop("hours", []), "region": "apac-jp", "generation": "apac-jp.g1", **kw}


JP = catalogue.region("apac-jp")


def test_percentiles_are_within_the_relative_error_of_exact_ones_bimodal_included():
    rng = random.Random(1)
    sets = ([rng.uniform(60, 100) for _ in range(400)], [rng.expovariate(1 / 40) for _ in range(250)], [12.5, 13, 250],
            [rng.uniform(40, 50) for _ in range(80)] + [rng.uniform(900, 1300) for _ in range(20)], [0.0] * 50 + [0.1, 13.0])
    err = DEFAULT_BUCKETS.relative_error
    assert 0.0108 < err < 0.0109
    for values in sets:
        h = Histogram.decode(enc(values))
        assert h.n == len(values)
        for q in (0, 10, 50, 90, 99, 100):
            want = exact(values, q)
            assert abs(h.percentile(q) - want) <= max(want * err * (1 + 1e-9), 0.25 if want < 0.25 else 0), (q, want)


def test_the_same_buckets_and_text_as_the_worker():
    b = DEFAULT_BUCKETS
    assert b.edge(0) == 0.25 and b.edge(32) == 0.5 and b.edge(b.top - 1) < 60_000 <= b.edge(b.top) and b.count == 574
    assert [b.bucket_of(v) for v in (0, 0.25, 0.2500001, 0.5, 0.5000001, 1e9)] == [0, 0, 1, 32, 33, b.top + 1]
    # worker/test/histogram.test.js writes "~200*4,*5,1,3*2" for these counts
    h = Histogram({200: 4, 201: 5, 202: 1, 205: 2})
    assert h.encode() == "~200*4,*5,1,3*2" and Histogram.decode("~200*4,*5,1,3*2") == h
    assert Buckets.from_doc({"low_ms": 0.25, "per_octave": 32, "top": 572, "count": 574}) == b
    with pytest.raises(HistogramError, match="buckets"):
        Buckets.from_doc({"low_ms": 0, "per_octave": 32, "top": 572})


def test_a_healthy_window_holds_every_check_with_shares_per_pod():
    rows = (requests(M, "NRT", "0", 300) + requests(M, "NRT", "1", 100) + requests(M + 1, "NRT", "0", 50)
            + [sync(M, "NRT", "NRT", [3, 4, 5] * 20), sync(M + 1, "NRT", "NRT", [3, 4] * 10)])
    rows.append([M, "NRT", "fallback", "total", enc([400] * 10)])  # 2 % of its minute: within the share
    r = live.build(doc(rows), JP, ["AP-JP-1", "AP-JP-1"], [Budget("state", 25), Budget("state_rtt", 40)])
    assert r.ok, r.violations
    assert r.requests == 460
    assert r.backends == {"pod-0": 350, "pod-1": 100, "fallback": 10}
    assert [p.share for p in r.pods] == [round(350 / 460, 4), round(100 / 460, 4), round(10 / 460, 4)]
    assert r.segments["state"]["p50"] == 0 and r.segments["state"]["n"] == 450
    assert 55 <= r.segments["upstream"]["p50"] <= 85
    assert 2.5 <= r.segments["sync"]["p50"] <= 6
    assert r.placement.ran.colo == "NRT" and r.placement.state.colo == "NRT"
    out = live.to_json(r)
    assert set(out["segments"]) == {"state", "upstream", "fallback", "total", "ttft", "itl", "queue", "sync"}
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
    iad = next(s for s in r.state_colos if s.colo == "IAD")
    assert iad.latest and iad.status == "out_of_region" and iad.floor_ms["NRT"] > 100
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
    with pytest.raises(live.LiveDataError, match="histogram part '999'"):
        live.build(doc([[M, "NRT", "0", "total", "~3,999"]]), JP)
    with pytest.raises(live.LiveDataError, match="a Worker older than this probe"):
        live.build(doc([[M, "NRT", "0", "total", "9:1"]]), JP)
    with pytest.raises(live.LiveDataError, match="buckets"):
        live.build(doc([], buckets={"low_ms": "x"}), JP)


def test_parse_since():
    assert live.parse_since("1h", 10_000_000) == 10_000_000 - 3_600_000
    assert live.parse_since("30m", 10_000_000) == 10_000_000 - 1_800_000
    assert live.parse_since("90", 10_000_000) == 10_000_000 - 90_000
    for bad in ("", "1x", "-1h", "0m", "h"):
        with pytest.raises(ValueError):
            live.parse_since(bad, 0)


def test_a_fleets_windows_merge_exactly_per_client_colo_and_an_unreadable_cell_fails():
    from colocate.probe import fleet_live

    rng = random.Random(5)
    jp_vals = [rng.uniform(20, 30) for _ in range(40)]
    us_vals = [rng.uniform(150, 190) for _ in range(10)]
    jp = doc([[M, "NRT", "0@NRT", "total", enc(jp_vals)], [M, "IAD", "NRT", "sync", enc([4] * 5)]], region="apac-jp")
    us = doc([[M, "IAD", "0@NRT", "total", enc(us_vals)], [M, "IAD", "0@IAD", "total", enc([9] * 7)]], region="us-east")
    windows = [fleet_live.CellWindow("apac-jp", None, jp), fleet_live.CellWindow("us-east", None, us),
               fleet_live.CellWindow("eu-west", catalogue.region("eu-west"), error="unreachable")]
    r = fleet_live.build("fl", windows, (M - 5) * 60000)
    assert not r.ok and r.violations[0]["message"] == "cell eu-west: unreachable"
    nrt = next(c for c in r.colos if c.colo == "NRT")
    assert nrt.nearest == "apac-jp" and [(s.cell, s.requests) for s in nrt.served] == [("apac-jp", 40), ("us-east", 10)]
    both = jp_vals + us_vals
    for q in (50, 90, 99):
        want = exact(both, q)
        assert abs(nrt.segments["total"][f"p{q}"] - want) <= want * DEFAULT_BUCKETS.relative_error + 0.01
    assert any("not the nearest cell apac-jp" in n for n in r.notes)
    assert r.requests == 57 and r.segments["total"]["n"] == 57 and r.segments["sync"]["n"] == 5
    assert "by client colo" in fleet_live.table(r) and fleet_live.to_json(r)["colos"][0]["colo"] == "NRT"
    # every segment a cell records is merged (a pod request's queue, a stream's ttft and itl); pick counts are not latencies
    more = doc([[M, "NRT", "0@NRT", "total", enc([30] * 3)], [M, "NRT", "0@NRT", "queue", enc([12] * 3)],
                [M, "NRT", "0@NRT", "ttft", enc([40] * 2)], [M, "NRT", "0@NRT", "affinity", enc([1] * 3)]], region="apac-jp")
    r = fleet_live.build("fl", [fleet_live.CellWindow("apac-jp", None, more), fleet_live.CellWindow("us-east", None, us)],
                         (M - 5) * 60000)
    assert r.ok and r.segments["queue"]["n"] == 3 and r.segments["ttft"]["n"] == 2 and r.segments["total"]["n"] == 20
    assert r.cells[0].segments["queue"]["n"] == 3 and "queue" in fleet_live.table(r)
    # a cell's own live view keeps the pods apart from the client colos
    one = live.build(us, catalogue.region("us-east"))
    assert one.backends == {"pod-0": 17}


def test_streams_ttft_and_itl_affinity_picks_and_each_pods_prefix_cache_are_shown():
    rows = requests(M, "NRT", "0", 40) + requests(M, "NRT", "1", 20)
    rows += [[M, "NRT", "0", "ttft", enc([120.0] * 30 + [900.0] * 10)], [M, "NRT", "0", "itl", enc([14.0] * 40)],
             [M, "NRT", "1", "ttft", enc([300.0] * 20)], [M, "NRT", "1", "itl", enc([16.0] * 20)],
             [M, "NRT", "0", "affinity", enc([0] * 36)], [M, "NRT", "0", "shed", enc([0] * 4)],
             [M, "NRT", "1", "affinity", enc([0] * 20)]]
    caches = [{"index": 0, "hits": 7500, "queries": 10000}, {"index": 1, "hits": 0, "queries": 0},
              {"index": 2, "hits": 9, "queries": 3}]  # more hits than queries: not believed
    r = live.build(doc(rows, pod_prefix=caches), JP, ["AP-JP-1", "AP-JP-1"],
                   [Budget("ttft", 1000), Budget("itl", 10)])
    assert r.segments["ttft"]["n"] == 60 and 118 <= r.segments["ttft"]["p50"] <= 302
    assert 895 <= r.segments["ttft"]["p99"] <= 910
    assert r.segments["itl"]["n"] == 60 and 13.8 <= r.segments["itl"]["p50"] <= 16.2
    # budgets on ttft and itl are judged live: itl 10 ms is broken, ttft 1000 holds
    assert [v["segment"] for v in r.violations if v["kind"] == "budget"] == ["itl"]
    pod0, pod1 = r.pods
    assert (pod0.affinity, pod0.shed, pod1.affinity, pod1.shed) == (36, 4, 20, 0)
    assert pod0.prefix_cache == {"hits": 7500, "queries": 10000, "hit_rate": 0.75}
    assert pod1.prefix_cache == {"hits": 0, "queries": 0, "hit_rate": None}
    assert live.prefix_caches(doc(rows, pod_prefix=caches)).keys() == {0, 1}
    assert pod0.segments["ttft"]["n"] == 40 and pod1.segments["itl"]["n"] == 20
    text = live.table(r)
    assert "by affinity 90%, shed by load 10%" in text and "prefix cache 75% of 10,000 tokens" in text
    assert any(line.startswith("ttft ") for line in text.splitlines())
    out = live.to_json(r)
    assert out["pods"][0]["prefix_cache"]["hit_rate"] == 0.75 and out["pods"][0]["shed"] == 4
