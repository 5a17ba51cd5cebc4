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
                    returns ``{"site", "rtt_ms"}``; ``GET /_sandbox/health`` reports the network.

Both stream: bodies are relayed chunk by chunk as they arrive (SSE passes unbuffered).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

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
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # A deploy (``apply``) swaps workerd the way the platform swaps versions: new requests
    # wait at the edge while the old version finishes its in-flight ones, none is dropped.
    _gate: threading.Condition = field(default_factory=threading.Condition)
    _paused: bool = False
    _inflight: int = 0

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
            return self._gate.wait_for(lambda: self._inflight == 0, drain_s)

    def resume(self, workerd: tuple[str, int], sites: Sites | None = None, targets: dict[str, str] | None = None) -> None:
        with self._gate:
            if sites is not None:
                self.sites = sites
            self.targets.update(targets or {})
            self.workerd = workerd
            self._paused = False
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


def _sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000.0)


class _Relay(BaseHTTPRequestHandler):
    """Shared request reading and streaming response relay."""

    protocol_version = "HTTP/1.1"
    server_version = "colocate-sandbox"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: no 40 ms delayed-ACK stalls
    network: Network  # set on the server

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # no request log: URLs may carry generation names only, but keep the noise out

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            total = 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
                total += size
                if total > MAX_REQUEST_BODY:
                    raise ValueError("request body too large for the sandbox network")
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REQUEST_BODY:
            raise ValueError("request body too large for the sandbox network")
        return self.rfile.read(length) if length else None

    def _body_or_413(self) -> bytes | None | bool:
        """The request body, or False after answering 413 for one too large to relay."""
        try:
            return self._read_body()
        except ValueError as exc:
            self._json(413, {"error": {"code": "payload_too_large", "message": str(exc)}})
            return False

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _relay(self, host: str, port: int, path: str, headers: dict[str, str], body: bytes | None,
               before_ms: float, after_ms: float, extra_response: dict[str, str] | None = None) -> None:
        """Forward to host:port after ``before_ms``; start the response ``after_ms`` after it arrives."""
        _sleep_ms(before_ms)
        conn = http.client.HTTPConnection(host, port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            try:
                conn.request(self.command, path, body=body, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self._json(502, {"error": {"code": "sandbox_upstream_unreachable",
                                           "message": f"sandbox network: {host}:{port} did not answer ({type(exc).__name__})"}})
                return
            _sleep_ms(after_ms)
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
                data = resp.read1(65536)
                if not data:
                    break
                if chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                else:
                    self.wfile.write(data)
                self.wfile.flush()  # stream: each piece goes out as it arrives
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            conn.close()

    def _forward_headers(self, drop: set[str]) -> dict[str, str]:
        out = {}
        for k, v in self.headers.items():
            if k.lower() not in HOP_BY_HOP and k.lower() not in drop and k.lower() not in ("content-length", "host"):
                out[k] = v
        return out


class _FrontHandler(_Relay):
    def _handle(self) -> None:
        net = self.network
        body = self._body_or_413()
        if body is False:
            return
        target = net.enter()
        if target is None:
            self._json(503, {"error": {"code": "sandbox_starting", "message": "workerd is not up yet"}})
            return
        try:
            net.count()
            sites = net.sites
            half = net.geography.rtt_ms(sites.client, sites.edge) / 2
            ray = f"{secrets.token_hex(8)}-{sites.client}"
            placement = sites.placement
            headers = self._forward_headers({"cf-ray", "cf-placement", "cf-connecting-ip"})
            headers.update({"cf-ray": ray, "cf-placement": placement, "cf-connecting-ip": self.client_address[0],
                            "host": self.headers.get("host", "localhost")})
            host, port = target
            self._relay(host, port, self.path, headers, body, half, half, {"cf-ray": ray, "cf-placement": placement})
        finally:
            net.leave()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle  # noqa: N815


class _OutboundHandler(_Relay):
    def _handle(self) -> None:
        net = self.network
        body = self._body_or_413()
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
            self._json(502, {"error": {"code": "sandbox_no_route",
                                       "message": f"sandbox network: no route to {key}; it reaches only "
                                                  f"{', '.join(sorted(net.targets)) or 'nothing'} and /cdn-cgi/trace"}})
            return
        net.count()
        half = net.geography.rtt_ms(caller, target) / 2
        path = url.path + (f"?{url.query}" if url.query else "")
        headers = self._forward_headers({SITE_HEADER})
        headers["host"] = key
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
        if url.path == "/_sandbox/pin":
            name, edge, hint = q.get("name", ""), q.get("edge", net.sites.edge), q.get("hint", "")
            try:
                where, created = net.pins.touch(name, edge, hint)
            except Exception as exc:  # noqa: BLE001 - reported to the wrapper, which throws it
                self._json(400, {"error": {"code": "sandbox_pin_failed", "message": str(exc)}})
                return
            self._json(200, {"name": name, "site": where, "created": created, "rtt_ms": net.geography.rtt_ms(edge, where)})
            return
        self._json(404, {"error": {"code": "not_found", "message": f"no sandbox control route {url.path}"}})

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle  # noqa: N815


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of 32 connections overflows it
    # and the dropped SYNs come back a second later (p99 ~1 s, resets).
    request_queue_size = 128

    @property
    def port(self) -> int:
        return self.server_address[1]


def _server(handler: type[_Relay], network: Network, host: str, port: int) -> _Server:
    cls = type(handler.__name__, (handler,), {"network": network})
    return _Server((host, port), cls)


class NetworkServers:
    """Both servers, each on its own thread; ``close()`` stops them and frees the ports."""

    def __init__(self, network: Network, host: str = "127.0.0.1", front_port: int = 0, outbound_port: int = 0):
        self.network = network
        self.front = _server(_FrontHandler, network, host, front_port)
        self.outbound = _server(_OutboundHandler, network, host, outbound_port)
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
