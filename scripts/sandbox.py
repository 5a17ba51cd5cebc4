#!/usr/bin/env python3
"""Run one colocate cell on this machine: workerd, a local pod, an emulated geography.

    sandbox.py up     [--stack S] [--state-dir DIR] [--stacks-dir DIR] [--client-site COLO]
                      [--stretch 1.55] [--rtt A:B=MS ...] [--force-split]
    sandbox.py apply  [--stack S] [--state-dir DIR] [--stacks-dir DIR] [--force-split]
    sandbox.py down   [--stack S] [--state-dir DIR]
    sandbox.py status [--stack S] [--state-dir DIR]     (neither: every sandbox that runs)
    sandbox.py pod-command [--stack S] [--state-dir DIR] [--model M] [-- VLLM_ARGS ...]

--stack defaults to ``sandbox`` (stacks/Pulumi.sandbox.yaml) and --state-dir to
.colocate/sandbox/<stack>/; a sandbox started with --state-dir DIR is named by the same
--state-dir DIR in every later command, and every command it prints carries it.
    sandbox.py demo   [--state-dir DIR] [--samples N] [--client-site COLO]
    sandbox.py up     --fleet F [--client-site COLO ...] [--sandboxes-dir DIR] [--stretch 1.55] [--rtt A:B=MS ...]
    sandbox.py apply|down|status --fleet F [--sandboxes-dir DIR]  (or --stack F: a fleet stack acts on the whole fleet)
    sandbox.py demo-fleet [--state-dir DIR] [--samples N]
    sandbox.py demo-autoscale [--state-dir DIR] [--json] [--shape FILE] [--prices POD_PER_HR,API_PER_1M]
    sandbox.py demo-spot [--state-dir DIR] [--json] [--shape FILE] [--seed N] [--spare N]

``up`` prints one JSON object (worker_url, pod_url, token, state_dir, sites, pids, ...);
``apply`` is the running cell's ``pulumi up``: it re-plans from the stack file, creates the
new pod before deleting the old one and swaps workerd without dropping a request;
``status`` prints what runs and whether it is healthy; ``down`` stops everything;
``pod-command`` prints the command that starts vLLM as the cell's pod at ``colocate:pod.url``,
with the cell's certificates and pod token (read from files in the state directory). A second
``up`` with the same options, or a ``down`` of a stopped sandbox, exits 0 with a one-line note.
A ``status`` or ``apply`` that finds no sandbox where it looked exits 1 (``apply``: 2), as does a
``down`` where no sandbox was ever started while one runs elsewhere; each names the sandboxes
that do run. With
``--fleet F`` (a fleet stack, docs/fleet.md) each acts on every member cell and the front
door: ``up --fleet`` prints one JSON object with an entry URL per client site, the cells and
one client key that works fleet-wide. Exit 0 on
success, 1 when ``status`` finds the sandbox unhealthy or nothing running, ``down`` finds no
sandbox ever started where it looked while one runs elsewhere, or ``demo`` fails a step, 2 on a
usage or configuration error (including an ``up`` with other options of a sandbox that runs).
Printed commands name this script by absolute path: they run as pasted anywhere. See docs/sandbox.md.
"""

# A Ctrl-C while Python loads the kit is held until the imports are done, then ends the
# command: nothing has started yet. Raised inside the import machinery it could land in a
# callback whose exception Python only prints ("Exception ignored in ... _get_module_lock
# ... KeyboardInterrupt"), and the command would go on as if no key had been pressed.
# The handler is this file's first statement, through _signal (built in, it imports nothing):
# the only window left is the interpreter's own start-up, before this file runs, where Python
# itself reports the KeyboardInterrupt and exits 1 with nothing started.
import _signal  # type: ignore[import-not-found]  # built in, and typeshed has no stub for it
import sys

_held: list[int] = []
_loading = _signal.signal(_signal.SIGINT, lambda signum, _frame: _held.append(signum))

