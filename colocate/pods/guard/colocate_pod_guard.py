"""The pod's guard: vLLM answers only the routes the router uses, and only with the pod token.

vLLM's ``--api-key`` (``VLLM_API_KEY``) guards paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` only: ``/invocations`` (inference), ``/tokenize``, ``/metrics``, ``/health``, ``/pause``,
``/abort_requests`` ... answer anyone who reaches the port. On RunPod's proxy path no client
certificate can reach the pod, so the port is as open as its URL is known. This ASGI middleware,
given to vLLM as ``--middleware colocate_pod_guard.PodGuard`` (vLLM adds a class with
``app.add_middleware``: outside its own routes and its own token check), admits:

- ``KNOWN_PATHS`` (the inference routes, ``/v1/models``, ``/health``, ``/metrics``) with the pod token
  as ``Authorization: Bearer``: the Worker's calls;
- ``GET /health`` (and ``HEAD``) with the readiness token, ``readiness_token(pod token)``: what
  ``scripts/pod.py`` waits with, which runs no inference;

and answers everything else as vLLM's own check does, ``401 {"error": "Unauthorized"}``, or ``404``
for a path the router never uses, whatever the credential. Tokens are compared in constant time.
The pod token is ``VLLM_API_KEY``: without one the guard refuses everything.

The file is standalone (the standard library only): pod/Dockerfile copies it into the image beside
the start command (colocate/pods/podstart.sh, which passes the flag), on ``PYTHONPATH``; the
stand-in applies the same ``decide`` (colocate/pods/standin/).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

TOKEN_ENV = "VLLM_API_KEY"
READINESS_LABEL = b"colocate pod readiness"
# The paths the router sends to a pod (worker/src/routes.js, forward.js, podmetrics.js, admin.js).
KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})
READINESS_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})
UNAUTHORIZED = (401, {"error": "Unauthorized"})  # vLLM's own 401 body
NOT_FOUND = (404, {"detail": "Not Found"})  # Starlette's 404 body, as vLLM answers an unknown path


def readiness_token(pod_token: str) -> str:
    """The credential that opens ``GET /health`` and nothing else, derived from the pod token (one way:
    it gives no inference)."""
    return hmac.new(pod_token.encode(), READINESS_LABEL, hashlib.sha256).hexdigest()


def _bearer(authorization: str | None) -> bytes:
    scheme, _, value = (authorization or "").partition(" ")
    return value.strip().encode() if scheme.lower() == "bearer" else b""


def _same(given: bytes, expected: str) -> bool:
    # Digests of equal length, compared in constant time: neither length nor content leaks.
    return bool(expected) and hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(expected.encode()).digest())


def decide(method: str, path: str, authorization: str | None, token: str) -> tuple[int, dict] | None:
    """None to pass the request on to vLLM, else the refusal's (status, JSON body). The pod token opens
    the router's paths (vLLM answers a method they do not take itself); the readiness token opens
    ``GET /health``; any other path is 404 whatever the credential."""
    path = path.split("?", 1)[0]
    if path not in KNOWN_PATHS:
        return NOT_FOUND
    given = _bearer(authorization)
    if _same(given, token):
        return None
    if (method, path) in READINESS_ROUTES and token and _same(given, readiness_token(token)):
        return None
    return UNAUTHORIZED


class PodGuard:
    """The ASGI middleware (pure ASGI, as vLLM's own authentication middleware)."""

    def __init__(self, app) -> None:
        self.app = app
        self.token = os.environ.get(TOKEN_ENV, "")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # the router opens none
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan: vLLM's own startup and shutdown
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        authorization = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        refusal = decide(scope["method"], path, authorization, self.token)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, body = refusal
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data if scope["method"] != "HEAD" else b""})
