"""`sandbox.py up --fleet`: every member cell and the front door on this machine
(`make demo-fleet`: tests/test_sandbox_fleet_demo.py).

One fleet (apac-jp, eu-west, us-east from copies of the committed stack files, pods at 5 ms) is
started once for the module through the CLI; its tests read what a user at each client site
sees. Bad input and Ctrl-C use directories of their own and check the machine afterwards: no
process names their directory, no lock is held.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from colocate import stackfile
from colocate.cell.catalogue import region
from colocate.fleet import plan as fleet_cfg
from colocate.sandbox import fleet, supervisor
from tests.support.sandbox import MODEL
from tests.test_sandbox_signals import assert_no_traceback_of_ours, interrupt, python_was_starting, sandbox_processes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SANDBOX = [sys.executable, str(ROOT / "scripts" / "sandbox.py")]
CELLS = ("apac-jp", "eu-west", "us-east")
SITES = ("NRT", "FRA", "IAD")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
OUT_KEYS = {"fleet", "state_dir", "entries", "cells", "key", "key_id", "pids"}


def fleet_stacks(directory: Path, compute_ms: int = 5, cells: tuple[str, ...] = CELLS) -> Path:
    """Copies of the committed fleet stack and its cells, on the oracle pod (every answer in ``compute_ms``)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stackfile.path_of("fleet"), stackfile.path_of("fleet", directory))
    for cell in cells:
        shutil.copyfile(stackfile.path_of(cell), stackfile.path_of(cell, directory))
        stackfile.write_config(cell, {"pod.profile": "oracle", "pod.computeMs": compute_ms}, directory)
    return directory


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*SANDBOX, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def call(url: str, key: str, headers: dict | None = None) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json=BODY, timeout=30,
                         headers={"authorization": f"Bearer {key}", **(headers or {})})


