"""The cell against a real vLLM (``make test-vllm``): vLLM's CPU build with a tiny random-weight
model of the default model's shape, started through the kit's own start path (podstart.sh, the
cell's certificate bundle, the pod token, the kit's arguments), behind a sandbox cell whose pod
is that server (tests/vllm_cpu/server.py). One vLLM for the whole run.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from colocate.pods import existing, podtls, readiness
from colocate.pods.guard.colocate_pod_guard import readiness_token
from colocate.sandbox import hopcerts
from colocate.sandbox.localca import LocalCA
from tests.support.sandbox import client_key
from tests.support.vllm_routes import NEVER_USED, ROUTER_USES

ROOT = Path(__file__).resolve().parents[2]
EXACT = {"min_tokens": 24, "max_tokens": 24, "ignore_eos": True}  # an answer of exactly 24 tokens
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


# ---- talking to the pod itself (the Worker's side of the hop) ---------------------------------

def pod_call(cell, method: str, path: str, token: str | None = None, body: dict | None = None,
             ctx: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    ctx = ctx or worker_ctx(cell)
    conn = http.client.HTTPSConnection("localhost", cell.port, context=ctx, timeout=60)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def worker_ctx(cell) -> ssl.SSLContext:
    return podtls.client_context(cell.hop.worker.cert_pem, cell.hop.worker.key_pem, cell.hop.public.cert_pem)


def metrics(cell) -> str:
    status, body = pod_call(cell, "GET", "/metrics", cell.token)
    assert status == 200
    return body.decode()


def sample(text: str, name: str) -> float:
    """The sum of a metric's series (vLLM exposes counters as ``<name>_total``)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    assert values, f"{name} is not in vLLM's /metrics"
    return sum(values)


