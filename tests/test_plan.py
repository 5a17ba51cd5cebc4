"""Settings and the cell plan: pure, no Pulumi."""

from __future__ import annotations

import itertools
import re

import pytest
from ruamel.yaml import YAML

from colocate import stackfile
from colocate.cell import catalogue, plan, settings
from colocate.errors import ConfigError, MissingSetting
from colocate.fleet import plan as fleet
from colocate.projectfile import PROJECT_FILE, declared
from tests.support.images import GUARDED_IMAGE, guarded

SECRETS = frozenset({"podToken", "probeToken", "fallbackUrl", "fallbackApiKey", "runpodApiKey", "vastaiApiKey"})


def raw_for(region="apac-jp", provider="runpod", **extra):
    raw = {
        "region": region,
        "generations": [{"name": f"{region}.g1", "region": region, "status": "active"}],
        "accountId": "0123456789abcdef0123456789abcdef",
        "pod": {"provider": provider},
        "worker": {"subdomain": "acme"},
        "fallbackModel": "gpt-4o-mini",
        "fallbackCap": {"cellUsdPerDay": 0},  # no cap, knowingly: the cap's own tests set one
    }
    if provider == "vastai":  # Vast.ai pods are reached through a DNS-only record on a zone
        raw["zone"] = ZONE
    raw.update(extra)
    return guarded(raw)


ZONE = {"id": "a" * 32, "name": "example.com"}


def cell(raw, stack="t"):
    return plan.plan_cell(settings.parse(raw, stack, secrets=SECRETS))


def test_pulumi_yaml_declares_every_key_as_settings_does():
    doc = YAML(typ="safe").load(PROJECT_FILE.read_text())
    assert doc["name"] == "colocate" and doc["stackConfigDir"] == "stacks"
    assert doc["runtime"]["options"]["virtualenv"] == ".venv"
    assert doc["config"] == declared()
    for key, entry in doc["config"].items():
        assert entry["description"], key
        # Only types project.json's simpleConfigType accepts without `items` (see projectfile.py).
        assert entry.get("type", "string") in ("string", "integer", "boolean"), key
    untyped = {k for k, e in doc["config"].items() if "type" not in e}
    assert untyped == {f"colocate:{k.name}" for k in settings.SCHEMA if k.type in ("object", "array")}


@pytest.mark.parametrize("region, provider", [
    (r.name, p) for r in catalogue.REGIONS.values() for p in r.providers
])
def test_pod_and_state_always_share_the_region(region, provider):
    p = cell(raw_for(region, provider))
    r = catalogue.region(region)
    assert p.pod.region == region == p.state.active.region
    assert p.state.hint == r.location_hint
    # auto: the pod itself where it has a DNS-only record, else the region's cloud hint.
    if p.pod.path == plan.PATH_ZONE_DNS:
        assert p.worker.placement_mode == "pod" and p.worker.placement_host.hostname == p.pod.pod_hostname
    else:
        assert p.worker.placement == {"region": r.placement_region} and p.worker.placement_mode == "targeted"
    assert p.pod.spec()["locations"] == list(r.locations(provider))
    assert p.probe.expected_colos == r.in_region_colos


def test_bindings_are_generated_from_the_plan():
    p = cell(raw_for())
    names = [b.name for b in p.worker.bindings]
    assert names[0] == "BREAKER"
    # SECRETS holds only the old probeToken: it fills every role, and PROBE_TOKEN for an older Worker.
    assert {"POD_TOKEN", "FALLBACK_URL", "FALLBACK_API_KEY", "READ_TOKEN", "ADMIN_TOKEN", "EXCHANGE_TOKEN", "PROBE_TOKEN"} == {
        b.name for b in p.worker.bindings if b.type == "secret_text"}
    assert p.worker.binding("POD_URLS").from_output == plan.POD_URLS_FROM_OUTPUT
    assert p.worker.binding("DEADLINE_MS").text == "2000"
    assert not any(b.text and "s3cret" in b.text for b in p.worker.bindings)


def test_each_operator_role_binds_its_own_secret():
    own = SECRETS - {"probeToken"} | set(settings.OPERATOR_TOKENS.values())
    s = settings.parse(raw_for(), "t", secrets=own, env={})
    p = plan.plan_cell(s)
    assert {b.name: b.secret for b in p.worker.bindings if b.name.endswith("_TOKEN") and b.name != "POD_TOKEN"} == {
        "READ_TOKEN": "readToken", "ADMIN_TOKEN": "adminToken", "EXCHANGE_TOKEN": "exchangeToken"}
    assert s.credential_warning is None and "PROBE_TOKEN" not in {b.name for b in p.worker.bindings}


