"""The sandbox with real processes on loopback: workerd, the local pod, the emulated network."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from colocate import stackfile
from colocate.sandbox import demokey, statedir, supervisor
from colocate.sandbox.errors import AlreadyRunning, OtherStack
from colocate.sandbox.geography import Geography
from tests.support.sandbox import MODEL as POD_MODEL, sandbox_stacks

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
MODEL = Geography()


@pytest.fixture
def stacks(tmp_path):
    """A copy of the sandbox stack with a short compute time, edited by each test."""
    return sandbox_stacks(tmp_path / "stacks", compute_ms=5)


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    yield d
    supervisor.down(d, quiet=True)  # whatever a failed test left running


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    """One running cell (clients in NRT) for the tests that only read from it: routed requests, the
    probe, the openai client, `status` listing it. Its state directory is `mine` under a directory of
    its own, so a test can point statedir.SANDBOXES_DIR there and find exactly this one."""
    root = tmp_path_factory.mktemp("sandboxes")
    stacks = sandbox_stacks(root.parent / f"{root.name}-stacks", compute_ms=5)
    state_dir = root / "mine"
    try:
        yield supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks, client_site="NRT")
    finally:
        supervisor.down(state_dir, quiet=True)


@pytest.fixture(scope="module")
def split_cell(tmp_path_factory):
    """One split cell for the tests that measure it: compute moved to Taipei (clients there too)
    while the ledger still names us-east.g1, whose object was first touched from IAD in an earlier
    life of the state directory (its pin; test_pin_survives_restart_and_down_leaves_nothing makes
    that pin by a first touch and a restart)."""
    root = tmp_path_factory.mktemp("split")
    stacks = sandbox_stacks(root / "stacks", compute_ms=5)
    _split(stacks)
    state_dir = root / "state"
    state_dir.mkdir()
    (state_dir / "pins.json").write_text(json.dumps({"us-east.g1": {"site": "IAD", "edge": "IAD", "hint": "enam"}}))
    try:
        yield supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks, force_split=True, client_site="TPE")
    finally:
        supervisor.down(state_dir, quiet=True)


def _get(url, token=None, timeout=30):
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, dict(r.headers), json.loads(r.read())


def _probe_bodies(cell, n):
    return [_get(cell["worker_url"] + "/_colocate/probe", cell["token"])[2] for _ in range(n)]


def _port_closed(port):
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _split(stacks):
    # compute moved to Taipei by hand; the ledger still names the us-east generation
    stackfile.write_config("sandbox", {"region": "apac-tw"}, stacks)


def test_routed_request_probe_and_headers(cell):
    state_dir = Path(cell["state_dir"])
    assert cell["sites"] == {**cell["sites"], "client": "NRT", "edge": "IAD", "pod": "IAD", "placement": "remote-IAD"}
    body = json.dumps({"model": POD_MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(cell["worker_url"] + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "authorization": f"Bearer {cell['key']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        assert r.headers["x-colocate-backend"] == "pod-0"
        assert r.headers["cf-ray"].endswith("-NRT")
        assert r.headers["cf-placement"] == "remote-IAD"
        assert "upstream;dur=" in r.headers["server-timing"]
        assert json.loads(r.read())["choices"]
    status, headers, probe = _get(cell["worker_url"] + "/_colocate/probe", cell["token"])
    assert status == 200
    assert (probe["worker_colo"], probe["ray_colo"], probe["cf_placement"]) == ("IAD", "NRT", "remote-IAD")
    assert probe["state_colo"] == "IAD" and probe["generation"] == "us-east.g1"
    assert json.loads((state_dir / "pins.json").read_text())["us-east.g1"]["site"] == "IAD"
    assert (state_dir / "secrets.json").stat().st_mode & 0o777 == 0o600
    assert (state_dir / "workerd.capnp").stat().st_mode & 0o777 == 0o600
    for name in ("workerd", "fallback", "runner", "pod"):
        assert (state_dir / "logs" / f"{name}.log").exists()
    # the config carries the product modules (rendered by colocate.workerd) and the sandbox entry
    text = (state_dir / "workerd.capnp").read_text()
    from colocate.cell.plan import worker_modules
    assert all(m.content().splitlines()[0] in text for m in worker_modules()) and "__sandbox_entry.js" in text


def test_emulated_round_trips_match_the_model(split_cell):
    """Worker in TPE, object first touched from IAD: state_rtt ~ rtt(TPE, IAD); pod next door ~ same-site."""
    bodies = _probe_bodies(split_cell, 5)
    assert {b["state_colo"] for b in bodies} == {"IAD"}
    assert {b["worker_colo"] for b in bodies} == {"TPE"}
    state_model = MODEL.rtt_ms("TPE", "IAD")
    state_p50 = statistics.median(b["state_rtt_ms"] for b in bodies)
    pod_p50 = statistics.median(b["pod_rtt_ms"] for b in bodies)
    # the emulated delay is a floor; loopback, workerd and the RPC add a few ms on top (more on a
    # loaded machine): the state hop pays it once, not twice, and the pod stays next door
    assert state_model - 1 <= state_p50 < 2 * state_model, (state_p50, state_model)
    assert MODEL.rtt_ms("TPE", "TPE") - 1 <= pod_p50 < state_model / 2, pod_p50


def _hop_connections(cell):
    """How many connections each pod hop has accepted so far: the pod's TLS handshakes, by hop port."""
    return _get(f"http://127.0.0.1:{cell['ports']['outbound']}/_sandbox/pod-hop/connections")[2]["connections"]


