"""Admission through the real Worker in workerd: a request is admitted only when its
own most fits each of its key's limits (OpenAI's rule), a key's uploads hold its own slots and
are bounded in time, and sizes the client chose (``echo`` of long prompts) are never the pod's
failure. The pure parts: worker/test/limits.test.js, worker/test/metering.test.js."""

from __future__ import annotations

import json
import random
import socket
import string
import time
from urllib.parse import urlsplit

import pytest

from tests.support.workerd import request, running_cell

pytestmark = pytest.mark.slow

BODY_TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 2_000, "bodyTimeoutMs": BODY_TIMEOUT_MS}, compute_ms=1) as c:
        yield c


@pytest.fixture
def client(openai_client):
    """client(cell, key): an openai client of ``cell`` with ``key``, closed after the test."""
    return lambda cell, key: openai_client(cell.url + "/v1", key)


HI = [{"role": "user", "content": "hi"}]


def test_a_request_that_can_never_fit_a_token_limit_is_a_400_naming_the_limit_and_the_fix(cell, client):
    # a 50-token monthly key was once admitted for a request the router reserved at 24,207
    import openai
    tiny = client(cell, cell.create_key("tiny", monthly_tokens=50)["key"])
    with pytest.raises(openai.BadRequestError) as exc:
        tiny.chat.completions.create(model="m", messages=HI, max_tokens=1)
    # the body alone is more bytes than 50 tokens may be: the prompt is at fault
    assert (exc.value.code, exc.value.param) == ("request_too_large", "messages")
    assert "more than this key's 50 tokens a month (its monthly_tokens)" in exc.value.message
    # a tpm 200 key got 1,535 tokens in a minute: without max_tokens a request may use the context
    tpm = client(cell, cell.create_key("tpm", tpm=200)["key"])
    with pytest.raises(openai.BadRequestError) as exc:
        tpm.chat.completions.create(model="m", messages=HI)
    assert (exc.value.code, exc.value.param) == ("request_too_large", "max_tokens")
    assert "may use 8192 tokens" in exc.value.message and "(its tpm): set max_tokens to at most" in exc.value.message
    before = cell.pod.requests
    assert tpm.chat.completions.create(model="m", messages=HI, max_tokens=5).choices[0].message.content
    assert cell.pod.requests == before + 1  # the refusals never reached the pod


def test_a_request_whose_most_is_more_than_the_month_has_left_is_a_429_saying_what_is_left(cell, client):
    import openai
    made = cell.create_key("month", monthly_tokens=6_000, tpm=0, rpm=0)
    c = client(cell, made["key"])
    # 50 tokens used (vLLM's min_tokens and ignore_eos: exactly 50), then a request whose most fits
    # the month's 6,000 alone (75 bytes and 5,905) but not beside them
    first = c.chat.completions.create(model="m", messages=HI, max_tokens=50, extra_body={"min_tokens": 50, "ignore_eos": True})
    assert first.usage.completion_tokens == 50
    deadline = time.monotonic() + 15
    while True:  # until the first request's usage is in the month's count (this isolate's, at once)
        with pytest.raises(openai.RateLimitError) as exc:
            c.chat.completions.create(model="m", messages=HI, max_tokens=5_905)
        if "left this month" in exc.value.message or time.monotonic() > deadline:
            break
    assert exc.value.code == "insufficient_quota"
    assert "this request may use" in exc.value.message and "lower max_tokens" in exc.value.message
    assert c.chat.completions.create(model="m", messages=HI, max_tokens=5).choices  # what fits is still admitted


def _upload(url: str, key: str, declared: int, first: bytes) -> socket.socket:
    """A POST whose headers and the first bytes of its body are sent, the rest held back."""
    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port), timeout=15)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"authorization: Bearer {key}\r\ncontent-length: {declared}\r\n\r\n".encode() + first)
    return s


def _status(s: socket.socket) -> tuple[int, bytes]:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(head.split(b" ")[1]), rest


def test_a_keys_uploads_hold_its_own_slots_and_a_slow_one_is_refused_in_time(cell, client):
    made = cell.create_key("uploads", rpm=0, tpm=0, monthly_tokens=0, max_parallel=2)
    start = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 1000
    held = [_upload(cell.url, made["key"], 900_000, start) for _ in range(2)]
    try:
        time.sleep(0.3)  # both are in the router, waiting for their bodies
        # A third upload of the key is refused at once, before any of its body is read: its key's
        # two slots are held by the first two (once: 150 such uploads, 184 MB in one isolate).
        third = _upload(cell.url, made["key"], 900_000, b"")
        t0 = time.monotonic()
        status, body = _status(third)
        third.close()
        assert status == 429 and json.loads(body)["error"]["code"] == "too_many_parallel_requests", body
        assert time.monotonic() - t0 < BODY_TIMEOUT_MS / 1000, "refused before any body, not at the body's time bound"
        # The held ones are refused once their bodies are late, and their slots freed.
        for s in held:
            status, body = _status(s)
            err = json.loads(body)["error"]
            assert status == 408 and err["code"] == "request_timeout" and f"within {BODY_TIMEOUT_MS} ms" in err["message"]
    finally:
        for s in held:
            s.close()
    assert client(cell, made["key"]).chat.completions.create(model="m", messages=HI, max_tokens=3).choices


def test_echo_of_long_prompts_is_the_clients_size_and_never_the_pods_failure(cell):
    rng = random.Random(58)
    prompts = ["".join(rng.choice(string.ascii_lowercase + " ") for _ in range(15_000)) for _ in range(64)]
    body = {"model": "m", "prompt": prompts, "echo": True, "max_tokens": 1}
    keys = [cell.create_key(f"echo-{i}", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0, max_parallel_tokens=0)["key"]
            for i in range(2)]
    # three of these from two keys once opened the breaker (502 oversized, charged to the pod)
    for i in range(3):
        res = request(cell.url, "POST", "/v1/completions", body=body, headers={"authorization": f"Bearer {keys[i % 2]}"})
        assert res.status == 200, res.body[:300]
        assert res.headers["x-colocate-backend"] == "pod-0"
        assert res.json()["choices"][0]["text"].startswith(prompts[0])  # the prompt came back whole
    streamed = request(cell.url, "POST", "/v1/completions", body={**body, "stream": True},
                       headers={"authorization": f"Bearer {keys[0]}"})
    assert streamed.status == 200 and prompts[-1].encode() in streamed.body and b"stream_too_large" not in streamed.body
    pods = cell.breaker()["pods"]
    assert all(p["failures"] == 0 and p["state"] == "closed" for p in pods), pods