def test_a_stack_with_only_the_old_probe_token_keeps_working_with_a_warning_naming_the_new_keys():
    s = settings.parse(raw_for(), "t", secrets=SECRETS, env={})
    p = plan.plan_cell(s)
    assert {p.worker.binding(n).secret for n in ("READ_TOKEN", "ADMIN_TOKEN", "EXCHANGE_TOKEN")} == {"probeToken"}
    for key in ("colocate:readToken", "colocate:adminToken", "colocate:exchangeToken", "pulumi config rm colocate:probeToken"):
        assert key in s.credential_warning


def test_a_stack_with_no_operator_token_is_refused_naming_the_first_missing():
    with pytest.raises(ConfigError) as err:
        settings.parse(raw_for(), "t", secrets=SECRETS - {"probeToken"}, env={})
    assert err.value.key == "colocate:readToken" and "pulumi config set --secret colocate:readToken" in err.value.fix


def test_new_keys_get_finite_default_limits_and_the_older_name_still_counts():
    p = cell(raw_for())
    names = ("DEFAULT_RPM", "DEFAULT_TPM", "DEFAULT_MONTHLY_TOKENS", "DEFAULT_MAX_PARALLEL", "DEFAULT_MAX_PARALLEL_TOKENS")
    # max_parallel_tokens: one context of the default pod (its --max-model-len)
    assert [p.worker.binding(n).text for n in names] == ["3000", "3000000", "1000000000", "8", "8192"]
    s = settings.parse(raw_for(keys={"defaults": {"rpm": 0, "maxParallel": 2, "maxParallelTokens": 4096}}), "t", secrets=SECRETS,
                       env={})
    assert s.key_defaults == {"rpm": 0, "tpm": 3_000_000, "monthly_tokens": 1_000_000_000, "max_parallel": 2,
                              "max_parallel_tokens": 4096,
                              "fallback_microusd_day": 0 if s.fallback_price is None else 2_000_000}
    assert settings.parse(raw_for(keys={"defaultMaxParallel": 5}), "t", secrets=SECRETS, env={}).key_defaults["max_parallel"] == 5
    with pytest.raises(ConfigError) as err:
        settings.parse(raw_for(keys={"defaults": {"rpm": -1}}), "t", secrets=SECRETS, env={})
    assert err.value.key == "colocate:keys.defaults.rpm"
    with pytest.raises(ConfigError) as err:
        settings.parse(raw_for(keys={"defaults": {"rps": 1}}), "t", secrets=SECRETS, env={})
    assert err.value.key == "colocate:keys.defaults.rps"


def test_draining_generation_is_bound_with_its_own_hint():
    gens = [{"name": "us-east.g1", "region": "us-east", "status": "draining"},
            {"name": "apac-jp.g2", "region": "apac-jp", "status": "active"}]
    p = cell(raw_for(generations=gens))
    assert p.worker.binding("DRAINING_GENERATION").text == "us-east.g1"
    assert p.worker.binding("DRAINING_HINT").text == "enam"
    assert re.fullmatch(r"colocate-t-apac-jp-g2-p0-[0-9a-f]{6}", p.pod.name)
    assert "apac-jp.g2" in p.pod.triggers()


def test_pod_name_is_deterministic_and_triggers_cover_identity():
    a, b = cell(raw_for()), cell(raw_for())
    assert a.pod.name == b.pod.name and a.pod.name.startswith("colocate-t-apac-jp-g1-")
    assert a.pod.triggers() == b.pod.triggers()
    other = cell(raw_for(pod={"provider": "runpod", "image": GUARDED_IMAGE.replace("v0.33.0", "v0.12.0")}))
    assert other.pod.triggers() != a.pod.triggers()
    # A replacement never shares its name with the pod it replaces (create would adopt it).
    assert other.pod.name != a.pod.name and other.pod.name.startswith("colocate-t-apac-jp-g1-")


# What a running pod cannot change (its create request fixes it): each must rename and replace
# the pod, since a re-run create with the same name adopts the old pod unchanged.
IDENTITY_CHANGES = {
    "port": raw_for(pod={"provider": "runpod", "port": 8001}),
    "diskGb": raw_for(pod={"provider": "runpod", "diskGb": 80}),
    "cloud": raw_for(pod={"provider": "runpod", "cloud": "COMMUNITY"}),
    "path": raw_for(zone=ZONE),  # provider-proxy -> zone-dns: RunPod exposes the port differently
    "renewal": raw_for(pod={"provider": "runpod", "renewal": 1}),  # the owner asks for new pods
}
# Where the next pod may go, not what a running pod is (taken at the next placement), and a
# setting a GPU pod ignores: the running pod stays.
KEEPING_CHANGES = {
    "maxPricePerHr": raw_for(pod={"provider": "runpod", "maxPricePerHr": 1.5}),
    "minReliability": raw_for(pod={"provider": "runpod", "minReliability": 0.5}),
    "minCudaVersion": raw_for(pod={"provider": "runpod", "minCudaVersion": "12.4"}),  # which host, not what runs
    "readyTimeoutS": raw_for(pod={"provider": "runpod", "readyTimeoutS": 60}),
    "computeMs": raw_for(pod={"provider": "runpod", "computeMs": 5}),  # the local stand-in's only
}


