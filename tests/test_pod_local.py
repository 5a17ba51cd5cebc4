"""The local provider: the stand-in as a detached process, found, adopted, swept and killed."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import requests

from colocate.pods import local
from tests.test_pod_providers import TOKEN, make_spec, run, sweep_argv, write_spec


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("POD_TOKEN", TOKEN)
    monkeypatch.setenv("COLOCATE_POD_POLL_S", "0.05")
    monkeypatch.setenv("COLOCATE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("PULUMI_COMMAND_STDOUT", raising=False)
    yield tmp_path
    # nothing may outlive a test: kill whatever a failing test left
    for info in local.Local().list_pods():
        local.Local().destroy(info.id)


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_local_create_serves_with_the_token_then_delete_twice(env, capsys, monkeypatch):
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "local"))])
    assert code == 0, err
    assert out["provider"] == "local" and out["id"] == "local-colocate-t1-us-east-g1" and out["cost_per_hr"] == 0.0
    record = json.loads((env / "state" / "pods" / "colocate-t1-us-east-g1.json").read_text())
    assert record["port"] == out["port"] and local.alive(record["pid"])
    assert requests.get(out["url"] + "/v1/models", timeout=5).status_code == 401
    r = requests.post(out["url"] + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 200
    monkeypatch.setenv("PULUMI_COMMAND_STDOUT", json.dumps(out))
    code, res, _ = run(capsys, ["delete"])
    assert code == 0 and res["already_gone"] is False
    assert not local.alive(record["pid"]) and port_closed(out["port"])
    code, res, _ = run(capsys, ["delete"])
    assert code == 0 and res["already_gone"] is True


def test_local_adopts_a_running_pod(env, capsys):
    spec_file = write_spec(env, make_spec("us-east", "local"))
    _, first, _ = run(capsys, ["create", "--spec", spec_file])
    code, second, err = run(capsys, ["create", "--spec", spec_file])
    assert code == 0 and second["port"] == first["port"] and second.get("adopted") and "adopting" in err
    assert len(local.Local().list_pods()) == 1


def test_local_stray_is_found_and_destroyed_by_sweep(env, capsys):
    spec_file = write_spec(env, make_spec("us-east", "local", gen=1))
    _, old, _ = run(capsys, ["create", "--spec", spec_file])
    _, current, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "local", gen=2))])
    code, out, _ = run(capsys, sweep_argv(env, "--provider", "local", "--keep", current["id"], provider="local"))
    assert code == 0 and [s["id"] for s in out["strays"]] == [old["id"]]
    code, out, _ = run(capsys, sweep_argv(env, "--provider", "local", "--keep", current["id"], "--destroy", provider="local"))
    assert out["destroyed"] == [old["id"]] and port_closed(old["port"])
    assert [p.id for p in local.Local().list_pods()] == [current["id"]]


def test_local_readiness_timeout_kills_the_process(env, capsys, monkeypatch):
    # A stand-in whose /health never answers 200 (compute irrelevant): point readiness at a dead port.
    original = local.Local._info

    def unhealthy(self, rec):
        info = original(self, rec)
        info.port = 9  # discard port: nothing listens, health fails
        return info

    monkeypatch.setattr(local.Local, "_info", unhealthy)
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "local", readyTimeoutS=1))])
    assert code == 1 and out is None and "destroyed" in err
    monkeypatch.setattr(local.Local, "_info", original)
    assert local.Local().list_pods() == []
    assert not any(p.name.endswith(".port.json") for p in (env / "state" / "pods").iterdir())


def test_dead_pid_shows_as_dead_and_delete_cleans_up(env, capsys):
    _, out, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "local"))])
    record = json.loads((env / "state" / "pods" / "colocate-t1-us-east-g1.json").read_text())
    os.killpg(record["pid"], 9)
    deadline = time.monotonic() + 10
    while local.alive(record["pid"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    code, st, _ = run(capsys, ["status", "--id", out["id"]])
    assert code == 0 and st["state"] == "dead"
    code, res, _ = run(capsys, ["delete", "--id", out["id"]])
    assert code == 0 and local.Local().list_pods() == []


def test_a_local_pod_runs_the_profile_its_spec_names(env, capsys):
    spec = make_spec("us-east", "local", profile="rtx4090-qwen2.5-7b-int4")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 0, err
    url = f"http://127.0.0.1:{out['port']}"
    r = requests.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "min_tokens": 20})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    metrics = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).text
    ttft_count = next(line for line in metrics.splitlines() if line.startswith("vllm:time_to_first_token_seconds_count"))
    assert ttft_count.endswith(" 1.0")  # the engine served it (the oracle counts nothing)


def test_the_sandboxs_host_preempts_an_interruptible_stand_in_at_once_never_an_on_demand_one(env, capsys):
    spec = make_spec("us-east", "local")
    spec["market"] = "interruptible"
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 0 and out["market"] == "interruptible", err
    provider = local.Local()
    pid = json.loads((env / "state" / "pods" / f"{out['name']}.json").read_text())["pid"]
    assert provider.preempt(out["id"]) is True
    info = provider.describe(out["id"])  # what the keeper reads: dead, preempted, interruptible
    assert (info.state, info.raw_state, info.market) == ("dead", local.PREEMPTED, "interruptible")
    deadline = time.monotonic() + 10
    # A killed process's leader is a zombie (not alive) a moment before its last thread lets the socket go.
    while (local.alive(pid) or not port_closed(out["port"])) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not local.alive(pid) and port_closed(out["port"])  # killed, not asked to stop
    assert provider.preempt(out["id"]) is False  # once
    assert provider.destroy(out["id"]) is True  # the keeper's update deletes the record
    od = make_spec("us-east", "local", stack="t2")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, od)])
    assert code == 0 and out["market"] == "ondemand" and provider.preempt(out["id"]) is False
    assert provider.describe(out["id"]).state == "running"
