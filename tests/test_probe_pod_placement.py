"""The probe under pod placement: the mode is reported, the Worker must sit at pod 0, and a
change of pod 0's address is named."""

from __future__ import annotations

import os

from colocate.cell import catalogue
from colocate.probe import placement as pl
from tests.support import fake_cell
from tests.test_probe_cli import TOKEN, fake_pulumi, probe, run_json, stack_file  # noqa: F401 (fixture)
from tests.test_probe_placement import body

JP = catalogue.region("apac-jp")
TW = catalogue.region("apac-tw")
HOST = "pod-x.example.com:8000"  # body()'s pod_host: pod 0's address as the Worker uses it


def test_pod_mode_holds_when_the_worker_runs_beside_pod_0():
    p = pl.observe([body(worker_colo="KIX")] * 3, ["KIX"] * 3, JP, "AP-JP-1", "pod", HOST)
    assert (p.mode, p.host, p.pod.colo) == ("pod", HOST, "NRT")
    # Osaka is 400 km from pod 0's site (Tokyo): a 4 ms floor, within the tolerance.
    assert p.pod_floor_ms < pl.POD_TOLERANCE_MS and p.at_pod is True and p.ok
    assert not [f for f in pl.findings(p, {}, "pod") if f.fails]
    doc = p.to_json()
    assert doc["mode"] == "pod" and doc["host"] == HOST and doc["at_pod"] is True and doc["host_change"] is None


def test_pod_mode_fails_an_in_region_worker_far_from_the_pod():
    # Taiwan's cell with its pod in Taipei and the Worker in Hong Kong's colo: 806 km, within
    # the tolerance. Japan's cell with the Worker in Okinawa: in region, but 1,612 km from the
    # pod in Tokyo, so pod placement did not do its job.
    near = pl.observe([body(worker_colo="HKG", region="apac-tw", state_colo="TPE")], ["HKG"], TW, "TW", "pod", HOST)
    assert near.at_pod is True
    far = pl.observe([body(worker_colo="OKA", state_colo="NRT")], ["OKA"], JP, "AP-JP-1", "pod", HOST)
    assert far.ran.status == pl.IN  # the region check alone would pass it
    assert far.at_pod is False and not far.ok
    fails = [f for f in pl.findings(far, {}, "pod") if f.fails]
    assert [f.part for f in fails] == ["ran"]
    assert fails[0].message.startswith("Worker runs in OKA, 1,612 km from pod 0's site NRT (floor 16 ms")
    assert f"tolerance {pl.POD_TOLERANCE_MS:g} ms): pod placement not applied" in fails[0].message
    assert HOST in fails[0].message and "placement targeted" in fails[0].message


def test_other_modes_are_reported_but_not_held_to_the_pod():
    p = pl.observe([body(worker_colo="FUK")], ["FUK"], JP, "AP-JP-1", "targeted", None)
    # Fukuoka is 880 km from Tokyo: fine for targeted placement, which promises the region only.
    assert p.mode == "targeted" and p.at_pod is None and p.ok
    assert p.to_json()["pod_tolerance_ms"] is None


def test_a_replaced_pod_0_shows_as_a_placement_host_change():
    new = "pod-x.example.com:41999"
    p = pl.observe([body(pod_host=new)], ["NRT"], JP, "AP-JP-1", "pod", HOST)
    assert p.host_change == {"from": HOST, "to": new} and p.ok  # informational: the colo check decides
    notes = [f.message for f in pl.findings(p, {}, "pod") if not f.fails]
    assert any(m.startswith(f"placement host changes from {HOST} to {new}") for m in notes)


def test_cli_reports_mode_and_host_from_the_stack_outputs(probe, capsys, monkeypatch, tmp_path):  # noqa: F811
    stack_file(tmp_path / "stacks")
    with fake_cell.serve(pod_host="pod-abc.example.com:41234") as cell:
        fake_pulumi(tmp_path / "bin", {"workerUrl": cell.url, "probeToken": TOKEN, "podLocation": "AP-JP-1",
                                       "podPath": "zone-dns", "placementMode": "pod",
                                       "placementHost": "pod-abc.example.com:40000"})
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        code, doc, err = run_json(probe, capsys, ["--stack", "t", "--stacks-dir", str(tmp_path / "stacks")])
    assert code == 0, err
    place = doc["placement"]
    assert place["mode"] == "pod" and place["host"] == "pod-abc.example.com:40000" and place["at_pod"] is True
    assert place["host_change"] == {"from": "pod-abc.example.com:40000", "to": "pod-abc.example.com:41234"}
    assert "placement host changes from pod-abc.example.com:40000 to pod-abc.example.com:41234" in err
    assert "(pod placement)" in doc["verdict"]


def test_cli_fails_a_pod_mode_worker_away_from_the_pod(probe, capsys):  # noqa: F811
    with fake_cell.serve(worker_colo="IAD", cf_placement="local-IAD") as cell:
        code, doc, _ = run_json(
            probe,
            capsys,
            [
                cell.url,
                "--token",
                TOKEN,
                "--expect-region",
                "apac-jp",
                "--pod-location",
                "AP-JP-1",
                "--placement-mode",
                "pod",
                "--placement-host",
                "pod-abc.example.com:8000",
                "--samples",
                "2",
            ],
        )
    assert code == 1 and doc["placement"]["at_pod"] is False
    assert any("pod placement" in v["message"] for v in doc["violations"])


def test_an_endpoint_the_team_runs_is_placed_and_judged_by_its_colo():
    # provider existing: pod 0's location is the colo nearest the box (Kaohsiung), its address its own name.
    own = "gpu1.team.example.org:8443"
    beside = pl.observe([body(worker_colo="KHH", region="apac-tw", state_colo="TPE", pod_host=own)], ["KHH"], TW, "KHH",
                        "pod", own)
    assert (beside.pod.colo, beside.pod.status, beside.at_pod, beside.host_change) == ("KHH", pl.IN, True, None)
    assert beside.ok and beside.floors()["pod_rtt"] == 0.0
    away = pl.observe([body(worker_colo="NRT", region="apac-tw", state_colo="TPE", pod_host=own)], ["NRT"], TW, "KHH",
                      "pod", own)
    assert away.at_pod is False and not away.ok  # 2,000 km from the box, and outside the region
    elsewhere = pl.observe([body(worker_colo="TPE", region="apac-tw", state_colo="TPE")], ["TPE"], TW, "NRT", "pod", own)
    assert elsewhere.pod.status == pl.OUT and not elsewhere.ok  # a box whose colo is another region's