@pytest.mark.parametrize("key", IDENTITY_CHANGES)
def test_a_change_a_running_pod_cannot_take_renames_and_replaces_every_pod(key):
    base = cell(raw_for(pod={"provider": "runpod", "count": 2}))
    raw = IDENTITY_CHANGES[key]
    changed = cell({**raw, "pod": {**raw["pod"], "count": 2}})
    assert changed.pod.spec() != base.pod.spec(), key  # the change reaches the create request
    for old, new in zip(base.pods, changed.pods, strict=True):
        assert new.name != old.name and new.triggers() != old.triggers(), (key, old.index)
        assert new.name.startswith(f"colocate-t-apac-jp-g1-p{old.index}-")


@pytest.mark.parametrize("key", KEEPING_CHANGES)
def test_placement_criteria_and_settings_a_gpu_pod_ignores_keep_the_running_pod(key):
    base, changed = cell(raw_for()), cell(KEEPING_CHANGES[key])
    assert changed.pod.spec() != base.pod.spec(), key  # the next placement still gets it
    assert changed.pod.name == base.pod.name and changed.pod.triggers() == base.pod.triggers(), key


def test_pod_names_stay_as_they_were_placed_until_the_owner_renews_them():
    # A key left at 0 (renewal, here) must not join the identity, so a stack upgraded to this kit
    # keeps its pods; each raise names the pods anew. A zoned RunPod cell on the stock image, as
    # this release names it (a zoneless one on the stock image is refused since the pod's guard:
    # plan.check_guard_image, so the names such cells had are not kept).
    old = "vllm/vllm-openai:v0.11.0"
    pods = cell(raw_for(zone=ZONE, pod={"provider": "runpod", "count": 2, "image": old})).pods
    assert [p.name for p in pods] == ["colocate-t-apac-jp-g1-p0-264fdf", "colocate-t-apac-jp-g1-p1-264fdf"]
    token = plan.token_fingerprint("pod-token-0123456789abcdef")
    assert [p.with_token_fingerprint(token).name for p in pods] == [
        "colocate-t-apac-jp-g1-p0-89634f", "colocate-t-apac-jp-g1-p1-89634f"]
    # A local pod is reached over mutual TLS: "hop=mtls" is in its identity.
    local = cell(raw_for("us-east", "local", pod={"provider": "local", "image": old, "profile": "oracle"})).pod
    assert local.name == "colocate-t-us-east-g1-p0-79556c"
    # The stand-in's profile is what the local pod is: another one (the default now) is a new pod.
    assert cell(raw_for("us-east", "local", pod={"provider": "local", "image": old})).pod.name != local.name
    assert cell(raw_for(zone=ZONE, pod={"provider": "runpod", "renewal": 0, "image": old})).pod.name == pods[0].name
    names = {cell(raw_for(pod={"provider": "runpod", "renewal": n})).pod.with_token_fingerprint(token).name
             for n in range(4)}
    assert len(names) == 4


def test_a_local_stand_ins_compute_time_is_part_of_what_it_is():
    base = cell(raw_for("us-east", "local"))
    slower = cell(raw_for("us-east", "local", pod={"provider": "local", "computeMs": 500}))
    assert slower.pod.name != base.pod.name and slower.pod.triggers() != base.pod.triggers()


def test_a_rotated_pod_token_renames_and_replaces_the_pod_without_declaring_it():
    token, rotated = "pod-token-0123456789abcdef", "pod-token-fedcba9876543210"
    planned = cell(raw_for(pod={"provider": "runpod", "count": 2}))
    for pod in planned.pods:
        a = pod.with_token_fingerprint(plan.token_fingerprint(token))
        again = pod.with_token_fingerprint(plan.token_fingerprint(token))
        b = pod.with_token_fingerprint(plan.token_fingerprint(rotated))
        assert (a.name, a.triggers()) == (again.name, again.triggers())  # deterministic: no spurious replace
        assert b.name != a.name and b.triggers() != a.triggers()
        assert a.name != pod.name and a.name.startswith(f"colocate-t-apac-jp-g1-p{pod.index}-")
        assert a.spec()["name"] == a.name and a.spec()["index"] == pod.index
        declared = " ".join([a.name, *a.triggers(), repr(a.spec())])
        assert token not in declared and "0123456789abcdef" not in declared
    fingerprint = plan.token_fingerprint(token)
    assert re.fullmatch(r"[0-9a-f]{8}", fingerprint) and fingerprint not in token
    assert fingerprint != plan.token_fingerprint(rotated)


