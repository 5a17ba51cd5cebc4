"""The fleet in the sandbox: every member cell, and the front door in front of them.

``up --fleet F`` validates the fleet stack and its members' stack files first (a bad one
fails before anything starts), brings every member cell up with the cell's own ``up``
(each a sandbox of its own, in ``<sandboxes dir>/<cell>``), then starts a detached
**front runner** (``python -m colocate.sandbox.fleet run STATE_DIR``) that owns:

    entry proxy (one per client site)   a user at SITE reaching colo SITE (its nearest colo):
                 RTT(site, colo)/2 each way (the same-site rule), ``cf-ray``, and
                 ``cf-blob: {"colo": SITE}``, the header the front door's socket parses into
                 ``request.cf`` (a client's own ``cf-blob`` is dropped: only the edge sets it)
    workerd      the front door (``front.js`` and its imports, the bytes the fleet stack
                 uploads; ``plan_fleet``'s bindings), one service per client colo
    binding proxy  each service's ``CELL_<i>`` is an external service reaching this proxy
                 with the colo and the cell named in injected headers; it charges
                 RTT(colo, the cell's Worker site)/2 each way and forwards to the cell's workerd

and, once the front door answers, makes one client key for the whole fleet the way
``keys.py create --stack F`` does (``colocate.admin``: the key made here, its row imported
into every cell). State directory (default ``<sandboxes dir>/<fleet stack>``)::

    fleet.lock        flock taken by up, inherited by the front runner for its whole life
    fleet-launch.json what up asked for, with every member's state directory (written before
                      any cell starts, so down finds them after a crash)
    front-run.json    the front runner's pid/pgid, written by the runner before it starts anything
    front.json        the front runner's ready record (entries, ports, pids, revision)
    fleet-key.json    the fleet's client key (mode 0600), reused while every cell accepts it
    fleet.json        what up prints (mode 0600: it holds the key)
    logs/             front-runner.log, workerd.log

Imports from ``supervisor`` only its lifecycle functions; what it needs of a running cell it
reads from the cell's own ``ready.json``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .. import admin, fleet as fleet_mod, outputs, settings as settings_mod, stackfile
from ..errors import ConfigError
from ..fleet_workerd import CF_BLOB_HEADER, cf_socket, front_worker_capnp
from ..plan import plan_cell
from ..pods.local import alive
from ..workerd import config_capnp, disk_service as wd_disk_service, external_service, worker_service
from . import proxies, supervisor
from .errors import AlreadyRunning, NotRunning, SandboxError, StartupFailed
from .geography import Geography, Sites, site
from .pinning import Pins

ROOT = Path(__file__).resolve().parents[2]
WORKERD = ROOT / "node_modules" / ".bin" / "workerd"
PLACEHOLDER_ACCOUNT = "0" * 32  # the sandbox never calls Cloudflare
PLACEHOLDER_SUBDOMAIN = "sandbox"
LAUNCH_FILE = "fleet-launch.json"
RUN_FILE = "front-run.json"
READY_FILE = "front.json"
FAILED_FILE = "front-failed.json"
KEY_FILE = "fleet-key.json"
OUT_FILE = "fleet.json"
LOCK_FILE = "fleet.lock"
KEY_NAME = "sandbox-fleet"
CELL_INDEX_HEADER = "x-sandbox-cell"
CHILD_TIMEOUT_S = 30.0
SWAP_WAIT_S = 30.0  # how long the binding proxy waits for a cell whose workerd is being swapped


def _log(msg: str) -> None:
    print(f"[sandbox fleet] {msg}", file=sys.stderr, flush=True)


def _write_json(path: Path, data: dict, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT and SIGTERM until the block ends (a cleanup cut short would leave processes
    running), then raise KeyboardInterrupt if one came. Only the main thread can do this."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: got.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        raise KeyboardInterrupt


# --- what the fleet is: validated before anything starts ---------------------------------------

@dataclass(frozen=True)
class Launch:
    """What ``up --fleet`` was asked for; the front runner re-derives the same plan from it."""

    fleet: str
    stacks_dir: str
    sandboxes_dir: str
    client_sites: tuple[str, ...]  # empty: each cell's edge site
    stretch: float | None
    rtt: tuple[str, ...]

    def cell_dir(self, cell: str) -> Path:
        return Path(self.sandboxes_dir) / fleet_mod.short_name(cell)

    def as_json(self) -> dict:
        return {"fleet": self.fleet, "stacks_dir": self.stacks_dir, "sandboxes_dir": self.sandboxes_dir,
                "client_sites": list(self.client_sites), "stretch": self.stretch, "rtt": list(self.rtt)}

    @classmethod
    def from_json(cls, d: dict) -> Launch:
        return cls(d["fleet"], d["stacks_dir"], d["sandboxes_dir"], tuple(d.get("client_sites") or ()), d.get("stretch"),
                   tuple(d.get("rtt") or ()))


def _member_outputs(index: int, stack: str, stacks_dir: Path) -> dict:
    """What the fleet stack would read from member ``stack``'s outputs, from its stack file
    (the sandbox has no Pulumi backend): its Worker's name and its region. The cell is
    parsed as the cell's own ``up`` parses it (no cloud pod, no real account), so a member
    ``up`` would refuse is refused here, before any cell starts."""
    key = f"{fleet_mod.KEY}.cells[{index}]"
    path = stackfile.path_of(fleet_mod.short_name(stack), stacks_dir)
    if "/" in stack:
        raise ConfigError(key, stack, "names a stack of another project or organisation; the sandbox runs only this "
                          f"project's stack files (in {stacks_dir})", f"name a stack with a file in {stacks_dir}")
    if not path.exists():
        known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in Path(stacks_dir).glob("Pulumi.*.yaml"))
        raise ConfigError(key, stack, f"no stack file {path}: the sandbox runs each member from its stack file",
                          f"create the cell stack (cp stacks/Pulumi.us-east.yaml {path}, then edit colocate:region), "
                          f"or pulumi config rm --path '{key}'; known stacks: {', '.join(known) or 'none'}")
    raw, secret_names = stackfile.read_config(stack, stacks_dir)
    if fleet_mod.is_fleet(raw):
        raise ConfigError(key, stack, "is a fleet stack, not a cell", f"pulumi config rm --path '{key}'")
    raw.update(_placeholders(raw))
    pod = dict(raw.get("pod") or {})
    pod["provider"] = "local"  # the sandbox never rents a GPU (the cell's up says so too)
    raw["pod"] = pod
    names = frozenset(secret_names) | frozenset(settings_mod.ALWAYS_SECRET)
    plan = plan_cell(settings_mod.parse(raw, stack, secrets=names, env={}))
    return {outputs.WORKER_NAME: plan.worker.script_name, outputs.WORKER_URL: f"http://sandbox.invalid/{stack}",
            outputs.REGION: plan.region.name}


def _placeholders(raw: dict) -> dict:
    """What a cloud stack lacks to run in the sandbox, which never calls Cloudflare: an account
    id and a workers.dev subdomain (the committed cell stacks leave both to the operator)."""
    out: dict = {} if raw.get("accountId") else {"accountId": PLACEHOLDER_ACCOUNT}
    worker = raw.get("worker") or {}
    if not raw.get("zone") and not (isinstance(worker, dict) and worker.get("subdomain")):
        out["worker"] = {**(worker if isinstance(worker, dict) else {}), "subdomain": PLACEHOLDER_SUBDOMAIN}
    return out


def sandbox_stacks(launch: Launch, plan: fleet_mod.FleetPlan, state_dir: Path) -> Path:
    """Copies of the members' stack files in ``<state_dir>/stacks`` with the placeholders
    (``_placeholders``) written in: the cells' own ``up``/``apply`` read these, and the
    committed stack files stay untouched. Made again from the originals at every up/apply."""
    target = Path(state_dir) / "stacks"
    target.mkdir(parents=True, exist_ok=True)
    for m in plan.members:
        name = fleet_mod.short_name(m.stack)
        shutil.copyfile(stackfile.path_of(name, Path(launch.stacks_dir)), stackfile.path_of(name, target))
        raw, _ = stackfile.read_config(name, target)
        updates = {k if k != "worker" else "worker.subdomain": v if k != "worker" else v["subdomain"]
                   for k, v in _placeholders(raw).items()}
        if updates:
            stackfile.write_config(name, updates, target)
    return target


def plan_of(launch: Launch) -> fleet_mod.FleetPlan:
    """The front door's plan from the fleet stack file and its members' stack files.
    ConfigError names the key, the value and the fix."""
    stacks_dir = Path(launch.stacks_dir)
    path = stackfile.path_of(launch.fleet, stacks_dir)
    if not path.exists():
        known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml"))
        raise ConfigError("--fleet", launch.fleet, f"no stack file {path}",
                          f"name a fleet stack (one whose config has {fleet_mod.KEY}), e.g. fleet; known stacks: "
                          f"{', '.join(known) or 'none'}")
    raw, secret_names = stackfile.read_config(launch.fleet, stacks_dir)
    if not fleet_mod.is_fleet(raw):
        raise ConfigError("--fleet", launch.fleet, f"is a cell stack: its config has no {fleet_mod.KEY}",
                          f"`{supervisor.SANDBOX_CMD} up --stack {launch.fleet}` runs a cell; --fleet takes a fleet stack "
                          "such as fleet")
    raw.update(_placeholders(raw))  # its Cloudflare account and address: the sandbox calls neither
    settings = fleet_mod.parse(raw, launch.fleet, secrets=secret_names)
    found = [_member_outputs(i, c, stacks_dir) for i, c in enumerate(settings.cells)]
    return fleet_mod.plan_fleet(settings, found)


def client_sites_of(launch: Launch, plan: fleet_mod.FleetPlan) -> list[str]:
    """The client sites, each once: as given, else every cell's edge site (cell order)."""
    wanted = launch.client_sites or tuple(m.region.edge_site for m in plan.members)
    return list(dict.fromkeys(site(s, "--client-site") for s in wanted))


