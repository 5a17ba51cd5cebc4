"""``sandbox.py demo-spot``: ``demo-autoscale``'s day on interruptible pods, against the same day on demand.

The fleet, its users and their day are ``demo-autoscale``'s (colocate/sandbox/autoscale_demo.py: three
cells, the cost policy, 0 to 2 pods a cell, a pod's 20-minute boot compressed with the day, ``DAY_S``), run twice in
real workerd with stand-in pods, side by side from one start (the same machine load on both): every pod on
demand, and every pod interruptible (``colocate:pod.market interruptible``, ``SPARE`` spare pod a cell,
run while it pays: SpotHedge's over-provisioning, colocate/scaling/policy.py ``hedge``; otherwise the
fleet and the capped fallback carry a preempted pod's share while its replacement boots). Each request is
a stream (its client times its first token, and sees how it ends). On both days each cell's controller
keeps its cell too (the keeper, colocate/keeper.py), passing every ``KEEP_INTERVAL_S`` of the day.

On the interruptible day the sandbox's host preempts pods (``Market``): each interruptible pod that
serves gets a life drawn at ``spot_day.PREEMPTIONS_PER_HOUR`` of the day; when it ends, the local
provider reports the pod preempted and kills its process (colocate/pods/local.py ``preempt``). The
Worker sees the hop fail at once (its requests not yet begun go to the other pod, the next cell or
the fallback; a stream cut mid-answer ends with an error event); the keeper finds the pod preempted
at its next pass and replaces it alone, the replacement booting for 20 minutes of the day, the sandbox's
update of a few seconds inside them as the cloud's are (``UpdateTimer``).

``Biller`` samples what each cell is billed for: its pods that serve or drain (a preempted one no more)
and the pods being rented (from the decision, through the boot, until the apply that creates them
returns). The figures and the verdicts are colocate/scaling/spot_day.py's, with two of the sandbox's own: how
long each preempted pod was out, and waited for its replacement to begin (``KeeperDeployer.done``), and which
requests waited at a cell's edge while an update swapped its Worker (``mark_held``: the runner's
``edge-holds.json``; Cloudflare's edge holds none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from .. import stackfile
from ..cell import settings as settings_mod
from ..cell.market import INTERRUPTIBLE
from ..cell.plan import modules_hash, worker_modules
from ..errors import ConfigError
from ..pods.base import DEAD
from ..pods.local import Local
from ..probe import timing as server_timing
from ..scaling import day, spot_day
from ..scaling.controller import CellClient, Controller, policy_of
from ..scaling.keeper import Keeper
from . import autoscale_demo as base, fleet, supervisor
from .demo import say
from .errors import SandboxError
from .pods import recorded_pods
from .scaling import SandboxDeployer
from .statedir import DAY_RECORD_FILE, EDGE_HOLDS_FILE, LOCAL_PODS_DIR, read_json

# The day, compressed: 1 hour = 25 s. A sandbox update (a pod started, the Worker swapped) takes 2 to 7 s of
# wall time on a 2-core machine. In demo-autoscale's 150 s day that was 20 to 70 minutes of the day on top of
# each replacement's 20-minute boot, the keeper waiting behind the cell's other updates 40 minutes on average:
# a preempted pod stayed out about two hours of the day. In 600 s, a replacement's update slept inside its boot
# (``UpdateTimer``), it is back after 22 minutes (``back_in_service``, median).
DAY_S = 600.0
STRETCHED = 2.0  # a median time back in service past this x the boot: the day said not to be a real one
KEEP_INTERVAL_S = 60.0  # of the day between a controller's passes: a preempted pod is found within a minute of it
SPARE = 1  # colocate:pod.spare on the interruptible day
SAMPLE_S = 0.05  # wall seconds between the biller's samples (7.2 s of the default day)
ON_DEMAND_PER_HR = base.PRICES.pod_per_hr  # demo-autoscale's $0.60/h
STREAM_BODY = {**base.BODY, "stream": True, "stream_options": {"include_usage": True}}


def local_provider(state_dir: Path) -> Local:
    provider = Local()
    provider.dir = Path(state_dir) / LOCAL_PODS_DIR  # where the sandbox's pod.py keeps its stand-ins
    return provider


def serving_ids(state_dir: Path) -> set[str]:
    """The cell's pods that serve or drain, as billed: recorded, and not taken back by the host."""
    provider = local_provider(state_dir)
    out = set()
    for p in recorded_pods(state_dir):
        with contextlib.suppress(Exception):  # a record the apply just rewrote: the next sample reads it
            if provider.describe(str(p["id"])).state != DEAD:
                out.add(str(p["id"]))
    return out


