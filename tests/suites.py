"""`make test`, `make test-fast`, `make lint`: run each suite with its whole output in a log file,
print one line per suite (and the slowest tests, and the skips), and every failure's output.

    python3 -m tests.suites lint js py     (make test)
    python3 -m tests.suites fast           (make test-fast)
    python -m tests.suites vllm            (make test-vllm, with COLOCATE_ENGINE=vllm)

It needs only Python's standard library: it sets up what its steps need (`.venv`, `node_modules`,
the tools) itself, each once, beside the steps that do not need it.

Each failing run keeps its failures in a file of its own, `.colocate/test-failures/<UTC time>.txt`
(never overwritten by a later run, so a failure seen once can be read later), named on the last
line. Exit 0 when every suite passed, 1 otherwise. docs/testing.md says why each option is set.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
LOGS = ROOT / ".colocate" / "test-logs"
FAILURES = ROOT / ".colocate" / "test-failures"
SHOWN_PER_SUITE = 80  # failure lines printed per suite; the file holds them all

# Eight workers for the whole suite, four for the inner loop; one file per worker at a time (the
# Pulumi mock files together: tests/conftest.py), longest first; the ten slowest tests printed so that a regression shows.
PYTEST = ["-m", "pytest", "-q", "--dist", "loadfile", "--no-loadscope-reorder", "--durations=10", "-rfEs"]


@dataclass
class Step:
    name: str
    argv: list[str]
    log: str
    # A step past this is stopped with every process it started, and fails: a hung process (a
    # node test file that never exits, nodejs/node#54918) must not hold `make test` forever.
    timeout_s: float = 1800
    # The set-ups (SETUPS) this step runs after.
    needs: tuple[str, ...] = ()


# What steps need set up, each made once (by the Makefile's rule) when a wanted step needs it, beside
# the steps that do not: on a fresh clone node's tests run during the venv's install.
SETUPS: dict[str, Step] = {
    "venv": Step("set-up .venv", ["make", "-s", ".venv/.installed"], "setup-venv"),
    "npm": Step("set-up node_modules", ["make", "-s", "node_modules/.installed"], "setup-npm"),
    # wrk, valgrind, prometheus: apt-get where absent (the Makefile's rules), else nothing
    "tools": Step("set-up wrk, valgrind, prometheus", ["make", "-s", "wrk", "valgrind", "prometheus"], "setup-tools"),
}


# pytest's workers each import every test module, and pytest rewrites each module's asserts
# (then caches the result, as Python caches bytecode, under .venv/pycache): on a fresh clone eight
# workers would all rewrite and compile everything at once. One collection first fills the caches.
COLLECT = [PY, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider"]

SUITES: dict[str, list[Step]] = {
    "lint": [Step("ruff", [str(ROOT / ".venv" / "bin" / "ruff"), "check", "--quiet", "."], "lint", needs=("venv",)),
             Step("tsc", [str(ROOT / "node_modules" / ".bin" / "tsc"), "-p", "worker/tsconfig.json"], "lint",
                  needs=("npm",)),
             Step("mypy", [str(ROOT / ".venv" / "bin" / "mypy")], "lint", needs=("venv",))],
    # The dot reporter prints one character per test and, at the end, each failure with its error.
    # --single-threaded (passed on to each file's process): without V8's background tasks, node 20
    # cannot deadlock in its exit's drain of them (nodejs/node#54918; a test file hung so once here).
    "js": [Step("node", ["node", "--single-threaded", "--test", "--test-concurrency=4", "--test-reporter=dot",
                         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "worker" / "test").glob("*.test.js"))],
                "node", timeout_s=300, needs=("npm",))],
    # The collection needs no tools (apt-get, where they are absent, runs on beside it); pytest starts
    # workerd, so needs node_modules.
    "py": [Step("collect", COLLECT, "pytest-collect", needs=("venv",)),
           Step("pytest", [PY, *PYTEST, "-n", "8"], "pytest", needs=("npm", "tools"))],
    "fast": [Step("collect", [*COLLECT, "-m", "not slow"], "pytest-collect", needs=("venv",)),
             Step("pytest (not slow)", [PY, *PYTEST, "-n", "4", "-m", "not slow"], "pytest-fast", needs=("npm",))],
    # make test-vllm (COLOCATE_ENGINE=vllm): one process, one vLLM for the run (docs/testing.md "The real engine").
    "vllm": [Step("pytest (vLLM)", [PY, "-m", "pytest", "-q", "-p", "no:xdist", "--durations=10", "-rfEs",
                                     "tests/vllm_cpu", "tests/engine_contract"], "pytest-vllm")],
}


def run_after(steps: list[Step], made: dict[str, Future], setups: dict[str, Step]) -> list[tuple[int, str, float]]:
    """Run ``steps`` in order, each once the set-ups it needs are ``made``; after a failed set-up, none."""
    results: list[tuple[int, str, float]] = []
    for step in steps:
        failed = [setups[n].name for n in step.needs if made[n].result()[0] != 0]
        if failed:
            return results + [(1, f"not run: {failed[0]} failed (its output is above)", 0.0)] * (len(steps) - len(results))
        results.append(run(step))
    return results


def run(step: Step) -> tuple[int, str, float]:
    """Run one step with its output going straight to its log (`tail -f` shows it live)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"{step.log}.log"
    t0 = time.monotonic()
    with open(path, "a") as log:
        log.write(f"$ {' '.join(step.argv)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(step.argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            code = proc.wait()
            log.write(f"\n{step.name}: stopped after {step.timeout_s:.0f} s, with every process it started "
                      f"(Step.timeout_s in tests/suites.py)\n")
    with open(path, errors="replace") as log:
        log.seek(start)
        return code, log.read(), time.monotonic() - t0


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it. Each is stopped as it is found, and the tree read
    again until it holds no new process: a process caught starting a child between one read of /proc
    and its kill would leave that child running (a loaded run did so once)."""
    found: list[int] = []
    while new := [p for p in _tree(pid) if p not in found]:
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        found += new
    for p in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    # A killed process ends once it is next scheduled: wait for that (10 s at most), so that none runs on
    # when the step is reported.
    deadline = time.monotonic() + 10
    while any(_running(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it (Linux's /proc; elsewhere ``pid`` alone), parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def pytest_summary(out: str) -> tuple[str, list[str], str]:
    """(the final counts line, the lines worth printing when it passed, the failures' text)."""
    lines = out.rstrip().splitlines()
    counts = lines[-1].strip("= ") if lines else "no output"
    shown = []
    if (start := _index(lines, r"=+ slowest \d+ durations =+")) is not None:
        shown += [ln for ln in lines[start + 1:start + 12] if re.match(r"\d+\.\d+s ", ln)]
    shown += [ln for ln in lines if ln.startswith("SKIPPED")]
    failed = ""
    begin = _index(lines, r"=+ (FAILURES|ERRORS) =+")
    if begin is not None:  # the tracebacks and captured output, up to the next section; then the one-line list
        end = next((i for i in range(begin + 1, len(lines)) if re.fullmatch(r"=+ (slowest|short test summary).*=+",
                                                                             lines[i].strip())), len(lines))
        failed = "\n".join([*lines[begin:end], *(ln for ln in lines[end:] if ln.startswith(("FAILED ", "ERROR ")))])
    return counts, shown, failed


def node_summary(out: str) -> tuple[str, str]:
    """(the counts, the failures' text: the dot reporter's "Failed tests:" section)."""
    marks = "".join(ln.strip() for ln in out.splitlines() if re.fullmatch(r"[.X]+", ln.strip()))  # a dot per test
    # The dot reporter marks a skipped test as it marks a passing one.
    line = f"{len(marks)} tests, {marks.count('X') or 'none'} failed" if marks else ""
    at = out.find("Failed tests:")
    return line, (out[at:].strip() if at >= 0 else "")


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _index(lines: list[str], pattern: str) -> int | None:
    return next((i for i, ln in enumerate(lines) if re.fullmatch(pattern, ln.strip())), None)


def _short(text: str, limit: int = SHOWN_PER_SUITE) -> str:
    lines = text.splitlines()
    return "\n".join(lines if len(lines) <= limit else [*lines[:limit], f"... ({len(lines) - limit} more lines in the file)"])


def main(argv: list[str], suites: dict[str, list[Step]] = SUITES, setups: dict[str, Step] = SETUPS) -> int:
    wanted = argv or ["lint", "js", "py"]
    unknown = [w for w in wanted if w not in suites]
    if unknown:
        print(f"suites.py: {unknown[0]!r}: unknown suite. Fix: one of {', '.join(suites)}", file=sys.stderr)
        return 2
    needed = list(dict.fromkeys(n for w in wanted for s in suites[w] for n in s.needs))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for name in {s.log for w in wanted for s in suites[w]} | {setups[n].log for n in needed}:
        (LOGS / f"{name}.log").unlink(missing_ok=True)
    failures: list[tuple[str, str]] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(needed) + len(wanted)) as pool:
        # The set-ups first, then the suites side by side, each its steps in order, each step once its
        # set-ups are made; lines print in that order. A suite never waits for another's report: pytest
        # once started only after node's tests, 12 s late.
        made = {n: pool.submit(run, setups[n]) for n in needed}
        started = {w: pool.submit(run_after, suites[w], made, setups) for w in wanted}
        _report([setups[n] for n in needed], [made[n].result() for n in needed], failures)
        for suite in wanted:
            _report(suites[suite], started[suite].result(), failures)
    took = time.monotonic() - t0
    if not failures:
        print(f"all passed: {', '.join(wanted)} in {took:.0f} s")
        return 0
    FAILURES.mkdir(parents=True, exist_ok=True)
    path = FAILURES / f"{stamp}.txt"
    path.write_text("".join(f"==== {name} (run started {stamp}; its whole output: {LOGS}/)\n{text}\n\n"
                            for name, text in failures))
    print(f"FAILED: {', '.join(n for n, _ in failures)} in {took:.0f} s; every failure's output is in {path}")
    return 1


def _report(steps: list[Step], results: list[tuple[int, str, float]], failures: list[tuple[str, str]]) -> None:
    """Print a line for each of ``steps`` from its result (its run's code, output and seconds); each
    failure's output goes on the terminal and into ``failures``."""
    for step, (code, out, took) in zip(steps, results, strict=True):
        log = _shown(LOGS / f"{step.log}.log")
        if step.log == "lint" or step.log.startswith("setup"):
            failed = out.strip() if code else ""
            line = "passed" if not code else f"FAILED (exit {code})"
        elif step.log == "node":
            line, failed = node_summary(out)
            failed = failed or ("" if not code else "\n".join(out.rstrip().splitlines()[-60:]))
        else:
            line, shown, failed = pytest_summary(out)
            failed = failed or ("" if not code else "\n".join(out.rstrip().splitlines()[-60:]))
        print(f"{step.name}: {line or ('passed' if not code else f'exit {code}')} ({took:.0f} s; log: {log})",
              flush=True)
        if step.log.startswith("pytest"):
            for ln in shown:
                print(f"  {ln}")
        if code:
            failures.append((step.name, failed or f"exit {code} and no output; see {log}"))
            print(_short(failures[-1][1]), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
