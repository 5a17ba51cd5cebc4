"""Probing a fleet from its client sites: which cell served each site, what it cost, and
whether that was the site's nearest healthy cell (docs/probe.md, "Probing a fleet").

For each client site (a URL that reaches the front door as a user at that site does) the
probe sends N routed requests over one reused connection and records, per sample, the cell
that served (``x-colocate-cell``), the backend (``x-colocate-backend``), the colo the front
door ran in (its Server-Timing ``front;desc="NRT"``), e2e and the segments
(``front, state, upstream, fallback, total``).

The expectation is computed the way the front door computes its choice: the cells ranked by
``colocate.fleet.plan.rank`` of that colo over the cells' regions (the same floor model and the
same data as its ``CELL_RANK`` binding), filtered by health. A cell is healthy when its own
``GET /_colocate/probe`` (probe token) answers and shows at least one pod that its breakers
let through and that answers ``/health``; unreachable or not found is not healthy. Health is
read before and after the samples: a sample may be served by the nearest healthy cell of
either reading (a cell that changed state mid-run is named in a note).

The judging (``health_of``, ``expected``, ``judge_site``, ``build``) is pure; the I/O
(``read_health``, ``sample_site``) is at the end.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..cell import geo
from ..cell.catalogue import Region
from ..fleet import plan as fleet_mod
from .errors import TargetError, Unauthorized, Unreachable, UsageError
from .placement import distance_km
from .sample import MODELS_PATH, Sample, Sampler
from .stats import summary

if TYPE_CHECKING:
    from .. import admin

SEGMENTS = ("e2e", "front", "state", "upstream", "fallback", "total")


# --- input ---

@dataclass(frozen=True)
class Site:
    name: str  # what the operator calls it (a colo code for the sandbox's sites)
    url: str


def parse_sites(flags: Sequence[str]) -> list[Site]:
    """``--client-site NAME=URL`` (repeatable) → sites; bad input names the flag, value and fix."""
    out: list[Site] = []
    fix = "give NAME=URL, e.g. --client-site NRT=https://colocate-fleet.example.workers.dev (one per site)"
    for value in flags:
        name, sep, url = value.partition("=")
        name, url = name.strip(), url.strip()
        parts = urlsplit(url)
        if not sep or not name:
            raise UsageError("--client-site", value, "must be NAME=URL", fix)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError("--client-site", value, f"{url!r} is not an http(s) URL", fix)
        if any(s.name == name for s in out):
            raise UsageError("--client-site", value, f"site {name} is given twice", "give each site once")
        out.append(Site(name, url.rstrip("/")))
    return out


@dataclass(frozen=True)
class SandboxFleet:
    """The running sandbox fleet's record (``<state dir>/fleet.json``): sites, cells, a key."""

    sites: list[Site]
    cells: list[dict]  # [{name, stack, region, worker_url, state_dir, edge_site}]
    key: str | None

    def __repr__(self) -> str:  # never print the key
        return f"SandboxFleet(sites={self.sites!r}, cells={[c.get('name') for c in self.cells]!r}, key=***)"


