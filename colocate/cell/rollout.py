"""How a cell's pods change when its plan does: the one replacement policy, for both consumers.
``infra.cell.Cell`` declares it (Pulumi's engine then carries it out) and the sandbox's
``Runner.apply`` carries it out itself.

- A pod is identified by its name (``PodPlan.identity()`` is in it): the same name at the same
  index keeps the pod; another name replaces it.
- Create before delete: the new pod serves, and the Worker uses it, before the pod it replaces
  is deleted, so a replacement never leaves an index without a pod. On a zone the new pod's
  record is a new record (its instance's name), made beside the old one, which stays until the
  end of the update: the old pod is reachable by its name until the Worker has moved.
- All at once: every new pod is rented and waited for side by side (a real pod takes 15 to 20
  minutes to a first token, FACTS; one after another, N pods took N boots). The Worker switches
  once every new pod serves: one WorkersScript carries POD_URLS, and an update changes it once.
  What must go one pod at a time (a dead pod, a certificate's renewal) the keeper does with one
  targeted update per pod (colocate/scaling/keeper.py).
- Indices beyond ``pod.count`` are removed last, after the Worker no longer names them.

Pure: no Pulumi import, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CREATE_BEFORE_DELETE = True
ONE_AT_A_TIME = False

KEEP, ADD, REPLACE, REMOVE = "keep", "add", "replace", "remove"


@dataclass(frozen=True)
class Step:
    """What happens to pod ``index``: ``old`` is the name it had (None: none), ``new`` the name
    it gets (None: it is removed)."""

    index: int
    action: str
    old: str | None
    new: str | None


def rollout(old: Mapping[int, str], new: Sequence[str]) -> list[Step]:
    """The steps from the pods that run (index -> name) to the plan's (names in index order):
    keep, add or replace each planned index in order, then remove the indices beyond it."""
    steps = []
    for index, name in enumerate(new):
        before = old.get(index)
        action = ADD if before is None else KEEP if before == name else REPLACE
        steps.append(Step(index, action, before, name))
    steps += [Step(index, REMOVE, old[index], None) for index in sorted(old) if index >= len(new)]
    return steps


def created_after(index: int) -> int | None:
    """The pod index whose create pod ``index`` waits for (None: it waits for none)."""
    return index - 1 if ONE_AT_A_TIME and index > 0 else None
