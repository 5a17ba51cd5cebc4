"""What ``up --fleet`` was asked for (``fleet-launch.json``) and what follows from it: the
fleet's plan from the fleet stack file and its members' stack files (validated before anything
starts), the client sites, and the members' stack files copied with the placeholders a cloud
stack lacks in the sandbox. Both the fleet's lifecycle (``fleet.py``) and the front runner
(``fleet_front.py``) derive the same plan from it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import stackfile
from ..cell import outputs, settings as settings_mod
from ..cell.plan import plan_cell
from ..errors import ConfigError
from ..fleet import plan as fleet_mod
from .geography import Geography, site
from .launch import local_pod
from .statedir import SANDBOX_CMD, STACKS_DIR, default_state_dir

PLACEHOLDER_ACCOUNT = "0" * 32  # the sandbox never calls Cloudflare
PLACEHOLDER_SUBDOMAIN = "sandbox"


@dataclass(frozen=True)
class Launch:
    """What ``up --fleet`` was asked for; the front runner re-derives the same plan from it."""

    fleet: str
    stacks_dir: str
    sandboxes_dir: str
    client_sites: tuple[str, ...]  # empty: each cell's edge site
    stretch: float | None
    rtt: tuple[str, ...]

    def cell_dir(self, cell: str) -> Path:
        return Path(self.sandboxes_dir) / fleet_mod.short_name(cell)

    def as_json(self) -> dict:
        return {"fleet": self.fleet, "stacks_dir": self.stacks_dir, "sandboxes_dir": self.sandboxes_dir,
                "client_sites": list(self.client_sites), "stretch": self.stretch, "rtt": list(self.rtt)}

    @classmethod
    def from_json(cls, d: dict) -> Launch:
        return cls(d["fleet"], d["stacks_dir"], d["sandboxes_dir"], tuple(d.get("client_sites") or ()), d.get("stretch"),
                   tuple(d.get("rtt") or ()))


def _member_outputs(index: int, stack: str, stacks_dir: Path) -> dict:
    """What the fleet stack would read from member ``stack``'s outputs, from its stack file
    (the sandbox has no Pulumi backend): its Worker's name and its region. The cell is
    parsed as the cell's own ``up`` parses it (no cloud pod, no real account), so a member
    ``up`` would refuse is refused here, before any cell starts."""
    key = f"{fleet_mod.KEY}.cells[{index}]"
    path = stackfile.path_of(fleet_mod.short_name(stack), stacks_dir)
    if "/" in stack:
        raise ConfigError(key, stack, "names a stack of another project or organisation; the sandbox runs only this "
                          f"project's stack files (in {stacks_dir})", f"name a stack with a file in {stacks_dir}")
    if not path.exists():
        known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in Path(stacks_dir).glob("Pulumi.*.yaml"))
        raise ConfigError(key, stack, f"no stack file {path}: the sandbox runs each member from its stack file",
                          f"create the cell stack (cp stacks/Pulumi.us-east.yaml {path}, then edit colocate:region), "
                          f"or pulumi config rm --path '{key}'; known stacks: {', '.join(known) or 'none'}")
    raw, secret_names = stackfile.read_config(stack, stacks_dir)
    if fleet_mod.is_fleet(raw):
        raise ConfigError(key, stack, "is a fleet stack, not a cell", f"pulumi config rm --path '{key}'")
    raw.update(_placeholders(raw))
    pod = dict(raw.get("pod") or {})
    # The sandbox never rents a GPU (the cell's up says so too): the cloud's hop and endpoints give way to stand-ins.
    raw["pod"] = local_pod(pod) if pod.get("provider") != "local" else pod
    names = frozenset(secret_names) | frozenset(settings_mod.ALWAYS_SECRET)
    plan = plan_cell(settings_mod.parse(raw, stack, secrets=names, env={}))
    return {outputs.WORKER_NAME: plan.worker.script_name, outputs.WORKER_URL: f"http://sandbox.invalid/{stack}",
            outputs.REGION: plan.region.name, outputs.ACCOUNT_ID: plan.worker.account_id,
            outputs.BUDGET_E2E_MS: plan.probe.budgets.get("e2e")}


def _placeholders(raw: dict) -> dict:
    """What a cloud stack lacks to run in the sandbox, which never calls Cloudflare: an account
    id and a workers.dev subdomain (the committed cell stacks leave both to the operator)."""
    out: dict = {} if raw.get("accountId") else {"accountId": PLACEHOLDER_ACCOUNT}
    worker = raw.get("worker") or {}
    if not raw.get("zone") and not (isinstance(worker, dict) and worker.get("subdomain")):
        out["worker"] = {**(worker if isinstance(worker, dict) else {}), "subdomain": PLACEHOLDER_SUBDOMAIN}
    return out


def sandbox_stacks(launch: Launch, plan: fleet_mod.FleetPlan, state_dir: Path) -> Path:
    """Copies of the members' stack files in ``<state_dir>/stacks`` with the placeholders
    (``_placeholders``) written in: the cells' own ``up``/``apply`` read these, and the
    committed stack files stay untouched. Made again from the originals at every up/apply."""
    target = Path(state_dir) / STACKS_DIR
    target.mkdir(parents=True, exist_ok=True)
    for m in plan.members:
        name = fleet_mod.short_name(m.stack)
        shutil.copyfile(stackfile.path_of(name, Path(launch.stacks_dir)), stackfile.path_of(name, target))
        raw, _ = stackfile.read_config(name, target)
        updates = {k if k != "worker" else "worker.subdomain": v if k != "worker" else v["subdomain"]
                   for k, v in _placeholders(raw).items()}
        if updates:
            stackfile.write_config(name, updates, target)
    return target


def plan_of(launch: Launch) -> fleet_mod.FleetPlan:
    """The front door's plan from the fleet stack file and its members' stack files.
    ConfigError names the key, the value and the fix."""
    stacks_dir = Path(launch.stacks_dir)
    path = stackfile.path_of(launch.fleet, stacks_dir)
    if not path.exists():
        known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml"))
        raise ConfigError("--fleet", launch.fleet, f"no stack file {path}",
                          f"name a fleet stack (one whose config has {fleet_mod.KEY}), e.g. fleet; known stacks: "
                          f"{', '.join(known) or 'none'}")
    raw, secret_names = stackfile.read_config(launch.fleet, stacks_dir)
    if not fleet_mod.is_fleet(raw):
        raise ConfigError("--fleet", launch.fleet, f"is a cell stack: its config has no {fleet_mod.KEY}",
                          f"`{SANDBOX_CMD} up --stack {launch.fleet}` runs a cell; --fleet takes a fleet stack "
                          "such as fleet")
    raw.update(_placeholders(raw))  # its Cloudflare account and address: the sandbox calls neither
    settings = fleet_mod.parse(raw, launch.fleet, secrets=secret_names)
    found = [_member_outputs(i, c, stacks_dir) for i, c in enumerate(settings.cells)]
    return fleet_mod.plan_fleet(settings, found)


def client_sites_of(launch: Launch, plan: fleet_mod.FleetPlan) -> list[str]:
    """The client sites, each once: as given, else every cell's edge site (cell order)."""
    wanted = launch.client_sites or tuple(m.region.edge_site for m in plan.members)
    return list(dict.fromkeys(site(s, "--client-site") for s in wanted))


def make_launch(fleet_stack: str, *, stacks_dir: Path = stackfile.STACKS_DIR, sandboxes_dir: Path | None = None,
                client_sites: tuple[str, ...] = (), stretch: float | None = None, rtt: tuple[str, ...] = ()) -> Launch:
    sandboxes = Path(sandboxes_dir).resolve() if sandboxes_dir else default_state_dir(fleet_stack).parent
    sites = tuple(site(s, "--client-site") for s in client_sites)  # an unknown colo fails here
    Geography.from_args(stretch, rtt)  # a bad --stretch/--rtt too
    return Launch(fleet_stack, str(Path(stacks_dir).resolve()), str(sandboxes), sites, stretch, tuple(rtt))
