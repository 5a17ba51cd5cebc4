"""Where each part of the cell really ran, checked against the expected region.

Four parts, each named by a colo:
    accepted  the colo that accepted the client (the ``cf-ray`` suffix); informational
    ran       the colo the Worker ran in (``worker_colo`` from the probe, i.e. the Worker's own
              ``/cdn-cgi/trace``; ``cf-placement`` only as a cross-check or when that is null)
    state     the colo of the state object (``state_colo``, the object's own trace)
    pod       the pod's site: the colo standing for its GPU location (``--pod-location`` or the
              stack's ``podLocation`` output), via the catalogue
Each is ``in_region``, ``out_of_region`` or ``unknown``; unknown is reported as unknown, never
as fine. The Worker and the state object must be known and in region for the placement check
to hold; an unknown pod location is reported but does not fail it (a stand-alone probe may
not know it). Floors (``colocate.cell.geo.floor_ms``) are per hop: ``state_rtt`` =
Worker ↔ state object, ``pod_rtt`` and ``upstream`` = Worker ↔ pod site.

The placement mode (``pod``, ``targeted``, ``smart``) is reported. In pod mode Cloudflare
places the Worker by probing pod 0's address (``placement.host``), so the Worker must also
run at the pod: its colo's floor to pod 0's site (the colo nearest the pod's location) must
be within ``POD_TOLERANCE_MS``. When the address Cloudflare was given differs from the one
the Worker forwards pod 0's requests to (a renewed or migrated pod 0), that is reported as
"placement host changes from X to Y".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..cell import catalogue, geo

IN, OUT, UNKNOWN = "in_region", "out_of_region", "unknown"
NEAR_ZERO_MS = 1.0  # a floor below this is "the same place": ratio shown as "-"
# Pod mode: how far (as a physical floor, ms) the Worker's colo may be from the colo nearest
# pod 0 and still count as "at the pod". 10 ms is 1,000 km of fibre: a neighbouring colo of
# the same metro area or country (Tokyo-Osaka 4 ms, Taipei-Kaohsiung 3 ms) passes, another
# country's does not (Taipei-Hong Kong 8 ms passes, Tokyo-Taipei 22 ms does not).
POD_TOLERANCE_MS = 10.0
PLACEMENT_MODES = ("pod", "targeted", "smart")


def common(values: Iterable[str | None]) -> tuple[str | None, dict[str, int]]:
    """The most frequent non-null value (first seen wins a tie) and the count of each."""
    seen: Counter[str] = Counter(v.upper() for v in values if isinstance(v, str) and v)
    if not seen:
        return None, {}
    return seen.most_common(1)[0][0], dict(seen)


def parse_cf_placement(value: str | None) -> tuple[str | None, str | None]:
    """``remote-NRT`` → ("remote", "NRT"); ``local-IAD`` → ("local", "IAD"); else (None, None)."""
    kind, _, code = (value or "").strip().partition("-")
    if kind.lower() in ("remote", "local") and len(code) == 3 and code.isalpha():
        return kind.lower(), code.upper()
    return None, None


def pod_site(location: str | None, region: catalogue.Region | None) -> str | None:
    """The colo standing for a GPU location: the region's own sites first, then any region's."""
    if not location:
        return None
    if region is not None:
        if location in region.location_sites:
            return region.location_sites[location]
        if location == "local":
            return region.edge_site  # the sandbox's pod sits at the cell's edge site
    for r in catalogue.REGIONS.values():
        if location in r.location_sites:
            return r.location_sites[location]
    code = location.upper()
    return code if code in geo.colos() else None


def distance_km(a: str | None, b: str | None) -> float | None:
    try:
        return geo.distance_km(a, b) if a and b else None
    except KeyError:
        return None


def floor_between(a: str | None, b: str | None) -> float | None:
    km = distance_km(a, b)
    return None if km is None else round(2 * km / geo.FIBRE_KM_PER_MS, 2)


@dataclass(frozen=True)
class Part:
    colo: str | None
    status: str
    seen: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"colo": self.colo, "status": self.status, "seen": dict(self.seen)}


@dataclass(frozen=True)
class Placement:
    expected_region: str | None
    in_region_colos: tuple[str, ...]
    accepted: Part
    ran: Part
    state: Part
    pod: Part
    ran_source: str  # "worker_colo" | "cf-placement" | "none"
    cf_placement: str | None
    pod_location: str | None
    pod_host: str | None
    generation: str | None = None
    draining_generation: str | None = None
    breaker: dict | None = None
    mode: str | None = None  # placement mode: pod | targeted | smart (None: not known)
    host: str | None = None  # pod mode: the host:port Cloudflare probes (placementHost)

    @property
    def ok(self) -> bool:
        return (self.ran.status == IN and self.state.status == IN and self.pod.status != OUT
                and self.at_pod is not False)

    @property
    def pod_floor_ms(self) -> float | None:
        """Floor between the Worker's colo and pod 0's site."""
        return floor_between(self.ran.colo, self.pod.colo)

    @property
    def at_pod(self) -> bool | None:
        """Pod mode: does the Worker run within POD_TOLERANCE_MS of pod 0's site? None when
        not in pod mode or either colo is unknown."""
        floor = self.pod_floor_ms
        if self.mode != "pod" or floor is None:
            return None
        return floor <= POD_TOLERANCE_MS

    @property
    def host_change(self) -> dict | None:
        """{"from", "to"} when the address Cloudflare places by is not pod 0's address as the
        Worker uses it (pod 0 was replaced since the placement was declared)."""
        if self.mode != "pod" or not self.host or not self.pod_host or self.host.lower() == self.pod_host:
            return None
        return {"from": self.host.lower(), "to": self.pod_host}

    def floors(self) -> dict[str, float | None]:
        state = floor_between(self.ran.colo, self.state.colo)
        pod = floor_between(self.ran.colo, self.pod.colo)
        # A new connection pays three round trips: TCP's handshake, TLS 1.3's, then the request's.
        return {"state_rtt": state, "pod_rtt": pod, "pod_rtt_new": None if pod is None else 3 * pod, "upstream": pod}

    def to_json(self) -> dict:
        return {
            "accepted": self.accepted.colo, "ran": self.ran.colo, "state": self.state.colo,
            "pod": self.pod_location, "pod_site": self.pod.colo, "pod_host": self.pod_host,
            "expected_region": self.expected_region, "in_region_colos": list(self.in_region_colos),
            "ok": self.ok, "ran_source": self.ran_source, "cf_placement": self.cf_placement,
            "checks": {name: getattr(self, name).to_json() for name in ("accepted", "ran", "state", "pod")},
            "generation": self.generation, "draining_generation": self.draining_generation,
            "breaker": self.breaker,
            "mode": self.mode, "host": self.host, "at_pod": self.at_pod, "pod_floor_ms": self.pod_floor_ms,
            "pod_tolerance_ms": POD_TOLERANCE_MS if self.mode == "pod" else None,
            "host_change": self.host_change,
        }


def _status(colo: str | None, region: catalogue.Region | None) -> str:
    if colo is None or region is None:
        return UNKNOWN
    return IN if region.is_in_region(colo) else OUT


def observe(bodies: list[dict], ray_colos: Iterable[str | None], region: catalogue.Region | None,
            pod_location: str | None = None, mode: str | None = None, host: str | None = None,
            cf_headers: Iterable[str | None] = ()) -> Placement:
    """Fold the probe bodies and response colos of a run into one Placement; ``cf_headers``:
    the responses' own ``cf-placement`` headers (Cloudflare sets it on the response)."""
    ray_colos = list(ray_colos)
    accepted, accepted_seen = common(ray_colos)
    if accepted is None:  # no cf-ray on the responses: what the Worker saw on the request
        accepted, accepted_seen = common(b.get("ray_colo") for b in bodies)
    ran, ran_seen = common(b.get("worker_colo") for b in bodies)
    cf_values = [v for v in [*(b.get("cf_placement") for b in bodies), *cf_headers] if v]
    cf_placement = Counter(cf_values).most_common(1)[0][0] if cf_values else None
    source = "worker_colo"
    if ran is None:
        ran, ran_seen = common(parse_cf_placement(v)[1] for v in cf_values)
        source = "cf-placement" if ran else "none"
    state, state_seen = common(b.get("state_colo") for b in bodies)
    pod_host, _ = common(b.get("pod_host") for b in bodies)
    site = pod_site(pod_location, region)
    last = bodies[-1] if bodies else {}
    return Placement(
        expected_region=region.name if region else None,
        in_region_colos=region.in_region_colos if region else (),
        accepted=Part(accepted, _status(accepted, region), accepted_seen),
        ran=Part(ran, _status(ran, region), ran_seen),
        state=Part(state, _status(state, region), state_seen),
        pod=Part(site, _status(site, region), {site: 1} if site else {}),
        ran_source=source,
        cf_placement=cf_placement,
        pod_location=pod_location,
        pod_host=pod_host.lower() if pod_host else None,
        generation=last.get("generation"),
        draining_generation=last.get("draining_generation"),
        breaker=last.get("breaker") if isinstance(last.get("breaker"), dict) else None,
        mode=mode,
        host=host,
    )


