"""The pod hop is mutual TLS: the Worker (real workerd) reaches the pod only with its client
certificate (of the cell's CA) and only a pod whose certificate is publicly trusted for its name
(a sandbox root stands in for the public CAs, as in the sandbox); a stranger on the pod's port
gets no model answer on any route; a wrong or expired certificate on either side, or a pod
certificate of the cell's own CA, fails closed, and the fallback serves. The Worker's other
fetches (the fallback) are on the same public trust and never on the cell's CA."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.pods import podtls, standin
from colocate.sandbox.localca import LocalCA
from colocate.workerd import HopClient, Workerd, render_config
from tests.support.fake_providers import FakeRunPod, FakeVast
from tests.support.workerd import FALLBACK_MODEL_NAME, SECRETS, Cell, cell_plan, chat, request, values_for
from tests.test_pod_providers import TOKEN, make_spec, offer, run, serving, write_spec

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
PAST = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.create("test hop CA")


@pytest.fixture(scope="module")
def worker_leaf(ca):
    return ca.client("colocate worker")


@pytest.fixture(scope="module")
def public() -> LocalCA:
    """Stands in for the public CAs (in the cloud: the ACME directory's chain, infra/hop.py)."""
    return LocalCA.create("test public root")


@pytest.fixture(scope="module")
def worker_client(public, worker_leaf) -> HopClient:
    return HopClient(worker_leaf.cert_pem, worker_leaf.key_pem, public.cert_pem)


def _server_context(tmp: Path, ca: LocalCA, leaf) -> ssl.SSLContext:
    """The stand-in's context from a bundle, read the way a pod reads COLOCATE_POD_TLS (a file here:
    /proc/self/environ is this process's own, fixed at its start)."""
    path = tmp / f"bundle-{os.urandom(4).hex()}"
    path.write_text(podtls.bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem))
    path.chmod(0o600)
    return podtls.server_context(str(path))


@contextlib.contextmanager
def _cell(pod_ctx: ssl.SSLContext, client: HopClient, fallback_tls: ssl.SSLContext | None = None):
    """A stand-in pod serving mutual TLS, a fallback (plain, or over ``fallback_tls``), and workerd with
    the sandbox plan whose POD_TLS binding presents ``client`` and whose own fetches trust only the
    client's public root; the pod's log lines (its refused handshakes) in ``cell.pod_log``."""
    plan = cell_plan()
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        pod = stack.enter_context(standin.serve(compute_ms=1, token=SECRETS["POD_TOKEN"], name="pod", tls=pod_ctx,
                                                log=lines.append))
        fb = stack.enter_context(standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME,
                                               name="fallback", tls=fallback_tls))
        w = stack.enter_context(Workerd())
        url = f"https://localhost:{pod.port}"
        fb_url = f"https://localhost:{fb.port}" if fallback_tls is not None else fb.url
        w.start(render_config(plan.worker, values_for(url, fb_url), port=w.port, storage_dir=w.directory / "objects",
                              pod_tls=client, public_roots=[client.ca_pem]))
        cell = Cell(w, [pod], fb, plan)
        cell.pod_log = lines
        cell.key = cell.create_key("hop")["key"]
        yield cell


