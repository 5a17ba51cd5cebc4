"""A local stand-in for the GPU pod: an OpenAI-compatible inference server that only pretends.

It answers what the router forwards to a real vLLM pod, with the same auth rule
(``Authorization: Bearer <POD_TOKEN>`` on ``/v1/*``, ``/health`` open, like vLLM's
``--api-key``), and spends ``compute_ms`` (default 95 ms, the INT4 GPTQ-Marlin figure
in FACTS.md) per request instead of running a model.

Routes:
    GET  /health                 200 {"status":"ok"} (no auth)
    GET  /v1/models              the one model
    POST /v1/chat/completions    JSON, or SSE with "stream": true (one chunk per token, then [DONE]);
                                 ``stream_options.include_usage``: every chunk carries ``"usage": null``
                                 and a last chunk before [DONE] has ``"choices": []`` and the usage
                                 (OpenAI's documented shape, which vLLM follows); JSON answers always
                                 carry ``usage``
    POST /v1/completions         JSON, or SSE with "stream": true
    POST /_standin/fault         {"mode": "ok"|"error"|"hang"|"slow", "delay_ms": N} (loopback clients only)
    GET  /_standin/stats         {"requests": N, "streams": {"completed": N, "cut": N}, "fault": {...}}
                                 (loopback clients only; a cut stream lost its client before [DONE])

Faults apply to every route except ``/_standin/*``: ``error`` answers 500, ``hang``
holds the request for ``delay_ms`` (or until shutdown when 0) then drops the connection,
``slow`` adds ``delay_ms`` before answering.

CLI: ``python -m colocate.pods.standin --host 127.0.0.1 --port 0 --compute-ms 95 --model NAME
[--port-file PATH]`` prints one JSON line ``{"url": ..., "port": ...}`` once listening and
stops cleanly on SIGTERM/SIGINT. In-process: ``with serve(compute_ms=5, token="t") as pod: pod.url``.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import ipaddress
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

DEFAULT_COMPUTE_MS = 95.0
DEFAULT_MODEL = "standin/qwen2.5-7b-instruct-gptq-int4"
FAULT_MODES = ("ok", "error", "hang", "slow")
MAX_BODY = 8 * 1024 * 1024
_HANG_CAP_S = 300.0  # a hang with no delay lasts until shutdown, but never longer than this


class StandinServer(ThreadingHTTPServer):
    """The HTTP server plus the stand-in's state (fault, request count)."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of 32 connections overflows it
    # and the dropped SYNs come back a second later (p99 ~1 s, resets).
    request_queue_size = 128

    def __init__(self, host: str, port: int, *, compute_ms: float, token: str | None, model: str, name: str = "standin"):
        self.compute_ms = float(compute_ms)
        self.token = token or None
        self.model = model
        self.name = name
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._fault = {"mode": "ok", "delay_ms": 0}
        self._requests = 0
        self._streams = {"completed": 0, "cut": 0}
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def requests(self) -> int:
        """How many ``/v1/*`` requests arrived (health checks and ``/_standin`` calls are not counted)."""
        with self._lock:
            return self._requests

    def count_request(self) -> None:
        with self._lock:
            self._requests += 1

    @property
    def streams(self) -> dict:
        """SSE answers sent to the end (``completed``) and those whose client went away
        first (``cut``): a router that stops reading must not leave the pod generating."""
        with self._lock:
            return dict(self._streams)

    def count_stream(self, outcome: str) -> None:
        with self._lock:
            self._streams[outcome] += 1

    @property
    def fault(self) -> dict:
        with self._lock:
            return dict(self._fault)

    def set_fault(self, mode: str, delay_ms: float = 0) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"fault mode {mode!r} is not one of {', '.join(FAULT_MODES)}")
        delay = float(delay_ms)
        if delay < 0:
            raise ValueError(f"delay_ms must be >= 0 (got {delay_ms!r})")
        with self._lock:
            self._fault = {"mode": mode, "delay_ms": delay}

    def stop(self) -> None:
        """Wake any hanging request, stop serving and close the socket."""
        self.stopping.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True  # headers and body go out in separate writes: avoid 40 ms delayed-ACK stalls
    protocol_version = "HTTP/1.1"
    server: StandinServer
    server_version = "colocate-standin/1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: tests and the sandbox read stdout/stderr for their own lines

    # ---- plumbing -------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-standin", self.server.name)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
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
            self.server.stopping.wait(self.server.compute_ms * fraction / 1000.0)

    # ---- routes ---------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        path = self.path.split("?", 1)[0]
        if path == "/_standin/stats":
            if not self._loopback_client():
                return self._error(403, "stand-in controls are local only", "forbidden")
            return self._send_json(200, {"requests": self.server.requests, "streams": self.server.streams,
                                         "fault": self.server.fault})
        if path == "/health":
            if self._apply_fault():
                self._send_json(200, {"status": "ok"})
            return
        if path == "/v1/models":
            self.server.count_request()
            if not self._authorised():
                return self._error(401, "Unauthorized", "invalid_api_key")
            if self._apply_fault():
                self._send_json(200, {"object": "list", "data": [
                    {"id": self.server.model, "object": "model", "created": int(time.time()), "owned_by": "colocate"}]})
            return
        if path in ("/v1/chat/completions", "/v1/completions", "/_standin/fault"):
            return self._error(405, f"{path} takes POST", "method_not_allowed", headers={"Allow": "POST"})
        self._error(404, f"no route {path}", "not_found")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        raw = self._read_body()
        if raw is None:
            self.close_connection = True
            return self._error(413, f"body larger than {MAX_BODY} bytes", "body_too_large")
        if path == "/_standin/fault":
            return self._post_fault(raw)
        if path not in ("/v1/chat/completions", "/v1/completions"):
            if path in ("/health", "/v1/models"):
                return self._error(405, f"{path} takes GET", "method_not_allowed", headers={"Allow": "GET"})
            return self._error(404, f"no route {path}", "not_found")
        self.server.count_request()
        if not self._authorised():
            return self._error(401, "Unauthorized", "invalid_api_key")
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            return self._error(400, "request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object", "invalid_body")
        chat = path == "/v1/chat/completions"
        if chat and not isinstance(body.get("messages"), list):
            return self._error(400, "'messages' must be a list", "invalid_messages")
        if not chat and "prompt" not in body:
            return self._error(400, "'prompt' is required", "invalid_prompt")
        if not self._apply_fault():
            return
        options = body.get("stream_options")
        if options is not None and not body.get("stream"):
            # vLLM's answer too: stream_options without streaming is a client error.
            return self._error(400, "Stream options can only be defined when `stream=True`.", "invalid_stream_options")
        if options is not None and not isinstance(options, dict):
            return self._error(400, "'stream_options' must be an object", "invalid_stream_options")
        model = body.get("model") or self.server.model
        tokens = _reply_tokens(body, chat, int(body.get("max_tokens") or 8))
        usage = _usage(body, tokens)
        if body.get("stream"):
            return self._stream(chat, model, tokens, usage if (options or {}).get("include_usage") else None)
        self._compute()
        text = "".join(tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
                  else {"index": 0, "text": text, "finish_reason": "stop"})
        self._send_json(200, {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage,
        })

    def _post_fault(self, raw: bytes) -> None:
        if not self._loopback_client():
            return self._error(403, "stand-in controls are local only", "forbidden")
        try:
            body = json.loads(raw or b"{}")
            self.server.set_fault(body.get("mode", "ok"), body.get("delay_ms", 0) or 0)
        except (ValueError, TypeError, AttributeError) as exc:
            return self._error(400, f"bad fault request: {exc}", "invalid_fault")
        self._send_json(200, {"fault": self.server.fault})

    def _stream(self, chat: bool, model: str, tokens: list[str], usage: dict | None = None) -> None:
        """SSE; with ``usage`` (the client asked ``include_usage``) every chunk has
        ``"usage": null`` and one more chunk, ``choices: []`` with the usage, precedes [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-standin", self.server.name)
        self.end_headers()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        # Time to first token is most of the compute; the rest is spread over the tokens.
        self._compute(0.5)
        try:
            for i, tok in enumerate(tokens):
                last = i == len(tokens) - 1
                if chat:
                    delta = {"role": "assistant", "content": tok} if i == 0 else {"content": tok}
                    choice = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
                    obj = "chat.completion.chunk"
                else:
                    choice = {"index": 0, "text": tok, "finish_reason": "stop" if last else None}
                    obj = "text_completion"
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if usage is not None:
                    chunk["usage"] = None
                self._write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                if not last:
                    self._compute(0.5 / max(1, len(tokens) - 1))
            if usage is not None:
                final = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": model, "choices": [], "usage": usage}
                self._write_chunk(f"data: {json.dumps(final)}\n\n".encode())
            self._write_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self.server.count_stream("cut")
            return
        self.server.count_stream("completed")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _usage(body: dict, tokens: list[str]) -> dict:
    # About four characters a token: enough for limits and usage accounting to have numbers.
    prompt_tokens = max(1, len(json.dumps(body.get("messages") or body.get("prompt"))) // 4)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens), "total_tokens": prompt_tokens + len(tokens)}


def _reply_tokens(body: dict, chat: bool, max_tokens: int) -> list[str]:
    words = ["This", " is", " the", " colocate", " stand-in", " answering", " from", " loopback", "."]
    return words[: max(1, min(max_tokens, len(words)))]


@contextlib.contextmanager
def serve(compute_ms: float = DEFAULT_COMPUTE_MS, token: str | None = None, model: str = DEFAULT_MODEL,
          host: str = "127.0.0.1", port: int = 0, name: str = "standin") -> Iterator[StandinServer]:
    """Run a stand-in in a background thread for the ``with`` block; the port is closed on exit."""
    server = StandinServer(host, port, compute_ms=compute_ms, token=token, model=model, name=name)
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
    p.add_argument("--port-file", type=Path, help="also write {url, port, pid} here once listening")
    args = p.parse_args(argv)
    if args.compute_ms < 0:
        p.error(f"--compute-ms must be >= 0 (got {args.compute_ms})")
    token = os.environ.get("POD_TOKEN") or None  # never from argv: argv is visible to every user
    try:
        server = StandinServer(args.host, args.port, compute_ms=args.compute_ms, token=token,
                               model=args.model, name=args.name)
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
    info = {"url": server.url, "port": server.port}
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
