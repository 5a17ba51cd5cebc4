"""``make demo``: the field story, told with real measurements from a running sandboxed cell.

    1. a cell in us-east, probed (the first touch pins us-east.g1 at IAD)
    2. compute moved to apac-tw by hand (region and pod moved, ledger untouched): the plan
       refuses it; forced through (sandbox only), the probe finds the state left in IAD
    3. the generation-rename migration: migrate start, up, probe (first touch of apac-tw.g2
       from TPE), migrate finish, up
    4. the probe again: state round trip about 10 ms, placement ok
    5. a before/after table of every segment, and the probe's plots

The demo works on a copy of stacks/Pulumi.sandbox.yaml inside its own state directory;
the committed stack files are never edited. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import stackfile
from ..errors import ConfigError
from . import supervisor
from .errors import SandboxError

STACK = "sandbox"
PROBE = supervisor.ROOT / "scripts" / "probe.py"
MIGRATE = supervisor.ROOT / "scripts" / "migrate.py"
SEGMENTS = ("e2e", "state", "state_rtt", "upstream", "pod_rtt", "total")
PROBE_TIMEOUT_S = 240.0


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def _py(argv: list[str], env: dict | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=supervisor.ROOT)


class Demo:
    def __init__(self, state_dir: Path, samples: int):
        self.state_dir = Path(state_dir).resolve()
        self.stacks_dir = self.state_dir / "stacks"
        self.samples = samples
        self.cell: dict | None = None
        self.results: dict[str, dict] = {}

    def fresh(self) -> None:
        """Stop a previous demo and start the story from nothing (its own copy of the stack)."""
        if self.state_dir.exists():
            supervisor.down(self.state_dir, quiet=True)
            for name in ("pins.json", "objects", "stacks", "probes"):
                target = self.state_dir / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "probes").mkdir(exist_ok=True)
        shutil.copyfile(stackfile.path_of(STACK), stackfile.path_of(STACK, self.stacks_dir))

    def up(self, force_split: bool = False) -> dict:
        # The first `up` starts the cell; every later one is a deploy to the running cell,
        # as `pulumi up` is: new pod before old, workerd swapped with no request dropped.
        if self.cell:
            self.cell = supervisor.apply(STACK, state_dir=self.state_dir, stacks_dir=self.stacks_dir,
                                         force_split=force_split)
        else:
            self.cell = supervisor.up(STACK, state_dir=self.state_dir, stacks_dir=self.stacks_dir,
                                      force_split=force_split)
        c = self.cell
        print(f"    cell up: {c['worker_url']}  region {c['region']}  Worker at {c['sites']['edge']}  "
              f"generation {c['generation']}" + (f" (draining {c['draining']})" if c["draining"] else "")
              + f"  objects hosted at {', '.join(c['sites']['objects'])}")
        return c

    def probe(self, label: str, expect_ok: bool) -> dict:
        c = self.cell
        out = self.state_dir / "probes" / f"{label}.json"
        png = self.state_dir / "probes" / f"{label}.png"
        proc = _py([str(PROBE), c["worker_url"], "--samples", str(self.samples), "--expect-region", c["region"],
                    "--pod-location", "local", "--json", str(out), "--plot", str(png)],
                   env={"COLOCATE_PROBE_TOKEN": c["token"]}, timeout=PROBE_TIMEOUT_S)
        if proc.returncode == 2 or not out.exists():
            raise SandboxError(f"probe.py failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
        result = json.loads(out.read_text())
        result["_exit"], result["_plot"] = proc.returncode, str(png)
        self.results[label] = result
        seg = result["segments"]
        place = result.get("placement", {})
        print(f"    probe exit {proc.returncode} ({'as expected' if (proc.returncode == 0) == expect_ok else 'UNEXPECTED'}): "
              f"{result.get('verdict')}")
        print(f"    state_rtt p50 {seg['state_rtt']['p50']:.1f} ms, state p50 {seg['state']['p50']:.1f} ms, "
              f"e2e p50 {seg['e2e']['p50']:.1f} ms; Worker ran at {place.get('ran')}, state object at {place.get('state')}")
        return result

    def migrate(self, *args: str) -> None:
        proc = _py([str(MIGRATE), *args, "--stack", STACK, "--stacks-dir", str(self.stacks_dir)])
        if proc.returncode != 0:
            raise SandboxError(f"migrate.py {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
        for line in proc.stdout.strip().splitlines()[:12]:
            print(f"    | {line}")

    def table(self, before: str, after: str) -> str:
        b, a = self.results[before]["segments"], self.results[after]["segments"]
        rows = [f"    {'segment':<10} {'before p50':>11} {'after p50':>10} {'difference':>11}  (ms)"]
        for name in SEGMENTS:
            if name in b and name in a:
                x, y = b[name]["p50"], a[name]["p50"]
                rows.append(f"    {name:<10} {x:>11.1f} {y:>10.1f} {y - x:>+11.1f}")
        rate_b, rate_a = self.results[before].get("fallback_rate", 0), self.results[after].get("fallback_rate", 0)
        rows.append(f"    {'fallback':<10} {rate_b:>10.0%} {rate_a:>10.0%}")
        return "\n".join(rows)


def run(state_dir: Path | None = None, samples: int = 15) -> int:
    demo = Demo(state_dir or supervisor.default_state_dir("demo"), samples)
    try:
        say("A fresh sandbox cell from a copy of stacks/Pulumi.sandbox.yaml "
            f"(state in {demo.state_dir}); the committed stack files stay untouched.")
        demo.fresh()

        say("1. A cell in us-east: Worker placed at IAD, state generation us-east.g1. The probe is its first touch.")
        demo.up()
        demo.probe("1-us-east", expect_ok=True)

        say("2. Compute moved to apac-tw the hand-rolled way: region and pod moved, the state name (ledger) kept.")
        stackfile.write_config(STACK, {"region": "apac-tw"}, demo.stacks_dir)
        try:
            supervisor.build_plan(supervisor.Launch(STACK, str(demo.stacks_dir), None, None, (), False))
            print("    the plan accepted the split (it should not have)")
            return 1
        except ConfigError as exc:
            print(f"    the plan refuses it:\n      {exc}")
        say("   Forcing it through anyway (sandbox only, --force-split) to see what the hand-rolled move does:")
        demo.up(force_split=True)
        demo.probe("2-split", expect_ok=False)

        say("3. The generation-rename migration: migrate start --to apac-tw, up, first touch from TPE, finish, up.")
        demo.migrate("start", "--to", "apac-tw")
        demo.up()
        demo.probe("3-draining", expect_ok=True)
        demo.migrate("finish")
        demo.up()

        say("4. The probe again, after the migration.")
        demo.probe("4-migrated", expect_ok=True)

        say("5. Before (state left behind) and after (state moved with compute), p50 per segment:")
        print(demo.table("2-split", "4-migrated"))
        print("    The router keeps breaker state in the isolate for stateTtlMs, so a routed request waits on the\n"
              "    object only when that cache is stale (state p50 0 in both); every refresh and every breaker\n"
              "    report pays state_rtt, which is what the migration cut.")
        print("\n    plots:")
        for label, result in demo.results.items():
            print(f"      {label}: {result['_plot']}")
        ok = demo.results["2-split"]["_exit"] == 1 and demo.results["4-migrated"]["_exit"] == 0
        say("Done." if ok else "Done, but a probe verdict was not the one the story expects (see above).")
        return 0 if ok else 1
    except (ConfigError, SandboxError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    finally:
        supervisor.down(demo.state_dir, quiet=True)
        print(f"\n    sandbox stopped; state kept in {demo.state_dir} (pins.json, probes/)", flush=True)
