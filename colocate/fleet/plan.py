"""A fleet: several cells behind one front door. Settings, validation and the ranking; pure.

A **fleet stack** is a stack of this project whose config has ``colocate:fleet`` (a
non-empty mapping). It names its member cells (existing cell stacks) and deploys one
Worker, the front door, with no placement, bound to each cell's Worker by service binding.
What the fleet knows of a cell (its Worker's name, URL and region) comes from the cell
stack's outputs (``pulumi.StackReference`` in ``infra/fleet.py``), never from a copy.

Keys of a fleet stack (``FLEET_KEYS``)::

    colocate:fleet      {cells: [stack, ...], rememberMs: 5000, exchangeMs: 1000, affinity: nearest}
    colocate:accountId  the Cloudflare account
    colocate:worker     only name, subdomain and maxBodyBytes (the front door's)
    colocate:zone       optional: {id, name, workerHostname} for a custom domain

A cell's own keys (region, generations, pod, secrets, ...) are refused on a fleet stack
when they hold anything but their project default: a fleet has no region of its own.

The ranking: for every Cloudflare colo with coordinates, the member cells ordered by the
physical floor (``geo.floor_ms``) from that colo to the cell's edge site (where a Worker
placed in the cell's region runs, the site the probe's floors start from); ties keep the
order of ``colocate:fleet.cells``, which is also the order for a colo the table lacks.
A colo's list is cut to the cells within its nearest cell's e2e budget (``within_budget``, from
each member's ``budgetE2eMs`` output), so a user is never sent farther than its own cell allows.
It is uploaded as the front door's module ``cellrank.js`` ({colo: [cell index, ...]}, made
by the plan in place of the kit's empty one), beside the ``CELLS`` binding ([{name,
region}], index = position = service binding ``CELL_<i>``). A module, not a binding: the
table grows with every cell past Cloudflare's 5 KB per environment variable.

Fleet-wide limits: the front door's Durable Object ``FleetLedger`` (binding ``LEDGER``,
its own migration list ``LEDGER_MIGRATIONS``) exchanges the cells' limit counters every
``exchangeMs`` through their operator endpoints, so the front door holds each cell's
exchange token (``CELL_TOKEN_<i>``, secret, from the cell stack's ``exchangeToken`` output).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .. import stackfile
from ..cell import cloudflare_limits, geo, outputs
from ..cell.catalogue import Region, region as lookup_region
from ..cell.plan import COMPATIBILITY_DATE, WORKER_DIR, Binding, Module, migration_decision, module_closure
from ..cell.settings import CELL_SECRETS, KEYS, NS, PROVIDER_SECRET, WORKER_DEFAULTS, ZoneSettings, parse_zone
from ..errors import ConfigError, MissingSetting

KEY = f"{NS}:fleet"
FLEET_DEFAULTS = {"cells": [], "rememberMs": 5000, "exchangeMs": 1000, "affinity": "nearest"}
# colocate:fleet.affinity: nearest (each request to the nearest cell that can serve it), or
# conversation (a conversation stays in one of the cells within budget: docs/fleet.md).
AFFINITIES = ("nearest", "conversation")
MAX_CELLS = 16
MAX_REMEMBER_MS = 60_000
MIN_EXCHANGE_MS, MAX_EXCHANGE_MS = 100, 60_000
LEDGER_CLASS = "FleetLedger"
LEDGER_BINDING = "LEDGER"
# The front door's Durable Object migrations (its own script, its own tags), as plan.MIGRATIONS for a cell.
LEDGER_MIGRATIONS: tuple[tuple[str, dict], ...] = (("v1", {"new_sqlite_classes": [LEDGER_CLASS]}),)
FLEET_KEYS = ("fleet", "accountId", "worker", "zone")
FRONT_WORKER_KEYS = ("name", "subdomain", "maxBodyBytes")
FRONT_MAIN_MODULE = "frontindex.js"  # exports front.js's handler and the FleetLedger class
RANK_MODULE = "cellrank.js"  # the ranking; the plan's replaces the kit's empty one
# What the fleet reads from each member stack (names in colocate/cell/outputs.py).
MEMBER_OUTPUTS = (outputs.WORKER_NAME, outputs.WORKER_URL, outputs.REGION, outputs.ACCOUNT_ID)
# Read when present: a cell deployed by an older kit lacks it (then no cell is cut for its users).
OPTIONAL_MEMBER_OUTPUTS = (outputs.BUDGET_E2E_MS,)
# A stack name as `pulumi stack init` takes it, optionally qualified as org/project/stack.
_STACK = re.compile(r"([A-Za-z0-9_.-]+/){0,2}[A-Za-z0-9_.-]+")
_SCRIPT = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_ACCOUNT = re.compile(r"[0-9a-f]{32}")


def is_fleet(raw: Mapping) -> bool:
    """A stack whose ``colocate:fleet`` is a non-empty mapping is a fleet stack."""
    value = raw.get("fleet")
    return isinstance(value, Mapping) and bool(value)


@dataclass(frozen=True)
class FleetSettings:
    stack: str
    account_id: str
    cells: tuple[str, ...]  # member stack names, as configured
    remember_ms: int
    exchange_ms: int
    worker_name: str
    subdomain: str
    max_body_bytes: int
    zone: ZoneSettings | None
    affinity: str = "nearest"  # one of AFFINITIES


def _unset(name: str, value: object) -> bool:
    """The value a stack holds when the key was never set (its project default)."""
    return value in (None, "", [], {}) or value == KEYS[name].default


def _whole(key: str, value: object, minimum: int, maximum: int) -> int:
    n = int(value) if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()) else value
    if isinstance(n, bool) or not isinstance(n, int) or not minimum <= n <= maximum:
        raise ConfigError(key, value, f"must be a whole number from {minimum} to {maximum}",
                          f"pulumi config set --path {key} <{minimum}..{maximum}>")
    return n


def short_name(stack: str) -> str:
    """The cell's name as the front door reports it (``x-colocate-cell``): the stack's own name."""
    return stack.rsplit("/", 1)[-1]


def parse_cells(value: object, stack: str) -> tuple[str, ...]:
    key = f"{KEY}.cells"
    fix = f"pulumi config set --path '{key}[0]' apac-jp (one entry per cell stack of this project)"
    if not isinstance(value, list) or not value:
        raise MissingSetting(key, value, "a fleet names at least one member cell stack", fix)
    if len(value) > MAX_CELLS:
        raise ConfigError(key, value, f"a fleet has at most {MAX_CELLS} cells", "remove cells from the list")
    seen: dict[str, int] = {}
    for i, name in enumerate(value):
        if not isinstance(name, str) or not _STACK.fullmatch(name):
            raise ConfigError(f"{key}[{i}]", name, "must be a stack name (letters, digits, '-', '_', '.'; "
                              "optionally org/project/stack)", fix)
        short = short_name(name)
        if short == stack:
            raise ConfigError(f"{key}[{i}]", name, "a fleet cannot be its own member",
                              f"name the cell stacks, not {stack}")
        if short in seen:
            raise ConfigError(f"{key}[{i}]", name, f"names the same cell as {key}[{seen[short]}]",
                              f"pulumi config rm --path '{key}[{i}]'")
        seen[short] = i
    return tuple(value)


def parse(raw: Mapping, stack: str, secrets: frozenset[str] | set[str] = frozenset()) -> FleetSettings:
    """Validate a fleet stack's raw ``colocate:*`` values (keys without the namespace)."""
    for name in sorted(raw):
        if name in FLEET_KEYS:
            continue
        if name not in KEYS:
            raise ConfigError(f"{NS}:{name}", raw[name], "unknown key", f"a fleet stack takes only "
                              f"{', '.join(f'{NS}:{k}' for k in FLEET_KEYS)}")
        if not _unset(name, raw[name]):
            raise ConfigError(f"{NS}:{name}", raw[name], "is a cell's key; a fleet stack has no region, pods or "
                              "state of its own (its cells do)", f"pulumi config rm {NS}:{name} -s {stack}")
    cell_secrets = sorted(set(secrets) & {*CELL_SECRETS, *(k for k, _ in PROVIDER_SECRET.values())})
    if cell_secrets:
        name = cell_secrets[0]
        raise ConfigError(
            f"{NS}:{name}",
            "[secret]",
            "is a cell's secret; the front door holds none of its own (the cells "
            "check client keys; their exchange tokens are read from their stacks)",
            f"pulumi config rm {NS}:{name} -s {stack}",
        )
    fleet = raw.get("fleet")
    if not isinstance(fleet, Mapping):
        raise ConfigError(
            KEY,
            fleet,
            "must be a mapping {cells: [...], rememberMs, exchangeMs, affinity}",
            f"pulumi config set --path '{KEY}.cells[0]' apac-jp",
        )
    unknown = sorted(set(fleet) - set(FLEET_DEFAULTS))
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]}", fleet[unknown[0]], "unknown key", f"use only {', '.join(FLEET_DEFAULTS)}")
    merged = {**FLEET_DEFAULTS, **fleet}
    cells = parse_cells(merged["cells"], stack)
    remember = _whole(f"{KEY}.rememberMs", merged["rememberMs"], 0, MAX_REMEMBER_MS)
    exchange = _whole(f"{KEY}.exchangeMs", merged["exchangeMs"], MIN_EXCHANGE_MS, MAX_EXCHANGE_MS)
    affinity = merged["affinity"]
    if affinity not in AFFINITIES:
        raise ConfigError(f"{KEY}.affinity", affinity, f"must be one of {', '.join(AFFINITIES)}",
                          f"pulumi config set --path {KEY}.affinity conversation")

    account = raw.get("accountId")
    if not isinstance(account, str) or not _ACCOUNT.fullmatch(account):
        problem = "is not set" if account in (None, "") else "must be 32 lower-case hex characters"
        raise MissingSetting(
            f"{NS}:accountId", account, problem, f"pulumi config set {NS}:accountId <id from the Cloudflare dashboard>"
        )

    worker = raw.get("worker") or {}
    wkey = f"{NS}:worker"
    if not isinstance(worker, Mapping):
        raise ConfigError(wkey, worker, "must be a mapping", f"pulumi config set --path {wkey}.subdomain <subdomain>")
    for sub in sorted(worker):
        if sub not in WORKER_DEFAULTS:
            raise ConfigError(f"{wkey}.{sub}", worker[sub], "unknown key", f"a fleet uses only {', '.join(FRONT_WORKER_KEYS)}")
        if sub not in FRONT_WORKER_KEYS and worker[sub] != WORKER_DEFAULTS[sub]:
            raise ConfigError(f"{wkey}.{sub}", worker[sub], "is a cell's setting: the front door has no placement, "
                              "pods or state", f"pulumi config rm --path {wkey}.{sub} -s {stack}")
    name = worker.get("name") or f"colocate-{stack}"
    if not isinstance(name, str) or not _SCRIPT.fullmatch(name):
        raise ConfigError(
            f"{wkey}.name", name, "a Worker name is lower-case letters, digits and '-'", "pick a name like colocate-fleet"
        )
    subdomain = worker.get("subdomain", "")
    if not isinstance(subdomain, str) or (subdomain and not _SCRIPT.fullmatch(subdomain)):
        raise ConfigError(f"{wkey}.subdomain", subdomain, "must be the bare workers.dev subdomain",
                          "write only the part before .workers.dev, for example acme")
    max_body = _whole(f"{wkey}.maxBodyBytes", worker.get("maxBodyBytes", WORKER_DEFAULTS["maxBodyBytes"]), 1, 100 * 1024 * 1024)
    zone = parse_zone(raw.get("zone"))
    if zone is not None and not (raw.get("zone") or {}).get("workerHostname"):
        zone = replace(zone, worker_hostname=f"{stack}.{zone.name}")  # not a cell's default infer.<zone>
    if zone is None and not subdomain:
        raise MissingSetting(
            f"{wkey}.subdomain",
            None,
            "the front door needs a public address: no zone and no workers.dev subdomain",
            f"pulumi config set --path {wkey}.subdomain <your-account-subdomain>, or set {NS}:zone",
        )
    return FleetSettings(stack, account, cells, remember, exchange, name, subdomain, max_body, zone, affinity)


