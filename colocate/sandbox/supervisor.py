"""The sandbox's lifecycle: ``up``, ``apply``, ``down`` and ``status`` of one cell.

``up`` validates the stack and builds the plan in the calling process (a bad stack fails
before anything starts), then starts a detached **runner** (``python -m
colocate.sandbox.supervisor run STATE_DIR``) in its own session and process group. The
runner (runner.py) owns every part of the cell until ``down``. The files ``up`` and the runner
keep are listed in statedir.py.

``down`` sends SIGTERM to the runner, which stops its children, deletes the pod through
``scripts/pod.py delete`` and releases the lock; what lingers is killed by process group, and
every local pod recorded under ``pods/`` is deleted too.

Ctrl-C during ``up``: the launcher may have started a runner that ``up`` never heard of, so the
cleanup does not trust what it knows; it waits while the lock is held, stops the runner named by
the runner's own run.json, and returns only when the lock is free (``stop_runner``). Cleanups
run with SIGINT/SIGTERM deferred (``deferred_signals``), so a second Ctrl-C cannot cut them short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .. import stackfile
from ..pods import podtls
from ..pods.guard.colocate_pod_guard import readiness_token
from ..pods.local import alive
from ..pods.readiness import tls_health
from . import detach, hopcerts
from .errors import AlreadyRunning, NotRunning, StartupFailed
from .geography import Geography, site
from .launch import Launch, build_plan, sites_for
from .pinning import Pins
from .pods import delete_local_pods, delete_recorded_pods
from .processes import CHILD_TIMEOUT_S, deferred_signals, group_alive, http_ok, signal_group
from .statedir import (
    APPLY_FAILED_FILE,
    FAILED_FILE,
    LAUNCH_FILE,
    LOGS_DIR,
    PINS_FILE,
    PODS_FILE,
    READY_FILE,
    ROOT,
    RUN_FILE,
    SANDBOX_CMD,
    check_owner,
    default_state_dir,
    is_running,
    load_secrets,
    log_line,
    log_path,
    owner,
    read_json,
    recorded_pids,
    remember,
    running_sandboxes,
    try_lock,
    where_command,
    where_sandboxes_run,
    write_json,
)

# What scripts/ and tests/ import from here; the rest lives in the modules above.
__all__ = [
    "PODS_FILE", "ROOT", "SANDBOX_CMD", "STOP_TIMEOUT_S", "UP_TIMEOUT_S", "Launch", "alive", "apply",
    "build_plan", "check_owner", "default_state_dir", "deferred_signals", "down", "is_running",
    "load_secrets", "owner", "remember", "running_sandboxes", "sites_for", "status", "stop_runner", "up",
    "where_command", "where_sandboxes_run",
]

UP_TIMEOUT_S = 90.0
ENGINE_PROGRESS_S = 15.0  # how often `up` says how a pod of the user's engine is coming along
STOP_TIMEOUT_S = 20.0


def up(stack: str, *, state_dir: Path | None = None, stacks_dir: Path = stackfile.STACKS_DIR,
       client_site: str | None = None, stretch: float | None = None, rtt: tuple[str, ...] = (),
       force_split: bool = False, timeout_s: float = UP_TIMEOUT_S) -> dict:
    """Start the sandboxed cell; return what ``sandbox.py up`` prints."""
    state_dir = Path(state_dir or default_state_dir(stack)).resolve()
    launch = Launch(stack, str(Path(stacks_dir).resolve()), client_site, stretch, tuple(rtt), force_split)
    Geography.from_args(stretch, rtt)  # a bad --stretch/--rtt fails here, before anything starts
    if client_site:
        site(client_site, "--client-site")
    plan, notes = build_plan(launch)  # a bad stack fails here too
    check_owner(state_dir, stack)
    engines = [p for p in plan.pods if p.settings.command or p.settings.url]
    if engines:  # a real engine starts in minutes: `up` waits its readiness (colocate:pod.readyTimeoutS)
        timeout_s = max(timeout_s, UP_TIMEOUT_S + max(p.settings.ready_timeout_s for p in engines))
    (state_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    fd = try_lock(state_dir)
    if fd is None:
        pids = ", ".join(f"{k} {v}" for k, v in recorded_pids(state_dir).items() if v)
        raise AlreadyRunning(f"a sandbox is already running in {state_dir} (pids {pids or 'unknown'}); "
                             f"run `{SANDBOX_CMD} down --state-dir {state_dir}` first",
                             same=(read_json(state_dir / LAUNCH_FILE) or {}) == launch.as_json())
    say_once(notes)
    launched = False
    try:
        remember(state_dir)
        load_secrets(state_dir)
        # We hold the lock, so no runner lives here: whatever run.json says is stale. From now
        # on run.json is written only by the runner itself, before it starts anything.
        for stale in (READY_FILE, FAILED_FILE, RUN_FILE):
            (state_dir / stale).unlink(missing_ok=True)
        write_json(state_dir / LAUNCH_FILE, launch.as_json())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # A short-lived launcher starts the runner in a new session and exits at once, so
        # the runner is nobody's child: it outlives `up` and is never left a zombie. The
        # runner inherits the lock, so "the lock is held" = "a runner (or its launcher) lives".
        launched = True
        with open(log_path(state_dir, "runner"), "ab") as log:
            started = subprocess.run(
                detach.command("colocate.sandbox.supervisor", state_dir, fd),
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                pass_fds=(fd,), start_new_session=True, timeout=30, check=True,
            )
        runner = int(started.stdout.strip())
        os.close(fd)  # the runner holds the lock from now on
        fd = None
        deadline = time.monotonic() + timeout_s
        said = time.monotonic()
        while time.monotonic() < deadline:
            ready = read_json(state_dir / READY_FILE)
            if ready:
                return ready
            failed = read_json(state_dir / FAILED_FILE)
            if failed or not alive(runner):
                why = (failed or {}).get("error") or "the runner exited"
                raise StartupFailed(f"sandbox did not come up: {why}. Logs: {state_dir / LOGS_DIR}")
            if engines and time.monotonic() - said >= ENGINE_PROGRESS_S:
                said = time.monotonic()
                log_line(f"waiting for your engine ({timeout_s - (deadline - said):.0f} of at most {timeout_s:.0f} s): "
                         f"{last_line(log_path(state_dir, 'pod')) or 'starting'}")
            time.sleep(0.1)
        raise StartupFailed(f"sandbox did not come up within {timeout_s:.0f} s. Logs: {state_dir / LOGS_DIR}")
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


_said: set[str] = set()


def say_once(notes: list[str]) -> None:
    """A plan's notes, each once per process: a demo that starts and applies many cells of the
    same kind (demo-autoscale: three cells, each applied at every scaling step) says it once."""
    for note in notes:
        if note not in _said:
            _said.add(note)
            log_line(note)


def last_line(path: Path) -> str:
    """The last line of a log (its last 4 KB read), or ""."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            lines = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def stop_runner(state_dir: Path, timeout_s: float = STOP_TIMEOUT_S + CHILD_TIMEOUT_S) -> bool:
    """Stop the runner ``up`` launched, even one that has not said who it is yet: while the
    lock is held (by the launcher or the runner), wait for the runner's own run.json and stop
    it. True once the lock is free, i.e. no runner lives."""
    state_dir = Path(state_dir)
    deadline = time.monotonic() + timeout_s
    while is_running(state_dir):
        run = read_json(state_dir / RUN_FILE) or {}
        if alive(run.get("pid")):
            down(state_dir, quiet=True)
            continue
        if time.monotonic() > deadline:
            log_line(f"WARNING: the state directory's lock is still held and no runner said who it is; "
                 f"see {log_path(state_dir, 'runner')}")
            return False
        time.sleep(0.05)
    return True


