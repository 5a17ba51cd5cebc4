"""The sandbox's credentials for the pod hop, the trust of the cloud emulated from outside.

In the cloud a pod's server certificate is publicly trusted (ACME on the zone) and the cell's own
CA signs only the Worker's client certificate, which the pods trust (infra/hop.py). Here a
sandbox-only "public" root stands in for the public CAs: it signs the pods' server certificate
(for ``localhost``, the name the Worker fetches them by), and workerd's pod TLS options trust it
and nothing else (``HopClient.ca_pem``); the cell's CA signs the Worker's client certificate (its
POD_TLS binding), and only the pods trust it. The readiness check's client certificate
(``scripts/pod.py``) is signed by a readiness CA of its own: the stand-in admits it to
``GET /health`` only (``podtls.allows``).

Generated once per state directory under ``hop/`` (directory 0700, files 0600), like
``secrets.json``. The keys stay in the directory; nothing is printed or put in argv.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..pods import podtls
from ..workerd import HopClient
from .localca import Leaf, LocalCA

DIR = "hop"
POD_NAME = "localhost"  # what PodPlan.tls_name is for a local pod
FILES = {"ca": "ca", "pod": "pod", "worker": "worker", "check": "check", "check_ca": "check-ca", "public": "public"}
_LOCK = threading.Lock()  # the runner creates pods side by side: one of them makes the files


@dataclass(frozen=True)
class HopCredentials:
    ca: LocalCA  # the cell's: signs the Worker's client certificate, which the pods trust
    pod: Leaf  # signed by ``public``
    worker: Leaf
    check: Leaf
    check_ca: LocalCA  # signs only the readiness certificate
    public: LocalCA  # the sandbox's stand-in for the public CAs: signs the pods' server certificate

    def worker_client(self) -> HopClient:
        """The Worker's side: its client certificate, and the public root (never the cell's CA) for the pods."""
        return HopClient(self.worker.cert_pem, self.worker.key_pem, self.public.cert_pem)

    def pod_env(self) -> dict[str, str]:
        """What ``scripts/pod.py create`` takes for a mutual-TLS pod (as infra/ passes it in the cloud)."""
        return {podtls.BUNDLE_ENV: podtls.bundle(self.pod.cert_pem, self.pod.key_pem, self.ca.cert_pem,
                                                 self.check_ca.cert_pem),
                podtls.CHECK_ENV: json.dumps({"cert": self.check.cert_pem, "key": self.check.key_pem,
                                              "ca": self.public.cert_pem})}


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def load(state_dir: Path) -> HopCredentials:
    """The state directory's hop credentials, made on first use. They are written into a private
    temporary directory and renamed into place whole, so a reader in another process (``status``)
    never pairs a certificate with another run's key; the first rename wins."""
    d = Path(state_dir) / DIR
    with _LOCK:
        if not (d / f"{FILES['public']}.pem").is_file():  # none yet, or made before the pods' public root
            if d.is_dir():
                old = d.with_name(f".{DIR}-old-{os.getpid()}-{threading.get_ident()}")
                with contextlib.suppress(OSError):  # another process may have moved it first
                    os.rename(d, old)
                shutil.rmtree(old, ignore_errors=True)
            _make(d)
        read = {k: Leaf((d / f"{n}.pem").read_text(), (d / f"{n}.key").read_text()) for k, n in FILES.items()}
    return HopCredentials(LocalCA(read["ca"].cert_pem, read["ca"].key_pem), read["pod"], read["worker"], read["check"],
                          LocalCA(read["check_ca"].cert_pem, read["check_ca"].key_pem),
                          LocalCA(read["public"].cert_pem, read["public"].key_pem))


def _make(d: Path) -> None:
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".hop-", dir=d.parent))  # mode 0700
    ca = LocalCA.create("colocate sandbox pod hop CA")
    check_ca = LocalCA.create(f"colocate sandbox {podtls.READINESS_CA}")
    public = LocalCA.create("colocate sandbox public root (stands in for the public CAs)")
    made = {"ca": Leaf(ca.cert_pem, ca.key_pem), "pod": public.server(POD_NAME),
            "worker": ca.client("colocate worker"), "check": check_ca.client("colocate pod readiness"),
            "check_ca": Leaf(check_ca.cert_pem, check_ca.key_pem), "public": Leaf(public.cert_pem, public.key_pem)}
    for key, leaf in made.items():
        _write(tmp / f"{FILES[key]}.pem", leaf.cert_pem)
        _write(tmp / f"{FILES[key]}.key", leaf.key_pem)
    try:
        os.rename(tmp, d)
    except OSError:  # another process made it first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)


def pod_leaf_end(state_dir: Path) -> float:
    """When the pods' server certificate (the one a new pod gets) ends, as a POSIX time."""
    from cryptography import x509

    return x509.load_pem_x509_certificate((Path(state_dir) / DIR / f"{FILES['pod']}.pem").read_bytes()) \
        .not_valid_after_utc.timestamp()


def reissue_pod(state_dir: Path, not_after=None) -> None:
    """A new server certificate for the pods the runner creates from now on (running pods keep
    theirs: a pod reads its certificate once, at start). ``not_after``: when it ends (default 90
    days). The key is written before the certificate, each by rename, in the keeper's process,
    while no pod is being created (it holds the controllers' lease)."""
    creds = load(state_dir)
    leaf = creds.public.server(POD_NAME, not_after=not_after)
    d = Path(state_dir) / DIR
    for suffix, text in ((".key", leaf.key_pem), (".pem", leaf.cert_pem)):
        tmp = d / f".{FILES['pod']}{suffix}.{os.getpid()}"
        _write(tmp, text)
        os.replace(tmp, d / f"{FILES['pod']}{suffix}")
