"""Zero trust in the router, through the real Worker in workerd: a hostile pod, hidden usage,
a slow upload, a client's ``defer``, operator credentials of the wrong role, a client's
account headers. Each attack gets its exact answer, and every served request is counted
once, with the tokens the request allows (docs/worker.md, "Who holds what" and "What the
router believes").
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

import pytest

from tests.support.workerd import OPERATOR_TOKENS, SECRETS, auth, request, running_cell

pytestmark = pytest.mark.slow

READ, ADMIN, EXCHANGE = (OPERATOR_TOKENS[k] for k in ("readToken", "adminToken", "exchangeToken"))
DEADLINE_MS = 3000  # the pod's first byte: well past a loaded machine's stalls


@pytest.fixture(scope="module")
def cell():
    with running_cell({"deadlineMs": DEADLINE_MS, "stateTtlMs": 60_000}, compute_ms=5, split_tokens=True) as c:
        yield c


@pytest.fixture
def key(cell):
    """A fresh key per test, so its usage row holds that test's requests only."""
    made = cell.create_key("sec")
    yield made
    for s in (*cell.pods, cell.fallback):
        s.set_fault("ok")


@contextlib.contextmanager
def pod_serves(cell):
    """The pod serves these requests whatever earlier tests' pod failures did to its breaker
    (the module's cell is shared): pinned closed, then released."""
    assert request(cell.url, "PUT", "/_colocate/breaker", body={"force": "closed"}, headers=auth(ADMIN)).status == 200
    try:
        yield
    finally:
        request(cell.url, "PUT", "/_colocate/breaker", body={"force": None}, headers=auth(ADMIN))


def body(max_tokens: int = 4, stream: bool = False, **extra) -> bytes:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens, **extra}
    if stream:
        doc["stream"] = True
    return json.dumps(doc).encode()


def call(cell, key, data: bytes, headers: dict | None = None, **kw):
    return request(cell.url, "POST", "/v1/chat/completions", body=data,
                   headers={"authorization": f"Bearer {key['key']}", "content-type": "application/json", **(headers or {})},
                   **kw)


def usage_row(cell, key, requests: int, timeout_s: float = 15.0) -> dict:
    """The key's usage row once it holds `requests` requests, each with the backend that served
    it (isolates flush within a second); then a little longer, so a request counted twice would
    show. A request is counted at admission and its backend (or a deferred one's withdrawal)
    when it ends: under load the two can reach the generation in different syncs."""
    deadline = time.monotonic() + timeout_s
    row: dict = {}
    while time.monotonic() < deadline:
        res = request(cell.url, "GET", f"/_colocate/usage?key={key['id']}", headers=auth(READ))
        assert res.status == 200, res.body
        rows = res.json()["usage"]
        row = {k: sum(r[k] for r in rows) for k in ("requests", "prompt_tokens", "completion_tokens", "pod_requests",
                                                     "fallback_requests", "estimated_tokens")} if rows else {}
        if row.get("requests", 0) >= requests and row["requests"] == row["pod_requests"] + row["fallback_requests"]:
            time.sleep(1.2)
            again = request(cell.url, "GET", f"/_colocate/usage?key={key['id']}", headers=auth(READ)).json()["usage"]
            assert sum(r["requests"] for r in again) == requests
            return row
        time.sleep(0.1)
    raise AssertionError(f"usage of {key['id']} did not reach {requests} requests: {row}")


