"""``sandbox.py demo-autoscale``: a compressed day of a fleet whose pods follow demand.

The fleet of ``demo-fleet`` (three cells behind one front door, users at NRT, FRA and IAD)
with ``colocate:scale`` (the cost policy, 0 to 2 pods a cell) in copies of its stack files.
Each cell's users send the day's shape in their local time (peaks hours apart), the day
compressed into ``day_s`` seconds; each cell has its own controller, the kit's
``colocate.scaling.controller.Controller``, driving its pods through the sandbox's apply
(``SandboxDeployer``), with a clock that runs at the day's speed. A pod's boot is compressed
with the day: ``BOOT_S`` of the day (a real pod's 20 minutes, ``colocate/cell/capacity.py``) before
the apply that creates it, billed from then. A pod serves ``TARGET_RPM``, the knee of the default
pod profile (``capacity.pod_capacity``), not a guess.

Before the day each cell answers ``WARMUP`` requests at its own address, as a cell that ran
yesterday has: the cost policy prices its deferred users at what its requests carried.
Those are not part of the day's figures. The figures are ``colocate/scaling/day.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import requests

from .. import stackfile
from ..cell import capacity, settings as settings_mod
from ..errors import ConfigError
from ..scaling import day as day
from ..scaling.controller import CellClient, Controller, policy_of
from . import fleet, supervisor
from .demo import say
from .errors import SandboxError
from .scaling import SandboxDeployer
from .statedir import READY_FILE, STACKS_DIR

FLEET = "fleet"
CELLS = ("apac-jp", "eu-west", "us-east")
SITES = {"apac-jp": "NRT", "eu-west": "FRA", "us-east": "IAD"}  # each cell's users
UTC_OFFSET = {"apac-jp": 9, "eu-west": 1, "us-east": -5}  # the cells' local time in December
DAY_S = 150.0  # the day, compressed: 1 hour = 6.25 s
SENT = 900  # requests sent over the day (about 6 a second on this 2-core machine)
MAX_PODS = 2
TARGET_RPM = capacity.pod_capacity()  # one pod's knee (default profile), requests/minute of the day
PRICES = day.Prices(pod_per_hr=0.60, api_per_1m=0.30)
UP_AFTER_S, DOWN_AFTER_S = 1800, 3600  # of the day
INTERVAL_S = 1800.0  # of the day between controller passes
STALE_AFTER_S = 4 * 3600.0  # of the day: a pass blocked in an apply (seconds here, hours of the day) is no outage
BOOT_S = float(capacity.BOOT_S)  # of the day: a real pod's image pull and model load, before the apply creates it
DRAIN_S = 1800.0  # of the day: the longest a draining pod's requests may take before it is deleted anyway
REMEMBER_MS = 300  # the front door passes over a cell without pods for this long (wall ms; 5000 in the stack)
WARMUP = 3
WARMUP_S = 30.0  # wall seconds a cell's warm-up may keep failing before the demo gives up
WORKERS_PER_SITE = 8
# ~1,290 characters of prompt: the stand-in counts four a token, so a request carries ~330 tokens.
BODY = {"model": settings_mod.POD_DEFAULTS["model"], "max_tokens": 16,
        "messages": [{"role": "user", "content": "Summarise the history of the Tokaido road. " * 30}]}


class DayClock:
    """The day's time from the wall clock: ``hours()`` (UTC hour of the day) and ``seconds()``."""

    def __init__(self, day_s: float):
        self.day_s = day_s
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()

    def hours(self) -> float:
        return (time.monotonic() - self.t0) / self.day_s * day.HOURS

    def seconds(self) -> float:
        return self.hours() * 3600

    def wall(self, day_seconds: float) -> float:
        return day_seconds / day.DAY_S * self.day_s


@dataclass
class PodLog:
    """A cell's pods over the day: (UTC hour, existing) for the bill, (hour, running, booting) for the plot."""

    existing: list[tuple[float, int]] = field(default_factory=list)
    shown: list[tuple[float, int, int]] = field(default_factory=list)