def idle(cell, timeout_s: float = 120) -> str:
    """vLLM's /metrics once it runs and queues nothing (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(cell)
        if sample(text, "vllm:num_requests_running") == 0 and sample(text, "vllm:num_requests_waiting") == 0:
            return text
        assert time.monotonic() < deadline, "vLLM still runs a request"
        time.sleep(0.2)


# ---- talking to the cell (a client of the Worker) ----------------------------------------------

def routed(cell, key: str, path: str, body: dict, timeout_s: float = 120) -> tuple[int, dict | list[dict], dict]:
    """(status, the JSON answer or a stream's events, headers) of one request through the Worker."""
    req = urllib.request.Request(cell.ready["worker_url"] + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw, status, headers = r.read().decode(), r.status, dict(r.headers)
    except urllib.error.HTTPError as err:
        with err:  # an HTTPError holds the connection until closed
            raw, status, headers = err.read().decode(), err.code, dict(err.headers)
    if body.get("stream") and status == 200:
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return status, events, headers
    return status, json.loads(raw), headers


def usage_of(cell, key_id: str, requests: int, completion: int = 0, timeout_s: float = 30) -> dict:
    """The key's usage as the cell recorded it, once ``requests`` requests and ``completion`` tokens are in
    (bounded): a request is counted when admitted, its tokens when it settles."""
    auth = {"authorization": f"Bearer {cell.ready['read_token']}"}
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(cell.ready["worker_url"] + f"/_colocate/usage?key={key_id}", headers=auth)
        with urllib.request.urlopen(req, timeout=30) as r:
            rows = [row for row in json.loads(r.read())["usage"] if row["key_id"] == key_id]
        total = {k: sum(row[k] for row in rows) for k in ("requests", "prompt_tokens", "completion_tokens")}
        if (total["requests"] >= requests and total["completion_tokens"] >= completion) or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


@pytest.fixture
def key(vllm_cell) -> dict:
    return client_key(vllm_cell.ready, max_parallel=8, rpm=0, tpm=0)


# ---- readiness ----------------------------------------------------------------------------------

def test_readiness_takes_vllms_refusal_of_its_certificate_for_serving(vllm_cell):
    cell = vllm_cell
    # the pod is checked by the public root, as a cloud pod's publicly trusted certificate is (hopcerts)
    checker = podtls.client_context(cell.hop.check.cert_pem, cell.hop.check.key_pem, cell.hop.public.cert_pem)
    ok, said = readiness.health(f"https://127.0.0.1:{cell.port}", timeout=10, tls=(checker, hopcerts.POD_NAME),
                                token=readiness_token(cell.token))
    assert ok and said.startswith("serving (it refused the readiness certificate"), said
    with pytest.raises(http.client.RemoteDisconnected):  # uvicorn's refusal: a close, no alert (the cause of item 1)
        pod_call(cell, "GET", "/health", readiness_token(cell.token), ctx=checker)
    log = (cell.state_dir / "logs" / "pod.log").read_text()
    assert "serving (it refused the readiness certificate: RemoteDisconnected)" in log  # how the cell's `up` passed


def test_an_existing_endpoint_check_sees_vllms_certificate_then_its_refusal(vllm_cell):
    """provider existing (colocate/pods/existing.py): vLLM started by the kit's start command with the cloud's
    bundle is a team's box on mutual TLS: its certificate is seen in a TLS 1.3 handshake, then it refuses the
    readiness certificate; a box serving another certificate for the name is not this stack's yet."""
    cell = vllm_cell
    ctx = podtls.client_context(cell.hop.check.cert_pem, cell.hop.check.key_pem, cell.hop.public.cert_pem)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    bundle = podtls.bundle(cell.hop.pod.cert_pem, cell.hop.pod.key_pem, cell.hop.ca.cert_pem)
    ready = readiness_token(cell.token)
    state, seen = existing.check_mtls("127.0.0.1", cell.port, hopcerts.POD_NAME, ctx, existing.leaf_der(bundle), ready, 10)
    assert (state, seen) == (existing.SERVING, "serving this stack's certificate (it refused the readiness certificate: "
                                               "RemoteDisconnected)")
    other = cell.hop.public.server(hopcerts.POD_NAME)
    state, seen = existing.check_mtls("127.0.0.1", cell.port, hopcerts.POD_NAME, ctx, existing.leaf_der(
        podtls.bundle(other.cert_pem, other.key_pem, cell.hop.ca.cert_pem)), ready, 10)
    assert state == existing.WAITING and "another certificate" in seen


def test_the_readiness_token_opens_health_alone(vllm_cell):
    ready = readiness_token(vllm_cell.token)
    assert pod_call(vllm_cell, "GET", "/health", ready) == (200, b"")
    for method, path in ROUTER_USES:
        if path != "/health":
            assert pod_call(vllm_cell, method, path, ready, {} if method == "POST" else None)[0] == 401, path


# ---- the hop's refusals -------------------------------------------------------------------------

def test_no_client_certificate_or_one_of_another_ca_gets_no_http_answer(vllm_cell):
    stranger = LocalCA.create("stranger CA").client("stranger")
    for leaf in (None, stranger):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cadata=vllm_cell.hop.public.cert_pem)
        if leaf is not None:
            ctx.load_cert_chain(*_files(vllm_cell.state_dir, leaf))
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected, OSError)):
            pod_call(vllm_cell, "GET", "/health", vllm_cell.token, ctx=ctx)
    # Plain HTTP on the TLS port: no HTTP answer either.
    with socket.create_connection(("127.0.0.1", vllm_cell.port), timeout=10) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {vllm_cell.token}\r\n\r\n".encode())
        s.settimeout(10)
        try:
            got = s.recv(1024)
        except OSError:
            got = b""
    assert not got.startswith(b"HTTP/1.1 2")


def _files(state_dir: Path, leaf) -> tuple[str, str]:
    d = state_dir / "stranger"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / "c.pem").write_text(leaf.cert_pem)
    (d / "k.pem").write_text(leaf.key_pem)
    return str(d / "c.pem"), str(d / "k.pem")


def test_every_vllm_route_refuses_a_stranger_and_the_unused_ones_refuse_everyone(vllm_cell):
    for method, path in ROUTER_USES + NEVER_USED:
        body = {} if method == "POST" else None
        for token in (None, "wrong", vllm_cell.token + "x"):
            status, answer = pod_call(vllm_cell, method, path, token, body)
            expected = 401 if (method, path) in ROUTER_USES else 404
            assert status == expected, (method, path, token, answer[:200])
            if status == 401:
                assert json.loads(answer) == {"error": "Unauthorized"}  # vLLM's own 401 body
        if (method, path) not in ROUTER_USES:
            assert pod_call(vllm_cell, method, path, vllm_cell.token, body)[0] == 404, (method, path)


