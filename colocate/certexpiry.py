"""When the pod hop's certificates lapse, said before they do (docs/pods.md, "Certificates never
lapse unseen"). Pure: no I/O.

The hop's leaves (infra/hop.py: each pod's server certificate, the Worker's client certificate,
the readiness check's) live 90 days, and pulumi-tls re-issues one only when a `pulumi up` runs in
its last 30 days (``early_renewal_hours``); nothing renews them on their own. A cell nobody
updates stops reaching its pods on day 90 and sends all its traffic to the fallback. The stack
exports the earliest leaf's not-after (``hopCertsNotAfter``); the post-deploy probe and the live
view (``probe.py``) judge it: a warning 30 days ahead, a failed check 7 days ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

WARN_DAYS = 30  # = infra/hop.py EARLY_RENEWAL_HOURS: from here a `pulumi up` re-issues them
FAIL_DAYS = 7
OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Expiry:
    level: str  # ok, warn, fail
    not_after: str
    days_left: float
    message: str

    def as_json(self) -> dict:
        return {"level": self.level, "not_after": self.not_after, "days_left": round(self.days_left, 1),
                "message": self.message}


def parse(not_after: str) -> datetime:
    """An RFC 3339 time (pulumi-tls ``validity_end_time``, e.g. ``2027-03-06T06:00:00Z``)."""
    value = datetime.fromisoformat(not_after.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def check(not_after: str, now: datetime, stack: str | None = None) -> Expiry:
    """The verdict on the hop's earliest certificate, with the way out when it is near."""
    days = (parse(not_after) - now).total_seconds() / 86400
    where = f" -s {stack}" if stack else ""
    renew = (f"run `pulumi up{where}` now: inside the last {WARN_DAYS} days it re-issues them, and the pods are "
             "replaced side by side, every new one healthy and named by the Worker before the old ones go")
    if days <= 0:
        return Expiry(FAIL, not_after, days, f"the pod hop's certificates expired {-days:.1f} days ago: the Worker "
                      f"cannot reach its pods and every request goes to the fallback; {renew}")
    if days <= FAIL_DAYS:
        return Expiry(FAIL, not_after, days, f"the pod hop's certificates expire in {days:.1f} days ({not_after}); "
                      f"{renew}")
    if days <= WARN_DAYS:
        return Expiry(WARN, not_after, days, f"the pod hop's certificates expire in {days:.1f} days ({not_after}); "
                      f"{renew}")
    return Expiry(OK, not_after, days, f"the pod hop's certificates run until {not_after} ({days:.0f} days)")
