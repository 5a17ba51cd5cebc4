"""The Worker's row shapes, read from their one declaration (worker/src/payloads.js).

A sync's counter rows, a fleet's exchange rows and a sync batch's usage, window and
in-flight rows are arrays; their columns are named once, in ``SHAPES`` of that file, and
Python reads the rows by the same names::

    from colocate.cell.payloads import COUNTER
    counts = view["counts"][key_id]
    counts[COUNTER["inflight"]]          # requests in flight in the other isolates
    COUNTER.record(counts)["req"]        # the same row as a dict
    WINDOW.row(key_id=k, minute=m, requests=1)  # a row to send, the other columns 0
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "worker" / "src" / "payloads.js"
_SHAPES_RE = re.compile(r"^export const SHAPES = /\*\* @type \{const\} \*/ \((\{.*?^\})\);$", re.M | re.S)


@dataclass(frozen=True)
class Shape:
    """One row shape: its columns in order, each with its meaning."""

    name: str
    columns: tuple[tuple[str, str], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.columns)

    def __getitem__(self, column: str) -> int:
        """The column's index; a KeyError names the shape and its columns."""
        try:
            return self.names.index(column)
        except ValueError:
            raise KeyError(f"{self.name} has no column {column!r} (it has {', '.join(self.names)})") from None

    def __len__(self) -> int:
        return len(self.columns)

    def row(self, **values: object) -> list:
        """A row from its columns by name, the others 0; an unknown name is refused."""
        for column in values:
            self[column]
        return [values.get(n, 0) for n in self.names]

    def record(self, row: Sequence) -> dict:
        """A row as {column: value}; a row of another length is refused, naming both."""
        if len(row) != len(self.columns):
            raise ValueError(f"a {self.name} row has {len(self.columns)} columns ({', '.join(self.names)}), "
                             f"got {len(row)}: {row!r}")
        return dict(zip(self.names, row, strict=True))


def load(source: Path = SOURCE) -> dict[str, Shape]:
    """Every shape declared in ``source`` (its ``SHAPES`` object is JSON)."""
    match = _SHAPES_RE.search(source.read_text())
    if match is None:
        raise ValueError(f"{source}: no `export const SHAPES = /** @type {{const}} */ ({{...}});` block (it must stay JSON)")
    raw = json.loads(match.group(1))
    return {name: Shape(name, tuple((c, meaning) for c, meaning in cols)) for name, cols in raw.items()}


SHAPES = load()
COUNTER = SHAPES["counter"]
EXCHANGE = SHAPES["exchange"]
USAGE = SHAPES["usage"]
WINDOW = SHAPES["window"]
INFLIGHT = SHAPES["inflight"]
HIST = SHAPES["hist"]
