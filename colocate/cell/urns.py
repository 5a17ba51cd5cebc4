"""The URNs of the resources a targeted `pulumi up` names (``--target``, ``--replace``): a pod's rent and
the hop's certificates, as infra/cell.py and infra/hop.py declare them under the ``Cell`` component.
tests/test_keeper_plan.py checks them against the URNs the program's resources get. Pure: no Pulumi.

``urn:pulumi:<stack>::<project>::<parent type>$<type>::<name>``; the Cell is named after the stack and
is a child of the stack's root resource, which a URN's type chain leaves out.
"""

from __future__ import annotations

CELL = "colocate:index:Cell"
COMMAND = "command:local:Command"
LOCALLY_SIGNED_CERT = "tls:index/locallySignedCert:LocallySignedCert"
ACME_CERTIFICATE = "acme:index/certificate:Certificate"


def urn(project: str, stack: str, typ: str, name: str) -> str:
    """A resource of the cell's component."""
    return f"urn:pulumi:{stack}::{project}::{CELL}${typ}::{name}"


def pod_rent(project: str, stack: str, index: int) -> str:
    """Pod ``index``'s rent (``<stack>-pod-<i>``), which holds its delete; its wait, DNS record and the
    Worker depend on it."""
    return urn(project, stack, COMMAND, f"{stack}-pod-{index}")


def hop_certificates(project: str, stack: str, role: str, renewal: int, public: bool) -> list[str]:
    """The certificates of a keeper's role (colocate/scaling/keeper.py): ``cell`` is the Worker's client
    certificate and the readiness check's (the cell's CA signs both), ``pod-<i>`` pod i's server
    certificate (ACME's on the zone, the cell CA's elsewhere)."""
    suffix = f"-r{renewal}" if renewal else ""
    if role == "cell":
        return [urn(project, stack, LOCALLY_SIGNED_CERT, f"{stack}-hop-{r}{suffix}") for r in ("worker", "check")]
    return [urn(project, stack, ACME_CERTIFICATE if public else LOCALLY_SIGNED_CERT, f"{stack}-hop-{role}{suffix}")]
