"""scripts/migrate.py: the file edit keeps comments and order; a failed command changes nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from colocate import stackfile
from colocate.cell import migration
from colocate.cell.ledger import Ledger
from colocate.cell.settings import POD_DEFAULTS
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
    # Vast.ai pods need a zone (a Worker cannot fetch their IP address): the stack has one.
    assert "colocate:zone:" in path.read_text()
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
    # The digest covers the pod token's fingerprint, which plan does not read: shown as *.
    assert "create   pod colocate-apac-jp-apac-tw-g2-p0-*:" in out and "delete   pod colocate-apac-jp-apac-jp-g1-p0-*:" in out
    # With a zone the cell places by its pod (auto): the move shows pod 0's new address.
    assert ("placement host changes from <pod 0's instance>.pod-apac-jp-g1.example.com:<pod 0's public port> to "
            "<the new pod 0's instance>.pod-apac-tw-g2.example.com:<the new pod 0's public port>") in out
    assert "bind     binding DRAINING_GENERATION: apac-jp.g1" in out
    assert "Worker TPE -> state NRT: 2,181 km, floor 22 ms" in out


ZONE_LINES = "\n  colocate:zone:\n    id: 0123456789abcdef0123456789abcdef\n    name: example.com\n"


def with_zone_and_gpu(stacks, stack, gpu=None):
    """The stack file with a zone (Vast.ai pods need one) and, if given, another pod.gpu."""
    path = stacks / f"Pulumi.{stack}.yaml"
    text = path.read_text()
    if "colocate:zone:" not in text:  # the shipped RunPod stacks have one already
        text = text.rstrip("\n") + ZONE_LINES  # with a zone: mutual TLS
    if gpu is not None:
        text = text.replace("gpu: NVIDIA GeForce RTX 4090", f"gpu: {gpu}")
    path.write_text(text)
    return path


def test_a_new_provider_gets_the_same_gpu_under_its_own_name(stacks, capsys):
    # RunPod's GPU id matches no Vast.ai offer: pulumi up would fail with "no capacity".
    with_zone_and_gpu(stacks, "apac-jp")
    assert run(stacks, "start", "--stack", "apac-jp", "--to", "apac-tw", "--provider", "vastai") == 0
    pod = stackfile.read_config("apac-jp", stacks)[0]["pod"]
    assert pod == {"provider": "vastai", "gpu": "RTX 4090"}
    assert "pod.gpu 'NVIDIA GeForce RTX 4090' -> 'RTX 4090' (vastai's name for the same GPU)" in capsys.readouterr().out


def test_a_gpu_the_catalogue_cannot_translate_is_refused_before_the_file_changes(stacks, capsys):
    path = with_zone_and_gpu(stacks, "apac-jp", gpu="NVIDIA L40S")
    snapshot = path.read_bytes()
    assert run(stacks, "start", "--stack", "apac-jp", "--to", "apac-tw", "--provider", "vastai") == 2
    err = capsys.readouterr().err
    assert "colocate:pod.gpu" in err and "'NVIDIA L40S'" in err and "--gpu" in err and "RTX 4090" in err
    assert path.read_bytes() == snapshot
    # The fix the message names works.
    assert run(stacks, "start", "--stack", "apac-jp", "--to", "apac-tw", "--provider", "vastai", "--gpu", "L40S") == 0
    assert stackfile.read_config("apac-jp", stacks)[0]["pod"] == {"provider": "vastai", "gpu": "L40S"}


def test_a_gpu_flag_under_the_other_provider_s_name_is_refused_with_the_right_name(stacks, capsys):
    path = with_zone_and_gpu(stacks, "apac-jp")
    snapshot = path.read_bytes()
    argv = ("start", "--stack", "apac-jp", "--to", "apac-tw", "--provider", "vastai", "--gpu", "NVIDIA GeForce RTX 4090")
    assert run(stacks, *argv) == 2
    assert "--gpu 'RTX 4090'" in capsys.readouterr().err
    assert path.read_bytes() == snapshot


def test_a_move_to_the_local_stand_in_keeps_any_gpu_name(stacks):
    # The stand-in ignores the GPU: nothing to translate, nothing to refuse.
    with_zone_and_gpu(stacks, "apac-jp", gpu="NVIDIA L40S")
    assert run(stacks, "start", "--stack", "apac-jp", "--to", "us-east", "--provider", "local") == 0
    assert stackfile.read_config("apac-jp", stacks)[0]["pod"] == {"provider": "local", "gpu": "NVIDIA L40S"}


def test_a_hand_switched_provider_with_the_old_gpu_name_is_refused_naming_the_fix(stacks, capsys):
    # `pulumi config set --path colocate:pod.provider vastai` alone keeps RunPod's GPU id.
    path = stacks / "Pulumi.apac-tw.yaml"
    path.write_text(path.read_text().replace("gpu: RTX 4090", "gpu: NVIDIA GeForce RTX 4090"))
    assert run(stacks, "plan", "--stack", "apac-tw") == 2
    err = capsys.readouterr().err
    assert "colocate:pod.gpu" in err and "'NVIDIA GeForce RTX 4090'" in err
    assert "pulumi config set --path colocate:pod.gpu 'RTX 4090'" in err


def test_a_vastai_pod_without_a_gpu_key_rents_the_default_gpu_under_vastai_s_name():
    raw = {"region": "apac-tw", "generations": [{"name": "apac-tw.g1", "region": "apac-tw", "status": "active"}],
           "pod": {"provider": "vastai"}, "zone": {"id": "a" * 32, "name": "example.com"}}
    assert migration.planning_settings(raw, "t").pod.gpu == "RTX 4090"
    assert migration.planning_settings({**raw, "pod": {"provider": "local"}}, "t").pod.gpu == POD_DEFAULTS["gpu"]


def test_finish_retires_and_plans_the_purge(stacks, capsys):
    assert run(stacks, "start", "--stack", "us-east", "--to", "apac-jp") == 0
    assert run(stacks, "finish", "--skip-import-check", "--stack", "us-east") == 0
    raw, _ = stackfile.read_config("us-east", stacks)
    assert [g["status"] for g in raw["generations"]] == ["retired", "active"]
    out = capsys.readouterr().out
    assert "unbind   binding DRAINING_GENERATION: was us-east.g1" in out
    assert "purge    generation us-east.g1" in out


def test_finish_refuses_while_the_cell_cannot_say_how_far_the_import_is(stacks, monkeypatch, capsys):
    # The import's progress is the cell's to tell (tests/test_migration_import.py asks a real one).
    assert run(stacks, "status", "--stack", "us-east") == 0  # nothing to ask with no move under way
    assert "no move under way; active us-east.g1" in capsys.readouterr().out
    assert run(stacks, "start", "--stack", "us-east", "--to", "apac-jp") == 0
    path = stacks / "Pulumi.us-east.yaml"
    snapshot = path.read_bytes()
    monkeypatch.setenv("COLOCATE_READ_TOKEN", "t")
    assert run(stacks, "finish", "--stack", "us-east", "--url", "http://127.0.0.1:9") == 2  # discard: nothing answers
    assert "did not answer" in capsys.readouterr().err
    assert run(stacks, "status", "--stack", "us-east", "--url", "http://127.0.0.1:9") == 2
    assert path.read_bytes() == snapshot


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
    monkeypatch.delenv("COLOCATE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("COLOCATE_PROBE_TOKEN", raising=False)
    assert migrate.main(["purge", "--url", "http://127.0.0.1:9", "--generation", "g"]) == 2
    assert "COLOCATE_ADMIN_TOKEN" in capsys.readouterr().err


def test_cli_runs_as_a_subprocess(stacks):
    proc = subprocess.run([sys.executable, "scripts/migrate.py", "plan", "--stack", "us-east", "--to", "eu-west",
                           "--stacks-dir", str(stacks)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "placement host changes from <pod 0's instance>.pod-us-east-g1.example.com" in proc.stdout
