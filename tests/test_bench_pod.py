"""make bench-pod (bench/pod.py): a sweep over HTTP against a stand-in, in virtual time, and its knee."""

from __future__ import annotations

import json
import time

import pytest

from bench import pod as bench
from colocate.pods import standin


def test_a_sweep_over_http_measures_tokens_and_finds_the_knee(tmp_path, capsys):
    out = tmp_path / "points.json"
    with standin.serve(profile="rtx4090-qwen2.5-7b-int4", seed=3) as server:
        assert bench.main(["--url", server.url, "--concurrency", "1,4", "--prompts", "4", "--input-tokens", "64",
                           "--output-tokens", "8", "--budget-ms", "5000", "--json", str(out)]) == 0
        # The client is done at [DONE]; the pod's thread counts the stream after its last write.
        deadline = time.monotonic() + 10
        while server.streams["completed"] < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.streams
    points = json.loads(out.read_text())["points"]
    assert [p["concurrency"] for p in points] == [1, 4] and all(p["requests"] == 4 and not p["errors"] for p in points)
    assert stats["completed"] == 8
    for p in points:
        assert p["ttft_p50_ms"] > 0 and p["output_tok_s"] > 0 and p["itl_p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "knee (TTFT p99 <= 5000 ms):" in printed and "at concurrency" in printed


def test_a_virtual_sweep_compares_with_the_cited_one(capsys):
    assert bench.main(["--virtual", "--compare", "--concurrency", "4,48"]) == 0
    printed = capsys.readouterr().out
    assert "2.09, 210, 53 ms" in printed and "within 20%" in printed
    # Too few prompts to fill concurrency 48: the comparison fails, and says so.
    assert bench.main(["--virtual", "--compare", "--concurrency", "48", "--prompts", "48"]) == 1
    assert "outside 20%" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--url", "http://10.0.0.7:8000"], "loopback only"),
    (["--concurrency", "4,x"], "--concurrency takes whole numbers"),
    (["--concurrency", "0"], "--concurrency takes whole numbers"),
    (["--prompts", "0"], "must be >= 1"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
