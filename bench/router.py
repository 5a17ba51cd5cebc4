"""Benchmark the router against its floor: a bare pass-through Worker in the same workerd.

In one run, interleaved over ``--rounds`` rounds, for each client count (default 1 and
32): ``wrk`` load for ``--seconds`` against the bench pod directly, against a bare
Worker (bench/passthrough.js: fetch(pod) and return; same workerd, the plan's
compatibility date), against the contract floor (bench/contract.js: only what
colocate's contract requires of any router, none of its own logic) and against the
router (the sandbox stack's plan, the cloud's bytes); then the same streaming (SSE,
bench/sse.mjs: time to first and last byte). Each Worker runs in its own workerd
process; the CPU each spends per request comes from its /proc/<pid>/stat. Reported as
medians over rounds: the router's added p50/p99 and SSE TTFB/TTLB vs the bare Worker,
throughput and CPU ratios (also router vs contract floor, and contract floor vs bare),
and the goals (met/missed; reported, not enforced).

Several pods: ``--pods 1,2,4 --pod-delay-ms 95 --pod-slots 1 --balance load`` runs one series
per pod count, each with that many bench pods in POD_URLS (the bare Worker takes them in turn);
``--pod-slots`` bounds each pod's concurrent work, so that more pods means more capacity. The
bench's requests are all alike, so the cells' default policy (prefix) keeps them on one pod until
its load bound moves them: ``--balance load`` (or least_busy) spreads them.
Streams that ask for their usage (``stream_options.include_usage``, which the router then
reads from each stream's last event): ``--sse-usage``. Streams like a real pod's, one
event per token: ``--sse-chunks 100 --sse-chunk-ms 20`` (the default is 8 events at once).
Requests of a real prompt's size (the router parses each request's JSON, the floors do
not): ``--prompt-bytes 16384``. A candidate router: ``--worker-src DIR`` reads the plan's
module names from DIR (e.g. a scratch copy of worker/src with a cut applied).
State object far away: ``--far-state-ms MS`` runs the router behind the sandbox's
emulated geography with only the Worker->object hop delayed; its pod traffic then also
passes the sandbox's Python outbound proxy, so compare only its state numbers.

Usage: .venv/bin/python -m bench.router [--rounds 5] [--seconds 3]
       [--clients 1,32] [--no-stream] [--sse-usage] [--prompt-bytes 0] [--sse-requests 3000]
       [--sse-chunks 8] [--sse-chunk-ms 0] [--pods 1] [--balance prefix|load|least_busy|random]
       [--pod-delay-ms 0] [--pod-slots 0] [--worker-src DIR] [--far-state-ms MS] [--state-requests 300] [--json PATH|-]
Exit: 0 done (goals reported, not enforced), 2 usage error or setup failure.
Needs wrk (`make bench` installs it with apt-get when absent) and node.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import harness
from colocate.cell import settings as settings_mod
from colocate.errors import ConfigError
from colocate.workerd import WorkerdError


def _ints(flag: str, low: int, high: int):
    def parse(text: str) -> tuple[int, ...]:
        try:
            out = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a comma-separated list of whole numbers") from None
        if not out or any(v < low or v > high for v in out):
            raise argparse.ArgumentTypeError(f"{flag}: {text!r}: use whole numbers {low}..{high}")
        return out
    return parse


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    m = result["machine"]
    o = result["options"]
    rows = [
        f"router vs bare pass-through Worker and contract floor ({m['workerd']}, compat {result['compatibility_date']}, "
        f"{m['cpus']} CPUs, "
        f"load {m['loadavg_at_start'][0]:.1f} at start; {o['rounds']} rounds x {o['seconds']:g} s, medians"
        + ("; SSE requests ask include_usage" if o.get("sse_usage") else "")
        + (f"; every request carries a {o['prompt_bytes']:,}-byte prompt" if o.get("prompt_bytes") else "")
        + f"; streams of {o.get('sse_chunks', 8)} events {o.get('sse_chunk_ms', 0):g} ms apart)"
    ]
    for s in result["series"]:
        rows.append(
            f"-- {s['pods']} pod(s), pod delay {s['pod_delay_ms']:g} ms, {s['pod_slots'] or 'unbounded'} slot(s), "
            f"router served by {s['router_backend']}"
            + (
                f"; state at {s['far_state']['state_colo']}, forced round trip p50 "
                f"{s['far_state']['state_rtt_p50_ms']} ms"
                if s.get("far_state")
                else ""
            )
            + (
                f"; router waited on state p50 {s['router_state_ms']['p50_ms']} ms, p99 "
                f"{s['router_state_ms']['p99_ms']} ms (Server-Timing, {s['router_state_ms']['n']} requests)"
                if s.get("router_state_ms")
                else ""
            )
        )
        rows.append(f"{'clients':>7} {'target':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu us/req':>10} {'errors':>6}"
                    f" {'sse ttfb':>9} {'sse ttlb':>9} {'sse us/req':>10}")
        for lv in s["levels"]:
            for t in (t for t in harness.TARGETS if t in lv["median"]):
                x = lv["median"][t]
                sse = x.get("sse") or {}
                rows.append(
                    f"{lv['clients']:>7} {t:>7} {_fmt(x['rps'], '.0f'):>9} {_fmt(x['p50_ms']):>8} {_fmt(x['p99_ms']):>8} "
                    f"{_fmt(x['cpu_us_per_req'], '.1f'):>10} {x['errors'] + (sse.get('errors') or 0):>6} "
                    f"{_fmt(sse.get('ttfb_p50_ms')):>9} {_fmt(sse.get('ttlb_p50_ms')):>9} "
                    f"{_fmt(sse.get('cpu_us_per_req'), '.1f'):>10}"
                )
            fb = lv["median"]["router"]["fallback_answers"]
            if fb:
                rows.append(
                    f"{'':>7} WARNING: the fallback answered {fb} of the router's requests: these numbers are not the pod path"
                )
            for name in ("router_vs_bare", "contract_vs_bare", "router_vs_contract"):
                rb = lv.get(name)
                if rb:
                    rows.append(
                        f"{'':>7} {name.replace('_vs_', ' vs ')}: p50 {_fmt(rb['added_p50_ms'], '+.3f')} ms, "
                        f"p99 {_fmt(rb['added_p99_ms'], '+.3f')} ms, "
                        f"throughput x{_fmt(rb['throughput_ratio'])}, CPU/req x{_fmt(rb.get('cpu_ratio'))}"
                        + (
                            f", SSE ttfb {_fmt(rb.get('sse_added_ttfb_p50_ms'), '+.3f')} ms, ttlb "
                            f"{_fmt(rb.get('sse_added_ttlb_p50_ms'), '+.3f')} ms, SSE CPU/req x{_fmt(rb.get('sse_cpu_ratio'))}"
                            if "sse_added_ttfb_p50_ms" in rb
                            else ""
                        )
                    )
    for g in result["goals"]:
        verdict = "n/a" if g["met"] is None else ("met" if g["met"] else "MISSED")
        sign = ">=" if g["goal"].endswith("throughput_ratio") else "<="
        what = " (router vs contract floor)" if g["goal"].startswith("own_") else ""
        rows.append(
            f"goal {g['goal']}{what} @ {g['clients']} client(s), {g['pods']} pod(s): "
            f"{_fmt(g['value'])} {sign} {g['limit']} {verdict}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; results are medians over them (default 5)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each wrk/SSE run (default 3)")
    p.add_argument("--clients", type=_ints("--clients", 1, 256), default=(1, 32), help="client counts (default 1,32)")
    p.add_argument("--no-stream", action="store_true", help="skip the streaming (SSE) runs")
    p.add_argument("--sse-usage", action="store_true",
                   help="the SSE requests ask for the stream's usage (stream_options.include_usage)")
    p.add_argument("--prompt-bytes", type=int, default=0,
                   help="a system message of this many bytes in every request, streamed or not (default 0: the user's 'hi' only)")
    p.add_argument("--sse-requests", type=int, default=3000, help="requests per SSE run, at most (default 3000)")
    p.add_argument("--sse-chunks", type=int, default=8, help="events in each bench pod stream, before [DONE] (default 8)")
    p.add_argument("--sse-chunk-ms", type=float, default=0.0,
                   help="the bench pods send a stream's events this far apart, like tokens (default 0: at once)")
    p.add_argument("--pods", type=_ints("--pods", 1, 8), default=(1,), help="pod counts, one series each (default 1)")
    p.add_argument("--balance", choices=settings_mod.BALANCES,
                   help="the router's balancing policy (default: the cells' default, prefix, which keeps this "
                        "bench's identical requests on one pod until its load bound moves them; load or least_busy "
                        "spread them over --pods)")
    p.add_argument("--pod-delay-ms", type=float, default=0.0, help="the bench pods answer after this long (default 0)")
    p.add_argument("--pod-slots", type=int, default=0, help="requests each pod works on at once, 0 = unbounded (default 0)")
    p.add_argument("--deadline-ms", type=int, default=5000, help="the router's DEADLINE_MS (default 5000)")
    p.add_argument("--worker-src", type=Path, help="read the router's modules from this directory (a candidate)")
    p.add_argument("--far-state-ms", type=float, help="the state object this many ms of round trip away (sandbox delay)")
    p.add_argument("--state-requests", type=int, default=300,
                   help="sequential requests after the rounds whose Server-Timing gives the router's wait on state (default 300)")
    p.add_argument("--json", help="write the result as JSON to PATH, or - for stdout (table then on stderr)")
    p.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    args = p.parse_args(argv)
    harness.check_args(p, (("--rounds", args.rounds, 1), ("--seconds", args.seconds, 1),
                           ("--sse-requests", args.sse_requests, 1), ("--sse-chunks", args.sse_chunks, 1),
                           ("--sse-chunk-ms", args.sse_chunk_ms, 0), ("--pod-delay-ms", args.pod_delay_ms, 0),
                           ("--pod-slots", args.pod_slots, 0), ("--deadline-ms", args.deadline_ms, 1),
                           ("--prompt-bytes", args.prompt_bytes, 0), ("--state-requests", args.state_requests, 1)),
                      args.worker_src)
    opts = harness.Options(
        clients=args.clients,
        rounds=args.rounds,
        seconds=args.seconds,
        stream=not args.no_stream,
        sse_usage=args.sse_usage,
        sse_requests=args.sse_requests,
        sse_chunks=args.sse_chunks,
        sse_chunk_ms=args.sse_chunk_ms,
        pods=args.pods,
        pod_delay_ms=args.pod_delay_ms,
        pod_slots=args.pod_slots,
        deadline_ms=args.deadline_ms,
        far_state_ms=args.far_state_ms,
        worker_src=args.worker_src,
        prompt_bytes=args.prompt_bytes,
        balance=args.balance,
        state_requests=args.state_requests,
    )
    log = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        result = harness.run(opts, log)
    except (harness.BenchError, ConfigError, WorkerdError) as exc:
        print(f"router: {exc}", file=sys.stderr)
        return exc.exit_code
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
