"""Ctrl-C at any moment of `sandbox.py up`, `apply` and `demo`.

Each test sends SIGINT to the command's process group (what a terminal does) after a delay
from a bounded sweep, then checks what is true afterwards, not what the command said: no
process of the sandbox runs (every one of them names the state directory on its command line:
runner, launcher, workerd, fallback, pod), the state directory's lock is free, no pod is left
recorded, and what the command printed agrees with that, without a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.sandbox import supervisor
from tests.support.sandbox import sandbox_stacks

ROOT = Path(__file__).resolve().parent.parent
SANDBOX = [sys.executable, str(ROOT / "scripts" / "sandbox.py")]
# sandbox.py's line that installs its SIGINT handler: a KeyboardInterrupt can only be raised in
# it up to there (then the command holds the signal and exits 130 after loading)
HANDLER_LINE = next(n for n, line in enumerate((ROOT / "scripts" / "sandbox.py").read_text().splitlines(), 1)
                    if line.startswith("_loading = _signal.signal("))
pytestmark = pytest.mark.slow

# `up` takes about a second here: loading, the launcher, the runner's imports, the pod, the
# fallback, workerd, the demo key. The sweep covers that whole window, and a little after.
UP_DELAYS = (0.0, 0.03, 0.08, 0.15, 0.25, 0.35, 0.5, 0.7, 0.9, 1.2)
APPLY_DELAYS = (0.05, 0.3, 0.8)
# The demo's first step (fresh state, up) takes a second or two; later steps are deploys
# (apply) and probes, covered by the apply sweep.
DEMO_DELAYS = (0.2, 0.6, 1.0, 1.4, 2.5)


def sandbox_processes(state_dir: Path) -> list[str]:
    """Every live process whose command line names the state directory (ours excluded)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(state_dir) in cmd and state != "Z":
            found.append(f"{pid}: {cmd[:160]}")
    return found


def _listeners(ports: set[int]) -> dict[int, set[str]]:
    """The given ports that something listens on (from /proc/net/tcp{,6}), each with the
    socket inodes listening there."""
    out: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and port in ports:  # 0A = LISTEN
                out.setdefault(port, set()).add(fields[9])
    return out


def _owners(inodes: set[str]) -> list[str]:
    """The pids whose open files include one of these sockets."""
    links = {f"socket:[{i}]" for i in inodes}
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in links:
                    found.append(pid)
                    break
            except OSError:
                continue
    return found


def _names(pid: str, state_dir: Path) -> bool:
    """Whether the process's command line or environment names the state directory (a local
    pod has it in COLOCATE_STATE_DIR)."""
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return str(state_dir).encode() in text


def _listening(ports: set[int], state_dir: Path) -> set[int]:
    """The given ports still listened on by a process of this sandbox. The suite's other
    workers bind port 0 all the time, so a port the sandbox released may already be another
    test's: a listener whose every owner names another directory is not ours. One whose owner
    cannot be found yet (exiting) counts until the bounded wait ends."""
    deadline = time.monotonic() + 5
    while True:
        ours = set()
        for port, inodes in _listeners(ports).items():
            owners = _owners(inodes)
            if not owners or any(_names(pid, state_dir) for pid in owners):
                ours.add(port)
        if not ours or time.monotonic() > deadline:
            return ours
        time.sleep(0.2)


def interrupt(argv: list[str], delay: float, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the "terminal" we press Ctrl-C in
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):  # it had finished already
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _only_python_start_up(stderr: str) -> bool:
    """Every traceback in stderr is Python's report of a KeyboardInterrupt raised while the
    interpreter was still starting (site, importlib, encodings, .pth files, with whatever they
    were handling; sandbox.py only up to the line that installs its handler): no other frame
    of our code."""
    if "Traceback" not in stderr:
        return True
    ours = [line for line in stderr.splitlines()
            if line.strip().startswith(f'File "{ROOT}/') and "/site-packages/" not in line
            and not (line.strip().startswith(f'File "{SANDBOX[1]}", line ')
                     and int(line.split(", line ", 1)[1].split(",", 1)[0]) <= HANDLER_LINE)]
    return ours == [] and "KeyboardInterrupt" in stderr


def python_was_starting(res: subprocess.CompletedProcess) -> bool:
    """The signal landed while the interpreter itself was starting, before sandbox.py's first
    line could install a handler: no script can act in that window. Python then dies of the
    signal (-2, silent) or prints its own "KeyboardInterrupt" report and exits 1 (or -2). This
    is a legitimate outcome: nothing of ours ran, so nothing may be running (the caller checks)."""
    if res.stdout != "":
        return False
    if res.returncode == -signal.SIGINT and res.stderr == "":
        return True
    return (res.returncode in (1, -signal.SIGINT) and res.stderr.rstrip().endswith("KeyboardInterrupt")
            and _only_python_start_up(res.stderr))


def assert_no_traceback_of_ours(res: subprocess.CompletedProcess) -> None:
    """No traceback, except Python's own report of a signal during its start-up (which it may
    also print and then carry on, when the KeyboardInterrupt lands in an ignored callback)."""
    assert "Traceback" not in res.stdout, res.stdout
    assert _only_python_start_up(res.stderr), res.stderr


