"""The pod hop's credentials as the stack declares them, under the Pulumi mocks: for every stack in
stacks/ (and a RunPod cell on a zone, the cloud's mutual-TLS path), the CA and certificates
(pulumi-tls), the pods' publicly trusted certificates on a zone (pulumiverse-acme, DNS-01), the
Worker's MtlsCertificate and its POD_TLS binding, each pod's bundle by environment, nothing that
changes what the zone trusts, and no private key anywhere but in a secret."""

from __future__ import annotations

import json

import pytest

from colocate import stackfile
from colocate.fleet import plan as fleet
from colocate.pods import podtls
from tests.support.images import GUARDED_IMAGE
from tests.support.pulumi_mocks import mock_pem, plain, run_program, stack_config, unsecret

WORKER = "cloudflare:index/workersScript:WorkersScript"
COMMAND = "command:local:Command"
MTLS = "cloudflare:index/mtlsCertificate:MtlsCertificate"
TRUST = "cloudflare:index/customOriginTrustStore:CustomOriginTrustStore"
ACME_CERT = "acme:index/certificate:Certificate"
ACME_ACCOUNT = "acme:index/registration:Registration"
ACME_PROVIDER = "pulumi:providers:acme"
KEY = "tls:index/privateKey:PrivateKey"
CA = "tls:index/selfSignedCert:SelfSignedCert"
LEAF = "tls:index/locallySignedCert:LocallySignedCert"
CSR = "tls:index/certRequest:CertRequest"
ZONE = {"id": "f" * 32, "name": "example.com"}
CELL_STACKS = sorted(
    p.name[len("Pulumi."):-len(".yaml")] for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml")
    if not fleet.is_fleet(stackfile.read_config(p.name[len("Pulumi."):-len(".yaml")])[0]))
# (stack, overrides): every stack as shipped, plus the cloud's mutual-TLS path (RunPod on a zone).
CASES = [(s, {}) for s in CELL_STACKS] + [
    ("apac-jp", {"zone": ZONE}), ("us-east", {"zone": ZONE, "pod": {"provider": "runpod", "count": 2}})]


def _mtls_expected(stack: str, overrides: dict) -> bool:
    """The rule, from the stack file: the sandbox's local pods, RunPod or Vast.ai on a zone (RunPod's proxy
    ends TLS before the pod), and endpoints the team runs whose every name is on the zone (an ip it names there)."""
    raw = {**stackfile.read_config(stack)[0], **overrides}
    pod = raw.get("pod") or {}
    provider = pod.get("provider", "runpod")
    zone = (raw.get("zone") or {}).get("name")
    if provider == "existing":
        return bool(zone) and all("ip" in e or e["host"].endswith("." + zone) for e in pod["endpoints"])
    return provider == "local" or (provider in ("runpod", "vastai") and bool(zone))


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}{'+zone' if o else ''}{'x2' if 'pod' in o else ''}" for s, o in CASES])
def deployed(request):
    stack, overrides = request.param
    config, keys = stack_config(stack, overrides=overrides)
    return stack, overrides, run_program(stack, config, keys)


def _bindings(run) -> dict:
    return {b["name"]: b for b in plain(run.mocks.one(WORKER).inputs["bindings"])}


def _pod_commands(run) -> list:
    return [r for r in run.mocks.of_type(COMMAND) if "pod.py rent" in r.inputs.get("create", "")]


