"""Reading and editing ``stacks/Pulumi.<stack>.yaml`` without the Pulumi CLI.

Scripts (sandbox, migrate, probe) read a stack's ``colocate:*`` values from its file.
Edits go through ruamel.yaml's round-trip mode so comments and key order survive,
and are written atomically: a failed edit leaves the file byte-identical.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cell.settings import NS
from .errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
STACKS_DIR = ROOT / "stacks"

# ruamel.yaml is imported where a stack file is read or written: pod.py and the sandbox's
# `down` import this module for its paths only.
if TYPE_CHECKING:
    from ruamel.yaml import YAML


def _yaml() -> YAML:
    from ruamel.yaml import YAML

    y = YAML()  # round-trip: keeps comments, order and quoting
    y.preserve_quotes = True
    y.indent(mapping=2, sequence=4, offset=2)
    y.width = 4096
    return y


def path_of(stack: str, stacks_dir: Path = STACKS_DIR) -> Path:
    return Path(stacks_dir) / f"Pulumi.{stack}.yaml"


def load_document(stack: str, stacks_dir: Path = STACKS_DIR) -> Any:
    path = path_of(stack, stacks_dir)
    if not path.exists():
        known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in Path(stacks_dir).glob("Pulumi.*.yaml"))
        raise ConfigError("--stack", stack, f"no stack file {path}", f"use one of: {', '.join(known) or '(none)'}")
    doc = _yaml().load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise ConfigError("--stack", stack, f"{path} has no config: mapping", "start from stacks/Pulumi.us-east.yaml")
    return doc


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_config(stack: str, stacks_dir: Path = STACKS_DIR) -> tuple[dict, frozenset[str]]:
    """The stack's ``colocate:*`` values as plain Python (namespace stripped) and the
    names of the keys stored as secrets (``secure:`` values, never decrypted here)."""
    config = load_document(stack, stacks_dir)["config"]
    raw, secrets = {}, set()
    for key, value in config.items():
        if not str(key).startswith(NS + ":"):
            continue
        name = str(key)[len(NS) + 1:]
        if isinstance(value, dict) and set(value) == {"secure"}:
            secrets.add(name)
        else:
            raw[name] = _plain(value)
    return raw, frozenset(secrets)


def write_config(stack: str, updates: dict[str, Any], stacks_dir: Path = STACKS_DIR) -> None:
    """Set ``colocate:<name>`` values (``name`` may be ``pod.provider`` for a nested key),
    keeping every other key, comment and the key order as they were."""
    path = path_of(stack, stacks_dir)
    doc = load_document(stack, stacks_dir)
    config = doc["config"]
    for name, value in updates.items():
        top, _, sub = name.partition(".")
        key = f"{NS}:{top}"
        if sub:
            if not isinstance(config.get(key), dict):
                config[key] = {}
            config[key][sub] = value
        elif key in config and isinstance(value, list) and isinstance(config[key], list):
            _replace_list(config[key], value)
        else:
            config[key] = value
    buf = io.StringIO()
    _yaml().dump(doc, buf)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(buf.getvalue())
        os.replace(tmp, path)  # atomic: the file is either old or new, never half-written
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _replace_list(target: list, new: list) -> None:
    # Update entries in place so comments attached to existing entries stay put.
    for i, item in enumerate(new):
        if i < len(target) and isinstance(target[i], dict) and isinstance(item, dict):
            for k in [k for k in target[i] if k not in item]:
                del target[i][k]
            for k, v in item.items():
                target[i][k] = v
        elif i < len(target):
            target[i] = item
        else:
            target.append(item)
    del target[len(new):]
