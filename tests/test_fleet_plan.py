"""The fleet's pure layer: settings, member outputs, the refusals and the ranking."""

from __future__ import annotations

import gzip
import json
import random
import re

import pytest

from colocate.cell import catalogue, cloudflare_limits, geo, outputs, settings
from colocate.cell.plan import worker_modules
from colocate.errors import ConfigError, MissingSetting
from colocate.fleet import plan as fleet

ACCOUNT = "0123456789abcdef0123456789abcdef"
CELLS = ["apac-jp", "eu-west", "us-east"]


def raw(**over) -> dict:
    base = {"fleet": {"cells": list(CELLS)}, "accountId": ACCOUNT, "worker": {"subdomain": "acme"}}
    base.update(over)
    return base


def outs(region: str, name: str | None = None) -> dict:
    name = name or f"colocate-{region}"
    return {outputs.WORKER_NAME: name, outputs.WORKER_URL: f"https://{name}.acme.workers.dev", outputs.REGION: region,
            outputs.ACCOUNT_ID: ACCOUNT, outputs.EXCHANGE_TOKEN: "secret-not-read"}


def three():
    return fleet.plan_fleet(fleet.parse(raw(), "fleet"), [outs(c) for c in CELLS])


def refused(exc=ConfigError, **over) -> ConfigError:
    with pytest.raises(exc) as err:
        fleet.parse(raw(**over), "fleet")
    return err.value


# --- settings -----------------------------------------------------------------------

def test_is_fleet_only_with_a_non_empty_mapping():
    assert fleet.is_fleet({"fleet": {"cells": ["a"]}})
    for value in (None, {}, [], "x"):
        assert not fleet.is_fleet({"fleet": value})
    assert not fleet.is_fleet({"region": "apac-jp"})


def test_parse_defaults():
    s = fleet.parse(raw(), "fleet")
    assert s.cells == tuple(CELLS) and s.remember_ms == 5000 and s.worker_name == "colocate-fleet"
    assert s.max_body_bytes == settings.WORKER_DEFAULTS["maxBodyBytes"] and s.zone is None


def test_project_defaults_of_cell_keys_are_accepted():
    # The CLI hands every stack the project's defaults (pod, worker, budgets, probe, zone).
    defaults = {k.name: k.default for k in settings.SCHEMA if k.default is not None and k.name not in ("fleet", "worker")}
    s = fleet.parse(raw(**defaults, region="", generations=[]), "fleet")
    assert s.cells == tuple(CELLS)


@pytest.mark.parametrize("name, value", [
    ("region", "apac-jp"),
    ("generations", [{"name": "apac-jp.g1", "region": "apac-jp", "status": "active"}]),
    ("pod", {"provider": "local"}),
    ("fallbackModel", "gpt-4o-mini"),
    ("budgets", {"state": 10}),
])
def test_a_cells_key_on_a_fleet_is_refused(name, value):
    err = refused(**{name: value})
    assert err.key == f"colocate:{name}" and err.value == value
    assert "a cell's key" in err.problem and f"pulumi config rm colocate:{name} -s fleet" in err.fix


def test_unknown_key_is_refused():
    err = refused(podRegion="x")
    assert err.key == "colocate:podRegion" and "colocate:fleet" in err.fix


@pytest.mark.parametrize("secret", ["podToken", "probeToken", "readToken", "adminToken", "exchangeToken", "fallbackUrl",
                                    "fallbackApiKey", "runpodApiKey"])
def test_a_cells_secret_on_a_fleet_is_refused(secret):
    with pytest.raises(ConfigError) as err:
        fleet.parse(raw(), "fleet", secrets={secret})
    assert err.value.key == f"colocate:{secret}" and "pulumi config rm" in err.value.fix
    assert "[secret]" in str(err.value)


@pytest.mark.parametrize("cells, key, words", [
    ([], "colocate:fleet.cells", "at least one"),
    ("apac-jp", "colocate:fleet.cells", "at least one"),
    (["apac-jp", ""], "colocate:fleet.cells[1]", "stack name"),
    (["apac-jp", "bad name"], "colocate:fleet.cells[1]", "stack name"),
    (["apac-jp", 7], "colocate:fleet.cells[1]", "stack name"),
    (["apac-jp", "apac-jp"], "colocate:fleet.cells[1]", "same cell as colocate:fleet.cells[0]"),
    (["apac-jp", "acme/colocate/apac-jp"], "colocate:fleet.cells[1]", "same cell"),
    (["apac-jp", "fleet"], "colocate:fleet.cells[1]", "its own member"),
    ([f"c{i}" for i in range(fleet.MAX_CELLS + 1)], "colocate:fleet.cells", f"at most {fleet.MAX_CELLS}"),
])
def test_bad_cell_lists(cells, key, words):
    err = refused(fleet={"cells": cells})
    assert err.key == key and words in err.problem and err.fix


