"""The fleet in the sandbox: every member cell, and the front door in front of them.

``up --fleet F`` validates the fleet stack and its members' stack files first (a bad one
fails before anything starts; ``fleet_launch.py``), brings every member cell up with the
cell's own ``up`` (each a sandbox of its own, in ``<sandboxes dir>/<cell>``), then starts a
detached **front runner** (``python -m colocate.sandbox.fleet_front run STATE_DIR``; what it
owns: ``fleet_front.py``) and, once the front door answers, makes one client key for the whole
fleet the way ``keys.py create --stack F`` does (``colocate.admin``: the key made here, its
row imported into every cell). State directory (default ``<sandboxes dir>/<fleet stack>``)::

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

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import admin, stackfile
from ..errors import ConfigError
from ..fleet import plan as fleet_mod
from ..pods.local import alive
from . import detach, supervisor
from .errors import AlreadyRunning, NotRunning, StartupFailed
from .fleet_front import log_fleet
from .fleet_launch import Launch, client_sites_of, make_launch, plan_of, sandbox_stacks
from .processes import CHILD_TIMEOUT_S, deferred_signals, http_ok, signal_group as _signal_pgid
from .statedir import (
    FLEET_KEY_FILE,
    FLEET_LAUNCH_FILE,
    FLEET_LOCK_FILE,
    FLEET_OUT_FILE,
    FRONT_FAILED_FILE,
    FRONT_READY_FILE,
    FRONT_RUN_FILE,
    LOGS_DIR,
    ROOT,
    is_running,
    log_path,
    read_object,
    try_lock,
    write_json,
)

KEY_NAME = "sandbox-fleet"


# --- the front runner's lock ---------------------------------------------------------------------

def front_running(state_dir: Path) -> bool:
    """True while up or the front runner holds the fleet's lock."""
    return is_running(state_dir, FLEET_LOCK_FILE)


def is_fleet_dir(state_dir: Path) -> bool:
    return (Path(state_dir) / FLEET_LAUNCH_FILE).exists()


def fleet_name(state_dir: Path) -> str | None:
    return (read_object(Path(state_dir) / FLEET_LAUNCH_FILE) or {}).get("fleet")


