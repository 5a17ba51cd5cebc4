"""Every configuration error ends the program with pulumi.RunError naming key, value and fix."""

from __future__ import annotations

import json

import pulumi
import pytest

from tests.support.pulumi_mocks import SECRET_VALUES, run_program, stack_config
from tests.test_ledger import assert_runnable_command


def refused(stack="apac-jp", **kwargs) -> str:
    config, keys = stack_config(stack, **kwargs)
    with pytest.raises(pulumi.RunError) as err:
        run_program(stack, config, keys)
    return str(err.value)


def test_unknown_region_lists_the_known_ones():
    msg = refused(overrides={"region": "ap-mars"})
    assert "colocate:region" in msg and "'ap-mars'" in msg
    for known in ("apac-tw", "apac-jp", "us-east", "us-west", "eu-west"):
        assert known in msg


def test_runpod_cannot_serve_taiwan_and_the_message_suggests_vastai():
    msg = refused("apac-tw", overrides={"pod": {"provider": "runpod"}})
    assert "colocate:pod.provider" in msg and "'runpod'" in msg and "vastai" in msg


def test_vastai_cannot_pin_us_east():
    msg = refused("us-east", overrides={"pod": {"provider": "vastai"}})
    assert "colocate:pod.provider" in msg and "runpod" in msg


def test_missing_account_id():
    msg = refused("apac-jp", drop=("accountId",))
    assert "colocate:accountId" in msg and "pulumi config set colocate:accountId" in msg


@pytest.mark.parametrize("secret", ["podToken", "readToken", "adminToken", "exchangeToken", "fallbackUrl", "fallbackApiKey",
                                    "runpodApiKey"])
def test_missing_secrets(secret, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    secrets = {k: v for k, v in SECRET_VALUES.items() if k != secret}
    msg = refused("apac-jp", secrets=secrets)
    assert f"colocate:{secret}" in msg and "pulumi config set --secret" in msg


def test_a_plain_http_fallback_is_refused_without_showing_it():
    msg = refused(secrets={**SECRET_VALUES, "fallbackUrl": "http://fallback.example.com"})
    assert "colocate:fallbackUrl" in msg and "https://" in msg and "'http'" in msg
    assert "fallback.example.com" not in msg and "pulumi config set --secret colocate:fallbackUrl" in msg


def test_provider_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RUNPOD_API_KEY", "from-env")
    secrets = {k: v for k, v in SECRET_VALUES.items() if k != "runpodApiKey"}
    config, keys = stack_config("apac-jp", secrets=secrets)
    run = run_program("apac-jp", config, keys)
    assert run.resolved["activeGeneration"] == "apac-jp.g1"
    # Not declared (nor saved in state): the pod commands inherit the environment of the
    # `pulumi` that runs them, so a delete after a rotation uses the key exported then.
    pod = next(r for r in run.mocks.resources if r.name.endswith("-pod-0"))
    assert "RUNPOD_API_KEY" not in json.dumps(pod.inputs.get("environment"))
    assert not any("from-env" in json.dumps(r.inputs, default=str) for r in run.mocks.resources)


def test_missing_cloudflare_token(monkeypatch):
    monkeypatch.delenv("CLOUDFLARE_API_TOKEN", raising=False)
    config, keys = stack_config("apac-jp")
    del config["cloudflare:apiToken"]
    with pytest.raises(pulumi.RunError, match="cloudflare:apiToken"):
        run_program("apac-jp", config, keys)


@pytest.mark.parametrize("budgets, key", [
    ({"state": -5}, "colocate:budgets.state"),
    ({"state": "fast"}, "colocate:budgets.state"),
    ({"latency": 10}, "colocate:budgets.latency"),
    ([10, 20], "colocate:budgets"),
])
def test_malformed_budgets(budgets, key):
    msg = refused(overrides={"budgets": budgets})
    assert key in msg and "Fix:" in msg


@pytest.mark.parametrize("ledger, found", [
    ([{"name": "apac-jp.g1", "region": "apac-jp", "status": "retired"}], "found 0"),
    ([{"name": "apac-jp.g1", "region": "apac-jp", "status": "active"},
      {"name": "apac-jp.g2", "region": "apac-jp", "status": "active"}], "found 2"),
])
def test_ledger_needs_exactly_one_active_generation(ledger, found):
    msg = refused(overrides={"generations": ledger})
    assert "colocate:generations" in msg and found in msg


def test_changing_only_the_region_is_refused_with_the_migrate_command():
    # The hand-rolled move: compute to Taiwan, ledger untouched.
    msg = refused("apac-jp", overrides={"region": "apac-tw", "pod": {"provider": "vastai"}})
    assert "apac-jp.g1 lives in apac-jp" in msg
    assert_runnable_command(msg, "scripts/migrate.py start --stack apac-jp --to apac-tw")


@pytest.mark.parametrize("overrides, key", [
    ({"podRegion": "apac-tw"}, "colocate:podRegion"),
    ({"stateRegion": "us-east"}, "colocate:stateRegion"),
    ({"pod": {"provider": "runpod", "region": "us-east"}}, "colocate:pod.region"),
    ({"pod": {"provider": "runpod", "locations": ["US-GA-1"]}}, "colocate:pod.locations"),
    ({"worker": {"subdomain": "acme", "placementRegion": "aws:us-east-1"}}, "colocate:worker.placementRegion"),
    ({"generations": [{"name": "us-east.g1", "region": "us-east", "status": "active"}]}, "colocate:region"),
])
def test_no_key_can_split_pod_worker_and_state(overrides, key):
    msg = refused("apac-jp", overrides=overrides)
    assert key in msg


def test_the_program_runs_under_mocks_after_a_test_that_left_no_event_loop():
    # asyncio.run() ends by setting no loop; a Pulumi mock run later in the same worker found none
    # ("There is no current event loop", test_infra_existing in make test's shared workers).
    import asyncio

    from tests.support.pulumi_mocks import run_program, stack_config

    asyncio.run(asyncio.sleep(0))
    config, keys = stack_config("apac-jp")
    assert run_program("apac-jp", config, keys).exports
