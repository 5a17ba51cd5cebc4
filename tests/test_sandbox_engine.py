"""Any OpenAI-compatible server as the sandbox's pod (colocate:pod.command / .url, docs/sandbox.md
"Your own engine"): given what a cloud pod gets (the pod token, the cloud's certificate bundle),
waited for by readiness, and seen by status, the probe and down. Here the server is the stand-in
run as a command or by hand; tests/vllm_cpu/ does the same with vLLM started by the printed command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from colocate import stackfile
from colocate.errors import ConfigError
from colocate.pods import podtls
from colocate.pods.local import alive
from colocate.sandbox import engine, supervisor
from tests.support.sandbox import MODEL, client_key, sandbox_stacks
from tests.test_plan import SECRETS, raw_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
# The stand-in as a user's server: it takes the token as POD_TOKEN and serves TLS from COLOCATE_POD_TLS.
# The stand-in reads COLOCATE_POD_TLS back from /proc/self/environ, as vLLM's flags do, where variables
# ahead of it can hide it from OpenSSL (colocate/pods/podtls.py); a shell passes its environment on in
# its own order (dash: by hash), so the command puts the bundle first itself (`env -i`, in this order),
# as podstart.sh's files spare vLLM. Without it the stand-in lost the bundle ("PEM lib") on a fresh clone.
STANDIN = (f'exec env -i COLOCATE_POD_TLS="$COLOCATE_POD_TLS" VLLM_API_KEY="$VLLM_API_KEY" POD_TOKEN="$VLLM_API_KEY" '
           f'PATH="$PATH" PYTHONPATH={ROOT} PYTHONPYCACHEPREFIX="$PYTHONPYCACHEPREFIX" {sys.executable} -m colocate.pods.standin '
           f'--host "$COLOCATE_POD_HOST" --port "$COLOCATE_POD_PORT" --model {MODEL} --compute-ms 5')


def chat(ready: dict, key: str) -> tuple[int, str]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(ready["worker_url"] + "/v1/chat/completions", data=body, method="POST",
                                 headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers["x-colocate-backend"]


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    yield d
    supervisor.down(d, quiet=True)


def stacks_with(tmp_path, **pod) -> Path:
    d = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    stackfile.write_config("sandbox", {"pod": {"provider": "local", "readyTimeoutS": 60, **pod}}, d)
    return d


def sandbox_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)


def test_a_pod_command_serves_the_cell_and_down_stops_it(tmp_path, state_dir):
    stacks = stacks_with(tmp_path, command=STANDIN)
    ready = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    pid = ready["pids"]["pod"]
    assert alive(pid) and ready["pods"][0]["url"].startswith("https://localhost:")
    # What it was given: the cloud's bundle (no readiness CA: readiness was refused in the handshake, as vLLM
    # refuses it, and took that for serving), the token, where to serve.
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert any(v.startswith(b"VLLM_API_KEY=") for v in environ) and not any(v.startswith(b"POD_TLS=") for v in environ)
    log = (state_dir / "logs" / "pod.log").read_text()
    assert "serving (it refused the readiness certificate" in log, log[-2000:]
    key = client_key(ready)["key"]
    assert chat(ready, key) == (200, "pod-0")
    where = ["--stack", "sandbox", "--state-dir", str(state_dir), "--stacks-dir", str(stacks)]
    status = sandbox_cli("status", *where[:4])
    assert status.returncode == 0 and json.loads(status.stdout)["healthy"] is True, status.stderr
    probe = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), ready["worker_url"], "--token",
                            ready["read_token"], "--key", key, "--samples", "2", "--model", MODEL, "--json",
                            str(tmp_path / "p.json")],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert probe.returncode in (0, 1), probe.stderr  # budgets are the emulation's business; the probe ran
    probed = json.loads((tmp_path / "p.json").read_text())
    pod = probed["pods"][0]  # the Worker's own check of the pod, with the pod token through the guard
    assert pod["checks"] > 0 and pod["healthy"] == pod["checks"] and set(pod["statuses"]) == {"200"}, pod
    down = sandbox_cli("down", *where[:4])
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_a_server_the_user_runs_is_waited_for_served_and_never_stopped(tmp_path, state_dir):
    port = _free_port()
    stacks = stacks_with(tmp_path, url=f"https://localhost:{port}")
    made = engine.files(state_dir, mtls=True)  # what `sandbox.py pod-command` writes and prints the way to
    printed = sandbox_cli("pod-command", "--stack", "sandbox", "--state-dir", str(state_dir), "--stacks-dir", str(stacks))
    assert printed.returncode == 0, printed.stderr
    command = printed.stdout.strip()
    assert "colocate/pods/podstart.sh" in command and f"--port {port}" in command and "--host localhost" in command
    assert str(made["tls"]) in command and str(made["token"]) in command and "PRIVATE KEY" not in command
    assert oct(made["tls"].stat().st_mode & 0o777) == "0o600" and oct(made["tls"].parent.stat().st_mode & 0o777) == "0o700"
    # The user starts their server with those files (here the stand-in, as vLLM would be started by the command).
    # COLOCATE_POD_TLS first: OpenSSL reads it back from /proc/self/environ, where variables before it can hide it
    env = podtls.environment(made["tls"].read_text(), {**os.environ, "POD_TOKEN": made["token"].read_text(),
                                                        "PYTHONPATH": str(ROOT)})
    server = subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port", str(port), "--model", MODEL,
                               "--compute-ms", "5"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        ready = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        assert "pod" not in ready["pids"]  # not the sandbox's process
        assert chat(ready, client_key(ready)["key"]) == (200, "pod-0")
        assert supervisor.status(state_dir)["healthy"] is True
        supervisor.down(state_dir, quiet=True)
        assert server.poll() is None  # down never stops a server the user started
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)


def test_the_keeper_never_replaces_a_server_the_user_runs_when_it_is_down_or_unrecorded(tmp_path, state_dir):
    """The user's server stops: the Worker's health check fails, which on a pod the kit started means a
    replacement after two passes. This one the keeper did not start and cannot start again: it says
    `down` and replaces nothing, pass after pass, nor when the sandbox's record of it is lost (for a
    pod the kit started, `gone`: replaced at once). Back up, it is `ok` again."""
    from colocate.cell import plan as plan_mod
    from colocate.sandbox.pods import recorded_pods
    from colocate.sandbox.scaling import SandboxDeployer
    from colocate.scaling.controller import CellClient, Controller
    from colocate.scaling.keeper import DOWN, OK, Keeper

    port = _free_port()
    stacks = stacks_with(tmp_path, url=f"https://localhost:{port}", readyTimeoutS=30)
    made = engine.files(state_dir, mtls=True)
    # COLOCATE_POD_TLS first: OpenSSL reads it back from /proc/self/environ, where variables before it can hide it
    env = podtls.environment(made["tls"].read_text(), {**os.environ, "POD_TOKEN": made["token"].read_text(),
                                                        "PYTHONPATH": str(ROOT)})

    def serve() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port", str(port), "--model", MODEL,
                                 "--compute-ms", "5"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    def stop(server: subprocess.Popen) -> None:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)

    server = serve()
    try:
        ready = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        before = recorded_pods(state_dir)
        client = CellClient(ready["worker_url"], ready["token"])
        lines: list[str] = []
        keeper = Keeper(SandboxDeployer("sandbox", state_dir), plan_mod.modules_hash(plan_mod.worker_modules()),
                        say=lines.append)
        ctl = Controller(client, keeper.deployer, None, owner="keeper-test", lock_ttl_s=60, say=lines.append, keeper=keeper)
        stop(server)
        for _ in range(3):  # one more than a pod the kit started is given
            ctl.step()
        (state_dir / "pods" / f"{before[0]['name']}.json").unlink()  # the sandbox's record of it, lost
        ctl.step()
        kept = client.state()["keeper"]
        assert [v["state"] for v in kept["pods"]] == [DOWN], kept["pods"]
        assert f"localhost:{port}" in kept["pods"][0]["detail"] or f"127.0.0.1:{port}" in kept["pods"][0]["detail"]
        assert "replaces no server it did not start" in kept["pods"][0]["detail"]
        assert kept["events"] == [] and not any("replacing" in line for line in lines), (kept["events"], lines)
        assert [p["id"] for p in recorded_pods(state_dir)] == [p["id"] for p in before]
        assert "replaced" not in (stackfile.read_config("sandbox", stacks)[0].get("pod") or {})
        server = serve()
        deadline = time.monotonic() + 30
        while client.probe()["pods"][0].get("ok") is not True and time.monotonic() < deadline:
            time.sleep(0.2)
        ctl.step()
        ctl.release()
        assert [v["state"] for v in client.state()["keeper"]["pods"]] == [OK]
    finally:
        if server.poll() is None:
            stop(server)


def test_a_server_that_never_serves_fails_up_within_its_ready_timeout(tmp_path, state_dir):
    stacks = stacks_with(tmp_path, command="exec sleep 600", readyTimeoutS=1)  # the least it takes: it never serves
    with pytest.raises(supervisor.StartupFailed):
        supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    records = [json.loads(p.read_text()) for p in (state_dir / "pods").glob("*.json") if not p.name.endswith(".port.json")]
    assert records == []  # the command was stopped and forgotten
    log = (state_dir / "logs" / "pod.log").read_text()
    assert "not ready after 1s" in log


@pytest.mark.parametrize("pod,problem", [
    ({"provider": "runpod", "command": "vllm serve x"}, "only the sandbox does"),
    ({"provider": "local", "url": "https://10.0.0.5:8000"}, "must be on this machine"),
    ({"provider": "local", "url": "localhost:8000"}, "scheme, host and port"),
    ({"provider": "local", "url": "https://localhost:8000/v1"}, "scheme, host and port"),
])
def test_an_engine_setting_that_cannot_work_is_refused_naming_the_key(pod, problem):
    from colocate.cell import plan, settings

    raw = raw_for()
    raw["pod"] = pod
    with pytest.raises(ConfigError, match=problem) as err:
        plan.plan_cell(settings.parse(raw, "t", secrets=SECRETS))
    assert "colocate:pod." in str(err.value)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
