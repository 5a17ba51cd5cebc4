"""The ``existing`` provider: an endpoint the team already runs (colocate/cell/endpoints.py), as
``scripts/pod.py`` sees it. The kit never creates, replaces or deletes it.

``rent`` records the endpoint (its id is ``<host>:<port>``; no network). ``wait`` is the readiness
check ``pulumi up`` runs, up to ``readyTimeoutS``; it fails with what it saw, and nothing is deleted:

- **mutual TLS** (the name on ``colocate:zone``): the box must prove the certificate this stack issued
  for its name (publicly trusted, ACME DNS-01), then refuse the readiness certificate, whose CA its
  bundle does not trust (a TLS 1.3 handshake, so the box's certificate is seen before the refusal).
  A box that answers a caller of an untrusted CA does not check client certificates: refused at once.
- **the pod token over the box's own TLS**: ``GET /health`` with the readiness token must be 200, over
  a certificate publicly trusted for the name; vLLM's routes that its ``--api-key`` leaves open must
  refuse a stranger (``STRANGER_PROBES``): a box that answers one without a credential runs no guard,
  and is refused at once.

Until the box serves this stack's credentials, ``wait`` writes them where only the deployer can read
them (``<state>/endpoints/<stack>-pod-<i>/``: directory 0700, files 0600; ``pod-token``, and
``pod-tls.pem`` on mutual TLS: the box's key, certificate and the Worker's CA) and prints how to copy
them to the box (scp, encrypted) and start vLLM with them there (the kit's image: podstart.sh and the
pod's guard). Its copy is removed once the box serves them. ``describe`` needs no network: a declared
endpoint runs until the Worker's health check says otherwise (the keeper reads both).
"""

from __future__ import annotations

import http.client
import os
import shlex
import shutil
import socket
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..cell.catalogue import EXISTING
from . import podtls, stop
from .base import RUNNING, PodInfo, Provider
from .errors import NotReadyError, PodConfigError
from .guard.colocate_pod_guard import readiness_token
from .readiness import poll_interval, refused_after_handshake
from .spec import PodSpec

