#!/usr/bin/env python3
"""Run one colocate cell on this machine: workerd, a local pod, an emulated geography.

    sandbox.py up     --stack S [--state-dir DIR] [--stacks-dir DIR] [--client-site COLO]
                      [--stretch 1.55] [--rtt A:B=MS ...] [--force-split]
    sandbox.py apply  [--stack S | --state-dir DIR] [--stacks-dir DIR] [--force-split]
    sandbox.py down   [--stack S | --state-dir DIR]
    sandbox.py status [--stack S | --state-dir DIR]
    sandbox.py demo   [--state-dir DIR] [--samples N] [--client-site COLO]

``up`` prints one JSON object (worker_url, pod_url, token, state_dir, sites, pids, ...);
``apply`` is the running cell's ``pulumi up``: it re-plans from the stack file, creates the
new pod before deleting the old one and swaps workerd without dropping a request;
``status`` prints what runs and whether it is healthy; ``down`` stops everything. Exit 0 on
success, 1 when ``status`` finds the sandbox unhealthy or ``demo`` fails a step, 2 on a usage
or configuration error (including a second ``up``). See docs/sandbox.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import stackfile  # noqa: E402
from colocate.errors import ConfigError  # noqa: E402
from colocate.sandbox import supervisor  # noqa: E402
from colocate.sandbox.errors import SandboxError  # noqa: E402

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
    for name, text in (("down", "stop everything the sandbox started"), ("status", "print what runs, with health")):
        where(sub.add_parser(name, help=text))
    d = sub.add_parser("demo", help="tell the field story with the running cell (make demo)")
    d.add_argument("--state-dir", type=Path, help="state directory (default .colocate/sandbox/demo/)")
    d.add_argument("--samples", type=int, default=15, help="probe samples per step (default 15)")
    d.add_argument("--client-site", default="NRT", metavar="COLO",
                   help="where the one user of the story sits, a colo code (default NRT, Tokyo)")
    return p


def _state_dir(args) -> Path:
    return args.state_dir or supervisor.default_state_dir(args.stack)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # SIGTERM behaves like Ctrl-C, so `up` and `demo` clean up on either.
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if args.cmd == "up":
            out = supervisor.up(args.stack, state_dir=_state_dir(args), stacks_dir=args.stacks_dir,
                                client_site=args.client_site, stretch=args.stretch, rtt=tuple(args.rtt),
                                force_split=args.force_split, timeout_s=args.timeout)
            print(json.dumps(out, indent=2, sort_keys=True))
            return 0
        if args.cmd == "apply":
            out = supervisor.apply(args.stack, state_dir=_state_dir(args), stacks_dir=args.stacks_dir,
                                   force_split=args.force_split, timeout_s=args.timeout)
            print(json.dumps(out, indent=2, sort_keys=True))
            return 0
        if args.cmd == "down":
            print(json.dumps(supervisor.down(_state_dir(args)), sort_keys=True))
            return 0
        if args.cmd == "status":
            out = supervisor.status(_state_dir(args))
            print(json.dumps(out, indent=2, sort_keys=True))
            return 0 if out.get("healthy") or not out["running"] else 1
        if args.cmd == "demo":
            from colocate.sandbox import demo

            return demo.run(state_dir=args.state_dir, samples=args.samples, client_site=args.client_site)
    except (ConfigError, SandboxError) as exc:
        print(f"sandbox.py {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sandbox.py {args.cmd}: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 2


if __name__ == "__main__":
    sys.exit(main())
