"""Readiness's certificate opens GET /health and nothing else.

Real stand-in pods serving mutual TLS: one that trusts the readiness CA (the sandbox's, which
enforces ``podtls.allows``) and one whose bundle carries only the cell's CA (the cloud's form:
vLLM cannot tell callers apart by path, so it is never given the readiness CA). Readiness
reaches "serving" on both; inference and /metrics answer only the Worker's certificate."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from colocate.pods import podtls, readiness, standin
from colocate.pods.guard.colocate_pod_guard import readiness_token
from colocate.sandbox import hopcerts
from colocate.sandbox.localca import LocalCA

pytestmark = pytest.mark.slow
TOKEN = "pod-token-for-the-readiness-test"


def _ctx(tmp: Path, text: str) -> ssl.SSLContext:
    path = tmp / f"bundle-{len(list(tmp.iterdir()))}"
    path.write_text(text)
    path.chmod(0o600)
    return podtls.server_context(str(path))


def _call(port: int, leaf, ca_pem: str, method: str, path: str, token: str | None = None) -> int:
    ctx = podtls.client_context(leaf.cert_pem, leaf.key_pem, ca_pem)
    conn = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=10)
    try:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}) if method == "POST" else None
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        conn.request(method, path, body=body, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> hopcerts.HopCredentials:
    return hopcerts.load(tmp_path_factory.mktemp("state"))


def test_the_sandbox_readiness_certificate_is_signed_by_a_ca_of_its_own(creds):
    assert creds.check_ca.cert_pem != creds.ca.cert_pem
    bundle = creds.pod_env()[podtls.BUNDLE_ENV]
    assert creds.check_ca.cert_pem.strip() in bundle  # the stand-in trusts it, and holds it to /health


def test_readiness_gets_get_health_only_and_the_worker_gets_the_rest(creds, tmp_path):
    ctx = _ctx(tmp_path, creds.pod_env()[podtls.BUNDLE_ENV])
    with standin.serve(compute_ms=1, token=TOKEN, name="pod", tls=ctx, log=lambda _l: None) as pod:
        check, worker, ca = creds.check, creds.worker, creds.public.cert_pem  # the pod is verified by its public root
        ready = readiness_token(TOKEN)
        assert _call(pod.port, check, ca, "GET", "/health", ready) == 200
        # The attack: the readiness certificate, with no token, the readiness token, the pod token.
        for token in (None, ready, TOKEN):
            assert _call(pod.port, check, ca, "POST", "/invocations", token) == 403
            assert _call(pod.port, check, ca, "GET", "/metrics", token) == 403
            assert _call(pod.port, check, ca, "POST", "/v1/completions", token) == 403
            assert _call(pod.port, check, ca, "GET", "/v1/models", token) == 403
        # The Worker's certificate opens the router's routes, with the pod token (the pod's guard);
        # the readiness token opens /health alone.
        assert _call(pod.port, worker, ca, "GET", "/health", TOKEN) == 200
        assert _call(pod.port, worker, ca, "GET", "/metrics", TOKEN) == 200
        assert _call(pod.port, worker, ca, "POST", "/v1/completions", TOKEN) == 200
        assert _call(pod.port, worker, ca, "POST", "/v1/completions") == 401
        assert _call(pod.port, worker, ca, "GET", "/health", ready) == 200
        for method, path in (("POST", "/v1/completions"), ("GET", "/metrics"), ("GET", "/v1/models")):
            assert _call(pod.port, worker, ca, method, path, ready) == 401
        assert pod.requests == 1  # the Worker's admitted /v1/completions: no refused request reached a route


def test_a_pod_that_does_not_trust_readiness_refuses_it_in_the_handshake_and_readiness_reads_that_as_serving(
        creds, tmp_path):
    cloud_bundle = podtls.bundle(creds.pod.cert_pem, creds.pod.key_pem, creds.ca.cert_pem)  # infra/hop.py's form
    assert creds.check_ca.cert_pem.strip() not in cloud_bundle
    checker = podtls.client_context(creds.check.cert_pem, creds.check.key_pem, creds.public.cert_pem)
    lines: list[str] = []
    with standin.serve(compute_ms=1, token=TOKEN, name="pod", tls=_ctx(tmp_path, cloud_bundle), log=lines.append) as pod:
        ok, said = readiness.health(f"https://127.0.0.1:{pod.port}", timeout=5, tls=(checker, hopcerts.POD_NAME))
        assert ok and said.startswith("serving (it refused the readiness certificate"), said
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _call(pod.port, creds.check, creds.public.cert_pem, "POST", "/invocations", TOKEN)
        assert pod.requests == 0
    assert any("refused a TLS handshake" in line for line in lines)


def test_readiness_is_not_fooled_by_a_pod_of_another_ca_or_a_port_that_never_serves(creds, tmp_path):
    checker = podtls.client_context(creds.check.cert_pem, creds.check.key_pem, creds.public.cert_pem)
    other = LocalCA.create("someone else's CA")
    leaf = other.server(hopcerts.POD_NAME)
    foreign = _ctx(tmp_path, podtls.bundle(leaf.cert_pem, leaf.key_pem, other.cert_pem))
    with standin.serve(compute_ms=1, token=TOKEN, name="pod", tls=foreign, log=lambda _l: None) as pod:
        ok, said = readiness.health(f"https://127.0.0.1:{pod.port}", timeout=5, tls=(checker, hopcerts.POD_NAME))
        assert not ok and "not the cell's" in said
    # A port that takes the connection and never answers (a hung server) is not ready either.
    with contextlib.closing(socket.create_server(("127.0.0.1", 0))) as silent:
        port = silent.getsockname()[1]
        ok, said = readiness.health(f"https://127.0.0.1:{port}", timeout=0.5, tls=(checker, hopcerts.POD_NAME))
        assert not ok and said.startswith("health:"), said


def test_the_policy_reads_the_issuer_the_handshake_verified():
    issuer = lambda cn: {"issuer": ((("organizationName", "colocate"),), (("commonName", cn),))}  # noqa: E731
    readiness_cert, worker_cert = issuer(f"colocate apac-jp {podtls.READINESS_CA}"), issuer("colocate apac-jp pod hop CA")
    assert podtls.allows(readiness_cert, "GET", "/health") and podtls.allows(readiness_cert, "GET", "/health?x=1")
    for method, path in (("POST", "/health"), ("GET", "/metrics"), ("POST", "/invocations"), ("GET", "/docs"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        assert not podtls.allows(readiness_cert, method, path)
        assert podtls.allows(worker_cert, method, path)


def test_the_sandbox_emulates_the_clouds_trust_the_pods_certificate_public_the_workers_the_cells(creds):
    """As in the cloud (infra/hop.py): the pod's server certificate chains to a (stand-in) public root,
    the Worker trusts that root for the pods and never the cell's CA, which signs only the Worker's
    client certificate and is the only caller CA a cloud pod's bundle carries."""
    from cryptography import x509

    def issuer(pem):
        return x509.load_pem_x509_certificate(pem.encode()).issuer

    def subject(pem):
        return x509.load_pem_x509_certificate(pem.encode()).subject

    assert issuer(creds.pod.cert_pem) == subject(creds.public.cert_pem) != subject(creds.ca.cert_pem)
    assert issuer(creds.worker.cert_pem) == subject(creds.ca.cert_pem)
    client = creds.worker_client()
    assert client.ca_pem == creds.public.cert_pem and creds.ca.cert_pem not in client.ca_pem
    assert json.loads(creds.pod_env()[podtls.CHECK_ENV])["ca"] == creds.public.cert_pem


