"""A local certificate authority for the pod hop on this machine (the sandbox and the tests).

In the cloud the stack declares the same three things with pulumi-tls (infra/hop.py): a CA, the
pod's server certificate for the name the Worker fetches, and the client certificates of the two
callers (the Worker, and ``scripts/pod.py``'s readiness check). Here they are made with the
``cryptography`` package: ECDSA P-256, the CA limited to signing leaves (path length 0), each leaf
limited to its role (serverAuth or clientAuth). ``not_before``/``not_after`` can be set so tests
can make an expired certificate.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

# cryptography is imported where a certificate is made: the sandbox's up, down and status import
# this module (through hopcerts) and never make one.
if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

DAY = datetime.timedelta(days=1)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "colocate"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


@dataclass(frozen=True)
class Leaf:
    """A certificate and its private key, in PEM."""

    cert_pem: str
    key_pem: str


@dataclass(frozen=True)
class LocalCA:
    cert_pem: str
    key_pem: str

    @classmethod
    def create(cls, name: str = "colocate pod hop CA", days: int = 365) -> LocalCA:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + days * DAY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))

    def _issue(self, common_name: str, usage, names: tuple[str, ...], not_before, not_after) -> Leaf:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        # The CA's key is the EC key create() made; the loader's type covers every kind of key.
        ca_key = cast(ec.EllipticCurvePrivateKey, serialization.load_pem_private_key(self.key_pem.encode(), None))
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem.encode())
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
                   .not_valid_after(not_after or now + 90 * DAY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return Leaf(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))

    def server(self, *names: str, not_before=None, not_after=None) -> Leaf:
        """The pod's certificate, for the names the Worker fetches it by."""
        from cryptography.x509.oid import ExtendedKeyUsageOID

        return self._issue(names[0], ExtendedKeyUsageOID.SERVER_AUTH, names, not_before, not_after)

    def client(self, common_name: str, *, not_before=None, not_after=None) -> Leaf:
        """A caller's certificate (the Worker's, the readiness check's)."""
        from cryptography.x509.oid import ExtendedKeyUsageOID

        return self._issue(common_name, ExtendedKeyUsageOID.CLIENT_AUTH, (), not_before, not_after)
