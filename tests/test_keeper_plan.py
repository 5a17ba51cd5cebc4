"""What the keeper relies on in the plan and the program (under the mock engine): colocate:pod.replaced
renames pod i alone; every `pulumi up` declares the count the keeper recorded in the generation, from
any checkout; the Worker carries its content hash (a WORKER_HASH binding, the workerContentHash
output); each pod's address and each role's certificate end are outputs; the URNs a targeted update
names are the declared resources' own; PulumiDeployer's targeted updates name only those, and a
locked stack is StackLocked."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from pulumi.automation._cmd import CommandResult
from pulumi.automation.errors import create_command_error

from colocate.cell import plan as plan_mod, settings, urns
from colocate.errors import ConfigError
from colocate.scaling.controller import PulumiDeployer
from colocate.scaling.keeper import StackLocked
from tests.support.pulumi_mocks import plain, record_options, run_program, stack_config
from tests.test_infra_scale import FakeWorker
from tests.test_settings_numbers import parse

COMMAND = "command:local:Command"
WORKER = "cloudflare:index/workersScript:WorkersScript"
ZONE = {"id": "f" * 32, "name": "example.com"}


def names(raw_replaced=None, count=3):
    pod = {"count": count, **({"replaced": raw_replaced} if raw_replaced is not None else {})}
    s = parse(**{f"pod.{k}": v for k, v in pod.items()})
    return [p.name for p in plan_mod.plan_cell(s).pods]


def test_a_replaced_count_renames_that_pod_alone():
    before = names()
    after = names({"1": 1})
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    assert names({"1": 2})[1] not in (before[1], after[1])  # each replacement a name of its own
    assert names({"1": 0}) == before  # 0 adds nothing: pods placed before the key keep their names
    assert names({1: 1}) == after  # a YAML mapping's integer key is the same pod


@pytest.mark.parametrize("bad", [{"8": 1}, {"x": 1}, {"1": -1}, {"1": "two"}, ["1"]])
def test_a_bad_replaced_value_names_the_key_and_the_fix(bad):
    with pytest.raises(ConfigError) as err:
        parse(**{"pod.replaced": bad})
    assert "colocate:pod.replaced" in str(err.value) and "scripts/scale.py" in err.value.fix


def test_the_worker_carries_its_content_hash_and_the_stack_exports_it():
    cell = plan_mod.plan_cell(parse())
    binding = cell.worker.binding(plan_mod.WORKER_HASH_BINDING)
    assert binding.type == "plain_text" and binding.text == cell.worker.content_hash() == plan_mod.modules_hash(
        plan_mod.worker_modules())
    config, keys = stack_config("us-east")
    run = run_program("us-east", config, keys)
    bindings = {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}
    assert bindings["WORKER_HASH"]["text"] == run.resolved["workerContentHash"] == cell.worker.content_hash()


def deploy(monkeypatch, desired, stack_replaced=None, count=2):
    pod = {"provider": "runpod", "count": count, **({"replaced": stack_replaced} if stack_replaced else {})}
    config, keys = stack_config("us-east", overrides={"pod": pod})
    worker = FakeWorker(desired)
    monkeypatch.setenv("COLOCATE_WORKER_URL", worker.url)
    try:
        run = run_program("us-east", config, keys)
    finally:
        worker.close()
    return {r.name: json.loads(r.inputs["stdin"])["name"] for r in run.mocks.of_type(COMMAND)
            if "pod.py rent" in r.inputs["create"]}, run


def test_every_up_from_any_checkout_declares_the_pod_the_keeper_replaced(monkeypatch):
    fresh, _ = deploy(monkeypatch, None)
    kept, run = deploy(monkeypatch, {"pods": 2, "draining": 0, "replaced": {"1": 1}})  # a fixed cell reads it too
    assert kept["us-east-pod-0"] == fresh["us-east-pod-0"] and kept["us-east-pod-1"] != fresh["us-east-pod-1"]
    # a stack file behind the generation applies the generation's; one ahead (the keeper's seed) its own
    behind, _ = deploy(monkeypatch, {"pods": 2, "draining": 0, "replaced": {"1": 1}}, stack_replaced={"1": 0})
    ahead, _ = deploy(monkeypatch, {"pods": 2, "draining": 0, "replaced": {"1": 1}}, stack_replaced={"1": 2})
    assert behind == kept and ahead["us-east-pod-1"] not in (kept["us-east-pod-1"], fresh["us-east-pod-1"])
    addresses = run.resolved["podAddresses"]
    assert [a["port"] for a in addresses] == [41234, 41235] and addresses[0]["ip"] == "203.0.113.7"


def test_a_fixed_cell_whose_worker_cannot_be_read_goes_on_from_its_stack_file(monkeypatch):
    config, keys = stack_config("us-east", overrides={"pod": {"provider": "runpod", "count": 2, "replaced": {"1": 1}}})
    worker = FakeWorker(None, status=503)
    monkeypatch.setenv("COLOCATE_WORKER_URL", worker.url)
    try:
        run = run_program("us-east", config, keys)  # no RunError: a scaled cell's would stop (test_infra_scale)
    finally:
        worker.close()
    assert len([r for r in run.mocks.of_type(COMMAND) if "pod.py rent" in r.inputs["create"]]) == 2


def test_the_urns_a_targeted_update_names_are_the_declared_resources(monkeypatch):
    declared = record_options(monkeypatch)
    config, keys = stack_config("us-east", overrides={"zone": ZONE, "pod": {"provider": "runpod", "count": 2,
                                                                          "renewal": 1}})
    run = run_program("us-east", config, keys)
    loop = asyncio.get_event_loop()
    by_name = {d.name: loop.run_until_complete(d.resource.urn.future()) for d in declared}
    assert urns.pod_rent("colocate", "us-east", 1) == by_name["us-east-pod-1"]
    for role in ("pod-0", "pod-1", "cell"):
        for urn in urns.hop_certificates("colocate", "us-east", role, 1, public=True):
            assert urn in by_name.values(), (role, urn)
    assert set(run.resolved["hopCerts"]) == {"cell", "pod-0", "pod-1"}
    assert run.resolved["hopCerts"]["pod-1"] == run.resolved["hopCertsNotAfter"]  # the mocks' one end


class Stack:
    """pulumi.automation's Stack as PulumiDeployer uses it, recording what it is asked."""

    name = "us-east"

    def __init__(self, fail=None):
        self.ups, self.config, self.fail = [], {}, fail
        project = dataclasses.make_dataclass("P", [("name", str)])("colocate")
        self.workspace = type("W", (), {"project_settings": lambda _self: project})()

    def set_config(self, key, value, path=False):
        self.config[key] = value.value

    def get_all_config(self):
        value = type("V", (), {"value": json.dumps({"provider": "runpod", "renewal": 0}), "secret": False})()
        return {"colocate:pod": value}

    def outputs(self):
        return {"podPath": type("O", (), {"value": "zone-dns"})()}

    def up(self, **kwargs):
        if self.fail:
            raise self.fail
        kwargs.pop("on_output")
        self.ups.append(kwargs)
        return type("R", (), {"summary": type("S", (), {"result": "succeeded", "resource_changes": {}})()})()


