"""How many pods a cell should run: a pure decision from what the cell measured.

``decide(samples, policy, current, now)`` is the whole policy (no I/O, no clock): the
controller (``colocate/scaling/controller.py``) reads the generation's counters into ``Sample``s, asks
this module, and acts. A sample holds the cell's cumulative counters at one moment
(requests and tokens by backend: ``pod-<i>``, ``fallback``, ``none``) and the requests in
flight per pod then; rates come from the differences between consecutive samples, so a
decision never depends on when the counters started.

Hysteresis, so the count never flaps: pods are added only when every interval of the last
``upAfterS`` needed more than run now (the least of those needs), and removed only when every
interval of the last ``downAfterS`` needed fewer (the most of those needs, computed with a
pod's capacity taken at ``DOWN_BAND`` of its target, so demand that hovers at a boundary keeps
the larger count). A window that the samples do not cover (the controller just started, or
the signal had a gap) changes nothing in its direction, and a signal older than
``stale_after_s`` changes nothing at all: a controller that cannot see the cell holds.

Counts are of pods declared: a policy with ``spare`` interruptible pods (colocate/cell/market.py,
SpotHedge's over-provisioning) runs up to that many more than the demand needs whenever it needs
any; the demand's windows decide the need as without them. Under ``latency`` the spare pods always
run. Under ``cost`` they run only while they pay (``hedge``): while the fallback's expected spend on
the share of the pods a preemption takes, for the replacement's boot, is above a spare's hour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cell.capacity import BOOT_S
from ..cell.market import INTERRUPTIBLE, needed_of

LATENCY, COST = "latency", "cost"
DEFERRED = "none"  # the backend of a request a fleet's front door took to another cell: no tokens here
# A pod is kept on the way down while demand fills this share of it (latency) or its
# tokens would cost this share of its price at the API (cost): the band between the two
# thresholds is what keeps a count from flapping when demand sits at a boundary.
DOWN_BAND = 0.8
STALE_AFTER_S = 30.0  # no new sample for this long: the signal is lost, hold


@dataclass(frozen=True)
class Sample:
    """The cell's counters at ``at`` (seconds): cumulative since the generation began."""

    at: float
    requests: dict[str, int]  # by backend: pod-<i>, fallback, none (deferred to another cell)
    tokens: dict[str, tuple[int, int]] = field(default_factory=dict)  # by backend: (prompt, completion)
    inflight: dict[str, int] = field(default_factory=dict)  # by pod index ("0", "1", ...): now

    def total_requests(self) -> int:
        return sum(self.requests.values())

    def total_tokens(self) -> tuple[int, int]:
        return (sum(t[0] for t in self.tokens.values()), sum(t[1] for t in self.tokens.values()))

    def served_requests(self) -> int:
        """Requests this cell served (its pods or its fallback): the ones whose tokens it counted."""
        return sum(n for b, n in self.requests.items() if b != DEFERRED)


@dataclass(frozen=True)
class Policy:
    """``colocate:scale`` with the prices the cost policy weighs."""

    min: int
    max: int
    target_rpm: float  # requests per minute one pod serves within budget
    up_after_s: float
    down_after_s: float
    policy: str = LATENCY
    pod_price_per_hr: float = 0.0  # what one pod bills (the providers' report, or the price cap)
    api_price: tuple[float, float] = (0.0, 0.0)  # $ per 1M (input, output) tokens at the fallback
    stale_after_s: float = STALE_AFTER_S
    spare: int = 0  # interruptible pods run beyond the need, at most (colocate:pod.spare)
    # the cost policy's hedge: how often an interruptible pod is preempted, and how long its share is
    # the fallback's (the replacement's boot; the keeper finds a preempted pod within one pass)
    preemptions_per_hr: float = 0.0
    gap_h: float = BOOT_S / 3600
    min_interval_s: float = 0.0  # demand is measured over intervals at least this long (``intervals``)

    def declared(self, needed: int, rpm: float | None = None, per_req: float = 0.0) -> int:
        """Pods declared when ``needed`` serve ``rpm`` (with the spare ones that pay, ``hedge``)."""
        return needed + hedge(self, needed, rpm, per_req)


