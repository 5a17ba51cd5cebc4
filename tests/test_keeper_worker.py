"""The Worker's side of the keeper, in real workerd: GET /_colocate/scale says which code runs
(worker_hash, the WORKER_HASH binding the plan computes); the lock's holder records the keeper's
pass and colocate:pod.replaced, which a later count without it keeps and a migration carries; bad
records are refused naming the field; /_colocate/metrics exposes the keeper's alerts, pod verdicts
and replacements, and a controller recording through CellClient round-trips all of it."""

from __future__ import annotations

import pytest

from colocate.scaling.controller import CellClient
from tests.support.workerd import SECRETS, auth, cell_plan, running_cell

pytestmark = pytest.mark.slow
G1 = [{"name": "us-east.g1", "region": "us-east", "status": "active"}]
MOVED = [{"name": "us-east.g1", "region": "us-east", "status": "draining"},
         {"name": "us-east.g2", "region": "us-east", "status": "active"}]
KEEPER = {"pods": [{"index": 0, "id": "p0", "state": "dead", "detail": "runpod reports p0 EXITED"}],
          "alerts": [{"name": "replace_failed", "pod": 0, "message": "3 attempts failed"}],
          "replacements": [{"pod": 0, "reason": "dead", "n": 1}], "events": []}


def test_the_worker_says_its_code_and_keeps_the_keepers_record_through_a_migration(tmp_path):
    with running_cell({"stateTtlMs": 300}, generations=G1, storage_dir=tmp_path / "do", compute_ms=1) as cell:
        client = CellClient(cell.url, SECRETS["PROBE_TOKEN"])
        state = client.state()
        assert state["worker_hash"] == cell.plan.worker.content_hash() and state["keeper"] is None
        assert client.lock("k", 30)[0]
        decision = {"desired": 1, "running": 1, "reason": "replacing pod 0 alone"}
        assert client.record("k", decision, (1, 0), {0: 1}, KEEPER)
        state = client.state()
        assert state["desired"]["replaced"] == {"0": 1} and state["keeper"]["alerts"][0]["name"] == "replace_failed"
        assert state["keeper"]["owner"] == "k" and isinstance(state["keeper"]["at"], int)
        assert client.record("k", decision, (1, 0))  # a scaling step's count alone keeps the replacements
        assert client.state()["desired"]["replaced"] == {"0": 1}
        assert not CellClient(cell.url, SECRETS["PROBE_TOKEN"]).record("other", decision, keeper=KEEPER)  # not the holder
        for body, code in (({"desired": {"pods": 1, "draining": 0, "replaced": {"9": 1}}}, "invalid_desired"),
                           ({"desired": {"pods": 1, "draining": 0, "replaced": {"0": -1}}}, "invalid_desired"),
                           ({"keeper": ["not", "a", "record"]}, "invalid_keeper"),
                           ({"keeper": {"events": ["x" * 20_000]}}, "invalid_keeper")):
            res = cell.call("POST", "/_colocate/scale", body={"owner": "k", "decision": decision, **body}, headers=auth())
            assert res.status in (400, 413) and (res.status == 413 or code.encode() in res.body), (body, res.body)
        metrics = cell.call("GET", "/_colocate/metrics", headers=auth()).body.decode()
        assert 'colocate_keeper_alert{alert="replace_failed"} 1' in metrics
        assert 'colocate_keeper_alert{alert="stack_locked"} 0' in metrics
        assert 'colocate_keeper_pod_state{pod="0",state="dead"} 1' in metrics
        assert 'colocate_keeper_replacements_total{pod="0",reason="dead"} 1' in metrics
        client.lock("k", 0, release=True)
        cell.restart(cell_plan({"stateTtlMs": 300}, generations=MOVED))  # the first touch of g2 imports g1
        moved = CellClient(cell.url, SECRETS["PROBE_TOKEN"]).state()
        assert moved["generation"] == "us-east.g2" and moved["desired"]["replaced"] == {"0": 1}
