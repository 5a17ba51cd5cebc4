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
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, BaseException) and c.__module__ == name]
    return found


ERRORS = defined_errors()


def test_the_walk_sees_the_errors_of_every_layer():
    assert {ConfigError, ProgramError, ScriptError, SandboxError} <= set(ERRORS)
    assert {c.__module__.split(".")[0] for c in ERRORS} == set(PACKAGES)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_error_sits_under_its_layers_base(cls):
    assert issubclass(cls, ColocateError), f"{cls.__module__}.{cls.__name__} is not a ColocateError"
    if cls in (ColocateError, *LAYER_BASES):
        return
    base = layer_base(cls.__module__)
    assert issubclass(cls, base), f"{cls.__module__}.{cls.__name__} belongs under {base.__name__}"
    assert [b for b in LAYER_BASES if issubclass(cls, b)] == [base], "one layer per error"


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_error_is_drawn_in_a_tree(cls):
    drawn = "\n".join(importlib.import_module(m).__doc__ for m in TREES)
    assert f" {cls.__name__} " in drawn, f"add {cls.__name__} to its layer's tree (colocate/errors.py names them)"


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
