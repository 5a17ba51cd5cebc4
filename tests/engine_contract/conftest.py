"""The engine the contract tests check: one server, answering as a pod answers the router.

``engine`` is an ``Engine``: the server's base URL (no ``/v1``), its pod token, the model name it
serves, the TLS client context that reaches it (the Worker's certificate; None on plain HTTP), and
``kind``: ``"standin"`` under ``make test``, ``"vllm"`` under ``make test-vllm``
(``COLOCATE_ENGINE=vllm``: vLLM's CPU build started through the kit's start path,
tests/vllm_cpu/server.py). A test that checks what only one of them can do says so with
``engine.kind``. The server is the pod itself, behind its guard, not the cell.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

KIND = os.environ.get("COLOCATE_ENGINE", "standin")


@dataclass(frozen=True)
class Engine:
    kind: str  # "standin" | "vllm"
    base_url: str  # e.g. https://localhost:8443
    token: str  # the pod token (Authorization: Bearer)
    model: str  # the served model name
    tls: ssl.SSLContext | None  # the Worker's client context on a mutual-TLS hop, else None


@pytest.fixture(scope="session")
def engine(request, tmp_path_factory) -> Engine:
    if KIND == "vllm":
        cell = request.getfixturevalue("vllm_cell")  # tests/conftest.py: one vLLM for the whole run
        hop = cell.hop
        from colocate.pods import podtls

        return Engine("vllm", cell.url, cell.token, cell.spec.model,
                      podtls.client_context(hop.worker.cert_pem, hop.worker.key_pem, hop.ca.cert_pem))
    if KIND != "standin":
        raise pytest.UsageError(f"COLOCATE_ENGINE={KIND!r}: one of standin, vllm")
    return request.getfixturevalue("standin_engine")


@pytest.fixture(scope="session")
def standin_engine() -> Iterator[Engine]:
    """The stand-in as a pod serves: the default profile's engine, the pod token, plain HTTP here
    (the shapes' tests decide what more it needs)."""
    from colocate.pods import standin

    token = "engine-contract-token"
    with standin.serve(compute_ms=0, token=token, model=standin.DEFAULT_MODEL, any_model=False,
                       log=lambda _l: None) as server:
        yield Engine("standin", server.url, token, standin.DEFAULT_MODEL, None)
