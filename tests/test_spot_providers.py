"""Interruptible pods (colocate:pod.market) against the fake Vast.ai and RunPod v2 APIs, which hold every
call to the vendors' specs (tests/support/fake_providers.py): Vast.ai rents them by bid (the search's
``type: bid`` and ``min_bid``, the create's ``price``), spreads them over hosts and countries, reports an
outbid one dead; the keeper calls it preempted and replaces it alone, on another host; ``mix`` rents on
demand when no interruptible capacity is left, ``interruptible`` does not (the fallback and the fleet
carry the gap); RunPod v2 cannot rent one, and says so before anything is rented."""

from __future__ import annotations

import pytest

from colocate.pods import lifecycle, spec as spec_mod
from colocate.pods.base import PodInfo
from colocate.pods.errors import CapacityError, PodConfigError
from colocate.pods.vastai import OUTBID, spread
from colocate.scaling.controller import Controller
from colocate.scaling.keeper import DEAD, PREEMPTED, Keeper
from tests.support.fake_providers import offer
from tests.support.keeping import Generation, ProviderCell, pod_plans, spec_of
from tests.test_pod_providers import env, fake_runpod, fake_vast, make_spec  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow  # real stand-in pods behind the fake APIs


def controller(cell: ProviderCell, gen: Generation) -> Controller:
    k = Keeper(cell, checkout_hash=None, say=lambda line: None, backoff_s=0.0)
    return Controller(gen, cell, None, owner="spot-test", say=lambda line: None, backoff_s=0.0, keeper=k)


def interruptible_cell(count: int = 1, **market) -> ProviderCell:
    cell = ProviderCell(pod_plans("t1", "apac-tw", "vastai", count, **{"market": "interruptible", "bid_per_hr": 0.25,
                                                                        **market}))
    cell.deploy_all()
    return cell


def instance(fake, pod_id: str) -> dict:
    return fake.instances[int(pod_id)]


def test_an_interruptible_pod_is_rented_by_bid_and_says_so(fake_vast):  # noqa: F811
    fake_vast.offers = [offer(41, "TW", 0.50, min_bid=0.20), offer(42, "TW", 0.40, min_bid=0.30)]
    cell = interruptible_cell()
    made = cell.made[0]
    search = fake_vast.calls("POST", "/api/v0/bundles")[-1]
    assert search["type"] == "bid" and search["min_bid"] == {"lte": 0.25} and "dph_total" not in search
    rent = fake_vast.calls("PUT", "/api/v0/asks/41")
    assert len(rent) == 1 and rent[0]["price"] == 0.25  # offer 42's least bid is above ours: never asked
    inst = instance(fake_vast, made["id"])
    assert inst["is_bid"] and made["market"] == "interruptible" and made["cost_per_hr"] == 0.25


def test_an_on_demand_pod_carries_no_bid(fake_vast):  # noqa: F811
    fake_vast.offers = [offer(41, "TW", 0.50)]
    cell = ProviderCell(pod_plans("t1", "apac-tw", "vastai", 1))
    cell.deploy_all()
    search, rent = fake_vast.calls("POST", "/api/v0/bundles")[-1], fake_vast.calls("PUT", "/api/v0/asks/41")[0]
    assert "type" not in search and search["dph_total"] == {"lte": 0.8} and "price" not in rent
    assert cell.made[0]["market"] == "ondemand"


def test_an_outbid_pod_is_preempted_and_replaced_alone_on_another_host(fake_vast):  # noqa: F811
    # two hosts in Taiwan; the cheaper one takes pod 0, then pod 1 spreads to the other
    fake_vast.offers = [offer(41, "TW", 0.40, min_bid=0.10, machine=7), offer(42, "TW", 0.40, min_bid=0.11, machine=7),
                        offer(43, "TW", 0.45, min_bid=0.15, machine=8), offer(44, "TW", 0.45, min_bid=0.16, machine=8),
                        offer(45, "TW", 0.50, min_bid=0.20, machine=9)]
    cell = interruptible_cell(2)
    hosts = [instance(fake_vast, cell.made[i]["id"])["machine_id"] for i in (0, 1)]
    assert hosts == [7, 8]  # spread: pod 1 passes over the cheaper bid on pod 0's host
    keep, old = dict(cell.made[0]), dict(cell.made[1])
    fake_vast.outbid(old["id"])  # a higher bid takes host 8: stopped, its processes killed
    gen = Generation()
    ctl = controller(cell, gen)
    ctl.step()
    assert cell.replacements == [[1]] and cell.made[0] == keep  # alone, in one pass
    verdicts = {e["outcome"]: e for e in gen.keeper["events"] if e["pod"] == 1}
    assert verdicts["replaced"]["reason"] == PREEMPTED and OUTBID in verdicts["replacing"]["detail"]
    assert "on host 8" in verdicts["replacing"]["detail"]
    # never the host it was outbid on, nor pod 0's while another is free: host 9, dearer but its own
    assert instance(fake_vast, cell.made[1]["id"])["machine_id"] == 9
    assert {"pod": 1, "reason": PREEMPTED, "n": 1} in gen.keeper["replacements"]
    ctl.step()  # both serve: nothing more
    assert cell.replacements == [[1]] and [p["state"] for p in gen.keeper["pods"]] == ["ok", "ok"]


