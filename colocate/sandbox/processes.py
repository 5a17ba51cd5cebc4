"""Process groups, signals deferred during a cleanup, stopping a child, and whether a child
answers over HTTP (detach.py launches a runner)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

CHILD_TIMEOUT_S = 30.0


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT and SIGTERM until the block ends, then raise KeyboardInterrupt if one came.
    A cleanup interrupted half-way would leave processes running; only the main thread can
    set handlers, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: got.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        raise KeyboardInterrupt


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs; zombies do not count (a container's init
    may take a second to reap them, and they hold nothing)."""
    if not signal_group(pgid, 0):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[-1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def stop_child(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``grace_s``; it is reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def http_ok(url: str, headers: dict | None = None, timeout: float = 2.0) -> tuple[bool, int | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return 200 <= r.status < 300, r.status
    except urllib.error.HTTPError as exc:
        exc.close()  # an HTTPError holds the connection until closed
        return False, exc.code
    except (OSError, ValueError):
        return False, None
