"""colocate/pods/serverloop.py: servers that sleep while idle and stop at once when shut down."""

from __future__ import annotations

import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from colocate.pods import standin
from colocate.pods.serverloop import WakeOnShutdown
from colocate.pods.standin import server as standin_server
from colocate.sandbox.proxies import RelayServer

IDLE_S = 0.5  # the stdlib's loop would wake 10 times in it at the stand-in's old 0.05 s poll


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


class _Server(WakeOnShutdown, ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.wakes = 0
        super().__init__(("127.0.0.1", 0), _Hello)

    def service_actions(self):  # the loop calls it once per wake-up
        self.wakes += 1


def test_an_idle_server_does_not_wake_serves_and_stops_when_shut_down():
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        time.sleep(IDLE_S)
        assert server.wakes == 0, "the loop woke with nothing to do"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/", timeout=10) as r:
            assert r.read() == b"ok"
        assert server.wakes >= 1
    finally:
        server.shutdown()
        server.server_close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_shutdown_before_serve_forever_stops_it_as_the_stdlib_does():
    server = _Server()
    stopper = threading.Thread(target=server.shutdown, daemon=True)
    stopper.start()
    server.serve_forever()  # returns: shutdown was asked for
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    server.server_close()


def test_the_stand_in_and_the_sandbox_relays_sleep_while_idle(monkeypatch):
    assert issubclass(RelayServer, WakeOnShutdown)
    wakes = []
    monkeypatch.setattr(standin_server.StandinServer, "service_actions", lambda self: wakes.append(1))
    with standin.serve(compute_ms=1) as pod:
        time.sleep(IDLE_S)
        assert not wakes, "an idle stand-in woke up"
        with urllib.request.urlopen(pod.url + "/health", timeout=10) as r:
            assert r.status == 200