import argparse
import difflib
import json
import signal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import stackfile
from colocate.cli import Parser, subcommands  # main's own `cli` flag is another thing
from colocate.errors import ConfigError
from colocate.sandbox import errors as supervisor_errors, fleet as sandbox_fleet, supervisor
from colocate.sandbox.errors import SandboxError
from colocate.sandbox.statedir import FLEET_OUT_FILE, LAUNCH_FILE, LOGS_DIR, READY_FILE, read_json  # noqa: E402

if _held:
    print("sandbox.py: interrupted while loading, before doing anything", file=sys.stderr)
    sys.exit(130)
_signal.signal(_signal.SIGINT, _loading)

DEFAULT_STACK = "sandbox"


def day_flags(p: argparse.ArgumentParser, demo: str, figures: str, day_s: float) -> None:
    """The flags demo-autoscale and demo-spot share: where, how printed, the day's shape and its length."""
    p.add_argument("--state-dir", type=Path, help=f"state directory (default .colocate/sandbox/{demo}/)")
    p.add_argument("--json", action="store_true", help=f"print {figures} as one JSON object (the story to stderr)")
    p.add_argument("--shape", type=Path, metavar="FILE",
                   help="the day: a CSV of cell,hour,requests_per_minute (hours 0-23 in the cell's local time)")
    p.add_argument("--day-seconds", type=float, default=day_s, metavar="S",
                   help=f"wall seconds the day is compressed into (default {day_s:g})")
    p.add_argument("--requests", type=int, default=900, help=argparse.SUPPRESS)  # tests: fewer requests


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="sandbox.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = subcommands(p, dest="cmd", required=True)

    def where(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--stack", default=DEFAULT_STACK, help=f"stack name (default {DEFAULT_STACK})")
        sp.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/<stack>/)")

    u = sub.add_parser("up", help="start the cell and print its JSON")
    where(u)
    u.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help="where Pulumi.<stack>.yaml lives")
    u.add_argument("--client-site", metavar="COLO", action="append", default=[],
                   help="the client's colo (default: the cell's edge site); with --fleet repeatable: one entry URL "
                        "per site (default: each cell's edge site)")
    u.add_argument("--fleet", metavar="F", help="run a fleet stack: every member cell and the front door")
    u.add_argument("--sandboxes-dir", type=Path,
                   help="with --fleet: where each cell's state directory goes, DIR/<cell> (default .colocate/sandbox)")
    u.add_argument("--stretch", type=float, help="path stretch over the physical floor (default 1.55)")
    u.add_argument("--rtt", action="append", default=[], metavar="A:B=MS", help="override one pair's round trip; repeatable")
    u.add_argument("--force-split", action="store_true",
                   help="sandbox only: accept a stack whose state and compute are split (reproduces a hand-rolled move)")
    u.add_argument("--timeout", type=float, default=supervisor.UP_TIMEOUT_S, help=argparse.SUPPRESS)
    a = sub.add_parser("apply", help="deploy the stack file's changes to the running cell, dropping no request (its `pulumi up`)")
    where(a)
    a.add_argument("--stacks-dir", type=Path, help="where Pulumi.<stack>.yaml lives (default: as at `up`)")
    a.add_argument("--force-split", action="store_true", help="as for up")
    a.add_argument("--timeout", type=float, default=supervisor.UP_TIMEOUT_S, help=argparse.SUPPRESS)
    a.add_argument("--fleet", metavar="F", help="apply every member cell of a running fleet, then its front door")
    a.add_argument("--sandboxes-dir", type=Path, help="with --fleet: where `up --fleet` was told to put it")
    dn = sub.add_parser("down", help="stop everything the sandbox started")
    where(dn)
    dn.add_argument("--fleet", metavar="F", help="stop a fleet: its front door and every member cell")
    dn.add_argument("--sandboxes-dir", type=Path, help="with --fleet: where `up --fleet` was told to put it")
    dn.add_argument("--stacks-dir", type=Path, help="where Pulumi.<stack>.yaml lives (to tell a typo from a stack)")
    st = sub.add_parser("status", help="print what runs, with health (no --stack: every sandbox that runs)")
    st.add_argument("--stack", help="stack name (default: list every sandbox under .colocate/sandbox/)")
    st.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/<stack>/)")
    st.add_argument("--stacks-dir", type=Path, help="where Pulumi.<stack>.yaml lives (to tell a typo from a stack)")
    st.add_argument(
        "--fleet", metavar="F", help="a fleet: every member cell, then the front door (exit 1 if a part is unhealthy)"
    )
    st.add_argument("--sandboxes-dir", type=Path, help="with --fleet: where `up --fleet` was told to put it")
    pc = sub.add_parser("pod-command", help="print the command that starts vLLM as the cell's pod at colocate:pod.url, "
                                            "with the cell's certificates and token (docs/sandbox.md)")
    where(pc)
    pc.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help="where Pulumi.<stack>.yaml lives")
    pc.add_argument("--model", help="the model vLLM loads (default colocate:pod.model); it serves it as colocate:pod.model")
    pc.add_argument("extra", nargs="*", metavar="VLLM_ARGS", help="more arguments for vLLM, after --")
    d = sub.add_parser("demo", help="a cell moved the hand-rolled way, then by migration, seen from Tokyo (make demo)")
    d.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/demo/)")
    d.add_argument("--samples", type=int, default=10, help="probe samples per step (default 10: enough for the p50/p90 table)")
    d.add_argument("--client-site", default="NRT", metavar="COLO",
                   help="where the one user of the story sits, a colo code (default NRT, Tokyo)")
    df = sub.add_parser("demo-fleet", help="three cells behind one front door, one cell losing its pods (make demo-fleet)")
    df.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/demo-fleet/)")
    df.add_argument("--samples", type=int, default=12, help="requests per client site and phase (default 12)")
    da = sub.add_parser("demo-autoscale", help="a compressed day of three cells whose pods follow demand, priced three "
                                               "ways (make demo-autoscale)")
    day_flags(da, "demo-autoscale", "the day's figures", 150.0)
    da.add_argument("--prices", metavar="POD_PER_HR,API_PER_1M",
                    help="a pod's $ per hour and the API's $ per 1M tokens (default 0.6,0.3)")
    ds = sub.add_parser("demo-spot", help="demo-autoscale's day on demand and on interruptible pods preempted at a "
                                          "published rate, side by side, priced against each other (make demo-spot)")
    # 600: a day long enough that the sandbox's own updates (seconds each) leave a replacement's 20-minute
    # boot about what it is (colocate/sandbox/spot_demo.py DAY_S; not imported here, for every command's start)
    day_flags(ds, "demo-spot", "both days' figures", 600.0)
    ds.add_argument("--seed", type=int, default=1, help="the seed of the pods' lives (default 1)")
    ds.add_argument("--spare", type=int, default=1, help="colocate:pod.spare on the interruptible day (default 1)")
    # tests: one day alone (colocate.scaling.spot_day.DAYS; not imported here, for every other command's start)
    ds.add_argument("--day", choices=("ondemand", "interruptible"), help=argparse.SUPPRESS)
    # tests: seconds of the day between the keepers' passes (fewer passes on a short day)
    ds.add_argument("--keep-interval", type=float, default=None, help=argparse.SUPPRESS)
    return p


