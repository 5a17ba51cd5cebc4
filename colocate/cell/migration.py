"""Migration planning: what the next ``pulumi up`` does when the ledger moves. Pure.

A Durable Object never moves; state moves by a new generation first touched from the
target region. ``start`` and ``finish`` are ledger transitions (colocate.cell.ledger); this
module turns a before/after pair of cell plans into the actions a person reviews,
and the state round trip before and after, from the physical floor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from . import geo
from .catalogue import gpu_name, gpu_names, region as lookup_region
from .ledger import UNKNOWN_REGION, Ledger
from .plan import CellPlan, plan_cell
from .settings import ALWAYS_SECRET, FALLBACK_PASSTHROUGH, NS, POD_DEFAULTS, PROVIDER_SECRET, Settings, default_gpu, parse

PLANNING_ACCOUNT = "0" * 32  # planning never deploys; a stack may not have its account id yet


@dataclass(frozen=True)
class Action:
    verb: str  # create | delete | update | bind | unbind | purge | probe | keep | cost | check | forget (an endpoint)
    what: str
    detail: str

    def __str__(self) -> str:
        return f"  {self.verb:<8} {self.what}: {self.detail}"


@dataclass(frozen=True)
class RoundTrip:
    label: str
    worker_site: str
    state_site: str | None

    @property
    def floor_ms(self) -> float | None:
        return None if self.state_site is None else geo.floor_ms(self.worker_site, self.state_site)

    def __str__(self) -> str:
        if self.state_site is None:
            return f"  {self.label:<34} Worker {self.worker_site}, state object: unknown (run the probe)"
        km = geo.distance_km(self.worker_site, self.state_site)
        floor = geo.floor_ms(self.worker_site, self.state_site)
        return (f"  {self.label:<34} Worker {self.worker_site} -> state {self.state_site}: {km:,.0f} km, "
                f"floor {floor:.0f} ms (~{floor * geo.DEFAULT_STRETCH:.0f} ms at {geo.DEFAULT_STRETCH}x)")


def planning_settings(raw: dict, stack: str) -> Settings:
    """Settings for planning only: secrets and the account id need not be set yet."""
    raw = dict(raw)
    raw.setdefault("accountId", PLANNING_ACCOUNT)
    # Planning shows pods, placement and bindings; the fallback's model changes none of them.
    raw.setdefault("fallbackModel", FALLBACK_PASSTHROUGH)
    if raw["fallbackModel"] == FALLBACK_PASSTHROUGH:
        raw.setdefault("fallbackModels", ["planning"])  # passthrough names its models; planning buys none
    worker = dict(raw.get("worker") or {})
    if not worker.get("subdomain") and not raw.get("zone"):
        worker["subdomain"] = "planning"
    raw["worker"] = worker
    secrets = set(ALWAYS_SECRET) | {key for key, _ in PROVIDER_SECRET.values()}
    return parse(raw, stack, secrets=secrets, require_cap=False)  # spends nothing; `pulumi preview` asks for the cap


def state_site(settings: Settings, generation_name: str) -> str | None:
    """Where a generation's object lives: its region's edge site, or what the probe observed."""
    gen = next(g for g in settings.ledger.generations if g.name == generation_name)
    if gen.observed_colo:
        return gen.observed_colo
    if gen.region == UNKNOWN_REGION:
        return None
    return lookup_region(gen.region).edge_site


def shown(pod) -> str:
    """A pod's name as a plan can know it: the digest ends in the pod token's fingerprint,
    which the plan does not read (no secrets), so it is shown as ``*``, which matches the
    live pod's name, rather than as a digest that matches no pod."""
    return pod.name if pod.token_fingerprint else pod.name.rpartition("-")[0] + "-*"


