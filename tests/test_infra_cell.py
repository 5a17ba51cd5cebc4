"""The real Pulumi program under the SDK's mock engine, for every stack file in stacks/."""

from __future__ import annotations

import base64
import json

import pulumi
import pytest

from colocate import stackfile
from colocate.cell import catalogue, outputs
from colocate.cell.plan import COMPATIBILITY_DATE, instance_host, worker_modules
from colocate.fleet import plan as fleet
from tests.support.pulumi_mocks import (
    SECRET_VALUES,
    RecordingMocks,
    plain,
    pod_stdout,
    run_program,
    stack_config,
    unsecret,
)

STACKS = sorted(
    p.name[len("Pulumi.") : -len(".yaml")]
    for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml")
    if not fleet.is_fleet(stackfile.read_config(p.name[len("Pulumi.") : -len(".yaml")])[0])
)  # tests/test_fleet_infra.py
WORKER = "cloudflare:index/workersScript:WorkersScript"
COMMAND = "command:local:Command"


def test_every_required_stack_file_exists():
    assert {"apac-tw", "apac-jp", "us-east", "sandbox"} <= set(STACKS)


@pytest.fixture(scope="module", params=STACKS)
def deployed(request):
    """One mock run of each stack's program for every test of this module that reads it (the
    tests only read: a run is what was declared, and declaring it again gives the same)."""
    stack = request.param
    config, secret_keys = stack_config(stack)
    raw, _ = stackfile.read_config(stack)
    return stack, raw, run_program(stack, config, secret_keys)


def placement_of(run) -> dict:
    """The placement block scripts/placement.py is handed (its stdin)."""
    return json.loads(run.mocks.one(COMMAND, "-placement").inputs["stdin"])


def endpoint_address(raw: dict, i: int = 0) -> str:
    """An existing endpoint's host:port as the Worker fetches it: its own name, or the kit's on the zone."""
    e = raw["pod"]["endpoints"][i]
    active = next(g for g in raw["generations"] if g["status"] == "active")
    first, _, rest = f"pod-{active['name'].replace('.', '-')}.{raw['zone']['name']}".partition(".") if "ip" in e else ("", "", "")
    host = e.get("host") or (f"{first}-p{i}.{rest}" if i else f"{first}.{rest}")
    return f"{host}:{e.get('port', 8000)}"


def expected_placement(raw: dict, region) -> dict:
    """auto: pod 0's DNS-only name and the port from its create output (the mocks' 41234) on
    zone-dns, an existing endpoint's own address, the region's cloud hint elsewhere."""
    if raw["pod"].get("provider") == "existing":
        return {"host": endpoint_address(raw)}
    if raw.get("zone"):
        active = next(g for g in raw["generations"] if g["status"] == "active")
        base = f"pod-{active['name'].replace('.', '-')}.{raw['zone']['name']}"
        return {"host": f"{instance_host(base, raw['pod']['provider'], 'pod-123')}:41234"}
    return {"region": region.placement_region}


def bindings_of(run) -> dict:
    is_secret, bindings = unsecret(run.mocks.one(WORKER).inputs["bindings"])
    return {b["name"]: b for b in bindings}, is_secret