def read_sandbox_fleet(path: Path) -> SandboxFleet | None:
    """None when there is no such file (no sandbox fleet runs there) or it holds no entries."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        return None
    sites = [Site(str(k), str(v).rstrip("/")) for k, v in entries.items() if isinstance(v, str) and v]
    cells = [c for c in doc.get("cells") or [] if isinstance(c, dict) and c.get("name")]
    key = doc.get("key") if isinstance(doc.get("key"), str) and doc.get("key") else None
    return SandboxFleet(sites, cells, key) if sites else None


# --- health (pure) ---

@dataclass(frozen=True)
class CellHealth:
    name: str  # short name: what x-colocate-cell says
    region: Region | None
    healthy: bool
    why: str  # one phrase: "1 of 1 pod serving" / "breaker forced open" / "unreachable (...)"
    pods: int = 0  # pods that pass both the breaker and /health


def health_of(name: str, region: Region | None, doc: Mapping | None, problem: str | None = None) -> CellHealth:
    """A cell's health from its ``/_colocate/probe`` answer (or why there is none).

    A pod serves when its breaker lets requests through (forced closed; or not forced and not
    open: a half-open pod gets trials) and it answered the Worker's ``GET /health``.
    """
    if doc is None:
        return CellHealth(name, region, False, problem or "no answer")
    breaker = doc.get("breaker") if isinstance(doc.get("breaker"), Mapping) else {}
    forced = breaker.get("forced")
    states = {p.get("index"): p.get("state") for p in breaker.get("pods") or [] if isinstance(p, Mapping)}
    checks = [p for p in doc.get("pods") or [] if isinstance(p, Mapping)]
    if not checks:
        return CellHealth(name, region, False, "its probe answer lists no pods")
    serving = 0
    for p in checks:
        through = forced == "closed" or (forced != "open" and states.get(p.get("index"), "closed") != "open")
        serving += bool(through and p.get("ok") is True)
    if forced == "open":
        why = "breaker forced open"
    elif serving:
        why = f"{serving} of {len(checks)} pod{'s' * (len(checks) != 1)} serving"
    else:
        opened = sum(1 for p in checks if states.get(p.get("index")) == "open")
        why = (f"no pod serving ({opened} breaker{'s' * (opened != 1)} open, "
               f"{sum(1 for p in checks if p.get('ok') is not True)} failing /health)")
    return CellHealth(name, region, serving > 0, why, serving)


def ranking(colo: str | None, cells: Sequence[CellHealth]) -> list[int]:
    """Cell indexes as the front door ranks them from ``colo`` (nearest first; an unknown or
    missing colo: configured order). A cell whose region is unknown goes last."""
    known = [i for i, c in enumerate(cells) if c.region is not None]
    order = fleet_mod.rank(colo or "", [cells[i].region for i in known])
    return [known[k] for k in order] + [i for i, c in enumerate(cells) if c.region is None]


def expected(colo: str | None, cells: Sequence[CellHealth]) -> str | None:
    """The nearest healthy cell's name from ``colo``; None when no cell is healthy."""
    return next((cells[i].name for i in ranking(colo, cells) if cells[i].healthy), None)


def floor_ms(colo: str | None, cell: CellHealth | None) -> float | None:
    """The floor from the front door's colo to the cell's edge site (``fleet.floor_to``)."""
    if not colo or cell is None or cell.region is None or colo.upper() not in geo.colos():
        return None
    return round(fleet_mod.floor_to(colo.upper(), cell.region), 2)


# --- judging a site (pure) ---

def front_colo(s: Sample) -> str | None:
    code = (s.timing.descs.get("front") or "").strip().upper()
    return code if len(code) == 3 and code.isalpha() else None


