"""The keeper against a real sandbox cell under load (workerd, two stand-in pods over mutual TLS, the
sandbox's apply as the deployer), in order on one sandbox:

1. a pod that dies (its process killed: the local provider reports it exited, as a cloud API
   reports an exited pod) is replaced alone within two passes, with 0 failed client requests: the
   Worker retries a request its pod failed before answering on the other pod;
2. pods whose certificates are in their last 30 days are renewed one at a time, never more than one
   extra pod running, each new pod serving before the next old one goes, 0 failed requests;
3. `scripts/scale.py run` from another checkout, whose Worker differs from the running one, refuses
   to deploy, names both hashes and exits 3; nothing changed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from colocate import stackfile
from colocate.cell import plan as plan_mod
from colocate.pods.local import alive
from colocate.sandbox import hopcerts, supervisor
from colocate.sandbox.pods import recorded_pods
from colocate.sandbox.scaling import SandboxDeployer
from colocate.scaling.controller import CellClient, Controller
from colocate.scaling.keeper import CERTIFICATE, DEAD, Keeper, days_left
from tests.support.sandbox import Load, load_key, sandbox_stacks
from tests.support.workerd import request

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    base = tmp_path_factory.mktemp("keeper")
    stacks = sandbox_stacks(base / "stacks", compute_ms=20)
    stackfile.write_config("sandbox", {"pod.count": 2, "worker.deadlineMs": 10_000}, stacks)
    state_dir = base / "state"
    # The pods start on a certificate in its last 30 days (day 70 of 90): what the keeper renews in test 2.
    hopcerts.reissue_pod(state_dir, not_after=datetime.now(UTC) + timedelta(days=20))
    try:
        ready = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        yield {"ready": ready, "state_dir": state_dir, "stacks": stacks, "key": load_key(ready)["key"],
               "client": CellClient(ready["worker_url"], ready["token"])}
    finally:
        supervisor.down(state_dir, quiet=True)


def controller(cell) -> Controller:
    deployer = SandboxDeployer("sandbox", cell["state_dir"])
    keeper = Keeper(deployer, plan_mod.modules_hash(plan_mod.worker_modules()), say=lambda line: None)
    return Controller(cell["client"], deployer, None, owner="keeper-test", lock_ttl_s=60, say=lambda line: None,
                      keeper=keeper)


def pods(cell) -> dict[int, dict]:
    return {p["index"]: p for p in recorded_pods(cell["state_dir"])}


class Counter(threading.Thread):
    """The most stand-in processes alive at once (the local provider's records whose process runs)."""

    def __init__(self, state_dir: Path):
        super().__init__(daemon=True)
        self.dir, self.most, self.done = Path(state_dir) / "pods", 0, threading.Event()

    def run(self) -> None:
        # A successor runs beside its predecessor for a whole swap (seconds): 50 ms polls see every overlap.
        while not self.done.wait(0.05):
            n = 0
            for f in self.dir.glob("*.json"):
                try:
                    n += not f.name.endswith(".port.json") and alive(json.loads(f.read_text()).get("pid"))
                except (OSError, ValueError):
                    continue
            self.most = max(self.most, n)


def test_a_dead_pod_is_replaced_alone_within_two_passes_and_no_client_request_fails(cell):
    before = pods(cell)
    ctl = controller(cell)
    # 10 requests a second: the dead pod stays in the Worker's rotation through the replacing apply (seconds), so
    # some requests meet it (the pod_failed lines below) and any the Worker did not retry fail `failures() == []`.
    with Load(cell["ready"]["worker_url"], cell["key"], rate_per_s=10, max_s=120) as load:
        time.sleep(1.0)
        os.killpg(cell["ready"]["pods"][1]["pid"], signal.SIGKILL)  # the stand-in leads its own session
        passes = 0
        while pods(cell)[1]["id"] == before[1]["id"] and passes < 2:
            ctl.step()
            passes += 1
        time.sleep(1.0)  # traffic on the new pod
    ctl.release()
    after = pods(cell)
    assert after[1]["id"] != before[1]["id"] and passes <= 2
    assert after[0]["id"] == before[0]["id"] and alive(cell["ready"]["pods"][0]["pid"])  # alone
    assert load.failures() == [] and len(load.results) >= 20, load.failures()[:5]
    # and requests did meet the dead pod: the Worker logged its failures, and retried each elsewhere
    log = (Path(cell["state_dir"]) / "logs" / "workerd.log").read_text()
    assert any('"event":"pod_failed"' in line and '"pod":1' in line for line in log.splitlines())
    assert {b for _, b, _ in load.results[-10:]} <= {"pod-0", "pod-1"}
    state = cell["client"].state()
    assert (1, DEAD, "replaced") in [(e["pod"], e["reason"], e["outcome"]) for e in state["keeper"]["events"]]
    metrics = request(cell["ready"]["worker_url"], "GET", "/_colocate/metrics",
                      headers={"authorization": f"Bearer {cell['ready']['token']}"}).body.decode()
    assert 'colocate_keeper_replacements_total{pod="1",reason="dead"} 1' in metrics
    for live in (["--live", "--since", "5m"], ["--samples", "3", "--streams", "0"]):  # the live view and the probe
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), "--state-dir", str(cell["state_dir"]),
                            *live, "--json", "-"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        doc = json.loads(r.stdout)
        assert {"pod": 1, "reason": DEAD, "n": 1} in doc["keeper"]["replacements"], r.stderr
        assert "keeper: 2 pod(s) checked" in r.stderr and "last: pod 1 dead replaced" in r.stderr


