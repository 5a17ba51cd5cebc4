"""Parsing ``Server-Timing`` headers (W3C Server Timing).

``state;dur=12.5, upstream;dur=65, fallback;dur=0, total;dur=80.1`` → ``{"state": 12.5, ...}``;
a metric's ``desc`` is kept too (``front;dur=1;desc="NRT"``: where a fleet's front door ran).
Entries are comma-separated, parameters semicolon-separated; a metric may carry ``desc``
and no ``dur``. An entry this kit expects to time (``wanted``) is *malformed* when its
``dur`` is missing, not a number, or negative; those problems are returned, not raised,
so the probe can count bad samples and keep the good ones. The first occurrence of a
metric wins, as the spec asks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


@dataclass(frozen=True)
class Timing:
    """The parsed header: durations in ms, and what was wrong with it (empty when fine)."""

    durations: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    descs: dict[str, str] = field(default_factory=dict)  # a metric's desc, e.g. the front door's colo

    @property
    def ok(self) -> bool:
        return not self.problems


def parse(header: str | None, wanted: Iterable[str] = ()) -> Timing:
    """Parse one (possibly combined) header value. ``wanted`` names metrics that must be present."""
    wanted = tuple(wanted)
    if header is None or not header.strip():
        return Timing({}, ("no Server-Timing header",) if wanted else ())
    durations: dict[str, float] = {}
    descs: dict[str, str] = {}
    problems: list[str] = []
    for raw in _split(header, ","):
        entry = raw.strip()
        if not entry:
            continue
        name, *params = [p.strip() for p in _split(entry, ";")]
        if not _TOKEN.match(name):
            problems.append(f"bad metric name {name!r}")
            continue
        if name in durations:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "desc" and name not in descs:
                descs[name] = value.strip().strip('"')
        dur: float | None = None
        bad = None
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() != "dur":
                continue
            try:
                dur = float(value.strip().strip('"'))
            except ValueError:
                bad = f"{name}: dur={value.strip()!r} is not a number"
                break
            if not math.isfinite(dur) or dur < 0:
                bad = f"{name}: dur={value.strip()} is not a duration"
                dur = None
            break
        if bad:
            problems.append(bad)
        elif dur is not None:
            durations[name] = dur
        elif name in wanted:
            problems.append(f"{name}: no dur")
    for name in wanted:
        if name not in durations and not any(p.startswith(f"{name}:") for p in problems):
            problems.append(f"{name}: missing")
    return Timing(durations, tuple(problems), descs)


def _split(text: str, sep: str) -> list[str]:
    # Split on `sep` outside double quotes (desc="a, b" is one parameter).
    parts: list[str] = []
    buf: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == sep and not quoted:
            parts.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    parts.append("".join(buf))
    return parts
