"""The fleet stack under Pulumi's mock engine: StackReferences in, one front door out."""

from __future__ import annotations

import base64
import json

import pulumi
import pytest

from colocate import projectfile, stackfile
from colocate.cell import outputs
from colocate.fleet import plan as fleet
from tests.support.pulumi_mocks import SECRET_VALUES, RecordingMocks, run_program, stack_config, unsecret

WORKER = "cloudflare:index/workersScript:WorkersScript"
SUBDOMAIN = "cloudflare:index/workersScriptSubdomain:WorkersScriptSubdomain"
DOMAIN = "cloudflare:index/workersCustomDomain:WorkersCustomDomain"
REF = "pulumi:pulumi:StackReference"
ACCOUNT = "0123456789abcdef0123456789abcdef"


def cell_outputs(region: str) -> dict:
    name = f"colocate-{region}"
    return {outputs.WORKER_NAME: name, outputs.WORKER_URL: f"https://{name}.acme.workers.dev", outputs.REGION: region,
            outputs.ACCOUNT_ID: ACCOUNT, outputs.EXCHANGE_TOKEN: f"exchange-secret-of-{region}"}


class FleetMocks(RecordingMocks):
    """Answers each StackReference with the outputs of the stack it names (by bare name)."""

    def __init__(self, stacks: dict[str, dict], scripts: dict[str, str] | None = None):
        super().__init__(scripts)
        self.stacks = stacks

    def new_resource(self, args):
        if args.typ == REF:
            self.resources.append(args)
            found = self.stacks.get(args.inputs["name"].rsplit("/", 1)[-1], {})
            return [args.inputs["name"], {"name": args.inputs["name"], "outputs": found,
                                          "secretOutputNames": [outputs.EXCHANGE_TOKEN]}]
        if args.typ == WORKER:  # a service binding reaches only a Worker of the same account
            accounts = {o.get(outputs.WORKER_NAME): o.get(outputs.ACCOUNT_ID) for o in self.stacks.values()}
            bindings = args.inputs.get("bindings") or []
            for b in bindings.get("value", []) if isinstance(bindings, dict) else bindings:
                if b.get("type") == "service" and accounts.get(b["service"]) != args.inputs["accountId"]:
                    raise RuntimeError(f"Cloudflare: service binding {b['name']}: no Worker {b['service']} in "
                                       f"account {args.inputs['accountId']}")
        return super().new_resource(args)


def fleet_config(overrides: dict | None = None, *, cli_defaults: bool = True) -> tuple[dict, list[str]]:
    """stacks/Pulumi.fleet.yaml as the CLI hands it over: the project's defaults for every
    key the stack does not set (Pulumi.yaml), then the stack's own values."""
    config: dict = {}
    if cli_defaults:
        for key, entry in projectfile.declared().items():
            if "default" in entry:
                d = entry["default"]
                config[key] = d if isinstance(d, str) else json.dumps(d)
    raw, _ = stackfile.read_config("fleet")
    raw.update({"accountId": ACCOUNT, "worker": {"subdomain": "acme"}})
    raw.update(overrides or {})
    for k, v in raw.items():
        config[f"colocate:{k}"] = v if isinstance(v, str) else json.dumps(v)
    config["cloudflare:apiToken"] = "cf-token-s3cret"
    return config, ["cloudflare:apiToken"]


STACKS = {r: cell_outputs(r) for r in ("apac-jp", "eu-west", "us-east")}


def deploy(stacks: dict | None = None, overrides: dict | None = None, scripts: dict | None = None, **kw):
    config, keys = fleet_config(overrides, **kw)
    return run_program("fleet", config, keys, mocks=FleetMocks(STACKS if stacks is None else stacks, scripts))


def refused(stacks: dict | None = None, overrides: dict | None = None) -> str:
    with pytest.raises(pulumi.RunError) as err:
        deploy(stacks, overrides)
    return str(err.value)


def test_the_fleet_stack_file_is_a_fleet():
    raw, _ = stackfile.read_config("fleet")
    assert fleet.is_fleet(raw) and raw["fleet"]["cells"] == ["apac-jp", "eu-west", "us-east"]
    for cell in raw["fleet"]["cells"]:  # each member is a cell stack of this project
        assert not fleet.is_fleet(stackfile.read_config(cell)[0])


