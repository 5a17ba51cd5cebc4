"""A local stand-in for the GPU pod: an OpenAI-compatible inference server that only pretends.

It answers what the router forwards to a real vLLM pod, with the same auth rule
(``Authorization: Bearer <POD_TOKEN>`` on ``/v1/*``, ``/health`` open, like vLLM's
``--api-key``). How long an answer takes depends on the profile (``colocate.pods.profiles``):
``oracle`` (the default) spends ``compute_ms`` (95 ms) per request whatever its length or load; a GPU
profile (``rtx4090-qwen2.5-7b-int4``, ...) runs every request through one engine modelled on vLLM's
scheduler (``colocate.pods.engine``), stepped in real time by a thread of its own (``EngineRunner``):
a stream sends each token when its step ends, a JSON answer goes out at its last token, and
``GET /metrics`` reports the engine under vLLM's names (docs/pods.md, "The local stand-in").

What it writes is what vLLM 0.32 writes (``colocate.pods.shapes``, ``colocate.pods.vllm_metrics``):
answers, stream events, errors, ``/v1/models`` and ``/metrics``, key for key, differing only in timing
and in the generated text; tests/engine_contract checks the same against a live vLLM.

Routes:
    GET  /health                 200, no body, as vLLM answers (no auth)
    GET  /v1/models              the one model
    POST /v1/chat/completions    JSON, or SSE with "stream": true (one event per token, then [DONE])
    POST /v1/completions         JSON, or SSE with "stream": true
    POST /_standin/fault         {"mode": "ok"|"error"|"hang"|"slow", "delay_ms": N}, {"mode": "slow_tokens",
                                 "factor": F} (every step, so every token, F times slower), or
                                 {"mode": "hostile", "attack": A} (loopback clients only; below)
    GET  /_standin/stats         {"requests": N, "streams": {"completed": N, "cut": N}, "redirected": N,
                                 "fault": {...}} (loopback clients only; a cut stream lost its client
                                 before [DONE]; ``redirected``: requests that followed the redirect attack)

Inference routes refuse what vLLM refuses, in its order and with its bodies (``validate``), and
take what pydantic's lax mode takes (``stream: "yes"``, ``temperature: "0.5"``); a missing
``model`` means the served one; a body nested past Python's recursion limit is vLLM's bare 500.
Another model name is vLLM's 404, as a real pod answers, from the CLI (the sandbox's pods);
``--any-model`` serves any name, as the sandbox's fallback does (``fallbackModel: passthrough``:
an API that serves many models). In-process, ``serve()`` defaults to any name
(``any_model=True``), for router tests that name models freely.

Routes vLLM answers without its key, mirrored so that tests can show who reaches them:
``POST /invocations`` (a completion, like SageMaker's route in vLLM), ``POST /tokenize``,
``/detokenize``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``, ``GET /metrics``, ``/docs``.

Mutual TLS (``COLOCATE_POD_TLS`` in the environment, as on a real pod; ``colocate.pods.podtls``):
the port serves TLS and refuses a caller without a client certificate of the cell's CA, with one
line on stderr per refused handshake (``standin: refused a TLS handshake from ...: <reason>``).
``/_standin/*`` then moves to a second, plain port on loopback (``control_url``), so the sandbox
and the tests can still inject faults: the pod's own port answers those routes only through TLS.

Faults apply to every route except ``/_standin/*``: ``error`` answers 500, ``hang``
holds the request for ``delay_ms`` (or until shutdown when 0) then drops the connection,
``slow`` adds ``delay_ms`` before answering.

``hostile`` is a pod that lies to the router, on the inference routes, with one ``attack``:
``usage_inflated`` reports 10^300 prompt and completion tokens; ``usage_hidden`` answers a
non-streamed request with vLLM's ``prompt_logprobs`` after ``usage``, a prompt token decoding
to ``"usage"`` last; ``headers`` adds ``Set-Cookie`` and ``Access-Control-Allow-Origin: *``;
``redirect`` answers 307 to ``/_standin/redirected`` (which counts who follows it);
``oversized`` sends a JSON answer of OVERSIZED_BYTES (64 MiB, chunked, stopping when the client
leaves), or to a streamed request an event stream of that size at about 3 MB/s (a pod that streams
on and on: 64 KiB every 20 ms; a stream the client leaves counts as ``cut``). ``{"mode": "ok"}`` ends it.

CLI: ``python -m colocate.pods.standin --host 127.0.0.1 --port 0 [--profile NAME] [--seed N]
--compute-ms 95 --model NAME [--any-model] [--port-file PATH]`` prints one JSON line
``{"url": ..., "port": ...}`` once listening and stops cleanly on SIGTERM/SIGINT. In-process:
``with serve(compute_ms=5, token="t", profile="oracle") as pod: pod.url``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import os
import queue
import select
import signal
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .. import engine as eng, podtls, profiles, shapes, vllm_metrics
from ..errors import ClientGone
from ..guard import colocate_pod_guard
from .answers import WORDS_ORACLE, Choice, answer_pieces, cut_at_stop, prompt_token_ids, reply_tokens
from .refusals import Refused, prompt_list, pydantic_error, validate
from .runner import EngineRunner, Ticket

DEFAULT_COMPUTE_MS = 95.0
DEFAULT_MODEL = "standin/qwen2.5-7b-instruct-gptq-int4"
FAULT_MODES = ("ok", "error", "hang", "slow", "slow_tokens", "hostile")
ATTACKS = ("usage_inflated", "usage_hidden", "headers", "redirect", "oversized")
OVERSIZED_BYTES = 64 * 1024 * 1024  # four times the router's cap on an answer (forward.js MAX_ANSWER_BYTES)
INFLATED = 10**300
MAX_BODY = 8 * 1024 * 1024
_HANG_CAP_S = 300.0  # a hang with no delay lasts until shutdown, but never longer than this


# Routes vLLM serves without checking --api-key (its security guide), each with what it answers.
OPEN_ROUTES = {"/invocations": "POST", "/tokenize": "POST", "/detokenize": "POST", "/pooling": "POST",
               "/classify": "POST", "/score": "POST", "/rerank": "POST", "/metrics": "GET", "/docs": "GET"}
HANDSHAKE_TIMEOUT_S = 10.0


class StandinServer(ThreadingHTTPServer):
    """The HTTP server plus the stand-in's state (fault, request count)."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of 32 connections overflows it
    # and the dropped SYNs come back a second later (p99 ~1 s, resets).
    request_queue_size = 128

    def __init__(self, host: str, port: int, *, compute_ms: float, token: str | None, model: str, name: str = "standin",
                 any_model: bool = True, tls: ssl.SSLContext | None = None, log=None,
                 profile: str | profiles.Profile = "oracle", seed: int | None = None):
        self.profile = profile if isinstance(profile, profiles.Profile) else profiles.get(profile)
        # The oracle answers in compute_ms in each handler; a real profile runs one engine for all.
        self.engine = None if self.profile.oracle_ms is not None else EngineRunner(self.profile, seed)
        self.tls = tls
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.control: _ControlServer | None = None
        self.compute_ms = float(compute_ms)
        self.token = token or None
        self.model = model
        self.any_model = any_model  # False: another model name is vLLM's 404, as a real pod answers
        self.name = name
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._fault: dict = {"mode": "ok", "delay_ms": 0}
        self._redirected = 0
        self._requests = 0
        self.seen_headers: list[dict[str, str]] = []  # the last 16 inference requests' headers (in-process tests)
        self.seen_paths: list[str] = []  # and their request targets, query included
        self.seen_bodies: list[dict] = []  # and the last 16 bodies that parsed
        self._streams = {"completed": 0, "cut": 0}
        self._counts: dict = {"vllm:prompt_tokens": 0, "vllm:generation_tokens": 0,
                              "vllm:prompt_tokens_by_source": {"local_compute": 0}}
        self._finished: dict[str, int] = {}
        self.started_at = time.time()
        super().__init__((host, port), _Handler)
        if tls is not None:
            self.control = _ControlServer(self)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def process_request_thread(self, request, client_address) -> None:
        # The handshake runs on the connection's own thread: a stranger who stalls it holds no one else up.
        if self.tls is not None:
            try:
                request.settimeout(HANDSHAKE_TIMEOUT_S)
                request = self.tls.wrap_socket(request, server_side=True)
                request.settimeout(None)
            except (ssl.SSLError, OSError) as exc:
                reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or type(exc).__name__
                self.log(f"standin: refused a TLS handshake from {client_address[0]}:{client_address[1]}: {reason}")
                with contextlib.suppress(OSError):
                    request.close()
                return
        super().process_request_thread(request, client_address)

    def handle_error(self, request, client_address) -> None:
        # A client (the router) that leaves is not an error: no traceback in pod.log.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host = str(self.server_address[0])
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def control_url(self) -> str:
        """Where ``/_standin/*`` answers: a plain loopback port under TLS, else the pod's own."""
        return self.control.url if self.control else self.url

    @property
    def requests(self) -> int:
        """How many ``/v1/*`` requests arrived (health checks and ``/_standin`` calls are not counted)."""
        with self._lock:
            return self._requests

    def metrics(self) -> str:
        """``GET /metrics``: vLLM's families (vllm_metrics), with the engine's gauges, counters and
        histograms and the server's own counts of tokens and finished requests (the oracle has no engine)."""
        with self._lock:
            values: dict = {"vllm:engine_sleep_state": {"awake": 1.0}, **self._counts,
                            "vllm:request_success": dict(self._finished)}
        if self.engine is not None:
            values.update(self.engine.metrics())
        return vllm_metrics.exposition(self.model, values, self.started_at)

    def count_answer(self, prompt_tokens: int, choices: list) -> None:
        """An answer sent whole or streamed to its end: its tokens and each choice's finish reason."""
        with self._lock:
            self._counts["vllm:prompt_tokens"] += prompt_tokens
            self._counts["vllm:prompt_tokens_by_source"]["local_compute"] += prompt_tokens
            self._counts["vllm:generation_tokens"] += sum(len(c.pieces) for c in choices)
            for c in choices:
                self._finished[c.finish] = self._finished.get(c.finish, 0) + 1

    def count_request(self, headers=None, path: str | None = None) -> None:
        with self._lock:
            self._requests += 1
            if headers is not None:
                self.seen_headers = [*self.seen_headers[-15:], {k.lower(): v for k, v in headers.items()}]
            if path is not None:
                self.seen_paths = [*self.seen_paths[-15:], path]

    @property
    def streams(self) -> dict:
        """SSE answers sent to the end (``completed``) and those whose client went away
        first (``cut``): a router that stops reading must not leave the pod generating."""
        with self._lock:
            return dict(self._streams)

    @property
    def redirected(self) -> int:
        """Requests that arrived at the redirect attack's target: a router must send none."""
        with self._lock:
            return self._redirected

    def count_redirected(self) -> None:
        with self._lock:
            self._redirected += 1

    def count_stream(self, outcome: str) -> None:
        with self._lock:
            self._streams[outcome] += 1

    @property
    def fault(self) -> dict:
        with self._lock:
            return dict(self._fault)

    def set_fault(self, mode: str, delay_ms: float = 0, attack: str | None = None, factor: float | None = None) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"fault mode {mode!r} is not one of {', '.join(FAULT_MODES)}")
        if (mode == "slow_tokens") != (factor is not None):
            raise ValueError(f"factor {factor!r}: mode slow_tokens takes a factor >= 1 (the token rate is divided by it), "
                             "other modes none")
        if factor is not None and not (isinstance(factor, (int, float)) and 1 <= factor <= 1000):
            raise ValueError(f"factor must be a number from 1 to 1000 (got {factor!r})")
        delay = float(delay_ms)
        if delay < 0:
            raise ValueError(f"delay_ms must be >= 0 (got {delay_ms!r})")
        if (mode == "hostile") != (attack is not None) or (attack is not None and attack not in ATTACKS):
            raise ValueError(f"attack {attack!r}: mode hostile takes one of {', '.join(ATTACKS)}, other modes none")
        with self._lock:
            self._fault = {"mode": mode, "delay_ms": delay, **({"attack": attack} if attack else {}),
                           **({"factor": float(factor)} if factor is not None else {})}
        if self.engine is not None:
            self.engine.factor = float(factor) if factor is not None else 1.0

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        if self.engine is not None:
            self.engine.start(self.stopping)
        if self.control is not None:
            threading.Thread(target=self.control.serve_forever, kwargs={"poll_interval": poll_interval},
                             name=f"standin-control-{self.control.port}", daemon=True).start()
        super().serve_forever(poll_interval)

    def stop(self) -> None:
        """Wake any hanging request, stop serving and close the socket."""
        self.stopping.set()
        if self.engine is not None:
            self.engine.wake()
        self.shutdown()
        self.server_close()
        if self.control is not None:
            self.control.shutdown()
            self.control.server_close()


