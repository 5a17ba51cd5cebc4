"""The scaling controller: reads the cell's signals, asks ``colocate.scaling.policy.decide`` and makes
the stack declare the count it decided, with Pulumi (or the sandbox's apply) the owner of
every pod.

One pass (``Controller.step``): read ``GET /_colocate/scale`` (cumulative requests and tokens
by backend, in flight per pod), decide, record the decision in the generation, and, when the
count changes, act through a ``Deployer``:

* up: the desired count (``pods`` = n) into the generation, then the owner's update (``pulumi
  up``): each new pod is created and healthy before the Worker's POD_URLS gains it, so no
  request waits for a boot; until then the pods that run, the next cell or the fallback serve.
* down: first ``draining`` = the pods leaving (declared, out of POD_URLS), update, wait until
  the generation reads 0 requests in flight on them (bounded by ``drain_timeout_s``), then
  ``pods`` = n, ``draining`` = 0, update: the pods are deleted only after their requests end.

The desired count lives in the generation (``desired`` of ``/_colocate/scale``), not only in a
stack file: the Pulumi program reads it at every ``up``, from any checkout (infra/program.py),
so a person's ``pulumi up`` applies the controller's count and never undoes a drain. The
stack file's ``scale.pods`` is written too, as the seed of a first deploy.

What the controller decides from is what exists (``Deployer.declared``: the pods of the last
completed update, and the ones the live Worker routes to), never the config it wrote: a failed
update leaves config ahead of the pods. A failed update backs off (``BACKOFF_S`` doubling up to
``BACKOFF_MAX_S`` of the controller's clock) instead of running again every pass. A scaling
step's update softens the post-deploy probe (``SCALE_STEP_ENV``: it reports and cannot fail the
step, and waits for no placement to settle): the step runs under the very load that called for it.

Only the lock's holder acts or records: a lease in the generation (``/_colocate/scale/lock``),
renewed through the whole pass: every update and the drain's wait. A controller that dies leaves
the stack as its last completed update declared, and the lease expires; the next one finishes a
drain it finds half done. Only the deployer differs between the sandbox and the cloud.

With a ``keeper`` (colocate/scaling/keeper.py) every pass first keeps the cell: it refuses to deploy from a
checkout whose Worker is not the running one, replaces a dead, remapped or misplaced pod alone and
renews certificates one pod at a time; a pass that did either deploys nothing else. A cell without
``colocate:scale`` (``policy`` None) is kept and never scaled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..cell import catalogue, outputs, urns
from ..cell.market import PREEMPTIONS_PER_HOUR
from ..pods.base import PodInfo
from .keeper import Keeper, RunningPod, StackLocked
from .policy import Decision, Policy, Sample, decide
from .signals import SCALE_STEP_ENV, CellClient, desired_of, draining_inflight, sample_of

HISTORY_S = 3 * 3600  # samples kept: more than any window a policy uses
DRAIN_TIMEOUT_S = 300.0
DRAIN_SETTLE_S = 2.5  # a draining pod reads 0 twice this far apart (isolates sync within ~1 s of a change)
BACKOFF_S = 60.0  # after a failed update: the first retry waits this long (controller clock), then doubles
BACKOFF_MAX_S = 3600.0  # ... up to this: a provider out of GPUs for hours is asked hourly, not every pass


class Deployer(Protocol):
    """Makes the stack declare a count and runs its owner's update."""

    def declared(self) -> tuple[int, int]:
        """(pods in rotation, pods draining) as they exist now: the pods of the last completed
        update and the live Worker's rotation, not the config last written."""

    def deploy(self, pods: int, draining: int) -> None:
        """Write colocate:scale.pods and .draining and run the update (blocks until done)."""


def backoff_s(failures: int, base: float = BACKOFF_S, cap: float = BACKOFF_MAX_S) -> float:
    """The wait before the next update after ``failures`` failed ones in a row: base, 2 x base, ... cap."""
    return 0.0 if failures <= 0 else min(cap, base * 2 ** (failures - 1))


