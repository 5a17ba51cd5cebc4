"""Preflight (colocate/cell/preflight.py): before any pod is rented, the Cloudflare token has each
permission the stack's shape uses, and the zone's CAA records let the pods' certificates be issued
without a change that would widen who may issue for the zone's other hostnames. Against a local
fake of Cloudflare's API (port 0), written from its reference: ``/user/tokens/verify``, the token's
own record, the reads each permission allows, the zone's DNS records of type CAA."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pulumi
import pytest

from colocate.cell import preflight
from tests.support.pulumi_mocks import run_program, stack_config

ACCOUNT = "0123456789abcdef0123456789abcdef"
ZONE_ID = "f" * 32
TOKEN = "cf-token-s3cret"
ZONE = {"id": ZONE_ID, "name": "example.com"}
LE = "https://acme-v02.api.letsencrypt.org/directory"
FULL = preflight.Shape(zone=True, mtls=True, acme=True, acme_names=("*.pod-us-east-g1.example.com",), acme_server=LE)
ALL = {"Workers Scripts Write", "Zone Read", "DNS Write", "SSL and Certificates Write"}


class FakeCloudflare:
    """What Cloudflare answers a token: ``grants`` the permission names it holds (account and zone
    alike); ``self_readable`` whether it may read its own record; ``acm`` the zone's ACM."""

    def __init__(self, grants=ALL, self_readable=True, caa=(), status="active", account_owned=False):
        self.grants, self.self_readable, self.caa, self.status = set(grants), self_readable, list(caa), status
        self.account_owned = account_owned
        self.paths: list[str] = []
        self.auth: set[str] = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fake.paths.append(self.path)
                fake.auth.add(self.headers.get("authorization", ""))
                status, body = fake.answer(self.path, self.headers.get("authorization"))
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/client/v4"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def ok(result):
        return 200, {"success": True, "errors": [], "messages": [], "result": result}

    @staticmethod
    def refused(code=10000, message="Authentication error"):
        return 403, {"success": False, "errors": [{"code": code, "message": message}], "messages": [], "result": None}

    def answer(self, path: str, auth: str | None):
        path = path.removeprefix("/client/v4")
        if auth != f"Bearer {TOKEN}":
            return 401, {"success": False, "errors": [{"code": 1000, "message": "Invalid API Token"}]}
        verify = {"id": "tok1", "status": self.status}
        if path == "/user/tokens/verify":
            return (401, {"success": False, "errors": [{"code": 1000, "message": "Invalid API Token"}]}) \
                if self.account_owned else self.ok(verify)
        if path == f"/accounts/{ACCOUNT}/tokens/verify":
            return self.ok(verify)
        if path in ("/user/tokens/tok1", f"/accounts/{ACCOUNT}/tokens/tok1"):
            if not self.self_readable:
                return self.refused(9109, "Unauthorized to access requested resource")
            policies = [
                {"id": "p1", "effect": "allow", "resources": {f"com.cloudflare.api.account.{ACCOUNT}": "*"},
                 "permission_groups": [{"id": g, "name": g} for g in self.grants
                                       if g in ("Workers Scripts Write", "SSL and Certificates Write")]},
                {"id": "p2", "effect": "allow",
                 "resources": {f"com.cloudflare.api.account.{ACCOUNT}": {"com.cloudflare.api.account.zone.*": "*"}},
                 "permission_groups": [{"id": g, "name": g} for g in self.grants]},
            ]
            return self.ok({"id": "tok1", "status": self.status, "policies": policies})
        needs = {f"/accounts/{ACCOUNT}/workers/scripts": "Workers Scripts Write", f"/zones/{ZONE_ID}": "Zone Read",
                 f"/zones/{ZONE_ID}/dns_records?per_page=1": "DNS Write",
                 f"/accounts/{ACCOUNT}/mtls_certificates": "SSL and Certificates Write"}
        if path in needs:
            if needs[path] not in self.grants:
                return self.refused()
            return self.ok([])
        if path == f"/zones/{ZONE_ID}/dns_records?type=CAA&per_page=5000":  # as the API lists a CAA record
            if "DNS Write" not in self.grants:
                return self.refused()
            return self.ok([{"id": f"r{i}", "type": "CAA", "name": name, "content": f'0 {tag} "{value}"',
                             "data": {"flags": 0, "tag": tag, "value": value}, "proxied": False, "ttl": 1}
                            for i, (name, tag, value) in enumerate(self.caa)])
        return 404, {"success": False, "errors": [{"code": 7003, "message": "No route"}]}


