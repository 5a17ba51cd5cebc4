"""N pods under the mock engine: what a change of pod.count or of the pods' identity
declares, so that the engine touches only the pods concerned, in a safe order."""

from __future__ import annotations

import functools
import json

import pytest

from colocate.cell import outputs
from colocate.cell.plan import instance_host
from tests.support.images import GUARDED_IMAGE
from tests.support.pulumi_mocks import SECRET_VALUES, plain, run_program, stack_config, unsecret

COMMAND = "command:local:Command"
WORKER = "cloudflare:index/workersScript:WorkersScript"


def deploy(count: int, stack: str = "us-east", pod: dict | None = None, secrets: dict | None = None, **kwargs):
    """The stack without its zone, on RunPod's proxy (the kit's image: the pod's guard), unless ``kwargs`` give one."""
    pod = {"provider": "runpod", "count": count, "image": GUARDED_IMAGE, **(pod or {})}
    config, keys = stack_config(stack, overrides={"pod": pod, **kwargs}, secrets=secrets,
                                drop=() if "zone" in kwargs else ("zone",))
    return run_program(stack, config, keys)


@functools.cache
def baseline(count: int):
    """``deploy(count)`` once per test session: many tests compare against the same plain
    cell, and each mock run of the program costs seconds. Read it, never change it."""
    return deploy(count)


def pods_of(run) -> dict[str, dict]:
    """Pod commands by resource name, in pod index order (the program registers them as their
    inputs resolve, in any order): what the engine diffs (stdin and triggers)."""
    pods = [r for r in run.mocks.of_type(COMMAND) if "-pod-" in r.name and "pod.py rent" in r.inputs["create"]]
    return {r.name: {"stdin": r.inputs["stdin"], "triggers": plain(r.inputs["triggers"]),
                     "create": r.inputs["create"], "delete": r.inputs["delete"]}
            for r in sorted(pods, key=lambda r: int(r.name.rsplit("-", 1)[1]))}


def test_growing_the_count_adds_only_the_new_pods_byte_identical_elsewhere():
    one, two, three = baseline(1), baseline(2), baseline(3)
    p1, p2, p3 = pods_of(one), pods_of(two), pods_of(three)
    assert list(p1) == ["us-east-pod-0"]
    assert list(p2) == ["us-east-pod-0", "us-east-pod-1"]
    assert list(p3) == ["us-east-pod-0", "us-east-pod-1", "us-east-pod-2"]
    # Same inputs for the pods that already exist: the engine sees no diff, no replace.
    assert p2["us-east-pod-0"] == p1["us-east-pod-0"]
    assert p3["us-east-pod-0"] == p1["us-east-pod-0"] and p3["us-east-pod-1"] == p2["us-east-pod-1"]
    # Each pod has its index in its name, its triggers and its spec.
    for name, pod in p3.items():
        i = int(name.rsplit("-", 1)[1])
        assert f"pod-{i}" in pod["triggers"] and json.loads(pod["stdin"])["index"] == i
        assert json.loads(pod["stdin"])["name"].split("-p")[-1].startswith(f"{i}-")


def test_shrinking_the_count_drops_only_the_last_pod():
    three, two = pods_of(baseline(3)), pods_of(baseline(2))
    assert set(three) - set(two) == {"us-east-pod-2"}
    assert {k: three[k] for k in two} == two


def test_the_worker_gets_every_pod_by_hostname_in_index_order():
    run = baseline(3)
    bindings = {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}
    assert json.loads(bindings["POD_URLS"]["text"]) == [
        "https://pod-123-8000.proxy.runpod.net", "https://pod-123-1-8000.proxy.runpod.net",
        "https://pod-123-2-8000.proxy.runpod.net"]
    r = run.resolved
    assert r[outputs.POD_IDS] == ["pod-123", "pod-123-1", "pod-123-2"]
    assert r[outputs.POD_ID] == "pod-123"  # the single-pod outputs describe pod 0
    assert len(r[outputs.POD_LOCATIONS]) == 3 and r[outputs.POD_LOCATION] == r[outputs.POD_LOCATIONS][0]
    assert r[outputs.PODS_COST_PER_HR] == pytest.approx(3 * 0.69)
    assert r[outputs.POD_PATH] == "provider-proxy"


def test_pods_are_spread_over_the_regions_locations():
    locations = [json.loads(p["stdin"])["locations"][0] for p in pods_of(baseline(2)).values()]
    assert len(set(locations)) == 2  # us-east has several RunPod data centres