def test_worker_declared_from_the_region(deployed):
    stack, raw, run = deployed
    region = catalogue.region(raw["region"])
    active = next(g for g in raw["generations"] if g["status"] == "active")
    w = run.mocks.one(WORKER).inputs
    # The upload carries no placement (read-only in the provider); the settings call sets it.
    assert "placement" not in w and placement_of(run) == expected_placement(raw, region)
    assert w["mainModule"] == "index.js"
    assert w["content"] == (stackfile.ROOT / "worker/src/index.js").read_text()
    others = {m.name for m in worker_modules()} - {"index.js"}
    assert set(w.get("files", {})) == others
    for name, f in w.get("files", {}).items():
        assert base64.b64decode(f["contentBase64"]) == (stackfile.ROOT / "worker/src" / name).read_bytes()
    assert w["compatibilityDate"] >= "2024-09-02" and w["compatibilityDate"] == COMPATIBILITY_DATE
    # No script in the account yet (the mock's default): the first deploy's migration.
    assert w["migrations"] == {"newTag": "v1", "steps": [{"newSqliteClasses": ["Breaker"]}]}
    bindings, _ = bindings_of(run)
    assert bindings["BREAKER"] == {"name": "BREAKER", "type": "durable_object_namespace", "className": "Breaker"}
    assert bindings["ACTIVE_GENERATION"]["text"] == active["name"]
    assert bindings["ACTIVE_HINT"]["text"] == region.location_hint
    assert bindings["CELL_REGION"]["text"] == region.name
    assert "DRAINING_GENERATION" not in bindings
    # Always a hostname (a deployed Worker cannot fetch an IP literal): the path the plan chose.
    expected = {"local-hostname": "https://localhost:41234",
                "provider-proxy": "https://pod-123-8000.proxy.runpod.net",
                # a zone's pod (Vast.ai here) is reached over mutual TLS
                "zone-dns": f"https://{expected_placement(raw, region).get('host')}",
                # the team's own box: always https, at its own address
                "endpoint": f"https://{expected_placement(raw, region).get('host')}"}
    path = run.resolved[outputs.POD_PATH]
    assert bindings["POD_URLS"]["text"] == f'["{expected[path]}"]'
    unzoned = {"local": "local-hostname", "runpod": "provider-proxy"}
    assert path == ("endpoint" if raw["pod"]["provider"] == "existing" else
                    "zone-dns" if raw.get("zone") else unzoned[raw["pod"]["provider"]])


def test_secrets_are_secret_bindings_and_secret_inputs(deployed):
    _, _, run = deployed
    bindings, is_secret = bindings_of(run)
    assert is_secret, "bindings carrying secrets must be stored as a secret"
    for name, key in [("POD_TOKEN", "podToken"), ("FALLBACK_URL", "fallbackUrl"),
                      ("FALLBACK_API_KEY", "fallbackApiKey"), ("READ_TOKEN", "readToken"),
                      ("ADMIN_TOKEN", "adminToken"), ("EXCHANGE_TOKEN", "exchangeToken")]:
        assert bindings[name]["type"] == "secret_text"
        assert bindings[name]["text"] == SECRET_VALUES[key]
    pod = run.mocks.one(COMMAND, "-pod-0").inputs
    env_secret, env = unsecret(pod["environment"])
    assert env_secret and env["POD_TOKEN"] == SECRET_VALUES["podToken"]
    for field in ("create", "delete", "stdin"):
        assert not any(v in json.dumps(pod.get(field)) for v in SECRET_VALUES.values()), field


def test_secrets_stay_secret_in_outputs(deployed):
    _, _, run = deployed
    assert set(run.resolved) == set(outputs.ALL)
    tokens = {outputs.READ_TOKEN: "readToken", outputs.ADMIN_TOKEN: "adminToken", outputs.EXCHANGE_TOKEN: "exchangeToken"}
    for name, key in tokens.items():
        assert run.secret_flags[name] is True and run.resolved[name] == SECRET_VALUES[key]
    for name, value in run.resolved.items():
        if name not in tokens:
            assert run.secret_flags[name] is False
            assert not any(s in json.dumps(value) for s in SECRET_VALUES.values()), name


def test_pod_command_is_replaced_on_identity_change_and_deletes_from_stdout(deployed):
    stack, raw, run = deployed
    region = catalogue.region(raw["region"])
    active = next(g for g in raw["generations"] if g["status"] == "active")
    pod = run.mocks.one(COMMAND, "-pod-0").inputs
    spec = json.loads(pod["stdin"])
    assert pod["create"] == ".venv/bin/python scripts/pod.py rent --spec -"
    assert spec["region"] == region.name and spec["generation"] == active["name"]
    assert spec["name"].startswith(f"colocate-{stack}-")
    triggers = plain(pod["triggers"])
    if spec["provider"] == "existing":  # the team's box: no delete, so `pulumi destroy` leaves it running
        assert "delete" not in pod and spec["locations"] == [raw["pod"]["endpoints"][0]["location"]]
        for identity in (region.name, active["name"], f"endpoint={endpoint_address(raw)}"):
            assert identity in triggers
        return
    assert pod["delete"] == f".venv/bin/python scripts/pod.py delete --stack {stack}"  # its current key first
    assert spec["locations"] == list(region.locations(spec["provider"]))
    for identity in (region.name, spec["gpu"], spec["image"], active["name"]):
        assert identity in triggers


