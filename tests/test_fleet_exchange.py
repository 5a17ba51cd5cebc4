"""The limits exchange over time (real workerd): a month's budget used up from one entry, a key
idle past its isolates' memory, the exchange's endpoints, and a cell that does not answer.

Two real cells behind the front door, as in tests/test_fleet_limits.py, with
``colocate:worker.servedKeepMs`` at 35 s (default 120 s): an isolate forgets a key's counters and
lease that long after it last served it, so the forgotten-lease test waits 40 s for it, not two
minutes. Every test here refuses a key for less than that (the month's for about ``2 * D_S``,
the forgotten lease's eu-west for at most its 28 s): an isolate that forgot a refused key would
admit it again on its floor share. Every wait for the exchange is a bounded poll of a cell's own
view of a key, never a fixed sleep standing in for an assertion.
"""

from __future__ import annotations

import json
import time

import pytest

from colocate.cell.payloads import COUNTER
from tests.support.fleet import Fleet, running_fleet
from tests.support.fleet_limits import COLO, D_S, EXCHANGE_MS, A, B, call, cap, make_key, peer_requests, send, told, until, view
from tests.support.minutes import fresh_minute
from tests.support.workerd import SECRETS, auth, request

pytestmark = pytest.mark.slow  # real workerd, two or three cells and the front door

SERVED_KEEP_MS = 35_000  # colocate:worker.servedKeepMs, compressed (default 120000); see the docstring


@pytest.fixture(scope="module")
def fl() -> Fleet:
    with running_fleet((A, B), remember_ms=0, exchange_ms=EXCHANGE_MS, worker={"servedKeepMs": SERVED_KEEP_MS}) as f:
        told(f)
        # A key each cell's isolate holds from now, then leaves idle: by its test (the last), every
        # isolate has forgotten its lease (servedKeepMs).
        key, kid = make_key(f, rpm=30)
        for c in f.cells:
            assert request(c.url, "GET", "/v1/models", headers={"authorization": f"Bearer {key}"}).status == 200
        f.dormant = (key, kid, time.monotonic())  # type: ignore[attr-defined]
        yield f


# --- monthly tokens -------------------------------------------------------------------------

def test_a_monthly_budget_used_up_from_one_entry_is_refused_at_every_entry(fl):
    per = 16  # the stand-in pod answers 16 tokens a request
    body = {"model": "client/model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": per}
    most = len(json.dumps(body)) + per  # what admission holds a request to: its body's bytes and max_tokens
    budget = 4 * most
    key, kid = make_key(fl, monthly_tokens=budget)
    statuses, last_ok = [], time.monotonic()
    for _ in range(120):  # bounded: the leases move toward the budget within a few rounds
        statuses.append(call(fl, A, key, body=body).status)
        if statuses[-1] == 200:
            last_ok = time.monotonic()
        elif time.monotonic() - last_ok > 2 * D_S:  # refused for longer than a lease's lag: used up
            break
        time.sleep(0.25)
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    month = COUNTER["month_tokens"]
    used = {c: (view(fl, c, kid)["own"] or [0] * len(COUNTER))[month] for c in (A, B)}
    # apac-jp served it while its share lasted, then eu-west from its own share (the front
    # door tries it when apac-jp's is in use): whole requests at their average cost, so a
    # cell's first request (no average yet) may cross its share by one request's tokens; and a
    # request is admitted only while its most fits what the budget has left, so up to a
    # request's most may stay unused.
    assert used[A] > 0 and budget - per - most < sum(used.values()) <= cap(budget) + per, (used, statuses)
    got = [call(fl, c, key, body=body) for c in (B, A)]
    assert [r.status for r in got] == [429, 429], [r.status for r in got]
    assert {r.json()["error"]["code"] for r in got} == {"insufficient_quota"}, [r.body for r in got]


# --- (f) the endpoints --------------------------------------------------------------------

def error_of(res) -> dict:
    body = res.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


