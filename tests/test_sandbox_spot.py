"""``sandbox.py demo-spot --json`` on a short day (a tiny --shape, fewer requests): the real fleet,
controllers, keepers and pods, on the interruptible day alone (``--day``), its pods preempted at the
published rate. The on-demand day runs the same code bar the preemptions and the price (a SpotDay is
demo-autoscale's day, tests/test_sandbox_autoscale.py), so a second fleet here would double the
file's CPU for no new line. It asserts outcomes that hold under load: pods were preempted and the
keeper replaced them, no request failed other than the streams a preemption cut (counted), the JSON's
figures add up, and nothing is left running. Not the bill's ratio: a short day's applies take hours
of its compressed clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.sandbox import fleet, spot_demo, statedir
from colocate.scaling import spot_day
from tests.test_sandbox_autoscale import processes_mentioning

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_a_short_day_on_interruptible_pods_fails_nothing_but_cut_streams_and_replaces_what_was_preempted(tmp_path):
    shape = tmp_path / "day.csv"
    rows = ["cell,hour,requests_per_minute"]
    rows += [f"apac-jp,{h},{400 if 8 <= h <= 22 else 20}" for h in range(24)]
    rows += [f"us-east,{h},{300 if 8 <= h <= 20 else 10}" for h in range(24)]
    shape.write_text("\n".join(rows) + "\n")
    state = tmp_path / "state"
    # A 20 s day whose keepers pass every 30 minutes of it (the demo's default: every minute of a 150 s day). Its
    # hours are the demo's, so are its pod-hours and the preemptions drawn over them at the published rate (about
    # ten on the interruptible day, about half of them replaced before the day ends), and its 80 streams still meet
    # pods that died. A keeper that replaces nothing fails `replaced > 0`; a Worker that fails a request a
    # preempted pod had not begun fails `failed == 0`. What it saves is the CPU of back-to-back passes (a minute
    # of a 40 s day is 28 ms) and of a fleet idling through a longer day.
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "demo-spot", "--json", "--shape", str(shape),
                        "--state-dir", str(state), "--day-seconds", "20", "--requests", "80", "--seed", "3",
                        "--keep-interval", "1800", "--day", "interruptible"],
                       capture_output=True, text=True, cwd=ROOT, timeout=420)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert list(out["days"]) == ["interruptible"]
    spot = out["days"]["interruptible"]
    assert spot["market"] == "interruptible"
    assert spot["preemptions"] > 0 and spot["replaced"] > 0  # seed 3: pods preempted, and replaced alone
    # each preempted pod back in service no sooner than its replacement's boot (the 20 s day's updates stretch it)
    back = spot["back_in_service_min"]
    assert 0 < back["n"] <= spot["replaced"] and 20 <= back["p50"] <= back["p90"], back
    # the same replacements, to when each began, then from then to serving: the boot at least
    waited, took = spot["waited_to_replace_min"], spot["replace_took_min"]
    assert waited["n"] == took["n"] == back["n"] and 0 <= waited["p50"] <= waited["p90"] < back["p90"], waited
    assert 20 <= took["p50"] <= took["p90"] <= back["p90"], took
    assert spot["failed"] == 0, r.stderr[-3000:]
    assert spot["cost"]["autoscaled"] == pytest.approx(spot["cost"]["pods"] + spot["cost"]["fallback"], abs=0.011)
    assert set(spot["fallback"]["usd_by_cell"]) == {"apac-jp", "eu-west", "us-east"}
    assert spot["fallback"]["cap_usd_per_cell"] == 20
    assert spot["ttft_ms"]["n"] > 0 and spot["ttft_ms"]["p50"] <= spot["ttft_ms"]["p99"]
    # each update's Worker swap held the cell's edge for a while (which Cloudflare's does not): recorded, and the
    # requests that met one set apart
    holds = [h for c in ("apac-jp", "eu-west", "us-east") for h in spot_demo.edge_holds(state / "interruptible" / c)]
    assert holds and all(0 < b - a < 60 for a, b in holds), holds
    assert spot["ttft_ms_unheld"]["n"] <= spot["ttft_ms"]["n"]
    # the day as it happened, for a look past its figures: every request, each preemption and replacement,
    # each hold (in hours of the day), and each cell's billed pods
    record = json.loads((state / "interruptible" / statedir.DAY_RECORD_FILE).read_text())
    sent = record["requests"]
    assert len(sent) == 80 and sum(1 for q in sent if not q["ok"] and not q["cut"]) == spot["failed"]
    assert sum(1 for q in sent if q["cut"]) == spot["cut"]
    on_pods = [q for q in sent if q["ok"] and q["ttft_ms"] is not None and (q["backend"] or "").startswith("pod-")]
    assert len(on_pods) == spot["ttft_ms"]["n"] and sum(not q["held"] for q in on_pods) == spot["ttft_ms_unheld"]["n"]
    # where each TTFT went: the router's segments up to its answer's headers, within the client's wait for them
    assert all({"state", "upstream", "total"} <= set(q["timing"]) for q in on_pods), on_pods[0]
    assert all(q["timing"]["state"] <= q["timing"]["total"] <= q["timing"]["headers"] <= q["ttft_ms"] for q in on_pods)
    assert len(record["preempted"]) == spot["preemptions"]
    assert {p["cell"] for p in record["preempted"]} <= set(spot["fallback"]["usd_by_cell"])
    assert sum(len(r["pods"]) for r in record["replaced"]) >= spot["replaced"] > 0
    assert all(r["decided_h"] <= r["serving_h"] for r in record["replaced"])
    assert sum(len(v) for v in record["holds"].values()) == len(holds)
    assert all(0 <= a < b for v in record["holds"].values() for a, b in v)
    assert all(steps and min(h for h, _ in steps) >= 0 for steps in record["billed"].values())
    assert spot["pod_per_hr"] == pytest.approx(spot_demo.ON_DEMAND_PER_HR * spot_day.INTERRUPTIBLE_SHARE)
    assert "preempted (its host took it back)" in r.stderr and "keeper: replacing pod" in r.stderr
    assert fleet.what_runs(state / "interruptible" / "fleet") == []
    assert not (state / "ondemand").exists()  # the other day never started
    assert processes_mentioning(str(state)) == []


def test_a_negative_spare_is_refused_naming_the_flag_and_starts_nothing(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "demo-spot", "--spare", "-1",
                        "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--spare -1" in r.stderr and "Fix: e.g. --spare 1" in r.stderr, r.stderr
    assert not (tmp_path / "state").exists()
