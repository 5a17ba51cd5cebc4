"""The keeper: what runs reconciled with what is declared, one pass at a time, inside the scaling
controller's pass and under its lease (colocate/scaling/controller.py ``Controller.step``; docs/pods.md, "The
keeper"). ``local.Command`` has no read step, so `pulumi refresh` finds nothing wrong with a pod
that died after deploy: the keeper is what looks.

Each pass, before anything is deployed:

1. **The code.** The running Worker says which modules it runs (``worker_hash`` of ``GET
   /_colocate/scale``, the ``WORKER_HASH`` binding); a controller whose checkout would upload
   other modules (``CellPlan.worker.content_hash()``) refuses to deploy anything and says which
   hash runs, which it has and what to do (``stale_checkout``).
2. **The pods.** Each pod the last update made is described through its provider's API
   (``Provider.describe``) and checked against the cell's own health view (the Worker's health
   check of each pod and its breaker, ``GET /_colocate/probe``): ``dead`` (RunPod EXITED, ERROR,
   TERMINATED; Vast.ai exited, offline, unknown; a stand-in that is gone), ``gone`` (the provider
   knows no such pod), ``remapped`` (running at another address than the one recorded: a RunPod
   reset maps the public port anew), ``misplaced`` (its location is outside the region) are
   replaced at once; ``unhealthy`` (the provider says it runs, the Worker cannot reach it) after
   ``UNHEALTHY_PASSES`` passes in a row. A server of the user's (the sandbox's ``colocate:pod.url``)
   is judged by the Worker's health check alone and never replaced or renewed: the keeper did not
   start it and cannot start another (``down`` says so; its owner starts it again). Each
   replacement is one targeted update of those pods
   alone: ``colocate:pod.replaced`` counts pod i's replacements into its name, recorded in the
   generation first (so every `pulumi up`, from any checkout, declares the same name), and the
   deployer replaces that pod's resources and those depending on them, never another pod's. An
   interruptible pod its provider reports dead (Vast.ai outbid or exited; the sandbox's host
   taking it back) is ``preempted``: replaced at once the same way, the replacement rented under
   the market policy (colocate/cell/market.py: interruptible again, on another host where the provider
   can tell; on demand under ``mix`` when no interruptible capacity is left). An endpoint the team
   runs (provider ``existing``) is judged and reported the same way, and never replaced: its operator
   mends it.
3. **The certificates.** A role whose certificate has ``RENEW_DAYS`` or fewer left (day 60 of 90)
   is renewed, one role a pass, after any replacement: the cell's own leaves (the Worker's client
   certificate, the readiness check's: no pod is replaced) first, then pod by pod (a pod that does
   not serve is replaced, with a certificate of its own, before it is renewed), each
   renewal one targeted update that replaces that pod alone (its certificate is in its name), the
   new pod serving and named by the Worker before the old one goes.
4. **The alerts.** A pod whose replacement failed ``ALERT_AFTER`` times in a row
   (``replace_failed``), ``ALERT_AFTER`` failed updates in a row (``update_failing``), a Pulumi
   stack lock held longer than ``LOCK_ALERT_S`` (``stack_locked``: a CLI killed mid-update leaves
   it) and a refused checkout (``stale_checkout``) are raised in the keeper's record, which the
   generation keeps: ``/_colocate/metrics`` exposes ``colocate_keeper_alert`` (docs/grafana/alerts.yml
   pages on it), the live view prints it, and ``scripts/scale.py run`` exits 3 so a supervisor sees it.

Only the deployer differs between the cloud (``pulumi up --target``) and the sandbox (its apply).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from ..cell import certexpiry
from ..errors import ScriptError
from ..pods.base import DEAD, RUNNING, PodInfo
from ..pods.errors import NotFoundError, PodError

OK, GONE, REMAPPED, MISPLACED, UNHEALTHY, UNKNOWN = "ok", "gone", "remapped", "misplaced", "unhealthy", "unknown"
PREEMPTED = "preempted"  # an interruptible pod its provider reports dead (colocate/cell/market.py)
DOWN = "down"  # a server of the user's that the Worker cannot reach: only its owner can start it
REPLACE_AT_ONCE = (DEAD, PREEMPTED, GONE, REMAPPED, MISPLACED)  # what the provider's own answer proves
CERTIFICATE = "certificate"  # a replacement's reason when a pod's certificate is renewed
UNHEALTHY_PASSES = 2  # the Worker's view alone: this many passes in a row before a boot is bought
ALERTS = ("replace_failed", "update_failing", "stack_locked", "stale_checkout")  # worker/src/metrics.js KEEPER_ALERTS
ALERT_AFTER = 3  # failed replacements of one pod, or failed updates, in a row
# A real update holds the stack's lock for one boot at most (colocate:pod.readyTimeoutS, 1,800 s, and
# the Worker and probe after it): a lock held longer was left by a CLI killed mid-update.
LOCK_ALERT_S = 2400.0
RENEW_DAYS = certexpiry.RENEW_DAYS
CELL_ROLE = "cell"  # the cell's own leaves: the Worker's client certificate and the readiness check's
EVENTS_KEPT = 10


class KeeperError(ScriptError):
    """The keeper's base: a pass could not do what it decided."""