def test_probe_cli_reports_state_left_behind_and_the_pod_hop_on_new_connections(split_cell, tmp_path):
    cell, state_dir = split_cell, split_cell["state_dir"]
    (port,) = _hop_connections(cell)  # one pod, one hop
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLOCATE_")}

    def probe(*how, **credentials):
        before = _hop_connections(cell)[port]
        out = tmp_path / "probe.json"
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), *how, "--samples", "4",
                               "--json", str(out)], env={**env, **credentials}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1, proc.stderr  # a placement failure
        return json.loads(out.read_text()), _hop_connections(cell)[port] - before, proc.stdout

    result, opened, _ = probe(cell["worker_url"], "--pod-location", "local", "--expect-region", "apac-tw",
                              COLOCATE_READ_TOKEN=cell["read_token"], COLOCATE_CLIENT_KEY=cell["key"])
    assert result["placement"]["state"] == "IAD" and result["placement"]["ran"] == "TPE"
    assert result["segments"]["state_rtt"]["p50"] >= MODEL.rtt_ms("TPE", "IAD") - 1
    # by URL alone nothing can close the Worker's pod connections or count them: no number is called new;
    # every probe and routed request rode the pooled connection (at most the first opened it, and
    # the router's background /metrics scrape, which can run beside a request in flight, a second)
    assert opened <= 2 and result["segments"]["pod_rtt"]["n"] == 4, (opened, result["values_ms"]["pod_rtt"])
    assert result["segments"]["pod_rtt_new"]["n"] == 0 and result["new_connections"]["measured"] is False
    assert "Cloudflare reuses a connection" in result["new_connections"]["why"]
    # the sandbox: before each of 4 more probes it closes the hop's connections; each new one is a handshake
    # the pod saw through its hop
    doc, opened, table = probe("--state-dir", str(state_dir))
    assert doc["placement"]["state"] == "IAD" and doc["placement"]["ran"] == "TPE"
    new, warm = doc["values_ms"]["pod_rtt_new"], doc["values_ms"]["pod_rtt"]
    assert doc["new_connections"]["measured"] is True and doc["new_connections"]["probes"] == 4
    assert 1 <= len(new) == doc["new_connections"]["shown_new"] <= opened, (doc["new_connections"], opened)
    assert len(warm) == 4 and doc["pods"][0]["pod_rtt_new"]["n"] == len(new)
    # TCP's round trip, TLS 1.3's, then the request's: a new connection cannot be faster than three
    hop = MODEL.rtt_ms("TPE", "TPE")
    assert min(new) >= 3 * hop - 1 and min(warm) >= hop - 1, (new, warm)
    pod_line = next(line for line in table.splitlines() if line.strip().startswith("pod 0"))
    assert f"new p50 {doc['pods'][0]['pod_rtt_new']['p50']:.1f} ms" in pod_line


