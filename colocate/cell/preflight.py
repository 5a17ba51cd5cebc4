"""Preflight: before any pod is rented, the Cloudflare API token has every permission the stack
uses, and the zone lets the pods' certificates be issued without changing what it trusts for its
other hostnames (docs/pods.md, "Preflight").

Without it a token that lacks one permission fails `pulumi up` at the first resource that
needs it, and the resources that need the SSL permissions (the Worker's mTLS certificate) are
declared beside pod 0: a GPU is already billing.

What each piece of a cell needs, from Cloudflare's API reference ("Accepted Permissions" of
each endpoint, developers.cloudflare.com/api, checked 2026-12-06):

* the Worker, its Durable Object, its workers.dev subdomain or custom domain, the placement
  apply and the migration-tag read: ``Workers Scripts Write`` (account; the dashboard calls it
  "Workers Scripts: Edit"). ``PUT /accounts/{id}/workers/domains`` accepts that one alone.
* ``colocate:zone``: ``Zone Read`` (the program's zone check) and ``DNS Write`` ("DNS: Edit",
  the pods' DNS-only records).
* a mutual-TLS hop: ``SSL and Certificates Write`` on the account (``POST
  /accounts/{id}/mtls_certificates``, the Worker's client certificate).
* a mutual-TLS hop on a zone's DNS-only records: nothing more. The pods' certificates are
  issued by ACME with a DNS-01 challenge (a TXT record: ``DNS Write``), and nothing is put in
  the zone's Custom Origin Trust Store, which would make Cloudflare ignore the public CAs for
  every origin of the zone ("Cloudflare will ignore all default publicly trusted CAs",
  developers.cloudflare.com/ssl/origin-configuration/custom-origin-trust-store). The zone's
  CAA records (``GET /zones/{id}/dns_records?type=CAA``) must let the ACME directory issue for
  the pods' names: where they do not, the fix is a CAA record on the pods' names alone, never
  one at a name above them, which would let that CA issue for the zone's other hostnames.

How the check asks (``check``): ``GET /user/tokens/verify`` (an account-owned token:
``GET /accounts/{id}/tokens/verify``) says whether the token is active and gives its id; the
token's own policies (``GET /user/tokens/{id}``, or the account's) say what it may do, when
the token may read itself. Most tokens may not (that takes "API Tokens Read"): each
permission is then tried with a read the permission allows, which is refused (403) without
it. A read proves the Read half of a Write permission only; the message says so.

Pure apart from ``http_get`` (urllib, overridable), so tests run it against a local server.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

API_BASE = "https://api.cloudflare.com/client/v4"
BASE_ENV = "CLOUDFLARE_API_BASE"  # tests point the check at a local server
# The CAA identifier of the ACME directories the kit knows (RFC 8659): Let's Encrypt's.
CAA_DOMAINS = {"https://acme-v02.api.letsencrypt.org/directory": "letsencrypt.org",
               "https://acme-staging-v02.api.letsencrypt.org/directory": "letsencrypt.org"}
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Need:
    """One permission the stack uses: its API name, where it applies, why, and a read it allows."""

    permission: str  # as the API names the permission group, e.g. "DNS Write"
    dashboard: str  # as the dashboard's token editor shows it
    scope: str  # "account" or "zone"
    why: str
    probe: str  # a GET this permission (or its Read half) allows; {account} and {zone} filled in

    def path(self, account_id: str, zone_id: str | None) -> str:
        return self.probe.format(account=account_id, zone=zone_id or "")


WORKERS = Need("Workers Scripts Write", "Account / Workers Scripts / Edit", "account",
               "the Worker, its Durable Object and its address", "/accounts/{account}/workers/scripts")
ZONE_READ = Need("Zone Read", "Zone / Zone / Read", "zone", "the zone check before anything is declared",
                 "/zones/{zone}")
DNS = Need("DNS Write", "Zone / DNS / Edit", "zone", "the pods' DNS-only records", "/zones/{zone}/dns_records?per_page=1")
MTLS = Need("SSL and Certificates Write", "Account / SSL and Certificates / Edit", "account",
            "the Worker's client certificate for the pod hop (mtls_certificates)", "/accounts/{account}/mtls_certificates")


@dataclass(frozen=True)
class Shape:
    """What a stack declares on Cloudflare, as far as permissions go."""

    zone: bool  # colocate:zone is set (zone check, pod DNS records, maybe a custom domain)
    mtls: bool  # the pod hop is mutual TLS (an mTLS certificate on the account)
    acme: bool = False  # ... with the pods' certificates issued by ACME DNS-01 on the zone
    acme_names: tuple[str, ...] = ()  # the names they are issued for (``*.<pod slot>``)
    acme_server: str = ""


def needs(shape: Shape) -> tuple[Need, ...]:
    """The permissions a stack of this shape uses, in the order the README lists them."""
    out = [WORKERS]
    if shape.zone:
        out += [ZONE_READ, DNS]
    if shape.mtls:
        out.append(MTLS)
    return tuple(out)


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}. Fix: {self.fix}"


Getter = Callable[[str], tuple[int, dict]]  # path -> (status, JSON body)


def http_get(base: str, token: str, timeout_s: float = TIMEOUT_S) -> Getter:
    """A GET against Cloudflare's API (or ``base``), with the token in a header, never a URL."""
    def get(path: str) -> tuple[int, dict]:
        req = urllib.request.Request(base.rstrip("/") + path, headers={"authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, _json(resp.read())
        except urllib.error.HTTPError as err:
            with err:  # an HTTPError holds the connection until closed
                return err.code, _json(err.read())
    return get


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _key_covers(key: str, want: str) -> bool:
    """A resource key naming ``want`` itself, or a ``*`` wildcard over its kind (an account
    wildcard does not cover zones)."""
    if key == want:
        return True
    return key.endswith("*") and want.startswith(key[:-1]) and ((".zone." in key) == (".zone." in want))


def _resource_covers(resources: dict, scope: str, account_id: str, zone_id: str | None) -> bool:
    """Whether a policy's resources include this account (or this zone). Keys are
    ``com.cloudflare.api.account.<id>``, ``com.cloudflare.api.account.zone.<id>`` or a ``*``
    wildcard; a value that is itself a mapping (an account's zones) is looked into."""
    account = f"com.cloudflare.api.account.{account_id}"
    want = account if scope == "account" else f"com.cloudflare.api.account.zone.{zone_id}"
    for key, value in resources.items():
        if isinstance(value, dict):
            if _key_covers(key, account) and _resource_covers(value, scope, account_id, zone_id):
                return True
        elif _key_covers(key, want):
            return True
    return False


def granted(policies: list, need: Need, account_id: str, zone_id: str | None) -> bool:
    """Whether allow-policies grant ``need`` here and no deny-policy takes it back."""
    allow = deny = False
    for policy in policies:
        if not isinstance(policy, dict):
            continue
        names = {str(g.get("name", "")) for g in policy.get("permission_groups") or [] if isinstance(g, dict)}
        if need.permission not in names:
            continue
        if not _resource_covers(policy.get("resources") or {}, need.scope, account_id, zone_id):
            continue
        if policy.get("effect") == "deny":
            deny = True
        else:
            allow = True
    return allow and not deny


def _verify(get: Getter, account_id: str) -> tuple[str | None, str | None, list[Problem]]:
    """(token id, where its own record is read, problems): a user token, else an account-owned one."""
    for verify, own in (("/user/tokens/verify", "/user/tokens/{id}"),
                        (f"/accounts/{account_id}/tokens/verify", f"/accounts/{account_id}/tokens/{{id}}")):
        status, body = get(verify)
        found = body.get("result")
        result: dict = found if isinstance(found, dict) else {}
        if status == 200 and result.get("id"):
            if result.get("status") != "active":
                return None, None, [Problem(f"cloudflare:apiToken: the token is {result.get('status')!r}, not active",
                                            "make a token (My Profile > API Tokens) with the permissions below and "
                                            "pulumi config set --secret cloudflare:apiToken <token>")]
            return str(result["id"]), own.format(id=result["id"]), []
    return None, None, [Problem("cloudflare:apiToken: Cloudflare does not accept the token (GET /user/tokens/verify "
                                f"answered {status})", "copy the token again from My Profile > API Tokens, then "
                                "pulumi config set --secret cloudflare:apiToken <token>")]


def check(shape: Shape, account_id: str, zone_id: str | None, get: Getter) -> list[Problem]:
    """Every missing permission and zone feature, each with its fix; empty when the token will do."""
    _token_id, own, problems = _verify(get, account_id)
    if problems:
        return problems
    wanted = needs(shape)
    status, body = get(own or "")
    policies = (body.get("result") or {}).get("policies") if status == 200 and isinstance(body.get("result"), dict) else None
    missing: list[Need] = []
    for need in wanted:
        if isinstance(policies, list):
            if not granted(policies, need, account_id, zone_id):
                missing.append(need)
            continue
        st, answer = get(need.path(account_id, zone_id))
        if st in (401, 403):
            missing.append(need)
    for need in missing:
        where = "the account" if need.scope == "account" else "the zone"
        problems.append(Problem(
            f"cloudflare:apiToken: the token lacks {need.permission} on {where} (needed for {need.why})",
            f"edit the token (My Profile > API Tokens) and add {need.dashboard}"
            + ("" if isinstance(policies, list) else
               " (checked with a read the permission allows: the token could not read its own policies)")))
    if shape.acme and DNS not in missing:
        problems += caa_problems(shape, zone_id, get)
    return problems


def _caa_records(get: Getter, zone_id: str | None) -> list[tuple[str, str, str]]:
    """The zone's CAA records as (name, tag, value), read with the DNS permission."""
    status, body = get(f"/zones/{zone_id}/dns_records?type=CAA&per_page=5000")
    if status != 200:
        return []
    out = []
    for rec in body.get("result") or []:
        if not isinstance(rec, dict):
            continue
        found = rec.get("data")
        data: dict = found if isinstance(found, dict) else {}
        tag, value = data.get("tag"), data.get("value")
        if tag is None:  # "0 issue \"letsencrypt.org\"" in content
            parts = str(rec.get("content") or "").split(None, 2)
            tag, value = (parts[1], parts[2].strip('"')) if len(parts) == 3 else (None, None)
        if tag:
            out.append((str(rec.get("name") or "").rstrip(".").lower(), str(tag).lower(), str(value or "")))
    return out


def caa_allows(records: list[tuple[str, str, str]], name: str, ca_domain: str) -> tuple[bool, str]:
    """Whether CAA lets ``ca_domain`` issue for ``name`` (RFC 8659: the closest name up the tree that has
    CAA records decides; a wildcard follows ``issuewild`` where that name has any, else ``issue``):
    (allowed, the name whose records decided, "" when none)."""
    wildcard = name.startswith("*.")
    labels = (name[2:] if wildcard else name).lower().split(".")
    for i in range(len(labels) - 1):
        at = ".".join(labels[i:])
        here = [(t, v) for n, t, v in records if n == at]
        if not here:
            continue
        tags = {"issuewild"} if wildcard and any(t == "issuewild" for t, _ in here) else {"issue"}
        values = [v.split(";", 1)[0].strip().lower() for t, v in here if t in tags]
        return ca_domain in values, at
    return True, ""


def caa_problems(shape: Shape, zone_id: str | None, get: Getter) -> list[Problem]:
    """Where the zone's CAA records keep the ACME directory from issuing the pods' certificates."""
    ca_domain = CAA_DOMAINS.get(shape.acme_server)
    if ca_domain is None or not shape.acme_names:
        return []  # another directory's CAA identifier is not known here: the issuance says
    records = _caa_records(get, zone_id)
    out = []
    for name in shape.acme_names:
        ok, at = caa_allows(records, name, ca_domain)
        if ok:
            continue
        slot = name[2:] if name.startswith("*.") else name
        out.append(Problem(
            f"colocate:zone: the CAA records at {at} do not let {ca_domain} issue for {name}, so the pods' "
            f"certificates cannot be issued (the pods would never serve); adding {ca_domain} at {at} would let it "
            f"issue for every hostname under {at}, changing what the zone trusts for names that are not the cell's",
            f"add CAA records on {slot} itself, which apply to the pods' names only: `0 issuewild \"{ca_domain}\"` "
            f"and `0 issue \"{ca_domain}\"` (DNS > Records > Add record, type CAA, name {slot})"))
    return out


def message(problems: list[Problem]) -> str:
    """One error for the program: every problem, then that nothing was rented."""
    return ("Preflight found what `pulumi up` would fail on after renting a pod:\n  "
            + "\n  ".join(str(p) for p in problems)
            + "\nNothing was declared. Skip the check only to debug it: COLOCATE_PREFLIGHT=off")
