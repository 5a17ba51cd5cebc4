"""The live view: per-segment latency and placement from real traffic (``probe.py --live``).

The Worker records every routed request's ``state``, ``upstream``, ``fallback`` and
``total`` (as in Server-Timing) and every isolate's background sync round trip (``sync``,
the ``state_rtt`` real traffic pays in the background) as relative-error histograms per
(minute, colo, pod or fallback, segment) in the generation object; ``GET
/_colocate/live?since=<ms>`` returns them (docs/probe.md, "Live view"). This module is pure:
it merges the rows of a window and judges them with the post-deploy probe's own models:

    percentiles  p10/p50/p90/p99 and n per segment, from the merged buckets (within 1.08 %
                 of the exact value, 0.25 ms below 0.25 ms: histogram.py)
    shares       requests per pod and by the fallback
    colos        the colos the Worker ran in and the state object answered from, each in or
                 out of the cell's region (``placement``: the same Parts, floors and findings)
    budgets      ``budgets.broken`` on the live segments; a ``state_rtt`` budget is checked
                 against ``sync``; budgets on segments the live view does not record
                 (``e2e``, ``pod_rtt``) are noted, not failed

Placement is judged on the latest minute with data, so a split is flagged within a minute
of starting and clears a minute after the fix; an earlier excursion in the window is a note.
A window without traffic has nothing to judge: every budget is noted as unchecked, exit 0.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC

from ..cell import catalogue
from ..cell.payloads import HIST
from ..scaling.cost import dollars
from . import budgets as budgets_mod, fallbackshare, placement as placement_mod
from .errors import TargetError
from .histogram import Buckets, Histogram, HistogramError, merged
from .stats import PERCENTILES

ROUTED = ("state", "upstream", "fallback", "total")
# A streamed answer's first byte from the request's start, and the mean gap between its tokens,
# as the Worker saw them (histogram.js STREAMED); counts of prefix-affinity picks (PICKS).
STREAMED = ("ttft", "itl")
PICKS = ("affinity", "shed")
# A pod request's wait for its first token: its place in the pod's queue (histogram.js QUEUED).
QUEUED = ("queue",)
# Counts of a pod's streams cut after their first token (it broke off or stalled: a preempted pod's
# streams end so), each ended with an error event (histogram.js CUTS).
CUTS = ("cut",)
SYNC = "sync"
SEGMENTS = (*ROUTED, *STREAMED, *QUEUED, SYNC)
RECORDED = (*SEGMENTS, *PICKS, *CUTS)  # every segment a row may carry
PER_POD = (*ROUTED, *STREAMED, *QUEUED, *PICKS, *CUTS)
# What each live segment stands for among the probe's segments (budgets, floors).
BUDGET_ALIAS = {"state_rtt": SYNC}
MINUTE_MS = 60_000
HOUR_MS = 3_600_000


class LiveDataError(TargetError):
    """The live endpoint's answer is not what the contract says (names the field and value)."""


# --- the window's rows ---

@dataclass(frozen=True)
class Row:
    start_ms: int  # the minute's (or hour's) first ms
    span_ms: int  # MINUTE_MS or HOUR_MS
    colo: str  # where the Worker ran (routed segments); where the state object answered (sync)
    who: str  # the pod index or "fallback" (routed segments); the Worker's colo (sync)
    segment: str
    hist: Histogram
    client: str | None = None  # behind a fleet's front door: the colo it received the request in


def rows_of(doc: Mapping) -> tuple[list[Row], Buckets]:
    """The rows and bucket layout of a ``GET /_colocate/live`` answer."""
    try:
        buckets = Buckets.from_doc(doc.get("buckets"))
    except HistogramError as exc:
        raise LiveDataError(str(exc)) from None
    out = []
    for field_name, span in (("minutes", MINUTE_MS), ("hours", HOUR_MS)):
        listed = doc.get(field_name) or []
        if not isinstance(listed, list):
            raise LiveDataError(f"{field_name}: expected a list of [start, colo, who, segment, histogram] rows")
        for r in listed:
            if not (isinstance(r, list) and len(r) == len(HIST) and isinstance(r[HIST["at"]], int)
                    and r[HIST["segment"]] in RECORDED):
                raise LiveDataError(f"{field_name} row {r!r}: expected [{', '.join(HIST.names)}] "
                                    f"with segment one of {', '.join(RECORDED)}")
            row = HIST.record(r)
            try:
                hist = Histogram.decode(row["hist"], buckets)
            except HistogramError as exc:
                raise LiveDataError(f"{field_name} row {r[:4]!r}: {exc}") from None
            segment = row["segment"]
            who, _, client = str(row["who"]).partition("@") if segment != SYNC else (str(row["who"]), "", "")
            out.append(Row(row["at"] * span, span, str(row["colo"] or "unknown").upper(), who, segment, hist, client or None))
    return out, buckets