def test_the_name_changes_exactly_when_the_triggers_change():
    # The same name with other triggers is the fatal case: the replacement's create adopts
    # the pod that the old resource's delete then destroys.
    raws = [raw_for(), *IDENTITY_CHANGES.values(), *KEEPING_CHANGES.values(),
            raw_for(pod={"provider": "runpod", "image": "x:1"}), raw_for(pod={"provider": "runpod", "gpuCount": 2})]
    pods = [cell(r).pod for r in raws]
    pods += [p.with_token_fingerprint(plan.token_fingerprint(t)) for p in pods[:2] for t in ("a", "b")]
    for a, b in itertools.combinations(pods, 2):
        assert (a.name == b.name) == (a.triggers() == b.triggers()), (a.triggers(), b.triggers())


def test_migrations_come_from_the_live_tag_with_the_stack_file_as_offline_fallback():
    first = {"old_tag": None, "new_tag": "v1", "steps": [{"new_sqlite_classes": ["Breaker"]}]}
    # Offline (no live tag): the stack file decides.
    assert cell(raw_for()).worker.migrations == first
    offline_done = cell(raw_for(worker={"subdomain": "acme", "migrationTag": "v1"}))
    assert offline_done.worker.migrations is None and offline_done.worker.pending_migrations == ()
    # Live: "" (no script, or no tag applied) means first deploy; "v1" means nothing pending.
    s = settings.parse(raw_for(), "t", secrets=SECRETS)
    assert plan.plan_cell(s, live_migration_tag="").worker.migrations == first
    done = plan.plan_cell(s, live_migration_tag="v1").worker
    assert done.migrations is None and done.pending_migrations == () and done.migration_warning is None
    with pytest.raises(ConfigError, match="migrationTag"):
        cell(raw_for(worker={"subdomain": "acme", "migrationTag": "v7"}))


def test_live_tag_wins_over_a_stack_file_that_disagrees_and_says_so():
    behind = plan.migration_decision("v1", "", script="colocate-t")
    assert behind.migrations is None and behind.warning is None  # an unset file is not a disagreement
    stale = plan.migration_decision("", "v1", script="colocate-t")
    assert stale.migrations["steps"] == [{"new_sqlite_classes": ["Breaker"]}] and stale.source == "cloudflare"
    assert "colocate:worker.migrationTag" in stale.warning and "colocate-t" in stale.warning


def test_one_pending_step_starts_from_the_live_tag(monkeypatch):
    monkeypatch.setattr(plan, "MIGRATIONS", plan.MIGRATIONS + (("v2", {"new_sqlite_classes": ["Usage"]}),))
    d = plan.migration_decision("v1", "v1")
    assert d.migrations == {"old_tag": "v1", "new_tag": "v2", "steps": [{"new_sqlite_classes": ["Usage"]}]}
    assert d.pending == ("v2",)


def test_a_live_tag_the_kit_never_applied_is_refused():
    with pytest.raises(ConfigError) as err:
        plan.migration_decision("v9-other-tool", "", script="colocate-t")
    msg = str(err.value)
    assert "v9-other-tool" in msg and "colocate-t" in msg and "colocate:worker.name" in msg


def test_no_pending_step_ever_deletes_a_class():
    for _, step in plan.MIGRATIONS:
        assert "deleted_classes" not in step


def test_worker_modules_are_what_the_router_imports_main_first():
    mods = plan.worker_modules()
    assert mods[0].name == "index.js"
    names = {m.name for m in mods}
    # Every source but the fleet's front door (its own Worker) is reached from index.js.
    assert names == {p.name for p in plan.WORKER_DIR.glob("*.js")} - {
        "front.js",
        "fleetfront.js",
        "frontindex.js",
        "fleetledger.js",
        "cellrank.js",
    }


def test_module_closure_follows_imports_and_refuses_a_missing_one(tmp_path):
    (tmp_path / "main.js").write_text('import { a } from "./a.js";\nexport { b } from "./b.js";\n')
    (tmp_path / "a.js").write_text('import {\n  c,\n} from "./c.js";\n')
    (tmp_path / "b.js").write_text("export const b = 1;\n")
    (tmp_path / "c.js").write_text("export const c = 1;\n")
    (tmp_path / "unused.js").write_text("export const u = 1;\n")
    assert [m.name for m in plan.module_closure(tmp_path, "main.js")] == ["main.js", "a.js", "b.js", "c.js"]
    (tmp_path / "c.js").unlink()
    with pytest.raises(FileNotFoundError, match="c.js is missing"):
        plan.module_closure(tmp_path, "main.js")