class _ControlServer(ThreadingHTTPServer):
    """``/_standin/*`` on plain loopback HTTP, beside a TLS pod port; the pod's state is shared."""

    daemon_threads = True

    def __init__(self, pod: StandinServer):
        self.pod = pod
        super().__init__(("127.0.0.1", 0), _ControlHandler)

    def __getattr__(self, name: str):
        return getattr(self.pod, name)  # fault, stats, counters: the pod's own

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True  # headers and body go out in separate writes: avoid 40 ms delayed-ACK stalls
    protocol_version = "HTTP/1.1"
    server: StandinServer
    server_version = "colocate-standin/1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: tests and the sandbox read stdout/stderr for their own lines

    def parse_request(self) -> bool:
        # Under TLS each caller gets what its certificate's CA opens (podtls.allows: readiness's, /health only).
        if not super().parse_request():
            return False
        if isinstance(self.connection, ssl.SSLSocket) and not podtls.allows(
                self.connection.getpeercert(), self.command, self.path):
            self.close_connection = True  # the refused request's body is never read
            self._error(403, f"this client certificate does not open {self.path.split('?', 1)[0]}: "
                        "the readiness certificate gets GET /health only", "forbidden")
            return False
        # The pod's guard, as a real pod runs it in front of vLLM (podstart.sh's --middleware): with a
        # token, only the router's routes with it (or the readiness token for /health). Not the
        # stand-in's own controls, which vLLM does not have.
        if self.server.token is not None and not self.path.startswith("/_standin/"):
            refusal = colocate_pod_guard.decide(self.command, self.path, self.headers.get("Authorization"),
                                                self.server.token)
            if refusal is not None:
                self.close_connection = True  # the refused request's body is never read
                self._send_json(*refusal)
                return False
        return True

    # ---- plumbing -------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()  # as vLLM (Starlette) spells JSON
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-standin", self.server.name)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-standin", self.server.name)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str, type_: str = "invalid_request_error", headers=None) -> None:
        self._send_json(status, {"error": {"message": message, "type": type_, "code": code}}, headers)

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            total = 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                total += size
                if total > MAX_BODY:
                    return None
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return None
        return self.rfile.read(length) if length else b""

    def _loopback_client(self) -> bool:
        try:
            return ipaddress.ip_address(self.client_address[0]).is_loopback
        except ValueError:
            return False

    def _authorised(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    def _apply_fault(self) -> bool:
        """Returns False when the fault already answered (or dropped) the request."""
        fault = self.server.fault
        mode, delay_s = fault["mode"], fault["delay_ms"] / 1000.0
        if mode == "error":
            self._error(500, "stand-in fault injection: error", "standin_fault", "server_error")
            return False
        if mode == "hang":
            self.server.stopping.wait(delay_s if delay_s > 0 else _HANG_CAP_S)
            self.close_connection = True
            return False
        if mode == "slow" and delay_s > 0:
            self.server.stopping.wait(delay_s)
        return True

    def _compute(self, fraction: float = 1.0) -> None:
        if self.server.compute_ms > 0:
            factor = self.server.fault.get("factor", 1.0)  # slow_tokens: the oracle's tokens come F times slower
            self.server.stopping.wait(self.server.compute_ms * fraction * factor / 1000.0)

    # ---- routes ---------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        path = self.path.split("?", 1)[0]
        if path == "/_standin/stats":
            if not self._loopback_client():
                return self._error(403, "stand-in controls are local only", "forbidden")
            return self._send_json(200, {"requests": self.server.requests, "streams": self.server.streams,
                                         "redirected": self.server.redirected, "fault": self.server.fault})
        if path == "/health":
            if self._apply_fault():
                self._send_text(200, "")  # vLLM's: 200, no body
            return
        if path == "/v1/models":
            self.server.count_request()
            if not self._authorised():
                return self._send_json(401, shapes.UNAUTHORIZED)
            if self._apply_fault():
                self._send_json(200, shapes.models(self.server.model, self.server.profile.max_model_len, int(time.time()),
                                                   uuid.uuid4().hex[:16]))
            return
        if path == "/metrics":
            if self._apply_fault():
                self._send_text(200, self.server.metrics(), "text/plain; version=1.0.0; charset=utf-8")
            return
        if OPEN_ROUTES.get(path) == "GET":
            return self._open_route(path, b"")
        if path in ("/v1/chat/completions", "/v1/completions", "/_standin/fault"):
            return self._error(405, f"{path} takes POST", "method_not_allowed", headers={"Allow": "POST"})
        self._error(404, f"no route {path}", "not_found")

    def _open_route(self, path: str, raw: bytes) -> None:
        """What vLLM's unguarded routes give anyone who reaches the port: here, a model answer on each."""
        if not self._apply_fault():
            return
        self._compute()
        self._send_json(200, {"route": path, "model": self.server.model, "text": "".join(reply_tokens(0, False, 8)[0]),
                              "note": "vLLM answers this route without --api-key"})

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        raw = self._read_body()
        if raw is None:
            self.close_connection = True
            return self._error(413, f"body larger than {MAX_BODY} bytes", "body_too_large")
        if path == "/_standin/fault":
            return self._post_fault(raw)
        if OPEN_ROUTES.get(path) == "POST":
            return self._open_route(path, raw)
        if path == "/_standin/redirected":
            self.server.count_redirected()
            return self._send_json(200, {"followed": True})
        if path not in ("/v1/chat/completions", "/v1/completions"):
            if path in ("/health", "/v1/models"):
                return self._error(405, f"{path} takes GET", "method_not_allowed", headers={"Allow": "GET"})
            return self._error(404, f"no route {path}", "not_found")
        self.server.count_request(self.headers, self.path)
        if not self._authorised():
            return self._send_json(401, shapes.UNAUTHORIZED)
        chat = path == "/v1/chat/completions"
        try:
            try:
                parsed = json.loads(raw or b"null")
            except json.JSONDecodeError as exc:
                raise pydantic_error("json_invalid", f"body.{exc.pos}", "JSON decode error", {}, {"error": exc.msg}) from None
            except ValueError:  # not UTF-8
                raise pydantic_error("json_invalid", "body.0", "JSON decode error", {}, {"error": "Expecting value"}) from None
            runner = self.server.engine
            prompt_ids: list[list[int]] = []

            def count(prompt) -> int:
                prompt_ids.append(prompt_token_ids(prompt, chat))
                return len(prompt_ids[-1])

            body = validate(parsed, chat, None if self.server.any_model else self.server.model,
                            count if runner is not None else None, self.server.profile.max_model_len)
            self.server.seen_bodies = [*self.server.seen_bodies[-15:], parsed]
        except Refused as exc:
            return self._send_json(exc.status, exc.body())
        except RecursionError:
            # vLLM's server parses with json.loads too; a body nested deeper than Python's
            # recursion limit raises there, outside its JSON error handler: Starlette's bare 500.
            return self._send_text(500, "Internal Server Error")
        if not self._apply_fault():
            return
        attack = self.server.fault.get("attack")
        if attack == "redirect":
            return self._send_json(307, {"redirect": True}, {"Location": "/_standin/redirected"})
        if attack == "oversized":
            return self._oversized_stream(chat) if body.get("stream") else self._oversized()
        self._answer(runner, chat, body, prompt_ids, attack)

    def _answer(self, runner: EngineRunner | None, chat: bool, body: dict, prompt_ids: list[list[int]],
                attack: str | None) -> None:
        """The answer vLLM would write (colocate.pods.shapes), each token sent as the engine (or
        the oracle's clock) makes it: a stream event per token, or the JSON answer at the last."""
        model = body.get("model") or self.server.model
        choices = self._plan(runner, chat, body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        extra = {"Set-Cookie": "session=standin; Path=/", "Access-Control-Allow-Origin": "*"} if attack == "headers" else None
        tickets: list[Ticket] | None = None
        if runner is not None:
            # One sequence per choice, as vLLM runs n (and each prompt of a list) as sequences of their own.
            sink: queue.Queue = queue.Queue()
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            tickets = [runner.submit(prompt_ids[i // body["n"]], len(c.pieces), salt,
                                     eng.tokenize("".join(c.pieces))[:len(c.pieces)], sink=sink, choice=i)
                       for i, c in enumerate(choices)]
        timeline = self._engine_timeline(runner, tickets) if runner is not None and tickets is not None \
            else self._oracle_timeline(choices)
        if body.get("stream"):
            return self._send_stream(chat, rid, created, model, body, choices, timeline, attack, extra)
        try:
            for _made in timeline:
                pass
        except ClientGone:
            return
        texts = [c.prefix + "".join(c.pieces) for c in choices]
        out = [{"text": t, "finish": c.finish, "stop_reason": c.stop_reason, "logprobs": self._logprobs(chat, body, c.pieces, 0)}
               for t, c in zip(texts, choices, strict=True)]
        made = sum(len(c.pieces) for c in choices)
        fp = shapes.fingerprint(self.server.model, self.server.profile.max_model_len)
        build = shapes.chat_answer if chat else shapes.completion_answer
        answer = build(rid, created, model, out, sum(body["_prompt_tokens"]), made, fp)
        if attack == "usage_inflated":
            answer["usage"] = {**answer["usage"], "prompt_tokens": INFLATED, "completion_tokens": INFLATED,
                               "total_tokens": 2 * INFLATED}
        if attack == "usage_hidden":
            # vLLM writes prompt_logprobs after usage; here the last prompt token decodes to "usage".
            answer["prompt_logprobs"] = [None, {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "hi"}},
                                         {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "usage"}}]
        self._send_json(200, answer, extra)
        self.server.count_answer(sum(body["_prompt_tokens"]), choices)

    def _plan(self, runner: EngineRunner | None, chat: bool, body: dict) -> list[Choice]:
        """Each choice's tokens, finish reason and stop reason: per prompt, ``n`` of them (index prompt * n + j)."""
        fmt = body.get("response_format")
        guided = isinstance(fmt, dict) and fmt.get("type") != "text"
        min_tokens, ignore_eos = body.get("min_tokens") or 0, bool(body.get("ignore_eos"))
        prompts = prompt_list(body, chat)
        out = []
        for p, limit in zip(prompts, body["_limits"], strict=True):
            prefix = p if not chat and body.get("echo") and isinstance(p, str) else ""
            for _j in range(body["n"]):
                if runner is not None:
                    length, finish = runner.answer_length(limit, min_tokens, ignore_eos, room=limit)
                    pieces, finish = answer_pieces(length, finish, fmt, limit)
                elif guided:
                    pieces, finish = answer_pieces(len(WORDS_ORACLE), "stop", fmt, limit)
                else:
                    pieces, finish = reply_tokens(min_tokens, ignore_eos, limit)
                pieces, finish, stop_reason = cut_at_stop(pieces, finish, body.get("stop"), min_tokens)
                out.append(Choice(pieces, finish, stop_reason, prefix))
        return out

    def _oracle_timeline(self, choices: list[Choice]):
        """The oracle's clock: half of compute_ms to the first token, the rest spread over the others;
        yields (choice, token index) as each is made, the choices in turn, as one engine step makes them."""
        longest = max(len(c.pieces) for c in choices)
        self._compute(0.5)
        for k in range(longest):
            for i, c in enumerate(choices):
                if k < len(c.pieces):
                    yield i, k
            if k < longest - 1:
                self._compute(0.5 / max(1, longest - 1))

    def _engine_timeline(self, runner: EngineRunner, tickets: list[Ticket]):
        """(choice, token index) as the engine hands each out; ClientGone (every sequence aborted)
        if the server stops or the client leaves while it waits."""
        left = len(tickets)
        sink = tickets[0].tokens
        try:
            while left:
                try:
                    choice, index, finished = sink.get(timeout=0.5)
                except queue.Empty:
                    if self.server.stopping.is_set() or self._client_gone():  # while it waits in the queue or between tokens
                        raise ClientGone() from None
                    continue
                yield choice, index
                if finished:
                    left -= 1
        except BaseException:
            for t in tickets:
                runner.abort(t)  # vLLM aborts a request whose client left: its blocks are freed
            self.close_connection = True
            raise

    def _logprobs(self, chat: bool, body: dict, pieces: list[str], first: int, offset: int = 0) -> dict | None:
        if chat:
            return shapes.chat_logprobs(pieces, first, body.get("top_logprobs") or 0) if body.get("logprobs") else None
        return None if body.get("logprobs") is None else shapes.completion_logprobs(pieces, first, offset, body["logprobs"])

    def _send_stream(self, chat: bool, rid: str, created: int, model: str, body: dict, choices: list[Choice], timeline,
                     attack: str | None, extra: dict | None) -> None:
        """SSE as vLLM streams it (shapes.Stream): chat opens each choice with its role; one event per
        token; the finish on the last; the usage event when asked; [DONE]. Counted ``completed``, or
        ``cut`` when the client left first."""
        fp = shapes.fingerprint(self.server.model, self.server.profile.max_model_len)
        stream = shapes.Stream(chat, rid, created, model, body["_prompt_tokens"], body["n"], body.get("stream_options"), fp)
        offsets = [len(c.prefix) for c in choices]
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("x-standin", self.server.name)
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            opened = False
            for i, k in timeline:
                if not opened:
                    for e in stream.opening():
                        self._write_chunk(e)
                    opened = True
                c = choices[i]
                piece = c.pieces[k]
                last = k == len(c.pieces) - 1
                text = (c.prefix + piece) if k == 0 else piece
                lp = self._logprobs(chat, body, [piece], k, offsets[i])
                offsets[i] += len(piece)
                self._write_chunk(stream.token(i, text, c.finish if last else None, c.stop_reason if last else None, lp))
            closing = stream.closing()
            if attack == "usage_inflated" and stream.include_usage:
                head = json.loads(closing[0][len(b"data: "):])
                head["usage"] = {"prompt_tokens": INFLATED, "total_tokens": 2 * INFLATED, "completion_tokens": INFLATED}
                closing = [shapes.event(head), *closing[1:]]
            for e in closing:
                self._write_chunk(e)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            self.close_connection = True
            self.server.count_stream("cut")
            return
        self.server.count_stream("completed")
        self.server.count_answer(sum(body["_prompt_tokens"]), choices)

    def _client_gone(self) -> bool:
        """Whether the client closed its connection while its request waits: vLLM's API server
        listens for the disconnect and aborts the request (``with_cancellation``, a streaming
        response's disconnect listener), so a router that gave up at its deadline frees the queue.
        An HTTP/1.1 client sends nothing while it waits for its answer: on a TLS connection any
        byte is its close_notify; on a plain one, the end of the stream."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            if isinstance(self.connection, ssl.SSLSocket):
                return True
            return socket.socket.recv(self.connection, 1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _oversized(self) -> None:
        """A JSON answer of OVERSIZED_BYTES, chunked (no length to refuse it by), until the client leaves."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-standin", self.server.name)
        self.end_headers()
        piece = b'{"pad":"' + b"x" * (1024 * 1024 - 10) + b'",'
        try:
            for _ in range(OVERSIZED_BYTES // len(piece)):
                self._write_chunk(piece)
            self._write_chunk(b'"end":1}')
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _oversized_stream(self, chat: bool) -> None:
        """Content events of about 1 KiB, 64 KiB of them every 20 ms up to OVERSIZED_BYTES, until the client leaves."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        choice = {"index": 0, "delta": {"content": "x" * 1000}} if chat else {"index": 0, "text": "x" * 1000}
        event = f"data: {json.dumps({'object': 'chat.completion.chunk' if chat else 'text_completion', 'choices': [choice]})}\n\n"
        piece = event.encode() * 64
        try:
            for _ in range(OVERSIZED_BYTES // len(piece)):
                self._write_chunk(piece)
                time.sleep(0.02)
            self._write_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.server.count_stream("cut")
        else:
            self.server.count_stream("completed")
        self.close_connection = True

    def _post_fault(self, raw: bytes) -> None:
        if not self._loopback_client():
            return self._error(403, "stand-in controls are local only", "forbidden")
        try:
            body = json.loads(raw or b"{}")
            self.server.set_fault(body.get("mode", "ok"), body.get("delay_ms", 0) or 0, body.get("attack"), body.get("factor"))
        except (ValueError, TypeError, AttributeError) as exc:
            return self._error(400, f"bad fault request: {exc}", "invalid_fault")
        self._send_json(200, {"fault": self.server.fault})

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class _ControlHandler(_Handler):
    """The control port: ``/_standin/*`` only."""

    def do_GET(self) -> None:  # noqa: N802
        if not self.path.startswith("/_standin/"):
            return self._error(404, "the control port serves /_standin/* only", "not_found")
        super().do_GET()

    def do_POST(self) -> None:  # noqa: N802
        if not self.path.startswith("/_standin/"):
            return self._error(404, "the control port serves /_standin/* only", "not_found")
        super().do_POST()


@contextlib.contextmanager
def serve(compute_ms: float = DEFAULT_COMPUTE_MS, token: str | None = None, model: str = DEFAULT_MODEL,
          host: str = "127.0.0.1", port: int = 0, name: str = "standin", any_model: bool = True,
          tls: ssl.SSLContext | None = None, log=None, profile: str | profiles.Profile = "oracle",
          seed: int | None = None) -> Iterator[StandinServer]:
    """Run a stand-in in a background thread for the ``with`` block; the port is closed on exit.
    ``tls``: serve mutual TLS with this context (``podtls.server_context``); ``log``: where its
    lines go (default stderr); ``profile``: a name of ``profiles.PROFILES`` (default ``oracle``:
    every request in ``compute_ms``), ``seed`` the engine's answer lengths."""
    server = StandinServer(host, port, compute_ms=compute_ms, token=token, model=model, name=name, any_model=any_model,
                           tls=tls, log=log, profile=profile, seed=seed)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"standin-{server.port}", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)


def _write_port_file(path: Path, info: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m colocate.pods.standin", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (reported on stdout)")
    p.add_argument("--compute-ms", type=float, default=DEFAULT_COMPUTE_MS, help="time spent per request (default 95)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--name", default="standin", help="echoed in the x-standin response header")
    p.add_argument("--any-model", action="store_true",
                   help="serve any model name, as a gateway would (the sandbox's fallback); by default another "
                        "name is vLLM's 404, as a real pod answers")
    p.add_argument("--profile", default="oracle", choices=sorted(profiles.PROFILES),
                   help="the GPU and model the stand-in behaves as (colocate.pods.profiles; default oracle: "
                        "every request in --compute-ms)")
    p.add_argument("--seed", type=int, help="seed of the answer lengths (default: random)")
    p.add_argument("--max-model-len", type=int, help="the context, prompt included, as vLLM's flag (default: the profile's)")
    p.add_argument("--port-file", type=Path, help="also write {url, port, pid} here once listening")
    args = p.parse_args(argv)
    if args.compute_ms < 0:
        p.error(f"--compute-ms must be >= 0 (got {args.compute_ms})")
    if args.max_model_len is not None and args.max_model_len < 1:
        p.error(f"--max-model-len must be >= 1 (got {args.max_model_len})")
    profile = profiles.get(args.profile)
    if args.max_model_len:
        profile = dataclasses.replace(profile, max_model_len=args.max_model_len)
    token = os.environ.get("POD_TOKEN") or None  # never from argv: argv is visible to every user
    try:
        # As vLLM does with its --ssl-* flags: the material comes from the environment (podtls).
        tls = podtls.server_context() if os.environ.get(podtls.ENV) else None
    except podtls.PodTlsError as exc:
        print(f"standin: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        server = StandinServer(args.host, args.port, compute_ms=args.compute_ms, token=token,
                               model=args.model, name=args.name, any_model=args.any_model, tls=tls,
                               profile=profile, seed=args.seed)
    except OSError as exc:
        print(f"standin: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    info = {"url": server.url, "port": server.port, "control_url": server.control_url}
    if args.port_file:
        _write_port_file(args.port_file, {**info, "pid": os.getpid()})
    print(json.dumps(info), flush=True)
    try:
        while not stop.wait(0.2):
            pass
    finally:
        server.stop()
        thread.join(timeout=10)
        if args.port_file:
            with contextlib.suppress(FileNotFoundError):
                args.port_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
