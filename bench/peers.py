"""colocate's router against the peers a user would pick instead, one instant pod, one run.

    direct    the bench pod (bench/pod.mjs): the floor every figure is measured from
    colocate  the sandbox stack's plan in workerd (the cloud's bytes), as bench/router.py runs it
    portkey   Portkey's gateway (npm @portkey-ai/gateway, Node, ``--headless``)
    litellm   LiteLLM's proxy (PyPI litellm[proxy], ``litellm --config``, one uvicorn worker)

Each is a pass-through to the same OpenAI-compatible pod: no cache, no log to disk or
database, no telemetry. colocate and LiteLLM hold the pod's credential and check the
client's own (a minted client key; LiteLLM's master key); Portkey's open-source gateway
checks no client key, and the client sends it the pod's credential. Load is ``wrk`` over keep-alive connections on loopback
(bench/post.lua), the targets rotated each round; CPU per request is each process's
utime + stime (its children too) around the run, divided by the requests answered, as
docs/benchmarks.md measures the router. Reported as medians over rounds: added p50 over
direct at 1 client, CPU per request at 1 and 32 clients, throughput at 32 clients; and
colocate against Portkey (the acceptance: added p50 <= 0.5x, CPU per request <= 0.25x).

The peers install themselves on first use, pinned, into bench/.peers/ (git-ignored):
``npm install --prefix bench/.peers`` and a venv of its own at bench/.peers/venv (never
the project's .venv). A peer that cannot be installed or started is left out of the
table, with the reason printed.

Usage: .venv/bin/python -m bench.peers [--rounds 3] [--seconds 3] [--clients 1,32]
       [--peers portkey,litellm|none] [--pod-delay-ms 0] [--json PATH]
Exit: 0 done (the acceptance reported, not enforced), 2 setup failure (wrk, node or the
router missing; a peer that fails is reported and skipped, not fatal).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from colocate.cell import plan as plan_mod

from . import harness

PEERS_DIR = harness.HERE / ".peers"
PORTKEY_VERSION = "1.15.2"  # npm @portkey-ai/gateway
# litellm[proxy]: 1.107.0 was a compromised release (withdrawn), and the proxy extra of
# 1.108 and later names packages not on PyPI; 1.106.12 is the newest whose extra installs.
LITELLM_VERSION = "1.106.12"
PEERS = ("portkey", "litellm")
TARGETS = ("direct", "colocate", *PEERS)
# The acceptance, judged in the same run: colocate against Portkey's gateway.
ACCEPT = {"added_p50_vs_portkey": 0.5, "cpu_vs_portkey": 0.25}


class PeerUnavailable(harness.BenchError):
    """A peer could not be installed or started: it is left out, with this reason."""


# --- installing -----------------------------------------------------------------------------

def _run(args: list[str], what: str, timeout: float) -> None:
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerUnavailable(f"{what}: {exc}") from None
    if res.returncode != 0:
        tail = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if not ln.startswith("WARNING: Location")]
        raise PeerUnavailable(f"{what} failed ({res.returncode}): {' / '.join(tail[-3:])[:400]}")


def portkey_entry(log=lambda _m: None) -> Path:
    """Portkey's gateway server script, installed under bench/.peers on first use."""
    pkg = PEERS_DIR / "node_modules" / "@portkey-ai" / "gateway"
    entry = pkg / "build" / "start-server.js"
    try:
        installed = json.loads((pkg / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        installed = None
    if installed != PORTKEY_VERSION or not entry.exists():
        if shutil.which("npm") is None:
            raise PeerUnavailable("npm is not installed")
        log(f"installing @portkey-ai/gateway@{PORTKEY_VERSION} into {PEERS_DIR} (npm install --prefix)")
        PEERS_DIR.mkdir(exist_ok=True)
        _run(["npm", "install", "--prefix", str(PEERS_DIR), "--no-audit", "--no-fund", "--no-save",
              f"@portkey-ai/gateway@{PORTKEY_VERSION}"], "npm install @portkey-ai/gateway", 600)
        if not entry.exists():
            raise PeerUnavailable(f"npm installed @portkey-ai/gateway but {entry} is missing")
    return entry


def litellm_bin(log=lambda _m: None) -> Path:
    """The ``litellm`` command of its own venv under bench/.peers, made on first use."""
    venv = PEERS_DIR / "venv"
    exe = venv / "bin" / "litellm"
    stamp = venv / f".litellm-{LITELLM_VERSION}"
    if not (exe.exists() and stamp.exists()):
        log(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} (a venv of its own)")
        PEERS_DIR.mkdir(exist_ok=True)
        if not (venv / "bin" / "pip").exists():
            _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", 300)
        _run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
              f"litellm[proxy]=={LITELLM_VERSION}"], "pip install litellm[proxy]", 1200)
        if not exe.exists():
            raise PeerUnavailable(f"pip installed litellm[proxy] but {exe} is missing")
        stamp.touch()
    return exe


