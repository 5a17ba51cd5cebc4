"""A cell of endpoints the team already runs (``colocate:pod.provider: existing``): settings and plan, pure."""

from __future__ import annotations

import pytest

from colocate.cell import geo, plan, settings
from colocate.errors import ConfigError, MissingSetting
from colocate.pods.spec import PodSpec
from tests.test_plan import SECRETS, ZONE, raw_for


def existing(endpoints, region="apac-tw", zone=True, **pod):
    raw = raw_for(region, "runpod" if region != "apac-tw" else "vastai")
    raw["pod"] = {"provider": "existing", "endpoints": endpoints, **pod}
    if zone:
        raw["zone"] = ZONE
    else:
        raw.pop("zone", None)
    return raw


def cell(raw):
    return plan.plan_cell(settings.parse(raw, "own", secrets=SECRETS))


BY_IP = {"ip": "203.0.113.7", "port": 8443, "location": "TPE", "costPerHr": 0.35}
BY_NAME = {"host": "gpu1.team.example.org", "location": "KHH"}


def test_an_ip_on_the_zone_is_named_there_and_reached_over_mutual_tls():
    p = cell(existing([BY_IP, {**BY_IP, "ip": "198.51.100.4", "port": 443, "costPerHr": "0.2"}]))
    assert p.pod_path == plan.PATH_ENDPOINT and p.mtls and p.acme_server == settings.ACME_SERVER
    names = [pod.endpoint.host for pod in p.pods]
    assert names == ["pod-apac-tw-g1.example.com", "pod-apac-tw-g1-p1.example.com"]
    assert [pod.tls_name for pod in p.pods] == names  # exactly the name: known before the box serves
    assert p.pods[1].worker_url({}) == "https://pod-apac-tw-g1-p1.example.com:443"
    assert [pod.settings.count for pod in p.pods] == [2, 2]
    assert "POD_TLS" in {b.name for b in p.worker.bindings}
    # Placed by pod 0's own address, as a rented pod on the zone; the port is the declared one.
    assert p.worker.placement_mode == plan.PLACEMENT_POD
    assert p.worker.placement_host.value({"port": 8443}) == "pod-apac-tw-g1.example.com:8443"
    spec = PodSpec.from_dict(p.pods[0].spec())
    assert spec.endpoint == {"host": names[0], "ip": "203.0.113.7", "port": 8443, "location": "TPE", "cost_per_hr": 0.35}
    assert spec.port == 8443 and spec.locations == ("TPE",) and spec.mtls
    assert p.pods[1].spec()["endpoint"]["cost_per_hr"] == 0.2


def test_a_name_off_the_zone_is_reached_with_the_pod_token_over_its_own_tls():
    p = cell(existing([BY_NAME], zone=False))
    assert not p.mtls and "POD_TLS" not in {b.name for b in p.worker.bindings}
    assert p.pod.worker_url({}) == "https://gpu1.team.example.org:8000"  # colocate:pod.port by default
    assert p.pod.settings.hop == "token" and plan.pod_guarded("existing", p.pod_path, p.pod.settings.hop)
    assert p.worker.placement_host.value({"port": 8000}) == "gpu1.team.example.org:8000"
    # The stock image is not refused: the kit starts nothing there, and readiness refuses an unguarded box.
    assert p.pod.settings.image.startswith(plan.STOCK_IMAGE)


def test_the_kit_never_sweeps_replaces_or_renames_an_endpoint():
    p = cell(existing([BY_IP], replaced={"0": 3}))
    assert p.sweep_provider is None
    assert not any(part.startswith("replaced=") for part in p.pod.identity())
    a, b = cell(existing([BY_IP])), cell(existing([{**BY_IP, "costPerHr": 2}]))
    assert a.pod.name == b.pod.name  # its price is not what it is
    assert cell(existing([{**BY_IP, "port": 9443}])).pod.name != a.pod.name


def test_its_location_is_a_colo_of_the_region_and_sets_the_pods_floor():
    p = cell(existing([{**BY_IP, "location": "khh"}]))
    assert p.pod.locations == ("KHH",)
    assert p.probe.floor_ms["pod_rtt"] == pytest.approx(geo.floor_ms("TPE", "KHH"), abs=0.01) and p.probe.floor_ms["pod_rtt"] > 0
    with pytest.raises(ConfigError, match=r"colocate:pod.endpoints\[0\].location.*'NRT'.*TPE, KHH, HKG") as err:
        cell(existing([{**BY_IP, "location": "NRT"}]))
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize("endpoint, key, words", [
    ({"host": "203.0.113.9", "location": "TPE"}, "endpoints[0].host", "cannot fetch an IP literal"),
    ({"host": "gpu.local", "location": "TPE"}, "endpoints[0].host", "no public resolver"),
    ({"host": "gpu", "location": "TPE"}, "endpoints[0].host", "not a DNS name"),
    ({"ip": "192.168.1.20", "location": "TPE"}, "endpoints[0].ip", "not reachable from the internet"),
    ({"ip": "::1", "location": "TPE"}, "endpoints[0].ip", "not reachable from the internet"),
    ({"ip": "203.0.113.7", "host": "gpu.example.com", "location": "TPE"}, "endpoints[0]", "exactly one of host"),
    ({"host": "gpu.example.com"}, "endpoints[0].location", "colo nearest the box"),
    ({"host": "gpu.example.com", "location": "TPE", "port": 70000}, "endpoints[0].port", "TCP port"),
    ({"host": "gpu.example.com", "location": "TPE", "costPerHr": -1}, "endpoints[0].costPerHr", "at least 0"),
    ({"host": "gpu.example.com", "location": "TPE", "scheme": "http"}, "endpoints[0].scheme", "unknown key"),
])
def test_a_bad_endpoint_names_its_key_and_the_fix(endpoint, key, words):
    with pytest.raises(ConfigError, match=words) as err:
        cell(existing([endpoint]))
    assert f"colocate:pod.{key}" in str(err.value) and "Fix:" in str(err.value)


