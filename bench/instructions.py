"""Instructions per request, counted by valgrind's callgrind: the cost ladder's rungs
(bare ... router, bench/ladder.py) at one client, each in its own workerd.

CPU time per request moves by 10 to 30 % from round to round on a shared 2-core machine,
so a cut of a few per cent needs many interleaved rounds to show. An instruction count
does not move with the machine's load. It counts every thread of the workerd process in
user space, V8's compiler and GC threads too; what the kernel spends on sockets is not in
it, so its ratios are larger than the CPU-time ratios of bench/router.py (the two
measure different things; neither replaces the other).

One thing makes a count move from run to run: when V8's background compiler finishes.
valgrind runs one thread at a time, so a hot function may still run in the interpreter
after a thousand requests in one run and be optimised in the next; the router's count
then moved by up to 18 %. So by default workerd runs with V8's concurrent compilation off
(``v8Flags``: the code is compiled on the request's own thread when it becomes hot, the
same code as otherwise, just not late), and the router repeats to within about 1 %.
``--concurrent-jit`` keeps V8's default, to see that spread; ``--repeat`` reports the
median of several runs and their spread.

The other thing that moves a count is the isolate's sync with its generation object
(worker/src/state.js: while requests come, at most one a second: its deltas out, the view
back), counted in the window with the object's side of it (the object runs in the same
workerd). Back to back, a fast machine spreads one sync over more requests than a slow or
loaded one: the router's count moved from 1.23 M to 1.31 M with the machine's load.
``--every-ms N`` starts the counted requests N ms apart: an isolate serving one every N ms,
whose syncs spread over its requests at that rate, not at the machine's speed (a request
that starts after its slot, the last one still answering, is counted as late and reported).
Paced runs still differ by about 5 %: how many syncs fall in a window depends on when each
ran. It shows what a quiet isolate pays; back to back, with --repeat, compares code.

Each rung: start under ``valgrind --tool=callgrind`` with its instrumentation off (the start is
not counted, and runs many times faster), switch it on (callgrind_control --instr=on), send
``--warm`` requests (the JIT settles), zero the counters (callgrind_control -z), send
``--requests`` requests one after another on one keep-alive connection, dump (callgrind_control
-d), divide.

``--request`` picks what is sent: ``json`` (a chat completion, the default), ``stream``
(the same with ``"stream": true``: ``--chunks`` SSE events and ``[DONE]``, read to the
end) or ``usage`` (a stream that asks ``stream_options.include_usage``). ``--pods 2``
puts two bench pods behind every rung, which is when the router watches a stream's end.
``--prompt-bytes N`` adds a system message of N bytes, the size of a real prompt: the
router decodes and parses every request's JSON, the contract floor does not.

Usage: .venv/bin/python -m bench.instructions [--requests 300] [--warm 1000] [--repeat 1]
       [--rungs bare,contract,router] [--request json|stream|usage] [--pods 1] [--chunks 8] [--prompt-bytes 0]
       [--every-ms 0] [--worker-src DIR] [--concurrent-jit] [--keep DIR] [--json PATH]
Exit: 0 done, 2 setup failure (valgrind or node missing, a process not starting).
"""

from __future__ import annotations

import argparse
import http.client
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from colocate.workerd import Workerd

from . import harness, ladder

OUT_NAME = "callgrind.out"


def launcher(out_dir: Path) -> list[str]:
    # --smc-check: V8 writes and patches machine code; callgrind must see it change.
    # %p: each process's dumps carry its pid (callgrind.out.<pid>.1 for the first -d).
    # --instr-atstart=no: workerd starts at valgrind's bare cost (a few times native, not callgrind's
    # 50-100): most of a rung's time was its start, which is never counted. `count` switches the
    # instrumentation on before the warm requests.
    return ["valgrind", "--tool=callgrind", "--smc-check=all-non-file", "--instr-atstart=no",
            f"--callgrind-out-file={out_dir / OUT_NAME}.%p"]


# V8 compiles hot functions on the thread that runs them (see above): same code, on time.
SYNC_JIT_FLAGS = ("--no-concurrent-recompilation", "--no-concurrent-sparkplug")
# The router's deadline and stall limit under valgrind: the first routed request (keys, the
# state object, every compile on the router's thread) ran past the benches' 5 s on a loaded
# 2-core machine and was answered by the fallback. Time is not what is counted here.
DEADLINE_MS = 120_000


def require_valgrind() -> None:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise harness.BenchError(f"{tool} is not installed: run `make bench-instructions` (it installs valgrind "
                                     "with apt-get) or `apt-get install -y valgrind`")
    harness.require_node()


def total_instructions(text: str) -> int:
    """The event total of a callgrind dump: its ``summary:`` line, else its ``totals:`` line."""
    for field in ("summary", "totals"):
        m = re.search(rf"^{field}:\s+(\d+)", text, re.M)
        if m:
            return int(m.group(1))
    raise harness.BenchError("the callgrind dump has neither a summary: nor a totals: line")