def test_the_stack_declares_the_hops_certificates_exactly_when_the_hop_is_mutual_tls(deployed):
    stack, overrides, run = deployed
    m = run.mocks
    pods = _pod_commands(run)
    if not _mtls_expected(stack, overrides):
        assert not any(m.of_type(t) for t in (KEY, CA, LEAF, CSR, MTLS, TRUST, ACME_CERT, ACME_ACCOUNT))
        assert "POD_TLS" not in _bindings(run)
        for cmd in pods:
            _, env = unsecret(cmd.inputs["environment"])
            assert podtls.BUNDLE_ENV not in env and podtls.CHECK_ENV not in env
        return
    cas = {r.name: r.inputs for r in m.of_type(CA)}
    assert set(cas) == {f"{stack}-hop-ca", f"{stack}-hop-check-ca"}
    for ca in cas.values():
        assert ca["isCaCertificate"] is True and ca["allowedUses"] == ["cert_signing", "crl_signing"]
        assert ca["maxPathLength"] == 0
    assert cas[f"{stack}-hop-check-ca"]["subject"]["commonName"].endswith(podtls.READINESS_CA)
    assert not cas[f"{stack}-hop-ca"]["subject"]["commonName"].endswith(podtls.READINESS_CA)
    zone = {**stackfile.read_config(stack)[0], **overrides}.get("zone")
    leaves = {r.name: r.inputs for r in m.of_type(LEAF)}
    # One leaf for the Worker, signed by the cell's CA; readiness's by a CA of its own; on a zone each
    # pod's is publicly trusted (ACME), in the sandbox stack a leaf of the cell's CA.
    pod_leaves = set() if zone else {f"{stack}-hop-pod-{i}" for i in range(len(pods))}
    assert set(leaves) == {f"{stack}-hop-worker", f"{stack}-hop-check", *pod_leaves}
    for name, leaf in leaves.items():
        ca = f"{stack}-hop-check-ca" if name.endswith("-hop-check") else f"{stack}-hop-ca"
        assert leaf["caCertPem"] == mock_pem("CERTIFICATE", ca)
        assert unsecret(leaf["caPrivateKeyPem"]) == (True, mock_pem("EC PRIVATE KEY", f"{ca}-key"))
        assert leaf["allowedUses"] == ["digital_signature", "server_auth" if "-pod-" in name else "client_auth"]
    # The Worker presents its own certificate through the binding the router fetches by.
    mtls = m.one(MTLS)
    assert mtls.inputs["ca"] is False and mtls.inputs["certificates"] == mock_pem("CERTIFICATE", f"{stack}-hop-worker")
    assert unsecret(mtls.inputs["privateKey"]) == (True, mock_pem("PRIVATE KEY", f"{stack}-hop-worker-key"))
    assert _bindings(run)["POD_TLS"] == {"name": "POD_TLS", "type": "mtls_certificate", "certificateId": f"{mtls.name}-id"}
    # Each pod gets its own certificate, for the name the Worker fetches it by, and readiness's credential.
    for cmd in pods:
        spec = json.loads(cmd.inputs["stdin"])
        i = spec["index"]
        csr = m.one(CSR, f"-hop-pod-{i}-csr").inputs
        assert csr["dnsNames"] == [spec["tls_name"]] and spec["tls_name"]
        is_secret, env = unsecret(cmd.inputs["environment"])
        assert is_secret
        # The pod trusts the cell's CA only: vLLM cannot hold readiness to /health, so it never admits it.
        served = mock_pem("CERTIFICATE", f"{stack}-hop-pod-{i}")
        if zone:  # the publicly trusted leaf and its issuer's chain
            served += mock_pem("CERTIFICATE", f"{stack}-hop-pod-{i} issuer")
        assert env[podtls.BUNDLE_ENV] == podtls.bundle(served, mock_pem("PRIVATE KEY", f"{stack}-hop-pod-{i}-key"),
                                                       mock_pem("CERTIFICATE", f"{stack}-hop-ca"))
        assert mock_pem("CERTIFICATE", f"{stack}-hop-check-ca") not in env[podtls.BUNDLE_ENV]
        check = json.loads(env[podtls.CHECK_ENV])
        # Readiness checks a zone pod's certificate against the public roots ("ca" empty), as the Worker does.
        assert check == {"cert": mock_pem("CERTIFICATE", f"{stack}-hop-check"),
                         "key": mock_pem("PRIVATE KEY", f"{stack}-hop-check-key"),
                         "ca": "" if zone else mock_pem("CERTIFICATE", f"{stack}-hop-ca")}
        assert "cert=sha256:" in " ".join(plain(cmd.inputs["triggers"]))  # a re-issued certificate replaces the pod
    if zone:  # the cloud's path: ACME DNS-01 on the zone, with the stack's token as a secret, renewed by `pulumi up`
        account = m.one(ACME_ACCOUNT)
        assert m.one(ACME_PROVIDER).inputs["serverUrl"] == "https://acme-v02.api.letsencrypt.org/directory"
        for cmd in pods:
            spec = json.loads(cmd.inputs["stdin"])
            cert = m.one(ACME_CERT, f"-hop-pod-{spec['index']}").inputs
            assert cert["certificateRequestPem"] == mock_pem("CERTIFICATE REQUEST", f"{stack}-hop-pod-{spec['index']}-csr")
            assert cert["accountKeyPem"] == account.inputs["accountKeyPem"]
            challenge_secret, challenges = unsecret(cert["dnsChallenges"])
            assert challenge_secret
            assert challenges == [{"provider": "cloudflare", "config": {"CF_DNS_API_TOKEN": "cf-token-s3cret"}}]
            # the keeper renews from 30, a pod at a time; an up, all, from 14; the team's box from 30 at any up
            # (no keeper can install it there: the up waits until the box serves the new one)
            assert cert["minDaysRemaining"] == (30 if spec["provider"] == "existing" else 14)
        assert all(u.startswith("https://") for u in json.loads(_bindings(run)["POD_URLS"]["text"]))