@pytest.fixture
def fake_cf():
    made = []

    def make(**kw):
        made.append(FakeCloudflare(**kw))
        return made[-1]
    yield make
    for f in made:
        f.close()


def check(fake, shape=FULL, token=TOKEN):
    return preflight.check(shape, ACCOUNT, ZONE_ID if shape.zone else None, preflight.http_get(fake.url, token))


def test_the_scopes_follow_the_stack_shape():
    assert [n.permission for n in preflight.needs(preflight.Shape(False, False))] == ["Workers Scripts Write"]
    assert [n.permission for n in preflight.needs(preflight.Shape(True, False))] == [
        "Workers Scripts Write", "Zone Read", "DNS Write"]
    # A zoned mutual-TLS cell: the account's SSL permission (the Worker's client certificate), nothing
    # on the zone's SSL (no trust store: the pods' certificates are publicly trusted, issued by DNS-01).
    full = preflight.needs(FULL)
    assert [(n.permission, n.scope) for n in full] == [
        ("Workers Scripts Write", "account"), ("Zone Read", "zone"), ("DNS Write", "zone"),
        ("SSL and Certificates Write", "account")]


@pytest.mark.parametrize("readable", [True, False], ids=["policies", "probes"])
def test_a_token_with_every_permission_passes(fake_cf, readable):
    fake = fake_cf(self_readable=readable)
    assert check(fake) == []
    assert fake.auth == {f"Bearer {TOKEN}"}  # the token travels in the header only
    assert all(TOKEN not in p for p in fake.paths)


@pytest.mark.parametrize("readable", [True, False], ids=["policies", "probes"])
@pytest.mark.parametrize("lacking", sorted(ALL))
def test_each_missing_permission_is_named_with_its_fix(fake_cf, readable, lacking):
    fake = fake_cf(grants=ALL - {lacking}, self_readable=readable)
    problems = check(fake)
    text = "\n".join(map(str, problems))
    assert problems and all(lacking in str(p) for p in problems), text
    assert "Fix: edit the token" in text and "My Profile > API Tokens" in text
    assert ("could not read its own policies" in text) is (not readable)


def test_the_documented_old_token_cannot_deploy_a_zoned_mtls_cell(fake_cf):
    """The README's former list (Workers Scripts edit, Zone read, DNS edit) lacks the account's SSL scope."""
    fake = fake_cf(grants={"Workers Scripts Write", "Zone Read", "DNS Write"})
    problems = check(fake)
    assert [str(p).split(" (needed")[0] for p in problems] == [
        "cloudflare:apiToken: the token lacks SSL and Certificates Write on the account"]
    assert check(fake, preflight.Shape(zone=True, mtls=False)) == []


@pytest.mark.parametrize("caa", [
    [],  # no CAA anywhere: any CA may issue
    [("example.com", "issue", "letsencrypt.org")],
    [("example.com", "issue", "pki.goog"), ("pod-us-east-g1.example.com", "issuewild", "letsencrypt.org")],
    [("example.com", "issuewild", "letsencrypt.org; validationmethods=dns-01")],
], ids=["none", "apex-allows", "slot-allows", "apex-wild-allows"])
def test_caa_that_lets_the_acme_directory_issue_for_the_pods_names_passes(fake_cf, caa):
    assert check(fake_cf(caa=caa)) == []


@pytest.mark.parametrize("readable", [True, False], ids=["policies", "probes"])
def test_caa_that_keeps_the_pods_certificates_out_is_refused_without_widening_the_zones_trust(fake_cf, readable):
    """The zone's apex allows only another CA: the fix is a CAA record on the pods' slot itself, never
    letsencrypt.org at the apex, which would let it issue for every hostname of the zone."""
    fake = fake_cf(caa=[("example.com", "issue", "pki.goog"), ("example.com", "issuewild", "digicert.com")],
                   self_readable=readable)
    problems = check(fake)
    assert len(problems) == 1
    text = str(problems[0])
    assert "colocate:zone" in text and "*.pod-us-east-g1.example.com" in text
    assert "every hostname under example.com" in text and "names that are not the cell's" in text
    assert 'CAA records on pod-us-east-g1.example.com itself' in text and '0 issuewild "letsencrypt.org"' in text
    assert check(fake, preflight.Shape(zone=True, mtls=True)) == []  # no ACME names: nothing to issue


