"""probe.py --stack <fleet> against a real front door and three real cells in one workerd.

Each client site is a loopback proxy (tests/support/site_proxy.py) that adds the colo the
front door runs in (``cf-blob``); each cell is found as keys.py finds it, by a sandbox's
``ready.json`` (its own URL and probe token) in --sandboxes-dir.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.cell import catalogue
from colocate.fleet import plan as fleet
from colocate.probe import keys as probe_keys
from tests.support.fleet import Fleet, running_fleet
from tests.support.site_proxy import site
from tests.support.workerd import SECRETS

pytestmark = pytest.mark.slow  # real workerd with three cells

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_script", ROOT / "scripts" / "probe.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)
HOME = {"NRT": "apac-jp", "FRA": "eu-west", "IAD": "us-east"}


def floor(colo: str, cell: str) -> str:
    """A floor as the verdict prints it (computed by the kit's own floor model)."""
    return f"{colo}→{cell} {fleet.floor_to(colo, catalogue.region(cell)):,.0f} ms"


@contextlib.contextmanager
def fleet_dirs(tmp: Path, f: Fleet):
    """A fleet stack file naming the cells, and a 'running sandbox' of each cell."""
    stacks, boxes = tmp / "stacks", tmp / "sandboxes"
    stacks.mkdir(parents=True)
    cells = ", ".join(c.name for c in f.cells)
    (stacks / "Pulumi.fl.yaml").write_text(f"config:\n  colocate:fleet:\n    cells: [{cells}]\n")
    for c in f.cells:
        (boxes / c.name).mkdir(parents=True)
        (boxes / c.name / "ready.json").write_text(json.dumps({"worker_url": c.url, "token": SECRETS["PROBE_TOKEN"]}))
    yield stacks, boxes


@contextlib.contextmanager
def sites(f: Fleet, *colos: str):
    with contextlib.ExitStack() as stack:
        yield [f"{colo}={stack.enter_context(site(f.url, colo))}" for colo in colos]


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    with running_fleet(remember_ms=0) as f, fleet_dirs(tmp_path_factory.mktemp("probefleet"), f) as dirs:
        yield f, dirs


@pytest.fixture(autouse=True)
def healthy(request):
    if "three" in request.fixturenames:
        f, _ = request.getfixturevalue("three")
        for c in f.cells:
            c.pod.set_fault("ok")
            c.breaker(None)
    yield


def run_in_process(dirs, site_flags, capsys, monkeypatch, key: str, *extra: str) -> tuple[int, dict, str]:
    stacks, boxes = dirs
    monkeypatch.setenv(probe_keys.KEY_ENV, key)
    argv = ["--stack", "fl", "--stacks-dir", str(stacks), "--sandboxes-dir", str(boxes), "--samples", "5",
            "--json", "-", *extra]
    for s in site_flags:
        argv += ["--client-site", s]
    code = probe.main(argv)
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out.strip() else {}, out.err


def test_each_site_is_served_by_its_nearest_cell(three, tmp_path):
    f, (stacks, boxes) = three
    with sites(f, "NRT", "FRA", "IAD") as flags:
        argv = [sys.executable, str(ROOT / "scripts" / "probe.py"), "--stack", "fl", "--stacks-dir", str(stacks),
                "--sandboxes-dir", str(boxes), "--samples", "5", "--json", "-"]
        for s in flags:
            argv += ["--client-site", s]
        env = {**os.environ, probe_keys.KEY_ENV: f.key}  # the key never goes in argv
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and [c["healthy"] for c in doc["cells"]] == [True, True, True]
    for s in doc["sites"]:
        home = HOME[s["site"]]
        assert s["colo"] == s["site"] and s["expected"] == home and s["served"] == {home: 5}, s
        assert s["backends"] == {"pod-0": 5} and s["ok"] is True
        assert [r["cell"] for r in s["ranking"]][0] == home
        assert s["ranking"][0]["floor_ms"] < s["ranking"][1]["floor_ms"] <= s["ranking"][2]["floor_ms"]
        for seg in ("e2e", "front", "state", "upstream", "fallback", "total"):
            assert s["segments"][seg]["n"] == 5, (s["site"], seg)
        assert s["segments"]["e2e"]["p50"] >= s["segments"]["total"]["p50"] > 0
    assert f.key not in proc.stdout + proc.stderr
    assert "OK: all 3 client sites served by their nearest healthy cell" in proc.stderr


def test_a_cell_with_its_breakers_open_is_passed_over_and_the_next_is_expected(three, capsys, monkeypatch):
    f, dirs = three
    f.cell("apac-jp").breaker("open")
    with sites(f, "NRT", "FRA") as flags:
        code, doc, err = run_in_process(dirs, flags, capsys, monkeypatch, f.key)
    assert code == 0, err
    jp = next(c for c in doc["cells"] if c["name"] == "apac-jp")
    assert jp["healthy"] is False and jp["why"] == "breaker forced open"
    nrt, fra = doc["sites"]
    # Tokyo's next nearest cell is eu-west (Dublin); Frankfurt's own cell is unaffected.
    assert nrt["expected"] == "eu-west" and nrt["served"] == {"eu-west": 5} and nrt["ok"] is True
    assert fra["expected"] == "eu-west" and fra["served"] == {"eu-west": 5}
    assert "apac-jp passed over: breaker forced open" in nrt["verdict"]


def test_no_healthy_cell_at_all_fails(three, capsys, monkeypatch):
    f, dirs = three
    for c in f.cells:
        c.breaker("open")
    with sites(f, "IAD") as flags:
        code, doc, err = run_in_process(dirs, flags, capsys, monkeypatch, f.key)
        assert code == 1, err
        (iad,) = doc["sites"]
        # Served all the same, by the second cell tried, through the fallback API.
        assert iad["served"] == {"eu-west": 5} and iad["backends"] == {"fallback": 5}
        assert iad["expected"] is None and "no cell of the fleet is healthy" in doc["verdict"]
        code, doc, err = run_in_process(dirs, flags, capsys, monkeypatch, f.key, "--warn-only")
    assert code == 0 and doc["ok"] is False and doc["warn_only"] is True, err


def test_a_site_not_served_by_its_nearest_healthy_cell_fails_with_the_floors(tmp_path, capsys, monkeypatch):
    """The front door remembers apac-jp as having no pod (rememberMs 60 s) after its breakers
    were open; they are closed again, so apac-jp is healthy and Tokyo's nearest, yet Tokyo
    is served by eu-west until the memory ends: the probe says so, with the floors."""
    with running_fleet(("apac-jp", "eu-west"), remember_ms=60_000) as f, fleet_dirs(tmp_path, f) as dirs:
        jp = f.cell("apac-jp")
        jp.breaker("open")
        assert f.call("NRT").headers["x-colocate-cell"] == "eu-west"  # remembered from now on
        jp.breaker(None)
        with sites(f, "NRT") as flags:
            code, doc, err = run_in_process(dirs, flags, capsys, monkeypatch, f.key)
    assert code == 1, err
    (nrt,) = doc["sites"]
    assert nrt["expected"] == "apac-jp" and nrt["served"] == {"eu-west": 5} and nrt["mismatched"] == 5
    assert [c["healthy"] for c in doc["cells"]] == [True, True]
    for text in (doc["verdict"], err):
        assert "site NRT (front door in NRT) was served by eu-west in 5 of 5 samples" in text
        assert "not by its nearest healthy cell apac-jp" in text
        assert floor("NRT", "apac-jp") in text and floor("NRT", "eu-west") in text
    assert err.rstrip().splitlines()[-1].startswith("FAIL: site NRT")


def test_live_merges_every_cells_histograms_per_client_colo(three, capsys, monkeypatch):
    f, (stacks, boxes) = three
    sent = {"NRT": 6, "FRA": 4, "IAD": 3}
    for colo, n in sent.items():
        for _ in range(n):
            # a client's own client-colo header is replaced by the front door's
            assert f.call(colo, headers={"x-colocate-client-colo": "XXX"}).status == 200
    argv = ["--stack", "fl", "--stacks-dir", str(stacks), "--sandboxes-dir", str(boxes), "--live", "--since", "15m",
            "--json", "-"]
    deadline = time.monotonic() + 20
    while True:  # each cell's isolate syncs its histograms within about a second
        code = probe.main(argv)
        doc = json.loads(capsys.readouterr().out)
        colos = {c["colo"]: c for c in doc["colos"]}
        # every cell's rows for a client colo, merged (on a loaded machine the front door may pass a slow
        # home cell over for a request: which cell served is the routing tests' concern, not this one's)
        served = {colo: sum(s["requests"] for s in colos.get(colo, {}).get("served", [])) for colo in sent}
        if all(served[c] >= n for c, n in sent.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert code == 0, doc["violations"]
    failed_syncs = [line for line in f.worker.log_text().splitlines() if "sync_failed" in line][-5:]
    assert all(served[c] >= n for c, n in sent.items()), (served, failed_syncs)
    assert "XXX" not in colos
    for colo in sent:
        assert colos[colo]["nearest"] == HOME[colo]
        assert colos[colo]["segments"]["total"]["n"] == colos[colo]["requests"]
    assert doc["segments"]["total"]["n"] == doc["requests"] == sum(c["requests"] for c in doc["cells"])
    assert [c["name"] for c in doc["cells"]] == ["apac-jp", "eu-west", "us-east"]
    assert probe.main(["--stack", "fl", "--stacks-dir", str(stacks), "--live", "--samples", "3"]) == 2
    assert "--samples" in capsys.readouterr().err
