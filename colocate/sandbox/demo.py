"""``make demo``: a cell moved the hand-rolled way, then by migration, as one user sees it, with real
measurements from a running sandboxed cell.

One client stays put (Tokyo, ``NRT``, unless ``--client-site``) while the cell moves:

    1  us-east      everything in us-east (Worker at IAD, state us-east.g1 at IAD, pod there)
    2  split        compute moved to apac-tw by hand, state left in IAD (the plan refuses it;
                    forced through, sandbox only), seen through two router settings:
                      colocate's router (``stateTtlMs`` 2000): the hot path does not wait on state
                      always-fresh (``colocate:worker.stateTtlMs: 0``): every request waits on the object
    3  migrated     the generation-rename migration (migrate start, up, first touch from TPE,
                    finish, up), then both router settings again

Then: the deadline miss rate at a deadline chosen from the measurements (phase 3 meets it,
phase 1 does not), a closing table (segment × phase, p50/p90) and one PNG (bars per phase,
stacked by segment). Every number comes from the probe's JSON of that phase.

The demo works on a copy of stacks/Pulumi.sandbox.yaml inside its own state directory;
the committed stack files are never edited. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from .. import stackfile
from ..cell import settings
from ..errors import ConfigError
from . import supervisor
from .errors import SandboxError
from .geography import site
from .statedir import DEMO_PLOT_FILE, OBJECTS_DIR, PINS_FILE, PROBES_DIR, STACKS_DIR

STACK = "sandbox"
PROBE = supervisor.ROOT / "scripts" / "probe.py"
MIGRATE = supervisor.ROOT / "scripts" / "migrate.py"
PROBE_TIMEOUT_S = 240.0
CLIENT_SITE = "NRT"
# The probe reads the sandbox's own credentials: none from the caller's environment may stand in.
TOKEN_VARIABLES = ("COLOCATE_ADMIN_TOKEN", "COLOCATE_READ_TOKEN", "COLOCATE_PROBE_TOKEN")
DEADLINE_STEP_MS = 50  # the deadline is a round number: the next multiple of this above phase 3's slowest e2e
# The demo's table, top to bottom: what the user sees first, then where it goes.
TABLE_ROWS = ("e2e", "total", "state", "upstream", "state_rtt", "pod_rtt", "pod_rtt_new")
# Both the probe's: pod_rtt the Worker's GET /health of pod 0 on its pooled connection, as requests
# find it; pod_rtt_new the same on a new connection (TCP, the mutual-TLS handshake, then the request),
# made by the sandbox closing the pod hop's connections first (colocate/probe/connections.py).


@dataclass(frozen=True)
class Phase:
    label: str  # file name under probes/
    title: str  # column heading
    fresh: bool  # stateTtlMs 0
    expect_ok: bool  # the probe's verdict the story expects


PHASES = (
    Phase("1-us-east", "1 us-east", False, True),
    Phase("2-split", "2 split", False, False),
    Phase("2-split-fresh", "2 split ttl0", True, False),
    Phase("3-migrated-fresh", "3 moved ttl0", True, True),
    Phase("3-migrated", "3 moved", False, True),
)


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def _py(argv: list[str], env: dict | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=supervisor.ROOT)


def _stop_probe(proc: subprocess.Popen) -> None:
    """Interrupted: let the probe revoke its key. A Ctrl-C at the terminal reached it too; a
    SIGTERM to the demo alone did not, so it gets a SIGTERM of its own (the probe treats it as
    Ctrl-C). Every wait is bounded."""
    for sig, wait_s in ((None, 2.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.0f} %"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def phase1(before: list[float], deadline: float, client_site: str) -> str:
    """What phase 1 did against the deadline, in words that stay true wherever the user sits."""
    rate = miss_rate(before, deadline)
    if not before or rate is None:
        return "phase 1 has no successful request to compare."
    if rate == 1.0:
        return (f"phase 1's fastest request took {min(before):.0f} ms: the {client_site}-to-IAD round trip "
                "alone does not fit.")
    return (f"phase 1 missed it for {rate * 100:.0f} % of requests (fastest {min(before):.0f} ms); "
            f"from {client_site} the us-east cell is close enough for the rest.")


def _probe_says(result: dict) -> str:
    """The probe's verdict in a few words, for the picture: what failed, or that all held."""
    said: list[str] = []
    for v in result.get("violations") or []:
        if v.get("kind") == "placement":
            what = f"{v.get('part')} placement"
        elif v.get("kind") == "budget":
            what = f"{v.get('segment')} over {v.get('budget_ms'):g} ms"
        else:
            what = str(v.get("kind"))
        if what not in said:
            said.append(what)
    if not said:
        return "probe: all checks hold"
    place = result.get("placement") or {}
    apart = place.get("state") and place.get("ran") and place["state"] != place["ran"]
    return "probe FAILS:\n" + ",\n".join(said) + (f"\n(Worker {place['ran']}, state {place['state']})" if apart else "")


