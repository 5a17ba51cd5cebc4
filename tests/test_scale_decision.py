"""colocate:scale's settings and the pure scaling decision (colocate/scaling/policy.py), on a table of
traffic shapes: a step, a spike shorter than upAfterS, a slow ramp, a day, an outage of the
signal. Pure and fast: no process, no clock."""

from __future__ import annotations

import math

import pytest

from colocate.cell import plan, settings
from colocate.errors import ConfigError
from colocate.scaling import policy as scale
from tests.support.images import GUARDED_IMAGE

SECRETS = frozenset({"podToken", "probeToken", "fallbackUrl", "fallbackApiKey", "runpodApiKey"})


def raw(**over) -> dict:
    r = {
        "region": "apac-jp",
        "generations": [{"name": "apac-jp.g1", "region": "apac-jp", "status": "active"}],
        "accountId": "0123456789abcdef0123456789abcdef",
        "pod": {"provider": "runpod", "image": GUARDED_IMAGE},  # no zone: RunPod's proxy, the kit's image (guarded)
        "worker": {"subdomain": "acme"},
        "fallbackModel": "gpt-4o-mini",
        "fallbackCap": {"cellUsdPerDay": 0},  # no cap, knowingly: the cap's own tests set one
        "fallbackPrice": {"input": 0.15, "output": 0.6},
        "scale": {"min": 0, "max": 4, "target": 60},
    }
    r.update(over)
    return r


def parse(**over) -> settings.Settings:
    return settings.parse(raw(**over), "t", secrets=SECRETS)


# --- settings ---

def test_scale_sets_the_declared_count_and_the_rotation():
    s = parse(scale={"min": 1, "max": 4, "pods": 3, "draining": 1})
    assert (s.scale.pods, s.scale.draining, s.pod.count) == (3, 1, 4)
    cell = plan.plan_cell(s)
    assert [p.index for p in cell.pods] == [0, 1, 2, 3]
    assert [p.index for p in cell.serving] == [0, 1, 2]
    # draining is not part of a pod's identity: leaving rotation does not replace the pod
    assert plan.plan_cell(parse(scale={"min": 1, "max": 4, "pods": 4})).pods[3].name == cell.pods[3].name


def test_pods_default_to_min_and_zero_pods_plan_a_cell_without_pods():
    s = parse()
    assert s.scale.pods == 0 and s.pod.count == 0
    cell = plan.plan_cell(s)
    assert cell.pods == () and cell.pod_path == "provider-proxy" and cell.pod_settings.provider == "runpod"
    assert cell.worker.placement_mode == "targeted"


@pytest.mark.parametrize("over, key, fix", [
    ({"pod": {"provider": "runpod", "count": 2}}, "colocate:pod.count", "pulumi config rm --path colocate:pod.count"),
    ({"scale": {"min": 3, "max": 2}}, "colocate:scale.max", "pulumi config set --path colocate:scale.max 3"),
    ({"scale": {"max": 9}}, "colocate:scale.max", "at most 8"),
    ({"scale": {"min": -1}}, "colocate:scale.min", "at least 0"),
    ({"scale": {"target": 0}}, "colocate:scale.target", "greater than 0"),
    ({"scale": {"policy": "cheap"}}, "colocate:scale.policy", "latency, cost"),
    ({"scale": {"policy": "cost"}, "fallbackPrice": None}, "colocate:scale.policy", "colocate:fallbackPrice.input"),
    ({"scale": {"min": 1, "max": 2, "pods": 3}}, "colocate:scale.pods", "pulumi config set --path colocate:scale.pods 2"),
    ({"scale": {"upAfterS": "soon"}}, "colocate:scale.upAfterS", "whole number"),
    ({"scale": {"maxPods": 3}}, "colocate:scale.maxPods", "use only min, max"),
    ({"scale": 3}, "colocate:scale", "pulumi config set --path colocate:scale.max"),
])
def test_a_bad_scale_is_refused_naming_the_key_and_the_fix(over, key, fix):
    r = raw()
    for k, v in over.items():
        if v is None:
            r.pop(k)
        else:
            r[k] = v
    with pytest.raises(ConfigError) as err:
        settings.parse(r, "t", secrets=SECRETS)
    assert err.value.key == key and fix in str(err.value)


