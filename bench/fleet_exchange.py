"""What the fleet's limits exchange costs, with many active keys (docs/fleet.md, "Limits across cells").

    .venv/bin/python -m bench.fleet_exchange [--keys 1000] [--seconds 10]

Two real cells and the front door in one workerd (tests/support/fleet.py, the fleet the
tests run), ``--keys`` keys replicated into both cells, each used once in each cell
through the front door (so each cell has that many changed keys), then steady traffic on
random keys at both cells. Prints one JSON object:

- ``counters``: a cell's answer to ``GET /_colocate/fleet/counters?since=0`` with every key
  changed (bytes, ms; median of 5), and ``peers``: ``POST /_colocate/fleet/peers`` of as
  many rows (bytes, ms; median of 5), both over loopback from this process;
- ``rounds``: the ledger's own log lines (``fleet_exchange``: rows pulled and pushed, bytes
  in and out, ms per round), the first (every key changed) and the steady ones;
- ``state_ms``: the router's Server-Timing ``state`` for requests with known keys in
  both cells while the rounds ran (counts of each value).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from colocate import admin
from tests.support.fleet import running_fleet
from tests.support.workerd import auth, request

CELLS = ("apac-jp", "eu-west")
COLO = {"apac-jp": "NRT", "eu-west": "FRA"}


def rounds_of(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith('{"event":"fleet_exchange"')]


def timed(fn, n: int = 5) -> dict:
    sizes, ms = [], []
    for _ in range(n):
        t = time.perf_counter()
        size = fn()
        ms.append((time.perf_counter() - t) * 1000)
        sizes.append(size)
    return {"bytes": int(statistics.median(sizes)), "ms": round(statistics.median(ms), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    with running_fleet(CELLS, remember_ms=0, compute_ms=0) as f:
        keys = []
        for i in range(args.keys):
            key = admin.new_key()
            row = admin.key_row(key, f"bench-{i}", rpm=1_000_000)
            for c in f.cells:
                assert request(c.url, "POST", "/_colocate/keys/replica", body=row, headers=auth()).status == 201
            keys.append((key, row["id"]))
        states: Counter = Counter()

        def use(cell: str, key: str) -> None:
            res = f.call(COLO[cell], "GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
            assert res.status == 200, res.body

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kc: use(kc[1], kc[0][0]), [(k, c) for k in keys for c in CELLS]))
        # The first round after that carries every key; wait for it (bounded).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(r["pulled"] for r in rounds_of(f.worker.log_text())) < len(CELLS) * args.keys:
            time.sleep(0.2)
        first_rounds = len(rounds_of(f.worker.log_text()))
        url = f.cell("apac-jp").url
        counters = timed(lambda: len(request(url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).body))
        sample = request(url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).json()["rows"]
        body = {"rows": sample}
        peers = timed(lambda: (request(url, "POST", "/_colocate/fleet/peers", body=body, headers=auth()),
                               len(json.dumps(body, separators=(",", ":"))))[1])
        # Steady traffic: random known keys at both cells, the router's state wait recorded.
        end = time.monotonic() + args.seconds
        sent = 0
        while time.monotonic() < end:
            key = random.choice(keys)[0]
            for cell in CELLS:
                res = f.call(COLO[cell], "GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
                states[res.timing()["state"]] += 1
                sent += 1
        time.sleep(2.5)  # let the last round land before reading the log (not an assertion)
        rounds = rounds_of(f.worker.log_text())
        steady = rounds[first_rounds:]
        out = {
            "keys": args.keys, "cells": len(CELLS),
            "counters_since_0": {**counters, "rows": len(sample)},
            "peers_push": {**peers, "rows": len(sample)},
            "rounds_first": {"n": first_rounds, "pulled": sum(r["pulled"] for r in rounds[:first_rounds]),
                             "largest": max(rounds[:first_rounds], key=lambda r: r["pulled"], default=None)},
            "rounds_steady": {"n": len(steady), "requests": sent, "seconds": args.seconds,
                              "pulled_median": statistics.median([r["pulled"] for r in steady]) if steady else 0,
                              "bytes_in_median": statistics.median([r["bytes_in"] for r in steady]) if steady else 0,
                              "bytes_out_median": statistics.median([r["bytes_out"] for r in steady]) if steady else 0,
                              "ms_median": statistics.median([r["ms"] for r in steady]) if steady else 0,
                              "ms_max": max([r["ms"] for r in steady], default=0)},
            "state_ms": {str(k): v for k, v in sorted(states.items())},
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
