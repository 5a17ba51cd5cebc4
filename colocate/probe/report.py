"""The probe's result: segments, placement, floors, budgets, violations, and how to show them.

``build`` turns a sampled run into a ``Result``; ``to_json`` is the machine form (the
contract in docs/probe.md), ``table`` the human one. Failed samples (non-2xx, timeouts) are
counted and left out of the percentiles; samples whose Server-Timing is missing or
malformed are counted, and their good entries still used. A segment with no data has
``None`` percentiles, shown as ``n/a``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..cell import catalogue
from ..cell.settings import SEGMENTS
from . import budgets as budgets_mod, fallbackshare, placement as placement_mod
from .connections import NOT_MEASURED, port_of
from .sample import PROBE_METRICS, ROUTED_METRICS, Run, Sample
from .stats import PERCENTILES, summary


@dataclass
class Result:
    url: str
    model: str
    samples: int
    values: dict[str, list[float]]  # raw ms per segment (for the plot)
    segments: dict[str, dict]
    fallback_rate: float | None
    backends: dict[str, int]
    placement: placement_mod.Placement
    floors: dict[str, float | None]
    budgets: list[budgets_mod.Budget]
    findings: list[placement_mod.Finding]
    violations: list[dict]
    errors: dict[str, dict[str, int]]
    server_timing: dict[str, dict[str, int]]
    notes: list[str] = field(default_factory=list)
    pods: list[dict] = field(default_factory=list)  # per pod: index, host, location, site, status, rtt, health
    pod_path: str | None = None  # how the Worker reaches the pods (zone-dns | provider-proxy | local-hostname)
    fallback_check: dict | None = None  # the Worker's one check of the fallback, as it reported it
    settling: dict | None = None  # --settle: {settled, seconds, colos}
    new_connections: dict = field(default_factory=dict)  # how pod_rtt_new was measured, or why not
    # ttft and itl of the streams the fallback answered: apart, so the segments above are the pods' own
    fallback_streams: dict = field(default_factory=dict)
    max_fallback_share: float = fallbackshare.DEFAULT_MAX_SHARE

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def provisional(self) -> bool:
        """A placement check failed while the placement had not settled (--settle ran out):
        Cloudflare may not have applied it yet, so the verdict cannot stand."""
        return bool(self.settling and not self.settling["settled"] and any(
            v["kind"] == "placement" for v in self.violations))

    @property
    def verdict(self) -> str:
        if self.violations:
            more = len(self.violations) - 1
            return self.violations[0]["message"] + (f" (+{more} more: see violations)" if more else "")
        p = self.placement
        pod = f"pod {p.pod_location} ({p.pod.colo})" if p.pod.colo else f"pod location not checked ({UNKNOWN_WHY['pod']})"
        e2e, rtt = self.segments["e2e"]["p50"], self.segments["state_rtt"]["p50"]
        path = f", pod_rtt p50 {_num(self.segments['pod_rtt']['p50'])} ms over {self.pod_path}" if self.pod_path else ""
        mode = f" ({p.mode} placement)" if p.mode else ""
        held = "all checks hold" if p.pod.colo else "every check made holds"
        return (f"{held}: Worker in {p.ran.colo}{mode}, state object in {p.state.colo}, {pod}, "
                f"region {p.expected_region}; e2e p50 {_num(e2e)} ms, state_rtt p50 {_num(rtt)} ms{path}")


# Why a part's colo can be unknown, printed next to it.
UNKNOWN_WHY = {
    "accepted": "no cf-ray header in the answers",
    "worker": "the Worker reported no worker_colo and no cf-placement",
    "state": "the state object reported no state_colo",
    "pod": "no pod location given: pass --pod-location LOC, or --stack S / --state-dir DIR to read it",
}


def _num(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def _errors(samples: Iterable[Sample]) -> dict[str, int]:
    return dict(Counter(s.error for s in samples if s.error))


def _timing_quality(samples: list[Sample]) -> dict[str, int]:
    ok = [s for s in samples if s.ok]
    missing = sum(1 for s in ok if s.timing.problems and s.timing.problems[0] == "no Server-Timing header")
    malformed = sum(1 for s in ok if s.timing.problems) - missing
    bad_body = sum(1 for s in ok if s.body_problem)
    out = {"ok": len(ok) - missing - malformed, "missing": missing, "malformed": malformed}
    if bad_body:
        out["bad_body"] = bad_body
    return out


def collect(run: Run) -> dict[str, list[float]]:
    """Raw values per segment from the successful samples."""
    values: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    for s in run.routed:
        if not s.ok:
            continue
        if s.e2e_ms is not None:
            values["e2e"].append(s.e2e_ms)
        for name in ROUTED_METRICS:
            if name in s.timing.durations:
                values[name].append(s.timing.durations[name])
    for s in run.probe:
        if not s.ok:
            continue
        body = s.body or {}
        for name in PROBE_METRICS:
            v = _number(body.get(f"{name}_ms"))
            if v is None:  # the JSON lacks it: the header may still carry it
                v = s.timing.durations.get(name)
            if v is not None:
                values[name].append(v)
    for s in run.streamed:  # the pods' streams: the fallback's are apart (fallback_streams)
        if s.ok and s.backend != "fallback" and s.ttft_ms is not None:
            values["ttft"].append(s.ttft_ms)
        if s.ok and s.backend != "fallback" and s.itl_ms is not None:
            values["itl"].append(s.itl_ms)
    for s in run.probe_new or []:
        first = next((e for e in pod_entries(s) if e.get("index") == 0), None)
        v = new_rtt(s, first) if first else None
        if v is not None:
            values["pod_rtt_new"].append(v)
    return values


def pod_entries(s: Sample) -> list[dict]:
    """The pods a successful probe body lists; a Worker from before several pods lists pod 0
    in the body's ``pod_*`` fields."""
    if not (s.ok and s.body):
        return []
    listed = s.body.get("pods")
    if not isinstance(listed, list):
        listed = [{"index": 0, "host": s.body.get("pod_host"), "rtt_ms": s.body.get("pod_rtt_ms"),
                   "ok": s.body.get("pod_ok"), "status": s.body.get("pod_status")}]
    return [e for e in listed if isinstance(e, dict) and isinstance(e.get("index"), int)]