def drive(url: str, headers: Mapping[str, str], n: int, body: str = harness.BODY, stream: bool = False,
          every_s: float = 0.0) -> int:
    """``n`` requests one after another on one keep-alive connection, each read to its
    end; each must answer 200, and a ``stream`` must end with ``[DONE]``. With ``every_s``,
    request i starts ``i * every_s`` after the first (never early). Returns how many started
    late: their slot had passed while the one before was still answering."""
    host, port = url.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    late = 0
    try:
        start = time.monotonic()
        for i in range(n):
            if every_s > 0:
                wait = start + i * every_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                elif i > 0:
                    late += 1
            conn.request("POST", harness.PATH, body=body, headers=dict(headers))
            res = conn.getresponse()
            data = res.read()
            if res.status != 200:
                raise harness.BenchError(f"{url} answered {res.status}, not 200: the count would measure an error path")
            if stream and not data.rstrip().endswith(b"data: [DONE]"):
                raise harness.BenchError(f"{url} answered a stream that does not end with [DONE]: {data[-120:]!r}")
    finally:
        conn.close()
    return late


def _control(flag: str, pid: int) -> None:
    res = subprocess.run(["callgrind_control", flag, str(pid)], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise harness.BenchError(f"callgrind_control {flag} {pid} failed: {(res.stderr or res.stdout).strip()[-300:]}")


def count(w: Workerd, out_dir: Path, headers: Mapping[str, str], warm: int, requests: int, body: str = harness.BODY,
          stream: bool = False, every_s: float = 0.0) -> tuple[Path, int]:
    """The callgrind dump of ``requests`` requests through ``w``, a workerd started under
    ``launcher(out_dir)``, after ``warm`` requests not counted (back to back), and how many
    counted requests started late for their ``every_s`` slot."""
    _control("--instr=on", w.process.pid)  # started with it off (``launcher``)
    drive(w.url, headers, warm, body, stream)
    _control("-z", w.process.pid)
    late = drive(w.url, headers, requests, body, stream, every_s)
    pattern = f"{OUT_NAME}.{w.process.pid}.*"
    before = set(out_dir.glob(pattern))
    _control("-d", w.process.pid)  # returns once the process has written the dump
    deadline = time.monotonic() + 60
    while not (dumps := sorted(set(out_dir.glob(pattern)) - before)):
        if time.monotonic() > deadline:
            raise harness.BenchError(f"callgrind wrote no dump {pattern} in {out_dir} within 60 s")
        time.sleep(0.1)
    return dumps[-1], late


def run(rungs: Sequence[str], warm: int, requests: int, repeat: int = 1, worker_src: Path | None = None,
        keep: Path | None = None, concurrent_jit: bool = False, log=lambda _m: None, request: str = "json",
        pod_count: int = 1, chunks: int = 8, prompt_bytes: int = 0, every_ms: int = 0) -> dict:
    require_valgrind()
    per: dict[str, list[int]] = {r: [] for r in rungs}
    late = 0
    body = harness.chat_body(request, prompt_bytes)
    with tempfile.TemporaryDirectory(prefix="colocate-callgrind-") as tmp:
        out_dir = Path(tmp)
        # One process at a time: under valgrind each is slow, and a count does not depend
        # on what else runs, so there is nothing to interleave. Repeats go round the rungs
        # so that a drift in the machine (a package upgrade mid-run) shows in every rung.
        for i in range(repeat):
            for rung in rungs:
                under = {"launcher": launcher(out_dir), "v8_flags": () if concurrent_jit else SYNC_JIT_FLAGS}
                with ladder.started(under, (rung,), worker_src, pod_count, chunks, deadline_ms=DEADLINE_MS) as (workers, headers):
                    dump, behind = count(workers[rung], out_dir, headers[rung], warm, requests, body, request != "json",
                                         every_ms / 1000)
                    late += behind
                    per[rung].append(total_instructions(dump.read_text(errors="replace")))
                    if keep is not None:  # for callgrind_annotate
                        keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy(dump, keep / f"callgrind.{rung}.{i + 1}.out")
                log(f"{rung} ({i + 1}/{repeat}): {per[rung][-1] / requests:,.0f} instructions per request"
                    + (f" ({behind} of {requests} late for their {every_ms} ms slot)" if behind else ""))
    out = summarise(per, warm, requests, worker_src)
    out["v8_flags"] = [] if concurrent_jit else list(SYNC_JIT_FLAGS)
    out.update(request=request, pods=pod_count, chunks=chunks if request != "json" else None, prompt_bytes=prompt_bytes,
               body_bytes=len(body.encode()), every_ms=every_ms or None, late=late)
    return out


def summarise(per: Mapping[str, Sequence[int]], warm: int, requests: int, worker_src: Path | None = None) -> dict:
    """Per rung: the median count per request, its spread (max - min over the median) and
    the median's ratio to the bare rung's; the router's to the contract floor's."""
    med = {r: statistics.median(counts) / requests for r, counts in per.items()}
    out: dict[str, Any] = {"warm": warm, "requests": requests, "repeat": max(len(c) for c in per.values()),
           "machine": harness.versions(), "valgrind": harness.first_line(["valgrind", "--version"]),
           "worker_src": str(worker_src) if worker_src else None, "rungs": []}
    base = med.get("bare")
    for rung, counts in per.items():
        out["rungs"].append({"rung": rung, "instructions_per_req": round(med[rung]),
                             "runs": [round(c / requests) for c in counts],
                             "spread": round((max(counts) - min(counts)) / statistics.median(counts), 3),
                             "vs_bare": round(med[rung] / base, 3) if base else None})
    if "router" in med and "contract" in med:
        out["router_vs_contract"] = round(med["router"] / med["contract"], 3)
    return out


def table(result: dict) -> str:
    m = result["machine"]
    what = {"json": "chat completions", "stream": "streams", "usage": "streams with usage"}[result.get("request", "json")]
    if result.get("chunks") is not None:
        what += f" of {result['chunks']} events"
    if result.get("prompt_bytes"):
        what += f", a {result['prompt_bytes']:,}-byte prompt ({result['body_bytes']:,}-byte body)"
    rows = [
        f"instructions per request at 1 client, {what}, {result.get('pods', 1)} pod(s) ({m['workerd']}, {result['valgrind']}; "
        f"{result['requests']} requests counted after {result['warm']} not counted; "
        f"median of {result['repeat']}; V8 flags: {' '.join(result.get('v8_flags') or ['(default)'])}; "
        + (f"one every {result['every_ms']} ms, {result['late']} late)" if result.get("every_ms") else "back to back)"),
        f"{'rung':>10} {'instr/req':>11} {'spread':>7} {'vs bare':>8}",
    ]
    for r in result["rungs"]:
        vs = f"{r['vs_bare']:.3f}" if r["vs_bare"] is not None else "-"
        rows.append(f"{r['rung']:>10} {r['instructions_per_req']:>11,} {r['spread']:>7.1%} {vs:>8}")
    if "router_vs_contract" in result:
        rows.append(f"router / contract floor: {result['router_vs_contract']:.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.instructions", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="requests counted per rung (default 300)")
    p.add_argument("--warm", type=int, default=1000, help="requests sent first and not counted (default 1000)")
    p.add_argument("--repeat", type=int, default=1, help="runs per rung; the median is reported (default 1)")
    p.add_argument(
        "--rungs",
        default=",".join(ladder.RUNGS),
        help=f"comma-separated, of {','.join(ladder.RUNGS + ladder.EXTRA)} (default: all but {','.join(ladder.EXTRA)})",
    )
    p.add_argument("--request", choices=ladder.REQUESTS, default="json",
                   help="a chat completion (json, default), a stream, or a stream that asks for its usage")
    p.add_argument("--prompt-bytes", type=int, default=0,
                   help="a system message of this many bytes in every request (default 0: the user's 'hi' only)")
    p.add_argument("--pods", type=int, default=1, help="bench pods behind every rung (default 1)")
    p.add_argument("--chunks", type=int, default=8, help="SSE events per stream (default 8)")
    p.add_argument("--worker-src", type=Path, help="the router's modules from this directory (a candidate cut)")
    p.add_argument("--concurrent-jit", action="store_true",
                   help="keep V8's concurrent compilation (the router's count then moves by up to 18 %% between runs)")
    p.add_argument("--every-ms", type=int, default=0,
                   help="counted requests start this many ms apart (default 0: back to back); see the module's doc")
    p.add_argument("--keep", type=Path, help="copy each rung's callgrind dump here (for callgrind_annotate)")
    p.add_argument("--json", type=Path, help="also write the result as JSON")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    harness.check_args(p, (("--requests", args.requests, 1), ("--warm", args.warm, 0), ("--repeat", args.repeat, 1),
                           ("--pods", args.pods, 1), ("--chunks", args.chunks, 1), ("--prompt-bytes", args.prompt_bytes, 0),
                           ("--every-ms", args.every_ms, 0)),
                       args.worker_src)
    rungs = tuple(r.strip() for r in args.rungs.split(",") if r.strip())
    unknown = [r for r in rungs if r not in ladder.RUNGS + ladder.EXTRA]
    if not rungs or unknown:
        p.error(f"--rungs {args.rungs!r}: {unknown[0] if unknown else 'empty'} is not a rung; "
                f"use some of {','.join(ladder.RUNGS + ladder.EXTRA)}")
    log = harness.progress(args.quiet)
    return harness.report("bench.instructions", lambda: run(rungs, args.warm, args.requests, args.repeat, args.worker_src,
                                                            args.keep, args.concurrent_jit, log, args.request, args.pods,
                                                            args.chunks, args.prompt_bytes, args.every_ms), table, args.json)


if __name__ == "__main__":
    sys.exit(main())
