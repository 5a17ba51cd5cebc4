"""tests/suites.py, the driver of `make test`: one line per passing suite, every failure's output
on the terminal and in a file of its own that the last line names, exit 1 on any failure. Real
pytest and node runs of small test files written here."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests import suites

pytestmark = pytest.mark.slow

PY_TESTS = '''
import sys
import pytest

def test_ok():
    pass

def test_bad():
    print("said on stdout")
    print("said on stderr", file=sys.stderr)
    assert 1 == 2

@pytest.mark.skip(reason="no wrk here")
def test_skipped():
    pass
'''
JS_TESTS = '''
const test = require("node:test");
const assert = require("node:assert");
test("passes", () => {});
test("fails here", () => { assert.equal(1, 2); });
'''


@pytest.fixture
def where(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "LOGS", tmp_path / "logs")
    monkeypatch.setattr(suites, "FAILURES", tmp_path / "failures")
    (tmp_path / "test_x.py").write_text(PY_TESTS)
    (tmp_path / "x.test.cjs").write_text(JS_TESTS)
    return tmp_path


def steps(where, *, failing: bool) -> dict[str, list[suites.Step]]:
    py = [suites.PY, *suites.PYTEST, "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", str(where),
          str(where / "test_x.py")]
    js = ["node", "--test", "--test-reporter=dot", *([] if failing else ["--test-name-pattern", "passes"]),
          str(where / "x.test.cjs")]
    if not failing:
        py += ["-k", "not bad"]
    return {"x": [suites.Step("pytest", py, "pytest"), suites.Step("node", js, "node")]}


def test_a_passing_run_prints_a_line_per_suite_and_the_skips(where, capsys):
    assert suites.main(["x"], steps(where, failing=False)) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"pytest: 1 passed, 1 skipped, 1 deselected in [\d.]+s \(\d+ s; log: .*pytest\.log\)", out[0]), out
    # then the slowest tests (those over 5 ms: how many depends on the machine's load) and the skip
    indented = out[1:-2]
    assert all(re.match(r"  (\d+\.\d+s (setup|call|teardown) |SKIPPED)", ln) for ln in indented), out
    assert [ln for ln in indented if "SKIPPED" in ln and "no wrk here" in ln]
    assert re.fullmatch(r"node: 2 tests, none failed \(\d+ s; log: .*node\.log\)", out[-2]), out
    assert out[-1].startswith("all passed: x in")
    assert not (where / "failures").exists()


def test_a_failing_run_keeps_each_failures_output_in_a_file_it_names_last(where, capsys):
    assert suites.main(["x"], steps(where, failing=True)) == 1
    out = capsys.readouterr().out
    last = out.rstrip().splitlines()[-1]
    assert "node: 1 tests, 1 failed" in out or "node: 2 tests, 1 failed" in out
    assert last.startswith("FAILED: pytest, node in ") and "every failure's output is in " in last
    kept = sorted((where / "failures").glob("*.txt"))
    assert len(kept) == 1 and last.endswith(str(kept[0]))
    text = kept[0].read_text()
    # pytest's traceback with the test's captured output, and its one-line entry; node's error
    assert "def test_bad():" in text and "said on stdout" in text and "said on stderr" in text
    assert re.search(r"^FAILED \S*test_x\.py::test_bad", text, re.M), text
    assert "fails here" in text and "AssertionError" in text and "passes" not in text.split("==== node")[1]
    assert "said on stdout" in out  # and on the terminal too
    # A later run never overwrites it: each failing run keeps its own file.
    time.sleep(1.1)  # the file is named by the second the run started
    assert suites.main(["x"], steps(where, failing=True)) == 1
    assert len(list((where / "failures").glob("*.txt"))) == 2


def test_an_unknown_suite_is_a_usage_error(capsys):
    assert suites.main(["pyy"]) == 2
    assert "'pyy': unknown suite. Fix: one of lint, js, py, fast" in capsys.readouterr().err


def test_suites_run_side_by_side_each_its_steps_in_order_and_print_in_order(where, capsys):
    # "a" waits (30 s at most) for a file only "b"'s second step makes: were "b"'s later steps held
    # back until "a" is reported (pytest once started only after node's tests), "a" would fail.
    made = where / "made-by-b"
    waits = (f"import pathlib, sys, time\nfor _ in range(300):\n    if pathlib.Path({str(made)!r}).exists(): sys.exit(0)\n"
             "    time.sleep(0.1)\nsys.exit(1)")
    makes = f"import pathlib; pathlib.Path({str(made)!r}).touch(); print('made it')"
    steps = {"a": [suites.Step("waits", [suites.PY, "-c", waits], "lint"),
                   suites.Step("then", [suites.PY, "-c", "print('after waits')"], "then")],
             "b": [suites.Step("first", [suites.PY, "-c", "print('first of b')"], "b"),
                   suites.Step("makes", [suites.PY, "-c", makes], "b2")]}
    assert suites.main(["a", "b"], steps) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(" (")[0] for ln in out[:4]] == ["waits: passed", "then: after waits", "first: first of b",
                                                     "makes: made it"], out


def test_a_step_past_its_timeout_is_stopped_with_every_process_it_started_and_fails(where, capsys):
    # The step starts child after child, each to sleep a minute, recording each pid: the kill must
    # find them all, including one started while the process tree was being read.
    pid_file = where / "children.pid"
    hangs = ("import subprocess, time\n"
             f"with open({str(pid_file)!r}, 'a') as f:\n"
             "    while True:\n"
             "        f.write(f\"{subprocess.Popen(['sleep', '60']).pid}\\n\"); f.flush(); time.sleep(0.005)")
    steps = {"x": [suites.Step("hangs", [suites.PY, "-c", hangs], "hangs", timeout_s=2)]}
    t0 = time.monotonic()
    assert suites.main(["x"], steps) == 1
    assert time.monotonic() - t0 < 30
    out = capsys.readouterr().out
    assert "hangs: stopped after 2 s, with every process it started" in out
    pids = pid_file.read_text().split()
    assert len(pids) > 10
    # each gone, or a zombie nobody reaped yet (its parent was killed too): either way not running
    running = [p for p in pids if (stat := Path("/proc") / p / "stat").exists()
               and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert running == []


def test_a_step_runs_once_its_set_up_is_made_and_the_other_suites_run_beside_the_set_up(where, capsys):
    # The set-up waits (30 s at most) for a file only "b" makes: were "b" held back until the set-ups
    # are made, the set-up would fail. "a" needs the set-up, and fails unless the set-up's file is there.
    made, set_up = where / "made-by-b", where / "set-up-done"
    waits = (f"import pathlib, sys, time\nfor _ in range(300):\n    if pathlib.Path({str(made)!r}).exists():\n"
             f"        pathlib.Path({str(set_up)!r}).touch(); sys.exit(0)\n    time.sleep(0.1)\nsys.exit(1)")
    setups = {"s": suites.Step("set-up s", [suites.PY, "-c", waits], "setup-s")}
    uses = f"import pathlib; assert pathlib.Path({str(set_up)!r}).exists(); print('it was made')"
    makes = f"import pathlib; pathlib.Path({str(made)!r}).touch(); print('made')"
    steps = {"a": [suites.Step("uses", [suites.PY, "-c", uses], "a", needs=("s",))],
             "b": [suites.Step("makes", [suites.PY, "-c", makes], "b")]}
    assert suites.main(["a", "b"], steps, setups) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(" (")[0] for ln in out[:3]] == ["set-up s: passed", "uses: it was made", "makes: made"], out


def test_a_failed_set_up_fails_the_steps_that_need_it_without_running_them(where, capsys):
    ran = where / "ran"
    setups = {"s": suites.Step("set-up s", [suites.PY, "-c", "import sys; print('pip said no'); sys.exit(3)"], "setup-s")}
    steps = {"a": [suites.Step("first", [suites.PY, "-c", "print('first ran')"], "a"),
                   suites.Step("needs it", [suites.PY, "-c", f"open({str(ran)!r}, 'w')"], "a2", needs=("s",)),
                   suites.Step("after it", [suites.PY, "-c", f"open({str(ran)!r}, 'w')"], "a3")],
             "b": [suites.Step("free", [suites.PY, "-c", "print('free ran')"], "b")]}
    assert suites.main(["a", "b"], steps, setups) == 1
    out = capsys.readouterr().out
    assert not ran.exists()
    assert "set-up s: FAILED (exit 3)" in out and "pip said no" in out
    assert "first: first ran" in out and "free: free ran" in out
    assert out.count("not run: set-up s failed") >= 2  # "needs it" and the step after it
    assert out.rstrip().splitlines()[-1].startswith("FAILED: set-up s, needs it, after it in ")