@pytest.fixture(scope="module")
def good(ca, public, worker_client, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hop-good")
    with _cell(_server_context(tmp, ca, public.server("localhost")), worker_client) as cell:
        yield cell


def _tls(ca_pem: str | None = None, leaf=None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_pem:
        ctx.load_verify_locations(cadata=ca_pem)
    else:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if leaf is not None:
        with podtls.client_files(leaf.cert_pem, leaf.key_pem, ca_pem or leaf.cert_pem) as (pair, _):
            ctx.load_cert_chain(*pair)
    return ctx


def _https(port: int, method: str, path: str, ctx: ssl.SSLContext, body: dict | None = None,
           token: str = SECRETS["POD_TOKEN"]) -> tuple[int, bytes]:
    """One request over TLS (raises on a refused handshake)."""
    conn = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=10)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"authorization": f"Bearer {token}",
                                                       "content-type": "application/json"})
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def _plain(port: int, method: str, path: str) -> bytes:
    """What a plain-HTTP caller with the pod token gets back from the port (raw bytes, bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        body = json.dumps(chat()).encode() if method == "POST" else b""
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {SECRETS['POD_TOKEN']}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        got = b""
        with contextlib.suppress(OSError):
            while len(got) < 65536:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        return got


def _wait_log(lines: list[str], needle: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while needle not in "\n".join(lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "\n".join(lines)


def test_the_worker_reaches_its_pod_over_mutual_tls(good):
    res = good.call("POST", "/v1/chat/completions", body=chat())
    assert res.status == 200 and res.headers["x-colocate-backend"] == "pod-0", res.body
    probe = good.call("GET", "/_colocate/probe", headers={"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}"})
    assert probe.json()["pod_ok"] is True and probe.json()["pod_status"] == 200
    assert good.pod.requests >= 1


# The router's routes (the pod's guard opens them to the pod token), and vLLM's routes it never uses.
ROUTES = [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics")]
UNUSED = [(method, path) for path, method in standin.OPEN_ROUTES.items() if path != "/metrics"]


@pytest.mark.parametrize("method,path", ROUTES + UNUSED)
def test_a_stranger_gets_no_answer_on_any_route(good, public, worker_leaf, method, path):
    port = good.pod.port
    body = chat() if method == "POST" else None
    # The Worker's credential opens the router's routes (so the refusals below are the hop's doing), and
    # the pod's guard answers 404 on the routes vLLM has and the router never uses, whoever asks ...
    status, _ = _https(port, method, path, _tls(public.cert_pem, worker_leaf), body)
    assert status == (200 if (method, path) in ROUTES else 404), (method, path)
    # ... plain HTTP with the pod token gets no HTTP answer at all ...
    assert not _plain(port, method, path).startswith(b"HTTP/"), (method, path)
    # ... and neither does TLS without a client certificate, nor with one of another CA, nor with a
    # publicly trusted one (anyone can get one of those).
    for leaf in (None, LocalCA.create("stranger CA").client("stranger"), public.client("stranger")):
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected, OSError)):
            _https(port, method, path, _tls(public.cert_pem, leaf), body)


def test_the_pod_logs_each_refused_handshake(good):
    before = len(good.pod_log)
    _plain(good.pod.port, "GET", "/health")
    deadline = time.monotonic() + 10
    while len(good.pod_log) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(line.startswith("standin: refused a TLS handshake from 127.0.0.1") for line in good.pod_log[before:])


def test_an_expired_worker_certificate_fails_closed_and_the_fallback_serves(ca, public, tmp_path):
    old = ca.client("colocate worker", not_before=PAST, not_after=PAST + datetime.timedelta(days=1))
    with _cell(_server_context(tmp_path, ca, public.server("localhost")),
               HopClient(old.cert_pem, old.key_pem, public.cert_pem)) as cell:
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback", res.headers
        assert cell.pod.requests == 0
        assert "certificate has expired" in _wait_log(cell.pod_log, "certificate has expired")


@pytest.mark.parametrize("which", ["expired", "other CA", "other name", "the cell's CA"])
def test_a_pod_without_a_publicly_trusted_certificate_for_its_name_is_refused_and_the_fallback_serves(
        ca, public, worker_client, tmp_path, which):
    if which == "expired":
        leaf = public.server("localhost", not_before=PAST, not_after=PAST + datetime.timedelta(days=1))
    elif which == "other CA":  # a pod (or the next renter of its address) with its own CA
        leaf = LocalCA.create("impostor CA").server("localhost")
    elif which == "other name":
        leaf = public.server("pod-elsewhere.example")
    else:  # the cell's CA signs only the Worker's client certificate: the Worker never trusts it for a pod
        leaf = ca.server("localhost")
    with _cell(_server_context(tmp_path, ca, leaf), worker_client) as cell:
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback", res.headers
        assert cell.pod.requests == 0  # not one byte of the request reached it
        log = cell.worker.log_text()
        assert "certificate" in log.lower(), log[-2000:]


def _fallback_tls(tmp: Path, leaf) -> ssl.SSLContext:
    """A public API's server side: its certificate, no client certificate asked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with podtls.client_files(leaf.cert_pem, leaf.key_pem, leaf.cert_pem) as (pair, _):
        ctx.load_cert_chain(*pair)
    return ctx


