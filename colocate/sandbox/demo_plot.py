"""The demo's one picture: a bar per phase, the p50 e2e stacked by what it is made of.

Parts, bottom to top: the network between the user and the Worker (e2e p50 - total p50), the
Worker's wait on the state object (state), the pod's answer (upstream), the fallback, and the
Worker's other work. The deadline is a dashed line. Under each bar: the Worker <-> state round
trip (state_rtt), which the hot path hides from e2e when the state is far away, and the probe's
verdict; a phase whose probe failed is drawn with a red edge and red labels, so the picture shows
what is wrong even where e2e looks right. Agg backend: no display.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

PARTS = (("network (client to Worker)", "tab:gray"), ("state wait", "tab:red"), ("pod (upstream)", "tab:blue"),
         ("fallback", "tab:orange"), ("Worker, other", "tab:green"))


def stack(ax, bars: list[dict], parts: tuple[tuple[str, str], ...], label: str) -> list[float]:
    """Each bar's ``parts`` stacked (a part under 0.5 ms in every bar is left out), its ``e2e``
    written above it with ``label``; the stacks' heights. Shared with ``fleet_demo``'s plot."""
    xs = range(len(bars))
    bottoms = [0.0] * len(bars)
    for name, colour in parts:
        heights = [b[name] for b in bars]
        if not any(h > 0.5 for h in heights):
            continue
        ax.bar(xs, heights, 0.6, bottom=bottoms, label=name, color=colour)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, b in zip(xs, bars, strict=True):
        ax.annotate(label.format(b["e2e"]), (x, max(b["e2e"], bottoms[x])), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    return bottoms


def _tick(bar: dict) -> str:
    rtt = bar.get("state_rtt")
    lines = [bar["phase"]] + ([f"state_rtt {rtt:.0f} ms"] if rtt is not None else [])
    return "\n".join([*lines, bar.get("probe_says", "")]).rstrip()


def write(bars: list[dict], path: str | Path, deadline_ms: float, client_site: str) -> Path:
    path = Path(path)
    fig, ax = plt.subplots(figsize=(10.0, 6.4), dpi=110)
    try:
        xs = range(len(bars))
        bottoms = stack(ax, bars, PARTS, "e2e {:.0f} ms")
        for x, b in zip(xs, bars, strict=True):
            if not b.get("probe_ok", True):  # the split: its e2e may look fine, its probe does not
                ax.bar([x], [bottoms[x]], 0.6, fill=False, edgecolor="red", linewidth=2.5)
        if deadline_ms:
            ax.axhline(deadline_ms, color="black", linestyle="dashed", linewidth=1)
            ax.annotate(f"deadline {deadline_ms:.0f} ms", (len(bars) - 0.5, deadline_ms), ha="right", va="bottom",
                        fontsize=8)
        ax.set_xticks(list(xs), [_tick(b) for b in bars], fontsize=8)
        for label, b in zip(ax.get_xticklabels(), bars, strict=True):
            label.set_color("black" if b.get("probe_ok", True) else "red")
        ax.set_ylabel("milliseconds (p50 of each part)")
        ax.set_title(f"One user in {client_site}, one cell that moves: what each request is made of", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
        ax.set_ylim(0, max([*bottoms, *(b["e2e"] for b in bars), deadline_ms]) * 1.18 + 1)
        fig.text(0.01, 0.01, "1 everything in us-east; 2 compute in apac-tw, state left in IAD; 3 after the migration; "
                 "ttl0 = colocate:worker.stateTtlMs 0", fontsize=7, color="dimgray")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
