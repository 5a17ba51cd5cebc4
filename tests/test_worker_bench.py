"""scripts/bench_router.py: a tiny real run in-process, and its usage errors as a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_router  # noqa: E402

pytestmark = pytest.mark.slow


def test_small_run_reports_both_paths(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench_router.main(["--requests", "30", "--max-seconds", "10", "--concurrency", "1,4", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    for lv in result["levels"]:
        assert lv["direct"]["n"] == 30 and lv["worker"]["n"] == 30
        assert lv["worker"]["backends"] == {"pod": 30}  # the router really served from the pod
        assert lv["direct"]["state_p50_ms"] is None and lv["worker"]["state_p50_ms"] is not None
        assert lv["added_p50_ms"] == pytest.approx(lv["worker"]["p50_ms"] - lv["direct"]["p50_ms"], abs=0.01)
    assert "added p50" in capsys.readouterr().out


def test_far_state_leaves_the_hot_path_at_zero(capsys):
    # The object 150 ms away (sandbox delay on that hop only): a forced round trip pays it,
    # a routed request with fresh isolate state does not.
    assert bench_router.main(["--requests", "20", "--concurrency", "1", "--compute-ms", "1", "--max-seconds", "30",
                              "--far-state-ms", "150", "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["far_state"]["state_colo"] == "IAD"
    assert 150 <= result["far_state"]["state_rtt_p50_ms"] < 250
    assert result["levels"][0]["worker"]["state_p50_ms"] == 0


def test_usage_error_exits_2_as_a_subprocess():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_router.py"), "--concurrency", "x"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--concurrency" in res.stderr
