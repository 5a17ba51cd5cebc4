"""The controller's pass logic against an in-memory cell and deployer (the decision and the
real sandbox are tested elsewhere): a failed update is retried on the next pass, and a
controller that is not the lock's holder neither acts nor records."""

from __future__ import annotations

from colocate.scale import Policy
from colocate.scaler import Controller


class Cell:
    """The generation's side of /_colocate/scale: cumulative counters, one lease, records."""

    def __init__(self):
        self.requests = 0
        self.holder = None
        self.records = []

    def state(self):
        return {"backends": {"fallback": {"requests": self.requests, "prompt_tokens": 0, "completion_tokens": 0}},
                "inflight": {}}

    def lock(self, owner, ttl_s, release=False):
        if self.holder not in (None, owner):
            return False, {"owner": self.holder}
        self.holder = None if release else owner
        return True, {"owner": owner}

    def record(self, owner, decision):
        if self.holder != owner:
            return False
        self.records.append(decision)
        return True


class Stack:
    def __init__(self, fail_once=False):
        self.config = (0, 0)
        self.applied = []
        self.fail_once = fail_once

    def declared(self):
        return self.config

    def deploy(self, pods, draining):
        self.config = (pods, draining)
        if self.fail_once:
            self.fail_once = False
            raise OSError("the provider had no GPU")
        self.applied.append((pods, draining))


POLICY = Policy(min=0, max=2, target_rpm=60, up_after_s=0, down_after_s=600)


def make(cell, stack, owner="c1"):
    clock = iter(range(0, 10_000, 10))
    cell.requests = 0

    def now():
        cell.requests += 20  # 120 req/min between two passes 10 s apart: two pods
        return next(clock)

    return Controller(cell, stack, POLICY, owner=owner, clock=now, sleep=lambda s: None, say=lambda line: None)


def test_a_failed_update_is_run_again_on_the_next_pass():
    cell, stack = Cell(), Stack(fail_once=True)
    ctl = make(cell, stack)
    ctl.run(0, steps=3)
    assert stack.applied and stack.applied[0] == (2, 0)  # the failed (2, 0) again, before any new decision
    assert stack.config == (2, 0) and not ctl.unsettled
    assert cell.holder is None  # released at the end


def test_a_controller_without_the_lock_neither_acts_nor_records():
    cell, stack = Cell(), Stack()
    cell.holder = "someone else"
    ctl = make(cell, stack)
    ctl.run(0, steps=3)
    assert stack.applied == [] and cell.records == [] and cell.holder == "someone else"