def test_the_hop_is_one_that_can_reach_every_endpoint_safely():
    with pytest.raises(ConfigError, match=r"endpoints\[0\].ip.*needs colocate:zone"):
        cell(existing([BY_IP], zone=False))
    # mutual TLS needs the kit's certificate, which only a name on the zone can get
    with pytest.raises(ConfigError, match=r"endpoints\[0\].host.*not on colocate:zone"):
        cell(existing([BY_NAME], hop="mtls"))
    # the pod token over TLS the box terminates needs a certificate the box holds for its name
    with pytest.raises(ConfigError, match=r"endpoints\[0\].ip.*token hop") as err:
        cell(existing([BY_IP], hop="token"))
    assert "Fix:" in str(err.value)
    with pytest.raises(ConfigError, match=r"endpoints\[1\].ip.*auto chose token"):
        cell(existing([BY_NAME, BY_IP]))  # one name off the zone, one named on it: no one hop fits both
    assert cell(existing([{"host": "gpu.example.com", "location": "TPE"}])).mtls  # a host on the zone: the kit's certificate
    assert not cell(existing([{"host": "gpu.example.com", "location": "TPE"}], hop="token")).mtls


def test_a_providers_shared_proxy_is_not_a_place_to_put_the_worker():
    proxied = {"host": "abc123-8000.proxy.runpod.net", "port": 443, "location": "NRT"}
    p = cell(existing([proxied], region="apac-jp", zone=False))
    assert p.worker.placement_mode == plan.PLACEMENT_TARGETED and not p.mtls
    raw = existing([proxied], region="apac-jp", zone=False)
    raw["worker"] = {**raw["worker"], "placement": "pod"}
    with pytest.raises(ConfigError, match="colocate:worker.placement.*shared proxy"):
        cell(raw)


def test_the_cell_runs_exactly_its_endpoints():
    with pytest.raises(MissingSetting, match="colocate:pod.endpoints"):
        cell(existing([]))
    with pytest.raises(ConfigError, match="colocate:pod.count.*one pod per endpoint"):
        cell(existing([BY_IP], count=2))
    assert cell(existing([BY_IP], count=1)).pods[0].endpoint.ip == "203.0.113.7"
    with pytest.raises(ConfigError, match="colocate:scale.*adds and removes none"):
        cell({**existing([BY_IP]), "scale": {"min": 1, "max": 2}})
    raw = raw_for("apac-jp")
    raw["pod"] = {**raw["pod"], "endpoints": [BY_NAME]}
    with pytest.raises(ConfigError, match="colocate:pod.endpoints.*provider existing"):
        cell(raw)
    with pytest.raises(ConfigError, match=r"endpoints\[1\].*endpoint 0 again"):
        cell(existing([BY_IP, dict(BY_IP)]))


def test_the_sandbox_runs_a_stand_in_for_each_endpoint():
    from colocate.sandbox.launch import Launch, build_plan

    p, notes = build_plan(Launch("apac-tw-own", str(plan.ROOT / "stacks"), None, None, (), False))
    assert p.pod_path == plan.PATH_LOCAL_HOSTNAME and len(p.pods) == 1 and p.pods[0].endpoint is None
    assert any("stand-in pod instead of each endpoint" in n and "colocate:pod.url" in n for n in notes)


def test_migrate_plan_checks_and_forgets_an_endpoint_never_creates_nor_deletes_it():
    from colocate.cell import migration

    before = cell(existing([BY_IP]))
    after = cell(existing([{**BY_IP, "port": 9443, "costPerHr": 0.5}]))
    actions = migration.diff(before, after)
    verbs = {a.verb: a for a in actions}
    assert "create" not in verbs and "delete" not in verbs
    assert "https://pod-apac-tw-g1.example.com:9443 (TPE), waited for" in verbs["check"].detail
    assert "keeps running: the kit never deletes it" in verbs["forget"].detail
    assert verbs["cost"].detail.startswith("$0.50/hr, your own figure")