def test_probe_runs_after_worker_and_pod_and_reruns_when_either_changes(deployed):
    stack, raw, run = deployed
    probe = run.mocks.one(COMMAND, "-probe").inputs
    create = probe["create"]
    assert create.startswith(".venv/bin/python scripts/probe.py https://")
    assert f"--expect-region {raw['region']}" in create
    made = pod_stdout(json.loads(run.mocks.one(COMMAND, "-pod-0").inputs["stdin"]))  # what pod 0's wait printed
    assert f"--pod-location {made['location']}" in create and "--wait 120" in create and "--json -" in create
    assert "--settle 300" in create  # a new placement is waited for, never failed on before it applies
    assert ("--warn-only" in create) != bool((raw.get("probe") or {}).get("enforce", False))
    triggers = plain(probe["triggers"])
    assert json.loads(triggers[-1]) == made
    env_secret, env = unsecret(probe["environment"])
    # The probe reads, and mints its routed samples' short-lived key: never the exchange token.
    assert env_secret and env == {"COLOCATE_READ_TOKEN": SECRET_VALUES["readToken"],
                                  "COLOCATE_ADMIN_TOKEN": SECRET_VALUES["adminToken"]}
    for budget, ms in (raw.get("budgets") or {}).items():
        assert f"--budget {budget}={ms:g}" in create


def test_worker_is_reachable_on_workers_dev_without_a_zone(deployed):
    stack, raw, run = deployed
    if raw.get("zone"):  # a stack file with a zone: the Worker is on its custom domain instead
        domain = run.mocks.one("cloudflare:index/workersCustomDomain:WorkersCustomDomain").inputs
        assert domain["hostname"] == f"infer.{raw['zone']['name']}"
        assert not run.mocks.of_type("cloudflare:index/workersScriptSubdomain:WorkersScriptSubdomain")
        return
    subdomain = (raw.get("worker") or {}).get("subdomain", "acme")
    sub = run.mocks.one("cloudflare:index/workersScriptSubdomain:WorkersScriptSubdomain").inputs
    assert sub["enabled"] is True and sub["scriptName"] == f"colocate-{stack}"
    assert run.resolved[outputs.WORKER_URL] == f"https://colocate-{stack}.{subdomain}.workers.dev"


def test_outputs(deployed):
    stack, raw, run = deployed
    region = catalogue.region(raw["region"])
    r = run.resolved
    made = pod_stdout(json.loads(run.mocks.one(COMMAND, "-pod-0").inputs["stdin"]))
    assert r[outputs.POD_ID] == made["id"] and r[outputs.POD_COST_PER_HR] == made["cost_per_hr"]
    assert r[outputs.POD_LOCATION] == made["location"]
    if raw["pod"]["provider"] == "existing":  # the team's own figure and place, as declared
        assert (made["cost_per_hr"], made["location"]) == (raw["pod"]["endpoints"][0]["costPerHr"],
                                                           raw["pod"]["endpoints"][0]["location"])
    assert r[outputs.ACTIVE_HINT] == region.location_hint
    assert r[outputs.PLACEMENT] == expected_placement(raw, region)
    assert r[outputs.PLACEMENT_MODE] == ("pod" if raw.get("zone") or raw["pod"]["provider"] == "existing" else "targeted")
    assert r[outputs.PLACEMENT_HOST] == expected_placement(raw, region).get("host")
    assert r[outputs.PROBE_VERDICT] == "all checks hold"


FIRST = {"newTag": "v1", "steps": [{"newSqliteClasses": ["Breaker"]}]}


def migrations_sent(run):
    return run.mocks.one(WORKER).inputs.get("migrations")


