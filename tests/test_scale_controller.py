"""The controller's pass logic against an in-memory cell and deployer (the decision and the
real sandbox are tested elsewhere): the desired count goes into the generation before any
update, decisions start from what exists (not the config last written), a failed update backs
off, the lease is renewed through a drain's wait, and a controller that is not the lock's holder
neither acts nor records."""

from __future__ import annotations

import threading
import time

import pytest

from colocate.scaling.controller import BACKOFF_MAX_S, BACKOFF_S, Controller, backoff_s, desired_of
from colocate.scaling.policy import Policy


class Cell:
    """The generation's side of /_colocate/scale: cumulative counters, one lease, records, the desired count."""

    def __init__(self):
        self.requests = 0
        self.holder = None
        self.records = []
        self.desired = None
        self.inflight = {}
        self.renewals = 0

    def state(self):
        return {"backends": {"fallback": {"requests": self.requests, "prompt_tokens": 0, "completion_tokens": 0}},
                "inflight": dict(self.inflight), "desired": self.desired}

    def lock(self, owner, ttl_s, release=False):
        if self.holder not in (None, owner):
            return False, {"owner": self.holder}
        if self.holder == owner and not release:
            self.renewals += 1
        self.holder = None if release else owner
        return True, {"owner": owner}

    def record(self, owner, decision, desired=None):
        if self.holder != owner:
            return False
        self.records.append(decision)
        if desired is not None:
            self.desired = {"pods": desired[0], "draining": desired[1], "owner": owner}
        return True


class Stack:
    """What exists (``pods``) apart from what was last asked (``config``): a failed update changes the config only."""

    def __init__(self, fail=0, cell=None):
        self.config = (0, 0)
        self.exists = (0, 0)
        self.applied = []
        self.fail = fail
        self.cell = cell
        self.seen_desired = []

    def declared(self):
        return self.exists

    def deploy(self, pods, draining):
        self.config = (pods, draining)
        if self.cell is not None:  # what a `pulumi up` reads: the generation's count, written first
            self.seen_desired.append(desired_of(self.cell.state()))
        if self.fail:
            self.fail -= 1
            raise OSError("the provider had no GPU")
        self.exists = (pods, draining)
        self.applied.append((pods, draining))


POLICY = Policy(min=0, max=2, target_rpm=60, up_after_s=0, down_after_s=600)


def make(cell, stack, owner="c1", step_s=10):
    t = {"now": 0}
    cell.requests = 0

    def now():
        return t["now"]

    def tick():  # the cell's traffic between passes: 120 req/min, two pods
        t["now"] += step_s
        cell.requests += 2 * step_s

    ctl = Controller(cell, stack, POLICY, owner=owner, clock=now, sleep=lambda s: None, say=lambda line: None)
    return ctl, tick


def passes(ctl, tick, n):
    for _ in range(n):
        tick()
        try:
            ctl.step()
        except OSError as err:  # what run() does with a failed pass
            ctl.failures += 1
            ctl.retry_at = ctl.clock() + backoff_s(ctl.failures, ctl.backoff_s, ctl.backoff_max_s)
            ctl.say(str(err))
        else:
            if ctl.retry_at is not None and ctl.clock() >= ctl.retry_at:
                ctl.failures, ctl.retry_at = 0, None


def test_the_desired_count_is_in_the_generation_before_the_update_runs():
    cell = Cell()
    stack = Stack(cell=cell)
    ctl, tick = make(cell, stack)
    passes(ctl, tick, 3)
    assert stack.applied == [(2, 0)]
    assert stack.seen_desired == [(2, 0)]  # a `pulumi up` during the update already reads the new count
    assert desired_of(cell.state()) == (2, 0)


def test_a_failed_update_backs_off_exponentially_and_decides_from_what_exists():
    cell = Cell()
    stack = Stack(fail=3, cell=cell)
    ctl, tick = make(cell, stack, step_s=10)
    attempts = []
    real = stack.deploy

    def counted(pods, draining):
        attempts.append(ctl.clock())
        real(pods, draining)
    stack.deploy = counted
    passes(ctl, tick, 60)  # 600 s of passes every 10 s
    # failures at t=20 (first decision), then waits of 60, 120, 240 s: attempts at 20, 80, 200, 440
    assert attempts[:4] == [20, 80, 200, 440]
    assert stack.applied == [(2, 0)] and stack.exists == (2, 0) and ctl.failures == 0 and ctl.retry_at is None
    # while the config said (2, 0) and nothing existed, the controller held at what existed
    holds = [r for r in cell.records if "backing off" in r["reason"]]
    assert holds and all(r["running"] == 0 for r in holds)


