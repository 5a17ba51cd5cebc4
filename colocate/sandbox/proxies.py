"""The emulated network: every hop's delay is added here or in js/wrapper.js, never in the router.

    FrontServer     client -> edge. Listens on the worker_url port, waits RTT(client, edge)/2,
                    forwards to workerd, waits RTT/2 again before the response starts. Adds what
                    Cloudflare's edge adds: ``cf-ray: <hex>-<accepting colo>`` and
                    ``cf-placement: remote-<EDGE>|local-<EDGE>`` (request and response).
    OutboundServer  Worker/object -> the world. workerd's ``globalOutbound`` for each service
                    points here with an injected ``x-sandbox-site`` header naming the caller's
                    site. ``/cdn-cgi/trace`` is answered with ``colo=<caller site>``; requests to
                    a known target (pod, fallback) wait RTT(caller, target) (half before, half
                    after) and are forwarded; a URL whose host is an IP literal is refused the
                    way Cloudflare refuses it (403, ``error code: 1003``, see ``ip_literal``);
                    anything else is refused (502, JSON). Targets are named by hostname
                    (``localhost:<port>``, what ``PodPlan.worker_url`` gives a local pod) and
                    the proxy maps that name to 127.0.0.1.
                    Requests without the site header are the control endpoint:
                    ``GET /_sandbox/pin?name=&edge=&hint=`` pins a generation on first touch and
                    returns ``{"site", "rtt_ms"}``; ``GET /_sandbox/health`` reports the network;
                    ``POST /_sandbox/pod-hop/cut`` closes every open connection of the pod hops,
                    so the Worker's next request to a pod opens a new one (TCP + TLS);
                    ``GET /_sandbox/pod-hop/connections`` (and the cut's answer) give each hop's
                    connections accepted so far, by the hop's port: ``{"connections": {"<port>": n}}``.

    PodHop          Worker -> pod, per pod: a TCP relay that delays the (mutual-TLS) bytes by
                    RTT(edge, pod)/2 each way, plus the TCP handshake's round trip per new
                    connection. The Worker reaches the pod through its POD_TLS binding (a
                    workerd network service), not through the outbound proxy.

Both stream: bodies are relayed chunk by chunk as they arrive (SSE passes unbuffered), and the
front proxy sends a request's body to workerd as the client uploads it (its framing checked first,
a malformed chunk answered 400 there), as Cloudflare's edge hands a Worker its request at once.

A client that leaves is passed on, as Cloudflare's edge cancels a Worker's request when its
client disconnects: from the moment a relay connects upstream until the answer has been
relayed, it watches its client's connection, and when the client closes it (or resets it),
the relay resets its own connection upstream (``ClientWatch``). workerd sees a closed
connection only as a reset, or when it next writes to it (a FIN while it waits for its own
answer goes unnoticed, seen in workerd 1.20261117.1); a reset cancels the request and fires its
abort signal (``Request.signal``), as the platform does, so the router's hang-up handling runs
here as it does in the cloud.

The front server answers malformed HTTP as Cloudflare's edge does, before the Worker sees it,
with the status the edge uses and a JSON body in OpenAI's error shape (never HTML, an internal
address or exception text): 400 for a bad request line, target, header or body framing, 413 for
a body over ``MAX_REQUEST_BODY``, 414 for a URL over 16 KB, 431 for headers over 32 KB in all
or 16 KB in one (Cloudflare's Workers request limits), 501 for a method it does not know.
Repeated headers (two ``Authorization`` lines) reach the Worker as sent, and the runtime joins
them with ", " as Cloudflare's does. A client that leaves (reset, broken pipe, timeout) is not
an error: nothing is logged for it.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import re
import secrets
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from .errors import SandboxError
from .geography import Geography, Sites
from .pinning import Pins

SITE_HEADER = "x-sandbox-site"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "proxy-connection"}
UPSTREAM_TIMEOUT_S = 120.0
HOLD_S = 60.0  # how long a request may wait at the edge while a deploy swaps workerd
MAX_REQUEST_BODY = 32 * 1024 * 1024
# What a deployed Worker gets from fetch("http://<ip>:<port>/..."): Cloudflare's known-issues
# page (cloudflare-docs PR #9802) says subrequests need a hostname; the answer users report
# is the body "error code: 1003" (cloudflare/workers-docs #981), HTTP 403 (Cloudflare's 1xxx
# errors page: 1003 "Direct IP access not allowed" is returned with 403).
IP_LITERAL_STATUS = 403
IP_LITERAL_BODY = b"error code: 1003"
LOCAL_NAMES = {"localhost": "127.0.0.1"}  # names the sandbox resolves (everything runs on loopback)
# Cloudflare's Workers request limits (developers.cloudflare.com/workers/platform/limits):
# "URLs have a limit of 16 KB"; "request headers observe a total limit of 32 KB, but each
# header is limited to 16 KB".
MAX_URL_BYTES = 16 * 1024
MAX_HEADERS_BYTES = 32 * 1024
MAX_HEADER_BYTES = 16 * 1024
# Methods the edge forwards; anything else is answered 501 (RFC 9110 section 9.1: a method
# the server does not recognise).
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
CLIENT_LEFT = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)
CLIENT_TIMEOUT_S = 300.0  # a client silent this long (mid-request or idle between requests) is dropped
LINGER_S = 1.0  # after an error answer, read what the client still sends (bounded) so a reset does not eat the answer
LINGER_BYTES = 4 * 1024 * 1024
_CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")
# Status -> (code, message) for errors the edge answers itself.
EDGE_ERRORS = {
    400: ("bad_request", "the edge could not parse this HTTP request"),
    413: ("payload_too_large", f"request body is larger than the edge accepts ({MAX_REQUEST_BODY} bytes)"),
    414: ("uri_too_long", f"the URL is longer than the edge accepts ({MAX_URL_BYTES} bytes)"),
    431: ("request_header_fields_too_large",
          f"request headers are larger than the edge accepts ({MAX_HEADERS_BYTES} bytes in all, {MAX_HEADER_BYTES} in one)"),
    501: ("method_not_implemented", f"the edge forwards only {', '.join(METHODS)}"),
    505: ("http_version_not_supported", "the edge speaks HTTP/1.0 and HTTP/1.1 here"),
}


class BadRequest(SandboxError):
    """A request the edge refuses; ``status`` and the message go to the client."""

    def __init__(self, status: int, message: str | None = None, code: str | None = None):
        default_code, default_message = EDGE_ERRORS.get(status, ("bad_request", "bad request"))
        super().__init__(message or default_message)
        self.status = status
        self.code = code or default_code


def error_body(status: int, code: str, message: str) -> dict:
    """OpenAI's error shape, as the Worker answers (worker/src/errors.js)."""
    return {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "code": code}}


