"""The generation-rename migration end to end in the sandbox, under a steady load.

start -> apply (the sandbox's `pulumi up`) -> finish -> apply, while about 25 requests per
second run on loopback with a client key created before the move: every request succeeds
(the key is read through from the draining generation, then copied), a breaker state set
before the move is still in force after it, and the key's usage survives the purge of the
old generation.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from colocate.sandbox import supervisor
from colocate.sandbox.statedir import PINS_FILE as PINS
from scripts import migrate
from tests.support.sandbox import Load, await_results, load_key, more_results, sandbox_stacks, usage_requests

pytestmark = pytest.mark.slow
# Each apply swaps the Worker (and here the pod and the generation too) with the requests that arrive
# in its 1.2 s grace held at the edge: 30 or more at this rate, so one dropped at a swap fails the check.
RATE_PER_S = 25
MAX_LOAD_S = 180  # the load stops by itself even if the test body fails to stop it
PHASE = 25  # requests answered in each phase of the move (before, during, after) before the next step
USAGE_WAIT_S = 30  # usage is reconciled in the object after the response (waitUntil)


@pytest.fixture
def stacks(tmp_path):
    return sandbox_stacks(tmp_path / "stacks", compute_ms=20)


@pytest.fixture
def cell(tmp_path, stacks):
    state = tmp_path / "state"
    up = supervisor.up("sandbox", state_dir=state, stacks_dir=stacks)
    yield up
    supervisor.down(state, quiet=True)


def admin(cell, method, path, body=None):
    r = requests.request(method, cell["worker_url"] + path, json=body, timeout=60,
                         headers={"Authorization": f"Bearer {cell['token']}"})
    assert r.status_code == 200, r.text
    return r.json()


def _usage_at_least(cell, key_id: str, n: int) -> int:
    deadline = time.monotonic() + USAGE_WAIT_S
    seen = usage_requests(cell, key_id)
    while seen < n and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = usage_requests(cell, key_id)
    return seen


def test_migration_under_load_drops_nothing_and_keeps_keys_usage_and_breaker_state(cell, stacks):
    state_dir = cell["state_dir"]
    assert admin(cell, "GET", "/_colocate/probe")["generation"] == "us-east.g1"  # first touch: pinned at IAD
    key = load_key(cell, "before-the-move")
    # Usage recorded in the old generation before anything moves.
    with Load(cell["worker_url"], key["key"], RATE_PER_S, MAX_LOAD_S) as warm:
        await_results(warm, more_results(warm, 10))
    assert not warm.failures(), warm.failures()[:5]
    before = _usage_at_least(cell, key["id"], len(warm.results))
    assert before >= len(warm.results) > 0
    # An operator forces the breaker open before the move: every request goes to the fallback.
    assert admin(cell, "PUT", "/_colocate/breaker", {"force": "open"})["breaker"]["forced"] == "open"

    started = time.monotonic()
    with Load(cell["worker_url"], key["key"], RATE_PER_S, MAX_LOAD_S) as load:
        # Requests answered before each step and after it (PHASE of them, a second at 25/s), and
        # through every deploy: the load runs on while `apply` replaces the Worker, the pod and the
        # generation, where a lost request would be.
        await_results(load, more_results(load, PHASE))
        assert migrate.main(["start", "--stack", "sandbox", "--to", "apac-tw", "--stacks-dir", str(stacks)]) == 0
        during = supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks)
        assert (during["generation"], during["draining"], during["sites"]["edge"]) == ("apac-tw.g2", "us-east.g1", "TPE")
        probe = admin(during, "GET", "/_colocate/probe")  # the post-deploy probe: first touch from TPE
        assert probe["state_colo"] == "TPE" and probe["generation"] == "apac-tw.g2"
        assert probe["breaker"]["forced"] == "open", "read through from the draining generation"
        await_results(load, more_results(load, PHASE))
        assert migrate.main(["finish", "--stack", "sandbox", "--stacks-dir", str(stacks)]) == 0
        after = supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks)
        assert after["draining"] is None and after["revision"] == during["revision"] + 1
        await_results(load, more_results(load, PHASE))
    elapsed = time.monotonic() - started

    results = load.results
    failures = load.failures()
    print(f"load: {len(results)} requests in {elapsed:.1f} s ({len(results) / elapsed:.0f}/s), {len(failures)} failed")
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:5]}"
    assert len(results) >= 0.6 * RATE_PER_S * elapsed, (len(results), elapsed)  # the load really ran at ~25/s
    assert {backend for _, backend, _ in results} == {"fallback"}, "the forced-open breaker held throughout"

    final = admin(after, "GET", "/_colocate/breaker")
    assert final["generation"] == "apac-tw.g2" and final["breaker"]["forced"] == "open"
    pins = json.loads((supervisor.Path(state_dir) / PINS).read_text())
    assert pins["apac-tw.g2"]["site"] == "TPE" and pins["us-east.g1"]["site"] == "IAD"
    # `finish` + apply purged the retired generation once; nothing is left to purge.
    again = admin(after, "POST", "/_colocate/purge", {"generation": "us-east.g1"})
    assert again["had_state"] is False
    # The key still works on the new generation alone, and its usage came along before the purge.
    r = requests.post(after["worker_url"] + "/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                      headers={"Authorization": f"Bearer {key['key']}"})
    assert r.status_code == 200, r.text
    # Every request is counted once: before the move, during it (late batches of the old
    # version are forwarded to the new generation), and after the purge.
    expected = before + len(results) + 1
    total = _usage_at_least(after, key["id"], expected)
    print(f"usage: {before} before the move, {total} after the purge, {len(results)} sent during it")
    assert total == expected, (total, expected)
    # The old pod was deleted after the new one served.
    pods = {p.name for p in (supervisor.Path(state_dir) / "pods").glob("*.json")}
    assert not any("us-east-g1" in name for name in pods), pods
