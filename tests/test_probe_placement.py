"""Placement truth, floors and verdict text, from probe bodies alone (no network)."""

import pytest

from colocate.cell import catalogue, geo
from colocate.probe import placement as pl

JP = catalogue.region("apac-jp")


def body(**kw):
    doc = {"worker_colo": "NRT", "cf_placement": "remote-NRT", "ray_colo": "NRT", "state_colo": "NRT",
           "state_rtt_ms": 3.0, "pod_rtt_ms": 12.0, "pod_ok": True, "generation": "apac-jp.g2",
           "region": "apac-jp", "pod_host": "pod-x.example.com:8000"}
    doc.update(kw)
    return doc


def test_floor_is_two_great_circle_distances_at_200_km_per_ms():
    km = geo.distance_km("NRT", "IAD")
    assert round(km) == 10845
    assert pl.floor_between("NRT", "IAD") == pytest.approx(2 * km / 200, abs=0.01)
    assert pl.floor_between("NRT", "NRT") == 0.0
    assert pl.floor_between("NRT", None) is None
    assert pl.floor_between("NRT", "ZZZ") is None  # not a colo: unknown, not 0


def test_left_behind_state_names_colos_distance_rtt_and_floor():
    p = pl.observe([body(state_colo="IAD")] * 3, ["NRT"] * 3, JP, "AP-JP-1")
    assert (p.ran.colo, p.state.colo, p.pod.colo) == ("NRT", "IAD", "NRT")
    assert p.state.status == pl.OUT and not p.ok
    f = pl.findings(p, {"state_rtt": 171.2, "pod_rtt": 12.0})
    fails = [x for x in f if x.fails]
    assert [x.part for x in fails] == ["state"]
    assert fails[0].message == ("state object runs in IAD, 10,845 km from the Worker in NRT: state left behind "
                                "(state_rtt p50 171 ms, floor 108 ms; generation apac-jp.g2) — preview the move of "
                                "state with compute: `.venv/bin/python scripts/migrate.py plan --stack <the cell stack> "
                                "--to apac-jp`")
    named = pl.findings(p, {"state_rtt": 171.2, "pod_rtt": 12.0}, migrate_flags="--stack apac-jp")
    assert named[[x.part for x in named].index("state")].message.endswith("migrate.py plan --stack apac-jp --to apac-jp`")
    assert p.floors()["state_rtt"] == pytest.approx(108.45, abs=0.01)


def test_worker_not_in_region_says_placement_not_applied():
    p = pl.observe([body(worker_colo="IAD", cf_placement="local-IAD", state_colo="IAD")], ["IAD"], JP, "AP-JP-1")
    f = pl.findings(p, {"state_rtt": 2.0}, worker_placement="smart")
    assert f[0].part == "ran" and f[0].fails
    assert f[0].message.startswith("Worker runs in IAD, outside apac-jp (NRT, KIX, FUK, OKA), cf-placement local-IAD: "
                                   "placement not applied — check colocate:worker.placement")
    assert "smart placement needs traffic" in f[0].message
    # the pod (NRT) is now 10,845 km from where the Worker runs: the pod floor says so
    assert p.floors()["pod_rtt"] == pytest.approx(108.45, abs=0.01)


def test_unknown_colos_are_unknown_not_ok():
    p = pl.observe([body(worker_colo=None, cf_placement=None, state_colo=None, ray_colo=None)], [None], JP, None)
    assert p.ran.status == p.state.status == p.pod.status == pl.UNKNOWN
    assert not p.ok
    f = pl.findings(p, {})
    parts = {x.part: x for x in f}
    assert parts["ran"].fails and "Worker colo unknown" in parts["ran"].message
    assert parts["state"].fails and "state object colo unknown" in parts["state"].message
    assert not parts["pod"].fails and "pod location unknown (pod_host pod-x.example.com:8000)" in parts["pod"].message
    assert parts["accepted"].message == "accepted colo unknown (no cf-ray header)"
    assert p.floors() == {"state_rtt": None, "pod_rtt": None, "pod_rtt_new": None, "upstream": None}


def test_cf_placement_used_when_the_trace_is_missing_and_cross_checked_otherwise():
    p = pl.observe([body(worker_colo=None, cf_placement="remote-KIX")], ["NRT"], JP)
    assert (p.ran.colo, p.ran_source, p.ran.status) == ("KIX", "cf-placement", pl.IN)
    p = pl.observe([body(cf_placement="remote-KIX")], ["NRT"], JP, "AP-JP-1")
    info = [x for x in pl.findings(p, {}) if "cf-placement says" in x.message]
    assert len(info) == 1 and not info[0].fails


def test_accepted_far_from_the_worker_is_informational():
    p = pl.observe([body()] * 2, ["LAX", "LAX"], JP, "AP-JP-1")
    assert p.ok
    f = pl.findings(p, {})
    assert len(f) == 1 and not f[0].fails
    assert f[0].message.startswith(f"accepted at LAX, {geo.distance_km('LAX', 'NRT'):,.0f} km from the Worker in NRT")


def test_pod_outside_the_region_fails_with_distance():
    p = pl.observe([body()], ["NRT"], JP, "US-DE-1")
    assert (p.pod.colo, p.pod.status) == ("PHL", pl.OUT)
    f = [x for x in pl.findings(p, {"pod_rtt": 160.0}) if x.fails]
    assert f[0].message.startswith(f"pod in US-DE-1 (PHL), {geo.distance_km('PHL', 'NRT'):,.0f} km from the Worker in NRT")


@pytest.mark.parametrize("location,region,site", [
    ("AP-JP-1", "apac-jp", "NRT"), ("TW", "apac-tw", "TPE"), ("local", "us-east", "IAD"),
    ("US-GA-1", "apac-jp", "ATL"), ("KIX", "apac-jp", "KIX"), ("nowhere", "apac-jp", None), (None, "apac-jp", None),
])
def test_pod_site(location, region, site):
    assert pl.pod_site(location, catalogue.region(region)) == site


def test_majority_colo_and_counts():
    p = pl.observe([body(state_colo="NRT"), body(state_colo="iad"), body(state_colo="IAD")], [], JP)
    assert p.state.colo == "IAD" and p.state.seen == {"NRT": 1, "IAD": 2}
    assert p.accepted.colo == "NRT"  # no cf-ray on responses: the ray colo the Worker saw


def test_no_expected_region_fails_with_the_fix():
    p = pl.observe([body(region=None)], ["NRT"], None)
    f = pl.findings(p, {})
    assert f[0].fails and "--expect-region" in f[0].message


@pytest.mark.parametrize("value,parsed", [("remote-NRT", ("remote", "NRT")), ("local-iad", ("local", "IAD")),
                                          ("", (None, None)), (None, (None, None)), ("remote-", (None, None))])
def test_parse_cf_placement(value, parsed):
    assert pl.parse_cf_placement(value) == parsed
