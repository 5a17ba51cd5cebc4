"""Benchmark the fleet's front door against calling its cell directly, in one workerd.

One workerd process runs two cells (the router, the sandbox stack's plan, the cloud's
bytes; regions us-east and eu-west) and the front door over them (colocate/fleet/plan.py's plan,
its bytes), each cell with its own socket and the front door with a socket that takes the
request's colo from the ``cf-blob`` header. Requests say they arrived at IAD, so the front
door picks the us-east cell first and sends it the request with the defer header: the
healthy path, which is what nearly every request takes. Interleaved over ``--rounds``
rounds, for each client count: ``wrk`` load for ``--seconds`` on the cell's own socket
(direct), on a bare Worker that only forwards through a service binding to that cell (hop:
the floor of any front door) and on the front door's (front). CPU per request is the workerd process's
(/proc/<pid>/stat) over each phase, so ``front`` counts the front door and the cell
together: the ratio front/direct is the front door's cost relative to the cell's.
Reported as medians over rounds: p50/p99 of each, the added p50, the CPU ratios (front and
hop over direct, front over hop), and the
goals (added p50 <= 0.2 ms, CPU <= 1.15x; reported, not enforced).

Usage: .venv/bin/python -m bench.front [--rounds 5] [--seconds 3] [--clients 1,32]
       [--pod-delay-ms 0] [--json PATH|-]
Exit: 0 done, 2 usage error or setup failure. Needs wrk and node (`make bench` installs wrk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
from pathlib import Path
from typing import Any

from bench import harness
from colocate import stackfile, workerd as wd
from colocate.cell import outputs, plan as plan_mod, settings as settings_mod
from colocate.fleet import plan as fleet
from colocate.fleet.workerd import CF_BLOB_HEADER, cf_socket, front_worker_capnp

REGIONS = ("us-east", "eu-west")
COLO = "IAD"  # nearest to us-east: the front door's first choice
GOAL_ADDED_P50_MS = 0.2
GOAL_CPU_RATIO = 1.15
TARGETS = ("direct", "hop", "front")
# The floor of any front door: a Worker that only forwards through the service binding.
HOP_JS = """export default {
  async fetch(request, env) {
    const res = await env.CELL.fetch(request);
    const out = new Response(res.body, res);
    out.headers.set("x-colocate-cell", "hop");
    return out;
  },
};
"""


def cell_plan(region: str, deadline_ms: int):
    raw, secrets = stackfile.read_config("sandbox")
    raw.update(region=region, generations=[{"name": f"{region}.g1", "region": region, "status": "active"}])
    raw["worker"] = {**(raw.get("worker") or {}), "deadlineMs": deadline_ms, "name": f"colocate-{region}"}
    s = settings_mod.parse(raw, region, secrets=set(secrets) | set(settings_mod.ALWAYS_SECRET))
    return plan_mod.plan_cell(s)


@contextlib.contextmanager
def fleet_worker(pod_url: str | dict[str, str], fallback_url: str, secrets: harness.Secrets, deadline_ms: int,
                 regions: tuple[str, ...] = REGIONS, remember_ms: int | None = None, exchange_ms: int | None = None):
    """One workerd: the cells on their own sockets, the front door on the main one.
    ``pod_url``: one pod for every cell, or {region: its pod's URL}."""
    with wd.Workerd(socket_name="front") as w, contextlib.ExitStack() as stack:
        services = [wd.network_service()]
        sockets = [cf_socket("front", "front")]
        extra: dict[str, socket.socket] = {}
        found = []
        urls = {}
        for region in regions:
            plan = cell_plan(region, deadline_ms)
            name = plan.worker.script_name
            pod = pod_url[region] if isinstance(pod_url, dict) else pod_url
            values = {"POD_URLS": plan_mod.pod_urls_text([pod]), "FALLBACK_URL": fallback_url, **secrets.bindings()}
            disk = f"disk-{region}"
            services += [wd.worker_service(name, wd.worker_capnp(plan.worker, values, storage_service=disk)),
                         wd.disk_service(disk, w.directory / "objects" / region)]
            s = stack.enter_context(contextlib.closing(wd.listening_socket()))
            extra[region] = s
            sockets.append(wd.socket_capnp(region, 0, name))
            urls[region] = f"http://127.0.0.1:{s.getsockname()[1]}"
            found.append({outputs.WORKER_NAME: name, outputs.WORKER_URL: urls[region], outputs.REGION: region,
                          outputs.ACCOUNT_ID: plan.worker.account_id})
        cfg = ({"cells": list(regions)} | ({} if remember_ms is None else {"rememberMs": remember_ms})
               | ({} if exchange_ms is None else {"exchangeMs": exchange_ms}))
        fs = fleet.parse({"fleet": cfg, "accountId": "0" * 32, "worker": {"subdomain": "bench"}}, "fleet")
        front = fleet.plan_fleet(fs, found)
        tokens = {f"CELL_TOKEN_{i}": secrets.bindings()["EXCHANGE_TOKEN"] for i in range(len(regions))}
        services += [wd.disk_service("disk-front", w.directory / "objects" / "front")]
        services.insert(0, wd.worker_service("front", front_worker_capnp(front, storage_service="disk-front", tokens=tokens)))
        hop = (f"(modules = [(name = \"hop.js\", esModule = {wd.capnp_text(HOP_JS)})], "
               f"compatibilityDate = {wd.capnp_text(front.compatibility_date)}, "
               f"bindings = [(name = \"CELL\", service = {wd.capnp_text(front.services[0].service)})])")
        services.append(wd.worker_service("hop", hop))
        s = stack.enter_context(contextlib.closing(wd.listening_socket()))
        extra["hop"] = s
        sockets.append(wd.socket_capnp("hop", 0, "hop"))
        urls["hop"] = f"http://127.0.0.1:{s.getsockname()[1]}"
        w.start(wd.config_capnp(services, sockets), extra_sockets=extra)
        yield w, urls


def run(opts, log=lambda _m: None) -> dict:
    harness.require_tools()
    secrets = harness.Secrets.fresh()
    with (
        harness.pods(1, opts.pod_delay_ms, secrets.pod_token) as pod_urls,
        harness.pods(1, 0, None) as fallback,
        fleet_worker(pod_urls[0], fallback[0], secrets, opts.deadline_ms) as (w, urls),
    ):
        key = harness.mint_key(urls[REGIONS[0]], secrets.probe_token)
        hdr = harness.router_headers(key)
        hdr_front = {**hdr, CF_BLOB_HEADER: json.dumps({"colo": COLO})}
        target = {"direct": (urls[REGIONS[0]], hdr), "hop": (urls["hop"], hdr), "front": (w.url, hdr_front)}
        served = check(w.url, hdr_front)
        body = harness.chat_body("json")
        for t in TARGETS:  # warm: isolates, connection pools, the object's first touch
            harness.wrk_run(target[t][0], max(opts.clients), 1, target[t][1], body)
        levels: dict[int, list[dict]] = {c: [] for c in opts.clients}
        for r in range(opts.rounds):
            for c in opts.clients:
                rd = {}
                for t in harness.rotated(TARGETS, r):
                    before = harness.answered(fallback[0])
                    url, h = target[t]
                    rd[t] = harness.measured(
                        w.proc.pid, lambda url=url, h=h, c=c: harness.wrk_run(url, c, opts.seconds, h, body)
                    )
                    rd[t]["fallback_answers"] = harness.answered(fallback[0]) - before
                levels[c].append(rd)
                log(f"round {r + 1}/{opts.rounds} clients {c}: "
                    + ", ".join(f"{t} {rd[t]['rps']:.0f} req/s p50 {rd[t]['p50_ms']:.3f} ms "
                                f"cpu {rd[t].get('cpu_us_per_req')} us" for t in TARGETS))
    return {"colo": COLO, "served_by": served, "rounds": opts.rounds, "seconds": opts.seconds,
            "pod_delay_ms": opts.pod_delay_ms, "versions": harness.versions(),
            "levels": [{"clients": c, "rounds": rs, **summarise(rs)} for c, rs in levels.items()]}


def check(url: str, headers: dict) -> dict:
    """One request through the front door: it must be served by the us-east cell's pod."""
    import urllib.request

    req = urllib.request.Request(url + harness.PATH, data=harness.chat_body("json").encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as res:
        cell, backend = res.headers.get("x-colocate-cell"), res.headers.get("x-colocate-backend")
    if (cell, backend) != (REGIONS[0], "pod-0"):
        raise harness.BenchError(f"the front door did not route to {REGIONS[0]}'s pod (cell {cell}, backend {backend})")
    return {"cell": cell, "backend": backend}


def summarise(rounds: list[dict]) -> dict:
    med = harness.median
    out: dict[str, Any] = {}
    for t in TARGETS:
        out[t] = {k: med(r[t].get(k) for r in rounds) for k in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req")}
        out[t]["errors"] = sum(r[t]["errors"] for r in rounds)
        out[t]["fallback_answers"] = sum(r[t]["fallback_answers"] for r in rounds)
    added = [r["front"]["p50_ms"] - r["direct"]["p50_ms"] for r in rounds]
    ratio = [r["front"]["cpu_us_per_req"] / r["direct"]["cpu_us_per_req"] for r in rounds
             if r["front"].get("cpu_us_per_req") and r["direct"].get("cpu_us_per_req")]
    out["added_p50_ms"] = med(added)
    out["cpu_ratio"] = med(ratio)
    # What a bare service-binding hop costs (the floor), and the front door over that floor.
    out["hop_added_p50_ms"] = med(r["hop"]["p50_ms"] - r["direct"]["p50_ms"] for r in rounds)
    out["hop_cpu_ratio"] = med(r["hop"]["cpu_us_per_req"] / r["direct"]["cpu_us_per_req"] for r in rounds
                               if r["hop"].get("cpu_us_per_req") and r["direct"].get("cpu_us_per_req"))
    out["front_over_hop_cpu_ratio"] = med(r["front"]["cpu_us_per_req"] / r["hop"]["cpu_us_per_req"] for r in rounds
                                          if r["front"].get("cpu_us_per_req") and r["hop"].get("cpu_us_per_req"))
    out["goals"] = [
        {"goal": f"front door adds <= {GOAL_ADDED_P50_MS} ms p50", "value": out["added_p50_ms"],
         "met": out["added_p50_ms"] is not None and out["added_p50_ms"] <= GOAL_ADDED_P50_MS},
        {"goal": f"front door + cell CPU <= {GOAL_CPU_RATIO}x the cell's", "value": out["cpu_ratio"],
         "met": out["cpu_ratio"] is not None and out["cpu_ratio"] <= GOAL_CPU_RATIO},
    ]
    return out


def render(result: dict) -> str:
    lines = [f"front door vs its cell, one workerd, loopback; requests from {result['colo']} "
             f"served by {result['served_by']['cell']} ({result['rounds']} rounds x {result['seconds']} s, medians)"]
    lines.append(f"{'clients':>7} {'target':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu us/req':>11} {'errors':>7}")
    for lv in result["levels"]:
        for t in TARGETS:
            s = lv[t]
            lines.append(f"{lv['clients']:>7} {t:>7} {s['rps']:>9} {s['p50_ms']:>8} {s['p99_ms']:>8} "
                         f"{s['cpu_us_per_req']!s:>11} {s['errors']:>7}")
        lines.append(f"{'':>7} bare hop: added p50 {lv['hop_added_p50_ms']} ms, CPU {lv['hop_cpu_ratio']}x; "
                     f"front door over the bare hop: CPU {lv['front_over_hop_cpu_ratio']}x")
        lines.append(f"{'':>7} front door: added p50 {lv['added_p50_ms']} ms, CPU ratio {lv['cpu_ratio']}x; "
                     + "; ".join(f"{g['goal']}: {'met' if g['met'] else 'missed'}" for g in lv["goals"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.front", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--clients", default="1,32", help="comma-separated wrk connection counts")
    p.add_argument("--pod-delay-ms", type=float, default=0.0)
    p.add_argument("--deadline-ms", type=int, default=2000)
    p.add_argument("--json", help="write the result as JSON to PATH (- for stdout only)")
    p.add_argument("--quiet", action="store_true")
    opts = p.parse_args(argv)
    try:
        opts.clients = tuple(int(c) for c in opts.clients.split(","))
    except ValueError:
        p.error(f"--clients must be comma-separated whole numbers (got {opts.clients!r})")
    harness.check_args(p, [("--rounds", opts.rounds, 1), ("--seconds", opts.seconds, 1),
                           ("--clients", min(opts.clients), 1), ("--pod-delay-ms", opts.pod_delay_ms, 0),
                           ("--deadline-ms", opts.deadline_ms, 1)])
    json_path = None if opts.json in (None, "-") else Path(opts.json)
    if opts.json == "-":
        return harness.report("bench.front", lambda: run(opts, harness.progress(opts.quiet)), json.dumps, None)
    return harness.report("bench.front", lambda: run(opts, harness.progress(opts.quiet)), render, json_path)


if __name__ == "__main__":
    sys.exit(main())
