"""Helpers for tests that run the sandbox: a private copy of the sandbox stack."""

from __future__ import annotations

import shutil
from pathlib import Path

from colocate import stackfile


def sandbox_stacks(directory: Path, compute_ms: int) -> Path:
    """Copy stacks/Pulumi.sandbox.yaml into ``directory`` with the pod's compute time set."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stackfile.path_of("sandbox"), stackfile.path_of("sandbox", directory))
    stackfile.write_config("sandbox", {"pod": {"provider": "local", "computeMs": compute_ms}}, directory)
    return directory
