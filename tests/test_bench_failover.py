"""bench/failover.py (make bench-failover) run small: both sandbox pods serve before pod 1 is killed,
so its death is measured, and the other takes its requests."""

import json

import pytest

from bench import failover

pytestmark = pytest.mark.slow


def test_the_killed_pod_was_serving_and_the_other_takes_over(tmp_path):
    out = tmp_path / "failover.json"
    assert failover.main(["--rate", "20", "--seconds", "6", "--kill-after", "3", "--compute-ms", "20",
                          "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["before"]["backends"] == ["pod-0", "pod-1"]
    assert "pod-1" not in r["after"]["backends"] and r["after"]["requests"] > 0
