"""A newcomer's path, in a fresh clone of the repository: the README's "call it from your app"
block run as written with a state directory of its own, and the wrong turns a new user takes
(a flag forgotten, the probe and cost.py pointed at a sandbox, a typo), each answered with the
directory it is about and a non-zero exit when nothing was found where the command looked."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
README_BLOCK = re.compile(r"\*\*Call it from your app\.\*\*.*?```sh\n(.*?)```", re.S)
PRINTED_COMMAND = re.compile(r"`(\S*\.venv/bin/python \S*scripts/[^`]*)`")  # relative, or absolute (works anywhere)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The committed repository cloned into a fresh directory, sharing this checkout's .venv and
    node_modules (set up already) rather than installing them again."""
    where = tmp_path_factory.mktemp("newcomer") / "colocate"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(where)], check=True, timeout=120)
    for shared in (".venv", "node_modules"):
        (where / shared).symlink_to((ROOT / shared).resolve())
    yield where
    from colocate.sandbox.statedir import STARTED_DIR

    for d in (where / ".colocate" / "sandbox").glob("*"):
        if d.name != STARTED_DIR:  # links to state directories elsewhere, not one itself
            _run(where, "scripts/sandbox.py", "down", "--state-dir", str(d), check=False)


def _run(cwd: Path, *argv: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([".venv/bin/python", *argv], cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _hints(text: str) -> list[str]:
    return PRINTED_COMMAND.findall(text)


@pytest.fixture(scope="module")
def readme_block(clone, tmp_path_factory):
    """The README's block run once as written, with a state directory of its own: it starts a cell,
    calls it and stops it, so that directory is also where a sandbox ran and was stopped."""
    block = README_BLOCK.search((clone / "README.md").read_text()).group(1)
    assert "/tmp/my-cell" in block and "sandbox.py up" in block and "OpenAI()" in block and "sandbox.py down" in block
    mine = tmp_path_factory.mktemp("readme") / "my-cell"
    script = block.replace("/tmp/my-cell", str(mine))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=clone, capture_output=True, text=True, timeout=300, env=env)
    yield mine, proc
    if proc.returncode != 0:  # it stopped before its own `down`
        _run(clone, "scripts/sandbox.py", "down", "--state-dir", str(mine), check=False)


def test_the_readmes_block_runs_as_written_in_a_fresh_clone(clone, readme_block, tmp_path):
    mine, proc = readme_block
    assert proc.returncode == 0, proc.stderr
    assert "colocate stand-in" in proc.stdout  # the pod's answer, through the Worker, to the openai client
    hints = _hints(proc.stderr)
    assert hints, proc.stderr
    for hint in hints:
        assert f"--state-dir {mine}" in hint, hint
    status = _run(clone, "scripts/sandbox.py", "status", "--state-dir", str(mine), check=False)
    assert status.returncode == 1 and json.loads(status.stdout)["running"] is False  # the block's `down` stopped it
    for hint in _hints(status.stderr):
        assert f"--state-dir {mine}" in hint, hint
    # A printed command works pasted anywhere: the block's `down` hint, run again from elsewhere, is a no-op.
    down = next(h for h in hints if " down " in h)
    again = subprocess.run(down, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "(already stopped)" in again.stderr, again.stderr


@pytest.fixture(scope="module")
def cell(clone, tmp_path_factory):
    """A sandbox in a directory of its own, as a newcomer starts it."""
    d = tmp_path_factory.mktemp("own") / "cell"
    up = _run(clone, "scripts/sandbox.py", "up", "--state-dir", str(d))
    yield d, json.loads(up.stdout)
    _run(clone, "scripts/sandbox.py", "down", "--state-dir", str(d), check=False)


def test_a_forgotten_state_dir_finds_nothing_says_so_and_names_the_running_cell(clone, cell):
    d, up = cell
    for cmd in ("down", "status"):
        proc = _run(clone, "scripts/sandbox.py", cmd, "--stack", "sandbox", check=False)
        assert proc.returncode == 1, (cmd, proc.stderr)
        assert str(d) in proc.stderr and f"--state-dir {d}" in proc.stderr, proc.stderr
    listed = json.loads(_run(clone, "scripts/sandbox.py", "status").stdout)["sandboxes"]
    assert [s["state_dir"] for s in listed] == [str(d)] and listed[0]["healthy"] is True  # still running, untouched


def test_the_probe_probes_a_sandbox_by_its_directory(clone, cell):
    d, _ = cell
    proc = _run(clone, "scripts/probe.py", "--state-dir", str(d), "--samples", "3", "--json", "-")
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and "unknown" not in proc.stderr.lower(), proc.stderr
    assert doc["placement"]["pod"] == "local" and doc["placement"]["pod_site"] == up_site(cell)
    assert doc["pod_path"] == "local-hostname" and doc["placement"]["expected_region"] == "us-east"
    live = _run(clone, "scripts/probe.py", "--state-dir", str(d), "--live", "--since", "15m", check=False)
    # exit 1 while no sync has been recorded yet (a verdict, not a usage error): the sandbox was found either way
    assert live.returncode in (0, 1) and "percentiles read from the Worker's fixed latency buckets" in live.stdout
    # --stack sandbox with no sandbox in the stack's own directory (and no Pulumi CLI here): where one runs
    by_stack = _run(clone, "scripts/probe.py", "--stack", "sandbox", check=False, env={"PATH": "/usr/bin:/bin"})
    assert by_stack.returncode == 2 and f"--state-dir {d}" in by_stack.stderr, by_stack.stderr


def up_site(cell) -> str:
    return cell[1]["sites"]["pod"]


def test_the_probe_by_url_says_why_the_pod_is_unchecked(clone, cell):
    _, up = cell
    tokens = {"COLOCATE_READ_TOKEN": up.get("read_token") or up["token"], "COLOCATE_ADMIN_TOKEN": up["token"]}
    proc = _run(clone, "scripts/probe.py", up["worker_url"], "--samples", "2", env=tokens)
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("pod ") and "UNKNOWN" in line)
    assert "no pod location given: pass --pod-location LOC" in row
    assert "OK: every check made holds" in proc.stdout and "pod location not checked" in proc.stdout


def test_cost_reads_the_sandboxs_price_and_does_not_scale_minutes_to_a_day(clone, cell):
    d, _ = cell
    proc = _run(clone, "scripts/cost.py", "--state-dir", str(d))
    assert "colocate:pod.maxPricePerHr x pod.count" in proc.stdout  # the price from the sandbox's own stack file
    assert re.search(r"cell cost over \d+ (s|min)", proc.stdout) and "days" not in proc.stdout.split("\n")[0]
    volume = next(line for line in proc.stdout.splitlines() if line.strip().startswith("volume"))
    assert "not scaled" in volume and "too short to scale to a day (at least 1 h)" in volume, volume


def test_after_down_every_hint_carries_the_directory(clone, readme_block, cell):
    gone, block = readme_block  # the README's block ran a cell there and stopped it with `sandbox.py down`
    assert block.returncode == 0, block.stderr
    down = json.loads(block.stdout.splitlines()[-1])  # its stdout: the openai client's answer, then `down`'s JSON line
    assert down["pod_deleted"] is True  # the runner deleted it: said truthfully
    for argv in (["scripts/keys.py", "list", "--state-dir", str(gone)], ["scripts/cost.py", "--state-dir", str(gone)],
                 ["scripts/sandbox.py", "apply", "--state-dir", str(gone)],
                 ["scripts/probe.py", "--state-dir", str(gone)]):
        proc = _run(clone, *argv, check=False)
        assert proc.returncode == 2, (argv, proc.stderr)
        hints = _hints(proc.stderr)
        assert any(f"up --stack sandbox --state-dir {gone}" in h for h in hints), (argv, proc.stderr)
        assert str(cell[0]) in proc.stderr  # and where a sandbox does run


def test_the_small_ones(clone):
    helped = _run(clone, "scripts/sandbox.py", "--help").stdout
    assert "--stack defaults to ``sandbox``" in helped and "up     [--stack S]" in helped
    typo = _run(clone, "scripts/sandbox.py", "status", "--stack", "sanbox", check=False)
    assert typo.returncode == 2 and "did you mean `--stack sandbox`?" in typo.stderr
    bare = _run(clone, "scripts/keys.py", "create", "--name", "x", check=False)
    assert bare.returncode == 2 and "--state-dir DIR" in bare.stderr
