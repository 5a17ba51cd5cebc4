"""Every command the kit prints runs as printed from the project root.

The convention is `.venv/bin/python scripts/<x>.py ...`: the system `python` lacks the kit's
dependencies (`ModuleNotFoundError: ruamel`), and a bare `scripts/x.py` depends on a shebang
that finds the same system python.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colocate import cli
from colocate.probe.errors import UsageError
from tests.support import pysource

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "colocate").rglob("*.py"), *(ROOT / "infra").glob("*.py")])

BARE_PYTHON = re.compile(r"(?<!\.venv/bin/)(?<![\w/}])python3? +scripts/")  # {PYTHON} scripts/... is the venv's
BARE_SCRIPT = re.compile(r"(`|\b(?:run|check|then|Next:|Usage:) +)scripts/\w+\.py")  # no interpreter at all


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def _printed_text(path: Path) -> list[tuple[int, str]]:
    """The string literals a user can see: messages (f-string parts included) and, for the
    scripts, the module docstring (their --help)."""
    tree = pysource.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    if path.parent.name == "scripts":
        skip = {i for i in skip if not (isinstance(tree.body[0], ast.Expr) and i == id(tree.body[0].value))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((node.lineno, node.value))
    return out


def _offenders(text: str) -> list[str]:
    return [m.group(0) for rx in (BARE_PYTHON, BARE_SCRIPT) for m in rx.finditer(text)]


def test_the_scan_finds_what_it_looks_for():
    assert _offenders("run `python scripts/migrate.py start --stack s`")
    assert _offenders("Next: scripts/sandbox.py down")
    assert _offenders("run `scripts/pod.py sweep --stack s`")
    assert not _offenders("run `.venv/bin/python scripts/migrate.py start --stack s`")
    assert not _offenders("{PYTHON} scripts/pod.py create --spec -".replace("{PYTHON}", "/x/.venv/bin/python"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_printed_commands_name_the_venv_python(path):
    bad = [(line, o) for line, text in _printed_text(path) for o in _offenders(text)]
    assert bad == [], f"{path.relative_to(ROOT)}: print `.venv/bin/python scripts/...` instead: {bad}"


def test_a_suggested_command_runs_from_any_directory(tmp_path):
    printed = cli.script("sandbox.py")
    assert printed.startswith(str(ROOT)) and printed.endswith(str(ROOT / "scripts" / "sandbox.py"))
    proc = subprocess.run(f"{printed} --help", shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "sandbox.py up" in proc.stdout, proc.stderr


@pytest.mark.parametrize("argv, said", [
    (["sandbox.py", "down", "--stat-dir", "/tmp/x"], "sandbox.py: --stat-dir: unknown flag. Fix: did you mean `--state-dir`?"),
    (["sandbox.py", "stauts"], "sandbox.py: 'stauts': unknown command. Fix: did you mean `status`?"),
    (["migrate.py", "start", "--stack", "s", "--too", "apac-jp"],
     "migrate.py start: --too: unknown flag. Fix: did you mean `--to`?"),
    (["probe.py", "--sampels", "3"], "probe.py: --sampels: unknown flag. Fix: did you mean `--samples`?"),
])
def test_a_typo_is_answered_with_what_was_meant_in_the_kits_shape(argv, said):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith(said), proc.stderr


def test_a_missing_token_does_not_print_none():
    assert str(UsageError("--token", None, "no read token", "set X")) == "--token: no read token. Fix: set X"
    assert "'abc'" in str(UsageError("--budget", "abc", "bad", "fix"))


def test_probe_without_a_token_says_so_plainly():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin"})  # no operator token
    assert proc.returncode == 2
    assert "--token: no read token" in proc.stderr and "None" not in proc.stderr, proc.stderr


@pytest.fixture
def stacks(tmp_path):
    import shutil

    from colocate import stackfile

    for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    return tmp_path


def test_a_sandbox_stack_is_deployed_by_the_sandboxs_own_apply(stacks, capsys):
    from scripts import migrate

    assert migrate.main(["start", "--stack", "sandbox", "--to", "apac-tw", "--stacks-dir", str(stacks)]) == 0
    out = capsys.readouterr().out
    assert f"Next: `{cli.script('sandbox.py')} apply --stack sandbox`" in out, out
    assert "pulumi up -s" not in out and f"`{cli.script('migrate.py')} finish --stack sandbox`" in out
    assert migrate.main(["finish", "--skip-import-check", "--stack", "sandbox", "--stacks-dir", str(stacks)]) == 0
    assert f"Next: `{cli.script('sandbox.py')} apply --stack sandbox`" in capsys.readouterr().out


def test_a_cloud_stack_is_deployed_by_pulumi_up(stacks, capsys):
    from scripts import migrate

    assert migrate.main(["start", "--stack", "us-east", "--to", "eu-west", "--stacks-dir", str(stacks)]) == 0
    out = capsys.readouterr().out
    assert "Next: `pulumi up -s us-east`" in out and f"`{cli.script('migrate.py')} finish --stack us-east`" in out


@pytest.mark.parametrize("command", ["down", "status", "apply"])
def test_a_fleet_up_put_under_sandboxes_dir_is_found_there_by_each_later_command(command, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), command, "--fleet", "fl",
                           "--sandboxes-dir", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "unknown flag" not in proc.stderr and str(tmp_path / "fl") in proc.stdout + proc.stderr, proc.stderr
