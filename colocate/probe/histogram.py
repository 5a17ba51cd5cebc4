"""The Worker's latency histograms, read in Python (worker/src/histogram.js holds the scheme).

Bucket 0 holds [0, 0.25 ms]; bucket k = 1..top holds (edge(k-1), edge(k)] with edge(k) =
0.25 ms x 2^(k/32) (OpenTelemetry's exponential grid at scale 5), top being the first edge
past 60 s; bucket top + 1 holds everything above. Each bucket stands for 2 lo hi / (lo + hi),
within 1.08 % of every value in it, so a percentile read here is within 1.08 % of the exact
one (0.25 ms below 0.25 ms). Counts add bucket by bucket: merging isolates, minutes, hours
and cells is exact. Text: "~" then, per non-empty bucket, its gap from the previous one and
"*count" unless 1, the gap left out when it is 1 and a count follows ("~0*118,200,3*40,*7").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .errors import ProbeError
from .stats import PERCENTILES


class HistogramError(ProbeError, ValueError):
    """A histogram text or bucket description that is not what the Worker writes (names the part)."""


@dataclass(frozen=True)
class Buckets:
    """The bucket layout, as ``GET /_colocate/live`` describes it in ``buckets``."""

    low_ms: float = 0.25
    per_octave: int = 32
    top: int = 572

    @classmethod
    def from_doc(cls, raw: object) -> Buckets:
        if raw is None:
            return cls()
        ok = (isinstance(raw, Mapping) and isinstance(raw.get("low_ms"), int | float) and raw["low_ms"] > 0
              and isinstance(raw.get("per_octave"), int) and raw["per_octave"] > 0
              and isinstance(raw.get("top"), int) and 0 < raw["top"] < 10_000)
        if not ok or not isinstance(raw, Mapping):
            raise HistogramError(f"buckets {raw!r}: expected {{low_ms, per_octave, top}} as the Worker sends them")
        return cls(float(raw["low_ms"]), raw["per_octave"], raw["top"])

    @property
    def count(self) -> int:
        return self.top + 2

    @property
    def relative_error(self) -> float:
        g = 2 ** (1 / self.per_octave)
        return (g - 1) / (g + 1)

    def edge(self, k: int) -> float:
        """The inclusive upper edge of bucket k (k = 0..top)."""
        return self.low_ms * 2 ** (k / self.per_octave)

    def bucket_of(self, ms: float) -> int:
        if not ms > self.low_ms:
            return 0
        if ms > self.edge(self.top):
            return self.top + 1
        k = math.ceil(math.log2(ms / self.low_ms) * self.per_octave)
        if ms > self.edge(k):  # the logarithm may land one off at an edge
            k += 1
        elif ms <= self.edge(k - 1):
            k -= 1
        return k

    def value(self, k: int) -> float:
        """What bucket k stands for: 2 lo hi / (lo + hi); 0 for bucket 0, the top edge above it."""
        if k <= 0:
            return 0.0
        if k > self.top:
            return self.edge(self.top)
        lo, hi = self.edge(k - 1), self.edge(k)
        return 2 * lo * hi / (lo + hi)


DEFAULT_BUCKETS = Buckets()


@dataclass(frozen=True)
class Summary:
    """p10/p50/p90/p99 (ms, None without data) and n: the probe's summary shape."""

    p10: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    n: int

    def to_json(self) -> dict:
        return {"p10": self.p10, "p50": self.p50, "p90": self.p90, "p99": self.p99, "n": self.n}


@dataclass
class Histogram:
    """Counts per bucket index (only non-empty buckets are held)."""

    counts: dict[int, int] = field(default_factory=dict)

    @classmethod
    def decode(cls, text: object, buckets: Buckets = DEFAULT_BUCKETS) -> Histogram:
        if not isinstance(text, str):
            raise HistogramError(f"histogram {text!r}: expected text '~gap*count,...'")
        h = cls()
        if text == "":
            return h
        if text[0] != "~":
            raise HistogramError(f"histogram {text[:40]!r}: expected text '~gap*count,...' (a Worker older than this probe?)")
        k, first = 0, True
        for part in text[1:].split(","):
            gap, star, count = part.partition("*")
            if gap == "" and star and not first:
                k += 1
            elif gap.isdigit() and len(gap) <= 4:
                k += int(gap)
            else:
                k = -1
            first = False
            if not (0 <= k < buckets.count and (not star or (count.isdigit() and int(count) > 0))):
                raise HistogramError(f"histogram part {part!r}: expected gap[*count] with buckets 0..{buckets.count - 1}")
            h.counts[k] = h.counts.get(k, 0) + (int(count) if star else 1)
        return h

    @classmethod
    def of(cls, values: Iterable[float], buckets: Buckets = DEFAULT_BUCKETS) -> Histogram:
        h = cls()
        for v in values:
            k = buckets.bucket_of(v)
            h.counts[k] = h.counts.get(k, 0) + 1
        return h

    def encode(self) -> str:
        parts: list[str] = []
        prev = 0
        for k in sorted(c for c in self.counts if self.counts[c]):
            c = self.counts[k]
            gap = "" if parts and k - prev == 1 and c > 1 else str(k - prev)
            parts.append(gap + ("" if c == 1 else f"*{c}"))
            prev = k
        return "~" + ",".join(parts) if parts else ""

    def add(self, other: Histogram) -> Histogram:
        for k, c in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + c
        return self

    @property
    def n(self) -> int:
        return sum(self.counts.values())

    def percentile(self, q: float, buckets: Buckets = DEFAULT_BUCKETS) -> float | None:
        """numpy's default ranks (interpolated between neighbours), each rank at its bucket's value."""
        n = self.n
        if n == 0:
            return None
        pos = min(100.0, max(0.0, q)) / 100 * (n - 1)
        lo = math.floor(pos)
        a = self._value_at(lo, buckets)
        return a if lo == pos else a + (self._value_at(lo + 1, buckets) - a) * (pos - lo)

    def _value_at(self, i: int, buckets: Buckets) -> float:
        before = 0
        for k in sorted(self.counts):
            before += self.counts[k]
            if i < before:
                return buckets.value(k)
        return buckets.value(buckets.top + 1)

    def summary(self, buckets: Buckets = DEFAULT_BUCKETS) -> Summary:
        p = {name: self.percentile(float(name[1:]), buckets) for name in PERCENTILES}
        return Summary(**{k: None if v is None else round(v, 2) for k, v in p.items()}, n=self.n)


def merged(hists: Iterable[Histogram]) -> Histogram:
    out = Histogram()
    for h in hists:
        out.add(h)
    return out
