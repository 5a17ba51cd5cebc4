"""The fleet's front runner (``python -m colocate.sandbox.fleet_front run STATE_DIR``, started
detached by ``fleet.up``): the front door and the emulated network in front of and behind it.

    entry proxy (one per client site)   a user at SITE reaching colo SITE (its nearest colo):
                 RTT(site, colo)/2 each way (the same-site rule), ``cf-ray``, and
                 ``cf-blob: {"colo": SITE}``, the header the front door's socket parses into
                 ``request.cf`` (a client's own ``cf-blob`` is dropped: only the edge sets it)
    workerd      the front door (``front.js`` and its imports, the bytes the fleet stack
                 uploads; ``plan_fleet``'s bindings), one service per client colo
    binding proxy  each service's ``CELL_<i>`` is an external service reaching this proxy
                 with the colo and the cell named in injected headers; it charges
                 RTT(colo, the cell's Worker site)/2 each way and forwards to the cell's workerd

It writes ``front-run.json`` (its pid/pgid) before it starts anything, ``front.json`` once the
front door answers (and again after each SIGHUP's apply), ``front-failed.json`` when a start or
an apply fails. What it needs of a running cell it reads from the cell's own ``ready.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..fleet import plan as fleet_mod
from ..fleet.workerd import CF_BLOB_HEADER, cf_socket, front_worker_capnp
from ..workerd import config_capnp, disk_service as wd_disk_service, external_service, worker_service
from . import proxies
from .errors import SandboxError, StartupFailed
from .fleet_launch import Launch, client_sites_of, plan_of
from .geography import Geography, Sites, site
from .pinning import Pins
from .processes import CHILD_TIMEOUT_S, http_ok, stop_child
from .runner import WORKERD
from .statedir import (
    ENTRY_PINS_FILE,
    FLEET_LAUNCH_FILE,
    FRONT_CONFIG_FILE,
    FRONT_FAILED_FILE,
    FRONT_READY_FILE,
    FRONT_RUN_FILE,
    LOGS_DIR,
    READY_FILE,
    log_line,
    log_path,
    read_object,
    write_json,
)

CELL_INDEX_HEADER = "x-sandbox-cell"
SWAP_WAIT_S = 30.0  # how long the binding proxy waits for a cell whose workerd is being swapped
CUT_WAIT_S = 5.0  # ... and for a swap after a request was cut off unanswered (a swap takes 1-2 s)


def log_fleet(msg: str) -> None:
    log_line(msg, "sandbox fleet")


class _EntryHandler(proxies.FrontHandler):
    """A user at the entry's site reaching its nearest colo: the cell's front proxy, plus the
    colo in ``cf-blob`` (the header workerd parses into ``request.cf``). The client's own
    ``cf-blob`` is dropped: on Cloudflare only the edge decides ``request.cf``."""

    def _forward_headers(self, drop: set[str]) -> list[tuple[str, str]]:
        colo = self.network.sites.edge
        return super()._forward_headers(set(drop) | {CF_BLOB_HEADER}) + [(CF_BLOB_HEADER, json.dumps({"colo": colo}))]


@dataclass
class CellRoute:
    """Where a member cell's Worker runs (its site) and listens (its workerd, which a cell's
    ``apply`` swaps for one on another port; the cell's network health endpoint names it)."""

    name: str
    state_dir: Path
    site: str
    outbound_port: int
    workerd: tuple[str, int] | None

    def current(self) -> tuple[str, int] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.outbound_port}/_sandbox/health", timeout=5) as r:
                host, _, port = (json.loads(r.read()).get("workerd") or "").rpartition(":")
            return (host, int(port)) if host else None
        except (OSError, ValueError):
            return None


def binding_rtt_ms(geography: Geography, colo: str, cell_site: str) -> float:
    """A service binding's cost from the front door's colo to the cell's Worker. Cloudflare:
    "When you use Service Bindings, there is zero overhead or added latency. By default, both
    Workers run on the same thread of the same Cloudflare server"
    (developers.cloudflare.com/workers/runtime-apis/bindings/service-bindings/): so 0 inside one
    colo. A cell's Worker is placed (targeted placement) at its own site, so from another colo
    the call crosses to it: the round trip between the two sites, as every other hop."""
    return 0.0 if colo == cell_site else geography.rtt_ms(colo, cell_site)


