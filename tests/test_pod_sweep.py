"""``pod.py sweep`` tells the truth: it fails when it cannot look, finds a stack's key as
``pulumi up`` does, knows the stack, and handles several pods per stack (``-p<i>-``)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from tests.support.fake_providers import API_KEY
from tests.test_pod_providers import env, fake_runpod, make_spec, run, stack_file, sweep_argv, write_spec  # noqa: F401

DIGEST = "0a1b2c"


def pod_spec(index: int, **over) -> dict:
    spec = make_spec("apac-jp", "runpod", **over)
    return {**spec, "index": index, "name": f"{spec['name']}-p{index}-{DIGEST}"}


def fake_pulumi(directory: Path, value: str | None) -> Path:
    """A `pulumi` on PATH that answers `config get --show-secrets colocate:runpodApiKey --stack t1`
    (and records every call); ``value`` None plays a CLI that cannot decrypt (exit 255)."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "calls.txt"
    body = (f'echo "$@" >> {log}\n'
            'if [ "$1 $2 $3 $4 $5 $6" = "config get --show-secrets colocate:runpodApiKey --stack t1" ]; then\n'
            + (f'  echo "{value}"; exit 0\n' if value else '  echo "error: passphrase must be set" >&2; exit 255\n')
            + 'fi\necho "error: unexpected call" >&2; exit 1\n')
    exe = directory / "pulumi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return log


@pytest.fixture
def no_cli(monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no pulumi here
    return empty


def test_key_only_in_pulumi_config_without_the_cli_is_exit_2_not_no_strays(fake_runpod, env, capsys, monkeypatch, no_cli):  # noqa: F811
    _, stray, _ = run(capsys, ["create", "--spec", write_spec(env, pod_spec(0))])
    monkeypatch.delenv("RUNPOD_API_KEY")
    stacks = stack_file(env / "stacks", secret_key=True)
    code, out, err = run(capsys, ["sweep", "--stack", "t1", "--stacks-dir", stacks])
    assert code == 2 and out is None, "no JSON: nothing was swept"
    assert "RUNPOD_API_KEY" in err and "colocate:runpodApiKey" in err and "pulumi CLI" in err
    assert "export RUNPOD_API_KEY" in err and "pulumi config set --secret colocate:runpodApiKey" in err
    # Also when the stack file has no key at all, and when --provider names it explicitly.
    for argv in (sweep_argv(env), sweep_argv(env, "--provider", "runpod")):
        code, out, err = run(capsys, argv)
        assert code == 2 and out is None and "cannot query runpod" in err
    assert [p["id"] for p in fake_runpod.live()] == [stray["id"]]


def test_key_read_from_pulumi_config_like_pulumi_up(fake_runpod, env, capsys, monkeypatch, tmp_path):  # noqa: F811
    _, stray, _ = run(capsys, ["create", "--spec", write_spec(env, pod_spec(0))])
    monkeypatch.setenv("RUNPOD_API_KEY", "a-stale-key-the-config-overrides")
    calls = fake_pulumi(tmp_path / "bin", API_KEY)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    stacks = stack_file(env / "stacks", secret_key=True)
    code, out, err = run(capsys, ["sweep", "--stack", "t1", "--stacks-dir", stacks])
    assert code == 0, err
    assert [s["id"] for s in out["strays"]] == [stray["id"]] and "runpod key from pulumi config" in err
    assert calls.read_text().split() == ["config", "get", "--show-secrets", "colocate:runpodApiKey", "--stack", "t1"]
    assert API_KEY not in err
    # A CLI that cannot decrypt falls back to the environment, as `pulumi up` would need it to.
    fake_pulumi(tmp_path / "bin", None)
    monkeypatch.setenv("RUNPOD_API_KEY", API_KEY)
    code, out, err = run(capsys, ["sweep", "--stack", "t1", "--stacks-dir", stacks])
    assert code == 0 and [s["id"] for s in out["strays"]] == [stray["id"]] and "environment RUNPOD_API_KEY" in err


def test_unknown_stack_is_exit_2_naming_the_known_ones(env, capsys):  # noqa: F811
    stacks = stack_file(env / "stacks", "apac-jp", provider="local")
    code, out, err = run(capsys, ["sweep", "--stack", "nosuch", "--stacks-dir", stacks])
    assert code == 2 and out is None
    assert "unknown stack" in err and "nosuch" in err and "apac-jp" in err


def test_sweep_with_several_pods_per_stack_keeps_the_listed_ones(fake_runpod, env, capsys):  # noqa: F811
    made = [run(capsys, ["create", "--spec", write_spec(env, pod_spec(i))])[1] for i in range(3)]
    assert [m["name"].rsplit("-", 2)[1] for m in made] == ["p0", "p1", "p2"]
    _, other, _ = run(capsys, ["create", "--spec", write_spec(env, pod_spec(1, stack="t1-p1"))])  # not t1's
    keep = ["--keep", made[0]["id"], "--keep", made[2]["id"]]
    code, out, _ = run(capsys, sweep_argv(env, *keep))
    assert code == 0 and [s["id"] for s in out["strays"]] == [made[1]["id"]] and out["destroyed"] == []
    code, out, _ = run(capsys, sweep_argv(env, *keep, "--destroy"))
    assert code == 0 and out["destroyed"] == [made[1]["id"]]
    assert sorted(p["id"] for p in fake_runpod.live()) == sorted([made[0]["id"], made[2]["id"], other["id"]])


def test_one_of_n_creates_failing_cleans_up_only_itself(fake_runpod, env, capsys):  # noqa: F811
    ok = [run(capsys, ["create", "--spec", write_spec(env, pod_spec(i))])[1] for i in (0, 2)]
    fake_runpod.ready_after = 10_000  # pod 1 never becomes ready
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, pod_spec(1, readyTimeoutS=0.5))])
    assert code == 1 and out is None and "destroyed" in err
    live = fake_runpod.live()
    assert sorted(p["id"] for p in live) == sorted(o["id"] for o in ok), "the others stay, the failed one is gone"
    assert all("-p1-" not in p["name"] for p in live)
    code, out, _ = run(capsys, sweep_argv(env, *sum((["--keep", o["id"]] for o in ok), [])))
    assert code == 0 and out["strays"] == [], json.dumps(out)