def new_rtt(s: Sample, entry: dict) -> float | None:
    """A pod's health check on a new connection: answered, and its hop accepted a connection meanwhile.
    A read-only answer names pods by index, without their hosts: then its check counts only
    when every hop accepted one."""
    port = port_of(entry.get("host"))
    shown = port in s.new_ports if port is not None else bool(s.hop_ports) and s.new_ports >= s.hop_ports
    if entry.get("ok") is not True or not shown:
        return None
    return _number(entry.get("rtt_ms"))


def pods_of(run: Run, region: catalogue.Region | None, locations: list[str]) -> list[dict]:
    """Each pod as the probe bodies list it (``pods``), with its location (index order) and site,
    its pod_rtt (pooled connection) and pod_rtt_new (a new one, where measured)."""
    seen: dict[int, dict] = {}

    def held(entry: dict) -> dict:
        return seen.setdefault(entry["index"], {"rtt": [], "rtt_new": [], "ok": 0, "checks": 0, "host": None,
                                                "statuses": set()})

    for s in run.probe:
        for entry in pod_entries(s):
            p = held(entry)
            p["host"] = entry.get("host") or p["host"]
            rtt = _number(entry.get("rtt_ms"))
            if rtt is not None:
                p["rtt"].append(rtt)
            p["checks"] += 1
            p["ok"] += entry.get("ok") is True
            p["statuses"].add(str(entry.get("status")))
    for s in run.probe_new or []:
        for entry in pod_entries(s):
            rtt = new_rtt(s, entry)
            if rtt is not None:
                held(entry)["rtt_new"].append(rtt)
    out = []
    for index in sorted(seen):
        pod = seen[index]
        location = locations[index] if index < len(locations) else None
        site = placement_mod.pod_site(location, region)
        status = placement_mod.UNKNOWN if site is None or region is None else (
            placement_mod.IN if region.is_in_region(site) else placement_mod.OUT)
        out.append({"index": index, "host": pod["host"], "location": location, "site": site, "status": status,
                    "pod_rtt": summary(pod["rtt"]), "pod_rtt_new": summary(pod["rtt_new"]), "healthy": pod["ok"],
                    "checks": pod["checks"], "statuses": sorted(pod["statuses"])})
    return out


