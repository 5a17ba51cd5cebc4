"""Processes, state directory, lock and cleanup of one sandbox.

``up`` validates the stack and builds the plan in the calling process (a bad stack fails
before anything starts), then starts a detached **runner** (``python -m
colocate.sandbox.supervisor run STATE_DIR``) in its own session and process group. The
runner owns every part of the cell until ``down``:

    pod        scripts/pod.py create --spec -  (provider local: a detached stand-in)
    fallback   a stand-in "external API" (child process)
    network    front proxy + outbound proxy + pin control (threads of the runner)
    workerd    the product Worker behind the sandbox entry (child process)

State directory (default ``<repo>/.colocate/sandbox/<stack>/``):

    secrets.json   generated once, mode 0600 (pod, probe, fallback tokens)
    pins.json      where each generation was first touched; survives down/up
    objects/<SITE> each object host's SQLite storage; survives down/up
    sandbox.lock   flock taken by ``up`` and inherited by the runner for its whole life
                   (a second ``up`` sees it; "held" = a runner or its launcher lives)
    run.json       runner pid/pgid, written by the runner itself before it starts anything
    launch.json    what ``up`` asked for
    ready.json     what ``up`` prints (mode 0600: it holds the probe token and the demo key)
    demo-key.json  the demo client key (mode 0600), reused by later ``up``s while the cell accepts it
    workerd.capnp  the generated config (mode 0600: it holds secret bindings)
    pods/          scripts/pod.py's local pod state;  pod.json  the create's output
    logs/          runner.log, workerd.log, fallback.log, pod.log

``down`` sends SIGTERM to the runner, which stops its children, deletes the pod through
``scripts/pod.py delete`` and releases the lock; what lingers is killed by process group, and
every local pod recorded under ``pods/`` is deleted too.

Ctrl-C during ``up``: the launcher may have started a runner that ``up`` never heard of, so the
cleanup does not trust what it knows; it waits while the lock is held, stops the runner named by
the runner's own run.json, and returns only when the lock is free (``stop_runner``). Cleanups
run with SIGINT/SIGTERM deferred (``deferred_signals``), so a second Ctrl-C cannot cut them short.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets as secrets_mod
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .. import settings as settings_mod
from .. import stackfile
from ..plan import POD_URLS_FROM_OUTPUT, CellPlan, plan_cell, pod_urls_text
from ..pods.local import alive
from . import config as config_mod
from .errors import AlreadyRunning, NotRunning, OtherStack, StartupFailed
from .geography import FALLBACK_SITE, Geography, Sites, landing_site, site, worker_site
from .pinning import FILE_NAME as PINS_FILE, Pins
from .proxies import Network, NetworkServers, local_url

ROOT = Path(__file__).resolve().parents[2]
WORKERD = ROOT / "node_modules" / ".bin" / "workerd"
POD_SCRIPT = ROOT / "scripts" / "pod.py"
SANDBOX_SECRETS = ("podToken", "probeToken", "fallbackApiKey")  # fallbackUrl is the fallback's URL, known at start
PLACEHOLDER_ACCOUNT = "0" * 32  # the sandbox never calls Cloudflare
FALLBACK_COMPUTE_MS = 95
FALLBACK_MODEL = "sandbox/fallback"
UP_TIMEOUT_S = 90.0
SANDBOX_CMD = ".venv/bin/python scripts/sandbox.py"  # every command we print runs as printed from the root
STOP_TIMEOUT_S = 20.0
CHILD_TIMEOUT_S = 30.0
POD_TIMEOUT_S = 60.0


SANDBOXES_DIR = ROOT / ".colocate" / "sandbox"


def default_state_dir(stack: str) -> Path:
    return SANDBOXES_DIR / stack


def running_sandboxes(parent: Path | None = None) -> list[Path]:
    """The state directories under ``parent`` (default: where ``up`` puts them) where a sandbox runs."""
    parent = Path(parent or SANDBOXES_DIR)
    if not parent.is_dir():
        return []
    return [d for d in sorted(Path(parent).iterdir()) if d.is_dir() and is_running(d)]


def _log(msg: str) -> None:
    print(f"[sandbox] {msg}", file=sys.stderr, flush=True)


def _write_json(path: Path, data: dict, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# --- secrets and plan --------------------------------------------------------------------

def load_secrets(state_dir: Path) -> dict[str, str]:
    """The sandbox's secrets, generated once per state directory (mode 0600)."""
    path = Path(state_dir) / "secrets.json"
    data = _read_json(path) if path.exists() else None
    if not data or any(not isinstance(data.get(k), str) or not data.get(k) for k in SANDBOX_SECRETS):
        data = {k: secrets_mod.token_hex(24) for k in SANDBOX_SECRETS}
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        _write_json(path, data, 0o600)
    return data