def test_qualified_stack_names_are_accepted_and_shortened():
    s = fleet.parse(raw(fleet={"cells": ["acme/colocate/apac-jp", "us-east"]}), "fleet")
    assert s.cells == ("acme/colocate/apac-jp", "us-east")
    assert [fleet.short_name(c) for c in s.cells] == ["apac-jp", "us-east"]


@pytest.mark.parametrize("value", [-1, "soon", 60_001, True, 1.5])
def test_bad_remember_ms(value):
    err = refused(fleet={"cells": CELLS, "rememberMs": value})
    assert err.key == "colocate:fleet.rememberMs" and "0..60000" in err.fix


@pytest.mark.parametrize("value", [0, 99, 60_001, "soon", True])
def test_bad_exchange_ms(value):
    err = refused(fleet={"cells": CELLS, "exchangeMs": value})
    assert err.key == "colocate:fleet.exchangeMs" and "100..60000" in err.fix and repr(value) in str(err)


def test_exchange_ms_default_and_binding():
    assert fleet.parse(raw(), "fleet").exchange_ms == 1000
    s = fleet.parse(raw(fleet={"cells": CELLS, "exchangeMs": "250"}), "fleet")
    assert s.exchange_ms == 250
    p = fleet.plan_fleet(s, [outs(c) for c in CELLS])
    b = {x.name: x for x in p.bindings}
    assert b["EXCHANGE_MS"].text == "250"
    assert b["LEDGER"].type == "durable_object_namespace" and b["LEDGER"].class_name == "FleetLedger"
    # Each cell's probe token, as a secret filled from that member stack's output (never held in the plan).
    assert [(b[f"CELL_TOKEN_{i}"].type, b[f"CELL_TOKEN_{i}"].from_output, b[f"CELL_TOKEN_{i}"].text) for i in range(3)] == [
        ("secret_text", f"cells[{i}].exchangeToken", None) for i in range(3)]


def test_the_ledger_class_is_created_once_by_its_own_migration():
    s = fleet.parse(raw(), "fleet")
    found = [outs(c) for c in CELLS]
    first = fleet.plan_fleet(s, found, live_migration_tag="").migrations
    assert first == {"old_tag": None, "new_tag": "v1", "steps": [{"new_sqlite_classes": ["FleetLedger"]}]}
    assert fleet.plan_fleet(s, found, live_migration_tag="v1").migrations is None
    with pytest.raises(ConfigError, match="migration tag 'v7'"):
        fleet.plan_fleet(s, found, live_migration_tag="v7")


def test_a_member_without_its_probe_token_is_refused():
    s = fleet.parse(raw(), "fleet")
    fleet.check_tokens(s, ["a", "b", "c"])
    with pytest.raises(ConfigError) as err:
        fleet.check_tokens(s, ["a", None, "c"])
    assert (
        err.value.key == "colocate:fleet.cells[1]"
        and "exchangeToken" in err.value.problem
        and "pulumi up -s eu-west" in err.value.fix
    )


def test_remember_ms_as_cli_text():
    assert fleet.parse(raw(fleet={"cells": CELLS, "rememberMs": "2500"}), "fleet").remember_ms == 2500


def test_unknown_fleet_subkey():
    err = refused(fleet={"cells": CELLS, "maxCells": 3})
    assert err.key == "colocate:fleet.maxCells" and "cells, rememberMs, exchangeMs" in err.fix


def test_front_door_has_no_placement():
    err = refused(worker={"subdomain": "acme", "placement": "smart"})
    assert err.key == "colocate:worker.placement" and err.value == "smart" and "no placement" in err.problem
    # The default value is what the CLI hands over when the stack says nothing: accepted.
    default = settings.WORKER_DEFAULTS["placement"]
    assert fleet.parse(raw(worker={"subdomain": "acme", "placement": default}), "fleet")


def test_missing_account_and_address():
    assert refused(MissingSetting, accountId="").key == "colocate:accountId"
    err = refused(MissingSetting, worker={})
    assert err.key == "colocate:worker.subdomain" and "colocate:zone" in err.fix


