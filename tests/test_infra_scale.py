"""colocate:scale under the mock engine: the counts a controller writes, one `pulumi up` each.
Every pod it ever adds is a declared `<stack>-pod-<i>` Command whose delete is `pod.py delete`
(so the update that drops it, or `pulumi destroy`, deletes it); a draining pod stays declared,
out of the Worker's POD_URLS; a cell at zero declares no pod and a Worker with POD_URLS []."""

from __future__ import annotations

import json

from tests.support.images import GUARDED_IMAGE
from tests.support.pulumi_mocks import plain, run_program, stack_config

COMMAND = "command:local:Command"
WORKER = "cloudflare:index/workersScript:WorkersScript"
SCALE = {"min": 0, "max": 3, "target": 60}


def deploy(pods: int, draining: int = 0):
    pod = {"provider": "runpod", "image": GUARDED_IMAGE}  # RunPod's proxy: the stack without its zone
    config, keys = stack_config("us-east", drop=("zone",),
                                overrides={"pod": pod, "scale": {**SCALE, "pods": pods, "draining": draining}})
    run = run_program("us-east", config, keys)
    commands = {r.name: r.inputs for r in run.mocks.of_type(COMMAND) if "pod.py rent" in r.inputs["create"]}
    bindings = {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}
    return commands, json.loads(bindings["POD_URLS"]["text"]), run


def test_every_pod_a_controller_adds_is_declared_with_its_delete_and_leaves_rotation_before_it_goes():
    # what a controller writes over a day: up 0 -> 1 -> 3, drain 3 -> 1, down, drain to 0, zero
    steps = [(0, 0), (1, 0), (3, 0), (1, 2), (1, 0), (0, 1), (0, 0)]
    from infra.cell import POD_DELETE  # here, not at collection: it imports pulumi_cloudflare

    ever: dict[str, dict] = {}
    for pods, draining in steps:
        commands, urls, run = deploy(pods, draining)
        assert sorted(commands) == [f"us-east-pod-{i}" for i in range(pods + draining)], (pods, draining)
        assert len(urls) == pods  # draining pods run but the Worker no longer routes to them
        for name, inputs in commands.items():
            assert inputs["delete"] == POD_DELETE.format(stack="us-east") and "pod.py rent" in inputs["create"]
            if name in ever:  # the same pod on every step: no diff, no replace, whether or not it drains
                assert (inputs["stdin"], plain(inputs["triggers"])) == (ever[name]["stdin"], plain(ever[name]["triggers"]))
            ever[name] = inputs
        assert run.resolved["podIds"] == [f"pod-123{'' if i == 0 else f'-{i}'}" for i in range(pods + draining)]
    assert sorted(ever) == ["us-east-pod-0", "us-east-pod-1", "us-east-pod-2"]
    # the last update declares none: every pod the controller added was deleted by an update's
    # delete of an undeclared resource, and `pulumi destroy` has no pod left to delete
    commands, urls, run = deploy(0, 0)
    assert commands == {} and urls == [] and run.resolved["podId"] is None


def test_the_draining_pod_is_the_last_one_and_keeps_its_name():
    serving, _, _ = deploy(2, 0)
    draining, urls, _ = deploy(1, 1)
    assert draining["us-east-pod-1"]["stdin"] == serving["us-east-pod-1"]["stdin"]
    assert urls == ["https://pod-123-8000.proxy.runpod.net"]


# --- one source of truth: the generation's desired count, read by every `pulumi up` ---