class StackLocked(KeeperError):
    """The owner's update found the stack locked (``pulumi.automation.ConcurrentUpdateError``): another
    update runs, or a CLI killed mid-update left the lock."""


@dataclass(frozen=True)
class RunningPod:
    """A pod as the last completed update recorded it: where it was, where it must be."""

    index: int
    id: str
    provider: str
    ip: str | None = None
    port: int | None = None
    location: str | None = None
    locations: tuple[str, ...] = ()  # the region's locations for its provider
    proxied: bool = False  # reached through the provider's proxy: its public address is not what the Worker uses
    # a server the keeper did not start (colocate:pod.url, provider existing): judged by health, never replaced or renewed
    own: bool = False


@dataclass(frozen=True)
class Verdict:
    index: int
    id: str
    state: str
    detail: str
    own: bool = False  # RunningPod.own: its verdict is reported, never acted on

    @property
    def replace(self) -> bool:
        return self.state in REPLACE_AT_ONCE and not self.own

    def as_json(self) -> dict:
        out = {"index": self.index, "id": self.id, "state": self.state, "detail": self.detail[:200]}
        return {**out, "own": True} if self.own else out


def judge(pod: RunningPod, describe: Callable[[RunningPod], PodInfo], health: Mapping | None) -> Verdict:
    """One pod's verdict from its provider's answer and the Worker's health check of it (None: not
    checked, e.g. a draining pod the Worker no longer routes to)."""
    if pod.own:
        return judge_own(pod, health)
    try:
        info = describe(pod)
    except NotFoundError as exc:
        return Verdict(pod.index, pod.id, GONE, f"{pod.provider} knows no pod {pod.id} ({exc})")
    except (PodError, OSError) as exc:
        return Verdict(pod.index, pod.id, UNKNOWN, f"{pod.provider} could not be asked about {pod.id}: {exc}")
    if info.state == DEAD:
        if info.market == "interruptible":
            return Verdict(pod.index, pod.id, PREEMPTED, f"{pod.provider} reports interruptible {pod.id} "
                           f"{info.raw_state}" + (f" on host {info.host}" if info.host else ""))
        return Verdict(pod.index, pod.id, DEAD, f"{pod.provider} reports {pod.id} {info.raw_state}")
    if pod.locations and info.location and info.location not in pod.locations:
        return Verdict(pod.index, pod.id, MISPLACED,
                       f"{pod.id} runs in {info.location}, outside the region's {', '.join(pod.locations)}")
    if info.state == RUNNING and not pod.proxied and pod.ip and (info.ip, info.port) != (pod.ip, pod.port):
        return Verdict(pod.index, pod.id, REMAPPED, f"{pod.id} runs at {info.ip}:{info.port}, recorded at "
                       f"{pod.ip}:{pod.port}: the Worker still sends to the old address")
    if health is not None and health.get("ok") is False:
        breaker = health.get("breaker")
        said = health.get("status") or "nothing"
        return Verdict(pod.index, pod.id, UNHEALTHY, f"{pod.provider} reports {pod.id} {info.raw_state}, but the Worker's "
                       f"health check answered {said}" + (f" (breaker {breaker})" if breaker else ""))
    return Verdict(pod.index, pod.id, OK, f"{info.raw_state}")


