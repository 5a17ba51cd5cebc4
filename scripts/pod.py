#!/usr/bin/env python3
"""GPU pod lifecycle for a cell: create | delete | status | sweep.

stdout: exactly one JSON object. stderr: logs and progress. Exit 0 on success, 2 on a
usage or configuration error (bad spec, missing key, a provider that cannot serve the
region), 1 when the provider fails (capacity, readiness, refusals).

  create --spec FILE|-      spec = JSON of colocate.cell.plan.PodPlan.spec(); token from env POD_TOKEN
                            (rent + wait in one process)
  rent --spec FILE|-        adopt or place the spec's pod, without waiting: {"id","provider","name"}
  wait --spec FILE|-        the spec with "rented" = rent's output: wait until that pod serves
                            (a gone or dead one is replaced under the same name); prints create's JSON
  delete [--id ID] [--stack S]
                            id (and provider) from --id or env PULUMI_COMMAND_STDOUT; already gone = success;
                            with --stack, the stack's current provider key is tried first (as sweep finds
                            it), then the environment's (the key saved at create, maybe since revoked)
  status --id ID            the pod's current state
  sweep --stack S [--scope X] [--provider P] [--keep ID ...] [--destroy] [--stacks-dir DIR]
                            pods named colocate-<S>[-<scope>]-<region>-g<N>[-p<i>]-<digest> other than
                            the kept ones; the stack must exist (exit 2 otherwise). --scope (the stack's
                            podScope output) leaves another project's stack of the same name alone

An existing endpoint (provider existing: a box the team runs) is recorded by rent and checked by wait,
and never created or deleted: delete exits 2 and sweep finds none (colocate/pods/existing.py).

create/delete/status read keys from the environment only: RUNPOD_API_KEY, VASTAI_API_KEY
(pulumi up passes them). sweep finds the stack's provider key as `pulumi up` does: the
stack's secret colocate:<provider>ApiKey through `pulumi config get --show-secrets` when
the pulumi CLI is on PATH, else the environment; without one it exits 2 (it could not
look). Endpoints from RUNPOD_API_BASE, VASTAI_API_BASE. See docs/pods.md.
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

from colocate import stackfile  # noqa: E402
from colocate.cell.settings import PROVIDER_SECRET  # noqa: E402
from colocate.errors import ScriptError  # noqa: E402
from colocate.pods import lifecycle, spec as podspec, stackkeys, stop  # noqa: E402
from colocate.pods.errors import FatalError, PodConfigError, PodError  # noqa: E402

PROVIDERS = ("runpod", "vastai", "local", "existing")
REFUSED_KEY = (401, 403)  # the provider's answer to a revoked or wrong key


class UsageError(ScriptError):
    """A flag argparse refuses (exit 2)."""

    exit_code = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit code 2 through main's return, not sys.exit
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pod.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("create", help="create (or adopt) the cell's pod and wait until it serves")
    c.add_argument("--spec", required=True, help="spec JSON file, or - for stdin")
    r = sub.add_parser("rent", help="adopt or place the spec's pod; do not wait for it (pulumi records it first)")
    r.add_argument("--spec", required=True, help="spec JSON file, or - for stdin")
    a = sub.add_parser("wait", help="wait for the pod rent recorded to serve (spec JSON with \"rented\")")
    a.add_argument("--spec", required=True, help="spec JSON file (with \"rented\": rent's output), or - for stdin")
    d = sub.add_parser("delete", help="delete a pod; already gone is success")
    d.add_argument("--id", help="pod id (default: from PULUMI_COMMAND_STDOUT)")
    d.add_argument("--provider", choices=PROVIDERS, help="needed with --id unless the id is local-...")
    d.add_argument("--stack", help="the stack the pod belongs to: its current provider key is tried first")
    d.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help=argparse.SUPPRESS)
    s = sub.add_parser("status", help="print a pod's current state")
    s.add_argument("--id", required=True)
    s.add_argument("--provider", choices=PROVIDERS)
    w = sub.add_parser("sweep", help="find (and with --destroy delete) a stack's stray pods")
    w.add_argument("--stack", required=True)
    w.add_argument("--provider", choices=PROVIDERS, action="append",
                   help="repeatable; default: local, the stack's provider, and every provider whose API key is set")
    w.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help=argparse.SUPPRESS)
    w.add_argument("--keep", action="append", default=[], help="pod id to keep (repeatable)")
    w.add_argument("--scope", help="the stack's pod scope (pulumi stack output podScope): other scopes are left alone")
    w.add_argument("--destroy", action="store_true")
    return p


def _target(args) -> tuple[str, str]:
    provider, pod_id, _ = _recorded(args)
    return provider, pod_id


def _recorded(args) -> tuple[str, str, str | None]:
    """(provider, pod id, the recorded name: from a create's or rent's JSON only)."""
    pod_id, provider, name = args.id, args.provider, None
    if not pod_id:
        raw = os.environ.get("PULUMI_COMMAND_STDOUT", "").strip()
        if not raw:
            raise PodConfigError("delete: no --id and PULUMI_COMMAND_STDOUT is empty. Fix: pass --id ID --provider P")
        try:
            prev = json.loads(raw)
            pod_id, provider = str(prev["id"]), provider or prev["provider"]
            name = prev.get("name") if isinstance(prev.get("name"), str) and prev["name"].startswith("colocate-") else None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PodConfigError("PULUMI_COMMAND_STDOUT is not the JSON of a create (needs id and provider). "
                                 "Fix: pass --id ID --provider P") from None
    if not provider:
        if pod_id.startswith("local-"):
            provider = "local"
        else:
            raise PodConfigError(f"--provider is required for pod id {pod_id!r}. Fix: add --provider runpod|vastai")
    return provider, pod_id, name


def _sweep_providers(args) -> tuple[list[str], dict[str, str]]:
    """(providers to query, API keys to expose to them). The stack's own provider (or each
    one named with --provider) must be queryable: no key is exit 2, never "no strays"."""
    stack = stackkeys.stack_providers(args.stack, args.stacks_dir)
    required = list(args.provider) if args.provider else ["local", stack.used]
    optional = [] if args.provider else [p for p, (_, env) in PROVIDER_SECRET.items() if os.environ.get(env)]
    providers = list(dict.fromkeys(required + optional))
    keys = {}
    for name in providers:
        if name in PROVIDER_SECRET:
            key, source = stackkeys.provider_key(name, stack)
            keys[PROVIDER_SECRET[name][1]] = key
            print(f"pod.py sweep: {name} key from {source}", file=sys.stderr)
    return providers, keys


def _delete(args) -> dict:
    """Delete with the current key first (``stackkeys.delete_keys``); a key the provider
    refuses (401, 403) passes to the next one."""
    provider, pod_id, name = _recorded(args)
    keys = stackkeys.delete_keys(provider, args.stack, args.stacks_dir) if provider in PROVIDER_SECRET else []
    if not keys:
        return lifecycle.delete(provider, pod_id, name)  # local, or no key: the provider names what is missing
    key_name, env_name = PROVIDER_SECRET[provider]

    def attempt(key: str, source: str) -> dict:
        with stackkeys.keys_in_environment({env_name: key}):
            out = lifecycle.delete(provider, pod_id, name)
        print(f"pod.py delete: {provider} key from {source}", file=sys.stderr)
        return out

    *earlier, (last_key, last_source) = keys
    for (key, source), (_, next_source) in zip(earlier, keys[1:], strict=True):
        try:
            return attempt(key, source)
        except FatalError as exc:
            status = getattr(exc, "status", None)
            if status not in REFUSED_KEY:
                raise
            print(f"pod.py delete: {provider} refused the key from {source} ({status}); trying the key from "
                  f"{next_source}", file=sys.stderr)
    try:
        return attempt(last_key, last_source)
    except FatalError as exc:
        if getattr(exc, "status", None) not in REFUSED_KEY:
            raise
        tried = ", ".join(s for _, s in keys)
        raise FatalError(f"{exc}\n{provider} refused every key tried ({tried}): a key rotated and the old one revoked? "
                         f"Fix: pulumi config set --secret colocate:{key_name} <current key> (or export {env_name}="
                         f"<current key>), then retry; pod {pod_id} may still be billing") from None


def _on_sigterm(signum, frame):
    # A stop at the lifecycle's next safe point, where create's cleanup (destroy what it made)
    # runs; never an exception from here, which could land inside the HTTP client (colocate/pods/stop.py).
    stop.request()


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.command == "create":
            out = lifecycle.create(podspec.load(args.spec))
        elif args.command == "rent":
            out = lifecycle.rent(podspec.load(args.spec))
        elif args.command == "wait":
            spec, rented = podspec.load_with(args.spec, "rented")
            out = lifecycle.wait(spec, rented)
        elif args.command == "delete":
            out = _delete(args)
        elif args.command == "status":
            out = lifecycle.status(*_target(args))
        else:
            providers, keys = _sweep_providers(args)
            with stackkeys.keys_in_environment(keys):
                out = lifecycle.sweep(args.stack, providers, args.keep, args.destroy, args.scope)
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
