"""Where a cell's pods are rented (``colocate:pod.market``): on demand, interruptible, or a mix.
Pure: no I/O.

SpotHedge (SkyServe: Mao et al., arXiv 2411.01438, EuroSys 2025) serves on spot replicas spread
over failure domains, over-provisioned beyond the target as a safeguard, and falls back to
on-demand replicas while spot capacity is gone. A cell cannot leave its region, but it has
failure domains of its own (the provider's hosts and locations in the region, the fleet's
neighbour cells) and a last resort no spot system has: the paid API, under its daily cap
(``colocate:fallbackCap``). So the policy is:

* ``ondemand`` (the default): every pod on demand.
* ``interruptible``: every pod interruptible (Vast.ai's bid instances). While a preempted pod's
  replacement boots (20 minutes, ``capacity.BOOT_S``) the cell's other pods, the fleet's next cell
  and the capped fallback carry its share; a replacement that finds no interruptible capacity
  fails and is tried again (the keeper's backoff; its ``replace_failed`` alert after three).
* ``mix``: pods ``0 .. onDemandFloor - 1`` on demand (they are the last to leave on a scale-down,
  which drains the highest indices first), the others interruptible; one of those that finds no
  interruptible capacity is rented on demand instead (SkyPilot's ``dynamic_ondemand_fallback``).

Up to ``spare`` interruptible pods are added to any count above zero (SpotHedge's
over-provisioning): they serve like the others, so one preemption leaves the cell its capacity.
They cost their hours, so the cost policy runs them only while they pay: while the fallback's
expected spend on a preempted pod's share through its replacement's boot, at
``PREEMPTIONS_PER_HOUR``, is above a spare's hour (colocate/scaling/policy.py ``hedge``); at night
the fleet's other cells and the fallback carry it. Spreading: pod i prefers the region's i-th
location (plan.py), and an interruptible Vast.ai pod prefers a host and a country no live pod of
its stack holds, never a host where one of them was outbid (colocate/pods/vastai.py).

RunPod's REST v2 has no interruptible pods (its ``CreatePodRequest`` takes no bid and no
interruptible field, and admits no property it does not list): ``interruptible`` and ``mix``
need ``vastai`` (or ``local``, the sandbox's stand-in, which emulates a market).
"""

from __future__ import annotations

from dataclasses import dataclass

ONDEMAND, INTERRUPTIBLE, MIX = "ondemand", "interruptible", "mix"
MARKETS = (ONDEMAND, INTERRUPTIBLE, MIX)
PROVIDERS = {"vastai": MARKETS, "local": MARKETS, "runpod": (ONDEMAND,)}  # the markets each provider's API can rent
# How often an interruptible GPU pod is taken back: the single-node trace SkyPilot published with "Can't
# Be Late" (Wu et al., NSDI 2024), four AWS p3.2xlarge spot instances for a week (colocate/scaling/spot_day.py
# says how it was counted). Vast.ai publishes no rate; the cost policy hedges spare pods at this one.
PREEMPTIONS_PER_HOUR = 202 / 431.2  # 0.468 an instance-hour: a mean life of 2.1 hours
PREEMPTION_SOURCE = ("skypilot-org/spot-traces preemption/1-node/aws-04-22-2023 (commit 221da1a; Wu et al., NSDI 2024): "
                     "202 preemptions in 431.2 hours of four AWS p3.2xlarge spot instances, 2023-04-22 to 04-29")
RUNPOD_HAS_NONE = ("RunPod's REST v2 has no interruptible pods: its createPod body (CreatePodRequest) takes no bid "
                   "or interruptible field and admits no other property")


@dataclass(frozen=True)
class PodMarket:
    """How one pod is rented: its market, and whether it may be rented on demand when no
    interruptible capacity is left (``mix``)."""

    market: str
    on_demand_fallback: bool = False

    @property
    def interruptible(self) -> bool:
        return self.market == INTERRUPTIBLE


def pod_market(market: str, floor: int, index: int) -> PodMarket:
    """Pod ``index``'s market under ``colocate:pod.market`` and ``.onDemandFloor``: the same for a
    given index whatever the count, so a count change never re-rents a pod that stays."""
    if market == ONDEMAND or (market == MIX and index < floor):
        return PodMarket(ONDEMAND)
    return PodMarket(INTERRUPTIBLE, on_demand_fallback=market == MIX)


def with_spare(needed: int, market: str, spare: int) -> int:
    """Pods declared when ``needed`` serve the demand: the ``spare`` interruptible pods on top of
    any count above zero (none on demand: spare pods insure against preemption)."""
    return needed + spare if needed > 0 and market != ONDEMAND else needed


def needed_of(declared: int, market: str, spare: int) -> int:
    """The inverse of ``with_spare``: the pods the demand needs among ``declared`` (a count short of
    its spare pods, as a change cut midway leaves it, still serves: at least one)."""
    return max(1, declared - spare) if declared > 0 and market != ONDEMAND else declared
