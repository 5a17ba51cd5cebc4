"""Where each generation's object lives: pinned on first touch, kept in ``pins.json``.

The real platform creates an object near the Worker that first calls ``get()`` on its
name and never moves it. The sandbox records that first decision in
``<state_dir>/pins.json`` and keeps it across restarts, ``down`` and ``up``: a later
``get()`` from another edge, with another hint, finds the object where it was.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

from .errors import SandboxError
from .geography import landing_site, site


class Pins:
    """The pin table of one state directory. Thread-safe; every new pin is written at once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._pins = self._load()

    def _load(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SandboxError(f"{self.path}: unreadable pin table ({exc}). Fix: delete it only if the sandbox's "
                               "objects may be forgotten (run `sandbox.py down` first)") from None
        if not isinstance(data, dict) or not all(isinstance(v, dict) and "site" in v for v in data.values()):
            raise SandboxError(f"{self.path}: not a pin table of {{name: {{site, ...}}}}. Fix: delete the file")
        return data

    def site_of(self, name: str) -> str | None:
        with self._lock:
            entry = self._pins.get(name)
            return entry["site"] if entry else None

    def all(self) -> dict[str, str]:
        with self._lock:
            return {name: entry["site"] for name, entry in self._pins.items()}

    def touch(self, name: str, edge: str, hint: str = "") -> tuple[str, bool]:
        """The site of ``name``; on first touch pin it by ``landing_site`` and persist.
        Returns (site, created)."""
        if not isinstance(name, str) or not name:
            raise SandboxError(f"generation name must be non-empty text (got {name!r})")
        with self._lock:
            entry = self._pins.get(name)
            if entry:
                return entry["site"], False
            where = landing_site(edge, hint)
            self._pins[name] = {"site": where, "edge": site(edge), "hint": hint, "pinned_at": round(time.time(), 3)}
            self._write()
            return where, True

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".pins.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self._pins, fh, indent=2, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