def ip_literal(host: str | None) -> bool:
    """True when a URL's host is an IPv4/IPv6 address rather than a name."""
    if not host:
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


@dataclass
class Network:
    """What the proxies need to know: the model, the sites, the pins, the targets."""

    geography: Geography
    sites: Sites
    pins: Pins
    targets: dict[str, str] = field(default_factory=dict)  # "127.0.0.1:8123" -> site
    workerd: tuple[str, int] | None = None  # the edge service's socket
    hops: int = 0
    pod_hops: list = field(default_factory=list)  # the PodHop relays, each registered while open
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # A deploy (``apply``) swaps workerd the way the platform swaps versions: new requests
    # wait at the edge while the old version finishes its in-flight ones, none is dropped.
    _gate: threading.Condition = field(default_factory=threading.Condition)
    _paused: bool = False
    _inflight: int = 0
    # Cloudflare holds no request during a deploy (a new version takes new ones at once), so each hold
    # is the sandbox's own: (start, end) on time.monotonic (one clock for every process of the machine)
    holds: list[tuple[float, float]] = field(default_factory=list)
    _held_since: float | None = None

    def count(self) -> None:
        with self._lock:
            self.hops += 1

    def enter(self, timeout_s: float = HOLD_S) -> tuple[str, int] | None:
        """Admit one front request; during a swap, wait (bounded) for the new version."""
        with self._gate:
            if not self._gate.wait_for(lambda: not self._paused and self.workerd is not None, timeout_s):
                return None
            self._inflight += 1
            return self.workerd

    def leave(self) -> None:
        with self._gate:
            self._inflight -= 1
            self._gate.notify_all()

    def pause(self, drain_s: float = HOLD_S) -> bool:
        """Hold new front requests and wait until the in-flight ones are done."""
        with self._gate:
            self._paused = True
            if self._held_since is None:
                self._held_since = time.monotonic()
            return self._gate.wait_for(lambda: self._inflight == 0, drain_s)

    def resume(self, workerd: tuple[str, int], sites: Sites | None = None, targets: dict[str, str] | None = None) -> None:
        with self._gate:
            if sites is not None:
                self.sites = sites
            self.targets.update(targets or {})
            self.workerd = workerd
            self._paused = False
            if self._held_since is not None:
                self.holds.append((self._held_since, time.monotonic()))
                self._held_since = None
            self._gate.notify_all()


