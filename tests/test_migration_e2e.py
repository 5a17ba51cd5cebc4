"""The generation-rename migration end to end in the sandbox, under a steady load.

start -> apply (the sandbox's `pulumi up`) -> finish -> apply, while about 50 requests per
second run on loopback: every request succeeds, and a breaker state set before the move is
still in force after it (read through from the draining generation).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from colocate.sandbox import supervisor
from colocate.sandbox.pinning import FILE_NAME as PINS
from scripts import migrate
from tests.support.sandbox import sandbox_stacks

pytestmark = pytest.mark.slow
RATE_PER_S = 50
MAX_LOAD_S = 180  # the load stops by itself even if the test body fails to stop it


@pytest.fixture
def stacks(tmp_path):
    return sandbox_stacks(tmp_path / "stacks", compute_ms=20)


@pytest.fixture
def cell(tmp_path, stacks):
    state = tmp_path / "state"
    up = supervisor.up("sandbox", state_dir=state, stacks_dir=stacks)
    yield up
    supervisor.down(state, quiet=True)


class Load:
    """A bounded open-loop load: one request every 1/RATE s until stopped or MAX_LOAD_S."""

    def __init__(self, url: str, key: str):
        self.url = url + "/v1/chat/completions"
        self.key = key  # the sandbox's demo client key, created before the move
        self.results: list[tuple[int | None, str | None, str]] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, session_pool: threading.local) -> None:
        s = getattr(session_pool, "s", None) or requests.Session()
        session_pool.s = s
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        try:
            r = s.post(self.url, json=body, timeout=90, headers={"authorization": f"Bearer {self.key}"})
            out = (r.status_code, r.headers.get("x-colocate-backend"), r.text[:200] if r.status_code != 200 else "")
        except requests.RequestException as exc:
            out = (None, None, type(exc).__name__)
        with self._lock:
            self.results.append(out)

    def _run(self) -> None:
        local = threading.local()
        deadline = time.monotonic() + MAX_LOAD_S
        with ThreadPoolExecutor(max_workers=32) as pool:
            next_at = time.monotonic()
            while not self.stop.is_set() and time.monotonic() < deadline:
                pool.submit(self._one, local)
                next_at += 1 / RATE_PER_S
                time.sleep(max(0.0, next_at - time.monotonic()))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(timeout=120)


def admin(cell, method, path, body=None):
    r = requests.request(method, cell["worker_url"] + path, json=body, timeout=60,
                         headers={"Authorization": f"Bearer {cell['token']}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_migration_under_load_drops_nothing_and_keeps_breaker_state(cell, stacks):
    state_dir = cell["state_dir"]
    assert admin(cell, "GET", "/_colocate/probe")["generation"] == "us-east.g1"  # first touch: pinned at IAD
    # An operator forces the breaker open before the move: every request goes to the fallback.
    assert admin(cell, "PUT", "/_colocate/breaker", {"force": "open"})["breaker"]["forced"] == "open"

    started = time.monotonic()
    with Load(cell["worker_url"], cell["key"]) as load:
        time.sleep(2)
        assert migrate.main(["start", "--stack", "sandbox", "--to", "apac-tw", "--stacks-dir", str(stacks)]) == 0
        during = supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks)
        assert (during["generation"], during["draining"], during["sites"]["edge"]) == ("apac-tw.g2", "us-east.g1", "TPE")
        probe = admin(during, "GET", "/_colocate/probe")  # the post-deploy probe: first touch from TPE
        assert probe["state_colo"] == "TPE" and probe["generation"] == "apac-tw.g2"
        assert probe["breaker"]["forced"] == "open", "read through from the draining generation"
        time.sleep(2)
        assert migrate.main(["finish", "--stack", "sandbox", "--stacks-dir", str(stacks)]) == 0
        after = supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks)
        assert after["draining"] is None and after["revision"] == during["revision"] + 1
        time.sleep(2)
    elapsed = time.monotonic() - started

    results = load.results
    failures = [r for r in results if r[0] != 200]
    print(f"load: {len(results)} requests in {elapsed:.1f} s ({len(results) / elapsed:.0f}/s), {len(failures)} failed")
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:5]}"
    assert len(results) >= 0.6 * RATE_PER_S * elapsed, (len(results), elapsed)  # the load really ran at ~50/s
    assert {backend for _, backend, _ in results} == {"fallback"}, "the forced-open breaker held throughout"

    final = admin(after, "GET", "/_colocate/breaker")
    assert final["generation"] == "apac-tw.g2" and final["breaker"]["forced"] == "open"
    pins = json.loads((supervisor.Path(state_dir) / PINS).read_text())
    assert pins["apac-tw.g2"]["site"] == "TPE" and pins["us-east.g1"]["site"] == "IAD"
    # `finish` + apply purged the retired generation once; nothing is left to purge.
    again = admin(after, "POST", "/_colocate/purge", {"generation": "us-east.g1"})
    assert again["had_state"] is False
    # The old pod was deleted after the new one served.
    pods = {p.name for p in (supervisor.Path(state_dir) / "pods").glob("*.json")}
    assert not any("us-east-g1" in name for name in pods), pods