def assert_nothing_runs(root: Path) -> None:
    deadline = time.monotonic() + 10  # a process killed a moment ago may still be exiting
    while sandbox_processes(root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes(root) == []
    for d in (root.iterdir() if root.exists() else []):
        if d.is_dir():
            assert not supervisor.is_running(d), d
            assert not fleet.front_running(d), d


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet")
    stacks = fleet_stacks(base / "stacks")
    sandboxes = base / "sandboxes"
    where = ["--fleet", "fleet", "--state-dir", str(sandboxes / "fleet")]
    res = cli("up", "--fleet", "fleet", "--stacks-dir", str(stacks), "--sandboxes-dir", str(sandboxes),
              *(a for s in SITES for a in ("--client-site", s)))
    try:
        assert res.returncode == 0, res.stderr[-3000:]
        yield {"out": json.loads(res.stdout), "stderr": res.stderr, "stacks": stacks, "sandboxes": sandboxes,
               "where": where}
    finally:
        fleet.down(sandboxes / "fleet")


def test_up_prints_one_json_object_and_writes_it_to_fleet_json(running):
    out = running["out"]
    assert set(out) == OUT_KEYS
    assert out["fleet"] == "fleet"
    assert set(out["entries"]) == set(SITES)
    assert [c["name"] for c in out["cells"]] == list(CELLS)
    for c in out["cells"]:
        assert set(c) == {"name", "stack", "region", "worker_url", "state_dir", "edge_site"}
        assert c["edge_site"] == region(c["region"]).edge_site
        assert Path(c["state_dir"]) == running["sandboxes"] / c["name"]
    assert out["key"].startswith("clc_") and out["key_id"].startswith("key_")
    assert all(isinstance(p, int) and p > 0 for p in out["pids"].values())
    assert {"front-runner", "front-workerd", "apac-jp-pod", "us-east-workerd"} <= set(out["pids"])
    path = Path(out["state_dir"]) / "fleet.json"
    assert json.loads(path.read_text()) == out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the key
    assert "serves at" in running["stderr"] and out["key"] in running["stderr"]


def test_each_entry_is_served_by_its_nearest_cell(running):
    out = running["out"]
    regions = [region(c["region"]) for c in out["cells"]]
    for s in SITES:
        nearest = out["cells"][fleet_cfg.rank(s, regions)[0]]["name"]
        res = call(out["entries"][s], out["key"])
        assert res.status_code == 200, res.text
        assert res.headers["x-colocate-cell"] == nearest
        assert res.headers["x-colocate-backend"] == "pod-0"
        assert res.headers["server-timing"].startswith("front;dur=")
    assert [out["cells"][fleet_cfg.rank(s, regions)[0]]["name"] for s in SITES] == list(CELLS)


def test_a_client_cannot_choose_its_colo(running):
    """cf-blob is the edge's to set: the entry drops a client's own."""
    out = running["out"]
    res = call(out["entries"]["NRT"], out["key"], {"cf-blob": json.dumps({"colo": "IAD"})})
    assert res.status_code == 200 and res.headers["x-colocate-cell"] == "apac-jp"


def test_the_fleet_key_works_through_every_entry_with_the_openai_client(running, openai_client):
    import openai
    out = running["out"]
    for s in SITES:
        client = openai_client(out["entries"][s] + "/v1", out["key"], timeout=60)
        done = client.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert done.parse().choices[0].message.content
        assert done.headers["x-colocate-cell"] in CELLS
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert client.models.list().data
        bad = openai_client(out["entries"][s] + "/v1", "clc_" + "x" * 32, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_keys_py_sees_one_fleet_key_in_every_cell(running):
    """The key was made the way `keys.py create --stack <fleet>` makes one; the demo key each
    cell's own `up` made is revoked, so the cells agree."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "keys.py"), "list", "--stack", "fleet", "--stacks-dir",
                          str(running["stacks"]), "--sandboxes-dir", str(running["sandboxes"]), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    active = [k for k in json.loads(res.stdout)["keys"] if set(k["cells"].values()) == {"active"}]
    assert [k["id"] for k in active] == [running["out"]["key_id"]]


def test_status_is_healthy(running):
    res = cli("status", *running["where"])
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["healthy"] is True and st["problems"] == []
    assert [c["name"] for c in st["cells"]] == list(CELLS) and all(c["healthy"] for c in st["cells"])
    assert st["entry_status"] == {s: 200 for s in SITES}


def test_apply_redeploys_every_cell_and_the_front_door(running):
    before = json.loads((Path(running["out"]["state_dir"]) / "front.json").read_text())["revision"]
    res = cli("apply", *running["where"], "--stacks-dir", str(running["stacks"]))
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["front"]["revision"] == before + 1
    assert [c["revision"] for c in out["cells"]] == [2, 2, 2]
    assert call(running["out"]["entries"]["FRA"], running["out"]["key"]).headers["x-colocate-cell"] == "eu-west"


def test_a_cell_without_pods_is_named_by_status_and_its_users_go_to_the_next_cell(running):
    out = running["out"]
    ready = json.loads((Path(out["cells"][2]["state_dir"]) / "ready.json").read_text())
    for p in ready["pods"]:
        os.kill(p["pid"], signal.SIGKILL)
    served = [call(out["entries"]["IAD"], out["key"]) for _ in range(4)]
    assert [r.status_code for r in served] == [200] * 4
    assert {r.headers["x-colocate-cell"] for r in served} == {"eu-west"}  # IAD's next nearest
    assert {r.headers["x-colocate-backend"] for r in served} == {"pod-0"}  # a pod, not the fallback
    res = cli("status", *running["where"])
    assert res.returncode == 1
    assert "UNHEALTHY" in res.stderr and "cell us-east" in res.stderr
    assert "cell apac-jp" not in res.stderr


def test_a_second_up_as_asked_succeeds_and_one_asking_otherwise_is_refused_naming_down(running):
    status = cli("status", *running["where"]).returncode  # whatever earlier tests left: unchanged below
    same = cli("up", "--fleet", "fleet", "--stacks-dir", str(running["stacks"]), "--sandboxes-dir",
               str(running["sandboxes"]), *(a for s in SITES for a in ("--client-site", s)))
    assert same.returncode == 0 and json.loads(same.stdout) == running["out"], same.stderr
    assert same.stderr.count("\n") == 1 and "already runs in" in same.stderr and "nothing started" in same.stderr
    res = cli("up", "--fleet", "fleet", "--stacks-dir", str(running["stacks"]), "--sandboxes-dir",
              str(running["sandboxes"]))  # other client sites than it runs with
    assert res.returncode == 2 and "already runs" in res.stderr and "down --fleet fleet" in res.stderr, res.stderr
    assert cli("status", *running["where"]).returncode == status  # nothing changed
    assert call(running["out"]["entries"]["NRT"], running["out"]["key"]).headers["x-colocate-cell"] == "apac-jp"


def test_a_cell_scaled_to_zero_sends_its_users_to_the_next_cell_and_a_pod_brings_them_home(running):
    """colocate:scale on us-east (docs/pods.md "Scaling with demand"): the controller's deployer
    takes the cell to zero pods, then back to one; state never moves, only pods."""
    from colocate.sandbox.scaling import SandboxDeployer

    out = running["out"]
    deployer = SandboxDeployer("us-east", Path(out["cells"][2]["state_dir"]))
    stackfile.write_config("us-east", {"scale": {"min": 0, "max": 1}}, deployer.stacks_dir)  # the cell's own stack file
    deployer.deploy(0, 0)
    served = [call(out["entries"]["IAD"], out["key"]) for _ in range(4)]
    assert [r.status_code for r in served] == [200] * 4
    assert {r.headers["x-colocate-cell"] for r in served} == {"eu-west"}  # IAD's next nearest with pods
    assert {r.headers["x-colocate-backend"] for r in served} == {"pod-0"}  # a pod, not the fallback
    deployer.deploy(1, 0)
    home = call(out["entries"]["IAD"], out["key"])
    assert home.status_code == 200 and home.headers["x-colocate-backend"] == "pod-0"
    assert home.headers["x-colocate-cell"] in ("us-east", "eu-west")  # the front door remembers "no pod" for rememberMs
    ready = json.loads((Path(out["cells"][2]["state_dir"]) / "ready.json").read_text())
    assert ready["generation"] == "us-east.g1" and len(ready["pods"]) == 1


def test_down_leaves_nothing_running(running):
    res = cli("down", *running["where"])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["was_running"] is True and out["running"] is False
    assert_nothing_runs(running["sandboxes"])
    assert not (Path(running["out"]["state_dir"]) / "fleet.json").exists()
    res = cli("status", *running["where"])
    assert res.returncode == 0 and "does not run" in res.stderr


# --- bad input: exit 2, the key, the value and the fix, nothing running ------------------------

def _refused(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stdout == ""
    for w in (*words, "Fix"):
        assert w in res.stderr, (w, res.stderr)
    assert "Traceback" not in res.stderr


def test_an_unknown_fleet_stack_is_refused(tmp_path):
    stacks = fleet_stacks(tmp_path / "stacks")
    res = cli("up", "--fleet", "nope", "--stacks-dir", str(stacks), "--sandboxes-dir", str(tmp_path / "sb"))
    _refused(res, "--fleet", "'nope'", "fleet")
    assert_nothing_runs(tmp_path)


def test_a_cell_stack_is_not_a_fleet(tmp_path):
    stacks = fleet_stacks(tmp_path / "stacks")
    res = cli("up", "--fleet", "eu-west", "--stacks-dir", str(stacks), "--sandboxes-dir", str(tmp_path / "sb"))
    _refused(res, "--fleet", "'eu-west'", "up --stack eu-west")
    assert_nothing_runs(tmp_path)


def test_a_fleet_with_a_missing_member_stack_is_refused_before_any_cell_starts(tmp_path):
    stacks = fleet_stacks(tmp_path / "stacks", cells=("apac-jp", "eu-west"))
    res = cli("up", "--fleet", "fleet", "--stacks-dir", str(stacks), "--sandboxes-dir", str(tmp_path / "sb"))
    _refused(res, "colocate:fleet.cells[2]", "'us-east'", "Pulumi.us-east.yaml")
    assert not (tmp_path / "sb").exists() or not any((tmp_path / "sb").iterdir())
    assert_nothing_runs(tmp_path)


def test_two_members_in_one_region_are_refused(tmp_path):
    stacks = fleet_stacks(tmp_path / "stacks", cells=("eu-west", "us-east"))
    shutil.copyfile(stackfile.path_of("sandbox"), stackfile.path_of("sandbox", stacks))  # also us-east
    stackfile.write_config("fleet", {"fleet.cells": ["eu-west", "us-east", "sandbox"]}, stacks)
    res = cli("up", "--fleet", "fleet", "--stacks-dir", str(stacks), "--sandboxes-dir", str(tmp_path / "sb"))
    _refused(res, "colocate:fleet.cells", "both in region us-east")
    assert_nothing_runs(tmp_path)


def test_an_unknown_client_site_is_refused(tmp_path):
    stacks = fleet_stacks(tmp_path / "stacks")
    res = cli("up", "--fleet", "fleet", "--stacks-dir", str(stacks), "--sandboxes-dir", str(tmp_path / "sb"),
              "--client-site", "NRT", "--client-site", "XYZ")
    _refused(res, "--client-site", "'XYZ'", "IATA")
    assert not (tmp_path / "sb").exists()
    assert_nothing_runs(tmp_path)


# --- Ctrl-C at any moment of up --fleet ---------------------------------------------------------

# `up --fleet` takes ~3.3 s here when the machine is quiet: loading 0.2 s, the three cells one
# after the other (~0.8 s each), then the front door and the key (~0.6 s). The sweep lands in
# each of those; on a loaded machine the points shift, and every outcome is checked the same way.
UP_DELAYS = (0.1, 0.6, 1.2, 1.9, 2.5, 2.8, 3.1)


@pytest.mark.parametrize("delay", UP_DELAYS)
def test_ctrl_c_at_any_moment_of_up_fleet_leaves_nothing_running(tmp_path, delay):
    stacks = fleet_stacks(tmp_path / "stacks")
    sandboxes = tmp_path / "sb"
    try:
        res = interrupt(SANDBOX + ["up", "--fleet", "fleet", "--stacks-dir", str(stacks), "--sandboxes-dir",
                                    str(sandboxes)], delay)
        if python_was_starting(res):
            pass
        elif res.returncode == 0 or res.stdout.lstrip().startswith("{"):
            json.loads(res.stdout)  # it was up before the signal landed: a running fleet, stopped below
            fleet.down(sandboxes / "fleet")
        elif res.returncode == 130:
            assert "nothing it started is running" in res.stderr or "before doing anything" in res.stderr, res.stderr
            assert res.stdout == ""
        else:
            pytest.fail(f"exit {res.returncode}, neither up nor a clean interruption: {res.stderr[-2000:]}")
        assert_no_traceback_of_ours(res)
        assert_nothing_runs(tmp_path)
    finally:
        if (sandboxes / "fleet").exists():
            fleet.down(sandboxes / "fleet")
