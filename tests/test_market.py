"""colocate:pod.market (colocate/cell/market.py): which pods are rented on demand and which interruptible,
the spare pods, the settings that choose them and what the plan declares. Pure and fast: settings.parse,
plan_cell, PodSpec and scale.decide only."""

from __future__ import annotations

import pytest

from colocate.cell import market, plan, settings
from colocate.errors import ConfigError
from colocate.pods.errors import PodConfigError
from colocate.pods.spec import PodSpec
from colocate.scaling import policy as scale

SECRETS = frozenset({"podToken", "probeToken", "fallbackUrl", "fallbackApiKey", "vastaiApiKey", "runpodApiKey"})
ZONE = {"id": "f" * 32, "name": "example.com"}


def raw(pod: dict | None = None, **over) -> dict:
    r = {
        "region": "apac-tw",
        "generations": [{"name": "apac-tw.g1", "region": "apac-tw", "status": "active"}],
        "accountId": "0123456789abcdef0123456789abcdef",
        "pod": {"provider": "vastai", "gpu": "RTX 4090", **(pod or {})},
        "zone": ZONE,
        "fallbackModel": "gpt-4o-mini",
        "fallbackCap": {"cellUsdPerDay": 20},
        "fallbackPrice": {"input": 0.15, "output": 0.6},
    }
    r.update(over)
    return r


def parse(pod: dict | None = None, **over) -> settings.Settings:
    return settings.parse(raw(pod, **over), "t", secrets=SECRETS)


# --- the policy ---

@pytest.mark.parametrize("mkt, floor, expect", [
    ("ondemand", 1, ["ondemand"] * 4),
    ("interruptible", 1, ["interruptible"] * 4),  # the floor is mix's alone
    ("mix", 1, ["ondemand", "interruptible", "interruptible", "interruptible"]),
    ("mix", 2, ["ondemand", "ondemand", "interruptible", "interruptible"]),
    ("mix", 0, ["interruptible"] * 4),
])
def test_each_index_has_one_market_whatever_the_count(mkt, floor, expect):
    assert [market.pod_market(mkt, floor, i).market for i in range(4)] == expect


def test_only_mixs_interruptible_pods_fall_back_to_on_demand():
    assert market.pod_market("mix", 1, 1).on_demand_fallback
    assert not market.pod_market("mix", 1, 0).on_demand_fallback  # already on demand
    assert not market.pod_market("interruptible", 1, 3).on_demand_fallback  # the fleet and the fallback carry its gap
    assert not market.pod_market("ondemand", 1, 0).on_demand_fallback


@pytest.mark.parametrize("needed, mkt, spare, declared", [
    (0, "interruptible", 1, 0),  # no pod serves: no spare either (the scale-to-zero night)
    (1, "interruptible", 1, 2), (3, "mix", 2, 5), (2, "ondemand", 1, 2), (2, "interruptible", 0, 2),
])
def test_spare_pods_join_any_count_above_zero_and_only_interruptible_ones(needed, mkt, spare, declared):
    assert market.with_spare(needed, mkt, spare) == declared
    assert market.needed_of(declared, mkt, spare) == needed


# --- the settings ---

def test_the_default_market_is_on_demand_and_names_nothing_new():
    s = parse(pod={"count": 2})
    assert (s.pod.market, s.pod.spare, s.pod.on_demand_floor, s.pod.bid_per_hr) == ("ondemand", 0, 1, 0.3)
    cell = plan.plan_cell(s)
    assert all(p.market == market.PodMarket("ondemand") and "market=" not in " ".join(p.identity()) for p in cell.pods)
    # the default adds nothing to a pod's identity: the names of pods placed before the key stay
    before = plan.plan_cell(parse(pod={"count": 2}))
    assert [p.name for p in cell.pods] == [p.name for p in before.pods]