@dataclass
class Controller:
    client: CellClient
    deployer: Deployer
    policy: Policy | None  # None: a cell of a fixed count, kept and never scaled
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{id(object())}")
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    lock_ttl_s: float = 60.0
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    settle_s: float = DRAIN_SETTLE_S
    say: Callable[[str], None] = print
    samples: list[Sample] = field(default_factory=list)
    last: dict | None = None  # the last decision recorded
    backoff_s: float = BACKOFF_S
    backoff_max_s: float = BACKOFF_MAX_S
    failures: int = 0  # failed updates in a row
    retry_at: float | None = None  # controller clock: no update before this (after a failure)
    keeper: Keeper | None = None

    # --- the lock ---

    def hold(self) -> bool:
        """Take or renew the lease; False when another controller holds it."""
        granted, lock = self.client.lock(self.owner, self.lock_ttl_s)
        if not granted:
            until = (lock or {}).get("until")
            left = f"{max(0.0, until / 1000 - time.time()):.0f} s" if until else "a while"
            self.say(f"scale: another controller ({(lock or {}).get('owner')}) holds the lock for {left}: not acting")
        return granted

    def release(self) -> None:
        with contextlib.suppress(OSError):  # the lease expires on its own
            self.client.lock(self.owner, 0, release=True)

    def _renewing(self):
        """A context that renews the lease every third of its TTL while an update runs."""
        ctl = self
        stop = threading.Event()

        class Renew:
            def __enter__(self):
                def loop():
                    while not stop.wait(ctl.lock_ttl_s / 3):
                        # a failed renewal: the next one tries again; Pulumi's own stack lock still guards the update
                        with contextlib.suppress(OSError):
                            ctl.client.lock(ctl.owner, ctl.lock_ttl_s)
                self.thread = threading.Thread(target=loop, daemon=True)
                self.thread.start()

            def __exit__(self, *exc):
                stop.set()
                self.thread.join(timeout=5)

        return Renew()

    # --- one pass ---

    def observe(self) -> dict | None:
        """Read the signals; None when the cell cannot be read (the decision then holds)."""
        try:
            state = self.client.state()
        except (OSError, ValueError) as err:
            self.say(f"scale: no signal ({err})")
            return None
        now = self.clock()
        self.samples.append(sample_of(state, now))
        self.samples = [s for s in self.samples if now - s.at <= HISTORY_S]
        return state

    def record(self, decision: Decision, running: int, draining: int, acting: str | None = None,
               desired: tuple[int, int] | None = None, replaced: dict[int, int] | None = None) -> bool:
        entry = {**decision.as_json(), "running": running, "draining": draining}
        if self.policy is not None:
            entry.update(policy=self.policy.policy, min=self.policy.min, max=self.policy.max)
        if acting:
            entry["acting"] = acting
        extra = {k: v for k, v in (("replaced", replaced),
                                   ("keeper", self.keeper.as_json() if self.keeper is not None else None)) if v is not None}
        if self.client.record(self.owner, entry, desired, **extra):
            self.last = entry
            return True
        return False

    def apply(self, decision: Decision, running: int, pods: int, draining: int, acting: str) -> None:
        """The desired count into the generation (where every `pulumi up` reads it), then the
        update. A count the generation did not take (the lease lost meanwhile) is not applied."""
        if not self.record(decision, running, draining, acting=acting, desired=(pods, draining)):
            raise OSError(f"the generation did not record the desired count {pods}+{draining} (lock lost?): not applied")
        self.deployer.deploy(pods, draining)

    def step(self) -> Decision | None:
        """Observe, decide, record, act. None when another controller holds the lock. The lease
        is renewed through the whole pass: the updates and the drain's wait."""
        if not self.hold():
            return None
        with self._renewing():
            return self._step()

    def _step(self) -> Decision:
        state = self.observe()
        pods, draining = self.deployer.declared()
        if self.keeper is not None:
            if state is None:  # which code runs cannot be known, nor whether a pod is what failed
                decision = Decision(pods, "the cell cannot be read: nothing is deployed this pass", None)
                self.record(decision, pods, draining)
                return decision
            self.keeper.load(state)
            refused = self.keeper.refusal(state)
            if refused is not None:  # nothing is deployed from a checkout whose Worker is not the running one
                self.say(f"keeper: refusing to deploy: {refused}")
                decision = Decision(pods, f"refusing to deploy: {refused}"[:500], None)
                self.record(decision, pods, draining)
                return decision
        now = self.clock()
        if self.retry_at is not None and now < self.retry_at:
            decision = Decision(pods, f"the last update failed: backing off, next try in {self.retry_at - now:.0f} s",
                                None)
            self.record(decision, pods, draining)
            return decision
        if self.keeper is not None:
            kept = self.keep(state, pods, draining)
            if kept is not None:  # one update a pass: scaling waits for the next one
                self.record(kept, pods, draining)
                return kept
        if self.policy is None:
            decision = Decision(pods, f"a fixed count of {pods} pod(s): kept, not scaled", None)
            self.record(decision, pods, draining)
            return decision
        want = desired_of(state) if state is not None else None
        top = self.policy.declared(self.policy.max)
        if (want is not None and want != (pods, draining) and self.policy.min <= want[0] <= top
                and sum(want) <= top):
            # A change recorded but not made, or not all of it: an update that failed or was cut,
            # or a controller killed mid-change. The generation's count is what every `pulumi up`
            # applies, so it is made first, before anything new is decided; a pod beyond it that
            # serves now leaves by a drain, never by a delete.
            target = (want[0], max(0, pods + draining - want[0]))
            self.say(f"scale: the recorded count {want[0]}+{want[1]} is not what exists ({pods}+{draining}): "
                     f"making it ({target[0]}+{target[1]})")
            if target != (pods, draining):
                self.deployer.deploy(*target)
            pods, draining = target
        if draining:  # a scale-down that a previous controller (or a failed pass) did not finish
            self.finish_drain(pods, draining, state)
            draining = 0
        decision = decide(self.samples, self.policy, pods, self.clock())
        if decision.desired == pods:
            self.record(decision, pods, 0, desired=(pods, 0))
            return decision
        self.say(f"scale: {decision.reason}")
        if decision.desired > pods:
            self.apply(decision, pods, decision.desired, 0, f"up {pods} -> {decision.desired}")
        else:
            self.apply(decision, pods, decision.desired, pods - decision.desired, f"drain {pods} -> {decision.desired}")
            self.finish_drain(decision.desired, pods - decision.desired, None)
        self.record(decision, decision.desired, 0)
        return decision

    def keep(self, state: dict | None, pods: int, draining: int) -> Decision | None:
        """The keeper's part of the pass (colocate/scaling/keeper.py): replace the pods in rotation that died,
        moved or left the region, alone; else renew the next certificate due. The decision recorded
        when it deployed, None when it did not."""
        assert self.keeper is not None
        verdicts = [v for v in self.keeper.check(self.client.probe()) if v.index < pods]
        bad = self.keeper.to_replace(verdicts)
        if bad:
            want = desired_of(state or {}) or (pods, draining)
            which = ", ".join(f"pod {v.index} {v.state}" for v in bad)
            entry = Decision(pods, f"replacing {which} alone", None)

            def post(counts: dict[int, int]) -> bool:
                return self.record(entry, pods, draining, acting=f"replace {which}", desired=want, replaced=counts)

            self.keeper.replace(bad, self.keeper.replaced_map((state or {}).get("desired")), post)
            self.keeper.update_done()
            return Decision(pods, f"replaced {which} alone", None)
        role = self.keeper.renew_due(verdicts)
        if role is not None:
            self.keeper.update_done()
            return Decision(pods, f"renewed {role}'s certificate", None)
        return None

    def finish_drain(self, pods: int, draining: int, state: dict | None) -> None:
        """Wait until the draining pods have no request in flight (or the timeout), then delete
        them. Runs inside ``step``'s renewal: a drain's wait (up to 300 s) outlasts a lease."""
        deadline = time.monotonic() + self.drain_timeout_s
        quiet_since = None
        while True:
            try:
                state = self.client.state()
            except (OSError, ValueError):
                state = None
            busy = None if state is None else draining_inflight(state, pods)
            if busy == 0:
                quiet_since = quiet_since if quiet_since is not None else time.monotonic()
                if time.monotonic() - quiet_since >= self.settle_s:
                    break
            else:
                quiet_since = None
            if time.monotonic() > deadline:
                self.say(f"scale: {busy if busy is not None else 'unknown'} requests still in flight on the draining pods "
                         f"after {self.drain_timeout_s:g} s: deleting them anyway")
                break
            self.sleep(0.5)
        self.apply(Decision(pods, f"{draining} pod(s) drained: deleting them", None), pods, pods, 0,
                   f"delete {draining} drained")
        self.say(f"scale: {draining} pod(s) drained and deleted; {pods} serve")

    def run(self, interval_s: float, steps: int | None = None, stop: threading.Event | None = None,
            stop_on_alert: bool = False) -> list[dict]:
        """Pass every ``interval_s`` (``steps`` times, or until ``stop``, or with ``stop_on_alert`` until
        the keeper raises an alert); the lease is released at the end. The keeper's alerts standing
        after the last pass are returned (scripts/scale.py exits 3 on any)."""
        stop = stop or threading.Event()
        n = 0
        alerts: list[dict] = []
        try:
            while steps is None or n < steps:
                try:
                    self.step()
                except Exception as err:  # noqa: BLE001 - an update failed; the cell serves as it was, a later pass retries
                    self.failed(err)
                else:
                    if self.retry_at is not None and self.clock() >= self.retry_at:
                        self.failures, self.retry_at = 0, None  # a pass that acted after the wait went through
                n += 1
                alerts = self.keeper.alerts() if self.keeper is not None else []
                for alert in alerts:
                    self.say(f"keeper: ALERT {alert['name']}: {alert['message']}")
                if (alerts and stop_on_alert) or stop.wait(interval_s):
                    break
        finally:
            self.release()
        return alerts

    def failed(self, err: Exception) -> None:
        """After a failed pass: back off (a locked stack is asked again after the first wait, not
        later and later), and record the failure where the operator's tools read it."""
        locked = isinstance(err, StackLocked)
        self.failures += 1
        wait = self.backoff_s if locked else backoff_s(self.failures, self.backoff_s, self.backoff_max_s)
        self.retry_at = self.clock() + wait
        self.say(f"scale: the update failed ({type(err).__name__}: {err}); failure {self.failures} in a row: "
                 f"the next update in {wait:g} s at the earliest")
        if self.keeper is not None:
            self.keeper.update_failed(err)
            with contextlib.suppress(OSError):  # the record is the alert's carrier: try, the next pass records again
                pods, draining = self.deployer.declared()
                self.record(Decision(pods, f"the update failed: {type(err).__name__}: {err}"[:500], None), pods, draining)