def local_url(url: str) -> str:
    """A loopback URL by name (``localhost``), as the sandbox's Worker must fetch it: the
    outbound proxy refuses IP literals the way Cloudflare does (error 1003)."""
    scheme, rest = url.split("://", 1)
    hostport, sep, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    if host in ("127.0.0.1", "[::1]"):
        hostport = f"localhost:{port}"
    return f"{scheme}://{hostport}{sep}{path}"


def sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000.0)


WATCH_POLL_S = 0.1  # how often a relay looks at its client's connection while the exchange runs


class ClientWatch:
    """While a relay's exchange runs, its client's connection is watched: a client that closes
    it (EOF) or resets it has left, and the upstream connection is reset (SO_LINGER 0: an RST,
    not a FIN), which workerd takes as the request's cancellation. Bytes from the client (a
    pipelined next request) end the watch: it is still there. ``gone`` tells the relay not to
    answer anyone."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client = client
        self.upstream = upstream
        self.gone = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="client-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self.client], [], [], WATCH_POLL_S)
                if not readable:
                    continue
                left = self.client.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                left = True
            if not left:
                return
            if self._done.is_set():
                return
            self.gone = True
            reset(self.upstream)
            return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


def reset(sock: socket.socket) -> None:
    """End a connection with an RST once it is closed, and wake whatever reads it now."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)  # a blocked recv returns at once; nothing is sent yet


