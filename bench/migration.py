"""A migration of a large generation in workerd, with requests during it and a crash in the middle.

    .venv/bin/python -m bench.migration                          # 200,000 keys, 500,000 seg_minute rows
    .venv/bin/python -m bench.migration --keys 20000 --seg-rows 50000 --usage-rows 20000

One workerd runs the plan's Worker with a ledger whose active generation (g2) is new and
whose draining one (g1) holds the state, and bench/gen_driver.js bound to the same objects.
The driver seeds g1 through the object's own bulk import (importState: a namespace binding,
no public route): K keys, D daily usage rows, M seg_minute rows (distinct minute x colo x
pod x segment over the last 6 days), and one client key with usage today. Then a client
sends requests with that key through the router (--rate a second, each on its own
connection): the first starts the import. When the import has merged --restart-at of its
rows, workerd is killed (SIGKILL) and started again on the same storage; the requests pause
for the restart alone. The run ends when the active generation says it imported g1.

Reported: seeding time; the import's time (first request to done, the restart included) and
rows a second; the rows merged when workerd was killed, when it started again (a resume starts
from its cursor, not from zero) and ALARM_ALONE_S later with no call to the object (its alarm
goes on by itself, read from its SQLite file); the requests sent during the import, how many
failed, their state wait (Server-Timing) and their time end to end (here the router and the
object share workerd's process, so a chunk's merge can delay a request; in the cloud it delays
only that object's calls); then, read from the objects' SQLite files once workerd has stopped,
each table's rows in g2 against g1's, and the client key's requests (seeded + sent, each once).
Exit 0 when no request failed, the import completed and every count matches; 1 otherwise.
Bounded: --timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import Secrets, cpu_seconds
from colocate import admin, stackfile, workerd as wd
from colocate.cell import plan as plan_mod, settings as settings_mod
from colocate.pods import standin
from colocate.probe.histogram import Histogram

HERE = Path(__file__).resolve().parent
DRIVER = "gen_driver.js"
OLD, NEW = "us-east.g1", "us-east.g2"
SEED_BATCH = 20_000  # rows per importState call
COLOS, PODS, SEGMENTS = ("IAD", "EWR", "ORD", "ATL", "MIA"), ("0", "1", "2", "fallback"), ("state", "upstream", "total")
CLIENT_REQUESTS_BEFORE = 7  # the client key's requests today in g1
ALARM_ALONE_S = 2.0  # after the restart, seconds without any call to the object
AFTER_S = 10.0  # the requests go on this long after the import, for their time without it (--after-s)


def migration_plan():
    """The sandbox stack's plan with g2 active and g1 draining (what `migrate.py start` and `pulumi up` make)."""
    raw, secrets = stackfile.read_config("sandbox")
    raw["generations"] = [{"name": OLD, "region": "us-east", "status": "draining"},
                          {"name": NEW, "region": "us-east", "status": "active"}]
    s = settings_mod.parse(raw, "sandbox", secrets=set(secrets) | set(settings_mod.ALWAYS_SECRET))
    return plan_mod.plan_cell(s)


