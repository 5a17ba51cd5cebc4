#!/usr/bin/env python3
"""GPU pod lifecycle for a cell: create | delete | status | sweep.

stdout: exactly one JSON object. stderr: logs and progress. Exit 0 on success, 2 on a
usage or configuration error (bad spec, missing key, a provider that cannot serve the
region), 1 when the provider fails (capacity, readiness, refusals).

  create --spec FILE|-      spec = JSON of colocate.plan.PodPlan.spec(); token from env POD_TOKEN
  delete [--id ID]          id (and provider) from --id or env PULUMI_COMMAND_STDOUT; already gone = success
  status --id ID            the pod's current state
  sweep --stack S [--provider P] [--keep ID ...] [--destroy]
                            pods named colocate-<S>-<region>-g<N> other than the kept ones

Keys only from the environment: RUNPOD_API_KEY, VASTAI_API_KEY; endpoints from
RUNPOD_API_BASE, VASTAI_API_BASE. See docs/pods.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate.pods import lifecycle, spec as podspec  # noqa: E402
from colocate.pods.errors import PodConfigError, PodError  # noqa: E402

PROVIDERS = ("runpod", "vastai", "local")


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit code 2 through main's return, not sys.exit
        raise _Usage(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pod.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("create", help="create (or adopt) the cell's pod and wait until it serves")
    c.add_argument("--spec", required=True, help="spec JSON file, or - for stdin")
    d = sub.add_parser("delete", help="delete a pod; already gone is success")
    d.add_argument("--id", help="pod id (default: from PULUMI_COMMAND_STDOUT)")
    d.add_argument("--provider", choices=PROVIDERS, help="needed with --id unless the id is local-...")
    s = sub.add_parser("status", help="print a pod's current state")
    s.add_argument("--id", required=True)
    s.add_argument("--provider", choices=PROVIDERS)
    w = sub.add_parser("sweep", help="find (and with --destroy delete) a stack's stray pods")
    w.add_argument("--stack", required=True)
    w.add_argument("--provider", choices=PROVIDERS, action="append",
                   help="repeatable; default: local plus every provider whose API key is set")
    w.add_argument("--keep", action="append", default=[], help="pod id to keep (repeatable)")
    w.add_argument("--destroy", action="store_true")
    return p


def _target(args) -> tuple[str, str]:
    pod_id, provider = args.id, args.provider
    if not pod_id:
        raw = os.environ.get("PULUMI_COMMAND_STDOUT", "").strip()
        if not raw:
            raise PodConfigError("delete: no --id and PULUMI_COMMAND_STDOUT is empty. Fix: pass --id ID --provider P")
        try:
            prev = json.loads(raw)
            pod_id, provider = str(prev["id"]), provider or prev["provider"]
        except (ValueError, KeyError, TypeError):
            raise PodConfigError("PULUMI_COMMAND_STDOUT is not the JSON of a create (needs id and provider). "
                                 "Fix: pass --id ID --provider P") from None
    if not provider:
        if pod_id.startswith("local-"):
            provider = "local"
        else:
            raise PodConfigError(f"--provider is required for pod id {pod_id!r}. Fix: add --provider runpod|vastai")
    return provider, pod_id


def _sweep_providers(args) -> list[str]:
    if args.provider:
        return args.provider
    return ["local"] + [p for p, k in (("runpod", "RUNPOD_API_KEY"), ("vastai", "VASTAI_API_KEY")) if os.environ.get(k)]


def _on_sigterm(signum, frame):
    # Turn SIGTERM into an exception so create's cleanup (destroy what it made) runs.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except _Usage as exc:
        print(str(exc), file=sys.stderr)
        return 2
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.command == "create":
            out = lifecycle.create(podspec.load(args.spec))
        elif args.command == "delete":
            out = lifecycle.delete(*_target(args))
        elif args.command == "status":
            out = lifecycle.status(*_target(args))
        else:
            out = lifecycle.sweep(args.stack, _sweep_providers(args), args.keep, args.destroy)
    except PodError as exc:
        print(f"pod.py {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"pod.py {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