@pytest.mark.parametrize("key, value, where", [
    ("pod", {"provider": "runpod", "gpuCount": 0}, "colocate:pod.gpuCount"),
    ("pod", {"provider": "runpod", "cloud": "HOME"}, "colocate:pod.cloud"),
    ("pod", {"provider": "aws"}, "colocate:pod.provider"),
    ("pod", "big", "colocate:pod"),
    ("worker", {"subdomain": "acme", "placement": "near"}, "colocate:worker.placement"),
    ("worker", {"subdomain": "Acme Corp"}, "colocate:worker.subdomain"),
    ("worker", {"subdomain": "acme", "deadlineMs": True}, "colocate:worker.deadlineMs"),
    ("probe", {"samples": 0}, "colocate:probe.samples"),
    ("probe", {"enforce": "yes"}, "colocate:probe.enforce"),
    ("zone", {"id": "nope", "name": "example.com"}, "colocate:zone.id"),
    ("accountId", "ABC", "colocate:accountId"),
])
def test_bad_values_name_the_key(key, value, where):
    with pytest.raises(ConfigError) as err:
        cell(raw_for(**{key: value}))
    assert where in str(err.value) and "Fix:" in str(err.value)


def test_no_address_for_the_worker():
    with pytest.raises(MissingSetting, match="colocate:worker.subdomain"):
        cell(raw_for(worker={}))


def test_every_stack_file_plans(tmp_path):
    for path in stackfile.STACKS_DIR.glob("Pulumi.*.yaml"):
        stack = path.name[len("Pulumi."):-len(".yaml")]
        raw, _ = stackfile.read_config(stack)
        if fleet.is_fleet(raw):
            continue  # a front door, not a cell: tests/test_fleet_infra.py
        raw.setdefault("accountId", "0123456789abcdef0123456789abcdef")
        raw["worker"] = {"subdomain": "acme", **(raw.get("worker") or {})}
        p = cell(raw, stack)
        assert p.pod.region == p.state.active.region == raw["region"]


