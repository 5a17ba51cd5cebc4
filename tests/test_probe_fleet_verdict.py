"""The fleet probe's judging, pure: health from a cell's probe answer, the ranking filtered by
health, the verdict per client site, and probe.py's bad input (exit 2, nothing sent)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from colocate.cell import catalogue
from colocate.fleet import plan as fleet
from colocate.probe import fleet as fp, timing
from colocate.probe.errors import UsageError
from colocate.probe.sample import ROUTED_METRICS, Sample

ROOT = Path(__file__).resolve().parent.parent
CELLS = ("apac-jp", "eu-west", "us-east")


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_script", ROOT / "scripts" / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer(*pods: tuple[str, bool], forced: str | None = None) -> dict:
    """A cell's GET /_colocate/probe answer: per pod (breaker state, /health ok)."""
    return {"region": "apac-jp",
            "pods": [{"index": i, "host": f"pod{i}:8000", "rtt_ms": 3, "ok": ok, "status": 200 if ok else None}
                     for i, (_, ok) in enumerate(pods)],
            "breaker": {"state": pods[0][0], "forced": forced,
                        "pods": [{"index": i, "host": f"pod{i}:8000", "state": st, "forced": forced}
                                 for i, (st, _) in enumerate(pods)]}}


def cells(*unhealthy: str, names=CELLS) -> list[fp.CellHealth]:
    return [fp.CellHealth(n, catalogue.region(n), n not in unhealthy, "breaker forced open" if n in unhealthy else "ok")
            for n in names]


def sample(cell: str | None, colo: str | None = "NRT", *, e2e: float = 20.0, status: int = 200,
           backend: str = "pod-0", upstream: float = 3.0) -> Sample:
    desc = f';desc="{colo}"' if colo else ""
    header = f"front;dur=0.5{desc}, state;dur=0, upstream;dur={upstream}, fallback;dur=0, total;dur={upstream + 1}"
    ok = 200 <= status < 300
    return Sample("routed", e2e if ok else None, status, None if ok else f"HTTP {status}",
                  timing.parse(header, ROUTED_METRICS), backend=backend if ok else None, cell=cell if ok else None)


SITE = fp.Site("NRT", "http://127.0.0.1:1")


def test_server_timing_keeps_a_metrics_desc():
    t = timing.parse('front;dur=1.5;desc="NRT", state;dur=0, front;dur=9;desc="FRA"', ("state",))
    assert t.durations == {"front": 1.5, "state": 0.0} and t.descs == {"front": "NRT"} and t.ok
    assert fp.front_colo(Sample("routed", 1, 200, None, t)) == "NRT"
    assert fp.front_colo(Sample("routed", 1, 200, None, timing.parse("front;dur=1", ()))) is None


@pytest.mark.parametrize("doc, healthy, why", [
    (answer(("closed", True)), True, "1 of 1 pod serving"),
    (answer(("closed", True), forced="open"), False, "breaker forced open"),
    (answer(("open", True)), False, "no pod serving (1 breaker open, 0 failing /health)"),
    (answer(("open", True), forced="closed"), True, "1 of 1 pod serving"),
    (answer(("half_open", True)), True, "1 of 1 pod serving"),
    (answer(("closed", False)), False, "no pod serving (0 breakers open, 1 failing /health)"),
    (answer(("open", True), ("closed", True)), True, "1 of 2 pods serving"),
    ({"pods": [], "breaker": {}}, False, "its probe answer lists no pods"),
])
def test_health_from_the_cells_probe_answer(doc, healthy, why):
    h = fp.health_of("apac-jp", catalogue.region("apac-jp"), doc)
    assert (h.healthy, h.why) == (healthy, why)


def test_an_unreachable_cell_is_not_healthy():
    h = fp.health_of("eu-west", None, None, "unreachable at http://x (connection failed)")
    assert not h.healthy and h.why == "unreachable at http://x (connection failed)"


def test_the_ranking_is_the_front_doors_binding():
    regions = [catalogue.region(n) for n in CELLS]
    table = fleet.rank_table(regions)  # what the front door gets as CELL_RANK
    for colo in ("NRT", "FRA", "IAD", "SIN", "GRU", "SYD", "LHR"):
        assert fp.ranking(colo, cells()) == table[colo], colo
    assert fp.ranking(None, cells()) == fp.ranking("ZZZ", cells()) == [0, 1, 2]  # configured order


def test_the_nearest_healthy_cell():
    assert fp.expected("NRT", cells()) == "apac-jp"
    assert fp.expected("NRT", cells("apac-jp")) == "eu-west"
    assert fp.expected("NRT", cells("apac-jp", "eu-west")) == "us-east"
    assert fp.expected("FRA", cells("apac-jp")) == "eu-west"
    assert fp.expected("IAD", cells(*CELLS)) is None
    # A cell whose region is unknown (unreachable, no stack file) ranks last, never first.
    odd = [fp.CellHealth("apac-jp", None, True, "ok"), *cells(names=("eu-west", "us-east"))]
    assert fp.ranking("NRT", odd) == [1, 2, 0] and fp.expected("NRT", odd) == "eu-west"