@dataclass(frozen=True)
class Member:
    """One member cell as its stack's outputs describe it."""

    stack: str  # as configured (maybe org/project/stack)
    name: str  # short name: what x-colocate-cell says
    region: Region
    worker_name: str
    worker_url: str
    account_id: str
    budget_e2e_ms: float | None = None  # the cell's colocate:budgets.e2e: its users are sent no farther


def member(index: int, stack: str, found: Mapping[str, object] | None) -> Member:
    """A member from its stack's outputs; refuses a stack that lacks them."""
    key = f"{KEY}.cells[{index}]"
    found = found or {}
    missing = [k for k in MEMBER_OUTPUTS if not isinstance(found.get(k), str) or not found.get(k)]
    if missing:
        problem = (f"stack {stack} has no outputs {', '.join(missing)}: it was never deployed, does not exist, or was "
                   f"last deployed by a kit that did not export them")
        raise ConfigError(key, stack, problem, f"pulumi up -s {short_name(stack)} (then pulumi up the fleet again), "
                          f"or pulumi config rm --path '{key}'")
    region = lookup_region(found[outputs.REGION], f"{key} (output {outputs.REGION} of stack {stack})")
    budget = found.get(outputs.BUDGET_E2E_MS)
    budget_ms = float(budget) if isinstance(budget, int | float) and not isinstance(budget, bool) and budget > 0 else None
    return Member(stack, short_name(stack), region, str(found[outputs.WORKER_NAME]), str(found[outputs.WORKER_URL]),
                  str(found[outputs.ACCOUNT_ID]), budget_ms)


