"""The router benchmark's processes and measurements (bench/router.py is the CLI).

Four targets, measured interleaved in each round so that whatever else the machine is
doing lands on all of them alike:

    direct    straight to the bench pod (bench/pod.mjs, Node, answers at once)
    bare      bench/passthrough.js in workerd: fetch(pod) and return, the floor
    contract  bench/contract.js in workerd: only what colocate's contract requires of any
              router (credential swap, body held for a retry, deadline, answer in hand,
              the two contract headers), none of the router's own logic
    router    the plan's Worker in workerd (colocate.workerd: the cloud's bytes)

Each workerd target runs in its own process, so the CPU each one spends is
read from its own /proc/<pid>/stat (utime + stime) around each run. Non-streaming load
comes from ``wrk`` (compiled; bench/post.lua), streaming from bench/sse.mjs (time to
first and to last byte). Imports no Pulumi.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from colocate import stackfile
from colocate.cell import plan as plan_mod, settings as settings_mod
from colocate.errors import ScriptError
from colocate.workerd import (
    MAIN_SERVICE,
    SOCKET_NAME,
    Workerd,
    WorkerdError,
    capnp_text,
    config_capnp,
    network_service,
    socket_capnp,
    worker_service,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATH = "/v1/chat/completions"
_CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# What each request kind adds to the chat request. usage: the same stream with its usage
# asked for (OpenAI's stream_options): the router then reads the stream's last event for
# the token count, as it does for a real client that asks it.
KINDS = {"json": {}, "stream": {"stream": True}, "usage": {"stream": True, "stream_options": {"include_usage": True}}}
_FILLER = "The quick brown fox jumps over the lazy dog. "


def chat_body(kind: str = "json", prompt_bytes: int = 0) -> str:
    """The bench's chat request of ``kind`` (KINDS). ``prompt_bytes`` > 0 puts a system
    message of that many ASCII bytes before the user's "hi": a real prompt's size."""
    chat = dict(_CHAT)
    if prompt_bytes:
        system = (_FILLER * (prompt_bytes // len(_FILLER) + 1))[:prompt_bytes]
        chat["messages"] = [{"role": "system", "content": system}, *_CHAT["messages"]]
    return json.dumps({**chat, **KINDS[kind]})


BODY = chat_body("json")
STREAM_BODY = chat_body("stream")
STREAM_USAGE_BODY = chat_body("usage")
TARGETS = ("direct", "bare", "contract", "router")
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The router's goals (medians over rounds, same run), against bare. goals() also judges each
# limit with the contract floor (the least any router keeping colocate's contract does) in
# place of bare, as own_<goal>: they bound the router's own logic.
GOALS = {
    "cpu_ratio_32": 1.10,         # router CPU/request <= 1.10 x bare, at 32 clients
    "throughput_ratio_32": 0.90,  # router req/s >= 0.90 x bare, at 32 clients
    "added_p50_ms_1": 0.1,        # router p50 - bare p50 <= 0.1 ms, at 1 client
    "sse_added_ttfb_ms_1": 0.2,   # router SSE TTFB p50 - bare <= 0.2 ms, at 1 client
}


class BenchError(ScriptError):
    """Setup failures the CLI reports with exit 2 (a tool missing, a process not starting)."""

    exit_code = 2


@dataclass(frozen=True)
class Secrets:
    """Bench-only values, generated per run and never printed."""

    pod_token: str
    fallback_api_key: str
    probe_token: str

    @classmethod
    def fresh(cls) -> Secrets:
        return cls(os.urandom(12).hex(), os.urandom(12).hex(), os.urandom(12).hex())

    def bindings(self) -> dict[str, str]:
        # One operator credential serves every role here: the bench mints its key and probes.
        return {"POD_TOKEN": self.pod_token, "FALLBACK_API_KEY": self.fallback_api_key,
                "READ_TOKEN": self.probe_token, "ADMIN_TOKEN": self.probe_token, "EXCHANGE_TOKEN": self.probe_token}


def router_headers(client_key: str | None = None) -> dict[str, str]:
    """Every header a routed benchmark request carries, in one place: when routed paths
    need a client key, pass the minted ``clc_...`` key here."""
    h = {"content-type": "application/json"}
    if client_key:
        h["authorization"] = f"Bearer {client_key}"
    return h


def direct_headers(pod_token: str) -> dict[str, str]:
    # Straight to the pod, and through the bare Worker (which forwards as-is): the pod's token.
    return {"content-type": "application/json", "authorization": f"Bearer {pod_token}"}


# --- processes --------------------------------------------------------------------------

def require_node() -> None:
    if shutil.which("node") is None:
        raise BenchError("node is not installed (the bench pod and the SSE client are Node scripts)")


def require_tools() -> None:
    if shutil.which("wrk") is None:
        raise BenchError("wrk is not installed: run `make bench` (it installs it with apt-get) or `apt-get install -y wrk`")
    require_node()


@contextlib.contextmanager
def pods(count: int, delay_ms: float, token: str | None, slots: int = 0, chunks: int = 8,
         chunk_ms: float = 0.0, pad: int = 0) -> Iterator[list[str]]:
    """``count`` bench pods (one Node process, one listener each, at most ``slots``
    requests in work per pod, 0 = unbounded; streams of ``chunks`` events, ``chunk_ms``
    apart, 0 = on the next turn of the pod's event loop, each event's content ``pad``
    characters longer); yields their URLs."""
    args = ["node", str(HERE / "pod.mjs"), "--count", str(count), "--delay-ms", str(delay_ms), "--slots", str(slots),
            "--chunks", str(chunks), "--chunk-ms", str(chunk_ms), "--pad", str(pad)]
    if token:
        args += ["--token", token]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise BenchError("the bench pod (bench/pod.mjs) did not start")
        yield json.loads(line)["urls"]
    finally:
        stop(proc)


STOP_WAIT_S = 10.0  # how long a pod process gets to end on SIGTERM before SIGKILL


def stop(proc: subprocess.Popen) -> None:
    """A pod process the bench started, ended: SIGTERM, then SIGKILL after STOP_WAIT_S; its pipe closed."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()