CMD = supervisor.SANDBOX_CMD


class UnknownStack(SandboxError):
    pass


def _where_flags(args, state_dir: Path, stack: str | None = None) -> str:
    """The flags that name this sandbox again in a printed command: always its stack (the one
    that runs there, not the command's default), and the state directory when it is not that
    stack's default, so a printed ``up`` never starts another stack in it."""
    return supervisor.where_command(state_dir, stack or getattr(args, "stack", None) or DEFAULT_STACK)


def _others(exclude: Path | None = None, verb: str = "status") -> str:
    return supervisor.where_sandboxes_run(exclude, verb)


def _state_dir(args) -> Path:
    """The state directory the command names. An unknown ``--stack`` (no stack file and no
    sandbox state for it) is an error, so a typo never reports "stopped" for the wrong cell."""
    if args.state_dir:
        return args.state_dir
    stack = args.stack or DEFAULT_STACK
    state_dir = supervisor.default_state_dir(stack)
    stacks_dir = getattr(args, "stacks_dir", None) or stackfile.STACKS_DIR
    if not stackfile.path_of(stack, stacks_dir).exists() and not state_dir.exists():
        known = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in Path(stacks_dir).glob("Pulumi.*.yaml"))
        close = difflib.get_close_matches(stack, known, n=1)
        fix = f"did you mean `--stack {close[0]}`? Known stacks" if close else "one of"
        raise UnknownStack(f"--stack {stack!r}: unknown stack (no {stackfile.path_of(stack, stacks_dir)} and no "
                           f"sandbox state in {state_dir}). Fix: {fix} {', '.join(known) or 'none'}; {_others()}")
    return state_dir


