"""A day on interruptible pods, priced against the same day on demand: pure arithmetic, no I/O.

``sandbox.py demo-spot`` (colocate/sandbox/spot_demo.py) runs ``demo-autoscale``'s fleet and day
twice, first with every pod on demand, then with every pod interruptible (``colocate:pod.market``)
while the sandbox's host preempts them at a published rate; this module holds the numbers it uses
and what it computes from what it measured.

**Preemptions.** ``PREEMPTIONS_PER_HOUR`` is the rate of the single-node preemption trace that
SkyPilot published with "Can't Be Late" (Wu et al., NSDI 2024; github.com/skypilot-org/spot-traces,
``preemption/1-node/aws-04-22-2023``, commit 221da1a, the same group's data behind SkyServe): one AWS
``p3.2xlarge`` (1 V100) spot instance kept running in each of four zones (us-east-1c, us-east-1f,
us-west-2b, us-west-2c) for a week from 2023-04-22, sampled every 32 s. Over the 431.2 hours the four
instances ran, 202 preemptions (a running sample followed by a stopped one): 0.47 an instance-hour, a
mean life of 2.1 hours (per zone 0.31 to 0.74 an hour). Vast.ai publishes no rate of its own; a GPU
instance that a higher bid can take at any time is not expected to fare better than that trace. Each
interruptible pod's life is drawn from an exponential distribution at that rate (Poisson preemptions).

**Prices.** On demand, ``demo-autoscale``'s $0.60/h. Interruptible: ``INTERRUPTIBLE_SHARE`` of it,
0.35, the middle of Vast.ai's own "Saves 50-80% on costs" (docs.vast.ai, Rental Types FAQ,
"Interruptible (Low Priority)"); the Vast.ai spec's example offer bids 0.474 of its on-demand price
(``min_bid`` 0.111111 against ``dph_total`` 0.234567), at the cheap end of that range, and the report
prices the same measured day at that share too (``SPEC_EXAMPLE_SHARE``). A pod bills from the decision
that rents it (its boot included) until the apply that deletes it returns, or until it is preempted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..cell.market import PREEMPTION_SOURCE, PREEMPTIONS_PER_HOUR
from .day import HOURS, Prices, Served, money, pod_hours

__all__ = ["PREEMPTIONS_PER_HOUR", "PREEMPTION_SOURCE"]  # the rate the day draws lives with the market policy

INTERRUPTIBLE_SHARE = 0.35  # of the on-demand price: the middle of Vast.ai's published 50-80 % saving
SPEC_EXAMPLE_SHARE = round(0.111111 / 0.234567, 3)  # the Vast.ai spec's example offer: min_bid / dph_total = 0.474
PRICE_SOURCE = ('Vast.ai\'s Rental Types FAQ ("Interruptible (Low Priority) ... Saves 50-80% on costs"); the spec\'s '
                "example offer bids 0.474 of its on-demand price")
MAX_COST_RATIO = 0.55  # done when: the interruptible day costs at most this x the on-demand day
MAX_TTFT_P99_RATIO = 1.2  # and its pods' TTFT p99 is at most this x the on-demand day's
DAYS = ("ondemand", "interruptible")


def lifetime_h(rng: random.Random, rate_per_h: float = PREEMPTIONS_PER_HOUR) -> float:
    """Hours an interruptible pod runs before its host takes it back: exponential at ``rate_per_h``."""
    return rng.expovariate(rate_per_h) if rate_per_h > 0 else math.inf


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Day:
    """What one day measured: its requests, each cell's billed pods over the day ((UTC hour, billed),
    a step function), its preemptions and replacements, and the price of its pods' hours."""

    market: str
    served: tuple[Served, ...]
    billed: Mapping[str, Sequence[tuple[float, int]]]
    pod_per_hr: float
    preemptions: int = 0
    replaced: int = 0
    # (preempted, replacement decided, serving) hours of each preemption replaced (``replacements``)
    replacements: tuple[tuple[float, float, float], ...] = ()


def replacements(preempted: Iterable[tuple[float, str, int]],
                 replaced: Iterable[tuple[float, float, str, Sequence[int]]]) -> list[tuple[float, float, float]]:
    """Each preemption ((hour, cell, pod index)) with the replacement of that index in that cell decided
    at or after it (``replaced``: (hour decided, hour serving, cell, indices)): (preempted, decided,
    serving) hours. A preemption no replacement followed (the day ended first, or the cell scaled that pod
    away) is left out."""
    done = sorted(replaced, key=lambda r: r[1])
    out = []
    for at, cell, index in sorted(preempted):
        r = next((r for r in done if r[2] == cell and index in r[3] and r[0] >= at), None)
        if r is not None:
            out.append((at, r[0], r[1]))
    return out


