"""Balancing policies compared (colocate:worker.balance): least_busy against load, on pods
that batch as vLLM does (bench/batchpod.mjs), with a mixed workload through the router.

Each policy gets its own router (the sandbox stack's Worker, the same bytes as the cloud's,
BALANCE bound to the policy) in front of its own pods, both up at once; each level runs one
policy after the other, in alternating order. At each concurrency C, C clients send
streamed chat completions through the router, one after another, 70 % short (16 tokens)
and 30 % long (128 tokens), for ``--seconds``; time to first token (TTFT) is the time to the
first data event, as a chat UI sees it. Besides them, ``--hidden`` × C clients send long
answers straight to pod 0: load the router does not count itself, as another isolate's
requests (known to it only as of that isolate's last sync) or another tenant's are. One
workerd runs one isolate, so the cell's counts across isolates (``others``) play no part
here; the pods' /metrics do.

Printed: per policy and C, routed requests/s, TTFT p50 and p99; and the knee, the highest
C whose TTFT p99 stays within ``--budget-ms``, with its throughput.

The pods' model defaults to steps of 30 + 1.5 ms × running and 16 sequences at most: 2.5 ×
slower than the RTX 4090 profile's steps, so that the pods, not this machine's Python client
threads, reach their knee first.

Usage: .venv/bin/python -m bench.balance [--pods 2] [--clients 8,16,24,32,40] [--seconds 12] [--hidden 0.5]
       [--budget-ms 1000] [--step-ms 30] [--per-seq-ms 1.5] [--max-seqs 16] [--json PATH]
Exit: 0 done, 2 setup failure (node missing, a process not starting).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from colocate import stackfile
from colocate.cell import plan as plan_mod, settings as settings_mod
from colocate.workerd import Workerd

from . import harness

HERE = Path(__file__).resolve().parent
POLICIES = ("least_busy", "load")
SHORT, LONG, LONG_SHARE = 16, 128, 0.3


@contextlib.contextmanager
def batch_pods(count: int, model: tuple[float, float, int]) -> Iterator[list[str]]:
    step, per_seq, max_seqs = model
    proc = subprocess.Popen(["node", str(HERE / "batchpod.mjs"), "--count", str(count), "--step-ms", str(step),
                             "--per-seq-ms", str(per_seq), "--max-seqs", str(max_seqs), "--kv-tokens", str(max_seqs * 400)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise harness.BenchError("the batching pod (bench/batchpod.mjs) did not start")
        yield json.loads(line)["urls"]
    finally:
        harness.stop(proc)


def policy_plan(policy: str):
    """The sandbox stack's plan with BALANCE = ``policy`` and a deadline no request misses here."""
    raw, secrets = stackfile.read_config("sandbox")
    raw["worker"] = {**(raw.get("worker") or {}), "deadlineMs": 30_000, "stallMs": 30_000, "balance": policy}
    s = settings_mod.parse(raw, "sandbox", secrets=set(secrets) | set(settings_mod.ALWAYS_SECRET))
    return plan_mod.plan_cell(s)


