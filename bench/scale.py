"""The generation object at scale: N isolates' syncs against one object in workerd.

    .venv/bin/python -m bench.scale                     # the goal: 100,000 keys, 10,000 active, 50 isolates
    .venv/bin/python -m bench.scale --keys 10000 --active 1000 --isolates 10 --seconds 10

One workerd runs the plan's Worker (the router, hosting the generation object, SQLite on
disk) and bench/gen_driver.js bound to the same object. The driver seeds K keys (batches
of createKey calls: a bench-only path, no public endpoint), then N sync loops emulate N
isolates at one sync a second each, each with its own id, its own share of the A active
keys (A / N keys it serves, all asked about in `info.keys`), a batch of usage, window and
in-flight rows for the keys it served since its last sync, and the key revision it holds;
one key is created per second so deltas flow. At the same time a client sends requests
with known keys through the router and reads Server-Timing `state`.

Measured: object CPU per second (utime + stime of the workerd process, which also runs
the router and the driver: an upper bound), sync p50/p99 (the driver's HTTP hop on
loopback included, no network hop: add the same-site RTT), bytes per sync (JSON of the
batch sent + the view answered), and the router's state wait for known keys. Bounded:
every loop stops after --seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench.harness import Secrets, bench_plan, cpu_seconds
from colocate import workerd as wd
from colocate.cell import plan as plan_mod
from colocate.cell.payloads import INFLIGHT, USAGE, WINDOW
from colocate.pods import standin

HERE = Path(__file__).resolve().parent
DRIVER = "gen_driver.js"
SEED_BATCH = 20_000  # keys per importState call
# sync bytes: the object's answer (the view); the batch and info sent are reported beside it.
GOALS = {"sync_p99_ms": 50.0, "object_cores": 0.5, "view_bytes_p99": 16 * 1024, "state_wait_p99_ms": 0.0}


class Conn:
    """One keep-alive HTTP connection (one emulated isolate's link to the object)."""

    def __init__(self, port: int):
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(
        self, path: str, body: dict | None = None, headers: dict | None = None, method: str = "POST"
    ) -> tuple[int, dict, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        h = {"content-type": "application/json", **(headers or {})}
        self.c.request(method, path, body=data, headers=h)
        r = self.c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


@contextlib.contextmanager
def cell(plan, secrets: Secrets) -> Iterator[tuple[wd.Workerd, int, int]]:
    """workerd with the router (port) and the driver (driver port), one stand-in pod."""
    with standin.serve(compute_ms=1, token=secrets.pod_token, name="pod") as pod, \
            standin.serve(compute_ms=1, token=secrets.fallback_api_key, name="fallback") as fb, \
            wd.Workerd() as w:
        second = wd.listening_socket()
        try:
            values = {"POD_URLS": plan_mod.pod_urls_text([pod.url]), "fallbackUrl": fb.url, **secrets.bindings()}
            a = wd.worker_capnp(plan.worker, values, storage_service="disk")
            d = wd.worker_capnp(plan.worker, values, host_objects=False, do_service="a",
                                extra_modules=[(DRIVER, (HERE / DRIVER).read_text())], main_module=DRIVER)
            services = [wd.worker_service("a", a), wd.worker_service("d", d), wd.network_service(),
                        wd.disk_service("disk", w.directory / "objects")]
            sockets = [wd.socket_capnp("http", w.port, "a"), wd.socket_capnp("second", 0, "d")]
            w.start(wd.config_capnp(services, sockets), extra_sockets={"second": second})
            yield w, w.port, second.getsockname()[1]
        finally:
            second.close()


def key_id(i: int) -> str:
    return f"key_{i:012x}"


def seed(driver: Conn, gen: str, count: int, log) -> float:
    """``count`` keys, SEED_BATCH per call of the object's own bulk import (importState, the
    migration's; reachable only through the namespace binding, here the driver's); seconds taken."""
    t0 = time.monotonic()
    now = int(time.time() * 1000)
    for start in range(0, count, SEED_BATCH):
        keys = []
        for i in range(start, min(count, start + SEED_BATCH)):
            h = hashlib.sha256(f"bench-key-{i}".encode()).hexdigest()
            keys.append({"id": key_id(i), "hash": h, "prefix": "clc_bench_", "name": f"k{i}", "rpm": 0, "tpm": 0,
                         "monthly_tokens": 0, "max_parallel": 0, "created_at": now, "expires_at": None, "revoked_at": None})
        data = {"forced": None, "keys": keys, "usage": [], "windows": []}
        status, _, body = driver.post("/rpc", {"gen": gen, "calls": [["importState", f"bench-seed-{start}", data]]})
        if status != 200:
            raise RuntimeError(f"seeding failed at key {start}: {status} {body[:200]!r}")
        log(f"  seeded {min(count, start + SEED_BATCH)} keys")
    return time.monotonic() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def isolate_loop(port: int, gen: str, n: int, keys: list[str], until: float, out: dict, rng: random.Random,
                 ttl_ms: int) -> None:
    """One emulated isolate: a sync a second until ``until``, with a batch for the keys it
    served since its last sync (a random half of its share)."""
    conn = Conn(port)
    iso = f"iso_bench_{n}"
    have = -1
    lat, sizes, view_sizes = [], [], []
    time.sleep(rng.random())  # spread the isolates over the second
    while time.monotonic() < until:
        t_next = time.monotonic() + 1.0
        now = time.time()
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        minute = int(now * 1000) // 60_000
        served = rng.sample(keys, max(1, len(keys) // 2)) if keys else []
        batch = {
            "usage": [USAGE.row(day=day, key_id=k, requests=3, prompt_tokens=40, completion_tokens=25, pod_requests=3)
                      for k in served],
            "windows": [WINDOW.row(key_id=k, minute=minute, requests=3, tokens=65) for k in served],
            "inflight": [INFLIGHT.row(key_id=k, n=rng.randint(0, 2)) for k in served[:10]],
        }
        info = {"generation": gen, "draining": None, "haveRev": have, "isolate": iso, "ttlMs": ttl_ms, "keys": keys,
                "failureThreshold": 3, "openMs": 30000, "deadlineMs": 2000}
        t0 = time.perf_counter()
        status, _, body = conn.post("/rpc", {"gen": gen, "calls": [["sync", info, batch]]})
        dt = (time.perf_counter() - t0) * 1000
        if status != 200:
            out.setdefault("errors", []).append(body[:200].decode(errors="replace"))
        else:
            res = json.loads(body)
            view = res["results"][0]
            have = view["rev"]
            lat.append(dt)
            sizes.append(len(json.dumps(batch, separators=(",", ":"))) + len(json.dumps(info, separators=(",", ":"))))
            view_sizes.append(res["bytes"][0])
        time.sleep(max(0.0, t_next - time.monotonic()))
    out.setdefault("lat", []).extend(lat)
    out.setdefault("bytes", []).extend(sizes)
    out.setdefault("view_bytes", []).extend(view_sizes)


def churn_loop(port: int, gen: str, start: int, until: float) -> int:
    """One new key a second (key-list deltas flow to every isolate)."""
    conn = Conn(port)
    i = start
    while time.monotonic() < until:
        h = hashlib.sha256(f"bench-key-{i}".encode()).hexdigest()
        conn.post("/rpc", {"gen": gen, "calls": [["createKey", {"id": key_id(i), "hash": h, "prefix": "clc_bench_", "name": "new",
                                                                 "rpm": 0, "tpm": 0, "monthly_tokens": 0, "max_parallel": 0,
                                                                 "created_at": int(time.time() * 1000), "expires_at": None},
                                                   {"generation": gen}]]})
        i += 1
        time.sleep(1.0)
    return i - start


def router_loop(port: int, headers_list: list[dict], until: float, rate: float, out: dict) -> None:
    """Requests with known keys through the router; the state wait of each (Server-Timing)."""
    conn = Conn(port)
    waits, statuses = [], []
    i = 0
    while time.monotonic() < until:
        status, headers, _ = conn.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 4}, headers_list[i % len(headers_list)])
        statuses.append(status)
        for part in headers.get("server-timing", "").split(","):
            name, _, rest = part.strip().partition(";")
            if name == "state":
                waits.append(float(rest.split("dur=", 1)[1]))
        i += 1
        time.sleep(1.0 / rate)
    out["waits"], out["statuses"] = waits, statuses


def run(opts: argparse.Namespace, log=print) -> dict:
    secrets = Secrets.fresh()
    plan = bench_plan(2000)
    gen = plan.state.active.name
    ttl_ms = plan.worker_settings.state_ttl_ms if hasattr(plan, "worker_settings") else 2000
    rng = random.Random(7)
    with cell(plan, secrets) as (w, port, driver_port):
        driver = Conn(driver_port)
        log(f"seeding {opts.keys} keys ...")
        seed_s = seed(driver, gen, opts.keys, log)
        # Known keys for the router: real ones, minted through the operator endpoint.
        admin = Conn(port)
        client_headers = []
        for i in range(5):
            status, _, body = admin.post(
                "/_colocate/keys", {"name": f"router{i}", "rpm": 0, "tpm": 0,
                                  "monthly_tokens": 0, "max_parallel": 0}, {"authorization": f"Bearer {secrets.probe_token}"}
            )
            if status != 201:
                raise RuntimeError(f"minting a router key failed: {status} {body[:200]!r}")
            client_headers.append({"authorization": f"Bearer {json.loads(body)['key']}"})
        active = [key_id(i) for i in rng.sample(range(opts.keys), min(opts.active, opts.keys))]
        share = max(1, len(active) // opts.isolates)
        shares = [active[i * share:(i + 1) * share] for i in range(opts.isolates)]
        # Warm: the router's isolate holds its keys before the measured window.
        warm = Conn(port)
        for h in client_headers:
            warm.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, h)
        log(f"{opts.isolates} isolates x 1 sync/s, {share} keys each, for {opts.seconds} s ...")
        until = time.monotonic() + opts.seconds + 1.0
        iso_out: dict = {}
        router_out: dict = {}
        threads = [threading.Thread(target=isolate_loop, args=(driver_port, gen, n, shares[n], until, iso_out,
                                                               random.Random(n), ttl_ms), daemon=True)
                   for n in range(opts.isolates)]
        threads.append(threading.Thread(target=router_loop, args=(port, client_headers, until, opts.router_rate, router_out),
                                        daemon=True))
        created: dict[str, int] = {}
        threads.append(threading.Thread(target=lambda: created.setdefault("n", churn_loop(driver_port, gen, opts.keys, until)),
                                        daemon=True))
        cpu0, t0 = cpu_seconds(w.process.pid), time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(opts.seconds + 120)
        cpu = (cpu_seconds(w.process.pid) - cpu0) / (time.monotonic() - t0)
    lat, sizes, waits = iso_out.get("lat", []), iso_out.get("bytes", []), router_out.get("waits", [])
    result = {
        "keys": opts.keys, "active": len(active), "isolates": opts.isolates, "keys_per_isolate": share,
        "seconds": opts.seconds, "seed_s": round(seed_s, 1),
        "syncs": len(lat), "sync_errors": len(iso_out.get("errors", [])),
        "syncs_per_s": round(len(lat) / opts.seconds, 1),
        "sync_p50_ms": round(pct(lat, 0.5), 2), "sync_p99_ms": round(pct(lat, 0.99), 2),
        "sent_bytes_p50": int(pct(sizes, 0.5)), "sent_bytes_p99": int(pct(sizes, 0.99)),
        "view_bytes_p50": int(pct(iso_out.get("view_bytes", []), 0.5)),
        "view_bytes_p99": int(pct(iso_out.get("view_bytes", []), 0.99)),
        "object_cores": round(cpu, 3),
        "router_requests": len(waits), "router_non_200": sum(1 for s in router_out.get("statuses", []) if s != 200),
        "state_wait_p50_ms": pct(waits, 0.5), "state_wait_p99_ms": pct(waits, 0.99),
        "state_wait_max_ms": max(waits) if waits else None,
        "keys_created_during": created.get("n", 0),
        "mean_sync_ms": round(statistics.fmean(lat), 2) if lat else None,
    }
    result["goals"] = {k: {"goal": v, "value": result[k], "met": result[k] <= v} for k, v in GOALS.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=100_000, help="keys in the generation (K)")
    p.add_argument("--active", type=int, default=10_000, help="keys with traffic (A), shared out over the isolates")
    p.add_argument("--isolates", type=int, default=50, help="emulated isolates (N), one sync a second each")
    p.add_argument("--seconds", type=int, default=30, help="measured window")
    p.add_argument("--router-rate", type=float, default=20.0, help="requests a second through the router (known keys)")
    p.add_argument("--json", type=Path, help="also write the result here")
    opts = p.parse_args(argv)
    for name in ("keys", "active", "isolates", "seconds"):
        if getattr(opts, name) < 1:
            p.error(f"--{name} must be at least 1 (got {getattr(opts, name)})")
    if opts.seconds > 600 or opts.isolates > 500:
        p.error("--seconds <= 600 and --isolates <= 500: the run is bounded")
    result = run(opts, log=lambda m: print(m, file=sys.stderr))
    text = json.dumps(result, indent=2)
    print(text)
    if opts.json:
        opts.json.write_text(text + "\n")
    return 0 if all(g["met"] for g in result["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
