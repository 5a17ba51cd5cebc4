"""The router judging pods by their first token and their token rate, in real workerd with
pods that stream on their own clock (docs/worker.md "Pace", "Routing"): a pod that makes
tokens below colocate:worker.minTokensPerS is passed over once two keys' answers said so,
its breaker untouched; a pod that stalls after its first token cuts a streaming client with
an OpenAI-shaped error event and a non-streaming one with a 502, and the fallback is not asked."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from colocate.pods import standin
from colocate.workerd import Workerd, render_config
from tests.support.workerd import SECRETS, Cell, cell_plan, request, values_for

pytestmark = pytest.mark.slow


class PacedPod(ThreadingHTTPServer):
    """A pod streaming ``tokens`` events ``gap_s`` apart (or stalling after ``stall_after``);
    counts the requests it was sent."""

    daemon_threads = True

    def __init__(self, tokens: int, gap_s: float, stall_after: int | None = None):
        super().__init__(("127.0.0.1", 0), _Paced)
        self.tokens, self.gap_s, self.stall_after = tokens, gap_s, stall_after
        self.requests = 0
        self.whole = 0  # requests asked without a stream: answered as one JSON body at the last token
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Paced(BaseHTTPRequestHandler):
    server: PacedPod
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass

    def do_GET(self):  # noqa: N802
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests += 1
            self.server.whole += body.get("stream") is not True
        if body.get("stream") is not True:
            return self._whole()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        pod = self.server
        # Without a gap the whole stream is one write: its pace as the router reads it is then the
        # pod's, not this loaded machine's scheduling of 41 writes (which once read as under 100/s).
        held: list[bytes] | None = [] if not pod.gap_s and pod.stall_after is None else None
        try:
            for i in range(pod.tokens):
                if pod.stall_after is not None and i >= pod.stall_after:
                    time.sleep(30)  # silent; the router cancels
                    return
                delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f"t{i} "}
                ev = {"id": "chatcmpl-p", "object": "chat.completion.chunk", "created": 1, "model": "m",
                      "choices": [{"index": 0, "delta": delta, "finish_reason": "length" if i == pod.tokens - 1 else None}]}
                data = f"data: {json.dumps(ev)}\n\n".encode()
                if held is None:
                    self._chunk(data)
                else:
                    held.append(data)
                if i and pod.gap_s:
                    time.sleep(pod.gap_s)
            usage = {"prompt_tokens": 5, "completion_tokens": pod.tokens - 1, "total_tokens": pod.tokens + 4}
            tail = f"data: {json.dumps({'id': 'chatcmpl-p', 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
            self._chunk(b"".join([*(held or []), tail]))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _whole(self) -> None:
        pod = self.server
        time.sleep(pod.gap_s * (pod.tokens - 1))  # as vLLM: the body once the last token is made
        n = pod.tokens - 1
        answer = {"id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "t " * n}, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@contextlib.contextmanager
def paced_cell(pods: list[PacedPod], worker: dict) -> Iterator[Cell]:
    with contextlib.ExitStack() as stack:
        for p in pods:
            threading.Thread(target=p.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            stack.callback(p.server_close)
            stack.callback(p.shutdown)
        fb = stack.enter_context(standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], name="fallback"))
        plan = cell_plan(worker)
        w = stack.enter_context(Workerd())
        w.start(render_config(plan.worker, values_for([p.url for p in pods], fb.url), port=w.port,
                              storage_dir=w.directory / "objects"))
        cell = Cell(w, [], fb, plan)
        yield cell


def chat(key: str, stream: bool, content: str = "hi", **fields) -> dict:
    return {"body": {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream, **fields},
            "headers": {"authorization": f"Bearer {key}"}}


def test_a_pod_making_tokens_too_slowly_is_passed_over_once_two_keys_said_so():
    slow, fast = PacedPod(41, 0.025), PacedPod(41, 0.0)  # 40 tokens/s, and at once
    # Marked for ten minutes: on a loaded machine the 40 answers can outlast the default 30 s mark.
    worker = {"stateTtlMs": 0, "failureThreshold": 2, "minTokensPerS": 100, "deadlineMs": 5000, "stallMs": 5000,
              "openMs": 600_000}
    with paced_cell([slow, fast], worker) as cell:
        keys = [cell.create_key(f"k{i}", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0)["key"] for i in range(2)]
        t0 = time.monotonic()
        backends, sent = [], []
        # A conversation each, as users send: the default balance (prefix) keeps a conversation on its pod, so
        # one repeated chat a key put each key on one pod, and the slow pod heard from one key only.
        for i in range(40):  # ties between idle pods are random: about half go to the slow pod until it is marked
            sent.append(time.monotonic() - t0)
            res = request(cell.url, "POST", "/v1/chat/completions", **chat(keys[i % 2], stream=bool(i % 3),
                                                                             content=f"conversation {i}"))
            assert res.status == 200, res.body
            backends.append(res.headers["x-colocate-backend"])
        # Marked after FAILURE_THRESHOLD (2) slow answers from both keys: a few answers, then none.
        assert 2 <= slow.requests <= 8, backends
        assert backends[-20:] == ["pod-1"] * 20, backends
        last_slow = max(i for i, b in enumerate(backends) if b == "pod-0")
        assert sent[last_slow] < 30, sent  # detected within 30 s of its first answers
        assert cell.breaker()["pods"][0]["state"] == "closed"  # still a pod: only passed over


def test_a_stall_after_the_first_token_cuts_the_answer_and_the_fallback_is_not_asked():
    pod = PacedPod(20, 0.0, stall_after=3)
    with paced_cell([pod], {"stateTtlMs": 0, "deadlineMs": 2000, "stallMs": 300}) as cell:
        key = cell.create_key("k", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0)["key"]
        before = cell.fallback.requests
        res = request(cell.url, "POST", "/v1/chat/completions", **chat(key, stream=True))
        assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
        events = [e for e in res.body.split(b"\n\n") if e]
        assert b"t2 " in res.body
        assert json.loads(events[-1][len(b"data: "):])["error"]["code"] == "upstream_stalled"
        res = request(cell.url, "POST", "/v1/chat/completions", **chat(key, stream=False))
        assert res.status == 502 and res.json()["error"]["code"] == "upstream_stalled"
        assert cell.fallback.requests == before


def test_a_long_non_streamed_answer_past_the_deadline_is_the_pods_and_counts_against_nothing():
    pod = PacedPod(601, 0.004)  # 600 tokens over about 2.4 s, five times the deadline
    with paced_cell([pod], {"stateTtlMs": 0, "deadlineMs": 500, "stallMs": 500, "failureThreshold": 1}) as cell:
        key = cell.create_key("k", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0)["key"]
        before = cell.fallback.requests
        for _ in range(2):
            res = request(cell.url, "POST", "/v1/chat/completions", **chat(key, stream=False))
            assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0", res.body[:200]
            answer = res.json()
            assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"].count("t") == 600
            assert answer["usage"]["completion_tokens"] == 600
        assert cell.fallback.requests == before
        snap = cell.breaker()
        assert snap["pods"][0]["state"] == "closed" and snap["pods"][0]["failures"] == 0


def test_a_short_non_streamed_answer_is_asked_whole_with_a_tokens_allowance_past_the_deadline():
    """At most WHOLE_MAX_TOKENS (16): asked of the pod as one body, within deadlineMs plus one token
    at minTokensPerS for each it may have (router.js wholeMs); longer ones are streamed and assembled."""
    pod = PacedPod(17, 0.06)  # 16 tokens, the whole body after about 0.96 s: past the 500 ms deadline
    worker = {"stateTtlMs": 0, "deadlineMs": 500, "stallMs": 500, "failureThreshold": 1, "minTokensPerS": 10}
    with paced_cell([pod], worker) as cell:
        key = cell.create_key("k", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0)["key"]
        before = cell.fallback.requests
        res = request(cell.url, "POST", "/v1/chat/completions", **chat(key, stream=False, max_tokens=16))
        assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0", res.body[:200]
        assert res.json()["usage"]["completion_tokens"] == 16 and pod.whole == 1
        # 17 tokens may be more than the router asks whole: a stream, assembled.
        res = request(cell.url, "POST", "/v1/chat/completions", **chat(key, stream=False, max_tokens=17))
        assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0" and pod.whole == 1
        assert res.json()["object"] == "chat.completion"
        assert cell.fallback.requests == before
        assert cell.breaker()["pods"][0]["state"] == "closed"
