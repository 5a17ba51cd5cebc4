"""Fleet-wide limits by lease: the front door's FleetLedger apportions each key's limits (real workerd).

Two real cells behind the front door (NRT reaches apac-jp, FRA reaches eu-west), each with
its own generation; every ``exchangeMs`` the ledger pulls each cell's changed counters and
pushes each cell its leases (its share of each key's rpm, tpm and monthly tokens) with the
others' sums (docs/fleet.md, "Limits across cells"). Every wait for the exchange is a
bounded poll of the cell's own view of a key (``GET /_colocate/fleet/peers?key=``), never
a fixed sleep standing in for an assertion.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from colocate import admin
from colocate.cell.payloads import COUNTER, EXCHANGE
from tests.support.fleet import Fleet, running_fleet
from tests.support.minutes import fresh_minute
from tests.support.workerd import SECRETS, auth, request

CHAT = {"model": "client/model", "messages": [{"role": "user", "content": "hi"}]}

pytestmark = pytest.mark.slow  # real workerd, two or three cells and the front door

A, B = "apac-jp", "eu-west"
COLO = {A: "NRT", B: "FRA"}
EXCHANGE_MS = 250  # colocate:fleet.exchangeMs, compressed (default 1000) so leases follow demand quickly
STATE_TTL_MS = 2000  # colocate:worker.stateTtlMs (the default)
# How long a lease takes to follow demand: a cell's flush (min(TTL/2, 1 s)), a round (the
# period, then at most max(1 s, period)), a replaced lease's grace (TTL + 1 s) and the
# other cell's sync (TTL).
D_S = (min(STATE_TTL_MS / 2, 1000) + EXCHANGE_MS + max(1000, EXCHANGE_MS) + 2 * STATE_TTL_MS + 1000) / 1000
CONVERGE_S = 5 * D_S  # how long a poll may wait on a loaded machine (bounded)


def cap(limit: int) -> int:
    """What a key's leases may add up to: the limit and max(10 %, 1) of it."""
    return limit + max(1, limit // 10)


def default_share(limit: int, cells: int = 2) -> int:
    """A cell's lease of a key before the ledger has apportioned it: the cap split evenly."""
    return cap(limit) // cells


@pytest.fixture(scope="module")
def fl() -> Fleet:
    with running_fleet((A, B), remember_ms=0, exchange_ms=EXCHANGE_MS) as f:
        told(f)
        # A key each cell's isolate holds from now, then leaves idle for the module's length: by
        # its test (the last), every isolate has forgotten its lease (state.js SERVED_KEEP_MS).
        key, kid = make_key(f, rpm=30)
        for c in f.cells:
            assert request(c.url, "GET", "/v1/models", headers={"authorization": f"Bearer {key}"}).status == 200
        f.dormant = (key, kid, time.monotonic())  # type: ignore[attr-defined]
        yield f


def told(f: Fleet) -> None:
    """Use the front door once (the ledger runs while it is used) and wait until every cell
    knows the fleet's size: from then on each key has a lease in every cell."""
    f.call(COLO[A])
    for c in f.cells:
        got = until(lambda c=c: view(f, c.name, "key_000000000000"), lambda v: v["fleet_cells"] == len(f.cells))
        assert got["fleet_cells"] == len(f.cells), got


def make_key(f: Fleet, **limits) -> tuple[str, str]:
    """A key replicated into every cell (as keys.py does): (key, id)."""
    key = admin.new_key()
    row = admin.key_row(key, "limits", **limits)
    for c in f.cells:
        res = request(c.url, "POST", "/_colocate/keys/replica", body=row, headers=auth())
        assert res.status == 201, res.body
    return key, row["id"]


def call(f: Fleet, cell: str, key: str, method: str = "POST", path: str = "/v1/chat/completions", body: dict | None = None):
    """A request through the front door from ``cell``'s entry colo: that cell serves it, or,
    when its share of the key's limit is in use while the key is under it, another cell."""
    res = f.call(COLO[cell], method, path, body=body, headers={"authorization": f"Bearer {key}"})
    assert "x-colocate-lease" not in res.headers  # between the front door and its cells only
    return res


def view(f: Fleet, cell: str, key_id: str) -> dict:
    """What a cell's generation holds of a key: own counters, the peers' row, its lease."""
    res = request(f.cell(cell).url, "GET", f"/_colocate/fleet/peers?key={key_id}", headers=auth())
    assert res.status == 200, res.body
    return res.json()


def until(fn, ok, within_s: float = CONVERGE_S):
    """Poll ``fn`` until ``ok(value)`` or ``within_s`` passes (bounded); its last value."""
    deadline = time.monotonic() + within_s
    while True:
        got = fn()
        if ok(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def peer(column: str):
    """A view's peers row column (payloads.js EXCHANGE, the row as pushed)."""
    return lambda v: (v["peers"] or {}).get(column, 0)


def lease(field: str):
    return lambda v: (v["lease"] or {}).get(field)


def send(f: Fleet, cell: str, key: str, n: int) -> list:
    return [call(f, cell, key) for _ in range(n)]


def paced(f: Fleet, cell: str, key: str, per_s: float, seconds: float, log: list, stop=None,
          before: float = float("inf"), count: int | None = None) -> None:
    """Requests to ``cell`` at ``per_s`` for ``seconds`` (never faster; slower when the
    machine is: the bounds below hold whatever the rate), at most ``count``, none started
    after ``before`` (time.monotonic()); (sent, cell, status, the cell that answered) into ``log``."""
    start = time.monotonic()
    i = 0
    while (time.monotonic() - start < seconds and time.monotonic() < before and not (stop and stop())
           and (count is None or i < count)):
        wait = start + i / per_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        t = time.monotonic()
        res = call(f, cell, key)
        log.append((t, cell, res.status, res.headers.get("x-colocate-cell")))
        i += 1


# --- the case and a key that moves, run side by side in one minute ----------------

@pytest.fixture(scope="module")
def minute(fl) -> dict:
    """In one UTC minute: (1) one key with rpm 30 sent 5 requests/s at each entry for 40 s;
    (2) another with rpm 30 sent 1 request/s (twice its limit's pace), first to apac-jp,
    then to eu-west."""
    # The keys first: replicating them into the cells is no part of the minute's traffic (on a
    # loaded machine it took seconds of it).
    hostile, hid = make_key(fl, rpm=30)
    mover, mid = make_key(fl, rpm=30)
    fresh_minute(45)  # 40 s of traffic, then room for a slow last call on a loaded machine
    began = int(time.time() // 60)
    # No request starts in the minute's last 2 s, however slow the machine made the calls
    # before it: every request lands in this minute's bucket.
    before = time.monotonic() + (60 - time.time() % 60) - 2
    logs = {"hostile": [], "move": []}
    moved_at = []

    def move() -> None:
        # 12 requests, 40 % of the limit, all in apac-jp: the move that once found apac-jp's lease
        # cut to what it had used while eu-west's had not grown yet (docs/testing.md).
        paced(fl, A, mover, 1, 13, logs["move"], before=before, count=12)
        moved_at.append(time.monotonic())
        # Then all of it to eu-west at the same rate until the fleet has admitted the limit.
        admitted = lambda: sum(1 for _, _, s, _ in logs["move"] if s == 200)  # noqa: E731
        paced(fl, B, mover, 1, 40, logs["move"], stop=lambda: admitted() >= 30 and logs["move"][-1][2] == 429,
              before=before)

    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(paced, fl, cell, hostile, 5, 40, logs["hostile"], before=before) for cell in (A, B)]
        jobs.append(pool.submit(move))
        for j in jobs:
            j.result()
    # Every request was sent inside one minute bucket (none in its last 2 s): the limit is per
    # sliding minute, so no window slides here. The last answer may come back after the
    # minute's end on a loaded machine; what counts is when it was sent.
    assert all(int((time.time() - (time.monotonic() - t)) // 60) == began for lg in logs.values() for t, *_ in lg)
    return {"hostile": logs["hostile"], "move": logs["move"], "moved_at": moved_at[0], "ids": (hid, mid)}


def test_rpm_30_at_two_entries_5_per_s_for_40_s_admits_at_most_33(fl, minute):
    log = minute["hostile"]
    ok = [served for _, _, s, served in log if s == 200]
    assert len(log) >= 100, len(log)  # the key asked for far more than its limit (400 at full pace)
    assert len(ok) <= cap(30), (len(ok), {c: ok.count(c) for c in (A, B)})
    # ... and it got its limit: the leases' rounding leaves at most a request per cell unused.
    assert len(ok) >= 30 - 2, (len(ok), {c: ok.count(c) for c in (A, B)})
    assert {s for _, _, s, _ in log} <= {200, 429}


def test_a_key_that_moves_cell_mid_minute_is_neither_over_admitted_nor_refused_under_its_limit(fl, minute):
    log = minute["move"]
    before = [s for t, _, s, _ in log if t < minute["moved_at"]]
    after = [(c, s, served) for t, c, s, served in log if t >= minute["moved_at"]]
    assert before == [200] * len(before) and len(before) >= 10, before
    assert {c for c, _, _ in after} == {B}
    admitted = len(before) + sum(1 for _, s, _ in after if s == 200)
    assert admitted <= cap(30), admitted
    assert admitted >= 30, (len(before), after)
    # Never refused while under its limit: when eu-west's share is in use before the ledger
    # has moved apac-jp's share over, the front door has apac-jp serve it (within its share).
    total = len(before)
    for _, s, _ in after:
        assert s == 200 or total >= 30, (total, after)
        total += s == 200
    # eu-west served it from its own share at once, and apac-jp only what eu-west's lacked.
    assert after[0] == (B, 200, B), after


def test_a_refusal_by_lease_is_marked_for_the_front_door_only_and_another_cell_serves(fl):
    fresh_minute(30)  # the counts below are one minute's: a minute that ends mid-test splits them
    limit = 30
    key, kid = make_key(fl, rpm=limit)
    direct = {"authorization": f"Bearer {key}"}

    def to_b(front: str):
        """A request to eu-west's own address, with ``front`` as its x-colocate-front."""
        return request(fl.cell(B).url, "POST", "/v1/chat/completions", body=CHAT, headers={**direct, "x-colocate-front": front})

    # Each cell's isolate serves the key once (from then on its syncs carry the key's lease) ...
    assert to_b("forged").status == 200 and call(fl, A, key).status == 200
    for c in (A, B):
        until(lambda c=c: view(fl, c, kid), lambda v: (v["own"] or [0, 0])[COUNTER["req"]] >= 1)
    # ... then 11 more from apac-jp's entry. apac-jp serves them while its lease lasts, and the
    # ledger leases the unused part toward it; but a round that saw eu-west's first request
    # before apac-jp's leased it toward eu-west (weighted by recent use), and then the front
    # door sends the rest there (a loaded machine's slower flush makes that round likelier).
    # Either way every one is served, each counted where it was served (x-colocate-cell).
    burst = send(fl, A, key, 11)
    assert [r.status for r in burst] == [200] * 11
    at_a = 1 + sum(r.headers["x-colocate-cell"] == A for r in burst)
    got = until(lambda: view(fl, B, kid), lambda v: peer("req")(v) >= at_a and lease("req")(v) != default_share(limit))
    assert peer("req")(got) == at_a and lease("req")(got) <= cap(limit) - at_a, (at_a, got)
    if at_a == 12:
        assert lease("req")(got) < default_share(limit), got  # the unused part leased toward apac-jp
    # To eu-west's own address, once its share is in use (the key still under its 30):
    # a client's own x-colocate-front, not eu-west's exchange token, gets a plain 429.
    statuses = []
    for _ in range(cap(limit)):  # bounded: eu-west's share is at most the cap
        statuses.append(to_b("forged"))
        if statuses[-1].status != 200:
            break
    no = statuses[-1]
    assert no.status == 429 and no.json()["error"]["code"] == "rate_limit_exceeded", [r.status for r in statuses]
    assert "x-colocate-lease" not in no.headers and "share" in no.json()["error"]["message"], (no.headers, no.body)
    # With eu-west's exchange token (what the front door holds), the same refusal is marked.
    res = to_b(SECRETS["PROBE_TOKEN"])
    assert res.status == 429 and res.headers.get("x-colocate-lease") == "elsewhere", (res.status, res.headers)
    # Through the front door from eu-west's entry: apac-jp serves it, within its share.
    res = call(fl, B, key)
    assert res.status == 200 and res.headers["x-colocate-cell"] == A, (res.status, res.body)


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


def test_leases_follow_the_key_and_never_sum_past_the_cap(fl):
    limit = 20
    fresh_minute(30)
    key, kid = make_key(fl, rpm=limit)
    assert [r.status for r in send(fl, A, key, 8)] == [200] * 8
    # The ledger moves the unused part toward what each cell has used: both leases and
    # what apac-jp used stay within the cap, and eu-west keeps a share to move to.
    got = {c: until(lambda c=c: view(fl, c, kid), lambda v: v["lease"] and v["lease"]["req"] != 11) for c in (A, B)}
    leases = {c: lease("req")(v) for c, v in got.items()}
    assert max(8, leases[A]) + leases[B] <= cap(limit) and leases[B] >= 1 and leases[A] > 11, leases
    res = call(fl, A, key)
    assert res.status == 200


# --- (e) the hot path ---------------------------------------------------------------------

def test_a_known_key_waits_0_ms_on_state_in_each_cell_while_exchanges_run(fl):
    key, kid = make_key(fl, rpm=100_000)
    for cell in (A, B):
        send(fl, cell, key, 3)  # the first request of a key in an isolate looks it up (a wait)
    waits = {A: [], B: []}
    for _ in range(25):
        for cell in (A, B):
            res = call(fl, cell, key)
            assert res.status == 200
            waits[cell].append(res.timing()["state"])
    assert waits == {A: [0] * 25, B: [0] * 25}, waits
    # ... and the exchange did run meanwhile: each cell sees the other's requests.
    for cell in (A, B):
        assert peer("req")(until(lambda c=cell: view(fl, c, kid), lambda v: peer("req")(v) >= 28)) >= 28, cell


# --- a deferred request counts once -------------------------------------------------------

def test_a_request_a_cell_deferred_is_counted_only_where_it_was_served(fl):
    key, kid = make_key(fl, rpm=1000)
    fl.cell(A).breaker("open")
    try:
        res = [fl.call("NRT", headers={"authorization": f"Bearer {key}"}) for _ in range(4)]
    finally:
        fl.cell(A).breaker(None)
    assert [(r.status, r.headers["x-colocate-cell"]) for r in res] == [(200, B)] * 4
    got = until(lambda: view(fl, B, kid), lambda v: (v["own"] or [0, 0])[COUNTER["req"]] >= 4)
    assert got["own"][COUNTER["req"]] == 4
    # A admitted each before answering "no pod" and took it back in the same batch: the key
    # is among A's changed counters (what the ledger reads) with 0 requests.
    def in_a():
        rows = request(fl.cell(A).url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).json()["rows"]
        return next((r for r in rows if r[EXCHANGE["key_id"]] == kid), None)

    row = until(in_a, lambda r: r is not None)
    assert row is not None and row[EXCHANGE["req"]] == 0 and row[EXCHANGE["prev_req"]] == 0, row
    assert peer("req")(until(lambda: view(fl, A, kid), lambda v: peer("req")(v) >= 4)) == 4


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


# --- a key whose lease the isolates forgot ---------------------------------------------------

def test_a_key_idle_past_its_isolates_memory_that_moves_cell_stays_within_the_cap(fl):
    """rpm 30, idle in both cells for longer than an isolate keeps a key's lease (SERVED_KEEP_MS,
    2 min: the module's earlier tests run meanwhile), then 10 requests/s to apac-jp's own address,
    then to eu-west's: eu-west's isolate admits the key on its floor share until its sync brings
    the lease the ledger cut meanwhile, so the fleet admits at most the cap in the minute."""
    key, _kid, made = fl.dormant
    time.sleep(max(0.0, made + 125 - time.monotonic()))
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


# --- (d) a cell down during the exchange ---------------------------------------------------

def test_a_cell_that_does_not_answer_is_skipped_and_the_others_keep_exchanging():
    with running_fleet((A, B, "us-east"), remember_ms=0, exchange_ms=EXCHANGE_MS, unreachable=("us-east",)) as f:
        key, kid = make_key(f, rpm=100_000)
        for cell in (A, B):
            send(f, cell, key, 1)  # held by each cell's isolate from now on
        waits = [call(f, A, key).timing()["state"] for _ in range(4)]
        got = until(lambda: view(f, B, kid), lambda v: peer("req")(v) >= 5)
        assert peer("req")(got) == 5, got
        waits += [call(f, B, key).timing()["state"] for _ in range(4)]
        assert waits == [0] * 8, waits  # the hot path does not notice the dead cell
        until(lambda: f.worker.log_text(), lambda t: "us-east (" in t)
        rounds = [json.loads(line) for line in f.worker.log_text().splitlines() if '"event":"fleet_exchange"' in line]
        assert rounds and any(any(s.startswith("us-east (") for s in r["skipped"]) for r in rounds), rounds[-3:]
        assert any(r["pulled"] > 0 for r in rounds)