def one(url: str, headers: dict, max_tokens: int, timeout: float = 60) -> tuple[float, float] | None:
    """(TTFT, total) in seconds of one streamed chat completion, or None when it failed."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       "stream": True})
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        res = conn.getresponse()
        if res.status != 200:
            res.read()
            return None
        ttft = None
        while True:
            line = res.readline()
            if not line:
                break
            if ttft is None and line.startswith(b"data:"):
                ttft = time.monotonic() - t0
        return None if ttft is None else (ttft, time.monotonic() - t0)
    except OSError:
        return None
    finally:
        conn.close()


def level(router_url: str, router_hdr: dict, pod0: str, pod_hdr: dict, clients: int, hidden: int, seconds: float) -> dict:
    stop = time.monotonic() + seconds
    ttfts: list[float] = []
    failed = [0]
    lock = threading.Lock()

    def routed(seed: int) -> None:
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            r = one(router_url, router_hdr, LONG if rnd.random() < LONG_SHARE else SHORT)
            with lock:
                if r is None:
                    failed[0] += 1
                elif time.monotonic() <= stop + 0.5:
                    ttfts.append(r[0])

    def outside() -> None:
        while time.monotonic() < stop:
            one(pod0, pod_hdr, LONG)

    threads = [threading.Thread(target=routed, args=(i,), daemon=True) for i in range(clients)]
    threads += [threading.Thread(target=outside, daemon=True) for _ in range(hidden)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 120)
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) >= 2 else [float("nan")] * 99
    return {"clients": clients, "hidden": hidden, "requests": len(ttfts), "failed": failed[0], "rps": len(ttfts) / seconds,
            "ttft_p50_ms": q[49] * 1000, "ttft_p99_ms": q[98] * 1000}


def run(args) -> dict:
    harness.require_node()
    secrets = harness.Secrets.fresh()
    out: dict = {"pods": args.pods, "seconds": args.seconds, "hidden": args.hidden, "budget_ms": args.budget_ms,
                 "pod_model": {"step_ms": args.step_ms, "per_seq_ms": args.per_seq_ms, "max_seqs": args.max_seqs},
                 "mix": {"short": SHORT, "long": LONG, "long_share": LONG_SHARE}, "policies": {}}
    with contextlib.ExitStack() as stack:
        # Both policies' cells up at once, each with its own pods; each level runs one policy
        # after the other, their order alternating, so the machine's drift falls on both.
        cells = {}
        for policy in POLICIES:
            plan = policy_plan(policy)
            pod_urls = stack.enter_context(batch_pods(args.pods, (args.step_ms, args.per_seq_ms, args.max_seqs)))
            fallback = stack.enter_context(harness.pods(1, 0, None))
            values = {"POD_URLS": plan_mod.pod_urls_text(pod_urls), "FALLBACK_URL": fallback[0], **secrets.bindings()}
            router = stack.enter_context(Workerd.serve(plan.worker, values))
            key = harness.mint_key(router.url, secrets.probe_token)
            hdr = harness.router_headers(key)
            one(router.url, hdr, SHORT)  # warm: the isolate, its view
            cells[policy] = (router.url, hdr, pod_urls, fallback[0])
        levels: dict[str, list] = {p: [] for p in POLICIES}
        for n, c in enumerate(args.clients):
            for policy in POLICIES if n % 2 == 0 else tuple(reversed(POLICIES)):
                url, hdr, pod_urls, fallback_url = cells[policy]
                lv = level(url, hdr, pod_urls[0], harness.direct_headers(secrets.pod_token), c, round(args.hidden * c),
                           args.seconds)
                lv["fallback_answers"] = harness.answered(fallback_url)
                levels[policy].append(lv)
                print(f"{policy} C={c}: {lv['rps']:.1f} req/s, TTFT p50 {lv['ttft_p50_ms']:.0f} ms "
                      f"p99 {lv['ttft_p99_ms']:.0f} ms ({lv['failed']} failed)", file=sys.stderr, flush=True)
    for policy in POLICIES:
        within = [lv for lv in levels[policy] if lv["ttft_p99_ms"] <= args.budget_ms and lv["failed"] == 0]
        knee = max(within, key=lambda lv: lv["clients"]) if within else None
        out["policies"][policy] = {"levels": levels[policy], "knee": knee}
    return out


def render(r: dict) -> str:
    lines = [f"pods {r['pods']}, {r['seconds']:.0f} s a level, {r['hidden']} × C outside clients on pod 0 "
             f"({LONG} tokens), routed mix {SHORT}/{LONG} tokens ({LONG_SHARE:.0%} long), knee: TTFT p99 <= {r['budget_ms']} ms",
             "", "| policy | clients | req/s | TTFT p50 | TTFT p99 |", "|---|---:|---:|---:|---:|"]
    for policy, p in r["policies"].items():
        for lv in p["levels"]:
            lines.append(f"| {policy} | {lv['clients']} | {lv['rps']:.1f} | {lv['ttft_p50_ms']:.0f} ms "
                         f"| {lv['ttft_p99_ms']:.0f} ms |")
    lines.append("")
    for policy, p in r["policies"].items():
        k = p["knee"]
        lines.append(f"{policy}: knee " + (f"C={k['clients']}, {k['rps']:.1f} req/s" if k else "below the lowest level"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 24, 32, 40])
    # The pods' model (bench/batchpod.mjs): 2.5 x slower steps than the 4090 profile's and 16
    # sequences at most, so that the pods, not this machine's client threads, reach their knee.
    p.add_argument("--step-ms", type=float, default=30.0)
    p.add_argument("--per-seq-ms", type=float, default=1.5)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--hidden", type=float, default=0.5, help="outside clients on pod 0, per routed client")
    p.add_argument("--budget-ms", type=float, default=1000.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.pods < 2 or args.seconds <= 0 or any(c < 1 for c in args.clients):
        p.error("--pods must be >= 2, --seconds > 0 and every --clients level >= 1")
    try:
        r = run(args)
    except harness.BenchError as exc:
        print(f"bench.balance: {exc}", file=sys.stderr)
        return 2
    print(render(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