def test_the_backoff_is_bounded():
    assert [backoff_s(n) for n in range(4)] == [0, BACKOFF_S, 2 * BACKOFF_S, 4 * BACKOFF_S]
    assert backoff_s(30) == BACKOFF_MAX_S


def test_a_controller_without_the_lock_neither_acts_nor_records():
    cell, stack = Cell(), Stack()
    cell.holder = "someone else"
    ctl, tick = make(cell, stack)
    passes(ctl, tick, 3)
    assert stack.applied == [] and cell.records == [] and cell.holder == "someone else" and cell.desired is None


def test_a_count_the_generation_did_not_take_is_not_applied():
    """The lease lost between the pass's start and its update: no `pulumi up` with a count nobody recorded."""
    cell, stack = Cell(), Stack()
    ctl, tick = make(cell, stack)
    real_record = cell.record

    def lost(owner, decision, desired=None):
        if desired is not None and desired != (0, 0):
            cell.holder = "thief"
            return False
        return real_record(owner, decision, desired)
    cell.record = lost
    passes(ctl, tick, 3)
    assert stack.applied == [] and ctl.failures >= 1


@pytest.mark.slow
def test_the_lease_is_renewed_through_a_drain_wait():
    """A drain's wait (up to 300 s) outlasts the lease (3 x the interval): it is renewed every third of it."""
    cell = Cell()
    stack = Stack()
    stack.exists = (2, 0)
    ctl = Controller(cell, stack, POLICY, owner="c1", lock_ttl_s=0.3, settle_s=0.05, drain_timeout_s=30,
                     say=lambda line: None)
    cell.inflight = {"1": 1}  # a request on the leaving pod until the test ends it
    done = threading.Event()

    def end_request():
        time.sleep(1.2)
        cell.inflight = {}
        done.set()
    threading.Thread(target=end_request, daemon=True).start()
    assert ctl.hold()
    renewals_before = cell.renewals
    stack.exists = (1, 1)  # a drain a previous controller left half done
    ctl.step()
    assert done.is_set() and stack.applied[-1] == (1, 0)
    assert cell.renewals - renewals_before >= 2, cell.renewals  # 1.2 s of waiting, a renewal every 0.1 s


def test_what_exists_is_the_pods_made_and_the_live_rotation():
    from colocate.scaling.controller import existing

    assert existing(3, 2) == (2, 1)  # three pods made, the Worker routes to two: one drains
    assert existing(2, None) == (2, 0)  # the rotation unknown: every pod made serves
    assert existing(1, 4) == (1, 0)  # a Worker of a newer update than the outputs read: never more than exist
    assert existing(0, 0) == (0, 0)


def test_a_change_recorded_but_not_made_is_made_before_anything_new():
    """A controller killed after recording a drain (1 + 1 leaving) but before its update: the next
    one finds 2 serving, applies the recorded count, drains, and deletes the pod."""
    cell = Cell()
    cell.desired = {"pods": 1, "draining": 1, "owner": "dead"}
    stack = Stack(cell=cell)
    stack.exists = (2, 0)
    ctl, tick = make(cell, stack)
    passes(ctl, tick, 1)
    assert stack.applied == [(1, 1), (1, 0)] and stack.exists == (1, 0)
    assert desired_of(cell.state()) == (1, 0)


def test_a_recorded_count_below_what_serves_is_reached_by_a_drain_not_a_delete():
    """Two pods serve (someone applied the stack file's count); the generation says one: the second drains first."""
    cell = Cell()
    cell.desired = {"pods": 1, "draining": 0, "owner": "c0"}
    cell.inflight = {"1": 0}
    stack = Stack(cell=cell)
    stack.exists = (2, 0)
    ctl, tick = make(cell, stack)
    passes(ctl, tick, 1)
    assert stack.applied == [(1, 1), (1, 0)]  # out of rotation first, deleted after its requests