def _ms(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


@dataclass
class SiteResult:
    site: Site
    samples: int
    colo: str | None  # the front door's most frequent colo
    colos: dict[str, int]
    served: dict[str, int]  # cell → samples it served
    backends: dict[str, int]
    expected: str | None
    ranked: list[dict]  # [{cell, region, floor_ms, healthy, why}] nearest first, from `colo`
    mismatched: int  # successful samples not served by the nearest healthy cell
    errors: dict[str, int]
    segments: dict[str, dict]
    values: dict[str, list[float]]
    ok: bool
    verdict: str
    notes: list[str] = field(default_factory=list)


def judge_site(site: Site, samples: Sequence[Sample], before: Sequence[CellHealth],
               after: Sequence[CellHealth] | None = None) -> SiteResult:
    after = after or before
    by_name = {c.name: c for c in before}
    ok_samples = [s for s in samples if s.ok]
    colos = Counter(front_colo(s) or "unknown" for s in ok_samples)
    colo = next((c for c, _ in colos.most_common() if c != "unknown"), None)
    served = Counter(s.cell or "unknown" for s in ok_samples)
    backends = Counter(s.backend or "unknown" for s in ok_samples)
    errors = Counter(s.error for s in samples if s.error)
    values: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    wrong: list[Sample] = []
    for s in ok_samples:
        if s.e2e_ms is not None:
            values["e2e"].append(s.e2e_ms)
        for name in SEGMENTS[1:]:
            if name in s.timing.durations:
                values[name].append(s.timing.durations[name])
        c = front_colo(s)
        if s.cell not in {expected(c, before), expected(c, after)} - {None}:
            wrong.append(s)
    segments = {name: summary(v) for name, v in values.items()}
    want = expected(colo, before)
    ranked = [{"cell": before[i].name, "region": before[i].region.name if before[i].region else None,
               "floor_ms": floor_ms(colo, before[i]), "healthy": before[i].healthy, "why": before[i].why}
              for i in ranking(colo, before)]
    notes = []
    where = colo or "an unknown colo"
    if colo is None and ok_samples:
        notes.append(f"site {site.name}: the front door did not say where it ran (no desc on its Server-Timing "
                     "front entry): ranked in the configured order, floors unknown")
    if len([c for c in colos if c != "unknown"]) > 1:
        notes.append(f"site {site.name}: the front door ran in {', '.join(f'{k} ×{v}' for k, v in colos.items())}")
    if site.name.upper() in geo.colos() and colo and colo != site.name.upper():
        km = distance_km(site.name.upper(), colo)
        notes.append(f"site {site.name} reached the front door at {colo}"
                     + (f", {km:,.0f} km away" if km is not None else ""))
    changed = [c.name for c, d in zip(before, after, strict=False) if c.healthy != d.healthy]
    if changed:
        notes.append(f"health changed during the run: {', '.join(changed)} (either reading's nearest healthy cell counted)")
    passed = [r for r in ranked if not r["healthy"]]
    if want and ranked and ranked[0]["cell"] != want:
        skipped = "; ".join(f"{r['cell']} ({r['why']})" for r in ranked[:[r['cell'] for r in ranked].index(want)])
        notes.append(f"site {site.name}: nearer cell{'s' * (skipped.count(';') > 0)} not healthy: {skipped}")
    fallback = backends.get("fallback", 0)
    if fallback:
        notes.append(f"site {site.name}: {fallback} of {len(ok_samples)} answered by the fallback API")

    if errors:
        shown = ", ".join(f"{k} ×{v}" for k, v in errors.most_common())
        ok, verdict = False, f"site {site.name}: {sum(errors.values())} of {len(samples)} requests failed ({shown})"
    elif not ok_samples:
        ok, verdict = False, f"site {site.name}: no sample was taken"
    elif not any(c.healthy for c in before) and not any(c.healthy for c in after):
        why = "; ".join(f"{c.name}: {c.why}" for c in before)
        ok, verdict = False, (f"site {site.name}: no cell of the fleet is healthy ({why}); served by "
                              f"{_counts(served)} — bring a cell's pods back")
    elif wrong:
        top = Counter(s.cell or "unknown" for s in wrong).most_common(1)[0][0]
        c = front_colo(next(s for s in wrong if (s.cell or "unknown") == top)) or colo
        exp = expected(c, before) or expected(c, after)
        f_exp, f_got = floor_ms(c, by_name.get(exp)), floor_ms(c, by_name.get(top))
        floors = (f"floor {c}→{exp} {_ms(f_exp)} ms, {c}→{top} {_ms(f_got)} ms" if c
                  else "floors unknown: the front door did not name its colo")
        ok = False
        exp_why = f" ({by_name[exp].why})" if exp in by_name else ""
        not_member = ("" if top in by_name else f" ({top} is not a member cell)" if top != "unknown"
                      else f" (answered without x-colocate-cell: is {site.url} the fleet's front door?)")
        verdict = (f"site {site.name} (front door in {c or 'unknown colo'}) was served by {top} in {len(wrong)} of "
                   f"{len(samples)} samples, not by its nearest healthy cell {exp}{exp_why}: {floors}{not_member}"
                   f" — the front door may still remember "
                   f"{exp} as having no pod (colocate:fleet.rememberMs), or its ranking is stale: pulumi up the fleet stack")
    else:
        e2e = segments["e2e"]
        verdict = (f"site {site.name}: served by {want} from {where} (floor {_ms(floor_ms(colo, by_name.get(want)))} ms), "
                   f"its nearest healthy cell, in {len(ok_samples)} of {len(samples)} samples; "
                   f"e2e p50 {_ms(e2e['p50'])} ms, p90 {_ms(e2e['p90'])} ms")
        if passed and ranked[0]["cell"] != want:
            verdict += f" ({ranked[0]['cell']} passed over: {ranked[0]['why']})"
        ok = True
    return SiteResult(site, len(samples), colo, dict(colos), dict(served), dict(backends), want, ranked, len(wrong),
                      dict(errors), segments, values, ok, verdict, notes)


def _counts(c: Mapping[str, int]) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or "nothing"


@dataclass
class FleetResult:
    fleet: str
    model: str
    samples: int
    cells: list[CellHealth]
    cells_after: list[CellHealth]
    sites: list[SiteResult]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.sites)

    @property
    def verdict(self) -> str:
        bad = [s for s in self.sites if not s.ok]
        if bad:
            return bad[0].verdict + (f" (+{len(bad) - 1} more sites: see sites)" if len(bad) > 1 else "")
        return f"all {len(self.sites)} client sites served by their nearest healthy cell: " + "; ".join(
            f"{s.site.name} → {s.expected}" for s in self.sites)


def _cell_json(c: CellHealth) -> dict:
    return {"name": c.name, "region": c.region.name if c.region else None,
            "edge_site": c.region.edge_site if c.region else None, "healthy": c.healthy, "why": c.why, "pods": c.pods}