def _up_summary(out: dict, args) -> str:
    where = _where_flags(args, Path(out["state_dir"]), out.get("stack"))
    key = out.get("key")
    use = (f"; client key {key}: OpenAI(base_url=\"{out['worker_url']}/v1\", api_key=\"{key}\")" if key else "")
    return (f"sandbox.py up: stack {out['stack']} ({out['region']}) serves at {out['worker_url']}{use}. "
            f"Next: `{CMD} status {where}`, then `{CMD} down {where}`")


def _up_again(exc: supervisor_errors.AlreadyRunning, args, state_dir: Path) -> int:
    """A second ``up`` of what already runs, as it was started: the running cell's JSON and a
    one-line note, exit 0. Started otherwise (another site, geography or stacks directory): refused."""
    ready = read_json(Path(state_dir).resolve() / READY_FILE) if exc.same else None
    if not ready:
        raise exc
    print(json.dumps(ready, indent=2, sort_keys=True), flush=True)
    where = _where_flags(args, Path(ready["state_dir"]), ready.get("stack"))
    print(f"sandbox.py up: stack {ready.get('stack')} already runs in {ready['state_dir']} as asked; nothing started. "
          f"Next: `{CMD} status {where}`, or `{CMD} apply {where}` to deploy a changed stack file", file=sys.stderr)
    return 0


def _unhealthy_parts(out: dict) -> list[str]:
    """What is wrong, once per cause: a pod whose process is gone is not also "not answering"."""
    health = out.get("health") or {}
    pids = out.get("pids") or {}
    dead = [k for k, ok in (health.get("processes") or {}).items() if not ok]
    parts = [f"{k} (pid {pids.get(k)}) is not running" for k in dead]
    if health.get("worker_probe") is False:
        parts.append(f"the Worker's probe answered {health.get('worker_status') or 'nothing'}")
    if health.get("pod") is False and not any(k == "pod" or k.startswith("pod-") for k in dead):
        parts.append("a pod does not answer /health")
    if health.get("network") is False:
        parts.append("the network proxy does not answer")
    return parts


def _status_summary(out: dict, args) -> str:
    where = _where_flags(args, Path(out["state_dir"]), out.get("stack"))
    if not out["running"]:
        return (f"sandbox.py status: nothing runs in {out['state_dir']} (start it: `{CMD} up {where}`); "
                f"{_others(Path(out['state_dir']))}")
    if out.get("healthy"):
        return (f"sandbox.py status: stack {out.get('stack')} runs at {out.get('worker_url')}, healthy. "
                f"Next: `{CMD} down {where}` when done")
    bad = _unhealthy_parts(out)
    return (f"sandbox.py status: stack {out.get('stack')} runs but is UNHEALTHY: {'; '.join(bad) or 'still starting'}; "
            f"logs in {Path(out['state_dir']) / LOGS_DIR}. Next: `{CMD} down {where}`, then `{CMD} up {where}`")


