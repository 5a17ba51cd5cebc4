"""Ledger shape and transitions: pure, every illegal step."""

import pytest

from colocate.cell.ledger import Ledger
from colocate.errors import ConfigError, LedgerError, UnknownRegion


def ledger(*entries):
    return Ledger.parse([{"name": n, "region": r, "status": s} for n, r, s in entries])


ONE = ledger(("us-east.g1", "us-east", "active"))


def test_start_makes_a_new_active_generation_named_for_its_region():
    moved = ONE.start("apac-tw")
    assert moved.active.name == "apac-tw.g2" and moved.active.region == "apac-tw"
    assert moved.draining.name == "us-east.g1"
    assert ONE.active.name == "us-east.g1", "transitions return a new ledger"


def test_finish_retires_the_draining_generation():
    done = ONE.start("apac-tw").finish()
    assert done.draining is None and [g.name for g in done.retired] == ["us-east.g1"]
    again = done.start("us-east")
    assert again.active.name == "us-east.g3", "numbers never repeat, so a name is never reused"


def test_start_while_draining_is_refused():
    with pytest.raises(LedgerError, match="already under way"):
        ONE.start("apac-tw").start("apac-jp")


def test_finish_with_nothing_draining_is_refused():
    with pytest.raises(LedgerError, match="nothing to finish"):
        ONE.finish()


def test_move_to_the_same_region_is_refused():
    with pytest.raises(LedgerError, match="already lives there"):
        ONE.start("us-east")


def test_move_to_an_unknown_region_is_refused():
    with pytest.raises(UnknownRegion, match="apac-tw"):
        ONE.start("moon-1")


@pytest.mark.parametrize("raw, match", [
    (None, "non-empty list"),
    ([], "non-empty list"),
    (["us-east.g1"], "mapping"),
    ([{"name": "bad name!", "region": "us-east", "status": "active"}], "name"),
    ([{"name": "x", "region": "mars", "status": "active"}], "unknown region"),
    ([{"name": "x", "region": "us-east", "status": "live"}], "unknown status"),
    ([{"name": "x", "region": "us-east", "status": "active"}, {"name": "x", "region": "us-east", "status": "retired"}], "twice"),
    ([{"name": "a", "region": "us-east", "status": "draining"}, {"name": "b", "region": "us-east", "status": "draining"},
      {"name": "c", "region": "us-east", "status": "active"}], "at most one"),
])
def test_malformed_ledgers(raw, match):
    with pytest.raises(ConfigError, match=match):
        Ledger.parse(raw)


def test_region_check_names_the_migrate_command():
    with pytest.raises(LedgerError) as err:
        ONE.check_region("apac-tw", "prod")
    assert_runnable_command(str(err.value), "scripts/migrate.py start --stack prod --to apac-tw")


def assert_runnable_command(message: str, tail: str) -> None:
    """The printed command runs as printed from the project root: the project's venv
    python (the system one lacks the kit's packages) and a script that exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    commands = re.findall(r"`([^`]+)`", message)
    cmd = next(c for c in commands if tail in c)
    argv = cmd.split()
    assert argv[0] == ".venv/bin/python", cmd
    assert (root / argv[1]).is_file(), cmd
    assert cmd == f".venv/bin/python {tail}", cmd


def test_adopted_generation_of_unknown_region_is_accepted_and_can_move():
    adopted = Ledger.parse([{"name": "breaker", "region": "unknown", "status": "active", "observedColo": "iad"}])
    adopted.check_region("apac-jp")
    assert adopted.active.observed_colo == "IAD"
    moved = adopted.start("apac-jp")
    assert moved.active.name == "apac-jp.g1" and moved.draining.name == "breaker"


def test_round_trip_through_config():
    moved = ONE.start("apac-tw")
    assert Ledger.parse(moved.as_config()) == moved
