"""A pod's capacity and boot time as the scaling policy, demo-autoscale and cost.py assume them
(colocate/cell/capacity.py): the knee of the pod's profile, not a guessed 300 requests a minute, and a
real pod's 20-minute boot, which colocate:pod.readyTimeoutS covers."""

from __future__ import annotations

import dataclasses

import pytest

from colocate.cell import capacity, settings
from colocate.pods import profiles


def test_the_default_capacity_is_the_default_profiles_knee():
    knee, where = capacity.knee_rps()
    p = profiles.get(profiles.DEFAULT_PROFILE)
    if p.knee_rps > 0:  # fitted on the stand-in's engine
        assert knee == p.knee_rps and "engine" in where
    else:  # the published sweeps: the highest rate whose TTFT p99 is within the planner's budget
        assert knee == max(pt.req_s for s in p.sweeps for pt in s.points
                           if pt.ttft_p99_ms <= profiles.DEFAULT_TTFT_P99_BUDGET_MS)
        assert "published sweep" in where
    assert capacity.pod_capacity() == round(knee * 60, 1)


def test_a_fitted_knee_wins_over_the_sweep(monkeypatch):
    p = profiles.get(profiles.DEFAULT_PROFILE)
    monkeypatch.setitem(profiles.PROFILES, p.name, dataclasses.replace(p, knee_rps=12.5))
    assert capacity.pod_capacity(p.name) == 750.0


def test_a_profile_without_a_limit_has_no_capacity_to_plan_by():
    with pytest.raises(capacity.NoCapacity, match="oracle"):
        capacity.pod_capacity("oracle")
    with pytest.raises(capacity.NoCapacity, match="unknown pod profile"):
        capacity.pod_capacity("h100-nothing")


def test_the_policy_the_demo_and_the_ready_wait_take_them():
    from colocate.sandbox import autoscale_demo

    assert settings.SCALE_DEFAULTS["target"] == capacity.pod_capacity()
    assert settings.parse_scale({"scale": {"max": 2}}, None).target == capacity.pod_capacity()
    assert capacity.pod_capacity() == autoscale_demo.TARGET_RPM and autoscale_demo.BOOT_S == capacity.BOOT_S == 1200
    assert settings.POD_DEFAULTS["readyTimeoutS"] >= capacity.BOOT_S + 600  # room for a slow pull
