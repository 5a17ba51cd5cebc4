"""bench/fleet_failover.py (make bench-fleet-failover): a cell losing its pod under load, through the front door."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench import fleet_failover as bench

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_windows_split_requests_by_when_they_started():
    rows = [(0.5, 20.0, 200, "pod-0", "apac-jp"), (1.2, 900.0, 200, "pod-0", "eu-west"),
            (1.4, 30.0, 502, None, None), (2.5, 25.0, 200, "fallback", "eu-west")]
    w = bench.window(rows, 1.0, 2.0)
    assert (w["requests"], w["failed"], w["fallback"], w["served_by"]) == (2, 1, 0, {"eu-west": 1})
    assert bench.window(rows, 2.0, float("inf"))["fallback"] == 1


def test_a_pod_that_errors_under_load_moves_tokyo_to_the_next_cell_with_nothing_failed(capsys):
    assert bench.main(["--mode", "error", "--rate", "20", "--seconds", "4", "--fault-after", "1.5",
                       "--window", "1.5", "--quiet", "--json", "-"]) == 0
    import json

    m = json.loads(capsys.readouterr().out)["modes"][0]
    assert m["total"]["failed"] == 0 and m["fallback_answers"] == 0
    assert set(m["before"]["served_by"]) <= {"apac-jp", "eu-west"} and m["before"]["served_by"].get("apac-jp", 0) > 0
    assert set(m["after"]["served_by"]) == {"eu-west"}


def test_a_pod_that_hangs_under_load_fails_nothing_the_keys_being_unlimited(capsys):
    # Each request to the hung pod holds for the 2 s deadline: 10 req/s a key keep ~20 in flight,
    # past the cells' default maxParallel (8), so a bench key with the defaults got 429s.
    assert bench.main(["--mode", "hang", "--rate", "20", "--seconds", "5", "--fault-after", "1.5",
                       "--window", "2", "--quiet", "--json", "-"]) == 0
    import json

    m = json.loads(capsys.readouterr().out)["modes"][0]
    assert m["total"]["failed"] == 0 and m["fallback_answers"] == 0
    assert m["total"]["served_by"].get("eu-west", 0) > 0


def test_a_bad_mode_is_named_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "bench.fleet_failover", "--mode", "melt"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "melt" in r.stderr and "error, down, hang" in r.stderr