def judge_own(pod: RunningPod, health: Mapping | None) -> Verdict:
    """A server of the user's: its provider record says only where it is (the keeper started nothing),
    so the Worker's health check alone says whether it serves; ``down`` is never replaced."""
    where = f"{pod.ip}:{pod.port}" if pod.ip and pod.port else pod.id
    if health is not None and health.get("ok") is False:
        said = health.get("status") or "nothing"
        return Verdict(pod.index, pod.id, DOWN, f"the server you run at {where} (colocate:pod.url or colocate:pod.endpoints) "
                       f"answered the Worker's health check {said}: the keeper replaces no server it did not start; "
                       "start it again on its host (docs/pods.md, docs/sandbox.md)", own=True)
    return Verdict(pod.index, pod.id, OK, f"the server you run at {where}", own=True)


def health_view(probe: Mapping | None) -> dict[int, dict]:
    """Pod index -> {ok, status, breaker} from ``GET /_colocate/probe`` (the pods in rotation)."""
    if not isinstance(probe, Mapping):
        return {}
    breakers = {p.get("index"): p.get("state") for p in ((probe.get("breaker") or {}).get("pods") or [])
                if isinstance(p, Mapping)}
    return {p["index"]: {"ok": p.get("ok"), "status": p.get("status"), "breaker": breakers.get(p["index"])}
            for p in probe.get("pods") or [] if isinstance(p, Mapping) and isinstance(p.get("index"), int)}


def days_left(not_after: str, now: float) -> float:
    return (certexpiry.parse(not_after) - datetime.fromtimestamp(now, UTC)).total_seconds() / 86400


def due_role(certs: Mapping[str, str | None], now: float, renew_days: float = RENEW_DAYS) -> str | None:
    """The next certificate role to renew: the cell's own leaves first (renewing them replaces no
    pod), then pods in index order; None when none has ``renew_days`` or fewer left."""
    due = [r for r, end in certs.items() if end and days_left(end, now) <= renew_days]
    return min(due, key=lambda r: (r != CELL_ROLE, int(r[4:]) if r.startswith("pod-") else 0), default=None)


class Deployer(Protocol):
    """What the keeper needs of the owner of the pods (the cloud's ``PulumiDeployer``, the sandbox's)."""

    def pods(self) -> list[RunningPod]:
        """The pods the last completed update made, as it recorded them."""

    def describe(self, pod: RunningPod) -> PodInfo:
        """The pod as its provider's API reports it now."""

    def replace(self, indices: Sequence[int], replaced: Mapping[int, int]) -> None:
        """One update of these pods alone under their new counts (``colocate:pod.replaced``)."""

    def certificates(self) -> dict[str, str | None]:
        """Each certificate role (``cell``, ``pod-<i>``) and when it ends (RFC 3339)."""

    def renew(self, role: str) -> None:
        """One update re-issuing that role's certificate and replacing only what holds it."""


