"""A day of a fleet that scales with demand, priced three ways: pure arithmetic, no I/O.

``sandbox.py demo-autoscale`` runs the day (``colocate/sandbox/autoscale_demo.py``); this
module holds what is computed before and after it:

* the day's shape: requests per minute by cell and local hour, from a CSV
  (``cell,hour,requests_per_minute``) or the demo's default, and ``--prices``;
* the send schedule: the day compressed into ``day_s`` seconds, each request sent standing
  for ``per_request`` requests of the day (a machine cannot send a day's traffic in minutes);
* the bill: fixed ``max`` pods all day, every request at the API, and the autoscaled kit
  (pod-hours, booting and draining included, at the pods' price plus the fallback's tokens at
  the API's price), per cell and in total; who served the requests; the peak hours' pod share
  and p50 against the cell's e2e budget.

A request's cost is attributed to its user's home cell, a pod's hours to the cell that runs it,
so the total of each column is the sum of the cells.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

HOURS = 24
DAY_S = 86_400
PEAK_SHARE = 0.8  # a cell's peak hours: those with at least this share of its busiest hour's traffic
MAX_COST_RATIO = 0.75  # done when: autoscaled <= this x the cheaper of fixed pods and API-only
MIN_PEAK_POD_SHARE = 0.95
SHAPE_HEADER = ("cell", "hour", "requests_per_minute")
SHAPE_FIX = "one line `cell,hour,requests_per_minute` per cell and local hour 0-23, e.g. `apac-jp,20,520`"

# Requests per minute by local hour: a consumer app's day, quiet at night, busy in the evening. Its
# evening needs two pods of the default profile's measured capacity (colocate/cell/capacity.py: 1,339 a
# minute), its night none (under the cost policy's ~100 a minute where a pod costs what the API would).
DEFAULT_DAY = (120, 80, 50, 40, 40, 60, 120, 260, 520, 720, 790, 850, 920, 890, 850, 850, 920, 1120, 1570, 1970,
               2170, 1840, 1180, 460)


@dataclass(frozen=True)
class Prices:
    pod_per_hr: float  # one pod, $ per hour, billed from its boot until it is deleted
    api_per_1m: float  # the API, $ per 1M tokens (prompt and completion alike)

    def api(self, tokens: float) -> float:
        return tokens * self.api_per_1m / 1e6


def parse_prices(text: str) -> Prices:
    """``--prices POD_PER_HR,API_PER_1M``, e.g. ``0.6,0.3``."""
    fix = "--prices POD_PER_HR,API_PER_1M with two positive numbers, e.g. --prices 0.6,0.3"
    parts = text.split(",")
    if len(parts) != 2:
        raise ConfigError("--prices", text, "must be two numbers separated by a comma", fix)
    out = []
    for name, part in zip(("POD_PER_HR", "API_PER_1M"), parts, strict=True):
        try:
            v = float(part)
        except ValueError:
            raise ConfigError(f"--prices {name}", part, "is not a number", fix) from None
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"--prices {name}", part, "must be a positive number", fix)
        out.append(v)
    return Prices(out[0], out[1])


def default_shape(cells: Sequence[str]) -> dict[str, tuple[float, ...]]:
    return {c: tuple(float(v) for v in DEFAULT_DAY) for c in cells}


def parse_shape(text: str, cells: Sequence[str], source: str = "--shape") -> dict[str, tuple[float, ...]]:
    """A day from CSV lines ``cell,hour,requests_per_minute`` (an optional header line of those
    names; blank lines and ``#`` comments skipped). Every cell named must have each hour 0-23
    exactly once; cells not named have no users. ConfigError names the line, the field, the
    value and the fix."""
    rows: dict[str, dict[int, float]] = {}
    seen_line: dict[tuple[str, int], int] = {}
    for n, fields in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not fields or not "".join(fields).strip() or fields[0].lstrip().startswith("#"):
            continue
        fields = [f.strip() for f in fields]
        if n == 1 and tuple(fields) == SHAPE_HEADER:
            continue
        where = f"{source} line {n}"
        if len(fields) != 3:
            raise ConfigError(where, ",".join(fields), f"has {len(fields)} fields, not 3", SHAPE_FIX)
        cell, hour_s, rpm_s = fields
        if cell not in cells:
            raise ConfigError(f"{where} field cell", cell, "is not a cell of the fleet", f"one of {', '.join(cells)}")
        try:
            hour = int(hour_s)
        except ValueError:
            raise ConfigError(f"{where} field hour", hour_s, "is not a whole number", "an hour 0-23 of the cell's "
                              "local time") from None
        if not 0 <= hour < HOURS:
            raise ConfigError(f"{where} field hour", hour_s, "is outside 0-23", "an hour 0-23 of the cell's local time")
        try:
            rpm = float(rpm_s)
        except ValueError:
            rpm = math.nan
        if not math.isfinite(rpm) or rpm < 0:
            raise ConfigError(f"{where} field requests_per_minute", rpm_s, "must be a number >= 0",
                              "requests per minute of the day in that hour, e.g. 120")
        if (cell, hour) in seen_line:
            raise ConfigError(f"{where} field hour", hour_s, f"{cell} hour {hour} is already on line "
                              f"{seen_line[(cell, hour)]}", "give each cell and hour once")
        seen_line[(cell, hour)] = n
        rows.setdefault(cell, {})[hour] = rpm
    if not rows:
        raise ConfigError(source, text[:40], "has no lines of traffic", SHAPE_FIX)
    for cell, hours in rows.items():
        missing = [h for h in range(HOURS) if h not in hours]
        if missing:
            raise ConfigError(f"{source} cell {cell}", f"hours {sorted(hours)}", f"lacks hour(s) {missing}",
                              f"add a line `{cell},{missing[0]},<requests per minute>` for each")
    if not any(v > 0 for hours in rows.values() for v in hours.values()):
        raise ConfigError(source, "every requests_per_minute 0", "the day has no traffic", "give some hour traffic")
    return {c: tuple(rows[c][h] for h in range(HOURS)) for c in cells if c in rows}


def local_hour(utc_h: float, offset_h: int) -> int:
    return int(math.floor(utc_h + offset_h)) % HOURS


def day_requests(shape: dict[str, tuple[float, ...]]) -> float:
    return sum(sum(v) * 60 for v in shape.values())


def per_request(shape: dict[str, tuple[float, ...]], sent: int) -> int:
    """How many of the day's requests one request sent stands for, to send about ``sent``."""
    return max(1, round(day_requests(shape) / max(1, sent)))


def schedule(shape: dict[str, tuple[float, ...]], offsets: dict[str, int], per: int) -> list[tuple[float, str]]:
    """The requests to send, as (UTC hour of the day, home cell), in time order: each cell's
    minutes carry ``rpm / per`` requests, spread evenly (deterministic, so the signal the
    controller reads is the shape's, not sampling noise)."""
    out = []
    for cell, rpm in shape.items():
        sent = 0.0  # requests due so far: request j leaves when this passes j + 0.5
        j = 0
        for minute in range(HOURS * 60):
            rate = rpm[local_hour(minute / 60, offsets[cell])] / per
            while rate > 0 and j + 0.5 <= sent + rate:
                out.append(((minute + (j + 0.5 - sent) / rate) / 60, cell))
                j += 1
            sent += rate
    return sorted(out)


def pods_needed(rpm: float, target: float, prices: Prices, tokens_per_request: float, max_pods: int) -> int:
    """The cost policy's count for a steady ``rpm`` (colocate/scaling/policy.py ``need``): pod k runs while
    the requests it would take cost more at the API than its hour."""
    n = 0
    for k in range(1, max_pods + 1):
        served = min(target, rpm - (k - 1) * target)
        if served <= 0 or prices.api(served * 60 * tokens_per_request) < prices.pod_per_hr:
            break
        n = k
    return n


@dataclass(frozen=True)
class Served:
    """One request the demo sent: when (UTC hour of the day), for whom, and how it ended."""

    at_h: float
    home: str
    ok: bool
    cell: str | None = None  # the cell that answered (x-colocate-cell)
    backend: str | None = None  # pod-<i> or fallback (x-colocate-backend)
    tokens: int = 0  # prompt + completion, from the answer's usage
    e2e_ms: float = 0.0
    why: str | None = None  # a failure's reason: the status and the error's message, or the exception
    ttft_ms: float | None = None  # a stream's first token as its client saw it (demo-spot)
    cut: bool = False  # a stream that ended with an error event after its first token (demo-spot: a preemption)
    held: bool = False  # it waited at a sandbox cell's edge while a deploy swapped workerd (demo-spot), as Cloudflare's does not
    # ms: the router's Server-Timing (state, upstream, total: up to its answer's headers) and the client's
    # wait for those headers (headers), where its TTFT went (demo-spot)
    timing: dict[str, float] | None = None

    def by(self) -> str | None:
        """pod (the home cell's), cell (another cell's pod), fallback; None for a failure."""
        if not self.ok:
            return None
        if self.backend == "fallback":
            return "fallback"
        return "pod" if self.cell == self.home else "cell"


def pod_hours(steps: Sequence[tuple[float, int]], end_h: float = HOURS) -> float:
    """Hours billed by a step function of (UTC hour, pods existing from then), up to ``end_h``."""
    total = 0.0
    ordered = sorted(steps, key=lambda step: step[0])  # stable: of two changes at one time, the later holds
    for (t, n), nxt in zip(ordered, [*ordered[1:], (end_h, 0)][: len(ordered)], strict=True):
        total += n * max(0.0, min(nxt[0], end_h) - min(t, end_h))
    return total


def peak_hours(rpm: Sequence[float]) -> set[int]:
    top = max(rpm)
    return {h for h, v in enumerate(rpm) if top > 0 and v >= PEAK_SHARE * top}


def money(x: float) -> float:
    return round(x + 0.0, 2)


def report(shape: dict[str, tuple[float, ...]], offsets: dict[str, int], served: Iterable[Served],
           pods: Mapping[str, Sequence[tuple[float, int]]], prices: Prices, per: int, max_pods: int,
           budgets: dict[str, float]) -> dict:
    """The demo's JSON: requests, failed, cost three ways and who served, in total and per cell."""
    served = list(served)
    cells: dict[str, dict] = {}
    for cell in shape:
        mine = [s for s in served if s.home == cell]
        api = prices.api(sum(s.tokens for s in mine) * per)
        fallback = prices.api(sum(s.tokens for s in mine if s.by() == "fallback") * per)
        pods_cost = pod_hours(pods.get(cell, ())) * prices.pod_per_hr
        peaks = peak_hours(shape[cell])
        at_peak = [s for s in mine if local_hour(s.at_h, offsets[cell]) in peaks]
        by_pod = [s for s in at_peak if s.by() in ("pod", "cell")]
        p50 = statistics.median(s.e2e_ms for s in at_peak if s.ok) if any(s.ok for s in at_peak) else None
        cells[cell] = {
            "cost": {"fixed": money(max_pods * HOURS * prices.pod_per_hr), "api": money(api),
                     "autoscaled": money(pods_cost + fallback)},
            "peak_pod_share": round(len(by_pod) / len(at_peak), 4) if at_peak else None,
            "peak_p50_ms": None if p50 is None else round(p50, 1),
            "budget_e2e_ms": budgets[cell],
        }
    kinds = [s.by() for s in served]
    return {
        "requests": len(served),
        "failed": sum(1 for s in served if not s.ok),
        "cost": {k: money(sum(c["cost"][k] for c in cells.values())) for k in ("fixed", "api", "autoscaled")},
        "served": {k: kinds.count(k) for k in ("pod", "cell", "fallback")},
        "cells": cells,
    }


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f} %"


