"""A running sandbox as the probe's target: what ``--stack`` reads from a deployed stack's
outputs, read from the sandbox's own files (``ready.json``, ``launch.json``) instead.

The sandbox reaches its pods by name on loopback (``local-hostname``), and its pods stand at
the sites the emulated geography gives them, so the probe's placement checks apply as in the
cloud."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..cell.plan import PATH_LOCAL_HOSTNAME
from ..sandbox.statedir import LAUNCH_FILE, READY_FILE, SANDBOX_CMD, default_state_dir, where_command, where_sandboxes_run
from .errors import UsageError


@dataclass(frozen=True)
class SandboxCell:
    state_dir: Path
    stack: str
    stacks_dir: Path | None
    url: str
    token: str  # the admin token (minting the probe's client key)
    read_token: str  # what the probe reads with
    region: str | None
    pod_locations: tuple[str, ...]
    pod_path: str = PATH_LOCAL_HOSTNAME
    control_url: str | None = None  # the sandbox network's control endpoint (its outbound proxy), if it said

    def __repr__(self) -> str:  # never print the token
        return f"SandboxCell(state_dir={str(self.state_dir)!r}, stack={self.stack!r}, url={self.url!r})"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read(state_dir: Path) -> SandboxCell | None:
    """The sandbox that runs in ``state_dir``, or None when none has said it is ready there."""
    ready = _read(Path(state_dir) / READY_FILE)
    if not ready or not ready.get("worker_url") or not ready.get("token"):
        return None
    # A sandbox started by the release before the split credentials has only "token".
    read_token = ready.get("read_token") or ready["token"]
    launch = _read(Path(state_dir) / LAUNCH_FILE) or {}
    pods = ready.get("pods") or [{"location": ready.get("pod_location")}]
    stacks_dir = launch.get("stacks_dir")
    outbound = (ready.get("ports") or {}).get("outbound")
    return SandboxCell(Path(state_dir), str(ready.get("stack") or launch.get("stack") or "sandbox"),
                       Path(stacks_dir) if stacks_dir else None, ready["worker_url"].rstrip("/"), ready["token"],
                       read_token, ready.get("region"), tuple(p.get("location") or "local" for p in pods),
                       control_url=f"http://127.0.0.1:{outbound}" if isinstance(outbound, int) else None)


def from_state_dir(state_dir: Path) -> SandboxCell:
    """``--state-dir DIR``: the sandbox there, or a usage error that says how to start it and
    where sandboxes do run."""
    cell = read(state_dir)
    if cell is None:
        raise UsageError("--state-dir", str(state_dir), "no sandbox runs there (no ready.json)",
                         f"start it with `{SANDBOX_CMD} up {where_command(Path(state_dir))}`; "
                         f"{where_sandboxes_run(Path(state_dir))}")
    return cell


def of_stack(stack: str, sandboxes_dir: Path | None = None) -> SandboxCell | None:
    """``--stack S``: S's sandbox in its default state directory, if one runs there."""
    return read(Path(sandboxes_dir) / stack if sandboxes_dir else default_state_dir(stack))


def no_cell_for_stack(stack: str, why: str) -> UsageError:
    """``--stack S`` with neither a sandbox of S nor readable outputs of a deployed S."""
    return UsageError("--stack", stack, f"no sandbox of it runs in {default_state_dir(stack)} and {why}",
                      f"start one with `{SANDBOX_CMD} up --stack {stack}`, pass --state-dir DIR for a sandbox "
                      f"started elsewhere, or the URL and --pod-location for a deployed Worker; {where_sandboxes_run()}")