def edge_holds(state_dir: Path) -> list[tuple[float, float]]:
    """When a cell's edge held requests while an update swapped its Worker (time.monotonic, as the runner wrote)."""
    return [(float(a), float(b)) for a, b in (read_json(state_dir / EDGE_HOLDS_FILE) or {}).get("holds", [])]


def mark_held(served: list[day.Served], holds: dict[str, list[tuple[float, float]]],
              clock: base.DayClock) -> list[day.Served]:
    """Each request whose wait for its first token (from its send, at its hour of the day) overlapped a hold of
    its home cell's edge or of the cell that answered it, marked ``held``."""
    out = []
    for s in served:
        start = clock.t0 + s.at_h / day.HOURS * clock.day_s
        end = start + (s.ttft_ms if s.ttft_ms is not None else s.e2e_ms) / 1000
        cells = {s.home, s.cell} - {None}
        held = any(a < end and b > start for c in cells for a, b in holds.get(str(c), []))
        out.append(dataclasses.replace(s, held=held) if held else s)
    return out


def day_record(served: list[day.Served], preempted: list[tuple[float, str, int]],
               replaced: list[tuple[float, float, str, tuple[int, ...]]], holds: dict[str, list[tuple[float, float]]],
               billed: dict[str, list[tuple[float, int]]], clock: base.DayClock) -> dict:
    """The day as it happened (``DAY_RECORD_FILE`` in the day's directory: what a figure hides, such as
    which requests made the TTFT tail and what their cell was doing then), every time in hours of the
    day: each request (``day.Served``), each preemption (cell, pod index), each replacement (decided,
    serving, cell, indices), each hold of a cell's edge while its Worker was swapped, and each cell's
    billed pods."""
    def hour(t: float) -> float:
        return round((t - clock.t0) / clock.day_s * day.HOURS, 4)

    return {"requests": [dataclasses.asdict(s) for s in served],
            "preempted": [{"at_h": h, "cell": c, "pod": i} for h, c, i in preempted],
            "replaced": [{"decided_h": a, "serving_h": b, "cell": c, "pods": list(ix)} for a, b, c, ix in replaced],
            "holds": {c: [[hour(a), hour(b)] for a, b in v] for c, v in holds.items()},
            "billed": {c: [list(step) for step in v] for c, v in billed.items()}}


@dataclass
class Renting:
    """Pods a decision rents: billed from then until they are recorded (they serve), or the apply returns."""

    cell: str
    k: int
    before: set[str]


class Biller(threading.Thread):
    """Each cell's billed pods over the day, sampled every SAMPLE_S: ``billed[cell]`` is a step function of
    (UTC hour of the day, pods billed)."""

    def __init__(self, cells: dict[str, Path], clock: base.DayClock):
        super().__init__(daemon=True)
        self.cells, self.clock = cells, clock
        self.renting: list[Renting] = []
        self.billed: dict[str, list[tuple[float, int]]] = {c: [] for c in cells}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def rent(self, cell: str, k: int) -> Renting:
        r = Renting(cell, k, serving_ids(self.cells[cell]))
        with self.lock:
            self.renting.append(r)
        self.sample(cell)
        return r

    def rented(self, r: Renting) -> None:
        with self.lock:
            self.renting.remove(r)
        self.sample(r.cell)

    def sample(self, cell: str) -> None:
        ids = serving_ids(self.cells[cell])
        with self.lock:
            booting = sum(max(0, r.k - len(ids - r.before)) for r in self.renting if r.cell == cell)
            n, steps = len(ids) + booting, self.billed[cell]
            if not steps or steps[-1][1] != n:
                steps.append((self.clock.hours(), n))

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            for cell in self.cells:
                self.sample(cell)


