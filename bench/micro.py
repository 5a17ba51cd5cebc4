"""What single hot-path operations cost inside workerd: bench/micro.js runs one of them N
times on one request, and the workerd process's CPU time (/proc) around that request,
less an empty request's, divided by N, is its cost. CPU time, not wall time, so a loaded
machine moves it little; the median of ``--repeat`` requests per operation.

Usage: .venv/bin/python -m bench.micro [--n 200000] [--repeat 5] [--ops url,cut,...]
Exit: 0 done, 2 setup failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import urllib.request

from colocate.workerd import WorkerdError

from . import harness

OPS = ("url", "cut", "salt", "saltcached", "headers", "record", "parse", "usage", "upstream", "timing", "histogram",
       "eventscan", "eventcut")


def cost_ns(url: str, pid: int, op: str, n: int) -> float:
    def spent(count: int) -> float:
        before = harness.cpu_seconds(pid)
        with urllib.request.urlopen(f"{url}/v1/chat/completions?op={op}&n={count}", timeout=300) as r:
            r.read()
        return harness.cpu_seconds(pid) - before

    spent(n // 10)  # the JIT settles on this operation
    return (spent(n) - spent(0)) * 1e9 / n


def run(ops: tuple[str, ...], n: int, repeat: int) -> dict:
    plan = harness.bench_plan(5000)
    modules = ("routes.js", "forward.js", "body.js", "validate.js", "usage.js", "timing.js", "histogram.js", "podstream.js")
    with harness.floor_worker(lambda port: harness.floor_config(plan.worker.compatibility_date, "micro.js", {}, port,
                                                                modules)) as w:
        return {op: statistics.median(cost_ns(w.url, w.process.pid, op, n) for _ in range(repeat)) for op in ops}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="operations per request (default 200000)")
    p.add_argument("--repeat", type=int, default=5, help="requests per operation; the median is reported (default 5)")
    p.add_argument("--ops", default=",".join(OPS), help=f"which, of {','.join(OPS)}")
    args = p.parse_args(argv)
    ops = tuple(o for o in args.ops.split(",") if o)
    if any(o not in OPS for o in ops):
        p.error(f"--ops {args.ops!r}: use some of {','.join(OPS)}")
    harness.check_args(p, (("--n", args.n, 1000), ("--repeat", args.repeat, 1)))
    try:
        got = run(ops, args.n, args.repeat)
    except (harness.BenchError, WorkerdError) as exc:
        print(f"bench.micro: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"CPU per operation inside workerd, median of {args.repeat} requests of {args.n:,} operations each")
    for op, ns in got.items():
        print(f"{op:>11} {ns:9.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