def to_json(r: FleetResult, warn_only: bool = False) -> dict:
    return {
        "ok": r.ok, "warn_only": warn_only, "verdict": r.verdict, "fleet": r.fleet, "model": r.model,
        "samples": r.samples, "connections": "reused", "clock": "time.perf_counter",
        "cells": [_cell_json(c) for c in r.cells], "cells_after": [_cell_json(c) for c in r.cells_after],
        "sites": [{"site": s.site.name, "url": s.site.url, "ok": s.ok, "verdict": s.verdict, "colo": s.colo,
                   "colos": s.colos, "served": s.served, "backends": s.backends, "expected": s.expected,
                   "mismatched": s.mismatched, "ranking": s.ranked, "errors": s.errors, "segments": s.segments,
                   "notes": s.notes} for s in r.sites],
    }


def _p50_p90(s: SiteResult, name: str) -> str:
    return f"{_ms(s.segments[name]['p50'], 1)}/{_ms(s.segments[name]['p90'], 1)}"


def table(r: FleetResult) -> str:
    lines = [f"colocate fleet probe  {r.fleet}  model {r.model}",
             f"{r.samples} routed samples per client site over one reused connection; e2e by the client "
             "(perf_counter), segments from Server-Timing", "",
             "cells (health from each cell's GET /_colocate/probe, before the samples)"]
    for c in r.cells:
        where = f"{c.region.name} ({c.region.edge_site})" if c.region else "region unknown"
        lines.append(f"  {c.name:<12}{where:<20}{'healthy' if c.healthy else 'NOT HEALTHY':<13}{c.why}")
    width = max([16, *(len(_counts(s.served)) + 2 for s in r.sites)])
    head = (f"{'site':<8}{'colo':<6}{'served by':<{width}}{'expected':<12}{'floor':>7}"
            + "".join(f"{n + ' p50/p90':>20}" for n in ("e2e", "front", "upstream")) + "  verdict")
    lines += ["", head + "   (ms)", "-" * len(head)]
    for s in r.sites:
        exp = next((x for x in s.ranked if x["cell"] == s.expected), None)
        lines.append(
            f"{s.site.name:<8}{s.colo or '?':<6}{_counts(s.served):<{width}}{s.expected or '-':<12}"
            f"{_ms(exp['floor_ms'] if exp else None):>7}"
            + "".join(f"{_p50_p90(s, n):>20}" for n in ("e2e", "front", "upstream"))
            + ("  ok" if s.ok else "  FAIL")
        )
    lines += ["", f"segments per site (p50/p90 ms): {', '.join(SEGMENTS)}"]
    for s in r.sites:
        lines.append(f"  {s.site.name:<8}" + "  ".join(
            f"{n} {_p50_p90(s, n)}" for n in SEGMENTS)
            + f"  backends {_counts(s.backends)}")
    notes = [n for s in r.sites for n in s.notes]
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    bad = [s for s in r.sites if not s.ok]
    if bad:
        lines += ["", "violations:"] + [f"  - {s.verdict}" for s in bad]
    lines += ["", ("OK: " if r.ok else "FAIL: ") + r.verdict]
    return "\n".join(lines) + "\n"


# --- I/O ---

def read_health(name: str, region: Region | None, target, timeout_s: float) -> tuple[CellHealth, Region | None]:
    """Ask one cell (an ``admin.Target``, or the error that says why it could not be found)."""
    if not hasattr(target, "url"):
        return health_of(name, region, None, f"not found ({target})"), region
    with Sampler(target.url, target.token, timeout_s) as s:
        answer = s.probe()
    if not answer.ok or answer.body is None:
        why = answer.error or answer.body_problem or "no answer"
        return health_of(name, region, None, f"unreachable at {target.url} ({why})"), region
    # No fleet.json or stack file said where the cell is: it says so itself (unknown: unranked).
    region = region or _region(answer.body.get("region"), f"region of cell {name}")
    return health_of(name, region, answer.body), region


def sample_site(site: Site, key: str, samples: int, timeout_s: float, model: str | None,
                progress: Callable[[str], None] | None = None) -> tuple[str, list[Sample]]:
    """A warm-up ``GET /v1/models`` (the model too, unless given), then ``samples`` routed requests."""
    import requests

    with Sampler(site.url, "", timeout_s, key=lambda: key) as s:
        where = site.url + MODELS_PATH
        try:
            r = s.models()
        except requests.Timeout:
            raise Unreachable(f"client site {site.name}: {where} did not answer within {timeout_s:g} s (--timeout)") from None
        except requests.ConnectionError:
            raise Unreachable(f"client site {site.name}: cannot reach {where}: connection refused or no route; "
                              "is the front door up and the URL right?") from None
        except Unauthorized as exc:
            raise Unauthorized(f"client site {site.name}: {exc}") from None
        if model is None:
            model = s.model_of(r)
            if model is None:
                raise TargetError(f"client site {site.name}: GET {where} answered HTTP {r.status_code} without a model "
                                  "in data[0].id: pass --model NAME")
        out = []
        for i in range(samples):
            out.append(s.routed(model))
            if progress and ((i + 1) % 5 == 0 or i + 1 == samples):
                progress(f"{site.name}: {i + 1}/{samples} samples")
        return model, out


