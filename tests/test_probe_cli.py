"""scripts/probe.py against a local fake cell with known delays, Server-Timing and colos."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import fake_cell

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "probe.py"
TOKEN = "probe-secret"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch):
    monkeypatch.delenv("COLOCATE_READ_TOKEN", raising=False)
    monkeypatch.delenv("COLOCATE_PROBE_TOKEN", raising=False)


def run_json(probe, capsys, argv):
    """main(argv + --json -) → (exit code, JSON document, stderr)."""
    code = probe.main([*argv, "--json", "-"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_e2e_and_server_timing_match_the_injected_truth(probe, capsys, monkeypatch):
    truth_ms = 100.0
    monkeypatch.setenv("COLOCATE_CLIENT_KEY", "clc_given")
    with fake_cell.serve(routed_delay_ms=truth_ms, state=[0, 10, 20, 30, 40], upstream=[60, 70],
                         total=[101.5], state_rtt_ms=[2.0, 4.0], pod_rtt_ms=[9.0], stream_ttft_ms=60,
                         stream_gap_ms=100, stream_tokens=6) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "15",
                                                 "--pod-location", "AP-JP-1"])
        log = list(cell.log)
    assert code == 0, err
    seg = doc["segments"]
    assert seg["e2e"]["n"] == 15
    # the delay counted once, not twice (a loaded machine adds its own few ms on top, so no tight bound)
    assert truth_ms <= seg["e2e"]["p50"] < 2 * truth_ms
    # Server-Timing values are reported as sent: 0,10,20,30,40 three times each → p10 0, p50 20, p90 40
    assert (seg["state"]["p10"], seg["state"]["p50"], seg["state"]["p90"], seg["state"]["n"]) == (0.0, 20.0, 40.0, 15)
    assert seg["upstream"]["p50"] == 60.0  # 60 ×8, 70 ×7
    assert seg["total"]["p99"] == 101.5 and seg["fallback"]["p50"] == 0.0
    # the warm-up took state_rtt 2.0 and the fallback check 4.0: the samples are 2.0 ×8, 4.0 ×7
    assert seg["state_rtt"]["p50"] == 2.0 and seg["state_rtt"]["n"] == 15 and seg["pod_rtt"]["p50"] == 9.0
    assert doc["fallback_rate"] == 0.0 and doc["connections"] == "reused"
    # a streamed answer every 5th round: its first token after 60 ms, then one each 100 ms, the last
    # at 560 ms: far enough apart that a busy machine's own delays cannot make one look like another
    assert seg["ttft"]["n"] == 3 and 60 <= seg["ttft"]["p50"] < 300
    assert seg["itl"]["n"] == 3 and 95 <= seg["itl"]["p50"] < 200  # (last - first) / 5 gaps of 100 ms each
    # warm-up + fallback check + models + 15 probes + 15 routed + 3 streamed, all over one connection, then the
    # keeper's record (GET /_colocate/scale); no key minted
    assert len(log) == 37 and log[-1].path == "/_colocate/scale"
    assert len({s.client_port for s in log[:-1]}) == 1  # the samples' one connection
    assert not cell.minted
    probes = [s for s in log if s.path.startswith("/_colocate/probe")]
    routed = [s for s in log if s.path.startswith("/v1/")]
    assert [s.path for s in probes[:2]] == ["/_colocate/probe", "/_colocate/probe?fallback=1"]
    assert len(probes) == 17 and all(s.authorization == f"Bearer {TOKEN}" for s in probes)
    # the probe token stays with /_colocate, the client key with the routed paths
    assert len(routed) == 19 and all(s.authorization == "Bearer clc_given" for s in routed)
    assert json.loads(routed[1].body) == {"model": "fake-model", "messages": [{"role": "user", "content": "ping"}],
                                          "max_tokens": 1}


def test_healthy_cell_exits_0_with_table_on_stderr(probe, capsys):
    with fake_cell.serve() as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "3",
                                                 "--pod-location", "AP-JP-1", "--budget", "state_rtt=40"])
    assert code == 0
    assert doc["ok"] is True and doc["violations"] == []
    assert doc["verdict"].startswith("all checks hold: Worker in NRT, state object in NRT, pod AP-JP-1 (NRT)")
    p = doc["placement"]
    assert (p["accepted"], p["ran"], p["state"], p["pod"], p["expected_region"], p["ok"]) == \
        ("NRT", "NRT", "NRT", "AP-JP-1", "apac-jp", True)
    assert doc["floor_ms"] == {"state_rtt": 0.0, "pod_rtt": 0.0, "pod_rtt_new": 0.0, "upstream": 0.0}
    assert doc["budgets"] == [{"segment": "state_rtt", "ms": 40.0, "percentile": "p50"}]
    assert "segment" in err and "OK: all checks hold" in err  # the table went to stderr


def test_left_behind_state_is_reported_with_colos_and_distance(probe, capsys):
    with fake_cell.serve(state_colo="IAD", state_rtt_ms=[171.0, 168.0, 175.0]) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "6",
                                                 "--pod-location", "AP-JP-1"])
    assert code == 1
    assert doc["ok"] is False
    assert doc["placement"]["state"] == "IAD" and doc["placement"]["ran"] == "NRT"
    assert doc["placement"]["checks"]["state"]["status"] == "out_of_region"
    assert doc["verdict"].startswith("state object runs in IAD, 10,845 km from the Worker in NRT: state left behind "
                                     "(state_rtt p50 171 ms, floor 108 ms")
    assert doc["verdict"].endswith("`.venv/bin/python scripts/migrate.py plan --stack <the cell stack> --to apac-jp`")
    assert doc["floor_ms"]["state_rtt"] == pytest.approx(108.45, abs=0.01)
    assert doc["ratio_to_floor"]["state_rtt"] == pytest.approx(171.0 / 108.45, abs=0.01)
    assert [v["kind"] for v in doc["violations"]] == ["placement"]


def test_budget_breach_exits_1_and_warn_only_exits_0(probe, capsys):
    with fake_cell.serve(state=[30.0]) as cell:
        argv = [cell.url, "--token", TOKEN, "--samples", "3", "--pod-location", "AP-JP-1", "--budget", "state=25"]
        code, doc, _ = run_json(probe, capsys, argv)
        assert code == 1
        assert doc["violations"] == [{"kind": "budget", "segment": "state", "percentile": "p50", "budget_ms": 25.0,
                                      "measured_ms": 30.0,
                                      "message": "state p50 30.0 ms exceeds its 25 ms budget"}]
        code, doc, err = run_json(probe, capsys, [*argv, "--warn-only"])
        assert code == 0 and doc["ok"] is False and doc["warn_only"] is True
        assert "state p50 30.0 ms exceeds its 25 ms budget" in err


def test_worker_outside_the_expected_region_fails(probe, capsys):
    with fake_cell.serve() as cell:  # everything in NRT, but the cell is meant to be in us-east
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                               "--expect-region", "us-east"])
    assert code == 1
    assert doc["placement"]["expected_region"] == "us-east"
    assert doc["verdict"].startswith("Worker runs in NRT, outside us-east")
    assert "placement not applied" in doc["verdict"]
    assert any("the Worker reports CELL_REGION apac-jp, but us-east was expected" in n for n in doc["notes"])


def test_unreachable_target_exits_2_naming_the_url(probe, capsys):
    url = f"http://127.0.0.1:{fake_cell.closed_port()}"
    code = probe.main([url, "--token", TOKEN, "--samples", "2"])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"cannot reach {url}/_colocate/probe" in err and out == ""


def test_warm_up_timeout_exits_2(probe, capsys):
    with fake_cell.serve(probe_delay_ms=3000) as cell:
        code = probe.main([cell.url, "--token", TOKEN, "--samples", "2", "--timeout", "0.3"])
    err = capsys.readouterr().err
    assert code == 2 and f"{cell.url}/_colocate/probe did not answer within 0.3 s (--timeout)" in err


def test_wrong_token_is_401_with_the_fix_and_no_secret(probe, capsys):
    with fake_cell.serve() as cell:
        code = probe.main([cell.url, "--token", "not-the-token", "--samples", "2"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "answered 401" in err and "pass --token or set COLOCATE_READ_TOKEN" in err
    assert "not-the-token" not in out + err


def test_missing_token_exits_2_before_any_request(probe, capsys):
    with fake_cell.serve() as cell:
        code = probe.main([cell.url, "--samples", "2"])
        assert cell.log == []
    assert code == 2 and "COLOCATE_READ_TOKEN" in capsys.readouterr().err


def test_token_from_the_environment_never_printed(probe, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLOCATE_READ_TOKEN", TOKEN)
    with fake_cell.serve(state_colo="IAD") as cell:
        code = probe.main([cell.url, "--samples", "2", "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 1
    assert TOKEN not in out + err + (tmp_path / "r.json").read_text()


def test_5xx_samples_are_counted_and_fail_the_run(probe, capsys):
    with fake_cell.serve(fail_every=5, fail_status=502) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "10",
                                                 "--pod-location", "AP-JP-1"])
    assert code == 1
    assert doc["errors"] == {"probe": {}, "routed": {"HTTP 502": 2}, "stream": {}}
    assert doc["segments"]["e2e"]["n"] == 8 and doc["segments"]["state"]["n"] == 8
    assert doc["verdict"] == "2 of 10 routed requests failed (HTTP 502 ×2)"


def test_missing_server_timing_is_n_a_not_zero(probe, capsys):
    with fake_cell.serve(routed_timing="missing") as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "4",
                                                 "--pod-location", "AP-JP-1", "--budget", "state=25"])
    assert code == 1
    for name in ("state", "upstream", "fallback", "total"):
        assert doc["segments"][name] == {"p10": None, "p50": None, "p90": None, "p99": None, "n": 0}
    assert doc["segments"]["e2e"]["n"] == 4  # the client's clock does not need the header
    assert doc["server_timing"]["routed"] == {"ok": 0, "missing": 4, "malformed": 0}
    assert doc["violations"][0]["message"] == "state budget 25 ms (p50) could not be checked: no data"
    state_row = next(line for line in err.splitlines() if line.startswith("state "))
    assert state_row.split()[1:6] == ["n/a", "n/a", "n/a", "n/a", "0"]
    assert "4 routed responses had a missing or malformed Server-Timing (4 missing" in err


def test_malformed_server_timing_is_counted_and_good_entries_kept(probe, capsys):
    with fake_cell.serve(routed_timing="malformed", upstream=[80.0]) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "3",
                                                 "--pod-location", "AP-JP-1"])
    assert code == 0  # no budget on the broken entries: reported, not failed
    assert doc["server_timing"]["routed"] == {"ok": 0, "missing": 0, "malformed": 3}
    assert doc["segments"]["upstream"]["p50"] == 80.0
    assert doc["segments"]["state"]["n"] == 0
    assert any("3 malformed" in n and "state: dur='abc'" in n for n in doc["notes"])


def test_fallback_rate(probe, capsys):
    with fake_cell.serve(backend=["pod", "fallback", "pod", "pod"]) as cell:
        _, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "8"])
    assert doc["fallback_rate"] == 0.25 and doc["backends"] == {"pod": 6, "fallback": 2}
    assert "fallback rate 25% (2/8" in err


def test_no_model_advertised_needs_model_flag(probe, capsys):
    with fake_cell.serve(models=[]) as cell:
        assert probe.main([cell.url, "--token", TOKEN, "--samples", "1"]) == 2
        assert "pass --model NAME" in capsys.readouterr().err
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "1", "--model", "m1",
                                               "--pod-location", "AP-JP-1"])
        assert code == 0 and doc["model"] == "m1"
        routed = [s for s in cell.log if s.path == "/v1/chat/completions"]
        assert json.loads(routed[-1].body)["model"] == "m1"


@pytest.mark.parametrize("extra,needle", [
    (["--budget", "bogus=5"], "--budget 'bogus=5': unknown segment 'bogus'"),
    (["--budget", "state=0"], "--budget 'state=0'"),
    (["--expect-region", "mars"], "--expect-region: unknown region (got 'mars')"),
    (["--samples", "0"], "--samples 0: must be between 1"),
])
def test_usage_errors_exit_2_before_any_request(probe, capsys, extra, needle):
    with fake_cell.serve() as cell:
        code = probe.main([cell.url, "--token", TOKEN, *extra])
        assert cell.log == []
    assert code == 2 and needle in capsys.readouterr().err


def test_bad_url_exits_2(probe, capsys):
    assert probe.main(["ftp://x", "--token", TOKEN]) == 2
    assert "URL 'ftp://x': not an http(s) URL" in capsys.readouterr().err
    assert probe.main(["--token", TOKEN]) == 2
    assert "no Worker URL" in capsys.readouterr().err


def test_plot_writes_a_png(probe, capsys, tmp_path):
    import matplotlib.pyplot as plt

    png = tmp_path / "probe.png"
    with fake_cell.serve(state=[0.0, 0.0, 12.0], state_rtt_ms=[170.0, 171.0]) as cell:
        code = probe.main([cell.url, "--token", TOKEN, "--samples", "5", "--budget", "state_rtt=40",
                           "--plot", str(png)])
    assert "plot written to" in capsys.readouterr().err
    assert code == 1  # the state_rtt budget is broken: the plot shows it, the exit code says it
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600


# --- --stack: a fake `pulumi` first on PATH tests our parsing and error handling, not Pulumi ---

def fake_pulumi(bin_dir: Path, outputs: dict | None, exit_code: int = 0, stderr: str = "") -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    record = bin_dir / "calls.txt"
    script = bin_dir / "pulumi"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        with open({str(record)!r}, "a") as fh:
            fh.write(os.getcwd() + " " + " ".join(sys.argv[1:]) + "\\n")
        sys.stdout.write({json.dumps(json.dumps(outputs)) if outputs is not None else '""'})
        sys.stderr.write({stderr!r})
        sys.exit({exit_code})
        """))
    script.chmod(0o755)
    return record


