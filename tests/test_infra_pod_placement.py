"""Pod placement under the mock engine: placement.host wired from pod 0's output, refusals."""

from __future__ import annotations

import json

import pulumi
import pytest

from colocate.cell import outputs
from colocate.cell.plan import instance_host
from tests.support.images import GUARDED_IMAGE
from tests.support.pulumi_mocks import POD_STDOUT, RecordingMocks, run_program, stack_config
from tests.test_infra_cell import placement_of

WORKER = "cloudflare:index/workersScript:WorkersScript"
COMMAND = "command:local:Command"
DNS = "cloudflare:index/dnsRecord:DnsRecord"
ZONE = {"id": "f" * 32, "name": "example.com"}


def test_placement_host_is_pod_0s_record_and_the_port_its_create_printed():
    config, keys = stack_config("apac-jp", overrides={"zone": ZONE, "worker": {"subdomain": "acme", "placement": "pod"}})
    run = run_program("apac-jp", config, keys)
    record = run.mocks.one(DNS, "-pod-dns-0").inputs
    host = f"{record['name']}:{POD_STDOUT['port']}"
    assert record["name"] == instance_host("pod-apac-jp-g1.example.com", "runpod", POD_STDOUT["id"])
    assert record["proxied"] is False
    assert placement_of(run) == {"host": host}
    assert run.resolved[outputs.PLACEMENT_MODE] == "pod" and run.resolved[outputs.PLACEMENT_HOST] == host
    probe = run.mocks.one(COMMAND, "-probe").inputs["create"]
    assert f"--placement-mode pod --placement-host {host}" in probe


def test_targeted_cells_export_their_mode_and_no_host():
    # RunPod's proxy path (the stack without its zone, on the kit's image): auto is targeted
    config, keys = stack_config("apac-jp", drop=("zone",), overrides={"pod": {"provider": "runpod", "image": GUARDED_IMAGE}})
    run = run_program("apac-jp", config, keys)
    assert run.resolved[outputs.PLACEMENT_MODE] == "targeted" and run.resolved[outputs.PLACEMENT_HOST] is None
    assert "--placement-mode targeted" in run.mocks.one(COMMAND, "-probe").inputs["create"]
    assert "--placement-host" not in run.mocks.one(COMMAND, "-probe").inputs["create"]


@pytest.mark.parametrize("stack, why", [("apac-jp", "anycast"), ("sandbox", "localhost")])
def test_pod_mode_without_a_single_homed_address_stops_before_any_resource(stack, why):
    unzoned = {"drop": ("zone",), "pod": {"provider": "runpod", "image": GUARDED_IMAGE}} if stack == "apac-jp" else {}
    config, keys = stack_config(stack, drop=unzoned.pop("drop", ()),
                                overrides={"worker": {"subdomain": "acme", "placement": "pod"}, **unzoned})
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as err:
        run_program(stack, config, keys, mocks=mocks)
    msg = str(err.value)
    assert msg.startswith("colocate:worker.placement") and "'pod'" in msg and why in msg
    assert "Fix:" in msg and "placement targeted" in msg
    assert mocks.resources == []


def test_placement_is_applied_by_the_settings_call_after_each_upload():
    # terraform-provider-cloudflare #6785/#6936: the provider treats placement.region/host as
    # read-only, so the upload carries none and scripts/placement.py sets it.
    from tests.support.pulumi_mocks import unsecret

    config, keys = stack_config("apac-jp", overrides={"zone": ZONE})
    run = run_program("apac-jp", config, keys)
    assert "placement" not in run.mocks.one(WORKER).inputs
    cmd = run.mocks.one(COMMAND, "-placement").inputs
    assert cmd["create"] == (".venv/bin/python scripts/placement.py apply --account 0123456789abcdef0123456789abcdef "
                             "--script colocate-apac-jp")
    assert "delete" not in cmd  # destroy removes the script, and its settings with it
    is_secret, env = unsecret(cmd["environment"])
    assert is_secret and env == {"CLOUDFLARE_API_TOKEN": "cf-token-s3cret"}
    assert "cf-token-s3cret" not in cmd["create"] + cmd["stdin"]
    host = f"{instance_host('pod-apac-jp-g1.example.com', 'runpod', POD_STDOUT['id'])}:41234"
    # Re-applied when the block, what the upload carries, a pod or the Worker's hop certificate
    # changes; never on the script's modified_on, which the settings call itself may bump.
    assert cmd["triggers"][0] == f'{{"host": "{host}"}}' and len(cmd["triggers"]) == 4
    assert json.loads(cmd["triggers"][2])["id"] == POD_STDOUT["id"]
    assert cmd["triggers"][3] == run.mocks.one("cloudflare:index/mtlsCertificate:MtlsCertificate").name + "-id"


def test_placement_is_reapplied_whenever_the_script_uploads_again():
    from tests.support.pulumi_mocks import SECRET_VALUES

    def upload_trigger(secrets=None, overrides=None) -> str:
        config, keys = stack_config("apac-jp", overrides={"zone": ZONE, **(overrides or {})}, secrets=secrets)
        triggers = run_program("apac-jp", config, keys).mocks.one(COMMAND, "-placement").inputs["triggers"]
        assert not any(v in json.dumps(triggers) for v in SECRET_VALUES.values())  # digested, never declared
        return triggers[1]

    first = upload_trigger()
    assert upload_trigger() == first
    # A rotated secret re-uploads the script (its secret_text binding), so placement is applied again.
    assert upload_trigger(secrets={**SECRET_VALUES, "adminToken": "rotated-admin-token"}) != first
    assert upload_trigger(overrides={"worker": {"subdomain": "acme", "deadlineMs": 1234}}) != first
