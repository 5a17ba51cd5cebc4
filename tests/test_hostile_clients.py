"""Key holders who want to spend the owner's money or hurt other clients, against the
router in real workerd: streams that do not ask for usage are still counted
(pod and fallback), bodies a pod would refuse or choke on stop at the edge with a 400
naming the field, one key's failing requests never open a breaker for everyone (while a
pod that really fails still does), and a real OpenAI client sees exactly what it asked for."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest

from colocate.cell import plan as plan_mod
from colocate.pods import standin
from colocate.workerd import Workerd, render_config
from tests.support.workerd import FALLBACK_MODEL_NAME, ROOT, SECRETS, Cell, auth, cell_plan, running_cell, values_for

if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.slow
THRESHOLD = 3
POISON = "poison-this-pod"  # a body this pod fails on (a bug it has), valid for everyone else


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def chat_body(content: str = "hello", **extra) -> dict:
    return {"model": "client/model", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(body: bytes) -> list:
    """The JSON data events of an SSE body ([DONE] left out)."""
    out = []
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                out.append(json.loads(line[5:]))
    return out


def usage_rows(cell: Cell, key_id: str, predicate, timeout_s: float = 15.0) -> list[dict]:
    """The key's usage rows, polled (bounded) until ``predicate(rows)`` holds: usage reaches
    the object in batches, at most a second after a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        res = cell.call("GET", f"/_colocate/usage?key={key_id}", headers=auth())
        assert res.status == 200, res.body
        rows = res.json()["usage"]
        if predicate(rows) or time.monotonic() > deadline:
            return rows


def tokens(rows: list[dict]) -> int:
    return sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 60_000, "failureThreshold": THRESHOLD}, compute_ms=1) as c:
        yield c


# --- every stream counted ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ["pod-0", "fallback"])
def test_streams_without_include_usage_stop_at_the_monthly_budget(cell, backend):
    # a stream without max_tokens may use the context (8,192): admitted while that fits the month
    made = cell.create_key(f"budget-{backend}", monthly_tokens=8192 + 50)
    if backend == "fallback":
        assert cell.call("PUT", "/_colocate/breaker", body={"force": "open"}, headers=auth()).status == 200
    try:
        served, refused = [], None
        for _ in range(20):  # each stream is ~20 tokens: the budget is gone after a few
            res = cell.call("POST", "/v1/chat/completions", body=chat_body(stream=True), headers=bearer(made["key"]))
            if res.status != 200:
                refused = res
                break
            assert res.headers["x-colocate-backend"] == backend
            events = sse_events(res.body)
            assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            # The router asked for the usage event; the client, who did not, never sees it.
            assert all(e["choices"] for e in events) and not any(e.get("usage") for e in events)
            served.append(res)
        assert refused is not None, "the key was never refused"
        assert refused.status == 429 and refused.headers["content-type"].startswith("application/json")
        err = refused.json()["error"]
        assert err["type"] == "insufficient_quota"
        assert 2 <= len(served) <= 6
    finally:
        if backend == "fallback":
            cell.call("PUT", "/_colocate/breaker", body={"force": None}, headers=auth())
    rows = usage_rows(cell, made["id"], lambda r: tokens(r) > 50)
    assert tokens(rows) > 50  # refused once what is left could not hold a request's most
    assert sum(r["requests"] for r in rows) == len(served)  # the refused request was not served
    assert sum(r["fallback_requests" if backend == "fallback" else "pod_requests"] for r in rows) == len(served)


def test_a_stream_cut_by_its_client_is_still_counted(cell):
    made = cell.create_key("leaver")
    # The client reads the first event and leaves before the usage event.
    parts = urlsplit(cell.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat_body(stream=True, max_tokens=8)),
                     headers={**bearer(made["key"]), "content-type": "application/json"})
        res = conn.getresponse()
        try:
            assert res.status == 200
            assert res.read1(64)
        finally:
            res.close()
    finally:
        conn.close()
    rows = usage_rows(cell, made["id"], lambda r: tokens(r) > 0)
    assert tokens(rows) > 0  # the real usage, or the estimate of what was streamed


