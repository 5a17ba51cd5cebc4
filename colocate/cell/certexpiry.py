"""When the pod hop's certificates lapse, said before they do (docs/pods.md, "Certificates renew
themselves"). Pure: no I/O.

The hop's leaves (infra/hop.py: each pod's server certificate, the Worker's client certificate,
the readiness check's) live 90 days. From day 60 (``RENEW_DAYS`` left) the keeper renews them,
the cell's own first, then one pod at a time (colocate/scaling/keeper.py). A `pulumi up` re-issues what
is left only in the last ``AUTO_RENEW_DAYS`` (``early_renewal_hours``, ACME's
``min_days_remaining``), all at once: the backstop of a cell nobody keeps, which would otherwise
stop reaching its pods on day 90. The stack exports the earliest leaf's not-after
(``hopCertsNotAfter``) and each role's (``hopCerts``); the post-deploy probe and the live view
(``probe.py``) judge the earliest: a warning ``WARN_DAYS`` ahead, a failed check ``FAIL_DAYS`` ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

RENEW_DAYS = 30  # the keeper renews a certificate from here (day 60 of 90), one pod at a time
AUTO_RENEW_DAYS = 14  # = infra/hop.py EARLY_RENEWAL_HOURS: from here any `pulumi up` re-issues them all
WARN_DAYS = 30
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


def check(not_after: str, now: datetime, stack: str | None = None, endpoints: bool = False) -> Expiry:
    """The verdict on the hop's earliest certificate, with the way out when it is near. ``endpoints``: the
    pods are endpoints the team runs (provider existing), whose certificates no keeper can install."""
    days = (parse(not_after) - now).total_seconds() / 86400
    where = f" -s {stack}" if stack else ""
    keeper = f".venv/bin/python scripts/scale.py run{where.replace(' -s', ' --stack')}"
    renew = (f"the keeper (`{keeper}`) renews them from {RENEW_DAYS} days left, one pod at a time, each new pod "
             f"serving before the next old one goes; without it, `pulumi up{where}` inside the last {AUTO_RENEW_DAYS} "
             "days re-issues them all at once, every pod replaced side by side")
    if endpoints:
        renew = (f"your endpoints serve the certificates the kit issued them: `pulumi up{where}` re-issues theirs from "
                 f"{RENEW_DAYS} days left and waits until each box serves its new one, printing where the credentials "
                 "are and the commands that install them (docs/pods.md, \"An endpoint you already run\"); the keeper "
                 "renews the cell's own")
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
