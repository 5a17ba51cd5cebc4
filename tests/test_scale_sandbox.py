"""The scaling controller against a real sandbox cell (workerd, stand-in pods, the sandbox's
apply as the deployer): the signals the sync carries, the lock, a scale-down with streams in
flight, scale to zero and the first request after it, and a controller killed mid-change.
One sandbox for the file; the tests run in order on it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from colocate import stackfile
from colocate.pods.local import alive
from colocate.sandbox import supervisor
from colocate.sandbox.scaling import SandboxDeployer
from colocate.scaling.controller import CellClient, Controller
from colocate.scaling.policy import Policy
from tests.support.sandbox import MODEL, client_key, sandbox_stacks
from tests.support.workerd import request

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
COMPUTE_MS = 1500  # a stream lasts this long: long enough to be in flight while the count changes
SCALE = {"min": 0, "max": 2, "target": 1, "upAfterS": 0, "downAfterS": 3600, "pods": 1}


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    base = tmp_path_factory.mktemp("scale")
    stacks = sandbox_stacks(base / "stacks", compute_ms=COMPUTE_MS)
    stackfile.write_config("sandbox", {"scale": SCALE, "worker.deadlineMs": 10_000}, stacks)
    state_dir = base / "state"
    try:
        ready = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        yield {"ready": ready, "state_dir": state_dir, "stacks": stacks, "key": client_key(ready)["key"],
               "client": CellClient(ready["worker_url"], ready["token"])}
    finally:
        supervisor.down(state_dir, quiet=True)


def chat(cell, stream: bool = False) -> tuple[int, str, bytes]:
    r = request(cell["ready"]["worker_url"], "POST", "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream},
                {"authorization": f"Bearer {cell['key']}"}, timeout=60)
    return r.status, r.headers.get("x-colocate-backend"), r.body


def streams(cell, n: int) -> tuple[list, list[threading.Thread]]:
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(chat(cell, stream=True))) for _ in range(n)]
    for t in threads:
        t.start()
    return out, threads


def poll(read, ok, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    value = read()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def controller(cell, **policy) -> Controller:
    p = Policy(**{"min": 0, "max": 2, "target_rpm": 1, "up_after_s": 0, "down_after_s": 0, **policy})
    return Controller(cell["client"], SandboxDeployer("sandbox", cell["state_dir"]), p, owner="test-controller",
                      lock_ttl_s=30, drain_timeout_s=30, say=lambda line: None)


def pods_on_file(cell) -> list[dict]:
    return json.loads((Path(cell["state_dir"]) / supervisor.PODS_FILE).read_text())["pods"]


def test_the_sync_carries_requests_by_backend_and_in_flight_per_pod(cell):
    before = cell["client"].state()["backends"].get("pod-0", {}).get("requests", 0)
    done, threads = streams(cell, 2)
    busy = poll(cell["client"].state, lambda s: s["inflight"].get("0") == 2)
    assert busy["inflight"] == {"0": 2}, busy
    for t in threads:
        t.join(30)
    assert [s for s, _, _ in done] == [200, 200]
    after = poll(cell["client"].state, lambda s: s["backends"].get("pod-0", {}).get("requests", 0) == before + 2
                 and not s["inflight"])
    assert after["backends"]["pod-0"]["requests"] == before + 2 and after["inflight"] == {}
    assert after["backends"]["pod-0"]["completion_tokens"] > 0


def test_one_controller_holds_the_lock_and_only_it_records(cell):
    a, b = cell["client"], CellClient(cell["ready"]["worker_url"], cell["ready"]["token"])
    granted, lock = a.lock("a", 30)
    assert granted and lock["owner"] == "a"
    granted, renewed = a.lock("a", 30)  # its holder renews it
    assert granted and renewed["since"] == lock["since"] and renewed["until"] >= lock["until"]
    granted, lock = b.lock("b", 30)
    assert not granted and lock["owner"] == "a"
    decision = {"desired": 1, "running": 1, "reason": "test"}
    assert not b.record("b", decision)
    assert a.record("a", decision)
    assert cell["client"].state()["decision"]["owner"] == "a"
    a.lock("a", 0, release=True)
    assert b.lock("b", 30)[0]
    b.lock("b", 0, release=True)
    # a client key opens nothing here; the read token reads the signals but cannot take the lock
    r = request(cell["ready"]["worker_url"], "POST", "/_colocate/scale/lock", {"owner": "x", "ttl_ms": 1000},
                {"authorization": f"Bearer {cell['key']}"})
    assert r.status == 401
    reader = CellClient(cell["ready"]["worker_url"], cell["ready"]["read_token"])
    assert "backends" in reader.state()
    r = request(cell["ready"]["worker_url"], "POST", "/_colocate/scale/lock", {"owner": "x", "ttl_ms": 1000},
                {"authorization": f"Bearer {cell['ready']['read_token']}"})
    assert r.status == 403


def test_scale_down_drains_streams_in_flight_and_cuts_none(cell):
    deployer = SandboxDeployer("sandbox", cell["state_dir"])
    deployer.deploy(2, 0)
    assert [p["index"] for p in pods_on_file(cell)] == [0, 1]
    done, threads = streams(cell, 6)
    poll(cell["client"].state, lambda s: s["inflight"].get("1", 0) > 0)
    ctl = controller(cell, min=1)
    ctl.observe()
    time.sleep(0.3)
    decision = ctl.step()
    assert decision.desired == 1 and "down from 2" in decision.reason
    for t in threads:
        t.join(30)
    assert len(done) == 6 and all(s == 200 and body.rstrip().endswith(b"data: [DONE]") for s, _, body in done), done
    assert {b for _, b, _ in done} == {"pod-0", "pod-1"}  # the drained pod was serving streams when it left
    assert [p["index"] for p in pods_on_file(cell)] == [0]
    assert deployer.declared() == (1, 0)
    recorded = cell["client"].state()["decision"]
    assert (recorded["desired"], recorded["running"], recorded["owner"]) == (1, 1, "test-controller")
    ctl.release()


def test_scale_to_zero_then_the_first_request_is_served_and_demand_brings_a_pod_back(cell):
    ctl = controller(cell)
    ctl.observe()
    time.sleep(0.3)
    assert ctl.step().desired == 0
    assert pods_on_file(cell) == [] and cell["client"].state()["routed_pods"] == 0
    status, backend, _ = chat(cell)
    assert (status, backend) == (200, "fallback")
    shown = supervisor.status(cell["state_dir"])["scale"]
    assert (shown["desired"], shown["running"]) == (0, 0) and "down from 1" in shown["reason"]
    live = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), "--live", "--state-dir", str(cell["state_dir"]),
                           "--json", "-", "--warn-only"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert live.returncode == 0, live.stderr
    assert "scale: desired 0, running 0, routed 0" in live.stderr
    assert (json.loads(live.stdout)["scale"]["desired"], json.loads(live.stdout)["scale"]["owner"]) == (0, "test-controller")
    ctl.observe()
    for _ in range(3):
        assert chat(cell)[0] == 200
    poll(cell["client"].state, lambda s: s["backends"].get("fallback", {}).get("requests", 0) >= 4)
    decision = ctl.step()
    assert decision.desired >= 1 and "up from 0" in decision.reason
    status, backend, _ = chat(cell)
    assert status == 200 and backend.startswith("pod-")
    assert len(pods_on_file(cell)) == decision.desired
    ctl.release()


def local_pod_records(cell) -> list[str]:
    """The local provider's own record of every stand-in it started and has not deleted (what sweep reads)."""
    d = Path(cell["state_dir"]) / "pods"
    return sorted(p.name for p in d.glob("*.json") if not p.name.endswith(".port.json"))