def backend_of(who: str) -> str:
    """``"0"`` → ``pod-0`` (x-colocate-backend's names); ``fallback`` stays."""
    return "fallback" if who == "fallback" else f"pod-{who}"


def _clock(ms: int) -> str:
    return time.strftime("%H:%M", time.gmtime(ms / 1000)) + " UTC"


def _status(colo: str | None, region: catalogue.Region | None) -> str:
    if colo is None or colo == "UNKNOWN" or region is None:
        return placement_mod.UNKNOWN
    return placement_mod.IN if region.is_in_region(colo) else placement_mod.OUT


def _current_part(by_minute: Mapping[int, Counter], region: catalogue.Region | None) -> tuple[placement_mod.Part, int | None]:
    """The Part as of the latest minute with data: its worst known colo (out of region first,
    then the most frequent; unknown only when nothing else was seen: an object or isolate
    that has not learnt its colo yet must not hide one that has), with every colo of the
    window in ``seen``."""
    seen: Counter = Counter()
    for c in by_minute.values():
        seen.update(c)
    if not by_minute:
        return placement_mod.Part(None, placement_mod.UNKNOWN, {}), None
    last = max(by_minute)
    now = by_minute[last]
    rank = {placement_mod.OUT: 0, placement_mod.IN: 1, placement_mod.UNKNOWN: 2}
    colo = min(now, key=lambda c: (rank[_status(c, region)], -now[c], c))
    shown = None if colo == "UNKNOWN" else colo
    return placement_mod.Part(shown, _status(shown, region), dict(seen)), last


# --- the window merged: one pass over the rows ---

@dataclass
class Minute:
    """One minute (or hour) of the window: requests, colos, and the total and sync histograms."""

    start_ms: int
    span_ms: int
    requests: int = 0
    fallback: int = 0  # of the requests, those the fallback answered
    worker: Counter = field(default_factory=Counter)
    state: Counter = field(default_factory=Counter)
    total: Histogram = field(default_factory=Histogram)
    sync: Histogram = field(default_factory=Histogram)


@dataclass
class Merged:
    """The window's rows added up by what the verdicts read."""

    # ttft and itl here are the pods' own; the fallback's streams are apart (fallback_streamed)
    segments: dict[str, Histogram] = field(default_factory=lambda: {s: Histogram() for s in RECORDED})
    fallback_streamed: dict[str, Histogram] = field(default_factory=lambda: {s: Histogram() for s in STREAMED})
    per_pod: dict[str, dict[str, Histogram]] = field(
        default_factory=lambda: defaultdict(lambda: {s: Histogram() for s in PER_POD}))
    # the state object's colo -> (the Worker's colo -> its syncs there)
    sync_pairs: dict[str, dict[str, Histogram]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(Histogram)))
    state_span: dict[str, tuple[int, int]] = field(default_factory=dict)
    minutes: dict[int, Minute] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: Iterable[Row]) -> Merged:
        m = cls()
        for r in rows:
            if r.segment in STREAMED and r.who == "fallback":
                m.fallback_streamed[r.segment].add(r.hist)
            else:
                m.segments[r.segment].add(r.hist)
            t = m.minutes.setdefault(r.start_ms, Minute(r.start_ms, r.span_ms))  # hours count as their first minute
            n = r.hist.n
            if r.segment == SYNC:
                m.sync_pairs[r.colo][r.who.upper()].add(r.hist)
                first, last = m.state_span.get(r.colo, (r.start_ms, r.start_ms + r.span_ms))
                m.state_span[r.colo] = (min(first, r.start_ms), max(last, r.start_ms + r.span_ms))
                t.state[r.colo] += n
                t.sync.add(r.hist)
            else:
                m.per_pod[r.who][r.segment].add(r.hist)
                if r.segment == "total":
                    t.worker[r.colo] += n
                    t.requests += n
                    t.fallback += n if r.who == "fallback" else 0
                    t.total.add(r.hist)
        return m

    def by_minute(self, part: str) -> dict[int, Counter]:
        return {s: getattr(t, part) for s, t in self.minutes.items() if getattr(t, part)}

    def sync_of(self, state_colo: str) -> Histogram:
        return merged(self.sync_pairs.get(state_colo, {}).values())


# --- the typed results ---