def new_connections_of(run: Run, values: list[float]) -> tuple[dict, str | None]:
    """How pod_rtt_new was measured (or why not) and, when some probes could not be shown to
    have opened a new connection to pod 0, a note saying so."""
    if run.probe_new is None:
        return {"measured": False, "why": NOT_MEASURED}, None
    taken, shown = len(run.probe_new), len(values)
    out = {"measured": True, "probes": taken, "shown_new": shown,
           "how": "the sandbox closed the pod hops' connections before each of these probes and counted the "
                  "connections each hop accepted during it; a pod's check counts only if its hop accepted one"}
    note = None if shown == taken else (
        f"{taken - shown} of {taken} new-connection probes were not shown to open a new connection to pod 0 "
        "(or its check failed): left out of pod_rtt_new")
    return out, note


def fallback_streams(run: Run) -> dict:
    """ttft and itl of the streamed samples the fallback answered ({} when it answered none)."""
    ours = [s for s in run.streamed if s.ok and s.backend == "fallback"]
    if not ours:
        return {}
    return {"ttft": summary([s.ttft_ms for s in ours if s.ttft_ms is not None]),
            "itl": summary([s.itl_ms for s in ours if s.itl_ms is not None])}


def fallback_of(run: Run) -> tuple[dict | None, str | None]:
    """The Worker's fallback check and, when there is none to read, why."""
    s = run.fallback_check
    if s is None:
        return None, None
    if not s.ok:
        return None, f"the fallback check request failed ({s.error})"
    fb = (s.body or {}).get("fallback")
    if not isinstance(fb, dict):
        return None, "the Worker did not report a fallback check (a Worker from before ?fallback=1)"
    return {k: fb.get(k) for k in ("ok", "status", "rtt_ms", "model", "model_listed", "error")}, None


