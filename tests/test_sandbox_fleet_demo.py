"""`make demo-fleet` (`sandbox.py demo-fleet`): its story, told with no failed request, and Ctrl-C
at any phase of it leaving nothing running. Each test runs the demo in a directory of its own
(the fleet `up --fleet` starts, what its tests read: tests/test_sandbox_fleet.py).
"""

from __future__ import annotations

import pytest

from colocate.sandbox import fleet
from tests.test_sandbox_fleet import CELLS, SANDBOX, SITES, assert_nothing_runs, cli
from tests.test_sandbox_signals import assert_no_traceback_of_ours, interrupt, python_was_starting

pytestmark = pytest.mark.slow


# --- make demo-fleet ----------------------------------------------------------------------------

def test_demo_fleet_tells_the_story_with_no_failed_request(tmp_path):
    res = cli("demo-fleet", "--state-dir", str(tmp_path / "demo"), "--samples", "3", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines()]

    def row(phase: str, client: str) -> list[str]:
        """[served by, backend, e2e p50/p90, n, failed] of one row of the closing table."""
        head = [*phase.split(), client]
        return next(r[len(head):] for r in rows if r[:len(head)] == head)

    for site, cell in zip(SITES, CELLS, strict=True):
        assert row("1 home", site)[:2] == [cell, "pod-0"]
        assert row("3 pods back", site)[:2] == [cell, "pod-0"]
    assert row("2 pods lost", "NRT")[:2] == ["eu-west", "pod-0"]  # the next nearest cell's pod, not the fallback
    alone = next(r for r in rows if r[:5] == ["2", "pods", "lost", "NRT", "without"])
    assert alone[7] == "fallback"
    # What the pod hop costs, per cell: a measured p50 on the pooled connection and on a new one.
    # A new one pays at least TLS 1.3's handshake round trip and the check's own, each at least
    # the emulated 10 ms same-site round trip (a lower bound that holds under load).
    for cell in CELLS:
        pooled, new, n = next(r[1:] for r in rows if len(r) == 4 and r[0] == cell)
        assert n == "5" and float(pooled) > 0 and float(new) >= 20, (cell, pooled, new)
    assert any(line.strip().endswith(", 0 failed") for line in res.stdout.splitlines()), res.stdout[-2000:]
    assert (tmp_path / "demo" / "demo-fleet.png").stat().st_size > 10_000
    assert_nothing_runs(tmp_path)


@pytest.mark.parametrize("delay", (1.0, 4.0, 8.0))
def test_ctrl_c_during_the_demo_leaves_nothing_running(tmp_path, delay):
    """Up, the load of a phase, the cell's apply: the demo always brings the fleet down."""
    try:
        res = interrupt(SANDBOX + ["demo-fleet", "--state-dir", str(tmp_path / "demo"), "--samples", "3"], delay)
        if not python_was_starting(res):
            assert res.returncode in (0, 130), res.stderr[-2000:]
        if res.returncode == 130:
            # A loaded machine may still be importing at the signal: "before doing anything".
            assert "nothing it started is running" in res.stderr or "before doing anything" in res.stderr, res.stderr[-2000:]
        assert_no_traceback_of_ours(res)
        assert_nothing_runs(tmp_path)
    finally:
        if (tmp_path / "demo" / "fleet").exists():
            fleet.down(tmp_path / "demo" / "fleet")