def test_an_image_change_replaces_every_pod_and_each_gets_a_new_name():
    old, new = pods_of(baseline(3)), pods_of(deploy(3, pod={"image": GUARDED_IMAGE.replace("v0.33.0", "v0.12.0")}))
    assert list(old) == list(new)
    for name in old:
        assert old[name]["triggers"] != new[name]["triggers"], name
        assert json.loads(old[name]["stdin"])["name"] != json.loads(new[name]["stdin"])["name"], name


ROTATED = {**SECRET_VALUES, "podToken": "pod-token-r0tated"}
# A running pod cannot take these (its create request fixes them); without a new name, the
# re-run create would adopt the old pod unchanged.
REPLACING = {
    "port": {"pod": {"port": 8001}},
    "diskGb": {"pod": {"diskGb": 80}},
    "cloud": {"pod": {"cloud": "COMMUNITY"}},
    "path": {"zone": {"id": "f" * 32, "name": "example.com"}},  # provider-proxy -> zone-dns
    "podToken": {"secrets": ROTATED},
    "renewal": {"pod": {"renewal": 1}},  # not a change a pod refuses: the owner asks for new pods
}
KEEPING = {"maxPricePerHr": {"pod": {"maxPricePerHr": 1.5}}, "minReliability": {"pod": {"minReliability": 0.5}}}


def named(pods: dict[str, dict]) -> dict[str, tuple[str, list]]:
    return {k: (json.loads(p["stdin"])["name"], p["triggers"]) for k, p in pods.items()}


@pytest.mark.parametrize("key", REPLACING)
def test_a_change_a_running_pod_cannot_take_gives_every_pod_new_triggers_and_a_new_name(key):
    old, new = named(pods_of(baseline(2))), named(pods_of(deploy(2, **REPLACING[key])))
    assert list(old) == list(new) == ["us-east-pod-0", "us-east-pod-1"]
    for resource in old:
        (old_name, old_triggers), (new_name, new_triggers) = old[resource], new[resource]
        assert new_triggers != old_triggers and new_name != old_name, (key, resource)


@pytest.mark.parametrize("key", KEEPING)
def test_placement_criteria_reach_the_spec_but_keep_the_running_pod(key):
    old, new = pods_of(baseline(2)), pods_of(deploy(2, **KEEPING[key]))
    assert named(new) == named(old)
    # Not a no-op: create re-runs with the new spec (and adopts the pod); the next placement uses it.
    assert all(new[r]["stdin"] != old[r]["stdin"] for r in old)


def test_the_pod_token_is_declared_only_as_the_pods_secret_environment():
    for secrets in (SECRET_VALUES, ROTATED):
        run = deploy(2, secrets=secrets)
        token = secrets["podToken"]
        for r in run.mocks.of_type(COMMAND):
            if r.name.endswith("-pod-sweep"):  # lists and deletes by the provider's key alone
                assert "POD_TOKEN" not in unsecret(r.inputs["environment"])[1]
                continue
            if "-pod-" not in r.name:
                continue
            stdin_secret, stdin = unsecret(r.inputs["stdin"])
            triggers_secret, triggers = unsecret(r.inputs["triggers"])
            # Readable in a diff (not secret), and the token is in neither, nor in the name.
            assert not stdin_secret and not triggers_secret, r.name
            assert token not in stdin and token not in json.dumps(triggers), r.name
            assert token not in json.loads(stdin)["name"], r.name
            env_secret, env = unsecret(r.inputs["environment"])
            assert env_secret and env["POD_TOKEN"] == token


def test_with_a_zone_each_pod_has_its_own_dns_only_record():
    run = deploy(2, zone={"id": "f" * 32, "name": "example.com"})
    records = {r.name: r.inputs for r in run.mocks.of_type("cloudflare:index/dnsRecord:DnsRecord")}
    host = functools.partial(instance_host, provider="runpod")
    assert {n: (i["name"], i["content"], i["proxied"]) for n, i in records.items()} == {
        "us-east-pod-dns-0": (host("pod-us-east-g1.example.com", pod_id="pod-123"), "203.0.113.7", False),
        "us-east-pod-dns-1": (host("pod-us-east-g1-p1.example.com", pod_id="pod-123-1"), "203.0.113.8", False)}
    bindings = {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}
    assert json.loads(bindings["POD_URLS"]["text"]) == [f"https://{records['us-east-pod-dns-0']['name']}:41234",
                                                        f"https://{records['us-east-pod-dns-1']['name']}:41235"]