class _BindingHandler(proxies.Relay):
    """``CELL_<i>`` of the front-door service of colo C: RTT(C, cell i's site)/2 each way, then
    cell i's workerd. A cell that cannot be reached closes the connection unanswered, so the
    front door's fetch throws, as a binding to an unreachable Worker does."""

    upstream_name = "cell"
    routes: list[CellRoute]
    geography: Geography
    _retrying = False

    def _upstream_failed(self, host: str, port: int, exc: BaseException) -> None:
        route = getattr(self, "_route", None)
        if route is not None and not self._retrying:
            # The cell is swapping its workerd (its `apply`): wait for the new one, as its own
            # front proxy holds requests during the swap. Refused: the old one is gone. Cut off
            # before an answer: the old one was stopped under this request, which the platform
            # would have let finish (its own front proxy drains in-flight requests first; the
            # bindings reach workerd directly): sent again to the new one if a swap follows soon.
            refused = isinstance(exc, ConnectionRefusedError)
            deadline = time.monotonic() + (SWAP_WAIT_S if refused else CUT_WAIT_S)
            while time.monotonic() < deadline:
                now = route.current()
                if now and now != (host, port):
                    route.workerd = now
                    self._retrying = True
                    self._relay(now[0], now[1], *self._pending, 0.0, self._pending_after)
                    return
                time.sleep(0.05)
        self.close_connection = True  # no answer: the front door's fetch throws and it tries the next cell

    def _handle(self) -> None:
        body = self._body_or_error()
        if body is False:
            return
        try:
            colo = site(self.headers.get(proxies.SITE_HEADER, ""), "binding colo")
            route = self.routes[int(self.headers.get(CELL_INDEX_HEADER, ""))]
        except (SandboxError, ValueError, IndexError):
            self._json(400, proxies.error_body(400, "sandbox_bad_binding", "no such cell binding"))
            return
        self._route = route
        self._retrying = False
        target = route.workerd or route.current()
        half = binding_rtt_ms(self.geography, colo, route.site) / 2
        headers = self._forward_headers({proxies.SITE_HEADER, CELL_INDEX_HEADER}) + [
            ("host", self.headers.get("host", "localhost"))
        ]
        self._pending = (self.path, headers, body)
        self._pending_after = half
        if target is None:
            proxies.sleep_ms(half)
            self._upstream_failed("127.0.0.1", 0, ConnectionRefusedError())
            return
        self._relay(target[0], target[1], self.path, headers, body, half, half)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle  # noqa: N815


