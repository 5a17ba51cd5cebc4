"""Helpers for tests of streamed (SSE) answers: a client that leaves mid-stream, and a
bounded wait for a counter to reach its value."""

from __future__ import annotations

import json
import socket
import time


def poll(read, want, timeout_s: float = 10.0):
    """``read()`` until it returns ``want`` or ``timeout_s`` passes; the last value read."""
    deadline = time.monotonic() + timeout_s
    while read() != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return read()


def leave_after_first_event(port: int, path: str, body: dict, headers: dict | None = None) -> None:
    """POST ``body`` to 127.0.0.1:``port``, read until the first SSE event, then close the
    connection: a client that goes away mid-stream."""
    raw = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "localhost", "Content-Type": "application/json",
                                                  **(headers or {}), "Content-Length": str(len(raw))}.items())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + raw)
        seen = b""
        while b"data: " not in seen and len(seen) < 65536:
            part = sock.recv(65536)
            assert part, "the server closed the stream before its first event"
            seen += part