class Market(threading.Thread):
    """The sandbox's host of interruptible pods: each one that serves gets a life drawn at ``rate`` a pod-hour
    of the day; when it ends, the local provider preempts it (recorded, then its process killed)."""

    def __init__(self, cells: dict[str, Path], clock: base.DayClock, rng: random.Random, say,
                 rate: float = spot_day.PREEMPTIONS_PER_HOUR):
        super().__init__(daemon=True)
        self.cells, self.clock, self.rng, self.say, self.rate = cells, clock, rng, say, rate
        self.ends: dict[str, float] = {}  # pod id -> the UTC hour of the day its host takes it back
        self.preempted: list[tuple[float, str, str, int]] = []  # (hour, cell, pod id, pod index)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            now = self.clock.hours()
            for cell, state_dir in self.cells.items():
                provider = local_provider(state_dir)
                for pod_id in sorted(serving_ids(state_dir)):
                    end = self.ends.setdefault(pod_id, now + spot_day.lifetime_h(self.rng, self.rate))
                    if now < end:
                        continue
                    index = next((int(p.get("index", 0)) for p in recorded_pods(state_dir) if str(p["id"]) == pod_id), -1)
                    if provider.preempt(pod_id):
                        self.preempted.append((now, cell, pod_id, index))
                        self.say(cell, f"pod {index} preempted (its host took it back)")


class UpdateTimer:
    """The wall seconds the sandbox's replacement updates take (a stand-in started and ready, the Worker
    swapped), shared by a day's keepers. In the cloud those seconds pass while the new pod boots; here the
    boot is slept first, so each replacement sleeps its boot short by their median: 3 s of wall time would
    otherwise add 7 minutes of a 600 s day to every replacement."""

    def __init__(self):
        self.took: list[float] = []
        self.lock = threading.Lock()

    def record(self, seconds: float) -> None:
        with self.lock:
            self.took.append(seconds)

    def estimate(self) -> float:
        with self.lock:
            return statistics.median(self.took) if self.took else 0.0


class KeeperDeployer:
    """The keeper's deployer: ``SandboxDeployer``, with a replacement's boot compressed with the day and the
    update's own seconds inside it (``UpdateTimer``), billed from the decision, as ``BootingDeployer``'s new
    pods are."""

    def __init__(self, inner: SandboxDeployer, cell: str, clock: base.DayClock, biller: Biller, say,
                 timer: UpdateTimer | None = None, sleep=time.sleep):
        self.inner, self.cell, self.clock, self.biller, self.say = inner, cell, clock, biller, say
        self.timer, self.sleep = timer or UpdateTimer(), sleep
        self.replaced = 0
        self.done: list[tuple[float, float, str, tuple[int, ...]]] = []  # (hour decided, hour serving, cell, indices)

    def pods(self):
        return self.inner.pods()

    def describe(self, pod):
        return self.inner.describe(pod)

    def certificates(self):
        return self.inner.certificates()

    def renew(self, role: str) -> None:
        self.inner.renew(role)

    def replace(self, indices, replaced) -> None:
        renting = self.biller.rent(self.cell, len(indices))
        start = self.clock.hours()
        try:
            self.say(f"keeper: replacing pod {', '.join(map(str, indices))}: {len(indices)} pod(s) booting")
            self.sleep(max(0.0, self.clock.wall(base.BOOT_S) - self.timer.estimate()))
            t = time.monotonic()
            self.inner.replace(indices, replaced)
            self.timer.record(time.monotonic() - t)
            self.replaced += len(indices)
            self.done.append((start, self.clock.hours(), self.cell, tuple(indices)))
        finally:
            self.biller.rented(renting)


