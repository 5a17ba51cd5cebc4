"""The compressed day's arithmetic (colocate/scaling/day.py): the shape CSV and --prices, the
send schedule, pod-hours, the three-way bill and the done-when verdicts. Pure and fast; the
demo itself runs in tests/test_sandbox_autoscale.py. A bad --shape through the CLI is refused
before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from colocate.errors import ConfigError
from colocate.scaling import day as day, policy as scale

ROOT = Path(__file__).resolve().parent.parent
CELLS = ("apac-jp", "eu-west", "us-east")
OFFSETS = {"apac-jp": 9, "eu-west": 1, "us-east": -5}


def csv_of(shape: dict[str, list[float]], header: bool = True) -> str:
    lines = ["cell,hour,requests_per_minute"] if header else []
    lines += [f"{c},{h},{v}" for c, rpm in shape.items() for h, v in enumerate(rpm)]
    return "\n".join(lines) + "\n"


def test_a_shape_reads_every_cell_and_hour_and_leaves_unnamed_cells_without_users():
    text = csv_of({"apac-jp": [10.0 * h for h in range(24)], "us-east": [5.0] * 24})
    shape = day.parse_shape(text + "\n# a comment\n", CELLS)
    assert list(shape) == ["apac-jp", "us-east"]
    assert shape["apac-jp"][23] == 230.0 and shape["us-east"] == (5.0,) * 24
    assert day.parse_shape(csv_of({"eu-west": [1] * 24}, header=False), CELLS) == {"eu-west": (1.0,) * 24}


@pytest.mark.parametrize("line, field, value, fix", [
    ("apac-jp,3", "line 2", "'apac-jp,3'", "cell,hour,requests_per_minute"),
    ("tokyo,3,10", "line 2 field cell", "'tokyo'", "one of apac-jp, eu-west, us-east"),
    ("apac-jp,three,10", "line 2 field hour", "'three'", "an hour 0-23"),
    ("apac-jp,24,10", "line 2 field hour", "'24'", "an hour 0-23"),
    ("apac-jp,3,-1", "line 2 field requests_per_minute", "'-1'", "requests per minute"),
    ("apac-jp,3,nan", "line 2 field requests_per_minute", "'nan'", "requests per minute"),
    ("apac-jp,0,10", "line 3 field hour", "'0'", "already on line 2"),
])
def test_a_bad_line_is_refused_naming_the_line_the_field_the_value_and_the_fix(line, field, value, fix):
    text = "cell,hour,requests_per_minute\n" + line + "\n" + csv_of({"apac-jp": [1] * 24}, header=False)
    with pytest.raises(ConfigError) as err:
        day.parse_shape(text, CELLS, "--shape day.csv")
    msg = str(err.value)
    assert msg.startswith(f"--shape day.csv {field}:") and f"(got {value})" in msg and fix in msg, msg


def test_a_cell_missing_hours_or_a_day_without_traffic_is_refused():
    text = csv_of({"apac-jp": [1] * 24}).replace("apac-jp,7,1\n", "")
    with pytest.raises(ConfigError, match=r"--shape cell apac-jp: lacks hour\(s\) \[7\].*apac-jp,7,"):
        day.parse_shape(text, CELLS)
    with pytest.raises(ConfigError, match="the day has no traffic"):
        day.parse_shape(csv_of({"apac-jp": [0] * 24}), CELLS)
    with pytest.raises(ConfigError, match="no lines of traffic"):
        day.parse_shape("cell,hour,requests_per_minute\n", CELLS)


def test_prices_are_two_positive_numbers():
    assert day.parse_prices("0.6,0.3") == day.Prices(0.6, 0.3)
    for bad, key in (("0.6", "--prices"), ("x,0.3", "--prices POD_PER_HR"), ("0.6,0", "--prices API_PER_1M"),
                     ("0.6,inf", "--prices API_PER_1M")):
        with pytest.raises(ConfigError, match=f"^{key}:.*Fix: --prices POD_PER_HR,API_PER_1M"):
            day.parse_prices(bad)


def test_the_schedule_sends_each_cells_day_in_its_local_time_at_the_chosen_scale():
    shape = day.default_shape(CELLS)
    per = day.per_request(shape, 900)
    assert per == round(day.day_requests(shape) / 900)
    plan = day.schedule(shape, OFFSETS, per)
    assert [t for t, _ in plan] == sorted(t for t, _ in plan) and all(0 <= t < 24 for t, _ in plan)
    for cell in CELLS:
        mine = [t for t, c in plan if c == cell]
        assert abs(len(mine) - sum(shape[cell]) * 60 / per) <= 1
        by_hour = [sum(1 for t in mine if int(t) == h) for h in range(24)]
        busiest = max(range(24), key=lambda h: by_hour[h])
        assert day.local_hour(busiest, OFFSETS[cell]) == day.DEFAULT_DAY.index(max(day.DEFAULT_DAY))  # 20:00 local
    # Tokyo's evening is Europe's noon and New York's night: the peaks are hours apart
    assert [day.local_hour(11, OFFSETS[c]) for c in CELLS] == [20, 12, 6]


def test_pod_hours_integrate_the_pods_that_exist_and_stop_at_the_end_of_the_day():
    assert day.pod_hours([(0.0, 1), (6.0, 2), (8.5, 0), (20.0, 1)]) == pytest.approx(6 + 5 + 4)
    assert day.pod_hours([(0.0, 2), (30.0, 0)]) == 48.0  # a change after the day is not billed
    assert day.pod_hours([]) == 0.0
    assert day.pod_hours([(0.0, 0), (5.0, 2), (5.0, 1)]) == 19.0  # recorded in that order at one time: 1 holds


@pytest.mark.parametrize("rpm", [0, 50, 99, 103, 150, 299, 350, 404, 420, 700])
def test_the_shapes_pod_count_is_the_cost_policys_own(rpm):
    prices, tokens = day.Prices(0.6, 0.3), 339
    policy = scale.Policy(min=0, max=2, target_rpm=300, up_after_s=0, down_after_s=0, policy=scale.COST,
                          pod_price_per_hr=0.6, api_price=(0.3, 0.3))
    iv = scale.Interval(0, 60, rpm, tokens, 0)
    n = day.pods_needed(rpm, 300, prices, tokens, 2)
    assert n == scale.need(iv, policy)
    # the demo's controller sees one request in 953, with target and pod price divided alike: same count
    per = 953
    scaled = scale.Policy(min=0, max=2, target_rpm=300 / per, up_after_s=0, down_after_s=0, policy=scale.COST,
                          pod_price_per_hr=0.6 / per, api_price=(0.3, 0.3))
    assert scale.need(scale.Interval(0, 60, rpm / per, tokens, 0), scaled) == n


def served(at_h, home, by, tokens=100, e2e=120.0):
    if by is None:
        return day.Served(at_h, home, False)
    cell = home if by == "pod" else "eu-west"
    return day.Served(at_h, home, True, cell, "fallback" if by == "fallback" else "pod-0", tokens, e2e)


def test_the_bill_three_ways_per_cell_and_in_total():
    shape = {"apac-jp": tuple([10.0] * 20 + [100.0] * 4), "us-east": (50.0,) * 24}
    requests = [served(12.0, "apac-jp", "pod", e2e=100), served(12.5, "apac-jp", "cell", e2e=300),  # 21:00-21:30 local
                served(13.0, "apac-jp", "fallback", e2e=200), served(1.0, "apac-jp", "fallback"),
                served(3.0, "us-east", "pod"), served(4.0, "us-east", None)]
    pods = {"apac-jp": [(0.0, 0), (11.0, 1), (15.0, 0)], "us-east": [(0.0, 1)]}
    out = day.report(shape, OFFSETS, requests, pods, day.Prices(0.5, 2.0), per=1000, max_pods=2,
                     budgets={"apac-jp": 250.0, "us-east": 600.0})
    jp, us = out["cells"]["apac-jp"], out["cells"]["us-east"]
    # API: every request of the cell's users, 100 tokens x 1000 each, at $2 per 1M
    assert jp["cost"] == {"fixed": 24.0, "api": 0.8, "autoscaled": 4 * 0.5 + 0.4}
    assert us["cost"] == {"fixed": 24.0, "api": 0.2, "autoscaled": 12.0}  # the failed request carried no tokens
    # apac-jp's peak: local 20-24 (UTC 11-15): three requests, two by a pod (its own and another cell's)
    assert (jp["peak_pod_share"], jp["peak_p50_ms"], jp["budget_e2e_ms"]) == (0.6667, 200.0, 250.0)
    assert us["peak_pod_share"] == 0.5  # a flat day is all peak; the failure counts against it
    assert out["cost"] == {k: round(jp["cost"][k] + us["cost"][k], 2) for k in ("fixed", "api", "autoscaled")}
    assert (out["requests"], out["failed"], out["served"]) == (6, 1, {"pod": 2, "cell": 1, "fallback": 2})
    assert set(out) == {"requests", "failed", "cost", "served", "cells"}
    assert set(jp) == {"cost", "peak_pod_share", "peak_p50_ms", "budget_e2e_ms"}
    verdicts = day.verdicts(out)
    assert [ok for ok, _ in verdicts] == [False, False, False, True]
    assert "6 requests, 1 failed" in verdicts[1][1] and "apac-jp 66.7 %" in verdicts[2][1]


def test_the_verdicts_pass_a_day_that_meets_them():
    out = {"requests": 10, "failed": 0, "cost": {"fixed": 40.0, "api": 30.0, "autoscaled": 22.5}, "served": {},
           "cells": {"a": {"peak_pod_share": 0.95, "peak_p50_ms": 600.0, "budget_e2e_ms": 600.0},
                     "b": {"peak_pod_share": None, "peak_p50_ms": None, "budget_e2e_ms": 600.0}}}  # b: no users
    assert all(ok for ok, _ in day.verdicts(out))
    assert "b n/a" in day.verdicts(out)[2][1]
    out["cost"]["autoscaled"] = 22.51
    assert not day.verdicts(out)[0][0]
    out["cells"]["a"]["peak_p50_ms"] = 601.0
    assert not day.verdicts(out)[3][0]
    out["cells"]["a"]["peak_pod_share"] = None
    assert not day.verdicts(out)[2][0]  # no cell to judge at all: not a pass


def test_a_bad_shape_file_exits_2_before_anything_starts(tmp_path):
    bad = tmp_path / "day.csv"
    bad.write_text("cell,hour,requests_per_minute\napac-jp,25,10\n")
    state = tmp_path / "state"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "demo-autoscale", "--shape", str(bad),
                        "--state-dir", str(state)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"--shape {bad} line 2 field hour: is outside 0-23 (got '25'). Fix: an hour 0-23" in r.stderr
    assert not state.exists()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "demo-autoscale", "--shape",
                        str(tmp_path / "none.csv"), "--prices", "1,1"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 2 and "none.csv" in r.stderr and "Fix:" in r.stderr
