"""The Pulumi program: read settings once, plan the cell, declare it, export outputs.

Every configuration error surfaces as ``pulumi.RunError`` (a clean message, no trace)
before any resource is declared.
"""

from __future__ import annotations

import os

import pulumi
import pulumi_cloudflare as cloudflare

from colocate import fleet, outputs
from colocate.errors import ConfigError, MissingSetting
from colocate.plan import PATH_LOCAL_HOSTNAME, PLACEMENT_POD, CellPlan, plan_cell
from colocate.settings import KEYS, NS, PROVIDER_SECRET, Settings, ZoneSettings, parse

from .cell import Cell, CellArgs

OBJECT_KEYS = {name for name, key in KEYS.items() if key.type in ("object", "array")}


def _raw_config() -> tuple[dict, dict[str, pulumi.Output[str]]]:
    """Plain values for the plan, secret values as Outputs (never unwrapped here)."""
    cfg = pulumi.Config(NS)
    raw: dict = {}
    secrets: dict[str, pulumi.Output[str]] = {}
    # Keys the kit does not know are passed through so that parse() refuses them by name
    # (a stray colocate:podRegion must fail, not be silently ignored). The SDK has no
    # public way to list config keys; these two are where it keeps them.
    known = set(pulumi.runtime.config.CONFIG.get()) | set(pulumi.runtime.config.get_config_env())
    for full in sorted(k for k in known if k.startswith(NS + ":")):
        name = full[len(NS) + 1:]
        if name not in KEYS:
            raw[name] = pulumi.runtime.get_config(full)
    for name, key in KEYS.items():
        present = pulumi.runtime.get_config(f"{NS}:{name}") not in (None, "")
        if not present:
            continue
        if key.secret or name in {k for k, _ in PROVIDER_SECRET.values()}:
            if key.secret and not pulumi.runtime.is_config_secret(f"{NS}:{name}"):
                # Pulumi.yaml cannot mark it secret (projectfile.py says why): refused here.
                raise pulumi.RunError(f"{NS}:{name}: is stored in plain text (got [not shown]). "
                                      f"Fix: pulumi config set --secret {NS}:{name} <value>")
            secrets[name] = cfg.require_secret(name)
        elif name in OBJECT_KEYS:
            raw[name] = cfg.get_object(name)
        else:
            raw[name] = cfg.get(name)
    return raw, secrets


def load_settings() -> tuple[Settings, dict[str, pulumi.Output[str]]]:
    raw, secrets = _raw_config()
    try:
        settings = parse(raw, pulumi.get_stack(), secrets=frozenset(secrets), env=dict(os.environ))
        if not (pulumi.runtime.get_config("cloudflare:apiToken") or os.environ.get("CLOUDFLARE_API_TOKEN")):
            raise MissingSetting("cloudflare:apiToken", None, "the Cloudflare API token is not set",
                                 "pulumi config set --secret cloudflare:apiToken <token> (or export CLOUDFLARE_API_TOKEN)")
    except ConfigError as err:
        raise pulumi.RunError(str(err)) from None
    return settings, secrets


def live_migration_tag(account_id: str, script: str) -> str:
    """The Durable Object migration tag Cloudflare last applied to ``script``; "" when the
    script does not exist yet (first deploy) or has applied none.

    One invoke, cloudflare:index/getWorkersScripts (pulumi-cloudflare 6.23.1:
    ``results[].id`` is the script name, ``results[].migration_tag`` the tag); it runs in
    ``pulumi preview`` too. A failed read is not caught: the SDK records a failed invoke
    and fails the update anyway, and stopping here, before any resource is declared, is
    the only outcome that cannot upload with a guessed tag. The stack file's tag is the
    fallback only where Cloudflare is not asked (the sandbox, ``migrate.py plan``).
    """
    found = cloudflare.get_workers_scripts(account_id=account_id)
    for entry in found.results or []:
        if _field(entry, "id") == script:
            return _field(entry, "migration_tag") or ""
    return ""


