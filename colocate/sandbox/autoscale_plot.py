"""``demo-autoscale``'s picture, over the day's UTC hours: each cell's traffic (requests per
minute of the day, by who served them), its pods running and booting, and the fleet's
cumulative cost three ways (fixed pods, API only, autoscaled). Agg backend: no display."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ..scaling import day as day
from .demo_plot import plt

COLOURS = {"pod": "tab:blue", "cell": "tab:purple", "fallback": "tab:orange"}
LABELS = {"pod": "its own pods", "cell": "another cell's pod", "fallback": "the fallback API"}
BIN_H = 0.5


def _binned(served: Sequence[day.Served], cell: str, per: int) -> dict[str, list[float]]:
    """Requests per minute of the day, by who served them, in BIN_H bins."""
    n = int(day.HOURS / BIN_H)
    out = {k: [0.0] * n for k in COLOURS}
    for s in served:
        k = s.by()
        if s.home == cell and k is not None:
            out[k][min(n - 1, int(s.at_h / BIN_H))] += per / (BIN_H * 60)
    return out


def _steps(points: Sequence[tuple[float, int, int]]) -> tuple[list[float], list[int], list[int]]:
    ts, running, booting = [], [], []
    for t, r, b in sorted(points, key=lambda p: p[0]):
        ts.append(t)
        running.append(r)
        booting.append(r + b)
    ts.append(day.HOURS)
    running.append(running[-1] if running else 0)
    booting.append(booting[-1] if booting else 0)
    return ts, running, booting


def _cumulative(served: Sequence[day.Served], existing: Mapping[str, Sequence[tuple[float, int]]], prices: day.Prices,
                per: int, cells: int, max_pods: int) -> tuple[list[float], dict[str, list[float]]]:
    hours = [i * 0.1 for i in range(int(day.HOURS * 10) + 1)]
    fixed = [cells * max_pods * prices.pod_per_hr * h for h in hours]
    api, auto = [], []
    for h in hours:
        before = [s for s in served if s.at_h <= h]
        api.append(prices.api(sum(s.tokens for s in before) * per))
        fb = prices.api(sum(s.tokens for s in before if s.by() == "fallback") * per)
        auto.append(fb + sum(day.pod_hours(e, h) for e in existing.values()) * prices.pod_per_hr)
    return hours, {"fixed max pods": fixed, "API only": api, "autoscaled": auto}


def draw(path: Path, shape: dict[str, tuple[float, ...]], offsets: dict[str, int], served: Sequence[day.Served],
         shown: Mapping[str, Sequence[tuple[float, int, int]]], existing: Mapping[str, Sequence[tuple[float, int]]],
         prices: day.Prices, per: int, max_pods: int, out: dict) -> Path:
    cells = list(shape)
    fig, axes = plt.subplots(len(cells) + 1, 1, figsize=(11.0, 2.4 * (len(cells) + 1)), dpi=100, sharex=True)
    try:
        for ax, cell in zip(axes, cells, strict=False):
            binned = _binned(served, cell, per)
            xs = [i * BIN_H for i in range(len(binned["pod"]))]
            bottom = [0.0] * len(xs)
            for k, colour in COLOURS.items():
                ax.bar(xs, binned[k], BIN_H, bottom=bottom, align="edge", color=colour, alpha=0.75, label=LABELS[k])
                bottom = [b + v for b, v in zip(bottom, binned[k], strict=True)]
            ax.plot([h + 0.5 for h in range(day.HOURS)],
                    [shape[cell][day.local_hour(h, offsets[cell])] for h in range(day.HOURS)], color="black", lw=1,
                    label="the day's shape")
            ax.set_ylabel("req/min", fontsize=8)
            c = out["cells"][cell]["cost"]
            ax.set_title(f"{cell} (UTC{offsets[cell]:+d}): fixed ${c['fixed']:.2f}, API only ${c['api']:.2f}, "
                         f"autoscaled ${c['autoscaled']:.2f}", fontsize=9, loc="left")
            pods = ax.twinx()
            ts, running, booting = _steps(shown.get(cell, ()))
            pods.step(ts, booting, where="post", color="tab:red", lw=1, ls="--", label="pods running + booting")
            pods.step(ts, running, where="post", color="tab:green", lw=2, label="pods running")
            pods.set_ylim(0, max_pods + 0.5)
            pods.set_yticks(range(max_pods + 1))
            pods.set_ylabel("pods", fontsize=8)
            if cell == cells[0]:
                h1, l1 = ax.get_legend_handles_labels()
                h2, l2 = pods.get_legend_handles_labels()
                ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", ncol=3)
        ax = axes[-1]
        hours, series = _cumulative(served, existing, prices, per, len(cells), max_pods)
        for (name, ys), colour in zip(series.items(), ("tab:gray", "tab:orange", "tab:blue"), strict=True):
            ax.plot(hours, ys, label=f"{name} ${ys[-1]:.2f}", color=colour, lw=2)
        ax.set_ylabel("$ so far", fontsize=8)
        ax.set_xlabel("hour of the day (UTC)")
        ax.set_title("The fleet's cost over the day", fontsize=9, loc="left")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_xlim(0, day.HOURS)
        ax.set_xticks(range(0, day.HOURS + 1, 3))
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