def hedge(policy: Policy, needed: int, rpm: float | None, per_req: float) -> int:
    """Spare pods to run beside ``needed`` serving ``rpm`` (requests costing ``per_req`` $ each at
    the fallback). SpotHedge (arXiv 2411.01438) over-provisions so a preemption leaves the target
    served; a spare costs its hour every hour, a preemption costs the fallback the lost pod's share
    for ``gap_h``. Under ``cost`` a spare runs while ``needed`` pods' expected preemptions an hour
    times that spend is above its price; under ``latency`` (or with no demand signal) always."""
    if needed <= 0 or policy.spare <= 0:
        return 0
    if policy.policy == LATENCY or rpm is None:
        return policy.spare
    share_rpm = min(policy.target_rpm, rpm / needed)
    lost_per_hr = needed * policy.preemptions_per_hr * policy.gap_h * share_rpm * 60 * per_req
    return policy.spare if lost_per_hr > policy.pod_price_per_hr else 0


@dataclass(frozen=True)
class Interval:
    """Demand between two consecutive samples."""

    start: float
    end: float
    rpm: float
    prompt_per_req: float
    completion_per_req: float


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    demand_rpm: float | None  # over the latest interval; None without a signal

    def as_json(self) -> dict:
        return {"desired": self.desired, "reason": self.reason,
                "demand_rpm": None if self.demand_rpm is None else round(self.demand_rpm, 2)}


def intervals(samples: list[Sample], stale_after_s: float, min_span_s: float = 0.0) -> list[Interval]:
    """Demand between consecutive samples (time order). A gap longer than ``stale_after_s``
    or counters that went backwards (a new generation) yields no interval there.

    Tokens per request are those of the requests the cell served in the interval; a request
    deferred to another cell has no tokens here, so an interval of deferrals alone (a cell at
    zero in a fleet) takes the cell's average since the generation began: its users' requests
    are priced as they were when it served them.

    ``min_span_s``: consecutive samples are merged (from the latest back) until an interval spans
    that long: a pass more frequent than the demand's arrivals (the keeper's) would otherwise see
    intervals of no request at all, and the way up (the least need of a window) would never rise."""
    out = []
    ordered = sorted(samples, key=lambda s: s.at)
    pairs = _spaced(ordered, stale_after_s, min_span_s) if min_span_s > 0 else zip(ordered, ordered[1:], strict=False)
    for a, b in pairs:
        dt = b.at - a.at
        dr = b.total_requests() - a.total_requests()
        (pa, ca), (pb, cb) = a.total_tokens(), b.total_tokens()
        if dt <= 0 or (dt > stale_after_s and min_span_s <= 0) or dr < 0 or pb < pa or cb < ca:
            continue
        served = b.served_requests() - a.served_requests()
        if served <= 0:  # priced at the cell's history (0 when it never served one)
            served, pa, ca = b.served_requests(), 0, 0
        out.append(Interval(a.at, b.at, dr * 60.0 / dt, (pb - pa) / served if served else 0.0,
                            (cb - ca) / served if served else 0.0))
    return out


def _spaced(ordered: list[Sample], stale_after_s: float, min_span_s: float) -> list[tuple[Sample, Sample]]:
    """Consecutive samples merged into pairs at least ``min_span_s`` apart, from the latest back;
    nothing is measured across a gap longer than ``stale_after_s`` (the pair before it may be shorter)."""
    pairs: list[tuple[Sample, Sample]] = []
    end = ordered[-1] if ordered else None
    for s, after in zip(reversed(ordered[:-1]), reversed(ordered[1:]), strict=False):
        assert end is not None
        if after.at - s.at > stale_after_s:  # a gap: close what runs up to it, start again before it
            if end is not after:
                pairs.append((after, end))
            end = s
        elif end.at - s.at >= min_span_s:
            pairs.append((s, end))
            end = s
    return pairs[::-1]


