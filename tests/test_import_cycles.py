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


# --- layers: catalogue and pure plan, then declarations (infra/), then runtime; imports one way ---

# The pure layer: plans and policies, no I/O beyond reading the kit's own files (the stack files a
# fleet's plan reads its cells from, the catalogue's data) and preflight's one injectable HTTP GET.
# colocate.pods' profiles, base and errors are what the cell and the keeper plan from.
PURE = ("colocate.cell", "colocate.fleet.plan", "colocate.scaling.policy", "colocate.scaling.day",
        "colocate.scaling.cost", "colocate.scaling.keeper", "colocate.errors", "colocate.cli", "colocate.stackfile",
        "colocate.pods.profiles", "colocate.pods.base", "colocate.pods.errors")
# What infra/ may import of the kit besides the pure layer: the pod hop's TLS names and the Worker's
# scale endpoints (the count every `up` applies); neither runs anything.
DECLARABLE = (*PURE, "colocate.pods.podtls", "colocate.scaling.signals")
RUNTIME_LIBS = ("pulumi", "pulumi_cloudflare", "pulumi_tls", "pulumi_command", "pulumiverse_acme", "requests",
                "subprocess")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return name == "colocate" or any(name == p or name.startswith(p + ".") for p in prefixes)


def imports_with_lines(package: Path) -> dict[str, list[tuple[str, int, str]]]:
    """Each module of ``package`` -> (file, line, imported module) for every import, the kit's and others'."""
    out: dict[str, list[tuple[str, int, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        name = _module_name(path, package)
        is_pkg = path.name == "__init__.py"
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        found: list[tuple[str, int, str]] = []
        for node in ast.walk(pysource.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(rel, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                found.append((rel, node.lineno, origin))
                found += [(rel, node.lineno, f"{origin}.{a.name}") for a in node.names if origin in ("colocate", )
                          or origin.startswith("colocate.")]
        out[name] = found
    return out


def layer_violations(imports: dict[str, list[tuple[str, int, str]]], modules: tuple[str, ...],
                     allowed: tuple[str, ...], known: set[str]) -> list[str]:
    """``file:line imports X`` for each import of a module in ``modules`` that leaves ``allowed`` (the
    kit's modules, ``known``) or names a runtime library."""
    bad = []
    for name, found in imports.items():
        if not _within(name, modules):
            continue
        deeper = {(rel, line, t.rpartition(".")[0]) for rel, line, t in found if t in known}
        for rel, line, target in found:
            if (rel, line, target) in deeper:
                continue  # `from pkg import module`: the module is what is imported
            top = target.split(".")[0]
            if top in RUNTIME_LIBS or (target in known and not _within(target, allowed)):
                bad.append(f"{rel}:{line} imports {target}")
    return sorted(set(bad))


def test_the_layer_checker_names_the_file_and_the_import(tmp_path):
    pkg = tmp_path / "colocate"
    (pkg / "cell").mkdir(parents=True)
    (pkg / "sandbox").mkdir()
    for init in (pkg / "__init__.py", pkg / "cell" / "__init__.py", pkg / "sandbox" / "__init__.py"):
        init.write_text("")
    (pkg / "sandbox" / "runner.py").write_text("import subprocess\n")
    (pkg / "cell" / "plan.py").write_text("import json\n\ndef f():\n    from ..sandbox import runner\n")
    imports = imports_with_lines(pkg)
    found = layer_violations(imports, ("colocate.cell",), PURE, set(imports))
    assert [v.split(" imports ")[1] for v in found] == ["colocate.sandbox.runner"] and found[0].endswith(":4 imports "
                                                                                                         "colocate.sandbox.runner")
    (pkg / "cell" / "plan.py").write_text("import pulumi\n")
    assert layer_violations(imports_with_lines(pkg), ("colocate.cell",), PURE, set(imports))[0].endswith(":1 imports pulumi")


def test_imports_run_one_way_from_the_pure_plan_to_declarations_to_runtime():
    imports = {k: v for p in PACKAGES for k, v in imports_with_lines(ROOT / p).items()}
    known = set(imports)
    assert "colocate.cell.plan" in known and "colocate.fleet.plan" in known and "colocate.scaling.policy" in known
    # the pure layer imports no Pulumi, no requests, no subprocess, and nothing of the kit above it
    pure = layer_violations(imports, PURE, PURE, known)
    assert not pure, "the pure layer imports above itself:\n" + "\n".join(pure)
    # declarations (infra/) import the pure layer and nothing that runs (sandbox, probe, scripts, controllers)
    infra = [v for v in layer_violations(imports, ("infra",), (*DECLARABLE, "infra"), known)
             if not v.split(" imports ")[1].startswith("pulumi")]
    assert not infra, "infra/ imports the runtime:\n" + "\n".join(infra)
    # the kit imports none of its consumers
    up = [f"{rel}:{line} imports {t}" for name, found in imports.items() if name.startswith("colocate")
          for rel, line, t in found if t.split(".")[0] in ("infra", "scripts", "bench", "tests")]
    assert not up, "colocate/ imports a consumer:\n" + "\n".join(up)
    # colocate/'s top level: packages by concern and a handful of shared modules
    top = sorted(p.stem for p in (ROOT / "colocate").glob("*.py") if p.stem != "__init__")
    assert top == ["admin", "cli", "errors", "projectfile", "stackfile", "workerd"], top
