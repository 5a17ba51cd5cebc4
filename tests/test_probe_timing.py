"""Server-Timing parsing: the contract's header, and what real headers get wrong."""

from colocate.probe import timing

ROUTED = ("state", "upstream", "fallback", "total")


def test_contract_header():
    t = timing.parse("state;dur=12.5, upstream;dur=65, fallback;dur=0, total;dur=80.1", ROUTED)
    assert t.ok
    assert t.durations == {"state": 12.5, "upstream": 65.0, "fallback": 0.0, "total": 80.1}


def test_desc_with_commas_and_semicolons_and_extra_metrics():
    t = timing.parse('cfCacheStatus;desc="a, b; c", state;desc="wait";dur=3, upstream;dur="7.5", '
                     "fallback;dur=0, total;dur=11", ROUTED)
    assert t.ok, t.problems
    assert t.durations["state"] == 3.0 and t.durations["upstream"] == 7.5
    assert "cfCacheStatus" not in t.durations  # no dur: nothing to time


def test_first_occurrence_wins():
    t = timing.parse("state;dur=1, state;dur=99, upstream;dur=2, fallback;dur=0, total;dur=3", ROUTED)
    assert t.durations["state"] == 1.0


def test_missing_header_is_a_problem_only_when_metrics_are_expected():
    assert timing.parse(None, ROUTED).problems == ("no Server-Timing header",)
    assert timing.parse("  ", ROUTED).problems == ("no Server-Timing header",)
    assert timing.parse(None).ok


def test_malformed_entries_are_reported_and_good_ones_kept():
    t = timing.parse("state;dur=abc, upstream;dur=65, fallback, total;dur=", ROUTED)
    assert t.durations == {"upstream": 65.0}
    assert not t.ok
    assert any(p.startswith("state: dur='abc'") for p in t.problems)
    assert "fallback: no dur" in t.problems
    assert any(p.startswith("total:") for p in t.problems)


def test_negative_and_non_finite_durations_are_malformed():
    t = timing.parse("state;dur=-1, upstream;dur=nan, fallback;dur=inf, total;dur=1", ROUTED)
    assert t.durations == {"total": 1.0}
    assert len(t.problems) == 3


def test_absent_expected_metric():
    t = timing.parse("state;dur=1, total;dur=2", ROUTED)
    assert set(t.problems) == {"upstream: missing", "fallback: missing"}


def test_bad_metric_name():
    t = timing.parse("st ate;dur=1", ())
    assert t.problems == ("bad metric name 'st ate'",)
