"""The live view end to end in real workerd: the router records, the sync carries, the object
keeps, GET /_colocate/live reads, probe.py --live judges. Accuracy against the clients' own
Server-Timing; the histograms survive a generation migration."""

from __future__ import annotations

import json
import time

import pytest

from colocate.probe import live
from colocate.probe.stats import percentile as exact
from scripts import probe
from tests.support.workerd import SECRETS, auth, cell_plan, chat, running_cell

pytestmark = pytest.mark.slow
ROUTED = ("state", "upstream", "fallback", "total")


def live_doc(cell, since_ms: int | None = None) -> dict:
    q = "" if since_ms is None else f"?since={since_ms}"
    res = cell.call("GET", f"/_colocate/live{q}", headers=auth())
    assert res.status == 200, res.body
    return res.json()


def wait_live(cell, since_ms: int, requests: int, timeout_s: float = 20.0) -> dict:
    """Poll until the object holds `requests` routed requests (syncs carry them within ~a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = live_doc(cell, since_ms)
        n = sum(sum(live.decode(r[4], len(doc["edges"]) + 1)) for r in doc["minutes"] if r[3] == "total")
        if n >= requests or time.monotonic() > deadline:
            return doc
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 300}, compute_ms=3) as c:
        yield c


def test_live_percentiles_agree_with_the_clients_server_timing(cell):
    since = int(time.time() * 1000) - 1000
    seen: dict[str, list[float]] = {s: [] for s in ROUTED}
    n = 60
    for i in range(n):
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.status == 200
        for s in ROUTED:
            seen[s].append(res.timing()[s])
        if i % 10 == 0:
            time.sleep(0.35)  # let background syncs happen: the sync segment gets samples too
    # one more request after a pause: its batch carries everything recorded before it
    time.sleep(0.5)
    res = cell.call("POST", "/v1/chat/completions", body=chat())
    for s in ROUTED:
        seen[s].append(res.timing()[s])
    doc = wait_live(cell, since, n + 1)
    assert doc["edges"] == list(live.DEFAULT_EDGES) or len(doc["edges"]) == 40
    result = live.build(doc, None, ["local"])
    assert result.requests == n + 1 and result.backends == {"pod-0": n + 1}
    edges = tuple(doc["edges"])
    for s in ROUTED:
        data = sorted(seen[s])
        assert result.segments[s]["n"] == len(data)
        for q in (10, 50, 90, 99):
            pos = (len(data) - 1) * q / 100
            lo, hi = data[int(pos)], data[min(len(data) - 1, int(pos) + 1)]
            width = max(_width(lo, edges), _width(hi, edges))
            got = result.segments[s][f"p{q}"]
            assert abs(got - exact(data, q)) <= width + 0.01, (s, q, got, exact(data, q))
    assert result.segments["sync"]["n"] >= 1  # the isolates' own round trips


def _width(ms: float, edges) -> float:
    lo, hi = live.bounds(live.bucket_of(ms, edges), edges)
    return hi - lo


def test_the_endpoint_needs_the_probe_token_and_a_time(cell):
    assert cell.call("GET", "/_colocate/live").status == 401
    bad = cell.call("GET", "/_colocate/live?since=yesterday", headers=auth())
    assert bad.status == 400 and '"since"' in bad.json()["error"]["message"]
    doc = live_doc(cell)
    assert doc["region"] == "us-east" and doc["generation"] == "us-east.g1"
    assert doc["now"] - doc["since"] == pytest.approx(3_600_000, abs=60_000)
    # a week back is answered per hour, folded by the Worker
    week = live_doc(cell, int(time.time() * 1000) - 7 * 24 * 3_600_000)
    assert week["minutes"] == [] and all(r[3] in live.SEGMENTS for r in week["hours"])


def test_probe_live_prints_the_table_and_json_and_fails_on_an_unknown_worker_colo(cell, capsys, monkeypatch, tmp_path):
    # Offline workerd has no /cdn-cgi/trace: the Worker's colo is unknown, which the live view,
    # like the probe, never calls fine (exit 1). The sandbox tests the colos themselves.
    monkeypatch.setenv("COLOCATE_PROBE_TOKEN", SECRETS["PROBE_TOKEN"])
    for _ in range(3):
        assert cell.call("POST", "/v1/chat/completions", body=chat()).status == 200
    time.sleep(0.5)
    assert cell.call("POST", "/v1/chat/completions", body=chat()).status == 200
    out_json = tmp_path / "live.json"
    # The last request's histogram travels with the isolate's next flush (within a second of
    # it; later on a loaded machine): ask until all four are in, for a bounded time.
    deadline = time.monotonic() + 15
    while True:
        code = probe.main([cell.url, "--live", "--since", "15m", "--expect-region", "us-east", "--json", str(out_json),
                           "--plot", str(tmp_path / "live.png"), "--budget", "total=5000"])
        text = capsys.readouterr().out
        doc = json.loads(out_json.read_text())
        if doc["segments"]["total"]["n"] >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert code == 1, text
    assert "colocate live view" in text and "Worker colo unknown" in text
    assert doc["live"] is True and set(doc["segments"]["total"]) == {"p10", "p50", "p90", "p99", "n"}
    assert doc["segments"]["total"]["n"] >= 4
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    assert probe.main([cell.url, "--live", "--since", "5x"]) == 2
    assert "--since '5x'" in capsys.readouterr().err


def test_histograms_move_with_the_generation(tmp_path):
    g1 = [{"name": "us-east.g1", "region": "us-east", "status": "active"}]
    moved = [{"name": "us-east.g1", "region": "us-east", "status": "draining"},
             {"name": "us-east.g2", "region": "us-east", "status": "active"}]
    since = int(time.time() * 1000) - 1000
    with running_cell({"stateTtlMs": 300}, generations=g1, storage_dir=tmp_path / "do", compute_ms=1) as cell:
        for _ in range(5):
            assert cell.call("POST", "/v1/chat/completions", body=chat()).status == 200
        time.sleep(0.5)
        assert cell.call("POST", "/v1/chat/completions", body=chat()).status == 200
        before = live.build(wait_live(cell, since, 6), None).requests
        assert before >= 6
        cell.restart(cell_plan({"stateTtlMs": 300}, generations=moved))
        doc = live_doc(cell, since)  # the first touch of g2 imports g1, histograms included
        assert doc["generation"] == "us-east.g2"
        assert live.build(doc, None).requests == before


# --- the object's tables, driven directly (bench/gen_driver.js) --------------------------

def _info(gen: str) -> dict:
    return {"generation": gen, "draining": None, "haveRev": -1, "isolate": "iso_live", "ttlMs": 2000, "keys": [],
            "failureThreshold": 3, "openMs": 30000, "deadlineMs": 2000}


def _hist_batch(rows) -> dict:
    return {"hist": rows}


def test_the_object_adds_rolls_up_and_drops_by_age():
    from tests.support.workerd import driven_cell

    now_min = int(time.time() // 60)
    day = 24 * 60
    with driven_cell({"stateTtlMs": 60_000}, with_key=False) as cell:
        # the same minute from two isolates adds up; a malformed row is dropped, never stored
        for _ in range(2):
            cell.one("sync", _info("live-a"), _hist_batch([[now_min, "NRT", "0", "total", "20:3"],
                                                           [now_min, "NRT", "0", "total", "99:1"],
                                                           [now_min, "NRT", "0", "bogus", "1:1"]]), gen="live-a")
        got = cell.one("live", (now_min - 5) * 60_000, _info("live-a"), gen="live-a")
        assert got["minutes"] == [[now_min, "NRT", "0", "total", "20:6"]] and got["hours"] == []

        # a minute 8 days old rolls up into its hour on the next sync (at most an hour of minutes a minute)
        old = (now_min - 8 * day) // 60 * 60  # the first minute of an hour: both rows share it
        cell.one(
            "sync",
            _info("live-b"),
            _hist_batch([[old, "NRT", "0", "total", "20:2"], [old + 1, "NRT", "0", "total", "21:1"]]),
            gen="live-b",
        )
        got = cell.one("live", (now_min - 9 * day) * 60_000, _info("live-b"), gen="live-b")
        assert got == {"minutes": [], "hours": [[old // 60, "NRT", "0", "total", "20:2,21:1"]]}

        # hours older than 35 days are dropped
        ancient = now_min - 36 * day
        cell.one("sync", _info("live-c"), _hist_batch([[ancient, "NRT", "0", "total", "20:2"]]), gen="live-c")
        got = cell.one("live", (now_min - 40 * day) * 60_000, _info("live-c"), gen="live-c")
        assert got == {"minutes": [], "hours": []}