def test_one_front_door_with_service_bindings_and_no_placement():
    run = deploy()
    refs = run.mocks.of_type(REF)
    # Registered concurrently: compare as a set of org/project/stack names.
    assert sorted(r.inputs["name"].split("/", 1)[1] for r in refs) == [f"colocate/{c}" for c in ("apac-jp", "eu-west", "us-east")]
    w = run.mocks.one(WORKER).inputs
    assert w["scriptName"] == "colocate-fleet" and w["accountId"] == ACCOUNT
    assert "placement" not in w, "the front door runs where the request arrives"
    main = "frontindex.js"  # front.js's handler and the FleetLedger class
    assert w["mainModule"] == main and w["content"] == (stackfile.ROOT / "worker/src" / main).read_text()
    assert set(w["files"]) == {m.name for m in fleet.front_modules()} - {main}
    for name, f in w["files"].items():
        if name != "cellrank.js":  # the plan's ranking, below
            assert base64.b64decode(f["contentBase64"]) == (stackfile.ROOT / "worker/src" / name).read_bytes()
    is_secret, bindings = unsecret(w["bindings"])
    assert is_secret, "the bindings hold the cells' probe tokens"
    b = {x["name"]: x for x in bindings}
    assert b["CELL_0"] == {"name": "CELL_0", "type": "service", "service": "colocate-apac-jp"}
    assert b["CELL_1"]["service"] == "colocate-eu-west" and b["CELL_2"]["service"] == "colocate-us-east"
    assert b["CELLS"]["type"] == "json"
    assert json.loads(b["CELLS"]["json"]) == [{"name": r, "region": r} for r in ("apac-jp", "eu-west", "us-east")]
    rank_js = base64.b64decode(w["files"]["cellrank.js"]["contentBase64"]).decode()
    rank = json.loads(rank_js.removeprefix("export default ").removesuffix(";\n"))
    assert rank["NRT"][0] == 0 and rank["FRA"][0] == 1 and rank["IAD"][0] == 2 and "CELL_RANK" not in b
    assert b["REMEMBER_MS"] == {"name": "REMEMBER_MS", "type": "plain_text", "text": "5000"}
    assert b["EXCHANGE_MS"] == {"name": "EXCHANGE_MS", "type": "plain_text", "text": "1000"}
    # The limits exchange: its object, and each cell's probe token read from that cell's stack.
    assert b["LEDGER"] == {"name": "LEDGER", "type": "durable_object_namespace", "className": "FleetLedger"}
    for i, region in enumerate(("apac-jp", "eu-west", "us-east")):
        assert b[f"CELL_TOKEN_{i}"] == {"name": f"CELL_TOKEN_{i}", "type": "secret_text", "text": f"exchange-secret-of-{region}"}
    others = [x for x in bindings if not x["name"].startswith("CELL_TOKEN_")]
    assert not any(s in json.dumps(others) for s in ("exchange-secret-of-", *SECRET_VALUES.values()))
    assert w["migrations"] == {"newTag": "v1", "steps": [{"newSqliteClasses": ["FleetLedger"]}]}
    sub = run.mocks.one(SUBDOMAIN).inputs
    assert sub["scriptName"] == "colocate-fleet" and sub["enabled"] is True
    assert not run.mocks.of_type(DOMAIN) and not run.mocks.of_type("command:local:Command")


def test_the_ledger_class_is_created_once():
    # Cloudflare reports the tag applied: nothing pending, no migrations block.
    assert deploy(scripts={"colocate-fleet": "v1"}).mocks.one(WORKER).inputs.get("migrations") is None
    with pytest.raises(pulumi.RunError) as err:
        deploy(scripts={"colocate-fleet": "v9"})
    msg = str(err.value)
    assert "colocate:worker.name" in msg and "'v9'" in msg


def test_a_member_without_its_exchange_token_is_refused():
    old = {k: v for k, v in cell_outputs("eu-west").items() if k != outputs.EXCHANGE_TOKEN}
    msg = refused({**STACKS, "eu-west": old})
    assert "colocate:fleet.cells[1]" in msg and "no output exchangeToken" in msg and "Fix: pulumi up -s eu-west" in msg


