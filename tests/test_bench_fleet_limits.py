"""bench.fleet_limits' --move: its argument check and its report (the run itself is in docs/benchmarks.md)."""

from __future__ import annotations

from bench import fleet_limits


def test_move_refuses_an_rpm_too_small_for_its_75_percent_mark(capsys):
    assert fleet_limits.main(["--move", "5"]) == 2
    err = capsys.readouterr().err
    assert "--move 5" in err and "at least 10" in err


def test_the_move_report_gives_each_cell_s_lease_over_time_and_when_the_new_one_reached_its_marks():
    got = {"limit": 30, "sent": 20, "refused": 0, "reached_s": {0.75: 12.0, 0.9: 34.0},
           "timeline": [(0.0, 19, 14), (8.0, 10, 20), (16.0, 9, 24)]}
    text = fleet_limits.render_move(got)
    assert "0s 19/14  8s 10/20  16s 9/24" in text
    assert "75 % after 12.0 s, 90 % after 34.0 s" in text and "20 requests sent to it, 0 refused" in text
    got["reached_s"] = {}
    assert "neither 75 % nor 90 %" in fleet_limits.render_move(got)