class BootingDeployer:
    """``SandboxDeployer`` with a pod's boot compressed with the day: new pods bill from the
    decision, wait ``BOOT_S`` of the day, then the apply creates them and the Worker routes to
    them; removed pods bill until the apply that deletes them returns."""

    def __init__(self, inner: SandboxDeployer, clock: DayClock, log: PodLog, say):
        self.inner, self.clock, self.log, self.say = inner, clock, log, say
        self.lock = threading.Lock()

    def declared(self) -> tuple[int, int]:
        return self.inner.declared()

    def deploy(self, pods: int, draining: int) -> None:
        before = sum(self.inner.declared())
        after = pods + draining
        running = self.inner.declared()[0]
        if after > before:
            with self.lock:
                self.log.existing.append((self.clock.hours(), after))
                self.log.shown.append((self.clock.hours(), before, after - before))
            self.say(f"{after - before} pod(s) booting")
            time.sleep(self.clock.wall(BOOT_S))
        self.inner.deploy(pods, draining)
        with self.lock:
            self.log.existing.append((self.clock.hours(), after))
            self.log.shown.append((self.clock.hours(), pods, 0))
        if pods > running:
            self.say(f"{pods} pod(s) serve (up from {running})")
        elif draining:
            self.say(f"{draining} pod(s) draining, {pods} serve")
        elif after < before:
            self.say(f"{before - after} pod(s) deleted, {pods} serve")


def _one(session: requests.Session, url: str, key: str, at_h: float, home: str, t0: float) -> tuple[day.Served, float]:
    t = time.monotonic()
    try:
        r = session.post(url + "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"}, timeout=30)
        e2e = (time.monotonic() - t) * 1000
        if r.status_code != 200:
            return day.Served(at_h, home, False, r.headers.get("x-colocate-cell"), r.headers.get("x-colocate-backend"),
                              e2e_ms=e2e, why=f"HTTP {r.status_code}: {error_message(r)}"), t - t0
        usage = r.json().get("usage") or {}
        return day.Served(at_h, home, True, r.headers.get("x-colocate-cell"), r.headers.get("x-colocate-backend"),
                          int(usage.get("total_tokens", 0)), e2e), t - t0
    except (requests.RequestException, ValueError) as exc:
        return day.Served(at_h, home, False, backend=type(exc).__name__, e2e_ms=(time.monotonic() - t) * 1000,
                          why=f"{type(exc).__name__}: {str(exc)[:200]}"), t - t0