def deadline_ms(e2e_after: list[float]) -> int:
    """The tightest round deadline 90 % of the post-migration requests met (their p90, between
    ranks): one request that a busy machine held up does not move it past phase 1's fastest."""
    return int(math.ceil(p90(e2e_after) / DEADLINE_STEP_MS) * DEADLINE_STEP_MS) if e2e_after else 0


def p90(values: list[float]) -> float:
    ranked = sorted(values)
    at = 0.9 * (len(ranked) - 1)
    low = int(at)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (ranked[high] - ranked[low]) * (at - low)


def miss_rate(e2e: list[float], deadline: float) -> float | None:
    return round(sum(1 for v in e2e if v > deadline) / len(e2e), 4) if e2e else None


class Demo:
    def __init__(self, state_dir: Path, samples: int, client_site: str = CLIENT_SITE):
        self.state_dir = Path(state_dir).resolve()
        self.stacks_dir = self.state_dir / STACKS_DIR
        self.samples = samples
        self.client_site = client_site
        self.cell: dict | None = None
        self.results: dict[str, dict] = {}

    def fresh(self) -> None:
        """Stop a previous demo and start the story from nothing (its own copy of the stack)."""
        if self.state_dir.exists():
            supervisor.down(self.state_dir, quiet=True)
            for name in (PINS_FILE, OBJECTS_DIR, STACKS_DIR, PROBES_DIR):
                target = self.state_dir / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / PROBES_DIR).mkdir(exist_ok=True)
        shutil.copyfile(stackfile.path_of(STACK), stackfile.path_of(STACK, self.stacks_dir))

    def set_config(self, **updates: object) -> None:
        stackfile.write_config(STACK, updates, self.stacks_dir)

    def up(self, why: str, force_split: bool = False) -> dict:
        # The first `up` starts the cell; every later one is a deploy to the running cell,
        # as `pulumi up` is: new pod before old, workerd swapped with no request dropped.
        print(f"    deploying: {why} ...", flush=True)
        t0 = time.monotonic()
        if self.cell:
            self.cell = supervisor.apply(STACK, state_dir=self.state_dir, stacks_dir=self.stacks_dir,
                                         force_split=force_split)
        else:
            self.cell = supervisor.up(STACK, state_dir=self.state_dir, stacks_dir=self.stacks_dir,
                                      client_site=self.client_site, force_split=force_split)
        c = self.cell
        print(f"    deployed in {time.monotonic() - t0:.1f} s: region {c['region']}, Worker at {c['sites']['edge']}, "
              f"generation {c['generation']}" + (f" (draining {c['draining']})" if c["draining"] else "")
              + f", objects at {', '.join(c['sites']['objects'])}; client at {c['sites']['client']}", flush=True)
        return c

    def touch(self) -> None:
        """One probe request: the first touch of a new generation, from where the Worker runs."""
        c = self.cell
        t0 = time.monotonic()
        r = requests.get(c["worker_url"] + "/_colocate/probe", timeout=30,
                         headers={"Authorization": f"Bearer {c['token']}"})
        ms = (time.monotonic() - t0) * 1000
        body = r.json() if r.ok else {}
        # Its time includes the import of the draining generation across the ocean.
        print(f"    first touch: generation {body.get('generation')} created at {body.get('state_colo')} "
              f"(Worker at {body.get('worker_colo')}), {ms:.0f} ms with the import from the draining generation")

    def probe(self, phase: Phase) -> dict:
        c = self.cell
        out = self.state_dir / PROBES_DIR / f"{phase.label}.json"
        out.unlink(missing_ok=True)
        print(f"    probing as a user at {c['sites']['client']}: {self.samples} routed + {self.samples} probe samples "
              f"+ {self.samples} on new pod connections + {max(1, self.samples // 5)} streamed answers of about 200 tokens",
              flush=True)
        # The probe reads with the read token and mints its own short-lived client key with the
        # admin token, then revokes it.
        # Its stderr (progress, the key's id, never the key) is shown as it comes: no silent wait.
        tail: list[str] = []
        # The probe reads the running sandbox itself (URL, token, pods, the stack copy's region and
        # budgets), so the commands it prints name this sandbox's stack and its stack directory.
        with subprocess.Popen(
            [sys.executable, str(PROBE), "--state-dir", str(self.state_dir), "--samples", str(self.samples),
             "--streams", str(max(1, self.samples // 5)), "--json", str(out)],
            env={k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}, cwd=supervisor.ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ) as proc:
            try:
                for line in proc.stderr:
                    tail.append(line.rstrip())
                    if line.startswith("  ") and ("samples" in line or "client key" in line):
                        print(f"    |{line.rstrip()}", flush=True)
                proc.wait(timeout=PROBE_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    _stop_probe(proc)
                    for line in (proc.stderr.read() or "").splitlines():  # it has exited: say what it revoked
                        if "client key" in line:
                            print(f"    |{line}", flush=True)
        if proc.returncode == 2 or not out.exists():
            raise SandboxError(f"probe.py failed (exit {proc.returncode}): {' | '.join(tail[-6:])}")
        result = json.loads(out.read_text())
        result["_exit"] = proc.returncode
        self.results[phase.label] = result
        seg = result["segments"]
        place = result.get("placement", {})
        as_expected = "as expected" if (proc.returncode == 0) == phase.expect_ok else "UNEXPECTED"
        print(f"    probe exit {proc.returncode} ({as_expected}): {result.get('verdict')}")
        print(f"    e2e p50 {_ms(seg['e2e']['p50'])} ms; the router waited on state (state) p50 "
              f"{_ms(seg['state']['p50'])} ms; state_rtt p50 {_ms(seg['state_rtt']['p50'])} ms; "
              f"Worker at {place.get('ran')}, state object at {place.get('state')}")
        print(f"    a 200-token streamed answer: first token (ttft) p50 {_ms(seg['ttft']['p50'])} ms, then one every "
              f"{_ms(seg['itl']['p50'])} ms (itl p50)")
        return result

    def migrate(self, *args: str) -> None:
        proc = _py([str(MIGRATE), *args, "--stack", STACK, "--stacks-dir", str(self.stacks_dir)])
        if proc.returncode != 0:
            raise SandboxError(f"migrate.py {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
        for line in proc.stdout.strip().splitlines()[:8]:
            print(f"    | {line}")

    # --- the closing numbers -----------------------------------------------------------

    def e2e_values(self, label: str) -> list[float]:
        return list((self.results[label].get("values_ms") or {}).get("e2e") or [])

    def table(self, deadline: int) -> str:
        heads = [p.title for p in PHASES]
        width = max(13, *(len(h) + 2 for h in heads))
        lines = [f"    {'segment':<14}" + "".join(f"{h:>{width}}" for h in heads) + "   (ms, p50/p90)"]
        lines.append("    " + "-" * (14 + width * len(heads)))
        for name in TABLE_ROWS:
            cells = []
            for p in PHASES:
                s = self.results[p.label]["segments"][name]
                cells.append(f"{_ms(s['p50'])}/{_ms(s['p90'])}")
            lines.append(f"    {name:<14}" + "".join(f"{c:>{width}}" for c in cells))
        miss = [_pct(miss_rate(self.e2e_values(p.label), deadline)) for p in PHASES]
        lines.append(f"    {f'miss {deadline} ms':<14}" + "".join(f"{c:>{width}}" for c in miss) + "   (% of requests)")
        routed = [_pct(self.results[p.label].get("fallback_rate")) for p in PHASES]
        lines.append(f"    {'router fallbk':<14}" + "".join(f"{c:>{width}}" for c in routed) + "   (% of requests)")
        return "\n".join(lines)

    def bars(self) -> list[dict]:
        """Per phase, the p50 e2e split into what it is made of (ms)."""
        out = []
        for p in PHASES:
            seg = self.results[p.label]["segments"]
            e2e, total = seg["e2e"]["p50"] or 0.0, seg["total"]["p50"] or 0.0
            state, upstream, fallback = (seg[n]["p50"] or 0.0 for n in ("state", "upstream", "fallback"))
            result = self.results[p.label]
            out.append({"phase": p.title, "e2e": e2e, "state_rtt": seg["state_rtt"]["p50"],
                        "probe_ok": result.get("_exit") == 0, "probe_says": _probe_says(result),
                        "network (client to Worker)": max(0.0, e2e - total),
                        "state wait": state,
                        "pod (upstream)": upstream,
                        "fallback": fallback,
                        "Worker, other": max(0.0, total - state - upstream - fallback)})
        return out

    def plot(self, path: Path, deadline: int) -> Path:
        from . import demo_plot  # matplotlib only here

        return demo_plot.write(self.bars(), path, deadline, self.client_site)


def run(state_dir: Path | None = None, samples: int = 10, client_site: str = CLIENT_SITE) -> int:
    try:
        client_site = site(client_site, "--client-site")  # before anything starts
    except (ConfigError, SandboxError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return exc.exit_code
    demo = Demo(state_dir or supervisor.default_state_dir("demo"), samples, client_site)
    started = time.monotonic()
    try:
        say(f"One user in {client_site} who stays put, and a cell that moves. A fresh sandbox cell from a copy of "
            f"stacks/Pulumi.sandbox.yaml (state in {demo.state_dir}); the committed stack files stay untouched.")
        demo.fresh()

        say("1. Everything in us-east: Worker at IAD, state generation us-east.g1 (first touched from IAD), pod there.")
        demo.up("the cell in us-east")
        demo.probe(PHASES[0])

        say("2. Compute moved to apac-tw the hand-rolled way: region and pod moved, the state name (ledger) kept.")
        demo.set_config(region="apac-tw")
        try:
            supervisor.build_plan(supervisor.Launch(STACK, str(demo.stacks_dir), client_site, None, (), False))
            print("    the plan accepted the split (it should not have)")
            return 1
        except ConfigError as exc:
            print(f"    the plan refuses it:\n      {exc}")
        say("2a. Forced through anyway (sandbox only, --force-split), seen with colocate's router: the hot path "
            "uses the isolate's copy of state (stateTtlMs 2000) and does not wait on the object.")
        demo.up("region apac-tw, state left in IAD (--force-split)", force_split=True)
        demo.probe(PHASES[1])
        say("2b. The same split with colocate:worker.stateTtlMs: 0 (always read fresh state: consistency over "
            "latency), as a router that reads state before every forward does: every request waits on the object.")
        demo.set_config(**{"worker.stateTtlMs": 0})
        demo.up("stateTtlMs 0", force_split=True)
        demo.probe(PHASES[2])

        say("3. The generation-rename migration: migrate start --to apac-tw, up, first touch from TPE, finish, up.")
        demo.migrate("start", "--to", "apac-tw")
        demo.up("migration started: apac-tw.g2 active, us-east.g1 draining")
        demo.touch()
        demo.migrate("finish")
        demo.up("migration finished")
        say("3a. After the migration, stateTtlMs 0 (every request still waits on the object, now next door).")
        demo.probe(PHASES[3])
        ttl = settings.WORKER_DEFAULTS["stateTtlMs"]
        say(f"3b. After the migration, colocate's router (stateTtlMs back to its default, {ttl}).")
        demo.set_config(**{"worker.stateTtlMs": ttl})
        demo.up(f"stateTtlMs {ttl}")
        demo.probe(PHASES[4])

        after = demo.e2e_values(PHASES[3].label) + demo.e2e_values(PHASES[4].label)
        deadline = deadline_ms(after)
        before = demo.e2e_values(PHASES[0].label)
        say(f"The same user in {client_site}, every phase: p50/p90 per segment in ms.")
        print(demo.table(deadline))
        print(f"""
    e2e    what the user measures: from sending the request to the last byte of the answer, on the
           user's clock, over a kept-alive connection; it includes the user-to-Worker network both ways.
    total  the Worker's own time for the request (Server-Timing): from its arrival at the Worker to the
           answer leaving it; e2e - total is the network between the user and the Worker.
    state  how long the Worker waited on the state object before forwarding (0: it used its copy);
    state_rtt  one round trip Worker <-> state object; upstream  the pod's answer as the Worker saw it;
    pod_rtt  one GET /health Worker <-> pod, on the Worker's pooled mutual-TLS connection;
    pod_rtt_new  the same on a new connection: TCP, the TLS handshake, then the request.
    miss {deadline} ms  the share of requests slower than {deadline} ms end to end, the deadline a client
           (or a router in front of it) would fall back to a paid API at. {deadline} ms is the next multiple of
           {DEADLINE_STEP_MS} ms above 90 % of the requests after the migration (p90 {p90(after):.0f} ms), so phase 3
           meets it (its row says for how many); {phase1(before, deadline, client_site)}
    router fallbk  the share the router itself sent to the fallback (x-colocate-backend: fallback),
           at colocate:worker.deadlineMs.""")
        png = demo.plot(demo.state_dir / PROBES_DIR / DEMO_PLOT_FILE, deadline)
        print(f"\n    plot (bars per phase, stacked by segment): {png}")
        ok = all((demo.results[p.label]["_exit"] == 0) == p.expect_ok for p in PHASES)
        say(f"Done in {time.monotonic() - started:.0f} s." if ok else
             "Done, but a probe verdict was not the one the story expects (see above).")
        return 0 if ok else 1
    except (ConfigError, SandboxError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        supervisor.down(demo.state_dir, quiet=True)
        print(f"\n    sandbox stopped; state kept in {demo.state_dir} (pins.json, probes/)", flush=True)