def diff(before: CellPlan, after: CellPlan) -> list[Action]:
    """The actions that take the cell from ``before`` to ``after``."""
    actions: list[Action] = []
    created = 0
    for i in range(max(len(before.pods), len(after.pods))):
        bp = before.pods[i] if i < len(before.pods) else None
        ap = after.pods[i] if i < len(after.pods) else None
        if bp and ap and bp.triggers() == ap.triggers():
            actions.append(Action("keep", f"pod {shown(ap)}", "unchanged"))
            continue
        if ap and ap.endpoint is not None:  # the team's box: checked, never rented
            actions.append(Action("check", f"pod {shown(ap)}", f"your endpoint {ap.worker_url({})} "
                                  f"({ap.endpoint.location}), waited for before the Worker uses it"))
        elif ap:
            created += 1
            actions.append(Action("create", f"pod {shown(ap)}", f"{ap.settings.provider} in {ap.region} "
                                  f"({', '.join(ap.locations)}), reached by {ap.path}, "
                                  "health-checked before anything is deleted"))
        if bp and bp.endpoint is not None:
            actions.append(Action("forget", f"pod {shown(bp)}", f"your endpoint {bp.worker_url({})} keeps running: "
                                  "the kit never deletes it"))
        elif bp:
            actions.append(Action("delete", f"pod {shown(bp)}", f"{bp.settings.provider} in {bp.region}, "
                                  "at the end of the update, after the Worker uses the new pods"))
    cap = after.pod.settings.max_price_per_hr
    n = len(after.pods)
    # Replaced pods are deleted at the end of the update: old and new bill together until then.
    peak = len(before.pods) + created
    during = f"; during the update {peak} pods run, up to ${cap * peak:.2f}/hr" if peak > n else ""
    if after.pods and all(p.endpoint is not None for p in after.pods):
        own = sum(p.endpoint.cost_per_hr for p in after.pods if p.endpoint is not None)
        actions.append(Action("cost", f"{n} pod{'s' if n > 1 else ''}", f"${own:.2f}/hr, your own figure "
                              "(colocate:pod.endpoints[].costPerHr)"))
    else:
        actions.append(Action("cost", f"{n} pod{'s' if n > 1 else ''}",
                              f"at most ${cap * n:.2f}/hr (cap ${cap:.2f}/hr each){during}"))
    host_move = _placement_host_change(before, after)
    if host_move:
        actions.append(Action("update", f"Worker {after.worker.script_name}", host_move))
    elif before.worker.placement != after.worker.placement:
        actions.append(Action("update", f"Worker {after.worker.script_name}",
                              f"placement {_placement(before)} -> {_placement(after)}"))
    b_bind = {b.name: b for b in before.worker.bindings}
    a_bind = {b.name: b for b in after.worker.bindings}
    for name in a_bind:
        if name in b_bind and a_bind[name] == b_bind[name]:
            continue
        verb = "bind" if name not in b_bind else "update"
        actions.append(Action(verb, f"binding {name}", a_bind[name].text or "(value from the new pod)"))
    for name in b_bind.keys() - a_bind.keys():
        actions.append(Action("unbind", f"binding {name}", f"was {b_bind[name].text}"))
    a_state, b_state = after.state, before.state
    if a_state.active.name != b_state.active.name:
        actions.append(Action("probe", f"generation {a_state.active.name}",
                              f"first touched by the post-deploy probe from {after.region.edge_site} "
                              f"with hint {a_state.hint}, then its colo is checked"))
    if a_state.draining and a_state.draining != b_state.draining:
        actions.append(Action("keep", f"generation {a_state.draining.name}",
                              "draining: read through while the new generation is empty, so breaker state survives"))
    for gen in set(a_state.purge) - set(b_state.purge):
        actions.append(Action("purge", f"generation {gen}", "storage deleted by the Worker's purge endpoint; "
                              "the Breaker class itself is kept (no class is deleted)"))
    return actions


def _placement(p: CellPlan) -> str:
    w = p.worker
    if w.placement_host is not None:
        return f"pod host {w.placement_host.describe()}"
    return w.placement.get("region") or f"mode {w.placement.get('mode')}"


def _placement_host_change(before: CellPlan, after: CellPlan) -> str | None:
    """Pod mode: pod 0's address (hostname and public port) after the update, when it changes.

    A replaced pod 0 (renewal, a new image, a migration's new generation) gets a new port
    from its provider, and a new generation a new DNS name: Cloudflare then probes the new
    address. The port is known only once the new pod exists, so it is named, not shown."""
    b, a = before.worker.placement_host, after.worker.placement_host
    if a is None or b is None:
        return None
    replaced = before.pods[a.pod_index].triggers() != after.pods[a.pod_index].triggers()
    if not replaced and a.hostname == b.hostname:
        return None
    why = f"pod {a.pod_index} is replaced" if replaced else "its DNS name changes"
    return (f"placement host changes from {b.describe()} to {a.describe(new=replaced)} "
            f"({why}; Cloudflare probes the new address)")


