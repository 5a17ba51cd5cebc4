"""bench/peers.py (make bench-peers): colocate against Portkey's gateway and LiteLLM's proxy. A
real run of colocate alone (wrk, the bench pod, the router's workerd), each peer when it is
installed under bench/.peers, a peer that cannot be installed or started named and left out,
the summary arithmetic, and usage errors. Nothing here asserts a speed."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness, peers

pytestmark = pytest.mark.slow
needs_wrk = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (make bench installs it)")


def _round(direct, colocate, portkey=None):
    """A round of per-target wrk results: (p50 ms, rps, cpu µs) each."""
    def res(p50, rps, cpu):
        return {"n": 100, "errors": 0, "p50_ms": p50, "rps": rps, "cpu_us_per_req": cpu}

    out = {"direct": res(*direct), "colocate": res(*colocate)}
    if portkey:
        out["portkey"] = res(*portkey)
    return out


def test_summary_takes_medians_of_per_round_differences_and_ratios():
    levels = {1: [_round((0.1, 9000, None), (0.5, 900, 600), (1.1, 300, 1200)),
                  _round((0.2, 9000, None), (0.4, 900, 500), (1.2, 300, 2000)),
                  _round((0.1, 9000, None), (0.9, 900, 700), (2.1, 300, 1400))],
              32: [_round((1.0, 20000, None), (9, 3000, 250), (90, 300, 1000))] * 3}
    s = peers.summarise(levels, ("direct", "colocate", "portkey"))
    assert s["colocate"]["added_p50_ms_1"] == 0.4  # the median of 0.4, 0.2, 0.8
    assert s["portkey"]["added_p50_ms_1"] == 1.0
    assert s["colocate"]["cpu_us_32"] == 250 and s["colocate"]["rps_32"] == 3000
    vs = s["colocate_vs_portkey"]
    assert vs["added_p50_1"] == pytest.approx(0.4)  # per round: 0.4/1.0, 0.2/1.0, 0.8/2.0
    assert vs["cpu_32"] == 0.25 and vs["cpu_1"] == 0.5  # per round: 0.5, 0.25, 0.5


def test_table_names_a_peer_left_out_and_judges_the_acceptance():
    levels = {1: [_round((0.1, 9000, None), (0.5, 900, 600), (1.1, 300, 1200))],
              32: [_round((1.0, 20000, None), (9, 3000, 250), (90, 300, 1100))]}
    result = {"machine": {"workerd": "w", "node": "v", "cpus": 2, "loadavg_at_start": (1.0, 1.0, 1.0)},
              "options": {"rounds": 1, "seconds": 1, "clients": [1, 32]}, "versions": {"portkey": "p", "litellm": "l"},
              "skipped": {"litellm": "pip install litellm[proxy] failed (1): no network"},
              "summary": peers.summarise(levels, ("direct", "colocate", "portkey"))}
    text = peers.table(result)
    assert "| colocate | +0.40 ms | 600 / 250 µs | 3,000 req/s |" in text
    assert "| Portkey's gateway | +1.00 ms | 1,200 / 1,100 µs | 300 req/s |" in text
    assert "LiteLLM's proxy |" not in text
    assert "litellm: NOT MEASURED: pip install litellm[proxy] failed (1): no network" in text
    assert "added p50 x0.40 (goal <= 0.5: met)" in text and "x0.23 (goal <= 0.25: met)" in text


def test_a_peer_that_cannot_be_installed_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path / ".peers")
    monkeypatch.setattr(peers.shutil, "which", lambda _name: None)
    with pytest.raises(peers.PeerUnavailable, match="npm is not installed"):
        peers.portkey_entry()
    # a venv whose pip cannot install: the reason is pip's own last lines. pip is refused the
    # index (PIP_NO_INDEX, which it honours as --no-index) so that it fails at once, not after
    # asking the network for a version that does not exist. The venv is made here without its
    # own pip (ensurepip's install costs 9 CPU-s) and given the kit's: litellm_bin takes a venv
    # that has a pip as made, and the pip that fails is real.
    venv = tmp_path / ".peers" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    (venv / "bin" / "pip").symlink_to(Path(sys.executable).parent / "pip")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setattr(peers, "LITELLM_VERSION", "0.0.0-no-such-version")
    monkeypatch.setattr(peers.sys, "executable", sys.executable)
    with pytest.raises(peers.PeerUnavailable, match=r"pip install litellm\[proxy\] failed"):
        peers.litellm_bin()


def test_a_peer_that_does_not_serve_is_named_with_its_output():
    args = [sys.executable, "-c", "import sys; print('listening on nothing'); sys.exit(3)"]
    said = r"did not serve a chat request \(exited 3\): listening on nothing"
    with pytest.raises(peers.PeerUnavailable, match=said), \
            peers.peer_process("fake", args, {}, peers.free_port(), {"content-type": "application/json"}, start_s=20):
        pass


@needs_wrk
def test_colocate_alone_is_measured_against_the_pod(tmp_path, capsys):
    out = tmp_path / "peers.json"
    # The pod answers 5 ms late: a few hundred requests a second instead of thousands, each through
    # the router whole; nothing here reads a speed.
    assert peers.main(["--rounds", "1", "--seconds", "1", "--clients", "1,4", "--peers", "none", "--pod-delay-ms", "5",
                       "--quiet", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["skipped"] == {}
    s = result["summary"]
    assert set(s) == {"direct", "colocate"}
    assert s["colocate"]["cpu_us_4"] > 0 and s["colocate"]["rps_4"] > 0 and s["colocate"]["errors_4"] == 0
    assert s["direct"]["cpu_us_1"] is None  # CPU is the router's process, not the pod's
    assert "| colocate |" in capsys.readouterr().out


@needs_wrk
@pytest.mark.parametrize("peer", peers.PEERS)
def test_an_installed_peer_passes_every_request_to_the_pod(peer, tmp_path):
    installed = {"portkey": peers.PEERS_DIR / "node_modules" / "@portkey-ai" / "gateway" / "package.json",
                 "litellm": peers.PEERS_DIR / "venv" / f".litellm-{peers.LITELLM_VERSION}"}[peer]
    if not installed.exists():
        pytest.skip(f"{peer} is not installed under bench/.peers (make bench-peers installs it)")
    out = tmp_path / "peers.json"
    assert peers.main(["--rounds", "1", "--seconds", "1", "--clients", "1", "--peers", peer, "--quiet",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["skipped"] == {}
    row = result["summary"][peer]
    assert row["errors_1"] == 0 and row["rps_1"] > 0 and row["cpu_us_1"] > 0


@pytest.mark.parametrize(("argv", "said"), [(["--peers", "kong"], "--peers: unknown kong"),
                                            (["--clients", "0"], "use whole numbers 1..256"),
                                            (["--rounds", "0"], "--rounds must be at least 1 (got 0)")])
def test_usage_errors_name_the_flag(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        peers.main(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_cpu_counts_a_process_and_its_children():
    import os
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'x = 0\\nwhile True: x += 1']); time.sleep(30)"])
    try:
        # The grandchild spins: its CPU time shows in the tree's count and never in the parent's own,
        # however long a busy machine takes to give it 0.2 s (bounded by the child's 30 s).
        deadline = time.monotonic() + 25
        while peers.tree_cpu_seconds(child.pid) <= harness.cpu_seconds(child.pid) + 0.2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert peers.tree_cpu_seconds(child.pid) > harness.cpu_seconds(child.pid) + 0.2
        assert harness.cpu_seconds(child.pid) < 0.2  # the parent itself only sleeps
    finally:
        with open(f"/proc/{child.pid}/task/{child.pid}/children") as fh:
            for pid in fh.read().split():
                os.kill(int(pid), 9)
        child.kill()
        child.wait()