def build(run: Run, region: catalogue.Region | None, pod_location: str | list[str] | None,
          budget_list: list[budgets_mod.Budget], worker_placement: str | None = None,
          pod_path: str | None = None, placement_host: str | None = None, migrate_flags: str | None = None,
          max_fallback_share: float = fallbackshare.DEFAULT_MAX_SHARE) -> Result:
    locations = [pod_location] if isinstance(pod_location, str) else list(pod_location or [])
    pod_location = locations[0] if locations else None
    values = collect(run)
    segments = {name: summary(values[name]) for name in SEGMENTS}
    ok_routed = [s for s in run.routed if s.ok]
    backends = dict(Counter(s.backend or "unknown" for s in ok_routed))
    with_backend = sum(n for b, n in backends.items() if b != "unknown")
    fallback_rate = round(backends.get("fallback", 0) / with_backend, 4) if with_backend else None

    bodies = [s.body for s in [run.warmup, *run.probe] if s.ok and s.body]
    if region is None:  # nothing said which region: believe the Worker's own CELL_REGION
        named = next((b.get("region") for b in reversed(bodies) if b.get("region") in catalogue.REGIONS), None)
        region = catalogue.REGIONS.get(named) if named else None
    rays = [s.ray_colo for s in [*run.probe, *run.routed] if s.status is not None]
    cf_headers = [s.cf_placement for s in [run.warmup, *run.probe, *run.routed]]
    place = placement_mod.observe(bodies, rays, region, pod_location, worker_placement, placement_host, cf_headers)
    floors = place.floors()
    p50 = {name: seg["p50"] for name, seg in segments.items()}
    found = placement_mod.findings(place, p50, worker_placement, migrate_flags)

    violations: list[dict] = []
    served = [s for s in [*run.routed, *run.streamed] if s.ok and s.backend]
    share = fallbackshare.Share(sum(s.backend == "fallback" for s in served), len(served), "the probe's answers")
    share_violation = share.violation(max_fallback_share)
    if share_violation:  # first: it is what the rest (a ttft budget with no pod data) follows from
        violations.append(share_violation)
    violations += [{"kind": "placement", "part": f.part, "message": f.message} for f in found if f.fails]
    violations += budgets_mod.broken(budget_list, segments, floors)
    errors = {"probe": _errors(run.probe), "routed": _errors(run.routed), "stream": _errors(run.streamed)}
    for kind, counts in errors.items():
        if counts:
            total = len({"probe": run.probe, "routed": run.routed, "stream": run.streamed}[kind])
            failed = sum(counts.values())
            what = ", ".join(f"{e} ×{n}" for e, n in sorted(counts.items()))
            violations.append({"kind": "errors", "part": kind, "count": failed,
                               "message": f"{failed} of {total} {kind} requests failed ({what})"})

    notes = []
    told = {str(b["region"]) for b in bodies if b.get("region")}
    if region is not None and told and told != {region.name}:
        notes.append(f"the Worker reports CELL_REGION {', '.join(sorted(told))}, but {region.name} was expected: "
                     "is this the right stack's URL?")
    pod_fail = [b for b in (s.body for s in run.probe if s.ok and s.body) if b.get("pod_ok") is False]
    renew = ("; the keeper (.venv/bin/python scripts/scale.py run) replaces it alone; without it, raise "
             "colocate:pod.renewal by one and run pulumi up, which replaces every pod (not pulumi up --replace)")
    if pod_path == "endpoint":  # provider existing: the team's box, which nothing of the kit replaces
        renew = ("; it is an endpoint you run, which the kit never replaces: check the box (its vLLM, its TLS, the pod "
                 "token; docs/pods.md, \"An endpoint you already run\")")
    if pod_fail:
        statuses = ", ".join(sorted({str(b.get("pod_status")) for b in pod_fail}))
        msg = f"pod health check failed in {len(pod_fail)} of {len(run.probe)} probes (pod_status {statuses})"
        if len(pod_fail) == len(run.probe):
            violations.append(
                {
                    "kind": "pod_health",
                    "part": "pod",
                    "message": msg
                    + ": the pod is not serving — check `.venv/bin/python scripts/pod.py status --id <pod id>`"
                    + renew,
                }
            )
        else:
            notes.append(msg)
    pods = pods_of(run, region, locations)
    new_connections, new_note = new_connections_of(run, values["pod_rtt_new"])
    if new_note:
        notes.append(new_note)
    for pod in pods[1:]:  # pod 0 is the placement's own "pod" check above
        if pod["status"] == placement_mod.OUT:
            violations.append({"kind": "placement", "part": f"pod-{pod['index']}",
                               "message": f"pod {pod['index']} in {pod['location']} ({pod['site']}): outside "
                                          f"{region.name if region else 'the region'} — check colocate:pod and run pulumi up"})
    for pod in pods:
        if pod["index"] and pod["checks"] and not pod["healthy"]:
            violations.append({"kind": "pod_health", "part": f"pod-{pod['index']}",
                               "message": f"pod {pod['index']} ({pod['host']}) failed every health check "
                                          f"(status {', '.join(pod['statuses'])}): it bills without serving — "
                                          "check it with .venv/bin/python scripts/pod.py status" + renew})
    if len(locations) > 1 and len(locations) != len(pods):
        notes.append(f"{len(locations)} pod locations given for {len(pods)} pods the Worker lists")
    fallback, why = fallback_of(run)
    if why:
        notes.append(why)
    elif fallback is not None and fallback["ok"] is not True:
        what = fallback.get("error") or f"status {fallback.get('status')}"
        model = fallback.get("model") or "as each client names it"
        violations.append({"kind": "fallback", "part": "fallback",
                           "message": f"fallback check failed: {what} (model {model}) "
                                      "— check colocate:fallbackUrl, colocate:fallbackApiKey and colocate:fallbackModel"})
    quality = {"routed": _timing_quality(run.routed), "probe": _timing_quality(run.probe)}
    for kind, q in quality.items():
        bad = q["missing"] + q["malformed"]
        if bad:
            examples = sorted({p for s in (run.routed if kind == "routed" else run.probe) if s.ok
                               for p in s.timing.problems})[:3]
            notes.append(f"{bad} {kind} responses had a missing or malformed Server-Timing "
                         f"({q['missing']} missing, {q['malformed']} malformed: {'; '.join(examples)})")
        if q.get("bad_body"):
            notes.append(f"{q['bad_body']} probe responses had no JSON object body")
    return Result(run.url, run.model, len(run.routed), values, segments, fallback_rate, backends, place, floors,
                  budget_list, found, violations, errors, quality, notes, pods, pod_path, fallback,
                  settling=None if run.settling is None else {"settled": run.settling.settled,
                                                              "seconds": run.settling.seconds,
                                                              "colos": run.settling.colos},
                  new_connections=new_connections, fallback_streams=fallback_streams(run),
                  max_fallback_share=max_fallback_share)


