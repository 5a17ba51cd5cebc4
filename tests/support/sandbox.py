"""Helpers for tests that run the sandbox: a private copy of the sandbox stack."""

from __future__ import annotations

import shutil
from pathlib import Path

# The tests' load generator lives with the benchmarks; MODEL: the name the sandbox's pods serve
# (any other is vLLM's 404).
from bench.load import MODEL, Load  # noqa: F401
from colocate import stackfile


def sandbox_stacks(directory: Path, compute_ms: int) -> Path:
    """Copy stacks/Pulumi.sandbox.yaml into ``directory`` with the oracle pod (every answer in
    ``compute_ms``, at any load): for tests of the cell's mechanics, not of a pod's timing."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stackfile.path_of("sandbox"), stackfile.path_of("sandbox", directory))
    stackfile.write_config("sandbox", {"pod": {"provider": "local", "profile": "oracle", "computeMs": compute_ms}},
                           directory)
    return directory


def client_key(ready: dict, name: str = "test", **limits) -> dict:
    """A client key created on a running sandbox through its admin endpoint (the probe token)."""
    from colocate.admin import AdminClient, Target

    return AdminClient(Target(ready["worker_url"], ready["token"], "sandbox")).create_key(name, **limits)


def load_key(ready: dict, name: str = "load") -> dict:
    """A client key whose limits admit everything bench.load's open-loop generator sends: the cell's
    default key allows 8 in flight, and a load test that slows the cell (a split, a migration, a pod
    killed) keeps more than that in flight without any of them being a failure of the cell."""
    from bench.load import MAX_IN_FLIGHT

    return client_key(ready, name, max_parallel=MAX_IN_FLIGHT, rpm=0, tpm=0)


def usage_requests(ready: dict, key_id: str) -> int:
    """All requests the cell has recorded for one key (every day, every backend)."""
    from colocate.admin import AdminClient, Target

    rows = AdminClient(Target(ready["worker_url"], ready["token"], "sandbox")).usage(
        since="2000-01-01", until="2999-12-31", key_id=key_id)["usage"]
    return sum(r["requests"] for r in rows if r["key_id"] == key_id)


def await_results(load, done, timeout_s: float = 60) -> None:
    """Wait (bounded, polling) until ``done(results)`` holds for a running Load's results so far:
    a wait on what the load has seen rather than a fixed sleep sized for an idle machine. It
    returns at the bound either way; the test's own checks then say what was missing."""
    import time

    deadline = time.monotonic() + timeout_s
    while not done(list(load.results)) and time.monotonic() < deadline:
        time.sleep(0.1)


def more_results(load, n: int):
    """A condition for await_results: n more results than ``load`` has now."""
    start = len(load.results)
    return lambda results: len(results) >= start + n


def served_by(load_or_results, *backends: str) -> bool:
    """Whether every named backend has answered a request 200 (x-colocate-backend)."""
    results = getattr(load_or_results, "results", load_or_results)
    return set(backends) <= {b for s, b, _ in results if s == 200}