@pytest.fixture
def declared_options(monkeypatch):
    """Records the ResourceOptions each pod Command and the Worker are declared with."""
    import infra.cell as cell_mod

    seen: dict[str, object] = {}
    real_command, real_script = cell_mod.local.Command, cell_mod.cloudflare.WorkersScript

    def record(real):
        def make(name, *args, opts=None, **kwargs):
            seen[name] = opts
            return real(name, *args, opts=opts, **kwargs)
        return make

    monkeypatch.setattr(cell_mod.local, "Command", record(real_command))
    monkeypatch.setattr(cell_mod.cloudflare, "WorkersScript", record(real_script))
    return seen


def test_pods_are_rented_side_by_side_and_each_waits_only_for_its_own(declared_options):
    deploy(3)
    pods = sorted(n for n in declared_options if "-pod-" in n and not n.endswith(("-ready", "-sweep")))
    assert pods == ["us-east-pod-0", "us-east-pod-1", "us-east-pod-2"]

    def deps(name):
        return [d._name for d in declared_options[name].depends_on or []]

    for name in pods:
        assert deps(name) == []  # no pod's rent waits for another pod
        assert deps(f"{name}-ready") == [name]  # its wait, for its own rent only
        # Create-before-delete: capacity never drops while a pod is replaced.
        assert declared_options[name].delete_before_replace is False
        assert declared_options[f"{name}-ready"].delete_before_replace is False
    # The Worker moves to the new pods only once every one of them serves.
    assert {f"{p}-ready" for p in pods} <= set(deps("us-east-worker"))


def test_a_pod_is_in_state_before_anything_waits_on_it():
    run = baseline(2)
    by_name = {r.name: r.inputs for r in run.mocks.of_type(COMMAND)}
    for i in range(2):
        rent, wait = by_name[f"us-east-pod-{i}"], by_name[f"us-east-pod-{i}-ready"]
        assert "pod.py rent" in rent["create"] and "pod.py delete --stack us-east" in rent["delete"]
        assert "pod.py wait" in wait["create"] and "delete" not in wait  # the rent's delete owns the pod
        rented = json.loads(wait["stdin"])["rented"]
        assert rented == {"id": "pod-123" if i == 0 else f"pod-123-{i}", "provider": "runpod",
                          "name": json.loads(rent["stdin"])["name"]}
        assert {**json.loads(wait["stdin"]), "rented": None} == {**json.loads(rent["stdin"]), "rented": None}
        assert [json.loads(t) for t in plain(wait["triggers"])] == [rented]  # a new rent is a new wait
    # After the update, the stack's pods that no declared pod holds are deleted.
    sweep = by_name["us-east-pod-sweep"]["create"]
    assert sweep == f".venv/bin/python scripts/pod.py sweep --stack us-east --scope {run.resolved['podScope']} " \
                    "--destroy --provider runpod --keep pod-123 --keep pod-123-1"


def test_pod_0_keeps_the_resource_it_had_as_the_only_pod(declared_options):
    deploy(2)
    aliases = [a.name for a in declared_options["us-east-pod-0"].aliases or []]
    assert aliases == ["us-east-pod"]
    assert not declared_options["us-east-pod-1"].aliases


def test_the_post_deploy_probe_gets_every_pods_location_in_index_order():
    run = baseline(3)
    probe = next(r for r in run.mocks.of_type(COMMAND) if r.name.endswith("-probe"))
    create = plain(probe.inputs["create"])
    locations = plain(run.resolved[outputs.POD_LOCATIONS])
    assert create.count("--pod-location ") == 3
    assert " ".join(f"--pod-location {loc}" for loc in locations) in create


def test_a_mix_declares_what_the_market_policy_says_and_a_spare_pod_beside_the_count():
    # apac-tw on Vast.ai (its zone kept): pod 0 on demand, the others interruptible with their bid, and a spare
    run = deploy(2, stack="apac-tw", pod={"provider": "vastai", "gpu": "RTX 4090", "image": GUARDED_IMAGE,
                                          "market": "mix", "onDemandFloor": 1, "spare": 1, "bidPerHr": 0.25},
                 zone={"id": "f" * 32, "name": "example.com"})
    specs = [json.loads(p["stdin"]) for p in pods_of(run).values()]
    assert [(s["index"], s["market"], s["on_demand_fallback"]) for s in specs] == [
        (0, "ondemand", False), (1, "interruptible", True), (2, "interruptible", True)]
    assert {s["bid_per_hr"] for s in specs} == {0.25}
    triggers = [p["triggers"] for p in pods_of(run).values()]
    assert ["market=interruptible" in t for t in triggers] == [False, True, True]
    bindings = {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}
    assert len(json.loads(bindings["POD_URLS"]["text"])) == 3  # the spare pod serves like the others