def _assert_nothing_left(state_dir: Path, ports: set[int] = frozenset()) -> None:
    assert not supervisor.is_running(state_dir), "the state directory's lock is still held"
    deadline = time.monotonic() + 10  # a process killed a moment ago may still be exiting
    while sandbox_processes(state_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes(state_dir) == []
    assert not (state_dir / "pod.json").exists()
    pods = state_dir / "pods"
    assert not pods.exists() or not [p for p in pods.glob("*.json") if not p.name.endswith(".port.json")]
    assert _listening(set(ports), state_dir) == set()


def _ports_of(cell: dict) -> set[int]:
    return {*cell["ports"].values(), int(cell["pod_url"].rsplit(":", 1)[1]),
            int(cell["fallback_url"].rsplit(":", 1)[1])}


@pytest.fixture
def stacks(tmp_path):
    return sandbox_stacks(tmp_path / "stacks", compute_ms=5)


@pytest.mark.parametrize("delay", UP_DELAYS)
def test_ctrl_c_at_any_moment_of_up_leaves_nothing_running(stacks, tmp_path, delay):
    state_dir = tmp_path / "state"
    try:
        res = interrupt(SANDBOX + ["up", "--state-dir", str(state_dir), "--stacks-dir", str(stacks)], delay)
        ports: set[int] = set()
        if python_was_starting(res):
            pass  # Python's own outcome, before our first line; nothing of ours ran (checked below)
        elif res.returncode == 0 or res.stdout.lstrip().startswith("{"):
            # it was up before the signal landed (the JSON is out; the signal may still end the
            # process on its way out): a normal, running cell
            cell = json.loads(res.stdout)
            assert supervisor.status(state_dir)["healthy"] is True
            ports = _ports_of(cell)
            supervisor.down(state_dir, quiet=True)
        elif res.returncode == 130:
            assert ("nothing it started is running" in res.stderr or "before doing anything" in res.stderr), res.stderr
            assert res.stdout == ""  # no JSON for a cell that does not run
        else:
            pytest.fail(f"exit {res.returncode}, neither up nor a clean interruption: {res.stderr[-2000:]}")
        assert_no_traceback_of_ours(res)
        _assert_nothing_left(state_dir, ports)
    finally:
        supervisor.stop_runner(state_dir, timeout_s=30)
        supervisor.down(state_dir, quiet=True)


@pytest.mark.parametrize("delay", APPLY_DELAYS)
def test_ctrl_c_during_apply_keeps_the_cell_consistent_and_down_stops_all(stacks, tmp_path, delay):
    """Interrupting a deploy is like interrupting `pulumi up`: the running cell is not torn
    down, and the command says so truthfully; the deploy finishes or fails in the runner with
    one pod serving, and `down` afterwards leaves nothing, including the replaced pod."""
    from colocate import stackfile

    state_dir = tmp_path / "state"
    try:
        cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        before = _ports_of(cell)
        stackfile.write_config("sandbox", {"region": "apac-tw"}, stacks)  # a new pod, in Taipei
        res = interrupt(SANDBOX + ["apply", "--state-dir", str(state_dir), "--stacks-dir", str(stacks),
                                    "--force-split"], delay)
        assert_no_traceback_of_ours(res)
        if not python_was_starting(res):  # if it was, no request was sent: nothing changes
            assert res.returncode in (0, 130), res.stderr
        if res.returncode == 130:
            assert ("still runs" in res.stderr and "status" in res.stderr) or "before doing anything" in res.stderr, \
                res.stderr
        # The runner finishes the deploy it was handed (revision 2, or a recorded failure with
        # the previous version serving); if the signal came before the hand-over, nothing changes.
        handed = res.returncode == 0 or "handed to its runner" in res.stderr
        if handed:
            settle = time.monotonic() + 60
            while time.monotonic() < settle:
                ready = json.loads((state_dir / "ready.json").read_text())
                if ready["revision"] == 2 or (state_dir / "apply-failed.json").exists():
                    break
                time.sleep(0.2)
        else:
            time.sleep(1)  # a deploy wrongly started would be under way by now
            assert json.loads((state_dir / "ready.json").read_text())["revision"] == 1, res.stderr
        # then exactly one cell serves
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not supervisor.status(state_dir).get("healthy"):
            time.sleep(0.2)
        st = supervisor.status(state_dir)
        assert st["healthy"] is True, json.dumps({k: st.get(k) for k in ("health", "pids", "pod_url")})
        ready = json.loads((state_dir / "ready.json").read_text())
        supervisor.down(state_dir, quiet=True)
        _assert_nothing_left(state_dir, before | _ports_of(ready))
    finally:
        supervisor.down(state_dir, quiet=True)


@pytest.mark.parametrize("delay", DEMO_DELAYS)
def test_ctrl_c_during_demo_leaves_nothing_running(tmp_path, delay):
    state_dir = tmp_path / "demo"
    try:
        res = interrupt(SANDBOX + ["demo", "--state-dir", str(state_dir), "--samples", "2"], delay, timeout=300)
        assert_no_traceback_of_ours(res)
        if not python_was_starting(res):
            assert res.returncode in (0, 1, 2, 130), res.stderr  # 1, 2: a step failed before the signal
        if res.returncode == 130:
            assert "nothing it started is running" in res.stderr or "before doing anything" in res.stderr, res.stderr
        _assert_nothing_left(state_dir)
    finally:
        supervisor.stop_runner(state_dir, timeout_s=30)
        supervisor.down(state_dir, quiet=True)
