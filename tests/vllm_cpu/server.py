"""The real engine behind a sandbox cell, once per test run: vLLM's CPU build started by hand as
a user would (``sandbox.py pod-command``'s command: colocate/pods/podstart.sh, the cell's bundle
and pod token, ``PodSpec.serve_args``), with only the model path and ``--load-format dummy``
changed (and, on a CPU without AVX-512, ``--quantization gptq_marlin`` left out: tinymodel.quantized),
and a sandbox cell whose pod is that server (``colocate:pod.url``).

``VLLM_CPU_KVCACHE_SPACE`` is 1 (GiB): without it vLLM's CPU build reserves 21 GB of RAM here.
``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0: the engine runs in vLLM's API server process (docs/testing.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from colocate import stackfile
from colocate.pods.spec import PodSpec
from colocate.sandbox import engine, hopcerts, supervisor
from colocate.sandbox.launch import Launch, build_plan
from colocate.sandbox.statedir import load_secrets

from . import tinymodel, venv as vllm_venv

READY_TIMEOUT_S = 900  # vLLM's first start compiles for about a minute; a loaded machine takes longer
STOP_TIMEOUT_S = 60


@dataclass
class VllmCell:
    ready: dict  # what `sandbox.py up` printed
    state_dir: Path
    stacks_dir: Path
    spec: PodSpec
    port: int  # vLLM's own port (https, mutual TLS)
    token: str  # the pod token
    hop: hopcerts.HopCredentials
    process: subprocess.Popen
    log: Path
    started_s: float  # from the spawn to the cell's `up` returning

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(process: subprocess.Popen, port: int, log: Path, deadline: float) -> float:
    """When vLLM's port took a connection (it listens only once its engine is up); fails at once if vLLM exits."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM exited with {process.returncode} before serving; the end of {log}:\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            return time.monotonic()
        time.sleep(1)
    raise RuntimeError(f"vLLM did not listen within {READY_TIMEOUT_S} s; see {log}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to vLLM's process group (podstart.sh exec'd vLLM: the group is vLLM and its engine), then SIGKILL."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the engine's own processes, if any outlived vLLM
    if process.poll() is None:
        process.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def vllm_cell(directory: Path) -> Iterator[VllmCell]:
    """vLLM started by the printed command, then a sandbox cell in front of it; both stopped on exit."""
    venv = vllm_venv.ensure()
    model = tinymodel.ensure(venv)
    port = _free_port()
    stacks = directory / "stacks"
    stacks.mkdir(parents=True, exist_ok=True)
    stackfile.path_of("sandbox", stacks).write_bytes(stackfile.path_of("sandbox").read_bytes())
    stackfile.write_config("sandbox", {"pod": {"provider": "local", "url": f"https://localhost:{port}",
                                               "readyTimeoutS": READY_TIMEOUT_S}}, stacks)
    state_dir = directory / "state"
    plan, _ = build_plan(Launch("sandbox", str(stacks), None, None, (), False))
    spec = PodSpec.from_dict(plan.pods[0].spec())
    command = engine.vllm_command(state_dir, spec, str(model), ("--load-format", "dummy"))
    if not tinymodel.quantized():  # vLLM's AVX2 kernels have no GPTQ: the model is unquantized, so is its start
        assert " --quantization gptq_marlin " in command, command
        command = command.replace(" --quantization gptq_marlin ", " ")
        print("test-vllm: this CPU has no AVX-512, so vLLM's CPU build has no GPTQ kernel: the tiny model is "
              "unquantized and --quantization gptq_marlin is left out of the kit's start command", file=sys.stderr, flush=True)
    log = directory / "vllm.log"
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}", "VLLM_CPU_KVCACHE_SPACE": "1",
           # The engine in vLLM's own process: on 2 cores its default engine process at times left the
           # API server still until an answer ended (docs/testing.md, "The real engine").
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for var in ("PYTHONPATH", "PYTHONPYCACHEPREFIX", "VIRTUAL_ENV"):  # the kit's, not vLLM's
        env.pop(var, None)
    t0 = time.monotonic()
    with open(log, "ab") as out:
        process = subprocess.Popen(["/bin/sh", "-c", "exec " + command], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=out, start_new_session=True)
    try:
        print(f"test-vllm: vLLM starting on port {port} (log {log})", file=sys.stderr, flush=True)
        listening = _wait_listening(process, port, log, t0 + READY_TIMEOUT_S) - t0
        ready = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        took = time.monotonic() - t0
        print(f"test-vllm: vLLM listened after {listening:.0f} s; the cell was up in front of it after {took:.0f} s",
              file=sys.stderr, flush=True)
        yield VllmCell(ready, state_dir, stacks, spec, port, load_secrets(state_dir)["podToken"], hopcerts.load(state_dir),
                       process, log, took)
    finally:
        with contextlib.suppress(Exception):
            supervisor.down(state_dir, quiet=True)
        stop(process)

