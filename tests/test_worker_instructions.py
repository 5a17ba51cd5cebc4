"""bench/instructions.py (make bench-instructions) under real callgrind: one small run of every
rung that differs, in a file of its own so that the slowest process of the suite (workerd under
valgrind) runs beside the other benchmark tests, not after them. Nothing here asserts a speed."""

import json
import shutil

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("callgrind_control") is None,
                                 reason="valgrind is not installed (make bench-instructions installs it)")]


def test_instructions_are_counted_per_rung_for_streams_of_a_real_prompts_size(tmp_path, capsys):
    from bench import instructions

    # Few requests, so the JIT has not settled and the numbers mean little; what is asserted is
    # that each rung really served (the driver refuses any answer but a 200 stream read to its
    # [DONE] with its usage) and was counted. Each request is a stream asking for its usage,
    # through two pods, with a 16 KiB prompt the router takes, parses and forwards whole. The
    # ends rung does what bare does plus a pipe, so it counts more; the router, which also tees
    # the stream to read its usage, more again. One request warms and three are counted: each
    # rung's start under valgrind is most of the cost, and the order holds with room to spare
    # (about 0.7 M, 1.0 M and 7-9 M a request here), so a rung that skipped its work would show.
    out = tmp_path / "i.json"
    rc = instructions.main(["--rungs", "bare,ends,router", "--request", "usage", "--pods", "2", "--chunks", "3",
                            "--prompt-bytes", "16384", "--warm", "1", "--requests", "3", "--every-ms", "100", "--quiet",
                            "--keep", str(tmp_path / "dumps"), "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert (result["request"], result["pods"], result["chunks"]) == ("usage", 2, 3)
    assert result["prompt_bytes"] == 16384 and result["body_bytes"] > 16384
    assert result["v8_flags"] == list(instructions.SYNC_JIT_FLAGS)
    # paced: under valgrind a slot may pass (a rung's first request is never late: at most 2 of its 3)
    assert result["every_ms"] == 100 and 0 <= result["late"] <= 3 * 2
    per = {r["rung"]: r["instructions_per_req"] for r in result["rungs"]}
    assert 0 < per["bare"] < per["ends"] < per["router"]
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == [
        "callgrind.bare.1.out", "callgrind.ends.1.out", "callgrind.router.1.out"]
