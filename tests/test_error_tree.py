"""The kit's errors form one tree (colocate/errors.py): every exception class the kit defines
sits under its layer's base, is drawn in a docstring tree, and the scripts return the exit
code the class declares (2 for bad input, naming the field)."""

import importlib
import inspect
import io
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from colocate import admin
from colocate.errors import ColocateError, ConfigError, ScriptError
from colocate.sandbox.errors import SandboxError
from infra.errors import ProgramError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("colocate", "infra", "scripts", "bench")
# The modules whose docstring draws (a part of) the tree.
TREES = ("colocate.errors", "infra.errors", "colocate.pods.errors", "colocate.probe.errors",
         "colocate.sandbox.errors", "colocate.admin")
LAYER_BASES = (ConfigError, ProgramError, ScriptError, SandboxError)


def layer_base(module: str) -> type:
    """The base every error defined in ``module`` must have."""
    if module.startswith("infra."):
        return ProgramError
    if module.startswith("colocate.sandbox.") or module in ("colocate.workerd", "scripts.sandbox"):
        return SandboxError
    if module == "colocate.errors":
        return ConfigError
    return ScriptError


def module_names() -> list[str]:
    """Every module of the kit (a Pulumi ``__main__`` aside, which runs the program when imported)."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] != "__main__":
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def defined_errors() -> list[type]:
    found = []
    for name in module_names():
        module = importlib.import_module(name)
        # Errors only: an interrupt (a KeyboardInterrupt carrying what it cut short) is not one,
        # as Python's own tree puts it outside Exception.
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, Exception) and c.__module__ == name]
    return found


@pytest.fixture(scope="module")
def errors() -> list[type]:
    # Imported when the tests run, not when they are collected: the walk imports the Pulumi
    # program (pulumi_cloudflare, seconds) and every pytest worker collects every file.
    return defined_errors()


def test_the_walk_sees_the_errors_of_every_layer(errors):
    assert {ConfigError, ProgramError, ScriptError, SandboxError} <= set(errors)
    assert {c.__module__.split(".")[0] for c in errors} == set(PACKAGES)


def misplaced(cls: type) -> str | None:
    """Why ``cls`` is not where its layer's errors belong, or None."""
    name = f"{cls.__module__}.{cls.__name__}"
    if not issubclass(cls, ColocateError):
        return f"{name} is not a ColocateError"
    if cls in (ColocateError, *LAYER_BASES):
        return None
    base = layer_base(cls.__module__)
    if not issubclass(cls, base):
        return f"{name} belongs under {base.__name__}"
    if [b for b in LAYER_BASES if issubclass(cls, b)] != [base]:
        return f"{name}: one layer per error"
    return None


def test_every_error_sits_under_its_layers_base(errors):
    wrong = [why for cls in errors if (why := misplaced(cls))]
    assert not wrong, wrong


def test_every_error_is_drawn_in_a_tree(errors):
    drawn = "\n".join(importlib.import_module(m).__doc__ for m in TREES)
    missing = [f"{c.__module__}.{c.__name__}" for c in errors if f" {c.__name__} " not in drawn]
    assert not missing, f"add these to their layer's tree (colocate/errors.py names them): {missing}"


def test_a_misplaced_or_undrawn_error_is_named():
    class Stray(Exception):
        pass

    Stray.__module__ = "colocate.nowhere"
    assert misplaced(Stray) == "colocate.nowhere.Stray is not a ColocateError"
    assert misplaced(ConfigError) is None


def test_the_exit_code_is_2_for_bad_input_and_1_for_a_failure_of_the_world():
    from colocate.pods.errors import PodConfigError, RetryableError
    from colocate.probe.errors import Unreachable

    assert ConfigError("k", 1, "bad", "fix").exit_code == 2
    assert PodConfigError("x").exit_code == 2 and RetryableError("x").exit_code == 1
    assert SandboxError("x").exit_code == 2 and Unreachable("x").exit_code == 2
    # A refusal of what was asked (no such key) is an answer; bad input or a failing Worker is not.
    assert [admin.Refused(s, "c", "m").exit_code for s in (404, 409, 400, 401, 503)] == [1, 1, 2, 2, 2]


def run_main(module: str, argv: list[str], monkeypatch, stdin: str = "") -> tuple[int, str]:
    main = importlib.import_module(module).main
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


# One bad input per script; each message names the field (or variable) and says how to fix it.
BAD_INPUT = [
    ("scripts.probe", ["ftp://cell"], "URL", {}),
    ("scripts.cost", ["--since", "1y", "--url", "https://cell.example"], "--since", {}),
    ("scripts.scale", ["run", "--stack", "dev", "--interval", "0"], "--interval", {}),
    ("scripts.placement", ["apply", "--account", "a", "--script", "s"], "CLOUDFLARE_API_TOKEN", {}),
    ("scripts.keys", ["sync", "--stack", "nosuch"], "nosuch", {}),
    ("scripts.pod", ["delete"], "pod.py", {}),
    ("scripts.sandbox", ["up", "--stack", "nosuch-stack"], "nosuch-stack", {}),
]


@pytest.mark.parametrize("module,argv,named,env", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_every_scripts_bad_input_exits_2_naming_the_field(module, argv, named, env, monkeypatch, tmp_path):
    monkeypatch.delenv("CLOUDFLARE_API_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    code, err = run_main(module, argv, monkeypatch)
    assert code == 2, err
    assert named in err, err
