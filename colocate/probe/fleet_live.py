"""A fleet's live view (``probe.py --stack <fleet> --live``): every cell's live histograms
merged, exactly (their buckets add), and shown as users see the fleet: per colo, which cells
served and their percentiles, next to the cell the fleet's ranking names nearest there.

The colo of a request is the client's: the colo the front door received it in, which the
front door tells the cell (``x-colocate-client-colo``) and the cell records with the
request's histograms; a request that reached the cell directly counts at the colo its
Worker ran in. Pure: the cells' ``GET /_colocate/live`` answers in, a result out;
``scripts/probe.py`` fetches them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..cell.catalogue import Region
from ..fleet import plan as fleet_mod
from .histogram import DEFAULT_BUCKETS, Buckets, Histogram
from .live import ROUTED, SEGMENTS, SYNC, LiveDataError, rows_of
from .stats import PERCENTILES


@dataclass(frozen=True)
class CellWindow:
    """One member cell's answer (``doc``), or why there is none (``error``)."""

    name: str
    region: Region | None
    doc: Mapping | None = None
    error: str | None = None


@dataclass(frozen=True)
class Served:
    """One cell's requests at one colo."""

    cell: str
    requests: int
    share: float
    nearest: bool
    segments: dict[str, dict]

    def to_json(self) -> dict:
        return {"cell": self.cell, "requests": self.requests, "share": self.share, "nearest": self.nearest,
                "segments": self.segments}


@dataclass(frozen=True)
class ColoView:
    colo: str
    requests: int
    nearest: str | None  # the cell the fleet's ranking puts first from this colo (None: colo unknown)
    served: list[Served]
    segments: dict[str, dict]  # all cells' requests at this colo together

    def to_json(self) -> dict:
        return {"colo": self.colo, "requests": self.requests, "nearest": self.nearest,
                "served": [s.to_json() for s in self.served], "segments": self.segments}


@dataclass(frozen=True)
class CellSummary:
    name: str
    region: str | None
    requests: int
    segments: dict[str, dict]  # the routed segments and sync
    error: str | None

    def to_json(self) -> dict:
        return {"name": self.name, "region": self.region, "requests": self.requests, "segments": self.segments,
                "error": self.error}


@dataclass
class FleetLive:
    stack: str
    since_ms: int
    until_ms: int
    buckets: Buckets
    requests: int
    segments: dict[str, dict]
    cells: list[CellSummary]
    colos: list[ColoView]
    notes: list[str] = field(default_factory=list)
    violations: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def verdict(self) -> str:
        if self.violations:
            return self.violations[0]["message"]
        if not self.requests:
            return f"no routed traffic in fleet {self.stack} since {_clock(self.since_ms)}: nothing to judge"
        total = self.segments["total"]
        return (f"{self.requests} requests in {len(self.cells)} cells since {_clock(self.since_ms)}; total p50 "
                f"{_num(total['p50'])} ms, p99 {_num(total['p99'])} ms")


def _clock(ms: int) -> str:
    return time.strftime("%H:%M", time.gmtime(ms / 1000)) + " UTC"


