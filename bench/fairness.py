"""Fair share: one key's flood against another key's latency, with and without max_parallel.

    .venv/bin/python -m bench.fairness                 # 200 connections, max_parallel 4, 10 s a phase

The plan's Worker in workerd, in front of one bench pod that works on at most --slots
requests at once, --delay-ms each (a GPU pod's batch). Three phases, each --seconds long:

    idle       key B alone, one request at a time: its p50 on an idle cell
    unlimited  key A floods with --connections connections (no max_parallel), B as before
    limited    key C floods the same way with max_parallel = --max-parallel, B as before

    limited_backoff   the same flood honouring Retry-After: 1, as OpenAI's SDKs do
    defaults   key D floods as in `limited`, made with no limits named: the cell's
               colocate:keys.defaults (out of the box: max_parallel 8, rpm 3000, ...)

In `limited` the flood does not honour Retry-After (a hostile client re-sends at once), so
the router answers thousands of 429s a second on one workerd thread. Reported: B's p50/p99
per phase, the ratio to idle (goal: limited <= 1.5), and the flood's counts per status.
The flood's client processes run under `nice -n 19`: they share this machine's cores with
the cell they attack, which a remote attacker does not.
Loopback only; every loop stops after its phase.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time

from bench.harness import Secrets, bench_plan, pods
from colocate.cell import plan as plan_mod
from colocate.workerd import Workerd

FLOOD_PROCESSES = 2  # the flood's client processes (threads in each)
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def call(conn_box: list, port: int, key: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        if conn_box[0] is None:
            conn_box[0] = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn_box[0].request("POST", "/v1/chat/completions", body=BODY,
                            headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        r = conn_box[0].getresponse()
        r.read()
        status = r.status
    except (OSError, http.client.HTTPException):
        if conn_box[0] is not None:
            conn_box[0].close()
        conn_box[0] = None
        status = 0
    return status, (time.perf_counter() - t0) * 1000


def measured(port: int, key: str, until: float) -> list[float]:
    """Key B: one request at a time until ``until``; latencies of its 200s (ms)."""
    box, out = [None], []
    while time.monotonic() < until:
        status, ms = call(box, port, key)
        if status == 200:
            out.append(ms)
        time.sleep(0.02)
    return out


def flood(port: int, key: str, until: float, counts: dict, lock: threading.Lock, backoff: bool) -> None:
    box = [None]
    while time.monotonic() < until:
        status, _ = call(box, port, key)
        with lock:
            counts[status] = counts.get(status, 0) + 1
        if backoff and status == 429:
            time.sleep(1.0)  # Retry-After: 1, as OpenAI's SDKs honour it


def flood_process(port: int, connections: int, seconds: float, backoff: bool) -> None:
    """The flood, in its own process (so its threads do not hold the measuring thread's
    GIL): the key comes on stdin, the status counts go to stdout as JSON."""
    key = sys.stdin.readline().strip()
    until = time.monotonic() + seconds
    counts: dict = {}
    lock = threading.Lock()
    threads = [
        threading.Thread(target=flood, args=(port, key, until, counts, lock, backoff), daemon=True) for _ in range(connections)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    print(json.dumps(counts))


def phase(port: int, b_key: str, flood_key: str | None, connections: int, seconds: float, backoff: bool = False) -> dict:
    until = time.monotonic() + seconds
    counts: dict = {}
    procs = []
    if flood_key:
        per = -(-connections // FLOOD_PROCESSES)
        for i in range(FLOOD_PROCESSES):
            n = min(per, connections - i * per)
            if n <= 0:
                break
            # niced: on this machine the flood's own client CPU would otherwise starve the cell it
            # attacks, which a remote attacker's CPU does not.
            proc = subprocess.Popen(
                [
                    "nice",
                    "-n",
                    "19",
                    sys.executable,
                    "-m",
                    "bench.fairness",
                    "--flood-port",
                    str(port),
                    "--connections",
                    str(n),
                    "--seconds",
                    str(seconds),
                ]
                + (["--flood-backoff"] if backoff else []),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            proc.stdin.write(flood_key + "\n")
            proc.stdin.close()
            procs.append(proc)
        time.sleep(min(1.0, seconds / 5))  # the flood is under way before B is measured
    lat = measured(port, b_key, until)
    for proc in procs:
        out = proc.stdout.read()
        proc.wait(timeout=seconds + 60)
        for k, v in json.loads(out or "{}").items():
            counts[int(k)] = counts.get(int(k), 0) + v
    s = sorted(lat)

    def p(q: float) -> float | None:
        return round(s[min(len(s) - 1, int(q * len(s)))], 1) if s else None

    return {
        "b_requests": len(s),
        "b_p50_ms": p(0.5),
        "b_p99_ms": p(0.99),
        "flood": {str(k): v for k, v in sorted(counts.items())},
    }


# Keys with no limit but the one measured (colocate:keys.defaults would otherwise apply).
NO_LIMITS = {"rpm": 0, "tpm": 0, "monthly_tokens": 0, "max_parallel": 0, "max_parallel_tokens": 0}


def mint(port: int, probe: str, body: dict) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/_colocate/keys", body=json.dumps(body), headers={"authorization": f"Bearer {probe}",
                                                                        "content-type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    if r.status != 201:
        raise RuntimeError(f"minting a key failed: {r.status} {data}")
    return data["key"]


def run(opts: argparse.Namespace, log=print) -> dict:
    secrets = Secrets.fresh()
    plan = bench_plan(10_000)
    with pods(1, opts.delay_ms, secrets.pod_token, slots=opts.slots) as urls, \
            Workerd.serve(plan.worker, {"POD_URLS": plan_mod.pod_urls_text(urls), "fallbackUrl": urls[0],
                                        **secrets.bindings()}) as w:
        b = mint(w.port, secrets.probe_token, {"name": "measured", **NO_LIMITS})
        a = mint(w.port, secrets.probe_token, {"name": "flood-unlimited", **NO_LIMITS})
        c = mint(w.port, secrets.probe_token, {"name": "flood-limited", **NO_LIMITS, "max_parallel": opts.max_parallel})
        d = mint(w.port, secrets.probe_token, {"name": "flood-defaults"})  # colocate:keys.defaults
        out = {"connections": opts.connections, "max_parallel": opts.max_parallel, "pod_delay_ms": opts.delay_ms,
               "pod_slots": opts.slots, "seconds": opts.seconds}
        log("idle ...")
        out["idle"] = phase(w.port, b, None, 0, opts.seconds)
        log("flood, no max_parallel ...")
        out["unlimited"] = phase(w.port, b, a, opts.connections, opts.seconds)
        log(f"flood, max_parallel {opts.max_parallel} ...")
        out["limited"] = phase(w.port, b, c, opts.connections, opts.seconds)
        log(f"flood, max_parallel {opts.max_parallel}, the flood honouring Retry-After ...")
        out["limited_backoff"] = phase(w.port, b, c, opts.connections, opts.seconds, backoff=True)
        log("flood, a key with the cell's default limits ...")
        out["defaults"] = phase(w.port, b, d, opts.connections, opts.seconds)
    out["key_defaults"] = {b.name: b.text for b in plan.worker.bindings if b.name.startswith("DEFAULT_")}
    idle = out["idle"]["b_p50_ms"]
    for name in ("unlimited", "limited", "limited_backoff", "defaults"):
        p50 = out[name]["b_p50_ms"]
        out[name]["ratio_to_idle"] = round(p50 / idle, 2) if p50 and idle else None
    out["goal_met"] = out["limited"]["ratio_to_idle"] is not None and out["limited"]["ratio_to_idle"] <= 1.5
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=200, help="the flood's concurrent connections")
    p.add_argument("--max-parallel", type=int, default=4, help="the limited flood key's max_parallel")
    p.add_argument("--delay-ms", type=float, default=95.0, help="the pod's compute per request")
    p.add_argument("--slots", type=int, default=8, help="requests the pod works on at once")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--flood-port", type=int, help=argparse.SUPPRESS)  # internal: run as one flood process
    p.add_argument("--flood-backoff", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.flood_port:
        flood_process(opts.flood_port, opts.connections, opts.seconds, opts.flood_backoff)
        return 0
    if not (1 <= opts.connections <= 1000 and opts.max_parallel >= 1 and opts.slots >= 1 and 1 <= opts.seconds <= 120):
        p.error("--connections 1..1000, --max-parallel >= 1, --slots >= 1, --seconds 1..120")
    result = run(opts, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(result, indent=2))
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