def what_runs(state_dir: Path) -> list[str]:
    """The parts of the fleet in ``state_dir`` that still run (a lock held), by name."""
    launch = read_object(Path(state_dir) / FLEET_LAUNCH_FILE) or {}
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
        record = read_object(state_dir / FLEET_LAUNCH_FILE) or {}
        raise AlreadyRunning(f"the fleet {fleet_stack} already runs in {state_dir} ({', '.join(what_runs(state_dir))}); "
                             f"run `{supervisor.SANDBOX_CMD} down --fleet {fleet_stack} --state-dir {state_dir}` first",
                             same={k: record.get(k) for k in launch.as_json()} == launch.as_json())
    for m, cell_dir in cells:
        if cell_dir == state_dir:
            raise ConfigError("--state-dir", str(state_dir), f"is member {m.name}'s state directory",
                              "give the fleet a directory of its own")
        if supervisor.is_running(cell_dir):
            raise AlreadyRunning(f"cell {m.name} of fleet {fleet_stack} already runs in {cell_dir}; stop it first with "
                                 f"`{supervisor.SANDBOX_CMD} down --state-dir {cell_dir}`; nothing was started")
        supervisor.check_owner(cell_dir, fleet_mod.short_name(m.stack))
    (state_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    fd = try_lock(state_dir, FLEET_LOCK_FILE)
    if fd is None:
        raise AlreadyRunning(f"the fleet {fleet_stack} already runs in {state_dir}; run "
                             f"`{supervisor.SANDBOX_CMD} down --fleet {fleet_stack}` first")
    try:
        for stale in (FRONT_READY_FILE, FRONT_FAILED_FILE, FRONT_RUN_FILE, FLEET_OUT_FILE):
            (state_dir / stale).unlink(missing_ok=True)
        record = {**launch.as_json(), "cells": [{"name": m.name, "stack": m.stack, "state_dir": str(d)} for m, d in cells]}
        write_json(state_dir / FLEET_LAUNCH_FILE, record)  # before any cell starts: down finds them all
        cell_stacks = sandbox_stacks(launch, plan, state_dir)
        ready_cells = []
        for m, cell_dir in cells:
            log_fleet(f"cell {m.name} ({m.region.name}): starting in {cell_dir}")
            ready_cells.append(supervisor.up(fleet_mod.short_name(m.stack), state_dir=cell_dir, stacks_dir=cell_stacks,
                                             stretch=stretch, rtt=tuple(rtt), timeout_s=timeout_s))
        log_fleet(f"front door: starting in {state_dir}")
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
        write_json(state_dir / FLEET_OUT_FILE, out, 0o600)
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
    with open(log_path(state_dir, "front-runner"), "ab") as log:
        started = subprocess.run(detach.command("colocate.sandbox.fleet_front", state_dir, fd), cwd=ROOT, env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, pass_fds=(fd,),
                                 start_new_session=True, timeout=30, check=True)
    return int(started.stdout.strip())


def _wait_front(state_dir: Path, runner: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = read_object(state_dir / FRONT_READY_FILE)
        if ready:
            return ready
        failed = read_object(state_dir / FRONT_FAILED_FILE)
        if failed or not alive(runner):
            why = (failed or {}).get("error") or "the front runner exited"
            raise StartupFailed(f"the front door did not come up: {why}. Logs: {state_dir / LOGS_DIR}")
        time.sleep(0.1)
    raise StartupFailed(f"the front door did not come up within {timeout_s:.0f} s. Logs: {state_dir / LOGS_DIR}")


def fleet_key(state_dir: Path, cells: dict[str, dict]) -> dict:
    """One client key for the whole fleet, made here and imported into every cell as
    ``keys.py create --stack <fleet>`` does (``colocate.admin``: only its digest leaves this
    process). Reused while every cell holds it unrevoked (the import is idempotent)."""
    targets = {name: admin.Target(c["worker_url"], c["token"], "sandbox") for name, c in cells.items()}
    path = Path(state_dir) / FLEET_KEY_FILE
    stored = read_object(path) or {}
    if stored.get("key") and stored.get("row"):
        held, failed = admin.fan_out(targets, lambda c: c.import_key(stored["row"], fleet_cells=len(cells)))
        if not failed and not any(r.get("revoked_at") or r.get("revoked") for r in held.values()):
            return {"key": stored["key"], "id": stored["row"]["id"]}
    key = admin.new_key()
    row = admin.key_row(key, KEY_NAME)
    _, failed = admin.fan_out(targets, lambda c: c.import_key(row, fleet_cells=len(cells)))
    if failed:
        cell, why = next(iter(failed.items()))
        raise StartupFailed(f"the fleet's client key could not be imported into cell {cell}: {why}")
    write_json(path, {"key": key, "row": row}, 0o600)
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

def signal_group(pgid: int | None, sig: int) -> bool:
    """``processes.signal_group``, False for no group yet (0 would signal our own group)."""
    return bool(pgid) and _signal_pgid(pgid, sig)


def stop_front(state_dir: Path, timeout_s: float = supervisor.STOP_TIMEOUT_S + CHILD_TIMEOUT_S) -> bool:
    """Stop the front runner, even one that has not said who it is yet: while the lock is held
    (by up, the launcher or the runner), wait for the runner's own front-run.json and stop it.
    True once the lock is free."""
    state_dir = Path(state_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        run = read_object(state_dir / FRONT_RUN_FILE) or {}
        pid, pgid = run.get("pid"), run.get("pgid")
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
            stop_by = time.monotonic() + supervisor.STOP_TIMEOUT_S
            while alive(pid) and time.monotonic() < stop_by:
                time.sleep(0.05)
        if signal_group(pgid, 0):
            signal_group(pgid, signal.SIGKILL)  # what the runner could not stop (workerd is in its group)
            kill_by = time.monotonic() + 5
            while signal_group(pgid, 0) and time.monotonic() < kill_by:
                time.sleep(0.05)
        if not front_running(state_dir):
            return True
        if time.monotonic() > deadline:
            log_fleet(f"WARNING: the fleet's lock in {state_dir} is still held and no front runner said who it is; "
                 f"see {log_path(state_dir, 'front-runner')}")
            return False
        time.sleep(0.05)


def down(state_dir: Path) -> dict:
    """Stop the front door, then every member cell; idempotent."""
    state_dir = Path(state_dir).resolve()
    with deferred_signals():
        launch = read_object(state_dir / FLEET_LAUNCH_FILE) or {}
        held = front_running(state_dir)
        # The entry first: no new request reaches a cell that is stopping.
        front_stopped = stop_front(state_dir) if held or read_object(state_dir / FRONT_RUN_FILE) else True
        members = launch.get("cells", [])
        # Side by side (each cell's down waits on its own runner, ~4 s here): down touches only
        # its own state directory, and the signals stay deferred in this, the main, thread.
        with ThreadPoolExecutor(max_workers=max(1, len(members))) as ex:
            downs = list(ex.map(lambda c: supervisor.down(Path(c["state_dir"]), quiet=True), members))
        cells = [{"name": c["name"], **d} for c, d in zip(members, downs, strict=True)]
        for name in (FRONT_RUN_FILE, FRONT_READY_FILE, FLEET_OUT_FILE):
            (state_dir / name).unlink(missing_ok=True)
    return {"fleet": launch.get("fleet"), "state_dir": str(state_dir), "front_stopped": front_stopped,
            "was_running": bool(held or any(c["was_running"] for c in cells)), "cells": cells,
            "running": front_running(state_dir) or any(c["running"] for c in cells)}



def status(state_dir: Path) -> dict:
    """Every member cell's status, then the front door's: its processes, and one routed request
    (``GET /v1/models`` with the fleet's key) through each entry. ``problems`` names what is wrong."""
    state_dir = Path(state_dir).resolve()
    launch = read_object(state_dir / FLEET_LAUNCH_FILE) or {}
    out: dict = {"fleet": launch.get("fleet"), "state_dir": str(state_dir), "running": front_running(state_dir)}
    cells, problems = [], []
    for c in launch.get("cells", []):
        st = supervisor.status(Path(c["state_dir"]))
        cells.append({"name": c["name"], **st})
        if not st.get("healthy"):
            problems.append(f"cell {c['name']} is {'unhealthy' if st.get('running') else 'not running'} "
                            f"(`{supervisor.SANDBOX_CMD} status --state-dir {c['state_dir']}`)")
    out["cells"] = cells
    ready = read_object(state_dir / FRONT_READY_FILE)
    fleet_out = read_object(state_dir / FLEET_OUT_FILE) or {}
    entries = {}
    if ready:
        for name, pid in ready.get("pids", {}).items():
            if not alive(pid):
                problems.append(f"front door {name} (pid {pid}) is not running")
        for colo, url in ready.get("entries", {}).items():
            code = http_ok(url + "/v1/models", {"authorization": f"Bearer {fleet_out.get('key', '')}"}, timeout=10)[1]
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
    record = read_object(state_dir / FLEET_LAUNCH_FILE)
    run = read_object(state_dir / FRONT_RUN_FILE) or {}
    previous = read_object(state_dir / FRONT_READY_FILE)
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
    write_json(state_dir / FLEET_LAUNCH_FILE, {**record, **launch.as_json()})
    (state_dir / FRONT_FAILED_FILE).unlink(missing_ok=True)
    os.kill(run["pid"], signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = read_object(state_dir / FRONT_READY_FILE) or {}
        if ready.get("revision", 0) > previous.get("revision", 0):
            return {"fleet": launch.fleet, "state_dir": str(state_dir), "front": ready,
                    "cells": [{k: c.get(k) for k in ("name", "stack", "region", "worker_url", "revision")} for c in cells]}
        failed = read_object(state_dir / FRONT_FAILED_FILE)
        if failed:
            raise StartupFailed(f"the front door's apply failed: {failed.get('error')}; the previous version still "
                                f"serves. Logs: {state_dir / LOGS_DIR}")
        time.sleep(0.1)
    raise StartupFailed(f"the front door's apply did not finish within {timeout_s:.0f} s. Logs: {state_dir / LOGS_DIR}")


def apply_cell(state_dir: Path, cell: str, timeout_s: float = supervisor.UP_TIMEOUT_S) -> dict:
    """One member's ``apply`` (its ``pulumi up -s <cell>``), from its stack file as the fleet
    runs it; the front door and the other cells are untouched."""
    state_dir = Path(state_dir).resolve()
    record = read_object(state_dir / FLEET_LAUNCH_FILE)
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


def start_afresh(fleet_dir: Path, state_dir: Path, stacks_dir: Path, fleet_stack: str, cells: tuple[str, ...]) -> None:
    """A demo's clean start: stop a previous run's fleet and cells (a run killed before it wrote
    its fleet record leaves only cells), then copies of the committed stacks in ``stacks_dir``."""
    import shutil

    if is_fleet_dir(fleet_dir):
        down(fleet_dir)
    for cell in cells:
        if (state_dir / cell).exists():
            supervisor.down(state_dir / cell, quiet=True)
    if state_dir.exists():
        shutil.rmtree(state_dir)
    stacks_dir.mkdir(parents=True)
    for stack in (fleet_stack, *cells):
        shutil.copyfile(stackfile.path_of(stack), stackfile.path_of(stack, stacks_dir))