@dataclass
class Record:
    """The keeper's state as the generation keeps it (``keeper`` of ``GET /_colocate/scale``): a
    restarted keeper goes on counting failures where the last one stopped."""

    pods: list[dict] = field(default_factory=list)
    replacements: dict[tuple[int, str], int] = field(default_factory=dict)
    failures: dict[int, int] = field(default_factory=dict)  # pod -> failed replacements in a row
    retry_at: dict[int, float] = field(default_factory=dict)  # pod -> no new attempt before (controller clock)
    update_failures: int = 0
    locked_since: float | None = None
    stale: dict | None = None  # {running, checkout, message} while the checkout is refused
    events: list[dict] = field(default_factory=list)
    certs: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: object) -> Record:
        if not isinstance(doc, Mapping):
            return cls()
        try:
            return cls(
                replacements={(int(r["pod"]), str(r["reason"])): int(r["n"]) for r in doc.get("replacements") or []},
                failures={int(k): int(v) for k, v in (doc.get("failures") or {}).items()},
                retry_at={int(k): float(v) for k, v in (doc.get("retry_at") or {}).items()},
                update_failures=int(doc.get("update_failures") or 0),
                locked_since=doc.get("locked_since"),
                events=list(doc.get("events") or [])[-EVENTS_KEPT:],
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            return cls()  # a record of another release: counting starts afresh

    def event(self, now: float, pod: int | str, reason: str, outcome: str, detail: str) -> None:
        self.events = [*self.events, {"at": int(now * 1000), "pod": pod, "reason": reason, "outcome": outcome,
                                      "detail": detail[:200]}][-EVENTS_KEPT:]

    def alerts(self, now: float, lock_alert_s: float = LOCK_ALERT_S) -> list[dict]:
        out = []
        for pod, n in sorted(self.failures.items()):
            if n >= ALERT_AFTER:
                out.append({"name": "replace_failed", "pod": pod,
                            "message": f"pod {pod} could not be replaced: {n} attempts failed in a row (the last: "
                                       f"{self._last_failure(pod)}); the Worker routes around it, the fallback may carry "
                                       "its share. Check the provider's capacity and the keeper's log"})
        if self.update_failures >= ALERT_AFTER:
            out.append({"name": "update_failing", "message": f"{self.update_failures} updates failed in a row; "
                                                             "see the keeper's log (.venv/bin/python scripts/scale.py run)"})
        if self.locked_since is not None and now - self.locked_since >= lock_alert_s:
            out.append({"name": "stack_locked", "message": f"the stack has been locked for {(now - self.locked_since) / 60:.0f} "
                                                           "min: if no `pulumi up` runs, a CLI killed mid-update left "
                                                           "the lock; `pulumi cancel` removes it"})
        if self.stale is not None:
            out.append({"name": "stale_checkout", "message": self.stale["message"]})
        return out

    def _last_failure(self, pod: int) -> str:
        return next((e["detail"] for e in reversed(self.events) if e.get("pod") == pod and e.get("outcome") == "failed"),
                    "unknown")

    def as_json(self, now: float, lock_alert_s: float = LOCK_ALERT_S) -> dict:
        return {"pods": self.pods, "alerts": self.alerts(now, lock_alert_s),
                "replacements": [{"pod": p, "reason": r, "n": n} for (p, r), n in sorted(self.replacements.items())],
                "failures": {str(k): v for k, v in sorted(self.failures.items()) if v},
                "retry_at": {str(k): v for k, v in sorted(self.retry_at.items())},
                "update_failures": self.update_failures, "locked_since": self.locked_since, "events": self.events,
                "certs": self.certs, **({"worker": {k: self.stale[k] for k in ("running", "checkout")}} if self.stale else {})}


def stale_message(running: str | None, checkout: str) -> str:
    """Why a controller refuses to deploy, with what runs, what it has and the way out."""
    if running is None:
        return (f"the running Worker does not say which code it runs (no worker_hash: it predates the keeper), and this "
                f"checkout's Worker is {checkout}: deploying could roll it back. Fix: deploy the Worker you mean to run "
                "once with `pulumi up` from that checkout, then start the controller from the same checkout")
    return (f"the running Worker is {running} and this checkout's is {checkout}: a deploy from here would replace the "
            f"Worker's code, perhaps with older code. Fix: run the controller from the checkout that deployed {running} "
            "(`pulumi stack output workerContentHash` names it; `git pull` this one), or deploy this checkout's Worker "
            "first with a person's `pulumi up`")


@dataclass
class Keeper:
    """One pass of keeping (``keep``), given the controller's cell client, the deployer and the record
    function that posts to the generation under the lease."""

    deployer: Deployer
    checkout_hash: str | None  # None: the code is not compared (a test's deployer that uploads nothing)
    clock: Callable[[], float] = time.time
    say: Callable[[str], None] = print
    renew_days: float = RENEW_DAYS
    lock_alert_s: float = LOCK_ALERT_S
    backoff_s: float = 60.0
    backoff_max_s: float = 3600.0
    record: Record = field(default_factory=Record)
    loaded: bool = False
    streaks: dict[int, int] = field(default_factory=dict)  # pod -> unhealthy passes in a row
    counted: BaseException | None = None  # the last failure already counted against its pods

    def load(self, state: Mapping | None) -> None:
        """Carry on from the record the generation holds (once, at the first pass)."""
        if not self.loaded and state is not None:
            self.record = Record.from_json(state.get("keeper"))
            self.loaded = True

    def refusal(self, state: Mapping | None) -> str | None:
        """Why nothing may be deployed from this checkout now (None: it may)."""
        if self.checkout_hash is None or state is None:
            return None
        running = state.get("worker_hash")
        if running == self.checkout_hash:
            self.record.stale = None
            return None
        message = stale_message(running if isinstance(running, str) else None, self.checkout_hash)
        if self.record.stale is None:
            self.record.event(self.clock(), "worker", "stale_checkout", "refused", message)
        self.record.stale = {"running": running, "checkout": self.checkout_hash, "message": message}
        return message

    def check(self, probe: Mapping | None) -> list[Verdict]:
        """Every recorded pod's verdict; an ``unhealthy`` one counts only after UNHEALTHY_PASSES in a row."""
        health = health_view(probe)
        verdicts = []
        for pod in self.deployer.pods():
            v = judge(pod, self.deployer.describe, health.get(pod.index))
            self.streaks[pod.index] = self.streaks.get(pod.index, 0) + 1 if v.state == UNHEALTHY else 0
            verdicts.append(v)
        self.record.pods = [v.as_json() for v in verdicts]
        return verdicts

    def to_replace(self, verdicts: Sequence[Verdict]) -> list[Verdict]:
        now = self.clock()
        out = []
        for v in verdicts:
            if v.own:
                if v.state != OK:
                    self.say(f"keeper: pod {v.index} ({v.id}) is {v.state}: it is a server you run, never replaced by "
                             "the kit; the Worker routes around it meanwhile. Mend it on its host")
                continue
            if not (v.replace or (v.state == UNHEALTHY and self.streaks.get(v.index, 0) >= UNHEALTHY_PASSES)):
                continue
            if now < self.record.retry_at.get(v.index, 0.0):
                self.say(f"keeper: pod {v.index} is {v.state}; its replacement failed, next try in "
                         f"{self.record.retry_at[v.index] - now:.0f} s")
                continue
            out.append(v)
        return out

    def replaced_map(self, desired: Mapping | None) -> dict[int, int]:
        """colocate:pod.replaced as the generation holds it."""
        raw = (desired or {}).get("replaced") or {}
        return {int(k): int(v) for k, v in raw.items() if str(k).isdigit() and isinstance(v, int)}

    def replace(self, bad: Sequence[Verdict], replaced: dict[int, int],
                post: Callable[[dict[int, int]], bool]) -> None:
        """Replace these pods alone: their counts into the generation first (``post``), then one update.
        A pod whose last attempt failed keeps its count: the retry is the same replacement."""
        now = self.clock()
        counts = dict(replaced)
        for v in bad:
            if not self.record.failures.get(v.index):
                counts[v.index] = counts.get(v.index, 0) + 1
        which = ", ".join(f"pod {v.index} ({v.state}: {v.detail})" for v in bad)
        if not post(counts):
            raise KeeperError(f"the generation did not record colocate:pod.replaced {counts} (lock lost?): not replacing {which}")
        self.say(f"keeper: replacing {which}, alone")
        for v in bad:
            self.record.event(now, v.index, v.state, "replacing", v.detail)
        try:
            self.deployer.replace([v.index for v in bad], counts)
            after = {p.index: p.id for p in self.deployer.pods()}
            same = [v for v in bad if after.get(v.index) == v.id]
            if same:  # an update that replaced nothing (a stack file ahead of the generation's count, say)
                raise KeeperError(f"the update left {', '.join(f'pod {v.index} as {v.id}' for v in same)}: "
                                  "it was not replaced")
        except StackLocked:
            raise  # not the pods' failure: update_failed counts the lock's time
        except Exception as exc:
            self.counted = exc  # the pods' failures carry it (replace_failed), not update_failing
            for v in bad:
                n = self.record.failures.get(v.index, 0) + 1
                self.record.failures[v.index] = n
                self.record.retry_at[v.index] = self.clock() + min(self.backoff_max_s, self.backoff_s * 2 ** (n - 1))
                self.record.event(self.clock(), v.index, v.state, "failed", f"{type(exc).__name__}: {exc}")
            raise
        for v in bad:
            self.record.failures.pop(v.index, None)
            self.record.retry_at.pop(v.index, None)
            self.streaks[v.index] = 0
            key = (v.index, v.state)
            self.record.replacements[key] = self.record.replacements.get(key, 0) + 1
            self.record.event(self.clock(), v.index, v.state, "replaced", f"pod {v.index} replaced alone")
        self.say(f"keeper: replaced {', '.join(f'pod {v.index}' for v in bad)}")

    def renew_due(self, verdicts: Sequence[Verdict]) -> str | None:
        """Renew the next certificate due; the role renewed (None: none). A pod that does not serve now
        is not renewed (its replacement comes first, with a new certificate of its own)."""
        try:
            certs = self.deployer.certificates()
        except (OSError, ValueError) as exc:
            self.say(f"keeper: the certificates could not be read ({exc})")
            return None
        self.record.certs = dict(certs)
        # A server the keeper did not start holds its operator's certificate: any `pulumi up` re-issues it (infra/hop.py).
        serving = {f"pod-{v.index}" for v in verdicts if v.state == OK and not v.own}
        role = due_role({r: e for r, e in certs.items() if r == CELL_ROLE or r in serving}, self.clock(), self.renew_days)
        if role is None:
            return None
        end = certs[role] or ""
        self.say(f"keeper: renewing {role}'s certificate (ends {end}, {days_left(end, self.clock()):.1f} days left)")
        index: int | str = int(role[4:]) if role.startswith("pod-") else role
        self.record.event(self.clock(), index, CERTIFICATE, "renewing", f"ends {end}")
        try:
            self.deployer.renew(role)
        except Exception as exc:
            self.record.event(self.clock(), index, CERTIFICATE, "failed", f"{type(exc).__name__}: {exc}")
            raise
        if isinstance(index, int):
            key = (index, CERTIFICATE)
            self.record.replacements[key] = self.record.replacements.get(key, 0) + 1
        self.record.event(self.clock(), index, CERTIFICATE, "renewed", f"{role} renewed")
        return role

    # --- what the controller tells the keeper about every update ---

    def update_done(self) -> None:
        self.record.update_failures = 0
        self.record.locked_since = None

    def update_failed(self, exc: BaseException) -> None:
        if isinstance(exc, StackLocked):
            if self.record.locked_since is None:
                self.record.locked_since = self.clock()
            return
        self.record.locked_since = None
        if exc is not self.counted:
            self.record.update_failures += 1

    def alerts(self) -> list[dict]:
        return self.record.alerts(self.clock(), self.lock_alert_s)

    def as_json(self) -> dict:
        return self.record.as_json(self.clock(), self.lock_alert_s)


def summary(keeper: Mapping | None) -> str:
    """One line of the keeper's last pass for the live view and the probe ("" when none ran)."""
    if not isinstance(keeper, Mapping):
        return ""
    pods = keeper.get("pods") or []
    bad = [f"pod {p.get('index')} {p.get('state')}" for p in pods if isinstance(p, Mapping) and p.get("state") != OK]
    alerts = [str(a.get("name")) for a in keeper.get("alerts") or [] if isinstance(a, Mapping)]
    last = next(iter(reversed(keeper.get("events") or [])), None)
    at = keeper.get("at")
    when = datetime.fromtimestamp(at / 1000, UTC).strftime("%H:%M:%S") if isinstance(at, int) else "?"
    line = f"keeper: {len(pods)} pod(s) checked at {when}, " + (", ".join(bad) if bad else "all serve")
    if last:
        line += f"; last: pod {last.get('pod')} {last.get('reason')} {last.get('outcome')}"
    if alerts:
        line += f"; ALERT: {', '.join(alerts)}"
    return line + "\n"


def replaced_text(counts: Mapping[int, int]) -> str:
    """colocate:pod.replaced as a stack file holds it (JSON object, index keys as text)."""
    return json.dumps({str(k): v for k, v in sorted(counts.items()) if v})
