"""A local HTTP server that plays a deployed colocate Worker, with known answers.

It serves the contract's surface (``GET /_colocate/probe`` with a bearer token, its ``pods``
list and, with ``?fallback=1``, the fallback check; the client-key endpoints
``POST /_colocate/keys``, ``GET /_colocate/keys``, ``POST /_colocate/keys/<id>/revoke`` behind the
probe token; ``POST /v1/chat/completions`` and ``GET /v1/models`` behind a client key, with
OpenAI-shaped 401s as the Worker answers) and injects what a test needs to know
the truth of: a sleep per request (``routed_delay_ms``, ``probe_delay_ms``), the
Server-Timing values of each response (cycled from lists), the colos each part reports,
the backend header, and misbehaviour on demand (missing or malformed Server-Timing,
every k-th routed request failing with a status, a models endpoint without models).

Bound to 127.0.0.1 port 0; ``serve(**behaviour)`` yields the server with ``.url``,
``.behaviour`` (mutable) and ``.log`` (one ``Seen`` per request). Sleeps wake at shutdown,
so nothing keeps running after the ``with`` block.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    token: str = "probe-secret"
    model: str = "fake-model"
    region: str | None = "apac-jp"
    worker_colo: str | None = "NRT"
    state_colo: str | None = "NRT"
    ray_colo: str | None = "NRT"  # suffix of the cf-ray response header; None: no header
    cf_placement: str | None = "remote-NRT"
    cf_placement_header: str | None = None  # the response's cf-placement header, as Cloudflare sets it
    placed_after: tuple[int, str] | None = None  # (k, colo): from the k-th probe request on, the Worker runs in colo
    pod_host: str = "pod-abc.example.com:8000"
    generation: str = "apac-jp.g1"
    draining_generation: str | None = None
    pod_ok: bool = True
    routed_delay_ms: float = 0.0
    probe_delay_ms: float = 0.0
    # cycled per request, in order
    state_rtt_ms: list[float] = field(default_factory=lambda: [3.0])
    pod_rtt_ms: list[float] = field(default_factory=lambda: [12.0])
    state: list[float] = field(default_factory=lambda: [0.0])
    upstream: list[float] = field(default_factory=lambda: [100.0])
    fallback: list[float] = field(default_factory=lambda: [0.0])
    total: list[float] = field(default_factory=lambda: [101.0])
    backend: list[str] = field(default_factory=lambda: ["pod-0"])
    routed_timing: str = "ok"  # "ok" | "missing" | "malformed"
    fail_every: int = 0  # every k-th routed request answers fail_status (0: never)
    fail_status: int = 503
    models: list[str] | None = None  # None: [model]
    unready_probes: int = 0  # the first k probe requests answer 404, as a route still propagating
    # client keys: routed paths need one of these (or one minted through /_colocate/keys) unless require_key is off
    require_key: bool = True
    client_keys: tuple[str, ...] = ("clc_given",)
    keys_endpoint: bool = True  # False: an older Worker without /_colocate/keys (404)
    # every pod after pod 0 reports pod_rtt + its offset; len() is the number of pods
    pod_offsets_ms: list[float] = field(default_factory=lambda: [0.0])
    pod_down: tuple[int, ...] = ()  # indexes of pods whose health check fails
    # a streamed chat request ("stream": true, counted apart from the routed ones): the first token after
    # stream_ttft_ms, then one every stream_gap_ms, stream_tokens in all; stream_status other than 200 refuses it
    stream_ttft_ms: float = 0.0
    stream_gap_ms: float = 0.0
    stream_tokens: int = 5
    stream_status: int = 200
    fallback_check: dict | None = field(default_factory=lambda: {
        "ok": True, "status": 200, "rtt_ms": 35.0, "model": "gpt-4o-mini", "model_listed": True, "error": None})


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    client_port: int
    authorization: str | None
    body: bytes


class FakeCell(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, behaviour: Behaviour):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviour = behaviour
        self.log: list[Seen] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._count = {"probe": 0, "routed": 0, "stream": 0}
        self.minted: dict[str, dict] = {}  # key id -> the record (plaintext under "key")

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def next_index(self, kind: str) -> int:
        with self._lock:
            i = self._count[kind]
            self._count[kind] += 1
            return i

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.log.append(seen)

    def mint(self, name: str, expires_in_s: object) -> dict:
        with self._lock:
            n = len(self.minted) + 1
            rec = {"id": f"key{n}", "key": f"clc_minted{n:04d}secret", "name": name, "prefix": f"clc_mint{n}",
                   "rpm": 0, "tpm": 0, "monthly_tokens": 0, "created_at": 1, "expires_in_s": expires_in_s,
                   "expires_at": None, "revoked_at": None}
            self.minted[rec["id"]] = rec
            return rec

    def key_ok(self, authorization: str | None) -> bool:
        b = self.behaviour
        if not b.require_key:
            return True
        key = (authorization or "").removeprefix("Bearer ").strip()
        with self._lock:
            live = {r["key"] for r in self.minted.values() if r["revoked_at"] is None}
        return bool(key) and (key in b.client_keys or key in live)

    def handle_error(self, request, client_address) -> None:  # a client that gave up: not a test failure
        pass


def _pick(values: list, i: int):
    return values[i % len(values)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the probe's connection reuse is observable
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall
    server: FakeCell

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, doc: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(doc).encode()
        b = self.server.behaviour
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if b.ray_colo:
            self.send_header("cf-ray", f"8c1f2e3d4a5b6c7d-{b.ray_colo}")
        if b.cf_placement_header:
            self.send_header("cf-placement", b.cf_placement_header)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _sleep(self, ms: float) -> None:
        if ms > 0:
            self.server.stopping.wait(ms / 1000)

    def _seen(self, body: bytes) -> None:
        self.server.record(Seen(self.command, self.path, self.client_address[1],
                                self.headers.get("Authorization"), body))

    def _admin_ok(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {self.server.behaviour.token}":
            self._send(401, {"error": {"code": "unauthorized", "message": "missing or wrong probe token"}})
            return False
        return True

    def _key_ok(self) -> bool:
        if not self.server.key_ok(self.headers.get("Authorization")):
            self._send(401, {"error": {"message": "a client key is required: Authorization: Bearer clc_...",
                                       "type": "invalid_request_error", "code": "invalid_api_key"}})
            return False
        return True

    def do_GET(self) -> None:
        self._seen(b"")
        b = self.server.behaviour
        path, _, query = self.path.partition("?")
        if path == "/_colocate/keys" and b.keys_endpoint:
            if self._admin_ok():
                with self.server._lock:
                    keys = [{k: v for k, v in r.items() if k != "key"} for r in self.server.minted.values()]
                self._send(200, {"keys": keys})
        elif path == "/_colocate/probe":
            if not self._admin_ok():
                return
            i = self.server.next_index("probe")
            if i < b.unready_probes:
                self._send(404, {"error": {"code": "not_found", "message": "no route yet"}})
                return
            self._sleep(b.probe_delay_ms)
            srtt, prtt = _pick(b.state_rtt_ms, i), _pick(b.pod_rtt_ms, i)
            ran = b.placed_after[1] if b.placed_after and i >= b.placed_after[0] else b.worker_colo
            doc = {
                "worker_colo": ran, "cf_placement": b.cf_placement, "ray_colo": b.ray_colo,
                "state_colo": b.state_colo, "state_rtt_ms": srtt, "pod_rtt_ms": prtt,
                "pod_ok": b.pod_ok, "pod_status": 200 if b.pod_ok else 503, "generation": b.generation,
                "hint": "apac", "draining_generation": b.draining_generation, "region": b.region,
                "pod_host": b.pod_host, "breaker": {"state": "closed", "forced": None},
                "pods": [{"index": k, "host": b.pod_host if k == 0 else f"pod-{k}.example.com:8000",
                          "rtt_ms": prtt + off, "ok": k not in b.pod_down, "status": 503 if k in b.pod_down else 200}
                         for k, off in enumerate(b.pod_offsets_ms)],
            }
            if "fallback=1" in query.split("&") and b.fallback_check is not None:
                doc["fallback"] = dict(b.fallback_check)
            timing = f"state_rtt;dur={srtt}, pod_rtt;dur={prtt}, total;dur={srtt + prtt + 1}"
            self._send(200, doc, {"Server-Timing": timing})
        elif path == "/v1/models":
            if not self._key_ok():
                return
            models = b.models if b.models is not None else [b.model]
            self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]},
                       {"x-colocate-backend": "pod-0"})
        else:
            self._send(404, {"error": {"code": "not_found", "message": self.path}})

    def do_POST(self) -> None:
        body = self._body()
        self._seen(body)
        b = self.server.behaviour
        if b.keys_endpoint and self.path == "/_colocate/keys":
            if self._admin_ok():
                req = json.loads(body or b"{}")
                self._send(201, self.server.mint(req.get("name"), req.get("expires_in_s")))
            return
        if b.keys_endpoint and self.path.startswith("/_colocate/keys/") and self.path.endswith("/revoke"):
            if self._admin_ok():
                rec = self.server.minted.get(self.path.split("/")[3])
                if rec is None:
                    self._send(404, {"error": {"code": "not_found", "message": "no such key"}})
                else:
                    rec["revoked_at"] = 2
                    self._send(200, {k: v for k, v in rec.items() if k != "key"})
            return
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"code": "not_found", "message": self.path}})
            return
        if not self._key_ok():
            return
        try:
            streamed = json.loads(body or b"{}").get("stream") is True
        except (ValueError, AttributeError):
            streamed = False
        if streamed:
            self._stream(b)
            return
        i = self.server.next_index("routed")
        self._sleep(b.routed_delay_ms)
        if b.fail_every and (i + 1) % b.fail_every == 0:
            self._send(b.fail_status, {"error": {"code": "upstream_failed", "message": "injected"}})
            return
        headers = {"x-colocate-backend": _pick(b.backend, i)}
        if b.routed_timing == "ok":
            headers["Server-Timing"] = ", ".join(
                f"{name};dur={_pick(getattr(b, name), i)}" for name in ("state", "upstream", "fallback", "total"))
        elif b.routed_timing == "malformed":
            headers["Server-Timing"] = f"state;dur=abc, upstream;dur={_pick(b.upstream, i)}, fallback, total;dur="
        self._send(200, {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": b.model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "p"},
                                      "finish_reason": "length"}]}, headers)


    def _stream(self, b: Behaviour) -> None:
        i = self.server.next_index("stream")
        if b.stream_status != 200:
            self._send(b.stream_status, {"error": {"code": "upstream_failed", "message": "injected"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("x-colocate-backend", _pick(b.backend, i))
        self.send_header("Transfer-Encoding", "chunked")  # the connection stays open for the next request
        self.end_headers()

        def send(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        self._sleep(b.stream_ttft_ms)
        for k in range(b.stream_tokens):
            if k:
                self._sleep(b.stream_gap_ms)
            chunk = {"id": f"chatcmpl-s{i}", "object": "chat.completion.chunk", "model": b.model,
                     "choices": [{"index": 0, "delta": {"content": f" t{k}"}, "finish_reason": None}]}
            send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        send(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@contextmanager
def serve(**behaviour) -> Iterator[FakeCell]:
    server = FakeCell(Behaviour(**behaviour))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def closed_port() -> int:
    """A port nothing listens on (bound, then released): connecting to it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