def _ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.0f}"


def verdicts(out: dict) -> list[tuple[bool, str]]:
    """The done-when figures of the demo's day, each with whether it holds."""
    cost = out["cost"]
    cheaper = min(cost["fixed"], cost["api"])
    ratio = cost["autoscaled"] / cheaper if cheaper else math.inf
    cells = out["cells"]
    shares = ", ".join(f"{c} {_pct(v['peak_pod_share'])}" for c, v in cells.items())
    p50s = ", ".join(f"{c} {_ms(v['peak_p50_ms'])}/{v['budget_e2e_ms']:g} ms" for c, v in cells.items())
    judged = [v for v in cells.values() if v["peak_pod_share"] is not None]  # n/a: no request in its peak hours
    return [
        (ratio <= MAX_COST_RATIO, f"autoscaled ${cost['autoscaled']:.2f} is {ratio:.2f} x the cheaper of fixed pods "
                                  f"(${cost['fixed']:.2f}) and API-only (${cost['api']:.2f}); at most {MAX_COST_RATIO}"),
        (out["failed"] == 0, f"{out['requests']} requests, {out['failed']} failed"),
        (bool(judged) and all(v["peak_pod_share"] >= MIN_PEAK_POD_SHARE for v in judged),
         f"peak-hour requests served by a pod: {shares}; at least {100 * MIN_PEAK_POD_SHARE:.0f} % in each cell"),
        (bool(judged) and all(v["peak_p50_ms"] is not None and v["peak_p50_ms"] <= v["budget_e2e_ms"] for v in judged),
         f"p50 e2e in the peak hours / the cell's budget: {p50s}"),
    ]
