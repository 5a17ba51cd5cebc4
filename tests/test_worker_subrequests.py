"""Subrequests per request, counted in real workerd through a recording outbound: every fetch the
Worker makes (pods, their /metrics, the fallback, /cdn-cgi/trace) reaches one local server, which
records when each opened and closed. A Worker may have six connections open at once per request
(developers.cloudflare.com/workers/platform/limits); with eight pods balanced by load, a request's
/metrics reads must leave its inference fetch a connection (docs/worker.md, "Subrequests per request")."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from colocate.workerd import Workerd, render_config
from tests.support.workerd import SECRETS, auth, cell_plan, chat, request, values_for

pytestmark = pytest.mark.slow
OPEN_AT_ONCE = 6  # Cloudflare's simultaneous open connections per request
PODS = 8  # colocate.cell.settings.MAX_PODS
METRICS_DELAY_S = 1.5  # a slow /metrics: each read holds its connection this long
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "client/model",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


class Recorder(ThreadingHTTPServer):
    """Every subrequest, host-style (workerd's external service): (host, path, opened, closed)."""

    daemon_threads = True

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[list] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                row = [self.headers.get("host"), self.path, time.monotonic(), None]
                with recorder.lock:
                    recorder.calls.append(row)
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path == "/metrics":
                    time.sleep(METRICS_DELAY_S)
                    body, ctype = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n", "text/plain"
                elif self.path == "/cdn-cgi/trace":
                    body, ctype = b"colo=IAD\n", "text/plain"
                else:
                    body, ctype = json.dumps(ANSWER).encode(), "application/json"
                try:
                    self.send_response(200)
                    self.send_header("content-type", ctype)
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the Worker stopped reading (a read it no longer needs)
                with recorder.lock:
                    row[3] = time.monotonic()

            do_GET = do_POST = _any  # noqa: N815

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def most_open_at_once(self, since: float) -> int:
        with self.lock:
            rows = [(o, c if c is not None else float("inf")) for _, _, o, c in self.calls if o >= since]
        return max((sum(1 for o2, c2 in rows if o2 <= o < c2) for o, _ in rows), default=0)

    def since(self, t: float) -> list:
        with self.lock:
            return [(h, p) for h, p, o, _ in self.calls if o >= t]


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    plan = cell_plan(worker={"balance": "load"})
    recorder = Recorder()
    urls = [f"http://127.0.0.1:{9001 + i}" for i in range(PODS)]  # each pod is the recorder, by Host
    w = Workerd(tmp_path_factory.mktemp("subrequests"))
    try:
        w.start(render_config(plan.worker, values_for(urls, "http://fallback.test"), port=w.port,
                              storage_dir=w.directory / "objects", global_outbound=("127.0.0.1", recorder.server_address[1])))
        res = request(w.url, "POST", "/_colocate/keys", body={"name": "sub"}, headers=auth(SECRETS["PROBE_TOKEN"]))
        assert res.status == 201, res.body
        yield w, recorder, res.json()["key"]
    finally:
        w.close()
        recorder.shutdown()
        recorder.server_close()


def test_one_request_leaves_its_inference_fetch_a_connection_with_eight_pods_balanced_by_load(cell):
    w, recorder, key = cell
    body = {**chat(), "max_tokens": 8}
    for _ in range(3):  # the first request of an isolate, then two more while reads are in flight
        t0 = time.monotonic()
        res = request(w.url, "POST", "/v1/chat/completions", body=body, headers={"authorization": f"Bearer {key}"})
        assert res.status == 200 and res.headers["x-colocate-backend"].startswith("pod-"), res.body
        time.sleep(METRICS_DELAY_S + 0.5)  # the request's background reads end
        made = recorder.since(t0)
        metrics = [m for m in made if m[1] == "/metrics"]
        assert len(metrics) <= 2, made  # router.js METRICS_PER_REQUEST
        assert len([m for m in made if m[1] == "/v1/chat/completions"]) == 1
        # At most the isolate's first trace, and the generation object's (its own request's subrequest).
        assert len([m for m in made if m[1] == "/cdn-cgi/trace"]) <= 2 and len(made) <= 5, made
        assert recorder.most_open_at_once(t0) < OPEN_AT_ONCE
