"""Several pods behind one router in real workerd: spreading, per-pod breakers, a retry on
another pod before the fallback, and the probe's per-pod round trips."""

import concurrent.futures
import contextlib
import http.client
import json
import time
from collections.abc import Iterator

import pytest

from tests.support.streams import leave_after_first_event, poll
from tests.support.workerd import auth, chat, running_cell

USAGE = {"stream_options": {"include_usage": True}}

pytestmark = pytest.mark.slow


def runtime(**over):
    return {"deadlineMs": 2000, "stateTtlMs": 60_000, "openMs": 60_000, "failureThreshold": 2, **over}


def test_concurrent_requests_spread_over_the_pods():
    # balance load: its fewest-in-flight choice is the subject. Prefix (the default) keeps one
    # conversation on its pod up to its load bound: 12 and 4 of 16 here, at the assertion's edge (its spread: affinity.test.js).
    with running_cell(runtime(balance="load"), pods=2, compute_ms=150) as cell:
        cell.call("GET", "/v1/models")  # warm
        before = [p.requests for p in cell.pods]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            res = list(ex.map(lambda _: cell.call("POST", "/v1/chat/completions", body=chat()), range(16)))
        assert [r.status for r in res] == [200] * 16
        backends = [r.headers["x-colocate-backend"] for r in res]
        assert set(backends) == {"pod-0", "pod-1"}
        served = [p.requests - b for p, b in zip(cell.pods, before, strict=True)]
        assert min(served) >= 4, served  # fewest-in-flight keeps both busy


def conversation(i: int) -> dict:
    """The opening turn of conversation ``i``: users send different ones, so prefix affinity
    (the default balance) spreads them over the pods, where one conversation stays on one pod."""
    return {**chat(), "messages": [{"role": "user", "content": f"hello, this is conversation {i}"}]}


def test_a_dead_pod_costs_no_request_its_breaker_opens_alone():
    with running_cell(runtime(), pods=2, compute_ms=1) as cell:
        cell.pods[0].set_fault("error")
        res = []
        # Each conversation's pod is its prefix's: go on until pod 0 was tried failureThreshold times (bounded).
        while cell.pods[0].requests < 2 and len(res) < 200:
            res.append(cell.call("POST", "/v1/chat/completions", body=conversation(len(res))))
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
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.headers["x-colocate-backend"] == "fallback"
        # the Worker's own clock (not the test's, which a loaded machine stretches): it gave up at
        # the deadline, before the pods answered (1 s)
        assert res.timing()["upstream"] < 1000
        assert sum(p.requests for p in cell.pods) == before + 1


def test_probe_reports_every_pod():
    with running_cell(runtime(), pods=2, compute_ms=1) as cell:
        cell.pods[1].set_fault("error")
        body = cell.call("GET", "/_colocate/probe", headers=auth()).json()
        assert [(p["index"], p["host"], p["ok"]) for p in body["pods"]] == [
            (0, f"127.0.0.1:{cell.pods[0].port}", True), (1, f"127.0.0.1:{cell.pods[1].port}", False)]
        assert all(isinstance(p["rtt_ms"], (int, float)) for p in body["pods"])
        assert [p["index"] for p in body["breaker"]["pods"]] == [0, 1]


@contextlib.contextmanager
def open_stream(cell, extra: dict, key: str | None = None) -> Iterator[http.client.HTTPResponse]:
    """A routed stream (with the cell's client key unless ``key`` is given) whose headers
    have arrived and whose body is not read yet."""
    conn = http.client.HTTPConnection("127.0.0.1", cell.worker.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**chat(stream=True), **extra}),
                     headers={"authorization": f"Bearer {key or cell.key}", "content-type": "application/json"})
        res = conn.getresponse()
        assert res.status == 200 and res.getheader("content-type").startswith("text/event-stream")
        yield res
    finally:
        conn.close()


@pytest.mark.parametrize("extra", [{}, USAGE], ids=["plain", "include_usage"])
def test_a_stream_holds_its_pod_until_its_last_byte_then_lets_it_go(extra):
    # Each stream lasts 500 ms at the pod (half before the first token, half spread over
    # the rest; its headers come at once); a request sent while it runs must go to the
    # other pod, every time. The subject is the pod's count of requests in flight, which
    # balance `load` shows directly (prefix keeps a conversation on its pod below the load
    # bound, so it would send the second request beside the first whatever the count).
    with running_cell(runtime(balance="load"), pods=2, compute_ms=500) as cell:
        for _ in range(5):
            with open_stream(cell, extra) as stream:
                busy = stream.getheader("x-colocate-backend")
                other = cell.call("POST", "/v1/chat/completions", body=chat())
                assert other.status == 200 and {busy, other.headers["x-colocate-backend"]} == {"pod-0", "pod-1"}
                events = [e for e in stream.read().split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and len(events) > 2
            if extra:
                assert json.loads(events[-2][len(b"data: "):])["usage"]["total_tokens"] > 0
        # Every stream ended, so both pods are free again: ties are broken at random, and
        # 24 requests all landing on one pod (a pod still counted busy) has odds 2**-23.
        landed = {cell.call("GET", "/v1/models").headers["x-colocate-backend"] for _ in range(24)}
        assert landed == {"pod-0", "pod-1"}
        # The five non-streamed requests were streamed from their pod too (assembled by the router).
        assert poll(lambda: sum(p.streams["completed"] for p in cell.pods), 10) == 10


def test_a_usage_stream_reaches_its_client_as_it_comes_and_its_tokens_are_counted():
    # Usage asked: the router reads its own copy of the stream in batches, pausing up to a
    # second between them. The pod sends the first token after 1.5 s and the last 1.5 s
    # later: the client must get them as they come, not when the router's copy is read,
    # and the usage event at the end must still be counted (tpm 8,192: a request without
    # max_tokens may use the whole context, so the next one no longer fits beside it).
    with running_cell(runtime(), pods=1, compute_ms=3000) as cell:
        key = cell.create_key("paced", tpm=8192)["key"]
        arrivals, parts = [], []
        with open_stream(cell, USAGE, key) as res:
            while part := res.read1(65536):
                arrivals.append(time.monotonic())
                parts.append(part)
        events = [e for e in b"".join(parts).split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and json.loads(events[-2][len(b"data: "):])["usage"]["total_tokens"] > 0
        assert arrivals[-1] - arrivals[0] >= 1.0, arrivals  # 1.5 s at the pod; 0 if held to the end
        over = cell.call("POST", "/v1/chat/completions", body=chat(), headers={"authorization": f"Bearer {key}"})
        assert over.status == 429 and over.json()["error"]["type"] == "tokens", over.body


@pytest.mark.parametrize(("pods", "extra"), [(1, {}), (2, {}), (1, USAGE)], ids=["passed-through", "piped", "tapped"])
def test_a_client_that_leaves_mid_stream_stops_the_pod(pods, extra):
    # One pod and no usage: the pod's body is returned as it is; several pods: the runtime
    # pipes it (the end frees the pod); usage asked: the runtime pipes one branch of a tee
    # and the router reads the other. In every case the pod must see its stream cut, not
    # keep generating for nobody.
    with running_cell(runtime(), pods=pods, compute_ms=1000) as cell:
        leave_after_first_event(cell.worker.port, "/v1/chat/completions", {**chat(stream=True), **extra},
                                {"Authorization": f"Bearer {cell.key}"})

        def total() -> dict:
            return {k: sum(p.streams[k] for p in cell.pods) for k in ("completed", "cut")}

        assert poll(total, {"completed": 0, "cut": 1}) == {"completed": 0, "cut": 1}
