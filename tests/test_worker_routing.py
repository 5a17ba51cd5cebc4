"""The router in real workerd: healthy pod, Server-Timing, the cached hot path, streaming."""

import http.client
import json
import time

import pytest

from tests.support.workerd import SECRETS, chat, running_cell

pytestmark = pytest.mark.slow
STREAM_COMPUTE_MS = 400  # the stand-in spreads half of this over the streamed tokens
SLOW = 5  # the streaming test's tokens, this many times slower


@pytest.fixture(scope="module")
def cell():
    # A long state TTL: after the first request the isolate's copy stays fresh.
    with running_cell({"deadlineMs": 5000, "stateTtlMs": 60_000}, compute_ms=STREAM_COMPUTE_MS) as c:
        yield c


def test_healthy_pod_serves_with_its_token_and_timing(cell):
    before = cell.pod.requests
    # The client's key must not reach the pod; the pod only accepts POD_TOKEN.
    res = cell.call("POST", "/v1/chat/completions", body=chat())
    assert res.status == 200, res.body
    assert res.headers["x-colocate-backend"] == "pod-0"
    assert "x-standin" not in res.headers  # only the allowlisted upstream headers reach the client
    assert res.json()["object"] == "chat.completion"
    assert res.json()["model"] == "client/model"  # body passed unchanged
    assert cell.pod.requests == before + 1
    t = res.timing()
    assert list(t) == ["state", "upstream", "fallback", "total"]
    assert t["fallback"] == 0
    assert t["upstream"] >= STREAM_COMPUTE_MS * 0.9
    assert t["total"] >= t["upstream"]


def test_models_and_completions_paths_with_query(cell):
    res = cell.call("GET", "/v1/models?limit=1")
    assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
    assert res.json()["object"] == "list"
    res = cell.call("POST", "/v1/completions", body={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert res.status == 200 and res.json()["object"] == "text_completion"


def test_hot_path_does_not_wait_on_the_object(cell):
    cell.call("GET", "/v1/models")  # warms the isolate's copy
    waits = [cell.call("GET", "/v1/models").timing()["state"] for _ in range(5)]
    assert waits == [0.0] * 5


def test_sse_passes_through_chunk_by_chunk(cell):
    # The tokens come SLOW times slower than the fixture's: a loaded machine that holds this process
    # back for a moment bunches the first arrivals, and at 200 ms in all one such moment (84 ms) failed it.
    cell.pod.set_fault("slow_tokens", factor=SLOW)
    conn = http.client.HTTPConnection("127.0.0.1", cell.worker.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat(stream=True)),
                      headers={"content-type": "application/json", "authorization": f"Bearer {cell.key}"})
        res = conn.getresponse()
        assert res.status == 200
        assert res.getheader("content-type").startswith("text/event-stream")
        assert res.getheader("x-colocate-backend") == "pod-0"
        arrivals, events, buf = [], [], b""
        while not events or events[-1] != b"[DONE]":
            piece = res.read1(65536)  # whatever has arrived, de-chunked
            if not piece:
                break
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    arrivals.append(time.monotonic())
                    events.append(event[6:].strip())
    finally:
        conn.close()
        cell.pod.set_fault("ok")
    assert events[-1] == b"[DONE]"
    tokens = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert "".join(tokens).startswith("This is the colocate")
    # The pod spends ~SLOW * STREAM_COMPUTE_MS/2 between its first and its last token; a router
    # that buffered would deliver them all at once.
    assert arrivals[-1] - arrivals[0] >= SLOW * (STREAM_COMPUTE_MS / 2) * 0.6 / 1000
    assert len({round(a, 3) for a in arrivals}) >= len(arrivals) // 2


def test_probe_reports_the_cell(cell):
    res = cell.call("GET", "/_colocate/probe", headers={"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}",
                                                         "cf-placement": "local-IAD", "cf-ray": "8f1a2b3c4d5e6f70-EWR"})
    assert res.status == 200, res.body
    body = res.json()
    plan = cell.plan
    assert body["generation"] == plan.state.active.name
    assert body["hint"] == plan.state.hint
    assert body["region"] == plan.region.name
    assert body["draining_generation"] is None
    assert body["cf_placement"] == "local-IAD"
    assert body["ray_colo"] == "EWR"
    assert body["worker_colo"] is None and body["state_colo"] is None  # offline: no trace
    assert body["pod_ok"] is True and body["pod_status"] == 200
    assert body["pod_host"] == f"127.0.0.1:{cell.pod.port}"
    assert body["pods"] == [
        {"index": 0, "host": f"127.0.0.1:{cell.pod.port}", "rtt_ms": body["pod_rtt_ms"], "ok": True, "status": 200}
    ]
    assert "fallback" not in body  # checked only when asked (?fallback=1)
    assert body["breaker"]["state"] == "closed" and body["breaker"]["forced"] is None
    assert isinstance(body["state_rtt_ms"], (int, float)) and isinstance(body["pod_rtt_ms"], (int, float))
    assert [p.split(";")[0] for p in res.headers["server-timing"].split(", ")] == ["state_rtt", "pod_rtt", "total"]