@dataclass(frozen=True)
class Launch:
    """What ``up`` was asked for; the runner re-derives the same plan from it."""

    stack: str
    stacks_dir: str
    client_site: str | None
    stretch: float | None
    rtt: tuple[str, ...]
    force_split: bool

    def as_json(self) -> dict:
        return {"stack": self.stack, "stacks_dir": self.stacks_dir, "client_site": self.client_site,
                "stretch": self.stretch, "rtt": list(self.rtt), "force_split": self.force_split}

    @classmethod
    def from_json(cls, d: dict) -> Launch:
        return cls(d["stack"], d["stacks_dir"], d.get("client_site"), d.get("stretch"), tuple(d.get("rtt", ())),
                   bool(d.get("force_split")))


SPLIT_WARNING = (
    "WARNING: --force-split: the plan's refusal to split state from compute is OVERRIDDEN. "
    "This reproduces a hand-rolled move for the demo; the Pulumi program never allows it."
)


def build_plan(launch: Launch) -> tuple[CellPlan, list[str]]:
    """Read and validate the stack, build the cell plan. Returns (plan, notes for stderr)."""
    raw, secret_names = stackfile.read_config(launch.stack, Path(launch.stacks_dir))
    notes = []
    raw.setdefault("accountId", PLACEHOLDER_ACCOUNT)
    pod = dict(raw.get("pod") or {})
    if pod.get("provider", settings_mod.POD_DEFAULTS["provider"]) != "local":
        notes.append(f"colocate:pod.provider is {pod.get('provider', settings_mod.POD_DEFAULTS['provider'])!r}: "
                     "the sandbox never rents a GPU, it runs the local stand-in pod instead")
        pod["provider"] = "local"
        raw["pod"] = pod
    names = frozenset(secret_names) | frozenset(settings_mod.ALWAYS_SECRET)
    s = settings_mod.parse(raw, launch.stack, secrets=names, env={}, allow_split_state=launch.force_split)
    if launch.force_split:
        notes.append(SPLIT_WARNING)
    return plan_cell(s), notes


def sites_for(plan: CellPlan, launch: Launch, pod_location: str) -> Sites:
    reg = plan.region
    client = site(launch.client_site, "--client-site") if launch.client_site else reg.edge_site
    pod = reg.site_of(pod_location)  # the stand-in ("local") stands at the region's own pod site
    edge = worker_site(plan.worker.placement_mode, hint_site=reg.edge_site, client=client, pod=pod)
    return Sites(client=client, edge=edge, pod=pod, fallback=FALLBACK_SITE)


def object_sites(plan: CellPlan, edge: str, pins: Pins) -> list[str]:
    """Every site an object of this cell may live at: the edge, where each of the ledger's
    generations would land, and where objects already are."""
    wanted = {edge, *pins.all().values()}
    state = plan.state
    for hint in (state.hint, state.draining_hint):
        wanted.add(landing_site(edge, hint or ""))
    return sorted(wanted)


# --- the lock ----------------------------------------------------------------------------

def _lock_path(state_dir: Path) -> Path:
    return Path(state_dir) / "sandbox.lock"