def _num(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def build(stack: str, windows: Sequence[CellWindow], since_ms: int) -> FleetLive:
    """Merge every cell's window (see the module docstring)."""
    # The fleet and each cell: every latency segment a cell records (live.SEGMENTS: the routed ones,
    # a stream's ttft and itl, the pods' queue, sync); per colo, the routed ones. Pick counts
    # (affinity, shed) are no latencies: the cells' own views show them.
    fleet_segments = {s: Histogram() for s in SEGMENTS}
    # colo -> cell -> segment -> histogram
    at: dict[str, dict[str, dict[str, Histogram]]] = defaultdict(lambda: defaultdict(lambda: {s: Histogram() for s in ROUTED}))
    cells, violations = [], []
    regions: list[Region | None] = []
    buckets = DEFAULT_BUCKETS
    until = since_ms
    for w in windows:
        regions.append(w.region or (_region_of(w.doc.get("region")) if w.doc is not None else None))
        if w.doc is None:
            violations.append({"kind": "cell", "cell": w.name, "message": f"cell {w.name}: {w.error}"})
            cells.append(CellSummary(w.name, w.region.name if w.region else None, 0, {}, w.error))
            continue
        try:
            rows, b = rows_of(w.doc)
        except LiveDataError as exc:
            violations.append({"kind": "cell", "cell": w.name, "message": f"cell {w.name}: {exc}"})
            cells.append(CellSummary(w.name, w.region.name if w.region else None, 0, {}, str(exc)))
            continue
        if b != buckets and rows:
            raise LiveDataError(f"cell {w.name}: buckets {b} differ from the other cells' {buckets}: deploy one Worker version")
        until = max(until, int(w.doc.get("now") or until))
        mine = {s: Histogram() for s in SEGMENTS}
        for r in rows:
            if r.segment not in mine:
                continue
            mine[r.segment].add(r.hist)
            fleet_segments[r.segment].add(r.hist)
            if r.segment in ROUTED:
                at[r.client or r.colo][w.name][r.segment].add(r.hist)
        summary = {s: h.summary(b).to_json() for s, h in mine.items()}
        cells.append(CellSummary(w.name, regions[-1].name if regions[-1] else None, mine["total"].n, summary, None))
    colos = []
    notes = []
    for colo in sorted(at, key=lambda c: -sum(h["total"].n for h in at[c].values())):
        by_cell = at[colo]
        n = sum(h["total"].n for h in by_cell.values())
        nearest = None
        if all(regions) and colo != "UNKNOWN":
            nearest = windows[fleet_mod.rank(colo, regions)[0]].name
        served = [Served(cell, h["total"].n, round(h["total"].n / n, 4) if n else 0.0, cell == nearest,
                         {s: h[s].summary(buckets).to_json() for s in ROUTED})
                  for cell, h in sorted(by_cell.items(), key=lambda kv: -kv[1]["total"].n)]
        merged = {s: Histogram() for s in ROUTED}
        for h in by_cell.values():
            for s in ROUTED:
                merged[s].add(h[s])
        colos.append(ColoView(colo, n, nearest, served, {s: merged[s].summary(buckets).to_json() for s in ROUTED}))
        away = [s for s in served if nearest and not s.nearest and s.requests]
        if away:
            notes.append(f"from {colo} {sum(s.requests for s in away)} of {n} requests were served by "
                         f"{', '.join(s.cell for s in away)}, not the nearest cell {nearest} (unhealthy then, or "
                         "the front door's remembered failure)")
    requests = sum(c.requests for c in cells)
    return FleetLive(stack, since_ms, until, buckets, requests,
                     {s: h.summary(buckets).to_json() for s, h in fleet_segments.items()}, cells, colos, notes, violations)


def _region_of(name: object) -> Region | None:
    """The region a cell reports about itself (its live answer), when it is one the catalogue knows."""
    from ..cell import catalogue
    from ..errors import ConfigError

    try:
        return catalogue.region(name, key="the cell's region") if isinstance(name, str) else None
    except ConfigError:
        return None


def to_json(r: FleetLive, warn_only: bool = False) -> dict:
    return {"ok": r.ok, "verdict": r.verdict, "live": True, "fleet": r.stack, "since_ms": r.since_ms,
            "until_ms": r.until_ms, "requests": r.requests, "segments": r.segments,
            "cells": [c.to_json() for c in r.cells], "colos": [c.to_json() for c in r.colos], "notes": r.notes,
            "violations": r.violations, "warn_only": warn_only, "relative_error": round(r.buckets.relative_error, 5)}


def _seg_row(name: str, seg: Mapping) -> str:
    return f"{name:<12}" + "".join(f"{_num(seg.get(p), 1):>9}" for p in PERCENTILES) + f"{seg.get('n', 0):>8}"


def table(r: FleetLive) -> str:
    head = f"{'':<12}" + "".join(f"{p:>9}" for p in PERCENTILES) + f"{'n':>8}  (ms)"
    lines = [f"colocate fleet live view  {r.stack}",
             f"real traffic from {_clock(r.since_ms)} to {_clock(r.until_ms)}: {r.requests} routed requests in "
             f"{len(r.cells)} cells; percentiles within {r.buckets.relative_error:.1%} of exact", "",
             "the fleet (every cell's histograms added)", head, "-" * len(head)]
    lines += [_seg_row(s, r.segments[s]) for s in SEGMENTS]
    lines += ["", "by client colo (where the front door received them), the cells that served: total"]
    for c in r.colos:
        near = f"nearest cell {c.nearest}" if c.nearest else "nearest cell unknown"
        lines.append(f"  {c.colo:<8}{c.requests:>8} requests  {near}")
        for s in c.served:
            t = s.segments["total"]
            lines.append(f"    {s.cell:<14}{s.requests:>8} {s.share:>7.1%}  p50 {_num(t['p50'], 1)}  p90 {_num(t['p90'], 1)}"
                         f"  p99 {_num(t['p99'], 1)} ms" + ("" if s.nearest or not c.nearest else "  (not the nearest)"))
    lines += ["", "cells"]
    for c in r.cells:
        if c.error:
            lines.append(f"  {c.name:<14}{c.region or '?':<12}  {c.error}")
            continue
        t, sync = c.segments["total"], c.segments[SYNC]
        lines.append(f"  {c.name:<14}{c.region or '?':<12}{c.requests:>8} requests, total p50 {_num(t['p50'], 1)} ms, "
                     f"sync p50 {_num(sync['p50'], 1)} ms")
    if r.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in r.notes]
    if r.violations:
        lines += ["", "violations:"] + [f"  - {v['message']}" for v in r.violations]
    lines += ["", ("OK: " if r.ok else "FAIL: ") + r.verdict]
    return "\n".join(lines) + "\n"