def write_json(dest: str | None, doc, indent: int = 2) -> None:
    """``--json``: "-" prints the document on stdout, a path writes it there, None does nothing."""
    if dest == "-":
        print(json.dumps(doc, indent=indent))
    elif dest:
        Path(dest).write_text(json.dumps(doc, indent=indent) + "\n")


def bench_plan(deadline_ms: int, worker_src: Path | None = None, balance: str | None = None):
    """The sandbox stack's plan (the cloud's Worker), with the bench's deadline, which is
    also its stall limit (as the contract floor's: under valgrind a JIT compile on the
    router's thread can outlast the sandbox's 2 s and cut a stream) and, when longer, its body
    timeout (under valgrind on a loaded machine a 16 KiB body took the router past its 10 s and
    was refused 408, colocate:worker.bodyTimeoutMs); with ``worker_src``
    the same module names read from another directory (a candidate cut); with ``balance``
    that policy (colocate:worker.balance) instead of the stack's."""
    raw, secrets = stackfile.read_config("sandbox")
    worker = raw.get("worker") or {}
    body_ms = max(deadline_ms, int(worker.get("bodyTimeoutMs", settings_mod.WORKER_DEFAULTS["bodyTimeoutMs"])))
    raw["worker"] = {**worker, "deadlineMs": deadline_ms, "stallMs": deadline_ms, "bodyTimeoutMs": body_ms,
                     **({"balance": balance} if balance else {})}
    s = settings_mod.parse(raw, "sandbox", secrets=set(secrets) | set(settings_mod.ALWAYS_SECRET))
    plan = plan_mod.plan_cell(s)
    if worker_src is None:
        return plan
    modules = []
    for m in plan.worker.modules:
        p = Path(worker_src) / m.name
        if not p.exists():
            raise BenchError(f"--worker-src {worker_src}: module {m.name} is missing there")
        modules.append(dataclasses.replace(m, path=p))
    return dataclasses.replace(plan, worker=dataclasses.replace(plan.worker, modules=tuple(modules)))