class FakeWorker:
    """GET /_colocate/scale as the Worker answers it (admin.js scaleState), with a read token."""

    def __init__(self, desired, status=200):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.desired, self.status, self.auth = desired, status, []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fake.auth.append(self.headers.get("authorization"))
                body = json.dumps({"generation": "us-east.g2", "routed_pods": 1, "backends": {}, "inflight": {},
                                   "desired": fake.desired}).encode()
                self.send_response(fake.status if self.path == "/_colocate/scale" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def deploy_from(monkeypatch, worker, pods=1, draining=0, env=None):
    monkeypatch.setenv("COLOCATE_WORKER_URL", worker.url)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return deploy(pods, draining)


def test_an_up_from_any_checkout_applies_the_generations_count_not_its_stack_file(monkeypatch):
    """The stack file of another checkout says 3 pods; the controller drained to 1 + 1 leaving: that is what is declared."""
    worker = FakeWorker({"pods": 1, "draining": 1, "owner": "c1", "at": 1})
    try:
        commands, urls, _ = deploy_from(monkeypatch, worker, pods=3)
    finally:
        worker.close()
    assert sorted(commands) == ["us-east-pod-0", "us-east-pod-1"] and len(urls) == 1  # pod 1 drains, pod 2 is gone
    assert worker.auth == ["Bearer read-token-s3cret"]  # the read token: GET needs no more


def test_without_a_recorded_count_the_stack_file_seeds_it(monkeypatch):
    worker = FakeWorker(None)  # a generation no controller wrote yet (a new one after a migration, say)
    try:
        commands, urls, _ = deploy_from(monkeypatch, worker, pods=2)
    finally:
        worker.close()
    assert sorted(commands) == ["us-east-pod-0", "us-east-pod-1"] and len(urls) == 2


def test_a_worker_that_cannot_be_read_stops_the_update_and_names_the_way_out(monkeypatch):
    import pulumi
    import pytest

    worker = FakeWorker(None, status=503)
    try:
        with pytest.raises(pulumi.RunError) as err:
            deploy_from(monkeypatch, worker, pods=2)
        msg = str(err.value)
        assert "colocate:scale" in msg and "could delete pods that serve" in msg and "COLOCATE_SCALE_FROM=stack" in msg
        commands, _, _ = deploy_from(monkeypatch, worker, pods=2, env={"COLOCATE_SCALE_FROM": "stack"})
        assert len(commands) == 2
    finally:
        worker.close()


def test_a_scaling_steps_probe_reports_and_cannot_fail_the_step(monkeypatch):
    monkeypatch.setenv("COLOCATE_SCALE_STEP", "1")
    _, _, run = deploy(1, 0)
    probe = next(r.inputs["create"] for r in run.mocks.of_type(COMMAND) if "probe.py" in r.inputs.get("create", ""))
    assert "--warn-only" in probe and "--settle" not in probe and "--wait" not in probe
    monkeypatch.delenv("COLOCATE_SCALE_STEP")
    _, _, run = deploy(1, 0)
    probe = next(r.inputs["create"] for r in run.mocks.of_type(COMMAND) if "probe.py" in r.inputs.get("create", ""))
    assert "--wait" in probe


def test_a_scaled_stack_still_on_the_legacy_probe_token_reads_its_worker_with_it(monkeypatch):
    """Only colocate:probeToken set (deprecated, it stands in for the three operator tokens): the
    program reads the controller's count with it, as the Worker then accepts, not with an empty token."""
    from tests.support.pulumi_mocks import SECRET_VALUES

    secrets = {k: v for k, v in SECRET_VALUES.items() if k not in ("readToken", "adminToken", "exchangeToken")}
    secrets["probeToken"] = "probe-token-s3cret"
    worker = FakeWorker({"pods": 2, "draining": 0, "owner": "c1", "at": 1})
    monkeypatch.setenv("COLOCATE_WORKER_URL", worker.url)
    try:
        config, keys = stack_config("us-east", overrides={"pod": {"provider": "runpod"},
                                                          "scale": {**SCALE, "pods": 1, "draining": 0}}, secrets=secrets)
        run = run_program("us-east", config, keys)
    finally:
        worker.close()
    assert worker.auth == ["Bearer probe-token-s3cret"]
    assert sorted(r.name for r in run.mocks.of_type(COMMAND) if "pod.py rent" in r.inputs["create"]) == [
        "us-east-pod-0", "us-east-pod-1"]
