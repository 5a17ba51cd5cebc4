"""What the fleet's limits exchange costs, with many active keys (docs/fleet.md, "Limits across cells").

    .venv/bin/python -m bench.fleet_exchange [--keys 1000] [--seconds 10]

Two real cells and the front door in one workerd (``bench.front.fleet_worker``, the front
door benchmark's fleet), ``--keys`` keys replicated into both cells, each used once in each cell
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

import requests

from bench import harness
from bench.front import fleet_worker
from colocate import admin
from colocate.fleet.workerd import CF_BLOB_HEADER

CELLS = ("apac-jp", "eu-west")
COLO = {"apac-jp": "NRT", "eu-west": "FRA"}
DEADLINE_MS = 10_000


def server_timing(res: requests.Response) -> dict[str, float]:
    out = {}
    for part in res.headers.get("server-timing", "").split(","):
        name, *params = [p.strip() for p in part.strip().split(";")]
        if name:
            out[name] = next((float(p[4:]) for p in params if p.startswith("dur=")), 0.0)
    return out


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
    secrets = harness.Secrets.fresh()
    auth = {"authorization": f"Bearer {secrets.probe_token}"}
    http = requests.Session()
    with (
        harness.pods(1, 0, secrets.pod_token) as pod_urls,
        harness.pods(1, 0, None) as fallback,
        fleet_worker(pod_urls[0], fallback[0], secrets, DEADLINE_MS, regions=CELLS, remember_ms=0) as (w, urls),
    ):
        keys = []
        for i in range(args.keys):
            key = admin.new_key()
            row = admin.key_row(key, f"bench-{i}", rpm=1_000_000)
            for cell in CELLS:
                res = http.post(urls[cell] + "/_colocate/keys/replica", json=row, headers=auth, timeout=30)
                assert res.status_code == 201, res.text
            keys.append((key, row["id"]))

        def front(cell: str, key: str) -> requests.Response:
            return http.get(w.url + "/v1/models", timeout=30, headers={
                "authorization": f"Bearer {key}", CF_BLOB_HEADER: json.dumps({"colo": COLO[cell]})})

        states: Counter = Counter()

        def use(cell: str, key: str) -> None:
            res = requests.get(w.url + "/v1/models", timeout=30, headers={
                "authorization": f"Bearer {key}", CF_BLOB_HEADER: json.dumps({"colo": COLO[cell]})})
            assert res.status_code == 200, res.text

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kc: use(kc[1], kc[0][0]), [(k, c) for k in keys for c in CELLS]))
        # The first round after that carries every key; wait for it (bounded).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(r["pulled"] for r in rounds_of(w.log_text())) < len(CELLS) * args.keys:
            time.sleep(0.2)
        first_rounds = len(rounds_of(w.log_text()))
        url = urls["apac-jp"]
        counters = timed(lambda: len(http.get(url + "/_colocate/fleet/counters?since=0", headers=auth, timeout=30).content))
        sample = http.get(url + "/_colocate/fleet/counters?since=0", headers=auth, timeout=30).json()["rows"]
        body = {"rows": sample}
        peers = timed(lambda: (http.post(url + "/_colocate/fleet/peers", json=body, headers=auth, timeout=30),
                               len(json.dumps(body, separators=(",", ":"))))[1])
        # Steady traffic: random known keys at both cells, the router's state wait recorded.
        end = time.monotonic() + args.seconds
        sent = 0
        while time.monotonic() < end:
            key = random.choice(keys)[0]
            for cell in CELLS:
                states[server_timing(front(cell, key))["state"]] += 1
                sent += 1
        time.sleep(2.5)  # let the last round land before reading the log (not an assertion)
        rounds = rounds_of(w.log_text())
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
