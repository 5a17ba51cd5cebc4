"""Benchmark a pod's death under load: the sandbox with two pods, one killed with SIGKILL.

Runs the sandbox stack (a private copy of stacks/Pulumi.sandbox.yaml with pod.count 2, the
stand-in's compute time and worker.balance load, so both pods serve) on loopback, sends an open-loop load of routed requests with
a client key (bench/load.py), kills pod 1's process with SIGKILL after ``--kill-after``
seconds, and keeps the load on for ``--seconds`` in all. Reports the requests that
failed, the fallback's share, and p50/p99 before and after the kill (the first second
after it is the failover window: requests in flight to the dead pod are retried on the
other, or served by the fallback once the breaker opens).

Usage: .venv/bin/python -m bench.failover [--rate 40] [--seconds 12] [--kill-after 4]
       [--compute-ms 95] [--json PATH|-]
Exit: 0 done (no goal is enforced), 2 usage error or setup failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.load import Load
from colocate import stackfile
from colocate.admin import AdminClient, Target
from colocate.errors import ConfigError
from colocate.sandbox import supervisor
from colocate.sandbox.errors import SandboxError


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 2)


def window(results, latencies, lo: int, hi: int) -> dict:
    rs, ls = results[lo:hi], latencies[lo:hi]
    served = [r for r in rs if r[0] == 200]
    fallback = sum(1 for r in served if r[1] == "fallback")
    return {"requests": len(rs), "failed": len(rs) - len(served),
            "fallback_share": round(fallback / len(served), 4) if served else None,
            "p50_ms": pct(ls, 50), "p99_ms": pct(ls, 99), "backends": sorted({r[1] for r in served if r[1]})}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="colocate-failover-") as tmp:
        stacks = Path(tmp) / "stacks"
        stacks.mkdir()
        (stacks / "Pulumi.sandbox.yaml").write_text(stackfile.path_of("sandbox").read_text())
        # balance load: both pods serve, so the one killed had requests in flight (the bench's requests are
        # all alike, and the cells' default, prefix, keeps them on one pod below its load bound, perhaps not pod 1).
        stackfile.write_config("sandbox", {"pod": {"provider": "local", "computeMs": args.compute_ms, "count": 2},
                                           "worker.balance": "load"}, stacks)
        state_dir = Path(tmp) / "state"
        cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        try:
            key = AdminClient(Target(cell["worker_url"], cell["token"], "sandbox")).create_key("failover-bench")["key"]
            victim = next(p for p in cell["pods"] if p["index"] == 1)
            with Load(cell["worker_url"], key, args.rate, args.seconds + 30) as load:
                time.sleep(args.kill_after)
                killed_at = len(load.results)
                os.kill(victim["pid"], signal.SIGKILL)
                time.sleep(max(0.0, args.seconds - args.kill_after))
            results, latencies = list(load.results), list(load.latencies_ms)
        finally:
            supervisor.down(state_dir, quiet=True)
    failover_end = killed_at + int(args.rate)  # the first second after the kill
    before = window(results, latencies, 0, killed_at)
    if "pod-1" not in before["backends"]:
        raise SandboxError(f"pod 1 served none of the {killed_at} requests before its kill (served by "
                           f"{', '.join(before['backends']) or 'nothing'}): its death would measure nothing")
    return {
        "options": vars(args) | {"json": None},
        "before": before,
        "failover_first_second": window(results, latencies, killed_at, failover_end),
        "after": window(results, latencies, failover_end, len(results)),
        "total": window(results, latencies, 0, len(results)),
        "median_ms": round(statistics.median(latencies), 2) if latencies else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=40, help="requests per second (open loop)")
    p.add_argument("--seconds", type=float, default=12, help="how long the load runs in all")
    p.add_argument("--kill-after", type=float, default=4, help="seconds of load before pod 1 is killed")
    p.add_argument("--compute-ms", type=int, default=95, help="the stand-in pods' compute time")
    p.add_argument("--json", metavar="PATH|-", help="write the result as JSON")
    args = p.parse_args(argv)
    if not (0 < args.rate <= 200 and 0 < args.kill_after < args.seconds <= 120):
        print("failover: need 0 < --rate <= 200 and 0 < --kill-after < --seconds <= 120", file=sys.stderr)
        return 2
    try:
        out = run(args)
    except (ConfigError, SandboxError) as exc:
        print(f"failover: {exc}", file=sys.stderr)
        return exc.exit_code
    for name in ("before", "failover_first_second", "after", "total"):
        w = out[name]
        share = "-" if w["fallback_share"] is None else f"{100 * w['fallback_share']:.1f} %"
        print(f"{name:22} {w['requests']:5d} requests  {w['failed']:3d} failed  fallback {share:>7}  "
              f"p50 {w['p50_ms']} ms  p99 {w['p99_ms']} ms  served by {', '.join(w['backends'])}")
    harness.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