def back_in_service(pairs: Iterable[tuple[float, float, float]]) -> list[float]:
    """Minutes of the day from each preemption until its replacement served (``replacements``)."""
    return [round((end - at) * 60, 1) for at, _, end in pairs]


def waited_to_replace(pairs: Iterable[tuple[float, float, float]]) -> list[float]:
    """Minutes of the day from each preemption until the keeper began its replacement: its next pass,
    and any update of the cell still running (a cell makes one at a time, and the controller's pass
    waits while one boots a pod or drains one)."""
    return [round((start - at) * 60, 1) for at, start, _ in pairs]


def replace_took(pairs: Iterable[tuple[float, float, float]]) -> list[float]:
    """Minutes of the day each replacement took from its beginning until it served: the boot, and the
    update's own time (in the sandbox, its seconds of wall time compressed with the day)."""
    return [round((end - start) * 60, 1) for _, start, end in pairs]


def fallback_usd(served: Iterable[Served], prices: Prices, per: int) -> float:
    """The fallback's spend over the day (each request sent stands for ``per`` of the day's)."""
    return prices.api(sum(s.tokens for s in served if s.backend == "fallback") * per)


def day_figures(d: Day, prices: Prices, per: int, max_pods: int, cap_usd_per_cell: float) -> dict:
    """One day's JSON: its bill three ways, who served, the cut and the failed, TTFT on pods."""
    cells = sorted(d.billed)
    hours = {c: pod_hours(d.billed[c]) for c in cells}
    pods_usd = sum(hours.values()) * d.pod_per_hr
    fb = {c: fallback_usd([s for s in d.served if s.home == c], prices, per) for c in cells}
    pod_served = [s for s in d.served if s.ok and s.backend and s.backend.startswith("pod-")]
    on_pods = [s.ttft_ms for s in pod_served if s.ttft_ms is not None]
    unheld = [s.ttft_ms for s in pod_served if s.ttft_ms is not None and not s.held]
    cut = [s for s in d.served if s.cut]
    failed = [s for s in d.served if not s.ok and not s.cut]
    answered = [s for s in d.served if s.ok or s.cut]
    by_fallback = sum(1 for s in answered if s.backend == "fallback")
    return {
        "market": d.market,
        "requests": len(d.served),
        "failed": len(failed),
        "cut": len(cut),
        "preemptions": d.preemptions,
        "replaced": d.replaced,
        "pod_hours": round(sum(hours.values()), 2),
        "pod_per_hr": d.pod_per_hr,
        "cost": {"autoscaled": money(pods_usd + sum(fb.values())), "pods": money(pods_usd),
                 "fallback": money(sum(fb.values())),
                 "fixed": money(max_pods * len(cells) * HOURS * prices.pod_per_hr),
                 "api": money(prices.api(sum(s.tokens for s in d.served) * per))},
        "fallback": {"share": round(by_fallback / len(answered), 4) if answered else None,
                     "usd_by_cell": {c: money(v) for c, v in fb.items()}, "cap_usd_per_cell": cap_usd_per_cell},
        "ttft_ms": {"p50": _ms(quantile(on_pods, 0.5)), "p99": _ms(quantile(on_pods, 0.99)), "n": len(on_pods)},
        # the sandbox's own deploy holds (Served.held) apart: what the same day would show on Cloudflare's edge
        "ttft_ms_unheld": {"p50": _ms(quantile(unheld, 0.5)), "p99": _ms(quantile(unheld, 0.99)), "n": len(unheld)},
        "back_in_service_min": _quantiles(back_in_service(d.replacements)),
        "waited_to_replace_min": _quantiles(waited_to_replace(d.replacements)),
        "replace_took_min": _quantiles(replace_took(d.replacements)),
        "cells": {c: {"pod_hours": round(hours[c], 2), "fallback_usd": money(fb[c])} for c in cells},
    }