@dataclass(frozen=True)
class PodServed:
    """One pod (or the fallback) in the window: its requests and segments; for a pod its site."""

    who: str
    requests: int
    share: float | None
    segments: dict[str, dict]
    index: int | None = None
    location: str | None = None
    site: str | None = None
    status: str | None = None
    affinity: int = 0  # requests prefix affinity sent here as the point's own pod
    shed: int = 0  # requests the load bound shed here from another pod
    prefix_cache: dict | None = None  # the pod's own vLLM counters: {hits, queries, hit_rate}
    cut: int = 0  # its streams cut after their first token (broke off or stalled), each ended with an error event

    @property
    def backend(self) -> str:
        return backend_of(self.who)

    def to_json(self) -> dict:
        out = {"pod": self.who, "backend": self.backend, "requests": self.requests, "share": self.share,
               "segments": self.segments}
        if self.index is not None:
            out.update(index=self.index, location=self.location, site=self.site, status=self.status,
                       affinity=self.affinity, shed=self.shed, prefix_cache=self.prefix_cache, cut=self.cut)
        return out


@dataclass(frozen=True)
class WorkerColo:
    colo: str
    requests: int
    share: float | None
    status: str
    floor_to_pod_ms: float | None
    latest: bool

    def to_json(self) -> dict:
        return {"colo": self.colo, "requests": self.requests, "share": self.share, "status": self.status,
                "floor_to_pod_ms": self.floor_to_pod_ms, "latest": self.latest}


@dataclass(frozen=True)
class StateColo:
    colo: str
    syncs: int
    status: str
    sync: dict
    by_worker: dict[str, dict]  # the Worker's colo -> its syncs' summary
    floor_ms: dict[str, float | None]
    first_ms: int
    last_ms: int
    latest: bool

    def to_json(self) -> dict:
        return {"colo": self.colo, "syncs": self.syncs, "status": self.status, "sync": self.sync, "from": self.by_worker,
                "first_ms": self.first_ms, "last_ms": self.last_ms, "floor_ms": self.floor_ms, "latest": self.latest}


@dataclass(frozen=True)
class TimelinePoint:
    start_ms: int
    span_s: int
    requests: int
    worker_colos: dict[str, int]
    state_colos: dict[str, int]
    sync_p50: float | None
    sync_p90: float | None
    total_p50: float | None
    total_p90: float | None

    def to_json(self) -> dict:
        return {"start_ms": self.start_ms, "span_s": self.span_s, "requests": self.requests,
                "worker_colos": self.worker_colos, "state_colos": self.state_colos, "sync_p50": self.sync_p50,
                "sync_p90": self.sync_p90, "total_p50": self.total_p50, "total_p90": self.total_p90}


@dataclass
class LiveResult:
    url: str | None
    since_ms: int
    until_ms: int
    buckets: Buckets
    segments: dict[str, dict]
    requests: int
    backends: dict[str, int]
    pods: list[PodServed]
    worker_colos: list[WorkerColo]
    state_colos: list[StateColo]
    placement: placement_mod.Placement
    floors: dict[str, float | None]
    budgets: list[budgets_mod.Budget]
    findings: list[placement_mod.Finding]
    violations: list[dict]
    notes: list[str] = field(default_factory=list)
    timeline: list[TimelinePoint] = field(default_factory=list)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    # The fallback's spend today (UTC) against its caps, $ ({day, usd, cell_cap_usd, key_cap_usd});
    # None from a Worker that does not report it.
    fallback_spend: dict | None = None
    fallback_streams: dict[str, dict] = field(default_factory=dict)  # the fallback's ttft, itl ({} if none)
    max_fallback_share: float = fallbackshare.DEFAULT_MAX_SHARE

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def verdict(self) -> str:
        if self.violations:
            more = len(self.violations) - 1
            return self.violations[0]["message"] + (f" (+{more} more: see violations)" if more else "")
        if not self.requests:
            return f"no routed traffic since {_clock(self.since_ms)}: nothing to judge"
        p = self.placement
        total, sync = self.segments["total"]["p50"], self.segments[SYNC]["p50"]
        fb = self.backends.get("fallback", 0)
        return (f"all checks hold: {self.requests} requests since {_clock(self.since_ms)}, Worker in {p.ran.colo}, "
                f"state object in {p.state.colo}, region {p.expected_region}; total p50 {_num(total)} ms, "
                f"sync p50 {_num(sync)} ms, fallback {fb / self.requests:.0%}")


