"""The ``config:`` block of Pulumi.yaml, written from ``settings.SCHEMA``.

Run ``python -m colocate.projectfile`` after changing SCHEMA; a test fails while the
two differ. Pulumi's project schema types only string, integer, boolean and array,
so object-valued keys carry a description and a default but no type.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ruamel.yaml import YAML

from .settings import NS, SCHEMA

PROJECT_FILE = Path(__file__).resolve().parent.parent / "Pulumi.yaml"


def declared() -> dict:
    out = {}
    for key in SCHEMA:
        entry: dict = {}
        if key.type in ("string", "integer", "boolean"):
            entry["type"] = key.type
        entry["description"] = key.description
        if key.secret:
            entry["secret"] = True
        if key.default is not None:
            entry["default"] = key.default
        out[f"{NS}:{key.name}"] = entry
    return out


def main() -> int:
    y = YAML()
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)
    doc = y.load(PROJECT_FILE.read_text())
    doc["config"] = declared()
    with PROJECT_FILE.open("w") as fh:
        y.dump(doc, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