def test_first_deploy_when_cloudflare_has_no_such_script():
    config, keys = stack_config("apac-jp")
    run = run_program("apac-jp", config, keys, scripts={"someone-elses-worker": "v3"})
    assert migrations_sent(run) == FIRST
    call = next(c for c in run.mocks.calls if c.token == "cloudflare:index/getWorkersScripts:getWorkersScripts")
    assert call.args["accountId"] == "0123456789abcdef0123456789abcdef"
    # Nothing is written back: the tag is Cloudflare's to keep, not a file's.
    assert not [r for r in run.mocks.of_type(COMMAND) if "record-tag" in str(r.inputs.get("create"))]


def test_nothing_pending_sends_no_migrations_block():
    config, keys = stack_config("apac-jp")
    run = run_program("apac-jp", config, keys, scripts={"colocate-apac-jp": "v1"})
    assert migrations_sent(run) is None


def test_one_pending_step_after_the_live_tag(monkeypatch):
    from colocate.cell import plan

    monkeypatch.setattr(plan, "MIGRATIONS", plan.MIGRATIONS + (("v2", {"new_sqlite_classes": ["Usage"]}),))
    config, keys = stack_config("apac-jp")
    run = run_program("apac-jp", config, keys, scripts={"colocate-apac-jp": "v1"})
    assert migrations_sent(run) == {"oldTag": "v1", "newTag": "v2", "steps": [{"newSqliteClasses": ["Usage"]}]}


def test_a_stack_file_behind_the_live_tag_warns_and_cloudflare_wins(monkeypatch):
    warnings = []
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, *a, **k: warnings.append(msg))
    # A clean checkout whose file says nothing was applied, or an old one that says v1 when the script has none.
    for file_tag, live, sent in [("", "v1", None), ("v1", "", FIRST)]:
        warnings.clear()
        config, keys = stack_config("apac-jp", overrides={"worker": {"subdomain": "acme", "migrationTag": file_tag}})
        run = run_program("apac-jp", config, keys, scripts={"colocate-apac-jp": live})
        assert migrations_sent(run) == sent
        assert bool(warnings) == bool(file_tag), warnings
        if file_tag:
            assert "colocate:worker.migrationTag" in warnings[0] and "colocate-apac-jp" in warnings[0]


def test_a_failed_read_of_the_live_tag_stops_before_any_resource():
    # No guessed tag: the program ends at the invoke, nothing is declared.
    config, keys = stack_config("apac-jp", overrides={"worker": {"subdomain": "acme", "migrationTag": "v1"}})
    mocks = RecordingMocks()
    with pytest.raises(Exception, match="Cloudflare API unreachable"):
        run_program("apac-jp", config, keys, scripts_fail=True, mocks=mocks)
    assert [c.token for c in mocks.calls][-1] == "cloudflare:index/getWorkersScripts:getWorkersScripts"
    assert mocks.resources == []


def test_a_live_tag_unknown_to_the_kit_is_refused_before_any_resource():
    config, keys = stack_config("apac-jp")
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-jp", config, keys, scripts={"colocate-apac-jp": "v9-from-elsewhere"})
    assert "v9-from-elsewhere" in str(err.value) and "colocate:worker.name" in str(err.value)


def test_zone_gives_custom_domain_and_dns_only_pod_hostname():
    zone = {"id": "f" * 32, "name": "example.com"}
    config, keys = stack_config("apac-jp", overrides={"zone": zone})
    run = run_program("apac-jp", config, keys)
    domain = run.mocks.one("cloudflare:index/workersCustomDomain:WorkersCustomDomain").inputs
    assert domain["hostname"] == "infer.example.com" and domain["zoneId"] == "f" * 32
    dns_args = run.mocks.one("cloudflare:index/dnsRecord:DnsRecord")
    assert dns_args.name == "apac-jp-pod-dns-0"
    dns = dns_args.inputs
    assert dns["proxied"] is False and dns["type"] == "A" and dns["content"] == "203.0.113.7"
    assert dns["name"] == instance_host("pod-apac-jp-g1.example.com", "runpod", "pod-123")  # the instance's own
    bindings, _ = bindings_of(run)
    # The pod's public port comes from the create output (providers map ports).
    assert bindings["POD_URLS"]["text"] == f'["https://{dns["name"]}:41234"]'
    assert run.resolved[outputs.WORKER_URL] == "https://infer.example.com"
    assert run.resolved[outputs.POD_PATH] == "zone-dns"
    assert "--pod-path zone-dns" in run.mocks.one(COMMAND, "-probe").inputs["create"]