def test_every_region_of_the_catalogue_has_a_stack_file_to_start_from():
    stacks = {p.name[len("Pulumi."):-len(".yaml")] for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml")}
    assert set(catalogue.REGIONS) <= stacks, f"regions without stacks/Pulumi.<region>.yaml: {set(catalogue.REGIONS) - stacks}"
    for name in catalogue.REGIONS:
        raw, _ = stackfile.read_config(name)
        assert raw["region"] == name and raw.get("zone"), f"stacks/Pulumi.{name}.yaml: the region's cell, on a zone"


def test_split_state_is_only_possible_on_explicit_request():
    split = raw_for("apac-tw", "vastai", generations=[{"name": "us-east.g1", "region": "us-east", "status": "active"}])
    with pytest.raises(ConfigError):
        cell(split)
    forced = plan.plan_cell(settings.parse(split, "t", secrets=SECRETS, allow_split_state=True))
    assert forced.state.hint == "enam" and forced.pod.region == "apac-tw"


def test_region_is_the_only_region_knob():
    region_words = {"region", "location", "hint", "placement", "datacenter", "geolocation"}
    for key in settings.SCHEMA:
        if key.name == "region":
            continue
        sub = key.default if isinstance(key.default, dict) else {}
        for name in itertools.chain([key.name], sub):
            if name == "placement":  # auto | pod | targeted | smart: a mode, not a place
                continue
            assert not any(w in name.lower() for w in region_words), f"{key.name}.{name}"


def test_readme_documents_every_key():
    readme = (stackfile.ROOT / "README.md").read_text()
    for key in settings.SCHEMA:
        assert f"colocate:{key.name}" in readme, key.name
    head = readme.split("## ")[0]
    assert "make demo" in head and "make test" in head


def test_sweep_recognises_the_planned_pod_name_and_only_for_its_stack():
    from colocate.pods.base import belongs_to_stack

    name = cell(raw_for(), stack="prod").pod.name
    assert belongs_to_stack(name, "prod")
    assert not belongs_to_stack(name, "pro")
    assert not belongs_to_stack(cell(raw_for(), stack="prod-b").pod.name, "prod")


def test_worker_reaches_the_pod_by_dns_name_on_its_public_port_with_a_zone():
    created = {"id": "abc123xyz", "url": "http://203.0.113.7:41234", "port": 41234, "ip": "203.0.113.7"}
    zoned = cell(raw_for(zone=ZONE))
    assert zoned.pod.path == "zone-dns" and zoned.probe.pod_path == "zone-dns"
    # A RunPod pod on a zone serves mutual TLS (colocate:pod.hop auto): the Worker fetches https.
    # The record's name carries the instance: a replacement (a new id) never shares it.
    host = plan.instance_host("pod-apac-jp-g1.example.com", "runpod", "abc123xyz")
    assert zoned.pod.worker_url(created) == f"https://{host}:41234" and zoned.pod.host(created) == host
    assert zoned.pod.host({**created, "id": "abc124"}) != host and host.endswith(".pod-apac-jp-g1.example.com")


def test_the_hop_is_mutual_tls_wherever_the_provider_and_path_can_carry_it():
    runpod_zoned = cell(raw_for(zone=ZONE))
    assert runpod_zoned.mtls and runpod_zoned.pod.tls_name == "*.pod-apac-jp-g1.example.com"  # each instance's name
    assert runpod_zoned.worker.binding("POD_TLS").type == "mtls_certificate"
    # The pods' certificates are publicly trusted (ACME on the zone): no flag puts the script's
    # external fetches (the fallback, /cdn-cgi/trace) on the zone's Custom Origin Trust Store.
    assert runpod_zoned.worker.compatibility_flags == ("enable_request_signal",) and runpod_zoned.acme_server.startswith("https://acme-v02.")
    assert "hop=mtls" in runpod_zoned.pod.identity()
    # Vast.ai (always on a zone) carries the bundle in its env object as RunPod does.
    vast = cell(raw_for("apac-tw", "vastai"))
    assert vast.mtls and vast.pod.tls_name == "*.pod-apac-tw-g1.example.com" and "hop=mtls" in vast.pod.identity()
    assert vast.worker.binding("POD_TLS").type == "mtls_certificate"
    # RunPod's proxy ends TLS itself: the pod token behind the pod's guard, over HTTPS to the proxy.
    p = cell(raw_for())
    assert not p.mtls and p.pod.tls_name == "" and p.acme_server is None
    assert p.worker.compatibility_flags == ("enable_request_signal",)
    assert plan.pod_guarded("runpod", p.pod_path, "auto") and not plan.pod_guarded("runpod", "zone-dns", "auto")
    assert "POD_TLS" not in {b.name for b in p.worker.bindings}
    assert p.pod.worker_url({"id": "abc", "port": 1}).startswith("https://abc-8000.proxy.runpod.net")
    local = cell(raw_for("us-east", "local"))
    # the sandbox's workerd trusts its roots itself
    assert local.mtls and local.worker.compatibility_flags == ("enable_request_signal",)


def test_runpod_without_a_zone_takes_the_guarded_token_hop_and_refuses_mtls_naming_the_key():
    for hop in ({}, {"hop": "auto"}, {"hop": "token"}):
        c = cell(raw_for(pod={"provider": "runpod", **hop}))
        assert c.pod.path == "provider-proxy" and not c.mtls and plan.pod_guarded("runpod", c.pod_path, c.pod_settings.hop)
    with pytest.raises(ConfigError) as err:
        cell(raw_for(pod={"provider": "runpod", "hop": "mtls"}))
    assert err.value.key == "colocate:pod.hop" and err.value.value == "mtls"
    assert "colocate:zone" in err.value.fix


@pytest.mark.parametrize("provider,region", [("runpod", "apac-jp"), ("vastai", "apac-tw")])
def test_hop_token_on_a_zone_is_refused_it_would_be_plain_http_on_a_public_port(provider, region):
    with pytest.raises(ConfigError) as err:
        cell(raw_for(region, provider, zone=ZONE, pod={"provider": provider, "hop": "token"}))
    assert err.value.key == "colocate:pod.hop" and err.value.value == "token"
    assert "plain HTTP" in err.value.problem and "pulumi config rm --path colocate:pod.hop" in err.value.fix


def test_the_api_docs_are_off_on_every_hop():
    from colocate.pods.spec import PodSpec
    for raw in (raw_for(), raw_for(zone=ZONE), raw_for("apac-tw", "vastai")):
        pod = cell(raw).pod
        args = PodSpec.from_dict(pod.spec()).vllm_args()
        assert "--disable-fastapi-docs" in args, (pod.path, pod.mtls)
        assert ("--ssl-cert-reqs" in args) == pod.mtls


def test_hop_mtls_where_it_cannot_be_carried_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError) as err:
        cell(raw_for(pod={"provider": "runpod", "hop": "mtls"}))
    msg = str(err.value)
    assert "colocate:pod.hop" in msg and "'mtls'" in msg and "RunPod's proxy" in msg and "Fix" in msg


def test_a_reissued_pod_certificate_renames_the_pod():
    pod = cell(raw_for(zone=ZONE)).pod
    a, b = pod.with_tls_fingerprint(plan.cert_fingerprint("A")), pod.with_tls_fingerprint(plan.cert_fingerprint("B"))
    assert a.name != b.name and a.triggers() != b.triggers()
    assert f"cert=sha256:{plan.cert_fingerprint('A')}" in a.identity()


