"""The sandbox's emulated geography: sites, the round-trip model, and where objects land.

Sites are Cloudflare colos (IATA codes, coordinates from ``colocate.cell.geo``). The round
trip between two sites is

    rtt(a, b) = override(a, b)                                  when one is given
              = max(floor_ms(a, b) * stretch, same_site_ms)     otherwise

``floor_ms`` is the physical floor (2 x great-circle km / 200 km per ms); ``stretch``
defaults to ``geo.DEFAULT_STRETCH`` (1.55: Tokyo-Ashburn was seen at 1.5x its floor,
Tokyo-Taipei at 1.65x). ``same_site_ms`` (10 ms) is the cost of a hop inside one metro:
the field measured 10-12 ms between a Worker and a Durable Object in the same place, so
two parts in one colo never talk for free. Overrides are symmetric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..cell import geo
from .errors import GeographyError

SAME_SITE_MS = 10.0
# The external fallback API's site. OpenAI-compatible APIs mostly answer from the US
# west coast; a fixed site keeps the fallback's cost honest wherever the cell is.
FALLBACK_SITE = "SJC"

# Where an object lands when its location hint names an area other than the edge's.
# One hosting colo per hint; `sam`, `afr` and `me` host no objects (cloudflare-docs
# ``durable-objects/reference/data-location``) and fall
# back to the nearest hosting area.
HINT_SITES = {"wnam": "SJC", "enam": "IAD", "weur": "AMS", "eeur": "WAW", "apac": "NRT", "oc": "SYD"}
NON_HOSTING = {"sam": "enam", "afr": "weur", "me": "eeur"}
HINTS = (*HINT_SITES, *NON_HOSTING)
_OVERRIDE = re.compile(r"^([A-Za-z]{3}):([A-Za-z]{3})=(\d+(?:\.\d+)?)$")


def site(code: object, what: str = "site") -> str:
    """A known colo code, upper-cased; GeographyError names the value otherwise."""
    if not isinstance(code, str) or not code:
        raise GeographyError(f"{what}: a site is a Cloudflare colo code like TPE or IAD (got {code!r})")
    try:
        return geo.colo(code).code
    except KeyError:
        raise GeographyError(f"{what}: unknown Cloudflare colo {code!r}. Fix: use an IATA code from "
                             f"colocate/data/{geo.COLOS_FILE.name}, for example TPE, NRT, IAD, SJC") from None


def area_of(code: str) -> str:
    """The location-hint area a colo sits in, from its coordinates (coarse, documented)."""
    c = geo.colo(code)
    lat, lon = c.lat, c.lon
    if lon < -25:  # the Americas
        if lat < 15:
            return "sam"
        return "wnam" if lon < -98 else "enam"
    if lon < 60:
        if lat >= 35:
            return "weur" if lon < 15 else "eeur"
        return "me" if lon >= 34 and lat >= 12 else "afr"
    return "oc" if lat < -10 and lon >= 110 else "apac"


def hosting_area(hint: str) -> str:
    return NON_HOSTING.get(hint, hint)


def landing_site(edge: str, hint: str = "") -> str:
    """Where an object first touched from ``edge`` with ``hint`` is created.

    The real rule (cloudflare-docs ``durable-objects/reference/data-location``): near the Worker
    that first calls ``get()``; the hint is a best-effort preference. Emulated: the edge's own site when there is no hint or the
    edge lies in the hint's area, else the hint's hosting colo (``HINT_SITES``).
    """
    edge = site(edge, "edge")
    edge_area = hosting_area(area_of(edge))
    wanted = hosting_area(hint) if hint else edge_area
    if wanted not in HINT_SITES:
        raise GeographyError(f"locationHint: unknown hint {hint!r}. Fix: use one of {', '.join(HINTS)}")
    if wanted == edge_area and area_of(edge) == edge_area:
        return edge
    return HINT_SITES[wanted]


def worker_site(mode: str, *, hint_site: str, client: str, pod: str) -> str:
    """Where the emulated platform runs a placed Worker.

    ``pod`` (placement.host): Cloudflare probes the pod's address and runs the Worker in the
    colo nearest it; the stand-in pod's site is already that colo (the catalogue's
    ``location_sites``: each location's nearest colo), so the Worker runs there, whatever the
    catalogue's cloud hint says. ``targeted``: the colo of the region's cloud hint
    (``hint_site``, the catalogue's ``edge_site``). ``smart``: where the request was accepted
    (smart placement only moves a Worker after it has seen traffic and analysed it).
    """
    if mode == "pod":
        return site(pod, "pod site")
    if mode == "smart":
        return site(client, "client site")
    return site(hint_site, "edge site")


def parse_override(text: str) -> tuple[tuple[str, str], float]:
    """``"TPE:IAD=170"`` -> (("IAD", "TPE"), 170.0); the pair is stored sorted (symmetric)."""
    m = _OVERRIDE.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise GeographyError(f"--rtt: {text!r} is not SITE:SITE=MS. Fix: write it like --rtt TPE:IAD=170")
    a, b = site(m.group(1), "--rtt"), site(m.group(2), "--rtt")
    low, high = sorted((a, b))
    return (low, high), float(m.group(3))


@dataclass(frozen=True)
class Geography:
    """The round-trip model. Pure: no sleeping happens here."""

    stretch: float = geo.DEFAULT_STRETCH
    same_site_ms: float = SAME_SITE_MS
    overrides: dict[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stretch, bool) or not isinstance(self.stretch, (int, float)) or not 1.0 <= self.stretch <= 5.0:
            raise GeographyError(f"--stretch: must be a number from 1.0 to 5.0 (got {self.stretch!r}). "
                                 f"Fix: omit it for the default {geo.DEFAULT_STRETCH}")
        if not isinstance(self.same_site_ms, (int, float)) or self.same_site_ms < 0:
            raise GeographyError(f"same-site RTT must be >= 0 ms (got {self.same_site_ms!r})")

    @classmethod
    def from_args(cls, stretch: float | None = None, overrides: list[str] | tuple[str, ...] = (),
                  same_site_ms: float = SAME_SITE_MS) -> Geography:
        return cls(stretch=geo.DEFAULT_STRETCH if stretch is None else stretch, same_site_ms=same_site_ms,
                   overrides=dict(parse_override(o) for o in overrides))

    def rtt_ms(self, a: str, b: str) -> float:
        a, b = site(a), site(b)
        pair = tuple(sorted((a, b)))
        if pair in self.overrides:
            return self.overrides[pair]
        return round(max(geo.floor_ms(a, b) * self.stretch, self.same_site_ms), 2)

    def as_json(self) -> dict:
        return {"stretch": self.stretch, "same_site_ms": self.same_site_ms,
                "overrides": {f"{a}:{b}": ms for (a, b), ms in sorted(self.overrides.items())}}

    @classmethod
    def from_json(cls, data: dict) -> Geography:
        return cls.from_args(data["stretch"], [f"{k}={v}" for k, v in data.get("overrides", {}).items()],
                             data.get("same_site_ms", SAME_SITE_MS))


@dataclass(frozen=True)
class Sites:
    """Where each part of the sandboxed cell sits."""

    client: str
    edge: str
    pod: str
    fallback: str = FALLBACK_SITE

    @property
    def placement(self) -> str:
        """The ``cf-placement`` value the real edge would add for this client and edge."""
        return f"{'local' if self.client == self.edge else 'remote'}-{self.edge}"

    def as_json(self) -> dict:
        return {"client": self.client, "edge": self.edge, "pod": self.pod, "fallback": self.fallback}
