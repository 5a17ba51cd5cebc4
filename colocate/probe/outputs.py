"""Reading a deployed stack's outputs and config for ``probe.py --stack``.

Outputs come from ``pulumi stack output --json --show-secrets --stack S`` run in the repo
root (the output names are the constants in ``colocate.cell.outputs``); config (region, budgets,
samples, placement mode) from ``stacks/Pulumi.<S>.yaml`` via ``colocate.stackfile``. The
command's stdout holds secrets: it is parsed, never echoed, not even in an error.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import stackfile
from ..cell import outputs as names
from ..errors import ConfigError
from . import fallbackshare
from .errors import OutputsError, UsageError

PULUMI_TIMEOUT_S = 120


@dataclass(frozen=True)
class StackOutputs:
    worker_url: str | None
    read_token: str | None  # readToken (an older stack's probeToken)
    pod_location: str | None
    pod_locations: tuple[str, ...] = ()  # every pod, index order (podLocations)
    pod_path: str | None = None  # podPath: how the Worker reaches the pods
    placement_mode: str | None = None  # placementMode: pod | targeted | smart
    placement_host: str | None = None  # placementHost: pod mode's host:port
    admin_token: str | None = None  # adminToken (an older stack's probeToken)
    hop_not_after: str | None = None  # hopCertsNotAfter: the pod hop's earliest certificate end (mutual TLS)

    def __repr__(self) -> str:  # never print the token
        return (f"StackOutputs(worker_url={self.worker_url!r}, pod_location={self.pod_location!r}, "
                f"pod_locations={self.pod_locations!r}, pod_path={self.pod_path!r}, "
                f"placement_mode={self.placement_mode!r}, placement_host={self.placement_host!r}, tokens=***)")


def read_outputs(stack: str, cwd: Path = stackfile.ROOT, pulumi: str = "pulumi") -> StackOutputs:
    """Run the Pulumi CLI once; OutputsError says what is missing and how to go on without it."""
    cmd = [pulumi, "stack", "output", "--json", "--show-secrets", "--stack", stack]
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=PULUMI_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise OutputsError(f"--stack {stack}: the pulumi CLI is not on PATH; install it, or pass the URL, "
                           "--pod-location and the token (COLOCATE_READ_TOKEN) yourself") from None
    except subprocess.TimeoutExpired:
        raise OutputsError(f"--stack {stack}: `pulumi stack output` did not finish in {PULUMI_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        why = next((line.strip() for line in proc.stderr.splitlines() if line.strip()), "no message")
        raise OutputsError(f"--stack {stack}: `pulumi stack output --stack {stack}` failed (exit {proc.returncode}): "
                           f"{why[:300]}; check the stack name (`pulumi stack ls`) and that it was deployed")
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise OutputsError(f"--stack {stack}: `pulumi stack output --json` did not print a JSON object")

    def text(key: str) -> str | None:
        v = data.get(key)
        return v if isinstance(v, str) and v else None

    locations = data.get(names.POD_LOCATIONS)
    locations = tuple(x for x in locations if isinstance(x, str) and x) if isinstance(locations, list) else ()
    legacy = text(names.PROBE_TOKEN)  # a stack deployed by the release before the split credentials
    return StackOutputs(text(names.WORKER_URL), text(names.READ_TOKEN) or legacy, text(names.POD_LOCATION),
                        locations, text(names.POD_PATH), text(names.PLACEMENT_MODE), text(names.PLACEMENT_HOST),
                        text(names.ADMIN_TOKEN) or legacy, text(names.HOP_NOT_AFTER))


@dataclass(frozen=True)
class StackConfig:
    region: str | None
    budgets: object  # raw colocate:budgets (validated by budgets.from_stack)
    samples: int | None
    worker_placement: str | None
    max_fallback_share: float = fallbackshare.DEFAULT_MAX_SHARE  # colocate:probe.maxFallbackShare


def read_config(stack: str, stacks_dir: Path = stackfile.STACKS_DIR) -> StackConfig:
    try:
        raw, _ = stackfile.read_config(stack, stacks_dir)
    except ConfigError as exc:
        raise UsageError("--stack", stack, exc.problem, exc.fix) from None
    probe = raw.get("probe") or {}
    worker = raw.get("worker") or {}
    probe, worker = (probe if isinstance(probe, dict) else {}), (worker if isinstance(worker, dict) else {})
    samples = probe.get("samples")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise UsageError("--stack", stack, f"colocate:probe.samples is {samples!r}, not a whole number above 0",
                         "pulumi config set --path colocate:probe.samples 25")
    share = probe.get("maxFallbackShare", fallbackshare.DEFAULT_MAX_SHARE)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise UsageError("--stack", stack, f"colocate:probe.maxFallbackShare is {share!r}, not a share from 0 to 1",
                         "pulumi config set --path colocate:probe.maxFallbackShare 0.1")
    return StackConfig(raw.get("region"), raw.get("budgets"), samples, worker.get("placement") or "auto", float(share))
