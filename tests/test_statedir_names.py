"""colocate/sandbox/statedir.py names every file of a state directory; no other module of
colocate/ or scripts/ spells one (a renamed file is then one edit, and a reader and its writer
cannot disagree on a name)."""

import ast
from pathlib import Path

from colocate.sandbox import statedir
from tests.support import pysource

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("colocate", "scripts")
OWNER = ROOT / "colocate" / "sandbox" / "statedir.py"
# Modules with a directory of their own that is no state directory: workerd's temporary one,
# the local pod provider's, the repository's stacks/.
NOT_STATE_DIRS = {ROOT / "colocate" / "workerd.py", ROOT / "colocate" / "pods" / "local.py", ROOT / "colocate" / "stackfile.py"}
NAMES = {v for k, v in vars(statedir).items() if k.endswith(("_FILE", "_DIR")) and isinstance(v, str)}
SUFFIXES = (".json", ".log", ".lock", ".capnp", ".pid", ".png")


def spelled_names(path: Path, source: str) -> list[str]:
    """``path:line: name`` for each state-directory name written as a literal: a file name
    anywhere (or one ending in a state file's suffix under colocate/sandbox and scripts), a
    directory name as the right side of ``/``."""
    strict = path.is_relative_to(ROOT / "colocate" / "sandbox") or path.is_relative_to(ROOT / "scripts")
    found, seen = [], set()
    for node in ast.walk(pysource.parse(source, str(path))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            seen.add(id(node.right))
            if node.right.value in NAMES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: / {node.right.value!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in seen:
            v = node.value
            if ("." in v and v in NAMES) or (strict and v.endswith(SUFFIXES) and v not in (".json", ".log")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {v!r}")
    return found


def test_no_module_but_statedir_spells_a_state_directory_file():
    found = [hit for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))
             if p != OWNER and p not in NOT_STATE_DIRS for hit in spelled_names(p, p.read_text())]
    assert not found, "use the names in colocate/sandbox/statedir.py:\n" + "\n".join(found)


def test_the_check_sees_a_file_a_directory_and_an_unlisted_file():
    source = 'a = d / "ready.json"\nb = d / "logs" / x\nc = {"logs": 1}\ne = "new-thing.json"\n'
    hits = spelled_names(ROOT / "scripts" / "x.py", source)
    assert sorted(h.split(": ", 1)[1] for h in hits) == ["'new-thing.json'", "/ 'logs'", "/ 'ready.json'"]
    assert spelled_names(ROOT / "colocate" / "geo.py", 'p = "colos.json"\nq = {"pods": 1}\n') == []


def test_the_docstring_lists_every_name():
    for name in NAMES - {statedir.STARTED_DIR}:
        assert name in statedir.__doc__, f"{name} is missing from statedir's docstring"
