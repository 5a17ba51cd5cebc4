"""The state directory of one sandbox: the name of every file in it, its lock, its secrets,
and which stack owns it. No other module spells one of these names; tests/test_statedir_names.py
greps colocate/ and scripts/ for them.

A cell's state directory (default ``<repo>/.colocate/sandbox/<stack>/``):

    secrets.json       generated once, mode 0600 (pod, read, admin, exchange, fallback tokens)
    pins.json          where each generation was first touched; survives down/up
    objects/<SITE>     each object host's SQLite storage; survives down/up
    sandbox.lock       flock taken by ``up`` and inherited by the runner for its whole life
                       (a second ``up`` sees it; "held" = a runner or its launcher lives)
    run.json           runner pid/pgid, written by the runner itself before it starts anything
    launch.json        what ``up`` (or ``apply``) asked for
    ready.json         what ``up`` prints (mode 0600: it holds the probe token and the demo key)
    failed.json        why the runner could not start (``up`` reads it and stops waiting)
    apply-failed.json  why the last ``apply`` could not be rolled out (the cell runs as before)
    purged.json        the retired generations whose storage the runner purged
    demo-key.json      the demo client key (mode 0600), reused by later ``up``s while the cell accepts it
    workerd.capnp      the generated config (mode 0600: it holds secret bindings)
    pods.json          what each pod's create printed, in pod index order (``pod.json``: the
                       one-pod layout of an older release, read once and removed)
    edge-holds.json    when the edge held requests while a deploy swapped workerd (demo-spot reads it)
    pods/              scripts/pod.py's local pod state, one record per pod
    logs/              runner.log, workerd.log, fallback.log, pod.log, front-runner.log
    stacks/, probes/   the demos' stack copies and probe results (demo.png, demo-fleet.png)
    day.json           demo-spot: in each day's directory, that day as it happened (its requests, pods, holds)

A fleet's state directory adds the front door's files: fleet-launch.json, fleet.lock,
fleet.json (what ``up --fleet`` prints), fleet-key.json, front-run.json, front.json,
front-failed.json, front.capnp and entry-pins.json.

A state directory outside ``.colocate/sandbox/`` is remembered by a link in
``.colocate/sandbox/.started/`` (``remember``), so ``status`` and every hint find it.

Imports nothing of the rest of the kit but the sandbox's errors: ``colocate.admin`` and the probe
find a sandbox's files through it, and the runner imports admin (for the demo key).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets as secrets_mod
import sys
import tempfile
from pathlib import Path

from ..cli import script
from .errors import OtherStack

ROOT = Path(__file__).resolve().parents[2]
# fallbackUrl is the fallback's URL, known at start
SANDBOX_SECRETS = ("podToken", "readToken", "adminToken", "exchangeToken", "fallbackApiKey")
SANDBOX_CMD = script("sandbox.py")  # every command we print runs as printed, from any directory
SANDBOXES_DIR = ROOT / ".colocate" / "sandbox"


# --- the names of the files (a cell's, then a fleet's) ----------------------------------------

SECRETS_FILE = "secrets.json"
PINS_FILE = "pins.json"
OBJECTS_DIR = "objects"
LOCK_FILE = "sandbox.lock"
RUN_FILE = "run.json"
LAUNCH_FILE = "launch.json"
READY_FILE = "ready.json"
FAILED_FILE = "failed.json"
APPLY_FAILED_FILE = "apply-failed.json"
PURGED_FILE = "purged.json"
DEMO_KEY_FILE = "demo-key.json"
WORKERD_CONFIG_FILE = "workerd.capnp"
PODS_FILE = "pods.json"
EDGE_HOLDS_FILE = "edge-holds.json"  # when the edge held requests while a deploy swapped workerd (proxies.Network.holds)
LEGACY_POD_FILE = "pod.json"
LOCAL_PODS_DIR = "pods"
LOGS_DIR = "logs"
STACKS_DIR = "stacks"
PROBES_DIR = "probes"
DEMO_PLOT_FILE = "demo.png"
FLEET_DEMO_PLOT_FILE = "demo-fleet.png"
DAY_RECORD_FILE = "day.json"  # demo-spot: each day as it happened (spot_demo.day_record), in the day's directory

FLEET_LAUNCH_FILE = "fleet-launch.json"
FLEET_LOCK_FILE = "fleet.lock"
FLEET_OUT_FILE = "fleet.json"
FLEET_KEY_FILE = "fleet-key.json"
FRONT_RUN_FILE = "front-run.json"
FRONT_READY_FILE = "front.json"
FRONT_FAILED_FILE = "front-failed.json"
FRONT_CONFIG_FILE = "front.capnp"
ENTRY_PINS_FILE = "entry-pins.json"


def log_path(state_dir: Path, component: str) -> Path:
    """The log of one component (runner, workerd, fallback, pod, front-runner) in ``logs/``."""
    return Path(state_dir) / LOGS_DIR / f"{component}.log"


def local_pod_records(state_dir: Path) -> list[Path]:
    """scripts/pod.py's records of the local pods (``pods/<name>.json``, not the provider's
    ``<name>.port.json`` beside them), by name."""
    pods = Path(state_dir) / LOCAL_PODS_DIR
    return [p for p in sorted(pods.glob("*.json")) if not p.name.endswith(".port.json")] if pods.is_dir() else []


def local_pod_record(state_dir: Path, name: str) -> Path:
    """scripts/pod.py's record of the local pod ``name``."""
    return Path(state_dir) / LOCAL_PODS_DIR / f"{name}.json"