def make_launch(fleet_stack: str, *, stacks_dir: Path = stackfile.STACKS_DIR, sandboxes_dir: Path | None = None,
                client_sites: tuple[str, ...] = (), stretch: float | None = None, rtt: tuple[str, ...] = ()) -> Launch:
    sandboxes = Path(sandboxes_dir).resolve() if sandboxes_dir else supervisor.default_state_dir(fleet_stack).parent
    sites = tuple(site(s, "--client-site") for s in client_sites)  # an unknown colo fails here
    Geography.from_args(stretch, rtt)  # a bad --stretch/--rtt too
    return Launch(fleet_stack, str(Path(stacks_dir).resolve()), str(sandboxes), sites, stretch, tuple(rtt))


# --- the front runner's lock ---------------------------------------------------------------------

def _try_lock(state_dir: Path) -> int | None:
    fd = os.open(Path(state_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def front_running(state_dir: Path) -> bool:
    """True while up or the front runner holds the fleet's lock."""
    if not (Path(state_dir) / LOCK_FILE).exists():
        return False
    fd = _try_lock(state_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


def is_fleet_dir(state_dir: Path) -> bool:
    return (Path(state_dir) / LAUNCH_FILE).exists()


def fleet_name(state_dir: Path) -> str | None:
    return (_read_json(Path(state_dir) / LAUNCH_FILE) or {}).get("fleet")


def what_runs(state_dir: Path) -> list[str]:
    """The parts of the fleet in ``state_dir`` that still run (a lock held), by name."""
    launch = _read_json(Path(state_dir) / LAUNCH_FILE) or {}
    parts = ["front door"] if front_running(state_dir) else []
    return parts + [f"cell {c['name']}" for c in launch.get("cells", []) if supervisor.is_running(Path(c["state_dir"]))]


# --- up / down / status / apply ----------------------------------------------------------------

def up(fleet_stack: str, *, state_dir: Path | None = None, stacks_dir: Path = stackfile.STACKS_DIR,
       sandboxes_dir: Path | None = None, client_sites: tuple[str, ...] = (), stretch: float | None = None,
       rtt: tuple[str, ...] = (), timeout_s: float = supervisor.UP_TIMEOUT_S) -> dict:
    """Start every member cell and the front door; return what ``sandbox.py up --fleet`` prints."""
    launch = make_launch(fleet_stack, stacks_dir=stacks_dir, sandboxes_dir=sandboxes_dir, client_sites=client_sites,
                         stretch=stretch, rtt=rtt)
    plan = plan_of(launch)  # a bad fleet or member stack fails here, before anything starts
    client_sites_of(launch, plan)
    state_dir = Path(state_dir or Path(launch.sandboxes_dir) / fleet_stack).resolve()
    cells = [(m, launch.cell_dir(m.stack).resolve()) for m in plan.members]
    if is_fleet_dir(state_dir) and what_runs(state_dir):
        raise AlreadyRunning(f"the fleet {fleet_stack} already runs in {state_dir} ({', '.join(what_runs(state_dir))}); "
                             f"run `{supervisor.SANDBOX_CMD} down --fleet {fleet_stack} --state-dir {state_dir}` first")
    for m, cell_dir in cells:
        if cell_dir == state_dir:
            raise ConfigError("--state-dir", str(state_dir), f"is member {m.name}'s state directory",
                              "give the fleet a directory of its own")
        if supervisor.is_running(cell_dir):
            raise AlreadyRunning(f"cell {m.name} of fleet {fleet_stack} already runs in {cell_dir}; stop it first with "
                                 f"`{supervisor.SANDBOX_CMD} down --state-dir {cell_dir}`; nothing was started")
        supervisor.check_owner(cell_dir, fleet_mod.short_name(m.stack))
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    fd = _try_lock(state_dir)
    if fd is None:
        raise AlreadyRunning(f"the fleet {fleet_stack} already runs in {state_dir}; run "
                             f"`{supervisor.SANDBOX_CMD} down --fleet {fleet_stack}` first")
    try:
        for stale in (READY_FILE, FAILED_FILE, RUN_FILE, OUT_FILE):
            (state_dir / stale).unlink(missing_ok=True)
        record = {**launch.as_json(), "cells": [{"name": m.name, "stack": m.stack, "state_dir": str(d)} for m, d in cells]}
        _write_json(state_dir / LAUNCH_FILE, record)  # before any cell starts: down finds them all
        cell_stacks = sandbox_stacks(launch, plan, state_dir)
        ready_cells = []
        for m, cell_dir in cells:
            _log(f"cell {m.name} ({m.region.name}): starting in {cell_dir}")
            ready_cells.append(supervisor.up(fleet_mod.short_name(m.stack), state_dir=cell_dir, stacks_dir=cell_stacks,
                                             stretch=stretch, rtt=tuple(rtt), timeout_s=timeout_s))
        _log(f"front door: starting in {state_dir}")
        runner = _launch_front(state_dir, fd)
        fd, held = None, fd  # the runner holds the lock from now on
        os.close(held)
        front = _wait_front(state_dir, runner, timeout_s)
        by_name = {fleet_mod.short_name(m.stack): c for (m, _), c in zip(cells, ready_cells, strict=True)}
        key = fleet_key(state_dir, by_name)
        retire_cell_keys(by_name, key["id"])
        out = {
            "fleet": fleet_stack,
            "state_dir": str(state_dir),
            "entries": front["entries"],
            "cells": [{"name": m.name, "stack": m.stack, "region": m.region.name, "worker_url": c["worker_url"],
                       "state_dir": c["state_dir"], "edge_site": c["sites"]["edge"]}
                      for (m, _), c in zip(cells, ready_cells, strict=True)],
            "key": key["key"],
            "key_id": key["id"],
            "pids": {**{f"front-{k}": v for k, v in front["pids"].items()},
                     **{f"{m.name}-{k}": v for (m, _), c in zip(cells, ready_cells, strict=True)
                        for k, v in (c.get("pids") or {}).items()}},
        }
        _write_json(state_dir / OUT_FILE, out, 0o600)
        return out
    except BaseException:
        with deferred_signals():
            if fd is not None:
                os.close(fd)
            down(state_dir)
        raise


def _launch_front(state_dir: Path, fd: int) -> int:
    """Start the front runner detached (in its own session, nobody's child); its pid. It
    inherits the lock: "the lock is held" = "up, the launcher or the runner lives"."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(state_dir / "logs" / "front-runner.log", "ab") as log:
        started = subprocess.run([sys.executable, "-m", "colocate.sandbox.fleet", "launch", str(state_dir),
                                  "--lock-fd", str(fd)], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=log, pass_fds=(fd,), start_new_session=True,
                                 timeout=30, check=True)
    return int(started.stdout.strip())


def _wait_front(state_dir: Path, runner: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = _read_json(state_dir / READY_FILE)
        if ready:
            return ready
        failed = _read_json(state_dir / FAILED_FILE)
        if failed or not alive(runner):
            why = (failed or {}).get("error") or "the front runner exited"
            raise StartupFailed(f"the front door did not come up: {why}. Logs: {state_dir / 'logs'}")
        time.sleep(0.1)
    raise StartupFailed(f"the front door did not come up within {timeout_s:.0f} s. Logs: {state_dir / 'logs'}")


def fleet_key(state_dir: Path, cells: dict[str, dict]) -> dict:
    """One client key for the whole fleet, made here and imported into every cell as
    ``keys.py create --stack <fleet>`` does (``colocate.admin``: only its digest leaves this
    process). Reused while every cell holds it unrevoked (the import is idempotent)."""
    targets = {name: admin.Target(c["worker_url"], c["token"], "sandbox") for name, c in cells.items()}
    path = Path(state_dir) / KEY_FILE
    stored = _read_json(path) or {}
    if stored.get("key") and stored.get("row"):
        held, failed = admin.fan_out(targets, lambda c: c.import_key(stored["row"]))
        if not failed and not any(r.get("revoked_at") or r.get("revoked") for r in held.values()):
            return {"key": stored["key"], "id": stored["row"]["id"]}
    key = admin.new_key()
    row = admin.key_row(key, KEY_NAME)
    _, failed = admin.fan_out(targets, lambda c: c.import_key(row))
    if failed:
        cell, why = next(iter(failed.items()))
        raise StartupFailed(f"the fleet's client key could not be imported into cell {cell}: {why}")
    _write_json(path, {"key": key, "row": row}, 0o600)
    return {"key": key, "id": row["id"]}


def retire_cell_keys(cells: dict[str, dict], fleet_key_id: str) -> None:
    """Revoke the demo key each cell's own ``up`` made: it lives in that cell alone, so with it
    the cells would disagree on an active key (``keys.py list --stack <fleet>`` exits 1 and
    ``sync`` would spread it). The fleet's clients use the fleet's key."""
    for name, c in cells.items():
        if c.get("key_id") and c["key_id"] != fleet_key_id:
            try:
                admin.AdminClient(admin.Target(c["worker_url"], c["token"], "sandbox")).revoke_key(c["key_id"])
            except admin.AdminError as exc:
                raise StartupFailed(f"cell {name}'s own demo key {c['key_id']} could not be revoked: {exc}") from None


def _signal_group(pgid: int | None, sig: int) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_front(state_dir: Path, timeout_s: float = supervisor.STOP_TIMEOUT_S + CHILD_TIMEOUT_S) -> bool:
    """Stop the front runner, even one that has not said who it is yet: while the lock is held
    (by up, the launcher or the runner), wait for the runner's own front-run.json and stop it.
    True once the lock is free."""
    state_dir = Path(state_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read_json(state_dir / RUN_FILE) or {}
        pid, pgid = run.get("pid"), run.get("pgid")
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
            stop_by = time.monotonic() + supervisor.STOP_TIMEOUT_S
            while alive(pid) and time.monotonic() < stop_by:
                time.sleep(0.05)
        if _signal_group(pgid, 0):
            _signal_group(pgid, signal.SIGKILL)  # what the runner could not stop (workerd is in its group)
            kill_by = time.monotonic() + 5
            while _signal_group(pgid, 0) and time.monotonic() < kill_by:
                time.sleep(0.05)
        if not front_running(state_dir):
            return True
        if time.monotonic() > deadline:
            _log(f"WARNING: the fleet's lock in {state_dir} is still held and no front runner said who it is; "
                 f"see {state_dir / 'logs' / 'front-runner.log'}")
            return False
        time.sleep(0.05)


def down(state_dir: Path) -> dict:
    """Stop the front door, then every member cell; idempotent."""
    state_dir = Path(state_dir).resolve()
    with deferred_signals():
        launch = _read_json(state_dir / LAUNCH_FILE) or {}
        held = front_running(state_dir)
        # The entry first: no new request reaches a cell that is stopping.
        front_stopped = stop_front(state_dir) if held or _read_json(state_dir / RUN_FILE) else True
        members = launch.get("cells", [])
        # Side by side (each cell's down waits on its own runner, ~4 s here): down touches only
        # its own state directory, and the signals stay deferred in this, the main, thread.
        with ThreadPoolExecutor(max_workers=max(1, len(members))) as ex:
            downs = list(ex.map(lambda c: supervisor.down(Path(c["state_dir"]), quiet=True), members))
        cells = [{"name": c["name"], **d} for c, d in zip(members, downs, strict=True)]
        for name in (RUN_FILE, READY_FILE, OUT_FILE):
            (state_dir / name).unlink(missing_ok=True)
    return {"fleet": launch.get("fleet"), "state_dir": str(state_dir), "front_stopped": front_stopped,
            "was_running": bool(held or any(c["was_running"] for c in cells)), "cells": cells,
            "running": front_running(state_dir) or any(c["running"] for c in cells)}


def _http(url: str, headers: dict | None = None, timeout: float = 10.0) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def status(state_dir: Path) -> dict:
    """Every member cell's status, then the front door's: its processes, and one routed request
    (``GET /v1/models`` with the fleet's key) through each entry. ``problems`` names what is wrong."""
    state_dir = Path(state_dir).resolve()
    launch = _read_json(state_dir / LAUNCH_FILE) or {}
    out: dict = {"fleet": launch.get("fleet"), "state_dir": str(state_dir), "running": front_running(state_dir)}
    cells, problems = [], []
    for c in launch.get("cells", []):
        st = supervisor.status(Path(c["state_dir"]))
        cells.append({"name": c["name"], **st})
        if not st.get("healthy"):
            problems.append(f"cell {c['name']} is {'unhealthy' if st.get('running') else 'not running'} "
                            f"(`{supervisor.SANDBOX_CMD} status --state-dir {c['state_dir']}`)")
    out["cells"] = cells
    ready = _read_json(state_dir / READY_FILE)
    fleet_out = _read_json(state_dir / OUT_FILE) or {}
    entries = {}
    if ready:
        for name, pid in ready.get("pids", {}).items():
            if not alive(pid):
                problems.append(f"front door {name} (pid {pid}) is not running")
        for colo, url in ready.get("entries", {}).items():
            code = _http(url + "/v1/models", {"authorization": f"Bearer {fleet_out.get('key', '')}"})
            entries[colo] = code
            if code != 200:
                problems.append(f"entry {colo} ({url}) answered GET /v1/models with {code or 'nothing'}")
        out["entries"] = ready.get("entries")
        out["pids"] = ready.get("pids")
    elif out["running"] or launch:
        problems.append("the front door is not running")
    out["entry_status"] = entries
    out["problems"] = problems
    out["healthy"] = bool(launch) and out["running"] and not problems
    return out


def apply(state_dir: Path, *, stacks_dir: Path | None = None, timeout_s: float = supervisor.UP_TIMEOUT_S) -> dict:
    """The fleet's ``pulumi up``: every member cell's ``apply``, then the front door re-planned
    from the fleet stack file (e.g. ``rememberMs``) and swapped with no request dropped. The
    sandbox does not add or remove cells on ``apply``: that is a ``down`` and an ``up``."""
    state_dir = Path(state_dir).resolve()
    record = _read_json(state_dir / LAUNCH_FILE)
    run = _read_json(state_dir / RUN_FILE) or {}
    previous = _read_json(state_dir / READY_FILE)
    if not record or not previous or not front_running(state_dir) or not alive(run.get("pid")):
        raise NotRunning(f"no fleet runs in {state_dir}; start one with `{supervisor.SANDBOX_CMD} up --fleet "
                         f"{(record or {}).get('fleet', 'F')}`")
    launch = Launch.from_json(record)
    if stacks_dir is not None:
        launch = Launch(launch.fleet, str(Path(stacks_dir).resolve()), launch.sandboxes_dir, launch.client_sites,
                        launch.stretch, launch.rtt)
    plan = plan_of(launch)  # a bad stack fails here and nothing changes
    now = [m.stack for m in plan.members]
    was = [c["stack"] for c in record["cells"]]
    if now != was:
        raise ConfigError(f"{fleet_mod.KEY}.cells", now, f"the running fleet has {was}; the sandbox's apply does not add "
                          "or remove cells", f"`{supervisor.SANDBOX_CMD} down --fleet {launch.fleet}` then "
                          f"`{supervisor.SANDBOX_CMD} up --fleet {launch.fleet}`")
    cell_stacks = sandbox_stacks(launch, plan, state_dir)
    cells = [{"name": c["name"], **supervisor.apply(fleet_mod.short_name(c["stack"]), state_dir=Path(c["state_dir"]),
                                                    stacks_dir=cell_stacks, timeout_s=timeout_s)}
             for c in record["cells"]]
    _write_json(state_dir / LAUNCH_FILE, {**record, **launch.as_json()})
    (state_dir / FAILED_FILE).unlink(missing_ok=True)
    os.kill(run["pid"], signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = _read_json(state_dir / READY_FILE) or {}
        if ready.get("revision", 0) > previous.get("revision", 0):
            return {"fleet": launch.fleet, "state_dir": str(state_dir), "front": ready,
                    "cells": [{k: c.get(k) for k in ("name", "stack", "region", "worker_url", "revision")} for c in cells]}
        failed = _read_json(state_dir / FAILED_FILE)
        if failed:
            raise StartupFailed(f"the front door's apply failed: {failed.get('error')}; the previous version still "
                                f"serves. Logs: {state_dir / 'logs'}")
        time.sleep(0.1)
    raise StartupFailed(f"the front door's apply did not finish within {timeout_s:.0f} s. Logs: {state_dir / 'logs'}")


def apply_cell(state_dir: Path, cell: str, timeout_s: float = supervisor.UP_TIMEOUT_S) -> dict:
    """One member's ``apply`` (its ``pulumi up -s <cell>``), from its stack file as the fleet
    runs it; the front door and the other cells are untouched."""
    state_dir = Path(state_dir).resolve()
    record = _read_json(state_dir / LAUNCH_FILE)
    if not record:
        raise NotRunning(f"no fleet runs in {state_dir}")
    member = next((c for c in record["cells"] if c["name"] == cell), None)
    if member is None:
        raise ConfigError("cell", cell, f"is not a member of the fleet in {state_dir}",
                          f"one of {', '.join(c['name'] for c in record['cells'])}")
    launch = Launch.from_json(record)
    cell_stacks = sandbox_stacks(launch, plan_of(launch), state_dir)
    return supervisor.apply(fleet_mod.short_name(member["stack"]), state_dir=Path(member["state_dir"]),
                            stacks_dir=cell_stacks, timeout_s=timeout_s)


# --- the emulated network of the front door --------------------------------------------------

class _EntryHandler(proxies._FrontHandler):
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


class _BindingHandler(proxies._Relay):
    """``CELL_<i>`` of the front-door service of colo C: RTT(C, cell i's site)/2 each way, then
    cell i's workerd. A cell that cannot be reached closes the connection unanswered, so the
    front door's fetch throws, as a binding to an unreachable Worker does."""

    upstream_name = "cell"
    routes: list[CellRoute]
    geography: Geography
    _retrying = False

    def _upstream_failed(self, host: str, port: int, exc: BaseException) -> None:
        route = getattr(self, "_route", None)
        if isinstance(exc, ConnectionRefusedError) and route is not None and not self._retrying:
            # The cell is swapping its workerd (its `apply`): wait for the new one, as its own
            # front proxy holds requests during the swap.
            deadline = time.monotonic() + SWAP_WAIT_S
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
        headers = self._forward_headers({proxies.SITE_HEADER, CELL_INDEX_HEADER}) + [("host", self.headers.get("host", "localhost"))]
        self._pending = (self.path, headers, body)
        self._pending_after = half
        if target is None:
            proxies._sleep_ms(half)
            self._upstream_failed("127.0.0.1", 0, ConnectionRefusedError())
            return
        self._relay(target[0], target[1], self.path, headers, body, half, half)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle  # noqa: N815


def _serve(server: proxies._Server) -> threading.Thread:
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
    colo and the cell from injected headers. ``tokens``: each cell's probe token (the
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
        self.logs = self.state_dir / "logs"
        self.stop = threading.Event()
        self.reload = threading.Event()
        self.workerd: subprocess.Popen | None = None
        self.servers: list[proxies._Server] = []
        self.entries: dict[str, proxies.Network] = {}
        self.binding: proxies._Server | None = None
        self.revision = 0

    def _routes(self, launch: dict) -> list[CellRoute]:
        routes = []
        for c in launch["cells"]:
            ready = _read_json(Path(c["state_dir"]) / "ready.json")
            if not ready:
                raise StartupFailed(f"cell {c['name']} has no ready.json in {c['state_dir']}: it is not running")
            routes.append(CellRoute(c["name"], Path(c["state_dir"]), ready["sites"]["edge"], ready["ports"]["outbound"],
                                    ("127.0.0.1", ready["ports"]["workerd"])))
        return routes

    def _tokens(self, plan: fleet_mod.FleetPlan) -> list[str]:
        """Each member's probe token, in the plan's order, from its running sandbox."""
        cells = {c["name"]: c for c in (_read_json(self.state_dir / LAUNCH_FILE) or {}).get("cells", [])}
        out = []
        for m in plan.members:
            ready = _read_json(Path(cells[m.name]["state_dir"]) / "ready.json") if m.name in cells else None
            if not ready or not ready.get("token"):
                raise StartupFailed(f"cell {m.name} has no probe token in its ready.json: it is not running")
            out.append(ready["token"])
        return out

    def _start_workerd(self, plan: fleet_mod.FleetPlan, colos: list[str]) -> dict[str, int]:
        if not WORKERD.exists():
            raise StartupFailed(f"{WORKERD} is missing. Fix: run `make setup` (npm ci installs workerd)")
        config = self.state_dir / "front.capnp"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(front_config(plan, colos, self.binding.port, self._tokens(plan), self.state_dir / "ledger"))
        socks = {colo: _listening() for colo in colos}
        try:
            args = [str(WORKERD), "serve", str(config)] + [f"--socket-fd=front-{c}={s.fileno()}" for c, s in socks.items()]
            log = open(self.logs / "workerd.log", "ab")  # noqa: SIM115 - handed to the child
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
            if _http(f"http://127.0.0.1:{first}/", timeout=5) is not None:
                return ports
            if self.workerd.poll() is not None:
                break
            time.sleep(0.1)
        raise StartupFailed(f"the front door's workerd did not answer; see {self.logs / 'workerd.log'}")

    def start(self) -> dict:
        launch = _read_json(self.state_dir / LAUNCH_FILE) or {}
        fl = Launch.from_json(launch)
        plan = plan_of(fl)
        colos = client_sites_of(fl, plan)
        geography = Geography.from_args(fl.stretch, fl.rtt)
        handler = type("_Binding", (_BindingHandler,), {"routes": self._routes(launch), "geography": geography,
                                                        "network": None})
        self.binding = proxies._Server(("127.0.0.1", 0), handler)
        self.servers.append(self.binding)
        _serve(self.binding)
        ports = self._start_workerd(plan, colos)
        pins = Pins(self.state_dir / "entry-pins.json")  # never written: the entries touch no object
        entries = {}
        for colo in colos:
            net = proxies.Network(geography, Sites(client=colo, edge=colo, pod=colo), pins)
            server = proxies._server(_EntryHandler, net, "127.0.0.1", 0)
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
        fl = Launch.from_json(_read_json(self.state_dir / LAUNCH_FILE) or {})
        plan = plan_of(fl)
        colos = list(self.entries)
        for net in self.entries.values():
            net.pause()
        try:
            old, self.workerd = self.workerd, None
            if old is not None and old.poll() is None:
                old.terminate()
                try:
                    old.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    old.kill()
                    old.wait(timeout=5)
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
                    _write_json(self.state_dir / READY_FILE, ready)
                    _log(f"applied revision {ready['revision']}")
                except Exception as exc:  # noqa: BLE001 - reported to apply through front-failed.json
                    _log(f"apply failed: {type(exc).__name__}: {exc}")
                    _write_json(self.state_dir / FAILED_FILE, {"error": str(exc)})
            if self.workerd is not None and self.workerd.poll() is not None:
                return f"workerd exited with {self.workerd.returncode}"
        return "stop requested"

    def cleanup(self) -> None:
        proc = self.workerd
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
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
    _write_json(state_dir / RUN_FILE, {"pid": os.getpid(), "pgid": os.getpgid(0), "started_at": time.time()})
    code = 0
    try:
        ready = runner.start()
        if runner.stop.is_set():
            return 0
        _write_json(state_dir / READY_FILE, ready)
        _log(f"up: entries {ready['entries']}")
        why = runner.watch()
        _log(f"stopping: {why}")
        code = 0 if why == "stop requested" else 1
    except Exception as exc:  # noqa: BLE001 - reported to up through front-failed.json
        _log(f"failed: {type(exc).__name__}: {exc}")
        _write_json(state_dir / FAILED_FILE, {"error": str(exc)})
        code = 1
    finally:
        runner.cleanup()
        (state_dir / READY_FILE).unlink(missing_ok=True)
        _log("stopped")
    return code


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m colocate.sandbox.fleet")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "launch"):
        sp = sub.add_parser(name, help="the front runner (started by sandbox.py up --fleet; not for direct use)")
        sp.add_argument("state_dir", type=Path)
        sp.add_argument("--lock-fd", type=int, required=name == "launch")
    a = p.parse_args()
    if a.cmd == "launch":
        child = subprocess.Popen([sys.executable, "-m", "colocate.sandbox.fleet", "run", str(a.state_dir),
                                  "--lock-fd", str(a.lock_fd)], stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                 stderr=sys.stderr, pass_fds=(a.lock_fd,))
        print(child.pid, flush=True)
        os._exit(0)  # leave the runner running; no destructor waits on it
    sys.exit(run(a.state_dir))
