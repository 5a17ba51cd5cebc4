"""Latency budgets: ``--budget NAME=MS[@pNN]`` flags or the stack's ``colocate:budgets``.

A budget is broken when the segment's measured percentile exceeds it: p50 unless the flag
says otherwise (``upstream=400@p99``); stack budgets are p50. A budget on a segment with no
data is broken too (it could not be checked), with a message that says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..cell.settings import SEGMENTS, parse_budgets
from .errors import UsageError
from .placement import NEAR_ZERO_MS
from .stats import PERCENTILES

FLAG = "--budget"


@dataclass(frozen=True)
class Budget:
    segment: str
    ms: float
    percentile: str = "p50"

    def to_json(self) -> dict:
        return {"segment": self.segment, "ms": self.ms, "percentile": self.percentile}


def parse_flag(text: str) -> Budget:
    """``state=25`` or ``upstream=400@p99``; UsageError names the flag, the value and the fix."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise UsageError(FLAG, text, "expected NAME=MS", "write e.g. --budget state=25")
    if name not in SEGMENTS:
        raise UsageError(FLAG, text, f"unknown segment {name!r}", f"use one of {', '.join(SEGMENTS)}")
    ms_text, at, pct = rest.partition("@")
    pct = pct.strip().lower() if at else "p50"
    if pct not in PERCENTILES:
        raise UsageError(FLAG, text, f"unknown percentile {pct!r}", f"use one of {', '.join(PERCENTILES)}")
    try:
        ms = float(ms_text)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise UsageError(FLAG, text, f"{ms_text.strip()!r} is not a positive number of milliseconds",
                         f"write e.g. --budget {name}=25")
    return Budget(name, ms, pct)


def from_flags(values: Iterable[str]) -> list[Budget]:
    out: dict[tuple[str, str], Budget] = {}
    for text in values:
        b = parse_flag(text)
        if (b.segment, b.percentile) in out:
            raise UsageError(FLAG, text, f"{b.segment} at {b.percentile} is given twice", "give each budget once")
        out[(b.segment, b.percentile)] = b
    return list(out.values())


def from_stack(raw: object) -> list[Budget]:
    """The stack's ``colocate:budgets`` (validated by colocate.cell.settings; defaults when unset)."""
    return [Budget(name, ms) for name, ms in parse_budgets(raw).items()]


def broken(budgets: Iterable[Budget], segments: Mapping[str, Mapping], floors: Mapping[str, float | None]) -> list[dict]:
    """One violation per broken budget, each with a message a person can act on."""
    out = []
    for b in budgets:
        seg = segments.get(b.segment) or {}
        measured = seg.get(b.percentile)
        if measured is None:
            out.append({"kind": "budget", "segment": b.segment, "percentile": b.percentile, "budget_ms": b.ms,
                        "measured_ms": None,
                        "message": f"{b.segment} budget {b.ms:g} ms ({b.percentile}) could not be checked: no data"})
            continue
        if measured <= b.ms:
            continue
        floor = floors.get(b.segment)
        why = f" (floor {floor:,.0f} ms)" if floor is not None and floor >= NEAR_ZERO_MS else ""
        out.append({"kind": "budget", "segment": b.segment, "percentile": b.percentile, "budget_ms": b.ms,
                    "measured_ms": measured,
                    "message": f"{b.segment} {b.percentile} {measured:,.1f} ms exceeds its {b.ms:g} ms budget{why}"})
    return out
