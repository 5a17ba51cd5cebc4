"""The scaling controller's deployer in the sandbox: the same ``colocate.scaler.Controller``
as in the cloud, with ``sandbox.py apply`` (the sandbox's ``pulumi up``) in place of Pulumi.

It writes ``colocate:scale.pods`` and ``.draining`` into the stack file the running sandbox
was started from, as ``pulumi config set --path`` would, then asks the runner to apply it:
new pods are created and healthy before the Worker routes to them, a draining pod leaves the
Worker's POD_URLS first and is deleted by the next apply. What exists (``declared``) is read
from the running sandbox (its pods) and its Worker (the pods it routes to), not the stack file:
an apply that failed leaves the file ahead of the pods.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import stackfile
from ..scaler import CellClient, existing, routed_of, scale_values
from . import supervisor
from .launch import Launch
from .statedir import LAUNCH_FILE, PODS_FILE, READY_FILE


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