def stack_file(stacks: Path, name: str = "t", extra: str = "") -> Path:
    stacks.mkdir(parents=True, exist_ok=True)
    path = stacks / f"Pulumi.{name}.yaml"
    path.write_text(textwrap.dedent("""\
        config:
          colocate:region: apac-jp
          colocate:budgets:
            state_rtt: 40
            e2e: 600
          colocate:probe:
            samples: 4
        """) + extra)
    return path


def test_stack_reads_url_token_and_pod_location_from_outputs(probe, capsys, monkeypatch, tmp_path):
    stack_file(tmp_path / "stacks")
    with fake_cell.serve(state_colo="KIX") as cell:
        calls = fake_pulumi(tmp_path / "bin", {"workerUrl": cell.url, "probeToken": TOKEN, "podLocation": "AP-JP-1"})
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        code, doc, err = run_json(probe, capsys, ["--stack", "t", "--stacks-dir", str(tmp_path / "stacks")])
        probes = sum(1 for s in cell.log if s.path == "/_colocate/probe")
    assert code == 0, err
    assert calls.read_text().strip() == f"{ROOT} stack output --json --show-secrets --stack t"
    assert probes == 1 + 4  # warm-up + the stack's colocate:probe.samples
    assert doc["url"] == cell.url and doc["placement"]["pod"] == "AP-JP-1"
    assert doc["placement"]["state"] == "KIX" and doc["placement"]["expected_region"] == "apac-jp"
    assert {b["segment"] for b in doc["budgets"]} == {"state_rtt", "e2e"}
    assert TOKEN not in json.dumps(doc) + err


