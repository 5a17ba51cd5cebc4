"""A cell of endpoints the team already runs, as the Pulumi program declares it (the SDK's mock engine):
stacks/Pulumi.apac-tw-own.yaml (a box by its ip, named on the zone, mutual TLS) and a box behind its own
name and TLS (the pod token). Nothing declared can create, replace or delete the box: its commands carry
no delete and no sweep runs, so `pulumi destroy` and a replacement leave it running."""

from __future__ import annotations

import json

import pulumi
import pytest

from colocate.cell import outputs, plan
from tests.support.pulumi_mocks import plain, run_program, stack_config, unsecret

STACK = "apac-tw-own"
COMMAND = "command:local:Command"
DNS = "cloudflare:index/dnsRecord:DnsRecord"
ACME_CERT = "acme:index/certificate:Certificate"
CSR = "tls:index/certRequest:CertRequest"
WORKER = "cloudflare:index/workersScript:WorkersScript"
NAME = "pod-apac-tw-g1.example.com"  # the kit's record for the shipped stack's ip
SECOND = {"ip": "2001:db8::7", "port": 443, "location": "KHH", "costPerHr": 0.5}


def _pod(overrides: dict | None = None) -> dict:
    from colocate import stackfile

    return {**stackfile.read_config(STACK)[0]["pod"], **(overrides or {})}


def _bindings(run) -> dict:
    return {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}


@pytest.fixture(scope="module")
def two():
    """The shipped box and a second one by an IPv6 address."""
    config, keys = stack_config(STACK, overrides={"pod": _pod({"endpoints": [*_pod()["endpoints"], SECOND]})})
    return run_program(STACK, config, keys)


def test_nothing_declared_can_delete_the_box(two):
    commands = {r.name: r.inputs for r in two.mocks.of_type(COMMAND)}
    for i in (0, 1):
        assert "delete" not in commands[f"{STACK}-pod-{i}"] and "delete" not in commands[f"{STACK}-pod-{i}-ready"]
    assert f"{STACK}-pod-sweep" not in commands  # nothing of the team's is swept
    assert not [n for n, c in commands.items() if "pod.py delete" in str(c.get("delete")) or "sweep" in str(c.get("create"))]


def test_each_box_is_named_on_the_zone_by_its_address_before_it_is_checked(two):
    records = {r.name: r.inputs for r in two.mocks.of_type(DNS)}
    assert records == {
        f"{STACK}-endpoint-dns-0": {**records[f"{STACK}-endpoint-dns-0"], "name": NAME, "type": "A",
                                    "content": "203.0.113.7", "proxied": False, "ttl": 60},
        f"{STACK}-endpoint-dns-1": {**records[f"{STACK}-endpoint-dns-1"], "name": "pod-apac-tw-g1-p1.example.com",
                                    "type": "AAAA", "content": "2001:db8::7", "proxied": False, "ttl": 60}}
    assert all(r["zoneId"] == "0" * 32 for r in records.values())


def test_each_box_gets_a_publicly_trusted_certificate_for_its_name_renewed_from_30_days(two):
    for i, name in enumerate((NAME, "pod-apac-tw-g1-p1.example.com")):
        assert two.mocks.one(CSR, f"-hop-pod-{i}-csr").inputs["dnsNames"] == [name]
        assert two.mocks.one(ACME_CERT, f"-hop-pod-{i}").inputs["minDaysRemaining"] == 30
        spec = json.loads(two.mocks.one(COMMAND, f"-pod-{i}").inputs["stdin"])
        assert spec["tls_name"] == name and spec["endpoint"]["host"] == name
        _, env = unsecret(two.mocks.one(COMMAND, f"-pod-{i}").inputs["environment"])
        assert set(env) == {"POD_TOKEN", "POD_TLS", "POD_CHECK_TLS"}  # no provider key: nothing is rented


def test_the_worker_reaches_places_and_balances_over_them_as_over_rented_pods(two):
    urls = json.loads(_bindings(two)["POD_URLS"]["text"])
    assert urls == [f"https://{NAME}:8443", "https://pod-apac-tw-g1-p1.example.com:443"]
    assert "POD_TLS" in _bindings(two)
    r = two.resolved
    assert r[outputs.POD_PATH] == plan.PATH_ENDPOINT and r[outputs.PLACEMENT_MODE] == "pod"
    assert r[outputs.PLACEMENT_HOST] == f"{NAME}:8443" == r[outputs.PLACEMENT]["host"]
    assert r[outputs.POD_LOCATIONS] == ["TPE", "KHH"] and r[outputs.POD_IDS] == [
        f"{NAME}:8443", "pod-apac-tw-g1-p1.example.com:443"]
    assert r[outputs.PODS_COST_PER_HR] == 0.85  # the team's own figures, summed
    probe = two.mocks.one(COMMAND, "-probe").inputs["create"]
    assert "--pod-location TPE --pod-location KHH --pod-path endpoint --placement-mode pod" in probe
    assert f"--placement-host {NAME}:8443" in probe


def test_a_box_behind_its_own_name_and_tls_is_reached_with_the_pod_token_alone():
    endpoint = {"host": "gpu1.team.example.org", "location": "TPE"}
    config, keys = stack_config(STACK, drop=("zone",), overrides={"pod": _pod({"endpoints": [endpoint]})})
    run = run_program(STACK, config, keys)
    assert not run.mocks.of_type(DNS) and not run.mocks.of_type(ACME_CERT) and not run.mocks.of_type(CSR)
    assert "POD_TLS" not in _bindings(run)
    assert json.loads(_bindings(run)["POD_URLS"]["text"]) == ["https://gpu1.team.example.org:8000"]
    _, env = unsecret(run.mocks.one(COMMAND, f"{STACK}-pod-0").inputs["environment"])
    assert set(env) == {"POD_TOKEN"}
    assert run.resolved[outputs.PODS_COST_PER_HR] == 0.0  # no figure given: 0, and cost.py says so
    assert "delete" not in run.mocks.one(COMMAND, f"{STACK}-pod-0").inputs


def test_an_address_off_any_zone_stops_before_anything_is_declared():
    from tests.support.pulumi_mocks import RecordingMocks

    config, keys = stack_config(STACK, drop=("zone",))
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError, match=r"colocate:pod.endpoints\[0\].ip.*needs colocate:zone") as err:
        run_program(STACK, config, keys, mocks=mocks)
    assert "Fix:" in str(err.value) and mocks.resources == []
