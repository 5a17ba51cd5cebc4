"""What the fleet-limits tests share: two cells' names and entry colos, the exchange's timings,
and bounded polls of a cell's view of a key (tests/test_fleet_limits.py, tests/test_fleet_exchange.py)."""

from __future__ import annotations

import time

from colocate import admin
from colocate.cell.payloads import COUNTER
from tests.support.fleet import Fleet
from tests.support.workerd import auth, request

CHAT = {"model": "client/model", "messages": [{"role": "user", "content": "hi"}]}

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


def peer_requests(v: dict) -> int:
    """The peers row's requests across a minute's turn (this minute's plus the last): a count
    read after a turn a loaded machine put mid-test is still whole."""
    return peer("req")(v) + peer("prev_req")(v)


def own_requests(v: dict) -> int:
    """This cell's own requests of the key, across a minute's turn as ``peer_requests``."""
    row = v["own"] or [0] * len(COUNTER)
    return row[COUNTER["req"]] + row[COUNTER["prev_req"]]


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
