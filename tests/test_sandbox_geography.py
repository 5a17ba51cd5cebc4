"""The sandbox's round-trip model and pinning rule (pure)."""

import pytest

from colocate.cell import catalogue, geo
from colocate.sandbox.errors import GeographyError
from colocate.sandbox.geography import HINT_SITES, SAME_SITE_MS, Geography, Sites, area_of, landing_site, parse_override


def test_rtt_is_floor_times_stretch():
    g = Geography()
    assert g.stretch == geo.DEFAULT_STRETCH
    assert g.rtt_ms("TPE", "IAD") == pytest.approx(geo.floor_ms("TPE", "IAD") * 1.55, abs=0.01)
    # the figure: Taipei-Ashburn floor about 126 ms, about 196 ms at the default stretch
    assert 125 < geo.floor_ms("TPE", "IAD") < 128
    assert 194 < g.rtt_ms("TPE", "IAD") < 198
    assert Geography(stretch=2.0).rtt_ms("NRT", "IAD") == pytest.approx(geo.floor_ms("NRT", "IAD") * 2, abs=0.01)


def test_rtt_is_symmetric_and_has_a_same_site_floor():
    g = Geography()
    assert g.rtt_ms("IAD", "TPE") == g.rtt_ms("TPE", "IAD")
    assert g.rtt_ms("TPE", "TPE") == SAME_SITE_MS
    # IAD-RIC is a few km of floor: never cheaper than one metro
    assert geo.floor_ms("IAD", "RIC") * 1.55 < SAME_SITE_MS
    assert g.rtt_ms("IAD", "RIC") == SAME_SITE_MS
    assert Geography(same_site_ms=3).rtt_ms("NRT", "NRT") == 3


def test_overrides_win_both_ways():
    g = Geography.from_args(None, ["TPE:IAD=170", "nrt:nrt=4"])
    assert g.rtt_ms("IAD", "TPE") == 170
    assert g.rtt_ms("TPE", "IAD") == 170
    assert g.rtt_ms("NRT", "NRT") == 4
    assert g.rtt_ms("NRT", "IAD") == pytest.approx(geo.floor_ms("NRT", "IAD") * 1.55, abs=0.01)
    assert Geography.from_json(g.as_json()) == g


@pytest.mark.parametrize("text", ["TPE-IAD=170", "TPE:IAD", "TPE:IAD=fast", "", "TPE:IAD=-3"])
def test_bad_override_names_the_fix(text):
    with pytest.raises(GeographyError, match="--rtt"):
        parse_override(text)


def test_unknown_site_and_bad_stretch_are_refused():
    with pytest.raises(GeographyError, match="unknown Cloudflare colo 'XXX'"):
        Geography().rtt_ms("XXX", "IAD")
    with pytest.raises(GeographyError, match="--stretch"):
        Geography(stretch=0.5)
    with pytest.raises(GeographyError, match="--rtt"):
        parse_override("ZZZ:IAD=5")


def test_every_region_edge_lies_in_its_own_hint_area():
    for r in catalogue.REGIONS.values():
        assert area_of(r.edge_site) == r.location_hint, r.name
        assert landing_site(r.edge_site, r.location_hint) == r.edge_site


def test_landing_site_rule():
    assert landing_site("TPE", "apac") == "TPE"  # edge in the hint's area: near the Worker
    assert landing_site("TPE", "") == "TPE"  # no hint: near the Worker
    assert landing_site("TPE", "enam") == HINT_SITES["enam"]  # edge outside: the hint's area
    assert landing_site("IAD", "apac") == HINT_SITES["apac"]
    assert landing_site("GRU", "") == HINT_SITES["enam"]  # sam hosts no objects
    assert landing_site("JNB", "afr") == HINT_SITES["weur"]
    with pytest.raises(GeographyError, match="locationHint"):
        landing_site("TPE", "mars")


def test_placement_header_names_the_edge():
    assert Sites(client="NRT", edge="TPE", pod="TPE").placement == "remote-TPE"
    assert Sites(client="TPE", edge="TPE", pod="TPE").placement == "local-TPE"
