"""Wait until a pod serves: provider state running, address known, then ``GET /health`` answers 200.

The health check goes to the URL the Worker will use (the public ip and mapped port;
a DNS-only hostname resolves to the same address). It carries the readiness token (``token``:
``colocate_pod_guard.readiness_token`` of the pod token), which the pod's guard admits to
``GET /health`` and nothing else: readiness never holds a credential that runs inference. On a
mutual-TLS hop it presents the readiness certificate and checks that the pod's certificate is
the cell's, for the name the Worker will use (``tls``: a client context and that name).
Progress lines go to stderr.
Poll interval: ``COLOCATE_POD_POLL_S`` (default 5 s). A pod that runs but has no address
``COLOCATE_POD_NO_ADDRESS_S`` (default 60 s) after it first ran fails at once when the
provider says it may never get one (``Provider.no_address_fix``), instead of at the timeout.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import sys
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from . import stop
from .base import DEAD, RUNNING, PodInfo
from .errors import NotFoundError, NotReadyError, RetryableError


def poll_interval() -> float:
    try:
        return max(0.01, float(os.environ.get("COLOCATE_POD_POLL_S") or 5))
    except ValueError:
        return 5.0


def health(url: str, timeout: float, tls: tuple[ssl.SSLContext, str] | None = None,
           token: str | None = None) -> tuple[bool, str]:
    if tls is not None:
        return tls_health(url, timeout, *tls, token=token)
    import requests  # here: a process that only checks over TLS (the sandbox's) never loads it

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with requests.get(url + "/health", headers=headers, timeout=timeout, allow_redirects=False) as r:
            return r.status_code == 200, f"health {r.status_code}"
    except requests.RequestException as exc:
        return False, f"health: {type(exc).__name__}"


def tls_health(url: str, timeout: float, ctx: ssl.SSLContext, name: str, token: str | None = None) -> tuple[bool, str]:
    """``GET /health`` over mutual TLS to the URL's address, the certificate checked for ``name``.

    A pod that proves the cell's certificate for ``name`` and then refuses ours is serving: vLLM
    trusts only the Worker's CA, never readiness's (podtls.READINESS_CA), and its port refuses
    connections until its engine is up (it is bound, not listening, while the engine loads). Its
    server (uvicorn, on asyncio's TLS) refuses a client certificate by closing the connection with
    no alert: the request then meets a close before any status line (``RemoteDisconnected``), a
    reset, or the alert where a server sends one (the stand-in). A pod that admits ours (the
    stand-in) must answer 200. A pod that holds the connection open without a word is not ready."""
    parts = urlsplit(url)
    shook = False
    try:
        with (socket.create_connection((parts.hostname, parts.port or 443), timeout=timeout) as raw,
              ctx.wrap_socket(raw, server_hostname=name) as conn):
            shook = True
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            conn.sendall(f"GET /health HTTP/1.1\r\nHost: {name}\r\n{auth}Connection: close\r\n\r\n".encode())
            resp = http.client.HTTPResponse(conn)
            resp.begin()
            return resp.status == 200, f"health {resp.status}"
    except ssl.SSLCertVerificationError as exc:
        return False, f"health: the pod's certificate is not the cell's for {name} ({exc.verify_message})"
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        if shook and refused_after_handshake(exc):
            return True, f"serving (it refused the readiness certificate: {reason})"
        return False, f"health: {reason}"


def refused_after_handshake(exc: BaseException) -> bool:
    """Whether ``exc``, met after our handshake completed, is the server refusing our certificate:
    a close before any status line, a reset, or a TLS alert; never a timeout or a garbled answer."""
    return isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError | ssl.SSLError)


def no_address_grace() -> float:
    try:
        return max(0.0, float(os.environ.get("COLOCATE_POD_NO_ADDRESS_S") or 60))
    except ValueError:
        return 60.0


def wait_ready(describe: Callable[[], PodInfo], timeout_s: float, log=None, poll_s: float | None = None,
               no_address_fix: str | None = None, tls: tuple[ssl.SSLContext, str] | None = None,
               token: str | None = None) -> PodInfo:
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    poll_s = poll_interval() if poll_s is None else poll_s
    start = time.monotonic()
    deadline = start + timeout_s
    last = "no answer yet"
    running_without_address: float | None = None  # when the pod was first seen running with no address
    while True:
        elapsed = time.monotonic() - start
        try:
            info = describe()
        except RetryableError as exc:
            info, last = None, f"provider busy ({exc})"
        except NotFoundError:
            raise NotReadyError("the pod disappeared while starting (deleted elsewhere, or reclaimed)") from None
        if info is not None:
            if info.state == DEAD:
                raise NotReadyError(f"pod {info.id} is {info.raw_state}: it will never serve")
            if info.state == RUNNING and info.url:
                ok, last = health(info.url, timeout=max(0.5, min(5.0, deadline - time.monotonic())), tls=tls, token=token)
                log(f"[{elapsed:6.1f}s] {info.id}: {info.raw_state} at {info.url}, {last}")
                if ok:
                    return info
            else:
                last = f"{info.raw_state}, address {'known' if info.url else 'not yet known'}"
                log(f"[{elapsed:6.1f}s] {info.id}: {last}")
                if info.state == RUNNING and no_address_fix:
                    now = time.monotonic()
                    if running_without_address is None:
                        running_without_address = now
                    if now - running_without_address >= no_address_grace():
                        raise NotReadyError(f"pod {info.id} is {info.raw_state} with no public address after "
                                            f"{now - running_without_address:.0f}s: {no_address_fix}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NotReadyError(f"not ready after {timeout_s:g}s (last: {last})")
        stop.sleep(min(poll_s, remaining))
