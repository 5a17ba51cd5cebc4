"""The fallback's share is judged (colocate/probe/fallbackshare.py): the post-deploy probe and the live
view fail when the paid API carries more than colocate:probe.maxFallbackShare while the cell has pods
in rotation, and the pods' ttft and itl are reported apart from the fallback's."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from colocate.cell import settings
from colocate.errors import ConfigError
from colocate.probe import fallbackshare, live, report
from colocate.probe.histogram import Histogram
from colocate.probe.sample import Run, Sample
from colocate.probe.timing import parse
from tests.support.sandbox import client_key, sandbox_stacks

M = 29_000_000  # a minute index


def enc(values) -> str:
    return Histogram.of(values).encode()


def rows(minute: int, who: str, n: int, segment: str = "total", ms: float = 40.0) -> list:
    return [[minute, "NRT", who, segment, enc([ms] * n)]]


def doc(listed: list) -> dict:
    syncs = [[m, "NRT", "NRT", "sync", enc([4.0] * 10)] for m in sorted({r[0] for r in listed})]  # the object in region
    return {"since": (M - 1) * 60_000, "now": (M + 3) * 60_000, "region": "apac-jp", "minutes": listed + syncs, "hours": [],
            "buckets": {"low_ms": 0.25, "per_octave": 32, "top": 572, "count": 574}}


def test_the_share_fails_above_the_ceiling_from_min_fallback_answers_on():
    over = fallbackshare.Share(3, 10, "x")
    assert over.violation(0.1)["kind"] == "fallback_share" and "30 % of x" in over.violation(0.1)["message"].replace("%", " %")
    assert fallbackshare.Share(2, 4, "x").violation(0.1) is None  # 50 %, but two answers are no alarm
    assert fallbackshare.Share(3, 30, "x").violation(0.1) is None  # exactly the ceiling holds
    assert fallbackshare.Share(30, 30, "x").violation(1.0) is None
    assert fallbackshare.Share(0, 0, "x").violation(0.1) is None


def test_a_cell_routed_to_no_pod_notes_the_share_instead_of_failing():
    s = fallbackshare.Share(30, 30, "the latest minute")
    assert s.violation(0.1, routed_pods=0) is None and "routes to no pod" in s.note(0.1, routed_pods=0)
    assert s.violation(0.1, routed_pods=2) is not None and s.note(0.1, routed_pods=2) is None


def test_the_live_view_fails_on_a_latest_minute_served_by_the_fallback_and_names_the_share():
    listed = rows(M, "0", 100) + rows(M + 1, "fallback", 40)
    r = live.build(doc(listed), None)
    assert not r.ok and r.violations[0]["kind"] == "fallback_share"
    assert r.violations[0]["share"] == 1.0 and r.violations[0]["requests"] == 40
    assert "the fallback served 100% of the latest minute's requests" in r.verdict
    assert live.to_json(r)["ok"] is False and "FAIL: the fallback served 100%" in live.table(r)
    # the next minute the pods serve again: the view holds, and says what the window saw
    healed = live.build(doc(listed + rows(M + 2, "0", 60)), None)
    assert healed.ok, healed.violations
    assert any("more than colocate:probe.maxFallbackShare" in n for n in healed.notes)
    # a cell scaled to zero serves from the fallback by design
    zero = live.build(doc(listed), None, routed_pods=0)
    assert zero.ok and any("routes to no pod" in n for n in zero.notes)


def test_the_live_views_ttft_and_itl_are_the_pods_and_the_fallbacks_are_apart():
    listed = (rows(M, "0", 50) + rows(M, "0", 20, "ttft", 80.0) + rows(M, "0", 20, "itl", 15.0)
              + rows(M, "fallback", 2) + rows(M, "fallback", 2, "ttft", 900.0) + rows(M, "fallback", 2, "itl", 40.0))
    r = live.build(doc(listed), None)
    assert r.ok, r.violations
    assert r.segments["ttft"]["n"] == 20 and r.segments["ttft"]["p99"] < 100  # no fallback stream in it
    assert r.segments["itl"]["n"] == 20 and r.segments["itl"]["p99"] < 20
    assert r.fallback_streams["ttft"]["n"] == 2 and r.fallback_streams["ttft"]["p50"] > 800
    out = live.to_json(r)
    assert out["fallback_streams"]["itl"]["n"] == 2 and out["max_fallback_share"] == fallbackshare.DEFAULT_MAX_SHARE
    fallback_line = next(line for line in live.table(r).splitlines()
                         if line.strip().startswith("fallback ") and "upstream p50" in line)
    assert "ttft p50" in fallback_line


def sample(kind: str, backend: str, ttft: float | None = None) -> Sample:
    return Sample(kind, 50.0, 200, None, parse("state;dur=0, upstream;dur=30, total;dur=31"), backend=backend,
                  ttft_ms=ttft, itl_ms=None if ttft is None else 15.0, tokens=None if ttft is None else 20)


def run_of(routed: list[Sample], streamed: list[Sample]) -> Run:
    probe = Sample("probe", 5.0, 200, None, parse("state_rtt;dur=3, pod_rtt;dur=4"),
                   body={"worker_colo": "NRT", "state_colo": "NRT", "region": "apac-jp"})
    return Run("https://cell.test", "m", probe, probe=[probe] * len(routed), routed=routed, streamed=streamed)


def test_the_probe_fails_when_the_fallback_answers_over_the_share_and_keeps_its_streams_apart():
    r = report.build(run_of([sample("routed", "fallback")] * 10, [sample("stream", "fallback", 900.0)] * 2),
                     None, None, [])
    assert not r.ok and r.violations[0]["kind"] == "fallback_share"
    assert r.violations[0]["fallback"] == 12 and "the fallback served 100% of the probe's answers" in r.verdict
    assert r.segments["ttft"]["n"] == 0 and r.fallback_streams["ttft"]["n"] == 2
    assert "the fallback's streams" in report.table(r)
    held = report.build(run_of([sample("routed", "pod-0")] * 10, [sample("stream", "pod-0", 80.0)] * 2),
                        None, None, [], max_fallback_share=0.1)
    assert held.ok, held.violations
    assert held.segments["ttft"]["n"] == 2 and held.fallback_streams == {}


def test_the_setting_is_a_share_from_0_to_1():
    from tests.test_settings_numbers import parse

    assert settings.PROBE_DEFAULTS["maxFallbackShare"] == fallbackshare.DEFAULT_MAX_SHARE
    assert parse(**{"probe.maxFallbackShare": "0.25"}).max_fallback_share == 0.25
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ConfigError, match="probe.maxFallbackShare"):
            parse(**{"probe.maxFallbackShare": bad})


@pytest.mark.slow
def test_with_the_pod_down_the_live_view_exits_1_naming_the_share_and_the_pods_ttft_apart(tmp_path, capsys):
    import requests

    from colocate.sandbox import supervisor
    from scripts import probe

    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    state_dir = tmp_path / "state"
    try:
        cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        key = client_key(cell, "share", rpm=0, tpm=0)["key"]
        url, headers = cell["worker_url"] + "/v1/chat/completions", {"Authorization": f"Bearer {key}"}

        def send(stream: bool) -> str:
            body = {"model": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": stream}
            r = requests.post(url, json=body, headers=headers, timeout=30, stream=stream)
            assert r.status_code == 200, r.text[:300]
            _ = r.content
            return r.headers["x-colocate-backend"]

        assert {send(True) for _ in range(4)} == {"pod-0"}
        os.kill(cell["pods"][0]["pid"], signal.SIGKILL)
        served = [send(stream=i % 2 == 0) for i in range(12)]
        assert served.count("fallback") >= 10, served  # the first may still fail over on the dead pod's connection
        out = tmp_path / "live.json"
        code = None
        for _ in range(40):  # the isolates' syncs carry the histograms within about a second
            code = probe.main(["--state-dir", str(state_dir), "--live", "--since", "10m", "--json", str(out)])
            doc = json.loads(out.read_text())
            if doc["backends"].get("fallback", 0) >= served.count("fallback"):
                break
            time.sleep(0.5)
        printed = capsys.readouterr().out
    finally:
        supervisor.down(state_dir, quiet=True)
    assert code == 1, printed
    assert doc["violations"][0]["kind"] == "fallback_share" and "the fallback served" in doc["verdict"]
    assert doc["segments"]["ttft"]["n"] == 4  # the pod's four streams, and no more
    assert doc["fallback_streams"]["ttft"]["n"] >= 5
    assert "FAIL: the fallback served" in printed


def test_an_outage_that_straddles_a_minute_fails_the_live_view_and_a_minute_of_pods_clears_it():
    from colocate.probe.live import Merged, Minute, fallback_share

    def minutes(*rows: tuple[int, int]) -> Merged:
        m = Merged()
        for i, (requests, fallback) in enumerate(rows):
            m.minutes[i * 60_000] = Minute(i * 60_000, 60_000, requests=requests, fallback=fallback)
        return m

    # The pod died late in a minute: 11 of its 15 answers were the fallback's, the next minute has one so far.
    violation, _ = fallback_share(minutes((15, 11), (1, 1)), 0.1, routed_pods=1)
    assert violation is not None and violation["fallback"] == 12 and violation["requests"] == 16
    assert "the latest two minutes" in violation["message"]
    # Pods serve again: a minute of three pod answers is judged alone, and clears the view.
    violation, notes = fallback_share(minutes((15, 11), (3, 0)), 0.1, routed_pods=1)
    assert violation is None and "the latest minute is within it" in notes[-1]
    # Two quiet minutes of one fallback answer each are not an alarm (fewer than MIN_FALLBACK).
    assert fallback_share(minutes((1, 1), (1, 1)), 0.1, routed_pods=1)[0] is None