@pytest.mark.parametrize("signed_by", ["public", "cell"])
def test_the_fallback_call_verifies_the_apis_public_certificate_never_the_cells_ca(
        ca, public, worker_client, tmp_path, signed_by):
    """The pod is down (its certificate is the cell CA's, which the Worker refuses), so the fallback is
    called over TLS: a publicly trusted chain serves; one of the cell's CA, present in the Worker's own
    credential, is refused: the cell's CA is trusted for nothing the Worker fetches."""
    issuer = public if signed_by == "public" else ca
    with _cell(_server_context(tmp_path, ca, ca.server("localhost")), worker_client,
               fallback_tls=_fallback_tls(tmp_path, issuer.server("localhost"))) as cell:
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert cell.pod.requests == 0 and res.headers["x-colocate-backend"] == "fallback", res.headers
        if signed_by == "public":
            assert res.status == 200 and cell.fallback.requests == 1, res.body
        else:
            assert res.status >= 500 and cell.fallback.requests == 0, (res.status, res.body)


def test_a_pod_process_serves_tls_from_its_environment_as_vllm_does(ca, tmp_path):
    """The real mechanism: COLOCATE_POD_TLS in the process's environment, read back through /proc/self/environ."""
    leaf, caller = ca.server("localhost"), ca.client("colocate worker")
    port_file = tmp_path / "port.json"
    env = podtls.environment(podtls.bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem),
                             {**os.environ, "POD_TOKEN": SECRETS["POD_TOKEN"], "PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port-file", str(port_file), "--compute-ms", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        info = json.loads(port_file.read_text())
        assert info["url"].startswith("https://")
        assert _https(info["port"], "GET", "/health", _tls(ca.cert_pem, caller))[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _https(info["port"], "GET", "/health", _tls(ca.cert_pem))
        # The fault endpoint stays on loopback, on the plain control port beside the TLS one.
        res = request(info["control_url"], "POST", "/_standin/fault", body={"mode": "error"})
        assert res.status == 200 and res.json()["fault"]["mode"] == "error"
        assert _https(info["port"], "GET", "/health", _tls(ca.cert_pem, caller))[0] == 500
        assert request(info["control_url"], "GET", "/health").status in (401, 404)  # the control port is not a back door
    finally:
        proc.terminate()
        proc.wait(timeout=10)


_LOAD = "import ssl; c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); c.load_cert_chain('/proc/self/environ', '/proc/self/environ')"


@pytest.mark.parametrize("first", [False, True])
def test_the_bundle_must_come_first_or_a_variable_before_it_can_hide_it_from_openssl(ca, first):
    """OpenSSL reads the text before the first PEM block in 254-byte pieces and stops at one that starts
    with the NUL between two variables: a 254-byte variable ahead of the bundle hides it."""
    leaf = ca.server("localhost")
    value = podtls.bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem)
    ahead = {"A": "x" * 252, "B": "y"}  # "A=" + 252 bytes fills the first piece; the second starts at its NUL
    env = podtls.environment(value, ahead) if first else {**ahead, podtls.ENV: value}
    res = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=30)
    if first:
        assert res.returncode == 0, res.stderr
    else:
        assert res.returncode != 0 and "PEM" in res.stderr, res.stderr