def test_zone_gives_the_front_door_its_own_hostname():
    zone = {"id": "f" * 32, "name": "example.com"}
    p = fleet.plan_fleet(fleet.parse(raw(zone=zone, worker={}), "fleet"), [outs(c) for c in CELLS])
    assert p.hostname == "fleet.example.com" and p.url == "https://fleet.example.com" and p.zone_id == "f" * 32
    p = fleet.plan_fleet(fleet.parse(raw(zone={**zone, "workerHostname": "ai.example.com"}), "fleet"), [outs(c) for c in CELLS])
    assert p.url == "https://ai.example.com"


# --- members ------------------------------------------------------------------------

def test_plan_from_member_outputs():
    p = three()
    assert [m.name for m in p.members] == CELLS
    assert [(s.name, s.service) for s in p.services] == [("CELL_0", "colocate-apac-jp"), ("CELL_1", "colocate-eu-west"),
                                                          ("CELL_2", "colocate-us-east")]
    b = {x.name: x for x in p.bindings}
    assert json.loads(b["CELLS"].text) == [{"name": c, "region": c} for c in CELLS]
    assert b["CELLS"].type == "json" and "CELL_RANK" not in b
    # The ranking is the module cellrank.js, made by the plan in place of the kit's empty one.
    rank = next(m for m in p.modules if m.name == "cellrank.js")
    assert rank.path is None and rank.content() == f"export default {fleet.json_text(p.rank)};\n"
    assert b["REMEMBER_MS"].text == "5000" and b["MAX_BODY_BYTES"].text == "1048576"
    assert p.url == "https://colocate-fleet.acme.workers.dev" and p.hostname is None
    assert p.cells_output()[0] == {"name": "apac-jp", "stack": "apac-jp", "region": "apac-jp",
                                   "workerName": "colocate-apac-jp", "workerUrl": "https://colocate-apac-jp.acme.workers.dev"}


@pytest.mark.parametrize("found, missing", [
    (None, "workerName, workerUrl, region"),
    ({}, "workerName, workerUrl, region"),
    ({outputs.WORKER_NAME: "w", outputs.WORKER_URL: "https://w"}, "region"),
    ({outputs.WORKER_NAME: "", outputs.WORKER_URL: "https://w", outputs.REGION: "eu-west"}, "workerName"),
])
def test_a_member_without_outputs_is_refused(found, missing):
    s = fleet.parse(raw(), "fleet")
    with pytest.raises(ConfigError) as err:
        fleet.plan_fleet(s, [outs("apac-jp"), found, outs("us-east")])
    e = err.value
    assert e.key == "colocate:fleet.cells[1]" and e.value == "eu-west"
    assert f"no outputs {missing}" in e.problem and "pulumi up -s eu-west" in e.fix


def test_a_member_in_an_unknown_region_is_refused():
    with pytest.raises(ConfigError) as err:
        fleet.plan_fleet(fleet.parse(raw(), "fleet"), [outs("apac-jp"), outs("mars-1"), outs("us-east")])
    assert "colocate:fleet.cells[1]" in err.value.key and err.value.value == "mars-1"


def test_two_cells_in_one_region_are_refused():
    s = fleet.parse(raw(fleet={"cells": ["apac-jp", "apac-jp-2", "us-east"]}), "fleet")
    with pytest.raises(ConfigError) as err:
        fleet.plan_fleet(s, [outs("apac-jp"), outs("apac-jp", "colocate-apac-jp-2"), outs("us-east")])
    e = err.value
    assert e.key == "colocate:fleet.cells" and e.value == ["apac-jp", "apac-jp-2", "us-east"]
    assert "apac-jp and apac-jp-2 are both in region apac-jp" in e.problem
    assert "pulumi config rm --path 'colocate:fleet.cells[1]'" in e.fix


def test_two_members_with_one_worker_are_refused():
    with pytest.raises(ConfigError, match="same Worker"):
        fleet.plan_fleet(fleet.parse(raw(), "fleet"), [outs("apac-jp", "w"), outs("eu-west", "w"), outs("us-east")])


# --- the ranking --------------------------------------------------------------------

@pytest.mark.parametrize("colo, nearest", [("NRT", "apac-jp"), ("KIX", "apac-jp"), ("TPE", "apac-jp"),
                                           ("FRA", "eu-west"), ("LHR", "eu-west"), ("CDG", "eu-west"),
                                           ("IAD", "us-east"), ("EWR", "us-east"), ("ORD", "us-east"), ("GRU", "us-east")])
def test_nearest_cell_by_colo(colo, nearest):
    p = three()
    assert CELLS[p.rank[colo][0]] == nearest


def test_rank_orders_every_cell_by_floor():
    p = three()
    regions = [m.region for m in p.members]
    assert set(p.rank) == set(geo.colos()) and len(p.rank) > 300
    for colo, order in p.rank.items():
        assert sorted(order) == [0, 1, 2], colo
        floors = [geo.floor_ms(colo, regions[i].edge_site) for i in order]
        assert floors == sorted(floors), colo