def try_lock(state_dir: Path) -> int | None:
    """An fd holding the state directory's lock, or None when a sandbox runs there."""
    fd = os.open(_lock_path(state_dir), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def is_running(state_dir: Path) -> bool:
    if not _lock_path(state_dir).exists():
        return False
    fd = try_lock(state_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


def _pids(state_dir: Path) -> dict:
    ready = _read_json(Path(state_dir) / "ready.json") or {}
    run = _read_json(Path(state_dir) / "run.json") or {}
    return ready.get("pids") or {"runner": run.get("pid")}


# --- up / down / status --------------------------------------------------------------------

def up(stack: str, *, state_dir: Path | None = None, stacks_dir: Path = stackfile.STACKS_DIR,
       client_site: str | None = None, stretch: float | None = None, rtt: tuple[str, ...] = (),
       force_split: bool = False, timeout_s: float = UP_TIMEOUT_S) -> dict:
    """Start the sandboxed cell; return what ``sandbox.py up`` prints."""
    state_dir = Path(state_dir or default_state_dir(stack)).resolve()
    launch = Launch(stack, str(Path(stacks_dir).resolve()), client_site, stretch, tuple(rtt), force_split)
    Geography.from_args(stretch, rtt)  # a bad --stretch/--rtt fails here, before anything starts
    if client_site:
        site(client_site, "--client-site")
    _, notes = build_plan(launch)  # a bad stack fails here too
    check_owner(state_dir, stack)
    for note in notes:
        _log(note)
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    fd = try_lock(state_dir)
    if fd is None:
        pids = ", ".join(f"{k} {v}" for k, v in _pids(state_dir).items() if v)
        raise AlreadyRunning(f"a sandbox is already running in {state_dir} (pids {pids or 'unknown'}); "
                             f"run `{SANDBOX_CMD} down --state-dir {state_dir}` first")
    launched = False
    try:
        load_secrets(state_dir)
        # We hold the lock, so no runner lives here: whatever run.json says is stale. From now
        # on run.json is written only by the runner itself, before it starts anything.
        for stale in ("ready.json", "failed.json", "run.json"):
            (state_dir / stale).unlink(missing_ok=True)
        _write_json(state_dir / "launch.json", launch.as_json())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # A short-lived launcher starts the runner in a new session and exits at once, so
        # the runner is nobody's child: it outlives `up` and is never left a zombie. The
        # runner inherits the lock, so "the lock is held" = "a runner (or its launcher) lives".
        launched = True
        with open(state_dir / "logs" / "runner.log", "ab") as log:
            started = subprocess.run(
                [sys.executable, "-m", "colocate.sandbox.supervisor", "launch", str(state_dir), "--lock-fd", str(fd)],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                pass_fds=(fd,), start_new_session=True, timeout=30, check=True,
            )
        runner = int(started.stdout.strip())
        os.close(fd)  # the runner holds the lock from now on
        fd = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = _read_json(state_dir / "ready.json")
            if ready:
                return ready
            failed = _read_json(state_dir / "failed.json")
            if failed or not alive(runner):
                why = (failed or {}).get("error") or "the runner exited"
                raise StartupFailed(f"sandbox did not come up: {why}. Logs: {state_dir / 'logs'}")
            time.sleep(0.1)
        raise StartupFailed(f"sandbox did not come up within {timeout_s:.0f} s. Logs: {state_dir / 'logs'}")
    except BaseException:
        # Ctrl-C or a failure while starting: nothing may be left behind, and a second
        # Ctrl-C must not cut the cleanup short (it is deferred until the cleanup is done).
        with deferred_signals():
            if fd is not None:
                os.close(fd)
            if launched:
                stop_runner(state_dir)
            down(state_dir, quiet=True)
        raise


def owner(state_dir: Path) -> str | None:
    """The stack whose sandbox the state directory holds (from the last ``up``), or None."""
    return (_read_json(Path(state_dir) / "launch.json") or {}).get("stack")


def check_owner(state_dir: Path, stack: str) -> None:
    """Refuse to run ``stack`` where another stack's sandbox keeps its pins, objects and pods."""
    other = owner(state_dir)
    if other is not None and other != stack:
        raise OtherStack(f"{state_dir} is the state directory of stack {other!r}, not {stack!r}: its pins, objects "
                         f"and secrets belong to {other}. Fix: `{SANDBOX_CMD} up --stack {other} --state-dir {state_dir}` "
                         f"for that sandbox, or `--stack {stack}` with its own state directory (default "
                         f"{default_state_dir(stack)}); nothing was started")


def stop_runner(state_dir: Path, timeout_s: float = STOP_TIMEOUT_S + CHILD_TIMEOUT_S) -> bool:
    """Stop the runner ``up`` launched, even one that has not said who it is yet: while the
    lock is held (by the launcher or the runner), wait for the runner's own run.json and stop
    it. True once the lock is free, i.e. no runner lives."""
    state_dir = Path(state_dir)
    deadline = time.monotonic() + timeout_s
    while is_running(state_dir):
        run = _read_json(state_dir / "run.json") or {}
        if alive(run.get("pid")):
            down(state_dir, quiet=True)
            continue
        if time.monotonic() > deadline:
            _log(f"WARNING: the state directory's lock is still held and no runner said who it is; "
                 f"see {state_dir / 'logs' / 'runner.log'}")
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT and SIGTERM until the block ends, then raise KeyboardInterrupt if one came.
    A cleanup interrupted half-way would leave processes running; only the main thread can
    set handlers, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: got.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        raise KeyboardInterrupt


def apply(stack: str, *, state_dir: Path | None = None, stacks_dir: Path | None = None,
          force_split: bool = False, timeout_s: float = UP_TIMEOUT_S) -> dict:
    """Deploy the stack file's current state to a running sandbox (its `pulumi up`)."""
    state_dir = Path(state_dir or default_state_dir(stack)).resolve()
    previous = _read_json(state_dir / "ready.json")
    run = _read_json(state_dir / "run.json") or {}
    if not previous or not is_running(state_dir) or not alive(run.get("pid")):
        raise NotRunning(f"no sandbox runs in {state_dir}; start one with `{SANDBOX_CMD} up --stack {stack}`")
    check_owner(state_dir, stack)
    old = Launch.from_json(_read_json(state_dir / "launch.json") or {})
    launch = Launch(stack, str(Path(stacks_dir or old.stacks_dir).resolve()), old.client_site, old.stretch, old.rtt,
                    force_split)
    _, notes = build_plan(launch)  # a bad stack fails here, and the running cell is untouched
    for note in notes:
        _log(note)
    _write_json(state_dir / "launch.json", launch.as_json())
    (state_dir / "apply-failed.json").unlink(missing_ok=True)
    os.kill(run["pid"], signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = _read_json(state_dir / "ready.json") or {}
        if ready.get("revision", 0) > previous.get("revision", 0):
            return ready
        failed = _read_json(state_dir / "apply-failed.json")
        if failed:
            raise StartupFailed(f"apply failed: {failed.get('error')}; the previous version still serves. "
                                f"Logs: {state_dir / 'logs'}")
        if not alive(run["pid"]):
            raise StartupFailed(f"the sandbox stopped during apply. Logs: {state_dir / 'logs'}")
        time.sleep(0.1)
    raise StartupFailed(f"apply did not finish within {timeout_s:.0f} s. Logs: {state_dir / 'logs'}")


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_alive(pgid: int) -> bool:
    return _signal_group(pgid, 0)


def down(state_dir: Path, quiet: bool = False) -> dict:
    """Stop everything the sandbox started in ``state_dir``; idempotent. ``was_running`` says
    whether there was anything to stop (a runner, a pod, a lock held)."""
    state_dir = Path(state_dir).resolve()
    with deferred_signals():  # a Ctrl-C during down must not leave half of the cell running
        held = is_running(state_dir)
        run = _read_json(state_dir / "run.json") or {}
        pid, pgid = run.get("pid"), run.get("pgid")
        stopped = []
        if pid and alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            stopped.append(pid)
        if pgid and _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)  # whatever the runner could not stop
            deadline = time.monotonic() + 5
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        pod_deleted = _delete_pod(state_dir)  # the runner normally did this; a crash may not have
        strays = _delete_local_pods(state_dir)  # a runner killed inside `pod.py create` leaves only these
        for name in ("run.json", "ready.json"):
            (state_dir / name).unlink(missing_ok=True)
    if not quiet:
        _log(f"stopped {state_dir}")
    return {"state_dir": str(state_dir), "stopped": stopped, "pod_deleted": pod_deleted or bool(strays),
            "was_running": bool(held or stopped or pod_deleted or strays), "running": is_running(state_dir)}


def _delete_local_pods(state_dir: Path) -> list[str]:
    """Delete every local pod recorded in the sandbox's own pod state (``pods/``)."""
    deleted = []
    for record in sorted((Path(state_dir) / "pods").glob("*.json")) if (Path(state_dir) / "pods").is_dir() else []:
        if record.name.endswith(".port.json"):
            continue
        pod_id = (_read_json(record) or {}).get("id")
        if pod_id and _delete_pod(state_dir, {"id": pod_id}):
            deleted.append(pod_id)
    return deleted


def _http_ok(url: str, headers: dict | None = None, timeout: float = 2.0) -> tuple[bool, int | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return 200 <= r.status < 300, r.status
    except urllib.error.HTTPError as exc:
        return False, exc.code
    except (OSError, ValueError):
        return False, None


def status(state_dir: Path) -> dict:
    state_dir = Path(state_dir).resolve()
    ready = _read_json(state_dir / "ready.json")
    running = is_running(state_dir)
    out: dict = {"state_dir": str(state_dir), "running": running, "pins": Pins(state_dir / PINS_FILE).all()}
    if not ready:
        return out
    pids = ready.get("pids", {})
    health = {name: alive(pid) for name, pid in pids.items()}
    worker_ok, worker_status = _http_ok(ready["worker_url"] + "/_colocate/probe",
                                        {"authorization": f"Bearer {ready['token']}"}, timeout=10)
    # Every pod, at the address its process listens on (the Worker's hostname is the proxy's to map).
    pods = ready.get("pods") or [{"address": ready["pod_url"]}]
    pod_ok = all(_http_ok((p.get("address") or p["url"]) + "/health", timeout=5)[0] for p in pods)
    net_ok, _ = _http_ok(f"http://127.0.0.1:{ready['ports']['outbound']}/_sandbox/health")
    out.update({k: ready[k] for k in ("stack", "region", "worker_url", "pod_url", "sites", "generation", "draining") if k in ready})
    out["pids"] = pids
    out["health"] = {"processes": health, "worker_probe": worker_ok, "worker_status": worker_status, "pod": pod_ok,
                     "network": net_ok}
    out["healthy"] = running and all(health.values()) and worker_ok and pod_ok and net_ok
    return out


# --- the pod, through the same script the cloud uses ----------------------------------------

def _pod_env(state_dir: Path, token: str) -> dict:
    return {**os.environ, "POD_TOKEN": token, "COLOCATE_STATE_DIR": str(state_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# Longer than the Worker's usage flush interval (worker/src/state.js FLUSH_MAX_MS = 1 s).
WAIT_UNTIL_GRACE_S = 1.2
PODS_FILE = "pods.json"  # what each pod's create printed, in pod index order


def _pods(state_dir: Path) -> list[dict]:
    """The cell's pods as created (index order); ``pod.json`` is the one-pod layout of old."""
    data = _read_json(Path(state_dir) / PODS_FILE)
    if data is not None:
        return [p for p in data.get("pods", []) if p]
    legacy = _read_json(Path(state_dir) / "pod.json")
    return [legacy] if legacy else []


def _record_pods(state_dir: Path, pods: list[dict | None]) -> None:
    _write_json(Path(state_dir) / PODS_FILE, {"pods": [p for p in pods if p]})
    (Path(state_dir) / "pod.json").unlink(missing_ok=True)


def _create_pod(state_dir: Path, plan: CellPlan, token: str, index: int = 0) -> dict:
    """Pod ``index`` of the plan, through ``scripts/pod.py create`` (its own process: a failed
    create cleans up only what it made itself)."""
    pod = plan.pods[index]
    with open(state_dir / "logs" / "pod.log", "ab") as log:
        proc = subprocess.run([sys.executable, str(POD_SCRIPT), "create", "--spec", "-"],
                              input=json.dumps(pod.spec()).encode(), stdout=subprocess.PIPE, stderr=log,
                              env=_pod_env(state_dir, token), cwd=ROOT, timeout=POD_TIMEOUT_S)
    if proc.returncode != 0:
        raise StartupFailed(f"the create of pod {index} ({pod.name}, scripts/pod.py create) exited {proc.returncode}; "
                            f"see {state_dir / 'logs' / 'pod.log'}")
    created = json.loads(proc.stdout)
    created["index"] = index
    created["worker_url"] = pod.worker_url(created)  # a hostname, as the Worker must use in the cloud
    return created


def _create_pods(state_dir: Path, plan: CellPlan, token: str) -> list[dict]:
    """Every pod of the plan, created side by side (each its own process). Each is recorded
    as soon as it serves, so a failure of one leaves the others findable for cleanup."""
    from concurrent.futures import ThreadPoolExecutor

    made: list[dict | None] = [None] * len(plan.pods)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            created = _create_pod(state_dir, plan, token, i)
        except BaseException as exc:  # noqa: BLE001 - collected, raised below
            errors.append(exc)
            return
        with lock:
            made[i] = created
            _record_pods(state_dir, made)

    with ThreadPoolExecutor(max_workers=len(plan.pods)) as ex:
        list(ex.map(one, range(len(plan.pods))))
    if errors:
        raise errors[0]
    return [p for p in made if p]


def _delete_pod(state_dir: Path, created: dict | None = None) -> bool:
    """Delete every pod of the cell (``pods.json``), or the given one (a pod replaced by ``apply``)."""
    if created is None:
        pods = _pods(state_dir)
        if not pods:
            return False
        left = [p for p in pods if not _delete_pod(state_dir, p)]
        _record_pods(state_dir, left)
        if not left:
            (Path(state_dir) / PODS_FILE).unlink(missing_ok=True)
        return not left
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(state_dir / "logs" / "pod.log", "ab") as log:
        proc = subprocess.run([sys.executable, str(POD_SCRIPT), "delete", "--id", created["id"],
                               "--provider", created.get("provider", "local")],
                              stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                              env=_pod_env(state_dir, ""), cwd=ROOT, timeout=POD_TIMEOUT_S)
    return proc.returncode == 0


def _hostport(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


# --- the demo client key -------------------------------------------------------------------

KEY_FILE = "demo-key.json"
DEMO_KEY_NAME = "sandbox-demo"


def _key_works(worker_url: str, key: str) -> bool | None:
    """True/False when the Worker accepts/refuses the key on a routed path; None if unsure."""
    ok, code = _http_ok(worker_url + "/v1/models", {"authorization": f"Bearer {key}"}, timeout=30)
    if ok:
        return True
    return False if code in (401, 403) else None


def demo_key(state_dir: Path, worker_url: str, probe_token: str) -> dict:
    """The sandbox's demo client key: the one in ``demo-key.json`` while the cell still accepts
    it (keys live in the generation's objects, which survive down/up), else a new one created
    through the Worker's admin endpoint. Stored with mode 0600: it is a credential."""
    from ..admin import AdminClient, AdminError, Target

    path = Path(state_dir) / KEY_FILE
    stored = _read_json(path) or {}
    if stored.get("key") and _key_works(worker_url, stored["key"]) is not False:
        return stored
    try:
        created = AdminClient(Target(worker_url, probe_token, "sandbox")).create_key(DEMO_KEY_NAME)
    except AdminError as exc:
        raise StartupFailed(f"could not create the demo client key: {exc}; see {state_dir / 'logs' / 'workerd.log'}") from None
    record = {k: created.get(k) for k in ("id", "key", "name", "prefix", "created_at")}
    _write_json(path, record, 0o600)
    return record


# --- the runner --------------------------------------------------------------------------

class Runner:
    """Owns every part of one running sandbox. Lives in its own process group."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.logs = self.state_dir / "logs"
        self.stop = threading.Event()
        self.children: dict[str, subprocess.Popen] = {}
        self.servers: NetworkServers | None = None
        self.network: Network | None = None
        self.reload = threading.Event()  # SIGHUP: `sandbox.py apply` asks for a deploy
        self.revision = 0
        self.fallback_url = ""
        self.key: dict = {}

    def _spawn(self, name: str, argv: list[str], env: dict | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=ROOT,
                                pass_fds=pass_fds)
        log.close()
        self.children[name] = proc
        return proc

    def _start_fallback(self, api_key: str) -> str:
        port_file = self.state_dir / "fallback.port"
        port_file.unlink(missing_ok=True)
        env = {**os.environ, "POD_TOKEN": api_key,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = self._spawn("fallback", [sys.executable, "-m", "colocate.pods.standin", "--host", "127.0.0.1", "--port", "0",
                                        "--compute-ms", str(FALLBACK_COMPUTE_MS), "--model", FALLBACK_MODEL,
                                        "--name", "fallback", "--port-file", str(port_file)], env=env)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            info = _read_json(port_file)
            if info and info.get("url"):
                return info["url"]
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise StartupFailed(f"the fallback stand-in did not start; see {self.logs / 'fallback.log'}")

    def _start_workerd(self, config_path: Path) -> int:
        if not WORKERD.exists():
            raise StartupFailed(f"{WORKERD} is missing. Fix: run `make setup` (npm ci installs workerd)")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        try:
            # workerd listens on the socket we bound (port 0, real port known up front).
            self._spawn("workerd", [str(WORKERD), "serve", str(config_path), "-S",
                                    f"{config_mod.SOCKET_NAME}={sock.fileno()}"], pass_fds=(sock.fileno(),))
        finally:
            sock.close()
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            ok, code = _http_ok(f"http://127.0.0.1:{port}/_colocate/probe", timeout=5)
            if code is not None:
                return port
            if self.children["workerd"].poll() is not None:
                break
            time.sleep(0.1)
        raise StartupFailed(f"workerd did not answer; see {self.logs / 'workerd.log'}")

    def start(self) -> dict:
        launch = Launch.from_json(_read_json(self.state_dir / "launch.json") or {})
        plan, _ = build_plan(launch)
        geography = Geography.from_args(launch.stretch, launch.rtt)
        secrets = load_secrets(self.state_dir)
        pins = Pins(self.state_dir / PINS_FILE)

        pods = _create_pods(self.state_dir, plan, secrets["podToken"])
        sites = sites_for(plan, launch, pods[0].get("location", "local"))
        fallback_url = local_url(self._start_fallback(secrets["fallbackApiKey"]))
        network = Network(geography, sites, pins, targets={_hostport(fallback_url): sites.fallback})
        network.targets.update(self._pod_targets(plan, launch, sites, pods))
        self.network = network
        self.fallback_url = fallback_url
        self.servers = NetworkServers(network)
        wport, state_sites = self._launch_workerd(plan, sites, pods)
        network.resume(("127.0.0.1", wport))
        self.key = demo_key(self.state_dir, f"http://127.0.0.1:{self.servers.front.port}", secrets["probeToken"])
        return self._ready(plan, launch, pods, sites, state_sites, wport)

    @staticmethod
    def _pod_targets(plan: CellPlan, launch: Launch, sites: Sites, pods: list[dict]) -> dict[str, str]:
        """The outbound proxy's routes to the pods: by the hostname the Worker uses, each at its site."""
        return {_hostport(p["worker_url"]): sites_for(plan, launch, p.get("location", "local")).pod for p in pods}

    def _launch_workerd(self, plan: CellPlan, sites: Sites, pods: list[dict]) -> tuple[int, list[str]]:
        pins = Pins(self.state_dir / PINS_FILE)
        state_sites = object_sites(plan, sites.edge, pins)
        objects = self.state_dir / "objects"
        urls = [p["worker_url"].rstrip("/") for p in sorted(pods, key=lambda p: p["index"])]
        values = {**load_secrets(self.state_dir), "fallbackUrl": self.fallback_url,
                  POD_URLS_FROM_OUTPUT: pod_urls_text(urls)}
        text = config_mod.compose(plan, values=values, edge_site=sites.edge, state_sites=state_sites,
                                  outbound=("127.0.0.1", self.servers.outbound.port), objects_dir=objects)
        config_path = config_mod.write(self.state_dir / "workerd.capnp", text, objects, state_sites)
        return self._start_workerd(config_path), state_sites

    def _swap(self, plan: CellPlan, sites: Sites, pods: list[dict]) -> tuple[int, list[str]]:
        """Deploy a new Worker version with these pods, dropping no request: new requests wait
        at the edge while in-flight ones finish, then the new workerd takes them."""
        net = self.network
        if not net.pause():
            _log("apply: in-flight requests did not finish in time; swapping anyway")
        # On Cloudflare an old version's isolates finish their ctx.waitUntil work after the
        # new version takes traffic; here both versions share the objects' disk, so the old
        # one gets that time before it stops: its batched usage reaches the object.
        time.sleep(WAIT_UNTIL_GRACE_S)
        old = self.children.pop("workerd", None)
        try:
            if old is not None and old.poll() is None:
                old.terminate()
                try:
                    old.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    old.kill()
                    old.wait(timeout=5)
            wport, state_sites = self._launch_workerd(plan, sites, pods)
        except BaseException:
            net.resume(net.workerd)  # never leave requests held
            raise
        net.resume(("127.0.0.1", wport), sites=sites)
        return wport, state_sites

    def apply(self) -> dict:
        """The sandbox's `pulumi up` on a running cell: re-plan from the stack file and replace
        the pods that changed **one at a time** (new pod i serves and the Worker uses it before
        old pod i is deleted), adding or removing only the pods whose index came or went."""
        launch = Launch.from_json(_read_json(self.state_dir / "launch.json") or {})
        plan, _ = build_plan(launch)
        token = load_secrets(self.state_dir)["podToken"]
        old = {p.get("index", 0): p for p in _pods(self.state_dir)}
        current: list[dict | None] = [old.get(i) for i in range(len(plan.pods))]
        deleted: set[str] = set()
        net = self.network

        def record() -> None:  # every pod that may bill is on file at every step
            live = [p for p in current if p]
            ids = {p["id"] for p in live} | deleted
            _record_pods(self.state_dir, live + [p for p in old.values() if p["id"] not in ids])

        def retire(pod: dict, why: str) -> None:
            if _delete_pod(self.state_dir, pod):
                deleted.add(pod["id"])
            _log(f"apply: deleted pod {pod.get('index', 0)} ({pod.get('name')}): {why}")
            record()

        sites = sites_for(plan, launch, (current[0] or {}).get("location", "local"))
        swapped = None
        for i, pod in enumerate(plan.pods):
            before = old.get(i)
            if before and before.get("name") == pod.name:
                continue
            created = _create_pod(self.state_dir, plan, token, i)  # serves before anything else happens
            current[i] = created
            record()
            sites = sites_for(plan, launch, current[0].get("location", "local"))
            net.targets.update(self._pod_targets(plan, launch, sites, [created]))  # before the swap
            swapped = self._swap(plan, sites, [p for p in current if p])
            _log(f"apply: pod {i} is now {created['name']}")
            if before:
                retire(before, "replaced")
        live = [p for p in current if p]
        removed = [p for j, p in sorted(old.items()) if j >= len(plan.pods)]
        if swapped is None or removed:
            swapped = self._swap(plan, sites, live)  # the new Worker version, without removed pods
        for extra in removed:
            retire(extra, f"pod.count is {len(plan.pods)}")
        self._purge_retired(plan)
        wport, state_sites = swapped
        return self._ready(plan, launch, live, sites, state_sites, wport)

    def _purge_retired(self, plan: CellPlan) -> None:
        """What the cell's purge commands do after `finish`: once per retired generation,
        through the Worker's own endpoint (as `migrate.py purge` does in the cloud)."""
        record = self.state_dir / "purged.json"
        done = set((_read_json(record) or {}).get("purged", []))
        token = load_secrets(self.state_dir)["probeToken"]
        for gen in plan.state.purge:
            if gen in done:
                continue
            req = urllib.request.Request(f"http://127.0.0.1:{self.servers.front.port}/_colocate/purge",
                                         data=json.dumps({"generation": gen}).encode(), method="POST",
                                         headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                _log(f"purged {gen}: {resp.read().decode()[:200]}")
            done.add(gen)
            _write_json(record, {"purged": sorted(done)})

    def _ready(self, plan: CellPlan, launch: Launch, pods: list[dict], sites: Sites, state_sites: list[str],
               wport: int) -> dict:
        self.revision += 1
        secrets = load_secrets(self.state_dir)
        pins = Pins(self.state_dir / PINS_FILE)
        first = pods[0]
        fallback_url = self.fallback_url
        geography = self.network.geography
        state = plan.state
        pod_pids = {("pod" if p["index"] == 0 else f"pod-{p['index']}"): _pod_pid(self.state_dir, p) for p in pods}
        return {
            "stack": plan.stack,
            "region": plan.region.name,
            "worker_url": f"http://127.0.0.1:{self.servers.front.port}",
            "pod_url": first["worker_url"].rstrip("/"),
            "pod_id": first.get("id"),
            "pod_location": first.get("location"),
            "pods": [{"index": p["index"], "id": p.get("id"), "name": p.get("name"), "url": p["worker_url"].rstrip("/"),
                      "address": p["url"].rstrip("/"), "location": p.get("location"), "pid": _pod_pid(self.state_dir, p)}
                     for p in pods],
            "fallback_url": fallback_url,
            "token": secrets["probeToken"],
            "key": self.key.get("key"),
            "key_id": self.key.get("id"),
            "state_dir": str(self.state_dir),
            "generation": state.active.name,
            "hint": state.hint,
            "draining": state.draining.name if state.draining else None,
            "force_split": launch.force_split,
            "sites": {**sites.as_json(), "objects": state_sites, "placement": sites.placement},
            "geography": geography.as_json(),
            "pins": pins.all(),
            "ports": {"front": self.servers.front.port, "outbound": self.servers.outbound.port, "workerd": wport},
            "pids": {"runner": os.getpid(), "workerd": self.children["workerd"].pid,
                     "fallback": self.children["fallback"].pid, **pod_pids},
            "logs": str(self.logs),
            "revision": self.revision,
        }

    def watch(self) -> str:
        """Wait until told to stop or a child dies; apply deploys when asked; say why it ended."""
        while not self.stop.wait(0.2):
            if self.reload.is_set():
                self.reload.clear()
                (self.state_dir / "apply-failed.json").unlink(missing_ok=True)
                try:
                    ready = self.apply()
                    _write_json(self.state_dir / "ready.json", ready, 0o600)
                    _log(f"applied revision {ready['revision']}: generation {ready['generation']}, edge {ready['sites']['edge']}")
                except Exception as exc:  # noqa: BLE001 - reported to `apply`; the old version keeps serving
                    _log(f"apply failed: {type(exc).__name__}: {exc}")
                    _write_json(self.state_dir / "apply-failed.json", {"error": str(exc)})
            for name, proc in self.children.items():
                if proc.poll() is not None:
                    return f"{name} exited with {proc.returncode}"
        return "stop requested"

    def cleanup(self) -> None:
        for proc in list(self.children.values())[::-1]:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.children.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self.servers:
            self.servers.close()
        _delete_pod(self.state_dir)


def _pod_pid(state_dir: Path, created: dict) -> int | None:
    record = _read_json(state_dir / "pods" / f"{created.get('name', '')}.json")
    return record.get("pid") if record else None


def run(state_dir: Path) -> int:
    """The runner's main: start everything, report readiness, wait, clean up."""
    state_dir = Path(state_dir)
    runner = Runner(state_dir)

    def on_signal(signum, _frame):
        runner.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda *_: runner.reload.set())
    _write_json(state_dir / "run.json", {"pid": os.getpid(), "pgid": os.getpgid(0), "started_at": time.time()})
    code = 0
    try:
        ready = runner.start()
        if runner.stop.is_set():
            return 0
        _write_json(state_dir / "ready.json", ready, 0o600)
        _log(f"up: {ready['worker_url']} (edge {ready['sites']['edge']}, objects at {ready['sites']['objects']})")
        why = runner.watch()
        _log(f"stopping: {why}")
        code = 0 if why == "stop requested" else 1
    except Exception as exc:  # noqa: BLE001 - reported to `up` through failed.json, then cleaned up
        _log(f"failed: {type(exc).__name__}: {exc}")
        _write_json(state_dir / "failed.json", {"error": str(exc)})
        code = 1
    finally:
        runner.cleanup()
        (state_dir / "ready.json").unlink(missing_ok=True)
        _log("stopped")
    return code


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m colocate.sandbox.supervisor")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the runner (started by sandbox.py up; not for direct use)")
    r.add_argument("state_dir", type=Path)
    r.add_argument("--lock-fd", type=int, help="inherited fd holding the state directory's lock")
    la = sub.add_parser("launch", help="start the runner detached and print its pid (used by up)")
    la.add_argument("state_dir", type=Path)
    la.add_argument("--lock-fd", type=int, required=True)
    a = p.parse_args()
    if a.cmd == "launch":
        child = subprocess.Popen([sys.executable, "-m", "colocate.sandbox.supervisor", "run", str(a.state_dir),
                                  "--lock-fd", str(a.lock_fd)], stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                 stderr=sys.stderr, pass_fds=(a.lock_fd,))
        print(child.pid, flush=True)
        os._exit(0)  # leave the runner running; no destructor waits on it
    sys.exit(run(a.state_dir))
