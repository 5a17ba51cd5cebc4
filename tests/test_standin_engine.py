"""The stand-in under a real profile, as a process: tokens over time, the slow_tokens fault,
vLLM's /metrics, what vLLM refuses. Times are asserted as lower bounds (a busy machine only adds)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from colocate.pods import engine, profiles, standin

ROOT = Path(__file__).resolve().parent.parent
PROFILE = profiles.get(profiles.DEFAULT_PROFILE)
MODEL = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pod():
    """A stand-in process under the default profile, serving one model only, as a real pod does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "POD_TOKEN": "t"}
    proc = subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port", "0", "--profile", PROFILE.name,
                             "--model", MODEL, "--seed", "1"], stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline() if proc.stdout else b""
        assert line, "the stand-in did not start"
        yield json.loads(line)["url"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


def post(url, body, stream=False):
    return requests.post(url + "/v1/chat/completions", json={"model": MODEL, **body}, stream=stream, timeout=60,
                         headers={"Authorization": "Bearer t"})


def token_times(url, body) -> tuple[float, list[float], list[dict]]:
    t0 = time.monotonic()
    times, chunks = [], []
    with post(url, {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if "role" in chunk["choices"][0]["delta"]:
                    continue  # vLLM's opening event (the role, empty content) comes with the first token
                times.append(time.monotonic())
                chunks.append(chunk)
    return t0, times, chunks


EXACT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 40, "min_tokens": 40, "ignore_eos": True}


def test_a_stream_emits_its_tokens_one_step_apart(pod):
    t0, times, chunks = token_times(pod, EXACT)
    assert len(times) == 40 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # 39 decode steps of one sequence each: no faster than the profile's step, and so no faster than physics.
    # (A late step's lag is made up by the next ones, up to CATCH_UP_S.)
    assert times[-1] - times[0] >= 39 * PROFILE.step_ms(1, 0) / 1000 - standin.CATCH_UP_S
    assert PROFILE.step_ms(1, 0) >= PROFILE.decode_floor_ms


def test_a_non_streamed_answer_is_sent_at_its_last_token(pod):
    t0 = time.monotonic()
    r = post(pod, {**EXACT, "max_tokens": 60, "min_tokens": 60})
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert elapsed >= 60 * PROFILE.step_ms(1, 0) / 1000 - standin.CATCH_UP_S


def test_slow_tokens_divides_the_token_rate(pod):
    _t, times, _c = token_times(pod, EXACT)
    normal = times[-1] - times[0]
    control = pod  # without TLS the control routes are on the pod's own port
    assert requests.post(control + "/_standin/fault", json={"mode": "slow_tokens", "factor": 3}, timeout=5).ok
    try:
        _t, times, _c = token_times(pod, EXACT)
        slow = times[-1] - times[0]
    finally:
        requests.post(control + "/_standin/fault", json={"mode": "ok"}, timeout=5)
    assert slow >= 3 * 39 * PROFILE.step_ms(1, 0) / 1000 - standin.CATCH_UP_S
    assert slow > 2 * normal
    bad = requests.post(control + "/_standin/fault", json={"mode": "slow_tokens"}, timeout=5)
    assert bad.status_code == 400 and "factor" in bad.json()["error"]["message"]


def scrape(url) -> tuple[str, dict[str, float]]:
    text = requests.get(url + "/metrics", headers={"Authorization": "Bearer t"}, timeout=5).text
    return text, {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}


def test_metrics_use_vllms_names(pod):
    messages = [{"role": "system", "content": "You answer briefly. " * 60}, {"role": "user", "content": "hi"}]
    long = {"messages": messages, "max_tokens": 2}
    assert post(pod, long).status_code == 200
    _text, before = scrape(pod)
    assert post(pod, long).status_code == 200  # the same prompt again: its prefix is cached
    text, samples = scrape(pod)
    prompt = len(engine.tokenize(engine.chat_text(messages)))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert name in samples, name
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text  # prometheus_client's spelling, as vLLM's
    # Every full block of the prompt but the one holding its last token (computed again, as in vLLM).
    assert samples["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == \
        (prompt - 1) // 16 * 16
    assert samples["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == prompt
    assert samples["vllm:time_to_first_token_seconds_count"] >= 2
    assert 0.0 <= samples["vllm:kv_cache_usage_perc"] <= 1.0


def test_an_unknown_model_is_vllms_404(pod):
    r = post(pod, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": f"The model `gpt-4o` does not exist. Valid aliases: {MODEL}.",
                                 "type": "NotFoundError", "param": "model", "code": 404}


def test_max_tokens_and_stop_end_the_answer(pod):
    r = post(pod, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] <= 5
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "ignore_eos": True, "stop": [" answering"]}
    body = post(pod, ask).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == "This is the colocate stand-in"
    assert body["usage"]["completion_tokens"] == 7  # the token holding the stop string is made, not sent
    # Not before min_tokens: the next " answering" ends it (the answer's words repeat every 24 tokens).
    body = post(pod, {**ask, "min_tokens": 20}).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 31
    assert body["choices"][0]["message"]["content"].count(" answering") == 1


def test_json_object_answers_are_json(pod):
    r = post(pod, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                   "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"]}
    r = post(pod, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"city", "n"}
    for bad in ({"type": "yaml"}, {"type": "json_schema", "json_schema": "x"}, "json"):
        r = post(pod, {"messages": [{"role": "user", "content": "hi"}], "response_format": bad})
        assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]


def test_in_process_oracle_stays_the_default():
    with standin.serve(compute_ms=1) as server:
        assert server.profile.name == "oracle" and server.engine is None
        text = requests.get(server.url + "/metrics", timeout=5).text
        assert "vllm:num_requests_running" in text


def test_slow_tokens_slows_the_oracle_too():
    with standin.serve(compute_ms=100) as server:
        server.set_fault("slow_tokens", factor=3)
        t0 = time.monotonic()
        r = requests.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          timeout=10)
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.3
        assert server.fault == {"mode": "slow_tokens", "delay_ms": 0.0, "factor": 3.0}
        with pytest.raises(ValueError, match="factor must be a number from 1 to 1000"):
            server.set_fault("slow_tokens", factor=0.5)


