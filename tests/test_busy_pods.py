"""Busy is not broken, through the real Worker in workerd: a pod whose queue makes
requests miss their first-token deadline while it answers its health check is never charged
for it, one whose health check fails still is, and a key's prompts waiting for their first token
are bounded (max_parallel_tokens). The stand-in on the default profile models vLLM's prefill
queue (colocate/pods/engine.py). The pure parts: worker/test/busy.test.js."""

from __future__ import annotations

import random
import threading
import time

import pytest

from bench.busy import fresh_text
from colocate.pods import profiles
from tests.support.workerd import auth, request, running_cell

pytestmark = pytest.mark.slow

MODEL = profiles.get(profiles.DEFAULT_PROFILE).model
UNLIMITED = {"rpm": 0, "tpm": 0, "monthly_tokens": 0, "max_parallel": 0}


def send(url: str, key: str, text: str, max_tokens: int = 1) -> tuple[int, str | None, dict]:
    res = request(url, "POST", "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                  body={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
    return res.status, res.headers.get("x-colocate-backend"), res.json() if res.status != 200 else {}


def test_misses_behind_a_queue_from_two_keys_leave_the_breaker_closed():
    # A 1 s deadline: behind the queue of eight 5k-token prompts (about 4 s of prefill on the
    # default profile) most requests miss it and go to the fallback. A miss's health check has
    # the deadline too, and the stand-in answers /health in a thread beside (and under the GIL
    # of) the ones tokenizing those prompts: 400 ms timed out under load (the breaker opened,
    # 6 'broken'). On main, three misses from two keys opened the breaker for every key.
    with running_cell({"deadlineMs": 1_000, "stateTtlMs": 2_000}, profile=profiles.DEFAULT_PROFILE) as cell:
        keys = [cell.create_key(f"long-{i}", **UNLIMITED, max_parallel_tokens=0)["key"] for i in range(2)]
        since = int(time.time() * 1000) - 60_000
        got: list[tuple[int, str | None, dict]] = []
        lock = threading.Lock()

        def one(key: str, seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(2):
                out = send(cell.url, key, fresh_text(rng, 5000))
                with lock:
                    got.append(out)

        threads = [threading.Thread(target=one, args=(k, 10 * i + j)) for i, k in enumerate(keys) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(got) == 16 and all(s == 200 for s, _b, _e in got), got
        missed = sum(1 for _s, b, _e in got if b == "fallback")
        assert missed >= 6, f"only {missed} of 16 missed the deadline: the queue did not build"
        time.sleep(2)  # the misses' background judgements (health check, the pod's queue) have run
        snap = cell.breaker()
        assert snap["state"] == "closed" and snap["failures"] < 3, snap
        # and a quiet key's short request is the pod's once the queue is gone
        quiet = cell.create_key("quiet", **UNLIMITED)["key"]
        assert send(cell.url, quiet, "hi", 4)[:2] == (200, "pod-0")
        # the queue showed in the live view: a pod request's wait for its first token
        path = f"/_colocate/live?since={since}"
        live = request(cell.url, "GET", path, headers=auth(), timeout=30)
        deadline = time.monotonic() + 15
        while not any(r[3] == "queue" and r[2] == "0" for r in live.json()["minutes"]) and time.monotonic() < deadline:
            time.sleep(0.5)
            live = request(cell.url, "GET", path, headers=auth(), timeout=30)
        assert any(r[3] == "queue" and r[2] == "0" for r in live.json()["minutes"]), live.json()["minutes"][:5]


def test_a_pod_that_misses_and_fails_its_health_check_is_still_taken_out():
    with running_cell({"deadlineMs": 300, "stateTtlMs": 2_000}, compute_ms=1) as cell:
        cell.pod.set_fault("hang", delay_ms=2_000)  # every route, /health included, hangs
        key = cell.create_key("one", **UNLIMITED)["key"]
        deadline = time.monotonic() + 30
        while cell.breaker()["state"] != "open" and time.monotonic() < deadline:
            assert send(cell.url, key, "hi", 3)[:2] == (200, "fallback")
            time.sleep(0.4)  # a health check a second per pod
        assert cell.breaker()["state"] == "open"


def test_a_keys_prompts_waiting_for_their_first_token_are_bounded_by_max_parallel_tokens():
    with running_cell({"stateTtlMs": 2_000, "deadlineMs": 5_000}, compute_ms=1) as cell:
        made = cell.create_key("prompts", **UNLIMITED, max_parallel_tokens=5_000)
        key = made["key"]
        # a prompt over the limit alone (a token a byte, at most) can never be admitted: 400 naming the field and the fix
        status, _b, err = send(cell.url, key, "x" * 6_000)
        assert status == 400 and err["error"]["code"] == "request_too_large" and err["error"]["param"] == "messages"
        assert "max_parallel_tokens" in err["error"]["message"]
        # two 3 KB prompts at once: the second waits for the first's first token (the pod is slow to start)
        cell.pod.set_fault("slow", delay_ms=1_500)
        first: list = []
        t = threading.Thread(target=lambda: first.append(send(cell.url, key, "y" * 3_000, 3)))
        t.start()
        time.sleep(0.5)
        status, _b, err = send(cell.url, key, "z" * 3_000, 3)
        t.join(30)
        cell.pod.set_fault("ok")
        assert status == 429 and err["error"]["code"] == "too_many_parallel_tokens", err
        assert first and first[0][:2] == (200, "pod-0")
        # another key is not held back by this one's prompts, and this one's next is admitted
        assert send(cell.url, cell.key, "y" * 3_000, 3)[:2] == (200, "pod-0")
        assert send(cell.url, key, "z" * 3_000, 3)[:2] == (200, "pod-0")
