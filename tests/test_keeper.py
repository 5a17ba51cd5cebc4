"""The keeper's pass logic with an in-memory generation and deployer (the providers' side is
tests/test_keeper_providers.py, the sandbox's tests/test_keeper_sandbox.py): a controller whose
checkout differs from the running Worker refuses to deploy and says why; a pod the Worker cannot
reach is replaced only after two passes; a stack lock left behind raises an alert and is asked
again at the first backoff, not later and later; certificates are renewed one role a pass, the
cell's own first, never while a pod is down."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pulumi.automation._cmd import CommandResult
from pulumi.automation.errors import ConcurrentUpdateError, create_command_error

from colocate.pods.base import RUNNING, PodInfo
from colocate.pods.errors import NotFoundError
from colocate.scaling.controller import BACKOFF_S, Controller
from colocate.scaling.keeper import (
    DEAD,
    DOWN,
    OK,
    UNHEALTHY,
    Keeper,
    Record,
    RunningPod,
    StackLocked,
    due_role,
    health_view,
    judge,
)
from tests.support.keeping import Generation

NOW = datetime(2027, 1, 1, tzinfo=UTC).timestamp()


def end(days: float) -> str:
    return (datetime.fromtimestamp(NOW, UTC) + timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")


class Pods:
    """A deployer whose pods all run where they were recorded, unless a test says otherwise."""

    def __init__(self, n=2, certs=None, fail=None):
        self.running = [RunningPod(i, f"p{i}", "runpod", "203.0.113.9", 40000 + i, "US-DE-1", ("US-DE-1",))
                        for i in range(n)]
        self.dead: set[int] = set()
        self.certs = certs or {}
        self.fail = fail
        self.replaced: list[list[int]] = []
        self.renewed: list[str] = []

    def declared(self):
        return len(self.running), 0

    def deploy(self, pods, draining):
        raise AssertionError("not scaled here")

    def pods(self):
        return list(self.running)

    def describe(self, pod):
        state = "dead" if pod.index in self.dead else RUNNING
        return PodInfo(pod.id, f"n{pod.index}", state, "EXITED" if state == "dead" else "RUNNING", pod.location,
                       pod.ip, pod.port)

    def replace(self, indices, replaced):
        if self.fail:
            raise self.fail
        self.replaced.append(list(indices))
        for i in indices:
            self.running[i] = RunningPod(i, f"p{i}r{replaced[i]}", "runpod", "203.0.113.9", 41000 + i, "US-DE-1",
                                         ("US-DE-1",))
            self.dead.discard(i)

    def certificates(self):
        return dict(self.certs)

    def renew(self, role):
        self.renewed.append(role)
        self.certs[role] = end(90)


def make(deployer, gen=None, checkout="h1", clock=None, **keeper):
    gen = gen or Generation(worker_hash="h1")
    t = clock or {"now": NOW}
    k = Keeper(deployer, checkout, clock=lambda: t["now"], say=lambda line: None, **keeper)
    ctl = Controller(gen, deployer, None, owner="k", clock=lambda: t["now"], say=lambda line: None, keeper=k)
    return ctl, gen, t


def test_a_checkout_whose_worker_differs_refuses_to_act_names_both_hashes_and_raises_an_alert():
    pods = Pods()
    pods.dead.add(1)  # something it would otherwise replace
    ctl, gen, _ = make(pods, Generation(worker_hash="a1b2c3d4e5f60718"), checkout="ffff000011112222")
    alerts = ctl.run(0, steps=3, stop_on_alert=True)
    assert pods.replaced == [] and [a["name"] for a in alerts] == ["stale_checkout"]
    reason = gen.decisions[-1]["reason"]
    assert reason.startswith("refusing to deploy") and "a1b2c3d4e5f60718" in reason and "ffff000011112222" in reason
    assert "git pull" in reason and "workerContentHash" in reason
    assert gen.keeper["worker"] == {"running": "a1b2c3d4e5f60718", "checkout": "ffff000011112222"}
    # a Worker that says nothing (an earlier release) is not trusted either
    ctl, gen, _ = make(Pods(), Generation(worker_hash=None))
    assert [a["name"] for a in ctl.run(0, steps=1)] == ["stale_checkout"]
    assert "does not say which code it runs" in gen.decisions[-1]["reason"]
    # the same code: it acts
    pods = Pods()
    pods.dead.add(1)
    ctl, gen, _ = make(pods)
    assert ctl.run(0, steps=1) == [] and pods.replaced == [[1]]


def test_a_pod_only_the_worker_finds_broken_is_replaced_on_the_second_pass_in_a_row():
    pods = Pods()
    gen = Generation(worker_hash="h1")
    gen.health = {"pods": [{"index": 0, "ok": True, "status": 200}, {"index": 1, "ok": False, "status": None}],
                  "breaker": {"pods": [{"index": 1, "state": "open"}]}}
    ctl, gen, _ = make(pods, gen)
    ctl.step()
    assert pods.replaced == [] and gen.keeper["pods"][1]["state"] == UNHEALTHY
    assert "breaker open" in gen.keeper["pods"][1]["detail"]
    ctl.step()
    assert pods.replaced == [[1]]
    gen.health["pods"][1]["ok"] = True
    ctl.step()
    assert pods.replaced == [[1]]


def test_a_stack_lock_is_asked_again_at_the_first_backoff_and_raises_an_alert_once_it_outlasts_an_update():
    locked = create_command_error(CommandResult(stdout="", stderr="error: the stack is currently locked by 1 lock(s)", code=255))
    assert isinstance(locked, ConcurrentUpdateError)  # what pulumi.automation raises; PulumiDeployer maps it
    pods = Pods(fail=StackLocked(f"the stack is locked ({locked})"))
    pods.dead.add(0)
    ctl, gen, t = make(pods, lock_alert_s=600)
    for _ in range(4):
        assert ctl.run(0, steps=1) == []
        assert ctl.retry_at == t["now"] + BACKOFF_S  # never doubled: a lock costs nothing to ask about
        t["now"] += BACKOFF_S
    assert gen.keeper["locked_since"] == NOW and gen.keeper["failures"] == {}  # not the pod's failure
    t["now"] += 600
    assert [a["name"] for a in ctl.run(0, steps=1)] == ["stack_locked"]
    assert "pulumi cancel" in gen.keeper["alerts"][0]["message"]
    pods.fail = None
    t["now"] += BACKOFF_S
    assert ctl.run(0, steps=1) == [] and gen.keeper["locked_since"] is None and pods.replaced == [[0]]


def test_updates_that_keep_failing_raise_an_alert_on_the_third():
    keeper = Keeper(Pods(), None, clock=lambda: NOW, say=lambda line: None)
    for n in range(3):
        assert [a["name"] for a in keeper.alerts()] == ([] if n < 3 else ["update_failing"])
        keeper.update_failed(OSError("the provider answered 503"))
    assert [a["name"] for a in keeper.alerts()] == ["update_failing"]
    keeper.update_done()
    assert keeper.alerts() == []


def test_certificates_are_renewed_one_role_a_pass_the_cells_first_and_never_a_pod_that_is_down():
    pods = Pods(certs={"cell": end(29), "pod-0": end(29.5), "pod-1": end(29.5)})
    pods.dead.add(1)
    ctl, gen, t = make(pods)
    ctl.step()  # a dead pod first: replaced, nothing renewed
    assert pods.replaced == [[1]] and pods.renewed == []
    for _ in range(4):
        ctl.step()
    assert pods.renewed == ["cell", "pod-0", "pod-1"]  # one a pass, then nothing left
    assert {"pod": 0, "reason": "certificate", "n": 1} in gen.keeper["replacements"]
    # a pod that cannot be replaced now (in its backoff) holds back only its own renewal
    pods = Pods(certs={"pod-0": end(29.5), "pod-1": end(29.5)}, fail=OSError("no GPU"))
    pods.dead.add(0)
    ctl, gen, t = make(pods)
    ctl.run(0, steps=1)  # pod 0's replacement fails: the next try after 60 s
    pods.fail = None
    t["now"] += 1
    ctl.retry_at = None
    ctl.step()
    assert pods.renewed == ["pod-1"] and pods.replaced == []
    assert due_role({"pod-3": end(31), "pod-2": end(10)}, NOW) == "pod-2"
    assert due_role({"pod-3": end(31)}, NOW) is None


def test_a_server_of_the_users_is_judged_by_the_workers_health_alone_and_never_replaced_nor_renewed():
    class Mine(Pods):
        def describe(self, pod):
            if pod.own:  # its record lost: for a pod the kit started, gone (replaced at once)
                raise NotFoundError("no record")
            return super().describe(pod)

    pods = Mine(certs={"pod-0": end(10), "pod-1": end(10)})
    pods.running[0] = RunningPod(0, "local-mine", "local", "localhost", 8000, "local", ("local",), own=True)
    gen = Generation(worker_hash="h1")
    gen.health = {"pods": [{"index": 0, "ok": False, "status": None}, {"index": 1, "ok": True, "status": 200}]}
    ctl, gen, _ = make(pods, gen)
    for _ in range(3):
        ctl.step()
    assert pods.replaced == [] and pods.renewed == ["pod-1"]  # the kit's own pod is renewed; the user's never
    assert gen.keeper["pods"][0]["state"] == DOWN and "localhost:8000" in gen.keeper["pods"][0]["detail"]
    gen.health["pods"][0] = {"index": 0, "ok": True, "status": 200}
    ctl.step()
    assert gen.keeper["pods"][0]["state"] == OK and pods.replaced == [] and pods.renewed == ["pod-1"]


def test_a_restarted_keeper_goes_on_counting_from_the_record():
    record = Record(failures={1: 2}, update_failures=1, locked_since=5.0)
    again = Record.from_json(record.as_json(NOW))
    assert again.failures == {1: 2} and again.update_failures == 1 and again.locked_since == 5.0
    assert Record.from_json({"failures": "garbage"}).failures == {}


def test_the_verdicts_from_a_providers_answer():
    pod = RunningPod(0, "p0", "runpod", "203.0.113.9", 40000, "US-DE-1", ("US-DE-1", "US-NC-1"))

    def info(**over):
        base = {"id": "p0", "name": "n", "state": RUNNING, "raw_state": "RUNNING", "location": "US-DE-1",
                "ip": "203.0.113.9", "port": 40000}
        return lambda _pod: PodInfo(**{**base, **over})

    assert judge(pod, info(), None).state == OK
    assert judge(pod, info(state="dead", raw_state="EXITED"), None).state == DEAD
    assert judge(pod, info(port=40001), None).state == "remapped"
    assert judge(pod, info(location="EU-NL-1"), None).state == "misplaced"
    assert judge(pod, info(), {"ok": False, "status": 502}).state == UNHEALTHY
    proxied = RunningPod(0, "p0", "runpod", None, None, "US-DE-1", (), proxied=True)
    assert judge(proxied, info(port=1), None).state == OK  # RunPod's proxy: no address of its own to compare
    assert health_view({"pods": [{"index": 0, "ok": False}], "breaker": {"pods": [{"index": 0, "state": "open"}]}}) == \
        {0: {"ok": False, "status": None, "breaker": "open"}}


def test_an_update_that_replaced_nothing_is_a_failure_and_an_unreadable_cell_deploys_nothing():
    class Idle(Pods):
        def replace(self, indices, replaced):
            self.replaced.append(list(indices))  # the update ran and changed nothing (the old name again)

    pods = Idle()
    pods.dead.add(1)
    ctl, gen, t = make(pods, backoff_s=0.0)
    ctl.backoff_s = 0.0
    alerts = ctl.run(0, steps=5, stop_on_alert=True)
    assert [a["name"] for a in alerts] == ["replace_failed"] and len(pods.replaced) == 3
    assert "it was not replaced" in gen.keeper["events"][-1]["detail"]

    class Unread(Generation):
        def state(self):
            raise OSError("connection refused")

    pods = Pods()
    pods.dead.add(0)
    ctl, gen, _ = make(pods, Unread(worker_hash="h1"))
    ctl.step()
    assert pods.replaced == [] and "cannot be read" in gen.decisions[-1]["reason"]


def test_an_endpoint_the_team_runs_is_judged_and_reported_but_never_replaced_nor_its_certificate_renewed():
    # provider existing: the Worker cannot reach endpoint 1 for many passes, and endpoint 0's certificate and the
    # cell's are in their last 30 days. The kit renews what it holds (the cell's) and touches no box.
    pods = Pods(certs={"cell": end(20), "pod-0": end(10), "pod-1": end(10)})
    pods.running = [RunningPod(i, f"gpu{i}.example.com:8443", "existing", f"gpu{i}.example.com", 8443, "TPE",
                               ("TPE", "KHH", "HKG"), own=True) for i in range(2)]
    pods.dead.add(0)  # a provider that said so would not be believed either: an endpoint is the team's to mend
    gen = Generation(worker_hash="h1")
    gen.health = {"pods": [{"index": 0, "ok": True, "status": 200}, {"index": 1, "ok": False, "status": None}]}
    said = []
    ctl, gen, t = make(pods, gen)
    ctl.keeper.say = said.append
    for _ in range(4):
        assert ctl.run(0, steps=1) == []
        t["now"] += 60
    assert pods.replaced == [] and pods.renewed == ["cell"]
    # Judged by the Worker's health alone, as every server the kit did not start (colocate:pod.url too).
    assert [(p["index"], p["state"], p.get("own")) for p in gen.keeper["pods"]] == [(0, OK, True), (1, DOWN, True)]
    assert any("pod 1 (gpu1.example.com:8443) is down: it is a server you run, never replaced" in s for s in said)
    # An endpoint's address is declared: an answer elsewhere is not a remap the keeper would chase.
    moved = RunningPod(0, "gpu0.example.com:8443", "existing", "gpu0.example.com", 8443, "TPE", ("TPE",), own=True)
    verdict = judge(moved, lambda _p: PodInfo(moved.id, "", RUNNING, "declared", None, "other", 1), None)
    assert verdict.state == OK and not verdict.replace