def test_the_exchange_endpoints_need_the_exchange_token_and_name_bad_fields(fl):
    url = fl.cell(A).url
    bad_auth = {"authorization": "Bearer not-the-probe-token"}
    for method, path, body in (
        ("GET", "/_colocate/fleet/counters?since=0", None),
        ("POST", "/_colocate/fleet/peers", {"rows": []}),
        ("GET", "/_colocate/fleet/peers?key=key_000000000000", None),
    ):
        for headers in ({}, bad_auth):
            res = request(url, method, path, body=body, headers=headers)
            assert res.status == 401 and error_of(res)["code"] == "unauthorized", (path, headers, res.body)
    # The front door does not expose them (only the routed paths).
    assert fl.call("NRT", "GET", "/_colocate/fleet/counters").status == 404
    for since in ("-1", "x", "1.5", ""):
        res = request(url, "GET", f"/_colocate/fleet/counters?since={since}", headers=auth())
        assert res.status == 400 and 'query "since"' in error_of(res)["message"], (since, res.body)
    good = ["key_0123456789ab", 1, 0, 0, 0, 0, "2026-12", 0]
    for body, field in (({"rows": "x"}, '"rows"'), ({"rows": [], "extra": 1}, '"extra"'),
                        ({"rows": [], "leases": [["key_0123456789ab", -1, None, "2026-12", None]]}, '"leases[0]"[1]'),
                        ({"rows": [], "leases": "x"}, '"leases"'),
                        ({"rows": [], "cells": 0}, '"cells"'), ({"rows": [], "cells": "2"}, '"cells"')):
        res = request(url, "POST", "/_colocate/fleet/peers", body=body, headers=auth())
        assert res.status == 400 and field in error_of(res)["message"], (body, res.body)
    # A bad row is dropped and named; the good rows of the same batch are stored.
    for bad, field in (([1], '"rows[1]"'), (good[:2] + [-1] + good[3:], '"rows[1]"[2]'),
                       (["nope"] + good[1:], '"rows[1]"[0]'), (good[:6] + ["Dec"] + good[7:], '"rows[1]"[6]'),
                       (good[:7] + [2**53], '"rows[1]"[7]')):
        res = request(url, "POST", "/_colocate/fleet/peers", body={"rows": [good, bad]}, headers=auth())
        assert res.status == 200 and res.json()["stored"] + res.json()["deleted"] == 1, res.body
        assert len(res.json()["dropped"]) == 1 and field in res.json()["dropped"][0], (bad, res.body)
    res = request(url, "GET", "/_colocate/fleet/peers?key=nope", headers=auth())
    assert res.status == 400 and 'query "key"' in error_of(res)["message"]
    # What the ledger reads: this cell's own rows changed since a cursor, paged by it.
    # (the fixture's request reaches the object with its isolate's next flush: a bounded poll)
    first = until(lambda: request(url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).json(), lambda b: b["rows"])
    assert first["generation"] == f"{A}.g1" and first["cursor"] >= len(first["rows"]) > 0
    again = request(url, "GET", f"/_colocate/fleet/counters?since={first['cursor']}", headers=auth()).json()
    assert again["rows"] == [] or all(r[0] for r in again["rows"])
    assert json.dumps(first).count(SECRETS["PROBE_TOKEN"]) == 0


# --- (d) a cell down during the exchange ---------------------------------------------------

def test_a_cell_that_does_not_answer_is_skipped_and_the_others_keep_exchanging():
    with running_fleet((A, B, "us-east"), remember_ms=0, exchange_ms=EXCHANGE_MS, unreachable=("us-east",)) as f:
        key, kid = make_key(f, rpm=100_000)
        for cell in (A, B):
            send(f, cell, key, 1)  # held by each cell's isolate from now on
        waits = [call(f, A, key).timing()["state"] for _ in range(4)]
        got = until(lambda: view(f, B, kid), lambda v: peer_requests(v) >= 5)
        assert peer_requests(got) == 5, got
        waits += [call(f, B, key).timing()["state"] for _ in range(4)]
        assert waits == [0] * 8, waits  # the hot path does not notice the dead cell
        until(lambda: f.worker.log_text(), lambda t: "us-east (" in t)
        rounds = [json.loads(line) for line in f.worker.log_text().splitlines() if '"event":"fleet_exchange"' in line]
        assert rounds and any(any(s.startswith("us-east (") for s in r["skipped"]) for r in rounds), rounds[-3:]
        assert any(r["pulled"] > 0 for r in rounds)


# --- a key whose lease the isolates forgot ---------------------------------------------------

def test_a_key_idle_past_its_isolates_memory_that_moves_cell_stays_within_the_cap(fl):
    """rpm 30, idle in both cells for longer than an isolate keeps a key's lease (SERVED_KEEP_MS:
    the module's earlier tests run meanwhile), then 10 requests/s to apac-jp's own address,
    then to eu-west's: eu-west's isolate admits the key on its floor share until its sync brings
    the lease the ledger cut meanwhile, so the fleet admits at most the cap in the minute."""
    key, _kid, made = fl.dormant
    time.sleep(max(0.0, made + SERVED_KEEP_MS / 1000 + 5 - time.monotonic()))
    fresh_minute(45)
    before = time.monotonic() + (60 - time.time() % 60) - 2
    log = []
    headers = {"authorization": f"Bearer {key}"}
    for cell, seconds in ((A, 12), (B, 28)):
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds and time.monotonic() < before:
            if i % 20 == 0:
                fl.call(COLO[A])  # the front door in use: the ledger's rounds go on (it pokes the ledger)
            wait = start + i / 10 - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            log.append((cell, request(fl.cell(cell).url, "GET", "/v1/models", headers=headers).status))
            i += 1
    ok = [c for c, s in log if s == 200]
    assert {s for _, s in log} <= {200, 429}
    assert len(ok) <= cap(30), (len(ok), {c: ok.count(c) for c in (A, B)})
    assert len(ok) >= 30 - 3, (len(ok), {c: ok.count(c) for c in (A, B)})  # and it got about its limit
