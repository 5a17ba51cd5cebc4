"""The scaling controller: reads the cell's signals, asks ``colocate.scale.decide`` and makes
the stack declare the count it decided, with Pulumi (or the sandbox's apply) the owner of
every pod.

One pass (``Controller.step``): read ``GET /_colocate/scale`` (cumulative requests and tokens
by backend, in flight per pod), decide, record the decision in the generation, and, when the
count changes, act through a ``Deployer``:

* up: ``colocate:scale.pods`` = n, then the owner's update (``pulumi up``): each new pod is
  created and healthy before the Worker's POD_URLS gains it, so no request waits for a boot;
  until then the pods that run, the next cell or the fallback serve.
* down: first ``draining`` = the pods leaving (declared, out of POD_URLS), update, wait until
  the generation reads 0 requests in flight on them (bounded by ``drain_timeout_s``), then
  ``pods`` = n, ``draining`` = 0, update: the pods are deleted only after their requests end.

Only the lock's holder acts or records: a lease in the generation (``/_colocate/scale/lock``),
renewed while the controller lives and during every update. A controller that dies leaves the
stack as its last completed update declared, and the lease expires; the next one finishes a
drain it finds half done. Only the deployer differs between the sandbox and the cloud.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .scale import Decision, Policy, Sample, decide

HISTORY_S = 3 * 3600  # samples kept: more than any window a policy uses
DRAIN_TIMEOUT_S = 300.0
DRAIN_SETTLE_S = 2.5  # a draining pod reads 0 twice this far apart (isolates sync within ~1 s of a change)


class Deployer(Protocol):
    """Makes the stack declare a count and runs its owner's update."""

    def declared(self) -> tuple[int, int]:
        """(pods in rotation, pods draining) as the stack declares them now."""

    def deploy(self, pods: int, draining: int) -> None:
        """Write colocate:scale.pods and .draining and run the update (blocks until done)."""