# ---- metering through the cell --------------------------------------------------------------------

@pytest.mark.parametrize("path,stream,include_usage,n", [
    ("/v1/chat/completions", False, False, 1),
    ("/v1/chat/completions", True, True, 1),
    ("/v1/chat/completions", True, False, 1),
    ("/v1/chat/completions", False, False, 2),
    ("/v1/chat/completions", True, True, 2),
    ("/v1/completions", False, False, 1),
    ("/v1/completions", True, True, 1),
    ("/v1/completions", True, False, 2),
])
def test_every_endpoint_and_stream_shape_is_metered_as_vllm_counted_it(vllm_cell, key, path, stream, include_usage, n):
    chat = path == "/v1/chat/completions"
    body = {"model": vllm_cell.spec.model, **({"messages": MESSAGES} if chat else {"prompt": "The sea is"}), **EXACT,
            "n": n, "stream": stream}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    before = sample(idle(vllm_cell), "vllm:prompt_tokens")
    status, answer, headers = routed(vllm_cell, key["key"], path, body)
    assert status == 200 and headers["x-colocate-backend"] == "pod-0", answer
    # What vLLM itself counted: it runs n > 1 as n sequences, each counting the prompt.
    prompt = (sample(idle(vllm_cell), "vllm:prompt_tokens") - before) / n
    if stream:
        assert isinstance(answer, list)
        usage = answer[-1].get("usage")
        assert (usage is not None) == include_usage  # the router asks for usage, and hands it on only if asked
        texts = [c for e in answer for c in e.get("choices", [])]
        assert {c["index"] for c in texts} == set(range(n))
    else:
        assert isinstance(answer, dict)
        usage = answer["usage"]
        assert len(answer["choices"]) == n
    counted = usage_of(vllm_cell, key["id"], 1, EXACT["max_tokens"] * n)
    assert counted["requests"] == 1
    assert counted["completion_tokens"] == EXACT["max_tokens"] * n
    assert counted["prompt_tokens"] == prompt > 0
    if usage is not None:
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, EXACT["max_tokens"] * n)


# ---- a client that leaves mid-answer ----------------------------------------------------------------

LONG = {"min_tokens": 3000, "max_tokens": 3000, "ignore_eos": True}


def _leave_after_first_bytes(cell, key: str, body: dict) -> None:
    url = urlsplit(cell.ready["worker_url"])
    data = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port), timeout=60) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        if body.get("stream"):
            s.recv(512)  # the stream has begun
        else:
            # The pod has begun (a non-streamed answer sends nothing before its end, so an answer
            # that comes first was not left: shown, with who answered).
            deadline = time.monotonic() + 60
            while sample(metrics(cell), "vllm:num_requests_running") == 0:
                if select.select([s], [], [], 0.05)[0]:
                    pytest.fail(f"answered before vLLM was seen running it: {s.recv(4096).decode(errors='replace')[:2000]}")
                assert time.monotonic() < deadline, "vLLM did not run the request within 60 s, and nobody answered"
            time.sleep(0.5)


def _tokens_made_after_leaving(cell, key: str, stream: bool) -> float:
    before = sample(idle(cell), "vllm:generation_tokens")
    _leave_after_first_bytes(cell, key, {"model": cell.spec.model, "messages": MESSAGES, **LONG, "stream": stream})
    return sample(idle(cell), "vllm:generation_tokens") - before


def test_a_client_that_leaves_a_stream_stops_the_pods_generation(vllm_cell, key):
    made = _tokens_made_after_leaving(vllm_cell, key["key"], stream=True)
    assert 0 < made < LONG["max_tokens"], made  # cancelled: vLLM stopped before the answer's end


def test_a_client_that_leaves_a_non_streamed_answer_stops_the_pods_generation(vllm_cell, key):
    made = _tokens_made_after_leaving(vllm_cell, key["key"], stream=False)
    assert 0 < made < LONG["max_tokens"], made


# ---- errors ----------------------------------------------------------------------------------------