def floor_config(compatibility_date: str, main: str, bindings: Mapping[str, str], port: int,
                 router_modules: tuple[str, ...] = ()) -> str:
    """workerd config for a floor Worker: bench/``main`` first, then ``router_modules`` and
    every module they import, read from worker/src (the router's own bytes), the plan's
    compatibility date, and the same outbound network service as colocate.workerd.render_config."""
    mods = [(main, (HERE / main).read_text())] + list(with_imports(router_modules).items())
    net = network_service()
    mod_list = ", ".join(f"(name = {capnp_text(n)}, esModule = {capnp_text(src)})" for n, src in mods)
    bind_list = ", ".join(f"(name = {capnp_text(k)}, text = {capnp_text(v)})" for k, v in bindings.items())
    lit = (f"(\n  modules = [{mod_list}],\n"
           f"  compatibilityDate = {capnp_text(compatibility_date)},\n"
           f"  bindings = [{bind_list}],\n"
           f"  globalOutbound = {capnp_text(net[0])}\n)")
    return config_capnp([worker_service(MAIN_SERVICE, lit), net], [socket_capnp(SOCKET_NAME, port, MAIN_SERVICE)])


MODULE_IMPORT = re.compile(r'from\s+"\./([\w.-]+\.js)"')


def with_imports(names: Sequence[str]) -> dict[str, str]:
    """worker/src modules ``names`` and those they import, transitively: name -> source.
    Following the imports keeps a floor Worker loadable when a router module gains one."""
    out: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = (ROOT / "worker" / "src" / name).read_text()
        todo.extend(MODULE_IMPORT.findall(out[name]))
    return out


def bare_config(compatibility_date: str, pod_urls: list[str], port: int) -> str:
    """The floor: passthrough.js, nothing but fetch(pod)."""
    return floor_config(compatibility_date, "passthrough.js", {"POD_URLS": plan_mod.pod_urls_text(pod_urls)}, port)


def contract_config(compatibility_date: str, pod_urls: list[str], pod_token: str, deadline_ms: int, port: int) -> str:
    """The contract floor: contract.js with the router's forward.js and timing.js."""
    bindings = {"POD_URLS": plan_mod.pod_urls_text(pod_urls), "POD_TOKEN": pod_token, "DEADLINE_MS": str(deadline_ms)}
    return floor_config(compatibility_date, "contract.js", bindings, port, ("forward.js", "timing.js"))


@contextlib.contextmanager
def floor_worker(config_for, under: Mapping[str, Sequence[str]] | None = None) -> Iterator[Workerd]:
    """A floor Worker in its own workerd: ``config_for(port)`` renders its config;
    ``under``: Workerd's ``launcher`` and ``v8_flags`` (bench/instructions.py)."""
    with Workerd(**(under or {})) as w:
        w.start(config_for(w.port))
        yield w


@contextlib.contextmanager
def router_worker(plan, values: Mapping[str, str], far_state_ms: float | None,
                  under: Mapping[str, Sequence[str]] | None = None) -> Iterator[Workerd]:
    if far_state_ms is None:
        with Workerd.serve(plan.worker, values, **(under or {})) as w:
            yield w
        return
    from colocate.sandbox.bench import router_with_state_delay

    if under:
        raise BenchError("a far state object is not measured under valgrind")
    with router_with_state_delay(plan, values, far_state_ms) as w:
        yield w