def test_json_answers_close_their_value_whatever_length_was_drawn():
    schema = {"type": "object", "required": [f"field_{i}" for i in range(12)],
              "properties": {f"field_{i}": {"type": "string", "minLength": 3} for i in range(12)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    pieces, finish = standin.answer_pieces(3, "stop", fmt, cap=500)  # a short draw: the value still closes
    assert finish == "stop" and set(json.loads("".join(pieces))) == set(schema["required"])
    pieces, finish = standin.answer_pieces(500, "length", fmt, cap=500)  # ignore_eos: whitespace after it
    assert finish == "length" and len(pieces) == 500 and json.loads("".join(pieces))
    pieces, finish = standin.answer_pieces(10, "stop", fmt, cap=10)  # max_tokens cuts it, as in vLLM
    assert finish == "length" and len(pieces) == 10
    pieces, _f = standin.answer_pieces(2, "stop", {"type": "json_object"}, cap=None)
    assert json.loads("".join(pieces)) == {"answer": ""}
    with standin.serve(compute_ms=0) as oracle:
        r = requests.post(oracle.url + "/v1/chat/completions", timeout=5, json={
            "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_the_oracle_takes_min_tokens_and_ignore_eos():
    with standin.serve(compute_ms=0) as oracle:
        def ask(**extra):
            body = {"messages": [{"role": "user", "content": "hi"}], **extra}
            return requests.post(oracle.url + "/v1/chat/completions", json=body, timeout=5).json()

        assert ask(max_tokens=600)["usage"]["completion_tokens"] == 9  # its end of sequence comes at nine
        long = ask(max_tokens=600, min_tokens=600, ignore_eos=True)
        assert long["usage"]["completion_tokens"] == 600 and long["choices"][0]["finish_reason"] == "length"
        assert ask(max_tokens=50, min_tokens=30)["usage"]["completion_tokens"] == 30
        assert ask(max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_request_whose_client_left_while_it_waited_leaves_the_queue():
    """vLLM aborts a request whose client disconnects, queued or running: a router that gave up at
    its first-token deadline must not leave the pod prefilling for nobody. max_num_seqs run; the
    rest wait; the waiting ones' clients leave; they leave the queue while every running one runs on."""
    import socket
    from urllib.parse import urlsplit

    seqs = PROFILE.max_num_seqs
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
                       "max_tokens": 1500, "min_tokens": 1500, "ignore_eos": True}).encode()
    with standin.serve(token="t", model=MODEL, profile=PROFILE.name, seed=1) as pod:
        u = urlsplit(pod.url)
        socks = []
        try:
            for _ in range(seqs + 3):
                s = socket.create_connection((u.hostname, u.port), timeout=10)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: pod\r\nAuthorization: Bearer t\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                socks.append(s)
            deadline = time.monotonic() + 30
            while scrape(pod.url)[1]["vllm:num_requests_waiting"] < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert scrape(pod.url)[1]["vllm:num_requests_waiting"] == 3
            # The waiting ones: no token yet (the running ones had theirs within a few steps).
            time.sleep(1.0)
            waiting = []
            for s in socks:
                s.settimeout(0.2)
                got = b""
                with contextlib.suppress(TimeoutError):
                    while b"data: {" not in got:
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        got += chunk
                if b"data: {" not in got:
                    waiting.append(s)
            assert len(waiting) == 3
            for s in waiting:
                s.close()
            deadline = time.monotonic() + 20
            while scrape(pod.url)[1]["vllm:num_requests_waiting"] and time.monotonic() < deadline:
                time.sleep(0.2)
            _text, now = scrape(pod.url)
            # Aborted, not admitted: a 1,500-token answer runs for tens of seconds, so every running
            # one still runs and none of the three took a place.
            assert (now["vllm:num_requests_waiting"], now["vllm:num_requests_running"]) == (0, seqs)
        finally:
            for s in socks:
                s.close()