@pytest.mark.parametrize("pod, key, fix", [
    ({"provider": "runpod", "gpu": "NVIDIA GeForce RTX 4090", "market": "interruptible"}, "colocate:pod.market",
     "colocate:pod.provider vastai"),
    ({"provider": "runpod", "gpu": "NVIDIA GeForce RTX 4090", "market": "mix"}, "colocate:pod.market", "market ondemand"),
    ({"market": "spot"}, "colocate:pod.market", "ondemand, interruptible, mix"),
    ({"spare": 1}, "colocate:pod.spare", "market interruptible"),
    ({"market": "interruptible", "spare": 8}, "colocate:pod.spare", "at most 7"),
    ({"market": "interruptible", "spare": -1}, "colocate:pod.spare", "at least 0"),
    ({"market": "mix", "onDemandFloor": 1.5}, "colocate:pod.onDemandFloor", "whole number"),
    ({"market": "interruptible", "bidPerHr": 0.9}, "colocate:pod.bidPerHr", "bidPerHr 0.4"),
    ({"market": "interruptible", "bidPerHr": 0}, "colocate:pod.bidPerHr", "greater than 0"),
    ({"market": "interruptible", "count": 6, "spare": 3}, "colocate:pod.spare", "pod.spare 2"),
])
def test_a_bad_market_is_refused_naming_the_key_the_value_and_the_fix(pod, key, fix):
    r = raw(pod)
    if pod.get("provider") == "runpod":
        r["region"], r["generations"] = "apac-jp", [{"name": "apac-jp.g1", "region": "apac-jp", "status": "active"}]
    with pytest.raises(ConfigError) as err:
        settings.parse(r, "t", secrets=SECRETS)
    assert err.value.key == key and fix in str(err.value), str(err.value)


def test_runpods_refusal_says_why_in_its_own_api():
    r = raw({"provider": "runpod", "gpu": "NVIDIA GeForce RTX 4090", "market": "interruptible"}, region="apac-jp",
            generations=[{"name": "apac-jp.g1", "region": "apac-jp", "status": "active"}])
    with pytest.raises(ConfigError, match="CreatePodRequest"):
        settings.parse(r, "t", secrets=SECRETS)


def test_a_fixed_count_declares_its_spare_pods_and_every_one_serves():
    cell = plan.plan_cell(parse(pod={"market": "interruptible", "count": 2, "spare": 1}))
    assert [p.index for p in cell.pods] == [0, 1, 2] and len(cell.serving) == 3
    assert all(p.market.interruptible for p in cell.pods)


def test_scaling_counts_the_spare_pods_in_its_bounds():
    s = parse(pod={"market": "interruptible", "spare": 1}, scale={"min": 0, "max": 2, "pods": 3, "draining": 1})
    assert (s.scale.pods, s.pod.count) == (3, 4)
    with pytest.raises(ConfigError) as err:  # 2 + 1 spare at most
        parse(pod={"market": "interruptible", "spare": 1}, scale={"min": 0, "max": 2, "pods": 4})
    assert err.value.key == "colocate:scale.pods" and "with 1 spare" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse(pod={"market": "interruptible", "spare": 2}, scale={"min": 0, "max": 7})
    assert err.value.key == "colocate:scale.max" and "scale.max 6" in str(err.value)


# --- the plan and the spec ---

def test_a_mix_declares_its_floor_on_demand_and_the_rest_interruptible_with_a_fallback():
    cell = plan.plan_cell(parse(pod={"market": "mix", "onDemandFloor": 1, "count": 3, "bidPerHr": 0.25}))
    specs = [p.spec() for p in cell.pods]
    assert [(s["market"], s["on_demand_fallback"]) for s in specs] == [
        ("ondemand", False), ("interruptible", True), ("interruptible", True)]
    assert {s["bid_per_hr"] for s in specs} == {0.25}
    # the spec the provider gets is what the plan said, checked again at the edge
    assert PodSpec.from_dict(specs[1]).interruptible and not PodSpec.from_dict(specs[0]).interruptible


