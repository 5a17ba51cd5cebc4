"""A client site on loopback: a tiny HTTP proxy that forwards every request to the front
door with ``cf-blob: {"colo": CODE}`` added, so a URL behaves like a user whose request
Cloudflare accepted at that colo (locally ``request.cf`` comes only from that header,
``colocate/fleet/workerd.py``). The probe is handed the proxy's URL as a ``--client-site``.

Port 0, one thread per client connection (keep-alive, so the probe's reused connection is
reused here too), one upstream connection per client connection. It stops when the
``with`` block ends, or by itself after ``lifetime_s``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from colocate.fleet.workerd import CF_BLOB_HEADER

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}


def _handler(upstream: str, colo: str) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall
        conn: http.client.HTTPConnection | None = None

        def log_message(self, *args) -> None:  # quiet in tests
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() != CF_BLOB_HEADER}
            headers[CF_BLOB_HEADER] = json.dumps({"colo": colo})
            if self.conn is None:
                self.conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            try:
                self.conn.request(self.command, self.path, body=body, headers=headers)
                res = self.conn.getresponse()
                data = res.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                self.send_error(502, "site proxy: the front door did not answer")
                return
            self.send_response(res.status, res.reason)
            for k, v in res.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _forward

        def finish(self) -> None:
            super().finish()
            if self.conn is not None:
                self.conn.close()

    return Handler


@contextlib.contextmanager
def site(upstream: str, colo: str, lifetime_s: float = 600.0) -> Iterator[str]:
    """The URL of a client site at ``colo`` in front of ``upstream`` (the front door's URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(upstream, colo))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    stop = threading.Timer(lifetime_s, server.shutdown)  # a forgotten site still ends
    stop.daemon = True
    stop.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
