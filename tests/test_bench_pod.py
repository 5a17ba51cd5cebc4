"""make bench-pod (bench/pod.py): the published sweeps replayed in virtual time and over HTTP, each point's ratio, the knee."""

from __future__ import annotations

import json
import time

import pytest

from bench import pod as bench
from colocate.pods import profiles, standin


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
    points = json.loads(out.read_text())["sweeps"][0]["points"]
    assert [p["level"] for p in points] == [1, 4] and all(p["requests"] == 4 and not p["errors"] for p in points)
    assert stats["completed"] == 8
    for p in points:
        assert p["ttft_p50_ms"] > 0 and p["output_tok_s"] > 0 and p["itl_p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "knee (TTFT p99 <= 5000 ms):" in printed and "at concurrency" in printed


def test_compare_replays_both_published_sweeps_and_prints_each_points_ratio(tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert bench.main(["--compare", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("within 20%") == 2 and "outside" not in printed
    assert "2.09, 210, 53, 157, -" in printed  # the Mistral sweep's row as published (no ITL given)
    assert "8.16, 1646, 162.9, 330.5, 28.41" in printed  # the IOG sweep's 32 requests/s
    doc = json.loads(out.read_text())
    assert [s["sweep"] for s in doc["sweeps"]] == ["mistral-7b-4090", "llama3-8b-4090"]
    assert [s["profile"] for s in doc["sweeps"]] == ["rtx4090-mistral-7b-fp16", "rtx4090-llama3-8b-fp16"]
    for s in doc["sweeps"]:
        assert len(s["points"]) == 5 and s["worst_error"] <= 0.2
        assert all(abs(r - 1) <= 0.2 for p in s["points"] for r in p["ratios"].values())
    assert set(doc["sweeps"][1]["points"][0]["ratios"]) == {"req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50"}


def test_a_comparison_that_misses_fails_and_says_so(capsys):
    # Too few prompts to fill concurrency 48: the comparison fails, and says so.
    assert bench.main(["--compare", "--sweep", "mistral-7b-4090", "--levels", "48", "--prompts", "48"]) == 1
    assert "outside 20%" in capsys.readouterr().out
    # The kit's INT4 pod is not the 16-bit pod the IOG sweep measured: it is faster, and the ratios say by how much.
    assert bench.main(["--compare", "--sweep", "llama3-8b-4090", "--profile", "rtx4090-qwen2.5-7b-int4",
                       "--levels", "32"]) == 1
    assert "outside 20%" in capsys.readouterr().out


def test_a_poisson_sweep_over_http_sends_each_request_its_own_lengths(tmp_path):
    lengths = (profiles.LLAMA3_8B_SWEEP.requests() or [])[:6]
    out = tmp_path / "points.json"
    with standin.serve(profile="rtx4090-qwen2.5-7b-int4", seed=3) as server:
        assert bench.main(["--url", server.url, "--sweep", "llama3-8b-4090", "--levels", "8", "--prompts", "6",
                           "--json", str(out)]) == 0
    [point] = json.loads(out.read_text())["sweeps"][0]["points"]
    # Every answer came whole: each request its own prompt and its own answer's length, as the source sent them.
    assert point["requests"] == 6 and not point["errors"]
    assert point["tokens"] == sum(o for _i, o in lengths)


@pytest.mark.parametrize("argv,message", [
    (["--url", "http://10.0.0.7:8000"], "loopback only"),
    (["--concurrency", "4,x"], "--concurrency takes whole numbers"),
    (["--concurrency", "0"], "--concurrency takes whole numbers"),
    (["--levels", "-1"], "--levels takes positive numbers"),
    (["--prompts", "0"], "must be >= 1"),
    (["--sweep", "h100"], "--sweep 'h100': one of all, none"),
    (["--compare", "--sweep", "none"], "--compare needs a published sweep"),
    (["--standin", "--url", "http://127.0.0.1:1"], "give one target"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