# --- measurement ------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """The CPU time of a process's threads, in seconds: the sum of its threads' run times in ns
    (/proc/PID/task/TID/schedstat), else utime + stime in clock ticks. Ticks are 10 ms: a 1 s
    run of the bare Worker on a loaded machine can spend less than one, and a ratio to it
    would divide by zero."""
    if os.path.exists(f"/proc/{pid}/schedstat"):  # the kernel keeps schedstats (CONFIG_SCHED_INFO)
        total = 0
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                with open(f"{task.path}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        return total / 1e9
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15 of proc(5)


def _lua(headers: Mapping[str, str], body: str) -> str:
    template = (HERE / "post.lua").read_text()
    lines = "\n".join(f'wrk.headers["{k}"] = [==[{v}]==]' for k, v in headers.items())
    return template.replace("@BODY@", body).replace("@HEADERS@", lines)


def wrk_run(url: str, clients: int, seconds: float, headers: Mapping[str, str], body: str = BODY) -> dict:
    """Closed-loop load from ``clients`` keep-alive connections for ``seconds``."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="colocate-bench-") as script:
        script.write(_lua(headers, body))
        script.flush()
        threads = 1 if clients == 1 else 2
        args = ["wrk", "-t", str(threads), "-c", str(clients), "-d", f"{max(1, round(seconds))}s", "--timeout", "10s",
                "--latency", "-s", script.name, url + PATH]
        res = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if res.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()[-300:]}")
    s = json.loads(line[6:])
    errors = s["connect"] + s["read"] + s["write"] + s["status"] + s["timeout"]
    secs = s["us"] / 1e6
    return {"n": s["n"], "errors": errors, "seconds": round(secs, 3), "rps": round(s["n"] / secs, 1) if secs else 0.0,
            "p50_ms": round(s["p50_us"] / 1000, 3), "p99_ms": round(s["p99_us"] / 1000, 3)}


