"""CPU profile of the router (or the bare Worker) in workerd under wrk load.

workerd runs with ``--inspector-addr``; a minimal WebSocket client speaks the Chrome
DevTools protocol to it (Profiler.start, load, Profiler.stop) and sums each function's
self time per answered request. Sampling inflates everything: compare rows between
runs (router against bare, a candidate against main), not the totals.

Usage: .venv/bin/python -m bench.profile [--bare | --contract] [--worker-src DIR] [--seconds 4]
       [--clients 32] [--top 30] [--out PATH.cpuprofile] [--heap]
       .venv/bin/python -m bench.profile --compare DIR [--rounds 3] [--seconds 4] [--clients 32] [--top 30]
``--compare DIR`` profiles bare, the router from DIR (worker/src before a change) and this
router in turn, ``--rounds`` times, and prints a markdown table of each function's self
time per request (medians, functions matched by name and file): docs/benchmarks.md's table.
``--heap``: bytes allocated per request by function instead (V8's sampling heap profiler,
objects already collected included). The .cpuprofile file opens in Chrome DevTools (Performance tab) for a flame chart.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import socket
import struct
import sys
from pathlib import Path

from colocate import workerd as wd
from colocate.cell import plan as plan_mod

from . import harness


class _WebSocket:
    """Just enough RFC 6455 for the inspector: text frames, client-masked sends."""

    def __init__(self, host: str, port: int, path: str):
        self.sock = socket.create_connection((host, port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise harness.BenchError("the inspector closed the connection during the handshake")
            buf += chunk
        head, self.buf = buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise harness.BenchError(f"the inspector refused the WebSocket: {head[:200]!r}")
        self.next_id = 0

    def _need(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise harness.BenchError("the inspector closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _message(self) -> dict:
        data = b""
        while True:
            b0, b1 = self._need(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._need(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._need(8))[0]
            data += self._need(n)
            if b0 & 0x80:
                return json.loads(data)

    def call(self, method: str, params: dict | None = None) -> dict:
        self.next_id += 1
        data = json.dumps({"id": self.next_id, "method": method, "params": params or {}}).encode()
        mask = os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
        while True:
            m = self._message()
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise harness.BenchError(f"inspector {method}: {m['error']}")
                return m.get("result", {})

    def close(self) -> None:
        self.sock.close()


def self_times(profile: dict, requests: int) -> list[tuple[float, float, str]]:
    """(µs per request, share, "function file:line") by self time, largest first."""
    nodes = {n["id"]: n["callFrame"] for n in profile["nodes"]}
    acc: collections.Counter = collections.Counter()
    for sample, dt in zip(profile["samples"], profile["timeDeltas"], strict=True):
        cf = nodes[sample]
        acc[f"{cf['functionName'] or '(anonymous)'} {cf['url'].rsplit('/', 1)[-1]}:{cf['lineNumber'] + 1}"] += dt
    total = sum(acc.values()) or 1
    return [(us / max(1, requests), us / total, name) for name, us in acc.most_common()]


def heap_bytes(profile: dict, requests: int) -> list[tuple[float, float, str]]:
    """(bytes allocated per request, share, "function file:line") from a sampling heap
    profile (HeapProfiler.stopSampling), largest first."""
    acc: collections.Counter = collections.Counter()
    todo = [profile["head"]]
    while todo:
        n = todo.pop()
        todo.extend(n.get("children", []))
        cf = n["callFrame"]
        acc[f"{cf['functionName'] or '(anonymous)'} {cf['url'].rsplit('/', 1)[-1]}:{cf['lineNumber'] + 1}"] += n["selfSize"]
    total = sum(acc.values()) or 1
    return [(b / max(1, requests), b / total, name) for name, b in acc.most_common() if b]


def profile(target: str, worker_src: Path | None, seconds: float, clients: int, heap: bool = False) -> tuple[dict, int]:
    """Profile ``target``: "router", "bare" or "contract" (the bench's floors); with ``heap``,
    V8's sampling heap profiler (every allocation, collected or not) instead of the CPU's."""
    harness.require_tools()
    plan = harness.bench_plan(5000, worker_src)
    compat = plan.worker.compatibility_date
    secrets = harness.Secrets.fresh()
    port = wd.free_port()
    headers = harness.direct_headers(secrets.pod_token) if target == "bare" else harness.router_headers()
    with harness.pods(1, 0, secrets.pod_token) as pods, harness.pods(1, 0, None) as fallback:
        values = {"POD_URLS": plan_mod.pod_urls_text(pods), "FALLBACK_URL": fallback[0], **secrets.bindings()}
        with wd.Workerd(extra_args=[f"--inspector-addr=127.0.0.1:{port}"]) as w:
            if target == "bare":
                w.start(harness.bare_config(compat, pods, w.port))
            elif target == "contract":
                w.start(harness.contract_config(compat, pods, secrets.pod_token, 5000, w.port))
            else:
                w.start(wd.render_config(plan.worker, values, port=w.port, storage_dir=w.directory / "objects"))
                # routed requests need a client key
                headers = harness.router_headers(harness.mint_key(w.url, secrets.probe_token))
            harness.wrk_run(w.url, clients, 1, headers)  # warm
            ws = _WebSocket("127.0.0.1", port, f"/{wd.MAIN_SERVICE}")
            try:
                if heap:
                    ws.call("HeapProfiler.enable")
                    ws.call("HeapProfiler.startSampling", {"samplingInterval": 256, "includeObjectsCollectedByMajorGC": True,
                                                           "includeObjectsCollectedByMinorGC": True})
                    run = harness.wrk_run(w.url, clients, seconds, headers)
                    prof = ws.call("HeapProfiler.stopSampling")["profile"]
                else:
                    ws.call("Profiler.enable")
                    ws.call("Profiler.setSamplingInterval", {"interval": 50})
                    ws.call("Profiler.start")
                    run = harness.measured(w.process.pid, lambda: harness.wrk_run(w.url, clients, seconds, headers))
                    prof = ws.call("Profiler.stop")["profile"]
                    prof["cpu_us_per_req"] = run["cpu_us_per_req"]  # the process's own, from /proc (compare())
            finally:
                ws.close()
    return prof, run["n"]


def _key(name: str) -> str:
    """A row's function without its line: the same function in two copies of the source."""
    fn, _, where = name.rpartition(" ")
    return f"{fn} {where.split(':')[0]}" if where.split(":")[0] else fn


def compare(before: Path, seconds: float, clients: int, rounds: int) -> tuple[dict, dict]:
    """Self time per request of each function, for bare, the router from ``before`` and the
    router here, profiled in turn ``rounds`` times (the order rotated): {target: {fn: median
    µs}}, and {target: median requests}. A function's µs per request is its share of the
    profile's busy samples times the process's CPU per request in that run (/proc): the
    sampler counts wall time, which a loaded machine stretches, the share it keeps."""
    targets = (("bare", "bare", None), ("before", "router", before), ("after", "router", None))
    got: dict = {t[0]: [] for t in targets}
    served: dict = {t[0]: [] for t in targets}
    for r in range(rounds):
        for name, target, src in harness.rotated(targets, r):
            prof, n = profile(target, src, seconds, clients)
            rows = [(share, _key(fn)) for _us, share, fn in self_times(prof, n)]
            busy = sum(share for share, fn in rows if fn != "(idle)") or 1.0
            by_fn: dict = collections.defaultdict(float)
            for share, fn in rows:
                if fn != "(idle)":
                    by_fn[fn] += share / busy * (prof["cpu_us_per_req"] or 0.0)
            got[name].append(dict(by_fn))
            served[name].append(n)
    out = {}
    for name, runs in got.items():
        fns = set().union(*runs)
        out[name] = {fn: harness.median(run.get(fn, 0.0) for run in runs) for fn in fns}
    return out, {name: harness.median(ns) for name, ns in served.items()}


def compare_table(costs: dict, served: dict, top: int) -> str:
    def total(t):
        return sum(us for fn, us in costs[t].items() if fn != "(idle)")

    rows = ["| function (self time, µs of CPU per request) | bare | router before | router after |", "|---|---:|---:|---:|"]
    def largest(fn):
        return -max(costs["before"].get(fn, 0), costs["after"].get(fn, 0))

    order = sorted(set(costs["before"]) | set(costs["after"]), key=largest)
    for fn in [f for f in order if f != "(idle)"][:top]:
        rows.append(f"| `{fn}` | " + " | ".join(f"{costs[t].get(fn, 0):.1f}" for t in ("bare", "before", "after")) + " |")
    rows.append("| the process's CPU per request | " + " | ".join(f"{total(t):.1f}" for t in ("bare", "before", "after")) + " |")
    rows.append("| requests profiled (median) | " + " | ".join(f"{served[t]:,.0f}" for t in ("bare", "before", "after")) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.profile", description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--bare", action="store_true", help="profile the bare pass-through Worker instead of the router")
    which.add_argument("--contract", action="store_true", help="profile the contract floor (bench/contract.js) instead")
    p.add_argument("--worker-src", type=Path, help="the router's modules from this directory (a candidate)")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", type=Path, help="also write the raw profile (.cpuprofile, for Chrome DevTools)")
    p.add_argument("--heap", action="store_true",
                   help="bytes allocated per request by function (V8's sampling heap profiler), not CPU time")
    p.add_argument("--compare", type=Path, metavar="DIR",
                   help="profile bare, the router from DIR (a copy of worker/src before a change) and this router, in turn, "
                        "--rounds times: a markdown table of self time per request, medians")
    p.add_argument("--rounds", type=int, default=3, help="with --compare: rounds (default 3)")
    args = p.parse_args(argv)
    if args.compare is not None:
        if not args.compare.is_dir():
            p.error(f"--compare {args.compare}: not a directory; pass a copy of worker/src")
        try:
            costs, served = compare(args.compare, args.seconds, args.clients, args.rounds)
        except (harness.BenchError, wd.WorkerdError) as exc:
            print(f"bench.profile: {exc}", file=sys.stderr)
            return exc.exit_code
        print(compare_table(costs, served, args.top))
        return 0
    try:
        target = "bare" if args.bare else "contract" if args.contract else "router"
        prof, n = profile(target, args.worker_src, args.seconds, args.clients, args.heap)
    except (harness.BenchError, wd.WorkerdError) as exc:
        print(f"bench.profile: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.out:
        args.out.write_text(json.dumps(prof))
    if args.heap:
        print(f"{target}: {n} requests at {args.clients} clients; bytes allocated per request (sampled)")
        for b, share, name in heap_bytes(prof, n)[:args.top]:
            print(f"{b:9.0f} B   {share:6.1%}  {name}")
        return 0
    print(f"{target}: {n} requests at {args.clients} clients; self time per request")
    for us, share, name in self_times(prof, n)[:args.top]:
        print(f"{us:9.2f} us  {share:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