def need(iv: Interval, policy: Policy, band: float = 1.0) -> int:
    """Pods this interval's demand calls for, before min/max. ``band`` < 1 is the way down:
    a pod counts as full at ``band`` of its target (latency) and is worth keeping while
    its tokens would cost ``band`` of its price at the API (cost)."""
    if iv.rpm <= 0:
        return 0
    if policy.policy == LATENCY:
        return math.ceil(round(iv.rpm / (policy.target_rpm * band), 9))
    # cost: pod k serves what pods 1..k-1 leave, up to its target; it runs while the API would
    # charge more than the pod's hour for those requests.
    per_req = _per_req(iv, policy)
    n = 0
    for k in range(1, policy.max + 1):
        served_rpm = min(policy.target_rpm, iv.rpm - (k - 1) * policy.target_rpm)
        if served_rpm <= 0 or served_rpm * 60 * per_req < policy.pod_price_per_hr * band:
            break
        n = k
    return n


def _covered(ivs: list[Interval], start: float) -> bool:
    """Whether the intervals run without a gap from ``start`` (or before) to their end."""
    if not ivs or ivs[0].start > start:
        return False
    return all(a.end >= b.start for a, b in zip(ivs, ivs[1:], strict=False))


def _window(ivs: list[Interval], now: float, seconds: float) -> list[Interval] | None:
    """The intervals that overlap the last ``seconds`` (at least the latest one), or None
    when they do not cover it."""
    start = now - seconds
    inside = [iv for iv in ivs if iv.end > start] or ivs[-1:]
    first = ivs.index(inside[0])
    return inside if _covered(ivs[first:], start) else None


def decide(samples: list[Sample], policy: Policy, current: int, now: float) -> Decision:
    """The pods the cell should run (``desired``) and why, given the counters seen so far,
    the pods it runs (``current``) and the time. Pure: the same input, the same answer."""
    if policy.policy == LATENCY:  # its spare pods always run: a count short of them gets them
        bounded = policy.declared(min(max(needed_of(current, INTERRUPTIBLE, policy.spare), policy.min), policy.max))
    else:  # the cost policy's run while they pay (hedge): any count up to max + spare holds
        bounded = min(max(current, policy.min), policy.max + (policy.spare if policy.max > 0 else 0))
    if bounded != current:
        spare = f" and {policy.spare} spare" if policy.spare else ""
        return Decision(bounded, f"{current} pods is outside colocate:scale {policy.min}..{policy.max}{spare}", None)
    latest = max((s.at for s in samples), default=None)
    if latest is None or now - latest > policy.stale_after_s:
        seen = "no signal yet" if latest is None else f"no signal for {now - latest:.0f} s"
        return Decision(current, f"{seen}: holding {current} pods", None)
    ivs = intervals(samples, policy.stale_after_s, policy.min_interval_s)
    if not ivs or ivs[-1].end < latest:
        why = "one sample so far" if len(samples) < 2 else "the counters restarted or skipped"
        return Decision(current, f"{why}: holding {current} pods", None)
    demand = ivs[-1].rpm
    what = f"{demand:.1f} req/min" + (f" ({LATENCY}, {policy.target_rpm:g} req/min a pod)" if policy.policy == LATENCY
                                      else f" ({COST}, a pod at ${policy.pod_price_per_hr:g}/h)")
    up = _window(ivs, now, policy.up_after_s)
    if up is not None:
        n = min(min(need(iv, policy) for iv in up), policy.max)
        want = policy.declared(n, min(iv.rpm for iv in up), _per_req(up[-1], policy))
        if want > current:
            return Decision(want, f"{what} needs {n} pods for {policy.up_after_s:g} s{_spare(want - n)}: "
                            f"up from {current}", demand)
    down = _window(ivs, now, policy.down_after_s)
    if down is not None:
        n = max(max(need(iv, policy, DOWN_BAND) for iv in down), policy.min)
        want = policy.declared(n, max(iv.rpm for iv in down) * DOWN_BAND, _per_req(down[-1], policy))
        if want < current:
            return Decision(want, f"{what} needs at most {n} pods for {policy.down_after_s:g} s"
                            f"{_spare(want - n)}: down from {current}", demand)
    return Decision(current, f"{what}: {current} pods hold", demand)


def _per_req(iv: Interval, policy: Policy) -> float:
    """One request's cost at the fallback, $."""
    return (iv.prompt_per_req * policy.api_price[0] + iv.completion_per_req * policy.api_price[1]) / 1e6


def _spare(k: int) -> str:
    return f" (+{k} spare)" if k > 0 else ""