@dataclass(frozen=True)
class Finding:
    """One line a person can act on. ``fails`` findings make the placement check fail."""

    part: str
    fails: bool
    message: str


def _km(a: str | None, b: str | None) -> str | None:
    km = distance_km(a, b)
    return None if km is None else f"{km:,.0f} km"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} ms"


def findings(p: Placement, p50: Mapping[str, float | None], worker_placement: str | None = None,
             migrate_flags: str | None = None) -> list[Finding]:
    """``migrate_flags``: what names the cell's stack to scripts/migrate.py (``--stack S``, and
    ``--stacks-dir DIR`` when not the default), so that a printed ``migrate.py plan`` runs as printed."""
    """What is wrong (or worth knowing) about the placement, most fundamental first.

    ``p50`` maps segment names to measured p50s (None when there was no data);
    ``worker_placement`` is the stack's ``colocate:worker.placement`` when known.
    """
    out: list[Finding] = []
    if p.expected_region is None:
        out.append(Finding("region", True, "expected region unknown: the probe did not report one; "
                                           "pass --expect-region or --stack"))
        return out
    region = catalogue.region(p.expected_region)
    where = f"{region.name} ({', '.join(p.in_region_colos)})"
    floors = p.floors()

    if p.ran.status == UNKNOWN:
        out.append(Finding("ran", True, "Worker colo unknown (worker_colo null and no cf-placement): cannot confirm "
                                        f"it runs in {where} — check that the Worker can fetch /cdn-cgi/trace"))
    elif p.ran.status == OUT:
        how = {"smart": "smart placement needs traffic and ~15 min of analysis",
               "targeted": f"targeted placement should pin {region.placement_region}",
               "pod": f"pod placement should run it beside pod 0 ({p.host or 'placement.host'})"}
        hint = how.get(worker_placement or "", f"targeted pins {region.placement_region}; "
                                               "smart placement needs traffic and ~15 min of analysis")
        extra = f", cf-placement {p.cf_placement}" if p.cf_placement else ""
        out.append(Finding("ran", True, f"Worker runs in {p.ran.colo}, outside {where}{extra}: placement not applied "
                                        f"— check colocate:worker.placement ({hint})"))
    elif len(p.ran.seen) > 1:
        others = ", ".join(f"{c} ×{n}" for c, n in p.ran.seen.items())
        out.append(Finding("ran", False, f"Worker ran in several colos ({others})"))

    if p.mode == "pod" and p.ran.status != UNKNOWN:
        if p.at_pod is False:
            out.append(Finding("ran", True, f"Worker runs in {p.ran.colo}, {_km(p.ran.colo, p.pod.colo)} from pod 0's "
                                            f"site {p.pod.colo} (floor {_ms(p.pod_floor_ms)}, tolerance "
                                            f"{POD_TOLERANCE_MS:g} ms): pod placement not applied — check that "
                                            f"placement.host {p.host or '(unknown)'} answers TCP from the internet "
                                            "and is DNS-only (not proxied), or set colocate:worker.placement targeted"))
        elif p.at_pod is None:
            out.append(Finding("ran", False, "pod placement: pod 0's site unknown, the Worker's distance to the pod "
                                             "is not checked (pass --pod-location or --stack)"))
    change = p.host_change
    if change:
        out.append(Finding("ran", False, f"placement host changes from {change['from']} to {change['to']}: "
                                         "Cloudflare was given pod 0's previous address; the next pulumi up "
                                         "gives it the new one (until then the Worker is placed by the old pod)"))

    kind, cf_colo = parse_cf_placement(p.cf_placement)
    if cf_colo and p.ran_source == "worker_colo" and p.ran.colo and cf_colo != p.ran.colo:
        out.append(Finding("ran", False, f"cf-placement says {p.cf_placement} but the Worker's own trace says "
                                         f"{p.ran.colo} (cf-placement is beta; the trace is trusted)"))

    if p.state.status == UNKNOWN:
        out.append(Finding("state", True, "state object colo unknown (state_colo null): cannot confirm it is in "
                                          f"{where} — check that the Breaker object can fetch /cdn-cgi/trace"))
    elif p.state.status == OUT:
        rtt = f"state_rtt p50 {_ms(p50.get('state_rtt'))}, floor {_ms(floors['state_rtt'])}"
        km = _km(p.state.colo, p.ran.colo)
        if km and p.ran.colo != p.state.colo:
            lead = f"state object runs in {p.state.colo}, {km} from the Worker in {p.ran.colo}"
        else:
            lead = f"state object runs in {p.state.colo}, outside {where}"
        gen = f"; generation {p.generation}" if p.generation else ""
        to = f" --to {p.expected_region}" if p.expected_region else ""
        out.append(Finding("state", True, f"{lead}: state left behind ({rtt}{gen}) — preview the move of state "
                                          f"with compute: `.venv/bin/python scripts/migrate.py plan "
                                          f"{migrate_flags or '--stack <the cell stack>'}{to}`"))

    if p.pod.status == UNKNOWN:
        what = f"pod location unknown (pod_host {p.pod_host})" if p.pod_host else "pod location unknown"
        if p.pod_location:
            what = f"pod location {p.pod_location!r} is not in the catalogue"
        out.append(Finding("pod", False, f"{what}: pass --pod-location or --stack to check it "
                                         f"(pod_rtt p50 {_ms(p50.get('pod_rtt'))})"))
    elif p.pod.status == OUT:
        km = _km(p.pod.colo, p.ran.colo)
        dist = f", {km} from the Worker in {p.ran.colo}" if km and p.ran.colo != p.pod.colo else ""
        out.append(Finding("pod", True, f"pod in {p.pod_location} ({p.pod.colo}){dist}: outside {where} "
                                        f"(pod_rtt p50 {_ms(p50.get('pod_rtt'))}, floor {_ms(floors['pod_rtt'])}) "
                                        "— check colocate:pod and run pulumi up"))

    if p.accepted.colo and p.ran.colo and p.accepted.status == OUT:
        km = _km(p.accepted.colo, p.ran.colo)
        dist = f", {km} from the Worker in {p.ran.colo}" if km and p.accepted.colo != p.ran.colo else ""
        out.append(Finding("accepted", False, f"accepted at {p.accepted.colo}{dist} (informational: the colo nearest "
                                              "this client; placement moved the Worker)"))
    elif p.accepted.colo is None:
        out.append(Finding("accepted", False, "accepted colo unknown (no cf-ray header)"))
    return out