# ------------------------------------------------- the cloud's create request (RunPod v2, by its spec)
@pytest.fixture
def cloud_env(monkeypatch, tmp_path):
    monkeypatch.setenv("POD_TOKEN", TOKEN)
    monkeypatch.setenv("COLOCATE_POD_POLL_S", "0.05")
    monkeypatch.setenv("COLOCATE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


@pytest.fixture
def runpod_api(cloud_env, monkeypatch):
    yield from serving(FakeRunPod(pod_token=TOKEN), monkeypatch, "RUNPOD", "RunPod v2")


@pytest.fixture
def vast_api(cloud_env, monkeypatch):
    yield from serving(FakeVast(pod_token=TOKEN), monkeypatch, "VASTAI", "Vast.ai")


@pytest.fixture
def hop_env(ca, monkeypatch):
    """What infra/ hands scripts/pod.py on a mutual-TLS hop: the pod's bundle and readiness's credential."""
    pod_leaf, check = ca.server("localhost"), ca.client("colocate pod readiness")
    bundle = podtls.bundle(pod_leaf.cert_pem, pod_leaf.key_pem, ca.cert_pem)
    monkeypatch.setenv(podtls.BUNDLE_ENV, bundle)
    monkeypatch.setenv(podtls.CHECK_ENV, json.dumps({"cert": check.cert_pem, "key": check.key_pem, "ca": ca.cert_pem}))
    return pod_leaf


def test_runpod_create_carries_the_bundle_first_and_vllms_tls_flags_and_readiness_checks_over_mtls(
        runpod_api, cloud_env, hop_env, ca, capsys):
    spec = make_spec("apac-jp", "runpod", hop="auto")
    assert spec["tls_name"] == "localhost"  # make_spec has no zone: the name the stand-in's certificate carries
    code, out, err = run(capsys, ["create", "--spec", write_spec(cloud_env, spec)])
    assert code == 0, err
    assert out["url"].startswith("https://") and runpod_api.pod_errors == []
    sent = runpod_api.calls("POST", "/v2/pods")[0]
    assert list(sent["env"]) == [podtls.ENV, "VLLM_API_KEY"]  # the bundle first, in the JSON object's order
    assert sent["env"][podtls.ENV] == os.environ[podtls.BUNDLE_ENV] and sent["env"]["VLLM_API_KEY"] == TOKEN
    assert " ".join(podtls.vllm_args()) in sent["args"] and "--disable-fastapi-docs" in sent["args"].split()
    assert hop_env.key_pem not in err and "PRIVATE KEY" not in err
    # The pod it brought up admits the cell's callers only: a caller without a certificate is refused.
    port = out["port"]
    assert _https(port, "GET", "/health", _tls(ca.cert_pem, ca.client("colocate worker")), token=TOKEN)[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        _https(port, "GET", "/health", _tls(ca.cert_pem))


def test_a_pod_whose_environment_hides_the_bundle_fails_readiness_and_is_deleted(runpod_api, cloud_env, hop_env, capsys):
    """RunPod's order of a pod's environment is not documented: if the platform put a long variable
    ahead of the bundle, vLLM could not load it. The user sees readiness fail; nothing is left running."""
    runpod_api.platform_env = {"RUNPOD_A": "x" * 245, "RUNPOD_B": "y"}  # "RUNPOD_A=..." fills OpenSSL's first 254-byte piece
    code, out, err = run(capsys, ["create", "--spec", write_spec(cloud_env, make_spec("apac-jp", "runpod", hop="auto",
                                                                                readyTimeoutS=2))])
    assert code == 1 and out is None
    assert "not ready after 2s" in err and "destroyed" in err
    assert runpod_api.live() == [] and any("PEM" in e for e in runpod_api.pod_errors)


def test_a_spec_on_a_mutual_tls_hop_is_refused_before_anything_is_rented_without_its_credentials(
        runpod_api, cloud_env, capsys, monkeypatch):
    monkeypatch.delenv(podtls.BUNDLE_ENV, raising=False)
    code, out, err = run(capsys, ["create", "--spec", write_spec(cloud_env, make_spec("apac-jp", "runpod", hop="auto"))])
    assert code == 2 and "POD_TLS is not set" in err and "Fix:" in err
    assert runpod_api.calls("POST", "/v2/pods") == []


def test_vastai_create_carries_the_bundle_first_in_its_env_object_and_serves_mutual_tls_only(
        vast_api, cloud_env, hop_env, ca, capsys):
    """Vast.ai takes ``env`` as a JSON object (its CLI sends one; its spec's string of Docker flags
    could not hold a PEM): the bundle first, the token, the direct port; vLLM's TLS flags in args."""
    vast_api.offers = [offer(16, "TW", 0.3)]
    spec = make_spec("apac-tw", "vastai", hop="auto")
    assert spec["tls_name"] == "localhost"
    code, out, err = run(capsys, ["create", "--spec", write_spec(cloud_env, spec)])
    assert code == 0, err
    assert out["url"].startswith("https://") and vast_api.pod_errors == []
    sent = vast_api.calls("PUT", "/api/v0/asks/")[0]
    assert list(sent["env"]) == [podtls.ENV, "VLLM_API_KEY", f"-p {spec['port']}:{spec['port']}"]
    assert sent["env"][podtls.ENV] == os.environ[podtls.BUNDLE_ENV] and sent["env"]["VLLM_API_KEY"] == TOKEN
    assert sent["runtype"] == "args" and " ".join(podtls.vllm_args()) in " ".join(sent["args"])
    assert "--disable-fastapi-docs" in sent["args"]
    assert hop_env.key_pem not in err and "PRIVATE KEY" not in err
    port = out["port"]
    assert _https(port, "GET", "/health", _tls(ca.cert_pem, ca.client("colocate worker")), token=TOKEN)[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):  # no client certificate: refused in the handshake
        _https(port, "GET", "/health", _tls(ca.cert_pem))
