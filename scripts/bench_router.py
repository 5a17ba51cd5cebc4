#!/usr/bin/env python3
"""Benchmark the router's overhead: requests through the Worker (in workerd) against
requests straight to the local stand-in pod, on loopback, with no emulated delay.

For each concurrency level (default 1 and 32 clients) the same request
(``POST /v1/chat/completions``, non-streaming) is sent directly to the pod and then
through the Worker, each run bounded by ``--requests`` and ``--max-seconds``. Reports
the added latency (p50, p99: Worker minus direct), the throughput ratio (Worker /
direct), and the Worker's own ``state`` Server-Timing p50 (0 ms on the hot path).

The pod runs as its own process (``python -m colocate.pods.standin``) and workerd as
another, so the load generator's threads do not share a GIL with the pod.

State object far away: ``--far-state-ms MS`` runs the Worker with the state object
MS ms of round trip away, through the sandbox's delay
(``colocate.sandbox.bench.router_with_state_delay``; only that hop is delayed).

Usage: .venv/bin/python scripts/bench_router.py [--requests 2000] [--max-seconds 20]
       [--concurrency 1,32] [--compute-ms 1] [--json PATH|-] [--far-state-ms MS]
Exit: 0 done (targets are reported, not enforced), 2 usage error or setup failure.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import plan as plan_mod  # noqa: E402
from colocate import settings as settings_mod  # noqa: E402
from colocate import stackfile  # noqa: E402
from colocate.errors import ConfigError  # noqa: E402
from colocate.workerd import Workerd, WorkerdError  # noqa: E402

TARGETS = {"added_p50_ms": 1.0, "throughput_ratio": 0.8, "state_p50_ms": 0.0}
BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
# Bench-only values: generated per run, never printed.
POD_TOKEN = os.urandom(12).hex()
SECRETS = {"POD_TOKEN": POD_TOKEN, "FALLBACK_API_KEY": os.urandom(12).hex(), "PROBE_TOKEN": os.urandom(12).hex()}


class UsageError(Exception):
    pass


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _timing(header: str | None) -> dict[str, float]:
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        if name and "dur=" in rest:
            out[name] = float(rest.split("dur=", 1)[1])
    return out


def run_load(url: str, concurrency: int, requests: int, max_seconds: float, token: str | None) -> dict:
    """``concurrency`` clients, each on one keep-alive connection, until ``requests``
    are done or ``max_seconds`` have passed."""
    host, port = url.split("//", 1)[1].split(":")
    lock = threading.Lock()
    issued = [0]
    lat: list[float] = []
    state: list[float] = []
    backends: dict[str, int] = {}
    errors = [0]
    stop_at = 0.0
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"

    ready = threading.Barrier(concurrency + 1)

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            # Connect before the clock starts: a burst of 32 connects overflows a small
            # listen backlog and measures SYN retransmits, not the router.
            with contextlib.suppress(OSError):
                conn.connect()
            ready.wait(timeout=30)
            while time.monotonic() < stop_at:
                with lock:
                    if issued[0] >= requests:
                        return
                    issued[0] += 1
                t = time.perf_counter()
                try:
                    conn.request("POST", "/v1/chat/completions", body=BODY, headers=headers)
                    res = conn.getresponse()
                    res.read()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = http.client.HTTPConnection(host, int(port), timeout=30)
                    with lock:
                        errors[0] += 1
                    continue
                ms = (time.perf_counter() - t) * 1000
                st = _timing(res.getheader("server-timing")).get("state")
                with lock:
                    if res.status != 200:
                        errors[0] += 1
                        continue
                    lat.append(ms)
                    if st is not None:
                        state.append(st)
                    b = res.getheader("x-colocate-backend") or "direct"
                    backends[b] = backends.get(b, 0) + 1
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    stop_at = time.monotonic() + max_seconds  # set before the barrier lets the clients go
    ready.wait(timeout=30)
    t0 = time.perf_counter()
    for th in threads:
        th.join(timeout=max_seconds + 60)
    elapsed = time.perf_counter() - t0
    return {
        "n": len(lat), "errors": errors[0], "seconds": round(elapsed, 3),
        "rps": round(len(lat) / elapsed, 1) if elapsed > 0 else 0.0,
        "p50_ms": round(percentile(lat, 50), 3), "p99_ms": round(percentile(lat, 99), 3),
        "state_p50_ms": round(percentile(state, 50), 3) if state else None,
        "state_p99_ms": round(percentile(state, 99), 3) if state else None,
        "backends": backends,
    }


@contextlib.contextmanager
def standin_process(compute_ms: float) -> Iterator[str]:
    env = {**os.environ, "POD_TOKEN": POD_TOKEN}
    # The stand-in writes headers and body in two sends; without TCP_NODELAY, Nagle plus
    # the client's delayed ACK adds ~40 ms to every answer, on both paths, hiding the
    # router's overhead. The stdlib knob turns it off for this run only.
    code = ("import sys; from colocate.pods import standin; standin._Handler.disable_nagle_algorithm = True; "
            "sys.exit(standin.main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--host", "127.0.0.1", "--port", "0",
                             "--compute-ms", str(compute_ms), "--name", "pod"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise UsageError("the stand-in pod did not start")
        yield json.loads(line)["url"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def bench_plan(deadline_ms: int):
    raw, secrets = stackfile.read_config("sandbox")
    raw["worker"] = {**(raw.get("worker") or {}), "deadlineMs": deadline_ms}
    s = settings_mod.parse(raw, "sandbox", secrets=set(secrets) | set(settings_mod.ALWAYS_SECRET))
    return plan_mod.plan_cell(s)


@contextlib.contextmanager
def router(plan, values: dict, far_state_ms: float | None) -> Iterator[str]:
    if far_state_ms is None:
        with Workerd.serve(plan.worker, values) as w:
            yield w.url
        return
    # The state object far away: the sandbox delays only the Worker -> object hop.
    from colocate.sandbox.bench import router_with_state_delay

    with router_with_state_delay(plan, values, far_state_ms) as url:
        yield url


def _state_distance(worker_url: str, samples: int = 5) -> dict:
    """Where the object is and what a forced round trip to it costs (the probe endpoint)."""
    rtts, colo = [], None
    with requests.Session() as s:
        for _ in range(samples):
            body = s.get(worker_url + "/_colocate/probe", timeout=30,
                         headers={"Authorization": f"Bearer {SECRETS['PROBE_TOKEN']}"}).json()
            rtts.append(body["state_rtt_ms"])
            colo = body["state_colo"]
    return {"state_colo": colo, "state_rtt_p50_ms": round(percentile(rtts, 50), 2)}


def bench(args) -> dict:
    levels = []
    with standin_process(args.compute_ms) as pod_url, standin_process(0) as fallback_url:
        cell_plan = bench_plan(args.deadline_ms)
        values = {"POD_URLS": plan_mod.pod_urls_text([pod_url]), "FALLBACK_URL": fallback_url, **SECRETS}
        with router(cell_plan, values, args.far_state_ms) as worker_url:
            # Warm both paths (isolate, connection pools, the object's first touch).
            run_load(pod_url, 2, 50, 10, POD_TOKEN)
            run_load(worker_url, 2, 50, 10, None)
            far = _state_distance(worker_url) if args.far_state_ms is not None else None
            for c in args.concurrency:
                direct = run_load(pod_url, c, args.requests, args.max_seconds, POD_TOKEN)
                via = run_load(worker_url, c, args.requests, args.max_seconds, None)
                levels.append({
                    "concurrency": c, "direct": direct, "worker": via,
                    "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 3),
                    "added_p99_ms": round(via["p99_ms"] - direct["p99_ms"], 3),
                    "throughput_ratio": round(via["rps"] / direct["rps"], 3) if direct["rps"] else None,
                })
    checks = []
    for lv in levels:
        checks.append({"concurrency": lv["concurrency"], "added_p50_ok": lv["added_p50_ms"] <= TARGETS["added_p50_ms"],
                       "throughput_ok": (lv["throughput_ratio"] or 0) >= TARGETS["throughput_ratio"],
                       "state_ok": lv["worker"]["state_p50_ms"] == TARGETS["state_p50_ms"]})
    return {"compute_ms": args.compute_ms, "requests_per_run": args.requests, "max_seconds": args.max_seconds,
            "far_state_ms": args.far_state_ms, "far_state": far, "cpus": os.cpu_count(), "targets": TARGETS, "levels": levels,
            "checks": checks}


def table(result: dict) -> str:
    rows = [f"router overhead on loopback (pod compute {result['compute_ms']} ms, {result['cpus']} CPUs, "
            f"far state: {result['far_state_ms'] or 'no'})"
            + (f"\nstate object at {result['far_state']['state_colo']}, forced round trip p50 "
               f"{result['far_state']['state_rtt_p50_ms']} ms" if result.get("far_state") else ""),
            f"{'clients':>7} {'path':>7} {'n':>6} {'errors':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'state p50':>9}"]
    for lv in result["levels"]:
        for name in ("direct", "worker"):
            r = lv[name]
            st = "" if r["state_p50_ms"] is None else f"{r['state_p50_ms']:.1f}"
            rows.append(f"{lv['concurrency']:>7} {name:>7} {r['n']:>6} {r['errors']:>6} {r['rps']:>8.1f} {r['p50_ms']:>8.2f} "
                        f"{r['p99_ms']:>8.2f} {st:>9}")
        rows.append(f"{'':>7} added p50 {lv['added_p50_ms']:+.2f} ms, p99 {lv['added_p99_ms']:+.2f} ms, "
                    f"throughput {lv['throughput_ratio']:.0%} of direct")
    for c in result["checks"]:
        rows.append(f"targets @ {c['concurrency']} clients: added p50 <= 1 ms {'ok' if c['added_p50_ok'] else 'MISSED'}, "
                    f"throughput >= 80% {'ok' if c['throughput_ok'] else 'MISSED'}, "
                    f"state p50 = 0 {'ok' if c['state_ok'] else 'MISSED'}")
    return "\n".join(rows)


def _levels(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency: {text!r} is not a comma-separated list of whole numbers") from None
    if not out or any(c < 1 or c > 256 for c in out):
        raise argparse.ArgumentTypeError(f"--concurrency: {text!r}: use whole numbers 1..256, e.g. 1,32")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_router.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests per run (default 2000)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per run (default 20)")
    p.add_argument("--concurrency", type=_levels, default=[1, 32], help="client counts (default 1,32)")
    p.add_argument("--compute-ms", type=float, default=1.0, help="stand-in pod compute per request (default 1)")
    p.add_argument("--deadline-ms", type=int, default=5000, help="DEADLINE_MS for the run (default 5000)")
    p.add_argument("--json", help="write the result as JSON to PATH, or - for stdout (table then on stderr)")
    p.add_argument("--far-state-ms", type=float, default=None, help="the state object this many ms of round trip away (sandbox delay)")
    args = p.parse_args(argv)
    for name, value, low in (("--requests", args.requests, 1), ("--max-seconds", args.max_seconds, 0.1),
                             ("--compute-ms", args.compute_ms, 0), ("--deadline-ms", args.deadline_ms, 1)):
        if value < low:
            p.error(f"{name} must be at least {low} (got {value})")
    try:
        result = bench(args)
    except (UsageError, ConfigError, WorkerdError) as exc:
        print(f"bench_router: {exc}", file=sys.stderr)
        return 2
    text = table(result)
    if args.json == "-":
        print(text, file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
