#!/usr/bin/env python3
"""Run one colocate cell on this machine: workerd, a local pod, an emulated geography.

    sandbox.py up     --stack S [--state-dir DIR] [--stacks-dir DIR] [--client-site COLO]
                      [--stretch 1.55] [--rtt A:B=MS ...] [--force-split]
    sandbox.py apply  [--stack S | --state-dir DIR] [--stacks-dir DIR] [--force-split]
    sandbox.py down   [--stack S | --state-dir DIR]
    sandbox.py status [--stack S | --state-dir DIR]     (no --stack: every sandbox that runs)
    sandbox.py demo   [--state-dir DIR] [--samples N] [--client-site COLO]

``up`` prints one JSON object (worker_url, pod_url, token, state_dir, sites, pids, ...);
``apply`` is the running cell's ``pulumi up``: it re-plans from the stack file, creates the
new pod before deleting the old one and swaps workerd without dropping a request;
``status`` prints what runs and whether it is healthy; ``down`` stops everything. Exit 0 on
success, 1 when ``status`` finds the sandbox unhealthy or ``demo`` fails a step, 2 on a usage
or configuration error (including a second ``up``). See docs/sandbox.md.
"""

# A Ctrl-C while Python loads the kit is held until the imports are done, then ends the
# command: nothing has started yet. Raised inside the import machinery it could land in a
# callback whose exception Python only prints ("Exception ignored in ... _get_module_lock
# ... KeyboardInterrupt"), and the command would go on as if no key had been pressed.
# The handler is this file's first statement, through _signal (built in, it imports nothing):
# the only window left is the interpreter's own start-up, before this file runs, where Python
# itself reports the KeyboardInterrupt and exits 1 with nothing started.
import _signal
import sys

_held: list[int] = []
_loading = _signal.signal(_signal.SIGINT, lambda signum, _frame: _held.append(signum))

import argparse
import json
import signal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import stackfile
from colocate.errors import ConfigError
from colocate.sandbox import supervisor
from colocate.sandbox.errors import SandboxError

if _held:
    print("sandbox.py: interrupted while loading, before doing anything", file=sys.stderr)
    sys.exit(130)
_signal.signal(_signal.SIGINT, _loading)

DEFAULT_STACK = "sandbox"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandbox.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)

    def where(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--stack", default=DEFAULT_STACK, help=f"stack name (default {DEFAULT_STACK})")
        sp.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/<stack>/)")

    u = sub.add_parser("up", help="start the cell and print its JSON")
    where(u)
    u.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help="where Pulumi.<stack>.yaml lives")
    u.add_argument("--client-site", metavar="COLO", help="the client's colo (default: the cell's edge site)")
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
    dn = sub.add_parser("down", help="stop everything the sandbox started")
    where(dn)
    dn.add_argument("--stacks-dir", type=Path, help="where Pulumi.<stack>.yaml lives (to tell a typo from a stack)")
    st = sub.add_parser("status", help="print what runs, with health (no --stack: every sandbox that runs)")
    st.add_argument("--stack", help="stack name (default: list every sandbox under .colocate/sandbox/)")
    st.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/<stack>/)")
    st.add_argument("--stacks-dir", type=Path, help="where Pulumi.<stack>.yaml lives (to tell a typo from a stack)")
    d = sub.add_parser("demo", help="tell the field story with the running cell (make demo)")
    d.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/demo/)")
    d.add_argument("--samples", type=int, default=10, help="probe samples per step (default 10: enough for the p50/p90 table)")
    d.add_argument("--client-site", default="NRT", metavar="COLO",
                   help="where the one user of the story sits, a colo code (default NRT, Tokyo)")
    return p


CMD = supervisor.SANDBOX_CMD


class UnknownStack(SandboxError):
    pass


def _where_flags(args, state_dir: Path, stack: str | None = None) -> str:
    """The flags that name this sandbox again in a printed command: always its stack (the one
    that runs there, not the command's default), and the state directory when it is not that
    stack's default, so a printed ``up`` never starts another stack in it."""
    stack = stack or supervisor.owner(state_dir) or getattr(args, "stack", None) or DEFAULT_STACK
    if Path(state_dir).resolve() == supervisor.default_state_dir(stack).resolve():
        return f"--stack {stack}"
    return f"--stack {stack} --state-dir {state_dir}"


def _others(exclude: Path | None = None) -> str:
    runs = [d for d in supervisor.running_sandboxes() if exclude is None or d.resolve() != Path(exclude).resolve()]
    if not runs:
        return "no sandbox runs under .colocate/sandbox/"
    return "sandboxes that run: " + ", ".join(f"{d.name} (`{CMD} status --stack {d.name}`)" for d in runs)


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
        raise UnknownStack(f"--stack {stack!r}: unknown stack (no {stackfile.path_of(stack, stacks_dir)} and no "
                           f"sandbox state in {state_dir}). Fix: one of {', '.join(known) or 'none'}; {_others()}")
    return state_dir