def test_a_zone_the_token_cannot_read_stops_before_any_pod_is_rented():
    # stacks/Pulumi.apac-tw.yaml ships a placeholder zone: with an account that lacks it,
    # the program must end at the zone lookup, not at the DNS record after the pods are up.
    config, keys = stack_config("apac-tw")
    mocks = RecordingMocks()
    mocks.zones = {"a" * 32: "acme.dev"}
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-tw", config, keys, mocks=mocks)
    msg = str(err.value)
    assert "colocate:zone.name" in msg and "'example.com'" in msg and "0" * 32 in msg
    assert "pulumi config set --path colocate:zone.id <Zone ID>" in msg
    assert mocks.resources == []


def test_a_zone_id_that_is_not_the_zones_stops_naming_the_right_one():
    config, keys = stack_config("apac-jp", overrides={"zone": {"id": "e" * 32, "name": "example.com"}})
    mocks = RecordingMocks()
    mocks.zones = {"f" * 32: "example.com", "e" * 32: "example.org"}
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-jp", config, keys, mocks=mocks)
    msg = str(err.value)
    assert "colocate:zone.id" in msg and "e" * 32 in msg
    assert f"pulumi config set --path colocate:zone.id {'f' * 32}" in msg
    assert mocks.resources == []
    assert [c.args.get("name") for c in mocks.calls if c.token.endswith("getZones")] == ["example.com"]


def test_smart_placement_is_an_option():
    config, keys = stack_config("apac-jp", overrides={"worker": {"subdomain": "acme", "placement": "smart"}})
    run = run_program("apac-jp", config, keys)
    assert placement_of(run) == {"mode": "smart"}


MOVE = [
    {"name": "apac-jp.g1", "region": "apac-jp", "status": "draining"},
    {"name": "apac-tw.g2", "region": "apac-tw", "status": "active"},
]


def test_migration_in_progress_binds_both_generations_and_moves_pod_with_state():
    config, keys = stack_config("apac-tw", overrides={"generations": MOVE})
    run = run_program("apac-tw", config, keys)
    bindings, _ = bindings_of(run)
    assert bindings["ACTIVE_GENERATION"]["text"] == "apac-tw.g2" and bindings["ACTIVE_HINT"]["text"] == "apac"
    assert bindings["DRAINING_GENERATION"]["text"] == "apac-jp.g1"
    spec = json.loads(run.mocks.one(COMMAND, "-pod-0").inputs["stdin"])
    assert spec["region"] == "apac-tw" and spec["generation"] == "apac-tw.g2" and spec["locations"] == ["TW"]
    assert run.resolved[outputs.DRAINING_GENERATION] == "apac-jp.g1"


def test_after_finish_the_retired_generation_is_unbound_and_purged_once():
    retired = [dict(MOVE[0], status="retired"), MOVE[1]]
    config, keys = stack_config("apac-tw", overrides={"generations": retired})
    run = run_program("apac-tw", config, keys)
    bindings, _ = bindings_of(run)
    assert "DRAINING_GENERATION" not in bindings
    purge = run.mocks.one(COMMAND, "-purge-apac-jp.g1").inputs
    assert "scripts/migrate.py purge" in purge["create"] and "--generation apac-jp.g1" in purge["create"]
    assert unsecret(purge["environment"])[0]


def test_a_failing_assertion_inside_the_mock_run_is_seen():
    # Guard against a harness that swallows failures (a wrong assertion must fail once).
    config, keys = stack_config("apac-jp")
    run = run_program("apac-jp", config, keys)
    with pytest.raises(AssertionError):
        assert placement_of(run) == {"region": "aws:us-east-1"}


def test_nothing_is_declared_at_import_time():
    import importlib

    import infra.cell
    import infra.program

    importlib.reload(infra.program)
    importlib.reload(infra.cell)
    assert isinstance(pulumi.runtime.get_config("colocate:region"), (str, type(None)))