def test_a_site_served_by_its_nearest_healthy_cell_is_ok():
    r = fp.judge_site(SITE, [sample("apac-jp", e2e=e) for e in (10, 20, 30)], cells())
    assert r.ok and r.expected == "apac-jp" and r.served == {"apac-jp": 3} and r.colo == "NRT"
    assert r.segments["e2e"]["p50"] == 20 and r.segments["front"]["n"] == 3 and r.segments["upstream"]["p50"] == 3
    assert r.verdict == ("site NRT: served by apac-jp from NRT (floor 0 ms), its nearest healthy cell, "
                         "in 3 of 3 samples; e2e p50 20 ms, p90 28 ms")
    assert [x["cell"] for x in r.ranked] == ["apac-jp", "eu-west", "us-east"]


def test_the_next_cell_is_expected_when_the_nearest_is_not_healthy():
    r = fp.judge_site(SITE, [sample("eu-west")] * 3, cells("apac-jp"))
    assert r.ok and r.expected == "eu-west"
    assert r.verdict.endswith("(apac-jp passed over: breaker forced open)")
    assert "site NRT: nearer cell not healthy: apac-jp (breaker forced open)" in r.notes


def test_a_site_served_by_another_cell_fails_with_both_floors():
    r = fp.judge_site(SITE, [sample("apac-jp"), sample("eu-west"), sample("eu-west")], cells())
    assert not r.ok and r.mismatched == 2
    floor_jp = fleet.floor_to("NRT", catalogue.region("apac-jp"))
    floor_eu = fleet.floor_to("NRT", catalogue.region("eu-west"))
    assert floor_eu > 50 > floor_jp  # Tokyo → Dublin against Tokyo → Tokyo
    assert r.verdict.startswith(f"site NRT (front door in NRT) was served by eu-west in 2 of 3 samples, not by its "
                                f"nearest healthy cell apac-jp (ok): floor NRT→apac-jp {floor_jp:,.0f} ms, "
                                f"NRT→eu-west {floor_eu:,.0f} ms — ")


def test_a_cell_that_is_not_a_member_is_named():
    r = fp.judge_site(SITE, [sample(None)], cells())
    assert not r.ok and "served by unknown in 1 of 1" in r.verdict
    assert "(answered without x-colocate-cell: is http://127.0.0.1:1 the fleet's front door?)" in r.verdict
    r = fp.judge_site(SITE, [sample("ap-south")], cells())
    assert not r.ok and "(ap-south is not a member cell)" in r.verdict


def test_failed_requests_fail_the_site():
    r = fp.judge_site(SITE, [sample("apac-jp"), sample("apac-jp", status=502)], cells())
    assert not r.ok and r.verdict == "site NRT: 1 of 2 requests failed (HTTP 502 ×1)"
    assert r.segments["e2e"]["n"] == 1


def test_no_healthy_cell_fails_even_when_a_fallback_answered():
    r = fp.judge_site(SITE, [sample("eu-west", backend="fallback")] * 2, cells(*CELLS))
    assert not r.ok and r.expected is None
    assert r.verdict.startswith("site NRT: no cell of the fleet is healthy (apac-jp: breaker forced open;")
    assert "site NRT: 2 of 2 answered by the fallback API" in r.notes


def test_health_that_changes_mid_run_accepts_either_readings_cell():
    before, after = cells("apac-jp"), cells()
    r = fp.judge_site(SITE, [sample("eu-west"), sample("apac-jp")], before, after)
    assert r.ok and any(n.startswith("health changed during the run: apac-jp") for n in r.notes)
    r = fp.judge_site(SITE, [sample("us-east")], before, after)
    assert not r.ok


def test_a_front_door_that_does_not_name_its_colo_uses_the_configured_order():
    r = fp.judge_site(fp.Site("here", "http://x"), [sample("apac-jp", colo=None)], cells())
    assert r.ok and r.colo is None and r.ranked[0]["floor_ms"] is None
    assert any("did not say where it ran" in n for n in r.notes)
    r = fp.judge_site(fp.Site("here", "http://x"), [sample("eu-west", colo=None)], cells())
    assert not r.ok and "not by its nearest healthy cell apac-jp (ok): floors unknown: the front door did not name" in r.verdict


def test_a_site_that_reaches_another_colo_is_noted_and_judged_from_where_the_front_door_ran():
    r = fp.judge_site(fp.Site("NRT", "http://x"), [sample("eu-west", colo="FRA")], cells())
    assert r.ok and r.colo == "FRA" and r.expected == "eu-west"
    assert any(n.startswith("site NRT reached the front door at FRA, 9,") for n in r.notes)


