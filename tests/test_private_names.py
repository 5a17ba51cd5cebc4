"""No `_private` name of the kit crosses a module: what another module uses is public.
Checked with ast over the package, the scripts, infra, bench and the tests: a
`from x import _name`, and a `module._name` on a module of the kit."""

import ast
from pathlib import Path

from tests.support import pysource

ROOT = Path(__file__).resolve().parent.parent
OURS = ("colocate", "infra", "bench", "scripts", "tests")


def module_of(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an import names (relative imports resolved from ``path``)."""
    if node.level == 0:
        return node.module or ""
    package = path.relative_to(ROOT).parent.parts
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def crossings(path: Path, source: str) -> list[str]:
    tree = pysource.parse(source)
    found, ours = [], set()  # names bound to the kit's own modules in this file
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and module_of(path, node).startswith(OURS):
            for a in node.names:
                if private(a.name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {module_of(path, node)} import {a.name}")
                ours.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            ours |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(OURS)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in ours):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_imported_across_modules():
    found = [hit for d in OURS for p in sorted((ROOT / d).rglob("*.py")) for hit in crossings(p, p.read_text())]
    assert not found, "make these public (or move them where they are used):\n" + "\n".join(found)


def test_the_check_sees_both_ways_of_reaching_a_private_name():
    here = ROOT / "colocate" / "sandbox" / "x.py"
    source = "from .statedir import _read, ok\nfrom colocate import plan\nimport sys\nplan._hidden\nsys._getframe\nok._fine\n"
    assert crossings(here, source) == ["colocate/sandbox/x.py:1: from colocate.sandbox.statedir import _read",
                                       "colocate/sandbox/x.py:4: plan._hidden", "colocate/sandbox/x.py:6: ok._fine"]