def test_an_interruptible_pod_that_exits_is_preempted_too_an_on_demand_one_is_dead(fake_vast):  # noqa: F811
    fake_vast.offers = [offer(41 + i, "TW", 0.40 + i / 100, machine=7 + i) for i in range(5)]  # one rent each
    cell = ProviderCell(pod_plans("t1", "apac-tw", "vastai", 2, market="mix", on_demand_floor=1, bid_per_hr=0.3))
    cell.deploy_all()
    assert [cell.made[i]["market"] for i in (0, 1)] == ["ondemand", "interruptible"]
    for i in (0, 1):
        fake_vast.set_status(cell.made[i]["id"], "exited")
    gen = Generation()
    controller(cell, gen).step()
    reasons = {r["pod"]: r["reason"] for r in gen.keeper["replacements"]}
    assert reasons == {0: DEAD, 1: PREEMPTED} and cell.replacements == [[0, 1]]


def test_a_mix_rents_on_demand_when_no_interruptible_capacity_is_left(fake_vast):  # noqa: F811
    fake_vast.offers = [offer(41, "TW", 0.50, min_bid=0.40)]  # its least bid is above ours
    cell = ProviderCell(pod_plans("t1", "apac-tw", "vastai", 2, market="mix", on_demand_floor=1, bid_per_hr=0.3))
    cell.plans = cell.plans[1:]  # pod 1 alone: interruptible, allowed to fall back
    made = lifecycle.create(spec_of(cell.plans[0]))
    assert made["market"] == "ondemand" and not instance(fake_vast, made["id"])["is_bid"]
    searches = fake_vast.calls("POST", "/api/v0/bundles")
    assert [s.get("type") for s in searches] == ["bid", None]  # a bid first, then on demand
    assert "price" not in fake_vast.calls("PUT", "/api/v0/asks/41")[-1]


def test_an_interruptible_cell_rents_nothing_on_demand_and_its_keeper_alerts_on_the_third_failure(fake_vast):  # noqa: F811
    fake_vast.offers = [offer(41, "TW", 0.40, min_bid=0.10, machine=7)]
    cell = interruptible_cell(1)
    fake_vast.outbid(cell.made[0]["id"])  # and no other host takes our bid
    gen = Generation()
    alerts = controller(cell, gen).run(0.0, steps=5, stop_on_alert=True)
    assert [a["name"] for a in alerts] == ["replace_failed"]
    assert all("price" in r for r in fake_vast.calls("PUT", "/api/v0/asks/"))  # never on demand
    failed = [e for e in gen.keeper["events"] if e["outcome"] == "failed"]
    assert len(failed) == 3 and "no capacity" in failed[-1]["detail"]
    with pytest.raises(CapacityError):  # the create itself: the outbid host is left out
        lifecycle.create(spec_of(cell.plans[0]))


def test_runpod_cannot_rent_an_interruptible_pod_and_says_so_before_renting(fake_runpod, env):  # noqa: F811
    spec = make_spec("apac-jp", "runpod")
    spec["market"] = "interruptible"
    with pytest.raises(PodConfigError, match="CreatePodRequest"):
        spec_mod.PodSpec.from_dict(spec)
    assert fake_runpod.calls("POST", "/v2/pods") == [] and fake_runpod.live() == []


def test_a_runpod_pod_is_on_demand_and_one_that_exits_is_dead_not_preempted(fake_runpod):  # noqa: F811
    cell = ProviderCell(pod_plans("t1", "us-east", "runpod", 1))
    cell.deploy_all()
    assert cell.made[0]["market"] == "ondemand"
    fake_runpod.set_status(cell.made[0]["id"], "EXITED")
    gen = Generation()
    controller(cell, gen).step()
    assert [r["reason"] for r in gen.keeper["replacements"]] == [DEAD]


# --- spreading, pure ---

def pod(host: str, country: str, raw: str = "running", state: str = "running") -> PodInfo:
    return PodInfo("i", "n", state, raw, location=country, host=host, market="interruptible")


def test_spread_leaves_out_an_outbid_host_and_puts_held_hosts_and_countries_last():
    offers = [offer(1, "TW", 0.4, min_bid=0.10, machine=1), offer(2, "TW", 0.4, min_bid=0.11, machine=2),
              offer(3, "JP", 0.4, min_bid=0.12, machine=3), offer(4, "TW", 0.4, min_bid=0.13, machine=4)]
    for o in offers:
        o["geolocation"] = o["geolocation"].split(",")[0] + ", " + ("JP" if o["id"] == 3 else "TW")
    stack = [pod("1", "TW", OUTBID, "dead"), pod("2", "TW")]
    assert [o["id"] for o in spread(offers, stack)] == [3, 4, 2]  # 1 never; 2 holds a pod; TW holds one
    assert [o["id"] for o in spread(offers, [])] == [1, 2, 3, 4]  # cheapest bid first


def test_a_vast_instance_stopped_while_meant_to_run_is_dead_not_starting(monkeypatch):
    # Vast.ai stops an outbid interruptible instance (its processes killed) and it waits, stopped, for its
    # host back: while the renter means it to run it serves nothing, so it is dead, not "starting"
    monkeypatch.setenv("VASTAI_API_KEY", "k")
    from colocate.pods.vastai import VastAI

    vast = VastAI()
    base = {"id": 1, "label": "n", "actual_status": "stopped", "intended_status": "running", "machine_id": 8}
    outbid = vast._info({**base, "is_bid": True})
    assert (outbid.state, outbid.raw_state, outbid.market, outbid.host) == ("dead", OUTBID, "interruptible", "8")
    ended = vast._info({**base, "is_bid": False})  # an on-demand contract its host ended
    assert (ended.state, ended.raw_state, ended.market) == ("dead", "stopped by its host", "ondemand")
    asked = vast._info({**base, "intended_status": "stopped", "is_bid": True})  # stopped as asked: not a failure
    assert asked.state == "starting"
    vast.close()
