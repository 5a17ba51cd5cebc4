"""The keeper against fake RunPod v2 and Vast.ai APIs that hold every call to the vendors' specs
(tests/support/fake_providers.py): a pod that goes exited, offline, unknown, remapped or misplaced
after deploy is found through the provider's own API and replaced alone within two controller passes,
the cell's other pod untouched; a pod that cannot be replaced raises an alert on the third failure,
in the generation's record and in what ``run`` returns (scripts/scale.py exits 3 on it)."""

from __future__ import annotations

import pytest

from colocate.scaling.controller import Controller
from colocate.scaling.keeper import DEAD, GONE, MISPLACED, REMAPPED, Keeper
from tests.support.fake_providers import offer
from tests.support.keeping import Generation, ProviderCell, pod_plans
from tests.test_pod_providers import env, fake_runpod, fake_vast  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow  # real stand-in pods behind the fake APIs, two to four a test


def controller(cell: ProviderCell, gen: Generation, **keeper) -> Controller:
    k = Keeper(cell, checkout_hash=None, say=lambda line: None, backoff_s=0.0, **keeper)
    return Controller(gen, cell, None, owner="keeper-test", say=lambda line: None, backoff_s=0.0, keeper=k)


def passes_until_replaced(ctl: Controller, cell: ProviderCell, index: int, old_id: str, limit: int = 2) -> int:
    for n in range(1, limit + 1):
        ctl.step()
        if cell.made[index]["id"] != old_id:
            return n
    return 0


def runpod_cell() -> tuple[ProviderCell, Generation]:
    cell = ProviderCell(pod_plans("t1", "us-east", "runpod", 2))
    cell.deploy_all()
    return cell, Generation()


@pytest.mark.parametrize("status", ["EXITED", "ERROR", "TERMINATED", "reset", "moved"])
def test_a_runpod_pod_that_exits_fails_is_reset_or_moved_is_replaced_alone_within_two_passes(fake_runpod, status):  # noqa: F811
    cell, gen = runpod_cell()
    keep, old = dict(cell.made[0]), dict(cell.made[1])
    if status == "reset":
        fake_runpod.reset(old["id"])  # RUNNING again, its public port mapped anew
    elif status == "moved":
        fake_runpod.move(old["id"], "EU-NL-1")
    elif status == "TERMINATED":  # v2 answers a terminated pod 404: gone
        fake_runpod.set_status(old["id"], "TERMINATED")
    else:
        fake_runpod.set_status(old["id"], status)
    ctl = controller(cell, gen)
    assert passes_until_replaced(ctl, cell, 1, old["id"]) == 1
    expected = {"EXITED": DEAD, "ERROR": DEAD, "TERMINATED": GONE, "reset": REMAPPED, "moved": MISPLACED}[status]
    # alone: one targeted update of pod 1, pod 0 the same pod, never deleted
    assert cell.replacements == [[1]] and cell.made[0] == keep and keep["id"] not in cell.deleted
    assert {p["id"] for p in fake_runpod.live()} == {keep["id"], cell.made[1]["id"]}  # the old one is gone
    assert cell.made[1]["name"] != old["name"] and cell.made[1]["location"] in cell.plans[1].locations
    # recorded in the generation before the update (every `pulumi up` then names pod 1 the same), and the event
    assert gen.desired["replaced"] == {"1": 1}
    events = [(e["pod"], e["reason"], e["outcome"]) for e in gen.keeper["events"]]
    assert (1, expected, "replacing") in events and (1, expected, "replaced") in events
    assert {"pod": 1, "reason": expected, "n": 1} in gen.keeper["replacements"] and gen.keeper["alerts"] == []
    # the next pass finds both serving and changes nothing
    ctl.step()
    assert cell.replacements == [[1]] and [p["state"] for p in gen.keeper["pods"]] == ["ok", "ok"]


@pytest.mark.parametrize("status", ["exited", "offline", "unknown", "readdressed"])
def test_a_vast_instance_that_exits_goes_offline_or_moves_is_replaced_alone_within_two_passes(fake_vast, status):  # noqa: F811
    fake_vast.offers = [offer(41, "TW", 0.40), offer(42, "TW", 0.45), offer(43, "TW", 0.50)]
    cell = ProviderCell(pod_plans("t1", "apac-tw", "vastai", 2))
    cell.deploy_all()
    gen = Generation()
    keep, old = dict(cell.made[0]), dict(cell.made[1])
    if status == "readdressed":
        fake_vast.readdress(old["id"])
    else:
        fake_vast.set_status(old["id"], status)
    ctl = controller(cell, gen)
    assert passes_until_replaced(ctl, cell, 1, old["id"]) == 1
    assert cell.replacements == [[1]] and cell.made[0] == keep
    assert {str(i["id"]) for i in fake_vast.live()} == {keep["id"], cell.made[1]["id"]}
    reason = REMAPPED if status == "readdressed" else DEAD
    assert {"pod": 1, "reason": reason, "n": 1} in gen.keeper["replacements"]


def test_a_pod_that_cannot_be_replaced_raises_an_alert_on_the_third_failure_and_then_a_new_one_clears_it(fake_runpod):  # noqa: F811
    cell, gen = runpod_cell()
    old = cell.made[1]["id"]
    fake_runpod.set_status(old, "EXITED")
    fake_runpod.capacity = {dc: False for dc in cell.plans[1].locations}  # no GPU anywhere in the region
    ctl = controller(cell, gen)
    alerts = ctl.run(0.0, steps=5, stop_on_alert=True)
    assert [a["name"] for a in alerts] == ["replace_failed"] and alerts[0]["pod"] == 1
    failed = [e for e in gen.keeper["events"] if e["outcome"] == "failed"]
    assert len(failed) == 3 and "could not place" in failed[-1]["detail"]  # stopped on the third
    assert [a["name"] for a in gen.keeper["alerts"]] == ["replace_failed"] and gen.keeper["failures"] == {"1": 3}
    # every retry kept the count it recorded first: one new name, tried three times
    assert gen.desired["replaced"] == {"1": 1} and cell.made[1]["id"] == old
    # capacity returns: the next pass replaces it and the alert clears
    fake_runpod.capacity = {}
    ctl.retry_at = None
    assert ctl.run(0.0, steps=1) == []
    assert cell.made[1]["id"] != old and gen.keeper["alerts"] == [] and gen.keeper["failures"] == {}