def error_message(r: requests.Response) -> str:
    """OpenAI's error shape where the answer has it, else the start of the body."""
    try:
        return str(r.json()["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


class Demo:
    def __init__(self, state_dir: Path, shape: dict[str, tuple[float, ...]], prices: day.Prices, day_s: float, sent: int):
        self.state_dir = Path(state_dir).resolve()
        self.stacks_dir = self.state_dir / STACKS_DIR
        self.fleet_dir = self.state_dir / FLEET
        # every cell of the fleet runs and may bill pods for others' users; one the shape leaves out has none of its own
        self.shape = {c: shape.get(c, (0.0,) * day.HOURS) for c in CELLS}
        self.prices, self.day_s = prices, day_s
        self.per = day.per_request(shape, sent)
        self.clock = DayClock(day_s)
        self.logs = {c: PodLog() for c in CELLS}
        self.served: list[day.Served] = []
        self.errors: list[str] = []
        self.out: dict = {}
        self.measured: dict | None = None  # the day's figures, once the day ran
        self.failure: str | None = None  # why the day was not measured
        self.interval_s = INTERVAL_S  # of the day, between a controller's passes

    # --- before the day -----------------------------------------------------------------------

    def initial_pods(self, cell: str) -> int:
        """What the cost policy runs at the cell's first hour: the day starts from yesterday's evening."""
        rpm = self.shape[cell][day.local_hour(0, UTC_OFFSET[cell])]
        return day.pods_needed(rpm, TARGET_RPM, self.prices, self.tokens_per_request(), MAX_PODS)

    @staticmethod
    def tokens_per_request() -> float:
        from ..pods.standin import prompt_tokens

        return prompt_tokens(BODY) + 9  # the stand-in answers nine tokens at most (max_tokens 16)

    def fresh(self) -> None:
        """Stop a previous run's fleet; copies of the committed stacks with the demo's policy."""
        fleet.start_afresh(self.fleet_dir, self.state_dir, self.stacks_dir, FLEET, CELLS)
        stackfile.write_config(FLEET, {"fleet.rememberMs": REMEMBER_MS}, self.stacks_dir)
        for cell in CELLS:
            # The policy in the units the controller sees: one request sent stands for `per` of the
            # day's, so a pod's target and its price are divided by `per` (the decision is the same).
            stackfile.write_config(cell, {
                "scale": {"min": 0, "max": MAX_PODS, "target": TARGET_RPM / self.per, "upAfterS": UP_AFTER_S,
                          "downAfterS": DOWN_AFTER_S, "policy": "cost", "pods": self.initial_pods(cell)},
                "fallbackPrice": {"input": self.prices.api_per_1m, "output": self.prices.api_per_1m},
                # Every site's users share the fleet's one key, and the front door sends a cell without
                # pods' users to another cell: one cell may hold every site's requests at once. The
                # key's in-flight limits (8 requests, and 8,192 prompt tokens waiting for a pod, a cell
                # by default) are not what this day measures: slow pods (a loaded machine) keep more
                # of its requests waiting at once. Each request's prompt counts at most its body's bytes.
                "keys": {"defaults": {"maxParallel": len(CELLS) * WORKERS_PER_SITE,
                                      "maxParallelTokens": len(CELLS) * WORKERS_PER_SITE * len(json.dumps(BODY))}},
            }, self.stacks_dir)

    def budget(self, cell: str) -> float:
        raw, _ = stackfile.read_config(cell, self.stacks_dir)
        e2e = settings_mod.parse_budgets(raw.get("budgets")).get("e2e")
        if e2e is None:
            raise ConfigError("colocate:budgets.e2e", None, f"stack {cell} has no e2e budget to judge its peak by",
                              f"pulumi config set --path colocate:budgets.e2e 600 -s {cell}")
        return float(e2e)

    def up(self) -> None:
        t0 = time.monotonic()
        self.out = fleet.up(FLEET, stacks_dir=self.stacks_dir, sandboxes_dir=self.state_dir,
                            client_sites=tuple(SITES[c] for c in CELLS))
        print(f"    up in {time.monotonic() - t0:.1f} s: " + ", ".join(
            f"{c} {self.initial_pods(c)} pod(s) at {day.local_hour(0, UTC_OFFSET[c]):02d}:00 local" for c in CELLS),
            flush=True)

    def ready(self, cell: str) -> dict:
        state_dir = next(c["state_dir"] for c in self.out["cells"] if c["name"] == cell)
        return json.loads((Path(state_dir) / READY_FILE).read_text())

    def warm_up(self) -> None:
        """WARMUP answered requests per cell; one that fails is sent again for up to WARMUP_S (a
        cell just up may still be swapping its Worker), then the failure is named with its reason."""
        session = requests.Session()
        for cell in CELLS:
            url = self.ready(cell)["worker_url"]
            deadline = time.monotonic() + WARMUP_S
            answered = 0
            while answered < WARMUP:
                s, _ = _one(session, url, self.out["key"], 0.0, cell, time.monotonic())
                if s.ok:
                    answered += 1
                elif time.monotonic() > deadline:
                    raise SandboxError(f"warm-up request to {cell} ({url}) failed for {WARMUP_S:g} s: {s.why}")
                else:
                    time.sleep(0.5)

    def controller(self, cell: str) -> Controller:
        ready = self.ready(cell)
        raw, _ = stackfile.read_config(cell, self.stacks_dir)
        price = settings_mod.parse_fallback_price(raw.get("fallbackPrice"))
        scale = settings_mod.parse_scale(raw, price)
        policy = policy_of(scale, price, self.prices.pod_per_hr / self.per)
        policy = dataclasses.replace(policy, stale_after_s=STALE_AFTER_S)
        def say(line: str) -> None:
            print(f"    {self.clock.hours():5.1f} h  {cell:<8} {line}", flush=True)

        def said(line: str) -> None:  # the controller's own lines, in its units, only when something went wrong
            if "fail" in line or "anyway" in line or "no signal" in line:
                say(line)

        deployer = BootingDeployer(SandboxDeployer(cell, Path(ready["state_dir"])), self.clock, self.logs[cell], say)
        return Controller(CellClient(ready["worker_url"], ready["token"]), deployer, policy, owner=f"demo-autoscale:{cell}",
                          clock=self.clock.seconds, lock_ttl_s=30.0, drain_timeout_s=self.clock.wall(DRAIN_S),
                          settle_s=1.0, say=said)

    # --- the day ------------------------------------------------------------------------------

    def send(self, plan: list[tuple[float, str]], stop: threading.Event) -> None:
        """Every cell's users side by side, each request at its time of the day (open loop)."""
        queues = {c: deque(t for t, home in plan if home == c) for c in CELLS}
        lock = threading.Lock()

        def worker(cell: str) -> None:
            session = requests.Session()
            url = self.out["entries"][SITES[cell]]
            while not stop.is_set():
                with lock:
                    if not queues[cell]:
                        return
                    at_h = queues[cell].popleft()
                wait = self.clock.t0 + at_h / day.HOURS * self.day_s - time.monotonic()
                if wait > 0 and stop.wait(wait):
                    return
                s = self.one(session, url, at_h, cell)
                with lock:
                    self.served.append(s)

        threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in CELLS for _ in range(WORKERS_PER_SITE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def one(self, session: requests.Session, url: str, at_h: float, home: str) -> day.Served:
        """One of the day's requests, sent now."""
        return _one(session, url, self.out["key"], at_h, home, self.clock.t0)[0]

    def run_day(self) -> None:
        plan = day.schedule(self.shape, UTC_OFFSET, self.per)
        controllers = {c: self.controller(c) for c in CELLS}
        stop = threading.Event()
        self.clock.start()
        for c in CELLS:
            n = self.initial_pods(c)
            self.logs[c].existing.append((0.0, n))
            self.logs[c].shown.append((0.0, n, 0))
        threads = [threading.Thread(target=controllers[c].run, args=(self.clock.wall(self.interval_s),),
                                    kwargs={"stop": stop}, daemon=True) for c in CELLS]
        for t in threads:
            t.start()
        try:
            self.send(plan, stop)
        finally:
            stop.set()
            for t in threads:  # a controller in an apply finishes it (bounded by the apply's timeout)
                t.join(timeout=supervisor.UP_TIMEOUT_S)

    # --- after it -----------------------------------------------------------------------------

    def report(self) -> dict:
        budgets = {c: self.budget(c) for c in self.shape}
        pods = {c: self.logs[c].existing for c in self.shape}
        return day.report(self.shape, UTC_OFFSET, self.served, pods, self.prices, self.per, MAX_PODS, budgets)

    def table(self, out: dict) -> str:
        head = (f"    {'cell':<10}{'peak (local)':>13}{'fixed':>10}{'API only':>10}{'autoscaled':>12}{'pod-h':>7}"
                f"{'by pod/cell/fallback':>22}{'peak by pod':>13}{'peak p50/budget':>17}")
        lines = [head, "    " + "-" * (len(head) - 4)]
        for cell, v in out["cells"].items():
            mine = [s for s in self.served if s.home == cell]
            by = [sum(1 for s in mine if s.by() == k) for k in ("pod", "cell", "fallback")]
            peaks = sorted(day.peak_hours(self.shape[cell]))
            share = "n/a" if v["peak_pod_share"] is None else f"{100 * v['peak_pod_share']:.1f} %"
            p50 = ("n/a" if v["peak_p50_ms"] is None else f"{v['peak_p50_ms']:.0f}") + f"/{v['budget_e2e_ms']:g} ms"
            peak = f"{peaks[0]:02d}-{peaks[-1] + 1:02d} h" if peaks else "no users"
            lines.append(f"    {cell:<10}{peak:>13}{v['cost']['fixed']:>10.2f}"
                         f"{v['cost']['api']:>10.2f}{v['cost']['autoscaled']:>12.2f}"
                         f"{day.pod_hours(self.logs[cell].existing):>7.1f}{'/'.join(map(str, by)):>22}{share:>13}"
                         f"{p50:>17}")
        c, s = out["cost"], out["served"]
        by_all = f"{s['pod']}/{s['cell']}/{s['fallback']}"
        lines.append(f"    {'total':<10}{'':>13}{c['fixed']:>10.2f}{c['api']:>10.2f}{c['autoscaled']:>12.2f}"
                     f"{sum(day.pod_hours(self.logs[x].existing) for x in self.shape):>7.1f}"
                     f"{by_all:>22}")
        return "\n".join(lines)

    def hours_cheaper(self) -> tuple[int, int]:
        """(cell-hours where the API is cheaper than a pod, cell-hours where a pod is) over the shape."""
        api = pods = 0
        for rpm in self.shape.values():
            for v in rpm:
                if v <= 0:
                    continue
                if day.pods_needed(v, TARGET_RPM, self.prices, self.tokens_per_request(), MAX_PODS):
                    pods += 1
                else:
                    api += 1
        return api, pods

    def plot(self, path: Path, out: dict) -> Path:
        from . import autoscale_plot

        return autoscale_plot.draw(path, self.shape, UTC_OFFSET, self.served, {c: self.logs[c].shown for c in self.shape},
                                   {c: self.logs[c].existing for c in self.shape}, self.prices, self.per, MAX_PODS, out)


def run(state_dir: Path | None = None, *, shape_file: Path | None = None, prices: str | None = None, as_json: bool = False,
        day_s: float = DAY_S, sent: int = SENT) -> int:
    try:
        shape = (day.parse_shape(Path(shape_file).read_text(), CELLS, f"--shape {shape_file}") if shape_file
                 else day.default_shape(CELLS))
        price = day.parse_prices(prices) if prices else PRICES
    except OSError as exc:
        return refused(f"--shape {shape_file}: {exc.strerror}. Fix: give a CSV file of cell,hour,requests_per_minute",
                        as_json)
    except ConfigError as exc:
        return refused(str(exc), as_json)
    demo = Demo(state_dir or supervisor.default_state_dir("demo-autoscale"), shape, price, day_s, sent)
    # With --json only the JSON goes to stdout; the story goes to stderr. A day that was measured
    # prints its JSON whatever fails after it (the plot, stopping the fleet): a run of
    # `--shape F --json` right after a plain one once ended in a traceback and no JSON.
    real_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):
        try:
            code, out = _run(demo)
        except Exception as exc:  # noqa: BLE001 - said, with the measured day's figures if there are any
            print(f"demo-autoscale: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            code, out = 1, demo.measured
            demo.failure = demo.failure or f"{type(exc).__name__}: {exc}"
    if as_json:  # one JSON object, always: the day's figures, or why there are none
        print(json.dumps(out if out is not None else {"error": demo.failure or "the day was not measured"}),
              file=real_stdout, flush=True)
    return code


def refused(why: str, as_json: bool) -> int:
    """Bad input: exit 2 with the reason on stderr (and, with --json, as the one JSON object)."""
    print(f"demo-autoscale: {why}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": why}), flush=True)
    return 2


def _run(demo: Demo) -> tuple[int, dict | None]:
    shape, price, day_s = demo.shape, demo.prices, demo.day_s
    started = time.monotonic()
    try:
        say(f"A day of three cells ({', '.join(CELLS)}), users at {', '.join(SITES[c] for c in CELLS)} in their local "
            f"time, compressed into {day_s:.0f} s (1 hour = {day_s / 24:.2f} s). One request sent stands for "
            f"{demo.per} of the day's ({day.day_requests(shape):,.0f} in all); a pod boots in {BOOT_S / 60:.0f} min "
            f"of the day plus the sandbox's apply.")
        api_h, pod_h = demo.hours_cheaper()
        print(f"    The cost policy, 0-{MAX_PODS} pods a cell, {TARGET_RPM:g} req/min a pod; a pod ${price.pod_per_hr:g}/h, "
              f"the API ${price.api_per_1m:g} per 1M tokens (~{demo.tokens_per_request():.0f} a request): the API is the "
              f"cheaper in {api_h} cell-hours of the day, a pod in {pod_h}.", flush=True)
        demo.fresh()
        demo.up()
        demo.warm_up()
        say("The day (UTC hours; each controller's decisions as they happen).")
        demo.run_day()
        out = demo.measured = demo.report()
        say("The day's bill ($), and who served its requests.")
        print(demo.table(out))
        cost = out["cost"]
        best = "fixed pods" if cost["fixed"] <= cost["api"] else "the API alone"
        cheaper = min(cost["fixed"], cost["api"])
        if cost["autoscaled"] < cheaper:
            print(f"\n    Neither fixed pods (${cost['fixed']:.2f}) nor the API alone (${cost['api']:.2f}) is optimal over "
                  f"the day: the cheaper of them, {best}, costs {cheaper / cost['autoscaled']:.2f} x the autoscaled kit "
                  f"(${cost['autoscaled']:.2f}).", flush=True)
        else:
            print(f"\n    Over this day {best} (${cheaper:.2f}) costs no more than the autoscaled kit "
                  f"(${cost['autoscaled']:.2f}): the shape or the prices leave scaling nothing to win.", flush=True)
        verdicts = day.verdicts(out)
        for ok, text in verdicts:
            print(f"    {'PASS' if ok else 'FAIL'}  {text}")
        try:
            png = demo.plot(demo.state_dir / "demo-autoscale.png", out)
            print(f"\n    plot: {png}")
        except Exception as exc:  # noqa: BLE001 - a plot that cannot be drawn costs the picture, not the day
            print(f"\n    plot: not drawn ({type(exc).__name__}: {exc})")
        print(f"\n    {out['requests']} requests, {out['failed']} failed")
        for s in [s for s in demo.served if not s.ok][:10]:  # what a failure was, not only that it was
            print(f"      failed: {s.at_h:.1f} h from {s.home}, cell {s.cell or '-'}, backend {s.backend or '-'}, "
                  f"{s.e2e_ms:.0f} ms: {s.why}")
        say(f"Done in {time.monotonic() - started:.0f} s.")
        return (0 if out["failed"] == 0 else 1), out
    except (ConfigError, SandboxError) as exc:
        print(f"demo-autoscale: {exc}", file=sys.stderr)
        demo.failure = str(exc)
        return 2, None
    finally:
        try:
            with fleet.deferred_signals():
                fleet.down(demo.fleet_dir)
            print(f"\n    fleet stopped; its state is kept in {demo.state_dir}", flush=True)
        except Exception as exc:  # noqa: BLE001 - said; the day's figures are printed anyway
            print(f"\n    the fleet could not be stopped ({type(exc).__name__}: {exc}): .venv/bin/python "
                  f"scripts/sandbox.py down --state-dir {demo.fleet_dir}", flush=True)