def _region(name: str | None, key: str) -> Region | None:
    from ..cell.catalogue import region as lookup
    from ..errors import ConfigError

    if not isinstance(name, str) or not name:
        return None
    try:
        return lookup(name, key=key)
    except ConfigError:
        return None


def _cell_region(stack: str, stacks_dir: Path) -> Region | None:
    """The cell's region from its stack file (what its ``region`` output is made from), if here."""
    from .. import stackfile
    from ..errors import ConfigError

    try:
        raw, _ = stackfile.read_config(fleet_mod.short_name(stack), stacks_dir)
    except ConfigError:
        return None
    return _region(raw.get("region"), f"colocate:region of stack {stack}")


def sites_for(stack: str, flags: Sequence[str], url: str | None, sandbox: SandboxFleet | None,
              sandbox_file: Path, read_url: Callable[[], str | None]) -> list[Site]:
    """Where the samples come from: ``--client-site`` flags, else the URL argument (one site
    "here"), else the running sandbox fleet's entries, else the fleet's ``workerUrl`` output."""
    if flags:
        return parse_sites(flags)
    if url:
        return parse_sites([f"here={url}"])
    if sandbox is not None:
        return sandbox.sites
    problem = None
    try:
        found = read_url()
    except Exception as exc:  # noqa: BLE001 - OutputsError or the like: said in the message below
        found, problem = None, str(exc)
    if found:
        return [Site("here", found.rstrip("/"))]
    raise UsageError("--client-site", None, f"no client site for fleet {stack}: no running sandbox fleet "
                     f"({sandbox_file} is absent) and no workerUrl output"
                     + (f" ({problem})" if problem else ""),
                     f"pass --client-site NAME=URL (repeatable), start `.venv/bin/python scripts/sandbox.py up "
                     f"--fleet {stack}`, or deploy it (pulumi up -s {stack})")


def member_targets(cells: Sequence[str], *, stacks_dir: Path, sandboxes_dir: Path | None = None,
                   sandbox: SandboxFleet | None = None) -> list[tuple[str, Region | None, admin.Target | admin.AdminError]]:
    """Each member cell: (name, region if known, its ``admin.Target`` or the error that says why none)."""
    from .. import admin

    described = {fleet_mod.short_name(str(c.get("stack") or c["name"])): c for c in (sandbox.cells if sandbox else [])}
    out = []
    for stack_name in cells:
        name = fleet_mod.short_name(stack_name)
        rec = described.get(name, {})
        region = _region(rec.get("region"), f"region of cell {name} in fleet.json") or _cell_region(stack_name, stacks_dir)
        target = admin.sandbox_target(Path(rec["state_dir"]), "read") if rec.get("state_dir") else None
        if target is None:
            try:
                target = admin.resolve(stack=stack_name, sandboxes_dir=sandboxes_dir)
            except admin.AdminError as exc:
                target = exc
        out.append((name, region, target))
    return out


def run(stack: str, cells: Sequence[str], sites: Sequence[Site], key: str, samples: int, timeout_s: float,
        model: str | None, *, stacks_dir: Path, sandboxes_dir: Path | None = None,
        sandbox: SandboxFleet | None = None, say: Callable[[str], None] = lambda _m: None) -> FleetResult:
    """Health of every cell, N samples from every site, health again; judged per site."""
    members = [list(m) for m in member_targets(cells, stacks_dir=stacks_dir, sandboxes_dir=sandboxes_dir, sandbox=sandbox)]

    def health() -> list[CellHealth]:
        out = []
        for m in members:
            h, m[1] = read_health(m[0], m[1], m[2], timeout_s)
            out.append(h)
        return out

    before = health()
    say("cells: " + "; ".join(f"{c.name} {'healthy' if c.healthy else 'NOT healthy'} ({c.why})" for c in before))
    taken = []
    for site in sites:
        say(f"site {site.name}: {site.url}")
        model, got = sample_site(site, key, samples, timeout_s, model, progress=say)
        taken.append((site, got))
    after = health()
    results = [judge_site(site, got, before, after) for site, got in taken]
    return FleetResult(stack, model or "", samples, before, after, results)