class BilledBootingDeployer(base.BootingDeployer):
    """``BootingDeployer`` whose new pods the biller counts from the decision."""

    def __init__(self, inner: SandboxDeployer, clock: base.DayClock, log: base.PodLog, say, cell: str, biller: Biller):
        super().__init__(inner, clock, log, say)
        self.cell, self.biller = cell, biller

    def deploy(self, pods: int, draining: int) -> None:
        more = pods + draining - sum(self.inner.declared())
        renting = self.biller.rent(self.cell, more) if more > 0 else None
        try:
            super().deploy(pods, draining)
        finally:
            if renting is not None:
                self.biller.rented(renting)


def stream_one(session: requests.Session, url: str, key: str, at_h: float, home: str) -> day.Served:
    """One streamed request: its first token's time, its usage, how it ended (done, cut by an error
    event after it began, or failed)."""
    t = time.monotonic()
    ttft = None
    try:
        with session.post(url + "/v1/chat/completions", json=STREAM_BODY, headers={"authorization": f"Bearer {key}"},
                          timeout=30, stream=True) as r:
            cell, backend = r.headers.get("x-colocate-cell"), r.headers.get("x-colocate-backend")
            st = {**server_timing.parse(r.headers.get("server-timing")).durations,
                  "headers": round((time.monotonic() - t) * 1000, 1)}
            if r.status_code != 200:
                return day.Served(at_h, home, False, cell, backend, e2e_ms=(time.monotonic() - t) * 1000,
                                  why=f"HTTP {r.status_code}: {base.error_message(r)}", timing=st)
            tokens, done, error = 0, False, None
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    done = True
                    break
                doc = json.loads(data)
                if "error" in doc:  # OpenAI's shape: what the SDK raises
                    error = doc["error"]
                    break
                if doc.get("usage"):
                    tokens = int(doc["usage"].get("total_tokens", 0))
                if ttft is None and any((c.get("delta") or {}).get("content") for c in doc.get("choices") or []):
                    ttft = (time.monotonic() - t) * 1000
            e2e = (time.monotonic() - t) * 1000
            if error is not None:
                return day.Served(at_h, home, False, cell, backend, tokens, e2e, f"error event: {error.get('code')}",
                                  ttft_ms=ttft, cut=True, timing=st)
            if not done:
                return day.Served(at_h, home, False, cell, backend, tokens, e2e, "the stream ended without [DONE]",
                                  ttft_ms=ttft, timing=st)
            return day.Served(at_h, home, True, cell, backend, tokens, e2e, ttft_ms=ttft, timing=st)
    except (requests.RequestException, ValueError) as exc:
        return day.Served(at_h, home, False, backend=type(exc).__name__, e2e_ms=(time.monotonic() - t) * 1000,
                          why=f"{type(exc).__name__}: {str(exc)[:200]}", ttft_ms=ttft)


