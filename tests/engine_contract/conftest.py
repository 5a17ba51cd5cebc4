"""The engine the contract runs against: ``engine``, a pod's base URL, token and model.

``COLOCATE_ENGINE`` picks it: ``standin`` (the default, in ``make test``: the kit's stand-in,
once with the oracle and once with the default GPU profile) or ``vllm``: under ``make test-vllm``
the run's one vLLM (tests/vllm_cpu/server.py: the kit's start path, behind its guard, over
mutual TLS), or a live vLLM named by ``COLOCATE_ENGINE_URL``, ``COLOCATE_ENGINE_TOKEN`` and
``COLOCATE_ENGINE_MODEL``. The same tests run on both, so the stand-in writes what vLLM writes
(docs/pods.md, "The local stand-in").
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

from colocate.pods import profiles, standin
from colocate.workerd import HopClient

TOKEN = "engine-contract-token-4c1f"
MODEL = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"  # the kit's default model, as a pod serves it


@dataclass(frozen=True)
class Engine:
    url: str
    token: str
    model: str
    kind: str  # "standin" or "vllm"
    tls: ssl.SSLContext | None = None  # the client side of a mutual-TLS pod, if it is one
    max_model_len: int = 8192
    hop: HopClient | None = None  # the router's side of that hop (workerd's pod_tls), for the tests through a router

    def request(self, method: str, path: str, body: dict | list | bytes | None = None, token: str | None = "",
                timeout: float = 120.0) -> tuple[int, dict[str, str], bytes]:
        """One request on a fresh connection: (status, headers, body). ``token`` None sends no
        Authorization; "" (the default) the engine's own."""
        parts = urlsplit(self.url)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=self.tls)
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        headers = {"content-type": "application/json"} if body is not None else {}
        if token is not None:
            headers["authorization"] = f"Bearer {token or self.token}"
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        try:
            conn.request(method, path, body=data, headers=headers)
            res = conn.getresponse()
            return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
        finally:
            conn.close()

    def post(self, path: str, body, **kw) -> tuple[int, object]:
        """POST a body: (status, the JSON answer)."""
        status, _h, raw = self.request("POST", path, body, **kw)
        return status, json.loads(raw)

    def events(self, path: str, body: dict) -> list[dict]:
        """A streamed answer's events, parsed; asserts it is SSE ending with [DONE]."""
        status, headers, raw = self.request("POST", path, body)
        assert status == 200, raw[:500]
        assert headers["content-type"] == "text/event-stream; charset=utf-8"
        blocks = [b for b in raw.decode().split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]", blocks[-1]
        assert all(b.startswith("data: ") and "\n" not in b for b in blocks), "one data line an event"
        return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


@contextlib.contextmanager
def standin_engine(profile: str) -> Iterator[Engine]:
    with standin.serve(compute_ms=5, token=TOKEN, model=MODEL, any_model=False, profile=profile, seed=1) as pod:
        yield Engine(pod.url, TOKEN, MODEL, "standin", max_model_len=pod.profile.max_model_len)


def vllm_engine(request) -> Engine:
    url = os.environ.get("COLOCATE_ENGINE_URL")
    if not url:  # make test-vllm: the run's own vLLM, as the cell's Worker reaches it
        from colocate.pods import podtls

        cell = request.getfixturevalue("vllm_cell")
        hop = cell.hop
        return Engine(cell.url, cell.token, cell.spec.model, "vllm",
                      tls=podtls.client_context(hop.worker.cert_pem, hop.worker.key_pem, hop.public.cert_pem),
                      max_model_len=cell.spec.max_model_len,
                      hop=HopClient(hop.worker.cert_pem, hop.worker.key_pem, hop.public.cert_pem))
    return Engine(url.rstrip("/"), os.environ.get("COLOCATE_ENGINE_TOKEN", ""), os.environ.get("COLOCATE_ENGINE_MODEL", MODEL),
                  "vllm", max_model_len=int(os.environ.get("COLOCATE_ENGINE_MAX_MODEL_LEN", "8192")))


KIND = os.environ.get("COLOCATE_ENGINE", "standin")
PROFILES = ["oracle", profiles.DEFAULT_PROFILE] if KIND == "standin" else ["vllm"]


@pytest.fixture(scope="module", params=PROFILES)
def engine(request) -> Iterator[Engine]:
    if KIND == "vllm":
        yield vllm_engine(request)
        return
    if KIND != "standin":
        pytest.fail(f"COLOCATE_ENGINE={KIND!r}: use standin (the default) or vllm")
    with standin_engine(request.param) as e:
        yield e
