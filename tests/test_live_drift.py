"""Drift caught from real traffic, in the sandbox: while requests flow, the cell's compute is moved
to Taipei by hand and the state object stays in Ashburn (`--force-split`). The router never waits
on state, so no request shows it; the isolates' background syncs do (segment `sync`, keyed by
the object's colo). `probe.py --live` must flag it within a minute of the split, naming the
segment and the colo, and clear once a generation-rename migration has fixed it."""

from __future__ import annotations

import json
import time

import pytest

from colocate import stackfile
from colocate.probe.histogram import DEFAULT_BUCKETS
from colocate.sandbox import supervisor
from colocate.sandbox.geography import Geography
from scripts import cost, migrate, probe
from tests.support.sandbox import Load, load_key, sandbox_stacks

pytestmark = pytest.mark.slow
# What is judged is the isolates' syncs, and an isolate syncs at most once a half stateTtlMs (1 s,
# refresh-ahead) and a second after usage (its flush) whatever the rate above one request a second:
# 5 a second gives each minute as many syncs as 15 did, and 300 requests (the fallback's share
# counts from 3 fallback answers, 1 % of them).
RATE_PER_S = 5
MAX_LOAD_S = 420  # the load stops by itself even if the test fails
FLAG_WITHIN_S = 60
CLEAR_WITHIN_S = 150  # the fix's own minute still holds the old syncs: clear by the next one, with slack


@pytest.fixture
def stacks(tmp_path):
    d = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    # The split's syncs take the emulated Taipei-Ashburn round trip (~196 ms), a same-site one 10 ms
    # plus the machine's time: a state_rtt budget of half the split's round trip is decided by the
    # geography, not by the load (40 ms, the stack's, a loaded machine's same-site syncs exceed).
    stackfile.write_config("sandbox", {"budgets.state_rtt": round(Geography().rtt_ms("TPE", "IAD") / 2)}, d)
    return d


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    yield d
    supervisor.down(d, quiet=True)


def live(state_dir, out, capsys) -> tuple[int, dict]:
    code = probe.main(["--live", "--state-dir", str(state_dir), "--since", "10m", "--json", str(out)])
    capsys.readouterr()
    return code, json.loads(out.read_text())


def poll(state_dir, out, capsys, until, within_s):
    deadline = time.monotonic() + within_s
    while True:
        code, doc = live(state_dir, out, capsys)
        if until(code, doc) or time.monotonic() > deadline:
            return code, doc
        time.sleep(2)


def test_a_split_is_flagged_within_a_minute_and_clears_after_the_migration(stacks, state_dir, tmp_path, capsys):
    cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    key = load_key(cell, "traffic")
    out = tmp_path / "live.json"
    with Load(cell["worker_url"], key["key"], RATE_PER_S, MAX_LOAD_S) as load:
        # the isolates learn the object's colo in the background after their first flush
        code, doc = poll(state_dir, out, capsys, lambda c, d: d["requests"] > 20 and d["placement"]["state"], 30)
        assert code == 0, doc["violations"]
        assert doc["placement"]["ran"] == "IAD" and doc["placement"]["state"] == "IAD"

        # compute moved to Taipei by hand; the ledger still names us-east.g1, pinned in Ashburn
        stackfile.write_config("sandbox", {"region": "apac-tw"}, stacks)
        supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks, force_split=True)
        split_at = time.monotonic()

        def flagged(c, d):
            # failed on the state object, with the evidence: syncs from Taipei answered in Ashburn
            return (c == 1 and any(v["part"] == "state" for v in d["violations"])
                    and any(s["colo"] == "IAD" and "TPE" in s["from"] for s in d["colos"]["state"]))

        code, doc = poll(state_dir, out, capsys, flagged, FLAG_WITHIN_S)
        took = time.monotonic() - split_at
        assert flagged(code, doc), doc["violations"]
        assert took <= FLAG_WITHIN_S
        state = next(v for v in doc["violations"] if v["part"] == "state")
        assert "segment sync (state_rtt), state colo IAD" in state["message"], state
        iad = next(s for s in doc["colos"]["state"] if s["colo"] == "IAD")
        # every such sync takes at least the emulated round trip: its p50 at least that, less the histograms' error
        floor = Geography().rtt_ms("TPE", "IAD") * (1 - DEFAULT_BUCKETS.relative_error)
        assert iad["latest"] and iad["from"]["TPE"]["p50"] >= floor
        with capsys.disabled():
            print(f"split flagged {took:.0f} s after it started: {state['message']}")

        # the fix: a generation-rename migration to apac-tw, first touched from Taipei
        assert migrate.main(["start", "--stack", "sandbox", "--to", "apac-tw", "--stacks-dir", str(stacks)]) == 0
        moved = supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks)
        assert moved["generation"] == "apac-tw.g2"
        fixed_at = time.monotonic()
        code, doc = poll(state_dir, out, capsys, lambda c, d: c == 0, CLEAR_WITHIN_S)
        assert code == 0, doc["violations"]
        assert doc["placement"]["state"] == "TPE" and doc["placement"]["ran"] == "TPE"
        assert any("answered from IAD (out of region)" in n for n in doc["notes"]), doc["notes"]
        with capsys.disabled():
            print(f"cleared {time.monotonic() - fixed_at:.0f} s after the migration")
    assert not load.failures(), load.failures()[:5]

    # The cost of this traffic, at the sandbox's stand-in price and the stack's fallbackPrice.
    assert cost.main(["--stack", "sandbox", "--state-dir", str(state_dir), "--stacks-dir", str(stacks), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pods"]["requests"] >= len(load.results) * 0.9 and report["pods"]["tokens"] > 0
    assert "maxPricePerHr" in report["cost_source"] and report["fallback_price_per_m"] == {"input": 0.15, "output": 0.6}
    assert report["hours"] < 1 and report["break_even_tokens_per_day"] > 0