REPO = Path(__file__).resolve().parents[2]
# Routes vLLM's --api-key leaves open (FACTS: /metrics, /tokenize, ...) and one it guards: a stranger
# must get none of them. (method, path, JSON body)
STRANGER_PROBES = (("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "colocate"}), ("GET", "/v1/models", None))
TOKEN_FILE, TLS_FILE = "pod-token", "pod-tls.pem"
BOX_DIR = "~/colocate-pod"  # where the printed commands put the files on the box
SERVING, WAITING, UNSAFE = "serving", "waiting", "unsafe"


def pod_id(host: str, port: int) -> str:
    return f"{host}:{port}"


def credentials_dir(spec: PodSpec) -> Path:
    """Where ``wait`` writes the box's credentials on the deployer's machine (as local pods' state)."""
    base = os.environ.get("COLOCATE_STATE_DIR")
    return (Path(base) if base else REPO / ".colocate") / "endpoints" / f"{spec.stack}-pod-{spec.index}"


class Existing(Provider):
    """Describes an endpoint by its id; lists none (the kit holds no account whose pods it could sweep);
    refuses to create or destroy one."""

    name = EXISTING

    def __init__(self, token: str = ""):
        pass

    def candidates(self, spec):
        return [], []

    def create(self, spec, candidate, token: str) -> str:
        raise PodConfigError(f"{spec.name} is an existing endpoint: the kit never creates one. Fix: run "
                             ".venv/bin/python scripts/pod.py rent and wait, which record and check it")

    def describe(self, pod_id: str) -> PodInfo:
        host, _, port = pod_id.rpartition(":")
        if not host or not port.isdigit():
            raise PodConfigError(f"{pod_id!r} is not an existing endpoint's id (<host>:<port>)")
        return PodInfo(id=pod_id, name="", state=RUNNING, raw_state="declared (the team's own endpoint)", ip=host,
                       port=int(port), scheme="https")

    def destroy(self, pod_id: str) -> bool:
        raise PodConfigError(f"{pod_id} is an existing endpoint: the kit never deletes it. Fix: stop it on the box "
                             "yourself; to take it out of the cell, remove it from colocate:pod.endpoints and pulumi up")

    def list_pods(self) -> list[PodInfo]:
        return []


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _endpoint(spec: PodSpec) -> dict:
    if spec.endpoint is None:
        raise PodConfigError(f"spec.endpoint: missing for provider {EXISTING}. Fix: regenerate the spec from the plan")
    return spec.endpoint


def rent(spec: PodSpec) -> dict:
    """The endpoint's record: nothing is rented."""
    e = _endpoint(spec)
    return {"id": pod_id(e["host"], e["port"]), "provider": EXISTING, "name": spec.name}


def result(spec: PodSpec) -> dict:
    """What ``wait`` prints once the endpoint serves (``create``'s JSON): all of it declared."""
    e = _endpoint(spec)
    return {"id": pod_id(e["host"], e["port"]), "provider": EXISTING, "location": e["location"],
            "url": f"https://{e['host']}:{e['port']}", "cost_per_hr": e["cost_per_hr"], "gpu": spec.gpu,
            "name": spec.name, "ip": e["ip"] or e["host"], "port": e["port"]}


def check_mtls(connect: str, port: int, name: str, ctx: ssl.SSLContext, expected_der: bytes, token: str,
               timeout: float) -> tuple[str, str]:
    """(state, what was seen) of a mutual-TLS endpoint, with readiness's client certificate (``ctx``)."""
    shook = False
    try:
        with (socket.create_connection((connect, port), timeout=timeout) as raw,
              ctx.wrap_socket(raw, server_hostname=name) as conn):
            shook = True
            served = conn.getpeercert(binary_form=True)
            if served != expected_der:
                ends = (conn.getpeercert() or {}).get("notAfter", "?")
                return WAITING, f"it serves another certificate for {name} than this stack's (that one ends {ends})"
            conn.sendall(f"GET /health HTTP/1.1\r\nHost: {name}\r\nAuthorization: Bearer {token}\r\n"
                         "Connection: close\r\n\r\n".encode())
            resp = http.client.HTTPResponse(conn)
            resp.begin()
            return UNSAFE, (f"it answered {resp.status} to a client certificate of a CA it must not trust: it does not "
                            "check the caller's certificate, so anyone who reaches it gets past TLS")
    except ssl.SSLCertVerificationError as exc:
        return WAITING, f"its certificate is not publicly trusted for {name} ({exc.verify_message})"
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        if shook and refused_after_handshake(exc):
            return SERVING, f"serving this stack's certificate (it refused the readiness certificate: {reason})"
        return WAITING, f"no TLS 1.3 handshake ({reason})"


def check_token(url: str, token: str, timeout: float) -> tuple[str, str]:
    """(state, what was seen) of an endpoint behind its own TLS and the pod's guard."""
    import requests  # here: pod.py for another provider never loads it

    with requests.Session() as s:
        try:
            r = s.get(url + "/health", headers={"Authorization": f"Bearer {token}"}, timeout=timeout,
                      allow_redirects=False)
        except requests.exceptions.SSLError as exc:
            return WAITING, f"its certificate is not publicly trusted for its name ({exc})"
        except requests.RequestException as exc:
            return WAITING, f"no answer ({type(exc).__name__})"
        if r.status_code != 200:
            return WAITING, (f"GET /health with this stack's readiness token answered {r.status_code}: it is not up, or "
                             "its guard holds another pod token")
        for method, path, body in STRANGER_PROBES:
            try:
                r = s.request(method, url + path, json=body, timeout=timeout, allow_redirects=False)
            except requests.RequestException as exc:
                return WAITING, f"{method} {path}: no answer ({type(exc).__name__})"
            if 200 <= r.status_code < 300:
                return UNSAFE, (f"{method} {path} answered {r.status_code} to a stranger (no credential): it serves vLLM's "
                                "routes that --api-key leaves open, so it runs without the pod's guard")
    return SERVING, "serving behind its guard (the readiness token opens /health, strangers get nothing)"


def leaf_der(bundle: str) -> bytes:
    """The box's own certificate (the bundle's first) in DER, as the handshake shows it."""
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    start = bundle.index(begin)
    return ssl.PEM_cert_to_DER_cert(bundle[start:bundle.index(end, start) + len(end)] + "\n")


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def write_credentials(spec: PodSpec, token: str, bundle: str) -> Path:
    """The box's credentials in a directory only this user can read; the instructions on stderr."""
    d = credentials_dir(spec)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    _write(d / TOKEN_FILE, token)
    if bundle:
        _write(d / TLS_FILE, bundle)
    return d


def instructions(spec: PodSpec, d: Path) -> str:
    """How the operator installs the credentials on the box and serves with them there."""
    e = _endpoint(spec)
    box = e["ip"] or e["host"]
    env = [f'VLLM_API_KEY="$(cat {BOX_DIR}/{TOKEN_FILE})"']
    if spec.mtls:
        env.insert(0, f'COLOCATE_POD_TLS="$(cat {BOX_DIR}/{TLS_FILE})"')
        ports, args = f"{e['port']}:{e['port']}", spec.serve_args("0.0.0.0", e["port"])
        behind = f"the box serves https://{e['host']}:{e['port']} itself, mutual TLS"
    else:  # the box's own TLS server (https://host:port) forwards to vLLM on 127.0.0.1:8000
        ports, args = "127.0.0.1:8000:8000", spec.serve_args("0.0.0.0", 8000)
        behind = f"then point your TLS server for https://{e['host']}:{e['port']} at http://127.0.0.1:8000"
    run = " ".join([*env, "docker run -d --name colocate-pod --restart unless-stopped --gpus all -p", ports,
                    *[f"-e {v.split('=', 1)[0]}" for v in env], shlex.quote(spec.image), shlex.quote(spec.model),
                    shlex.join(args)])
    # read, then removed, then vLLM: in that order inside one background shell
    bare = " ".join(["(export", *env, f"&& rm -r {BOX_DIR} && exec /bin/sh colocate/pods/podstart.sh",
                     shlex.quote(spec.model), shlex.join(args if spec.mtls else spec.serve_args("127.0.0.1", 8000)),
                     ") >colocate-pod.log 2>&1 &"])
    return (f"endpoint {spec.index} ({e['host']}:{e['port']}) does not serve this cell's credentials yet. They are in "
            f"{d} (mode 0600). Copy them to the box and serve with them there ({behind}):\n"
            f"  scp -rp {shlex.quote(str(d))} <user>@{box}:{BOX_DIR.removeprefix('~/')}\n"
            f"  on the box: {run} && rm -r {BOX_DIR}\n"
            f"  or, with vLLM installed and a checkout of this kit on the box, from that checkout: {bare}\n"
            f"(colocate:pod.image must be the kit's image, pod/Dockerfile: its start command, podstart.sh, loads the "
            f"bundle and runs the pod's guard.) This check waits until the box serves them, then removes {d}.")


def wait(spec: PodSpec, rented: object, clock: Callable[[], float] = time.monotonic) -> dict:
    """Until the endpoint serves this stack's credentials (``readyTimeoutS``); never deletes anything."""
    if not isinstance(rented, dict) or rented.get("name") != spec.name or rented.get("provider") != EXISTING:
        raise PodConfigError(f"wait: the recorded endpoint {rented!r} is not this spec's ({spec.name}). "
                             "Fix: pass the spec with `rented` set to the JSON `pod.py rent` printed for it")
    e = _endpoint(spec)
    token = os.environ.get("POD_TOKEN", "")
    if not token:
        raise PodConfigError("POD_TOKEN is not set: the box serves the pod token the Worker sends. "
                             "Fix: export POD_TOKEN (pulumi config colocate:podToken --secret)")
    bundle, ctx, expected = "", None, b""
    if spec.mtls:
        try:
            bundle, ctx = podtls.bundle_from_env(), podtls.checker_from_env()
        except podtls.PodTlsError as exc:
            raise PodConfigError(str(exc)) from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # the box's certificate is seen before it refuses ours
        expected = leaf_der(bundle)
    ready = readiness_token(token)
    url = f"https://{e['host']}:{e['port']}"
    start, written = clock(), None
    deadline = start + spec.ready_timeout_s
    while True:
        timeout = max(0.5, min(5.0, deadline - clock()))
        if ctx is not None:
            state, seen = check_mtls(e["ip"] or e["host"], e["port"], e["host"], ctx, expected, ready, timeout)
        else:
            state, seen = check_token(url, ready, timeout)
        _log(f"[{clock() - start:6.1f}s] {url}: {seen}")
        if state == UNSAFE:
            raise NotReadyError(f"endpoint {spec.index} ({url}): {seen}. Fix: serve it through the kit's start command "
                                "(pod/Dockerfile's image, or colocate/pods/podstart.sh), which "
                                + ("loads the bundle with --ssl-cert-reqs 2" if spec.mtls else "runs the pod's guard")
                                + "; nothing was changed or deleted")
        if state == SERVING:
            if written is not None or credentials_dir(spec).exists():
                shutil.rmtree(credentials_dir(spec), ignore_errors=True)
            return result(spec)
        if written is None:
            written = write_credentials(spec, token, bundle)
            _log(instructions(spec, written))
        if clock() >= deadline:
            raise NotReadyError(f"endpoint {spec.index} ({url}) did not serve this cell's credentials within "
                                f"{spec.ready_timeout_s:g} s (last: {seen}). Fix: install them as printed above (they "
                                f"are in {written}), then run pulumi up again; the kit deleted nothing")
        stop.sleep(min(poll_interval(), max(0.0, deadline - clock())))


def create(spec: PodSpec) -> dict:
    """``rent`` then ``wait``, in one process."""
    return wait(spec, rent(spec))