def standin_prompt_tokens(data: bytes) -> int:
    return max(1, len(json.dumps(json.loads(data)["messages"])) // 4)  # colocate.pods.standin.prompt_tokens


# --- the router believes its pod no more than it must ------------------------------------

def test_inflated_usage_is_capped_by_what_the_request_allows(cell, key):
    cell.pod.set_fault("hostile", attack="usage_inflated")
    data = body(max_tokens=4)
    res = call(cell, key, data)
    assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
    streamed = call(cell, key, body(max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert streamed.status == 200 and b"[DONE]" in streamed.body
    row = usage_row(cell, key, 2)
    # prompt: no more tokens than the body has bytes; completion: max_tokens x n.
    assert row["prompt_tokens"] == len(data) + len(body(max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert row["completion_tokens"] == 4 + 3 and row["pod_requests"] == 2
    # The key can go on: its month is not burnt, and the counters stay whole numbers.
    cell.pod.set_fault("ok")
    assert call(cell, key, data).status == 200


def test_hidden_usage_is_read_from_the_top_level(cell, key):
    cell.pod.set_fault("hostile", attack="usage_hidden")
    # A request read whole, not assembled from a stream (an answer of at most 16 tokens:
    # router.js WHOLE_MAX_TOKENS), where a hostile pod's answer can hide a "usage" after the real one.
    data = body(max_tokens=4)
    res = call(cell, key, data)
    assert res.status == 200 and res.json()["prompt_logprobs"][-1]["2"]["decoded_token"] == "usage"
    row = usage_row(cell, key, 1)
    assert (row["prompt_tokens"], row["completion_tokens"], row["estimated_tokens"]) == (standin_prompt_tokens(data), 4, 0)


def test_response_headers_are_an_allowlist(cell, key):
    cell.pod.set_fault("hostile", attack="headers")
    for data in (body(), body(stream=True)):
        res = call(cell, key, data)
        assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
        assert "set-cookie" not in res.headers and "access-control-allow-origin" not in res.headers
        assert "x-standin" not in res.headers and res.headers["content-type"].split(";")[0] in (
            "application/json", "text/event-stream")
    assert usage_row(cell, key, 2)["pod_requests"] == 2


def test_a_redirect_is_not_followed_and_the_fallback_serves(cell, key):
    cell.pod.set_fault("hostile", attack="redirect")
    before = cell.fallback.requests
    res = call(cell, key, body())
    assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
    assert res.json()["object"] == "chat.completion"
    assert cell.pod.redirected == 0 and cell.fallback.redirected == 0
    assert cell.fallback.requests == before + 1
    row = usage_row(cell, key, 1)
    assert (row["pod_requests"], row["fallback_requests"]) == (0, 1)


def test_an_oversized_answer_is_cut_and_the_fallback_serves(cell, key):
    cell.pod.set_fault("hostile", attack="oversized")
    # Read whole (an answer of at most 16 tokens is not streamed): past 16 MiB it is a failure
    # before any answer, so the fallback serves.
    res = call(cell, key, body(), timeout=60)
    assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
    assert len(res.body) < 4096 and res.json()["object"] == "chat.completion"
    row = usage_row(cell, key, 1)
    assert (row["pod_requests"], row["fallback_requests"]) == (0, 1)


def test_an_oversized_stream_for_an_assembled_answer_is_cut_counted_and_not_bought_again():
    # A cell of its own: the stand-in's oversized stream may run on after the cut (seen in
    # workerd with the assembled answer's BYOB reader), holding the module's pod.
    with running_cell({"deadlineMs": DEADLINE_MS, "stateTtlMs": 60_000}, compute_ms=5, split_tokens=True) as cell:
        _oversized_assembled(cell, cell.create_key("sec"))


def _oversized_assembled(cell, key):
    cell.pod.set_fault("hostile", attack="oversized")
    before = cell.fallback.requests
    # Asked as a stream for a client that asked none (an answer longer than the router asks
    # whole, router.js WHOLE_MAX_TOKENS): past what max_tokens allows (usage.js streamCap) after
    # its first token, the answer has begun: a 502, counted within max_tokens.
    res = call(cell, key, body(max_tokens=32), timeout=60)
    assert res.status == 502 and res.headers["x-colocate-backend"] == "pod-0"
    assert res.json()["error"]["code"] == "upstream_broken"
    assert cell.fallback.requests == before
    row = usage_row(cell, key, 1)
    assert (row["pod_requests"], row["fallback_requests"]) == (1, 0) and row["completion_tokens"] <= 32


def stream_cut(cell, key, data: bytes) -> tuple[int, bytes, bool]:
    """(status, the bytes received, whether the chunked body ended properly)."""
    import http.client

    host, port = cell.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=data,
                     headers={"authorization": f"Bearer {key['key']}", "content-type": "application/json"})
        res = conn.getresponse()
        assert res.getheader("x-colocate-backend") == "pod-0"
        try:
            return res.status, res.read(), True
        except http.client.IncompleteRead as exc:
            return res.status, exc.partial, False
    finally:
        conn.close()


@pytest.mark.parametrize("include_usage", [False, True], ids=["router-asks-usage", "client-asks-usage"])
def test_a_stream_past_what_the_request_can_produce_is_cut_and_counted(cell, key, include_usage):
    """A pod that streams on and on (about 3 MB/s, up to 64 MiB) past 64 KiB + 4 KiB per allowed
    token: every pod stream passes through the router's own pump (podstream.js pumpPod: it takes
    the continuous usage it asked for out of the client's events, whether or not the client asked
    for usage), which cuts at that cap and ends with an error event. The pod's stream is cancelled
    and the request counted once, within max_tokens."""
    cell.pod.set_fault("hostile", attack="oversized")
    cut_before = cell.pod.streams["cut"]
    data = body(max_tokens=4, stream=True, **({"stream_options": {"include_usage": True}} if include_usage else {}))
    status, got, ended = stream_cut(cell, key, data)
    cap = 65_536 + 4 * 4096
    assert status == 200
    events = [e for e in got.split(b"\n\n") if e]
    assert ended and len(got) <= cap + len(events[-1]) + 2
    assert json.loads(events[-1].removeprefix(b"data: ")) == {"error": {
        "message": f"the upstream's stream passed {cap} bytes, more than this request can produce: cut here",
        "type": "server_error", "code": "stream_too_large"}}
    deadline = time.monotonic() + 15
    while cell.pod.streams["cut"] == cut_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cell.pod.streams["cut"] == cut_before + 1  # the pod's stream was cancelled, not read to its end
    row = usage_row(cell, key, 1)
    assert (row["pod_requests"], row["completion_tokens"]) == (1, 4)  # estimated from the text, within max_tokens
    assert row["estimated_tokens"] == row["prompt_tokens"] + 4


# --- denial of wallet -------------------------------------------------------------------

def test_a_slow_upload_is_not_charged_to_the_pods_deadline(cell, key):
    """The body arrives over more than the deadline; the pod still serves (not the fallback)."""
    data = body()
    host, port = cell.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key['key']}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode())
        half = len(data) // 2
        s.sendall(data[:half])
        time.sleep(DEADLINE_MS / 1000 + 0.5)
        s.sendall(data[half:])
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head = raw.split(b"\r\n\r\n", 1)[0].decode().lower()
    assert head.startswith("http/1.1 200") and "x-colocate-backend: pod-0" in head
    row = usage_row(cell, key, 1)
    assert (row["pod_requests"], row["fallback_requests"]) == (1, 0)


def test_a_clients_defer_header_is_ignored(cell, key):
    """Only the front door, with the cell's exchange token, may ask for "no pod"."""
    cell.pod.set_fault("error")
    for headers in ({"x-colocate-fallback": "defer"}, {"x-colocate-fallback": "defer", "x-colocate-front": READ}):
        res = call(cell, key, body(), headers)
        assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
    # The front door's own request (the exchange token) is deferred: 503 no_pod, not counted here.
    res = call(cell, key, body(), {"x-colocate-fallback": "defer", "x-colocate-front": EXCHANGE})
    assert res.status == 503 and res.json()["error"]["code"] == "no_pod"
    row = usage_row(cell, key, 2)
    assert row["fallback_requests"] == 2
    assert all("x-colocate-front" not in h and "x-colocate-fallback" not in h for h in cell.fallback.seen_headers)


def test_client_account_headers_do_not_reach_the_fallback(cell, key):
    cell.pod.set_fault("error")
    sent = {"OpenAI-Organization": "org-victim", "OpenAI-Project": "proj_x", "Cookie": "a=b", "X-Forwarded-For": "6.6.6.6"}
    res = call(cell, key, body(), sent)
    assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
    seen = cell.fallback.seen_headers[-1]
    assert not {"openai-organization", "openai-project", "cookie", "x-forwarded-for"} & set(seen)
    assert seen["authorization"] == f"Bearer {SECRETS['FALLBACK_API_KEY']}"
    assert usage_row(cell, key, 1)["fallback_requests"] == 1


def test_each_key_gets_its_own_prefix_cache_salt_and_cannot_choose_another(cell, key):
    other = cell.create_key("sec-other")
    # The pod serves these whatever earlier tests' pod failures did to its breaker.
    assert request(cell.url, "PUT", "/_colocate/breaker", body={"force": "closed"}, headers=auth(ADMIN)).status == 200
    try:
        for k in (key, other):
            for data in (body(cache_salt="victim-salt"), body(stream=True)):
                res = call(cell, k, data)
                assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0"
    finally:
        request(cell.url, "PUT", "/_colocate/breaker", body={"force": None}, headers=auth(ADMIN))
    salts = [b.get("cache_salt") for b in cell.pod.seen_bodies[-4:]]
    assert salts == [key["id"], key["id"], other["id"], other["id"]]
    assert usage_row(cell, key, 2)["pod_requests"] == 2


# --- what a pod is sent of a client's request (worker/src/podfields.js) --------------------

# vLLM's engine fields a client could once pass to the pod (docs/worker.md, "what the pods are sent").
ENGINE_FIELDS = {
    "chat_template": "{{ 'x' }}", "chat_template_kwargs": {"enable_thinking": True}, "mm_processor_kwargs": {"fps": 1},
    "media_io_kwargs": {"video": {"num_frames": 1}}, "guided_regex": "a+", "guided_grammar": 'root ::= "a"',
    "structured_outputs": {"regex": "a+"}, "guided_decoding_backend": "xgrammar",
    "kv_transfer_params": {"do_remote_decode": True}, "priority": -100, "logits_processors": ["x.y"], "vllm_xargs": {"a": 1},
    "request_id": "victim", "allowed_token_ids": [1],
    "bad_words": ["no"], "truncate_prompt_tokens": 1, "documents": [{"title": "t", "text": "x"}], "prompt_embeds": "UEsDBA==",
}
MEDIA = {
    "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}, "audio_url": {"url": "https://example.com/a.wav"},
    "video_url": {"url": "https://example.com/v.mp4"}, "input_audio": {"data": "AAAA", "format": "wav"},
    "image_embeds": "UEsDBA==",
}


def test_vllm_engine_fields_and_media_parts_never_reach_a_pod(cell, key):
    before = cell.pod.requests
    for field, value in ENGINE_FIELDS.items():
        res = call(cell, key, body(**{field: value}))
        assert res.status == 400, (field, res.body)
        assert (res.json()["error"]["param"], res.json()["error"]["code"]) == (field, "unsupported_parameter"), res.body
    for kind, value in MEDIA.items():
        content = [{"type": "text", "text": "what is this?"}, {"type": kind, kind: value}]
        res = call(cell, key, json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode())
        assert res.status == 400 and res.json()["error"]["param"] == "messages[0].content[1].type", (kind, res.body)
    assert cell.pod.requests == before  # nothing reached the pod, and nothing was counted
    # OpenAI's own fields the pods do not serve are dropped, so a client written for OpenAI is served.
    res = call(cell, key, body(store=True, metadata={"a": "b"}, top_k=5))
    assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0", res.body
    seen = cell.pod.seen_bodies[-1]
    assert "store" not in seen and "metadata" not in seen and seen["top_k"] == 5, seen
    assert usage_row(cell, key, 1)["requests"] == 1


def test_the_engine_request_id_is_the_routers_and_the_query_string_stays_in_the_worker(cell, key):
    path = "/v1/chat/completions?api-version=2024-02-01&stream=true"
    sent = {"authorization": f"Bearer {key['key']}", "content-type": "application/json", "x-request-id": "victim-request"}
    with pod_serves(cell):
        res = request(cell.url, "POST", path, body=body(), headers=sent)
    assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0", res.body
    seen = cell.pod.seen_headers[-1]
    assert re.fullmatch(r"[0-9a-f]{32}", seen["x-request-id"]), seen  # 128 random bits, never the client's
    assert cell.pod.seen_paths[-1] == "/v1/chat/completions"
    # Each request its own id: one client cannot name another's request at the engine.
    assert request(cell.url, "POST", path, body=body(), headers=sent).status == 200
    assert cell.pod.seen_headers[-1]["x-request-id"] != seen["x-request-id"]
    cell.pod.set_fault("error")
    res = request(cell.url, "POST", path, body=body(), headers=sent)
    assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback", res.body
    assert cell.fallback.seen_paths[-1] == "/v1/chat/completions"
    assert "x-request-id" not in cell.fallback.seen_headers[-1]


# --- least privilege for operators -------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("POST", "/_colocate/keys", {ADMIN}),
    ("GET", "/_colocate/keys", {READ, ADMIN}),
    ("GET", "/_colocate/probe", {READ, ADMIN}),
    ("GET", "/_colocate/usage", {READ, ADMIN}),
    ("GET", "/_colocate/live", {READ, ADMIN}),
    ("GET", "/_colocate/metrics", {READ, ADMIN}),
    ("PUT", "/_colocate/breaker", {ADMIN}),
    ("GET", "/_colocate/keys/replica", {ADMIN}),
    ("GET", "/_colocate/fleet/counters", {EXCHANGE}),
])
def test_each_operator_credential_opens_only_its_role(cell, method, path, allowed):
    data = {"name": "minted"} if path == "/_colocate/keys" and method == "POST" else (
        {"force": None} if path == "/_colocate/breaker" else None)
    for token in (READ, ADMIN, EXCHANGE, SECRETS["PROBE_TOKEN"]):
        res = request(cell.url, method, path, body=data, headers=auth(token))
        if token in allowed:
            assert res.status in (200, 201), (token, res.body)
        elif token == SECRETS["PROBE_TOKEN"]:  # not bound on this cell: no credential at all
            assert res.status == 401 and res.json()["error"]["code"] == "unauthorized"
        else:
            assert res.status == 403, (token, res.body)
            error = res.json()["error"]
            assert error["code"] == "forbidden" and path in error["message"]


