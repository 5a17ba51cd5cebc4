"""The region catalogue and the physical floor: pure."""


import pytest

from colocate.cell import catalogue, geo
from colocate.errors import UnknownRegion, UnsupportedProvider

REQUIRED = ("apac-tw", "apac-jp", "us-east", "us-west", "eu-west")


def test_required_regions_exist():
    assert set(REQUIRED) <= set(catalogue.REGIONS)


@pytest.mark.parametrize("name", REQUIRED)
def test_every_region_is_complete_and_consistent(name):
    r = catalogue.region(name)
    cloud, _, where = r.placement_region.partition(":")
    assert cloud in ("aws", "gcp", "azure") and where
    assert r.location_hint in catalogue.HOSTING_HINTS
    assert r.location_hint not in ("sam", "afr", "me")
    colos = geo.colos()
    assert r.edge_site in r.in_region_colos
    assert all(c in colos for c in r.in_region_colos)
    assert r.providers and "local" in r.providers
    for provider in r.providers:
        for loc in r.locations(provider):
            site = r.site_of(loc)
            assert site in colos
            # A GPU location of a region is near it: within 1,200 km of the edge.
            assert geo.distance_km(site, r.edge_site) < 1200, (name, loc)


def test_specific_placements():
    assert catalogue.region("apac-tw").placement_region == "gcp:asia-east1"
    assert catalogue.region("apac-jp").placement_region == "aws:ap-northeast-1"
    assert catalogue.region("apac-jp").locations("runpod") == ("AP-JP-1",)
    assert catalogue.region("apac-tw").locations("vastai") == ("TW",)


def test_runpod_in_taiwan_is_refused_with_vastai_suggested():
    with pytest.raises(UnsupportedProvider) as err:
        catalogue.region("apac-tw").locations("runpod")
    assert "vastai" in str(err.value) and "colocate:pod.provider" in str(err.value)


def test_unknown_region_lists_known():
    with pytest.raises(UnknownRegion) as err:
        catalogue.region("ap-south")
    assert all(n in str(err.value) for n in REQUIRED)



@pytest.mark.parametrize("a, b, km, floor", [
    ("TPE", "IAD", 12635, 126.4),
    ("NRT", "IAD", 10845, 108.4),
    ("NRT", "TPE", 2181, 21.8),
])
def test_great_circle_and_floor_match_field_figures(a, b, km, floor):
    assert geo.distance_km(a, b) == pytest.approx(km, abs=5)
    assert geo.floor_ms(a, b) == pytest.approx(floor, abs=0.1)
    assert geo.floor_ms(b, a) == geo.floor_ms(a, b)
    assert geo.floor_ms(a, a) == 0


def test_region_of_colo():
    assert catalogue.region_of_colo("KIX").name == "apac-jp"
    assert catalogue.region_of_colo("IAD").name == "us-east"
    assert catalogue.region_of_colo("GRU") is None
    assert catalogue.region_of_colo(None) is None