def _status_all() -> int:
    found = [supervisor.status(d) for d in supervisor.running_sandboxes()]
    print(json.dumps({"sandboxes": found}, indent=2, sort_keys=True))
    if not found:
        print("sandbox.py status: no sandbox runs (looked under .colocate/sandbox/ and in every --state-dir `up` was "
              f"given). Next: `{CMD} up --stack {DEFAULT_STACK}`, or `{CMD} up --state-dir DIR` for one in DIR",
              file=sys.stderr)
        return 0
    for out in found:
        d = Path(out["state_dir"])
        print(f"sandbox.py status: {d}: {out.get('worker_url')}, "
              f"{'healthy' if out.get('healthy') else 'UNHEALTHY'} (`{CMD} status {supervisor.where_command(d)}`)",
              file=sys.stderr)
    return 0 if all(o.get("healthy") for o in found) else 1


_swallowed: list[BaseException] = []  # interrupts Python could only report as "Exception ignored"


def _unraisable(info) -> None:
    # A Ctrl-C that lands inside a finaliser or weakref callback (e.g. importlib's module
    # lock clean-up) cannot propagate: Python would print "Exception ignored" with a
    # traceback and carry on as if nothing happened. Keep it, and honour it below.
    if isinstance(info.exc_value, KeyboardInterrupt):
        _swallowed.append(info.exc_value)
        return
    sys.__unraisablehook__(info)


def _interrupted(signum, _frame):
    # The first Ctrl-C (or SIGTERM) interrupts; later ones are ignored so that the cleanup
    # it starts is never cut short (every cleanup is bounded by timeouts).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _pod_command(args) -> str:
    """``pod-command``: the stack's pod 0 as vLLM started by hand at colocate:pod.url (a server the sandbox
    does not start or stop: `up` waits for it, `down` leaves it running)."""
    from colocate.pods.spec import PodSpec
    from colocate.sandbox import engine
    from colocate.sandbox.launch import Launch, build_plan

    state_dir = Path(args.state_dir or supervisor.default_state_dir(args.stack)).resolve()
    plan, _ = build_plan(Launch(args.stack, str(Path(args.stacks_dir).resolve()), None, None, (), False))
    if not plan.pods or not plan.pods[0].settings.url or plan.pods[0].settings.command:
        raise UnknownStack(f"{args.stack}: colocate:pod.url is not set (or colocate:pod.command is: the sandbox starts "
                           "that itself). Fix: pulumi config set --path colocate:pod.url https://localhost:8000 on the "
                           "stack, then run this again")
    return engine.vllm_command(state_dir, PodSpec.from_dict(plan.pods[0].spec()), args.model, tuple(args.extra))


def _fleet_of(args) -> str | None:
    """The fleet a command names: ``--fleet F``, or ``--stack F`` where F is a fleet stack
    (its stack file has colocate:fleet) or a fleet's state directory."""
    if args.cmd not in ("up", "down", "status", "apply"):
        return None
    if getattr(args, "fleet", None):
        return args.fleet
    stack = getattr(args, "stack", None)
    if not stack:
        return None
    from colocate.fleet import plan as fleet_cfg

    stacks_dir = getattr(args, "stacks_dir", None) or stackfile.STACKS_DIR
    if stackfile.path_of(stack, stacks_dir).exists():
        raw, _ = stackfile.read_config(stack, stacks_dir)
        return stack if fleet_cfg.is_fleet(raw) else None
    return stack if sandbox_fleet.is_fleet_dir(args.state_dir or supervisor.default_state_dir(stack)) else None


