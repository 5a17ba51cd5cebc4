"""The ``config:`` block of Pulumi.yaml, written from ``settings.SCHEMA``.

Run ``.venv/bin/python -m colocate.projectfile`` after changing SCHEMA; a test fails while
the two differ.

Object-valued keys (pod, worker, budgets, probe, zone) and the ledger carry a description
and a default but no ``type``. The CLI validates Pulumi.yaml against pulumi/pulumi's
``sdk/go/common/workspace/project.json``, whose ``simpleConfigType`` is the enum
string | integer | boolean | array (read at commits 0498be1 and 5351d86); ``type: object``
was proposed in pulumi/pulumi #20129 and documented for Pulumi YAML programs (pulumi/docs
#17846, #18971), but a CLI whose schema lacks it refuses the whole project file on every
command (pulumi/pulumi #11321), and ``type: array`` requires ``items``, which the ledger's
objects cannot be typed by. An untyped key is accepted by every CLI; the program validates.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ruamel.yaml import YAML

from .cell.settings import NS, SCHEMA
from .fleet.plan import FLEET_KEYS

# The types project.json's simpleConfigType accepts and the kit declares ("array" needs
# `items`, which the ledger's objects cannot be described by, so it is left untyped too).
DECLARED_TYPES = ("string", "integer", "boolean")

PROJECT_FILE = Path(__file__).resolve().parent.parent / "Pulumi.yaml"


def declared() -> dict:
    out = {}
    for key in SCHEMA:
        entry: dict = {}
        if key.type in DECLARED_TYPES:
            entry["type"] = key.type
        entry["description"] = key.description
        if key.secret:
            entry["secret"] = True
        if key.default is not None:
            entry["default"] = key.default
        elif key.name not in FLEET_KEYS:
            # The CLI demands every project key without a default from every stack ("Stack
            # 'fleet' is missing configuration values ...", pulumi/pulumi workspace mergeConfig),
            # a fleet stack included. So a cell's required keys default to empty here and the
            # program requires them (settings.parse). The CLI also refuses a `secret: true` key
            # whose default is plain, so those lose the flag: the program refuses a plain-text
            # value instead (infra/program.py).
            entry["default"] = [] if key.type == "array" else ""
            entry.pop("secret", None)
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
