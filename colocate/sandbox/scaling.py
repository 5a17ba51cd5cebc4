"""The scaling controller's deployer in the sandbox: the same ``colocate.scaling.controller.Controller``
as in the cloud, with ``sandbox.py apply`` (the sandbox's ``pulumi up``) in place of Pulumi.

It writes ``colocate:scale.pods`` and ``.draining`` into the stack file the running sandbox
was started from, as ``pulumi config set --path`` would, then asks the runner to apply it:
new pods are created and healthy before the Worker routes to them, a draining pod leaves the
Worker's POD_URLS first and is deleted by the next apply. What exists (``declared``) is read
from the running sandbox (its pods) and its Worker (the pods it routes to), not the stack file:
an apply that failed leaves the file ahead of the pods.

For the keeper (colocate/scaling/keeper.py) it describes the pods through the ``local`` provider (a stand-in
whose process is gone is dead, as an exited cloud pod), replaces pod i by raising its
``colocate:pod.replaced`` count in the stack file and applying (the runner creates the renamed pod,
moves the Worker to it, then deletes the old one), and reads each pod's certificate from the pod
itself. A pod's renewal gives new pods a new certificate first; the cell's own leaves are made once
per state directory and are not the keeper's. A server of the user's (``colocate:pod.url``, or a pod
the local provider recorded as one) is marked ``own``: the keeper never replaces it.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from .. import stackfile
from ..cell import catalogue
from ..cell.settings import parse_replaced
from ..pods.base import PodInfo
from ..pods.local import Local
from ..pods.podtls import client_context
from ..scaling.controller import CellClient, existing, routed_of, scale_values
from ..scaling.keeper import RENEW_DAYS, RunningPod, days_left
from . import hopcerts, supervisor
from .launch import Launch
from .pods import recorded_pods
from .statedir import LAUNCH_FILE, LOCAL_PODS_DIR, PODS_FILE, READY_FILE, local_pod_record, read_json


class SandboxDeployer:
    def __init__(self, stack: str, state_dir: Path):
        self.stack = stack
        self.state_dir = Path(state_dir)
        launch = Launch.from_json(json.loads((self.state_dir / LAUNCH_FILE).read_text()))
        self.stacks_dir = Path(launch.stacks_dir)

    def declared(self) -> tuple[int, int]:
        """The pods the sandbox holds (its pods file, which every apply rewrites; the ready
        file keeps the first up's) and the pods its Worker routes to."""
        try:
            ready = json.loads((self.state_dir / READY_FILE).read_text())
            pods = json.loads((self.state_dir / PODS_FILE).read_text()).get("pods") or []
        except (OSError, ValueError):  # not running: what the stack file says
            raw, _ = stackfile.read_config(self.stack, self.stacks_dir)
            return scale_values(raw.get("scale"))
        client = CellClient(ready["worker_url"], ready["token"])
        return existing(len(pods), routed_of(client))

    def deploy(self, pods: int, draining: int) -> None:
        stackfile.write_config(self.stack, {"scale.pods": pods, "scale.draining": draining}, self.stacks_dir)
        supervisor.apply(self.stack, state_dir=self.state_dir, stacks_dir=self.stacks_dir)

    # --- the keeper's (colocate/scaling/keeper.py) ---

    def pods(self) -> list[RunningPod]:
        raw, _ = stackfile.read_config(self.stack, self.stacks_dir)
        allowed = tuple(catalogue.region(str(raw.get("region")), key="colocate:region").locations("local"))
        url = bool((raw.get("pod") or {}).get("url"))
        return [RunningPod(int(p.get("index", 0)), str(p["id"]), "local", p.get("ip"), p.get("port"), p.get("location"),
                           allowed, own=url or self._users(p)) for p in recorded_pods(self.state_dir)]

    def _users(self, pod: dict) -> bool:
        """Whether the local provider recorded the pod as a server of the user's (at a url it did not start)."""
        record = read_json(local_pod_record(self.state_dir, str(pod.get("name", ""))))
        return record is not None and record.get("engine") == "url"

    def describe(self, pod: RunningPod) -> PodInfo:
        provider = Local()
        provider.dir = self.state_dir / LOCAL_PODS_DIR  # where the runner's pod.py keeps its stand-ins (COLOCATE_STATE_DIR)
        return provider.describe(pod.id)

    def replace(self, indices: Sequence[int], replaced: Mapping[int, int]) -> None:
        """Pod i renamed (a count above the stack file's, whatever the generation says), then one apply."""
        raw, _ = stackfile.read_config(self.stack, self.stacks_dir)
        counts = dict(parse_replaced("colocate:pod.replaced", (raw.get("pod") or {}).get("replaced")))
        for i in indices:
            counts[i] = max(int(replaced.get(i, 0)), counts.get(i, 0) + 1)
        stackfile.write_config(self.stack, {"pod.replaced": {str(k): v for k, v in sorted(counts.items())}},
                               self.stacks_dir)
        supervisor.apply(self.stack, state_dir=self.state_dir, stacks_dir=self.stacks_dir)

    def certificates(self) -> dict[str, str | None]:
        """Each pod's certificate as the pod serves it (a plain-HTTP pod has none)."""
        ready = json.loads((self.state_dir / READY_FILE).read_text())
        creds = hopcerts.load(self.state_dir)
        ctx = client_context(creds.check.cert_pem, creds.check.key_pem, creds.public.cert_pem)
        return {f"pod-{p['index']}": served_until(p["address"], ctx, hopcerts.POD_NAME)
                for p in ready.get("pods") or [] if str(p.get("address", "")).startswith("https://")}

    def renew(self, role: str) -> None:
        """Pod i on a new certificate: the pods' certificate re-issued first if it is due, then pod i replaced."""
        if not role.startswith("pod-"):
            raise ValueError(f"the sandbox renews pods' certificates only, not {role!r}")
        if days_left(datetime.fromtimestamp(hopcerts.pod_leaf_end(self.state_dir), UTC).isoformat(), time.time()) \
                <= RENEW_DAYS:
            hopcerts.reissue_pod(self.state_dir)
        self.replace([int(role[4:])], {})


def served_until(address: str, ctx: ssl.SSLContext, name: str) -> str:
    """When the certificate a pod serves at ``address`` ends (RFC 3339), read in a handshake."""
    from cryptography import x509

    parts = urlsplit(address)
    with socket.create_connection((parts.hostname, parts.port or 443), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=name) as conn:
        der = conn.getpeercert(binary_form=True)
    if der is None:
        raise ValueError(f"the pod at {address} sent no certificate")
    return x509.load_der_x509_certificate(der).not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