def test_a_read_token_cannot_mint_a_key(cell):
    res = request(cell.url, "POST", "/_colocate/keys", body={"name": "stolen"}, headers=auth(READ))
    assert res.status == 403
    assert res.json()["error"] == {"message": "this credential cannot POST /_colocate/keys: it needs ADMIN_TOKEN",
                                   "type": "invalid_request_error", "code": "forbidden"}
    names = [k["name"] for k in request(cell.url, "GET", "/_colocate/keys", headers=auth(READ)).json()["keys"]]
    assert "stolen" not in names


# --- strangers ------------------------------------------------------------------------------

def test_a_flood_of_guessed_keys_from_one_address_is_refused_and_real_keys_still_pass(cell, key):
    """Each address has 100 look-ups of unknown keys at once and 10 a second more (strangers.js):
    past that, 429 before any hashing or look-up. Keys from other addresses, and keys this
    isolate already accepted, are not held up."""
    import secrets
    from concurrent.futures import ThreadPoolExecutor

    flood_from, other = "203.0.113.9", "198.51.100.7"
    warm = call(cell, key, body(), {"cf-connecting-ip": flood_from})
    assert warm.status == 200
    fresh = cell.create_key("sec-fresh")  # never presented yet: its first request is a look-up
    guesses = ["clc_" + secrets.token_urlsafe(24)[:32] for _ in range(300)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda g: call(cell, {"key": g}, body(), {"cf-connecting-ip": flood_from}), guesses))
        elapsed = time.monotonic() - t0
        with pod_serves(cell):
            real = call(cell, fresh, body(), {"cf-connecting-ip": other})
        again = call(cell, key, body(), {"cf-connecting-ip": flood_from})
    codes = [a.json()["error"]["code"] for a in answers]
    assert set(codes) <= {"invalid_api_key", "too_many_unknown_keys"}
    looked_up = codes.count("invalid_api_key")
    assert looked_up <= 100 + 10 * elapsed + 1, (looked_up, elapsed)
    refused = [a for a in answers if a.status == 429]
    assert len(refused) == len(answers) - looked_up
    for a in refused:
        assert a.headers["retry-after"] == "1"
        assert a.json()["error"]["message"].startswith("too many unknown API keys from this address: at most 100 at once")
    assert (real.status, real.headers["x-colocate-backend"]) == (200, "pod-0")
    assert again.status == 200
    assert usage_row(cell, key, 2)["requests"] == 2


