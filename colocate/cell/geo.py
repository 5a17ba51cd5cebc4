"""Colo coordinates, great-circle distances and the physical round-trip floor.

Light in fibre covers about 200 km per millisecond, so a round trip between two
sites costs at least ``2 * km / 200`` ms. Measured paths run about 1.5-1.65x that
(Tokyo-Ashburn 165 ms against a 109 ms floor, Tokyo-Taipei 36 ms against 22 ms), hence the default stretch the sandbox uses.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

FIBRE_KM_PER_MS = 200.0
DEFAULT_STRETCH = 1.55
EARTH_RADIUS_KM = 6371.0088
COLOS_FILE = Path(__file__).parents[1] / "data" / "cloudflare-colos.json"


@dataclass(frozen=True)
class Colo:
    code: str
    city: str
    country: str  # ISO 3166-1 alpha-2
    lat: float
    lon: float


@lru_cache(maxsize=1)
def colos() -> dict[str, Colo]:
    raw = json.loads(COLOS_FILE.read_text())
    # 31 entries (mainland China partner colos) carry no coordinates: they cannot be sites.
    return {
        code: Colo(code, entry.get("city", code), entry.get("cca2", ""), float(entry["lat"]), float(entry["lon"]))
        for code, entry in raw.items()
        if entry.get("lat") is not None and entry.get("lon") is not None
    }


def colo(code: str) -> Colo:
    try:
        return colos()[code.upper()]
    except KeyError:
        raise KeyError(f"unknown Cloudflare colo {code!r}: not in {COLOS_FILE.name}") from None


def distance_km(a: str, b: str) -> float:
    """Great-circle (haversine) distance between two colos."""
    ca, cb = colo(a), colo(b)
    la1, lo1, la2, lo2 = map(math.radians, (ca.lat, ca.lon, cb.lat, cb.lon))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def floor_ms(a: str, b: str) -> float:
    """The physical minimum round trip between two colos, in ms."""
    return 2 * distance_km(a, b) / FIBRE_KM_PER_MS
