"""probe.py's client key (given, or minted and revoked), each pod, the pod path and the fallback check."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import fake_cell
from tests.test_probe_cli import ROOT, SCRIPT, TOKEN, fake_pulumi, run_json, stack_file

pytest_plugins = ["tests.test_probe_cli"]  # its fixtures: probe, no_token_in_env


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv("COLOCATE_CLIENT_KEY", raising=False)


def test_without_a_key_one_is_minted_used_and_revoked_and_never_shown(probe, capsys):
    with fake_cell.serve() as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "3",
                                                 "--pod-location", "AP-JP-1"])
        minted = dict(cell.minted)
        log = list(cell.log)
    assert code == 0, err
    assert list(minted) == ["key1"]
    rec = minted["key1"]
    assert rec["name"].startswith("probe-") and rec["name"].endswith("Z") and rec["expires_in_s"] == 900
    assert rec["revoked_at"] is not None  # revoked at the end
    mint = [s for s in log if s.path == "/_colocate/keys"]
    assert len(mint) == 1 and mint[0].authorization == f"Bearer {TOKEN}"
    # no limits asked for: the probe's key has the cell's default limits, so a leaked one is bounded too
    assert json.loads(mint[0].body) == {"name": rec["name"], "expires_in_s": 900}
    routed = [s for s in log if s.path.startswith("/v1/")]
    assert len(routed) == 4 and all(s.authorization == f"Bearer {rec['key']}" for s in routed)
    # minted after the warm-up (the cell answers first), revoked after the last sample
    paths = [s.path for s in log]
    assert paths.index("/_colocate/keys") == 1 and paths[-2:] == ["/_colocate/keys/key1/revoke", "/_colocate/scale"]
    shown = json.dumps(doc) + err
    assert rec["key"] not in shown and TOKEN not in shown
    assert "minted client key key1" in err and "revoked client key key1" in err


def test_a_given_key_is_used_and_nothing_minted(probe, capsys, monkeypatch):
    monkeypatch.setenv("COLOCATE_CLIENT_KEY", "clc_given")
    with fake_cell.serve() as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2"])
        assert code == 0 and not cell.minted
        assert "clc_given" not in json.dumps(doc) + err


def test_a_refused_key_exits_2_with_the_fix(probe, capsys):
    with fake_cell.serve() as cell:
        code = probe.main([cell.url, "--token", TOKEN, "--samples", "2", "--key", "clc_wrong"])
    err = capsys.readouterr().err
    assert code == 2
    assert "client key was refused" in err and "COLOCATE_CLIENT_KEY" in err and "clc_wrong" not in err


def test_a_worker_without_key_endpoints_is_probed_without_a_key(probe, capsys):
    with fake_cell.serve(keys_endpoint=False, require_key=False) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2"])
        routed = [s for s in cell.log if s.path.startswith("/v1/")]
    assert code == 0, err
    assert "no /_colocate/keys" in err and all(s.authorization is None for s in routed)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_mid_run_revokes_the_minted_key(sig):
    with fake_cell.serve(routed_delay_ms=200) as cell:
        env = {k: v for k, v in os.environ.items() if k not in ("COLOCATE_CLIENT_KEY",)}
        env["COLOCATE_READ_TOKEN"] = TOKEN
        # SIGINT as a terminal sends it, even when this test runs where SIGINT is ignored (a background job)
        proc = subprocess.Popen([sys.executable, str(SCRIPT), cell.url, "--samples", "50"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(s.path == "/v1/chat/completions" for s in list(cell.log)):
                time.sleep(0.05)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        minted = dict(cell.minted)
    assert proc.returncode == 130, err
    assert list(minted) == ["key1"] and minted["key1"]["revoked_at"] is not None
    assert "revoked client key key1" in err and minted["key1"]["key"] not in err


def test_each_pod_with_its_location_rtt_and_the_pod_path(probe, capsys):
    with fake_cell.serve(pod_rtt_ms=[10.0], pod_offsets_ms=[0.0, 5.0]) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "4",
                                                 "--pod-location", "AP-JP-1", "--pod-location", "JP",
                                                 "--pod-path", "provider-proxy"])
    assert code == 0, err
    assert doc["pod_path"] == "provider-proxy"
    pods = doc["pods"]
    assert [(p["index"], p["location"], p["status"], p["pod_rtt"]["p50"], p["healthy"], p["checks"]) for p in pods] == \
        [(0, "AP-JP-1", "in_region", 10.0, 4, 4), (1, "JP", "in_region", 15.0, 4, 4)]
    assert pods[1]["host"] == "pod-1.example.com:8000"
    assert "pods (pod path provider-proxy" in err
    assert "pod 1   JP (NRT)" in err and "pod_rtt p50 15.0 ms" in err
    assert "pod_rtt p50 10 ms over provider-proxy" in doc["verdict"]


def test_a_second_pod_outside_the_region_or_never_healthy_fails(probe, capsys):
    with fake_cell.serve(pod_offsets_ms=[0.0, 5.0, 7.0], pod_down=(2,)) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "3",
                                               "--pod-location", "AP-JP-1", "--pod-location", "US-GA-1",
                                               "--pod-location", "AP-JP-1"])
    assert code == 1
    parts = {(v["kind"], v["part"]) for v in doc["violations"]}
    assert parts == {("placement", "pod-1"), ("pod_health", "pod-2")}
    sick = next(v for v in doc["violations"] if v["kind"] == "pod_health")
    assert "raise colocate:pod.renewal by one" in sick["message"] and "scripts/scale.py run" in sick["message"]


def test_a_failed_fallback_check_is_a_violation(probe, capsys):
    bad = {"ok": False, "status": 200, "rtt_ms": 40.0, "model": "Qwen/Qwen2.5-7B", "model_listed": False,
           "error": "FALLBACK_MODEL is not among the fallback's models"}
    with fake_cell.serve(fallback_check=bad) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                                 "--pod-location", "AP-JP-1"])
        checks = [s for s in cell.log if s.path == "/_colocate/probe?fallback=1"]
    assert code == 1 and len(checks) == 1  # once per run
    assert doc["fallback_check"] == bad
    assert [v["kind"] for v in doc["violations"]] == ["fallback"]
    assert "fallback check failed: FALLBACK_MODEL is not among" in doc["verdict"]
    assert "colocate:fallbackModel" in doc["verdict"]
    assert "fallback check: FAILED" in err and "NOT LISTED" in err


def test_a_good_fallback_check_is_reported(probe, capsys):
    with fake_cell.serve() as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                                 "--pod-location", "AP-JP-1"])
    assert code == 0
    assert doc["fallback_check"]["ok"] is True and doc["fallback_check"]["model"] == "gpt-4o-mini"
    assert "fallback check: ok: GET /v1/models answered 200 in 35 ms; model gpt-4o-mini listed" in err


def test_a_worker_without_the_fallback_check_is_a_note_not_a_failure(probe, capsys):
    with fake_cell.serve(fallback_check=None) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                               "--pod-location", "AP-JP-1"])
    assert code == 0 and doc["fallback_check"] is None
    assert any("did not report a fallback check" in n for n in doc["notes"])


def test_stack_outputs_give_every_pod_location_and_the_pod_path(probe, capsys, monkeypatch, tmp_path):
    stack_file(tmp_path / "stacks")
    with fake_cell.serve(pod_offsets_ms=[0.0, 2.0]) as cell:
        calls = fake_pulumi(tmp_path / "bin", {"workerUrl": cell.url, "probeToken": TOKEN, "podLocation": "AP-JP-1",
                                               "podLocations": ["AP-JP-1", "JP"], "podPath": "zone-dns"})
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        code, doc, err = run_json(probe, capsys, ["--stack", "t", "--stacks-dir", str(tmp_path / "stacks")])
    assert code == 0, err
    assert calls.exists()
    assert doc["pod_path"] == "zone-dns"
    assert [p["location"] for p in doc["pods"]] == ["AP-JP-1", "JP"]
