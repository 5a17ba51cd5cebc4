"""The ``Fleet`` component: one front door Worker over the member cells' Workers.

A fleet stack (``colocate:fleet`` set; ``infra/program.py`` dispatches here) reads each
member cell's outputs with ``pulumi.StackReference`` (its Worker's name, URL and region),
plans the front door from them (``colocate.fleet.plan.plan_fleet``: the refusals and the
ranking are decided there) and declares one ``WorkersScript`` with **no placement**, a
service binding to each cell's Worker by script name, and its public address as a cell
has one (``infra.cell.public_route``). Nothing in a cell stack changes.

The limits exchange (``FleetLedger``, a Durable Object of the front door) calls each cell's
operator endpoints, so each cell's ``exchangeToken`` (a secret output) is read by its
StackReference and bound as the secret ``CELL_TOKEN_<i>``; the class is created by the
front door's own migration list (``colocate.fleet.plan.LEDGER_MIGRATIONS``), from the tag
Cloudflare reports for the script, as a cell's Breaker is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import pulumi
import pulumi_cloudflare as cloudflare

from colocate import stackfile
from colocate.cell import cloudflare_limits, outputs
from colocate.errors import ConfigError
from colocate.fleet import plan as fleet

from .cell import by_name, module_files, public_route
from .errors import ProgramError
from .stackconfig import check_zone, live_migration_tag, migrations_args, raw_config, require_api_token


class FleetArgs(TypedDict):
    """Inputs of a Fleet."""

    settings: fleet.FleetSettings
    """The fleet stack's validated settings; the members come from their stacks' outputs."""
    live_migration_tag: str | None
    """The Durable Object migration tag Cloudflare reports for the front door's script ("" none)."""


def qualified(stack: str) -> str:
    """``org/project/stack`` for a member named by its bare stack name (this project's)."""
    if stack.count("/") == 2:
        return stack
    if "/" in stack:  # project/stack
        return f"{pulumi.get_organization()}/{stack}"
    return f"{pulumi.get_organization()}/{pulumi.get_project()}/{stack}"


def _plan(settings: fleet.FleetSettings, found: Sequence[dict], live_tag: str | None) -> fleet.FleetPlan:
    try:
        return fleet.plan_fleet(settings, list(found), live_migration_tag=live_tag)
    except ConfigError as err:
        raise ProgramError(str(err)) from None


def _binding_args(settings: fleet.FleetSettings, plan: fleet.FleetPlan, tokens: Sequence[object]) -> list:
    """The front door's bindings; ``tokens``: each member's exchangeToken output, index order."""
    try:
        fleet.check_tokens(settings, tokens)
        for i, token in enumerate(tokens):
            cloudflare_limits.check_binding_value(settings.worker_name, f"CELL_TOKEN_{i}", token,
                                                  f"{fleet.KEY}.cells[{i}]")
    except ConfigError as err:
        raise ProgramError(str(err)) from None
    by_output = {fleet.token_output(i): t for i, t in enumerate(tokens)}
    out = [cloudflare.WorkersScriptBindingArgs(name=s.name, type="service", service=s.service) for s in plan.services]
    for b in plan.bindings:
        if b.type == "json":
            out.append(cloudflare.WorkersScriptBindingArgs(name=b.name, type="json", json=b.text))
        elif b.type == "durable_object_namespace":
            out.append(cloudflare.WorkersScriptBindingArgs(name=b.name, type=b.type, class_name=b.class_name))
        elif b.type == "secret_text":
            out.append(cloudflare.WorkersScriptBindingArgs(name=b.name, type=b.type, text=by_output[b.from_output]))
        else:
            out.append(cloudflare.WorkersScriptBindingArgs(name=b.name, type=b.type, text=b.text))
    return by_name(out)  # services and the rest together


class Fleet(pulumi.ComponentResource):
    """A colocate fleet: the front door Worker and its service bindings to the cells."""

    url: pulumi.Output[str]
    cells: pulumi.Output[list]  # [{name, stack, region, workerName, workerUrl}]

    def __init__(self, name: str, args: FleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("colocate:index:Fleet", name, None, opts)
        s = args["settings"]
        child = pulumi.ResourceOptions(parent=self)
        self.references = [
            pulumi.StackReference(f"{name}-cell-{fleet.short_name(cell)}", stack_name=qualified(cell), opts=child)
            for cell in s.cells
        ]
        # Only the outputs the plan needs, one by one: a cell's exchangeToken is a secret output
        # and must not make the plan (and the exported cells) secret; it goes only into the
        # bindings, which are secret for it.
        found = [pulumi.Output.all(**{k: ref.get_output(k) for k in (*fleet.MEMBER_OUTPUTS, *fleet.OPTIONAL_MEMBER_OUTPUTS)})
                 for ref in self.references]
        tokens = [ref.get_output(outputs.EXCHANGE_TOKEN) for ref in self.references]
        live_tag = args.get("live_migration_tag")
        plan = pulumi.Output.all(*found).apply(lambda f: _plan(s, f, live_tag))
        bindings = pulumi.Output.all(plan, *tokens).apply(lambda a: _binding_args(s, a[0], a[1:]))

        main = fleet.front_modules()[0]  # frontindex.js; the ranking module comes with the plan
        hostname, url = fleet.address(s)
        self.worker = cloudflare.WorkersScript(
            f"{name}-worker",
            account_id=s.account_id,
            script_name=s.worker_name,
            main_module=main.name,
            content=main.content(),
            files=plan.apply(lambda p: module_files(p.modules, p.main_module)),
            compatibility_date=fleet.COMPATIBILITY_DATE,
            # No placement: the front door runs in the colo that accepted the request.
            bindings=bindings,
            migrations=plan.apply(lambda p: migrations_args(p.migrations)),
            observability=cloudflare.WorkersScriptObservabilityArgs(enabled=True),
            # The FleetLedger class: Cloudflare deletes its script (and the ledger's objects)
            # only when forced (docs/worker.md, "Destroy").
            force=True,
            opts=child,
        )
        self.route = public_route(name, s.account_id, s.worker_name, hostname, s.zone.id if s.zone else None,
                                  pulumi.ResourceOptions(parent=self, depends_on=[self.worker]))
        self.url = pulumi.Output.from_input(url)
        self.cells = plan.apply(lambda p: p.cells_output())
        self.register_outputs({"url": self.url, "cells": self.cells})


def main() -> dict[str, pulumi.Input]:
    """Declare the fleet stack and export its outputs; returns the exports (tests read them)."""
    raw, secrets = raw_config()
    try:
        settings = fleet.parse(raw, pulumi.get_stack(), secrets=frozenset(secrets))
        fleet.check_member_stacks(settings, stackfile.STACKS_DIR)
        require_api_token()
    except ConfigError as err:
        raise ProgramError(str(err)) from None
    if settings.zone is not None:
        check_zone(settings.zone)
    tag = live_migration_tag(settings.account_id, settings.worker_name)
    front = Fleet(settings.stack, FleetArgs(settings=settings, live_migration_tag=tag))
    exports = {
        outputs.WORKER_URL: front.url,
        outputs.WORKER_NAME: settings.worker_name,
        outputs.CELLS: front.cells,
    }
    for key, value in exports.items():
        pulumi.export(key, value)
    return exports