def _up_summary(out: dict, args) -> str:
    where = _where_flags(args, Path(out["state_dir"]), out.get("stack"))
    key = out.get("key")
    use = (f"; client key {key}: OpenAI(base_url=\"{out['worker_url']}/v1\", api_key=\"{key}\")" if key else "")
    return (f"sandbox.py up: stack {out['stack']} ({out['region']}) serves at {out['worker_url']}{use}. "
            f"Next: `{CMD} status {where}`, then `{CMD} down {where}`")


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
        return f"sandbox.py status: nothing runs in {out['state_dir']}; {_others(Path(out['state_dir']))}"
    if out.get("healthy"):
        return (f"sandbox.py status: stack {out.get('stack')} runs at {out.get('worker_url')}, healthy. "
                f"Next: `{CMD} down {where}` when done")
    bad = _unhealthy_parts(out)
    return (f"sandbox.py status: stack {out.get('stack')} runs but is UNHEALTHY: {'; '.join(bad) or 'still starting'}; "
            f"logs in {Path(out['state_dir']) / 'logs'}. Next: `{CMD} down {where}`, then `{CMD} up {where}`")


def _status_all() -> int:
    found = [supervisor.status(d) for d in supervisor.running_sandboxes()]
    print(json.dumps({"sandboxes": found}, indent=2, sort_keys=True))
    if not found:
        print("sandbox.py status: no sandbox runs under .colocate/sandbox/. "
              f"Next: `{CMD} up --stack {DEFAULT_STACK}`", file=sys.stderr)
        return 0
    for out in found:
        print(f"sandbox.py status: {Path(out['state_dir']).name}: {out.get('worker_url')}, "
              f"{'healthy' if out.get('healthy') else 'UNHEALTHY'} (`{CMD} status --stack {Path(out['state_dir']).name}`)",
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


def _after_interrupt(cmd: str, state_dir: Path | None) -> str:
    """What an interrupted command says, from what actually runs now (never from hope)."""
    if state_dir is None or not supervisor.is_running(state_dir):
        return "interrupted; nothing it started is running" if cmd != "apply" else \
            "interrupted; no sandbox runs there"
    if cmd == "apply":
        return (f"interrupted; the sandbox in {state_dir} still runs (a deploy under way finishes or fails in the "
                f"runner, the previous version serving). Check: `{CMD} status --state-dir {state_dir}`")
    return f"interrupted, but a sandbox still runs in {state_dir}: stop it with `{CMD} down --state-dir {state_dir}`"


def main(argv: list[str] | None = None, *, cli: bool = False) -> int:
    """``cli``: the process ends after this returns, so late signals are ignored rather than
    turned into a traceback (the command's outcome is already printed)."""
    handlers = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    if cli:
        sys.unraisablehook = _unraisable
    try:
        args = parser().parse_args(argv)
    except KeyboardInterrupt:
        print("sandbox.py: interrupted before doing anything", file=sys.stderr)
        return 130
    state_dir: Path | None = None
    try:
        if args.cmd == "up":
            state_dir = _state_dir(args)
            try:
                out = supervisor.up(args.stack, state_dir=state_dir, stacks_dir=args.stacks_dir,
                                    client_site=args.client_site, stretch=args.stretch, rtt=tuple(args.rtt),
                                    force_split=args.force_split, timeout_s=args.timeout)
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
            out = supervisor.down(state_dir, quiet=True)
            print(json.dumps(out, sort_keys=True))
            if out["was_running"]:
                print(f"sandbox.py down: stopped the sandbox in {out['state_dir']}", file=sys.stderr)
            else:
                print(f"sandbox.py down: nothing was running in {out['state_dir']}; {_others(state_dir)}",
                      file=sys.stderr)
            return 0
        if args.cmd == "status":
            if args.stack is None and args.state_dir is None:
                return _status_all()
            state_dir = _state_dir(args)
            out = supervisor.status(state_dir)
            print(json.dumps(out, indent=2, sort_keys=True))
            print(_status_summary(out, args), file=sys.stderr)
            return 0 if out.get("healthy") or not out["running"] else 1
        if args.cmd == "demo":
            from colocate.sandbox import demo

            state_dir = args.state_dir or supervisor.default_state_dir("demo")
            return demo.run(state_dir=state_dir, samples=args.samples, client_site=args.client_site)
    except (ConfigError, SandboxError) as exc:
        print(f"sandbox.py {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sandbox.py {args.cmd}: {_after_interrupt(args.cmd, state_dir)}", file=sys.stderr)
        return 130
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, signal.SIG_IGN if cli else handler)
    return 2


if __name__ == "__main__":
    sys.exit(main(cli=True))