def _fleet_dir(args, fleet: str) -> Path:
    if args.state_dir:
        return args.state_dir
    parent = getattr(args, "sandboxes_dir", None)
    return (Path(parent) / fleet) if parent else supervisor.default_state_dir(fleet)


def _fleet_problems(out: dict) -> str:
    return "; ".join(out.get("problems") or []) or "still starting"


def _fleet_command(args, fleet: str, state_dir: Path) -> int:
    where = f"--fleet {fleet}" + (f" --state-dir {state_dir}" if Path(state_dir).resolve() !=
                                  supervisor.default_state_dir(fleet).resolve() else "")
    if getattr(args, "force_split", False):
        raise UnknownStack("--force-split: a fleet's cells run as their stack files say. Fix: leave it out, or "
                           "force a split on one cell with `up --stack CELL --force-split`")
    if args.cmd == "up":
        try:
            try:
                out = sandbox_fleet.up(fleet, state_dir=state_dir, stacks_dir=args.stacks_dir,
                                       sandboxes_dir=args.sandboxes_dir, client_sites=tuple(args.client_site),
                                       stretch=args.stretch, rtt=tuple(args.rtt), timeout_s=args.timeout)
            except supervisor_errors.AlreadyRunning as exc:
                ready = read_json(Path(state_dir).resolve() / FLEET_OUT_FILE) if exc.same else None
                if not ready:
                    raise
                print(json.dumps(ready, indent=2, sort_keys=True), flush=True)
                print(f"sandbox.py up: the fleet {fleet} already runs in {ready['state_dir']} as asked; nothing started. "
                      f"Next: `{CMD} status {where}`", file=sys.stderr)
                return 0
            if _swallowed:
                raise KeyboardInterrupt
            print(json.dumps(out, indent=2, sort_keys=True), flush=True)
        except KeyboardInterrupt:
            with sandbox_fleet.deferred_signals():
                sandbox_fleet.down(state_dir)
            raise
        entries = ", ".join(f"{k} {v}" for k, v in out["entries"].items())
        print(f"sandbox.py up: fleet {fleet} ({', '.join(c['name'] for c in out['cells'])}) serves at {entries}; "
              f"client key {out['key']} works at every entry. Next: `{CMD} status {where}`, then `{CMD} down {where}`",
              file=sys.stderr)
        return 0
    if not sandbox_fleet.is_fleet_dir(state_dir):
        if args.cmd == "down" or args.cmd == "status":
            print(json.dumps({"fleet": fleet, "state_dir": str(state_dir), "running": False, "was_running": False}))
            print(f"sandbox.py {args.cmd}: no fleet was started in {state_dir}; {_others()}", file=sys.stderr)
            return 1
        raise supervisor_errors.NotRunning(f"no fleet runs in {state_dir}; start one with `{CMD} up {where}`")
    if args.cmd == "down":
        out = sandbox_fleet.down(state_dir)
        print(json.dumps(out, sort_keys=True))
        said = "stopped" if out["was_running"] else "nothing was running in"
        print(f"sandbox.py down: {said} the fleet {fleet} in {state_dir} (front door and "
              f"{len(out['cells'])} cells)", file=sys.stderr)
        return 0 if not out["running"] else 1
    if args.cmd == "status":
        out = sandbox_fleet.status(state_dir)
        print(json.dumps(out, indent=2, sort_keys=True))
        if out["healthy"]:
            print(f"sandbox.py status: fleet {fleet} is healthy at {', '.join((out.get('entries') or {}).values())}. "
                  f"Next: `{CMD} down {where}` when done", file=sys.stderr)
            return 0
        if not out["running"] and not any(c.get("running") for c in out["cells"]):
            print(f"sandbox.py status: the fleet {fleet} does not run in {state_dir}. Next: `{CMD} up {where}`",
                  file=sys.stderr)
            return 0
        print(f"sandbox.py status: fleet {fleet} runs but is UNHEALTHY: {_fleet_problems(out)}. Next: "
              f"`{CMD} down {where}`, then `{CMD} up {where}`", file=sys.stderr)
        return 1
    out = sandbox_fleet.apply(state_dir, stacks_dir=args.stacks_dir, timeout_s=args.timeout)
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


