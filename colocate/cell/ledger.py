"""The generation ledger (``colocate:generations``) and its legal transitions.

A generation is a Durable Object name. It is pinned where it is first touched and
never moves, so its region is part of its name (``apac-tw.g2``) and never changes.
Exactly one generation is ``active`` and its region equals ``colocate:region``; at
most one is ``draining`` (the previous home, read through while state moves).

    start(to)   active -> draining, a new generation in ``to`` becomes active
    finish()    draining -> retired (the next deploy purges and unbinds it)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import LedgerError
from .catalogue import region as lookup_region

KEY = "colocate:generations"
ACTIVE, DRAINING, RETIRED = "active", "draining", "retired"
STATUSES = (ACTIVE, DRAINING, RETIRED)
UNKNOWN_REGION = "unknown"  # an adopted generation whose home the probe has yet to measure
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_GEN_SUFFIX = re.compile(r"\.g(\d+)$")


@dataclass(frozen=True)
class Generation:
    name: str
    region: str
    status: str
    observed_colo: str | None = None  # where the probe last saw the object (adopted generations)

    def as_config(self) -> dict:
        out = {"name": self.name, "region": self.region, "status": self.status}
        if self.observed_colo:
            out["observedColo"] = self.observed_colo
        return out


@dataclass(frozen=True)
class Ledger:
    generations: tuple[Generation, ...]

    @classmethod
    def parse(cls, raw: object) -> Ledger:
        if not isinstance(raw, list) or not raw:
            raise LedgerError(
                KEY, raw, "the ledger must be a non-empty list of {name, region, status}",
                "run `.venv/bin/python scripts/migrate.py init --stack <stack>` or add "
                "[{name: <region>.g1, region: <region>, status: active}]",
            )
        gens = []
        for i, entry in enumerate(raw):
            where = f"{KEY}[{i}]"
            if not isinstance(entry, dict):
                raise LedgerError(where, entry, "each entry is a mapping", "write {name: ..., region: ..., status: ...}")
            name, reg, status = entry.get("name"), entry.get("region"), entry.get("status")
            if not isinstance(name, str) or not _NAME.match(name):
                raise LedgerError(f"{where}.name", name, "a generation name is 1-63 letters, digits, '.', '_' or '-'",
                                  "name it <region>.g<N>, for example apac-tw.g2")
            if reg != UNKNOWN_REGION:
                lookup_region(reg, key=f"{where}.region")
            if status not in STATUSES:
                raise LedgerError(f"{where}.status", status, "unknown status", f"use one of {', '.join(STATUSES)}")
            observed = entry.get("observedColo")
            gens.append(Generation(name, str(reg), status, observed.upper() if isinstance(observed, str) else None))
        ledger = cls(tuple(gens))
        ledger._check_shape()
        return ledger

    def _check_shape(self) -> None:
        names = [g.name for g in self.generations]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise LedgerError(KEY, dupes, "a generation name appears twice", "every generation needs its own name")
        active = [g.name for g in self.generations if g.status == ACTIVE]
        if len(active) != 1:
            raise LedgerError(
                KEY, active, f"exactly one generation must be active, found {len(active)}",
                "keep one entry with status: active (use scripts/migrate.py, not a hand edit)",
            )
        draining = [g.name for g in self.generations if g.status == DRAINING]
        if len(draining) > 1:
            raise LedgerError(KEY, draining, "at most one generation may be draining",
                              "run `.venv/bin/python scripts/migrate.py finish --stack <stack>` before another move")

    @property
    def active(self) -> Generation:
        return next(g for g in self.generations if g.status == ACTIVE)

    @property
    def draining(self) -> Generation | None:
        return next((g for g in self.generations if g.status == DRAINING), None)

    @property
    def retired(self) -> tuple[Generation, ...]:
        return tuple(g for g in self.generations if g.status == RETIRED)

    def check_region(self, cell_region: str, stack: str = "<stack>") -> None:
        """The active generation must live in the cell's region (or be adopted, region unknown)."""
        active = self.active
        if active.region not in (cell_region, UNKNOWN_REGION):
            raise LedgerError(
                "colocate:region", cell_region,
                f"the active generation {active.name} lives in {active.region}: state and compute would be split",
                f"move state with compute: run `.venv/bin/python scripts/migrate.py start --stack {stack} --to {cell_region}`, "
                "then `pulumi up`",
            )

    def next_name(self, region: str) -> str:
        numbers = [int(m.group(1)) for g in self.generations if (m := _GEN_SUFFIX.search(g.name))]
        return f"{region}.g{max(numbers, default=0) + 1}"

    def start(self, to_region: str, stack: str = "<stack>") -> Ledger:
        """Begin a move: the active generation drains, a new one in ``to_region`` becomes active."""
        lookup_region(to_region, key="--to")
        if self.draining is not None:
            raise LedgerError(
                KEY, self.draining.name, "a move is already under way (a generation is draining)",
                f"run `.venv/bin/python scripts/migrate.py finish --stack {stack}` and `pulumi up` first",
            )
        if self.active.region == to_region:
            raise LedgerError("--to", to_region, f"the active generation {self.active.name} already lives there",
                              "pick another region; nothing needs to move")
        new = Generation(self.next_name(to_region), to_region, ACTIVE)
        gens = tuple(replace(g, status=DRAINING) if g.status == ACTIVE else g for g in self.generations)
        return Ledger(gens + (new,))

    def finish(self, stack: str = "<stack>") -> Ledger:
        """End a move: the draining generation is retired (purged and unbound by the next deploy)."""
        if self.draining is None:
            raise LedgerError(KEY, [g.name for g in self.generations], "no generation is draining: nothing to finish",
                              f"run `.venv/bin/python scripts/migrate.py start --stack {stack} --to <region>` to begin a move")
        return Ledger(tuple(replace(g, status=RETIRED) if g.status == DRAINING else g for g in self.generations))

    def as_config(self) -> list[dict]:
        return [g.as_config() for g in self.generations]
