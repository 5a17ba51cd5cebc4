"""Mutual TLS on the pod hop: how a pod serves it from a stock image, and how a caller presents itself.

The pod terminates TLS itself and refuses any caller without a client certificate signed by the
cell's CA (vLLM's ``--ssl-cert-reqs 2``, uvicorn's ``ssl.CERT_REQUIRED``): a stranger on the pod's
port never gets past the handshake, on any path. The stock image takes only arguments and
environment variables (RunPod's v2 create request has no entrypoint or start command, and
``vllm/vllm-openai``'s entrypoint is ``vllm serve``), so nothing can write a file before vLLM starts.
The TLS material therefore travels as one environment variable, ``COLOCATE_POD_TLS``: a newline,
then the pod's certificate, its private key and the CA that signs callers, in PEM. vLLM is
pointed at ``/proc/self/environ`` for all three files: OpenSSL's PEM reader skips what is not
PEM, so the certificate file yields the pod's certificate (first), the key file its key, and the
CA file the certificates it trusts. The leading newline puts the first ``-----BEGIN`` at the start
of a line, as the PEM reader needs. No other variable of the pod may hold PEM.

The variable must come first in the process's environment (``environment`` below puts it there).
OpenSSL reads the non-PEM text before the first ``-----BEGIN`` in pieces of at most 254 bytes
(``BIO_gets`` with a 255-byte line buffer) and takes a piece that begins with the NUL between two
variables for the end of the file: whatever variables come before ours can hide it. This is not
theoretical: a clean CI machine's environment hid the bundle from the stand-in, with "PEM lib".

An image whose entrypoint is ``podstart.sh`` (pod/Dockerfile) takes the same arguments and writes the
bundle to files on tmpfs before vLLM starts, so no variable can hide it (docs/pods.md).

The stand-in (``colocate.pods.standin``) serves its TLS through ``server_context`` below, the
same calls uvicorn makes for vLLM's flags, reading the same variable the same way.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import PodConfigError

ENV = "COLOCATE_POD_TLS"  # in the pod's environment: "\n" + certificate + key + client CA (PEM)
SOURCE = "/proc/self/environ"  # where vLLM (and the stand-in) read that variable back as PEM files
CERT_REQUIRED = 2  # ssl.CERT_REQUIRED, as vLLM's --ssl-cert-reqs takes it


class PodTlsError(PodConfigError, ValueError):
    """Missing or malformed TLS material for the pod hop; the message names the variable and the fix."""


def bundle(cert_pem: str, key_pem: str, client_ca_pem: str, readiness_ca_pem: str = "") -> str:
    """The value of ``COLOCATE_POD_TLS``: the pod's certificate first (its chain may follow), its key, the
    callers' CA, and (only for a pod that enforces ``allows``: the stand-in) the readiness CA."""
    parts = {"certificate": cert_pem, "private key": key_pem, "client CA": client_ca_pem}
    if readiness_ca_pem:
        parts["readiness CA"] = readiness_ca_pem
    for what, pem in parts.items():
        if "-----BEGIN" not in (pem or ""):
            raise PodTlsError(f"pod TLS: the {what} is not PEM. Fix: pass the PEM text the stack declared")
    return "\n" + "".join(p if p.endswith("\n") else p + "\n" for p in parts.values())


# Readiness has a CA of its own (common name ending in READINESS_CA), never the cell's: its
# certificate sits in every pod command's environment and must not run inference. A pod that
# trusts that CA admits its certificates to READINESS_ROUTES only (``allows``). vLLM cannot tell
# callers apart by path, so a cloud pod's bundle does not carry the readiness CA at all: vLLM
# refuses the readiness certificate in the handshake, which readiness takes as "serving"
# (colocate.pods.readiness). The stand-in trusts it and enforces the rule, so tests can show it.
READINESS_CA = "pod readiness CA"
READINESS_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})


def caller_role(peercert: dict | None) -> str:
    """``readiness`` for a certificate the readiness CA signed, else ``worker`` (the handshake
    already verified it against a CA the pod trusts; the issuer's name says which)."""
    issuer = dict(pair for rdn in (peercert or {}).get("issuer", ()) for pair in rdn)
    return "readiness" if str(issuer.get("commonName", "")).endswith(READINESS_CA) else "worker"


def allows(peercert: dict | None, method: str, path: str) -> bool:
    """Whether a caller with ``peercert`` (``SSLSocket.getpeercert()``) may ``method path``."""
    if caller_role(peercert) == "readiness":
        return (method, path.split("?", 1)[0]) in READINESS_ROUTES
    return True


def environment(bundle_value: str, others: dict[str, str]) -> dict[str, str]:
    """A pod's environment with ``COLOCATE_POD_TLS`` first, so no other variable can hide it from OpenSSL."""
    rest = {k: v for k, v in others.items() if k != ENV}
    return {ENV: bundle_value, **rest}


