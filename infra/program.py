"""The Pulumi program: read settings once, plan the cell, declare it, export outputs.

Every configuration error surfaces as ``ProgramError`` (a ``pulumi.RunError``: a clean message, no trace)
before any resource is declared.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pulumi
import pulumi_cloudflare as cloudflare

from colocate.cell import outputs, preflight as preflight_mod
from colocate.cell.plan import PATH_ENDPOINT, PATH_LOCAL_HOSTNAME, PATH_ZONE_DNS, PLACEMENT_POD, CellPlan, plan_cell, pod_scope
from colocate.cell.settings import MAX_PODS, NS, PROVIDER_SECRET, ScaleSettings, Settings, parse, parse_replaced
from colocate.errors import ConfigError
from colocate.fleet import plan as fleet
from colocate.scaling import signals
from colocate.scaling.signals import SCALE_STEP_ENV

from . import fleet as fleet_program
from .cell import Cell, CellArgs
from .errors import ProgramError
from .stackconfig import TOKEN_KEY, check_zone, field, live_migration_tag, raw_config, require_api_token

PREFLIGHT_ENV = "COLOCATE_PREFLIGHT"  # "off" skips the token check (to debug the check itself)
SCALE_FROM_ENV = "COLOCATE_SCALE_FROM"  # "stack": apply the stack file's scale.pods, not the generation's
WORKER_URL_ENV = "COLOCATE_WORKER_URL"  # where the live Worker is read (tests: a local one; default the plan's URL)


def load_settings() -> tuple[Settings, dict[str, pulumi.Output[str]]]:
    raw, secrets = raw_config()
    try:
        settings = parse(raw, pulumi.get_stack(), secrets=frozenset(secrets), env=dict(os.environ))
        require_api_token()
    except ConfigError as err:
        raise ProgramError(str(err)) from None
    return settings, secrets


def plan() -> tuple[CellPlan, dict[str, pulumi.Output[str]]]:
    settings, secrets = load_settings()
    if settings.zone is not None:
        check_zone(settings.zone)
    tag = live_migration_tag(settings.account_id, settings.worker.name)
    # Two projects or organizations with a stack of this name on one provider account keep apart.
    scope = pod_scope(pulumi.get_organization(), pulumi.get_project())
    try:
        cell_plan = plan_cell(settings, live_migration_tag=tag, scope=scope)
        state = live_state(settings, cell_plan)
        before = settings
        if settings.scale is not None:
            scale = live_scale(settings, state)
            settings = replace(settings, scale=scale, pod=replace(settings.pod, count=scale.declared))
        settings = replace(settings, pod=replace(settings.pod, replaced=live_replaced(settings, state)))
        if settings != before:
            cell_plan = plan_cell(settings, live_migration_tag=tag, scope=scope)
    except ConfigError as err:
        raise ProgramError(str(err)) from None
    if os.environ.get(SCALE_STEP_ENV) == "1":  # the scaling controller's update: a softened probe
        cell_plan = replace(cell_plan, probe=replace(cell_plan.probe, step=True))
    if cell_plan.worker.placement_mode == PLACEMENT_POD and cell_plan.pod_path == PATH_LOCAL_HOSTNAME:
        # The plan lets the sandbox place by its stand-in (localhost); a deployed Worker
        # would have Cloudflare probe "localhost", which is no place at all.
        raise ProgramError(
            f"{NS}:worker.placement: 'pod' places the Worker by pod 0's address, and a local pod's address is "
            f"localhost, which Cloudflare cannot probe (got 'pod' with colocate:pod.provider local). Fix: run this "
            f"stack in the sandbox (.venv/bin/python scripts/sandbox.py up --stack {settings.stack}), or pulumi "
            f"config set --path {NS}:worker.placement targeted")
    if cell_plan.worker.migration_warning:
        pulumi.log.warn(cell_plan.worker.migration_warning)
    if settings.credential_warning:
        pulumi.log.warn(settings.credential_warning)
    return cell_plan, secrets


def script_exists(account_id: str, script: str) -> bool:
    """Whether Cloudflare has the Worker (cloudflare:index/getWorkersScripts, as live_migration_tag)."""
    found = cloudflare.get_workers_scripts(account_id=account_id)
    return any(field(entry, "id") == script for entry in found.results or [])


def live_state(settings: Settings, cell_plan: CellPlan) -> dict | None:
    """The live generation's ``GET /_colocate/scale``: what the controller recorded for every `pulumi
    up` to apply (``desired``: the pod count and ``replaced``, the keeper's replacements of single
    pods), so no checkout applies a stale stack file (deleting the controller's pods undrained,
    undoing a drain, or renaming a pod the keeper replaced back to a name no pod carries). None where
    nothing can be recorded yet: before the Worker exists (a first deploy), under the test mocks,
    and with ``COLOCATE_SCALE_FROM=stack``. A Worker that exists but cannot be read stops the update
    of a scaled cell (guessing could delete serving pods); a fixed cell's goes on from its stack file
    with a warning (at worst a pod the keeper replaced is replaced once more)."""
    if os.environ.get(SCALE_FROM_ENV) == "stack":
        pulumi.log.warn(f"{SCALE_FROM_ENV}=stack: applying the stack file's colocate:scale and colocate:pod.replaced, "
                        "not what the scaling controller recorded")
        return None
    override = os.environ.get(WORKER_URL_ENV)
    if override is None and _under_mocks():
        return None
    if override is None and not script_exists(settings.account_id, cell_plan.worker.script_name):
        return None  # a first deploy: nothing recorded anywhere yet
    url = (override or cell_plan.worker.url).rstrip("/")
    # The role that reads: readToken, or on a stack still on the one old token (deprecated,
    # settings.credential_warning), probeToken, which the Worker binds then (plan.worker_bindings).
    token = pulumi.runtime.get_config(f"{NS}:{settings.operator_secrets['read']}") or ""
    try:
        return signals.CellClient(url, token).state()
    except (OSError, ValueError) as err:
        if settings.scale is None:
            pulumi.log.warn(f"{NS}:pod.replaced: what the keeper recorded could not be read from {url}/_colocate/scale "
                            f"({err}); applying the stack file's")
            return None
        scale = settings.scale
        raise ProgramError(
            f"{NS}:scale: the scaling controller's pod count could not be read from {url}/_colocate/scale ({err}); "
            f"applying the stack file's {scale.pods}+{scale.draining} could delete pods that serve, undrained. Fix: check "
            f"that the Worker answers (.venv/bin/python scripts/probe.py {url}), or, knowing no controller runs, "
            f"{SCALE_FROM_ENV}=stack pulumi up") from None


def live_scale(settings: Settings, state: dict | None) -> ScaleSettings:
    """The pod count to declare: the one the scaling controller recorded in the live generation
    (``desired``), clamped to the policy. The stack file's ``scale.pods``/``.draining`` count only
    where no controller recorded one (``state`` None, or a generation it has not written yet)."""
    scale = settings.scale
    assert scale is not None
    desired = signals.desired_of(state) if state is not None else None
    if desired is None:
        return scale
    pods = min(max(desired[0], scale.min), scale.max)
    draining = max(0, min(desired[1], MAX_PODS - pods))
    if (pods, draining) != (scale.pods, scale.draining):
        pulumi.log.info(f"{NS}:scale: {pods} pod(s) in rotation and {draining} draining, as the scaling controller "
                        f"recorded in generation {state.get('generation')} (the stack file says {scale.pods}+"
                        f"{scale.draining})")
    return replace(scale, pods=pods, draining=draining)


def live_replaced(settings: Settings, state: dict | None) -> tuple[tuple[int, int], ...]:
    """colocate:pod.replaced to declare: per pod, the larger of the stack file's count and the one the
    keeper recorded in the generation (counts only grow: the larger is the later)."""
    counts = dict(settings.pod.replaced)
    recorded = ((state or {}).get("desired") or {}).get("replaced")
    if isinstance(recorded, dict):
        try:
            live = dict(parse_replaced(f"{NS}:pod.replaced", recorded))
        except ConfigError:
            live = {}
        for index, n in live.items():
            counts[index] = max(counts.get(index, 0), n)
    return tuple(sorted(counts.items()))


def _under_mocks() -> bool:
    """Whether the program runs under ``pulumi.runtime.set_mocks`` (the tests), not an engine."""
    monitor = getattr(pulumi.runtime.settings.SETTINGS, "monitor", None)
    return type(monitor).__name__ == "MockMonitor"


def shape_of(cell_plan: CellPlan) -> preflight_mod.Shape:
    acme = cell_plan.mtls and cell_plan.pod_path in (PATH_ZONE_DNS, PATH_ENDPOINT)
    return preflight_mod.Shape(zone=cell_plan.worker.zone_id is not None, mtls=cell_plan.mtls, acme=acme,
                               acme_names=tuple(p.tls_name for p in cell_plan.pods) if acme else (),
                               acme_server=cell_plan.acme_server or "")


def preflight(cell_plan: CellPlan) -> None:
    """The token's permissions and the zone's features, before any resource (a pod first of all)
    is declared, in preview and up alike (colocate/cell/preflight.py). Under the test mocks it runs
    only against a server named by CLOUDFLARE_API_BASE."""
    if os.environ.get(PREFLIGHT_ENV, "").lower() == "off":
        pulumi.log.warn(f"{PREFLIGHT_ENV}=off: the Cloudflare token's permissions are not checked before pods are rented")
        return
    base = os.environ.get(preflight_mod.BASE_ENV)
    if base is None and _under_mocks():
        return
    base = base or preflight_mod.API_BASE
    token = pulumi.runtime.get_config(TOKEN_KEY) or os.environ.get("CLOUDFLARE_API_TOKEN", "")
    get = preflight_mod.http_get(base, token)
    try:
        problems = preflight_mod.check(shape_of(cell_plan), cell_plan.worker.account_id, cell_plan.worker.zone_id, get)
    except OSError as err:
        raise ProgramError(f"preflight: Cloudflare's API ({base}) could not be read to check the token's permissions "
                           f"({err}). Fix: check the network and run again; {PREFLIGHT_ENV}=off skips the check") from None
    if problems:
        raise ProgramError(preflight_mod.message(problems))


def require_https(url: str) -> str:
    """The fallback API is called with the owner's key and the clients' prompts: never in
    plain text. (The sandbox's local fallback is http; the sandbox never runs this program.)"""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme != "https":
        raise ProgramError(f"{NS}:fallbackUrl: must be an https:// URL (got a secret value whose scheme is "
                              f"{scheme or 'missing'!r}). "
                              f"Fix: pulumi config set --secret {NS}:fallbackUrl https://<the API's host>")
    return url


def _total_cost(pods: list[dict]) -> float | None:
    costs = [p.get("cost_per_hr") for p in pods]
    return None if any(c is None for c in costs) else round(sum(costs), 4)


def is_fleet_stack() -> bool:
    """A stack whose colocate:fleet is set is a fleet stack (colocate/fleet/plan.py)."""
    return fleet.is_fleet({"fleet": pulumi.Config(NS).get_object("fleet")})


def main() -> dict[str, pulumi.Input]:
    """Declare the cell (or, on a fleet stack, the front door) and export its outputs;
    returns the exports (tests read them)."""
    if is_fleet_stack():
        return fleet_program.main()
    cell_plan, secrets = plan()
    preflight(cell_plan)
    secrets = {**secrets, "fallbackUrl": secrets["fallbackUrl"].apply(require_https)}
    pod_env = {}
    key_name, env_name = PROVIDER_SECRET.get(cell_plan.pod_settings.provider, (None, None))
    if key_name in secrets:
        pod_env[env_name] = secrets[key_name]
    # A key only in the environment is not declared: the commands inherit the environment of
    # the `pulumi` that runs them, so a delete uses the key exported now, not one saved at
    # create and maybe revoked since (docs/pods.md, "Rotating a provider key").
    cf_token = pulumi.Config("cloudflare").get_secret("apiToken") or pulumi.Output.secret(
        os.environ.get("CLOUDFLARE_API_TOKEN", ""))  # load_settings refused a stack with neither
    cell = Cell(cell_plan.stack, CellArgs(plan=cell_plan, secrets=secrets, pod_environment=pod_env,
                                          cloudflare_token=cf_token))

    exports = {
        outputs.WORKER_URL: cell.worker_url,
        outputs.WORKER_NAME: cell_plan.worker.script_name,
        outputs.POD_ID: cell.pod.apply(lambda p: p.get("id")),
        outputs.POD_LOCATION: cell.pod.apply(lambda p: p.get("location")),
        outputs.POD_COST_PER_HR: cell.pod.apply(lambda p: p.get("cost_per_hr")),
        outputs.POD_URL: cell.pod.apply(lambda p: p.get("url")),
        outputs.POD_IDS: cell.pods.apply(lambda pods: [p.get("id") for p in pods]),
        outputs.POD_LOCATIONS: cell.pods.apply(lambda pods: [p.get("location") for p in pods]),
        outputs.PODS_COST_PER_HR: cell.pods.apply(_total_cost),
        outputs.POD_PATH: cell_plan.pod_path,
        outputs.ACTIVE_GENERATION: cell_plan.state.active.name,
        outputs.ACTIVE_HINT: cell_plan.state.hint,
        outputs.DRAINING_GENERATION: cell_plan.state.draining.name if cell_plan.state.draining else None,
        outputs.PLACEMENT: ({"host": cell.placement_host} if cell.placement_host is not None
                            else cell_plan.worker.placement),
        outputs.PLACEMENT_MODE: cell_plan.worker.placement_mode,
        outputs.PLACEMENT_HOST: cell.placement_host,
        outputs.PROBE_VERDICT: cell.probe_result.apply(lambda r: r.get("verdict")),
        **{outputs.OPERATOR_TOKENS[b.name]: pulumi.Output.secret(secrets[b.secret])
           for b in cell_plan.worker.bindings if b.name in outputs.OPERATOR_TOKENS},
        outputs.REGION: cell_plan.region.name,  # what a fleet stack reads
        outputs.ACCOUNT_ID: cell_plan.worker.account_id,
        outputs.BUDGET_E2E_MS: cell_plan.probe.budgets.get("e2e"),
        outputs.HOP_NOT_AFTER: cell.hop.not_after() if cell.hop is not None else None,
        outputs.POD_SCOPE: cell_plan.scope,
        # What the keeper reads (colocate/scaling/keeper.py): the code this update uploads, where each pod was
        # when it served (a pod found elsewhere was remapped), and when each role's certificate ends.
        outputs.WORKER_CONTENT_HASH: cell_plan.worker.content_hash(),
        outputs.POD_ADDRESSES: cell.pods.apply(lambda pods: [{"ip": p.get("ip"), "port": p.get("port")} for p in pods]),
        outputs.HOP_CERTS: cell.hop.by_role() if cell.hop is not None else None,
    }
    for key, value in exports.items():
        pulumi.export(key, value)
    return exports