def sse_run(url: str, clients: int, requests: int, seconds: float, headers: Mapping[str, str],
            usage: bool = False, prompt_bytes: int = 0) -> dict:
    args = ["node", str(HERE / "sse.mjs"), url + PATH, str(clients), str(requests), str(seconds),
            json.dumps(dict(headers)), chat_body("usage" if usage else "stream", prompt_bytes)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)
    if res.returncode != 0 or not res.stdout.strip():
        raise BenchError(f"bench/sse.mjs failed ({res.returncode}): {res.stderr.strip()[-300:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measured(pid: int | None, run) -> dict:
    """Run ``run()`` and add the workerd process's CPU µs per answered request."""
    before = cpu_seconds(pid) if pid else None
    out = run()
    if pid:
        spent = cpu_seconds(pid) - before
        out["cpu_us_per_req"] = round(spent * 1e6 / out["n"], 1) if out["n"] else None
    return out


def answered(pod_url: str) -> int:
    """How many requests a bench pod process has answered (all its listeners)."""
    import urllib.request

    with urllib.request.urlopen(pod_url + "/__bench/count", timeout=10) as r:
        return json.loads(r.read())["answered"]


def rotated(items: tuple, r: int) -> tuple:
    """``items`` started at position r (mod len): round r's order, so no target always runs first."""
    k = r % len(items)
    return items[k:] + items[:k]


def median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


# --- a whole run ------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    clients: tuple[int, ...] = (1, 32)
    rounds: int = 5
    seconds: float = 3.0
    stream: bool = True
    sse_usage: bool = False  # the SSE runs ask for the stream's usage (include_usage)
    sse_requests: int = 3000
    sse_chunks: int = 8  # events per bench pod stream (a real pod sends one per token)
    sse_chunk_ms: float = 0.0  # between them; 0 = as fast as the pod's event loop turns
    pods: tuple[int, ...] = (1,)
    pod_delay_ms: float = 0.0
    pod_slots: int = 0
    deadline_ms: int = 5000
    far_state_ms: float | None = None
    worker_src: Path | None = None
    client_key: str | None = None  # for routed requests once they need one (router_headers)
    prompt_bytes: int = 0  # a system message of this many bytes in every request (chat_body)
    balance: str | None = None  # colocate:worker.balance; None: the stack's (the cells' default)
    state_requests: int = 300  # sequential requests that read the router's wait on state (state_waits)


def check_router(url: str, headers: Mapping[str, str], timeout_s: float = 30) -> str:
    """One routed request must be served by a pod, or the numbers would measure the fallback."""
    import http.client

    host, port = url.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", PATH, body=BODY, headers=dict(headers))
        res = conn.getresponse()
        res.read()
        backend = res.getheader("x-colocate-backend") or ""
    finally:
        conn.close()
    if res.status != 200 or not backend.startswith("pod"):
        raise BenchError(f"the router answered {res.status} from {backend or 'nowhere'!r}, not from a pod: "
                         "check the bench pod's token and the router's bindings")
    return backend


def state_waits(url: str, headers: Mapping[str, str], n: int = 300) -> dict:
    """The router's own Server-Timing ``state`` (time waited on the state object before
    forwarding) over ``n`` sequential requests on one connection: p50 and p99 in ms."""
    import http.client

    from colocate.probe import timing

    host, port = url.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    waits = []
    try:
        for _ in range(n):
            conn.request("POST", PATH, body=BODY, headers=dict(headers))
            res = conn.getresponse()
            res.read()
            state = timing.parse(res.getheader("server-timing")).durations.get("state")
            if state is not None:
                waits.append(state)
    finally:
        conn.close()
    waits.sort()
    pick = (lambda q: waits[min(len(waits) - 1, round(q / 100 * (len(waits) - 1)))]) if waits else (lambda q: None)
    return {"n": len(waits), "p50_ms": pick(50), "p99_ms": pick(99)}


def mint_key(url: str, probe_token: str) -> str:
    """A client key for the bench's routed requests, through the router's admin endpoint."""
    from colocate.admin import AdminClient, Target

    # No limits: the bench measures the router, not a key's limits (colocate:keys.defaults are finite).
    return AdminClient(Target(url, probe_token, "url")).create_key("bench", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0,
                                                                   max_parallel_tokens=0)["key"]


def state_distance(url: str, probe_token: str, samples: int = 5) -> dict:
    """Where the object is and what a forced round trip to it costs (the probe endpoint)."""
    import requests

    rtts, colo = [], None
    with requests.Session() as s:
        for _ in range(samples):
            body = s.get(url + "/_colocate/probe", timeout=30, headers={"Authorization": f"Bearer {probe_token}"}).json()
            rtts.append(body["state_rtt_ms"])
            colo = body["state_colo"]
    return {"state_colo": colo, "state_rtt_p50_ms": median(rtts)}


def summarise(rounds: list[dict]) -> dict:
    """Medians over rounds: each target's own numbers, and router-vs-bare per round (also
    router-vs-contract and contract-vs-bare when the contract floor was run)."""
    out: dict = {"median": {}, "router_vs_bare": {}, "bare_vs_direct": {}}
    present = [t for t in TARGETS if t in rounds[0]]
    for t in present:
        rs = [r[t] for r in rounds]
        m = {k: median(x.get(k) for x in rs) for k in ("p50_ms", "p99_ms", "rps", "cpu_us_per_req")}
        m["errors"] = sum(x["errors"] for x in rs)
        m["fallback_answers"] = sum(x.get("fallback_answers", 0) + x.get("sse", {}).get("fallback_answers", 0) for x in rs)
        if all("sse" in x for x in rs):
            m["sse"] = {k: median(x["sse"].get(k) for x in rs)
                        for k in ("ttfb_p50_ms", "ttfb_p99_ms", "ttlb_p50_ms", "ttlb_p99_ms", "rps", "cpu_us_per_req")}
            m["sse"]["errors"] = sum(x["sse"]["errors"] for x in rs)
        out["median"][t] = m

    def per_round(a: str, b: str) -> dict:
        def diff(k, sub=None):
            return median((r[a][sub][k] if sub else r[a][k]) - (r[b][sub][k] if sub else r[b][k]) for r in rounds
                          if (r[a][sub][k] if sub else r[a][k]) is not None)

        def ratio(k):
            return median(r[a][k] / r[b][k] for r in rounds if r[a].get(k) and r[b].get(k))

        d = {"added_p50_ms": diff("p50_ms"), "added_p99_ms": diff("p99_ms"), "throughput_ratio": ratio("rps")}
        if a != "direct" and b != "direct":
            d["cpu_ratio"] = ratio("cpu_us_per_req")
        if all("sse" in r[a] and "sse" in r[b] for r in rounds):
            d["sse_added_ttfb_p50_ms"] = diff("ttfb_p50_ms", "sse")
            d["sse_added_ttlb_p50_ms"] = diff("ttlb_p50_ms", "sse")
            if a != "direct" and b != "direct":
                d["sse_cpu_ratio"] = median(r[a]["sse"]["cpu_us_per_req"] / r[b]["sse"]["cpu_us_per_req"] for r in rounds
                                            if r[a]["sse"].get("cpu_us_per_req") and r[b]["sse"].get("cpu_us_per_req"))
        return d

    out["router_vs_bare"] = per_round("router", "bare")
    out["bare_vs_direct"] = per_round("bare", "direct")
    if "contract" in present:
        out["contract_vs_bare"] = per_round("contract", "bare")
        out["router_vs_contract"] = per_round("router", "contract")
    return out


def goals(series: list[dict]) -> list[dict]:
    """The router's goals, judged per pod count on the medians against bare; and the same
    limits against the contract floor (``own_`` goals) when it ran."""
    checks = []

    def check(name, pods, clients, value, limit, upper=True):
        met = None if value is None else (value <= limit if upper else value >= limit)
        checks.append({"goal": name, "pods": pods, "clients": clients, "value": value, "limit": limit, "met": met})

    for s in series:
        for lv in s["levels"]:
            for prefix, floor in (("", "router_vs_bare"), ("own_", "router_vs_contract")):
                rb = lv.get(floor)
                if not rb:
                    continue
                if lv["clients"] == 32:
                    check(prefix + "cpu_ratio", s["pods"], 32, rb.get("cpu_ratio"), GOALS["cpu_ratio_32"])
                    check(prefix + "throughput_ratio", s["pods"], 32, rb.get("throughput_ratio"), GOALS["throughput_ratio_32"],
                          upper=False)
                if lv["clients"] == 1:
                    check(prefix + "added_p50_ms", s["pods"], 1, rb.get("added_p50_ms"), GOALS["added_p50_ms_1"])
                    if "sse_added_ttfb_p50_ms" in rb:
                        check(
                            prefix + "sse_added_ttfb_ms", s["pods"], 1, rb["sse_added_ttfb_p50_ms"], GOALS["sse_added_ttfb_ms_1"]
                        )
    return checks


def run_series(opts: Options, plan, secrets: Secrets, pod_count: int, log=lambda _msg: None) -> dict:
    hdr_pod = direct_headers(secrets.pod_token)
    with pods(pod_count, opts.pod_delay_ms, secrets.pod_token, opts.pod_slots, opts.sse_chunks, opts.sse_chunk_ms) as pod_urls, \
            pods(1, 0, None) as fallback:
        values = {"POD_URLS": plan_mod.pod_urls_text(pod_urls), "FALLBACK_URL": fallback[0], **secrets.bindings()}
        compat = plan.worker.compatibility_date
        with (
            floor_worker(lambda port: bare_config(compat, pod_urls, port)) as bare,
            floor_worker(lambda port: contract_config(compat, pod_urls, secrets.pod_token, opts.deadline_ms, port)) as contract,
            router_worker(plan, values, opts.far_state_ms) as router,
        ):
            # Routed requests need a client key: the router checks it on every request.
            key = opts.client_key or mint_key(router.url, secrets.probe_token)
            hdr_router = router_headers(key)
            urls = {"direct": pod_urls[0], "bare": bare.url, "contract": contract.url, "router": router.url}
            pids = {"direct": None, "bare": bare.proc.pid, "contract": contract.proc.pid, "router": router.proc.pid}
            # The contract Worker gets the router's request bytes (it swaps the credential too).
            hdrs = {"direct": hdr_pod, "bare": hdr_pod, "contract": hdr_router, "router": hdr_router}
            backend = check_router(router.url, hdr_router)
            body = chat_body("json", opts.prompt_bytes)
            for t in TARGETS:  # warm: isolates, connection pools, the object's first touch
                wrk_run(urls[t], max(opts.clients), 1, hdrs[t], body)
            far = state_distance(router.url, secrets.probe_token) if opts.far_state_ms is not None else None
            levels = {c: [] for c in opts.clients}
            for r in range(opts.rounds):
                for c in opts.clients:
                    order = rotated(TARGETS, r)
                    rd: dict = {}
                    for t in order:
                        before = answered(fallback[0])
                        rd[t] = measured(pids[t], lambda t=t, c=c: wrk_run(urls[t], c, opts.seconds, hdrs[t], body))
                        rd[t]["fallback_answers"] = answered(fallback[0]) - before
                    if opts.stream:
                        for t in order:
                            before = answered(fallback[0])
                            rd[t]["sse"] = measured(pids[t], lambda t=t, c=c: sse_run(urls[t], c, opts.sse_requests,
                                                                                      opts.seconds, hdrs[t], opts.sse_usage,
                                                                                      opts.prompt_bytes))
                            rd[t]["sse"]["fallback_answers"] = answered(fallback[0]) - before
                    levels[c].append(rd)
                    log(f"pods {pod_count} round {r + 1}/{opts.rounds} clients {c}: "
                        + ", ".join(f"{t} {rd[t]['rps']:.0f} req/s p50 {rd[t]['p50_ms']:.3f} ms" for t in TARGETS))
            state = state_waits(router.url, hdr_router, opts.state_requests)
    return {
        "pods": pod_count,
        "pod_delay_ms": opts.pod_delay_ms,
        "pod_slots": opts.pod_slots,
        "router_backend": backend,
        "far_state": far,
        "router_state_ms": state,
        "levels": [{"clients": c, "rounds": rs, **summarise(rs)} for c, rs in levels.items()],
    }


def first_line(args: list[str]) -> str | None:
    """The first line a tool prints (its version), or None when it does not run."""
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return (res.stdout or res.stderr).strip().splitlines()[0] if (res.stdout or res.stderr).strip() else None


def versions() -> dict:
    from colocate.workerd import workerd_binary

    return {"workerd": first_line([str(workerd_binary()), "--version"]), "wrk": first_line(["wrk", "--version"]),
            "node": first_line(["node", "--version"]), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}


def run(opts: Options, log=lambda _msg: None) -> dict:
    require_tools()
    plan = bench_plan(opts.deadline_ms, opts.worker_src, opts.balance)
    secrets = Secrets.fresh()
    machine = versions()
    series = [run_series(opts, plan, secrets, n, log) for n in opts.pods]
    return {"machine": machine, "options": {**dataclasses.asdict(opts), "client_key": bool(opts.client_key),
                                            "worker_src": str(opts.worker_src) if opts.worker_src else None},
            "compatibility_date": plan.worker.compatibility_date, "goals": goals(series), "series": series}


# --- command line -------------------------------------------------------------------------

def check_args(parser, least: Sequence[tuple[str, float, float]], worker_src: Path | None = None) -> None:
    """A bench command's argument checks: each (flag, value, lowest) and, when given,
    ``--worker-src`` a directory; a bad one is the parser's error (exit 2) naming it."""
    for name, value, low in least:
        if value < low:
            parser.error(f"{name} must be at least {low} (got {value})")
    if worker_src is not None and not worker_src.is_dir():
        parser.error(f"--worker-src {worker_src}: not a directory; pass a copy of worker/src")


def progress(quiet: bool):
    """The ``log`` of a bench's run(): progress lines on stderr, or nothing."""
    return (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))


def report(prog: str, compute, render, json_path: Path | None) -> int:
    """A bench command's ending: ``compute()``, print ``render(result)``, write the JSON;
    a setup failure is one line on stderr and exit 2."""
    try:
        result = compute()
    except (BenchError, WorkerdError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return exc.exit_code
    print(render(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0