def _serve(server: proxies.RelayServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    t.start()
    return t


def _listening() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def front_config(plan: fleet_mod.FleetPlan, colos: list[str], binding_port: int, tokens: Sequence[str],
                 storage_dir: Path) -> str:
    """One front-door service per colo (the same modules and plan bindings), each on its own
    socket that parses ``cf-blob``; its ``CELL_<i>`` reach the binding proxy, which learns the
    colo and the cell from injected headers. ``tokens``: each cell's exchange token (the
    ``CELL_TOKEN_<i>`` a deployed fleet reads from the cells' outputs). The first colo's
    service owns the limits ledger's namespace, stored in ``storage_dir``; the others bind
    to it, so the fleet has one ledger, as in the cloud."""
    values = {f"CELL_TOKEN_{i}": t for i, t in enumerate(tokens)}
    services, sockets = [wd_disk_service("front-ledger-disk", storage_dir)], []
    for k, colo in enumerate(colos):
        names = [f"cell-{colo}-{i}" for i in range(len(plan.members))]
        owner = f"front-{colos[0]}"
        literal = (front_worker_capnp(plan, names, storage_service="front-ledger-disk", tokens=values) if k == 0 else
                   front_worker_capnp(plan, names, storage_service=None, tokens=values, ledger_service=owner))
        services.append(worker_service(f"front-{colo}", literal))
        services += [external_service(n, "127.0.0.1", binding_port, {proxies.SITE_HEADER: colo, CELL_INDEX_HEADER: str(i)})
                     for i, n in enumerate(names)]
        sockets.append(cf_socket(f"front-{colo}", f"front-{colo}"))
    return config_capnp(services, sockets)


class FrontRunner:
    """Owns the front door of one running fleet. Lives in its own process group."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.logs = self.state_dir / LOGS_DIR
        self.stop = threading.Event()
        self.reload = threading.Event()
        self.workerd: subprocess.Popen | None = None
        self.servers: list[proxies.RelayServer] = []
        self.entries: dict[str, proxies.Network] = {}
        self.binding: proxies.RelayServer | None = None
        self.revision = 0

    def _routes(self, launch: dict) -> list[CellRoute]:
        routes = []
        for c in launch["cells"]:
            ready = read_object(Path(c["state_dir"]) / READY_FILE)
            if not ready:
                raise StartupFailed(f"cell {c['name']} has no ready.json in {c['state_dir']}: it is not running")
            routes.append(CellRoute(c["name"], Path(c["state_dir"]), ready["sites"]["edge"], ready["ports"]["outbound"],
                                    ("127.0.0.1", ready["ports"]["workerd"])))
        return routes

    def _tokens(self, plan: fleet_mod.FleetPlan) -> list[str]:
        """Each member's exchange token, in the plan's order, from its running sandbox."""
        cells = {c["name"]: c for c in (read_object(self.state_dir / FLEET_LAUNCH_FILE) or {}).get("cells", [])}
        out = []
        for m in plan.members:
            ready = read_object(Path(cells[m.name]["state_dir"]) / READY_FILE) if m.name in cells else None
            if not ready or not ready.get("exchange_token"):
                raise StartupFailed(f"cell {m.name} has no exchange token in its ready.json: it is not running "
                                    f"(or was started by an older release: restart it)")
            out.append(ready["exchange_token"])
        return out

    def _start_workerd(self, plan: fleet_mod.FleetPlan, colos: list[str]) -> dict[str, int]:
        if not WORKERD.exists():
            raise StartupFailed(f"{WORKERD} is missing. Fix: run `make setup` (npm ci installs workerd)")
        config = self.state_dir / FRONT_CONFIG_FILE
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(front_config(plan, colos, self.binding.port, self._tokens(plan), self.state_dir / "ledger"))
        socks = {colo: _listening() for colo in colos}
        try:
            args = [str(WORKERD), "serve", str(config)] + [f"--socket-fd=front-{c}={s.fileno()}" for c, s in socks.items()]
            log = open(log_path(self.state_dir, "workerd"), "ab")  # noqa: SIM115 - handed to the child
            # In the runner's process group: down's SIGKILL to the group reaches it too.
            self.workerd = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.state_dir,
                                            pass_fds=tuple(s.fileno() for s in socks.values()))
            log.close()
            ports = {c: s.getsockname()[1] for c, s in socks.items()}
        finally:
            for s in socks.values():
                s.close()
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        first = ports[colos[0]]
        while time.monotonic() < deadline and not self.stop.is_set():
            if http_ok(f"http://127.0.0.1:{first}/", timeout=5)[1] is not None:
                return ports
            if self.workerd.poll() is not None:
                break
            time.sleep(0.1)
        raise StartupFailed(f"the front door's workerd did not answer; see {log_path(self.state_dir, 'workerd')}")

    def start(self) -> dict:
        launch = read_object(self.state_dir / FLEET_LAUNCH_FILE) or {}
        fl = Launch.from_json(launch)
        plan = plan_of(fl)
        colos = client_sites_of(fl, plan)
        geography = Geography.from_args(fl.stretch, fl.rtt)
        handler = type("_Binding", (_BindingHandler,), {"routes": self._routes(launch), "geography": geography,
                                                        "network": None})
        self.binding = proxies.RelayServer(("127.0.0.1", 0), handler)
        self.servers.append(self.binding)
        _serve(self.binding)
        ports = self._start_workerd(plan, colos)
        pins = Pins(self.state_dir / ENTRY_PINS_FILE)  # never written: the entries touch no object
        entries = {}
        for colo in colos:
            net = proxies.Network(geography, Sites(client=colo, edge=colo, pod=colo), pins)
            server = proxies.make_server(_EntryHandler, net, "127.0.0.1", 0)
            self.servers.append(server)
            _serve(server)
            net.resume(("127.0.0.1", ports[colo]))
            self.entries[colo] = net
            entries[colo] = f"http://127.0.0.1:{server.port}"
        self.urls = entries
        return self._ready(ports)

    def _ready(self, ports: dict[str, int]) -> dict:
        self.revision += 1
        return {"entries": self.urls, "ports": {"binding": self.binding.port, "workerd": ports},
                "pids": {"runner": os.getpid(), "workerd": self.workerd.pid}, "revision": self.revision,
                "logs": str(self.logs)}

    def apply(self) -> dict:
        """A new front door version (the fleet stack re-read) with no request dropped: the
        entries hold new requests while in-flight ones finish, then the new workerd takes them."""
        fl = Launch.from_json(read_object(self.state_dir / FLEET_LAUNCH_FILE) or {})
        plan = plan_of(fl)
        colos = list(self.entries)
        for net in self.entries.values():
            net.pause()
        try:
            old, self.workerd = self.workerd, None
            stop_child(old, 10)
            ports = self._start_workerd(plan, colos)
        finally:
            for colo, net in self.entries.items():
                net.resume(net.workerd if self.workerd is None else ("127.0.0.1", ports[colo]))
        return self._ready(ports)

    def watch(self) -> str:
        while not self.stop.wait(0.2):
            if self.reload.is_set():
                self.reload.clear()
                try:
                    ready = self.apply()
                    write_json(self.state_dir / FRONT_READY_FILE, ready)
                    log_fleet(f"applied revision {ready['revision']}")
                except Exception as exc:  # noqa: BLE001 - reported to apply through front-failed.json
                    log_fleet(f"apply failed: {type(exc).__name__}: {exc}")
                    write_json(self.state_dir / FRONT_FAILED_FILE, {"error": str(exc)})
            if self.workerd is not None and self.workerd.poll() is not None:
                return f"workerd exited with {self.workerd.returncode}"
        return "stop requested"

    def cleanup(self) -> None:
        stop_child(self.workerd, 5)
        for s in self.servers:
            s.shutdown()
            s.server_close()


def run(state_dir: Path) -> int:
    """The front runner's main: start, report readiness, wait, clean up."""
    state_dir = Path(state_dir)
    runner = FrontRunner(state_dir)
    signal.signal(signal.SIGTERM, lambda *_: runner.stop.set())
    signal.signal(signal.SIGINT, lambda *_: runner.stop.set())
    signal.signal(signal.SIGHUP, lambda *_: runner.reload.set())
    write_json(state_dir / FRONT_RUN_FILE, {"pid": os.getpid(), "pgid": os.getpgid(0), "started_at": time.time()})
    code = 0
    try:
        ready = runner.start()
        if runner.stop.is_set():
            return 0
        write_json(state_dir / FRONT_READY_FILE, ready)
        log_fleet(f"up: entries {ready['entries']}")
        why = runner.watch()
        log_fleet(f"stopping: {why}")
        code = 0 if why == "stop requested" else 1
    except Exception as exc:  # noqa: BLE001 - reported to up through front-failed.json
        log_fleet(f"failed: {type(exc).__name__}: {exc}")
        write_json(state_dir / FRONT_FAILED_FILE, {"error": str(exc)})
        code = 1
    finally:
        runner.cleanup()
        (state_dir / FRONT_READY_FILE).unlink(missing_ok=True)
        log_fleet("stopped")
    return code


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m colocate.sandbox.fleet_front")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("run", help="the front runner (started by sandbox.py up --fleet; not for direct use)")
    sp.add_argument("state_dir", type=Path)
    sp.add_argument("--lock-fd", type=int)
    a = p.parse_args()
    sys.exit(run(a.state_dir))
