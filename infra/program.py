"""The Pulumi program: read settings once, plan the cell, declare it, export outputs.

Every configuration error surfaces as ``pulumi.RunError`` (a clean message, no trace)
before any resource is declared.
"""

from __future__ import annotations

import os

import pulumi

from colocate import outputs
from colocate.errors import ConfigError, MissingSetting
from colocate.plan import CellPlan, plan_cell
from colocate.settings import KEYS, NS, PROVIDER_SECRET, Settings, parse

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


def plan() -> tuple[CellPlan, dict[str, pulumi.Output[str]]]:
    settings, secrets = load_settings()
    try:
        return plan_cell(settings), secrets
    except ConfigError as err:
        raise pulumi.RunError(str(err)) from None


def main() -> dict[str, pulumi.Input]:
    """Declare the cell and export its outputs; returns the exports (tests read them)."""
    cell_plan, secrets = plan()
    pod_env = {}
    key_name, env_name = PROVIDER_SECRET.get(cell_plan.pod.settings.provider, (None, None))
    if key_name in secrets:
        pod_env[env_name] = secrets[key_name]
    elif env_name and os.environ.get(env_name):
        pod_env[env_name] = pulumi.Output.secret(os.environ[env_name])
    cell = Cell(cell_plan.stack, CellArgs(plan=cell_plan, secrets=secrets, pod_environment=pod_env))

    exports = {
        outputs.WORKER_URL: cell.worker_url,
        outputs.WORKER_NAME: cell_plan.worker.script_name,
        outputs.POD_ID: cell.pod.apply(lambda p: p.get("id")),
        outputs.POD_LOCATION: cell.pod.apply(lambda p: p.get("location")),
        outputs.POD_COST_PER_HR: cell.pod.apply(lambda p: p.get("cost_per_hr")),
        outputs.POD_URL: cell.pod.apply(lambda p: p.get("url")),
        outputs.ACTIVE_GENERATION: cell_plan.state.active.name,
        outputs.ACTIVE_HINT: cell_plan.state.hint,
        outputs.DRAINING_GENERATION: cell_plan.state.draining.name if cell_plan.state.draining else None,
        outputs.PLACEMENT: cell_plan.worker.placement,
        outputs.PROBE_VERDICT: cell.probe_result.apply(lambda r: r.get("verdict")),
        outputs.PROBE_TOKEN: pulumi.Output.secret(secrets["probeToken"]),
    }
    for key, value in exports.items():
        pulumi.export(key, value)
    return exports
