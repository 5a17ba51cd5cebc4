"""The pod hop's certificates never lapse unseen (colocate/cell/certexpiry.py): the stack exports the
earliest leaf's end (hopCertsNotAfter), the post-deploy probe is handed it, and the probe (and
the live view) warn 30 days ahead and fail 7 days ahead, naming the way out."""

from __future__ import annotations

import importlib.util
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from colocate.cell import certexpiry
from tests.support import fake_cell
from tests.support.images import GUARDED_IMAGE
from tests.support.pulumi_mocks import MOCK_NOT_AFTER, run_program, stack_config

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 12, 6, tzinfo=UTC)
ZONE = {"id": "f" * 32, "name": "example.com"}


def at(days: float) -> str:
    return (NOW + timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(("days", "level"), [(90, "ok"), (30.5, "ok"), (30, "warn"), (8, "warn"), (7, "fail"),
                                             (0.5, "fail"), (-2, "fail")])
def test_the_verdict_warns_30_days_ahead_and_fails_7(days, level):
    v = certexpiry.check(at(days), NOW, "us-east")
    assert v.level == level
    if level != "ok":
        assert "pulumi up -s us-east" in v.message and "side by side" in v.message
    if days < 0:
        assert "expired" in v.message and "fallback" in v.message


def test_the_stack_exports_the_earliest_leaf_end_and_hands_it_to_the_probe():
    config, keys = stack_config("us-east", overrides={"zone": ZONE, "pod": {"provider": "runpod"}})
    run = run_program("us-east", config, keys)
    assert run.resolved["hopCertsNotAfter"] == MOCK_NOT_AFTER
    probe = next(r.inputs["create"] for r in run.mocks.of_type("command:local:Command")
                 if "probe.py" in r.inputs.get("create", ""))
    assert f"--hop-not-after {MOCK_NOT_AFTER}" in probe


def test_a_token_hop_has_no_certificates_to_watch():
    # RunPod's proxy (the stack without its zone): the pod token behind the pod's guard (the kit's image)
    config, keys = stack_config("us-east", drop=("zone",),
                                overrides={"pod": {"provider": "runpod", "image": GUARDED_IMAGE}})
    run = run_program("us-east", config, keys)
    assert run.resolved["hopCertsNotAfter"] is None
    probe = next(r.inputs["create"] for r in run.mocks.of_type("command:local:Command")
                 if "probe.py" in r.inputs.get("create", ""))
    assert "--hop-not-after" not in probe


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_script_certs", ROOT / "scripts" / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("days", "code", "level"), [(60, 0, "ok"), (20, 0, "warn"), (3, 1, "fail")])
def test_the_probe_judges_the_certificates_beside_its_budgets(probe, capsys, monkeypatch, days, code, level):
    monkeypatch.setenv("COLOCATE_CLIENT_KEY", "clc_given")
    not_after = (datetime.now(UTC) + timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")
    with fake_cell.serve() as cell:
        got = probe.main([cell.url, "--token", "probe-secret", "--samples", "3", "--pod-location", "AP-JP-1",
                          "--hop-not-after", not_after, "--json", "-"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert got == code, err
    assert doc["hop_certificates"]["level"] == level and doc["hop_certificates"]["not_after"] == not_after
    assert ("hop certificates: FAIL" in err) is (level == "fail") and ("expire in" in err) is (level != "ok")


def test_the_way_out_says_the_keeper_renews_one_pod_at_a_time_and_an_up_all_at_once_as_colocate_rollout_does():
    from colocate.cell import rollout
    from infra.hop import EARLY_RENEWAL_HOURS

    message = certexpiry.check(MOCK_NOT_AFTER, datetime(2027, 3, 1, tzinfo=UTC), "us-east").message
    assert "scripts/scale.py run --stack us-east" in message and "one pod at a time" in message
    assert f"inside the last {EARLY_RENEWAL_HOURS // 24} days" in message and "all at once" in message
    assert rollout.ONE_AT_A_TIME is False and "side by side" in message and rollout.CREATE_BEFORE_DELETE
    # the keeper's window opens before any `pulumi up` would re-issue them all
    assert certexpiry.RENEW_DAYS > EARLY_RENEWAL_HOURS // 24


def test_endpoints_the_team_runs_are_told_that_an_up_re_issues_theirs_and_waits_for_the_box(probe, capsys, monkeypatch):
    # provider existing: no keeper can install a box's certificate; an up re-issues it from the first warning
    # (infra/hop.py: the endpoints' ACME min_days_remaining is RENEW_DAYS) and waits until the box serves it.
    message = certexpiry.check(MOCK_NOT_AFTER, datetime(2027, 3, 1, tzinfo=UTC), "apac-tw-own", endpoints=True).message
    assert f"`pulumi up -s apac-tw-own` re-issues theirs from {certexpiry.RENEW_DAYS} days left" in message
    assert "waits until each box serves its new one" in message and "replaced" not in message
    monkeypatch.setenv("COLOCATE_CLIENT_KEY", "clc_given")
    not_after = (datetime.now(UTC) + timedelta(days=20)).strftime("%Y-%m-%dT%H:%M:%SZ")
    with fake_cell.serve() as cell:
        assert probe.main([cell.url, "--token", "probe-secret", "--samples", "3", "--pod-location", "TPE",
                           "--expect-region", "apac-tw", "--pod-path", "endpoint", "--hop-not-after", not_after,
                           "--json", "-"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["hop_certificates"]["level"] == "warn" and "your endpoints" in doc["hop_certificates"]["message"]
