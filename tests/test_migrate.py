"""scripts/migrate.py: the file edit keeps comments and order; a failed command changes nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from colocate import stackfile
from colocate.ledger import Ledger
from scripts import migrate

ROOT = stackfile.ROOT


@pytest.fixture
def stacks(tmp_path):
    for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    return tmp_path


def run(stacks, *argv):
    return migrate.main([*argv, "--stacks-dir", str(stacks)])


def test_start_edits_ledger_and_region_keeping_comments_and_order(stacks, capsys):
    path = stacks / "Pulumi.apac-jp.yaml"
    # Vast.ai pods need a zone (a Worker cannot fetch their IP address): the operator has one.
    path.write_text(path.read_text().rstrip("\n") + "\n  colocate:zone:\n    id: 0123456789abcdef0123456789abcdef\n"
                    "    name: example.com\n")
    before = path.read_text()
    assert run(stacks, "start", "--stack", "apac-jp", "--to", "apac-tw", "--provider", "vastai") == 0
    after = path.read_text()
    for line in before.splitlines():
        if line.lstrip().startswith("#"):
            assert line in after, f"comment lost: {line}"
    keys = [ln.split(":")[0] + ":" + ln.split(":")[1] for ln in after.splitlines() if ln.startswith("  colocate:")]
    assert keys == [ln.split(":")[0] + ":" + ln.split(":")[1] for ln in before.splitlines() if ln.startswith("  colocate:")]
    raw, _ = stackfile.read_config("apac-jp", stacks)
    assert raw["region"] == "apac-tw" and raw["pod"]["provider"] == "vastai"
    ledger = Ledger.parse(raw["generations"])
    assert (ledger.active.name, ledger.draining.name) == ("apac-tw.g2", "apac-jp.g1")
    out = capsys.readouterr().out
    assert "create   pod colocate-apac-jp-apac-tw-g2-" in out and "delete   pod colocate-apac-jp-apac-jp-g1-" in out
    assert "placement aws:ap-northeast-1 -> gcp:asia-east1" in out
    assert "bind     binding DRAINING_GENERATION: apac-jp.g1" in out
    assert "Worker TPE -> state NRT: 2,181 km, floor 22 ms" in out


def test_finish_retires_and_plans_the_purge(stacks, capsys):
    assert run(stacks, "start", "--stack", "us-east", "--to", "apac-jp") == 0
    assert run(stacks, "finish", "--stack", "us-east") == 0
    raw, _ = stackfile.read_config("us-east", stacks)
    assert [g["status"] for g in raw["generations"]] == ["retired", "active"]
    out = capsys.readouterr().out
    assert "unbind   binding DRAINING_GENERATION: was us-east.g1" in out
    assert "purge    generation us-east.g1" in out


@pytest.mark.parametrize("argv, message", [
    (["start", "--stack", "us-east", "--to", "us-east"], "already lives there"),
    (["start", "--stack", "us-east", "--to", "moon-1"], "unknown region"),
    (["start", "--stack", "us-east", "--to", "apac-tw"], "add --provider vastai"),
    (["finish", "--stack", "us-east"], "nothing to finish"),
    (["start", "--stack", "nope", "--to", "apac-jp"], "no stack file"),
])
def test_illegal_steps_exit_2_and_leave_the_file_byte_identical(stacks, capsys, argv, message):
    files = {p: p.read_bytes() for p in stacks.iterdir()}
    assert run(stacks, *argv) == 2
    assert message in capsys.readouterr().err
    assert {p: p.read_bytes() for p in stacks.iterdir()} == files


def test_start_while_draining_leaves_the_file_byte_identical(stacks, capsys):
    assert run(stacks, "start", "--stack", "us-east", "--to", "apac-jp") == 0
    path = stacks / "Pulumi.us-east.yaml"
    snapshot = path.read_bytes()
    assert run(stacks, "start", "--stack", "us-east", "--to", "eu-west") == 2
    assert "finish --stack us-east" in capsys.readouterr().err
    assert path.read_bytes() == snapshot


def test_plan_writes_nothing_and_reports_floors(stacks, capsys):
    snapshot = (stacks / "Pulumi.us-east.yaml").read_bytes()
    assert run(stacks, "plan", "--stack", "us-east", "--to", "apac-jp") == 0
    out = capsys.readouterr().out
    assert "Worker NRT -> state IAD: 10,845 km, floor 108 ms" in out
    assert "after this migration" in out
    assert (stacks / "Pulumi.us-east.yaml").read_bytes() == snapshot


def test_plan_uses_the_probe_for_an_adopted_generation(stacks, tmp_path, capsys):
    stackfile.write_config("apac-jp", {"generations": [{"name": "breaker", "region": "unknown", "status": "active"}]}, stacks)
    assert run(stacks, "plan", "--stack", "apac-jp") == 0
    assert "unknown (run the probe)" in capsys.readouterr().out
    probe = tmp_path / "probe.json"
    probe.write_text('{"placement": {"state": "IAD", "ran": "NRT"}}')
    assert run(stacks, "plan", "--stack", "apac-jp", "--to", "apac-jp", "--probe-json", str(probe)) == 0
    out = capsys.readouterr().out
    assert "now                                Worker NRT -> state IAD: 10,845 km" in out
    assert "after this migration               Worker NRT -> state NRT" in out


def test_record_tag_sets_the_nested_key_only(stacks):
    before = stackfile.read_config("apac-jp", stacks)[0]
    assert run(stacks, "record-tag", "--stack", "apac-jp", "--tag", "v1") == 0
    after = stackfile.read_config("apac-jp", stacks)[0]
    assert after.pop("worker") == {"migrationTag": "v1"}
    assert after == before
    assert run(stacks, "record-tag", "--stack", "apac-jp", "--tag", "v9") == 2


def test_purge_needs_the_token(monkeypatch, capsys):
    monkeypatch.delenv("COLOCATE_PROBE_TOKEN", raising=False)
    assert migrate.main(["purge", "--url", "http://127.0.0.1:9", "--generation", "g"]) == 2
    assert "COLOCATE_PROBE_TOKEN" in capsys.readouterr().err


def test_cli_runs_as_a_subprocess(stacks):
    proc = subprocess.run([sys.executable, "scripts/migrate.py", "plan", "--stack", "us-east", "--to", "eu-west",
                           "--stacks-dir", str(stacks)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "placement aws:us-east-1 -> aws:eu-west-1" in proc.stdout