def test_the_program_at_each_step_of_a_migration(tmp_path):
    import shutil

    from scripts import migrate

    for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    steps = {}
    for step, argv in [("start", ["start", "--stack", "us-east", "--to", "apac-jp"]),
                       ("finish", ["finish", "--stack", "us-east", "--skip-import-check"])]:  # no cell here to ask
        assert migrate.main([*argv, "--stacks-dir", str(tmp_path)]) == 0
        config, keys = stack_config("us-east", stacks_dir=tmp_path)
        steps[step] = run_program("us-east", config, keys)
    start, finish = steps["start"], steps["finish"]
    bindings, _ = bindings_of(start)
    assert (bindings["ACTIVE_GENERATION"]["text"], bindings["DRAINING_GENERATION"]["text"]) == ("apac-jp.g2", "us-east.g1")
    # pod placement on the stack's zone: beside the new generation's pod 0
    assert placement_of(start)["host"].endswith(".pod-apac-jp-g2.example.com:41234")
    assert json.loads(start.mocks.one(COMMAND, "-pod-0").inputs["stdin"])["locations"] == ["AP-JP-1"]
    assert not [r for r in start.mocks.of_type(COMMAND) if "-purge-" in r.name]
    bindings, _ = bindings_of(finish)
    assert "DRAINING_GENERATION" not in bindings and bindings["ACTIVE_GENERATION"]["text"] == "apac-jp.g2"
    assert finish.mocks.one(COMMAND, "-purge-us-east.g1")
    # The pod is the same across finish: only the ledger's draining entry changed.
    assert start.mocks.one(COMMAND, "-pod-0").inputs["stdin"] == finish.mocks.one(COMMAND, "-pod-0").inputs["stdin"]


@pytest.mark.parametrize("stack", ["apac-jp", "fleet"])
def test_destroy_is_possible_because_the_scripts_delete_forced(stack, monkeypatch):
    # Each script implements a Durable Object class (and a cell's is bound by its front door):
    # Cloudflare deletes it only when forced, and the mocks refuse a script it could not delete.
    import infra.cell
    import infra.fleet
    from tests.support.pulumi_mocks import UndeletableScript
    from tests.test_fleet_infra import deploy

    def go():
        if stack == "fleet":
            return deploy()
        config, keys = stack_config(stack)
        return run_program(stack, config, keys)

    assert plain(go().mocks.one(WORKER).inputs)["force"] is True
    real = infra.cell.cloudflare.WorkersScript

    def unforced(name, *args, **kwargs):
        kwargs.pop("force", None)
        return real(name, *args, **kwargs)

    module = infra.fleet if stack == "fleet" else infra.cell
    monkeypatch.setattr(module.cloudflare, "WorkersScript", unforced)
    with pytest.raises(Exception) as err:
        go()
    assert isinstance(err.value, UndeletableScript), repr(err.value)
    assert "implements the Durable Object class" in str(err.value)


@pytest.mark.parametrize("stack", ["apac-jp", "fleet"])
def test_bindings_are_declared_in_name_order(stack):
    # The order Cloudflare's API returns them in: nothing can be matched by position to the
    # wrong binding (terraform-provider-cloudflare #7350, #7370), and the order is stable.
    from tests.test_fleet_infra import deploy

    if stack == "fleet":
        run = deploy()
    else:
        config, keys = stack_config(stack)
        run = run_program(stack, config, keys)
    names = [b["name"] for b in plain(run.mocks.one(WORKER).inputs["bindings"])]
    assert len(names) > 10 and names == sorted(names)


def test_preview_refuses_a_binding_past_cloudflares_limit_naming_it():
    # workerd takes any size; Cloudflare refuses an environment variable over 5 KB at upload.
    config, keys = stack_config("apac-jp", overrides={"fallbackModel": "m" * 5200})
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-jp", config, keys)
    msg = str(err.value)
    assert msg.startswith("colocate:fallbackModel:") and "FALLBACK_MODEL" in msg and "5 KB" in msg
    # A secret is checked as it resolves, and never shown.
    long_url = "https://fallback.example.com/" + "x" * 5200
    config, keys = stack_config("apac-jp", secrets={**SECRET_VALUES, "fallbackUrl": long_url})
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-jp", config, keys)
    assert str(err.value).startswith("colocate:fallbackUrl:") and "5 KB" in str(err.value)
    assert long_url not in str(err.value)


