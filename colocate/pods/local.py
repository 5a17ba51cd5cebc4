"""The ``local`` provider: the stand-in server as a detached process on this machine.

State lives in ``$COLOCATE_STATE_DIR/pods/`` (default ``<repo>/.colocate/pods/``):
``<name>.json`` holds ``{id, name, pid, port, url, control_url, ...}``, ``<name>.log`` the process's
output. The pod id is ``local-<name>``. Delete sends SIGTERM to the process group (then
SIGKILL if it lingers) and removes the file; deleting a gone pod is a success.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from . import podtls
from .base import DEAD, RUNNING, PodInfo, Provider
from .errors import NotFoundError, ProviderError

REPO = Path(__file__).resolve().parents[2]
PREFIX = "local-"


def state_dir() -> Path:
    base = os.environ.get("COLOCATE_STATE_DIR")
    return (Path(base) if base else REPO / ".colocate") / "pods"


def alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs (None: no process)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this very process still answers kill(0): reap it if so.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    # Anyone else's zombie has exited too: a container's init may take a second to reap it.
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # gone meanwhile, or no procfs: kill(0) answered for it
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"  # the state follows the parenthesised name


def _is_standin(pid: int) -> bool:
    """Guard against a recycled pid: only ever signal a process that is our stand-in."""
    try:
        return b"colocate.pods.standin" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return not Path("/proc").is_dir()  # no procfs (macOS): trust the record


class Local(Provider):
    name = "local"

    def __init__(self, token: str = ""):
        self.dir = state_dir()

    def _file(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def candidates(self, spec):
        return ["local"], []

    def create(self, spec, location: str, token: str) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        port_file = self.dir / f"{spec.name}.port.json"
        port_file.unlink(missing_ok=True)
        env = {
            **os.environ,
            "POD_TOKEN": token,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        for var in (podtls.BUNDLE_ENV, podtls.CHECK_ENV, podtls.ENV):
            env.pop(var, None)  # the stand-in gets exactly what a real pod gets, and no caller's key
        if spec.mtls:
            env = podtls.environment(self.pod_tls, env)  # first, as the clouds' create requests carry it
        argv = [sys.executable, "-m", "colocate.pods.standin", "--host", "127.0.0.1", "--port", "0",
                "--compute-ms", str(spec.compute_ms), "--model", spec.model, "--name", spec.name,
                "--profile", spec.profile, "--max-model-len", str(spec.max_model_len),
                "--port-file", str(port_file)]
        with open(self.dir / f"{spec.name}.log", "ab") as log:
            # posix_spawn with setsid: a detached process in its own session (delete kills the group),
            # not a Popen this process would be expected to wait for.
            pid = os.posix_spawn(sys.executable, argv, env, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log.fileno(), 1),
                (os.POSIX_SPAWN_DUP2, log.fileno(), 2)])
        pod_id = PREFIX + spec.name
        record = {"id": pod_id, "name": spec.name, "pid": pid, "port": None, "url": None,
                  "model": spec.model, "created": time.time()}
        self._write(spec.name, record)  # written first: a crash from here on leaves a file sweep can find
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if port_file.exists():
                info = json.loads(port_file.read_text())
                record.update(port=info["port"], url=info["url"], control_url=info.get("control_url"))
                self._write(spec.name, record)
                return pod_id
            if not alive(pid):
                break
            time.sleep(0.02)
        self.destroy(pod_id)
        raise ProviderError(f"local stand-in did not start (see {self.dir / (spec.name + '.log')})")

    def _write(self, name: str, record: dict) -> None:
        tmp = self._file(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._file(name))

    def _record(self, pod_id: str) -> dict:
        if not pod_id.startswith(PREFIX):
            raise NotFoundError(f"{pod_id!r} is not a local pod id (they look like {PREFIX}<name>)")
        try:
            return json.loads(self._file(pod_id[len(PREFIX):]).read_text())
        except (FileNotFoundError, ValueError):
            raise NotFoundError(f"local pod {pod_id} not found in {self.dir}") from None

    def _info(self, rec: dict) -> PodInfo:
        up = alive(rec["pid"])
        return PodInfo(id=rec["id"], name=rec["name"], state=RUNNING if up else DEAD,
                       raw_state="running" if up else "exited", location="local",
                       ip="127.0.0.1" if rec.get("port") else None, port=rec.get("port"),
                       cost_per_hr=0.0, gpu="stand-in")

    def describe(self, pod_id: str) -> PodInfo:
        return self._info(self._record(pod_id))

    def destroy(self, pod_id: str) -> bool:
        try:
            rec = self._record(pod_id)
        except NotFoundError:
            return False
        pid = rec["pid"]
        if alive(pid) and _is_standin(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        name = rec["name"]
        for path in (self._file(name), self.dir / f"{name}.port.json"):
            path.unlink(missing_ok=True)
        return True

    def list_pods(self) -> list[PodInfo]:
        if not self.dir.is_dir():
            return []
        out = []
        for f in sorted(self.dir.glob("*.json")):
            if f.name.endswith(".port.json"):
                continue
            with contextlib.suppress(ValueError, KeyError, OSError):
                out.append(self._info(json.loads(f.read_text())))
        return out
