"""Budget flags, the stack's budgets, and when a budget is broken."""

import pytest

from colocate.errors import ConfigError
from colocate.probe import budgets
from colocate.probe.errors import UsageError


def test_flag_forms():
    assert budgets.parse_flag("state=25") == budgets.Budget("state", 25.0, "p50")
    assert budgets.parse_flag("upstream=400.5@p99") == budgets.Budget("upstream", 400.5, "p99")


@pytest.mark.parametrize("text,needle", [
    ("foo=10", "unknown segment 'foo'"), ("state=0", "not a positive number"), ("state=-3", "not a positive number"),
    ("state=abc", "not a positive number"), ("state", "expected NAME=MS"), ("state=inf", "not a positive number"),
    ("state=10@p75", "unknown percentile 'p75'"), ("=10", "expected NAME=MS"),
])
def test_bad_flags_name_the_flag_and_value(text, needle):
    with pytest.raises(UsageError) as err:
        budgets.parse_flag(text)
    assert str(err.value).startswith(f"--budget {text!r}: ") and needle in str(err.value)


def test_same_budget_twice_is_refused():
    with pytest.raises(UsageError, match="given twice"):
        budgets.from_flags(["state=1", "state=2"])
    assert len(budgets.from_flags(["state=1", "state=2@p99"])) == 2


def test_stack_budgets_are_p50_and_validated():
    assert budgets.from_stack({"e2e": 600}) == [budgets.Budget("e2e", 600.0)]
    assert {b.segment for b in budgets.from_stack(None)} == {"state", "state_rtt", "ttft", "itl"}  # the kit's defaults
    with pytest.raises(ConfigError, match="colocate:budgets.nope"):
        budgets.from_stack({"nope": 1})


def test_broken_when_the_percentile_exceeds_the_budget():
    segs = {"state": {"p50": 25.0, "p99": 90.0}, "e2e": {"p50": 300.0, "p99": 900.0}, "pod_rtt": {"p50": None}}
    bs = [budgets.Budget("state", 25), budgets.Budget("state", 50, "p99"), budgets.Budget("e2e", 250),
          budgets.Budget("pod_rtt", 40)]
    out = budgets.broken(bs, segs, {"state": None, "e2e": None})
    assert [(v["segment"], v["percentile"]) for v in out] == [("state", "p99"), ("e2e", "p50"), ("pod_rtt", "p50")]
    assert out[0]["message"] == "state p99 90.0 ms exceeds its 50 ms budget"
    assert out[2]["measured_ms"] is None and "could not be checked: no data" in out[2]["message"]
    with_floor = budgets.broken([budgets.Budget("state_rtt", 40)], {"state_rtt": {"p50": 171.0}}, {"state_rtt": 108.4})
    assert with_floor[0]["message"] == "state_rtt p50 171.0 ms exceeds its 40 ms budget (floor 108 ms)"
