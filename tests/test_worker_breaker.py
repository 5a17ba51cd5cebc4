"""The breaker in real workerd: fallback on failure and deadline, open, half-open, close,
state shared through the Durable Object, operator override, generation read-through."""

import time

import pytest

from tests.support.workerd import FALLBACK_MODEL_NAME, auth, cell_plan, chat, running_cell

pytestmark = pytest.mark.slow
THRESHOLD = 3


def runtime(**over):
    # Runtime numbers only; every binding still comes from the sandbox plan.
    return {"deadlineMs": 300, "stateTtlMs": 0, "openMs": 60_000, "failureThreshold": THRESHOLD, **over}


def test_pod_down_every_request_succeeds_via_fallback_and_breaker_opens():
    with running_cell(runtime()) as cell:
        # A port that refuses connections: start a stand-in, note its URL, stop it.
        cell.pod.set_fault("error")
        before = cell.fallback.requests
        results = [cell.call("POST", "/v1/chat/completions", body=chat()) for _ in range(THRESHOLD + 3)]
        assert [r.status for r in results] == [200] * len(results)
        assert {r.headers["x-colocate-backend"] for r in results} == {"fallback"}
        assert cell.fallback.requests == before + len(results)
        snap = cell.wait_breaker("open")
        assert snap["state"] == "open" and snap["failures"] >= THRESHOLD
        # Open: the pod is not tried at all.
        pod_before = cell.pod.requests
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
        assert res.timing()["upstream"] == 0 and cell.pod.requests == pod_before


def test_pod_errors_open_the_breaker_too():
    with running_cell(runtime()) as cell:
        cell.pod.set_fault("error")
        before = cell.pod.requests
        results = [cell.call("GET", "/v1/models") for _ in range(THRESHOLD)]
        assert [r.headers["x-colocate-backend"] for r in results] == ["fallback"] * THRESHOLD
        assert cell.pod.requests == before + THRESHOLD  # each one tried the pod first
        assert cell.wait_breaker("open")["state"] == "open"


@pytest.mark.parametrize("fallback_model", ["passthrough", FALLBACK_MODEL_NAME])
def test_fallback_gets_its_key_and_model(fallback_model):
    extra = {"fallbackModels": ["client/model"]} if fallback_model == "passthrough" else {}  # passthrough names its models
    with running_cell(runtime(), fallbackModel=fallback_model, **extra) as cell:
        named = fallback_model != "passthrough"
        assert ("FALLBACK_MODEL" in {b.name for b in cell.plan.worker.bindings}) == named
        cell.pod.set_fault("error")
        res = cell.call("POST", "/v1/chat/completions", body=chat(model="client/model"))
        assert res.status == 200, res.body  # the fallback stand-in only accepts FALLBACK_API_KEY
        assert res.headers["x-colocate-backend"] == "fallback"
        assert res.json()["model"] == (fallback_model if named else "client/model")


def test_pod_slower_than_deadline_falls_back_and_counts():
    with running_cell(runtime(deadlineMs=300)) as cell:
        cell.pod.set_fault("slow", delay_ms=2000)
        res = cell.call("POST", "/v1/chat/completions", body=chat())
        assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"
        t = res.timing()
        assert t["upstream"] < 1500  # gave up at the deadline, not when the pod answered (2 s)
        assert t["state"] + t["upstream"] >= 280  # ...and not before it (deadline counts from arrival)
        assert cell.wait_for(lambda s: s["failures"] >= 1)["failures"] == 1  # a deadline miss counts


def test_pod_back_half_open_trial_closes_the_breaker():
    with running_cell(runtime(openMs=2500)) as cell:
        cell.pod.set_fault("error")
        for _ in range(THRESHOLD):
            assert cell.call("POST", "/v1/chat/completions", body=chat()).status == 200
        assert cell.wait_breaker("open")["state"] == "open"
        cell.pod.set_fault("ok")
        # Within OPEN_MS the fallback serves; after it, one trial goes to the pod and closes.
        snap = cell.wait_breaker("closed", timeout_s=0.01)
        assert snap["state"] == "open"
        deadline = time.monotonic() + 15
        backends = []
        while time.monotonic() < deadline:
            res = cell.call("POST", "/v1/chat/completions", body=chat())
            assert res.status == 200
            backends.append(res.headers["x-colocate-backend"])
            if backends[-1] == "pod-0":
                break
            time.sleep(0.1)
        assert backends[0] == "fallback" and backends[-1] == "pod-0"
        snap = cell.wait_breaker("closed")
        assert snap["state"] == "closed" and snap["failures"] == 0