def test_second_choice_from_tokyo_and_frankfurt():
    p = three()
    # Tokyo's next cell: us-east (IAD ~10,900 km) or eu-west (DUB ~9,600 km): Dublin is nearer.
    assert [CELLS[i] for i in p.rank["NRT"]] == ["apac-jp", "eu-west", "us-east"]
    assert [CELLS[i] for i in p.rank["FRA"]] == ["eu-west", "us-east", "apac-jp"]
    assert [CELLS[i] for i in p.rank["IAD"]] == ["us-east", "eu-west", "apac-jp"]


def test_a_colos_cells_are_cut_to_its_nearest_cells_e2e_budget():
    def plan(budgets):
        found = [{**outs(c), **({outputs.BUDGET_E2E_MS: budgets[c]} if c in budgets else {})} for c in CELLS]
        return fleet.plan_fleet(fleet.parse(raw(), "fleet"), found)

    # Tokyo's round trips, floor x 1.55: eu-west (Dublin) ~149 ms, us-east (Ashburn) ~168 ms
    assert [CELLS[i] for i in plan({"apac-jp": 120}).rank["NRT"]] == ["apac-jp"]
    assert [CELLS[i] for i in plan({"apac-jp": 160}).rank["NRT"]] == ["apac-jp", "eu-west"]
    assert [CELLS[i] for i in plan({"apac-jp": 600}).rank["NRT"]] == ["apac-jp", "eu-west", "us-east"]
    # the nearest cell's budget decides, for every colo; a cell without one (an older kit) cuts nothing
    p = plan({"apac-jp": 120, "eu-west": 120, "us-east": 120})
    regions = [m.region for m in p.members]
    for colo, order in p.rank.items():
        assert order[0] == fleet.rank(colo, regions)[0], colo
        assert all(geo.floor_ms(colo, regions[i].edge_site) * geo.DEFAULT_STRETCH <= 120 for i in order[1:]), colo
    assert [CELLS[i] for i in p.rank["FRA"]] == ["eu-west", "us-east"]  # Ashburn ~102 ms; Tokyo ~145 ms
    assert plan({"eu-west": 120, "us-east": 120}).rank["NRT"] == [0, 1, 2]
    assert plan({"apac-jp": True}).members[0].budget_e2e_ms is None  # not a number of ms: no cut


def test_rank_ties_and_unknown_colos_keep_the_configured_order():
    jp = catalogue.region("apac-jp")
    us = catalogue.region("us-east")
    assert fleet.rank("XXX", [us, jp]) == [0, 1]
    assert fleet.rank("NRT", [us, jp]) == [1, 0]
    assert fleet.rank("nrt", [us, jp]) == [1, 0]
    # Two identical regions tie everywhere: the configured order stands.
    assert fleet.rank("FRA", [jp, jp]) == [0, 1]


def test_every_region_in_one_fleet_fits_cloudflares_limits():
    # As a json binding the ranking of five cells would pass Cloudflare's 5 KB per
    # environment variable (and workerd would not notice): as a module it has no such limit.
    regions = list(catalogue.REGIONS)
    settings = fleet.parse({**raw(), "fleet": {"cells": regions}}, "fleet")
    p = fleet.plan_fleet(settings, [outs(r) for r in regions])
    assert len(fleet.json_text(p.rank).encode()) > cloudflare_limits.ENV_VAR_BYTES
    assert all(len((b.text or "").encode()) <= cloudflare_limits.ENV_VAR_BYTES for b in p.bindings)
    assert fleet.json_text(p.rank) in next(m for m in p.modules if m.name == "cellrank.js").content()


def test_a_binding_past_cloudflares_limit_is_refused_naming_the_limit_and_the_key():
    with pytest.raises(ConfigError) as err:
        cloudflare_limits.check_worker("w", [("a.js", b"x")], [("CELLS", "json", "x" * 5121)],
                                       {"CELLS": "colocate:fleet.cells"}, "colocate:worker.name")
    assert err.value.key == "colocate:fleet.cells" and "5120 bytes (5 KB" in str(err.value)
    assert "CELLS" in str(err.value) and "limits" in str(err.value)
    cloudflare_limits.check_worker("w", [("a.js", b"x")], [("CELLS", "json", "x" * 5120)], {}, "k")  # at the limit
    many = [(f"V{i}", "plain_text", "1") for i in range(65)]
    with pytest.raises(ConfigError, match="65 environment variables.*64 on Workers Free"):
        cloudflare_limits.check_worker("w", [], many, {}, "colocate:worker.name")
    cloudflare_limits.check_worker("w", [], many[:64] + [("S", "service", None)], {}, "k")  # services are not variables
    big = [("big.js", random.Random(1).randbytes(cloudflare_limits.SCRIPT_GZIP_BYTES + 1))]
    with pytest.raises(ConfigError, match="after compression.*3 MB"):
        cloudflare_limits.check_worker("w", big, [], {}, "colocate:worker.name")


