"""The cell's pods, created and deleted through ``scripts/pod.py`` (the same script the cloud
uses), each in its own process; ``pods.json`` records every pod that may be serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from ..cell.plan import CellPlan
from ..pods import podtls
from . import hopcerts
from .engine import pod_bundle
from .errors import StartupFailed
from .statedir import (
    LEGACY_POD_FILE,
    LOGS_DIR,
    PODS_FILE,
    ROOT,
    local_pod_record,
    local_pod_records,
    log_path,
    read_json,
    write_json,
)

POD_SCRIPT = ROOT / "scripts" / "pod.py"
POD_TIMEOUT_S = 60.0


def _pod_env(state_dir: Path, token: str) -> dict:
    return {**os.environ, "POD_TOKEN": token, "COLOCATE_STATE_DIR": str(state_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def recorded_pods(state_dir: Path) -> list[dict]:
    """The cell's pods as created (index order); ``pod.json`` is the one-pod layout of old."""
    data = read_json(Path(state_dir) / PODS_FILE)
    if data is not None:
        return [p for p in data.get("pods", []) if p]
    legacy = read_json(Path(state_dir) / LEGACY_POD_FILE)
    return [legacy] if legacy else []


def record_pods(state_dir: Path, pods: Sequence[dict | None]) -> None:
    write_json(Path(state_dir) / PODS_FILE, {"pods": [p for p in pods if p]})
    (Path(state_dir) / LEGACY_POD_FILE).unlink(missing_ok=True)


def create_pod(state_dir: Path, plan: CellPlan, token: str, index: int = 0) -> dict:
    """Pod ``index`` of the plan, through ``scripts/pod.py create`` (its own process: a failed
    create cleans up only what it made itself)."""
    pod = plan.pods[index]
    spec = pod.spec()
    hop = hopcerts.load(state_dir).pod_env() if pod.mtls else {}
    engine = bool(spec["command"] or spec["url"])
    if engine and pod.mtls:  # a real engine gets the cloud's bundle: it cannot hold readiness to /health
        hop[podtls.BUNDLE_ENV] = pod_bundle(state_dir)
    with open(log_path(state_dir, "pod"), "ab") as log:
        proc = subprocess.run([sys.executable, str(POD_SCRIPT), "create", "--spec", "-"],
                              input=json.dumps(spec).encode(), stdout=subprocess.PIPE, stderr=log,
                              env={**_pod_env(state_dir, token), **hop}, cwd=ROOT,
                              # an engine's own readiness wait (minutes for a real one) within this bound
                              timeout=spec["ready_timeout_s"] + POD_TIMEOUT_S if engine else POD_TIMEOUT_S)
    if proc.returncode != 0:
        raise StartupFailed(f"the create of pod {index} ({pod.name}, scripts/pod.py create) exited {proc.returncode}; "
                            f"see {log_path(state_dir, 'pod')}")
    created = json.loads(proc.stdout)
    created["index"] = index
    created["worker_url"] = pod.worker_url(created)  # a hostname, as the Worker must use in the cloud
    return created


def create_pods(state_dir: Path, plan: CellPlan, token: str) -> list[dict]:
    """Every pod of the plan, created side by side (each its own process). Each is recorded
    as soon as it serves, so a failure of one leaves the others findable for cleanup."""
    from concurrent.futures import ThreadPoolExecutor

    made: list[dict | None] = [None] * len(plan.pods)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            created = create_pod(state_dir, plan, token, i)
        except BaseException as exc:  # noqa: BLE001 - collected, raised below
            errors.append(exc)
            return
        with lock:
            made[i] = created
            record_pods(state_dir, made)

    if not plan.pods:  # a cell scaled to zero
        record_pods(state_dir, [])
        return []
    with ThreadPoolExecutor(max_workers=len(plan.pods)) as ex:
        list(ex.map(one, range(len(plan.pods))))
    if errors:
        raise errors[0]
    return [p for p in made if p]


def delete_recorded_pods(state_dir: Path) -> bool:
    """Delete every pod of the cell (``pods.json``); those that would not go stay recorded."""
    pods = recorded_pods(state_dir)
    if not pods:
        return False
    left = [p for p in pods if not delete_pod(state_dir, p)]
    record_pods(state_dir, left)
    if not left:
        (Path(state_dir) / PODS_FILE).unlink(missing_ok=True)
    return not left


def delete_pod(state_dir: Path, created: dict) -> bool:
    """Delete one pod (``created``: its record, at least its ``id``), e.g. one ``apply`` replaced."""
    (state_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    with open(log_path(state_dir, "pod"), "ab") as log:
        proc = subprocess.run([sys.executable, str(POD_SCRIPT), "delete", "--id", created["id"],
                               "--provider", created.get("provider", "local")],
                              stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                              env=_pod_env(state_dir, ""), cwd=ROOT, timeout=POD_TIMEOUT_S)
    return proc.returncode == 0


def delete_local_pods(state_dir: Path) -> list[str]:
    """Delete every local pod recorded in the sandbox's own pod state (``pods/``)."""
    deleted = []
    for record in local_pod_records(state_dir):
        pod_id = (read_json(record) or {}).get("id")
        if pod_id and delete_pod(state_dir, {"id": pod_id}):
            deleted.append(pod_id)
    return deleted


def pod_pid(state_dir: Path, created: dict) -> int | None:
    """The pod's process, if this machine runs one the sandbox started (not a server at a url of the user's)."""
    record = read_json(local_pod_record(state_dir, created.get("name", "")))
    return record.get("pid") if record else None


def pod_control(state_dir: Path, created: dict) -> str | None:
    """Where the stand-in's ``/_standin/*`` answers (a plain loopback port beside its TLS one)."""
    record = read_json(local_pod_record(state_dir, created.get("name", "")))
    return record.get("control_url") if record else None