def call(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 120) -> tuple[int, dict, bytes]:
    """One request on its own connection (closed after): status, headers, body."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


class Cell:
    """workerd with the router (``port``) and the driver (``driver_port``) on one storage directory."""

    def __init__(self, w: wd.Workerd, config: str, second, storage: Path):
        self.w, self.config, self.second, self.storage = w, config, second, storage
        self.port, self.driver_port = w.port, second.getsockname()[1]

    def kill_and_start(self) -> float:
        """SIGKILL workerd (no shutdown of any kind) and start it again; seconds it was down."""
        t0 = time.monotonic()
        os.killpg(self.w.process.pid, signal.SIGKILL)
        self.w.stop()
        self.w.start(self.config, extra_sockets={"second": self.second})
        return time.monotonic() - t0


@contextlib.contextmanager
def cell(plan, secrets: Secrets) -> Iterator[Cell]:
    with standin.serve(compute_ms=1, token=secrets.pod_token, name="pod") as pod, \
            standin.serve(compute_ms=1, token=secrets.fallback_api_key, name="fallback") as fb, \
            wd.Workerd() as w:
        second = wd.listening_socket()
        try:
            storage = w.directory / "objects"
            values = {"POD_URLS": plan_mod.pod_urls_text([pod.url]), "fallbackUrl": fb.url, **secrets.bindings()}
            a = wd.worker_capnp(plan.worker, values, storage_service="disk")
            d = wd.worker_capnp(plan.worker, values, host_objects=False, do_service="a",
                                extra_modules=[(DRIVER, (HERE / DRIVER).read_text())], main_module=DRIVER)
            services = [wd.worker_service("a", a), wd.worker_service("d", d), wd.network_service(),
                        wd.disk_service("disk", storage)]
            config = wd.config_capnp(services, [wd.socket_capnp("http", w.port, "a"), wd.socket_capnp("second", 0, "d")])
            w.start(config, extra_sockets={"second": second})
            yield Cell(w, config, second, storage)
        finally:
            second.close()


def seed(c: Cell, opts: argparse.Namespace, client_row: dict, log) -> float:
    """g1's tables through importState, SEED_BATCH rows a call; seconds taken."""
    t0 = time.monotonic()

    def put(data: dict, what: str) -> None:
        calls = [["importState", f"bench-seed-{what}", data]]
        status, _, body = call(c.driver_port, "POST", "/rpc", {"gen": OLD, "calls": calls})
        if status != 200:
            raise RuntimeError(f"seeding {what} failed: {status} {body[:300]!r}")

    now = int(time.time() * 1000)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    put({"keys": [client_row], "usage": [{"day": today, "key_id": client_row["id"], "requests": CLIENT_REQUESTS_BEFORE,
                                          "prompt_tokens": 70, "completion_tokens": 7, "pod_requests": CLIENT_REQUESTS_BEFORE,
                                          "fallback_requests": 0}],
         "months": [{"key_id": client_row["id"], "month": today[:7], "tokens": 77}]}, "client")
    for start in range(0, opts.keys, SEED_BATCH):
        put({"keys": [{"id": f"key_{i:012x}", "hash": hashlib.sha256(f"bench-key-{i}".encode()).hexdigest(),
                       "prefix": "clc_bench_", "name": f"k{i}", "rpm": 0, "tpm": 0, "monthly_tokens": 0, "max_parallel": 0,
                       "created_at": now, "expires_at": None, "revoked_at": None}
                      for i in range(start, min(opts.keys, start + SEED_BATCH))]}, f"keys-{start}")
    log(f"  {opts.keys} keys")
    for start in range(0, opts.usage_rows, SEED_BATCH):
        rows = []
        for i in range(start, min(opts.usage_rows, start + SEED_BATCH)):
            day = time.strftime("%Y-%m-%d", time.gmtime(now / 1000 - 86400 * (1 + i // max(1, opts.keys))))
            rows.append({"day": day, "key_id": f"key_{i % max(1, opts.keys):012x}", "requests": 2, "prompt_tokens": 20,
                         "completion_tokens": 5, "pod_requests": 2, "fallback_requests": 0})
        put({"usage": rows}, f"usage-{start}")
    log(f"  {opts.usage_rows} daily usage rows")
    first_minute = now // 60000 - 6 * 24 * 60
    combos = len(COLOS) * len(PODS) * len(SEGMENTS)
    hists = [Histogram.of([0.5 + k, 3.0 * (k + 1), 40.0 + k]).encode() for k in range(16)]
    for start in range(0, opts.seg_rows, SEED_BATCH):
        segs: list[list] = []
        for i in range(start, min(opts.seg_rows, start + SEED_BATCH)):
            k = i % combos
            colo, pod = COLOS[k // (len(PODS) * len(SEGMENTS))], PODS[(k // len(SEGMENTS)) % len(PODS)]
            segs.append([first_minute + i // combos, colo, pod, SEGMENTS[k % len(SEGMENTS)], hists[i % len(hists)]])
        put({"seg_minute": segs}, f"seg-{start}")
        log(f"  {min(opts.seg_rows, start + SEED_BATCH)} seg_minute rows")
    return time.monotonic() - t0


@dataclass
class Load:
    """The client's requests during the import: stopped by ``stop``, paused while ``pause`` is set."""

    stop: threading.Event = field(default_factory=threading.Event)
    pause: threading.Event = field(default_factory=threading.Event)
    paused: threading.Event = field(default_factory=threading.Event)  # set by the loader: paused, nothing in flight
    results: list[tuple[float, int | None]] = field(default_factory=list)  # each request: (its start, status; None: no answer)
    failures: list[tuple[int | None, str]] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # Server-Timing state, ms
    e2e: list[tuple[float, float]] = field(default_factory=list)  # each answered request: (its start, ms end to end)


def load(port: int, key: str, rate: float, state: Load) -> None:
    """Requests with the client key until ``state.stop``; paused while ``state.pause`` (workerd restarting)."""
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    while not state.stop.is_set():
        if state.pause.is_set():
            state.paused.set()
            time.sleep(0.05)
            continue
        state.paused.clear()
        t = time.monotonic()
        try:
            status, hdrs, raw = call(port, "POST", "/v1/chat/completions", body, headers, timeout=60)
        except OSError as exc:
            status, hdrs, raw = None, {}, repr(exc).encode()
        state.results.append((t, status))
        if status is not None:
            state.e2e.append((t, (time.monotonic() - t) * 1000))
        if status != 200:
            state.failures.append((status, raw[:200].decode(errors="replace")))
        for part in hdrs.get("server-timing", "").split(","):
            name, _, rest = part.strip().partition(";")
            if name == "state" and "dur=" in rest:
                state.waits.append(float(rest.split("dur=", 1)[1]))
        time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t)))


def progress(port: int, token: str) -> dict:
    """The active generation's import as GET /_colocate/breaker says it: {imported, rows, total}."""
    status, _, body = call(port, "GET", "/_colocate/breaker", None, {"authorization": f"Bearer {token}"}, timeout=60)
    if status != 200:
        raise RuntimeError(f"GET /_colocate/breaker answered {status}: {body[:300]!r}")
    b = json.loads(body)["breaker"]
    mine = [p for p in b.get("importing", []) if p["from"] == OLD]
    return {"imported": OLD in b["imported"], "rows": mine[0]["rows"] if mine else None,
            "total": mine[0]["total"] if mine else None}


def stored_rows(storage: Path) -> int | str | None:
    """g2's import cursor's rows as its SQLite file holds them (read while workerd runs: no
    call reaches the object); "done" once it records the import, None before it begins."""
    for path in storage.rglob("*.sqlite"):
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                meta = dict(db.execute("SELECT k, v FROM meta WHERE k IN (?, ?)",
                                       (f"importing:{OLD}", f"imported:{OLD}")).fetchall())
            finally:
                db.close()
        except sqlite3.DatabaseError:
            continue
        if f"imported:{OLD}" in meta:
            return "done"
        if f"importing:{OLD}" in meta:
            return int(json.loads(meta[f"importing:{OLD}"])["rows"])
    return None


def pct(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def tables(storage: Path, before_minute: int) -> dict[str, dict]:
    """Rows per table in g1 and g2, read from their SQLite files (workerd stopped): the
    exporter has meta `successor`, the importer `imported:g1`; seg_minute's rows before
    ``before_minute`` (the seeded ones, not the minutes of the requests during the import)."""
    found: dict[str, dict] = {}
    for path in storage.rglob("*.sqlite"):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT k, v FROM meta").fetchall())
            who = "g1" if meta.get("successor") == NEW else "g2" if f"imported:{OLD}" in meta else None
            if who:
                found[who] = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]  # noqa: S608 (fixed names)
                              for t in ("client_keys", "usage_daily", "key_month")}
                seeded = db.execute("SELECT COUNT(*) FROM seg_minute WHERE minute < ?", (before_minute,))
                found[who]["seg_minute"] = seeded.fetchone()[0]
                found[who]["import_pulled"] = db.execute("SELECT COUNT(*) FROM import_pulled").fetchone()[0]
        except sqlite3.DatabaseError:
            pass
        finally:
            db.close()
    return found


def usage_of(port: int, token: str, key_id: str) -> int:
    status, _, body = call(port, "GET", f"/_colocate/usage?key={key_id}", None, {"authorization": f"Bearer {token}"})
    if status != 200:
        raise RuntimeError(f"GET /_colocate/usage answered {status}: {body[:300]!r}")
    return sum(r["requests"] for r in json.loads(body)["usage"])


def flushed(port: int, token: str, key_id: str, state: Load, within_s: float = 3.0) -> None:
    """Wait (bounded) until the loader has paused and the object counts every request it sent."""
    deadline = time.monotonic() + within_s
    state.paused.wait(within_s)
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError, OSError):
            if usage_of(port, token, key_id) >= CLIENT_REQUESTS_BEFORE + len(state.results):
                return
        time.sleep(0.05)


def run(opts: argparse.Namespace, log=print) -> dict:
    secrets = Secrets.fresh()
    plan = migration_plan()
    client_key = admin.new_key()
    client_row = {**admin.key_row(client_key, "moved", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0, fallback_microusd_day=0),
                  "revoked_at": None}
    with cell(plan, secrets) as c:
        log(f"seeding {OLD} ...")
        seed_s = seed(c, opts, client_row, log)
        state = Load()
        loader = threading.Thread(target=load, args=(c.port, client_key, opts.rate, state), daemon=True)
        t0, t0_wall = time.monotonic(), time.time()
        cpu0 = cpu_seconds(c.w.process.pid)
        progress_seen: list[dict] = []
        loader.start()  # its first request names the draining generation: the import starts
        deadline = t0 + opts.timeout
        timeline: list[tuple[float, int | None]] = []
        killed_at = resumed_at = alarm_alone = None
        down_s = None
        cpu = 0.0
        done = False
        try:
            while time.monotonic() < deadline:
                p = progress(c.port, secrets.probe_token)
                progress_seen.append(p)
                timeline.append((round(time.monotonic() - t0, 1), p["rows"]))
                if p["imported"]:
                    done = True
                    break
                if killed_at is None and p["rows"] is not None and p["rows"] >= opts.restart_at * p["total"]:
                    state.pause.set()
                    # The request in flight finishes and the router flushes their usage (within 1 s):
                    # what an isolate holds unsent dies with the process, migration or not. Waited on,
                    # not slept: a fixed 1.5 s let a fast machine finish the import before the crash.
                    flushed(c.port, secrets.probe_token, client_row["id"], state)
                    killed_at = progress(c.port, secrets.probe_token)["rows"]
                    cpu += cpu_seconds(c.w.process.pid) - cpu0
                    log(f"  killing workerd at {killed_at} of {p['total']} rows ...")
                    down_s = c.kill_and_start()
                    cpu0 = cpu_seconds(c.w.process.pid)
                    # No call reaches the object for a while: the alarm alone goes on (read from its file).
                    resumed_at = stored_rows(c.storage)
                    time.sleep(ALARM_ALONE_S)
                    alarm_alone = stored_rows(c.storage)
                    log(f"  started again in {down_s:.1f} s at {resumed_at} rows; {alarm_alone} rows {ALARM_ALONE_S} s later, "
                        "with no call")
                    state.pause.clear()
                    continue
                time.sleep(0.5)
            t_done = time.monotonic()
            import_s = t_done - t0
            cpu += cpu_seconds(c.w.process.pid) - cpu0
            if done:
                time.sleep(opts.after_s)  # the same requests with the import done: what they take here anyway
        finally:
            state.stop.set()
            loader.join(120)
        time.sleep(2.5)  # the router's last usage batch reaches the object (FLUSH_MAX_MS 1 s)
        counted = usage_of(c.port, secrets.probe_token, client_row["id"])
        c.w.stop()
        rows = tables(c.storage, int(t0_wall // 60) - 60)
    total = next((p["total"] for p in reversed(progress_seen) if p["total"]), None)
    waits = state.waits
    during = [ms for t, ms in state.e2e if t < t_done]
    after = [ms for t, ms in state.e2e if t >= t_done]
    g1, g2 = rows.get("g1", {}), rows.get("g2", {})
    result = {
        "keys": opts.keys, "usage_rows": opts.usage_rows, "seg_minute_rows": opts.seg_rows, "rows": total,
        "seed_s": round(seed_s, 1), "import_s": round(import_s, 1), "completed": done,
        "rows_per_s": round(total / import_s) if done and total else None, "process_cores": round(cpu / import_s, 2),
        "killed_at_rows": killed_at, "resumed_at_rows": resumed_at, "alarm_alone_rows": alarm_alone,
        "down_s": round(down_s, 1) if down_s else None,
        "requests": len(state.results), "requests_during": sum(1 for t, _ in state.results if t < t_done),
        "failed": len(state.failures), "failures": state.failures[:5],
        "state_wait_p50_ms": pct(waits, 0.5), "state_wait_p99_ms": pct(waits, 0.99),
        "state_wait_max_ms": max(waits, default=None),
        "e2e_p50_ms": round(pct(during, 0.5) or 0, 1), "e2e_p99_ms": round(pct(during, 0.99) or 0, 1),
        "after_s": opts.after_s,
        "e2e_after_p50_ms": round(pct(after, 0.5) or 0, 1), "e2e_after_p99_ms": round(pct(after, 0.99) or 0, 1),
        "client_requests": {"seeded": CLIENT_REQUESTS_BEFORE, "sent": len(state.results), "counted": counted},
        "tables": {"g1": g1, "g2": g2}, "timeline": timeline,
    }
    # The alarm went on alone: more rows (or done) with no call since the restart.
    alarm_moved = alarm_alone == "done" or (isinstance(alarm_alone, int) and isinstance(resumed_at, int)
                                            and alarm_alone > resumed_at)
    result["ok"] = (done and not state.failures and isinstance(killed_at, int) and isinstance(resumed_at, int)
                    and resumed_at >= killed_at and alarm_moved and counted == CLIENT_REQUESTS_BEFORE + len(state.results)
                    and g2.get("seg_minute") == g1.get("seg_minute") == opts.seg_rows
                    and g2.get("client_keys") == g1.get("client_keys") == opts.keys + 1
                    and g2.get("key_month") == g1.get("key_month") and g2.get("import_pulled") == 0)
    return result


def render(r: dict) -> str:
    c = r["client_requests"]
    alone = "the import done" if r["alarm_alone_rows"] == "done" else f"{r['alarm_alone_rows']} rows"
    return "\n".join([
        f"migration of {r['keys']:,} keys, {r['usage_rows']:,} daily usage rows, {r['seg_minute_rows']:,} seg_minute rows "
        f"({r['rows']} rows in all)",
        f"  seeded in {r['seed_s']} s; imported in {r['import_s']} s ({r['rows_per_s']} rows/s, "
        f"workerd {r['process_cores']} cores), completed: {r['completed']}",
        f"  killed at {r['killed_at_rows']} rows, started again after {r['down_s']} s at {r['resumed_at_rows']} rows, "
        f"{alone} {ALARM_ALONE_S} s later with no call (the object's alarm alone)",
        f"  {r['requests']} requests ({r['requests_during']} during the import), {r['failed']} failed; "
        f"state wait p50 {r['state_wait_p50_ms']} ms, "
        f"p99 {r['state_wait_p99_ms']} ms, max {r['state_wait_max_ms']} ms; "
        f"end to end p50 {r['e2e_p50_ms']} ms, p99 {r['e2e_p99_ms']} ms "
        f"({r['after_s']:.0f} s after it: p50 {r['e2e_after_p50_ms']} ms, p99 {r['e2e_after_p99_ms']} ms)",
        f"  the client key: {c['seeded']} requests before + {c['sent']} sent = {c['counted']} counted",
        f"  rows g1 -> g2: {r['tables']}",
        f"  {'OK' if r['ok'] else 'FAILED'}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.migration", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=200_000, help="keys in the draining generation")
    p.add_argument("--usage-rows", type=int, default=60_000, help="its daily usage rows (over the keys, a day each per --keys)")
    p.add_argument("--seg-rows", type=int, default=500_000, help="its seg_minute rows")
    p.add_argument("--rate", type=float, default=10.0, help="client requests a second during the import")
    p.add_argument("--restart-at", type=float, default=0.4, help="kill workerd when this share of the rows is merged")
    p.add_argument("--after-s", type=float, default=AFTER_S, help="the requests go on this long after the import")
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds of import")
    p.add_argument("--json", type=Path, help="also write the result here")
    opts = p.parse_args(argv)
    if min(opts.keys, opts.seg_rows, opts.usage_rows, opts.after_s) < 0 or not 0 < opts.restart_at < 1 or opts.rate <= 0:
        p.error("--keys, --usage-rows, --seg-rows and --after-s >= 0, 0 < --restart-at < 1, --rate > 0")
    most = 6 * 24 * 60 * len(COLOS) * len(PODS) * len(SEGMENTS)
    if opts.seg_rows > most:
        p.error(f"--seg-rows: at most {most} (6 days of minutes x colo x pod x segment)")
    result = run(opts, log=lambda m: print(m, file=sys.stderr))
    print(render(result))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