class SpotDay(base.Demo):
    """One day of the fleet on one market (``ondemand`` or ``interruptible``)."""

    def __init__(self, state_dir: Path, shape, prices: day.Prices, day_s: float, sent: int, market: str, seed: int,
                 spare: int = SPARE, keep_interval_s: float = KEEP_INTERVAL_S):
        super().__init__(state_dir, shape, prices, day_s, sent)
        self.market, self.seed = market, seed
        self.spare = spare if market == INTERRUPTIBLE else 0
        self.interval_s = keep_interval_s
        self.pod_per_hr = ON_DEMAND_PER_HR * (spot_day.INTERRUPTIBLE_SHARE if market == INTERRUPTIBLE else 1.0)
        self.keepers: dict[str, KeeperDeployer] = {}
        self.update_timer = UpdateTimer()  # one a day: its keepers' replacements are alike
        self.biller: Biller | None = None
        self.host: Market | None = None

    def fresh(self) -> None:
        super().fresh()
        for cell in base.CELLS:  # the sandbox's local provider emulates a market: how each pod is rented
            # Every site's users share the fleet's one key (demo-autoscale): while a cell has no pod its users'
            # prompts wait elsewhere, and the key's prompt tokens in flight are not what this day measures.
            raw, _ = stackfile.read_config(cell, self.stacks_dir)
            defaults = {**((raw.get("keys") or {}).get("defaults") or {}), "maxParallelTokens": 0}
            stackfile.write_config(cell, {"pod.provider": "local", "pod.market": self.market,
                                          "pod.spare": self.spare,
                                          "keys": {"defaults": defaults}}, self.stacks_dir)

    def cell_say(self, cell: str):
        def say_(line: str) -> None:  # both days print at once: each line names its day
            print(f"    {self.market[:6]:<6} {self.clock.hours():5.1f} h  {cell:<8} {line}", flush=True)
        return say_

    def controller(self, cell: str) -> Controller:
        ready = self.ready(cell)
        raw, _ = stackfile.read_config(cell, self.stacks_dir)
        price = settings_mod.parse_fallback_price(raw.get("fallbackPrice"))
        spare = self.spare
        policy = policy_of(settings_mod.parse_scale(raw, price, spare), price, self.pod_per_hr / self.per, spare)
        # The keeper passes every minute of the day, the demand is judged over demo-autoscale's passes (30
        # minutes of it): a minute holds ~0.1 request sent, and most minutes none.
        policy = dataclasses.replace(policy, stale_after_s=base.STALE_AFTER_S, min_interval_s=base.INTERVAL_S)
        say_ = self.cell_say(cell)

        def said(line: str) -> None:  # the controller's own lines, only when something went wrong
            if "fail" in line or "anyway" in line or "no signal" in line:
                say_(line)

        inner = SandboxDeployer(cell, Path(ready["state_dir"]))
        assert self.biller is not None
        deployer = BilledBootingDeployer(inner, self.clock, self.logs[cell], say_, cell, self.biller)
        keeping = KeeperDeployer(SandboxDeployer(cell, Path(ready["state_dir"])), cell, self.clock, self.biller, say_,
                                 self.update_timer)
        self.keepers[cell] = keeping
        keeper = Keeper(keeping, modules_hash(worker_modules()), clock=self.clock.seconds, say=said)
        return Controller(CellClient(ready["worker_url"], ready["token"]), deployer, policy, owner=f"demo-spot:{cell}",
                          clock=self.clock.seconds, lock_ttl_s=30.0, drain_timeout_s=self.clock.wall(base.DRAIN_S),
                          settle_s=1.0, say=said, keeper=keeper)

    def one(self, session: requests.Session, url: str, at_h: float, home: str) -> day.Served:
        return stream_one(session, url, self.out["key"], at_h, home)

    def run_day(self) -> None:
        cells = {c: Path(self.ready(c)["state_dir"]) for c in base.CELLS}
        self.biller = Biller(cells, self.clock)
        self.host = Market(cells, self.clock, random.Random(self.seed), lambda cell, line: self.cell_say(cell)(line))
        self.biller.start()
        if self.market == INTERRUPTIBLE:
            self.host.start()
        try:
            super().run_day()  # the clock starts here: the biller's first samples are the day's first pods
        finally:
            self.host.stop.set()
            self.biller.stop.set()

    def figures(self) -> dict:
        assert self.biller is not None and self.host is not None
        holds = {c: edge_holds(Path(self.ready(c)["state_dir"])) for c in base.CELLS}
        self.served = mark_held(self.served, holds, self.clock)
        preempted = [(h, cell, i) for h, cell, _, i in self.host.preempted]
        done = [r for k in self.keepers.values() for r in k.done]
        measured = spot_day.Day(self.market, tuple(self.served), {c: list(v) for c, v in self.biller.billed.items()},
                                self.pod_per_hr, preemptions=len(self.host.preempted),
                                replaced=sum(k.replaced for k in self.keepers.values()),
                                replacements=tuple(spot_day.replacements(preempted, done)))
        raw, _ = stackfile.read_config(base.CELLS[0], self.stacks_dir)
        cap = float((raw.get("fallbackCap") or {}).get("cellUsdPerDay") or 0)
        (self.state_dir / DAY_RECORD_FILE).write_text(json.dumps(day_record(
            self.served, preempted, done, holds, self.biller.billed, self.clock)) + "\n")
        return spot_day.day_figures(measured, self.prices, self.per, base.MAX_PODS, cap)


