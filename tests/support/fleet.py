"""A fleet in one workerd: the front door and 2-3 real cells bound by service bindings.

Each cell is the real router (the sandbox stack's plan with its region, ledger and Worker
name overridden) with its own Breaker namespace and storage and its own stand-in pod;
one stand-in fallback serves them all. The front door is ``colocate.fleet.plan.plan_fleet``'s
plan, its modules read from disk. Its socket parses ``request.cf`` from the ``cf-blob``
request header (workerd's ``cfBlobHeader``), which is how a test says which colo a
request arrived at: locally ``request.cf`` has no colo.

One client key works in every cell: it is made by cell 0's ``POST /_colocate/keys`` and
copied into the others by a test-only entry module (``KEY_ENTRY``, never uploaded) that
stores the same key row through the cell's own object (the kit's own replication,
`keys.py --stack <fleet>`, is tested in tests/test_fleet_keys.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from colocate import workerd as wd
from colocate.cell import outputs
from colocate.fleet import plan as fleet
from colocate.fleet.workerd import CF_BLOB_HEADER, cf_socket, front_worker_capnp
from colocate.pods import standin
from tests.support.workerd import FALLBACK_MODEL_NAME, SECRETS, Response, auth, cell_plan, request, values_for

KEY_ENTRY = "fleet_key.js"
KEY_JS = """
import product from "./index.js";
export * from "./index.js";
import { readConfig } from "./config.js";
import { displayPrefix, keyHash, newKeyId } from "./keys.js";
import { activeStub, cache, infoOf } from "./state.js";

// Test-only: store a given client key in this cell's generation, as POST /_colocate/keys would.
export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url);
    if (url.pathname !== "/__test/key") return product.fetch(request, env, ctx);
    const { key, name } = await request.json();
    const cfg = readConfig(env);
    const row = { id: newKeyId(), hash: await keyHash(key), prefix: displayPrefix(key), name, rpm: 0, tpm: 0,
      monthly_tokens: 0, created_at: Date.now(), expires_at: null };
    const stored = await activeStub(env, cfg).createKey(row, infoOf(cfg));
    cache.drop(cfg.activeGeneration);
    return Response.json(stored);
  },
};
"""


@dataclass
class FleetCell:
    name: str
    region: str
    plan: object
    pod: standin.StandinServer
    url: str  # the cell's own address (admin calls); the front door uses the service binding

    def breaker(self, force: str | None) -> dict:
        res = request(self.url, "PUT", "/_colocate/breaker", body={"force": force}, headers=auth())
        assert res.status == 200, res.body
        return res.json()["breaker"]


@dataclass
class Fleet:
    worker: wd.Workerd
    plan: fleet.FleetPlan
    cells: list[FleetCell]
    fallback: standin.StandinServer
    key: str = ""
    responses: list[Response] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.worker.url

    def cell(self, name: str) -> FleetCell:
        return next(c for c in self.cells if c.name == name)

    def call(self, colo: str | None, method: str = "POST", path: str = "/v1/chat/completions", body=None,
             headers: dict | None = None, **kw) -> Response:
        """One request to the front door as if it arrived at ``colo`` (None: no colo)."""
        hdrs = {"authorization": f"Bearer {self.key}"}
        hdrs.update(headers or {})
        hdrs = {k: v for k, v in hdrs.items() if v != ""}
        if colo is not None:
            hdrs[CF_BLOB_HEADER] = json.dumps({"colo": colo})
        if body is None and method == "POST":
            body = {"model": "client/model", "messages": [{"role": "user", "content": "hi"}]}
        res = request(self.url, method, path, body=body, headers=hdrs, **kw)
        self.responses.append(res)
        return res


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def generation(region: str) -> list[dict]:
    return [{"name": f"{region}.g1", "region": region, "status": "active"}]


@contextlib.contextmanager
def running_fleet(regions: tuple[str, ...] = ("apac-jp", "eu-west", "us-east"), *, compute_ms: float = 2,
                  remember_ms: int = 5000, worker: dict | None = None, exchange_ms: int = 1000,
                  unreachable: tuple[str, ...] = (), budgets: dict[str, float] | None = None, **raw_overrides) -> Iterator[Fleet]:
    """workerd with the front door on its main socket and each cell on its own socket.
    ``unreachable``: cells whose service binding leads to a closed port (a cell that is down).
    ``budgets``: cells' e2e budgets in ms, as their stacks export them (the ranking's cut).
    ``raw_overrides``: other ``colocate:*`` values of every cell (e.g. ``fallbackPrice``)."""
    with contextlib.ExitStack() as stack:
        fb = stack.enter_context(standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME,
                                               name="fallback"))
        w = stack.enter_context(wd.Workerd(socket_name="front"))
        services: list[tuple[str, str]] = [wd.network_service()]
        sockets: list[tuple[str, str]] = [cf_socket("front", "front")]
        extra: dict[str, socket.socket] = {}
        cells: list[FleetCell] = []
        found = []
        for region in regions:
            name = f"colocate-{region}"
            plan = cell_plan({"name": name, **(worker or {})}, generation(region), region=region, **raw_overrides)
            pod = stack.enter_context(standin.serve(compute_ms=compute_ms, token=SECRETS["POD_TOKEN"], name=f"pod-{region}"))
            disk = f"disk-{region}"
            lit = wd.worker_capnp(plan.worker, values_for(pod.url, fb.url), storage_service=disk,
                                  extra_modules=[(KEY_ENTRY, KEY_JS)], main_module=KEY_ENTRY)
            services += [wd.worker_service(name, lit), wd.disk_service(disk, w.directory / "objects" / region)]
            s = stack.enter_context(contextlib.closing(wd.listening_socket()))
            extra[region] = s
            sockets.append(wd.socket_capnp(region, 0, name))
            cells.append(FleetCell(region, region, plan, pod, f"http://127.0.0.1:{s.getsockname()[1]}"))
            found.append({outputs.WORKER_NAME: name, outputs.WORKER_URL: f"https://{name}.sandbox.workers.dev",
                          outputs.REGION: region, outputs.ACCOUNT_ID: plan.worker.account_id,
                          **({outputs.BUDGET_E2E_MS: budgets[region]} if region in (budgets or {}) else {})})
        settings = fleet.parse({"fleet": {"cells": list(regions), "rememberMs": remember_ms, "exchangeMs": exchange_ms},
                                "accountId": "0" * 32, "worker": {"subdomain": "sandbox"}}, "fleet")
        plan = fleet.plan_fleet(settings, found)
        targets = []
        for region, s in zip(regions, plan.services, strict=True):
            if region in unreachable:
                dead = f"dead-{region}"
                services.append(wd.external_service(dead, "127.0.0.1", closed_port()))
                targets.append(dead)
            else:
                targets.append(s.service)
        tokens = {f"CELL_TOKEN_{i}": SECRETS["PROBE_TOKEN"] for i in range(len(regions))}
        services.append(wd.disk_service("disk-front", w.directory / "objects" / "front"))
        services.insert(
            0, wd.worker_service("front", front_worker_capnp(plan, targets, storage_service="disk-front", tokens=tokens))
        )
        w.start(wd.config_capnp(services, sockets), extra_sockets=extra)
        f = Fleet(w, plan, cells, fb)
        made = request(cells[0].url, "POST", "/_colocate/keys", body={"name": "fleet"}, headers=auth())
        assert made.status == 201, made.body
        f.key = made.json()["key"]
        for c in cells[1:]:
            res = request(c.url, "POST", "/__test/key", body={"key": f.key, "name": "fleet"})
            assert res.status == 200, res.body
        yield f