def _after_interrupt(cmd: str, state_dir: Path | None, handed: bool = False) -> str:
    """What an interrupted command says, from what actually runs now (never from hope)."""
    if state_dir is not None and sandbox_fleet.is_fleet_dir(state_dir):
        left = sandbox_fleet.what_runs(state_dir)
        if not left:
            return "interrupted; nothing it started is running"
        return (f"interrupted, but part of the fleet still runs in {state_dir} ({', '.join(left)}): stop it with "
                f"`{CMD} down --fleet {sandbox_fleet.fleet_name(state_dir)} --state-dir {state_dir}`")
    if state_dir is None:  # interrupted while it was still finding its sandbox: it had not acted
        return "interrupted before doing anything"
    if not supervisor.is_running(state_dir):
        return "interrupted; nothing it started is running" if cmd != "apply" else \
            "interrupted; no sandbox runs there"
    if cmd == "apply" and handed:
        return (f"interrupted; the sandbox in {state_dir} still runs and the deploy was handed to its runner: it "
                f"finishes or fails there, the previous version serving. Check: `{CMD} status --state-dir {state_dir}`")
    if cmd == "apply":
        return (f"interrupted before the deploy was handed to the runner; the sandbox in {state_dir} still runs, "
                f"unchanged. Check: `{CMD} status --state-dir {state_dir}`")
    return f"interrupted, but a sandbox still runs in {state_dir}: stop it with `{CMD} down --state-dir {state_dir}`"