def test_delete_after_a_key_rotation_uses_the_stacks_current_key(fake_runpod, env, capsys, monkeypatch, tmp_path):  # noqa: F811
    # pulumi-command runs a delete with the environment saved at create: after a rotation it
    # holds the revoked key. With --stack the stack's current key (pulumi config) goes first.
    code, created, _ = run(capsys, ["create", "--spec", write_spec(env, pod_spec(0))])
    assert code == 0
    stacks = stack_file(env / "stacks", secret_key=True)
    monkeypatch.setenv("RUNPOD_API_KEY", "revoked-key")  # what the saved environment holds
    monkeypatch.setenv("PULUMI_COMMAND_STDOUT", json.dumps(created))
    calls = fake_pulumi(tmp_path / "bin", API_KEY)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    code, out, err = run(capsys, ["delete", "--stack", "t1", "--stacks-dir", stacks])
    assert code == 0, err
    assert out["id"] == created["id"] and out["already_gone"] is False and fake_runpod.live() == []
    assert "runpod key from pulumi config" in err and API_KEY not in err and "revoked-key" not in err
    assert calls.read_text().split() == ["config", "get", "--show-secrets", "colocate:runpodApiKey", "--stack", "t1"]


def test_delete_falls_back_to_the_saved_key_and_names_the_fix_when_every_key_is_refused(fake_runpod, env, capsys, monkeypatch, tmp_path):  # noqa: E501, F811
    code, created, _ = run(capsys, ["create", "--spec", write_spec(env, pod_spec(0))])
    assert code == 0
    stacks = stack_file(env / "stacks", secret_key=True)
    monkeypatch.setenv("PULUMI_COMMAND_STDOUT", json.dumps(created))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    # The config's key is the one refused (set but not yet valid): the saved one still works.
    fake_pulumi(tmp_path / "bin", "not-yet-valid-key")
    code, out, err = run(capsys, ["delete", "--stack", "t1", "--stacks-dir", stacks])
    assert code == 0, err
    assert "refused the key from pulumi config (401); trying the key from environment RUNPOD_API_KEY" in err
    assert fake_runpod.live() == []
    # Both keys refused: exit 1 with the fix, never "deleted".
    code, created, _ = run(capsys, ["create", "--spec", write_spec(env, pod_spec(1))])
    monkeypatch.setenv("PULUMI_COMMAND_STDOUT", json.dumps(created))
    monkeypatch.setenv("RUNPOD_API_KEY", "revoked-key")
    code, out, err = run(capsys, ["delete", "--stack", "t1", "--stacks-dir", stacks])
    assert code == 1 and out is None
    assert "refused every key tried (pulumi config, environment RUNPOD_API_KEY)" in err
    assert "pulumi config set --secret colocate:runpodApiKey <current key>" in err and "may still be billing" in err
    assert [p["id"] for p in fake_runpod.live()] == [created["id"]]


