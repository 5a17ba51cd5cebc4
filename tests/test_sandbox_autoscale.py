"""``sandbox.py demo-autoscale --json`` on a short day of two cells' users (a tiny --shape): the
real fleet, controllers and pods. It asserts what holds under load: every request answered, the
JSON's keys, each total the sum of its cells, who served adding up, and nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.sandbox import fleet

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def processes_mentioning(text: str) -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            out.append(f"{proc.name}: {cmdline[:160]}")
    return out


def test_a_short_day_answers_every_request_and_its_totals_are_the_sums_of_its_cells(tmp_path):
    shape = tmp_path / "day.csv"
    # Tokyo busy in its evening, New York in its morning; eu-west has no users of its own.
    rows = ["cell,hour,requests_per_minute"]
    rows += [f"apac-jp,{h},{400 if 18 <= h <= 22 else 20}" for h in range(24)]
    rows += [f"us-east,{h},{300 if 8 <= h <= 12 else 10}" for h in range(24)]
    shape.write_text("\n".join(rows) + "\n")
    state = tmp_path / "state"
    # A 14 s day (an hour is 0.58 s): its controllers still scale cells up from 0, to 2 pods and down through a
    # drain while requests arrive (an apply takes hours of it), so a request lost in a change fails `failed == 0`;
    # a longer day only idles the fleet longer.
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "demo-autoscale", "--json", "--shape",
                        str(shape), "--state-dir", str(state), "--day-seconds", "14", "--requests", "60"],
                       capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert set(out) == {"requests", "failed", "cost", "served", "cells"}
    assert out["failed"] == 0 and 50 <= out["requests"] <= 70
    # every cell of the fleet is billed: eu-west has no users but may run pods for the others'
    assert set(out["cells"]) == {"apac-jp", "eu-west", "us-east"}
    for name, cell in out["cells"].items():
        assert set(cell) == {"cost", "peak_pod_share", "peak_p50_ms", "budget_e2e_ms"}
        assert set(cell["cost"]) == {"fixed", "api", "autoscaled"} and cell["budget_e2e_ms"] == 600
        if name == "eu-west":
            assert (cell["peak_pod_share"], cell["peak_p50_ms"], cell["cost"]["api"]) == (None, None, 0)
        else:
            assert 0 <= cell["peak_pod_share"] <= 1 and cell["peak_p50_ms"] > 0
    for k in ("fixed", "api", "autoscaled"):
        assert out["cost"][k] == round(sum(c["cost"][k] for c in out["cells"].values()), 2)
    assert set(out["served"]) == {"pod", "cell", "fallback"}
    assert sum(out["served"].values()) == out["requests"] - out["failed"]
    assert f"{out['requests']} requests, 0 failed" in r.stderr and "PASS  " in r.stderr
    # Each thing said once: three cells started and applied at every step, one note that the
    # sandbox runs its stand-in in place of the stacks' RunPod pods.
    assert r.stderr.count("colocate:pod.provider is 'runpod'") == 1, r.stderr[-3000:]
    png = state / "demo-autoscale.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fleet.what_runs(state / "fleet") == []
    assert processes_mentioning(str(state)) == []
