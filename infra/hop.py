"""The pod hop's credentials, declared by the stack (docs/pods.md, "Who can reach the pod").

A CA of the cell (pulumi-tls: ECDSA P-256, self-signed, signing leaves only) signs the Worker's
client certificate (uploaded as a ``cloudflare.MtlsCertificate`` and bound as ``POD_TLS``); every
pod admits only callers it signed. The pods' server certificates are publicly trusted, for the
name the Worker fetches them by: on ``zone-dns`` they are issued by ACME (pulumiverse-acme,
Let's Encrypt by default) with a DNS-01 challenge on the cell's zone, from a key and request the
stack makes, so the Worker verifies the pod with public trust and nothing in the zone trusts the
cell's CA (no Custom Origin Trust Store, no ``cots_on_external_fetch``: docs/worker.md, "The pod
hop's trust"). The sandbox stack's local pods keep a leaf of the cell's CA (the program never
deploys them; the sandbox makes its own, colocate/sandbox/hopcerts.py). The client certificate of
``scripts/pod.py``'s readiness check has a CA of its own, which the pods do not trust.

Keys are pulumi-tls outputs the provider marks secret; they are wrapped as secrets again where
they leave a resource, so they reach state only encrypted, the pod command only through its
secret environment (``POD_TLS``, ``POD_CHECK_TLS``: never argv) and Cloudflare only in the
MtlsCertificate's secret input; the ACME provider gets the Cloudflare token only as a secret.
``colocate:pod.renewal`` rotates everything: the resources carry it in their names, so a new value
creates a new CA and new keys (and the pods, whose identity holds them, are replaced with them) and
deletes the old ones at the end of the update. A ``pulumi up`` within a certificate's last 14 days
re-issues it (``early_renewal_hours``, ACME's ``min_days_remaining``); from 30 days left the keeper
renews them one role at a time with targeted updates (``hopCerts`` names each role's end).
"""

from __future__ import annotations

import json

import pulumi
import pulumi_cloudflare as cloudflare
import pulumi_tls as tls
import pulumiverse_acme as acme

from colocate.cell import certexpiry
from colocate.cell.plan import PATH_ENDPOINT, PATH_ZONE_DNS, CellPlan, PodPlan, cert_fingerprint
from colocate.pods import podtls

ALGORITHM, CURVE = "ECDSA", "P256"
CA_HOURS = 5 * 365 * 24  # the CA outlives its leaves; the trust store holds it
LEAF_HOURS = 90 * 24
# A `pulumi up` within the last 14 days of a leaf re-issues it; a pod whose certificate is
# re-issued is replaced (its identity holds the certificate's fingerprint). The keeper renews each
# from 30 days left, one pod at a time (colocate/scaling/keeper.py): this is the backstop of a cell nobody
# keeps, and leaves the keeper's days 60 to 76 to itself, so a scaling step there renews nothing.
EARLY_RENEWAL_HOURS = certexpiry.AUTO_RENEW_DAYS * 24
ORGANIZATION = "colocate"
# DNS-01 through Cloudflare's API with the stack's token (lego's "cloudflare" provider; the token's
# Zone Read and DNS Edit on the zone are what a zoned cell needs anyway: colocate/cell/preflight.py).
DNS_PROVIDER = "cloudflare"
DNS_TOKEN_VAR = "CF_DNS_API_TOKEN"


def _secret(value: pulumi.Input[str]) -> pulumi.Output[str]:
    """``value`` as a secret (typed: the SDK's ``Output.secret`` leaves its type unsolved for mypy)."""
    return pulumi.Output.from_input(value).apply(pulumi.Output.secret)


def resource_suffix(renewal: int) -> str:
    """``-r<N>`` after the names of the hop's resources; nothing at renewal 0."""
    return f"-r{renewal}" if renewal else ""