def deployer(stack) -> PulumiDeployer:
    from pulumi import automation

    d = object.__new__(PulumiDeployer)
    d.auto, d.stack, d.say, d.client = automation, stack, (lambda line: None), None
    return d


def test_the_cloud_deployer_updates_the_replaced_pods_and_their_dependents_and_nothing_else():
    stack = Stack()
    deployer(stack).replace([1], {1: 3})
    assert stack.config == {'colocate:pod.replaced["1"]': "3"}
    assert stack.ups == [{"target": [urns.pod_rent("colocate", "us-east", 1)], "target_dependents": True}]
    deployer(stack).renew("pod-0")
    cert = urns.hop_certificates("colocate", "us-east", "pod-0", 0, public=True)
    assert stack.ups[-1] == {"target": cert, "replace": cert, "target_dependents": True}


def test_a_locked_stack_is_stack_locked_naming_pulumi_cancel():
    for stderr in ("error: the stack is currently locked by 1 lock(s). Either wait for the other process(es) to end "
                   "or delete the lock file with `pulumi cancel`.", "[409] Conflict: Another update is currently in progress."):
        stack = Stack(fail=create_command_error(CommandResult(stdout="", stderr=stderr, code=255)))
        with pytest.raises(StackLocked) as err:
            deployer(stack).replace([0], {0: 1})
        assert "pulumi cancel" in str(err.value)
    with pytest.raises(Exception) as other:
        deployer(Stack(fail=create_command_error(CommandResult(stdout="", stderr="error: 500", code=1)))).deploy(1, 0)
    assert not isinstance(other.value, StackLocked)


def test_pulumi_yaml_and_the_settings_agree_on_replaced():
    assert settings.POD_DEFAULTS["replaced"] == {}


def test_the_cloud_deployer_marks_the_teams_endpoints_own_and_their_colos_as_their_region():
    class Endpoints(Stack):
        name = "apac-tw-own"

        def get_all_config(self):
            value = lambda v: type("V", (), {"value": v, "secret": False})()  # noqa: E731
            return {"colocate:pod": value(json.dumps({"provider": "existing"})), "colocate:region": value("apac-tw")}

        def outputs(self):
            out = {"podIds": ["pod-apac-tw-g1.example.com:8443"], "podLocations": ["TPE"], "podPath": "endpoint",
                   "podAddresses": [{"ip": "203.0.113.7", "port": 8443}]}
            return {k: type("O", (), {"value": v})() for k, v in out.items()}

    (pod,) = deployer(Endpoints()).pods()
    assert pod.own and pod.provider == "existing" and pod.locations == ("TPE", "KHH", "HKG")
    assert deployer(Endpoints()).describe(pod).raw_state.startswith("declared")  # no provider account to ask