def test_pin_survives_restart_and_down_leaves_nothing(stacks, state_dir):
    cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    _probe_bodies(cell, 1)
    with pytest.raises(AlreadyRunning, match=r"already running .*pids .*sandbox.py down"):
        supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    assert _get(cell["worker_url"] + "/_colocate/probe", cell["token"])[0] == 200  # not clobbered
    pids, ports = cell["pids"], cell["ports"]
    result = supervisor.down(state_dir)
    assert result["running"] is False
    for name, pid in pids.items():
        assert pid and not supervisor.alive(pid), name
    for name, port in ports.items():
        assert _port_closed(port), name
    assert _port_closed(int(cell["pod_url"].rsplit(":", 1)[1]))
    assert not (state_dir / "pods").exists() or not list((state_dir / "pods").glob("*.json"))

    _split(stacks)
    cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks, force_split=True)
    probe = _probe_bodies(cell, 1)[0]
    assert (probe["worker_colo"], probe["state_colo"]) == ("TPE", "IAD")  # the object did not move


def test_cli_up_second_up_and_down(stacks, state_dir):
    base = [sys.executable, str(ROOT / "scripts" / "sandbox.py")]
    where = ["--stack", "sandbox", "--state-dir", str(state_dir)]
    up = subprocess.run(base + ["up", *where, "--stacks-dir", str(stacks)], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    cell = json.loads(up.stdout)  # stdout is the JSON alone
    assert {"worker_url", "pod_url", "token", "key", "state_dir", "sites", "pids"} <= set(cell)
    # one human line on stderr: where it serves, the key and how to use it, the next step
    summary = up.stderr.strip().splitlines()[-1]
    assert summary.startswith("sandbox.py up: stack sandbox") and cell["worker_url"] in summary
    assert f'OpenAI(base_url="{cell["worker_url"]}/v1", api_key="{cell["key"]}")' in summary
    assert f"Next: `{supervisor.SANDBOX_CMD} status --stack sandbox --state-dir {state_dir}`" in summary
    # A second identical up succeeds with a one-line note and the running cell's JSON; another one is refused.
    again = subprocess.run(base + ["up", *where, "--stacks-dir", str(stacks)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and json.loads(again.stdout)["worker_url"] == cell["worker_url"], again.stderr
    assert again.stderr.count("\n") == 1 and "already runs in" in again.stderr and "nothing started" in again.stderr
    other = subprocess.run(base + ["up", *where, "--stacks-dir", str(stacks), "--client-site", "NRT"],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "already running" in other.stderr and other.stdout == ""
    status = subprocess.run(base + ["status", *where], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout
    assert json.loads(status.stdout)["healthy"] is True
    assert f"runs at {cell['worker_url']}, healthy. Next: `{supervisor.SANDBOX_CMD} down" in status.stderr
    down = subprocess.run(base + ["down", *where], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0
    assert json.loads(down.stdout)["was_running"] is True and "stopped the sandbox" in down.stderr
    assert not any(supervisor.alive(p) for p in cell["pids"].values())
    # Stopping what is stopped succeeds: a second down (a script's trap) is not an error.
    twice = subprocess.run(base + ["down", *where], capture_output=True, text=True, timeout=60)
    assert twice.returncode == 0 and json.loads(twice.stdout)["was_running"] is False
    assert twice.stderr.strip() == f"sandbox.py down: nothing runs in {state_dir} (already stopped)"


def test_bad_stack_fails_before_anything_starts(stacks, state_dir, capsys):
    from scripts import sandbox as cli

    _split(stacks)  # without --force-split the plan refuses
    code = cli.main(["up", "--stack", "sandbox", "--state-dir", str(state_dir), "--stacks-dir", str(stacks)])
    assert code == 2
    err = capsys.readouterr().err
    assert "colocate:region" in err and "migrate.py start" in err
    assert not (state_dir / "run.json").exists()
    assert cli.main(["up", "--stack", "sandbox", "--state-dir", str(state_dir), "--stacks-dir", str(stacks),
                     "--rtt", "TPE-IAD"]) == 2
    assert "--rtt" in capsys.readouterr().err


def test_ctrl_c_during_up_leaves_nothing(stacks, state_dir):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "up", "--stack", "sandbox",
                             "--state-dir", str(state_dir), "--stacks-dir", str(stacks)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (state_dir / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    run = json.loads((state_dir / "run.json").read_text())
    time.sleep(0.3)  # somewhere inside the start: pod, fallback or workerd
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), err  # 0 only if it was already up when the signal landed
    if proc.returncode == 0:
        supervisor.down(state_dir, quiet=True)
    assert not supervisor.alive(run["pid"])
    assert not supervisor.is_running(state_dir)
    assert not (state_dir / "pod.json").exists()
    assert not list((state_dir / "pods").glob("*.json")) if (state_dir / "pods").exists() else True


def test_apply_without_a_running_sandbox_says_so(tmp_path, stacks, capsys):
    from colocate.sandbox.errors import NotRunning

    with pytest.raises(NotRunning, match="sandbox.py up"):
        supervisor.apply("sandbox", state_dir=tmp_path / "nothing", stacks_dir=stacks)
    code = subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "apply", "--state-dir",
                           str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60)
    assert code.returncode == 2 and "no sandbox runs" in code.stderr


def test_demo_key_is_created_kept_0600_reused_and_replaced_when_revoked(stacks, state_dir):
    from colocate.admin import AdminClient, Target

    cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    key = cell["key"]
    assert key.startswith("clc_") and cell["key_id"]
    path = state_dir / statedir.DEMO_KEY_FILE
    assert path.stat().st_mode & 0o777 == 0o600 and json.loads(path.read_text())["key"] == key
    models = urllib.request.Request(cell["worker_url"] + "/v1/models", headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(models, timeout=30) as r:
        assert r.status == 200
    supervisor.down(state_dir, quiet=True)

    again = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    assert again["key"] == key  # still accepted by the cell: reused, not piled up
    admin = AdminClient(Target(again["worker_url"], again["token"], "sandbox"))
    assert [k["name"] for k in admin.list_keys()] == [demokey.DEMO_KEY_NAME]
    admin.revoke_key(again["key_id"])
    supervisor.down(state_dir, quiet=True)

    third = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    assert third["key"] != key and third["key"].startswith("clc_")
    models = urllib.request.Request(third["worker_url"] + "/v1/models", headers={"authorization": f"Bearer {third['key']}"})
    with urllib.request.urlopen(models, timeout=30) as r:
        assert r.status == 200


def test_openai_client_uses_the_printed_key(cell, openai_client):
    client = openai_client(cell["worker_url"] + "/v1", cell["key"], timeout=60)
    reply = client.chat.completions.create(model=POD_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content


def _cli(argv, capsys):
    from scripts import sandbox as cli

    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_down_and_status_tell_a_typo_and_an_empty_state_dir_from_a_sandbox(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(statedir, "SANDBOXES_DIR", tmp_path / "sandboxes")
    for cmd in ("down", "status"):
        code, out, err = _cli([cmd, "--stack", "sandbx"], capsys)
        assert code == 2 and out == "", err
        assert "--stack 'sandbx': unknown stack" in err and "sandbox" in err
    empty = tmp_path / "empty"
    code, out, err = _cli(["down", "--state-dir", str(empty)], capsys)  # nothing to stop, nothing runs elsewhere
    assert code == 0 and json.loads(out)["was_running"] is False
    assert f"nothing runs in {empty} (already stopped); no sandbox runs" in err
    code, out, err = _cli(["status", "--state-dir", str(empty)], capsys)
    assert code == 1 and json.loads(out)["running"] is False and f"nothing runs in {empty}" in err
    assert f"up --stack sandbox --state-dir {empty}" in err  # how to start it there, not somewhere else
    code, out, err = _cli(["status"], capsys)
    assert code == 0 and json.loads(out) == {"sandboxes": []} and "no sandbox runs" in err


def test_status_without_a_stack_lists_the_sandboxes_that_run(cell, capsys, monkeypatch):
    running = Path(cell["state_dir"])  # .../sandboxes<n>/mine: the only sandbox under its parent
    monkeypatch.setattr(statedir, "SANDBOXES_DIR", running.parent)
    code, out, err = _cli(["status"], capsys)
    assert code == 0, err
    listed = json.loads(out)["sandboxes"]
    assert [(s["state_dir"], s["worker_url"], s["healthy"]) for s in listed] == [(str(running), cell["worker_url"], True)]
    assert "mine: " + cell["worker_url"] in err
    # `down` of another (valid) stack stops nothing, says so, and names the one that runs
    code, out, err = _cli(["down", "--stack", "sandbox"], capsys)
    assert code == 1 and json.loads(out)["was_running"] is False
    assert "no sandbox was ever started in" in err and "nothing stopped" in err
    assert f"{running} (`{supervisor.SANDBOX_CMD} down --stack sandbox --state-dir {running}`)" in err, err
    assert supervisor.status(running)["healthy"] is True


def test_an_unhealthy_cell_names_its_own_stack_and_up_refuses_another_stacks_state_dir(stacks, state_dir, capsys):
    import shutil
    import signal
    import time

    cmd = supervisor.SANDBOX_CMD
    shutil.copyfile(stackfile.path_of("sandbox", stacks), stackfile.path_of("other", stacks))
    cell = supervisor.up("other", state_dir=state_dir, stacks_dir=stacks)
    pod = cell["pids"]["pod"]
    os.kill(pod, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while supervisor.alive(pod) and time.monotonic() < deadline:
        time.sleep(0.05)
    code, out, err = _cli(["status", "--state-dir", str(state_dir)], capsys)  # no --stack: not the default's
    assert code == 1 and json.loads(out)["healthy"] is False
    where = f"--stack other --state-dir {state_dir}"
    assert f"Next: `{cmd} down {where}`, then `{cmd} up {where}`" in err, err
    assert f"pod (pid {pod}) is not running" in err and "/health" not in err and "pod, pod" not in err, err
    # `up` of another stack in that state directory: refused before anything starts, naming the fix.
    run_before = (state_dir / "run.json").read_text()
    code, out, err = _cli(["up", "--stack", "sandbox", "--state-dir", str(state_dir), "--stacks-dir", str(stacks)], capsys)
    assert code == 2 and out == ""
    assert f"{state_dir} is the state directory of stack 'other'" in err
    assert f"`{cmd} up --stack other --state-dir {state_dir}`" in err and "nothing was started" in err
    assert (state_dir / "run.json").read_text() == run_before  # the running cell was not touched
    with pytest.raises(OtherStack):
        supervisor.apply("sandbox", state_dir=state_dir, stacks_dir=stacks)
    supervisor.down(state_dir, quiet=True)
    with pytest.raises(OtherStack):  # the directory stays the other stack's after down (pins, objects)
        supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
    assert not (state_dir / "run.json").exists() and not supervisor.is_running(state_dir)