def test_placement_pod_is_refused_when_pod_0_may_not_exist():
    zone = {"id": "f" * 32, "name": "example.com"}
    pod = {"provider": "runpod"}  # on a zone the hop is mutual TLS (token is refused there)
    with pytest.raises(ConfigError) as err:
        plan.plan_cell(parse(zone=zone, pod=pod, worker={"subdomain": "acme", "placement": "pod"}))
    assert err.value.key == "colocate:worker.placement" and "colocate:scale.min 1" in str(err.value)
    assert plan.plan_cell(parse(zone=zone, pod=pod)).worker.placement_mode == "targeted"  # auto
    assert plan.plan_cell(parse(zone=zone, pod=pod, scale={"min": 1, "max": 2})).worker.placement_mode == "pod"


# --- the decision ---

STEP_S = 10.0  # the controller's sampling period in these tables
LAT = scale.Policy(min=0, max=4, target_rpm=60, up_after_s=60, down_after_s=300)


def samples_of(rpm_at, until: float, *, start: float = 0.0, every: float = STEP_S, tokens=(500, 200)) -> list[scale.Sample]:
    """Cumulative counters sampled every ``every`` s from a demand curve (req/min at t)."""
    out, total, t = [], 0.0, start
    while t <= until + 1e-9:
        n = int(total)
        out.append(scale.Sample(at=t, requests={"pod-0": n}, tokens={"pod-0": (n * tokens[0], n * tokens[1])}))
        total += rpm_at(t) * every / 60
        t += every
    return out


def run(rpm_at, policy: scale.Policy, until: float, current: int = 0, every: float = STEP_S) -> list[tuple[float, int, str]]:
    """The controller's loop over a shape: decide at every sample, act at once. The changes."""
    history = samples_of(rpm_at, until, every=every)
    changes = []
    for i, s in enumerate(history):
        d = scale.decide(history[: i + 1], policy, current, s.at)
        if d.desired != current:
            changes.append((s.at, d.desired, d.reason))
            current = d.desired
    return changes


def test_a_step_scales_up_after_up_after_s_and_not_before():
    changes = run(lambda t: 0 if t < 100 else 150, LAT, until=400)
    (at, n, reason), = changes
    assert n == 3 and 100 + LAT.up_after_s <= at <= 100 + LAT.up_after_s + 2 * STEP_S
    assert "needs 3 pods" in reason and "up from 0" in reason


def test_a_spike_shorter_than_up_after_s_changes_nothing():
    assert run(lambda t: 500 if 100 <= t < 140 else 30, LAT, until=600, current=1) == []


def test_a_slow_ramp_adds_pods_one_at_a_time_and_never_removes_one():
    changes = run(lambda t: t / 5, LAT, until=1200, current=0)  # 0 -> 240 req/min over 20 min
    assert [n for _, n, _ in changes] == [1, 2, 3, 4]
    for at, n, _ in changes:  # pod n is needed from t = 300 (n - 1) on (60 req/min a pod), added upAfterS later
        assert 300 * (n - 1) + LAT.up_after_s <= at <= 300 * (n - 1) + LAT.up_after_s + 3 * STEP_S


def test_demand_at_a_boundary_never_flaps():
    # 118..122 req/min: two pods' worth give or take; the band keeps the larger count
    changes = run(lambda t: 120 + 2 * math.sin(t / 7), LAT, until=3600, current=2)
    assert changes == []


def day_rpm(t: float) -> float:
    """A compressed day, one hour = 60 s: night ~6 req/min, a peak of 200 at noon."""
    hour = (t / 60) % 24
    return 6 + 194 * math.exp(-((hour - 12) ** 2) / 8)


def test_a_day_follows_demand_up_and_down_with_few_changes():
    policy = scale.Policy(min=0, max=4, target_rpm=60, up_after_s=60, down_after_s=240)
    changes = run(day_rpm, policy, until=24 * 60 - 1, current=0)
    counts = [n for _, n, _ in changes]
    assert max(counts) == 4 and len(changes) <= 10  # up to the peak's 4 pods, no flapping
    peak_at = next(at for at, n, _ in changes if n == 4)
    assert 11 * 60 <= peak_at <= 13 * 60  # demand needs 4 pods above 180 req/min: hour 11.1 to 12.9
    # back down by the evening; the night's 6 req/min keep one pod under the latency policy
    assert counts[-1] == 1 and changes[-1][0] < 20 * 60


def test_silence_for_down_after_s_scales_to_zero():
    changes = run(lambda t: 30 if t < 200 else 0, LAT, until=700, current=1)
    (at, n, reason), = changes
    assert n == 0 and at >= 200 + LAT.down_after_s and "down from 1" in reason


