"""The front door in workerd: building blocks over ``colocate.workerd``, from a ``FleetPlan``.

The plan's modules are read from disk (the bytes the fleet stack uploads) and its bindings
are the plan's: ``CELLS`` and ``CELL_RANK`` as json bindings, ``CELL_<i>`` as service
bindings to workerd services named like the cells' Workers (as in the cloud, where a
service binding names the script). A socket may parse ``request.cf`` from a request header
(workerd's ``HttpOptions.cfBlobHeader``): locally ``request.cf`` has no colo, so a test
or a benchmark says which colo a request arrived at with ``cf-blob: {"colo": "NRT"}``.
The front door hosts its own Durable Object namespace (``FleetLedger``, the limits
exchange) with SQLite on ``storage_service``'s disk, as a cell hosts its Breaker; each
``CELL_TOKEN_<i>`` gets its value from ``tokens`` (the cell's probe token). Imports no Pulumi.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..workerd import BindingValueMissing, capnp_text
from .plan import LEDGER_CLASS, FleetPlan

CF_BLOB_HEADER = "cf-blob"


def front_worker_capnp(plan: FleetPlan, service_names: Sequence[str] | None = None, *, storage_service: str | None,
                       tokens: Mapping[str, str], namespace_key: str | None = None,
                       ledger_service: str | None = None) -> str:
    """The front door as one ``Workerd.Worker`` literal; ``service_names`` overrides the
    workerd services its ``CELL_<i>`` bindings reach (default: the cells' Worker names).
    ``storage_service``: a disk service for the ledger's SQLite; ``tokens``: each
    ``CELL_TOKEN_<i>``'s value, by binding name (or by its ``from_output``).
    ``ledger_service``: another front-door service that owns the ledger's namespace (one
    ledger per fleet, as in the cloud, when several front-door services emulate several
    colos); this one then binds to it and declares no namespace or storage."""
    services = list(service_names or [s.service for s in plan.services])
    items = []
    for b in plan.bindings:
        if b.type == "durable_object_namespace":
            target = capnp_text(b.class_name) if ledger_service is None else \
                f"(className = {capnp_text(b.class_name)}, serviceName = {capnp_text(ledger_service)})"
            items.append(f"(name = {capnp_text(b.name)}, durableObjectNamespace = {target})")
            continue
        if b.type == "secret_text":
            value = tokens.get(b.name, tokens.get(b.from_output or ""))
            if value is None:
                raise BindingValueMissing(b)
            items.append(f"(name = {capnp_text(b.name)}, text = {capnp_text(value)})")
            continue
        kind = "json" if b.type == "json" else "text"
        items.append(f"(name = {capnp_text(b.name)}, {kind} = {capnp_text(b.text)})")
    for s, target in zip(plan.services, services, strict=True):
        items.append(f"(name = {capnp_text(s.name)}, service = {capnp_text(target)})")
    modules = ",\n    ".join(f"(name = {capnp_text(m.name)}, esModule = {capnp_text(m.content())})" for m in plan.modules)
    head = (f"(\n  modules = [\n    {modules}\n  ],\n  compatibilityDate = {capnp_text(plan.compatibility_date)},\n"
            "  bindings = [\n    " + ",\n    ".join(items) + "\n  ]")
    if ledger_service is not None:
        return head + "\n)"
    if storage_service is None:
        raise ValueError("front_worker_capnp: storage_service is required unless ledger_service is given")
    key = namespace_key or f"{plan.script_name}-{LEDGER_CLASS}"  # stable: it names the on-disk directory
    return (head + ",\n"
            f"  durableObjectNamespaces = [(className = {capnp_text(LEDGER_CLASS)}, uniqueKey = {capnp_text(key)}, "
            "enableSql = true)],\n"
            f"  durableObjectStorage = (localDisk = {capnp_text(storage_service)})\n)")


def cf_socket(name: str, service: str, port: int = 0, host: str = "127.0.0.1") -> tuple[str, str]:
    """A socket whose requests carry ``request.cf`` from the ``cf-blob`` header (JSON)."""
    return name, (f"(name = {capnp_text(name)}, address = {capnp_text(f'{host}:{port}')}, "
                  f"http = (cfBlobHeader = {capnp_text(CF_BLOB_HEADER)}), service = {capnp_text(service)})")