class Relay(BaseHTTPRequestHandler):
    """Shared request reading and streaming response relay."""

    protocol_version = "HTTP/1.1"
    server_version = "colocate-sandbox"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: no 40 ms delayed-ACK stalls
    timeout = CLIENT_TIMEOUT_S
    network: Network  # set on the server
    upstream_name = "upstream"  # how an unreachable upstream is named to the client

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # no request log: URLs may carry generation names only, but keep the noise out

    # ---- reading the request ---------------------------------------------
    def _content_length(self) -> int | None:
        values = self.headers.get_all("Content-Length") or []
        if not values:
            return None
        parts = {p.strip() for v in values for p in v.split(",")}
        if len(parts) != 1 or not _CONTENT_LENGTH.fullmatch(next(iter(parts))):
            raise BadRequest(400, "Content-Length must be one whole number of bytes", "invalid_content_length")
        return int(next(iter(parts)))

    def _framing(self) -> tuple[str, int]:
        """How the body is framed, checked before any of it is read: ("none", 0), ("length", N)
        or ("chunked", 0); raises BadRequest for a framing refused, or a length over the limit."""
        codings = [c.strip().lower() for v in self.headers.get_all("Transfer-Encoding") or [] for c in v.split(",")]
        codings = [c for c in codings if c]
        length = self._content_length()
        if codings:
            if codings != ["chunked"]:
                raise BadRequest(501, "only Transfer-Encoding: chunked is supported", "unsupported_transfer_encoding")
            if length is not None:  # both framings at once: the classic smuggling shape (RFC 9112 section 6.1)
                raise BadRequest(400, "a request cannot carry both Content-Length and Transfer-Encoding",
                                 "invalid_content_length")
            return "chunked", 0
        if length is None or length == 0:
            return "none", 0
        if length > MAX_REQUEST_BODY:
            raise BadRequest(413)
        return "length", length

    def _body_pieces(self, framing: tuple[str, int]):
        """The body as it arrives, piece by piece; raises BadRequest for a malformed chunk or a
        chunked body over the limit, or a CLIENT_LEFT error when the client goes away mid-body."""
        kind, length = framing
        if kind == "length":
            left = length
            while left:
                data = self.rfile.read1(min(left, 65536))
                if not data:
                    raise ConnectionAbortedError("client closed mid-body")
                left -= len(data)
                yield data
            return
        if kind != "chunked":
            return
        total = 0
        while True:
            line = self.rfile.readline(1024)
            if not line:
                raise ConnectionAbortedError("client closed mid-body")
            size_text = line.split(b";", 1)[0].strip()
            if not _CHUNK_SIZE.fullmatch(size_text):
                raise BadRequest(400, "malformed chunk size in a chunked body", "invalid_chunked_body")
            size = int(size_text, 16)
            if size == 0:
                for _ in range(100):  # trailers, bounded
                    if self.rfile.readline(MAX_HEADER_BYTES) in (b"\r\n", b"\n", b""):
                        break
                return
            total += size
            if total > MAX_REQUEST_BODY:
                raise BadRequest(413)
            data = self.rfile.read(size)
            if len(data) < size:
                raise ConnectionAbortedError("client closed mid-body")
            yield data
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise BadRequest(400, "malformed chunk in a chunked body", "invalid_chunked_body")

    def _read_body(self) -> bytes | None:
        """The whole body (None when there is none); raises as _framing and _body_pieces do."""
        framing = self._framing()
        if framing[0] == "none":
            return None
        return b"".join(self._body_pieces(framing))

    def _body_or_error(self) -> bytes | None | bool:
        """The request body, or False after answering an error for it."""
        try:
            return self._read_body()
        except BadRequest as exc:
            self._refuse(exc)
            return False

    # ---- answering -------------------------------------------------------
    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _refuse(self, exc: BadRequest) -> None:
        """Answer an error the request earned, then close the connection the way a server
        that may not have read the whole request must: after a bounded read of what is left."""
        if self.request_version in ("", "HTTP/0.9"):
            self.request_version = "HTTP/1.1"  # never answer without a status line
        self.close_connection = True
        self._json(exc.status, error_body(exc.status, exc.code, str(exc)), {"connection": "close"})
        self.wfile.flush()
        self._linger()

    def _linger(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            deadline, got = time.monotonic() + LINGER_S, 0
            while time.monotonic() < deadline and got < LINGER_BYTES:
                data = self.connection.recv(65536)
                if not data:
                    break
                got += len(data)
        except OSError:
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's errors (bad request line, header too long, unknown method), as JSON."""
        self._refuse(BadRequest(int(code)))

    def _relay(self, host: str, port: int, path: str, headers: list[tuple[str, str]], body: bytes | None,
               before_ms: float, after_ms: float, extra_response: dict[str, str] | None = None,
               framing: tuple[str, int] | None = None) -> None:
        """Forward to host:port after ``before_ms``; start the response ``after_ms`` after it arrives.

        The body is sent while the response is read: an upstream may answer before it has read
        the whole body (the Worker's 413 for a body over its limit) and close; that answer is
        relayed, not turned into a broken pipe. With ``framing`` (_framing's), the body is not
        in ``body`` but read from the client as it arrives and sent on at once, as Cloudflare's
        edge streams a request body to the Worker: a client that leaves mid-body resets the
        upstream connection, a malformed chunk is answered 400 here."""
        sleep_ms(before_ms)
        sender = sock = resp = None
        watch: list[ClientWatch] = []  # started once the whole request is read (a streamed body: by its sender)
        failed: list[BaseException] = []  # the streamed body's own failure: BadRequest, or the client gone
        try:
            try:
                sock = socket.create_connection((host, port), timeout=UPSTREAM_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                head = [f"{self.command} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers]
                if framing is not None and framing[0] == "chunked":
                    head.append("transfer-encoding: chunked")
                elif framing is not None and framing[0] == "length":
                    head.append(f"content-length: {framing[1]}")
                elif body is not None:
                    head.append(f"content-length: {len(body)}")
                head.append("connection: close")
                raw_head = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
                if framing is not None and framing[0] != "none":
                    sock.sendall(raw_head)
                    sender = threading.Thread(target=self._send_body, args=(sock, framing, watch, failed), daemon=True)
                    sender.start()
                elif body is None or len(body) <= 65536:
                    sock.sendall(raw_head + (body or b""))
                    watch.append(ClientWatch(self.connection, sock))
                else:
                    watch.append(ClientWatch(self.connection, sock))
                    sender = threading.Thread(target=_send_quietly, args=(sock, raw_head + body), daemon=True)
                    sender.start()
                resp = http.client.HTTPResponse(sock, method=self.command)
                resp.begin()
            except (OSError, http.client.HTTPException, UnicodeError) as exc:
                if sender is not None:
                    sender.join(timeout=5)  # its failure, if it reset the connection, is known then
                if failed and isinstance(failed[0], BadRequest):
                    self._refuse(failed[0])
                    return
                if failed or (watch and watch[0].gone):  # the client left: nobody to answer
                    self.close_connection = True
                    return
                self._upstream_failed(host, port, exc)
                return
            sleep_ms(after_ms)
            self.send_response_only(resp.status, resp.reason)  # upstream's own Date/Server are relayed
            length = resp.getheader("content-length")
            for k, v in resp.getheaders():
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            for k, v in (extra_response or {}).items():
                self.send_header(k, v)
            no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
            chunked = not no_body and length is None
            if no_body:
                self.send_header("content-length", length or "0")
            elif chunked:
                self.send_header("transfer-encoding", "chunked")
            else:
                self.send_header("content-length", length)
            self.end_headers()
            self.wfile.flush()
            if no_body:
                return
            while True:
                try:
                    data = resp.read1(65536)
                except (OSError, http.client.HTTPException, ValueError):
                    # The upstream's answer broke off (or was reset for a client that left): the
                    # client's answer ends unfinished, as the platform ends it.
                    self.close_connection = True
                    return
                if not data:
                    if failed or (watch and watch[0].gone):
                        self.close_connection = True
                        return
                    break
                if chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                else:
                    self.wfile.write(data)
                self.wfile.flush()  # stream: each piece goes out as it arrives
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except CLIENT_LEFT:
            self.close_connection = True
            if sock is not None:
                reset(sock)  # the client left mid-answer: the upstream is told as it would be on the platform
        finally:
            if sender is not None and framing is not None and sender.is_alive():
                # Answered before the client finished its body (the Worker's 413): this
                # connection cannot carry another request; closing it ends the sender's read.
                self.close_connection = True
            for w in watch:
                w.stop()
            if resp is not None:
                resp.close()  # the socket's file: the socket closes only once it is closed too
            if sock is not None:
                sock.close()
            if sender is not None and not (framing is not None and self.close_connection):
                sender.join(timeout=5)

    def _send_body(self, sock: socket.socket, framing: tuple[str, int], watch: list, failed: list) -> None:
        """Send the client's body upstream as it arrives (chunked bodies re-chunked as read),
        then watch the client; a malformed body or a client gone mid-body resets upstream."""
        chunked = framing[0] == "chunked"
        pieces = self._body_pieces(framing)
        while True:
            try:
                piece = next(pieces, None)
            except (BadRequest, OSError) as exc:  # the client's side: a bad body, or it left mid-body
                failed.append(exc)
                reset(sock)
                return
            except ValueError:
                # The upstream answered before the body was all read (the Worker's 413) and the
                # handler has closed the client's connection under this read: nothing left to send.
                return
            try:
                if piece is None:
                    if chunked:
                        sock.sendall(b"0\r\n\r\n")
                    break
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            except OSError:
                return  # the upstream answered (and closed) before taking the whole body: its answer is relayed
        watch.append(ClientWatch(self.connection, sock))

    def _upstream_failed(self, host: str, port: int, exc: BaseException) -> None:
        # Who did not answer and why goes to the log (runner.log); the client gets no address
        # and no exception text.
        print(f"[sandbox] {self.upstream_name} at {host}:{port} did not answer ({type(exc).__name__})",
              file=sys.stderr, flush=True)
        self.close_connection = True
        self._json(502, error_body(502, "upstream_unreachable", f"the {self.upstream_name} did not answer; retry shortly"),
                   {"connection": "close"})

    def _forward_headers(self, drop: set[str]) -> list[tuple[str, str]]:
        """The request's headers as sent, repeated ones included (the runtime joins them)."""
        out = []
        for k, v in self.headers.items():
            if k.lower() not in HOP_BY_HOP and k.lower() not in drop and k.lower() not in ("content-length", "host"):
                out.append((k, v))
        return out


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    # the upstream answered (and closed) before taking the whole body; its answer is relayed
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _origin_form(target: str) -> str:
    """The request target to forward, or BadRequest. Bytes the URL grammar does not allow
    raw are refused when they are controls (NUL, CR, LF, ...) and percent-encoded when they
    are above ASCII (the request line is read as Latin-1, one character per byte)."""
    if len(target) > MAX_URL_BYTES:
        raise BadRequest(414)
    if target.startswith(("http://", "https://")):  # absolute-form (RFC 9112 section 3.2.2)
        parts = urlsplit(target)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not target.startswith("/"):
        raise BadRequest(400, "the request target must be a path starting with /", "invalid_request_target")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in target):
        raise BadRequest(400, "the request target contains a control character or a space", "invalid_request_target")
    if any(ord(c) > 0x7F for c in target):
        target = "".join(c if ord(c) < 0x80 else f"%{ord(c):02X}" for c in target)
    return target


class FrontHandler(Relay):
    upstream_name = "Worker"

    def _check_request(self) -> str:
        """The path to forward, after the checks Cloudflare's edge makes before a Worker runs."""
        if self.request_version not in ("HTTP/1.0", "HTTP/1.1"):
            raise BadRequest(400, "the edge does not speak HTTP/0.9", "bad_request")
        total = 0
        for k, v in self.headers.items():
            size = len(k) + len(v) + 4
            if size > MAX_HEADER_BYTES:
                raise BadRequest(431, f"the {k[:64]} header is larger than the edge accepts ({MAX_HEADER_BYTES} bytes)")
            total += size
        if total > MAX_HEADERS_BYTES:
            raise BadRequest(431)
        return _origin_form(self.path)

    def _handle(self) -> None:
        net = self.network
        try:
            path = self._check_request()
            framing = self._framing()  # the body itself is streamed to the Worker as it arrives
        except BadRequest as exc:
            self._refuse(exc)
            return
        target = net.enter()
        if target is None:
            self._json(503, error_body(503, "sandbox_starting", "the Worker is not up yet; retry shortly"))
            return
        try:
            net.count()
            sites = net.sites
            half = net.geography.rtt_ms(sites.client, sites.edge) / 2
            ray = f"{secrets.token_hex(8)}-{sites.client}"
            placement = sites.placement
            headers = self._forward_headers({"cf-ray", "cf-placement", "cf-connecting-ip"})
            headers += [("cf-ray", ray), ("cf-placement", placement), ("cf-connecting-ip", self.client_address[0]),
                        ("host", self.headers.get("host", "localhost"))]
            host, port = target
            self._relay(host, port, path, headers, None, half, half, {"cf-ray": ray, "cf-placement": placement}, framing)
        finally:
            net.leave()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle  # noqa: N815


class _OutboundHandler(Relay):
    upstream_name = "target"

    def _upstream_failed(self, host: str, port: int, exc: BaseException) -> None:
        # The Worker (not a client) reads this: as a failed subrequest it names the target.
        self.close_connection = True
        self._json(502, error_body(502, "sandbox_upstream_unreachable",
                                   f"sandbox network: {host}:{port} did not answer ({type(exc).__name__})"),
                   {"connection": "close"})

    def _handle(self) -> None:
        net = self.network
        body = self._body_or_error()
        if body is False:
            return
        caller = (self.headers.get(SITE_HEADER) or "").upper()
        if not caller:  # the control service carries no site
            self._control()
            return
        # workerd sends host-style requests (origin-form path, target in Host); an
        # absolute-form request line (proxy style) is accepted too.
        url = urlsplit(self.path if not self.path.startswith("/") else f"http://{self.headers.get('host', '')}{self.path}")
        if url.path == "/cdn-cgi/trace" and url.hostname in ("www.cloudflare.com", "cloudflare.com"):
            self._trace(caller)
            return
        port = url.port or (443 if url.scheme == "https" else 80)
        if ip_literal(url.hostname):
            self._refuse_ip_literal()
            return
        key = f"{url.hostname}:{port}"
        target = net.targets.get(key)
        if target is None:
            self._json(502, error_body(502, "sandbox_no_route",
                                       f"sandbox network: no route to {key}; it reaches only "
                                       f"{', '.join(sorted(net.targets)) or 'nothing'} and /cdn-cgi/trace"))
            return
        net.count()
        half = net.geography.rtt_ms(caller, target) / 2
        path = url.path + (f"?{url.query}" if url.query else "")
        headers = self._forward_headers({SITE_HEADER}) + [("host", key)]
        self._relay(LOCAL_NAMES.get(url.hostname, url.hostname), port, path or "/", headers, body, half, half)

    def _refuse_ip_literal(self) -> None:
        self.send_response(IP_LITERAL_STATUS)
        self.send_header("content-type", "text/plain; charset=UTF-8")
        self.send_header("content-length", str(len(IP_LITERAL_BODY)))
        self.end_headers()
        self.wfile.write(IP_LITERAL_BODY)

    def _trace(self, caller: str) -> None:
        # The trace endpoint answers from the colo the caller runs in: no hop to pay for.
        lines = ["fl=sandbox", "h=www.cloudflare.com", "ip=127.0.0.1", f"ts={time.time():.3f}",
                 "visit_scheme=https", "uag=colocate-sandbox", f"colo={caller}", "sliver=none", "http=http/1.1",
                 "loc=XX", "tls=TLSv1.3", "sni=plaintext", "warp=off", "gateway=off", "rbi=off", "kex=none"]
        data = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _control(self) -> None:
        net = self.network
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/_sandbox/health":
            self._json(200, {"ok": True, "sites": net.sites.as_json(), "pins": net.pins.all(), "hops": net.hops,
                             "workerd": f"{net.workerd[0]}:{net.workerd[1]}" if net.workerd else None})
            return
        if url.path == "/_sandbox/pod-hop/cut" and self.command == "POST":
            hops = list(net.pod_hops)
            self._json(200, {"cut": sum(h.cut() for h in hops), "connections": {str(h.port): h.connections for h in hops}})
            return
        if url.path == "/_sandbox/pod-hop/connections":
            self._json(200, {"connections": {str(h.port): h.connections for h in list(net.pod_hops)}})
            return
        if url.path == "/_sandbox/pin":
            name, edge, hint = q.get("name", ""), q.get("edge", net.sites.edge), q.get("hint", "")
            try:
                where, created = net.pins.touch(name, edge, hint)
            except Exception as exc:  # noqa: BLE001 - reported to the wrapper, which throws it
                self._json(400, error_body(400, "sandbox_pin_failed", str(exc)))
                return
            self._json(200, {"name": name, "site": where, "created": created, "rtt_ms": net.geography.rtt_ms(edge, where)})
            return
        self._json(404, error_body(404, "not_found", f"no sandbox control route {url.path}"))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle  # noqa: N815


class RelayServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of 32 connections overflows it
    # and the dropped SYNs come back a second later (p99 ~1 s, resets).
    request_queue_size = 128

    @property
    def port(self) -> int:
        return self.server_address[1]

    def handle_error(self, request, client_address) -> None:
        # A client that leaves (reset, broken pipe, timeout) is not an error: no traceback,
        # no line. Anything else is a bug in the sandbox and keeps the stdlib's traceback.
        if isinstance(sys.exc_info()[1], CLIENT_LEFT):
            return
        super().handle_error(request, client_address)


def make_server(handler: type[Relay], network: Network, host: str, port: int) -> RelayServer:
    cls = type(handler.__name__, (handler,), {"network": network})
    return RelayServer((host, port), cls)


class NetworkServers:
    """Both servers, each on its own thread; ``close()`` stops them and frees the ports."""

    def __init__(self, network: Network, host: str = "127.0.0.1", front_port: int = 0, outbound_port: int = 0):
        self.network = network
        self.front = make_server(FrontHandler, network, host, front_port)
        self.outbound = make_server(_OutboundHandler, network, host, outbound_port)
        self._threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                                          name=f"sandbox-{n}") for n, s in (("front", self.front), ("outbound", self.outbound))]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        for s in (self.front, self.outbound):
            s.shutdown()
            s.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> NetworkServers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PodHop:
    """The Worker -> pod hop at the byte level: a TCP relay in front of one pod, on loopback.

    The pod hop is mutual TLS between workerd and the pod, so the sandbox cannot read it and
    does not need to: it delays the bytes. Each direction's bytes arrive RTT(edge, pod)/2 after
    they were sent (a reader stamps them, a writer sends them when due, so a stream keeps its
    pace), and a new connection's first bytes wait one more RTT, the TCP handshake's. A fresh
    connection therefore costs what it costs on the internet: TCP, then TLS (one more round trip
    in TLS 1.3), then the request; a pooled one only the request. ``cut()`` closes every open
    connection, so the next request pays for a new one (the demo's first-request figures).
    """

    def __init__(self, network: Network, pod_site: str, target: tuple[str, int], host: str = "127.0.0.1"):
        self.network = network
        self.pod_site = pod_site
        self.target = target
        self.listener = socket.create_server((host, 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = threading.Event()
        self.connections = 0  # accepted so far: how many handshakes the pod has seen through here
        self._thread = threading.Thread(target=self._accept, name=f"pod-hop-{self.port}", daemon=True)
        self._thread.start()
        network.pod_hops.append(self)

    def one_way_ms(self) -> float:
        return self.network.geography.rtt_ms(self.network.sites.edge, self.pod_site) / 2

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=UPSTREAM_TIMEOUT_S)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed.is_set():
                client.close()
                upstream.close()
                return
            self._open.update((client, upstream))
        one_way = self.one_way_ms() / 1000.0
        handshake = 2 * one_way  # SYN, SYN-ACK: paid once per connection, before its first byte
        pumps = [threading.Thread(target=self._pump, args=(client, upstream, one_way, handshake), daemon=True),
                 threading.Thread(target=self._pump, args=(upstream, client, one_way, 0.0), daemon=True)]
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay_s: float, first_extra_s: float) -> None:
        import queue

        q: queue.Queue = queue.Queue()

        def write() -> None:
            extra = first_extra_s
            while True:
                due, data = q.get()
                wait = due + extra - time.monotonic()
                extra = 0.0
                if wait > 0:
                    time.sleep(wait)
                try:
                    if data is None:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            q.put((time.monotonic() + delay_s, data or None))
            if not data:
                break
        writer.join()

    def cut(self) -> int:
        """Close every open connection through the hop; returns how many there were."""
        with self._lock:
            open_now = list(self._open)
            self._open.clear()
        for s in open_now:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return len(open_now) // 2

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(ValueError):
            self.network.pod_hops.remove(self)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        with contextlib.suppress(OSError):
            self.listener.close()
        self.cut()
        self._thread.join(timeout=5)