def test_exports_list_the_cells_with_their_regions():
    run = deploy()
    assert set(run.resolved) == set(outputs.FLEET_ALL)
    assert run.resolved[outputs.WORKER_URL] == "https://colocate-fleet.acme.workers.dev"
    assert [(c["name"], c["region"], c["workerName"]) for c in run.resolved[outputs.CELLS]] == [
        ("apac-jp", "apac-jp", "colocate-apac-jp"), ("eu-west", "eu-west", "colocate-eu-west"),
        ("us-east", "us-east", "colocate-us-east")]
    assert not any(run.secret_flags.values())


def test_a_zone_gives_a_custom_domain():
    zone = {"id": "f" * 32, "name": "example.com"}
    run = deploy(overrides={"zone": zone, "worker": {}})
    d = run.mocks.one(DOMAIN).inputs
    assert d["hostname"] == "fleet.example.com" and d["service"] == "colocate-fleet" and d["zoneId"] == "f" * 32
    assert run.resolved[outputs.WORKER_URL] == "https://fleet.example.com"


def test_a_member_stack_without_outputs_is_refused():
    msg = refused({**STACKS, "eu-west": {}})
    assert "colocate:fleet.cells[1]" in msg and "'eu-west'" in msg
    assert "no outputs workerName, workerUrl, region, accountId" in msg
    assert "Fix: pulumi up -s eu-west" in msg


def test_a_member_deployed_before_the_region_output_is_refused():
    old = {k: v for k, v in cell_outputs("us-east").items() if k != outputs.REGION}
    msg = refused({**STACKS, "us-east": old})
    assert "colocate:fleet.cells[2]" in msg and "no outputs region" in msg


@pytest.fixture
def stacks_dir(tmp_path, monkeypatch):
    """A copy of stacks/ the program reads instead (a test adds cell stack files to it)."""
    d = tmp_path / "stacks"
    d.mkdir()
    for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml"):
        (d / p.name).write_text(p.read_text())
    monkeypatch.setattr(stackfile, "STACKS_DIR", d)
    return d


def test_two_cells_in_one_region_are_refused(stacks_dir):
    (stacks_dir / "Pulumi.apac-jp-2.yaml").write_text((stacks_dir / "Pulumi.apac-jp.yaml").read_text())
    stacks = {**STACKS, "apac-jp-2": {**cell_outputs("apac-jp"), outputs.WORKER_NAME: "colocate-apac-jp-2"}}
    msg = refused(stacks, {"fleet": {"cells": ["apac-jp", "apac-jp-2", "us-east"]}})
    assert "colocate:fleet.cells" in msg and "both in region apac-jp" in msg and "Fix:" in msg


def test_a_member_stack_that_does_not_exist_is_refused_before_any_reference(stacks_dir):
    mocks = FleetMocks(STACKS)
    config, keys = fleet_config({"fleet": {"cells": ["apac-jp", "ap-south", "us-east"]}})
    with pytest.raises(pulumi.RunError) as err:
        run_program("fleet", config, keys, mocks=mocks)
    msg = str(err.value)
    assert "colocate:fleet.cells[1]" in msg and "'ap-south'" in msg and "no stack ap-south" in msg
    assert "pulumi stack init ap-south" in msg and "apac-jp, apac-tw" in msg
    # Refused by the program, not by the engine: no reference was read at all.
    assert not [r for r in mocks.resources if r.typ == REF]


def test_a_fleet_named_as_a_member_is_refused(stacks_dir):
    (stacks_dir / "Pulumi.fleet2.yaml").write_text((stacks_dir / "Pulumi.fleet.yaml").read_text())
    msg = refused(overrides={"fleet": {"cells": ["apac-jp", "fleet2"]}})
    assert "colocate:fleet.cells[1]" in msg and "fleet2 is a fleet stack, not a cell" in msg


def test_a_member_of_another_project_is_checked_by_its_outputs_only(stacks_dir):
    stacks = {**STACKS, "tokyo": cell_outputs("apac-tw")}
    run = deploy(stacks, {"fleet": {"cells": ["acme/other/tokyo", "eu-west"]}})
    assert [(c["name"], c["stack"], c["region"]) for c in run.resolved[outputs.CELLS]] == [
        ("tokyo", "acme/other/tokyo", "apac-tw"), ("eu-west", "eu-west", "eu-west")]