def test_without_a_zone_a_runpod_pod_is_reached_through_runpods_proxy_hostname():
    created = {"id": "abc123xyz", "url": "http://203.0.113.7:41234", "port": 41234, "ip": "203.0.113.7"}
    p = cell(raw_for())
    assert p.pod.path == "provider-proxy" and p.pod.pod_hostname is None
    # The proxy addresses the pod's own port (8000), not the mapped public one.
    assert p.pod.worker_url(created) == "https://abc123xyz-8000.proxy.runpod.net"
    assert "--pod-path provider-proxy" in " ".join(p.probe.argv("https://w", ["AP-JP-1"]))


@pytest.mark.parametrize("zone", [None, ZONE])
def test_local_pods_are_reached_by_the_name_localhost(zone):
    p = cell(raw_for("us-east", "local", **({"zone": zone} if zone else {})))
    assert p.pod.path == "local-hostname"
    assert p.pod.worker_url({"id": "local-1", "port": 5123, "url": "https://127.0.0.1:5123"}) == "https://localhost:5123"


def test_no_worker_url_is_ever_an_ip_literal():
    import ipaddress
    from urllib.parse import urlsplit

    created = {"id": "abc", "url": "http://203.0.113.7:41234", "port": 41234, "ip": "203.0.113.7"}
    for region in catalogue.REGIONS.values():
        for provider in region.providers:
            for zone in (None, ZONE):
                if provider == "vastai" and zone is None:
                    continue
                extra = {"zone": zone} if zone else {}
                host = urlsplit(cell(raw_for(region.name, provider, **extra)).pod.worker_url(created)).hostname
                with pytest.raises(ValueError):
                    ipaddress.ip_address(host)


def test_vastai_without_a_zone_is_refused_naming_the_key_and_why():
    raw = raw_for("apac-tw", "vastai")
    del raw["zone"]
    with pytest.raises(ConfigError) as err:
        cell(raw)
    assert err.value.key == "colocate:zone"
    assert "IP" in str(err.value) and "1003" in str(err.value)


def test_each_pod_gets_its_own_dns_only_hostname_and_pod_0_keeps_the_plain_one():
    pod = {"provider": "runpod", "count": 3}
    p = cell(raw_for(zone=ZONE, pod=pod))
    assert [x.pod_hostname for x in p.pods] == [
        "pod-apac-jp-g1.example.com", "pod-apac-jp-g1-p1.example.com", "pod-apac-jp-g1-p2.example.com"]
    custom = cell(raw_for(zone={**ZONE, "podHostname": "gpu{index}-{generation}.example.com"}, pod=pod))
    assert [x.pod_hostname for x in custom.pods][1] == "gpu1-apac-jp-g1.example.com"
    one = cell(raw_for(zone=ZONE))
    assert one.pods[0].pod_hostname == p.pods[0].pod_hostname


def test_fallback_model_is_required_with_an_explicit_passthrough():
    raw = raw_for()
    del raw["fallbackModel"]
    with pytest.raises(MissingSetting) as err:
        cell(raw)
    assert err.value.key == "colocate:fallbackModel" and "passthrough" in str(err.value)
    with pytest.raises(MissingSetting):
        cell(raw_for(fallbackModel=""))
    with pytest.raises(ConfigError, match="colocate:fallbackModel"):
        cell(raw_for(fallbackModel=" gpt-4o-mini"))
    named = cell(raw_for(fallbackModel="gpt-4o-mini")).worker.binding("FALLBACK_MODEL")
    assert named.text == "gpt-4o-mini"
    passthrough = cell(raw_for(fallbackModel="passthrough", fallbackModels=["client/model"]))
    assert "FALLBACK_MODEL" not in {b.name for b in passthrough.worker.bindings}


def test_a_class_deletion_needs_the_explicit_opt_in(monkeypatch):
    steps = plan.MIGRATIONS + (("v2", {"deleted_classes": ["Breaker"]}),)
    monkeypatch.setattr(plan, "MIGRATIONS", steps)
    applied = {"subdomain": "acme", "migrationTag": "v1"}
    with pytest.raises(ConfigError, match="allowClassDeletion"):
        cell(raw_for(worker=applied))
    opted = plan.plan_cell(settings.parse(raw_for(worker={**applied, "allowClassDeletion": True}), "t", secrets=SECRETS))
    assert opted.worker.migrations == {"old_tag": "v1", "new_tag": "v2", "steps": [{"deleted_classes": ["Breaker"]}]}


