"""``WakeOnShutdown``: a socketserver whose ``serve_forever`` sleeps until a connection arrives or
``shutdown()`` is called.

The stdlib's loop wakes every ``poll_interval`` to see whether ``shutdown()`` was asked for, so a
short interval (a prompt stop) costs CPU for as long as the server idles: a stand-in pod, the
sandbox's proxies and the tests' servers idle for most of their lives. Here ``shutdown()`` wakes
the loop through a pipe, so it stops at once and an idle server costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading


class WakeOnShutdown:
    """Mix in before the server class: ``class S(WakeOnShutdown, ThreadingHTTPServer)``. Same
    contract as the stdlib's: ``shutdown()`` (from another thread) returns once ``serve_forever``
    has stopped; ``poll_interval`` is accepted and ignored."""

    def __init__(self, *args, **kwargs) -> None:
        self._stop_serving = threading.Event()
        self._stopped_serving = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        super().__init__(*args, **kwargs)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped_serving.clear()
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)  # type: ignore[arg-type]  # has fileno()
                selector.register(self._wake_r, selectors.EVENT_READ)
                while not self._stop_serving.is_set():
                    ready = selector.select()
                    if self._stop_serving.is_set():
                        break
                    for key, _ in ready:
                        if key.fileobj is self:
                            self._handle_request_noblock()  # type: ignore[attr-defined]
                        else:
                            os.read(self._wake_r, 512)
                    self.service_actions()  # type: ignore[attr-defined]
        finally:
            self._stop_serving.clear()
            self._stopped_serving.set()

    def shutdown(self) -> None:
        self._stop_serving.set()
        with contextlib.suppress(OSError):  # closed by server_close: the loop no longer selects on it
            os.write(self._wake_w, b"\0")
        self._stopped_serving.wait()

    def server_close(self) -> None:
        super().server_close()  # type: ignore[misc]
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
