"""scripts/keys.py against a real router in workerd: create, list, revoke, usage, errors."""

import json
import os
import subprocess
import sys

import pytest

from scripts import keys
from tests.support.workerd import SECRETS, chat, running_cell

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 60_000}, compute_ms=1) as c:
        yield c


@pytest.fixture
def token(monkeypatch):
    monkeypatch.delenv("COLOCATE_PROBE_TOKEN", raising=False)
    monkeypatch.setenv("COLOCATE_ADMIN_TOKEN", SECRETS["PROBE_TOKEN"])


def run(capsys, *argv) -> tuple[int, str, str]:
    code = keys.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_create_prints_the_key_once_and_it_works(cell, token, capsys):
    code, out, err = run(capsys, "create", "--url", cell.url, "--name", "ci-bot", "--rpm", "100")
    assert code == 0
    key = out.strip()
    assert key.startswith("clc_") and "shown only once" in err and key not in err
    res = cell.call("GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
    assert res.status == 200
    code, out, _ = run(capsys, "list", "--url", cell.url)
    assert code == 0 and "ci-bot" in out and key not in out and key[:10] in out
    row = next(line for line in out.splitlines() if "ci-bot" in line)
    assert "100" in row and "active" in row


def test_a_key_made_without_limits_gets_the_cells_finite_defaults_and_says_so(cell, token, capsys):
    code, out, err = run(capsys, "create", "--url", cell.url, "--name", "plain-bot", "--tpm", "0")
    assert code == 0 and out.startswith("clc_")
    assert ("limits: rpm 3000 (default), tpm no limit, monthly_tokens 1000000000 (default), max_parallel 8 (default), "
            "max_parallel_tokens 8192 (default), fallback $2 a day (default)") in err
    code, out, _ = run(capsys, "list", "--url", cell.url, "--json")
    row = next(k for k in json.loads(out)["keys"] if k["name"] == "plain-bot")
    assert (row["rpm"], row["tpm"], row["monthly_tokens"], row["max_parallel"]) == (3000, 0, 1_000_000_000, 8)


def test_create_env_prints_only_the_exports_on_stdout_and_the_limits_on_stderr(cell, token, capsys):
    code, out, err = run(capsys, "create", "--url", cell.url, "--name", "env-bot", "--rpm", "7", "--env")
    assert code == 0
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())
    assert set(exports) == {"OPENAI_BASE_URL", "OPENAI_API_KEY"} and exports["OPENAI_API_KEY"].startswith("clc_")
    assert exports["OPENAI_API_KEY"] not in err  # shown once, where eval takes it
    assert "env-bot" in err and "limits: rpm 7, tpm 3000000 (default)" in err


def test_a_flag_typo_is_named_with_the_flag_meant():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "keys.py"), "create", "--name", "x", "--rmp", "5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "keys.py: --rmp: unknown flag. Fix: did you mean `--rpm`? (`keys.py --help` lists the flags)"


def test_max_parallel_is_set_and_listed(cell, token, capsys):
    code, out, _ = run(capsys, "create", "--url", cell.url, "--name", "par-bot", "--max-parallel", "3", "--json")
    assert code == 0 and json.loads(out)["max_parallel"] == 3
    code, out, _ = run(capsys, "list", "--url", cell.url)
    header = out.splitlines()[0].split()
    row = next(line for line in out.splitlines() if "par-bot" in line).split()
    assert "parallel" in header and row[header.index("parallel")] == "3"
    code, out, err = run(capsys, "create", "--url", cell.url, "--name", "neg", "--max-parallel", "-1")
    assert code != 0 and "max_parallel" in err and "-1" in err


def test_max_parallel_tokens_is_set_listed_and_defaults_to_the_cells(cell, token, capsys):
    code, out, _ = run(capsys, "create", "--url", cell.url, "--name", "prompt-bot", "--max-parallel-tokens", "4096", "--json")
    assert code == 0 and json.loads(out)["max_parallel_tokens"] == 4096
    code, out, err = run(capsys, "create", "--url", cell.url, "--name", "prompt-default")
    assert code == 0 and "max_parallel_tokens 8192 (default)" in err  # colocate:keys.defaults: one context
    code, out, _ = run(capsys, "list", "--url", cell.url)
    header = out.splitlines()[0]
    row = next(line for line in out.splitlines() if "prompt-bot" in line)
    assert "prompt tokens" in header and " 4096 " in row


def test_list_json_revoke_and_usage(cell, token, capsys):
    code, out, _ = run(capsys, "create", "--url", cell.url, "--name", "tmp", "--json")
    made = json.loads(out)
    for _ in range(2):
        assert (
            cell.call("POST", "/v1/chat/completions", body=chat(), headers={"authorization": f"Bearer {made['key']}"}).status
            == 200
        )
    code, out, _ = run(capsys, "revoke", "--url", cell.url, made["id"])
    assert code == 0 and made["id"] in out
    assert cell.call("GET", "/v1/models", headers={"authorization": f"Bearer {made['key']}"}).status == 401
    code, out, _ = run(capsys, "list", "--url", cell.url, "--json")
    listed = {k["id"]: k for k in json.loads(out)["keys"]}
    assert listed[made["id"]]["revoked_at"] is not None and "key" not in listed[made["id"]]
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        code, out, _ = run(capsys, "usage", "--url", cell.url, "--key", made["id"], "--json")
        rows = json.loads(out)["usage"]
        if rows and rows[0]["pod_requests"] == 2:
            break
        time.sleep(0.1)
    assert rows[0]["requests"] == 2 and rows[0]["name"] == "tmp"
    code, out, _ = run(capsys, "usage", "--url", cell.url, "--key", made["id"])
    assert code == 0 and "tmp" in out and out.splitlines()[-1].startswith("total")


