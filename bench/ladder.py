"""Where the contract's cost goes: bare, then one piece of colocate's contract at a time,
then the contract floor and the router, all at one client count and interleaved.

    bare        bench/passthrough.js: fetch(pod) and return
    credential  + the pod's credential instead of the client's   (bench/ladder.js)
    headers     + the two contract headers on a new Response     (bench/ladder.js)
    deadline    + a deadline timer around the fetch              (bench/ladder.js)
    contract    + the JS hop-header filter, both bodies held      (bench/contract.js)
    router      the plan's Worker (keys, limits, metering, breaker, pod choice)

Beside the climb, run here and counted by bench/instructions.py when named in --rungs (EXTRA):

    ends          bare + the runtime's pipe that tells a stream's end  (bench/ends.js)
    held-request  credential + the request body read whole, sent as bytes (bench/ladder.js)
    held-answer   credential + the answer read whole, returned as bytes   (bench/ladder.js)
    held-both     credential + both                                       (bench/ladder.js)
    parse-bytes   credential + the body as bytes, decoded, parsed, sent on (bench/ladder.js)
    parse-text    credential + the body as text, parsed, sent on as text   (bench/ladder.js)

Each rung is its own workerd process; CPU per request comes from its /proc/<pid>/stat
around each load run. Reported per rung: req/s and CPU µs per request (medians over
rounds), and CPU and throughput against bare (medians of per-round ratios, so a noisy
round moves every rung alike). Imports no Pulumi.

Usage: .venv/bin/python -m bench.ladder [--rounds 8] [--seconds 2] [--clients 32] [--json PATH]
           [--rungs bare,...] [--pods 1] [--pod-delay-ms 0] [--request json|stream|usage]

--request stream|usage runs bench/sse.mjs instead of wrk and adds each rung's time to first
byte, and its median per-round difference from bare's.

Exit: 0 done, 2 setup failure (wrk or node missing, a process not starting).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from colocate.cell import plan as plan_mod

from . import harness

RUNGS = ("bare", "credential", "headers", "deadline", "contract", "router")
# Not steps of the climb, measured beside it: bare plus the runtime's pipe that tells a
# Worker when a stream has ended (bench/ends.js), the price of balancing several pods; and
# credential plus one held body, or both (bench/ladder.js), the price of retries and metering.
EXTRA = ("ends", "held-request", "held-answer", "held-both", "parse-bytes", "parse-text")


def _floor_config(rung: str, compat: str, pod_urls: list[str], pod_token: str, port: int) -> str:
    if rung == "bare":
        return harness.bare_config(compat, pod_urls, port)
    if rung == "contract":
        return harness.contract_config(compat, pod_urls, pod_token, 5000, port)
    if rung == "ends":
        return harness.floor_config(compat, "ends.js", {"POD_URLS": plan_mod.pod_urls_text(pod_urls)}, port)
    bindings = {"POD_URLS": plan_mod.pod_urls_text(pod_urls), "POD_TOKEN": pod_token, "RUNG": rung}
    return harness.floor_config(compat, "ladder.js", bindings, port)


@contextlib.contextmanager
def started(under: Mapping[str, Sequence[str]] | None = None, rungs: Sequence[str] = RUNGS,
            worker_src: Path | None = None, pod_count: int = 1, chunks: int = 8,
            pod_delay_ms: float = 0.0, deadline_ms: int = 5000) -> Iterator[tuple[dict, dict]]:
    """Each rung in ``rungs`` in its own workerd, all behind the same ``pod_count`` bench
    pods (streams of ``chunks`` events, each answer ``pod_delay_ms`` late): yields
    ({rung: Workerd}, {rung: request headers}).
    ``under``: Workerd's ``launcher`` and ``v8_flags`` (bench/instructions.py);
    ``worker_src``: the router's modules from another directory (a candidate cut);
    ``deadline_ms``: the router's deadline and stall limit (colocate:worker.deadlineMs)."""
    unknown = [r for r in rungs if r not in RUNGS + EXTRA]
    if unknown:
        raise harness.BenchError(f"unknown rung {unknown[0]!r}: use one of {', '.join(RUNGS + EXTRA)}")
    plan = harness.bench_plan(deadline_ms, worker_src)
    compat = plan.worker.compatibility_date
    secrets = harness.Secrets.fresh()
    with contextlib.ExitStack() as stack:
        pod_urls = stack.enter_context(harness.pods(pod_count, pod_delay_ms, secrets.pod_token, chunks=chunks))
        fallback = stack.enter_context(harness.pods(1, 0, None))
        pods_text = plan_mod.pod_urls_text(pod_urls)
        workers, headers = {}, {}
        for rung in rungs:
            if rung == "router":
                values = {"POD_URLS": pods_text, "FALLBACK_URL": fallback[0], **secrets.bindings()}
                workers[rung] = stack.enter_context(harness.router_worker(plan, values, None, under))
            else:
                workers[rung] = stack.enter_context(harness.floor_worker(
                    lambda port, rung=rung: _floor_config(rung, compat, pod_urls, secrets.pod_token, port), under))
        # Every rung but bare gets the client's request, with its client key, as the router gets it.
        routed = harness.router_headers(harness.mint_key(workers["router"].url, secrets.probe_token)
                                        if "router" in workers else "clc_" + "x" * 32)
        for rung in rungs:  # bare and ends forward the request as it comes: the pod's token
            headers[rung] = harness.direct_headers(secrets.pod_token) if rung in ("bare", "ends") else routed
        if "router" in workers:
            harness.check_router(workers["router"].url, routed, timeout_s=deadline_ms / 1000 + 30)
        yield workers, headers