def _quantiles(minutes: Sequence[float]) -> dict:
    return {"p50": quantile(minutes, 0.5), "p90": quantile(minutes, 0.9), "n": len(minutes)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def report(days: Mapping[str, dict], prices: Prices, per: int) -> dict:
    """Both days and how the interruptible one compares: cost ratio, TTFT p99 ratio, the bill again at
    the spec example's price share."""
    od, spot = days["ondemand"], days["interruptible"]
    ratio = spot["cost"]["autoscaled"] / od["cost"]["autoscaled"] if od["cost"]["autoscaled"] else math.inf
    p99 = _ratio(spot["ttft_ms"]["p99"], od["ttft_ms"]["p99"])
    unheld = _ratio(spot["ttft_ms_unheld"]["p99"], od["ttft_ms_unheld"]["p99"])
    at_example = spot["pod_hours"] * prices.pod_per_hr * SPEC_EXAMPLE_SHARE + spot["cost"]["fallback"]
    return {"days": dict(days), "cost_ratio": round(ratio, 3), "ttft_p99_ratio": None if p99 is None else round(p99, 3),
            "ttft_p99_ratio_unheld": None if unheld is None else round(unheld, 3),
            "cost_ratio_at_spec_example_price": round(at_example / od["cost"]["autoscaled"], 3)
            if od["cost"]["autoscaled"] else None,
            "per": per, "preemptions_per_hour": round(PREEMPTIONS_PER_HOUR, 3),
            "interruptible_share": INTERRUPTIBLE_SHARE}


def verdicts(out: dict) -> list[tuple[bool, str]]:
    """The done-when figures of the two days, each with whether it holds."""
    od, spot = out["days"]["ondemand"], out["days"]["interruptible"]
    fb = spot["fallback"]
    per = int(out["per"])
    over = {c: v for c, v in fb["usd_by_cell"].items() if v > fb["cap_usd_per_cell"]}
    over_scaled = {c: v for c, v in fb["usd_by_cell"].items() if v > fb["cap_usd_per_cell"] * per}
    p99 = out["ttft_p99_ratio"]
    failed = od["failed"] + spot["failed"]
    return [
        (out["cost_ratio"] <= MAX_COST_RATIO,
         f"interruptible ${spot['cost']['autoscaled']:.2f} is {out['cost_ratio']:.2f} x the on-demand day "
         f"(${od['cost']['autoscaled']:.2f}); at most {MAX_COST_RATIO}"),
        (failed == 0, f"{od['requests'] + spot['requests']} requests, {failed} failed; {spot['cut']} stream(s) cut "
                      f"mid-answer by {spot['preemptions']} preemption(s), each ended with an error event"),
        # Like with like: the Worker capped what it spent ($ of the requests sent); the figures are
        # that spend x per (the day's), so the cap is scaled the same way. The full-scale reading, the
        # day's spend against the cap as written, is said beside it (and the stricter).
        (not over_scaled, "fallback spend a cell, x" + f"{per:,}" + ": " + ", ".join(
            f"{c} ${v:.2f}" for c, v in fb["usd_by_cell"].items()) + f" against its cap scaled the same way "
         f"(${fb['cap_usd_per_cell']:g} x {per:,}); against ${fb['cap_usd_per_cell']:g} itself "
         + ("held" if not over else "over in " + ", ".join(sorted(over)))),
        (p99 is not None and p99 <= MAX_TTFT_P99_RATIO,
         f"TTFT p99 on pods {_num(spot['ttft_ms']['p99'])} ms against {_num(od['ttft_ms']['p99'])} ms on demand: "
         f"{'n/a' if p99 is None else f'{p99:.2f}'} x; at most {MAX_TTFT_P99_RATIO}"),
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def held_line(out: dict) -> str | None:
    """What the sandbox's own deploy holds did to the TTFT comparison (None when no request met one)."""
    od, spot = out["days"]["ondemand"], out["days"]["interruptible"]
    held = {k: d["ttft_ms"]["n"] - d["ttft_ms_unheld"]["n"] for k, d in (("od", od), ("spot", spot))}
    if not any(held.values()) or out["ttft_p99_ratio_unheld"] is None:
        return None
    return (f"{held['spot']} of the interruptible day's requests on pods ({held['od']} on demand) waited at a sandbox "
            f"cell's edge while an update swapped its Worker, which Cloudflare's edge does not do; without them TTFT "
            f"p99 is {_num(spot['ttft_ms_unheld']['p99'])} ms against {_num(od['ttft_ms_unheld']['p99'])} ms: "
            f"{out['ttft_p99_ratio_unheld']:.2f} x")


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"