def test_stack_with_everything_given_does_not_call_pulumi(probe, capsys, monkeypatch, tmp_path):
    stack_file(tmp_path / "stacks")
    calls = fake_pulumi(tmp_path / "bin", None, exit_code=3)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("COLOCATE_READ_TOKEN", TOKEN)
    with fake_cell.serve() as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--stack", "t", "--stacks-dir", str(tmp_path / "stacks"),
                                               "--pod-location", "AP-JP-1", "--pod-path", "zone-dns",
                                               "--budget", "e2e=900"])
    assert code == 0 and not calls.exists()
    assert doc["budgets"] == [{"segment": "e2e", "ms": 900.0, "percentile": "p50"}]  # flags replace the stack's


def test_stack_without_pulumi_cli_exits_2(probe, capsys, monkeypatch, tmp_path):
    stack_file(tmp_path / "stacks")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code = probe.main(["--stack", "t", "--stacks-dir", str(tmp_path / "stacks")])
    assert code == 2 and "the pulumi CLI is not on PATH" in capsys.readouterr().err


def test_stack_unknown_to_pulumi_exits_2_with_its_message(probe, capsys, monkeypatch, tmp_path):
    stack_file(tmp_path / "stacks")
    fake_pulumi(tmp_path / "bin", None, exit_code=255, stderr="error: no stack named 't' found\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    code = probe.main(["--stack", "t", "--stacks-dir", str(tmp_path / "stacks")])
    err = capsys.readouterr().err
    assert code == 2 and "failed (exit 255): error: no stack named 't' found" in err


def test_stack_printing_garbage_exits_2(probe, capsys, monkeypatch, tmp_path):
    stack_file(tmp_path / "stacks")
    fake_pulumi(tmp_path / "bin", ["not", "an", "object"])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert probe.main(["--stack", "t", "--stacks-dir", str(tmp_path / "stacks")]) == 2
    assert "did not print a JSON object" in capsys.readouterr().err


def test_missing_stack_file_exits_2(probe, capsys, tmp_path):
    (tmp_path / "stacks").mkdir()
    assert probe.main(["--stack", "nope", "--stacks-dir", str(tmp_path / "stacks")]) == 2
    assert "--stack 'nope': no stack file" in capsys.readouterr().err


def test_as_a_subprocess(tmp_path):
    with fake_cell.serve(state_colo="IAD") as cell:
        env = {**os.environ, "COLOCATE_READ_TOKEN": TOKEN}
        proc = subprocess.run([sys.executable, str(SCRIPT), cell.url, "--samples", "3", "--json", "-"],
                              capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["placement"]["state"] == "IAD" and "state left behind" in doc["verdict"]
    assert "FAIL: state object runs in IAD" in proc.stderr


def test_timeouts_mid_run_are_counted_not_fatal(probe, capsys):
    with fake_cell.serve(routed_delay_ms=2000) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2", "--timeout", "0.4",
                                               "--pod-location", "AP-JP-1"])
    assert code == 1
    assert doc["errors"]["routed"] == {"timeout": 2} and doc["segments"]["e2e"]["n"] == 0
    assert doc["segments"]["state_rtt"]["n"] == 2  # the probe requests still answered