def main(argv: list[str] | None = None, *, cli: bool = False) -> int:
    """``cli``: the process ends after this returns, so late signals are ignored rather than
    turned into a traceback (the command's outcome is already printed)."""
    handlers: dict[int, Any] = {}

    def restore() -> None:
        for sig, handler in handlers.items():
            signal.signal(sig, signal.SIG_IGN if cli else handler)

    try:
        # Inside the try: a signal may land between the two installs, once the first is ours.
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, _interrupted)
        if cli:
            sys.unraisablehook = _unraisable
        args = parser().parse_args(argv)
    except KeyboardInterrupt:
        restore()
        print("sandbox.py: interrupted before doing anything", file=sys.stderr)
        return 130
    state_dir: Path | None = None
    try:
        fleet = _fleet_of(args)
        if fleet is not None:
            state_dir = _fleet_dir(args, fleet)
            return _fleet_command(args, fleet, state_dir)
        if args.cmd == "up":
            if len(args.client_site) > 1:
                raise UnknownStack(f"--client-site {' --client-site '.join(args.client_site)}: a cell has one client "
                                   "site. Fix: give it once, or run a fleet (--fleet F) for one entry per site")
            state_dir = _state_dir(args)
            try:
                try:
                    out = supervisor.up(args.stack, state_dir=state_dir, stacks_dir=args.stacks_dir,
                                        client_site=(args.client_site or [None])[0], stretch=args.stretch,
                                        rtt=tuple(args.rtt), force_split=args.force_split, timeout_s=args.timeout)
                except supervisor_errors.AlreadyRunning as exc:
                    return _up_again(exc, args, state_dir)
                if _swallowed:
                    raise KeyboardInterrupt  # the user did press Ctrl-C during up
                print(json.dumps(out, indent=2, sort_keys=True), flush=True)
            except KeyboardInterrupt:
                # up cleans up after itself; an interrupt after it returned must stop the cell too
                with supervisor.deferred_signals():
                    supervisor.stop_runner(state_dir)
                    supervisor.down(state_dir, quiet=True)
                raise
            print(_up_summary(out, args), file=sys.stderr)
            return 0
        if args.cmd == "apply":
            state_dir = _state_dir(args)
            out = supervisor.apply(args.stack, state_dir=state_dir, stacks_dir=args.stacks_dir,
                                   force_split=args.force_split, timeout_s=args.timeout)
            print(json.dumps(out, indent=2, sort_keys=True))
            return 0
        if args.cmd == "down":
            state_dir = _state_dir(args)
            ran_here = (Path(state_dir) / LAUNCH_FILE).exists()  # before down: a sandbox was started here once
            out = supervisor.down(state_dir, quiet=True)
            print(json.dumps(out, sort_keys=True))
            if out["was_running"]:
                print(f"sandbox.py down: stopped the sandbox in {out['state_dir']}", file=sys.stderr)
                return 0
            others = _others(state_dir, "down")
            if ran_here or not supervisor.running_sandboxes():
                # Stopping what is stopped succeeds, as `docker compose down` does: a script's trap
                # or a second `down` is not an error.
                print(f"sandbox.py down: nothing runs in {out['state_dir']} (already stopped)"
                      + ("" if ran_here else f"; {others}"), file=sys.stderr)
                return 0
            # No sandbox was ever started here while one runs elsewhere: most likely the wrong
            # directory (a forgotten --state-dir), so say which `down` was meant.
            print(f"sandbox.py down: no sandbox was ever started in {out['state_dir']}: nothing stopped; {others}",
                  file=sys.stderr)
            return 1
        if args.cmd == "status":
            if args.stack is None and args.state_dir is None:
                return _status_all()
            state_dir = _state_dir(args)
            out = supervisor.status(state_dir)
            print(json.dumps(out, indent=2, sort_keys=True))
            print(_status_summary(out, args), file=sys.stderr)
            return 0 if out.get("healthy") else 1
        if args.cmd == "demo-fleet":
            from colocate.sandbox import fleet_demo

            demo_dir = args.state_dir or supervisor.default_state_dir("demo-fleet")
            state_dir = Path(demo_dir) / fleet_demo.FLEET  # what an interrupt reports on
            return fleet_demo.run(state_dir=demo_dir, samples=args.samples)
        if args.cmd == "demo-autoscale":
            from colocate.sandbox import autoscale_demo

            demo_dir = args.state_dir or supervisor.default_state_dir("demo-autoscale")
            state_dir = Path(demo_dir) / autoscale_demo.FLEET  # what an interrupt reports on
            return autoscale_demo.run(demo_dir, shape_file=args.shape, prices=args.prices, as_json=args.json,
                                      day_s=args.day_seconds, sent=args.requests)
        if args.cmd == "demo-spot":
            from colocate.sandbox import spot_demo

            demo_dir = args.state_dir or supervisor.default_state_dir("demo-spot")
            state_dir = Path(demo_dir)  # what an interrupt reports on
            return spot_demo.run(demo_dir, shape_file=args.shape, as_json=args.json, day_s=args.day_seconds,
                                 sent=args.requests, seed=args.seed, spare=args.spare,
                                 keep_interval_s=args.keep_interval or spot_demo.KEEP_INTERVAL_S,
                                 **({"days": (args.day,)} if args.day else {}))
        if args.cmd == "pod-command":
            print(_pod_command(args))
            return 0
        if args.cmd == "demo":
            from colocate.sandbox import demo

            state_dir = args.state_dir or supervisor.default_state_dir("demo")
            return demo.run(state_dir=state_dir, samples=args.samples, client_site=args.client_site)
    except (ConfigError, SandboxError) as exc:
        print(f"sandbox.py {args.cmd}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        handed = isinstance(exc, supervisor.ApplyInterrupted) and exc.handed
        print(f"sandbox.py {args.cmd}: {_after_interrupt(args.cmd, state_dir, handed)}", file=sys.stderr)
        return 130
    finally:
        restore()
    return 2


if __name__ == "__main__":
    sys.exit(main(cli=True))
