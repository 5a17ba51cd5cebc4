"""``make demo-fleet``: three cells behind one front door, users in Tokyo, Frankfurt and Virginia.

    1  home        each user is served by its nearest cell (NRT apac-jp, FRA eu-west, IAD us-east)
    2  pods lost   every pod of apac-jp is killed (SIGKILL): Tokyo is served by the next nearest
                   cell's pod, not the paid fallback API; beside it, what Tokyo pays with
                   apac-jp alone (no fleet): the same requests sent to apac-jp's own address,
                   which falls back to the emulated fallback API (measured, not computed)
    3  pods back   apac-jp's pods recreated the way the cell gets new pods: ``pod.renewal`` raised
                   by one in (a copy of) its stack file and the cell's ``apply`` (its
                   ``pulumi up -s apac-jp``), under Tokyo's traffic; Tokyo returns home

Every request of every phase, transitions included, is counted; the demo ends with the
number that failed (``0 failed``, else exit 1), a table and a PNG. It works on copies of the
stack files in its own state directory and always brings the fleet down at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import requests

from .. import stackfile
from ..cell.settings import POD_DEFAULTS
from ..errors import ConfigError
from . import fleet, supervisor
from .demo import say
from .errors import SandboxError
from .statedir import FLEET_DEMO_PLOT_FILE, READY_FILE, STACKS_DIR

FLEET = "fleet"
CELLS = ("apac-jp", "eu-west", "us-east")
SITES = ("NRT", "FRA", "IAD")
HOME = {"NRT": "apac-jp", "FRA": "eu-west", "IAD": "us-east"}
LOST = "apac-jp"  # the cell whose pods die
LOST_SITE = "NRT"
RETURN_WAIT_S = 60.0  # bounded: how long phase 3 waits for Tokyo to be served at home again
HOP_SAMPLES = 5  # per cell: the pod hop's pooled and new-connection checks after the story
# The fleet's stacks leave colocate:pod.model at its default: a pod answers any other name 404.
BODY = {"model": POD_DEFAULTS["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _timing(header: str | None) -> dict[str, float]:
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";dur=")
        try:
            out[name] = float(rest)
        except ValueError:
            continue
    return out


@dataclass
class Sample:
    ok: bool
    cell: str | None = None
    backend: str | None = None
    e2e: float = 0.0
    timing: dict = field(default_factory=dict)
    error: str | None = None


class Tally:
    """Every request the demo sends, by (phase, row)."""

    def __init__(self):
        self.rows: dict[tuple[str, str], list[Sample]] = {}
        self.lock = threading.Lock()

    def add(self, phase: str, row: str, s: Sample) -> None:
        with self.lock:
            self.rows.setdefault((phase, row), []).append(s)

    def all(self) -> list[Sample]:
        return [s for v in self.rows.values() for s in v]

    def failed(self) -> list[Sample]:
        return [s for s in self.all() if not s.ok]


def one(session: requests.Session, url: str, key: str) -> Sample:
    t = time.monotonic()
    try:
        r = session.post(url + "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"}, timeout=30)
        e2e = (time.monotonic() - t) * 1000
        if r.status_code != 200:
            return Sample(False, r.headers.get("x-colocate-cell"), r.headers.get("x-colocate-backend"), e2e,
                          error=f"{r.status_code} {r.text[:120]}")
        return Sample(True, r.headers.get("x-colocate-cell"), r.headers.get("x-colocate-backend"), e2e,
                      _timing(r.headers.get("server-timing")))
    except requests.RequestException as exc:
        return Sample(False, e2e=(time.monotonic() - t) * 1000, error=type(exc).__name__)


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Demo:
    def __init__(self, state_dir: Path, samples: int):
        self.state_dir = Path(state_dir).resolve()
        self.stacks_dir = self.state_dir / STACKS_DIR
        self.fleet_dir = self.state_dir / FLEET
        self.samples = samples
        self.tally = Tally()
        self.out: dict = {}
        self.sessions = {s: requests.Session() for s in SITES}

    def fresh(self) -> None:
        """Stop a previous demo's fleet and start from nothing (copies of the committed stacks)."""
        fleet.start_afresh(self.fleet_dir, self.state_dir, self.stacks_dir, FLEET, CELLS)

    def up(self) -> None:
        t0 = time.monotonic()
        self.out = fleet.up(FLEET, stacks_dir=self.stacks_dir, sandboxes_dir=self.state_dir, client_sites=SITES)
        cells = ", ".join(f"{c['name']} (Worker at {c['edge_site']})" for c in self.out["cells"])
        print(f"    up in {time.monotonic() - t0:.1f} s: {cells}; entries {', '.join(self.out['entries'])}; one client "
              f"key for the fleet ({self.out['key_id']})", flush=True)

    def load(self, phase: str, sites=SITES, n: int | None = None) -> None:
        """``n`` requests from each site, the sites side by side, each over its kept-alive connection."""
        def run(site_code: str) -> None:
            for _ in range(n or self.samples):
                self.tally.add(phase, site_code, one(self.sessions[site_code], self.out["entries"][site_code],
                                                     self.out["key"]))

        threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in sites]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def cell(self, name: str) -> dict:
        return next(c for c in self.out["cells"] if c["name"] == name)

    def kill_pods(self, name: str) -> list[int]:
        """SIGKILL every pod process the cell recorded (its ready.json): a host lost at once."""
        ready = json.loads((Path(self.cell(name)["state_dir"]) / READY_FILE).read_text())
        pids = [p["pid"] for p in ready.get("pods", []) if p.get("pid")]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def alone(self, phase: str, n: int) -> None:
        """Tokyo's requests sent to apac-jp's own address: what Tokyo pays without the fleet."""
        session = requests.Session()
        for _ in range(n):
            self.tally.add(phase, f"{LOST_SITE} without fleet", one(session, self.cell(LOST)["worker_url"], self.out["key"]))

    def renew_pods(self, name: str) -> None:
        """New pods for the cell as an operator gets them: pod.renewal + 1, then the cell's apply."""
        raw, _ = stackfile.read_config(name, self.stacks_dir)
        renewal = int((raw.get("pod") or {}).get("renewal", 0)) + 1
        stackfile.write_config(name, {"pod.renewal": renewal}, self.stacks_dir)
        t0 = time.monotonic()
        fleet.apply_cell(self.fleet_dir, name)
        print(f"    {name}: pod.renewal {renewal}, applied in {time.monotonic() - t0:.1f} s (new pod created, "
              "Worker swapped with no request dropped, the dead pod deleted)", flush=True)

    def until_home(self, phase: str) -> float:
        """Tokyo's requests until one is served by its own cell again; the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < RETURN_WAIT_S:
            s = one(self.sessions[LOST_SITE], self.out["entries"][LOST_SITE], self.out["key"])
            self.tally.add(phase, LOST_SITE, s)
            if s.ok and s.cell == LOST:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise SandboxError(f"{LOST_SITE} was not served by {LOST} within {RETURN_WAIT_S:.0f} s of its pods' return")

    # --- the closing numbers ---------------------------------------------------------------

    def rows(self) -> list[tuple[str, str, list[Sample]]]:
        """Phases in the order they ran, clients in SITES order (threads add them in any order)."""
        phases = list(dict.fromkeys(ph for ph, _ in self.tally.rows))
        order = [*SITES, f"{LOST_SITE} without fleet"]
        keys = sorted(self.tally.rows, key=lambda k: (phases.index(k[0]), order.index(k[1]) if k[1] in order else 99))
        return [(ph, row, self.tally.rows[(ph, row)]) for ph, row in keys]

    def table(self) -> str:
        # "served by" fits a transition's two cells with their counts ("eu-west 41, apac-jp 15").
        head = f"    {'phase':<22}{'client':<20}{'served by':<26}{'backend':<18}{'e2e p50/p90 ms':>15}{'n':>5}{'failed':>8}"
        lines = [head, "    " + "-" * (len(head) - 4)]
        for ph, row, v in self.rows():
            ok = [s for s in v if s.ok]
            cells = Counter(s.cell for s in ok)
            backends = Counter(s.backend for s in ok)
            e2e = [s.e2e for s in ok]
            served = ", ".join(f"{c or '-'}" + (f" {k}" if len(cells) > 1 else "") for c, k in cells.most_common())
            back = ", ".join(f"{b}" + (f" {k}" if len(backends) > 1 else "") for b, k in backends.most_common())
            p50, p90 = p(e2e, 50), p(e2e, 90)
            e = f"{p50:.0f}/{p90:.0f}" if p50 is not None else "n/a"
            lines.append(f"    {ph:<22}{row:<20}{served or '-':<25} {back or '-':<18}{e:>15}{len(v):>5}{len(v) - len(ok):>8}")
        return "\n".join(lines)

    def hop_costs(self, n: int = HOP_SAMPLES) -> str:
        """Each cell's Worker to its pod 0, GET /health over the mutual-TLS hop: on the pooled
        connection and on a new one (the cell's network closes the hop's connections first and
        counts the one each check opens), as the probe's pod_rtt and pod_rtt_new measure it."""
        from ..probe import connections, report, sample, sandbox as probe_sandbox
        from ..probe.errors import ProbeError

        def pod0(s: sample.Sample) -> dict | None:
            return next((e for e in report.pod_entries(s) if e.get("index") == 0), None)

        lines = [f"    {'cell':<10}{'pooled p50 ms':>15}{'new connection p50 ms':>24}{'n':>4}"]
        for c in self.out["cells"]:
            cell = probe_sandbox.read(Path(c["state_dir"]))
            if cell is None or not cell.control_url:
                lines.append(f"    {c['name']:<10}{'n/a':>15}{'n/a':>24}")
                continue
            hops = connections.HopControl(cell.control_url, 10.0)
            pooled: list[float] = []
            new: list[float] = []
            with sample.Sampler(cell.url, cell.read_token, 10.0) as s, contextlib.suppress(ProbeError):
                for _ in range(n):  # a network control that stops answering leaves what was measured
                    fresh = sample.new_connection_probe(s, hops)
                    first = pod0(fresh)
                    rtt = report.new_rtt(fresh, first) if first else None
                    if rtt is not None:
                        new.append(rtt)
                    warm = pod0(s.probe(sample.POD_ONLY))
                    if warm and warm.get("ok"):
                        pooled.append(float(warm["rtt_ms"]))
            a, b = (("n/a" if v is None else f"{v:.0f}") for v in (p(pooled, 50), p(new, 50)))
            lines.append(f"    {c['name']:<10}{a:>15}{b:>24}{n:>4}")
        return "\n".join(lines)

    def bars(self, phases: list[str]) -> list[dict]:
        out = []
        for ph, row, v in self.rows():
            if ph not in phases:
                continue
            ok = [s for s in v if s.ok]
            if not ok:
                continue

            def med(name: str, ok: list[Sample] = ok) -> float:
                return statistics.median(s.timing.get(name, 0.0) for s in ok)

            e2e, front, total, up, fb = (statistics.median(s.e2e for s in ok), med("front"), med("total"),
                                         med("upstream"), med("fallback"))
            cell = Counter(s.cell for s in ok).most_common(1)[0][0] or f"{LOST} alone"
            out.append({"label": f"{ph.split()[0]} {row}\n{cell}", "e2e": e2e,
                        "network (user to front door to cell)": max(0.0, e2e - front - total),
                        "front door": front, "pod (upstream)": up, "fallback API": fb,
                        "cell Worker, other": max(0.0, total - up - fb)})
        return out

    def plot(self, path: Path, phases: list[str]) -> Path:
        from . import demo_plot  # matplotlib only here

        plt = demo_plot.plt
        parts = (("network (user to front door to cell)", "tab:gray"), ("front door", "tab:purple"),
                 ("pod (upstream)", "tab:blue"), ("fallback API", "tab:orange"), ("cell Worker, other", "tab:green"))
        bars = self.bars(phases)
        fig, ax = plt.subplots(figsize=(11.0, 5.4), dpi=110)
        try:
            xs = range(len(bars))
            bottoms = demo_plot.stack(ax, bars, parts, "{:.0f} ms")
            ax.set_xticks(list(xs), [b["label"] for b in bars], fontsize=7)
            ax.set_ylabel("milliseconds (p50 of each part)")
            ax.set_title("Three cells behind one front door: who serves each user, before, during and after "
                         "apac-jp loses its pods", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
            ax.set_ylim(0, max([*bottoms, *(b["e2e"] for b in bars)]) * 1.18 + 1)
            fig.text(0.01, 0.01, "1 home; 2 apac-jp's pods killed (\"without fleet\": apac-jp alone falls back to the "
                     "paid API); 3 pods back (pod.renewal + apply)", fontsize=7, color="dimgray")
            fig.tight_layout(rect=(0, 0.04, 1, 1))
            fig.savefig(path, format="png")
        finally:
            plt.close(fig)
        return path


P1, P2, P2T, P3T, P3 = "1 home", "2 pods lost", "2 transition", "3 transition", "3 pods back"


def run(state_dir: Path | None = None, samples: int = 12) -> int:
    if samples < 1:
        print(f"demo-fleet: --samples {samples}: must be at least 1", file=sys.stderr)
        return 2
    demo = Demo(state_dir or supervisor.default_state_dir("demo-fleet"), samples)
    started = time.monotonic()
    try:
        say(f"Three cells ({', '.join(CELLS)}) behind one front door, users at {', '.join(SITES)}. Copies of the "
            f"committed stack files in {demo.stacks_dir}; the fleet's state in {demo.state_dir}.")
        demo.fresh()
        demo.up()

        say(f"1. Each user is served by its nearest cell ({samples} requests per site).")
        demo.load(P1)

        say(f"2. Every pod of {LOST} is killed (SIGKILL). {LOST_SITE} should be served by the next nearest cell's pod, "
            "not by the paid fallback API.")
        print(f"    killed pod pids {demo.kill_pods(LOST)}", flush=True)
        demo.load(P2T, sites=(LOST_SITE,), n=3)  # the first requests after the loss: the breaker learns
        demo.load(P2)
        print(f"    beside it, {LOST_SITE} without the fleet: {samples} requests to {LOST}'s own address "
              "(its router falls back to the emulated fallback API)", flush=True)
        demo.alone(P2, samples)

        say(f"3. {LOST}'s pods come back (pod.renewal + 1 and the cell's apply), under {LOST_SITE}'s traffic.")
        stop = threading.Event()

        def background() -> None:
            while not stop.is_set():
                demo.tally.add(P3T, LOST_SITE, one(requests.Session(), demo.out["entries"][LOST_SITE], demo.out["key"]))

        t = threading.Thread(target=background, daemon=True)
        t.start()
        try:
            demo.renew_pods(LOST)
        finally:
            stop.set()
            t.join(timeout=40)
        took = demo.until_home(P3T)
        print(f"    {LOST_SITE} served by {LOST} again {took:.1f} s after the apply returned", flush=True)
        demo.load(P3)

        say("Every request of the demo, by phase and client site (e2e on the client's clock, p50/p90).")
        print(demo.table())
        say(f"What the pod hop costs: each cell's Worker to its pod over mutual TLS ({HOP_SAMPLES} checks each).")
        print(demo.hop_costs(), flush=True)
        total, failed = len(demo.tally.all()), demo.tally.failed()
        png = demo.plot(demo.state_dir / FLEET_DEMO_PLOT_FILE, [P1, P2, P3])
        p2 = [s for s in demo.tally.rows.get((P2, LOST_SITE), []) if s.ok]
        alone = [s for s in demo.tally.rows.get((P2, f"{LOST_SITE} without fleet"), []) if s.ok]
        if p2 and alone:
            a, b = statistics.median(s.e2e for s in p2), statistics.median(s.e2e for s in alone)
            print(f"\n    {LOST_SITE} with {LOST}'s pods gone: {a:.0f} ms p50 through the fleet (a pod of "
                  f"{Counter(s.cell for s in p2).most_common(1)[0][0]}) against {b:.0f} ms from {LOST} alone, whose "
                  f"router pays the fallback API ({'+' if a >= b else ''}{a - b:.0f} ms); both measured here. The fallback "
                  "API's per-token bill is what the fleet avoids: no fallback request was spent through the fleet"
                  if not any(s.backend == "fallback" for s in demo.tally.all() if s.cell) else "")
        print(f"\n    plot: {png}")
        print(f"\n    {total} requests, {len(failed)} failed" + (
            "" if not failed else ": " + "; ".join(sorted({f.error or '?' for f in failed})[:5])))
        say(f"Done in {time.monotonic() - started:.0f} s.")
        return 0 if not failed else 1
    except (ConfigError, SandboxError) as exc:
        print(f"demo-fleet: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        with fleet.deferred_signals():
            fleet.down(demo.fleet_dir)
        print(f"\n    fleet stopped; its state is kept in {demo.state_dir}", flush=True)
