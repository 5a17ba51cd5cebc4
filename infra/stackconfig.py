"""What the cell program and the fleet program both read from Pulumi and Cloudflare before
declaring anything: the stack's raw config, the API token's presence, the zone, the live
Durable Object migration tag, and the migrations block of an upload.

Every problem surfaces as ``ProgramError`` (a ``pulumi.RunError``: a clean message, no trace) before any
resource is declared.
"""

from __future__ import annotations

import os

import pulumi
import pulumi_cloudflare as cloudflare

from colocate.cell.settings import KEYS, NS, PROVIDER_SECRET, ZoneSettings
from colocate.errors import MissingSetting

from .errors import ProgramError

OBJECT_KEYS = {name for name, key in KEYS.items() if key.type in ("object", "array")}
TOKEN_KEY = "cloudflare:apiToken"


def raw_config() -> tuple[dict, dict[str, pulumi.Output[str]]]:
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
                raise ProgramError(f"{NS}:{name}: is stored in plain text (got [not shown]). "
                                      f"Fix: pulumi config set --secret {NS}:{name} <value>")
            secrets[name] = cfg.require_secret(name)
        elif name in OBJECT_KEYS:
            raw[name] = cfg.get_object(name)
        else:
            raw[name] = cfg.get(name)
    return raw, secrets


def require_api_token() -> None:
    """Raises MissingSetting (a ConfigError) when neither cloudflare:apiToken nor
    CLOUDFLARE_API_TOKEN is set: the provider and scripts/placement.py need one."""
    if not (pulumi.runtime.get_config(TOKEN_KEY) or os.environ.get("CLOUDFLARE_API_TOKEN")):
        raise MissingSetting(TOKEN_KEY, None, "the Cloudflare API token is not set",
                             f"pulumi config set --secret {TOKEN_KEY} <token> (or export CLOUDFLARE_API_TOKEN)")


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
        if field(entry, "id") == script:
            return field(entry, "migration_tag") or ""
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
    ids = [field(r, "id") for r in found.results or [] if field(r, "name") == zone.name]
    if zone.id in ids:
        return
    if ids:
        raise ProgramError(
            f"{key}.id: {zone.id!r} is not the id of zone {zone.name} (Cloudflare gives {ids[0]!r}). "
            f"Fix: pulumi config set --path {key}.id {ids[0]}")
    raise ProgramError(
        f"{key}.name: Cloudflare has no zone {zone.name!r} that cloudflare:apiToken can read (zone id {zone.id!r} "
        f"in the stack). Fix: set both to a zone of your account, from its Overview page (pulumi config set --path "
        f"{key}.name <domain>; pulumi config set --path {key}.id <Zone ID>), and give the token Zone Read and "
        "DNS Edit on it")


def field(entry, name: str):
    """``name`` of an invoke's result entry: typed results expose attributes; a plain
    mapping (as some engines return) uses camelCase."""
    camel = "".join(w.capitalize() if i else w for i, w in enumerate(name.split("_")))
    if isinstance(entry, dict):
        return entry.get(name, entry.get(camel))
    return getattr(entry, name, None)


def migrations_args(m: dict | None) -> cloudflare.WorkersScriptMigrationsArgs | None:
    """The upload's migrations block from a plan's ``{old_tag, new_tag, steps}``; None when
    nothing is pending: the upload then carries no migrations block, as wrangler's does."""
    if m is None:
        return None
    steps = [cloudflare.WorkersScriptMigrationsStepArgs(**step) for step in m["steps"]]
    return cloudflare.WorkersScriptMigrationsArgs(old_tag=m["old_tag"], new_tag=m["new_tag"], steps=steps)