def apply(stack: str, *, state_dir: Path | None = None, stacks_dir: Path | None = None,
          force_split: bool = False, timeout_s: float = UP_TIMEOUT_S) -> dict:
    """Deploy the stack file's current state to a running sandbox (its `pulumi up`)."""
    state_dir = Path(state_dir or default_state_dir(stack)).resolve()
    previous = read_json(state_dir / READY_FILE)
    run = read_json(state_dir / RUN_FILE) or {}
    if not previous or not is_running(state_dir) or not alive(run.get("pid")):
        raise NotRunning(f"no sandbox runs in {state_dir}; start it with `{SANDBOX_CMD} up "
                         f"{where_command(state_dir, stack)}`; {where_sandboxes_run(state_dir)}")
    check_owner(state_dir, stack)
    old = Launch.from_json(read_json(state_dir / LAUNCH_FILE) or {})
    launch = Launch(stack, str(Path(stacks_dir or old.stacks_dir).resolve()), old.client_site, old.stretch, old.rtt,
                    force_split)
    _, notes = build_plan(launch)  # a bad stack fails here, and the running cell is untouched
    say_once(notes)
    handed = False
    try:
        with deferred_signals():  # the hand-over is whole: the launch file and the signal, or neither
            write_json(state_dir / LAUNCH_FILE, launch.as_json())
            (state_dir / APPLY_FAILED_FILE).unlink(missing_ok=True)
            os.kill(run["pid"], signal.SIGHUP)
            handed = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = read_json(state_dir / READY_FILE) or {}
            if ready.get("revision", 0) > previous.get("revision", 0):
                return ready
            failed = read_json(state_dir / APPLY_FAILED_FILE)
            if failed:
                raise StartupFailed(f"apply failed: {failed.get('error')}; the previous version still serves. "
                                    f"Logs: {state_dir / LOGS_DIR}")
            if not alive(run["pid"]):
                raise StartupFailed(f"the sandbox stopped during apply. Logs: {state_dir / LOGS_DIR}")
            time.sleep(0.1)
    except KeyboardInterrupt as exc:
        raise ApplyInterrupted(handed) from exc
    raise StartupFailed(f"apply did not finish within {timeout_s:.0f} s. Logs: {state_dir / LOGS_DIR}")