@pytest.mark.parametrize("overrides, key", [
    ({"region": "apac-jp"}, "colocate:region"),
    ({"fleet": {"cells": []}}, "colocate:fleet"),  # empty: not a fleet, so a cell missing its keys
    ({"fleet": {"cells": ["apac-jp", "apac-jp"]}}, "colocate:fleet.cells[1]"),
    ({"worker": {"subdomain": "acme", "placement": "smart"}}, "colocate:worker.placement"),
    ({"accountId": ""}, "colocate:accountId"),
])
def test_bad_fleet_config_is_refused_naming_the_key(overrides, key):
    msg = refused(overrides=overrides)
    assert key in msg and "Fix:" in msg


def test_a_cells_secret_on_the_fleet_is_refused():
    config, keys = fleet_config()
    config["colocate:podToken"] = "pod-token"
    with pytest.raises(pulumi.RunError, match="colocate:podToken.*a cell's secret"):
        run_program("fleet", config, [*keys, "colocate:podToken"], mocks=FleetMocks(STACKS))


def test_a_cells_secret_in_plain_text_is_refused():
    config, keys = stack_config("apac-jp")
    keys = [k for k in keys if k != "colocate:podToken"]
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-jp", config, keys)
    msg = str(err.value)
    assert "colocate:podToken: is stored in plain text" in msg and "pulumi config set --secret colocate:podToken" in msg
    assert SECRET_VALUES["podToken"] not in msg


def test_a_cell_exports_its_region_and_account_for_fleets():
    config, keys = stack_config("eu-west")
    run = run_program("eu-west", config, keys)
    assert run.resolved[outputs.REGION] == "eu-west"
    assert run.resolved[outputs.ACCOUNT_ID] == config["colocate:accountId"] == ACCOUNT


def test_a_member_in_another_account_is_refused_by_preview():
    other = {**cell_outputs("eu-west"), outputs.ACCOUNT_ID: "f" * 32}
    msg = refused({**STACKS, "eu-west": other})
    assert "colocate:fleet.cells[1]" in msg and "f" * 32 in msg and ACCOUNT in msg and "same account" in msg


def test_project_defaults_leave_a_cell_as_strict_as_before():
    # The CLI no longer demands a cell's keys (a fleet stack lacks them): the program does.
    config, keys = stack_config("apac-jp", drop=("region",))
    config.setdefault("colocate:region", "")
    with pytest.raises(pulumi.RunError, match="colocate:region"):
        run_program("apac-jp", config, keys)
    config, keys = stack_config("apac-jp", secrets={k: v for k, v in SECRET_VALUES.items() if k != "readToken"})
    config["colocate:readToken"] = ""
    with pytest.raises(pulumi.RunError, match="colocate:readToken.*pulumi config set --secret"):
        run_program("apac-jp", config, keys)


def test_fleet_mocks_fail_when_they_should():
    # The mock answers by stack name: a stack it does not know has no outputs, so the
    # refusal above is the program's, not the mock's.
    assert "no outputs" in refused({k: v for k, v in STACKS.items() if k != "apac-jp"})
    assert isinstance(RecordingMocks(), pulumi.runtime.Mocks)


def test_the_mocks_refuse_what_the_cloud_would_when_the_program_does_not(monkeypatch):
    # The program refuses a member in another account, and a binding past 5 KB, at preview; the
    # mocks refuse the upload Cloudflare would, so a program that stopped checking is caught.
    monkeypatch.setattr(fleet, "check_accounts", lambda settings, members: None)
    with pytest.raises(Exception, match="no Worker colocate-eu-west in account"):
        deploy({**STACKS, "eu-west": {**cell_outputs("eu-west"), outputs.ACCOUNT_ID: "f" * 32}})
    from colocate.cell import cloudflare_limits

    monkeypatch.setattr(cloudflare_limits, "check_worker", lambda *a, **k: None)
    monkeypatch.setattr(fleet, "json_text", lambda value: json.dumps(value) + " " * 6000)  # CELLS past 5 KB
    with pytest.raises(Exception, match="binding CELLS is .* bytes; Cloudflare refuses an environment variable over 5120"):
        deploy()