def test_pod_py_reads_exactly_the_spec_the_plan_writes():
    # scripts/pod.py re-validates the JSON at its edge; the two field lists must not drift.
    from dataclasses import MISSING, fields

    from colocate.pods.spec import OPTIONAL, REQUIRED, PodSpec

    written = set(cell(raw_for()).pod.spec())
    assert written == set(REQUIRED) | set(OPTIONAL) == {f.name for f in fields(PodSpec)}
    # a field a spec of an earlier release lacks has a default pod.py falls back to
    assert all(f.default is not MISSING for f in fields(PodSpec) if f.name not in REQUIRED)
    assert PodSpec.from_dict(cell(raw_for()).pod.spec()).locations == ("AP-JP-1",)


def test_migrate_plan_lists_every_pod_and_the_cost_cap():
    from colocate.cell import migration

    raw = raw_for("us-east", pod={"provider": "runpod", "count": 2})
    before = settings.parse(raw, "t", secrets=SECRETS)
    grown = settings.parse(raw_for("us-east", pod={"provider": "runpod", "count": 3}), "t", secrets=SECRETS)
    actions = [str(a) for a in migration.diff(*migration.plan_pair(before, grown))]
    assert sum(a.lstrip().startswith("keep     pod") for a in actions) == 2
    assert sum(a.lstrip().startswith("create   pod") for a in actions) == 1
    assert any("3 pods: at most $2.40/hr" in a for a in actions)
    new_image = settings.parse(raw_for("us-east", pod={"provider": "runpod", "count": 2, "image": "x:1"}), "t",
                               secrets=SECRETS)
    actions = [str(a) for a in migration.diff(*migration.plan_pair(before, new_image))]
    assert sum(a.lstrip().startswith("delete   pod") for a in actions) == 2
    assert any("during the update 4 pods run, up to $3.20/hr" in a for a in actions)


def test_planning_does_not_need_the_fallback_model():
    from colocate.cell import migration

    raw = raw_for()
    del raw["fallbackModel"]
    assert migration.planning_settings(raw, "t").fallback_model == ""


def test_runpod_community_cloud_with_a_zone_is_refused_before_any_pod():
    raw = raw_for(zone=ZONE, pod={"provider": "runpod", "cloud": "COMMUNITY"})
    with pytest.raises(ConfigError) as err:
        cell(raw)
    assert err.value.key == "colocate:pod.cloud" and "public ip" in str(err.value)
    assert "colocate:pod.cloud SECURE" in str(err.value)
    # Without a zone RunPod's proxy needs no public ip: Community Cloud is fine there.
    raw.pop("zone")
    assert cell(guarded(raw)).pod.path == "provider-proxy"


@pytest.mark.parametrize("stack", ["apac-jp", "eu-west", "us-east"])
def test_the_shipped_runpod_stacks_are_zoned_and_their_sandbox_pods_mutual_tls(stack, tmp_path):
    """No shipped stack leaves vLLM to its guard alone: each RunPod stack's cloud path is its zone's
    (mutual TLS, any image); its local stand-ins get `auto`'s mutual TLS too."""
    from colocate.sandbox.launch import Launch, build_plan

    raw = stackfile.read_config(stack)[0]
    assert "hop" not in raw["pod"] and raw["zone"]["name"]
    cloud = plan.plan_cell(settings.parse({**raw, "accountId": "0" * 32}, stack, secrets=SECRETS))
    assert cloud.pod.path == plan.PATH_ZONE_DNS and cloud.mtls
    (tmp_path / f"Pulumi.{stack}.yaml").write_text(stackfile.path_of(stack).read_text())
    cell_plan, _ = build_plan(Launch(stack, str(tmp_path), None, None, (), False))
    assert cell_plan.pod_settings.provider == "local" and cell_plan.mtls and cell_plan.pod.tls_name == "localhost"


def test_the_workers_pace_and_balance_reach_it_as_bindings_and_a_bad_policy_names_its_key():
    c = cell(raw_for(worker={"subdomain": "acme", "stallMs": 1500, "minTokensPerS": 12.5, "balance": "least_busy"}))
    texts = {b.name: b.text for b in c.worker.bindings if b.type == "plain_text"}
    assert (texts["STALL_MS"], texts["MIN_TOKENS_PER_S"], texts["BALANCE"]) == ("1500", "12.5", "least_busy")
    defaults = {b.name: b.text for b in cell(raw_for(worker={"subdomain": "acme"})).worker.bindings if b.type == "plain_text"}
    assert (defaults["STALL_MS"], defaults["MIN_TOKENS_PER_S"], defaults["BALANCE"]) == ("2000", "25.0", "prefix")
    with pytest.raises(ConfigError) as e:
        cell(raw_for(worker={"subdomain": "acme", "balance": "fastest"}))
    assert "colocate:worker.balance" in str(e.value) and "least_busy" in str(e.value)