def test_an_outage_of_the_signal_changes_nothing():
    history = samples_of(lambda t: 0 if t < 100 else 200, 400)
    last = history[-1].at
    # no sample for longer than stale_after_s: hold, even though demand called for pods
    d = scale.decide(history, LAT, 1, last + LAT.stale_after_s + 1)
    assert (d.desired, d.demand_rpm) == (1, None) and "no signal for" in d.reason
    assert scale.decide([], LAT, 2, 0).desired == 2
    # a gap inside the window: the window is not covered, so no change in either direction
    gapped = [s for s in samples_of(lambda t: 200, 400) if not 350 <= s.at <= 380]
    assert scale.decide(gapped, LAT, 1, 400).desired == 1
    # counters that went backwards (a new generation) are no interval either
    reset = samples_of(lambda t: 200, 400)[:-1] + [scale.Sample(at=400, requests={"pod-0": 3})]
    assert scale.decide(reset, LAT, 1, 400).desired == 1


def test_min_and_max_bound_the_count():
    assert scale.decide([], LAT, 7, 0).desired == 4
    capped = run(lambda t: 10_000, LAT, until=200, current=1)
    assert [n for _, n, _ in capped] == [4]


COST = scale.Policy(min=0, max=4, target_rpm=60, up_after_s=60, down_after_s=240, policy="cost",
                    pod_price_per_hr=0.5, api_price=(0.15, 0.6))


def test_the_cost_policy_runs_a_pod_only_while_it_costs_less_than_the_api():
    # a request of 500 in + 200 out tokens costs $0.000195 at the API: one pod's $0.50/h
    # buys 2564 requests an hour, 42.7 req/min. Below that the API is cheaper.
    per_req = (500 * 0.15 + 200 * 0.6) / 1e6
    breakeven = 0.5 / per_req / 60
    assert run(lambda t: breakeven * 0.9, COST, until=600) == []
    (_, n, _), = run(lambda t: breakeven * 1.3, COST, until=600)  # 10 s samples: +-6 req/min
    assert n == 1
    # 130 req/min: two full pods (60 each) pay; the third would serve 10 req/min, not worth its hour
    (_, n, _), = run(lambda t: 130, COST, until=600)
    assert n == 2
    # the latency policy runs the third for the same traffic
    (_, n, _), = run(lambda t: 130, LAT, until=600)
    assert n == 3


def test_the_cost_policy_keeps_a_pod_in_the_band_and_drops_it_below():
    per_req = (500 * 0.15 + 200 * 0.6) / 1e6
    breakeven = 0.5 / per_req / 60
    assert run(lambda t: breakeven * 0.9, COST, until=900, current=1) == []  # within DOWN_BAND of paying
    (_, n, _), = run(lambda t: breakeven * 0.5, COST, until=900, current=1)
    assert n == 0


def test_the_cost_policy_prices_deferred_requests_at_the_cells_history():
    # A cell at zero in a fleet: the front door takes its users to another cell, so its counters
    # grow under backend "none" with no tokens. They are its users' requests all the same, priced
    # at what its served requests carried (500 + 200 tokens), so demand above break-even brings
    # a pod back; without that history the cell cannot price them and holds.
    history = [scale.Sample(at=0, requests={"fallback": 10}, tokens={"fallback": (5000, 2000)})]
    for i in range(1, 61):
        history.append(scale.Sample(at=10.0 * i, requests={"fallback": 10, "none": 20 * i},
                                    tokens={"fallback": (5000, 2000)}))  # 120 req/min, all deferred
    d = scale.decide(history, COST, 0, history[-1].at)
    assert d.desired == 2 and "up from 0" in d.reason
    never_served = [scale.Sample(at=s.at, requests={"none": s.requests["none"]} if "none" in s.requests else {})
                    for s in history]
    assert scale.decide(never_served, COST, 0, history[-1].at).desired == 0
    # served requests in the interval set the price: the deferred ones there count as demand only
    iv = scale.intervals([scale.Sample(0, {"pod-0": 0}, {"pod-0": (0, 0)}),
                          scale.Sample(60, {"pod-0": 10, "none": 30}, {"pod-0": (1000, 500)})], 30)
    assert iv == []  # a gap longer than stale_after_s
    iv = scale.intervals([scale.Sample(0, {"pod-0": 0}, {"pod-0": (0, 0)}),
                          scale.Sample(20, {"pod-0": 10, "none": 30}, {"pod-0": (1000, 500)})], 30)
    assert (iv[0].rpm, iv[0].prompt_per_req, iv[0].completion_per_req) == (120.0, 100.0, 50.0)
