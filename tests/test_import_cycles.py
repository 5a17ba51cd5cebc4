"""No import cycle anywhere in the project (colocate, infra, bench, scripts, tests), counting
imports made inside functions too (a lazy import is still a cycle: it only moves the failure
to the first call that takes it). Benchmarks do not depend on tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import pysource

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("colocate", "infra", "bench", "scripts", "tests")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(*packages: Path) -> dict[str, set[str]]:
    """Each module of ``packages`` -> the modules of ``packages`` it imports, anywhere in its body."""
    files = {_module_name(p, package): p for package in packages for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(pysource.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets.add(origin)
                targets.update(f"{origin}.{a.name}" for a in node.names)  # `from pkg import module`
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first == last), or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def test_the_checker_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "admin.py").write_text("def f():\n    from .sub.supervisor import x\n")
    (pkg / "sub" / "supervisor.py").write_text("def g():\n    from ..admin import f\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.admin", "pkg.sub.supervisor", "pkg.admin"]
    (pkg / "sub" / "statedir.py").write_text("x = 1\n")
    (pkg / "admin.py").write_text("from .sub import statedir\n")
    assert find_cycle(import_graph(pkg)) is None


def test_the_project_has_no_import_cycle_and_benches_do_not_import_tests():
    graph = import_graph(*(ROOT / p for p in PACKAGES))
    assert "colocate.sandbox.statedir" in graph["colocate.admin"]  # the graph sees each package's imports
    assert "infra.stackconfig" in graph["infra.fleet"] and "infra.fleet" in graph["infra.program"]
    assert "bench.harness" in graph["bench.fleet_exchange"]  # the graph sees infra/ and bench/
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    for name, targets in graph.items():
        if name.startswith(("bench.", "colocate.", "infra.", "scripts.")):
            assert not [t for t in targets if t.startswith("tests")], f"{name} imports tests: {sorted(targets)}"


def test_admin_and_the_supervisor_import_alone_without_each_other():
    # Each in a fresh interpreter: neither pulls the other in. The runner runs as the supervisor's
    # __main__, so its importing colocate.sandbox.supervisor would load a second copy of it.
    for first, absent in (("colocate.admin", "colocate.sandbox.supervisor"),
                          ("colocate.sandbox.supervisor", "colocate.admin"),
                          ("colocate.sandbox.runner", "colocate.sandbox.supervisor")):
        code = (f"import sys, {first}; "
                f"assert {absent!r} not in sys.modules, sorted(m for m in sys.modules if m.startswith('colocate'))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"import {first}: {proc.stderr}"
