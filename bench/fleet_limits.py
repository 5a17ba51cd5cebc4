"""How close a key's limit holds across the fleet's cells, by lease (docs/fleet.md, "Limits across cells").

    .venv/bin/python -m bench.fleet_limits [--seconds 50] [--idle] [--json PATH|-]
    .venv/bin/python -m bench.fleet_limits --move RPM     # one key moving cell: how its lease follows

Three real cells (apac-jp, eu-west, us-east) and the front door in one workerd
(bench/front.py's fleet, the kit's default exchange period and state TTL), users at NRT,
FRA and IAD (each served by its own cell). Every case is one key with one limit, sent
through the front door at a fixed rate split over two or three cells, in fixed proportions
or shifting (all of the key's traffic moves to the next cell every ``--seconds``/4 s). The
cases run side by side inside one UTC minute, so no rpm or tpm window slides during a
case. Each key is used once in every cell two minutes before (so each cell's isolate holds
it, including a cell the front door tries for a case that does not send there: a known
key's requests are what ``state`` measures), and a key with no limit keeps every isolate
warm until the end.

Prints, per case: the limit, the cells and pattern, the rate asked (x the limit), what was
admitted (requests, or tokens for tpm and monthly tokens), admitted / limit, the refusals
while the key was under its limit (a 429 answered while what the fleet had admitted of the
key, plus that request, was still within L), the admitted requests another cell than the
user's served (the front door's retry: one more cell call and that cell's distance), and
the routers' Server-Timing ``state`` p99 over the case's requests. ``--idle``: the keys are left
idle until every isolate has forgotten their counters and leases (state.js SERVED_KEEP_MS), and
the cases send to the cells' own addresses (no front door to retry elsewhere): a key coming back
to a cell that cut its lease meanwhile. Exit 0; 2 on a setup failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import requests

from bench import harness
from bench.front import fleet_worker
from colocate import admin
from colocate.fleet.workerd import CF_BLOB_HEADER

CELLS = ("apac-jp", "eu-west", "us-east")
COLO = {"apac-jp": "NRT", "eu-west": "FRA", "us-east": "IAD"}
DEADLINE_MS = 10_000
TOKENS = 8  # what bench/pod.mjs answers per chat completion


@dataclass
class Case:
    name: str
    limit: str  # rpm | tpm | monthly_tokens
    value: int
    per_min: float  # requests a minute the key sends, over all its cells
    cells: tuple[str, ...]
    split: tuple[float, ...] | None  # fixed proportions; None: shifting (all to one cell, moving)

    @property
    def asked(self) -> float:
        """The rate asked, as a multiple of the limit (tokens for tpm and monthly tokens)."""
        per = TOKENS if self.limit != "rpm" else 1
        return self.per_min * per / self.value


CASES = [
    Case("rpm 10, 2 cells 50/50, 20x", "rpm", 10, 200, CELLS[:2], (0.5, 0.5)),
    Case("rpm 10, 3 cells shifting, 0.6x", "rpm", 10, 6, CELLS, None),
    Case("rpm 30, 2 cells 50/50, 20x", "rpm", 30, 600, CELLS[:2], (0.5, 0.5)),
    Case("rpm 30, 3 cells 60/30/10, 4x", "rpm", 30, 120, CELLS, (0.6, 0.3, 0.1)),
    Case("rpm 30, 3 cells shifting, 2x", "rpm", 30, 60, CELLS, None),
    Case("rpm 600, 2 cells 70/30, 1.5x", "rpm", 600, 900, CELLS[:2], (0.7, 0.3)),
    Case("rpm 600, 3 cells shifting, 2x", "rpm", 600, 1200, CELLS, None),
    Case("rpm 600, 3 cells even, 0.5x", "rpm", 600, 300, CELLS, (1 / 3, 1 / 3, 1 / 3)),
    Case("tpm 400, 2 cells 50/50, 4x", "tpm", 400, 200, CELLS[:2], (0.5, 0.5)),
    Case("monthly 800 tokens, 3 cells even, used up", "monthly_tokens", 800, 180, CELLS, (1 / 3, 1 / 3, 1 / 3)),
]


def state_ms(res: requests.Response) -> float:
    for part in res.headers.get("server-timing", "").split(","):
        name, *params = [p.strip() for p in part.strip().split(";")]
        if name == "state":
            return next((float(p[4:]) for p in params if p.startswith("dur=")), 0.0)
    return 0.0


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def front_call(front_url: str, key: str, cell: str, limit: str) -> requests.Response:
    """One request of ``key`` through the front door from ``cell``'s users' colo: a model list
    for an rpm case (no tokens), else a chat completion (its tokens count)."""
    headers = {"authorization": f"Bearer {key}", CF_BLOB_HEADER: json.dumps({"colo": COLO[cell]})}
    if limit == "rpm":
        return requests.get(front_url + "/v1/models", headers=headers, timeout=30)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return requests.post(front_url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def keys_for(urls: dict, auth: dict, name: str, limits: dict, cells: tuple[str, ...] = CELLS) -> tuple[str, str]:
    """A key made here and imported into every cell (as keys.py does): (key, id)."""
    key = admin.new_key()
    row = admin.key_row(key, name, **limits)
    for cell in cells:
        res = requests.post(urls[cell] + "/_colocate/keys/replica", json=row, headers=auth, timeout=30)
        if res.status_code != 201:
            raise harness.BenchError(f"{cell} refused the key: {res.status_code} {res.text}")
    return key, row["id"]


IDLE_S = 125  # past state.js SERVED_KEEP_MS (120 s): every isolate has forgotten the keys' leases


def run(seconds: float, log=lambda _m: None, idle: bool = False) -> list[dict]:
    secrets = harness.Secrets.fresh()
    auth = {"authorization": f"Bearer {secrets.probe_token}"}
    with (
        harness.pods(1, 0, secrets.pod_token) as pod_urls,
        harness.pods(1, 0, None) as fallback,
        fleet_worker(pod_urls[0], fallback[0], secrets, DEADLINE_MS, regions=CELLS, remember_ms=0) as (w, urls),
    ):
        def call(key: str, cell: str, limit: str) -> requests.Response:
            if idle and limit == "rpm":  # the cell's own address
                return requests.get(urls[cell] + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)
            return front_call(w.url, key, cell, limit)

        keys = [keys_for(urls, auth, f"bench-limits-{i}", {case.limit: case.value}) for i, case in enumerate(CASES)]
        # Each cell's isolate learns each key (a look-up), and the ledger tells every cell the fleet's size.
        # Every cell, not only the case's: the front door may send a request to any of them.
        for key, _ in keys:
            for cell in CELLS:
                call(key, cell, "rpm")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            told = [requests.get(urls[c] + f"/_colocate/fleet/peers?key={keys[0][1]}", headers=auth, timeout=30).json()
                    .get("fleet_cells") for c in CELLS]
            if told == [len(CELLS)] * len(CELLS):
                break
            time.sleep(0.2)
        else:
            raise harness.BenchError("the ledger did not reach every cell within 30 s")
        # One more key with no limit, used at every cell twice a second from now to the end:
        # the isolates stay warm while the run waits for the minute (an idle isolate's first
        # request waits on a sync, which is not what `state` measures here).
        warm, _ = keys_for(urls, auth, "bench-limits-warm", {})
        done = threading.Event()

        def keep_warm() -> None:
            while not done.is_set():
                for cell in CELLS:
                    call(warm, cell, "rpm")
                done.wait(0.5)

        keeper = threading.Thread(target=keep_warm, daemon=True)
        keeper.start()
        # The look-ups above counted against the keys' limits: start in the minute after the
        # next, so they are out of every case's sliding window too.
        left = 120 - time.time() % 60
        if idle:  # then the next minute's start
            left = IDLE_S + (60 - (time.time() + IDLE_S) % 60)
        log(f"waiting {left:.0f} s for the minute after the next to start")
        time.sleep(left + 0.3)
        minute = int(time.time() // 60)
        results: dict[str, dict[str, Any]] = {c.name: {"ok": 0, "tokens": 0, "sent": 0, "under": 0, "state": [],
                                              "codes": {}, "away": 0} for c in CASES}
        lock = threading.Lock()
        start = time.monotonic()

        def sender(case: Case, key: str, cell: str, share: float | None) -> None:
            r = results[case.name]
            if share is not None:
                per_s = case.per_min * share / 60
                slots = None
            else:  # shifting: all of the traffic, in this cell's quarter of the run
                per_s = case.per_min / 60
                mine = case.cells.index(cell)
                slots = [(q * seconds / 4, (q + 1) * seconds / 4) for q in range(4) if q % len(case.cells) == mine]
            i = 0
            while True:
                t = time.monotonic() - start
                if t >= seconds:
                    return
                if slots is not None and not any(a <= t < b for a, b in slots):
                    nxt = [a for a, _ in slots if a > t]
                    if not nxt:
                        return
                    time.sleep(nxt[0] - t)
                    continue
                due = i / per_s if slots is None else None
                if due is not None and due > t:
                    time.sleep(due - t)
                res = call(key, cell, case.limit)
                i += 1
                with lock:
                    r["sent"] += 1
                    r["codes"][res.status_code] = r["codes"].get(res.status_code, 0) + 1
                    r["state"].append(state_ms(res))
                    if res.status_code == 200:
                        r["ok"] += 1
                        r["away"] += res.headers.get("x-colocate-cell", cell) != cell
                        if case.limit != "rpm":
                            r["tokens"] += res.json()["usage"]["total_tokens"]
                    elif res.status_code == 429:
                        so_far, cost = (r["ok"], 1) if case.limit == "rpm" else (r["tokens"], TOKENS)
                        r["under"] += so_far + cost <= case.value
                if slots is not None:
                    time.sleep(max(0.0, 1 / per_s - (time.monotonic() - start - t)))

        threads = []
        for case, (key, _) in zip(CASES, keys, strict=True):
            for j, cell in enumerate(case.cells):
                share = case.split[j] if case.split else None
                threads.append(threading.Thread(target=sender, args=(case, key, cell, share), daemon=True))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done.set()
        keeper.join()
        if int(time.time() // 60) != minute:
            raise harness.BenchError("the run crossed a minute boundary (a loaded machine): rerun with a smaller --seconds")
        out = []
        for case in CASES:
            r = results[case.name]
            admitted = r["ok"] if case.limit == "rpm" else r["tokens"]
            out.append({"case": case.name, "limit": case.limit, "value": case.value, "asked_x": round(case.asked, 2),
                        "sent": r["sent"], "admitted": admitted, "admitted_over_limit": round(admitted / case.value, 3),
                        "refused_under_limit": r["under"], "elsewhere": r["away"], "state_p99_ms": p99(r["state"]),
                        "codes": r["codes"]})
        return out


def move(limit: int, seconds: float = 40.0, log=lambda _m: None) -> dict:
    """A key that moves cell at its limit's pace (``--move``): 3 requests through apac-jp's
    entry, 8 s idle, then one every 60 / limit s (at least 1 s apart) through eu-west's
    for ``seconds``; each cell's lease of the key every ~7 s (the cell's own view), when
    eu-west's first reaches 75 % and 90 % of the limit, and the refusals (each under the
    limit here: the key never sends faster than its limit)."""
    secrets = harness.Secrets.fresh()
    auth = {"authorization": f"Bearer {secrets.probe_token}"}
    a, b = CELLS[0], CELLS[1]
    with (
        harness.pods(1, 0, secrets.pod_token) as pod_urls,
        harness.pods(1, 0, None) as fallback,
        fleet_worker(pod_urls[0], fallback[0], secrets, DEADLINE_MS, regions=(a, b), remember_ms=0) as (w, urls),
    ):
        def call(key: str, cell: str) -> int:
            return front_call(w.url, key, cell, "rpm").status_code

        def lease(cell: str, kid: str) -> int | None:
            got = requests.get(urls[cell] + f"/_colocate/fleet/peers?key={kid}", headers=auth, timeout=30).json()
            return (got.get("lease") or {}).get("req") if got.get("fleet_cells") == 2 else None

        key, kid = keys_for(urls, auth, "bench-move", {"rpm": limit}, cells=(a, b))
        deadline = time.monotonic() + 30
        while lease(a, kid) is None or lease(b, kid) is None:  # the ledger has told both cells the fleet's size
            if time.monotonic() > deadline:
                raise harness.BenchError("the ledger did not reach both cells within 30 s")
            call(key, a)
            time.sleep(0.5)
        for _ in range(3):
            call(key, a)
            time.sleep(1)
        time.sleep(8)
        log(f"leases before the move: {a} {lease(a, kid)}, {b} {lease(b, kid)}")
        every = max(1.0, 60 / limit)
        start = time.monotonic()
        timeline: list[tuple[float, int | None, int | None]] = []
        reached: dict[float, float] = {}
        refused = sent = 0
        while (t := time.monotonic() - start) < seconds:
            refused += call(key, b) == 429
            sent += 1
            la, lb = lease(a, kid), lease(b, kid)
            for frac in (0.75, 0.9):
                if frac not in reached and lb is not None and lb >= frac * limit:
                    reached[frac] = round(t, 1)
            if not timeline or t - timeline[-1][0] >= 7:
                timeline.append((round(t, 1), la, lb))
            time.sleep(max(0.0, start + sent * every - time.monotonic()))
        return {"limit": limit, "sent": sent, "refused": refused, "reached_s": reached, "timeline": timeline}


def render_move(r: dict) -> str:
    steps = "  ".join(f"{t:.0f}s {la}/{lb}" for t, la, lb in r["timeline"])
    reached = ", ".join(f"{int(f * 100)} % after {s} s" for f, s in sorted(r["reached_s"].items())) or "neither 75 % nor 90 %"
    return (f"rpm {r['limit']}: leases apac-jp/eu-west as the key moved  {steps}\n"
            f"eu-west's lease: {reached}; {r['sent']} requests sent to it, {r['refused']} refused")


def render(rows: list[dict]) -> str:
    lines = [f"{'case':44} {'sent':>5} {'admitted':>9} {'admitted/L':>10} {'refused<L':>9} {'elsewhere':>9} {'state p99':>9}"]
    for r in rows:
        lines.append(f"{r['case']:44} {r['sent']:>5} {r['admitted']:>9} {r['admitted_over_limit']:>10.3f}"
                     f" {r['refused_under_limit']:>9} {r['elsewhere']:>9} {r['state_p99_ms']:>6.0f} ms")
    worst = max(r["admitted_over_limit"] for r in rows)
    lines.append(f"worst admitted/L {worst:.3f} (bound 1.10); state p99 {max(r['state_p99_ms'] for r in rows):.0f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=50.0, help="how long every case sends (inside one minute, at most 55)")
    ap.add_argument("--json", help="also write the rows as JSON to PATH (- for stdout)")
    ap.add_argument("--move", type=int, metavar="RPM", help="instead: one key with this rpm moving cell (move())")
    ap.add_argument("--idle", action="store_true",
                    help="keys idle past the isolates' memory of them, rpm cases to the cells' own addresses")
    args = ap.parse_args(argv)
    if args.move is not None and args.move < 10:
        print(f"--move {args.move}: give an rpm of at least 10 (75 % of it must be a whole request)", file=sys.stderr)
        return 2
    if args.move is None and not 4 <= args.seconds <= 55:
        print(f"--seconds must be 4..55 so the run fits in one minute (got {args.seconds})", file=sys.stderr)
        return 2
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        got: Any = move(args.move, log=log) if args.move is not None else run(args.seconds, log=log, idle=args.idle)
    except harness.BenchError as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    print(render_move(got) if args.move is not None else render(got))
    harness.write_json(args.json, got, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