REQUESTS = tuple(harness.KINDS)  # json (a chat completion), stream, usage (a stream that asks for its usage)


def load(url: str, clients: int, seconds: float, headers: Mapping[str, str], request: str) -> dict:
    """One closed-loop run: wrk for chat completions, bench/sse.mjs (bounded by ``seconds``)
    for streams, which also times each answer's first byte."""
    if request == "json":
        return harness.wrk_run(url, clients, seconds, headers)
    return harness.sse_run(url, clients, 10**6, seconds, headers, usage=request == "usage")


def run(rounds: int, seconds: float, clients: int, rungs: Sequence[str] = RUNGS, pod_count: int = 1,
        request: str = "json", log=lambda _m: None, pod_delay_ms: float = 0.0) -> dict:
    harness.require_tools()
    with started(rungs=rungs, pod_count=pod_count, pod_delay_ms=pod_delay_ms) as (workers, headers):
        for rung in rungs:  # warm, and every rung must answer 200 (wrk counts other statuses as errors)
            warm = load(workers[rung].url, clients, 1, headers[rung], request)
            if warm["errors"] or not warm["n"]:
                raise harness.BenchError(f"rung {rung}: {warm['errors']} errors in {warm['n']} answers of the warm-up run")
        per: dict[str, list[dict]] = {r: [] for r in rungs}
        for i in range(rounds):
            for rung in harness.rotated(tuple(rungs), i):
                w = workers[rung]
                per[rung].append(
                    harness.measured(w.proc.pid, lambda w=w, rung=rung: load(w.url, clients, seconds, headers[rung], request))
                )
            log(f"round {i + 1}/{rounds}: " + ", ".join(f"{r} {per[r][-1]['cpu_us_per_req']} us" for r in rungs))
    out: dict[str, Any] = {"clients": clients, "rounds": rounds, "seconds": seconds, "pods": pod_count, "request": request,
           "pod_delay_ms": pod_delay_ms, "machine": harness.versions(), "rungs": []}
    bare = per["bare"]
    for rung in rungs:
        rs = per[rung]
        row = {
            "rung": rung, "rps": harness.median(x["rps"] for x in rs),
            "cpu_us_per_req": harness.median(x["cpu_us_per_req"] for x in rs),
            "errors": sum(x["errors"] for x in rs),
            "cpu_vs_bare": harness.median(x["cpu_us_per_req"] / b["cpu_us_per_req"] for x, b in zip(rs, bare, strict=True)),
            "throughput_vs_bare": harness.median(x["rps"] / b["rps"] for x, b in zip(rs, bare, strict=True)),
        }
        if request != "json":
            row["ttfb_p50_ms"] = harness.median(x["ttfb_p50_ms"] for x in rs)
            row["ttfb_added_ms"] = harness.median(x["ttfb_p50_ms"] - b["ttfb_p50_ms"] for x, b in zip(rs, bare, strict=True))
        out["rungs"].append(row)
    return out