def test_caa_follows_rfc_8659s_tree_climbing_and_issuewild():
    records = [("example.com", "issue", "letsencrypt.org"), ("pod-x.example.com", "issue", "pki.goog")]
    # The closest name with CAA decides: the slot's own record wins over the apex's.
    assert preflight.caa_allows(records, "*.pod-x.example.com", "letsencrypt.org") == (False, "pod-x.example.com")
    assert preflight.caa_allows(records, "*.pod-y.example.com", "letsencrypt.org") == (True, "example.com")
    # A wildcard follows issuewild where that name has one, whatever issue says.
    wild = [("example.com", "issue", "letsencrypt.org"), ("example.com", "issuewild", ";")]
    assert preflight.caa_allows(wild, "*.pod-x.example.com", "letsencrypt.org") == (False, "example.com")
    assert preflight.caa_allows([], "*.pod-x.example.com", "letsencrypt.org") == (True, "")


def test_an_account_owned_token_is_verified_on_its_account(fake_cf):
    fake = fake_cf(account_owned=True)
    assert check(fake) == []
    assert f"/client/v4/accounts/{ACCOUNT}/tokens/tok1" in fake.paths


def test_a_bad_or_inactive_token_says_so_first(fake_cf):
    fake = fake_cf()
    problems = check(fake, token="wrong")
    assert len(problems) == 1 and "does not accept the token" in str(problems[0])
    fake2 = fake_cf(status="expired")
    assert "'expired', not active" in str(check(fake2)[0])


def test_wildcards_and_denies_in_policies():
    need = preflight.DNS
    allow = {"effect": "allow", "permission_groups": [{"name": need.permission}],
             "resources": {"com.cloudflare.api.account.zone.*": "*"}}
    assert preflight.granted([allow], need, ACCOUNT, ZONE_ID)
    deny = {**allow, "effect": "deny", "resources": {f"com.cloudflare.api.account.zone.{ZONE_ID}": "*"}}
    assert not preflight.granted([allow, deny], need, ACCOUNT, ZONE_ID)
    account_only = {**allow, "resources": {"com.cloudflare.api.account.*": "*"}}
    assert not preflight.granted([account_only], need, ACCOUNT, ZONE_ID)  # an account wildcard is not its zones
    ssl = {**account_only, "permission_groups": [{"name": preflight.MTLS.permission}]}
    assert preflight.granted([ssl], preflight.MTLS, ACCOUNT, ZONE_ID)
    other_account = {**allow, "resources": {"com.cloudflare.api.account.abc": {"com.cloudflare.api.account.zone.*": "*"}}}
    assert not preflight.granted([other_account], need, ACCOUNT, ZONE_ID)


def _program(monkeypatch, fake, overrides):
    monkeypatch.setenv(preflight.BASE_ENV, fake.url)
    config, keys = stack_config("us-east", overrides=overrides)
    return run_program("us-east", config, keys)


def test_the_program_stops_before_any_resource_when_a_scope_is_missing(fake_cf, monkeypatch):
    """A RunPod cell on a zone (mutual TLS, its certificates by DNS-01): the token lacks the zone's
    DNS permission, so nothing is declared, least of all a pod."""
    fake = fake_cf(grants=ALL - {"DNS Write"})
    overrides = {"zone": ZONE, "pod": {"provider": "runpod"}}
    monkeypatch.setenv(preflight.BASE_ENV, fake.url)
    config, keys = stack_config("us-east", overrides=overrides)
    from tests.support.pulumi_mocks import RecordingMocks

    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as err:
        run_program("us-east", config, keys, mocks=mocks)
    assert "lacks DNS Write on the zone" in str(err.value) and "Zone / DNS / Edit" in str(err.value)
    assert mocks.resources == []  # no pod Command, no certificate, nothing


def test_the_program_declares_the_cell_when_the_token_will_do(fake_cf, monkeypatch):
    fake = fake_cf()
    run = _program(monkeypatch, fake, {"zone": ZONE, "pod": {"provider": "runpod"}})
    assert any(r.typ == "command:local:Command" for r in run.mocks.resources)
    assert "/client/v4/user/tokens/verify" in fake.paths


def test_the_program_stops_when_cloudflare_cannot_be_read(monkeypatch):
    monkeypatch.setenv(preflight.BASE_ENV, "http://127.0.0.1:9/client/v4")  # discard port: refused
    config, keys = stack_config("us-east", overrides={"zone": ZONE, "pod": {"provider": "runpod"}})
    with pytest.raises(pulumi.RunError, match="COLOCATE_PREFLIGHT=off"):
        run_program("us-east", config, keys)