class HopCredentials:
    """The hop's resources for one cell, parented to its component."""

    def __init__(self, name: str, plan: CellPlan, parent: pulumi.Resource, dns_token: pulumi.Input[str] = ""):
        self.name, self.plan = name, plan
        self.suffix = resource_suffix(plan.pod_settings.renewal if plan.pod_settings else 0)
        self.opts = pulumi.ResourceOptions(parent=parent)
        self.leaf_ends: dict[str, pulumi.Output[str]] = {}  # role -> its leaf's end (RFC 3339)
        self.ca_key = self._key(f"{name}-hop-ca-key")
        self.ca = tls.SelfSignedCert(
            f"{name}-hop-ca{self.suffix}",
            private_key_pem=_secret(self.ca_key.private_key_pem),
            is_ca_certificate=True,
            max_path_length=0,
            allowed_uses=["cert_signing", "crl_signing"],
            validity_period_hours=CA_HOURS,
            set_subject_key_id=True,
            subject=tls.SelfSignedCertSubjectArgs(common_name=f"colocate {plan.stack} pod hop CA",
                                                  organization=ORGANIZATION),
            opts=self.opts,
        )
        self.worker_key, self.worker_cert = self._leaf("worker", "colocate worker", "client_auth", [])
        # Readiness's certificate comes from a CA of its own, which no cloud pod trusts: vLLM cannot
        # limit a caller to /health, so this key (in every pod command's environment) opens nothing
        # there; the pod's refusal in the handshake is what readiness reads as serving (podtls).
        self.check_ca_key = self._key(f"{name}-hop-check-ca-key")
        self.check_ca = tls.SelfSignedCert(
            f"{name}-hop-check-ca{self.suffix}",
            private_key_pem=_secret(self.check_ca_key.private_key_pem),
            is_ca_certificate=True,
            max_path_length=0,
            allowed_uses=["cert_signing", "crl_signing"],
            validity_period_hours=CA_HOURS,
            set_subject_key_id=True,
            subject=tls.SelfSignedCertSubjectArgs(common_name=f"colocate {plan.stack} {podtls.READINESS_CA}",
                                                  organization=ORGANIZATION),
            opts=self.opts,
        )
        self.check_key, self.check_cert = self._leaf("check", "colocate pod readiness", "client_auth", [],
                                                     ca=(self.check_ca, self.check_ca_key))
        self.mtls_certificate = cloudflare.MtlsCertificate(
            f"{name}-hop-worker-mtls{self.suffix}",
            account_id=plan.worker.account_id,
            ca=False,
            certificates=self.worker_cert.cert_pem,
            private_key=_secret(self.worker_key.private_key_pem_pkcs8),
            name=f"colocate-{plan.stack}-worker{self.suffix}",
            opts=self.opts,
        )
        # zone-dns: the pods' certificates come from ACME, publicly trusted (readiness checks them
        # against the public roots: "ca" empty); elsewhere (the sandbox stack) from the cell's CA.
        self.public = plan.pod_path in (PATH_ZONE_DNS, PATH_ENDPOINT)
        self.acme_opts: pulumi.ResourceOptions | None = None
        self.acme_account: acme.Registration | None = None
        if self.public:
            provider = acme.Provider(f"{name}-hop-acme", server_url=plan.acme_server, opts=self.opts)
            self.acme_opts = pulumi.ResourceOptions(parent=parent, provider=provider)
            account_key = self._key(f"{name}-hop-acme-account-key")
            self.acme_account = acme.Registration(f"{name}-hop-acme-account{self.suffix}",
                                                  account_key_pem=_secret(account_key.private_key_pem),
                                                  opts=self.acme_opts)
        self.dns_token = dns_token
        self.check_env = _secret(pulumi.Output.all(
            self.check_cert.cert_pem, self.check_key.private_key_pem_pkcs8, "" if self.public else self.ca.cert_pem,
        ).apply(lambda a: json.dumps({"cert": a[0], "key": a[1], "ca": a[2]})))

    def _key(self, name: str) -> tls.PrivateKey:
        return tls.PrivateKey(f"{name}{self.suffix}", algorithm=ALGORITHM, ecdsa_curve=CURVE, opts=self.opts)

    def _leaf(self, role: str, common_name: str, usage: str, dns_names: list[str], ca=None):
        ca_cert, ca_key = ca or (self.ca, self.ca_key)
        key = self._key(f"{self.name}-hop-{role}-key")
        request = tls.CertRequest(
            f"{self.name}-hop-{role}-csr{self.suffix}",
            private_key_pem=_secret(key.private_key_pem),
            dns_names=dns_names or None,
            subject=tls.CertRequestSubjectArgs(common_name=common_name, organization=ORGANIZATION),
            opts=self.opts,
        )
        cert = tls.LocallySignedCert(
            f"{self.name}-hop-{role}{self.suffix}",
            cert_request_pem=request.cert_request_pem,
            ca_cert_pem=ca_cert.cert_pem,
            ca_private_key_pem=_secret(ca_key.private_key_pem),
            allowed_uses=["digital_signature", usage],
            validity_period_hours=LEAF_HOURS,
            early_renewal_hours=EARLY_RENEWAL_HOURS,
            opts=self.opts,
        )
        self.leaf_ends[role] = cert.validity_end_time
        return key, cert

    def not_after(self) -> pulumi.Output[str]:
        """The earliest end of the hop's leaves (colocate/cell/certexpiry.py warns and fails before it)."""
        return pulumi.Output.all(*self.leaf_ends.values()).apply(lambda ends: min((e for e in ends if e), default=""))

    def by_role(self) -> pulumi.Output[dict]:
        """When each role's certificate ends, as the keeper renews them (colocate/scaling/keeper.py): ``cell``
        (the Worker's and the readiness check's, renewed together: no pod holds them) and ``pod-<i>``."""
        roles = list(self.leaf_ends)

        def group(ends: list) -> dict:
            named = dict(zip(roles, ends, strict=True))
            cell = [named.pop(r) for r in ("worker", "check") if r in named]
            return {"cell": min((e for e in cell if e), default=None), **named}

        return pulumi.Output.all(*self.leaf_ends.values()).apply(group)

    def _public_leaf(self, role: str, dns_name: str, renew_days: int = EARLY_RENEWAL_HOURS // 24,
                     ) -> tuple[tls.PrivateKey, pulumi.Output[str]]:
        """A key of the stack's, and a publicly trusted certificate for ``dns_name`` (with its chain)
        from the ACME directory, by DNS-01 on the zone: the key never leaves the stack."""
        assert self.acme_account is not None and self.acme_opts is not None
        key = self._key(f"{self.name}-hop-{role}-key")
        request = tls.CertRequest(
            f"{self.name}-hop-{role}-csr{self.suffix}",
            private_key_pem=_secret(key.private_key_pem),
            dns_names=[dns_name],
            opts=self.opts,
        )
        cert = acme.Certificate(
            f"{self.name}-hop-{role}{self.suffix}",
            account_key_pem=self.acme_account.account_key_pem,
            certificate_request_pem=request.cert_request_pem,
            dns_challenges=[acme.CertificateDnsChallengeArgs(
                provider=DNS_PROVIDER, config={DNS_TOKEN_VAR: _secret(self.dns_token)})],
            min_days_remaining=renew_days,
            opts=self.acme_opts,
        )
        self.leaf_ends[role] = cert.certificate_not_after
        chain = pulumi.Output.all(cert.certificate_pem, cert.issuer_pem).apply(
            lambda a: "".join(p if p.endswith("\n") else p + "\n" for p in a if p))
        return key, chain

    def pod(self, pod: PodPlan) -> tuple[dict[str, pulumi.Output[str]], pulumi.Output[str]]:
        """Pod ``pod``'s certificate: (scripts/pod.py's environment for it, the certificate's fingerprint)."""
        if self.public:
            # An existing endpoint's is installed by its operator and renewed by no keeper: any `pulumi up`
            # from the probe's first warning re-issues it, and waits until the box serves the new one.
            renew = certexpiry.RENEW_DAYS if pod.endpoint is not None else EARLY_RENEWAL_HOURS // 24
            key, chain = self._public_leaf(f"pod-{pod.index}", pod.tls_name, renew)
        else:
            key, cert = self._leaf(f"pod-{pod.index}", pod.tls_name, "server_auth", [pod.tls_name])
            chain = cert.cert_pem
        bundle = _secret(pulumi.Output.all(chain, key.private_key_pem_pkcs8, self.ca.cert_pem)
                                      .apply(lambda a: podtls.bundle(*a)))
        env = {podtls.BUNDLE_ENV: bundle, podtls.CHECK_ENV: self.check_env}
        return env, pulumi.Output.unsecret(chain.apply(cert_fingerprint))