def round_trips(before: Settings, after: Settings) -> list[RoundTrip]:
    """State round trip now, after a hand-rolled move (state left behind), and after the migration."""
    now_edge = before.region.edge_site
    new_edge = after.region.edge_site
    old_site = state_site(before, before.ledger.active.name)
    trips = [RoundTrip("now", now_edge, old_site)]
    if after.region.name != before.region.name or after.ledger.active.name != before.ledger.active.name:
        if after.region.name != before.region.name:
            trips.append(RoundTrip("compute moved, state left behind", new_edge, old_site))
        trips.append(RoundTrip("after this migration", new_edge, state_site(after, after.ledger.active.name)))
    return trips


def with_ledger(raw: dict, ledger: Ledger, region_name: str | None = None) -> dict:
    out = dict(raw, generations=ledger.as_config())
    if region_name:
        out["region"] = region_name
    return out


@dataclass(frozen=True)
class PodChange:
    """The pod settings a move changes: the raw config after it, the stack-file updates, and
    a line per change for the printed plan."""

    raw: dict
    updates: dict[str, str]
    notes: tuple[str, ...]


def change_pod(raw: dict, provider: str | None = None, gpu: str | None = None) -> PodChange:
    """Move the pod to ``provider`` and/or ``gpu``. A new provider gets the same GPU under its
    own name (catalogue.GPUS): RunPod's "NVIDIA GeForce RTX 4090" is "RTX 4090" on Vast.ai,
    and the old name would match no offer. A GPU the catalogue cannot translate is refused
    (ConfigError naming colocate:pod.gpu) unless ``gpu`` names it; nothing is written here."""
    pod = raw.get("pod") or {}
    if not isinstance(pod, dict) or (provider is None and gpu is None):
        return PodChange(raw, {}, ())  # nothing asked, or a malformed pod that parse() refuses by name
    old_provider = pod.get("provider", POD_DEFAULTS["provider"])
    old_gpu = pod["gpu"] if "gpu" in pod else default_gpu(old_provider)
    new_provider = provider or old_provider
    new_gpu, why = old_gpu, ""
    if gpu is not None:
        right = gpu_name(gpu, new_provider)
        if right not in (None, gpu):
            raise ConfigError("--gpu", gpu, f"that is another provider's name for this GPU; {new_provider} calls it {right!r}",
                              f"--gpu '{right}'")
        new_gpu, why = gpu, "--gpu"
    elif new_provider != old_provider and new_provider != "local":  # the local stand-in ignores the GPU
        new_gpu = gpu_name(old_gpu, new_provider)
        if new_gpu is None:
            known = gpu_names(new_provider)
            raise ConfigError(
                f"{NS}:pod.gpu", old_gpu,
                f"the kit does not know {new_provider}'s name for this GPU, and {old_provider}'s name may match "
                f"no {new_provider} GPU (pulumi up would then fail with no capacity after the move began)",
                f"add --gpu '<{new_provider}'s name for it>' to the command"
                + (f" (names the kit knows for {new_provider}: {', '.join(known)})" if known else ""))
        why = f"{new_provider}'s name for the same GPU"
    updates, notes = {}, []
    if provider is not None and new_provider != old_provider:
        updates["pod.provider"] = new_provider
        notes.append(f"  pod.provider {old_provider} -> {new_provider}")
    if new_gpu != old_gpu:
        updates["pod.gpu"] = new_gpu
        notes.append(f"  pod.gpu {old_gpu!r} -> {new_gpu!r} ({why})")
    out = dict(raw, pod={**pod, **{k.partition(".")[2]: v for k, v in updates.items()}})
    return PodChange(out, updates, tuple(notes))


def adopt_observation(settings: Settings, generation: str, colo_code: str | None) -> Settings:
    """Settings whose generation carries the colo the probe observed (for an adopted object)."""
    if not colo_code:
        return settings
    gens = tuple(replace(g, observed_colo=colo_code.upper()) if g.name == generation else g
                 for g in settings.ledger.generations)
    return replace(settings, ledger=Ledger(gens))


def plan_pair(before: Settings, after: Settings) -> tuple[CellPlan, CellPlan]:
    return plan_cell(before), plan_cell(after)