def vllm_args() -> list[str]:
    """vLLM's flags for mutual TLS from ``COLOCATE_POD_TLS`` (uvicorn's ssl options)."""
    return ["--ssl-certfile", SOURCE, "--ssl-keyfile", SOURCE, "--ssl-ca-certs", SOURCE,
            "--ssl-cert-reqs", str(CERT_REQUIRED)]


def server_context(source: str = SOURCE) -> ssl.SSLContext:
    """What uvicorn builds from those flags: the pod's keypair, callers verified against the CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(source, source)
        ctx.load_verify_locations(source)
    except (ssl.SSLError, OSError) as exc:
        raise PodTlsError(f"pod TLS: cannot load the keypair and client CA from {ENV} ({exc}). "
                          f"Fix: set {ENV} to pod_tls.bundle(certificate, key, client CA)") from None
    ctx.verify_mode = ssl.VerifyMode(CERT_REQUIRED)
    return ctx


# scripts/pod.py's own credential for readiness: JSON {"cert", "key", "ca"} (PEM; "ca" "" = the public roots)
CHECK_ENV = "POD_CHECK_TLS"
BUNDLE_ENV = "POD_TLS"  # scripts/pod.py's input: the pod's bundle(), handed to the pod as COLOCATE_POD_TLS


def client_context(cert_pem: str, key_pem: str, ca_pem: str) -> ssl.SSLContext:
    """A client that presents ``cert_pem`` and trusts only ``ca_pem``, checking the server's name;
    ``ca_pem`` "" trusts the public roots (certifi's, as ``requests`` does): a cloud pod's
    certificate on a zone is publicly trusted (infra/hop.py)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    with client_files(cert_pem, key_pem, ca_pem or "") as (pair, ca):
        ctx.load_cert_chain(*pair)  # read into memory: the files go when the block ends
        if ca_pem:
            ctx.load_verify_locations(ca)
        else:
            import certifi

            ctx.load_verify_locations(certifi.where())
    return ctx


def checker_from_env(environ=os.environ) -> ssl.SSLContext:
    """The readiness check's client context from ``POD_CHECK_TLS``; PodTlsError names what is wrong."""
    import json

    raw = environ.get(CHECK_ENV, "")
    try:
        data = json.loads(raw) if raw else None
        ok = isinstance(data, dict) and all(isinstance(data.get(k), str) and "-----BEGIN" in data[k]
                                            for k in ("cert", "key")) and isinstance(data.get("ca"), str) and (
            data["ca"] == "" or "-----BEGIN" in data["ca"])
    except ValueError:
        ok = False
    if not ok or not isinstance(data, dict):
        raise PodTlsError(f"{CHECK_ENV} is {'not set' if not raw else 'not a JSON object of PEM cert, key and ca'}: "
                          "the pod admits only callers with a certificate of the cell's CA, readiness included. "
                          f"Fix: export {CHECK_ENV}='{{\"cert\": ..., \"key\": ..., \"ca\": ...}}' "
                          "(the stack's readiness certificate; the sandbox writes its own)")
    try:
        return client_context(data["cert"], data["key"], data["ca"])
    except (ssl.SSLError, OSError) as exc:
        raise PodTlsError(f"{CHECK_ENV}: the certificate, key or CA does not load ({exc}). "
                          "Fix: pass the PEM text the stack declared") from None


def bundle_from_env(environ=os.environ) -> str:
    """The pod's TLS bundle from ``POD_TLS``; PodTlsError names the variable when it is missing."""
    raw = environ.get(BUNDLE_ENV, "")
    if raw.count("-----BEGIN") < 3:
        raise PodTlsError(f"{BUNDLE_ENV} is {'not set' if not raw else 'not a bundle of certificate, key and client CA'}: "
                          "this pod's hop is mutual TLS. Fix: export POD_TLS=<podtls.bundle(cert, key, client CA)> "
                          "(the stack declares them; the sandbox writes its own)")
    return raw


@contextlib.contextmanager
def client_files(cert_pem: str, key_pem: str, ca_pem: str) -> Iterator[tuple[tuple[str, str], str]]:
    """((certificate file, key file), CA file) for a client such as ``requests``, in a private
    directory (mode 0700, files 0600) that is removed on exit: the key is never left on disk."""
    with tempfile.TemporaryDirectory(prefix="colocate-hop-") as d:
        paths = []
        for name, text in (("client.pem", cert_pem), ("client.key", key_pem), ("ca.pem", ca_pem)):
            path = Path(d) / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            paths.append(str(path))
        yield (paths[0], paths[1]), paths[2]