def test_a_script_no_compression_could_take_past_the_limit_is_checked_without_compressing(monkeypatch):
    # Compressing the Worker (~500 KB, gzip level 9) cost every plan ~0.1 s of CPU; gzip's worst
    # case (incompressible bytes) bounds the size, so a script under the bound is never compressed.
    for n in (0, 1, 65_536, 1 << 20):
        data = random.Random(n).randbytes(n)
        assert len(gzip.compress(data, mtime=0)) <= cloudflare_limits.gzip_bound(n)

    def no_gzip(*_a, **_k):
        raise AssertionError("compressed a script that cannot reach the limit")

    monkeypatch.setattr(cloudflare_limits.gzip, "compress", no_gzip)
    modules = [(m.name, m.content().encode()) for m in worker_modules()]
    cloudflare_limits.check_worker("w", modules, [], {}, "colocate:worker.name")


def test_member_outputs_wrong_length_is_a_bug():
    with pytest.raises(ValueError):
        fleet.plan_fleet(fleet.parse(raw(), "fleet"), [outs("apac-jp")])


# --- the front door's modules ---------------------------------------------------------

def test_front_modules_are_front_js_and_what_it_imports():
    mods = fleet.front_modules()
    names = [m.name for m in mods]
    # The main module exports front.js's handler and the limits exchange's object.
    assert names[0] == "frontindex.js" and "export class FleetLedger" in (fleet.WORKER_DIR / "fleetledger.js").read_text()
    assert {"front.js", "fleetledger.js", "fleetexchange.js", "errors.js", "timing.js", "body.js", "routes.js"} <= set(names)
    # The cell's state, router and object are not part of the front door.
    assert not {"router.js", "generation.js", "state.js", "index.js"} & set(names)
    for m in mods:  # closed under imports
        for dep in re.findall(r'from\s+"\./([^"]+)"', m.content()):
            assert dep in names, (m.name, dep)


def test_a_cell_command_on_a_fleet_stack_says_so():
    from colocate import stackfile

    raw, secrets = stackfile.read_config("fleet")
    with pytest.raises(ConfigError) as err:
        settings.parse(raw, "fleet", secrets=secrets)
    assert err.value.key == "colocate:fleet" and "is a fleet" in err.value.problem
    assert "apac-jp, eu-west, us-east" in err.value.fix


def test_a_cell_in_another_account_is_refused_before_any_upload():
    # Service bindings reach Workers of the same account only; the cloud would refuse the upload.
    other = "f" * 32
    found = [outs(c) for c in CELLS]
    found[1] = {**found[1], outputs.ACCOUNT_ID: other}
    with pytest.raises(ConfigError) as err:
        fleet.plan_fleet(fleet.parse(raw(), "fleet"), found)
    msg = str(err.value)
    assert err.value.key == "colocate:fleet.cells[1]" and other in msg and ACCOUNT in msg
    assert "same account" in msg and f"pulumi config set colocate:accountId {other}" in msg
    # A cell deployed before it exported its account: redeploy it, as for any missing output.
    found[1] = {k: v for k, v in found[1].items() if k != outputs.ACCOUNT_ID}
    with pytest.raises(ConfigError, match="accountId"):
        fleet.plan_fleet(fleet.parse(raw(), "fleet"), found)


def test_affinity_default_binding_and_refusal():
    """colocate:fleet.affinity: nearest unless set; conversation binds AFFINITY; anything else names the key."""
    p = fleet.plan_fleet(fleet.parse(raw(), "fleet"), [outs(c) for c in CELLS])
    assert {x.name: x for x in p.bindings}["AFFINITY"].text == "nearest"
    s = fleet.parse(raw(fleet={"cells": CELLS, "affinity": "conversation"}), "fleet")
    p = fleet.plan_fleet(s, [outs(c) for c in CELLS])
    assert {x.name: x for x in p.bindings}["AFFINITY"].text == "conversation"
    err = refused(fleet={"cells": CELLS, "affinity": "sticky"})
    assert err.key == "colocate:fleet.affinity" and "conversation" in err.fix and "sticky" in str(err)