def to_json(r: Result, warn_only: bool = False) -> dict:
    """The machine-readable result (docs/probe.md, "JSON"). Never holds the token."""
    return {
        "ok": r.ok,
        "verdict": r.verdict,
        "url": r.url,
        "model": r.model,
        "samples": r.samples,
        "connections": "reused",
        "clock": "time.perf_counter",
        "segments": r.segments,
        "values_ms": {name: list(v) for name, v in r.values.items()},  # every good sample, in order taken
        "fallback_rate": r.fallback_rate,
        "backends": r.backends,
        "placement": r.placement.to_json(),
        "floor_ms": r.floors,
        "ratio_to_floor": {name: ratio(r.segments[name]["p50"], f) for name, f in r.floors.items()},
        "budgets": [b.to_json() for b in r.budgets],
        "violations": r.violations,
        "findings": [{"part": f.part, "fails": f.fails, "message": f.message} for f in r.findings],
        "errors": r.errors,
        "server_timing": r.server_timing,
        "notes": r.notes,
        "warn_only": warn_only,
        "pods": r.pods,
        "pod_path": r.pod_path,
        "fallback_check": r.fallback_check,
        "settling": r.settling,
        "provisional": r.provisional,
        "new_connections": r.new_connections,
        "fallback_streams": r.fallback_streams,
        "max_fallback_share": r.max_fallback_share,
    }


def ratio(measured: float | None, floor: float | None) -> float | None:
    """measured / floor, None when either is unknown or the floor is ~0 (same place)."""
    if measured is None or floor is None or floor < placement_mod.NEAR_ZERO_MS:
        return None
    return round(measured / floor, 2)