def check_accounts(settings: FleetSettings, members: Sequence[Member]) -> None:
    """Service bindings reach Workers of the front door's own account only: a member in
    another account would fail only at upload, after the plan looked fine."""
    for i, m in enumerate(members):
        if m.account_id != settings.account_id:
            raise ConfigError(f"{KEY}.cells[{i}]", m.stack,
                              f"stack {m.stack} deploys its Worker in account {m.account_id} (its output "
                              f"{outputs.ACCOUNT_ID}), not this fleet's {settings.account_id}: a service binding "
                              "reaches only Workers of the same account",
                              f"pulumi config set {NS}:accountId {m.account_id} -s {settings.stack} (every cell in "
                              f"that account), or deploy {m.name} in {settings.account_id}")


def check_members(members: Sequence[Member]) -> None:
    """Two cells in one region are refused: the second could never be ranked nearest by
    any colo (same edge site), so it would only ever serve as an expensive spare."""
    by_region: dict[str, int] = {}
    for i, m in enumerate(members):
        if m.region.name in by_region:
            j = by_region[m.region.name]
            raise ConfigError(f"{KEY}.cells", [x.stack for x in members],
                              f"{members[j].name} and {m.name} are both in region {m.region.name}: the front door "
                              "ranks cells by where they run, so one of them would never be the nearest",
                              f"keep one cell per region (more pods in one cell: colocate:pod.count); "
                              f"pulumi config rm --path '{KEY}.cells[{i}]'")
        by_region[m.region.name] = i
    names = [m.worker_name for m in members]
    if len(set(names)) != len(names):
        raise ConfigError(f"{KEY}.cells", [x.stack for x in members], "two member stacks deploy the same Worker",
                          "give each cell its own colocate:worker.name")


