"""Pinning: the first touch decides, forever, and the decision is on disk."""

import json

import pytest

from colocate.sandbox.errors import SandboxError
from colocate.sandbox.pinning import Pins


def test_first_touch_pins_and_later_touches_keep_it(tmp_path):
    pins = Pins(tmp_path / "pins.json")
    assert pins.touch("us-east.g1", "IAD", "enam") == ("IAD", True)
    # the Worker moved to Taipei and asks with another hint: the object stays
    assert pins.touch("us-east.g1", "TPE", "apac") == ("IAD", False)
    assert pins.touch("apac-tw.g2", "TPE", "apac") == ("TPE", True)
    assert pins.all() == {"us-east.g1": "IAD", "apac-tw.g2": "TPE"}


def test_pins_survive_a_new_process_view(tmp_path):
    Pins(tmp_path / "pins.json").touch("us-east.g1", "IAD", "enam")
    again = Pins(tmp_path / "pins.json")
    assert again.site_of("us-east.g1") == "IAD"
    assert again.touch("us-east.g1", "NRT", "") == ("IAD", False)
    assert json.loads((tmp_path / "pins.json").read_text())["us-east.g1"]["edge"] == "IAD"


def test_far_hint_places_away_from_the_edge(tmp_path):
    assert Pins(tmp_path / "p.json").touch("g", "TPE", "enam") == ("IAD", True)


def test_unreadable_table_is_a_clear_error(tmp_path):
    (tmp_path / "pins.json").write_text("{not json")
    with pytest.raises(SandboxError, match="pins.json: unreadable pin table"):
        Pins(tmp_path / "pins.json")
    (tmp_path / "pins.json").write_text('{"g": "IAD"}')
    with pytest.raises(SandboxError, match="not a pin table"):
        Pins(tmp_path / "pins.json")


def test_empty_name_is_refused(tmp_path):
    with pytest.raises(SandboxError, match="generation name"):
        Pins(tmp_path / "pins.json").touch("", "IAD")
