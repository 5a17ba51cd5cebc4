"""The ``local`` provider: the stand-in server as a detached process on this machine, or a server
of the user's (an engine: ``colocate:pod.command`` and ``.url``, docs/sandbox.md "Your own engine").

State lives in ``$COLOCATE_STATE_DIR/pods/`` (default ``<repo>/.colocate/pods/``):
``<name>.json`` holds ``{id, name, pid, port, url, control_url, ...}``, ``<name>.log`` the process's
output. The pod id is ``local-<name>``. Delete sends SIGTERM to the process group (then
SIGKILL if it lingers) and removes the file; deleting a gone pod is a success.

An engine pod is created at once, like a cloud pod: its readiness is the lifecycle's wait
(``readyTimeoutS``, progress on stderr). A command runs in a session of its own with what a cloud
pod gets (``VLLM_API_KEY``, ``COLOCATE_POD_TLS`` on a mutual-TLS hop) and where to serve
(``COLOCATE_POD_HOST``, ``COLOCATE_POD_PORT``, and ``COLOCATE_POD_ARGS``: the kit's vLLM arguments
after the model); delete stops it, and only it (its pid and start time are recorded). A server at
``url`` that the sandbox did not start is never signalled: delete forgets it.

The sandbox emulates a market (colocate:pod.market): a stand-in records how it was rented, and
``preempt`` is its host taking an interruptible one back, as a cloud does: the record says
``preempted`` (``describe`` reports it dead, as Vast.ai reports an outbid instance) and its process
is killed at once (SIGKILL: its connections are cut mid-answer, nothing is said to its clients).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from . import podtls
from .base import DEAD, RUNNING, PodInfo, Provider
from .errors import NotFoundError, PodConfigError, ProviderError

REPO = Path(__file__).resolve().parents[2]
PREFIX = "local-"
PREEMPTED = "preempted"  # the raw state of a stand-in its emulated host took back


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


def started_at(pid: int) -> str | None:
    """The process's start time (``/proc/<pid>/stat`` field 22, in clock ticks since boot): with the pid, it
    names one process, never a later one that reuses the pid. None without procfs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19]
    except (OSError, IndexError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_standin(pid: int) -> bool:
    """Guard against a recycled pid: only ever signal a process that is our stand-in."""
    try:
        return b"colocate.pods.standin" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return not Path("/proc").is_dir()  # no procfs (macOS): trust the record


def _ours(rec: dict) -> bool:
    """Whether the record's command still runs as the process this provider started."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or not alive(pid):
        return False
    return rec.get("started") is None or started_at(pid) == rec.get("started")


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
        if spec.engine:
            return self._create_engine(spec, token)
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
                  "model": spec.model, "created": time.time(), "market": spec.market}
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

    def _create_engine(self, spec, token: str) -> str:
        """A server of the user's as the pod: started here (``command``) or already running (``url``)."""
        scheme = "https" if spec.mtls else "http"
        url = spec.url or f"{scheme}://127.0.0.1:{_free_port()}"
        parts = urlsplit(url)
        if parts.scheme != scheme:
            raise PodConfigError(f"colocate:pod.url: {url} is {parts.scheme}, but this cell's hop is "
                                 f"{'mutual TLS' if spec.mtls else 'the pod token over plain HTTP'}. Fix: "
                                 f"pulumi config set --path colocate:pod.url {scheme}://{parts.netloc}")
        host, port = parts.hostname or "127.0.0.1", int(parts.port or 0)
        pod_id = PREFIX + spec.name
        record = {"id": pod_id, "name": spec.name, "pid": None, "port": port, "url": url, "ip": host,
                  "model": spec.model, "created": time.time(), "engine": "command" if spec.command else "url"}
        if spec.command:
            env = {k: v for k, v in os.environ.items()
                   if k not in (podtls.BUNDLE_ENV, podtls.CHECK_ENV, podtls.ENV, "POD_TOKEN", "VLLM_API_KEY")}
            env.update(VLLM_API_KEY=token, COLOCATE_POD_HOST=host, COLOCATE_POD_PORT=str(port),
                       COLOCATE_POD_ARGS=shlex.join(spec.serve_args(host, port)))
            if spec.mtls:
                env = podtls.environment(self.pod_tls, env)  # first, as the clouds' create requests carry it
            with open(self.dir / f"{spec.name}.log", "ab") as log:
                pid = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", spec.command], env, setsid=True, file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log.fileno(), 1),
                    (os.POSIX_SPAWN_DUP2, log.fileno(), 2)])
            record.update(pid=pid, started=started_at(pid))
        self._write(spec.name, record)
        return pod_id

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
        engine = rec.get("engine")
        preempted = bool(rec.get("preempted"))
        up = not preempted and (True if engine == "url" else _ours(rec) if engine == "command" else alive(rec["pid"]))
        down = PREEMPTED if preempted else "exited"
        return PodInfo(id=rec["id"], name=rec["name"], state=RUNNING if up else DEAD,
                       raw_state=("serving at its url" if engine == "url" else "running") if up else down,
                       location="local", ip=(rec.get("ip") or "127.0.0.1") if rec.get("port") else None,
                       port=rec.get("port"), cost_per_hr=0.0, gpu="your engine" if engine else "stand-in",
                       market=rec.get("market") or "ondemand", host="local")

    def preempt(self, pod_id: str) -> bool:
        """The host takes an interruptible stand-in back: recorded first (``describe`` says
        ``preempted``), then its process group killed at once. False when it was not running, or is
        not interruptible (an on-demand pod is never preempted)."""
        rec = self._record(pod_id)
        if rec.get("market") != "interruptible" or rec.get("engine") or rec.get("preempted") or not alive(rec["pid"]):
            return False
        self._write(rec["name"], {**rec, "preempted": True})
        if _is_standin(rec["pid"]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec["pid"], signal.SIGKILL)
        return True

    def describe(self, pod_id: str) -> PodInfo:
        return self._info(self._record(pod_id))

    def destroy(self, pod_id: str) -> bool:
        try:
            rec = self._record(pod_id)
        except NotFoundError:
            return False
        pid = rec["pid"]
        # A stand-in, or a command this provider started (never a server the user started: no pid).
        if alive(pid) and (_ours(rec) if rec.get("engine") else _is_standin(pid)):
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