def test_how_a_pod_is_rented_is_part_of_its_identity_its_bid_is_not():
    od = plan.plan_cell(parse(pod={"count": 1})).pods[0]
    spot = plan.plan_cell(parse(pod={"market": "interruptible", "count": 1})).pods[0]
    cheaper = plan.plan_cell(parse(pod={"market": "interruptible", "count": 1, "bidPerHr": 0.2})).pods[0]
    assert od.name != spot.name and "market=interruptible" in spot.triggers()
    assert cheaper.name == spot.name  # a bid chooses the next placement, like maxPricePerHr


def test_raising_the_floor_re_rents_only_the_pod_that_changes_market():
    one = plan.plan_cell(parse(pod={"market": "mix", "onDemandFloor": 1, "count": 3})).pods
    two = plan.plan_cell(parse(pod={"market": "mix", "onDemandFloor": 2, "count": 3})).pods
    assert [a.name == b.name for a, b in zip(one, two, strict=True)] == [True, False, True]


def spec(**over) -> dict:
    cell = plan.plan_cell(parse(pod={"market": "interruptible", "count": 1}))
    return {**cell.pods[0].spec(), **over}


@pytest.mark.parametrize("over, field", [
    ({"market": "spot"}, "spec.market"),
    ({"bid_per_hr": 0.9}, "spec.bid_per_hr"),
    ({"on_demand_fallback": "yes"}, "spec.on_demand_fallback"),
])
def test_a_spec_that_cannot_be_rented_is_refused_at_the_edge(over, field):
    with pytest.raises(PodConfigError, match=field.replace(".", r"\.")):
        PodSpec.from_dict(spec(**over))


def test_an_interruptible_runpod_spec_is_refused_with_runpods_reason():
    s = spec(provider="runpod", region="apac-jp", locations=["AP-JP-1"], gpu="NVIDIA GeForce RTX 4090",
             name="colocate-t-apac-jp-g1-p0-abcdef", stack="t")
    with pytest.raises(PodConfigError, match="no interruptible pods"):
        PodSpec.from_dict(s)


def test_a_spec_of_an_older_kit_is_an_on_demand_pod():
    old = {k: v for k, v in spec().items() if k not in ("market", "on_demand_fallback", "bid_per_hr")}
    assert PodSpec.from_dict(old).market == "ondemand"


# --- the scaling decision with spare pods ---

SPARE = scale.Policy(min=0, max=3, target_rpm=60, up_after_s=60, down_after_s=300, spare=1)


def steady(rpm: float, until: float) -> list[scale.Sample]:
    out, total, t = [], 0.0, 0.0
    while t <= until:
        out.append(scale.Sample(at=t, requests={"pod-0": int(total)}, tokens={"pod-0": (0, 0)}))
        total += rpm * 10 / 60
        t += 10
    return out


def test_the_scaler_adds_the_spare_pod_to_what_the_demand_needs():
    d = scale.decide(steady(100, 120), SPARE, 0, 120)
    assert d.desired == 3 and "needs 2 pods" in d.reason and "+1 spare" in d.reason


def test_the_spare_pod_holds_while_the_demand_holds_and_leaves_with_the_last_pod():
    assert scale.decide(steady(100, 400), SPARE, 3, 400).desired == 3
    assert scale.decide(steady(0, 400), SPARE, 2, 400).desired == 0  # 1 needed + 1 spare -> none
    assert scale.decide(steady(40, 400), SPARE, 3, 400).desired == 2  # 1 needed + its spare


def test_a_count_outside_the_bounds_is_brought_back_with_its_spare():
    assert scale.decide([], SPARE, 6, 0).desired == 4  # max 3 + 1 spare
    # a count short of its spare pod (a change cut midway) serves: it gets its spare, it never loses a pod
    assert scale.decide([], SPARE, 1, 0).desired == 2