def test_a_keys_refusals_are_counted_in_usage_and_in_the_metrics_by_reason(cell, token, capsys):
    import time

    code, out, _ = run(capsys, "create", "--url", cell.url, "--name", "noisy", "--rpm", "2", "--json")
    made = json.loads(out)
    answers = [cell.call("POST", "/v1/chat/completions", body=chat(), headers={"authorization": f"Bearer {made['key']}"})
               for _ in range(5)]
    refused = sum(a.status == 429 for a in answers)
    assert refused >= 3 and all(a.json()["error"]["code"] == "rate_limit_exceeded" for a in answers if a.status == 429)
    deadline = time.monotonic() + 10  # the isolate flushes within a second
    while time.monotonic() < deadline:
        code, out, _ = run(capsys, "usage", "--url", cell.url, "--key", made["id"], "--json")
        rows = json.loads(out)["usage"]
        if rows and rows[0]["refused"] == refused:
            break
        time.sleep(0.1)
    assert rows[0]["refused"] == refused and rows[0]["requests"] == 5 - refused, rows
    code, out, _ = run(capsys, "usage", "--url", cell.url, "--key", made["id"])
    head, row = out.splitlines()[0].split(), out.splitlines()[1].split()
    assert head[:4] == ["day", "key", "requests", "refused"] and row[1:4] == ["noisy", str(5 - refused), str(refused)], out
    text = cell.call("GET", "/_colocate/metrics", headers={"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}"}).body.decode()
    assert f'colocate_refusals_total{{key="{made["id"]}",reason="rpm"}} {refused}' in text, text[-2000:]


def test_errors_exit_codes_and_messages(cell, token, capsys, monkeypatch):
    code, _, err = run(capsys, "revoke", "--url", cell.url, "key_000000000000")
    assert code == 1 and "unknown_key" in err
    code, _, err = run(capsys, "create", "--url", cell.url, "--name", "x", "--rpm", "-5")
    assert code == 2 and '"rpm"' in err
    code, _, err = run(capsys, "list", "--url", "http://127.0.0.1:9")
    assert code == 2 and "did not answer" in err
    monkeypatch.setenv("COLOCATE_ADMIN_TOKEN", "tok-3f9a1b")
    code, _, err = run(capsys, "list", "--url", cell.url)
    assert code == 2 and "401" in err and "tok-3f9a1b" not in err
    monkeypatch.delenv("COLOCATE_ADMIN_TOKEN")
    code, _, err = run(capsys, "list", "--url", cell.url)
    assert code == 2 and "COLOCATE_ADMIN_TOKEN" in err
    # The old single token still works for this release, with a warning naming the new variable.
    monkeypatch.setenv("COLOCATE_PROBE_TOKEN", SECRETS["PROBE_TOKEN"])
    code, _, err = run(capsys, "list", "--url", cell.url)
    assert code == 0 and "COLOCATE_PROBE_TOKEN is deprecated" in err and "export COLOCATE_ADMIN_TOKEN" in err


def test_as_a_subprocess_with_a_sandbox_state_dir(cell, tmp_path):
    (tmp_path / "ready.json").write_text(json.dumps({"worker_url": cell.url, "token": SECRETS["PROBE_TOKEN"]}))
    env = {k: v for k, v in os.environ.items() if k not in ("COLOCATE_PROBE_TOKEN", "COLOCATE_ADMIN_TOKEN")}
    proc = subprocess.run([sys.executable, "scripts/keys.py", "list", "--state-dir", str(tmp_path), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "keys" in json.loads(proc.stdout)
    assert SECRETS["PROBE_TOKEN"] not in proc.stdout + proc.stderr


def test_a_stack_with_no_sandbox_and_no_deployment_names_this_commands_options(capsys, monkeypatch, tmp_path):
    from colocate.sandbox import statedir

    monkeypatch.setattr(statedir, "SANDBOXES_DIR", tmp_path / "sandboxes")
    monkeypatch.delenv("COLOCATE_PROBE_TOKEN", raising=False)
    monkeypatch.delenv("COLOCATE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no pulumi CLI
    code, out, err = run(capsys, "list", "--stack", "nosuch")
    assert code == 2 and out == ""
    assert "pulumi CLI" in err and str(tmp_path / "sandboxes" / "nosuch") in err
    assert "sandbox.py up --stack nosuch" in err and "--state-dir DIR" in err and "--url URL" in err
    assert "--pod-location" not in err  # probe.py's option, not keys.py's
    # A pulumi that answers: the stack was never deployed. Its reason is passed on, with the same fixes.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pulumi").write_text("#!/bin/sh\necho \"error: no stack named 'nosuch' found\" >&2\nexit 255\n")
    (bin_dir / "pulumi").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    code, out, err = run(capsys, "list", "--stack", "nosuch")
    assert code == 2 and "no stack named 'nosuch' found" in err
    assert "--state-dir DIR" in err and "--pod-location" not in err