def test_a_controller_killed_mid_change_leaves_the_cell_serving_and_nothing_orphaned(cell):
    SandboxDeployer("sandbox", cell["state_dir"]).deploy(2, 0)
    stackfile.write_config("sandbox", {"scale.min": 1, "scale.downAfterS": 0, "scale.target": 1000}, cell["stacks"])
    done, threads = streams(cell, 4)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "scale.py"), "run", "--stack", "sandbox", "--sandbox",
                             "--state-dir", str(cell["state_dir"]), "--stacks-dir", str(cell["stacks"]), "--interval", "0.5",
                             "--drain-timeout", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            start_new_session=True)
    try:  # killed as soon as it has asked for the drain: pod 1 is leaving rotation, not yet deleted
        draining = poll(lambda: stackfile.read_config("sandbox", cell["stacks"])[0]["scale"].get("draining"),
                        lambda d: d == 1, timeout_s=30)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert draining == 1
    for t in threads:
        t.join(30)
    assert all(s == 200 and body.rstrip().endswith(b"data: [DONE]") for s, _, body in done), done
    # the cell serves, and the pods that run are the ones on file, both still alive
    assert chat(cell)[0] == 200
    assert [p["index"] for p in pods_on_file(cell)] == [0, 1] and len(local_pod_records(cell)) == 2
    st = supervisor.status(cell["state_dir"])
    pod1 = st["pids"]["pod-1"]
    assert st["healthy"] and alive(pod1)
    # the dead controller's lease blocks another until it expires; then the next one finishes the drain
    assert cell["client"].state()["lock"]["owner"] != "test-controller"
    ctl = controller(cell, min=1, down_after_s=3600)
    assert ctl.step() is None  # not its turn
    poll(lambda: cell["client"].state()["lock"], lambda lk: lk is None, timeout_s=20)
    assert ctl.step().desired == 1
    ctl.release()
    assert [p["index"] for p in pods_on_file(cell)] == [0] and len(local_pod_records(cell)) == 1
    assert SandboxDeployer("sandbox", cell["state_dir"]).declared() == (1, 0)
    assert poll(lambda: alive(pod1), lambda a: not a, timeout_s=10) is False
    assert chat(cell)[0] == 200


def test_the_desired_count_is_the_lock_holders_and_bounded(cell):
    """Last in this file: it leaves a desired count recorded. Only the holder writes it, 0 to 8 pods in all."""
    a, b = cell["client"], CellClient(cell["ready"]["worker_url"], cell["ready"]["token"])
    assert a.lock("a", 30)[0]
    decision = {"desired": 1, "running": 1, "reason": "test"}
    assert not b.record("b", decision, (2, 0))
    assert a.record("a", decision, (1, 1))
    desired = cell["client"].state()["desired"]
    assert (desired["pods"], desired["draining"], desired["owner"]) == (1, 1, "a")
    for bad in ({"pods": 9, "draining": 0}, {"pods": 5, "draining": 4}, {"pods": -1, "draining": 0}, {"pods": "2"}):
        r = request(cell["ready"]["worker_url"], "POST", "/_colocate/scale",
                    {"owner": "a", "decision": decision, "desired": bad},
                    {"authorization": f"Bearer {cell['ready']['token']}"})
        assert r.status == 400 and b"invalid_desired" in r.body, bad
    a.lock("a", 0, release=True)
