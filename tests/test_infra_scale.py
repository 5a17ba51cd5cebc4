"""colocate:scale under the mock engine: the counts a controller writes, one `pulumi up` each.
Every pod it ever adds is a declared `<stack>-pod-<i>` Command whose delete is `pod.py delete`
(so the update that drops it, or `pulumi destroy`, deletes it); a draining pod stays declared,
out of the Worker's POD_URLS; a cell at zero declares no pod and a Worker with POD_URLS []."""

from __future__ import annotations

import json

from tests.support.pulumi_mocks import plain, run_program, stack_config

COMMAND = "command:local:Command"
WORKER = "cloudflare:index/workersScript:WorkersScript"
SCALE = {"min": 0, "max": 3, "target": 60}


def deploy(pods: int, draining: int = 0):
    pod = {"provider": "runpod"}
    config, keys = stack_config("us-east", overrides={"pod": pod, "scale": {**SCALE, "pods": pods, "draining": draining}})
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