OURS, THEIRS = "abc123", "def456"  # plan.pod_scope of two projects, each with a stack t1 on one account


def scoped_spec(index: int, scope: str) -> dict:
    spec = make_spec("apac-jp", "runpod")
    return {**spec, "index": index, "name": f"colocate-t1-{scope}-apac-jp-g1-p{index}-{DIGEST}"}


def test_destroys_sweep_deletes_every_pod_of_its_scope_and_leaves_another_projects_stack_of_that_name(
        fake_runpod, env, capsys):  # noqa: F811
    """`pulumi destroy` runs the sweep Command's delete (no --keep): every pod of the stack's scope goes, one
    a killed rent left on no record included, and a pod named before scopes; another project's `t1` stays."""
    ours = run(capsys, ["create", "--spec", write_spec(env, scoped_spec(0, OURS))])[1]
    lost = run(capsys, ["create", "--spec", write_spec(env, scoped_spec(1, OURS))])[1]  # on no record
    old = run(capsys, ["create", "--spec", write_spec(env, pod_spec(0))])[1]  # named before scopes
    theirs = run(capsys, ["create", "--spec", write_spec(env, scoped_spec(0, THEIRS))])[1]
    code, out, err = run(capsys, sweep_argv(env, "--scope", OURS, "--destroy", "--provider", "runpod"))
    assert code == 0, err
    assert sorted(out["destroyed"]) == sorted([ours["id"], lost["id"], old["id"]])
    assert [p["id"] for p in fake_runpod.live()] == [theirs["id"]]


def test_a_sweep_without_a_scope_lists_every_scope_but_destroys_only_unscoped_names(fake_runpod, env, capsys):  # noqa: F811
    theirs = run(capsys, ["create", "--spec", write_spec(env, scoped_spec(0, THEIRS))])[1]
    old = run(capsys, ["create", "--spec", write_spec(env, pod_spec(0))])[1]
    code, out, err = run(capsys, sweep_argv(env, "--destroy"))
    assert code == 0 and {s["id"] for s in out["strays"]} == {theirs["id"], old["id"]}
    assert out["destroyed"] == [old["id"]] and out["held"] == [theirs["id"]]
    assert "--scope $(pulumi stack output podScope --stack t1)" in err
    assert [p["id"] for p in fake_runpod.live()] == [theirs["id"]]


def test_scope_of_reads_the_stacks_names_old_and_new():
    from colocate.pods.base import belongs_to_stack, scope_of

    assert scope_of("colocate-t1-abc123-apac-jp-g1-p0-0a1b2c", "t1") == "abc123"
    assert scope_of("colocate-t1-apac-jp-g1-p0-0a1b2c", "t1") == ""
    assert scope_of("colocate-t1-b-apac-jp-g1-p0-0a1b2c", "t1") is None  # stack t1-b's
    assert belongs_to_stack("colocate-t1-abc123-apac-jp-g1-p0-0a1b2c", "t1", "abc123")
    assert not belongs_to_stack("colocate-t1-def456-apac-jp-g1-p0-0a1b2c", "t1", "abc123")