def test_preview_refuses_runpod_community_cloud_behind_a_zone():
    config, keys = stack_config("apac-jp", overrides={"zone": {"id": "f" * 32, "name": "example.com"},
                                                      "pod": {"provider": "runpod", "cloud": "COMMUNITY"}})
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError, match=r"colocate:pod\.cloud: .*public ip.*Fix: pulumi config set --path "
                                              r"colocate:pod\.cloud SECURE"):
        run_program("apac-jp", config, keys, mocks=mocks)
    assert mocks.of_type(COMMAND) == []  # no pod was declared


def test_every_stack_rents_then_waits_for_its_pods_and_sweeps_cloud_strays_after_the_worker(deployed):
    stack, raw, run = deployed
    commands = {r.name: r.inputs for r in run.mocks.of_type(COMMAND)}
    assert "pod.py rent" in commands[f"{stack}-pod-0"]["create"]
    assert "pod.py wait" in commands[f"{stack}-pod-0-ready"]["create"]
    sweep = commands.get(f"{stack}-pod-sweep")
    if raw["pod"]["provider"] in ("local", "existing"):
        # a local stand-in is this machine's process, an existing endpoint the team's box: not rented GPUs
        assert sweep is None
    else:
        scope = run.resolved["podScope"]
        sweep_cmd = f".venv/bin/python scripts/pod.py sweep --stack {stack} --scope {scope} --destroy"
        assert sweep["create"] == f"{sweep_cmd} --provider {raw['pod']['provider']} --keep pod-123"
        # `pulumi destroy` deletes every pod of the stack's scope, also one a killed rent left with no record.
        assert sweep["delete"] == f"{sweep_cmd} --provider {raw['pod']['provider']}"
        assert all(json.loads(r.inputs["stdin"])["name"].startswith(f"colocate-{stack}-{scope}-")
                   for r in run.mocks.of_type(COMMAND) if "pod.py rent" in r.inputs.get("create", ""))


def test_pod_names_are_scoped_by_the_pulumi_organization_and_project(monkeypatch):
    """Two projects (or organizations) with a stack `us-east` on one RunPod account name their pods apart."""
    from colocate.cell.plan import pod_scope

    config, keys = stack_config("us-east")
    run = run_program("us-east", config, keys)
    scope = run.resolved["podScope"]
    assert scope == pod_scope(pulumi.get_organization(), "colocate") != pod_scope(pulumi.get_organization(), "other")
    assert scope != pod_scope("another-org", "colocate") and len(scope) == 6


@pytest.mark.parametrize("stack,overrides", [("apac-tw", {}), ("apac-jp", {"zone": {"id": "f" * 32, "name": "example.com"},
                                                                           "pod": {"provider": "runpod", "count": 2}})])
def test_a_pod_replacement_keeps_the_old_pod_reachable_until_the_worker_has_moved(stack, overrides, monkeypatch):
    """A replaced pod is a new instance with a new record name: the record is replaced (created beside
    the old one, never renamed in place: in terraform-provider-cloudflare's dns_record schema only
    zone_id forces that), the Worker is uploaded only once the new records exist, and the old pod and
    its record, replaced create-before-delete, are deleted by the engine at the end of the update."""
    from tests.support.pulumi_mocks import record_options

    declared = record_options(monkeypatch)
    config, keys = stack_config(stack, overrides=overrides)
    run_program(stack, config, keys)
    records = [d for d in declared if d.typ == "cloudflare:index/dnsRecord:DnsRecord"]
    rents = [d for d in declared if d.typ == "command:local:Command" and "-pod-" in d.name and "sweep" not in d.name]
    worker = next(d for d in declared if d.typ == "cloudflare:index/workersScript:WorkersScript")
    assert records and len(rents) == 2 * len(records)  # a rent and a wait per pod
    for record in records:
        assert record.opts.replace_on_changes == ["name"] and record.opts.delete_before_replace is False
    for rent in rents:
        assert rent.opts.delete_before_replace is False  # create before delete
    needs = {id(r) for r in worker.opts.depends_on or []}
    assert all(id(r.resource) in needs for r in [*records, *[r for r in rents if r.name.endswith("-ready")]])
