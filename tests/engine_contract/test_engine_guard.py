"""The engine behind its guard: the served model listed to the pod token, vLLM's own 401 to anyone else."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


def get(engine, path: str, token: str | None) -> tuple[int, bytes]:
    parts = urlsplit(engine.url)
    conn = (http.client.HTTPSConnection(parts.hostname, parts.port, context=engine.tls, timeout=30) if engine.tls
            else http.client.HTTPConnection(parts.hostname, parts.port, timeout=30))
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def test_the_engine_lists_its_model_to_the_pod_token_and_refuses_anyone_else(engine):
    status, body = get(engine, "/v1/models", engine.token)
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [engine.model]
    for token in (None, "wrong"):
        status, body = get(engine, "/v1/models", token)
        assert (status, json.loads(body)) == (401, {"error": "Unauthorized"})
