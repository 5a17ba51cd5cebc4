"""bench.scale run small in real workerd: what a sync answers is measured as the object sends it
(a binary key filter at its bytes, not JSON's object of indexes), and an isolate's first sync,
which carries the filter, is reported apart from the steady state the goals are about."""

import json

import pytest

from bench import scale

pytestmark = pytest.mark.slow


def test_scale_reports_the_first_sync_apart_and_counts_the_key_filter_at_its_bytes(tmp_path):
    out = tmp_path / "scale.json"
    # timing goals are reported, not asserted here: the exit is 0 or 1 by them
    assert scale.main(["--keys", "2000", "--active", "200", "--isolates", "4", "--seconds", "3",
                       "--router-rate", "5", "--json", str(out)]) in (0, 1)
    r = json.loads(out.read_text())
    assert r["sync_errors"] == 0 and r["router_non_200"] == 0 and r["router_requests"] > 0
    assert r["first_syncs"] == 4 and r["syncs"] > 0
    # the smallest filter is 16 KB (keyfilter.js); the first view's JSON around it is small
    assert 16 * 1024 < r["first_view_bytes_max"] < 16 * 1024 + 4096
    # the steady state: key-row deltas and the counters of the isolate's 50 keys
    assert r["goals"]["view_bytes_p99"]["met"] and 0 < r["view_bytes_p50"] <= r["view_bytes_p99"]


def test_scale_names_a_bad_value(capsys):
    with pytest.raises(SystemExit) as exc:
        scale.main(["--isolates", "0"])
    assert exc.value.code == 2 and "--isolates must be at least 1 (got 0)" in capsys.readouterr().err