def test_certificates_in_their_last_30_days_are_renewed_one_pod_at_a_time(cell):
    deployer = SandboxDeployer("sandbox", cell["state_dir"])
    certs = deployer.certificates()
    assert sorted(certs) == ["pod-0", "pod-1"] and all(days_left(e, time.time()) < 30 for e in certs.values())
    before = pods(cell)
    ctl = controller(cell)
    counter = Counter(cell["state_dir"])
    counter.start()
    # 10 a second: each renewal's swap (seconds) is crossed by tens of requests, any of them lost fails below.
    with Load(cell["ready"]["worker_url"], cell["key"], rate_per_s=10, max_s=120) as load:
        for _ in range(3):
            ctl.step()
    counter.done.set()
    counter.join(5)
    ctl.release()
    renewed = [e["pod"] for e in cell["client"].state()["keeper"]["events"]
               if e["reason"] == CERTIFICATE and e["outcome"] == "renewed"]
    assert renewed == [0, 1]  # one a pass, in order; the third pass found nothing due
    after = pods(cell)
    assert all(after[i]["id"] != before[i]["id"] for i in (0, 1))
    assert all(days_left(e, time.time()) > 80 for e in deployer.certificates().values())
    assert counter.most == 3  # two pods and, while one is renewed, its successor: never more
    assert load.failures() == [], load.failures()[:5]


def test_a_controller_from_another_checkout_refuses_to_deploy_and_exits_3(cell, tmp_path):
    other = tmp_path / "checkout"
    for part in ("scripts", "colocate", "worker", "bench"):
        shutil.copytree(ROOT / part, other / part, ignore=shutil.ignore_patterns("__pycache__", "node_modules"))
    (other / "node_modules").symlink_to(ROOT / "node_modules")
    router = other / "worker" / "src" / "router.js"
    router.write_text(router.read_text() + "\n// an older router\n")
    before, stack_file = pods(cell), stackfile.path_of("sandbox", cell["stacks"]).read_text()
    running = cell["client"].state()["worker_hash"]
    r = subprocess.run([sys.executable, str(other / "scripts" / "scale.py"), "run", "--stack", "sandbox", "--sandbox",
                        "--state-dir", str(cell["state_dir"]), "--stacks-dir", str(cell["stacks"]), "--interval", "0.5",
                        "--steps", "3"], capture_output=True, text=True, cwd=other, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert running in r.stdout and "refusing to deploy" in r.stdout and "stale_checkout" in r.stderr
    assert pods(cell) == before and stackfile.path_of("sandbox", cell["stacks"]).read_text() == stack_file
    keeper = cell["client"].state()["keeper"]
    assert [a["name"] for a in keeper["alerts"]] == ["stale_checkout"] and keeper["worker"]["running"] == running