def test_pod_failing_every_health_check_fails_the_run(probe, capsys):
    with fake_cell.serve(pod_ok=False) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                               "--pod-location", "AP-JP-1"])
    assert code == 1
    assert doc["violations"][0]["kind"] == "pod_health"
    assert "raise colocate:pod.renewal by one" in doc["violations"][0]["message"]
    assert doc["verdict"].startswith("pod health check failed in 2 of 2 probes (pod_status 503)")
    # an endpoint the team runs is mended on the box: nothing of the kit replaces it
    with fake_cell.serve(pod_ok=False) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2", "--pod-location", "NRT",
                                               "--pod-path", "endpoint"])
    message = next(v["message"] for v in doc["violations"] if v["kind"] == "pod_health")
    assert code == 1 and "an endpoint you run, which the kit never replaces" in message and "renewal" not in message


def test_fake_cell_leaves_nothing_listening():
    with fake_cell.serve() as cell:
        port = cell.port
    import socket

    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


def test_the_repo_stack_files_are_readable():
    from colocate.probe import outputs

    cfg = outputs.read_config("apac-jp")
    assert cfg.region == "apac-jp" and cfg.samples == 25 and cfg.worker_placement == "auto"
    assert cfg.budgets == {"state": 25, "state_rtt": 40, "upstream": 400, "e2e": 600}


