"""Fleet-wide rpm by lease: the front door's FleetLedger apportions each key's limits (real workerd).

Two real cells behind the front door (NRT reaches apac-jp, FRA reaches eu-west), each with
its own generation; every ``exchangeMs`` the ledger pulls each cell's changed counters and
pushes each cell its leases (its share of each key's rpm, tpm and monthly tokens) with the
others' sums (docs/fleet.md, "Limits across cells"). Here: a key's requests per minute spread
over entries or moved between them, the hot path, a deferred request, a refusal by lease and
leases following a key; the month's budget, a forgotten lease, the exchange's endpoints and a
silent cell are in tests/test_fleet_exchange.py. Every wait for the exchange is a bounded poll
of the cell's own view of a key (``GET /_colocate/fleet/peers?key=``), never a fixed sleep
standing in for an assertion.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from colocate.cell.payloads import COUNTER, EXCHANGE
from tests.support.fleet import Fleet, running_fleet
from tests.support.fleet_limits import (
    CHAT,
    EXCHANGE_MS,
    A,
    B,
    call,
    cap,
    default_share,
    lease,
    make_key,
    own_requests,
    paced,
    peer,
    peer_requests,
    send,
    told,
    until,
    view,
)
from tests.support.minutes import fresh_minute
from tests.support.workerd import SECRETS, auth, request

pytestmark = pytest.mark.slow  # real workerd, two cells and the front door


@pytest.fixture(scope="module")
def fl() -> Fleet:
    with running_fleet((A, B), remember_ms=0, exchange_ms=EXCHANGE_MS) as f:
        told(f)
        yield f


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
        # cut to what it had used while eu-west's had not grown yet (docs/fleet.md, "How the ledger apportions").
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


# The hot path and a deferred request need no minute of their own: they run in what is left of the
# minute above, before the refusal's test waits for a fresh one.

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
        assert peer_requests(until(lambda c=cell: view(fl, c, kid), lambda v: peer_requests(v) >= 28)) >= 28, cell


# --- a deferred request counts once -------------------------------------------------------

def test_a_request_a_cell_deferred_is_counted_only_where_it_was_served(fl):
    key, kid = make_key(fl, rpm=1000)
    fl.cell(A).breaker("open")
    try:
        res = [fl.call("NRT", headers={"authorization": f"Bearer {key}"}) for _ in range(4)]
    finally:
        fl.cell(A).breaker(None)
    assert [(r.status, r.headers["x-colocate-cell"]) for r in res] == [(200, B)] * 4
    assert own_requests(until(lambda: view(fl, B, kid), lambda v: own_requests(v) >= 4)) == 4
    # A admitted each before answering "no pod" and took it back in the same batch: the key
    # is among A's changed counters (what the ledger reads) with 0 requests.
    def in_a():
        rows = request(fl.cell(A).url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).json()["rows"]
        return next((r for r in rows if r[EXCHANGE["key_id"]] == kid), None)

    row = until(in_a, lambda r: r is not None)
    assert row is not None and row[EXCHANGE["req"]] == 0 and row[EXCHANGE["prev_req"]] == 0, row
    assert peer_requests(until(lambda: view(fl, A, kid), lambda v: peer_requests(v) >= 4)) == 4


# --- a refusal by lease ---------------------------------------------------------------------

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
