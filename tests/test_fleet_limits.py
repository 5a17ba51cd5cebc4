"""Fleet-wide limits: the front door's FleetLedger exchanges the cells' counters (real workerd).

Two real cells behind the front door (NRT reaches apac-jp, FRA reaches eu-west), each with
its own generation; the ledger pulls each cell's changed counters and pushes the others'
sums every ``exchangeMs`` (docs/fleet.md, "Limits across cells"). Every wait for the
exchange is a bounded poll of the cell's own view of its peers
(``GET /_colocate/fleet/peers?key=``), never a fixed sleep standing in for an assertion.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from colocate import admin
from colocate.payloads import COUNTER, EXCHANGE
from tests.support.fleet import Fleet, running_fleet
from tests.support.workerd import SECRETS, auth, request

pytestmark = pytest.mark.slow  # real workerd, two or three cells and the front door

A, B = "apac-jp", "eu-west"
COLO = {A: "NRT", B: "FRA"}
EXCHANGE_MS = 1000  # colocate:fleet.exchangeMs (the default)
STATE_TTL_MS = 2000  # colocate:worker.stateTtlMs (the default)
# The bound's delay D (docs/fleet.md): a cell's flush (min(TTL/2, 1 s)), one exchange period,
# the round itself (at most max(1 s, period): the ledger's timeout), the other cell's sync (TTL).
D_S = (min(STATE_TTL_MS / 2, 1000) + EXCHANGE_MS + max(1000, EXCHANGE_MS) + STATE_TTL_MS) / 1000
CONVERGE_S = 10 * D_S  # how long a poll may wait on a loaded machine (bounded)


@pytest.fixture(scope="module")
def fl() -> Fleet:
    with running_fleet((A, B), remember_ms=0, exchange_ms=EXCHANGE_MS) as f:
        yield f


def make_key(f: Fleet, **limits) -> tuple[str, str]:
    """A key replicated into every cell (as keys.py does): (key, id)."""
    key = admin.new_key()
    row = admin.key_row(key, "limits", **limits)
    for c in f.cells:
        res = request(c.url, "POST", "/_colocate/keys/replica", body=row, headers=auth())
        assert res.status == 201, res.body
    return key, row["id"]


def call(f: Fleet, cell: str, key: str, method: str = "POST", path: str = "/v1/chat/completions"):
    res = f.call(COLO[cell], method, path, headers={"authorization": f"Bearer {key}"})
    if res.status == 200:
        assert res.headers["x-colocate-cell"] == cell
    return res


def view(f: Fleet, cell: str, key_id: str) -> dict:
    """What a cell's generation holds of a key: own counters, the peers' row, their sum."""
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


def fresh_minute(need_s: float) -> None:
    """Start a phase with at least ``need_s`` left in this UTC minute, so rpm windows do
    not slide under the assertions (a bounded wait of at most ``need_s``)."""
    left = 60 - time.time() % 60
    if left < need_s:
        time.sleep(left + 0.2)


def send(f: Fleet, cell: str, key: str, n: int) -> list:
    return [call(f, cell, key) for _ in range(n)]


# --- (a) rpm ------------------------------------------------------------------------------

def test_rpm_used_in_one_cell_is_counted_in_the_other(fl):
    limit = 20
    fresh_minute(40)
    key, kid = make_key(fl, rpm=limit)
    assert [r.status for r in send(fl, A, key, limit // 2)] == [200] * (limit // 2)
    got = until(lambda: view(fl, B, kid), lambda v: peer("req")(v) >= limit // 2)
    assert peer("req")(got) == limit // 2 and got["counts"][COUNTER["req"]] == limit // 2, got
    # B admits what is left of the fleet's limit, then refuses in OpenAI's shape. Its
    # isolate never served the key, so its look-up carries the peers: no per-cell slack.
    statuses = [r.status for r in send(fl, B, key, limit)]
    admitted = statuses.count(200)
    assert admitted <= limit - limit // 2, statuses
    assert admitted == limit - limit // 2 and statuses[admitted:] == [429] * (limit - admitted), statuses
    refused = call(fl, B, key)
    err = refused.json()["error"]
    assert refused.status == 429 and err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert refused.headers["x-colocate-cell"] == B and int(refused.headers["retry-after"]) >= 1
    # And back: A learns of B's half and refuses too (its own isolate holds the key: the
    # peers reach it with its next background sync, within the state TTL).
    until(lambda: view(fl, A, kid), lambda v: peer("req")(v) >= limit - limit // 2)
    assert until(lambda: call(fl, A, key).status, lambda s: s == 429, 5 * STATE_TTL_MS / 1000) == 429


# --- (b) monthly tokens -------------------------------------------------------------------

def test_a_monthly_budget_used_up_in_one_cell_is_refused_in_the_other(fl):
    budget = 100
    key, kid = make_key(fl, monthly_tokens=budget)
    statuses = [call(fl, A, key).status for _ in range(12)]
    assert 429 in statuses and statuses.index(429) > 0, statuses  # served until the budget was used
    month = COUNTER["month_tokens"]
    used = until(lambda: view(fl, A, kid)["own"] or [0] * len(COUNTER), lambda o: o[month] >= budget)[month]
    assert used >= budget
    got = until(lambda: view(fl, B, kid), lambda v: peer("month_tokens")(v) >= budget)
    assert peer("month_tokens")(got) == used, got
    res = call(fl, B, key)
    assert res.status == 429 and res.json()["error"]["code"] == "insufficient_quota", res.body


# --- (c) the overshoot bound --------------------------------------------------------------

def test_both_cells_at_once_overshoot_at_most_the_documented_bound(fl):
    limit = 10
    fresh_minute(40)
    key, kid = make_key(fl, rpm=limit)
    stamps: dict[str, list[tuple[float, float, int]]] = {A: [], B: []}

    def burst(cell: str) -> None:
        for _ in range(2 * limit):
            t0 = time.monotonic()
            status = call(fl, cell, key).status
            stamps[cell].append((t0, time.monotonic(), status))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(burst, [A, B]))
    admitted = {c: [s for s in stamps[c] if s[2] == 200] for c in stamps}
    total = sum(len(v) for v in admitted.values())
    # Per cell, one isolate each here: a cell alone never passes the limit.
    assert all(len(v) <= limit for v in admitted.values()), {c: len(v) for c, v in admitted.items()}
    # The fleet bound: the cell i that admitted last knew every admission elsewhere older
    # than D, so total <= L + what the other cells admitted in the D before i's last one.
    last = max(((c, s) for c, v in admitted.items() for s in v), key=lambda cs: cs[1][1])
    cell_i, (sent_i, _, _) = last
    unseen = sum(1 for c, v in admitted.items() if c != cell_i for s in v if s[1] >= sent_i - D_S)
    assert total <= limit + unseen, (total, unseen, {c: len(v) for c, v in admitted.items()})
    assert total <= 2 * limit  # N cells x L at worst
    # Once the exchange has carried both sides, neither cell admits more this minute.
    until(lambda: view(fl, A, kid), lambda v: peer("req")(v) >= len(admitted[B]))
    until(lambda: view(fl, B, kid), lambda v: peer("req")(v) >= len(admitted[A]))
    for cell in (A, B):
        assert until(lambda c=cell: call(fl, c, key).status, lambda s: s == 429, 5 * STATE_TTL_MS / 1000) == 429


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
    for body, field in (({"rows": "x"}, '"rows"'), ({"rows": [], "extra": 1}, '"extra"')):
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
    first = request(url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).json()
    assert first["generation"] == f"{A}.g1" and first["cursor"] >= len(first["rows"]) > 0
    again = request(url, "GET", f"/_colocate/fleet/counters?since={first['cursor']}", headers=auth()).json()
    assert again["rows"] == [] or all(r[0] for r in again["rows"])
    assert json.dumps(first).count(SECRETS["PROBE_TOKEN"]) == 0


# --- (d) a cell down during the exchange ---------------------------------------------------

def test_a_cell_that_does_not_answer_is_skipped_and_the_others_keep_exchanging():
    with running_fleet((A, B, "us-east"), remember_ms=0, exchange_ms=EXCHANGE_MS, unreachable=("us-east",)) as f:
        limit = 10
        fresh_minute(40)
        key, kid = make_key(f, rpm=limit)
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