def floor_to(colo_code: str, cell: Region) -> float:
    return geo.floor_ms(colo_code, cell.edge_site)


def rank(colo_code: str, regions: Sequence[Region]) -> list[int]:
    """Cell indexes, nearest first by the physical floor from ``colo_code``; ties (and an
    unknown colo) keep the configured order."""
    if colo_code.upper() not in geo.colos():
        return list(range(len(regions)))
    return sorted(range(len(regions)), key=lambda i: (round(floor_to(colo_code, regions[i]), 3), i))


def within_budget(colo_code: str, regions: Sequence[Region], budgets: Sequence[float | None]) -> list[int]:
    """``rank`` cut to the cells a user at ``colo_code`` may be sent to: the nearest cell (the
    user's own) always; another only while the round trip to it alone, the physical floor
    stretched as real paths are (``geo.DEFAULT_STRETCH``), fits the nearest cell's e2e budget.
    A cell beyond it could not answer in time even with an idle pod, so when the user's own
    cell has no pod its fallback serves instead."""
    order = rank(colo_code, regions)
    budget = budgets[order[0]] if order else None
    if budget is None or colo_code.upper() not in geo.colos():
        return order
    return [i for k, i in enumerate(order) if k == 0 or floor_to(colo_code, regions[i]) * geo.DEFAULT_STRETCH <= budget]