class CellClient:
    """The Worker's scaling endpoints, with the admin token (never in argv or logs): reading the
    signals takes the read token, the lock and the records the admin one."""

    def __init__(self, url: str, token: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"authorization": f"Bearer {self._token}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            text = err.read()
            try:
                return err.code, json.loads(text)
            except ValueError:
                return err.code, {"error": text[:200].decode(errors="replace")}

    def state(self) -> dict:
        status, body = self._call("/_colocate/scale")
        if status != 200:
            raise OSError(f"GET /_colocate/scale answered {status}: {body}")
        return body

    def lock(self, owner: str, ttl_s: float, release: bool = False) -> tuple[bool, dict | None]:
        status, body = self._call("/_colocate/scale/lock", {"owner": owner, "ttl_ms": max(1, int(ttl_s * 1000)),
                                                             "release": release})
        if status not in (200, 409):
            raise OSError(f"POST /_colocate/scale/lock answered {status}: {body}")
        return status == 200, body.get("lock")

    def record(self, owner: str, decision: dict) -> bool:
        status, _ = self._call("/_colocate/scale", {"owner": owner, "decision": decision})
        return status == 200


def sample_of(state: dict, at: float) -> Sample:
    """A decision sample from the generation's answer, stamped with the controller's clock."""
    backends = state.get("backends") or {}
    return Sample(
        at=at,
        requests={b: int(v.get("requests", 0)) for b, v in backends.items()},
        tokens={b: (int(v.get("prompt_tokens", 0)), int(v.get("completion_tokens", 0))) for b, v in backends.items()},
        inflight={str(k): int(v) for k, v in (state.get("inflight") or {}).items()},
    )


def draining_inflight(state: dict, first: int) -> int:
    """Requests in flight on pods ``first`` and up (the ones leaving)."""
    return sum(int(n) for k, n in (state.get("inflight") or {}).items() if int(k) >= first)


@dataclass
class Controller:
    client: CellClient
    deployer: Deployer
    policy: Policy
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{id(object())}")
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    lock_ttl_s: float = 60.0
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    settle_s: float = DRAIN_SETTLE_S
    say: Callable[[str], None] = print
    samples: list[Sample] = field(default_factory=list)
    last: dict | None = None  # the last decision recorded
    unsettled: bool = False  # an update failed: the stack's config may be ahead of what exists

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

    def record(self, decision: Decision, running: int, draining: int, acting: str | None = None) -> None:
        entry = {**decision.as_json(), "running": running, "draining": draining, "policy": self.policy.policy,
                 "min": self.policy.min, "max": self.policy.max}
        if acting:
            entry["acting"] = acting
        if self.client.record(self.owner, entry):
            self.last = entry

    def step(self) -> Decision | None:
        """Observe, decide, record, act. None when another controller holds the lock."""
        if not self.hold():
            return None
        state = self.observe()
        pods, draining = self.deployer.declared()
        if self.unsettled:  # the last update failed: run it again before deciding anything new
            with self._renewing():
                self.deployer.deploy(pods, draining)
            self.unsettled = False
        if draining:  # a scale-down that a previous controller did not finish
            self.finish_drain(pods, draining, state)
        decision = decide(self.samples, self.policy, pods, self.clock())
        if decision.desired == pods:
            self.record(decision, pods, 0)
            return decision
        if decision.desired > pods:
            self.record(decision, pods, 0, acting=f"up {pods} -> {decision.desired}")
            self.say(f"scale: {decision.reason}")
            with self._renewing():
                self.deployer.deploy(decision.desired, 0)
        else:
            self.record(decision, pods, 0, acting=f"drain {pods} -> {decision.desired}")
            self.say(f"scale: {decision.reason}")
            with self._renewing():
                self.deployer.deploy(decision.desired, pods - decision.desired)
            self.finish_drain(decision.desired, pods - decision.desired, None)
        self.record(decision, decision.desired, 0)
        self.hold()
        return decision

    def finish_drain(self, pods: int, draining: int, state: dict | None) -> None:
        """Wait until the draining pods have no request in flight (or the timeout), then delete them."""
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
        with self._renewing():
            self.deployer.deploy(pods, 0)
        self.say(f"scale: {draining} pod(s) drained and deleted; {pods} serve")

    def run(self, interval_s: float, steps: int | None = None, stop: threading.Event | None = None) -> None:
        """Pass every ``interval_s`` (``steps`` times, or until ``stop``); the lease is released at the end."""
        stop = stop or threading.Event()
        n = 0
        try:
            while steps is None or n < steps:
                try:
                    self.step()
                except Exception as err:  # noqa: BLE001 - an update failed; the cell serves as it was, the next pass retries
                    self.unsettled = True
                    self.say(f"scale: the update failed ({type(err).__name__}: {err}); retrying on the next pass")
                n += 1
                if stop.wait(interval_s):
                    break
        finally:
            self.release()


# --- deployers ---

def scale_values(raw_scale: dict | None) -> tuple[int, int]:
    """(pods, draining) from a stack's colocate:scale value (pods defaults to min)."""
    s = raw_scale or {}
    pods = s.get("pods")
    return int(s.get("min", 1) if pods is None else pods), int(s.get("draining", 0) or 0)


class PulumiDeployer:
    """The cloud: ``pulumi.automation`` sets the two keys in the stack's config and runs ``pulumi up``."""

    def __init__(self, stack: str, work_dir: Path, say: Callable[[str], None] = print):
        from pulumi import automation as auto  # the CLI must be installed; imported only here

        self.auto = auto
        self.stack = auto.select_stack(stack_name=stack, work_dir=str(work_dir))
        self.say = say

    def declared(self) -> tuple[int, int]:
        value = self.stack.get_all_config().get("colocate:scale")
        return scale_values(json.loads(value.value) if value else None)

    def deploy(self, pods: int, draining: int) -> None:
        self.stack.set_config("colocate:scale.pods", self.auto.ConfigValue(str(pods)), path=True)
        self.stack.set_config("colocate:scale.draining", self.auto.ConfigValue(str(draining)), path=True)
        result = self.stack.up(on_output=lambda line: self.say(line.rstrip()))
        self.say(f"scale: pulumi up {result.summary.result}: {json.dumps(result.summary.resource_changes or {})}")


def lease_ttl(interval_s: float) -> float:
    """A lease that survives a missed pass or two, and expires soon after a controller dies."""
    return max(10.0, math.ceil(3 * interval_s))


def policy_of(scale, fallback_price: tuple[float, float] | None, pod_price_per_hr: float) -> Policy:
    """The decision's policy from ``colocate:scale`` (``settings.ScaleSettings``) and the prices."""
    return Policy(min=scale.min, max=scale.max, target_rpm=scale.target, up_after_s=scale.up_after_s,
                  down_after_s=scale.down_after_s, policy=scale.policy, pod_price_per_hr=pod_price_per_hr,
                  api_price=fallback_price or (0.0, 0.0))