def test_wait_retries_a_target_that_is_not_answering_yet(probe, capsys):
    # Right after a deploy a new route may 404 for a few seconds; the cell's step passes --wait.
    with fake_cell.serve(unready_probes=2) as cell:
        assert probe.main([cell.url, "--token", TOKEN, "--samples", "2", "--wait", "10"]) == 0
    with fake_cell.serve(unready_probes=2) as cell:
        assert probe.main([cell.url, "--token", TOKEN, "--samples", "2"]) == 2
    assert "answered HTTP 404" in capsys.readouterr().err


def test_wait_is_bounded_on_a_closed_port(probe, capsys):
    url = f"http://127.0.0.1:{fake_cell.closed_port()}"
    assert probe.main([url, "--token", TOKEN, "--samples", "2", "--wait", "1.5"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_settle_waits_for_a_new_placement_before_judging_it(probe, capsys, monkeypatch):
    # The placement was just set: the Worker still runs in IAD for a few probes, then in NRT.
    from colocate.probe import sample

    monkeypatch.setattr(sample, "SETTLE_INTERVAL_S", 0.01)
    with fake_cell.serve(worker_colo="IAD", placed_after=(4, "NRT")) as cell:
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                                  "--expect-region", "apac-jp", "--settle", "30"])
    assert code == 0 and doc["ok"] is True and doc["provisional"] is False, err
    s = doc["settling"]
    assert s["settled"] is True and s["colos"][0] == "IAD" and s["colos"][-3:] == ["NRT"] * 3
    assert doc["placement"]["ran"] == "NRT"