@contextlib.contextmanager
def asyncio_tls_server(ctx: ssl.SSLContext) -> Iterator[int]:
    """A server on asyncio's TLS, as uvicorn (vLLM's server) serves: it refuses a client certificate
    it does not trust by closing the connection, with no TLS alert. It answers 200 to anyone else."""
    loop = asyncio.new_event_loop()

    async def handle(reader, writer):
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()


def test_a_pod_on_asyncio_tls_that_closes_without_an_alert_is_serving_and_still_refuses_readiness(creds, tmp_path):
    """vLLM's uvicorn closes on an untrusted client certificate with no alert; readiness read that
    close (RemoteDisconnected) as "not ready" and a cloud pod on a mutual-TLS hop never passed."""
    cloud_bundle = podtls.bundle(creds.pod.cert_pem, creds.pod.key_pem, creds.ca.cert_pem)  # infra/hop.py's form
    checker = podtls.client_context(creds.check.cert_pem, creds.check.key_pem, creds.public.cert_pem)
    with asyncio_tls_server(_ctx(tmp_path, cloud_bundle)) as port:
        with pytest.raises(http.client.RemoteDisconnected):  # what the server does to readiness's certificate
            _call(port, creds.check, creds.public.cert_pem, "GET", "/health")
        ok, said = readiness.health(f"https://127.0.0.1:{port}", timeout=5, tls=(checker, hopcerts.POD_NAME))
        assert ok and said.startswith("serving (it refused the readiness certificate"), said
        assert _call(port, creds.worker, creds.public.cert_pem, "GET", "/health") == 200  # the Worker's is admitted


def test_a_port_bound_but_not_listening_is_not_ready(creds):
    """vLLM binds its port before the engine loads and listens only once it is up: until then a
    connection is refused."""
    checker = podtls.client_context(creds.check.cert_pem, creds.check.key_pem, creds.public.cert_pem)
    with contextlib.closing(socket.socket()) as bound:
        bound.bind(("127.0.0.1", 0))
        ok, said = readiness.health(f"https://127.0.0.1:{bound.getsockname()[1]}", timeout=2,
                                    tls=(checker, hopcerts.POD_NAME))
        assert not ok and said == "health: ConnectionRefusedError", said
