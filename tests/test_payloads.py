"""The row shapes declared once (worker/src/payloads.js): Python reads the Worker's own
declaration, every column a reader names in either language is declared, and a row of
another shape is refused naming the columns. The real writers and readers agree in
workerd: tests/test_generation_scale.py, the counters a routed request leaves."""

import json
import re
import subprocess

import pytest

from colocate.cell import payloads
from colocate.cell.payloads import COUNTER, EXCHANGE, SHAPES, USAGE
from tests.support.workerd import ROOT

SHAPE_NAMES = {"COUNTER": "counter", "EXCHANGE": "exchange", "USAGE": "usage", "WINDOW": "window", "INFLIGHT": "inflight",
               "BACKEND": "backend", "POD_INFLIGHT": "pod_inflight", "HIST": "hist"}
SHAPE_PROPERTIES = {"names", "columns", "length", "zero", "of"}


def test_python_reads_the_shapes_the_worker_declares():
    code = 'import("./worker/src/payloads.js").then((m) => console.log(JSON.stringify(m.SHAPES)))'
    out = subprocess.run(["node", "-e", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert {name: tuple(map(tuple, cols)) for name, cols in json.loads(out).items()} == {
        name: shape.columns for name, shape in SHAPES.items()}


def js_uses(text: str) -> set[tuple[str, str]]:
    """(shape, column) of every `SHAPE.column` in a Worker source, `const E = EXCHANGE` aliases included."""
    declared = re.findall(r"const (\w+) = (" + "|".join(SHAPE_NAMES) + r");", text)
    aliases = {**SHAPE_NAMES, **{a: SHAPE_NAMES[s] for a, s in declared}}
    return {(aliases[a], col) for a, col in re.findall(r"\b(" + "|".join(aliases) + r")\.(\w+)", text)
            if col not in SHAPE_PROPERTIES}


def test_every_column_a_reader_or_writer_names_is_declared():
    uses: dict[str, set[tuple[str, str]]] = {}
    for path in sorted((ROOT / "worker").glob("*/*.js")):
        uses[str(path.relative_to(ROOT))] = js_uses(path.read_text())
    for path in sorted(ROOT.glob("[cbst]*/**/*.py")):
        found = re.findall(r"\b(" + "|".join(SHAPE_NAMES) + r')\["(\w+)"\]', path.read_text())
        uses[str(path.relative_to(ROOT))] = {(SHAPE_NAMES[s], col) for s, col in found}
    unknown = {f"{where}: {shape}.{col}" for where, used in uses.items() for shape, col in used
               if col not in SHAPES[shape].names}
    assert not unknown, f"columns not declared in worker/src/payloads.js: {sorted(unknown)}"
    assert ("counter", "inflight") in uses["worker/src/router.js"]  # the scan sees what it checks
    assert js_uses("const E = EXCHANGE; x[E.mnth]; y[COUNTER.names]") == {("exchange", "mnth")}


def test_a_row_of_another_shape_is_refused_naming_the_columns():
    row = [7, 1, 10, 0, 0, 10, 0, 0, 0, 0, 0]
    assert COUNTER.record(row)["req"] == 1 and row[COUNTER["month_tokens"]] == 10
    with pytest.raises(ValueError, match=r"a counter row has 11 columns \(minute, req, tok, prev_req, prev_tok, month_tokens, "
                                         r"inflight, day_fallback_microusd, reserved, prompt_inflight, "
                                         r"fallback_reserved\), got 10"):
        COUNTER.record(row[:-1])
    misspelt = "requests"  # a window's column, not the exchange's
    with pytest.raises(KeyError, match="exchange has no column 'requests'"):
        EXCHANGE[misspelt]


def test_a_declaration_that_is_not_json_is_refused_naming_the_file(tmp_path):
    source = tmp_path / "payloads.js"
    source.write_text("export const SHAPES = /** @type {const} */ ({\n  counter: [],\n});\n")
    with pytest.raises(json.JSONDecodeError):
        payloads.load(source)
    source.write_text("export const SHAPES = makeShapes();\n")
    with pytest.raises(ValueError, match=r"payloads.js: no `export const SHAPES"):
        payloads.load(source)


def test_a_row_to_send_is_built_by_name():
    row = USAGE.row(day="2026-12-05", key_id="key_0123456789ab", requests=3)
    assert row == ["2026-12-05", "key_0123456789ab", 3, *[0] * (len(USAGE.names) - 3)]
    with pytest.raises(KeyError, match="usage has no column 'prompt'"):
        USAGE.row(prompt=1)