def test_a_placement_that_never_settles_is_provisional_not_a_failure(probe, capsys, monkeypatch):
    from colocate.probe import sample

    monkeypatch.setattr(sample, "SETTLE_INTERVAL_S", 0.01)
    with fake_cell.serve(worker_colo="IAD") as cell:  # never applied within the window
        code, doc, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                                  "--expect-region", "apac-jp", "--settle", "0.3"])
        assert code == 0 and doc["ok"] is False and doc["provisional"] is True
        assert doc["settling"]["settled"] is False and set(doc["settling"]["colos"]) == {"IAD"}
        assert "verdict is provisional" in err and "PROVISIONAL: Worker runs in IAD" in err
        # Without --settle (a later check by hand) the same placement fails.
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                                "--expect-region", "apac-jp"])
        assert code == 1 and doc["provisional"] is False and doc["settling"] is None
    # A budget broken while placement settled is no placement question: it still fails.
    with fake_cell.serve(state=[30.0]) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2", "--expect-region",
                                                "apac-jp", "--budget", "state=5", "--settle", "5"])
    assert code == 1 and doc["settling"]["settled"] is True and doc["provisional"] is False


def test_cf_placement_is_read_from_the_response_headers(probe, capsys):
    # The Worker's trace and body say nothing; Cloudflare's response header says where it ran.
    with fake_cell.serve(worker_colo=None, cf_placement=None, cf_placement_header="remote-NRT") as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "2",
                                                "--expect-region", "apac-jp"])
    assert code == 0, doc["verdict"]
    assert doc["placement"]["ran"] == "NRT" and doc["placement"]["ran_source"] == "cf-placement"
    assert doc["placement"]["cf_placement"] == "remote-NRT"


def test_streamed_answers_failing_are_a_violation_and_streams_can_be_turned_off(probe, capsys, monkeypatch):
    monkeypatch.setenv("COLOCATE_CLIENT_KEY", "clc_given")
    with fake_cell.serve(stream_status=503) as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "4", "--streams", "2"])
    assert code == 1 and doc["errors"]["stream"] == {"HTTP 503": 2}
    assert "2 of 2 stream requests failed (HTTP 503 ×2)" in [v["message"] for v in doc["violations"]]
    assert doc["segments"]["ttft"]["n"] == 0 and doc["segments"]["ttft"]["p50"] is None
    with fake_cell.serve() as cell:
        code, doc, _ = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "4", "--streams", "0"])
        streamed = [s for s in cell.log if b'"stream": true' in s.body]
    assert code == 0 and streamed == [] and doc["segments"]["itl"]["n"] == 0
    with fake_cell.serve() as cell:
        code, _, err = run_json(probe, capsys, [cell.url, "--token", TOKEN, "--samples", "4", "--streams", "5"])
    assert code == 2 and "--streams" in err
