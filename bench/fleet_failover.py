"""Benchmark a cell losing all its pods under load, through the fleet's front door.

One workerd runs two cells (apac-jp, eu-west: the router, the cloud's bytes) and the front
door over them (colocate/fleet/plan.py's plan, its bytes); each cell has its own stand-in pod
(colocate.pods.standin, ``--compute-ms`` per request) and one stand-in plays the paid
fallback API. Two client keys (one fleet key each, made once and imported into both
cells as `keys.py --stack <fleet>` does) send an open-loop load of ``--rate`` requests/s in
all, as if from Tokyo (``cf-blob: {"colo": "NRT"}``), so apac-jp serves first. After
``--fault-after`` seconds apac-jp's only pod fails in the way ``--mode`` says:

    error   answers every request 500 (a crashed model server behind a live proxy)
    down    its port closes (the machine is gone: connection refused)
    hang    accepts and never answers (a wedged GPU): each request costs the cell's deadline

Reported: failed requests (anything but a 200), how many the fallback answered, and p50/p99
of the requests answered before the fault, of the switch (the requests in flight at the
fault and those started in the ``--window`` seconds after it), and after; the
added p99 of the switch against the cell's deadline (the goal: 0 failed and added
p99 <= one deadline; reported, not enforced).

Usage: .venv/bin/python -m bench.fleet_failover [--mode error,down,hang] [--rate 30]
       [--seconds 10] [--fault-after 3] [--window 3] [--compute-ms 20] [--deadline-ms 2000] [--json PATH|-]
Exit: 0 done, 2 usage error or setup failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from bench import harness
from bench.front import fleet_worker
from bench.load import Load
from colocate.admin import AdminClient, Target, key_row, new_key
from colocate.fleet.workerd import CF_BLOB_HEADER
from colocate.pods import standin

REGIONS = ("apac-jp", "eu-west")
COLO = "NRT"
MODES = ("error", "down", "hang")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 1)


def window(rows: list[tuple], lo: float, hi: float, done_by: float | None = None) -> dict:
    """Requests that started in [lo, hi) s after the load began (and, with ``done_by``,
    had their answer by then): rows are (start_s, ms, status, backend, cell)."""
    rs = [r for r in rows if lo <= r[0] < hi and (done_by is None or r[0] + r[1] / 1000 < done_by)]
    ok = [r for r in rs if r[2] == 200]
    cells: dict[str, int] = {}
    for r in ok:
        cells[r[4] or "?"] = cells.get(r[4] or "?", 0) + 1
    return {"requests": len(rs), "failed": len(rs) - len(ok), "fallback": sum(1 for r in ok if r[3] == "fallback"),
            "p50_ms": pct([r[1] for r in rs], 50), "p99_ms": pct([r[1] for r in rs], 99), "served_by": cells}


def one_mode(mode: str, opts) -> dict:
    secrets = harness.Secrets.fresh()
    with contextlib.ExitStack() as stack:
        fb = stack.enter_context(standin.serve(compute_ms=opts.compute_ms, token=None, name="fallback"))
        pods = {r: stack.enter_context(standin.serve(compute_ms=opts.compute_ms, token=secrets.pod_token, name=f"pod-{r}"))
                for r in REGIONS}
        w, urls = stack.enter_context(fleet_worker({r: p.url for r, p in pods.items()}, fb.url, secrets,
                                                   opts.deadline_ms, regions=REGIONS, remember_ms=5000))
        keys = []
        for i in range(2):  # two clients: a breaker opens on failures seen from two keys (docs/worker.md)
            key = new_key()
            row = key_row(key, f"failover-{i}")
            for r in REGIONS:
                AdminClient(Target(urls[r], secrets.probe_token, r)).import_key(row)
            keys.append(key)
        hdr = {CF_BLOB_HEADER: json.dumps({"colo": COLO})}
        loads = [Load(w.url, k, opts.rate / 2, opts.seconds + 60, headers=hdr) for k in keys]
        fallback_before = fb.requests
        with contextlib.ExitStack() as running:
            t_start = time.monotonic()
            for ld in loads:
                running.enter_context(ld)
            time.sleep(opts.fault_after)
            t_fault = time.monotonic()
            if mode == "down":
                # A hang on a stopped stand-in closes each kept-alive connection at once,
                # unanswered; with the port closed too, that is a process that died.
                pods["apac-jp"].set_fault("hang")
                pods["apac-jp"].stop()
            else:
                pods["apac-jp"].set_fault(mode)
            time.sleep(max(0.0, opts.seconds - opts.fault_after))
        rows = []
        for ld in loads:
            rows += [(t0 - t_start, ms, res[0], res[1], cell)
                     for t0, ms, res, cell in zip(ld.started, ld.latencies_ms, ld.results, ld.cells, strict=True)]
        fallback_answers = fb.requests - fallback_before
    f = t_fault - t_start
    # Before: answered before the fault. The switch: everything else that started by the
    # window's end, including the requests in flight when the pod failed.
    before = window(rows, 0, f, done_by=f)
    switch = window([r for r in rows if r[0] + r[1] / 1000 >= f], 0, f + opts.window)
    added = None if before["p99_ms"] is None or switch["p99_ms"] is None else round(switch["p99_ms"] - before["p99_ms"], 1)
    return {"mode": mode, "fault_at_s": round(f, 2), "before": before, "switch": switch,
            "after": window(rows, f + opts.window, float("inf")), "total": window(rows, 0, float("inf")),
            "fallback_answers": fallback_answers, "added_p99_ms": added,
            "goal": {"failed": 0, "added_p99_ms_at_most": opts.deadline_ms,
                     "met": sum(1 for r in rows if r[2] != 200) == 0 and added is not None and added <= opts.deadline_ms}}


def render(result: dict) -> str:
    o = result["options"]
    lines = [f"a cell losing its only pod under {o['rate']:g} req/s from {COLO}, through the front door "
             f"(apac-jp then eu-west; deadline {o['deadline_ms']} ms, pods {o['compute_ms']:g} ms; one workerd, loopback)",
             f"{'mode':>6} {'window':>8} {'requests':>9} {'failed':>7} {'fallback':>9} {'p50 ms':>8} {'p99 ms':>8}  served by"]
    for m in result["modes"]:
        for name in ("before", "switch", "after"):
            s = m[name]
            by = ", ".join(f"{c} {n}" for c, n in sorted(s["served_by"].items()))
            lines.append(f"{m['mode']:>6} {name:>8} {s['requests']:>9} {s['failed']:>7} {s['fallback']:>9} "
                         f"{s['p50_ms']!s:>8} {s['p99_ms']!s:>8}  {by}")
        lines.append(f"{'':>6} added p99 in the switch: {m['added_p99_ms']} ms (goal <= {o['deadline_ms']} ms); "
                     f"failed {m['total']['failed']}; the fallback answered {m['fallback_answers']}: "
                     f"goal {'met' if m['goal']['met'] else 'missed'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_failover", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--rate", type=float, default=30, help="requests per second in all (open loop)")
    p.add_argument("--seconds", type=float, default=10, help="how long the load runs")
    p.add_argument("--fault-after", type=float, default=3, help="seconds of load before the pod fails")
    p.add_argument("--window", type=float, default=3, help="the switch window: seconds after the fault")
    p.add_argument("--compute-ms", type=float, default=20, help="the stand-in pods' time per request")
    p.add_argument("--deadline-ms", type=int, default=2000, help="the cells' colocate:worker.deadlineMs")
    p.add_argument("--json", metavar="PATH|-", help="write the result as JSON")
    p.add_argument("--quiet", action="store_true")
    opts = p.parse_args(argv)
    modes = tuple(m.strip() for m in opts.mode.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--mode: {', '.join(bad) or opts.mode!r} is not one of {', '.join(MODES)}. Fix: e.g. --mode error,hang")
    if not (0 < opts.rate <= 200 and 0 < opts.fault_after < opts.seconds <= 120 and opts.window > 0):
        p.error("need 0 < --rate <= 200, 0 < --fault-after < --seconds <= 120 and --window > 0")
    harness.check_args(p, [("--compute-ms", opts.compute_ms, 0), ("--deadline-ms", opts.deadline_ms, 1)])
    log = harness.progress(opts.quiet)

    def compute() -> dict:
        harness.require_node()
        out = []
        for m in modes:
            log(f"mode {m}: {opts.seconds:g} s of load, the pod fails at {opts.fault_after:g} s")
            out.append(one_mode(m, opts))
        return {"options": {k: v for k, v in vars(opts).items() if k not in ("json", "quiet")},
                "versions": harness.versions(), "modes": out}

    if opts.json == "-":
        return harness.report("bench.fleet_failover", compute, json.dumps, None)
    return harness.report("bench.fleet_failover", compute, render, None if opts.json is None else Path(opts.json))


if __name__ == "__main__":
    sys.exit(main())
