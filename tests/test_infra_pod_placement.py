"""Pod placement under the mock engine: placement.host wired from pod 0's output, refusals."""

from __future__ import annotations

import pulumi
import pytest

from colocate import outputs
from tests.support.pulumi_mocks import POD_STDOUT, RecordingMocks, run_program, stack_config

WORKER = "cloudflare:index/workersScript:WorkersScript"
COMMAND = "command:local:Command"
DNS = "cloudflare:index/dnsRecord:DnsRecord"
ZONE = {"id": "f" * 32, "name": "example.com"}


def test_placement_host_is_pod_0s_record_and_the_port_its_create_printed():
    config, keys = stack_config("apac-jp", overrides={"zone": ZONE, "worker": {"subdomain": "acme", "placement": "pod"}})
    run = run_program("apac-jp", config, keys)
    record = run.mocks.one(DNS, "-pod-dns-0").inputs
    host = f"{record['name']}:{POD_STDOUT['port']}"
    assert record["name"] == "pod-apac-jp-g1.example.com" and record["proxied"] is False
    assert run.mocks.one(WORKER).inputs["placement"] == {"host": host}
    assert run.resolved[outputs.PLACEMENT_MODE] == "pod" and run.resolved[outputs.PLACEMENT_HOST] == host
    probe = run.mocks.one(COMMAND, "-probe").inputs["create"]
    assert f"--placement-mode pod --placement-host {host}" in probe


def test_targeted_cells_export_their_mode_and_no_host():
    config, keys = stack_config("apac-jp")  # RunPod's proxy path: auto is targeted
    run = run_program("apac-jp", config, keys)
    assert run.resolved[outputs.PLACEMENT_MODE] == "targeted" and run.resolved[outputs.PLACEMENT_HOST] is None
    assert "--placement-mode targeted" in run.mocks.one(COMMAND, "-probe").inputs["create"]
    assert "--placement-host" not in run.mocks.one(COMMAND, "-probe").inputs["create"]


@pytest.mark.parametrize("stack, why", [("apac-jp", "anycast"), ("sandbox", "localhost")])
def test_pod_mode_without_a_single_homed_address_stops_before_any_resource(stack, why):
    config, keys = stack_config(stack, overrides={"worker": {"subdomain": "acme", "placement": "pod"}})
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as err:
        run_program(stack, config, keys, mocks=mocks)
    msg = str(err.value)
    assert msg.startswith("colocate:worker.placement") and "'pod'" in msg and why in msg
    assert "Fix:" in msg and "placement targeted" in msg
    assert mocks.resources == []
