"""The pod's guard (colocate/pods/guard/colocate_pod_guard.py, vLLM's --middleware, applied by the
stand-in too): only the router's routes, only with the pod token; the readiness token opens GET
/health and nothing else; 404 for every other path whatever the credential; vLLM's own 401 body.
tests/vllm_cpu/ checks the same against the real vLLM, route by route."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from colocate.pods import standin
from colocate.pods.guard import colocate_pod_guard as guard
from tests.support.vllm_routes import NEVER_USED, ROUTER_USES

TOKEN = "pod-token-for-the-guard-test"
READY = guard.readiness_token(TOKEN)


def call(port: int, method: str, path: str, token: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": standin.DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2}) if method == "POST" else None
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        conn.request(method, path, body=body, headers=headers)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def pod():
    with standin.serve(compute_ms=0, token=TOKEN, log=lambda _l: None) as server:
        yield server


def test_a_stranger_gets_401_on_the_routers_routes_and_404_on_every_other(pod):
    for method, path in ROUTER_USES + NEVER_USED:
        for token in (None, "wrong", TOKEN[:-1], TOKEN + "x", READY if path != "/health" else "wrong"):
            status, body = call(pod.port, method, path, token)
            if (method, path) in ROUTER_USES:
                assert (status, json.loads(body)) == (401, {"error": "Unauthorized"}), (method, path, token)
            else:
                assert status == 404, (method, path, token)
    assert pod.requests == 0


def test_the_pod_token_opens_the_routers_routes_and_nothing_else(pod):
    for method, path in ROUTER_USES:
        path = path.replace("/v1/chat/completions", "/v1/completions")  # the body is a completion's
        assert call(pod.port, "POST" if path == "/v1/completions" else method, path, TOKEN)[0] == 200, path
    for method, path in NEVER_USED:
        assert call(pod.port, method, path, TOKEN)[0] == 404, (method, path)


def test_the_readiness_token_opens_get_health_alone(pod):
    assert call(pod.port, "GET", "/health", READY) == (200, b"")
    assert READY != TOKEN and TOKEN not in READY
    for method, path in [*ROUTER_USES[:-2], ("GET", "/metrics"), ("POST", "/health")]:
        assert call(pod.port, method, path, READY)[0] in (401, 404), (method, path)


def test_the_guard_as_vllm_runs_it_an_asgi_middleware_in_front_of_the_app(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    reached = []

    async def app(scope, receive, send):
        reached.append((scope["type"], scope.get("path")))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    def run(scope):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        asyncio.run(guard.PodGuard(app)(scope, receive, send))
        return sent

    def http_scope(method, path, token=None):
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        return {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers}

    assert run({"type": "lifespan"}) == [] and reached == [("lifespan", None)]  # vLLM's startup passes
    refused = run(http_scope("POST", "/invocations", TOKEN))
    assert refused[0]["status"] == 404 and len(reached) == 1
    refused = run(http_scope("GET", "/metrics"))
    assert refused[0]["status"] == 401 and json.loads(refused[1]["body"]) == {"error": "Unauthorized"}
    assert run(http_scope("GET", "/metrics", TOKEN))[0]["status"] == 200 and reached[-1] == ("http", "/metrics")
    assert run(http_scope("GET", "/health", READY))[0]["status"] == 200
    assert run({"type": "websocket", "path": "/v1/realtime", "headers": []}) == [{"type": "websocket.close", "code": 1008}]


def test_without_a_pod_token_the_guard_refuses_everything():
    for method, path in ROUTER_USES:
        assert guard.decide(method, path, "Bearer ", "") == guard.UNAUTHORIZED
        assert guard.decide(method, path, None, "") == guard.UNAUTHORIZED
