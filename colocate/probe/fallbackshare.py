"""The fallback's share of the answers, judged: the probe and the live view fail when the paid API
carries more than the operator's share while the cell has pods that should serve.

A pod that dies, a hop that refuses, a breaker held open: each sends every request to the
fallback, and each answer still succeeds, so nothing else the checks read would fail. The share
is the one number that says the pods are not serving. ``colocate:probe.maxFallbackShare`` sets
the ceiling (``DEFAULT_MAX_SHARE``); fewer than ``MIN_FALLBACK`` fallback answers never fail, so
one deadline miss on a quiet cell is not an alarm. A cell the scaling controller runs with no
pod in rotation serves from the fallback by design: that is said, not failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cell.settings import PROBE_DEFAULTS

DEFAULT_MAX_SHARE = float(PROBE_DEFAULTS["maxFallbackShare"])
MIN_FALLBACK = 3
FIX = ("check the pods: `.venv/bin/python scripts/probe.py --stack <stack>` (pod health, breakers), "
       "`.venv/bin/python scripts/pod.py status`; raise colocate:probe.maxFallbackShare only if this share is intended")


@dataclass(frozen=True)
class Share:
    """``fallback`` of ``total`` answers came from the fallback (``where`` names the window)."""

    fallback: int
    total: int
    where: str

    @property
    def share(self) -> float | None:
        return self.fallback / self.total if self.total else None

    def violation(self, max_share: float, routed_pods: int | None = None) -> dict | None:
        """The violation this share makes (None when it is within ``max_share``, too small to count,
        or the cell routes to no pod: see ``note``)."""
        if self.share is None or self.fallback < MIN_FALLBACK or self.share <= max_share or routed_pods == 0:
            return None
        return {"kind": "fallback_share", "part": "fallback", "share": round(self.share, 4), "max_share": max_share,
                "fallback": self.fallback, "requests": self.total,
                "message": f"the fallback served {self.share:.0%} of {self.where} ({self.fallback} of {self.total}; "
                           f"colocate:probe.maxFallbackShare {max_share:.0%}): the pods are not serving — {FIX}"}

    def note(self, max_share: float, routed_pods: int | None) -> str | None:
        """What to say instead of failing: a share over the ceiling with no pod in rotation."""
        if routed_pods == 0 and self.fallback and self.share is not None and self.share > max_share:
            return (f"the fallback served {self.share:.0%} of {self.where}: the cell routes to no pod "
                    "(scaled to zero), so the fallback serves by design")
        return None