def test_state_is_shared_through_the_object_and_force_overrides():
    with running_cell(runtime(stateTtlMs=0)) as cell:
        put = cell.call("PUT", "/_colocate/breaker", body={"force": "open"}, headers=auth())
        assert put.status == 200 and put.json()["breaker"]["forced"] == "open"
        pod_before = cell.pod.requests
        res = cell.call("GET", "/v1/models")
        assert res.headers["x-colocate-backend"] == "fallback" and cell.pod.requests == pod_before
        # The routed request waited on the object (TTL 0): state comes from it, not a guess.
        probe = cell.call("GET", "/_colocate/probe", headers=auth()).json()
        assert probe["breaker"]["forced"] == "open"
        cell.call("PUT", "/_colocate/breaker", body={"force": "closed"}, headers=auth())
        cell.pod.set_fault("error")
        for _ in range(THRESHOLD + 1):
            cell.call("GET", "/v1/models")
        # Forced closed: failures are counted underneath but the pod is still tried.
        pod_before = cell.pod.requests
        cell.call("GET", "/v1/models")
        assert cell.pod.requests == pod_before + 1
        cell.call("PUT", "/_colocate/breaker", body={"force": None}, headers=auth())
        assert cell.wait_breaker("open")["forced"] is None


def tables_by_object(directory) -> dict[str, list[str]]:
    """Each Durable Object's SQLite file under ``directory`` that holds any table -> its tables."""
    import sqlite3

    out = {}
    for path in sorted(directory.rglob("*.sqlite")):
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
            names = [r[0] for r in rows if not r[0].startswith("_")]  # workerd's own bookkeeping
        finally:
            con.close()
        if names:
            out[path.name] = names
    return out


def test_generation_switch_reads_through_the_draining_state(tmp_path):
    g1 = [{"name": "us-east.g1", "region": "us-east", "status": "active"}]
    moved = [{"name": "us-east.g1", "region": "us-east", "status": "draining"},
             {"name": "us-east.g2", "region": "us-east", "status": "active"}]
    finished = [{"name": "us-east.g1", "region": "us-east", "status": "retired"},
                {"name": "us-east.g3", "region": "us-east", "status": "active"}]
    # A pod's answer may take its time: under a loaded suite 300 ms (runtime()) once sent a healthy
    # pod's /v1/models to the fallback, and this test is about whose state routes, not the deadline.
    worker = runtime(deadlineMs=5000)
    with running_cell(worker, generations=g1, storage_dir=tmp_path / "do") as cell:
        assert cell.call("PUT", "/_colocate/breaker", body={"force": "open"}, headers=auth()).status == 200
        cell.restart(cell_plan(worker, generations=g1))  # storage survives a restart
        assert cell.breaker()["forced"] == "open"

        cell.restart(cell_plan(worker, generations=moved))
        assert cell.plan.worker.binding("DRAINING_GENERATION").text == "us-east.g1"
        probe = cell.call("GET", "/_colocate/probe", headers=auth()).json()
        assert probe["generation"] == "us-east.g2" and probe["draining_generation"] == "us-east.g1"
        assert probe["breaker"]["forced"] == "open" and probe["breaker"]["imported"] == ["us-east.g1"]
        res = cell.call("GET", "/v1/models")
        assert res.headers["x-colocate-backend"] == "fallback"
        # The new generation now owns its state: clearing it there does not touch g1.
        cell.call("PUT", "/_colocate/breaker", body={"force": None}, headers=auth())
        assert cell.breaker()["forced"] is None
        assert cell.call("GET", "/v1/models").headers["x-colocate-backend"] == "pod-0"
        # Purge: never the active generation; the draining one on request.
        refused = cell.call("POST", "/_colocate/purge", body={"generation": "us-east.g2"}, headers=auth())
        assert refused.status == 409 and refused.json()["error"]["code"] == "active_generation"
        assert len(tables_by_object(tmp_path / "do")) == 2  # g1 and g2 hold tables
        purged = cell.call("POST", "/_colocate/purge", body={"generation": "us-east.g1"}, headers=auth())
        assert purged.status == 200 and purged.json()["had_state"] is True
        # A purged generation holds nothing, its schema included: only g2's object has tables.
        assert len(tables_by_object(tmp_path / "do")) == 1
        again = cell.call("POST", "/_colocate/purge", body={"generation": "us-east.g1"}, headers=auth())
        assert again.status == 200 and again.json()["had_state"] is False
        assert len(tables_by_object(tmp_path / "do")) == 1

        # Control: a generation with nothing draining starts empty (no read-through).
        cell.restart(cell_plan(worker, generations=finished))
        assert cell.breaker()["forced"] is None and cell.breaker()["imported"] == []
