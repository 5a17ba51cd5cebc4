"""docs/configuration.md gives every key of colocate/cell/settings.py with its true default.

The table is parsed as a reader sees it: a row names one key or several (`colocate:pod.gpu` /
`.gpuCount`), and its default column gives one default per key, separated by " / " (or one for
all). A default is a backticked literal (read as YAML: `{rpm: 3000}`, `[]`, `"12.9"`, `auto`), a
bare number or `true`/`false`, or a word: `required` and `none` (nothing is set), `empty` (the
empty text). Objects whose fields are listed in the row rather than one a row (keys.defaults,
budgets, scale, fleet) give their defaults as one `{field: value}` literal.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from colocate.cell import settings
from colocate.fleet.plan import FLEET_DEFAULTS

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
# Objects documented one row per field: colocate:<object>.<field>.
FIELD_ROWS = {"pod": settings.POD_DEFAULTS, "worker": settings.WORKER_DEFAULTS, "probe": settings.PROBE_DEFAULTS}
# Objects documented in one row whose default column holds a {field: value} literal of all their defaults
# (scale: the defaults once it is set; `pods` and `draining` are written by scripts/scale.py, named in the row).
MAPPING_ROWS = {"keys.defaults": settings.KEY_LIMIT_DEFAULTS, "budgets": settings.BUDGET_DEFAULTS,
                "scale": settings.SCALE_DEFAULTS, "fleet": FLEET_DEFAULTS}
WRITTEN_BY_THE_KIT = {"scale": ("pods", "draining")}
# Objects without defaults of their own: the row names each field.
NAMED_FIELDS = {"zone": settings.ZONE_FIELDS, "fallbackCap": settings.FALLBACK_CAP_FIELDS,
                "fallbackPrice": ("input", "output")}
# An empty default that stands for something the doc states instead.
DERIVED = {"worker.name": "colocate-<stack>"}
NOTHING = object()  # `required` or `none`: no value unless the stack sets one
_yaml = YAML(typ="safe")


def _value(text: str):
    text = text.strip()
    literal = re.match(r"`([^`]*)`", text)
    if literal:
        return _yaml.load(literal.group(1))
    word = re.match(r"[^\s;,(]+", text)
    token = word.group(0) if word else ""
    if token in ("required", "required:", "none"):
        return NOTHING
    if token == "empty":
        return ""
    return _yaml.load(token)


def rows(doc: str) -> dict[str, tuple[object, str]]:
    """Every key the table of "Every key" names: {dotted key: (its default, the row's text)}."""
    section = doc.split("## Every key", 1)[1].split("\n## ", 1)[0]
    out: dict[str, tuple[object, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`colocate:"):
            continue
        names, parent = [], ""
        for part in cells[0].split(" / "):
            name = part.strip().strip("`")
            if name.startswith("."):
                name = parent + name
            else:
                name = name.removeprefix("colocate:")
                parent = name.rsplit(".", 1)[0] if "." in name else name
            names.append(name)
        defaults = cells[2].split(" / ")
        if len(defaults) != len(names):
            defaults = [cells[2]] * len(names)
        for name, default in zip(names, defaults, strict=True):
            assert name not in out, f"configuration.md names colocate:{name} twice"
            out[name] = (default, line)
    return out


def mapping_in(text: str) -> dict:
    found = re.search(r"`(\{[^`]*\})`", text)
    assert found, f"expected a `{{field: value}}` literal of the defaults in {text!r}"
    return _yaml.load(found.group(1))


def expected_keys() -> set[str]:
    out: set[str] = set()
    for key in settings.SCHEMA:
        if key.name in FIELD_ROWS:
            out |= {f"{key.name}.{f}" for f in FIELD_ROWS[key.name]}
        elif key.name == "keys":
            out.add("keys.defaults")
        else:
            out.add(key.name)
    return out


DOCUMENTED = rows(DOC.read_text())


def test_the_table_names_every_key_of_the_settings_and_no_other():
    documented, expected = set(DOCUMENTED), expected_keys()
    assert not expected - documented, f"keys without a line in docs/configuration.md: {sorted(expected - documented)}"
    assert not documented - expected, f"lines for keys the settings do not have: {sorted(documented - expected)}"


@pytest.mark.parametrize("name", sorted(k for k in expected_keys() if k.split(".")[0] in FIELD_ROWS))
def test_each_field_of_pod_worker_and_probe_has_its_true_default(name):
    default, _ = DOCUMENTED[name]
    obj, field = name.split(".", 1)
    want = DERIVED.get(name, FIELD_ROWS[obj][field])
    got = _value(default)
    assert got == want and type(got) is type(want) or (isinstance(want, float) and got == want), (
        f"docs/configuration.md gives colocate:{name} the default {default!r}; the settings say {want!r}")


@pytest.mark.parametrize("name", sorted(MAPPING_ROWS))
def test_objects_listed_in_one_row_give_every_fields_default(name):
    default, line = DOCUMENTED[name]
    got = mapping_in(default)
    want = {k: v for k, v in MAPPING_ROWS[name].items() if k not in WRITTEN_BY_THE_KIT.get(name, ())}
    assert got == want, f"colocate:{name}: docs/configuration.md says {got}, the settings {want}"
    for field in WRITTEN_BY_THE_KIT.get(name, ()):
        assert f"`{field}`" in line, f"colocate:{name}.{field} is not named in its row"


@pytest.mark.parametrize("name", sorted(NAMED_FIELDS))
def test_objects_without_defaults_name_each_field(name):
    _, line = DOCUMENTED[name]
    missing = [f for f in NAMED_FIELDS[name] if not re.search(rf"\b{f}\b", line)]
    assert not missing, f"colocate:{name}'s row does not name {missing}"


@pytest.mark.parametrize("key", [k for k in settings.SCHEMA if k.name not in FIELD_ROWS and k.name != "keys"
                                 and k.name not in MAPPING_ROWS], ids=lambda k: k.name)
def test_every_other_key_has_its_true_default(key):
    default, _ = DOCUMENTED[key.name]
    got = _value(default)
    if key.default is None or key.default == {}:  # nothing set: required, or an optional object
        assert got is NOTHING, f"colocate:{key.name}: documented default {default!r}, the settings have none"
    else:
        assert got == key.default, f"colocate:{key.name}: documented default {default!r}, the settings say {key.default!r}"


def test_the_parser_reads_what_a_reader_reads():
    doc = ("## Every key\n| key | kind | default | what |\n| --- | --- | --- | --- |\n"
           "| `colocate:pod.gpu` / `.gpuCount` | s / i | `NVIDIA X` (on `vastai`: `X`) / 1 | a |\n"
           "| `colocate:readToken` / `colocate:adminToken` | secret | required | b |\n"
           "| `colocate:budgets` | object | `{state: 25}` | c |\n## Stack outputs\n| `colocate:no` | x | 1 | d |\n")
    got = rows(doc)
    assert set(got) == {"pod.gpu", "pod.gpuCount", "readToken", "adminToken", "budgets"}
    assert [_value(got[k][0]) for k in ("pod.gpu", "pod.gpuCount")] == ["NVIDIA X", 1]
    assert _value(got["readToken"][0]) is NOTHING and _value("empty") == "" and _value("`[]`") == []
    assert _value('`"12.9"`') == "12.9" and _value("0.8") == 0.8 and _value("false") is False
    assert mapping_in(got["budgets"][0]) == {"state": 25}