def default_state_dir(stack: str) -> Path:
    return SANDBOXES_DIR / stack


STARTED_DIR = ".started"  # under SANDBOXES_DIR: a link to each state directory elsewhere that `up` was given


def _started_links() -> Path:
    return Path(SANDBOXES_DIR) / STARTED_DIR


def remember(state_dir: Path) -> None:
    """Keep a link to a state directory outside SANDBOXES_DIR, so that listings and hints
    find a sandbox started with ``--state-dir`` too (one link per directory, replaced atomically)."""
    state_dir = Path(state_dir).resolve()
    if state_dir.parent == Path(SANDBOXES_DIR).resolve():
        return
    links = _started_links()
    links.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]
    tmp = links / f".{name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(state_dir)
    os.replace(tmp, links / name)


def _remembered() -> list[Path]:
    links = _started_links()
    if not links.is_dir():
        return []
    found = []
    for link in sorted(links.iterdir()):
        target = Path(os.readlink(link)) if link.is_symlink() else None
        if target is None or not target.is_dir():
            link.unlink(missing_ok=True)  # its directory was deleted: forget it
            continue
        found.append(target)
    return found


def running_sandboxes(parent: Path | None = None) -> list[Path]:
    """The state directories where a sandbox runs: under ``parent``, or by default under
    SANDBOXES_DIR and every directory elsewhere that ``up`` was given (``remember``)."""
    dirs = []
    base = Path(parent or SANDBOXES_DIR)
    if base.is_dir():
        dirs = [d for d in sorted(base.iterdir()) if d.is_dir() and d.name != STARTED_DIR]
    if parent is None:
        dirs += _remembered()
    seen, out = set(), []
    for d in dirs:
        if d.resolve() not in seen and is_running(d):
            seen.add(d.resolve())
            out.append(d)
    return out


def where_command(state_dir: Path, stack: str | None = None) -> str:
    """The flags that name this sandbox in a printed command: its stack (the one that ran there
    last, else ``stack``, else ``sandbox``) and the directory when it is not that stack's default."""
    stack = owner(state_dir) or stack or "sandbox"
    if Path(state_dir).resolve() == default_state_dir(stack).resolve():
        return f"--stack {stack}"
    return f"--stack {stack} --state-dir {state_dir}"


def where_sandboxes_run(exclude: Path | None = None, verb: str = "status") -> str:
    """One sentence for a command that found no sandbox where it looked: where sandboxes do run,
    each with the command (``verb``: the one the user ran, e.g. ``down``) that names it."""
    runs = [d for d in running_sandboxes() if exclude is None or d.resolve() != Path(exclude).resolve()]
    if not runs:
        return "no sandbox runs under .colocate/sandbox/ or in a --state-dir `up` was given"
    return "sandboxes that run: " + ", ".join(f"{d} (`{SANDBOX_CMD} {verb} {where_command(d)}`)" for d in runs)


def log_line(msg: str, who: str = "sandbox") -> None:
    print(f"[{who}] {msg}", file=sys.stderr, flush=True)


def write_json(path: Path, data: dict, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_object(path: Path) -> dict | None:
    """``read_json``, where a file holding anything but a JSON object counts as missing too."""
    data = read_json(Path(path))
    return data if isinstance(data, dict) else None


def load_secrets(state_dir: Path) -> dict[str, str]:
    """The sandbox's secrets, generated once per state directory (mode 0600)."""
    path = Path(state_dir) / SECRETS_FILE
    data = read_json(path) if path.exists() else None
    if not data or any(not isinstance(data.get(k), str) or not data.get(k) for k in SANDBOX_SECRETS):
        data = {k: secrets_mod.token_hex(24) for k in SANDBOX_SECRETS}
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        write_json(path, data, 0o600)
    return data


# --- the lock ----------------------------------------------------------------------------


def _lock_path(state_dir: Path, name: str = LOCK_FILE) -> Path:
    return Path(state_dir) / name


def try_lock(state_dir: Path, name: str = LOCK_FILE) -> int | None:
    """An fd holding the state directory's lock (``name``: the fleet's is another file), or
    None when a sandbox runs there."""
    fd = os.open(_lock_path(state_dir, name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def is_running(state_dir: Path, name: str = LOCK_FILE) -> bool:
    """True while the lock ``name`` in ``state_dir`` is held."""
    if not _lock_path(state_dir, name).exists():
        return False
    fd = try_lock(state_dir, name)
    if fd is None:
        return True
    os.close(fd)
    return False


def recorded_pids(state_dir: Path) -> dict:
    ready = read_json(Path(state_dir) / READY_FILE) or {}
    run = read_json(Path(state_dir) / RUN_FILE) or {}
    return ready.get("pids") or {"runner": run.get("pid")}


def owner(state_dir: Path) -> str | None:
    """The stack whose sandbox the state directory holds (from the last ``up``), or None."""
    return (read_json(Path(state_dir) / LAUNCH_FILE) or {}).get("stack")


def check_owner(state_dir: Path, stack: str) -> None:
    """Refuse to run ``stack`` where another stack's sandbox keeps its pins, objects and pods."""
    other = owner(state_dir)
    if other is not None and other != stack:
        raise OtherStack(f"{state_dir} is the state directory of stack {other!r}, not {stack!r}: its pins, objects "
                         f"and secrets belong to {other}. Fix: `{SANDBOX_CMD} up --stack {other} --state-dir {state_dir}` "
                         f"for that sandbox, or `--stack {stack}` with its own state directory (default "
                         f"{default_state_dir(stack)}); nothing was started")