# --- bad requests stop at the edge ------------------------------------------------------

DEEP = '{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":' + "[" * 10_000 + "]" * 10_000 + "}"
POISONED = [
    (DEEP.encode(), "tools", "too_deep"),
    (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e309}', "max_tokens", "invalid_value"),
    (json.dumps(chat_body(max_tokens=-1)).encode(), "max_tokens", "invalid_value"),
    (json.dumps(chat_body(stream="yes")).encode(), "stream", "invalid_value"),
    (json.dumps(chat_body(n=1_000_000)).encode(), "n", "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "model", "missing_field"),
    (json.dumps(chat_body(temperature=3)).encode(), "temperature", "invalid_value"),
]


def test_poisoned_requests_get_400s_naming_the_field_and_leave_the_breaker_closed(cell):
    attacker = cell.create_key("attacker")
    bystander = cell.create_key("bystander")
    pod_before, fallback_before = cell.pod.requests, cell.fallback.requests
    for _ in range(2):
        for body, param, code in POISONED:
            res = cell.call("POST", "/v1/chat/completions", body=body,
                            headers={**bearer(attacker["key"]), "content-type": "application/json"})
            assert res.status == 400, (param, res.body)
            err = res.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
            assert err["message"].startswith(param)
    assert cell.pod.requests == pod_before and cell.fallback.requests == fallback_before  # none reached an upstream
    for _ in range(10):
        res = cell.call("POST", "/v1/chat/completions", body=chat_body(), headers=bearer(bystander["key"]))
        assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
    assert cell.fallback.requests == fallback_before
    assert cell.breaker()["state"] == "closed"


# --- a failure the request caused is not the pod's --------------------------------------

class BuggyPod(ThreadingHTTPServer):
    """A pod with a bug one body triggers: requests holding POISON get a 500, everything
    else (and /health) is answered as vLLM would. ``fail_all`` makes it fail every
    completion while /health still says ok (a pod broken past its health check)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _BuggyHandler)
        self.fail_all = False
        self.health_ok = True
        self.seen = {"poison": 0, "other": 0, "health": 0}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, what: str) -> None:
        with self.lock:
            self.seen[what] += 1


class _BuggyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: BuggyPod

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self.server.count("health")
            return self._send(200 if self.server.health_ok else 503, {"status": "ok" if self.server.health_ok else "down"})
        self._send(404, {"error": {"message": "no route"}})

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        poisoned = POISON.encode() in body
        self.server.count("poison" if poisoned else "other")
        if poisoned or self.server.fail_all:
            return self._send(500, {"error": {"message": "internal error", "type": "server_error"}})
        self._send(200, {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


@contextlib.contextmanager
def buggy_cell() -> Iterator[tuple[Cell, BuggyPod]]:
    """workerd routing to a BuggyPod, with the stand-in fallback; the sandbox plan's bindings."""
    plan = cell_plan({"stateTtlMs": 0, "failureThreshold": THRESHOLD, "openMs": 60_000, "deadlineMs": 2000})
    pod = BuggyPod()
    thread = threading.Thread(target=pod.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME, name="fallback") as fb, \
                Workerd() as w:
            w.start(render_config(plan.worker, values_for(pod.url, fb.url), port=w.port, storage_dir=w.directory / "objects"))
            yield Cell(w, [pod], fb, plan), pod
    finally:
        pod.shutdown()
        pod.server_close()
        thread.join(timeout=10)


def test_one_keys_failing_requests_never_send_another_key_to_the_fallback():
    with buggy_cell() as (cell, pod):
        attacker = cell.create_key("attacker")
        bystander = cell.create_key("bystander")
        for _ in range(3 * THRESHOLD):
            res = cell.call("POST", "/v1/chat/completions", body=chat_body(POISON), headers=bearer(attacker["key"]))
            assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"  # served, by the fallback
        assert pod.seen["poison"] == 3 * THRESHOLD
        # The streak is counted, from one key: a health check was asked and said the pod is fine.
        snap = cell.wait_for(lambda s: s["failures"] >= 3 * THRESHOLD and pod.seen["health"] > 0)
        assert snap["state"] == "closed" and snap["failures"] == 3 * THRESHOLD, snap
        assert pod.seen["health"] >= 1
        fallback_before = cell.fallback.requests
        for _ in range(20):
            res = cell.call("POST", "/v1/chat/completions", body=chat_body(), headers=bearer(bystander["key"]))
            assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
        assert cell.fallback.requests == fallback_before  # 0 requests of the other key went to the fallback
        assert cell.breaker()["state"] == "closed"


def test_a_pod_that_really_fails_still_opens_its_breaker():
    with buggy_cell() as (cell, pod):
        alice, bob = cell.create_key("alice"), cell.create_key("bob")
        pod.fail_all = True  # /health still says ok: only two keys' failures can tell
        for i in range(THRESHOLD):
            key = (alice, bob)[i % 2]
            res = cell.call("POST", "/v1/chat/completions", body=chat_body(), headers=bearer(key["key"]))
            assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
        assert cell.wait_breaker("open")["state"] == "open"
    with buggy_cell() as (cell, pod):
        alice = cell.create_key("alice")
        pod.fail_all, pod.health_ok = True, False  # one key, and a health check that agrees
        for _ in range(THRESHOLD):
            assert cell.call("POST", "/v1/chat/completions", body=chat_body(), headers=bearer(alice["key"])).status == 200
        snap = cell.wait_breaker("open")
        assert snap["state"] == "open" and pod.seen["health"] >= 1


# --- a real OpenAI client sees what it asked for ----------------------------------------

def client(cell, key: str) -> openai.OpenAI:
    import openai  # here, not at collection: every pytest worker collects every file

    return openai.OpenAI(base_url=cell.url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_streams_get_a_usage_chunk_only_when_they_ask(cell, include_usage):
    made = cell.create_key(f"sdk-{include_usage}")
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    with client(cell, made["key"]) as c:
        chunks = list(c.chat.completions.create(
            model="client/model", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=5, **extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with_usage = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert len(with_usage) == 1 and chunks[-1].usage.total_tokens > 0 and chunks[-1].choices == []
    else:
        assert with_usage == [] and all(c.choices for c in chunks)
    rows = usage_rows(cell, made["id"], lambda r: tokens(r) > 0)
    assert tokens(rows) > 0  # counted either way


def test_openai_bad_request_names_the_param(cell):
    import openai

    with client(cell, cell.key) as c:
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
        done = c.completions.create(model="client/model", prompt="hi", max_tokens=3)
    assert exc.value.status_code == 400 and exc.value.param == "max_tokens" and exc.value.code == "invalid_value"
    assert done.choices[0].text and done.usage.total_tokens > 0


def test_a_pod_health_table_from_before_failure_keys_gains_the_column(tmp_path):
    """A deployed object's pod_health has no failure_keys column: its first report adds it."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "worker" / "src", src)
    schema = src / "schema.js"
    text = schema.read_text()
    assert ", failure_keys TEXT)" in text
    schema.write_text(text.replace(", failure_keys TEXT)", ")"))
    plan = cell_plan({"stateTtlMs": 0, "failureThreshold": THRESHOLD, "openMs": 60_000})
    old = dataclasses.replace(plan.worker, modules=plan_mod.worker_modules(src))
    with running_cell({"stateTtlMs": 0, "failureThreshold": THRESHOLD, "openMs": 60_000}, compute_ms=1,
                      with_key=False) as cell:
        cell.restart(dataclasses.replace(plan, worker=old))  # before anything touched the object
        alice, bob = cell.create_key("alice"), cell.create_key("bob")
        cell.pod.set_fault("error")
        for i in range(THRESHOLD):
            res = cell.call("POST", "/v1/chat/completions", body=chat_body(), headers=bearer((alice, bob)[i % 2]["key"]))
            assert res.headers["x-colocate-backend"] == "fallback"
        assert cell.wait_breaker("open")["state"] == "open"