def run(state_dir: Path | None = None, *, as_json: bool = False, day_s: float = DAY_S, sent: int = base.SENT,
        seed: int = 1, shape_file: Path | None = None, spare: int = SPARE,
        keep_interval_s: float = KEEP_INTERVAL_S, days: tuple[str, ...] = spot_day.DAYS) -> int:
    """``days``: both (the demo), or one alone (tests: its figures, nothing compared)."""
    try:
        shape = (day.parse_shape(Path(shape_file).read_text(), base.CELLS, f"--shape {shape_file}") if shape_file
                 else day.default_shape(base.CELLS))
    except OSError as exc:
        return base.refused(f"--shape {shape_file}: {exc.strerror}. Fix: give a CSV file of cell,hour,requests_per_minute",
                             as_json)
    except ConfigError as exc:
        return base.refused(str(exc), as_json)
    if spare < 0:
        return base.refused(f"--spare {spare}: the spare pods a cell runs on the interruptible day must be 0 or more. "
                            "Fix: e.g. --spare 1 (the default) or --spare 0", as_json)
    root = Path(state_dir or supervisor.default_state_dir("demo-spot")).resolve()
    real_stdout = sys.stdout
    out: dict | None = None
    failure = None
    with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):
        try:
            code, out = _run(root, shape, day_s, sent, seed, spare, keep_interval_s, days)
        except Exception as exc:  # noqa: BLE001 - said; the JSON carries it
            print(f"demo-spot: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            code, failure = 1, f"{type(exc).__name__}: {exc}"
    if as_json:
        print(json.dumps(out if out is not None else {"error": failure or "the days were not measured"}), file=real_stdout,
              flush=True)
    return code


def _run(root: Path, shape, day_s: float, sent: int, seed: int, spare: int = SPARE,
         keep_interval_s: float = KEEP_INTERVAL_S, days: tuple[str, ...] = spot_day.DAYS) -> tuple[int, dict | None]:
    started = time.monotonic()
    prices = base.PRICES
    figures: dict[str, dict] = {}
    per = day.per_request(shape, sent)
    both = tuple(days) == spot_day.DAYS
    how = "twice at once" if both else f"on {days[0]} pods"
    say(f"A day of three cells ({', '.join(base.CELLS)}) {how}, compressed into {day_s:.0f} s: every pod on demand "
        f"(${ON_DEMAND_PER_HR:g}/h), and every pod interruptible (${ON_DEMAND_PER_HR * spot_day.INTERRUPTIBLE_SHARE:.2f}/h, "
        f"{spot_day.INTERRUPTIBLE_SHARE:g} of it: {spot_day.PRICE_SOURCE}) and preempted "
        f"{spot_day.PREEMPTIONS_PER_HOUR:.2f} times a pod-hour ({spot_day.PREEMPTION_SOURCE}). A pod boots in "
        f"{base.BOOT_S / 60:.0f} min of the day; each request is a stream and stands for {per} of the day's.")
    # Both days at once, their clocks started together: each sees the machine's load at the same
    # moments, so their TTFT is compared under the same conditions (run one after the other, a
    # loaded minute on one day alone showed as that day's tail).
    demos = {m: SpotDay(root / m, shape, prices, day_s, sent, m, seed, spare, keep_interval_s) for m in days}
    start = threading.Barrier(len(demos))
    failed: dict[str, BaseException] = {}

    def one_day(market: str) -> None:
        demo = demos[market]
        try:
            demo.fresh()
            demo.up()
            demo.warm_up()
            start.wait()
            demo.run_day()
            figures[market] = demo.figures()
        except BaseException as exc:  # noqa: BLE001 - the main thread says it and stops both fleets
            failed[market] = exc
            start.abort()  # the other day does not wait for this one

    say(("Both days side by side, started together" if both else f"The {days[0]} day")
        + " (UTC hours; preemptions and replacements as they happen).")
    threads = [threading.Thread(target=one_day, args=(m,), name=f"day-{m}", daemon=True) for m in days]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for demo in demos.values():
            try:
                with fleet.deferred_signals():
                    fleet.down(demo.fleet_dir)
            except Exception as exc:  # noqa: BLE001 - said; the day's figures stand
                print(f"    the fleet could not be stopped ({type(exc).__name__}: {exc}): .venv/bin/python "
                      f"scripts/sandbox.py down --state-dir {demo.fleet_dir}", flush=True)
    real = {m: e for m, e in failed.items() if not isinstance(e, threading.BrokenBarrierError)}
    for market, err in real.items():
        if isinstance(err, (ConfigError, SandboxError)):
            print(f"demo-spot: the {market} day: {err}", file=sys.stderr)
            return 2, None
        raise err
    for market in days:
        say(f"The day on {market} pods.")
        print_day(figures[market], demos[market])
    if not both:  # one day alone: its figures, nothing to compare them with
        say(f"Done in {time.monotonic() - started:.0f} s.")
        return 0, {"days": figures, "per": per, "preemptions_per_hour": round(spot_day.PREEMPTIONS_PER_HOUR, 3),
                   "interruptible_share": spot_day.INTERRUPTIBLE_SHARE}
    out = spot_day.report(figures, prices, per)
    say("The two days' bills ($), their failures and their pods' TTFT.")
    print(table(out))
    verdicts = spot_day.verdicts(out)
    for ok, text in verdicts:
        print(f"    {'PASS' if ok else 'FAIL'}  {text}")
    if (held := spot_day.held_line(out)) is not None:
        print(f"          {held}")
    spot = out["days"]["interruptible"]
    print(f"\n    Priced at the Vast.ai spec example's share ({spot_day.SPEC_EXAMPLE_SHARE:g} of on demand) the same "
          f"interruptible day is {out['cost_ratio_at_spec_example_price']:.2f} x the on-demand day.")
    print(f"\n    {spot['requests']} requests on interruptible pods, {spot['failed']} failed, {spot['cut']} cut mid-answer "
          f"by {spot['preemptions']} preemption(s), {spot['replaced']} pod(s) replaced by the keeper")
    say(f"Done in {time.monotonic() - started:.0f} s.")
    return (0 if all(ok for ok, _ in verdicts) else 1), out


def print_day(f: dict, demo: SpotDay) -> None:
    failures = [s for s in demo.served if not s.ok and not s.cut]
    print(f"    {f['requests']} requests, {f['failed']} failed, {f['cut']} cut mid-answer; {f['preemptions']} preemption(s), "
          f"{f['replaced']} replaced; {f['pod_hours']} pod-hours; fallback {100 * (f['fallback']['share'] or 0):.1f} %",
          flush=True)
    on_pods = [s for s in demo.served if s.ok and s.ttft_ms is not None and (s.backend or "").startswith("pod-")]
    away = [s for s in on_pods if s.cell != s.home]  # served by another cell's pods: the TTFT tail's usual cause
    if on_pods:
        def p99(xs: list[day.Served]) -> str:
            v = spot_day.quantile([s.ttft_ms for s in xs if s.ttft_ms is not None], 0.99)
            return "n/a" if v is None else f"{v:.0f} ms"
        print(f"      on pods: {len(away)} of {len(on_pods)} ({100 * len(away) / len(on_pods):.1f} %) served by another "
              f"cell's pods; TTFT p99 at home {p99([s for s in on_pods if s.cell == s.home])}, away {p99(away)}; "
              f"{sum(1 for s in on_pods if s.held)} held at a cell's edge while an update swapped its Worker", flush=True)
    back = f["back_in_service_min"]
    if back["n"]:  # a real replacement: the keeper's next pass, the boot, the update (seconds to a minute)
        boot = base.BOOT_S / 60
        print(f"      preempted pods served again after {back['p50']:.0f} min of the day (median; p90 {back['p90']:.0f}, "
              f"{back['n']} replaced), a {boot:.0f}-minute boot among it"
              + (f": the sandbox's own updates stretched it, so the day is not a real one. Fix: a longer day "
                 f"(--day-seconds, {DAY_S:.0f} s by default)" if back["p50"] > STRETCHED * boot else ""), flush=True)
        waited, took = f["waited_to_replace_min"], f["replace_took_min"]
        print(f"      each replacement began {waited['p50']:.0f} min of the day after its preemption (median; p90 "
              f"{waited['p90']:.0f}): the keeper's next pass, and any update of the cell still running (one at a "
              f"time: a pass waits while another boots or drains a pod); then it took {took['p50']:.0f} (median; "
              f"p90 {took['p90']:.0f}): the boot, the sandbox's update inside it as the cloud's seconds are",
              flush=True)
    by_fallback = [s for s in demo.served if s.backend == "fallback"]
    if by_fallback:  # where the fallback's spend comes from: which cell bought it, at which hours of the day
        cells = sorted({s.cell or "-" for s in by_fallback})
        print("      by the fallback: " + ", ".join(
            f"{c} {sum(1 for s in by_fallback if (s.cell or '-') == c)} (hours "
            + " ".join(f"{h:.1f}" for h in sorted(s.at_h for s in by_fallback if (s.cell or '-') == c)) + ")"
            for c in cells), flush=True)
    for s in failures[:10]:
        print(f"      failed: {s.at_h:.1f} h from {s.home}, cell {s.cell or '-'}, backend {s.backend or '-'}: {s.why}")


def table(out: dict) -> str:
    head = (f"    {'day':<14}{'pod-h':>7}{'$/pod-h':>9}{'pods':>9}{'fallback':>10}{'total':>9}{'fixed':>9}{'API only':>10}"
            f"{'fb share':>10}{'failed':>8}{'cut':>6}{'TTFT p50/p99 (ms)':>20}")
    lines = [head, "    " + "-" * (len(head) - 4)]
    for name in spot_day.DAYS:
        d = out["days"][name]
        c = d["cost"]
        share = "n/a" if d["fallback"]["share"] is None else f"{100 * d['fallback']['share']:.1f} %"
        ttft = f"{d['ttft_ms']['p50'] or 0:.0f}/{d['ttft_ms']['p99'] or 0:.0f}"
        lines.append(f"    {name:<14}{d['pod_hours']:>7.1f}{d['pod_per_hr']:>9.2f}{c['pods']:>9.2f}{c['fallback']:>10.2f}"
                     f"{c['autoscaled']:>9.2f}{c['fixed']:>9.2f}{c['api']:>10.2f}{share:>10}{d['failed']:>8}{d['cut']:>6}"
                     f"{ttft:>20}")
    return "\n".join(lines)