class ApplyInterrupted(KeyboardInterrupt):
    """An interrupted ``apply``: ``handed`` says whether the runner was given the deploy (it
    then finishes or fails there) or not (the sandbox runs unchanged)."""

    def __init__(self, handed: bool) -> None:
        super().__init__(handed)
        self.handed = handed


def down(state_dir: Path, quiet: bool = False) -> dict:
    """Stop everything the sandbox started in ``state_dir``; idempotent. ``was_running`` says
    whether there was anything to stop (a runner, a pod, a lock held)."""
    state_dir = Path(state_dir).resolve()
    with deferred_signals():  # a Ctrl-C during down must not leave half of the cell running
        held = is_running(state_dir)
        # The runner deletes the pods it made when it stops: which pods ran is read first, so the
        # answer says whether they are gone, whoever deleted them.
        pod_pids = [p.get("pid") for p in (read_json(state_dir / READY_FILE) or {}).get("pods") or [] if p.get("pid")]
        run = read_json(state_dir / RUN_FILE) or {}
        pid, pgid = run.get("pid"), run.get("pgid")
        stopped = []
        if pid and alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            stopped.append(pid)
        if pgid and group_alive(pgid):
            signal_group(pgid, signal.SIGKILL)  # whatever the runner could not stop
            deadline = time.monotonic() + 5
            while group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        pod_deleted = delete_recorded_pods(state_dir)  # the runner normally did this; a crash may not have
        strays = delete_local_pods(state_dir)  # a runner killed inside `pod.py create` leaves only these
        for name in (RUN_FILE, READY_FILE):
            (state_dir / name).unlink(missing_ok=True)
    if not quiet:
        log_line(f"stopped {state_dir}")
    pods_gone = bool(pod_pids) and not any(alive(pid) for pid in pod_pids)
    return {"state_dir": str(state_dir), "stopped": stopped, "pod_deleted": pods_gone or pod_deleted or bool(strays),
            "was_running": bool(held or stopped or pod_deleted or strays), "running": is_running(state_dir)}


def _pod_ok(state_dir: Path, address: str) -> bool:
    """A pod's ``/health`` at its own address with the readiness token (and, over mutual TLS, the
    readiness certificate), as pod.py checks it."""
    token = readiness_token(load_secrets(state_dir)["podToken"])
    if not address.startswith("https://"):
        return http_ok(address + "/health", {"authorization": f"Bearer {token}"}, timeout=5)[0]
    creds = hopcerts.load(state_dir)
    ctx = podtls.client_context(creds.check.cert_pem, creds.check.key_pem, creds.public.cert_pem)
    return tls_health(address, 5, ctx, hopcerts.POD_NAME, token=token)[0]


def status(state_dir: Path) -> dict:
    state_dir = Path(state_dir).resolve()
    ready = read_json(state_dir / READY_FILE)
    running = is_running(state_dir)
    out: dict = {"state_dir": str(state_dir), "running": running, "pins": Pins(state_dir / PINS_FILE).all()}
    if not ready:
        return out
    pids = ready.get("pids", {})
    health = {name: alive(pid) for name, pid in pids.items()}
    worker_ok, worker_status = http_ok(ready["worker_url"] + "/_colocate/probe",
                                        {"authorization": f"Bearer {ready['token']}"}, timeout=10)
    # Every pod, at the address its process listens on (the Worker's hostname is the proxy's to map).
    pods = ready["pods"] if "pods" in ready else [{"address": ready["pod_url"]}]
    pod_ok = all(_pod_ok(state_dir, p.get("address") or p["url"]) for p in pods)
    net_ok, _ = http_ok(f"http://127.0.0.1:{ready['ports']['outbound']}/_sandbox/health")
    out.update(
        {k: ready[k] for k in ("stack", "region", "worker_url", "pod_url", "sites", "generation", "draining") if k in ready}
    )
    out["pids"] = pids
    out["health"] = {"processes": health, "worker_probe": worker_ok, "worker_status": worker_status, "pod": pod_ok,
                     "network": net_ok}
    out["healthy"] = running and all(health.values()) and worker_ok and pod_ok and net_ok
    out["scale"] = scale_status(ready)
    return out


def scale_status(ready: dict) -> dict | None:
    """The scaling controller's last decision and lock as the generation holds them (docs/pods.md,
    "Scaling with demand"); None when the Worker cannot be asked."""
    req = urllib.request.Request(ready["worker_url"] + "/_colocate/scale", headers={"authorization": f"Bearer {ready['token']}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            state = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    d = state.get("decision") or {}
    return {"desired": d.get("desired"), "running": d.get("running"), "draining": d.get("draining"), "reason": d.get("reason"),
            "decided_at": d.get("at"), "lock": (state.get("lock") or {}).get("owner"), "routed_pods": state.get("routed_pods"),
            "inflight": state.get("inflight")}


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m colocate.sandbox.supervisor")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the runner (started by sandbox.py up; not for direct use)")
    r.add_argument("state_dir", type=Path)
    r.add_argument("--lock-fd", type=int, help="inherited fd holding the state directory's lock")
    a = p.parse_args()
    from .runner import run  # only the runner's process needs it (it imports admin, workerd's config, the proxies)

    sys.exit(run(a.state_dir))