def test_no_declared_resource_changes_what_the_zone_trusts_for_other_hostnames(deployed):
    """No Custom Origin Trust Store (Cloudflare then ignores the public CAs for every origin of the zone)
    and no cots_on_external_fetch (the Worker's fallback and trace fetches would check public hosts
    against it): the only things on the zone are the pods' own records and their ACME challenges."""
    _, _, run = deployed
    m = run.mocks
    assert m.of_type(TRUST) == []
    assert m.one(WORKER).inputs["compatibilityFlags"] == ["enable_request_signal"]  # a client's hang-up reaches the router
    zone_types = {r.typ for r in m.resources if "zoneId" in r.inputs}
    assert zone_types <= {"cloudflare:index/dnsRecord:DnsRecord", "cloudflare:index/workersCustomDomain:WorkersCustomDomain"}


def _leaks(value, path: str, inside_secret: bool = False):
    """Where a private key appears outside a secret in a declared value."""
    is_secret, value = unsecret(value)
    inside_secret = inside_secret or is_secret
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaks(v, f"{path}.{k}", inside_secret)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaks(v, f"{path}[{i}]", inside_secret)
    elif isinstance(value, str) and "PRIVATE KEY" in value and not inside_secret:
        yield path


def test_no_private_key_is_declared_outside_a_secret_nor_exported_nor_in_argv(deployed):
    _, _, run = deployed
    leaks = [p for r in run.mocks.resources for p in _leaks(r.inputs, r.name)]
    assert leaks == []
    for r in run.mocks.of_type(COMMAND):
        assert "PRIVATE KEY" not in plain(r.inputs.get("create", "")) + plain(r.inputs.get("stdin", "") or "")
    for name, value in run.resolved.items():
        assert "PRIVATE KEY" not in json.dumps(value, default=str) or run.secret_flags[name], name


def test_renewal_rotates_the_ca_and_every_key_with_the_pods():
    config, keys = stack_config("apac-jp", overrides={"zone": ZONE})
    before = run_program("apac-jp", config, keys)
    config, keys = stack_config("apac-jp", overrides={"zone": ZONE, "pod": {"provider": "runpod", "renewal": 1}})
    after = run_program("apac-jp", config, keys)
    hop_types = (KEY, CA, LEAF, CSR, MTLS, ACME_CERT, ACME_ACCOUNT)
    old = {r.name for r in before.mocks.resources if r.typ in hop_types}
    new = {r.name for r in after.mocks.resources if r.typ in hop_types}
    assert old and not old & new and all(n.endswith("-r1") for n in new)
    spec = [json.loads(c.inputs["stdin"]) for c in _pod_commands(before) + _pod_commands(after)]
    assert spec[0]["name"] != spec[1]["name"]


def test_hop_token_on_a_zone_is_refused_never_plain_http():
    """On a zone the pod's port is public: a token hop would carry prompts and the pod token in plain HTTP."""
    config, keys = stack_config("apac-jp", overrides={"zone": ZONE, "pod": {"provider": "runpod", "hop": "token"}})
    with pytest.raises(Exception, match="colocate:pod.hop.*plain HTTP") as err:
        run_program("apac-jp", config, keys)
    assert "pulumi config rm --path colocate:pod.hop" in str(err.value)


def test_a_zoneless_runpod_stack_declares_no_certificates_and_reaches_the_proxy_over_https():
    config, keys = stack_config("apac-jp", drop=("zone",), overrides={"pod": {"provider": "runpod", "image": GUARDED_IMAGE}})
    run = run_program("apac-jp", config, keys)
    assert not any(run.mocks.of_type(t) for t in (KEY, CA, LEAF, MTLS, TRUST, ACME_CERT))
    assert "POD_TLS" not in _bindings(run)
    assert all(u.startswith("https://") and ".proxy.runpod.net" in u for u in json.loads(_bindings(run)["POD_URLS"]["text"]))