def test_the_report_json_and_table():
    before = cells("apac-jp")
    res = fp.FleetResult("fleet", "m", 2, before, before,
                         [fp.judge_site(SITE, [sample("eu-west")] * 2, before),
                          fp.judge_site(fp.Site("IAD", "http://y"), [sample("eu-west", "IAD")] * 2, before)])
    doc = fp.to_json(res)
    assert doc["ok"] is False and doc["verdict"].startswith("site IAD (front door in IAD) was served by eu-west")
    assert [s["site"] for s in doc["sites"]] == ["NRT", "IAD"] and doc["cells"][0]["healthy"] is False
    json.dumps(doc)
    text = fp.table(res)
    assert "NOT HEALTHY  breaker forced open" in text and text.rstrip().splitlines()[-1].startswith("FAIL: site IAD")


def test_client_sites_from_flags():
    assert fp.parse_sites(["NRT=http://127.0.0.1:9/", "FRA = https://f.example"]) == [
        fp.Site("NRT", "http://127.0.0.1:9"), fp.Site("FRA", "https://f.example")]
    for bad, problem in (("NRT", "must be NAME=URL"), ("=http://x", "must be NAME=URL"),
                         ("NRT=ftp://x", "is not an http(s) URL"), ("NRT=localhost:9", "is not an http(s) URL")):
        with pytest.raises(UsageError) as e:
            fp.parse_sites([bad])
        assert e.value.flag == "--client-site" and e.value.value == bad and problem in str(e.value)
        assert "Fix: give NAME=URL" in str(e.value)
    with pytest.raises(UsageError, match="site NRT is given twice"):
        fp.parse_sites(["NRT=http://a", "NRT=http://b"])


def test_client_sites_from_a_running_sandbox_fleet_then_the_fleets_url(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"fleet": "fl", "entries": {"NRT": "http://127.0.0.1:7/", "FRA": "http://127.0.0.1:8"},
                                "cells": [{"name": "apac-jp", "region": "apac-jp", "state_dir": "/x"}], "key": "clc_k"}))
    box = fp.read_sandbox_fleet(path)
    assert box.sites == [fp.Site("NRT", "http://127.0.0.1:7"), fp.Site("FRA", "http://127.0.0.1:8")]
    assert box.key == "clc_k" and "clc_k" not in repr(box)
    never = lambda: pytest.fail("the stack's outputs are read only when nothing else names a site")  # noqa: E731
    assert fp.sites_for("fl", [], None, box, path, never) == box.sites
    assert fp.sites_for("fl", ["X=http://x"], None, box, path, never) == [fp.Site("X", "http://x")]
    assert fp.sites_for("fl", [], "http://u/", box, path, never) == [fp.Site("here", "http://u")]
    assert fp.read_sandbox_fleet(tmp_path / "none.json") is None
    assert fp.sites_for("fl", [], None, None, path, lambda: "https://fl.example.workers.dev") == [
        fp.Site("here", "https://fl.example.workers.dev")]


def _fleet_stack(tmp_path: Path) -> tuple[Path, Path]:
    stacks, boxes = tmp_path / "stacks", tmp_path / "boxes"
    stacks.mkdir()
    boxes.mkdir()
    (stacks / "Pulumi.fl.yaml").write_text("config:\n  colocate:fleet:\n    cells: [apac-jp, eu-west]\n")
    return stacks, boxes


def test_bad_input_exits_2_naming_the_flag_value_and_fix(probe, tmp_path, capsys, monkeypatch):
    stacks, boxes = _fleet_stack(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no pulumi CLI: the fleet's outputs cannot be read
    monkeypatch.delenv("COLOCATE_CLIENT_KEY", raising=False)
    base = ["--stack", "fl", "--stacks-dir", str(stacks), "--sandboxes-dir", str(boxes)]

    def run(*argv: str) -> str:
        assert probe.main([*base, *argv]) == 2
        return capsys.readouterr().err

    err = run("--client-site", "NRT")
    assert "--client-site 'NRT': must be NAME=URL. Fix: give NAME=URL" in err
    err = run()
    assert "--client-site: no client site for fleet fl: no running sandbox fleet" in err
    assert "pass --client-site NAME=URL" in err and "sandbox.py up --fleet fl" in err
    err = run("--client-site", "NRT=http://127.0.0.1:9")  # refused before any request: nothing listens there
    assert "--key: no client key" in err and "keys.py create --stack fl" in err
    err = run("--client-site", "NRT=http://127.0.0.1:9", "--budget", "e2e=100")
    assert "--budget ['e2e=100']: probes one cell; --stack fl is a fleet" in err
    assert probe.main(["http://127.0.0.1:9", "--client-site", "NRT=http://127.0.0.1:9"]) == 2
    assert "--client-site 'NRT=http://127.0.0.1:9': only a fleet is probed from client sites" in capsys.readouterr().err


def test_an_unreachable_site_exits_2_naming_it(probe, tmp_path, capsys, monkeypatch):
    stacks, boxes = _fleet_stack(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("COLOCATE_CLIENT_KEY", "clc_x")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    code = probe.main(["--stack", "fl", "--stacks-dir", str(stacks), "--sandboxes-dir", str(boxes),
                       "--client-site", f"NRT=http://127.0.0.1:{port}", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 2 and f"client site NRT: cannot reach http://127.0.0.1:{port}/v1/models" in err
    assert "apac-jp NOT healthy (not found" in err  # no sandbox, no pulumi: the cell could not be asked