# --- running ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int, path: str, headers: Mapping[str, str]) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=harness.BODY, headers=dict(headers))
        res = conn.getresponse()
        res.read()
        return res.status
    except OSError:
        return None
    finally:
        conn.close()


@contextlib.contextmanager
def peer_process(name: str, args: list[str], env: Mapping[str, str], port: int, headers: Mapping[str, str],
                 start_s: float = 120.0) -> Iterator[subprocess.Popen]:
    """``args`` started in a session of its own, ready once a chat request through it answers
    200; stopped (the whole session) on exit. Its output goes to a temporary file, shown when
    it does not start."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        try:
            deadline = time.monotonic() + start_s
            status = None
            while time.monotonic() < deadline and proc.poll() is None:
                status = _answers(port, harness.PATH, headers)
                if status == 200:
                    break
                time.sleep(0.5)
            if status != 200:
                out.seek(0)
                tail = " / ".join(out.read().strip().splitlines()[-4:])[:500]
                why = f"exited {proc.returncode}" if proc.poll() is not None else f"answered {status} after {start_s:g} s"
                raise PeerUnavailable(f"{name} did not serve a chat request ({why}): {tail}")
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def portkey(pod_url: str, pod_token: str, log) -> tuple[contextlib.AbstractContextManager, dict[str, str]]:
    entry = portkey_entry(log)
    port = free_port()
    # The pod as a custom host of the OpenAI provider, by Portkey's documented headers for a
    # self-hosted OpenAI-compatible server, the pod's credential sent by the client: the cheaper
    # of its two ways here (the same in an x-portkey-config with the credential in it cost it
    # 1.8-2.3 ms of CPU a request at 32 clients against 1.5-1.7 ms, in one run, 2026-12-06).
    headers = {"content-type": "application/json", "x-portkey-provider": "openai",
               "x-portkey-custom-host": pod_url + "/v1", "authorization": f"Bearer {pod_token}"}
    env = {"NODE_ENV": "production"}  # production: no log console, no UI routes (also --headless)
    ctx = peer_process("portkey", ["node", str(entry), f"--port={port}", "--headless"], env, port, headers)
    return _Served(ctx, f"http://127.0.0.1:{port}"), headers


def litellm(pod_url: str, pod_token: str, workdir: Path, log) -> tuple[contextlib.AbstractContextManager, dict[str, str]]:
    exe = litellm_bin(log)
    port = free_port()
    master = "sk-bench-" + os.urandom(12).hex()
    # One model, straight to the pod; no cache, no callbacks (nothing logged anywhere), no
    # database (keys are the master key only), no telemetry.
    config = {
        "model_list": [{"model_name": "bench", "litellm_params": {
            "model": "openai/bench", "api_base": pod_url + "/v1", "api_key": "os.environ/BENCH_POD_TOKEN"}}],
        "litellm_settings": {"telemetry": False, "cache": False, "drop_params": True, "set_verbose": False,
                             "success_callback": [], "failure_callback": [], "callbacks": []},
        "general_settings": {"master_key": "os.environ/BENCH_MASTER_KEY", "disable_spend_logs": True},
    }
    path = workdir / "litellm.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    path.chmod(0o600)
    env = {"BENCH_POD_TOKEN": pod_token, "BENCH_MASTER_KEY": master, "LITELLM_LOG": "ERROR",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_MODE": "PRODUCTION",
           "DATABASE_URL": "", "NO_DOCS": "True"}
    env = {k: v for k, v in env.items() if v}
    headers = {"content-type": "application/json", "authorization": f"Bearer {master}"}
    args = [str(exe), "--config", str(path), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    ctx = peer_process("litellm", args, env, port, headers, start_s=180.0)
    return _Served(ctx, f"http://127.0.0.1:{port}"), headers


class _Served:
    """A peer's process context that yields (url, pid)."""

    def __init__(self, ctx, url: str):
        self.ctx, self.url = ctx, url

    def __enter__(self):
        proc = self.ctx.__enter__()
        return self.url, proc.pid

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its descendants still running (uvicorn's worker, say)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += harness.cpu_seconds(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
    return total


def measured(pid: int | None, run) -> dict:
    before = tree_cpu_seconds(pid) if pid else 0.0
    out = run()
    if pid:
        out["cpu_us_per_req"] = round((tree_cpu_seconds(pid) - before) * 1e6 / out["n"], 1) if out["n"] else None
    return out


# --- a whole run -----------------------------------------------------------------------------

def run(rounds: int, seconds: float, clients: tuple[int, ...], peers: tuple[str, ...], log, pod_delay_ms: float = 0.0) -> dict:
    harness.require_tools()
    plan = harness.bench_plan(5000)
    secrets = harness.Secrets.fresh()
    machine = harness.versions()
    skipped: dict[str, str] = {}
    with harness.pods(1, pod_delay_ms, secrets.pod_token) as pod_urls, harness.pods(1, 0, None) as fallback, \
            tempfile.TemporaryDirectory(prefix="colocate-peers-") as tmp, contextlib.ExitStack() as stack:
        values = {"POD_URLS": plan_mod.pod_urls_text(pod_urls), "FALLBACK_URL": fallback[0], **secrets.bindings()}
        router = stack.enter_context(harness.router_worker(plan, values, None))
        key = harness.mint_key(router.url, secrets.probe_token)
        urls = {"direct": pod_urls[0], "colocate": router.url}
        pids: dict[str, int | None] = {"direct": None, "colocate": router.process.pid}
        hdrs = {"direct": harness.direct_headers(secrets.pod_token), "colocate": harness.router_headers(key)}
        harness.check_router(router.url, hdrs["colocate"])
        for name in peers:
            try:
                served, headers = (portkey(pod_urls[0], secrets.pod_token, log) if name == "portkey"
                                   else litellm(pod_urls[0], secrets.pod_token, Path(tmp), log))
                urls[name], pids[name] = stack.enter_context(served)
                hdrs[name] = headers
            except PeerUnavailable as exc:
                skipped[name] = str(exc)
                log(f"{name}: left out: {exc}")
        targets = tuple(t for t in TARGETS if t in urls)
        for t in targets:  # every peer's request reaches the pod: the pod's count moves by one
            before = harness.answered(pod_urls[0])
            status = _answers(int(urls[t].rsplit(":", 1)[1]), harness.PATH, hdrs[t])
            if status != 200 or harness.answered(pod_urls[0]) != before + 1:
                raise harness.BenchError(f"{t} answered {status} without exactly one pod answer: not a pass-through")
        for t in targets:  # warm: JITs, connection pools
            harness.wrk_run(urls[t], max(clients), 1, hdrs[t])
        levels: dict[int, list[dict]] = {c: [] for c in clients}
        for r in range(rounds):
            for c in clients:
                rd = {}
                for t in harness.rotated(targets, r):
                    rd[t] = measured(pids[t], lambda t=t, c=c: harness.wrk_run(urls[t], c, seconds, hdrs[t]))
                levels[c].append(rd)
                log(f"round {r + 1}/{rounds} clients {c}: "
                    + ", ".join(f"{t} {rd[t]['rps']:.0f} req/s p50 {rd[t]['p50_ms']:.3f} ms "
                                f"{rd[t].get('cpu_us_per_req') or 0:.0f} us" for t in targets))
        fallback_answers = harness.answered(fallback[0])
    if fallback_answers:
        raise harness.BenchError(f"the router's fallback answered {fallback_answers} requests: not the pod path")
    return {"machine": machine, "options": {"rounds": rounds, "seconds": seconds, "clients": list(clients),
                                           "pod_delay_ms": pod_delay_ms},
            "versions": {"portkey": PORTKEY_VERSION, "litellm": LITELLM_VERSION},
            "compatibility_date": plan.worker.compatibility_date, "skipped": skipped,
            "summary": summarise(levels, targets), "levels": {str(c): rs for c, rs in levels.items()}}


def summarise(levels: dict[int, list[dict]], targets: tuple[str, ...]) -> dict:
    """Per target: added p50 over direct (per round, then the median), CPU per request and
    throughput at each client count (medians); colocate against Portkey, per round."""
    med = harness.median
    out: dict = {}
    for t in targets:
        row: dict = {}
        for c, rounds in levels.items():
            row[f"p50_ms_{c}"] = med(r[t]["p50_ms"] for r in rounds)
            row[f"added_p50_ms_{c}"] = med(r[t]["p50_ms"] - r["direct"]["p50_ms"] for r in rounds)
            row[f"cpu_us_{c}"] = med(r[t].get("cpu_us_per_req") for r in rounds)
            row[f"rps_{c}"] = med(r[t]["rps"] for r in rounds)
            row[f"errors_{c}"] = sum(r[t]["errors"] for r in rounds)
        out[t] = row
    if "portkey" in targets:
        vs: dict = {}
        for c, rounds in levels.items():
            added = [(r["colocate"]["p50_ms"] - r["direct"]["p50_ms"], r["portkey"]["p50_ms"] - r["direct"]["p50_ms"])
                     for r in rounds]
            vs[f"added_p50_{c}"] = med(a / b for a, b in added if b > 0)
            vs[f"cpu_{c}"] = med(r["colocate"]["cpu_us_per_req"] / r["portkey"]["cpu_us_per_req"] for r in rounds
                                 if r["colocate"].get("cpu_us_per_req") and r["portkey"].get("cpu_us_per_req"))
        out["colocate_vs_portkey"] = vs
    return out


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    m, o, s = result["machine"], result["options"], result["summary"]
    lo, hi = min(o["clients"]), max(o["clients"])
    pod = f"one bench pod answering {o['pod_delay_ms']:g} ms late" if o.get("pod_delay_ms") else "one instant bench pod"
    rows = [f"colocate and its peers, {pod} ({m['workerd']}, node {m['node']}, Portkey "
            f"{result['versions']['portkey']}, LiteLLM {result['versions']['litellm']}; {m['cpus']} CPUs, load "
            f"{m['loadavg_at_start'][0]:.1f} at start; {o['rounds']} rounds x {o['seconds']:g} s, medians)",
            "",
            f"| | added p50 ({lo} client) | CPU per request ({lo} / {hi} clients) | throughput ({hi} clients) |",
            "|---|---:|---:|---:|"]
    names = {"colocate": "colocate", "portkey": "Portkey's gateway", "litellm": "LiteLLM's proxy"}
    for t in ("colocate", *PEERS):
        if t not in s:
            continue
        x = s[t]
        errs = sum(v for k, v in x.items() if k.startswith("errors_"))
        rows.append(f"| {names[t]} | {_f(x[f'added_p50_ms_{lo}'], '+.2f')} ms | {_f(x[f'cpu_us_{lo}'], ',.0f')} / "
                    f"{_f(x[f'cpu_us_{hi}'], ',.0f')} µs | {_f(x[f'rps_{hi}'], ',.0f')} req/s |"
                    + (f" {errs} errors" if errs else ""))
    d = s["direct"]
    rows.append(f"\ndirect: p50 {_f(d[f'p50_ms_{lo}'], '.3f')} ms at {lo} client, {_f(d[f'rps_{hi}'], ',.0f')} req/s "
                f"at {hi} (wrk's own ceiling, not a target)")
    for name, why in result["skipped"].items():
        rows.append(f"{name}: NOT MEASURED: {why}")
    vs = s.get("colocate_vs_portkey")
    if vs:
        a, c = vs.get(f"added_p50_{lo}"), vs.get(f"cpu_{hi}")
        rows.append(
            f"colocate / Portkey (per round, medians): added p50 x{_f(a, '.2f')} (goal <= {ACCEPT['added_p50_vs_portkey']}: "
            f"{'met' if a is not None and a <= ACCEPT['added_p50_vs_portkey'] else 'MISSED'}), CPU per request at {hi} "
            f"clients x{_f(c, '.2f')} (goal <= {ACCEPT['cpu_vs_portkey']}: "
            f"{'met' if c is not None and c <= ACCEPT['cpu_vs_portkey'] else 'MISSED'}); at {lo} client x"
            f"{_f(vs.get(f'cpu_{lo}'), '.2f')}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians (default 3)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each wrk run (default 3)")
    p.add_argument("--clients", default="1,32", help="client counts, the first for p50, the last for throughput (default 1,32)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"which peers, or none (default {','.join(PEERS)})")
    p.add_argument("--pod-delay-ms", type=float, default=0.0, help="the bench pod answers after this long (default 0)")
    p.add_argument("--json", type=Path, help="also write the result as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    try:
        clients = tuple(sorted(int(x) for x in args.clients.split(",") if x.strip()))
    except ValueError:
        p.error(f"--clients {args.clients!r}: not a comma-separated list of whole numbers")
    if not clients or clients[0] < 1 or clients[-1] > 256:
        p.error(f"--clients {args.clients!r}: use whole numbers 1..256")
    peers = tuple(x.strip() for x in args.peers.split(",") if x.strip() and x.strip() != "none")
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; use {', '.join(PEERS)}")
    harness.check_args(p, (("--rounds", args.rounds, 1), ("--seconds", args.seconds, 1),
                           ("--pod-delay-ms", args.pod_delay_ms, 0)))
    return harness.report("bench.peers", lambda: run(args.rounds, args.seconds, clients, peers, harness.progress(args.quiet),
                                                     args.pod_delay_ms), table, args.json)


if __name__ == "__main__":
    sys.exit(main())
