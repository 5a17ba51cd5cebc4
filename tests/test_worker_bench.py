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


def test_far_state_hook_is_a_clear_usage_error_until_the_sandbox_provides_it(capsys):
    try:
        import colocate.sandbox.bench  # noqa: F401
        pytest.skip("the sandbox provides the hook now")
    except ImportError:
        pass
    assert bench_router.main(["--requests", "1", "--concurrency", "1", "--far-state-ms", "170"]) == 2
    assert "sandbox" in capsys.readouterr().err


def test_usage_error_exits_2_as_a_subprocess():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_router.py"), "--concurrency", "x"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--concurrency" in res.stderr
