"""Guard for the router's hot path, not timed: counts, in real workerd,
the subrequests and Durable Object calls a routed request makes, with a client key.

The router runs from the sandbox stack's plan (the cloud's bytes) behind a test-only
entry (bench/count_calls.js) that counts every call on an object stub, whatever the
method is named; the object itself is hosted in a second service, as in the sandbox.
Every subrequest (the pod, the fallback, /cdn-cgi/trace, from the Worker or the object)
goes to one global outbound server here that records it. Once the isolate has its
breaker copy, a routed request must make exactly one subrequest (to the pod) and no
object call before its response leaves (usage and limit counters go to the object in
batched background syncs, at most one per isolate per second, counted separately): a
change that adds a wait to the hot path fails here without timing anything.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from colocate import workerd as wd
from colocate.cell import plan as plan_mod
from tests.support.workerd import SECRETS, cell_plan, request

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
POD_HOST, FALLBACK_HOST = "pod-0.hot-path.test", "fallback.hot-path.test"
ENTRY = "count_calls.js"
OBJECT_SERVICE = "objects"
# A cold isolate syncs its view once before it can route; nothing else may wait.
COLD_OBJECT_CALLS = 1
WARM_REQUESTS = 12
# Routed requests carry these and the client key minted for the test.
ROUTED_HEADERS = {"content-type": "application/json"}


class _Outbound(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.seen: list[tuple[str, str, str]] = []  # (method, Host, path)
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        with self.server.lock:
            self.server.seen.append((self.command, self.headers.get("host", ""), self.path))
        if b'"stream": true' in body or b'"stream":true' in body:
            out, ctype = b'data: {"choices":[]}\n\ndata: [DONE]\n\n', "text/event-stream"
        else:
            out, ctype = b'{"object":"chat.completion","choices":[]}', "application/json"
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer  # noqa: N815


@contextlib.contextmanager
def counted_router() -> Iterator[tuple[wd.Workerd, _Outbound]]:
    # A long state TTL: no background refresh may fall inside the test, however slow the machine.
    plan = cell_plan(worker={"stateTtlMs": 600_000, "deadlineMs": 10_000})
    values = {"POD_URLS": plan_mod.pod_urls_text([f"http://{POD_HOST}"]), "FALLBACK_URL": f"http://{FALLBACK_HOST}",
              "probeToken": SECRETS["PROBE_TOKEN"], **SECRETS}
    out = _Outbound()
    t = threading.Thread(target=out.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        entry = (ENTRY, (ROOT / "bench" / ENTRY).read_text())
        edge = wd.worker_capnp(plan.worker, values, host_objects=False, do_service=OBJECT_SERVICE,
                               global_outbound=wd.OUTBOUND_SERVICE, extra_modules=[entry], main_module=ENTRY)
        with wd.Workerd() as w:
            objects = wd.worker_capnp(plan.worker, values, global_outbound=wd.OUTBOUND_SERVICE, storage_service="disk")
            services = [wd.worker_service(wd.MAIN_SERVICE, edge), wd.worker_service(OBJECT_SERVICE, objects),
                        wd.external_service(wd.OUTBOUND_SERVICE, "127.0.0.1", out.server_address[1]),
                        wd.disk_service("disk", w.directory / "objects")]
            w.start(wd.config_capnp(services, [wd.socket_capnp(wd.SOCKET_NAME, w.port, wd.MAIN_SERVICE)]))
            yield w, out
    finally:
        out.shutdown()
        out.server_close()
        t.join(timeout=10)


def _counts(w: wd.Workerd, out: _Outbound) -> tuple[int, dict, list]:
    """Object calls made before a response left (hot), the whole count, and the subrequests."""
    res = request(w.url, "GET", "/__count/calls")
    assert res.status == 200, res.body
    body = res.json()
    with out.lock:
        seen = list(out.seen)
    return body["hot"], body, seen


def _mint_key(w: wd.Workerd) -> str:
    res = request(w.url, "POST", "/_colocate/keys", body=json.dumps({"name": "guard"}).encode(),
                  headers={"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}", "content-type": "application/json"})
    assert res.status == 201, res.body
    return res.json()["key"]


def _routed(w: wd.Workerd, method: str, path: str, body: dict | None = None, key: str = ""):
    data = json.dumps(body).encode() if body is not None else None
    headers = {**(ROUTED_HEADERS if data else {}), "authorization": f"Bearer {key}"}
    res = request(w.url, method, path, body=data, headers=headers)
    assert res.status == 200, res.body
    assert res.headers.get("x-colocate-backend", "").startswith("pod"), res.headers
    return res


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_warm_routed_requests_make_one_pod_subrequest_and_no_object_call():
    with counted_router() as (w, out):
        key = _mint_key(w)  # an operator call; it also drops this isolate's view, as a new isolate has none
        minted, _, _ = _counts(w, out)
        _routed(w, "POST", "/v1/chat/completions", CHAT, key)  # the cold isolate syncs its view once
        cold_calls, cold_body, cold_seen = _counts(w, out)
        cold_calls -= minted
        assert 1 <= cold_calls <= COLD_OBJECT_CALLS, cold_body  # >= 1: the counter does see the object
        # Background, once: the isolate's own /cdn-cgi/trace (the live view's colo, after its first
        # answer) and the object's (its view's colo). Every other subrequest is the request's own.
        # And the pod's load (GET /metrics, at most once a second per pod: pods.js metricsDue).
        cold_seen = [s for s in cold_seen if not s[2].startswith("/cdn-cgi/trace") and s[2] != "/metrics"]
        assert [(m, h) for m, h, _ in cold_seen] == [("POST", POD_HOST)]

        kinds = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"model": "m", "prompt": "hi"}),
                 ("POST", "/v1/chat/completions", {**CHAT, "stream": True}), ("GET", "/v1/models", None)]
        t0 = time.monotonic()
        for i in range(WARM_REQUESTS):
            _routed(w, *kinds[i % len(kinds)], key=key)
        elapsed = time.monotonic() - t0
        calls, body, seen = _counts(w, out)
        traces = [s for s in seen if s[2].startswith("/cdn-cgi/trace")]
        assert len(traces) <= 2, traces  # once per isolate and once per object, never per request
        scrapes = [s for s in seen if s[2] == "/metrics"]
        assert len(scrapes) <= 2 + int(elapsed), scrapes  # the pod's load: once a second at most, never per request
        seen = [s for s in seen if not s[2].startswith("/cdn-cgi/trace") and s[2] != "/metrics"]
        assert calls - minted - cold_calls == 0, f"the warm hot path called the object: {body}"
        # Usage reaches the object in the background, batched: at most one flush a second of
        # traffic (FLUSH_MAX_MS; a loaded machine stretches the loop), never one call per request.
        assert body["background"] <= 2 + int(elapsed) and body["background"] < WARM_REQUESTS, (body, elapsed)
        warm = seen[len(cold_seen):]
        assert len(warm) == WARM_REQUESTS, warm
        assert all(h == POD_HOST for _, h, _ in warm), warm  # no fallback, no trace, no second pod try
        assert [(m, p) for m, _, p in warm] == [(k[0], k[1]) for k in (kinds * WARM_REQUESTS)[:WARM_REQUESTS]]