def table(r: Result) -> str:
    """The human report: segments, placement, findings, verdict."""
    budgets: dict[str, list[str]] = {}
    broken = {(v["segment"], v["percentile"]) for v in r.violations if v["kind"] == "budget"}
    for b in r.budgets:
        mark = " BROKEN" if (b.segment, b.percentile) in broken else " ok"
        budgets.setdefault(b.segment, []).append(f"{b.ms:g}@{b.percentile}{mark}")
    fresh = (f" + {r.new_connections['probes']} probes on new pod connections (the sandbox closed them first)"
             if r.new_connections.get("measured") else "")
    lines = [f"colocate probe  {r.url}  model {r.model}",
             f"{r.samples} routed + {r.samples} probe samples{fresh} after a warm-up; one connection, reused; "
             "e2e by the client (perf_counter)", ""]
    head = f"{'segment':<12}" + "".join(f"{p:>9}" for p in PERCENTILES) + f"{'n':>5}{'floor':>9}{'p50/floor':>11}  budget"
    lines += [head + "  (ms)", "-" * len(head)]
    for name in SEGMENTS:
        seg = r.segments[name]
        row = f"{name:<12}" + "".join(f"{_num(seg[p], 1):>9}" for p in PERCENTILES) + f"{seg['n']:>5}"
        floor = r.floors.get(name)
        rat = ratio(seg["p50"], floor)
        row += f"{_num(floor, 1) if name in r.floors else '':>9}"
        row += f"{(f'{rat:.2f}x' if rat is not None else '-') if name in r.floors else '':>11}"
        row += "  " + ", ".join(budgets.get(name, []))
        lines.append(row.rstrip())
    total = sum(r.backends.values())
    rate = "n/a" if r.fallback_rate is None else f"{r.fallback_rate:.0%}"
    lines += ["", f"fallback rate {rate} ({r.backends.get('fallback', 0)}/{total} answered by the fallback; "
                  f"the probe fails above {r.max_fallback_share:.0%})"]
    if r.fallback_streams:
        fs = r.fallback_streams
        lines.append(f"the fallback's streams (not in ttft and itl above, which are the pods'): ttft p50 "
                     f"{_num(fs['ttft']['p50'], 1)} ms, itl p50 {_num(fs['itl']['p50'], 1)} ms, {fs['ttft']['n']} streams")
    lines.append("")
    p = r.placement
    expected = (f"{p.expected_region} ({', '.join(p.in_region_colos)})" if p.expected_region
                else "unknown: no --expect-region or --stack, and the Worker reported no region")
    mode = f"; mode {p.mode}" + (f", host {p.host}" if p.host else "") if p.mode else ""
    lines.append(f"placement (expected region {expected}{mode})")
    rows = [("accepted", p.accepted.colo, p.accepted.status, "cf-ray"),
            ("worker", p.ran.colo, p.ran.status, p.ran_source + (f", cf-placement {p.cf_placement}" if p.cf_placement else "")),
            ("state", p.state.colo, p.state.status, f"generation {p.generation}" if p.generation else ""),
            ("pod", p.pod.colo, p.pod.status, ", ".join(x for x in (p.pod_location and f"location {p.pod_location}",
                                                                 p.pod_host and f"host {p.pod_host}") if x))]
    for label, colo, status, where in rows:
        shown = status.replace("_", " ").upper() if status != "in_region" else "in region"
        if colo is None:  # say why, once, where the reader sees the gap
            where = ", ".join(x for x in (where, UNKNOWN_WHY[label]) if x)
        lines.append(f"  {label:<9}{colo or 'unknown':<8}{shown:<15}{where}")
    if p.draining_generation:
        lines.append(f"  draining generation {p.draining_generation}")
    if r.pods:
        path = f"pod path {r.pod_path}" if r.pod_path else "pod path unknown (pass --pod-path or --stack)"
        lines += ["", f"pods ({path}; pod_rtt = the Worker's GET /health of each pod on its pooled connection, "
                      "new = on a new one: TCP, the TLS handshake, the request)"]
        for pod in r.pods:
            rtt, new = pod["pod_rtt"], pod.get("pod_rtt_new") or {"p50": None, "p90": None}
            where = f"{pod['location']} ({pod['site']})" if pod["location"] else "location not given"
            shown = pod["status"].replace("_", " ").upper() if pod["status"] != "in_region" else "in region"
            lines.append(f"  pod {pod['index']:<4}{where:<20}{shown:<15}pod_rtt p50 {_num(rtt['p50'], 1)} ms, "
                         f"p90 {_num(rtt['p90'], 1)} ms  new p50 {_num(new['p50'], 1)} ms, p90 {_num(new['p90'], 1)} ms"
                         f"  healthy {pod['healthy']}/{pod['checks']}  host {pod['host']}")
        if not r.new_connections.get("measured", True):
            lines.append(f"  new: not measured: {r.new_connections['why']}")
    fb = r.fallback_check
    if fb is not None:
        listed = {True: "listed", False: "NOT LISTED", None: "not checked (the client's model)"}[fb.get("model_listed")]
        state = "ok" if fb.get("ok") is True else f"FAILED ({fb.get('error')})"
        lines += ["", f"fallback check: {state}: GET /v1/models answered {fb.get('status')} in "
                      f"{_num(fb.get('rtt_ms'), 0)} ms; model {fb.get('model') or '-'} {listed}"]
    info = [f.message for f in r.findings if not f.fails] + r.notes
    if info:
        lines += ["", "notes:"] + [f"  - {m}" for m in info]
    if r.violations:
        lines += ["", "violations:"] + [f"  - {v['message']}" for v in r.violations]
    if r.settling:
        s = r.settling
        lines += ["", f"placement {'settled' if s['settled'] else 'NOT settled'} after {s['seconds']:g} s "
                      f"(Worker colos: {', '.join(c or '?' for c in s['colos'][-6:])})"]
    head = "OK: " if r.ok else ("PROVISIONAL: " if r.provisional else "FAIL: ")
    lines += ["", head + r.verdict]
    return "\n".join(lines) + "\n"
