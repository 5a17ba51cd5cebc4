"""The sandbox's emulated platform under pod placement: the Worker follows the stand-in pod,
even when the catalogue's cloud hint for the region is wrong."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from colocate import stackfile
from colocate.cell import catalogue
from colocate.sandbox import supervisor
from colocate.sandbox.geography import Geography, landing_site, worker_site
from tests.support.sandbox import sandbox_stacks


def launch(stacks, client="NRT"):
    return supervisor.Launch("sandbox", str(stacks), client, None, (), False)


@pytest.fixture
def jp_stacks(tmp_path):
    """The sandbox stack moved (with its ledger) to apac-jp."""
    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    stackfile.write_config("sandbox", {"region": "apac-jp", "generations": [
        {"name": "apac-jp.g1", "region": "apac-jp", "status": "active"}]}, stacks)
    return stacks


@pytest.fixture
def wrong_hint(monkeypatch):
    """apac-jp's catalogue entry with a cloud hint on the wrong continent (a deliberate error):
    its hint and hint colo say Virginia, its pods (and the stand-in) are in Tokyo."""
    right = catalogue.REGIONS["apac-jp"]
    monkeypatch.setitem(catalogue.REGIONS, "apac-jp",
                        dataclasses.replace(right, placement_region="aws:us-east-1", edge_site="IAD"))
    return right


def placed(stacks, mode, client="NRT"):
    stackfile.write_config("sandbox", {"worker": {"subdomain": "sandbox", "placement": mode}}, stacks)
    plan, _ = supervisor.build_plan(launch(stacks, client))
    return plan, supervisor.sites_for(plan, launch(stacks, client), "local")


def test_a_wrong_hint_misplaces_a_targeted_cell_and_pod_mode_places_it_right(jp_stacks, wrong_hint):
    plan, targeted = placed(jp_stacks, "targeted")
    assert plan.worker.placement == {"region": "aws:us-east-1"}
    assert (targeted.edge, targeted.pod) == ("IAD", "NRT")  # the hint wins: 10,900 km from the pod
    plan, pod = placed(jp_stacks, "pod")
    assert plan.worker.placement_mode == "pod" and plan.worker.placement_host.hostname == "localhost"
    assert (pod.edge, pod.pod) == ("NRT", "NRT")  # the pod wins
    model = Geography()
    assert model.rtt_ms(pod.edge, pod.pod) == model.same_site_ms < model.rtt_ms(targeted.edge, targeted.pod) / 10
    # The generation's first touch comes from where the Worker runs: pod mode pins it in Tokyo.
    assert landing_site(pod.edge, plan.state.hint) == "NRT"
    assert landing_site(targeted.edge, plan.state.hint) == "NRT"  # the apac hint still pulls it over, from afar


def test_auto_stays_targeted_in_the_sandbox_and_the_default_cell_is_unchanged(tmp_path):
    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    plan, _ = supervisor.build_plan(launch(stacks))
    sites = supervisor.sites_for(plan, launch(stacks), "local")
    assert plan.worker.placement_mode == "targeted" and (sites.edge, sites.pod) == ("IAD", "IAD")


def test_worker_site_per_mode():
    assert worker_site("pod", hint_site="IAD", client="LAX", pod="nrt") == "NRT"
    assert worker_site("targeted", hint_site="IAD", client="LAX", pod="NRT") == "IAD"
    assert worker_site("smart", hint_site="IAD", client="LAX", pod="NRT") == "LAX"


@pytest.mark.slow
def test_a_pod_mode_sandbox_runs_the_worker_at_the_stand_in_and_the_probe_agrees(tmp_path):
    import os
    import subprocess
    import sys

    stacks = sandbox_stacks(tmp_path / "stacks", compute_ms=5)
    stackfile.write_config("sandbox", {"worker": {"subdomain": "sandbox", "placement": "pod"}}, stacks)
    state_dir = tmp_path / "state"
    try:
        # A client in Tokyo: smart placement would run the Worker there; pod placement runs it
        # beside the stand-in, at us-east's local site (IAD).
        cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks, client_site="NRT")
        assert (cell["sites"]["edge"], cell["sites"]["pod"], cell["sites"]["client"]) == ("IAD", "IAD", "NRT")
        out = tmp_path / "probe.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "probe.py"),
                               cell["worker_url"], "--samples", "3", "--pod-location", "local", "--expect-region",
                               "us-east", "--placement-mode", "pod", "--json", str(out)],
                              env={**os.environ, "COLOCATE_READ_TOKEN": cell["read_token"], "COLOCATE_CLIENT_KEY": cell["key"]},
                              capture_output=True, text=True, timeout=120)
        result = json.loads(out.read_text())
        assert proc.returncode == 0, proc.stderr
        place = result["placement"]
        assert (place["mode"], place["ran"], place["pod_site"], place["at_pod"]) == ("pod", "IAD", "IAD", True)
    finally:
        supervisor.down(state_dir, quiet=True)
