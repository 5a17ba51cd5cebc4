"""demo-autoscale --json prints one JSON object whatever happens: the day's figures when the day
was measured (even if the plot or stopping the fleet fails afterwards), else {"error": why}. A run
of `--shape F --json` right after a plain one once exited with neither."""

from __future__ import annotations

import json

import pytest

from colocate.sandbox import autoscale_demo as demo_mod
from colocate.sandbox.errors import SandboxError

FIGURES = {"requests": 3, "failed": 0, "cost": {"fixed": 1.0, "api": 2.0, "autoscaled": 0.5},
           "served": {"pod": 3, "cell": 0, "fallback": 0},
           "cells": {c: {"cost": {"fixed": 1.0, "api": 2.0, "autoscaled": 0.5}, "peak_pod_share": 1.0,
                         "peak_p50_ms": 100.0, "budget_e2e_ms": 600.0} for c in demo_mod.CELLS}}


@pytest.fixture
def quiet_fleet(monkeypatch):
    """The demo without its processes: nothing started, nothing to stop."""
    monkeypatch.setattr(demo_mod.Demo, "fresh", lambda self: None)
    monkeypatch.setattr(demo_mod.Demo, "warm_up", lambda self: None)
    monkeypatch.setattr(demo_mod.Demo, "run_day", lambda self: None)
    monkeypatch.setattr(demo_mod.fleet, "down", lambda d: {})


def run_json(capsys, tmp_path):
    code = demo_mod.run(tmp_path, as_json=True)
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_a_day_measured_prints_its_json_though_the_plot_and_the_stop_fail(quiet_fleet, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo_mod.Demo, "up", lambda self: None)
    monkeypatch.setattr(demo_mod.Demo, "report", lambda self: dict(FIGURES))
    monkeypatch.setattr(demo_mod.Demo, "table", lambda self, out: "table")

    def no_plot(self, path, out):
        raise RuntimeError("no display")
    monkeypatch.setattr(demo_mod.Demo, "plot", no_plot)

    def stuck(d):
        raise OSError(39, "Directory not empty")
    monkeypatch.setattr(demo_mod.fleet, "down", stuck)
    code, doc, err = run_json(capsys, tmp_path)
    assert doc == FIGURES and code == 0
    assert "plot: not drawn (RuntimeError: no display)" in err and "could not be stopped" in err


def test_a_failure_after_the_day_still_prints_the_figures(quiet_fleet, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo_mod.Demo, "up", lambda self: None)
    monkeypatch.setattr(demo_mod.Demo, "report", lambda self: dict(FIGURES))

    def broken(self, out):
        raise KeyError("cells")
    monkeypatch.setattr(demo_mod.Demo, "table", broken)
    code, doc, err = run_json(capsys, tmp_path)
    assert doc == FIGURES and code == 1 and "KeyError" in err


def test_a_day_that_never_ran_prints_why_as_json(quiet_fleet, monkeypatch, capsys, tmp_path):
    def refused(self):
        raise SandboxError("warm-up request to apac-jp (http://127.0.0.1:1) failed for 30 s: HTTP 502: no pod")
    monkeypatch.setattr(demo_mod.Demo, "up", refused)
    code, doc, err = run_json(capsys, tmp_path)
    assert code == 2 and doc == {"error": "warm-up request to apac-jp (http://127.0.0.1:1) failed for 30 s: HTTP 502: no pod"}


def test_a_bad_shape_is_refused_with_a_json_error(capsys, tmp_path):
    code = demo_mod.run(tmp_path, shape_file=tmp_path / "missing.csv", as_json=True)
    out, err = capsys.readouterr()
    assert code == 2 and "--shape" in json.loads(out)["error"] and "Fix:" in err