def _num(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def _pod_order(who: str) -> tuple[int, int | str]:
    return (0, int(who)) if who.isdigit() else (1, who)


def _placement(doc: Mapping, m: Merged, region: catalogue.Region | None,
               locations: Sequence[str]) -> tuple[placement_mod.Placement, int | None]:
    ran, _ = _current_part(m.by_minute("worker"), region)
    state, last_state_minute = _current_part(m.by_minute("state"), region)
    site = placement_mod.pod_site(locations[0], region) if locations else None
    place = placement_mod.Placement(
        expected_region=region.name if region else None,
        in_region_colos=region.in_region_colos if region else (),
        accepted=placement_mod.Part(None, placement_mod.UNKNOWN, {}),
        ran=ran, state=state,
        pod=placement_mod.Part(site, _status(site, region), {site: 1} if site else {}),
        ran_source="live", cf_placement=None,
        pod_location=locations[0] if locations else None, pod_host=None,
        generation=doc.get("generation") if isinstance(doc.get("generation"), str) else None,
        draining_generation=doc.get("draining_generation") if isinstance(doc.get("draining_generation"), str) else None,
    )
    return place, last_state_minute


def prefix_caches(doc: Mapping) -> dict[int, dict]:
    """The answer's ``pod_prefix`` ([{index, hits, queries}], each pod's own vLLM prefix-cache counters, in
    tokens, as the Worker read them from its /metrics just now) by pod index, with the hit rate; absent: {}."""
    out = {}
    for p in doc.get("pod_prefix") or []:
        if not isinstance(p, Mapping) or not isinstance(p.get("index"), int):
            continue
        hits, queries = p.get("hits"), p.get("queries")
        if isinstance(hits, int | float) and isinstance(queries, int | float) and 0 <= hits <= queries:
            out[p["index"]] = {"hits": hits, "queries": queries, "hit_rate": round(hits / queries, 4) if queries else None}
    return out


def _pods(m: Merged, requests: int, region: catalogue.Region | None, locations: Sequence[str],
          buckets: Buckets, caches: Mapping[int, dict] | None = None) -> tuple[list[PodServed], list[dict]]:
    """Each pod and the fallback, and a violation per pod out of region that served requests."""
    out, violations = [], []
    caches = caches or {}
    for who, h in sorted(m.per_pod.items(), key=lambda kv: _pod_order(kv[0])):
        n = h["total"].n
        share = round(n / requests, 4) if requests else None
        segments = {s: h[s].summary(buckets).to_json() for s in (*ROUTED, *STREAMED, *QUEUED)}
        if not who.isdigit():
            out.append(PodServed(who, n, share, segments))
            continue
        index = int(who)
        loc = locations[index] if index < len(locations) else None
        psite = placement_mod.pod_site(loc, region)
        pod = PodServed(who, n, share, segments, index, loc, psite, _status(psite, region),
                        h["affinity"].n, h["shed"].n, caches.get(index), h["cut"].n)
        if pod.status == placement_mod.OUT and index > 0 and n:
            violations.append({"kind": "placement", "part": "pod",
                               "message": f"pod {index} in {loc} ({psite}) served {n} requests from outside "
                                          f"{region.name if region else '?'} — check colocate:pod and run pulumi up"})
        out.append(pod)
    return out, violations


def build(doc: Mapping, region: catalogue.Region | None, locations: Sequence[str] = (),
          budget_list: Iterable[budgets_mod.Budget] = (), worker_placement: str | None = None,
          url: str | None = None, max_fallback_share: float = fallbackshare.DEFAULT_MAX_SHARE,
          routed_pods: int | None = None) -> LiveResult:
    """Merge the window's rows and judge them (see the module docstring). ``routed_pods``: the pods the
    Worker routes to (``GET /_colocate/scale``), where known: with none, the fallback serves by design."""
    rows, buckets = rows_of(doc)
    since = int(doc.get("since") or 0)
    until = int(doc.get("now") or (max((r.start_ms + r.span_ms for r in rows), default=since)))
    if region is None and isinstance(doc.get("region"), str):
        region = catalogue.region(doc["region"], key="the Worker's region")
    m = Merged.of(rows)
    segments = {s: m.segments[s].summary(buckets).to_json() for s in SEGMENTS}
    backends = {backend_of(who): h["total"].n for who, h in sorted(m.per_pod.items(), key=lambda kv: _pod_order(kv[0]))}
    requests = sum(backends.values())

    place, last_state_minute = _placement(doc, m, region, locations)
    ran, state = place.ran, place.state
    floors = place.floors()
    live_floors = {SYNC: floors["state_rtt"], "upstream": floors["upstream"]}
    # The state check's numbers: the sync round trips of the latest minute's state colo.
    current_sync = None
    if state.colo and last_state_minute is not None:
        pair = m.sync_pairs.get(state.colo, {}).get(ran.colo or "")  # from where the Worker runs now, when seen
        current_sync = (pair if pair and pair.n else m.sync_of(state.colo)).summary(buckets).p50
    p50 = {"state_rtt": current_sync, "pod_rtt": None}

    notes: list[str] = []
    found = [f for f in placement_mod.findings(place, p50, worker_placement) if f.part != "accepted"]
    violations = []
    if requests:
        for f in found:
            if not f.fails:
                continue
            where = {"ran": f"segment total, Worker colo {ran.colo}",
                     "state": f"segment sync (state_rtt), state colo {state.colo}",
                     "pod": f"segment upstream, pod site {place.pod.colo}"}.get(f.part, f.part)
            violations.append({"kind": "placement", "part": f.part, "message": f"{f.message} [live: {where}]"})
    pods, pod_violations = _pods(m, requests, region, locations, buckets, prefix_caches(doc))
    violations += pod_violations
    share_violation, share_notes = fallback_share(m, max_fallback_share, routed_pods)
    violations = ([share_violation] if share_violation else []) + violations  # first: the rest follows from it
    notes += share_notes

    by_worker = m.by_minute("worker")
    seen_worker: Counter = Counter()
    for c in by_worker.values():
        seen_worker.update(c)
    worker_colos = [WorkerColo(colo, n, round(n / requests, 4) if requests else None, _status(colo, region),
                               placement_mod.floor_between(colo, place.pod.colo), colo in by_worker[max(by_worker)])
                    for colo, n in seen_worker.most_common()]
    by_state = m.by_minute("state")
    state_colos = []
    for colo in sorted(m.sync_pairs, key=lambda c: -m.sync_of(c).n):
        h = m.sync_of(colo)
        first, last = m.state_span[colo]
        pairs = {w: v.summary(buckets).to_json() for w, v in m.sync_pairs[colo].items()}
        s = StateColo(colo, h.n, _status(colo, region), h.summary(buckets).to_json(), pairs,
                      {w: placement_mod.floor_between(w, colo) for w in pairs}, first, last,
                      last_state_minute is not None and colo in by_state.get(last_state_minute, {}))
        state_colos.append(s)
        if s.status == placement_mod.OUT and not s.latest:
            notes.append(f"the state object answered from {colo} (out of region) from {_clock(first)} to "
                         f"{_clock(last)} (sync p50 {_num(s.sync['p50'])} ms); since then from "
                         f"{state.colo or 'unknown'}")
    for w in worker_colos:
        if w.status == placement_mod.OUT and not w.latest:
            notes.append(f"the Worker ran in {w.colo} (out of region) for {w.requests} requests earlier in the "
                         f"window; in the latest minute it ran in {ran.colo}")

    budget_list = list(budget_list)
    live_budgets = [b for b in budget_list if b.segment in ROUTED or b.segment in STREAMED or b.segment in BUDGET_ALIAS]
    for b in budget_list:
        if b not in live_budgets:
            notes.append(f"{b.segment} budget {b.ms:g} ms ({b.percentile}) is not checked live: real traffic does "
                         "not record it (run probe.py without --live)")
    if requests:
        view = {**segments, **{alias: segments[s] for alias, s in BUDGET_ALIAS.items()}}
        violations += budgets_mod.broken(live_budgets, view, {**live_floors, "state_rtt": floors["state_rtt"]})
    elif live_budgets:
        notes.append(f"no routed traffic since {_clock(since)}: {len(live_budgets)} budgets not checked")
    found_info = [f for f in found if not f.fails or not requests]
    return LiveResult(
        url=url, since_ms=since, until_ms=until, buckets=buckets, segments=segments, requests=requests,
        backends=backends, pods=pods, worker_colos=worker_colos, state_colos=state_colos, placement=place,
        floors=live_floors, budgets=live_budgets, findings=found_info, violations=violations, notes=notes,
        timeline=[_timeline_point(t, buckets) for _, t in sorted(m.minutes.items())],
        histograms={s: h for s, h in m.segments.items() if h.n},
        fallback_spend=spend_of(doc),
        fallback_streams={s: h.summary(buckets).to_json() for s, h in m.fallback_streamed.items()} if any(
            h.n for h in m.fallback_streamed.values()) else {},
        max_fallback_share=max_fallback_share,
    )


def fallback_share(m: Merged, max_share: float, routed_pods: int | None) -> tuple[dict | None, list[str]]:
    """The fallback's share judged on the latest minute with requests (as placement is: a minute of pods
    down fails the view, and the minute after they serve again clears it); over the whole window, a note.
    A latest minute of fewer than ``MIN_FALLBACK`` answers is too young to judge alone (the requests of
    an outage that straddle a minute's boundary would leave it one answer and pass): it is judged
    together with the busy minute before it."""
    busy = sorted((t for t in m.minutes.values() if t.requests), key=lambda t: t.start_ms)
    if not busy:
        return None, []
    judged = busy[-2:] if busy[-1].requests < fallbackshare.MIN_FALLBACK else busy[-1:]
    which = (f"the latest minute's requests ({_clock(judged[-1].start_ms)})" if len(judged) == 1 else
             f"the latest two minutes' requests ({_clock(judged[0].start_ms)} and {_clock(judged[-1].start_ms)})")
    latest = fallbackshare.Share(sum(t.fallback for t in judged), sum(t.requests for t in judged), which)
    window = fallbackshare.Share(sum(t.fallback for t in busy), sum(t.requests for t in busy), "the window's requests")
    notes = [n for n in (latest.note(max_share, routed_pods),) if n]
    violation = latest.violation(max_share, routed_pods)
    if violation is None and routed_pods != 0 and window.violation(max_share) is not None:
        notes.append(f"the fallback served {window.share:.0%} of the window's requests ({window.fallback} of "
                     f"{window.total}), more than colocate:probe.maxFallbackShare {max_share:.0%}; the latest minute "
                     "is within it")
    return violation, notes


def spend_of(doc: Mapping) -> dict | None:
    """The answer's ``fallback_spend``, checked: {day, usd, cell_cap_usd, key_cap_usd}, numbers >= 0 or null."""
    spend = doc.get("fallback_spend")
    if spend is None:
        return None
    fields = ("usd", "cell_cap_usd", "key_cap_usd")
    if not isinstance(spend, Mapping) or not isinstance(spend.get("day"), str) or not all(
            spend.get(f) is None or (isinstance(spend.get(f), int | float) and not isinstance(spend.get(f), bool)
                                     and spend.get(f) >= 0) for f in fields):
        raise LiveDataError(f"fallback_spend is {spend!r}: expected {{day, usd, cell_cap_usd, key_cap_usd}}, "
                            "each amount a number >= 0 or null")
    return {"day": spend["day"], **{f: spend.get(f) for f in fields}}


def spend_line(spend: dict | None) -> str | None:
    """The table's line for the fallback's spend today, or None when the Worker did not report it."""
    if spend is None:
        return None
    if spend["usd"] is None:
        return f"fallback spend {spend['day']} (UTC): not counted (set colocate:fallbackPrice)"
    return (f"fallback spend {spend['day']} (UTC): {dollars(spend['usd'])} of {_cap(spend['cell_cap_usd'])} for the cell; "
            f"each key {_cap(spend['key_cap_usd'])}")


def _cap(usd: float | None) -> str:
    return "no cap" if usd is None else f"{dollars(usd)} a day"


def _timeline_point(t: Minute, buckets: Buckets) -> TimelinePoint:
    sync, total = t.sync.summary(buckets), t.total.summary(buckets)
    return TimelinePoint(t.start_ms, t.span_ms // 1000, t.requests, dict(t.worker), dict(t.state),
                         sync.p50, sync.p90, total.p50, total.p90)


def to_json(r: LiveResult, warn_only: bool = False) -> dict:
    """The machine form (docs/probe.md, "Live view"): ``segments.<name>.{p10,p50,p90,p99,n}``."""
    return {
        "ok": r.ok, "verdict": r.verdict, "live": True, "url": r.url,
        "since_ms": r.since_ms, "until_ms": r.until_ms,
        "segments": r.segments, "requests": r.requests, "backends": r.backends,
        "fallback_rate": round(r.backends.get("fallback", 0) / r.requests, 4) if r.requests else None,
        "pods": [p.to_json() for p in r.pods],
        "colos": {"worker": [w.to_json() for w in r.worker_colos], "state": [s.to_json() for s in r.state_colos]},
        "placement": r.placement.to_json(), "floor_ms": r.floors,
        "budgets": [b.to_json() for b in r.budgets], "violations": r.violations,
        "findings": [{"part": f.part, "fails": f.fails, "message": f.message} for f in r.findings],
        "notes": r.notes, "timeline": [t.to_json() for t in r.timeline], "warn_only": warn_only,
        "relative_error": round(r.buckets.relative_error, 5),
        "fallback_spend": r.fallback_spend,
        "fallback_streams": r.fallback_streams,
        "max_fallback_share": r.max_fallback_share,
    }


# One line per segment of the table, and why a colo can be unknown.
SEGMENT_LEGEND = (
    "state     the Worker waiting on the state object before forwarding (0: it used its cached copy)",
    "upstream  the pods' answer as the Worker saw it, every pod tried",
    "fallback  the fallback API's answer (0 when it was not used)",
    "total     the Worker's own time for the request, from its arrival to the answer leaving it",
    "sync      each isolate's background round trip to the state object (its state_rtt)",
    "ttft      a pod's streamed answer: its first byte, from the request's arrival at the Worker",
    "itl       a pod's streamed answer: the mean gap between its tokens (the fallback's streams are apart, below)",
    "queue     a pod request's wait for its first token: the prompts ahead of it in the pod's queue and its own prefill",
)
UNKNOWN_COLO_WHY = {
    "worker": "the Worker's /cdn-cgi/trace did not answer, so where it ran is not known",
    "state": "the state object's /cdn-cgi/trace did not answer, so where it lives is not known",
}


def table(r: LiveResult) -> str:
    """The human report, laid out as the probe's: segments, shares, colos, verdict."""
    broken = {(v["segment"], v["percentile"]) for v in r.violations if v["kind"] == "budget"}
    marks: dict[str, list[str]] = {}
    for b in r.budgets:
        seg = BUDGET_ALIAS.get(b.segment, b.segment)
        mark = " BROKEN" if (b.segment, b.percentile) in broken else " ok"
        marks.setdefault(seg, []).append(f"{b.segment} {b.ms:g}@{b.percentile}{mark}")
    lines = [f"colocate live view  {r.url or ''}".rstrip(),
             f"real traffic from {_clock(r.since_ms)} to {_clock(r.until_ms)}: {r.requests} routed requests; "
             f"percentiles read from the Worker's fixed latency buckets: within {r.buckets.relative_error:.1%} "
             "of exact", ""]
    head = f"{'segment':<10}" + "".join(f"{p:>9}" for p in PERCENTILES) + f"{'n':>8}{'floor':>9}{'p50/floor':>11}  budget"
    lines += [head + "  (ms)", "-" * len(head)]
    for name in SEGMENTS:
        seg = r.segments[name]
        row = f"{name:<10}" + "".join(f"{_num(seg[p], 1):>9}" for p in PERCENTILES) + f"{seg['n']:>8}"
        floor = r.floors.get(name)
        ratio = None if seg["p50"] is None or floor is None or floor < placement_mod.NEAR_ZERO_MS else seg["p50"] / floor
        row += f"{_num(floor, 1) if name in r.floors else '':>9}"
        row += f"{(f'{ratio:.2f}x' if ratio is not None else '-') if name in r.floors else '':>11}"
        row += "  " + ", ".join(marks.get(name, []))
        lines.append(row.rstrip())
    lines += ["", *SEGMENT_LEGEND, "", "served by (who answered the routed requests; a pod's location and region check; "
                                     f"the view fails when the fallback answers over {r.max_fallback_share:.0%} of a minute)"]
    for pod in r.pods:
        share = "n/a" if pod.share is None else f"{pod.share:.1%}"
        up = pod.segments["upstream"]
        where = ""
        if pod.index is not None:
            loc = f"{pod.location} ({pod.site})" if pod.location else "location not given (--pod-location)"
            where = f"  {loc} {(pod.status or '').replace('_', ' ')}"
        picked = pod.affinity + pod.shed
        picks = f"  by affinity {pod.affinity / picked:.0%}, shed by load {pod.shed / picked:.0%}" if picked else ""
        cache = pod.prefix_cache
        hit = (f"  prefix cache {cache['hit_rate']:.0%} of {cache['queries']:,.0f} tokens"
               if cache and cache["hit_rate"] is not None else "")
        streams = (f"  ttft p50 {_num(pod.segments['ttft']['p50'], 1)} ms, itl p50 {_num(pod.segments['itl']['p50'], 1)} ms"
                   if pod.segments["ttft"]["n"] else "")
        cut = f"  {pod.cut} stream(s) cut mid-answer" if pod.cut else ""
        lines.append(f"  {pod.backend:<10}{pod.requests:>8} {share:>7}  upstream p50 {_num(up['p50'], 1)} "
                     f"p90 {_num(up['p90'], 1)} ms{where}{picks}{hit}{streams}{cut}")
    p = r.placement
    expected = (f"{p.expected_region} ({', '.join(p.in_region_colos)})" if p.expected_region
                else "unknown: no --expect-region or --stack, and the Worker reported no region")
    lines += ["", f"colos (where the Worker ran and where the state object answered its syncs; expected region "
                  f"{expected}; judged on the latest minute)"]
    for w in r.worker_colos:
        shown = w.status.replace("_", " ")
        lines.append(f"  worker {w.colo:<8}{shown:<15}{w.requests:>8} requests"
                     + ("" if w.latest else "  (earlier in the window)")
                     + (f"  ({UNKNOWN_COLO_WHY['worker']})" if w.colo == "UNKNOWN" else ""))
    for s in r.state_colos:
        shown = s.status.replace("_", " ")
        if s.colo == "UNKNOWN":
            lines.append(f"  state  unknown {s.syncs:>23} syncs, p50 {_num(s.sync['p50'], 1)} ms  "
                         f"({UNKNOWN_COLO_WHY['state']})")
            continue
        floors = ", ".join(f"from {w} floor {_num(f, 1)} ms" for w, f in s.floor_ms.items())
        lines.append(f"  state  {s.colo:<8}{shown:<15}{s.syncs:>8} syncs, p50 {_num(s.sync['p50'], 1)} ms"
                     f" ({floors})" + ("" if s.latest else "  (earlier in the window)"))
    if p.generation:
        lines.append(f"  generation {p.generation}")
    spend = spend_line(r.fallback_spend)
    if spend:
        lines += ["", spend]
    info = [f.message for f in r.findings] + r.notes
    if info:
        lines += ["", "notes:"] + [f"  - {m}" for m in info]
    if r.violations:
        lines += ["", "violations:"] + [f"  - {v['message']}" for v in r.violations]
    lines += ["", ("OK: " if r.ok else "FAIL: ") + r.verdict]
    return "\n".join(lines) + "\n"


def parse_since(text: str, now_ms: int | None = None) -> int:
    """``30m``, ``1h``, ``7d`` (or a whole number of seconds) before now → ms epoch."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    units = {"s": 1_000, "m": MINUTE_MS, "h": HOUR_MS, "d": 24 * HOUR_MS}
    t = (text or "").strip().lower()
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "s")
    if not num.isdigit() or int(num) <= 0:
        raise ValueError(f"{text!r} is not a duration like 30m, 1h or 7d")
    return now_ms - int(num) * units[unit]


def write_plot(r: LiveResult, path) -> None:
    """A PNG of the window, minute by minute: total and sync p50 (lines) and p90 (dotted), the
    minutes the state object or the Worker answered from outside the region shaded red, the
    budgets as dashed lines (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    try:
        pts = [t.to_json() for t in r.timeline if t.requests or t.sync_p50 is not None]
        xs = [datetime.fromtimestamp(t["start_ms"] / 1000, tz=UTC) for t in pts]
        for key, colour, label in (("total", "tab:blue", "total"), ("sync", "tab:orange", "sync (state_rtt)")):
            p50 = [t[f"{key}_p50"] for t in pts]
            p90 = [t[f"{key}_p90"] for t in pts]
            ax.plot(xs, [float("nan") if v is None else v for v in p50], color=colour, marker=".", label=f"{label} p50")
            ax.plot(xs, [float("nan") if v is None else v for v in p90], color=colour, linestyle="dotted",
                    label=f"{label} p90")
        region = catalogue.region(r.placement.expected_region) if r.placement.expected_region else None
        shaded = False
        for t, x in zip(pts, xs, strict=True):
            bad = [c for c in (*t["state_colos"], *t["worker_colos"]) if _status(c, region) == placement_mod.OUT]
            if bad:
                ax.axvspan(x, datetime.fromtimestamp((t["start_ms"] + t["span_s"] * 1000) / 1000, tz=UTC),
                           color="tab:red", alpha=0.15, label=None if shaded else "out of region")
                shaded = True
        for b in r.budgets:
            ax.axhline(b.ms, color="tab:red", linestyle="dashed", linewidth=1)
            ax.annotate(f"{b.segment} {b.ms:g} ({b.percentile})", (xs[0] if xs else 0, b.ms), fontsize=7, color="tab:red")
        if not pts:
            ax.text(0.5, 0.5, "no traffic in the window", ha="center", va="center", transform=ax.transAxes)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        ax.set_xlabel("minute (UTC)")
        ax.set_ylabel("milliseconds")
        values = [v for t in pts for v in (t["total_p90"], t["sync_p90"]) if v]
        if values and max(values) / max(min(values), 0.25) > 20:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.set_title(("OK: " if r.ok else "FAIL: ") + r.verdict, fontsize=7, wrap=True)
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def scale_summary(state: Mapping | None) -> tuple[str, dict | None]:
    """The scaling controller's last decision as ``GET /_colocate/scale`` holds it: one table
    line and its JSON (desired and running pods, the last reason; docs/pods.md "Scaling with demand")."""
    if state is None:
        return "", None
    d = state.get("decision") or {}
    doc = {"desired": d.get("desired"), "running": d.get("running"), "draining": d.get("draining"), "reason": d.get("reason"),
           "decided_at": d.get("at"), "owner": d.get("owner"), "routed_pods": state.get("routed_pods"),
           "inflight": dict(state.get("inflight") or {}), "lock": (state.get("lock") or {}).get("owner")}
    if not d:
        return f"scale: no decision recorded; the Worker routes to {state.get('routed_pods')} pod(s)\n", doc
    when = _clock(int(d["at"])) if isinstance(d.get("at"), int) else "?"
    return (f"scale: desired {d.get('desired')}, running {d.get('running')}, routed {state.get('routed_pods')} "
            f"(decided {when} by {d.get('owner')}): {d.get('reason')}\n"), doc
