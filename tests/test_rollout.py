"""colocate/cell/rollout.py: the one pod replacement policy. The pure steps, and the Pulumi Cell
declaring the same policy (the sandbox's Runner.apply carrying it out is exercised with real
pods in tests/test_sandbox_pods.py)."""

from colocate.cell import rollout
from colocate.cell.rollout import ADD, KEEP, REMOVE, REPLACE, Step, rollout as steps_of
from tests.test_infra_pods import declared_options, deploy  # noqa: F401 - the fixture is used by name


def test_same_name_keeps_another_name_replaces_in_index_order():
    assert steps_of({0: "a", 1: "b"}, ["a", "b2"]) == [Step(0, KEEP, "a", "a"), Step(1, REPLACE, "b", "b2")]


def test_a_grown_count_adds_and_a_shrunk_count_removes_last():
    assert steps_of({0: "a"}, ["a", "b", "c"]) == [Step(0, KEEP, "a", "a"), Step(1, ADD, None, "b"), Step(2, ADD, None, "c")]
    assert steps_of({0: "a", 1: "b", 2: "c"}, ["a2"]) == [
        Step(0, REPLACE, "a", "a2"), Step(1, REMOVE, "b", None), Step(2, REMOVE, "c", None)]


def test_an_empty_cell_adds_every_pod_and_no_plan_removes_every_pod():
    assert [s.action for s in steps_of({}, ["a", "b"])] == [ADD, ADD]
    assert [s.action for s in steps_of({1: "b", 0: "a"}, [])] == [REMOVE, REMOVE]
    assert [s.index for s in steps_of({1: "b", 0: "a"}, [])] == [0, 1]


def test_all_at_once_no_pod_waits_for_another():
    assert [rollout.created_after(i) for i in range(3)] == [None, None, None]


def test_the_cell_declares_the_policy_the_runner_follows(declared_options):  # noqa: F811 - the fixture
    deploy(3)
    for i in range(3):
        opts = declared_options[f"us-east-pod-{i}"]
        waits = [d._name for d in opts.depends_on or []]
        assert waits == [f"us-east-pod-{j}-ready" for j in (rollout.created_after(i),) if j is not None]
        assert opts.delete_before_replace is (not rollout.CREATE_BEFORE_DELETE)