def table(result: dict) -> str:
    m = result["machine"]
    streams = result["request"] != "json"
    rows = [f"cost ladder at {result['clients']} clients, {result['request']} requests, {result['pods']} pod(s)"
            + (f" answering {result['pod_delay_ms']:g} ms late" if result.get("pod_delay_ms") else "") + " "
            f"({m['workerd']}, {m['cpus']} CPUs, load {m['loadavg_at_start'][0]:.1f} "
            f"at start; {result['rounds']} rounds x {result['seconds']:g} s, medians)",
            f"{'rung':>12} {'req/s':>8} {'cpu us/req':>10} {'cpu/bare':>9} {'req/s /bare':>11} {'errors':>6}"
            + (f" {'ttfb ms':>8} {'ttfb +ms':>8}" if streams else "")]
    for r in result["rungs"]:
        rows.append(f"{r['rung']:>12} {r['rps']:>8.0f} {r['cpu_us_per_req']:>10.1f} {r['cpu_vs_bare']:>9.3f} "
                    f"{r['throughput_vs_bare']:>11.3f} {r['errors']:>6}"
                    + (f" {r['ttfb_p50_ms']:>8.3f} {r['ttfb_added_ms']:>+8.3f}" if streams else ""))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.ladder", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rungs", default=",".join(RUNGS),
                   help=f"comma-separated, bare first, of {','.join(RUNGS + EXTRA)} (default: the climb, {','.join(RUNGS)})")
    p.add_argument("--pods", type=int, default=1, help="bench pods behind every rung, taken in turn (default 1)")
    p.add_argument("--pod-delay-ms", type=float, default=0.0, help="the bench pods answer after this long (default 0)")
    p.add_argument("--request", choices=REQUESTS, default="json",
                   help="chat completions under wrk (json, default), or streams under bench/sse.mjs, which also "
                        "reports time to first byte: stream, or usage (a stream that asks for its usage)")
    p.add_argument("--json", type=Path, help="also write the result as JSON")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    harness.check_args(p, (("--rounds", args.rounds, 1), ("--seconds", args.seconds, 1), ("--clients", args.clients, 1),
                           ("--pods", args.pods, 1), ("--pod-delay-ms", args.pod_delay_ms, 0)))
    rungs = tuple(r.strip() for r in args.rungs.split(",") if r.strip())
    unknown = [r for r in rungs if r not in RUNGS + EXTRA]
    if unknown or not rungs or rungs[0] != "bare" or len(set(rungs)) != len(rungs):
        p.error(
            f"--rungs {args.rungs!r}: "
            + (f"unknown rung {unknown[0]!r}" if unknown else "bare must come first, each rung once")
            + f"; use bare and any of {', '.join(r for r in RUNGS + EXTRA if r != 'bare')}, comma-separated"
        )
    log = harness.progress(args.quiet)
    return harness.report(
        "bench.ladder",
        lambda: run(args.rounds, args.seconds, args.clients, rungs, args.pods, args.request, log, args.pod_delay_ms),
        table,
        args.json,
    )


if __name__ == "__main__":
    sys.exit(main())
