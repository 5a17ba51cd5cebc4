"""scripts/scale.py refuses bad input with exit 2, naming what is wrong and the fix, before it
reads or changes anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from colocate import stackfile
from tests.support.sandbox import sandbox_stacks

ROOT = Path(__file__).resolve().parent.parent


def scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "scale.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_a_stack_without_a_policy_is_kept_so_the_controller_goes_on_to_its_cell(tmp_path):
    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    r = scale("status", "--stack", "sandbox", "--sandbox", "--stacks-dir", str(stacks), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2 and "no sandbox runs there" in r.stderr and "colocate:scale" not in r.stderr


def test_a_policy_beside_a_fixed_count_is_refused(tmp_path):
    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    stackfile.write_config("sandbox", {"pod.count": 2, "scale": {"min": 0, "max": 2}}, stacks)
    r = scale("run", "--stack", "sandbox", "--sandbox", "--stacks-dir", str(stacks), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2 and "colocate:pod.count" in r.stderr and "pulumi config rm --path colocate:pod.count" in r.stderr


def test_no_running_sandbox_and_a_bad_interval_are_refused(tmp_path):
    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    stackfile.write_config("sandbox", {"scale": {"min": 0, "max": 2}}, stacks)
    r = scale("run", "--stack", "sandbox", "--sandbox", "--stacks-dir", str(stacks), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2 and "no sandbox runs there" in r.stderr and "sandbox.py up --stack sandbox" in r.stderr
    r = scale("run", "--stack", "sandbox", "--sandbox", "--stacks-dir", str(stacks), "--interval", "0")
    assert r.returncode == 2 and "--interval" in r.stderr and "must be positive" in r.stderr


def test_the_cloud_needs_the_pulumi_cli(tmp_path):
    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    stackfile.write_config("sandbox", {"scale": {"min": 0, "max": 2}}, stacks)
    env_path = str(Path(sys.executable).parent)  # python, and no pulumi
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale.py"), "run", "--stack", "sandbox", "--stacks-dir",
                        str(stacks)], capture_output=True, text=True, cwd=ROOT, timeout=60, env={"PATH": env_path})
    assert r.returncode == 2 and "the Pulumi CLI is not on PATH" in r.stderr and "--sandbox" in r.stderr
