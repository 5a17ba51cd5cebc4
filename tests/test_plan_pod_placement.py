"""Pod placement (colocate:worker.placement pod): the plan's side. Pure, no Pulumi."""

from __future__ import annotations

import pytest

from colocate.cell import migration, plan
from colocate.errors import ConfigError
from tests.test_plan import ZONE, cell, raw_for


def test_pod_mode_places_by_pod_0s_dns_name_and_the_port_from_its_output():
    p = cell(raw_for("apac-jp", "runpod", zone=ZONE, worker={"subdomain": "acme", "placement": "pod"}))
    w = p.worker
    assert p.pod.path == plan.PATH_ZONE_DNS and w.placement_mode == "pod"
    assert w.placement_host == plan.PlacementHost("pod-apac-jp-g1.example.com", 0, plan.POD_PORT_FROM_OUTPUT, "runpod")
    host = plan.instance_host("pod-apac-jp-g1.example.com", "runpod", "x")  # pod 0's record: its instance's name
    # The port is the provider's mapped one, read from pod 0's create output, not colocate:pod.port.
    assert w.placement_args({"id": "x", "port": 41234, "ip": "203.0.113.9"}) == {"host": f"{host}:41234"}
    assert w.placement == {"host": "<pod 0's instance>.pod-apac-jp-g1.example.com:<pod 0's public port>"}
    with pytest.raises(ValueError, match="pod 0's create output"):
        w.placement_args()
    argv = p.probe.argv(w.url, ["AP-JP-1"], "pod-apac-jp-g1.example.com:41234")
    assert argv[argv.index("--placement-mode") + 1] == "pod"
    assert argv[argv.index("--placement-host") + 1] == "pod-apac-jp-g1.example.com:41234"


def test_pod_is_the_default_on_zone_dns_and_targeted_elsewhere():
    zoned = cell(raw_for("apac-jp", "runpod", zone=ZONE))
    proxied = cell(raw_for("apac-jp", "runpod"))
    local = cell(raw_for("apac-jp", "local"))
    assert (zoned.worker.placement_mode, proxied.worker.placement_mode, local.worker.placement_mode) == (
        "pod", "targeted", "targeted")
    assert proxied.worker.placement_args() == {"region": "aws:ap-northeast-1"}
    assert "--placement-host" not in proxied.probe.argv(proxied.worker.url, ["AP-JP-1"])
    # An explicit choice is kept on zone-dns too.
    for mode, block in (("targeted", {"region": "aws:ap-northeast-1"}), ("smart", {"mode": "smart"})):
        p = cell(raw_for("apac-jp", "runpod", zone=ZONE, worker={"subdomain": "acme", "placement": mode}))
        assert p.worker.placement_mode == mode and p.worker.placement_args() == block


def test_pod_mode_is_refused_on_runpods_proxy_with_key_value_and_fix():
    with pytest.raises(ConfigError) as err:
        cell(raw_for("apac-jp", "runpod", worker={"subdomain": "acme", "placement": "pod"}))
    msg = str(err.value)
    assert err.value.key == "colocate:worker.placement" and err.value.value == "pod"
    assert "anycast" in msg and "colocate:zone" in msg and "placement targeted" in msg


def test_the_sandbox_places_by_its_stand_in():
    p = cell(raw_for("apac-jp", "local", worker={"subdomain": "acme", "placement": "pod"}))
    assert p.pod.path == plan.PATH_LOCAL_HOSTNAME and p.worker.placement_mode == "pod"
    assert p.worker.placement_args({"port": 5001}) == {"host": "localhost:5001"}


def test_unknown_placement_value_names_the_choices():
    with pytest.raises(ConfigError, match="colocate:worker.placement.*auto, pod, targeted, smart"):
        cell(raw_for("apac-jp", "runpod", worker={"subdomain": "acme", "placement": "near"}))


def zone_raw(gen="apac-jp.g1", **pod):
    raw = raw_for("apac-jp", "runpod", zone=ZONE)
    raw["generations"] = [{"name": gen, "region": "apac-jp", "status": "active"}]
    raw["pod"] = {"provider": "runpod", **pod}
    return raw


def plain(raw):
    return plan.plan_cell(migration.planning_settings(raw, "t"))


def test_a_renewal_shows_that_the_placement_host_follows_the_new_pod():
    before, after = plain(zone_raw()), plain(zone_raw(renewal=1))
    lines = [str(a) for a in migration.diff(before, after)]
    moved = [line for line in lines if "placement host" in line]
    assert moved == ["  update   Worker colocate-t: placement host changes from <pod 0's instance>.pod-apac-jp-g1."
                     "example.com:<pod 0's public port> to <the new pod 0's instance>.pod-apac-jp-g1.example.com:"
                     "<the new pod 0's public port> (pod 0 is replaced; Cloudflare probes the new address)"]
    # Nothing replaced, nothing said.
    assert not [a for a in migration.diff(before, plain(zone_raw())) if "placement" in a.detail]


def test_a_migration_shows_the_new_generations_pod_name():
    raw = zone_raw()
    after = dict(raw, generations=[{"name": "apac-jp.g1", "region": "apac-jp", "status": "draining"},
                                   {"name": "apac-jp.g2", "region": "apac-jp", "status": "active"}])
    lines = [str(a) for a in migration.diff(plain(raw), plain(after)) if "placement host" in a.detail]
    assert len(lines) == 1 and "from <pod 0's instance>.pod-apac-jp-g1.example.com:<pod 0's public port> to " \
                                "<the new pod 0's instance>.pod-apac-jp-g2.example.com:<the new pod 0's public port>" in lines[0]