def rank_table(regions: Sequence[Region], budgets: Sequence[float | None] | None = None) -> dict[str, list[int]]:
    """{colo: [cell index, ...]} for every colo with coordinates: nearest first, cut to the
    nearest cell's e2e budget (``within_budget``) when ``budgets`` gives one per cell."""
    budgets = budgets if budgets is not None else [None] * len(regions)
    return {code: within_budget(code, regions, budgets) for code in sorted(geo.colos())}


def front_modules(directory: Path = WORKER_DIR, main: str = FRONT_MAIN_MODULE,
                  rank: Mapping[str, list[int]] | None = None) -> tuple[Module, ...]:
    """The front door's ES modules: its main module ``frontindex.js`` and what it imports,
    transitively (main first); with ``rank``, ``cellrank.js`` is the plan's (``rank_module``)."""
    modules = module_closure(directory, main)
    if rank is None:
        return modules
    return tuple(rank_module(rank) if m.name == RANK_MODULE else m for m in modules)


def rank_module(rank: Mapping[str, list[int]]) -> Module:
    """``cellrank.js`` holding ``rank`` as its default export."""
    return Module(RANK_MODULE, None, text=f"export default {json_text(rank)};\n")


@dataclass(frozen=True)
class ServiceBinding:
    """A service binding: ``env.<name>`` calls the Worker ``service`` (no public hop)."""

    name: str
    service: str


@dataclass(frozen=True)
class FleetPlan:
    stack: str
    account_id: str
    zone_id: str | None
    script_name: str
    main_module: str
    modules: tuple[Module, ...]
    compatibility_date: str
    members: tuple[Member, ...]
    services: tuple[ServiceBinding, ...]
    bindings: tuple[Binding, ...]  # plain_text, json, the LEDGER namespace, CELL_TOKEN_<i> (secret, from_output)
    rank: dict[str, list[int]]  # as uploaded in the module cellrank.js
    hostname: str | None
    url: str
    migrations: dict | None  # the FleetLedger class's pending steps ({old_tag, new_tag, steps}); None: none

    def cells_output(self) -> list[dict]:
        """What the fleet stack exports as ``cells`` (and `pulumi preview` shows)."""
        return [{"name": m.name, "stack": m.stack, "region": m.region.name, "workerName": m.worker_name,
                 "workerUrl": m.worker_url} for m in self.members]


def address(settings: FleetSettings) -> tuple[str | None, str]:
    """The front door's custom hostname (None on workers.dev) and its URL."""
    zone = settings.zone
    if zone:
        return zone.worker_hostname, f"https://{zone.worker_hostname}"
    return None, f"https://{settings.worker_name}.{settings.subdomain}.workers.dev"