EDGE_TOTAL = "too many unknown API keys at this edge"  # strangers.js takeTotal's refusal


async def _flood(url: str, guesses: list[str], reals: list[str], data: bytes, at_once: int,
                 reals_from: int) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], int]:
    """Each guess in one POST from its own IPv6 /64, ``at_once`` connections in flight, and the
    ``reals`` sent beside them one at a time: each as a guess is refused by the isolate's total
    (it is empty then), and one every 50 guesses from the ``reals_from``-th (a loaded machine's
    workerd may take guesses slower than the total refills, and then they queue for look-ups).
    Returns the guesses' (status, body), the reals', and how many reals went as the total refused."""
    import asyncio
    from urllib.parse import urlsplit

    host, port = urlsplit(url).hostname, urlsplit(url).port
    gate = asyncio.Semaphore(at_once)
    sent: list[asyncio.Task] = []
    on_empty = 0

    async def post(key: str, i: int) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
                f"cf-connecting-ip: 2001:db8:{i >> 16:x}:{i & 0xffff:x}::1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\nconnection: close\r\n\r\n")
        writer.write(head.encode() + data)
        raw = await asyncio.wait_for(reader.read(), 60)
        writer.close()
        status = int(raw.split(b" ", 2)[1])
        payload = raw.split(b"\r\n\r\n", 1)[1]
        if b"transfer-encoding: chunked" in raw.split(b"\r\n\r\n", 1)[0].lower():
            payload = payload.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
        return status, payload

    def send_real() -> bool:
        if len(sent) == len(reals):
            return False
        sent.append(asyncio.ensure_future(post(reals[len(sent)], len(guesses) + len(sent))))
        return True

    async def guess(i: int) -> tuple[int, bytes]:
        nonlocal on_empty
        async with gate:
            if i >= reals_from and (i - reals_from) % 50 == 0:
                send_real()
            answer = await post(guesses[i], i)
            if answer[0] == 429 and EDGE_TOTAL.encode() in answer[1] and send_real():
                on_empty += 1
            return answer

    answers = list(await asyncio.gather(*(guess(i) for i in range(len(guesses)))))
    while send_real():
        pass
    return answers, list(await asyncio.gather(*sent)), on_empty