def test_vllms_errors_reach_the_client_in_openais_shape(vllm_cell, key):
    status, answer, headers = routed(vllm_cell, key["key"], "/v1/chat/completions",
                                     {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 4})
    assert status == 404 and answer["error"]["type"] == "NotFoundError" and "gpt-4o" in answer["error"]["message"]
    assert headers["x-colocate-backend"] == "pod-0"
    status, answer, _ = routed(vllm_cell, key["key"], "/v1/chat/completions",
                               {"model": vllm_cell.spec.model, "messages": MESSAGES, "max_tokens": 4, "top_p": 0})
    assert status == 400 and answer["error"]["message"] and answer["error"]["type"]


def test_a_request_vllm_refuses_is_charged_nothing(vllm_cell, key):
    long_prompt = " ".join(["sea"] * 9000)  # over the context in vLLM's tokens, under the Worker's 16-chars-a-token bound
    status, answer, _ = routed(vllm_cell, key["key"], "/v1/completions",
                               {"model": vllm_cell.spec.model, "prompt": long_prompt, "max_tokens": 4})
    assert status == 400, answer
    # A request that settles after it: once its tokens are counted, the refused one has settled too.
    _, after, _ = routed(vllm_cell, key["key"], "/v1/completions", {"model": vllm_cell.spec.model, "prompt": "sea", **EXACT})
    counted = usage_of(vllm_cell, key["id"], 2, EXACT["max_tokens"])
    refused = {"prompt": counted["prompt_tokens"] - after["usage"]["prompt_tokens"],
               "completion": counted["completion_tokens"] - after["usage"]["completion_tokens"]}
    assert refused == {"prompt": 0, "completion": 0}, refused


# ---- metrics: what the router reads, read by the router's own code ---------------------------------

def test_the_router_reads_vllms_metrics_with_its_own_parsers(vllm_cell, key):
    routed(vllm_cell, key["key"], "/v1/chat/completions", {"model": vllm_cell.spec.model, "messages": MESSAGES, **EXACT})
    text = idle(vllm_cell)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count"):
        sample(text, name)
    script = ("import { prefixCounters } from './worker/src/podmetrics.js';"
              "import { readFileSync } from 'node:fs';"
              "console.log(JSON.stringify(prefixCounters(readFileSync(0, 'utf8'))));")
    out = subprocess.run(["node", "--input-type=module", "-e", script], input=text, capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    counters = json.loads(out.stdout)
    assert counters == {"hits": sample(text, "vllm:prefix_cache_hits"), "queries": sample(text, "vllm:prefix_cache_queries")}
    assert counters["queries"] > 0


# ---- the assembled non-streamed answer ----------------------------------------------------------------

def test_a_long_non_streamed_answer_comes_back_whole(vllm_cell, key):
    """Past 16 tokens the router streams from the pod and assembles the answer (worker/src/assemble.js)."""
    body = {"model": vllm_cell.spec.model, "messages": MESSAGES, **EXACT}
    status, answer, _ = routed(vllm_cell, key["key"], "/v1/chat/completions", body)
    assert status == 200 and answer["object"] == "chat.completion" and answer["model"] == vllm_cell.spec.model
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == EXACT["max_tokens"]


def test_the_assembled_answer_has_the_fields_vllms_own_answer_has(vllm_cell, key):
    body = {"model": vllm_cell.spec.model, "messages": MESSAGES, **EXACT}
    _, own = pod_call(vllm_cell, "POST", "/v1/chat/completions", vllm_cell.token, body)
    own = json.loads(own)
    _, assembled, _ = routed(vllm_cell, key["key"], "/v1/chat/completions", body)
    assert set(assembled) == set(own)
    assert set(assembled["choices"][0]) == set(own["choices"][0])
    assert set(assembled["choices"][0]["message"]) == set(own["choices"][0]["message"])


# ---- what is left behind --------------------------------------------------------------------------------

def test_the_pods_key_is_on_no_filesystem_while_vllm_runs(vllm_cell):
    fds = Path(f"/proc/{vllm_cell.process.pid}/fd")
    targets = [str(p.readlink()) for p in fds.iterdir() if "colocate-tls." in str(p.readlink())]
    assert len(targets) == 3 and all(t.endswith(" (deleted)") for t in targets), targets


def test_status_sees_the_engine_and_no_process_of_its_own(vllm_cell):
    from colocate.sandbox import supervisor

    status = supervisor.status(vllm_cell.state_dir)
    assert status["healthy"] is True and status["health"]["pod"] is True, status
    assert "pod" not in status["pids"]  # vLLM is the user's server here: `down` never signals it
