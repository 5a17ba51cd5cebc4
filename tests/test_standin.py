"""The local stand-in pod: auth like vLLM's --api-key, what it counts, faults, CLI. What it
writes (answers, streams, errors, /v1/models, /metrics) is checked against vLLM itself by
tests/engine_contract, which runs the same tests on the stand-in and on a live vLLM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from colocate.pods import standin
from tests.support.streams import leave_after_first_event, poll

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def pod():
    with standin.serve(compute_ms=5, token="s3cret", model="m1") as server:
        yield server


def auth(token="s3cret"):
    return {"Authorization": f"Bearer {token}"}


def test_health_and_models_need_the_token(pod):
    # The pod's guard (colocate_pod_guard, in front of vLLM and of the stand-in alike): vLLM's own 401 body.
    r = requests.get(pod.url + "/health", timeout=5)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = requests.get(pod.url + "/health", headers=auth(), timeout=5)
    assert (r.status_code, r.content) == (200, b"")  # vLLM answers its /health with no body
    r = requests.get(pod.url + "/v1/models", timeout=5)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # vLLM's middleware, not an ErrorResponse
    r = requests.get(pod.url + "/v1/models", headers=auth("wrong"), timeout=5)
    assert r.status_code == 401
    r = requests.get(pod.url + "/v1/models", headers=auth(), timeout=5)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["m1"]


def test_no_token_configured_means_open():
    with standin.serve(compute_ms=0) as server:
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_chat_completion_takes_compute_time_and_counts(pod):
    with standin.serve(compute_ms=120, model="m") as slow:
        t0 = time.monotonic()
        r = requests.post(
            slow.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}, timeout=5
        )
        elapsed = time.monotonic() - t0
        assert r.status_code == 200 and elapsed >= 0.12
        body = r.json()
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert slow.requests == 1
    requests.get(pod.url + "/health", headers=auth(), timeout=5)
    assert pod.requests == 0  # health checks are not inference requests


def test_streaming_sends_one_sse_chunk_per_token_then_done(pod):
    body = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with requests.post(pod.url + "/v1/chat/completions", json=body, headers=auth(), stream=True, timeout=5) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert len(chunks) > 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streams_are_counted_completed_or_cut_by_their_client():
    body = {"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    with standin.serve(compute_ms=400, model="m") as slow:
        with requests.post(slow.url + "/v1/chat/completions", json=body, stream=True, timeout=5) as r:
            assert [line for line in r.iter_lines() if line][-1] == b"data: [DONE]"
        assert poll(lambda: slow.streams, {"completed": 1, "cut": 0}) == {"completed": 1, "cut": 0}
        # A client that leaves after the first event: the next writes fail and the stream is cut.
        leave_after_first_event(slow.port, "/v1/chat/completions", body)
        assert poll(lambda: slow.streams, {"completed": 1, "cut": 1}) == {"completed": 1, "cut": 1}
        stats = requests.get(slow.url + "/_standin/stats", timeout=5).json()
        assert stats["streams"] == {"completed": 1, "cut": 1} and stats["requests"] == 2


def _sse(pod, path, body):
    with requests.post(pod.url + path, json=body, headers=auth(), stream=True, timeout=5) as r:
        assert r.status_code == 200, r.text
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    return [json.loads(e[len(b"data: "):]) for e in events[:-1]]


def test_non_streamed_answers_carry_usage_and_stream_options_need_stream(pod):
    body = {"model": "m1", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
    r = requests.post(pod.url + "/v1/chat/completions", json=body, headers=auth(), timeout=5)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 3 and usage["total_tokens"] == usage["prompt_tokens"] + 3
    r = requests.post(pod.url + "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}},
                      headers=auth(), timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_bad_requests_get_json_errors(pod):
    r = requests.post(pod.url + "/v1/chat/completions", data=b"{nope", headers=auth(), timeout=5)
    assert r.status_code == 400 and r.json()["error"] == {**r.json()["error"], "type": "Bad Request", "code": 400}
    r = requests.post(pod.url + "/v1/chat/completions", json={"model": "m1"}, headers=auth(), timeout=5)
    assert r.status_code == 400
    r = requests.get(pod.url + "/nowhere", timeout=5)
    assert r.status_code == 404


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body", [{"model": "m1"}, {**CHAT, "max_tokens": -1}, {**CHAT, "max_tokens": 10**12}])
def test_a_refused_request_counts_and_starts_nothing(pod, body):
    before = pod.requests
    r = requests.post(pod.url + "/v1/chat/completions", json=body, headers=auth(), timeout=5)
    assert r.status_code == 400, r.text
    assert pod.requests == before + 1  # counted like any inference request, but nothing was generated
    assert pod.streams == {"completed": 0, "cut": 0}


def test_a_model_it_does_not_serve_is_404_only_when_told_to_serve_one_name():
    with standin.serve(compute_ms=0, model="served/one", any_model=False) as strict:
        r = requests.post(strict.url + "/v1/chat/completions", json={**CHAT, "model": "other"}, timeout=5)
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "The model `other` does not exist. Valid aliases: served/one.", "type": "NotFoundError", "param": "model",
            "code": 404}
        for body in ({**CHAT, "model": "served/one"}, {"messages": CHAT["messages"]}):  # no model: the served one
            r = requests.post(strict.url + "/v1/chat/completions", json=body, timeout=5)
            assert r.status_code == 200 and r.json()["model"] == "served/one", r.text
    with standin.serve(compute_ms=0, model="served/one") as lenient:  # the default (see the module docstring)
        r = requests.post(lenient.url + "/v1/chat/completions", json={**CHAT, "model": "other"}, timeout=5)
        assert r.status_code == 200 and r.json()["model"] == "other"


def test_takes_what_vllm_takes(pod):
    # pydantic's lax mode: "yes" is a bool, "0.5" a float, 3.0 an int; null is the default.
    with requests.post(pod.url + "/v1/chat/completions", json={**CHAT, "stream": "yes"}, headers=auth(), stream=True,
                       timeout=5) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert [line for line in r.iter_lines() if line][-1] == b"data: [DONE]"
    for extra in ({"temperature": "0.5"}, {"max_tokens": 3.0}, {"n": None, "max_tokens": None}, {"stream": 0},
                  {"max_completion_tokens": 2, "max_tokens": -1}):
        r = requests.post(pod.url + "/v1/chat/completions", json={**CHAT, **extra}, headers=auth(), timeout=5)
        assert r.status_code == 200, (extra, r.text)
    r = requests.post(pod.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3.0}, headers=auth(), timeout=5)
    assert r.json()["usage"]["completion_tokens"] == 3


def test_a_body_nested_past_the_recursion_limit_is_vllms_bare_500(pod):
    # The breaker attack (one key, bodies that crash the pod): vLLM parses with json.loads, which raises RecursionError
    # outside its JSON error handler, so a real pod answers Starlette's plain 500.
    deep = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    r = requests.post(pod.url + "/v1/chat/completions", data=deep, headers=auth(), timeout=5)
    assert r.status_code == 500 and r.text == "Internal Server Error"
    assert requests.get(pod.url + "/health", headers=auth(), timeout=5).status_code == 200  # and it still serves


def test_fault_injection_error_slow_hang_and_back(pod):
    msg = {"messages": [{"role": "user", "content": "x"}]}
    r = requests.post(pod.url + "/_standin/fault", json={"mode": "error"}, timeout=5)
    assert r.json()["fault"]["mode"] == "error"
    assert requests.post(pod.url + "/v1/chat/completions", json=msg, headers=auth(), timeout=5).status_code == 500
    assert requests.get(pod.url + "/health", headers=auth(), timeout=5).status_code == 500
    pod.set_fault("slow", delay_ms=150)
    t0 = time.monotonic()
    assert requests.get(pod.url + "/health", headers=auth(), timeout=5).status_code == 200
    assert time.monotonic() - t0 >= 0.15
    pod.set_fault("hang")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(pod.url + "/health", headers=auth(), timeout=0.3)
    pod.set_fault("ok")
    assert requests.get(pod.url + "/health", headers=auth(), timeout=5).status_code == 200
    r = requests.post(pod.url + "/_standin/fault", json={"mode": "explode"}, timeout=5)
    assert r.status_code == 400 and "explode" in r.json()["error"]["message"]


def test_a_hanging_request_does_not_block_shutdown():
    with standin.serve(compute_ms=0) as server:
        server.set_fault("hang")
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_cli_prints_url_writes_port_file_and_stops_on_sigterm(tmp_path):
    port_file = tmp_path / "p.json"
    env = {**os.environ, "POD_TOKEN": "tok", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port", "0", "--compute-ms", "1",
                             "--model", "cli-model", "--port-file", str(port_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert info["url"] == f"http://127.0.0.1:{info['port']}"
        assert json.loads(port_file.read_text())["pid"] == proc.pid
        r = requests.get(info["url"] + "/v1/models", headers=auth("tok"), timeout=5)
        assert r.json()["data"][0]["id"] == "cli-model"
        assert requests.get(info["url"] + "/v1/models", timeout=5).status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not port_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