def test_guesses_from_rotating_addresses_never_starve_a_real_key_new_to_the_isolate(cell):
    """Each guess from its own /64 (the per-address budget never applies), 1,500 at once: past
    the isolate's total (1,000 at once, 200 a second) guesses get 429, but real keys new to this
    isolate are vouched for by its key filter (keyfilter.js), never meet the total, and are
    looked up ahead of the guesses waiting for theirs. Twenty real keys, each sent as a guess was
    refused by the total: were they drawing on it, a refill's token would seldom be theirs."""
    import asyncio
    import secrets

    fresh = [cell.create_key(f"sec-rotating-{i}") for i in range(20)]  # never presented: each first request is a look-up
    # The isolate learns of them with its next sync: the live view syncs the isolate that answers it
    # first, where a routed request's flush (within a second) may come late on a loaded machine.
    assert request(cell.url, "GET", "/_colocate/live", headers=auth(READ)).status == 200
    guesses = ["clc_" + secrets.token_urlsafe(24)[:32] for _ in range(3000)]
    answers, reals, on_empty = asyncio.run(_flood(cell.url, guesses, [k["key"] for k in fresh], body(), 1500, 2000))
    assert [status for status, _ in reals] == [200] * len(fresh), ([p[:200] for s, p in reals if s != 200], on_empty)
    # Every guess is refused: unknown after its look-up, over the total, or (a look-up wait past
    # 5 s, on a loaded machine) told to retry. None is served.
    seen = {(s, json.loads(p)["error"]["code"]) for s, p in answers}
    assert seen <= {(401, "invalid_api_key"), (429, "too_many_unknown_keys"), (503, "key_lookup_busy")}, seen
    assert (401, "invalid_api_key") in seen, seen
    assert usage_row(cell, fresh[0], 1)["requests"] == usage_row(cell, fresh[-1], 1)["requests"] == 1