def check_zone(zone: ZoneSettings) -> None:
    """``colocate:zone`` must be a zone the API token can read, with the id and the name the
    stack gives it. One invoke, cloudflare:index/getZones:getZones filtered by name
    (pulumi-cloudflare 6.23.1: ``results[].id``/``.name``), in ``pulumi preview`` too. A
    list, not a get by id: a missing zone is an empty list this program can explain, not a
    failed invoke. Without it a placeholder or mistyped zone fails only at the pod's DNS
    record, after the pods are rented and healthy."""
    key = f"{NS}:zone"
    found = cloudflare.get_zones(name=zone.name)
    ids = [_field(r, "id") for r in found.results or [] if _field(r, "name") == zone.name]
    if zone.id in ids:
        return
    if ids:
        raise pulumi.RunError(
            f"{key}.id: {zone.id!r} is not the id of zone {zone.name} (Cloudflare gives {ids[0]!r}). "
            f"Fix: pulumi config set --path {key}.id {ids[0]}")
    raise pulumi.RunError(
        f"{key}.name: Cloudflare has no zone {zone.name!r} that cloudflare:apiToken can read (zone id {zone.id!r} "
        f"in the stack). Fix: set both to a zone of your account, from its Overview page (pulumi config set --path "
        f"{key}.name <domain>; pulumi config set --path {key}.id <Zone ID>), and give the token Zone Read and "
        "DNS Edit on it")


def _field(entry, name: str):
    # Typed results expose attributes; a plain mapping (as some engines return) uses camelCase.
    camel = "".join(w.capitalize() if i else w for i, w in enumerate(name.split("_")))
    if isinstance(entry, dict):
        return entry.get(name, entry.get(camel))
    return getattr(entry, name, None)


def plan() -> tuple[CellPlan, dict[str, pulumi.Output[str]]]:
    settings, secrets = load_settings()
    if settings.zone is not None:
        check_zone(settings.zone)
    try:
        cell_plan = plan_cell(settings, live_migration_tag=live_migration_tag(settings.account_id, settings.worker.name))
    except ConfigError as err:
        raise pulumi.RunError(str(err)) from None
    if cell_plan.worker.placement_mode == PLACEMENT_POD and cell_plan.pod_path == PATH_LOCAL_HOSTNAME:
        # The plan lets the sandbox place by its stand-in (localhost); a deployed Worker
        # would have Cloudflare probe "localhost", which is no place at all.
        raise pulumi.RunError(
            f"{NS}:worker.placement: 'pod' places the Worker by pod 0's address, and a local pod's address is "
            f"localhost, which Cloudflare cannot probe (got 'pod' with colocate:pod.provider local). Fix: run this "
            f"stack in the sandbox (.venv/bin/python scripts/sandbox.py up --stack {settings.stack}), or pulumi "
            f"config set --path {NS}:worker.placement targeted")
    if cell_plan.worker.migration_warning:
        pulumi.log.warn(cell_plan.worker.migration_warning)
    return cell_plan, secrets


def _total_cost(pods: list[dict]) -> float | None:
    costs = [p.get("cost_per_hr") for p in pods]
    return None if any(c is None for c in costs) else round(sum(costs), 4)


def is_fleet_stack() -> bool:
    """A stack whose colocate:fleet is set is a fleet stack (colocate/fleet.py)."""
    return fleet.is_fleet({"fleet": pulumi.Config(NS).get_object("fleet")})


def main() -> dict[str, pulumi.Input]:
    """Declare the cell (or, on a fleet stack, the front door) and export its outputs;
    returns the exports (tests read them)."""
    if is_fleet_stack():
        from .fleet import main as fleet_main

        return fleet_main()
    cell_plan, secrets = plan()
    pod_env = {}
    key_name, env_name = PROVIDER_SECRET.get(cell_plan.pod_settings.provider, (None, None))
    if key_name in secrets:
        pod_env[env_name] = secrets[key_name]
    elif env_name and os.environ.get(env_name):
        pod_env[env_name] = pulumi.Output.secret(os.environ[env_name])
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
        outputs.PROBE_TOKEN: pulumi.Output.secret(secrets["probeToken"]),
        outputs.REGION: cell_plan.region.name,  # what a fleet stack reads
    }
    for key, value in exports.items():
        pulumi.export(key, value)
    return exports