def test_without_spare_the_decision_is_what_it_was():
    plain = scale.Policy(min=0, max=3, target_rpm=60, up_after_s=60, down_after_s=300)
    d = scale.decide(steady(100, 120), plain, 0, 120)
    assert d.desired == 2 and "spare" not in d.reason


def priced(rpm: float, until: float, prompt: int = 1000) -> list[scale.Sample]:
    """``steady`` whose requests carry ``prompt`` tokens each: the cost policy can price them."""
    return [scale.Sample(at=s.at, requests=s.requests, tokens={"pod-0": (s.requests["pod-0"] * prompt, 0)})
            for s in steady(rpm, until)]


# $1 per 1M tokens, 1,000 a request: $0.001 a request at the fallback; a pod $0.5/h, 60 req/min
HEDGED = scale.Policy(min=0, max=3, target_rpm=60, up_after_s=60, down_after_s=300, policy=scale.COST,
                      pod_price_per_hr=0.5, api_price=(1.0, 1.0), spare=1,
                      preemptions_per_hr=market.PREEMPTIONS_PER_HOUR)


def test_the_cost_policy_runs_its_spare_pod_only_while_it_pays():
    # 60 req/min: a preempted pod's share at the fallback for its 20-minute boot, 0.468 times an hour,
    # is $0.56 an hour of risk against the spare's $0.5: it runs
    d = scale.decide(priced(60, 120), HEDGED, 0, 120)
    assert d.desired == 2 and "+1 spare" in d.reason
    # 20 req/min: one pod still pays ($1.2/h at the API), its risk ($0.19/h) does not buy a spare
    assert scale.decide(priced(20, 120), HEDGED, 0, 120).desired == 1
    # and the spare leaves once the demand no longer pays for it; the serving pod stays
    assert scale.decide(priced(20, 400), HEDGED, 2, 400).desired == 1
    # a count with or without its spare is within bounds: neither is changed without a signal
    assert scale.decide([], HEDGED, 1, 0).desired == 1 and scale.decide([], HEDGED, 4, 0).desired == 4


def test_the_controller_hedges_at_the_published_rate_only_with_spare_pods():
    from colocate.cell.settings import ScaleSettings
    from colocate.scaling.controller import policy_of
    s = ScaleSettings(min=0, max=2, target=60, up_after_s=60, down_after_s=300, policy=scale.COST, pods=0)
    assert policy_of(s, (1.0, 1.0), 0.5, spare=1).preemptions_per_hr == pytest.approx(0.468, abs=0.001)
    assert policy_of(s, (1.0, 1.0), 0.5).preemptions_per_hr == 0.0


def sparse(until: float, every: int = 5) -> list[scale.Sample]:
    """A pass every 10 s and one request every ``every`` passes: 1.2 req/min, most intervals empty."""
    return [scale.Sample(at=t, requests={"pod-0": t // (10 * every)}, tokens={"pod-0": (0, 0)})
            for t in range(0, int(until) + 1, 10)]


def test_passes_more_frequent_than_the_arrivals_still_see_the_demand():
    slow = scale.Policy(min=0, max=2, target_rpm=1, up_after_s=120, down_after_s=600)
    # every 10-s interval of the window: one of five holds a request, the least need is 0
    assert scale.decide(sparse(300), slow, 0, 300).desired == 0
    # judged over minutes, each holds a request or two: a pod at least
    spaced = scale.Policy(min=0, max=2, target_rpm=1, up_after_s=120, down_after_s=600, min_interval_s=60)
    assert scale.decide(sparse(300), spaced, 0, 300).desired == 1
    # a gap longer than the signal's staleness is still a gap: nothing is measured across it
    gapped = [s for s in sparse(300) if not 100 < s.at < 200]
    assert all(not (iv.start < 150 < iv.end) for iv in scale.intervals(gapped, 30, 60))
