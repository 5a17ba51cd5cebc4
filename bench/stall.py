"""A client that stops reading mid-stream: what the router holds for it, and what it passes.

The router tees a stream whose client asked for its usage (worker/src/usage.js). A tee
keeps what one branch has not read yet, so this measures two things, with the router
behind one bench pod that sends a long usage stream at once (``--chunks`` events):

    stall   a client reads the headers, stops for ``--stall-s`` seconds (its socket's
            receive buffer kept small), then reads the rest. Reported: workerd's memory
            (RSS) growth during the stall, the bytes that had left the pod by its end
            (``ss -tni``'s bytes_acked on the pod's side: the pod is held back when it
            stays low), and the time to read the rest.
    burst   a client reads the same kind of stream (``--burst-chunks`` events) at full
            speed. Reported: time to the last byte and the largest gap between reads,
            so a router that holds the client's bytes back shows.

Every answer must end with its usage event and ``[DONE]``. ``--worker-src DIR`` measures a
candidate copy of worker/src. Imports no Pulumi.

Usage: .venv/bin/python -m bench.stall [--chunks 200000] [--stall-s 4] [--burst-chunks 8000]
       [--worker-src DIR] [--json PATH]
Exit: 0 done, 2 setup failure (node missing, a process not starting, a stream cut short).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from urllib.parse import urlsplit

from colocate.cell import plan as plan_mod

from . import harness

END = b"data: [DONE]\n\n"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise harness.BenchError(f"no VmRSS for pid {pid}")


def left_the_pod_mb(pod_url: str) -> float | None:
    """Bytes the pod's connections have had acknowledged (MB), or None without ``ss``."""
    if not shutil.which("ss"):
        return None
    port = urlsplit(pod_url).port
    out = subprocess.run(["ss", "-tni", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    return round(sum(int(n) for n in re.findall(r"bytes_acked:(\d+)", out)) / 1e6, 2)


# The sandbox pods' --max-model-len less room for the prompt (colocate/cell/plan.py MAX_MODEL_LEN).
MAX_TOKENS = plan_mod.MAX_MODEL_LEN - 64


def _request(port: int, key: str, rcvbuf: int | None, tokens: int) -> socket.socket:
    # The request allows as many tokens as the pod streams events, up to what the pods' context
    # admits (the router refuses more at the edge): the router cuts a stream past what its
    # request can produce in bytes (docs/worker.md), and this one is not an attack.
    body = json.dumps({**json.loads(harness.STREAM_USAGE_BODY), "max_tokens": min(tokens, MAX_TOKENS)}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    head = (f"POST {harness.PATH} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def _read_all(sock: socket.socket, seen: bytes = b"") -> tuple[bytes, list[float]]:
    """Read until the server closes; the bytes and each read's time (monotonic)."""
    data, times = bytearray(seen), []
    while chunk := sock.recv(1 << 20):
        times.append(time.monotonic())
        data += chunk
    return bytes(data), times


def _whole(data: bytes, what: str) -> None:
    # chunked transfer: the last event, then the terminating zero-length chunk
    tail = data[-400:]
    if END not in tail or b'"usage":{' not in tail:
        raise harness.BenchError(f"{what}: the stream did not end with its usage event and [DONE]")


def stall(port: int, pid: int, pod_url: str, key: str, stall_s: float, tokens: int) -> dict:
    start = rss_mb(pid)
    sock = _request(port, key, rcvbuf=65536, tokens=tokens)
    try:
        seen = sock.recv(4096)  # the headers, perhaps the first events
        time.sleep(stall_s)
        held, left = rss_mb(pid), left_the_pod_mb(pod_url)
        t0 = time.monotonic()
        data, _ = _read_all(sock, seen)
        rest_s = time.monotonic() - t0
    finally:
        sock.close()
    _whole(data, "stall")
    return {"stall_s": stall_s, "rss_start_mb": round(start, 1), "rss_growth_mb": round(held - start, 1),
            "left_the_pod_mb": left, "answer_mb": round(len(data) / 1e6, 2), "rest_read_s": round(rest_s, 2)}


def burst(port: int, key: str, tokens: int) -> dict:
    t0 = time.monotonic()
    sock = _request(port, key, rcvbuf=None, tokens=tokens)
    try:
        data, times = _read_all(sock)
    finally:
        sock.close()
    _whole(data, "burst")
    gaps = [b - a for a, b in pairwise(times)]
    return {"answer_mb": round(len(data) / 1e6, 2), "ttlb_ms": round((times[-1] - t0) * 1000, 1),
            "max_gap_ms": round(max(gaps, default=0) * 1000, 1)}


def run(chunks: int, stall_s: float, burst_chunks: int, worker_src: Path | None, log=lambda _m: None) -> dict:
    harness.require_node()
    secrets = harness.Secrets.fresh()
    plan = harness.bench_plan(5000, worker_src)
    out = {"machine": harness.versions(), "chunks": chunks, "burst_chunks": burst_chunks}
    for name, n in (("stall", chunks), ("burst", burst_chunks)):
        # One pod process per shape: the pod's byte count then covers this measurement only.
        with harness.pods(1, 0, secrets.pod_token, chunks=n) as pod_urls, harness.pods(1, 0, None) as fallback:
            values = {"POD_URLS": plan_mod.pod_urls_text(pod_urls), "FALLBACK_URL": fallback[0], **secrets.bindings()}
            with harness.router_worker(plan, values, None) as router:
                key = harness.mint_key(router.url, secrets.probe_token)
                port = router.port
                out[name] = (stall(port, router.process.pid, pod_urls[0], key, stall_s, n) if name == "stall"
                             else burst(port, key, n))
                log(f"{name}: {out[name]}")
    return out


def table(result: dict) -> str:
    s, b = result["stall"], result["burst"]
    left = "-" if s["left_the_pod_mb"] is None else f"{s['left_the_pod_mb']:g} MB"
    return "\n".join([
        f"a client that stalls ({result['machine']['workerd']}; usage streams, one pod)",
        f"stall: {s['answer_mb']:g} MB answer, client stopped {s['stall_s']:g} s: workerd RSS +{s['rss_growth_mb']:g} MB "
        f"(from {s['rss_start_mb']:g}), {left} had left the pod; the rest read in {s['rest_read_s']:g} s",
        f"burst: {b['answer_mb']:g} MB answer at once: last byte after {b['ttlb_ms']:g} ms, largest gap between reads "
        f"{b['max_gap_ms']:g} ms",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=200_000, help="events in the stalled stream (default 200000, ~25 MB)")
    p.add_argument("--stall-s", type=float, default=4.0, help="how long the client stops reading (default 4)")
    p.add_argument("--burst-chunks", type=int, default=8000, help="events in the full-speed stream (default 8000, ~1 MB)")
    p.add_argument("--worker-src", type=Path, help="read the router's modules from this directory (a candidate)")
    p.add_argument("--json", type=Path, help="also write the result as JSON")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    harness.check_args(p, (("--chunks", args.chunks, 1), ("--stall-s", args.stall_s, 0),
                           ("--burst-chunks", args.burst_chunks, 1)), args.worker_src)
    log = harness.progress(args.quiet)
    return harness.report("bench.stall", lambda: run(args.chunks, args.stall_s, args.burst_chunks, args.worker_src, log),
                          table, args.json)


if __name__ == "__main__":
    sys.exit(main())
