"""A PNG of the per-segment latency distributions, for people who would rather look.

One box per segment with data (whiskers at 1.5 IQR, matplotlib's default),
every sample drawn over it as a jittered dot, the physical floor as a grey dotted tick and
each budget as a red dashed tick. The axis is logarithmic when the data spans more than
20x (a 2 ms ``state`` next to a 250 ms ``e2e``; symlog when some are 0), linear otherwise. Agg backend: no display.
"""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from .report import Result  # noqa: E402


def write(result: Result, path: str | Path) -> Path:
    """Write the PNG to ``path``; returns it. Segments without data are named in the caption."""
    path = Path(path)
    names = [n for n, v in result.values.items() if v]
    empty = [n for n, v in result.values.items() if not v]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2.5), 5.0), dpi=110)
    try:
        if names:
            data = [result.values[n] for n in names]
            ax.boxplot(data, tick_labels=names, showfliers=False, widths=0.5,
                       medianprops={"color": "tab:blue", "linewidth": 2})
            jitter = random.Random(0)  # fixed seed: the same run draws the same picture
            for i, vals in enumerate(data, start=1):
                xs = [i + jitter.uniform(-0.15, 0.15) for _ in vals]
                ax.scatter(xs, vals, s=10, alpha=0.6, color="tab:gray", zorder=3)
            positive = [v for vals in data for v in vals if v > 0]
            span = max(positive) / min(positive) if positive else 1
            labelled = set()
            for i, n in enumerate(names, start=1):
                floor = result.floors.get(n)
                if floor:
                    ax.hlines(floor, i - 0.35, i + 0.35, colors="dimgray", linestyles="dotted", linewidth=2,
                              label="_nolegend_" if "floor" in labelled else "physical floor", zorder=4)
                    labelled.add("floor")
                for b in result.budgets:
                    if b.segment == n:
                        ax.hlines(b.ms, i - 0.35, i + 0.35, colors="tab:red", linestyles="dashed", linewidth=2,
                                  label="_nolegend_" if "budget" in labelled else "budget", zorder=4)
                        ax.annotate(f"{b.ms:g} ({b.percentile})", (i + 0.37, b.ms), fontsize=7, color="tab:red",
                                    va="center")
                        labelled.add("budget")
            if span > 20:  # zeros (a fresh cached state) need symlog: linear below 1 ms
                zeros = any(v <= 0 for vals in data for v in vals)
                ax.set_yscale("symlog", linthresh=1.0) if zeros else ax.set_yscale("log")
            if labelled:  # below the axes, so it never hides a box or a budget line
                fig.legend(loc="lower right", ncol=2, fontsize=7, frameon=False)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel("milliseconds" + (" (log scale)" if ax.get_yscale() in ("log", "symlog") else ""))
        ax.grid(axis="y", alpha=0.3)
        title = ("OK: " if result.ok else "FAIL: ") + result.verdict
        ax.set_title(textwrap.fill(title, 130), fontsize=8)
        caption = f"{result.url} — {result.samples} samples per kind, one reused connection"
        if empty:
            caption += f"; no data: {', '.join(empty)}"
        fig.text(0.01, 0.01, caption, fontsize=7, color="dimgray")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
