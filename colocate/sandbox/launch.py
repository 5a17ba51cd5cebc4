"""The launch record (``launch.json``: what ``up`` was asked for) and what the runner derives
from it the same way ``up`` did: the cell plan and the sites of its parts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import stackfile
from ..cell import settings as settings_mod
from ..cell.plan import CellPlan, plan_cell
from .geography import FALLBACK_SITE, Sites, landing_site, site, worker_site
from .pinning import Pins

PLACEHOLDER_ACCOUNT = "0" * 32  # the sandbox never calls Cloudflare


@dataclass(frozen=True)
class Launch:
    """What ``up`` was asked for; the runner re-derives the same plan from it."""

    stack: str
    stacks_dir: str
    client_site: str | None
    stretch: float | None
    rtt: tuple[str, ...]
    force_split: bool

    def as_json(self) -> dict:
        return {"stack": self.stack, "stacks_dir": self.stacks_dir, "client_site": self.client_site,
                "stretch": self.stretch, "rtt": list(self.rtt), "force_split": self.force_split}

    @classmethod
    def from_json(cls, d: dict) -> Launch:
        return cls(d["stack"], d["stacks_dir"], d.get("client_site"), d.get("stretch"), tuple(d.get("rtt", ())),
                   bool(d.get("force_split")))


SPLIT_WARNING = (
    "WARNING: --force-split: the plan's refusal to split state from compute is OVERRIDDEN. "
    "This reproduces a hand-rolled move for the demo; the Pulumi program never allows it."
)


def build_plan(launch: Launch) -> tuple[CellPlan, list[str]]:
    """Read and validate the stack, build the cell plan. Returns (plan, notes for stderr)."""
    raw, secret_names = stackfile.read_config(launch.stack, Path(launch.stacks_dir))
    notes = []
    raw.setdefault("accountId", PLACEHOLDER_ACCOUNT)
    pod = dict(raw.get("pod") or {})
    provider = pod.get("provider", settings_mod.POD_DEFAULTS["provider"])
    if provider != "local":
        notes.append(f"colocate:pod.provider is {provider!r}: the sandbox never rents a GPU, it runs the local "
                     "stand-in pod instead" + (" of each endpoint (your own engine: colocate:pod.url, docs/sandbox.md)"
                                               if provider == settings_mod.EXISTING else ""))
        raw["pod"] = local_pod(pod)
    names = frozenset(secret_names) | frozenset(settings_mod.ALWAYS_SECRET)
    s = settings_mod.parse(raw, launch.stack, secrets=names, env={}, allow_split_state=launch.force_split)
    if launch.force_split:
        notes.append(SPLIT_WARNING)
    return plan_cell(s), notes


def local_pod(pod: dict) -> dict:
    """A cloud stack's ``colocate:pod`` as the sandbox runs it: the local stand-in, one for each endpoint of an
    ``existing`` cell. The stack's hop was chosen for its cloud path (``token``: RunPod's proxy, or a box's own
    TLS); the stand-ins serve what ``auto`` gives a local pod, mutual TLS, as a zoned cloud pod does."""
    out = {k: v for k, v in pod.items() if k not in ("hop", "endpoints")}
    if pod.get("provider") == settings_mod.EXISTING and isinstance(pod.get("endpoints"), list):
        out["count"] = len(pod["endpoints"]) or 1
    out["provider"] = "local"
    return out


def sites_for(plan: CellPlan, launch: Launch, pod_location: str) -> Sites:
    reg = plan.region
    client = site(launch.client_site, "--client-site") if launch.client_site else reg.edge_site
    pod = reg.site_of(pod_location)  # the stand-in ("local") stands at the region's own pod site
    edge = worker_site(plan.worker.placement_mode, hint_site=reg.edge_site, client=client, pod=pod)
    return Sites(client=client, edge=edge, pod=pod, fallback=FALLBACK_SITE)


def object_sites(plan: CellPlan, edge: str, pins: Pins) -> list[str]:
    """Every site an object of this cell may live at: the edge, where each of the ledger's
    generations would land, and where objects already are."""
    wanted = {edge, *pins.all().values()}
    state = plan.state
    for hint in (state.hint, state.draining_hint):
        wanted.add(landing_site(edge, hint or ""))
    return sorted(wanted)