def json_text(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def token_output(index: int) -> str:
    """What fills ``CELL_TOKEN_<index>``: member ``index``'s ``exchangeToken`` stack output."""
    return f"cells[{index}].{outputs.EXCHANGE_TOKEN}"


def check_tokens(settings: FleetSettings, tokens: Sequence[object]) -> None:
    """Every member stack exports its exchange token (the ledger calls the cell with it)."""
    for i, (stack, token) in enumerate(zip(settings.cells, tokens, strict=True)):
        if not isinstance(token, str) or not token:
            raise ConfigError(f"{KEY}.cells[{i}]", stack,
                              f"stack {stack} has no output {outputs.EXCHANGE_TOKEN}: the front door's "
                              "limits exchange calls each cell with its exchange token",
                              f"pulumi up -s {short_name(stack)} (then pulumi up the fleet again)")


def plan_fleet(settings: FleetSettings, found: Sequence[Mapping[str, object] | None],
               worker_dir: Path = WORKER_DIR, *, live_migration_tag: str | None = None) -> FleetPlan:
    """The front door from the settings and each member stack's outputs (index order).
    ``live_migration_tag``: the tag Cloudflare reports for the front door's script ("" none,
    None unknown: every step is sent, as for a first deploy)."""
    if len(found) != len(settings.cells):
        raise ValueError(f"{len(found)} member outputs for {len(settings.cells)} cells")
    members = tuple(member(i, s, f) for i, (s, f) in enumerate(zip(settings.cells, found, strict=True)))
    check_members(members)
    check_accounts(settings, members)
    table = rank_table([m.region for m in members], [m.budget_e2e_ms for m in members])
    services = tuple(ServiceBinding(f"CELL_{i}", m.worker_name) for i, m in enumerate(members))
    bindings = (
        Binding("CELLS", "json", text=json_text([{"name": m.name, "region": m.region.name} for m in members])),
        Binding("REMEMBER_MS", "plain_text", text=str(settings.remember_ms)),
        Binding("MAX_BODY_BYTES", "plain_text", text=str(settings.max_body_bytes)),
        Binding("EXCHANGE_MS", "plain_text", text=str(settings.exchange_ms)),
        Binding("AFFINITY", "plain_text", text=settings.affinity),
        Binding(LEDGER_BINDING, "durable_object_namespace", class_name=LEDGER_CLASS),
        *(Binding(f"CELL_TOKEN_{i}", "secret_text", from_output=token_output(i)) for i in range(len(members))),
    )
    decision = migration_decision(live_migration_tag if live_migration_tag is not None else "", script=settings.worker_name,
                                  migrations=LEDGER_MIGRATIONS)
    zone = settings.zone
    hostname, url = address(settings)
    modules = front_modules(worker_dir, rank=table)
    cloudflare_limits.check_worker(settings.worker_name, [(m.name, m.content().encode()) for m in modules],
                                   [(b.name, b.type, b.text) for b in bindings], {"CELLS": f"{KEY}.cells"}, f"{KEY}.cells")
    return FleetPlan(
        stack=settings.stack,
        account_id=settings.account_id,
        zone_id=zone.id if zone else None,
        script_name=settings.worker_name,
        main_module=FRONT_MAIN_MODULE,
        modules=modules,
        compatibility_date=COMPATIBILITY_DATE,
        members=members,
        services=services,
        bindings=bindings,
        rank=table,
        hostname=hostname,
        url=url,
        migrations=decision.migrations,
    )


def check_member_stacks(settings: FleetSettings, stacks_dir: Path) -> None:
    """Each member named by its bare stack name must be a cell stack of this project: its
    stack file in ``stacks_dir`` exists and is not a fleet's. The program checks this before
    reading any StackReference, because a reference to a stack that does not exist fails the
    whole deployment with the engine's own "unknown stack", which the program cannot catch
    (pulumi/pulumi#3540). A member named ``project/stack`` or ``org/project/stack`` may
    belong to another project: only its outputs are checked (``member``)."""
    for i, stack in enumerate(settings.cells):
        if "/" in stack:
            continue
        key = f"{KEY}.cells[{i}]"
        path = stacks_dir / f"Pulumi.{stack}.yaml"
        if not path.is_file():
            known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml"))
            raise ConfigError(key, stack, f"no stack {stack} in this project ({stacks_dir.name}/{path.name} does not exist; "
                              f"stacks here: {', '.join(known) or 'none'})",
                              f"create and deploy the cell first (pulumi stack init {stack}; pulumi config set colocate:region "
                              f"<region> -s {stack}; pulumi up -s {stack}), or pulumi config rm --path '{key}'")
        raw, _ = stackfile.read_config(stack, stacks_dir)
        if is_fleet(raw):
            raise ConfigError(key, stack, f"{stack} is a fleet stack, not a cell: a fleet's members are cells",
                              f"name its cells instead, or pulumi config rm --path '{key}'")
