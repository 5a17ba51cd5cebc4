"""SIGTERM as a request to stop at the next safe point, not an exception at any bytecode.

``pod.py`` turns SIGTERM (Pulumi cancelling an update, a CI job's timeout) into
``request()``; the lifecycle raises ``KeyboardInterrupt`` at its waits and after each
create (``check``, ``sleep``), where its cleanup (destroy what it made) can run. An
exception raised by the signal handler itself could land inside the HTTP client while
it held its connection pool's lock, and the cleanup's own request then waited on that
lock for ever, leaving the pod billing. SIGINT (Ctrl-C at a terminal) still interrupts
at once.
"""

from __future__ import annotations

import time

_requested = False
SLICE_S = 0.1  # how soon a wait sees a request


def request() -> None:
    """Ask the lifecycle to stop (a signal handler may call this: it only sets a flag)."""
    global _requested
    _requested = True


def check() -> None:
    """Raise KeyboardInterrupt if a stop was requested."""
    if _requested:
        raise KeyboardInterrupt("SIGTERM")


def sleep(seconds: float) -> None:
    """``time.sleep`` that ends, raising KeyboardInterrupt, within SLICE_S of a stop request."""
    deadline = time.monotonic() + seconds
    while True:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(SLICE_S, left))
