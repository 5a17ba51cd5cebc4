"""Several pods behind one router in real workerd: spreading, per-pod breakers, a retry on
another pod before the fallback, and the probe's per-pod round trips."""

import concurrent.futures
import time

import pytest

from tests.support.workerd import auth, chat, running_cell

pytestmark = pytest.mark.slow


def runtime(**over):
    return {"deadlineMs": 2000, "stateTtlMs": 60_000, "openMs": 60_000, "failureThreshold": 2, **over}


def test_concurrent_requests_spread_over_the_pods():
    with running_cell(runtime(), pods=2, compute_ms=150) as cell:
        cell.call("GET", "/v1/models")  # warm
        before = [p.requests for p in cell.pods]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            res = list(ex.map(lambda _: cell.call("POST", "/v1/chat/completions", body=chat()), range(16)))
        assert [r.status for r in res] == [200] * 16
        backends = [r.headers["x-colocate-backend"] for r in res]
        assert set(backends) == {"pod-0", "pod-1"}
        served = [p.requests - b for p, b in zip(cell.pods, before, strict=True)]
        assert min(served) >= 4, served  # fewest-in-flight keeps both busy


def test_a_dead_pod_costs_no_request_its_breaker_opens_alone():
    with running_cell(runtime(), pods=2, compute_ms=1) as cell:
        cell.pods[0].set_fault("error")
        res = []
        # Ties are broken at random: go on until pod 0 was tried failureThreshold times (bounded).
        while cell.pods[0].requests < 2 and len(res) < 200:
            res.append(cell.call("POST", "/v1/chat/completions", body=chat()))
        assert cell.pods[0].requests >= 2
        assert [r.status for r in res] == [200] * len(res)
        assert {r.headers["x-colocate-backend"] for r in res} == {"pod-1"}  # retried there, never the fallback
        assert cell.fallback.requests == 0
        snap = cell.wait_for(lambda s: s["pods"][0]["state"] == "open")
        assert snap["pods"][0]["state"] == "open" and snap["pods"][1]["state"] == "closed"
        tried = cell.pods[0].requests
        for _ in range(5):
            assert cell.call("GET", "/v1/models").headers["x-colocate-backend"] == "pod-1"
        assert cell.pods[0].requests == tried  # open: not tried any more


def test_both_pods_down_goes_to_the_fallback_after_one_retry():
    with running_cell(runtime(), pods=3, compute_ms=1) as cell:
        for p in cell.pods:
            p.set_fault("error")
        before = sum(p.requests for p in cell.pods)
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
        assert sum(p.requests for p in cell.pods) == before + 2  # the chosen pod and one other, not all three


def test_a_deadline_miss_is_not_retried_on_another_pod():
    with running_cell(runtime(deadlineMs=300), pods=2, compute_ms=1) as cell:
        for p in cell.pods:
            p.set_fault("slow", delay_ms=1000)
        before = sum(p.requests for p in cell.pods)
        t = time.monotonic()
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.headers["x-colocate-backend"] == "fallback"
        assert time.monotonic() - t < 1.0  # the deadline holds: no second 300 ms wait
        assert sum(p.requests for p in cell.pods) == before + 1


def test_probe_reports_every_pod():
    with running_cell(runtime(), pods=2, compute_ms=1) as cell:
        cell.pods[1].set_fault("error")
        body = cell.call("GET", "/_colocate/probe", headers=auth()).json()
        assert [(p["index"], p["host"], p["ok"]) for p in body["pods"]] == [
            (0, f"127.0.0.1:{cell.pods[0].port}", True), (1, f"127.0.0.1:{cell.pods[1].port}", False)]
        assert all(isinstance(p["rtt_ms"], (int, float)) for p in body["pods"])
        assert [p["index"] for p in body["breaker"]["pods"]] == [0, 1]