# --- deployers ---

def scale_values(raw_scale: dict | None) -> tuple[int, int]:
    """(pods, draining) from a stack's colocate:scale value (pods defaults to min)."""
    s = raw_scale or {}
    pods = s.get("pods")
    return int(s.get("min", 1) if pods is None else pods), int(s.get("draining", 0) or 0)


def existing(total: int, routed: int | None) -> tuple[int, int]:
    """(in rotation, draining) from the pods that exist and the live Worker's rotation (None:
    unknown, all of them)."""
    routed = total if routed is None else max(0, min(int(routed), total))
    return routed, total - routed


def routed_of(client: CellClient | None) -> int | None:
    """How many pods the live Worker routes to (``routed_pods``); None when it cannot be read."""
    if client is None:
        return None
    try:
        value = client.state().get("routed_pods")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


class PulumiDeployer:
    """The cloud: ``pulumi.automation`` sets the two keys in the stack's config (the first
    deploy's seed; the program reads the generation's count) and runs ``pulumi up`` as a scaling
    step (``SCALE_STEP_ENV``)."""

    def __init__(self, stack: str, work_dir: Path, say: Callable[[str], None] = print, client: CellClient | None = None):
        from pulumi import automation as auto  # the CLI must be installed; imported only here

        self.auto = auto
        self.stack = auto.select_stack(stack_name=stack, work_dir=str(work_dir))
        self.say = say
        self.client = client

    def declared(self) -> tuple[int, int]:
        """The pods the last completed update made (its ``podIds``), and the live Worker's rotation."""
        ids = self.stack.outputs().get("podIds")
        if ids is None:  # never deployed: what the config seeds
            value = self.stack.get_all_config().get("colocate:scale")
            return scale_values(json.loads(value.value) if value else None)
        return existing(len(ids.value or []), routed_of(self.client))

    def deploy(self, pods: int, draining: int) -> None:
        self.stack.set_config("colocate:scale.pods", self.auto.ConfigValue(str(pods)), path=True)
        self.stack.set_config("colocate:scale.draining", self.auto.ConfigValue(str(draining)), path=True)
        self._up()

    def _up(self, **targeted) -> None:
        """``pulumi up`` as a scaling step (``targeted``: target, replace, target_dependents). A stack
        another update holds, or a killed CLI left locked, raises ``StackLocked``."""
        before = os.environ.get(SCALE_STEP_ENV)
        os.environ[SCALE_STEP_ENV] = "1"  # the CLI and the program it runs inherit it
        try:
            result = self.stack.up(on_output=lambda line: self.say(line.rstrip()), **targeted)
        except self.auto.ConcurrentUpdateError as exc:
            raise StackLocked(f"the stack {self.stack.name} is locked: another `pulumi up` runs, or one was killed and "
                              f"left its lock (`pulumi cancel`); {str(exc).strip()[-300:]}") from None
        finally:
            if before is None:
                os.environ.pop(SCALE_STEP_ENV, None)
            else:
                os.environ[SCALE_STEP_ENV] = before
        self.say(f"scale: pulumi up {result.summary.result}: {json.dumps(result.summary.resource_changes or {})}")

    # --- the keeper's (colocate/scaling/keeper.py) ---

    def _config(self) -> dict:
        return {k.removeprefix("colocate:"): v.value for k, v in self.stack.get_all_config().items()
                if k.startswith("colocate:") and not v.secret}

    def _project(self) -> str:
        return self.stack.workspace.project_settings().name

    def pods(self) -> list[RunningPod]:
        """The pods of the last completed update (``podIds``, ``podAddresses``, ``podLocations``)."""
        outs = {k: v.value for k, v in self.stack.outputs().items()}
        ids, addresses = outs.get(outputs.POD_IDS) or [], outs.get(outputs.POD_ADDRESSES) or []
        locations, path = outs.get(outputs.POD_LOCATIONS) or [], outs.get(outputs.POD_PATH)
        cfg = self._config()
        pod = json.loads(cfg["pod"]) if isinstance(cfg.get("pod"), str) else {}
        provider = pod.get("provider", "runpod")
        region = catalogue.region(cfg.get("region"), key="colocate:region")
        allowed = tuple(region.locations(provider))
        out = []
        for i, pod_id in enumerate(ids):
            addr = addresses[i] if i < len(addresses) and isinstance(addresses[i], dict) else {}
            out.append(RunningPod(i, str(pod_id), provider, addr.get("ip"), addr.get("port"),
                                  locations[i] if i < len(locations) else None, allowed,
                                  proxied=path == "provider-proxy", own=provider == catalogue.EXISTING))
        return out

    def describe(self, pod: RunningPod) -> PodInfo:
        from ..cell.settings import PROVIDER_SECRET
        from ..pods.lifecycle import provider_for

        key_name, env_name = PROVIDER_SECRET.get(pod.provider, ("", ""))
        if env_name and not os.environ.get(env_name):  # the stack's secret, as its pods' commands get it
            value = self.stack.get_all_config().get(f"colocate:{key_name}")
            if value is not None and value.value:
                os.environ[env_name] = value.value
        provider = provider_for(pod.provider)
        try:
            if hasattr(provider, "serve_port"):  # Vast.ai maps the pod's own port: which one it serves on
                provider.serve_port = json.loads(self._config().get("pod") or "{}").get("port", 8000)
            return provider.describe(pod.id)
        finally:
            provider.close()

    def replace(self, indices, replaced) -> None:
        """Pod i's count into the stack file (the seed; the generation's wins), then one update of
        those pods' rents and what depends on them: their waits, DNS records, the Worker, never another pod."""
        for i in indices:
            self.stack.set_config(f'colocate:pod.replaced["{i}"]', self.auto.ConfigValue(str(replaced[i])), path=True)
        project = self._project()
        self._up(target=[urns.pod_rent(project, self.stack.name, i) for i in indices], target_dependents=True)

    def certificates(self) -> dict[str, str | None]:
        value = self.stack.outputs().get(outputs.HOP_CERTS)
        return dict(value.value or {}) if value else {}

    def renew(self, role: str) -> None:
        """Re-issue the role's certificates (``--replace``) and update what holds them: pod i, whose
        certificate is in its name, is replaced alone; the cell's leaves replace no pod."""
        outs = self.stack.outputs()
        public = (outs[outputs.POD_PATH].value if outputs.POD_PATH in outs else None) in ("zone-dns", "endpoint")
        pod = json.loads(self._config().get("pod") or "{}")
        certs = urns.hop_certificates(self._project(), self.stack.name, role, int(pod.get("renewal") or 0), public)
        self._up(target=certs, replace=certs, target_dependents=True)


def lease_ttl(interval_s: float) -> float:
    """A lease that survives a missed pass or two, and expires soon after a controller dies."""
    return max(10.0, math.ceil(3 * interval_s))


def policy_of(scale, fallback_price: tuple[float, float] | None, pod_price_per_hr: float, spare: int = 0) -> Policy:
    """The decision's policy from ``colocate:scale`` (``settings.ScaleSettings``), the prices and the
    spare interruptible pods (``settings.PodSettings.spare_pods``), hedged at the published
    preemption rate (colocate/cell/market.py ``PREEMPTIONS_PER_HOUR``)."""
    return Policy(min=scale.min, max=scale.max, target_rpm=scale.target, up_after_s=scale.up_after_s,
                  down_after_s=scale.down_after_s, policy=scale.policy, pod_price_per_hr=pod_price_per_hr,
                  api_price=fallback_price or (0.0, 0.0), spare=spare,
                  preemptions_per_hr=PREEMPTIONS_PER_HOUR if spare else 0.0)
