#!/usr/bin/env python3
"""Move a cell's state with a generation-rename migration: plan | start | finish.

    migrate.py plan   --stack S [--to REGION [--provider P] [--gpu NAME]] [--probe-json FILE]
    migrate.py start  --stack S --to REGION [--provider P] [--gpu NAME]
    migrate.py status --stack S [--url URL]
    migrate.py finish --stack S [--url URL] [--skip-import-check]

``start`` makes a new generation in REGION active, the old one draining, and sets
``colocate:region`` (with ``--provider``, also ``pod.provider`` and ``pod.gpu`` under the new
provider's name for the same GPU); ``finish`` retires the draining generation. Both edit
``stacks/Pulumi.<stack>.yaml`` in place (comments and key order kept, atomic write) and
print what the next ``pulumi up`` does. An illegal step changes nothing and exits 2.
``status`` asks the cell how far the new generation's import of the draining one is
(GET /_colocate/breaker with the read token: the stack's running sandbox, its deployed
outputs, or --url with COLOCATE_READ_TOKEN); ``finish`` asks the same and refuses until the
import is complete.

The cell's own Pulumi steps also call:
    migrate.py record-tag --stack S --tag TAG    record an applied Durable Object migration tag
    migrate.py purge --url URL --generation G    purge a retired generation (token: COLOCATE_ADMIN_TOKEN)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import requests  # noqa: E402

from colocate import admin, cli, stackfile
from colocate.cell import migration  # noqa: E402
from colocate.cell.ledger import UNKNOWN_REGION, Ledger  # noqa: E402
from colocate.cell.plan import MIGRATIONS  # noqa: E402
from colocate.errors import ColocateError, ConfigError, LedgerError, UnsupportedProvider  # noqa: E402
from colocate.sandbox.statedir import LAUNCH_FILE  # noqa: E402


def _load(args) -> tuple[dict, Ledger]:
    raw, _ = stackfile.read_config(args.stack, args.stacks_dir)
    return raw, Ledger.parse(raw.get("generations"))


def _deployed(raw: dict, ledger: Ledger) -> dict:
    # What is running now: compute where the active generation lives. A region edited
    # by hand (the mistake the kit refuses) is not yet deployed.
    if ledger.active.region != UNKNOWN_REGION:
        return dict(raw, region=ledger.active.region)
    return raw


def _observed(path: str | None) -> str | None:
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    return (data.get("placement") or {}).get("state")


MIGRATE = cli.script("migrate.py")  # printed commands run as printed, from any directory


def _running_sandbox(stack: str, stacks_dir: Path) -> Path | None:
    """The state directory of a running sandbox of this stack file, if one runs."""
    from colocate.sandbox import statedir

    wanted = Path(stacks_dir).resolve()
    for state_dir in statedir.running_sandboxes():
        launch = statedir.read_json(state_dir / LAUNCH_FILE) or {}
        if launch.get("stack") == stack and Path(launch.get("stacks_dir", "")).resolve() == wanted:
            return state_dir
    return None


def _deploy_cmd(stack: str, stacks_dir: Path, raw: dict) -> str:
    """The command that deploys this stack file: the sandbox's own apply for a cell that runs
    (or can only run) in the sandbox, `pulumi up` for a cloud cell."""
    from colocate.cell.settings import POD_DEFAULTS
    from colocate.sandbox import supervisor

    state_dir = _running_sandbox(stack, stacks_dir)
    if state_dir is not None:
        where = f"--stack {stack}" if state_dir == supervisor.default_state_dir(stack) else f"--state-dir {state_dir}"
        return f"`{supervisor.SANDBOX_CMD} apply {where}` (the sandbox's `pulumi up`)"
    if (raw.get("pod") or {}).get("provider", POD_DEFAULTS["provider"]) == "local":
        return f"`{supervisor.SANDBOX_CMD} apply --stack {stack}` (a local pod runs only in the sandbox)"
    return f"`pulumi up -s {stack}`"


def _report(stack: str, raw_before: dict, raw_after: dict, observed: str | None, heading: str,
            notes: tuple[str, ...] = ()) -> None:
    before = migration.planning_settings(raw_before, stack)
    after = migration.planning_settings(raw_after, stack)
    if observed:
        before = migration.adopt_observation(before, before.ledger.active.name, observed)
        after = migration.adopt_observation(after, before.ledger.active.name, observed)
    old, new = migration.plan_pair(before, after)
    print(heading)
    region = (f"{before.region.name} -> {after.region.name}" if before.region.name != after.region.name
              else f"{after.region.name} (unchanged)")
    print(f"Stack {stack}: region {region}; "
          f"active {after.ledger.active.name}" + (f", draining {after.ledger.draining.name}" if after.ledger.draining else ""))
    if notes:
        print("Pod settings the move changes:")
        for note in notes:
            print(note)
    print("The next `pulumi up` will:")
    for action in migration.diff(old, new):
        print(action)
    print("State round trip (physical floor: 2 x great-circle km / 200 km per ms):")
    for trip in migration.round_trips(before, after):
        print(trip)


def cmd_plan(args) -> int:
    raw, ledger = _load(args)
    observed = _observed(args.probe_json) or ledger.active.observed_colo
    before = _deployed(raw, ledger)
    if args.to:
        change = migration.change_pod(migration.with_ledger(raw, ledger.start(args.to, args.stack), args.to),
                                      args.provider, args.gpu)
        _report(args.stack, before, change.raw, observed, f"Plan for `migrate.py start --to {args.to}` (nothing written):",
                change.notes)
    elif ledger.draining:
        after = migration.with_ledger(raw, ledger.finish(args.stack))
        _report(args.stack, before, after, observed, "Plan for `migrate.py finish` (nothing written):")
    else:
        _report(args.stack, before, before, observed, "No move under way. Current cell:")
        if ledger.active.region == UNKNOWN_REGION and not observed:
            print(f"  generation {ledger.active.name} was adopted and its home is unknown: run "
                  f"`.venv/bin/python scripts/probe.py --stack {args.stack} --json probe.json`, then "
                  f"`{MIGRATE} plan --stack {args.stack} --probe-json probe.json`")
    return 0


def cmd_start(args) -> int:
    raw, ledger = _load(args)
    new_ledger = ledger.start(args.to, args.stack)
    # A new provider takes the GPU under its own name, or the move is refused here.
    change = migration.change_pod(migration.with_ledger(raw, new_ledger, args.to), args.provider, args.gpu)
    after = change.raw
    # Validate the whole target cell (region, provider, GPU, ledger) before touching the file.
    _report(args.stack, _deployed(raw, ledger), after, ledger.active.observed_colo, f"Started a move to {args.to}.",
            change.notes)
    stackfile.write_config(args.stack, {"region": args.to, "generations": new_ledger.as_config(), **change.updates},
                           args.stacks_dir)
    deploy = _deploy_cmd(args.stack, args.stacks_dir, after)
    print(f"Wrote {stackfile.path_of(args.stack, args.stacks_dir)}. Next: {deploy}, "
          f"then `{MIGRATE} finish --stack {args.stack}` and the same deploy again.")
    return 0


def _import_state(args, raw: dict, ledger: Ledger) -> dict:
    """How far the active generation's import of the draining one is, as the cell says:
    {done, rows, total, part} (rows and total None once done)."""
    assert ledger.draining is not None
    state_dir = None if args.url else _running_sandbox(args.stack, args.stacks_dir)
    target = (admin.sandbox_target(state_dir, "read") if state_dir else None) or admin.resolve(
        url=args.url, stack=args.stack, role="read")
    answer = admin.AdminClient(target).breaker()
    active, draining = ledger.active.name, ledger.draining.name
    if answer.get("generation") != active:
        raise LedgerError("colocate:generations", active, f"the cell at {target.url} runs generation "
                          f"{answer.get('generation')}, not the ledger's active one",
                          f"deploy the start first ({_deploy_cmd(args.stack, args.stacks_dir, raw)})")
    b = answer.get("breaker") or {}
    if draining in (b.get("imported") or []):
        return {"done": True, "rows": None, "total": None, "part": None}
    mine = next((p for p in b.get("importing") or [] if p.get("from") == draining), None)
    if mine is None:
        raise LedgerError("colocate:generations", draining, f"the cell at {target.url} has not begun importing it",
                          f"deploy the start first ({_deploy_cmd(args.stack, args.stacks_dir, raw)}): its Worker names "
                          "the draining generation, and its first request starts the import")
    return {"done": False, "rows": mine["rows"], "total": mine["total"], "part": mine.get("part")}


def _far(state: dict, active: str, draining: str) -> str:
    total = state["total"] or 0
    share = f" ({100 * state['rows'] // total} %)" if total else ""
    return (f"{active} has imported {state['rows']:,} of {total:,} rows{share} of {draining}"
            + (f", now {state['part']}" if state.get("part") else ""))


def cmd_status(args) -> int:
    raw, ledger = _load(args)
    if ledger.draining is None:
        print(f"Stack {args.stack}: no move under way; active {ledger.active.name}.")
        return 0
    state = _import_state(args, raw, ledger)
    active, draining = ledger.active.name, ledger.draining.name
    if state["done"]:
        print(f"Stack {args.stack}: {active} has imported all of {draining}. "
              f"Next: `{MIGRATE} finish --stack {args.stack}` retires {draining}.")
    else:
        print(f"Stack {args.stack}: {_far(state, active, draining)}. The cell serves meanwhile; "
              f"`{MIGRATE} finish --stack {args.stack}` waits for the rest.")
    return 0


def cmd_finish(args) -> int:
    raw, ledger = _load(args)
    new_ledger = ledger.finish(args.stack)
    assert ledger.draining is not None  # finish() refuses a ledger with no draining generation
    if not args.skip_import_check:
        state = _import_state(args, raw, ledger)
        if not state["done"]:
            raise LedgerError("colocate:generations", ledger.draining.name,
                              f"{_far(state, ledger.active.name, ledger.draining.name)}: retiring it now would purge "
                              "what has not moved yet",
                              f"wait until `{MIGRATE} status --stack {args.stack}` says the import is complete, then run "
                              "finish again")
    after = migration.with_ledger(raw, new_ledger)
    _report(args.stack, raw, after, None, f"Finishing: {ledger.draining.name} retires.")
    stackfile.write_config(args.stack, {"generations": new_ledger.as_config()}, args.stacks_dir)
    print(f"Wrote {stackfile.path_of(args.stack, args.stacks_dir)}. Next: {_deploy_cmd(args.stack, args.stacks_dir, raw)} "
          "(drops the draining binding and purges its storage).")
    return 0


def cmd_record_tag(args) -> int:
    tags = [t for t, _ in MIGRATIONS]
    if args.tag not in tags:
        raise ConfigError("--tag", args.tag, "not one of the kit's migration tags", f"use one of {', '.join(tags)}")
    stackfile.write_config(args.stack, {"worker.migrationTag": args.tag}, args.stacks_dir)
    print(json.dumps({"stack": args.stack, "migrationTag": args.tag}))
    return 0


def cmd_purge(args) -> int:
    token = admin.token_from_env(os.environ, "admin")
    if not token:
        raise ConfigError(admin.TOKEN_ENVS["admin"], None, "the admin token is not in the environment",
                          f"export {admin.TOKEN_ENVS['admin']}=<the stack's adminToken output>")
    url = args.url.rstrip("/") + "/_colocate/purge"
    try:
        resp = requests.post(url, json={"generation": args.generation},
                             headers={"Authorization": f"Bearer {token}"}, timeout=30)
    except requests.RequestException as err:
        print(f"purge: cannot reach {url}: {err.__class__.__name__}", file=sys.stderr)
        return 1
    if resp.status_code >= 300:
        print(f"purge: {url} answered {resp.status_code}: {resp.text[:300]}", file=sys.stderr)
        return 1
    print(json.dumps({"purged": args.generation, "status": resp.status_code}))
    return 0


GPU_HELP = ("GPU under the target provider's name (default: the stack's GPU, translated to a new "
            "--provider's name when the kit knows it)")


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="migrate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = cli.subcommands(p, dest="command", required=True)

    def stack_args(sp):
        sp.add_argument("--stack", required=True, help="stack name: stacks/Pulumi.<stack>.yaml")
        sp.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help=argparse.SUPPRESS)

    sp = sub.add_parser("plan", help="print what start/finish and the next pulumi up would do")
    stack_args(sp)
    sp.add_argument("--to", help="target region (preview a start)")
    sp.add_argument("--provider", choices=("runpod", "vastai", "local"), help="GPU provider in the target region")
    sp.add_argument("--gpu", help=GPU_HELP)
    sp.add_argument("--probe-json", help="a probe.py --json result: where the active object really lives")
    sp.set_defaults(func=cmd_plan)
    sp = sub.add_parser("start", help="begin a move: new generation active in --to, the old one draining")
    stack_args(sp)
    sp.add_argument("--to", required=True, help="target region")
    sp.add_argument("--provider", choices=("runpod", "vastai", "local"), help="GPU provider in the target region")
    sp.add_argument("--gpu", help=GPU_HELP)
    sp.set_defaults(func=cmd_start)
    sp = sub.add_parser("status", help="how far the new generation's import of the draining one is")
    stack_args(sp)
    sp.add_argument("--url", help="the Worker's URL (with COLOCATE_READ_TOKEN); default: the stack's sandbox or outputs")
    sp.set_defaults(func=cmd_status)
    sp = sub.add_parser("finish", help="end a move: the draining generation retires (once its import is complete)")
    stack_args(sp)
    sp.add_argument("--url", help="the Worker's URL (with COLOCATE_READ_TOKEN); default: the stack's sandbox or outputs")
    sp.add_argument("--skip-import-check", action="store_true",
                    help="retire without asking the cell (the Worker's purge still refuses an incomplete import)")
    sp.set_defaults(func=cmd_finish)
    sp = sub.add_parser("record-tag", help="record an applied migration tag (run by the cell after deploy)")
    stack_args(sp)
    sp.add_argument("--tag", required=True)
    sp.set_defaults(func=cmd_record_tag)
    sp = sub.add_parser("purge", help="purge a retired generation's storage (run by the cell after finish)")
    sp.add_argument("--url", required=True, help="the Worker's URL")
    sp.add_argument("--generation", required=True)
    sp.set_defaults(func=cmd_purge)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except UnsupportedProvider as err:
        if getattr(args, "to", None):  # the stack's provider cannot follow the move
            err = UnsupportedProvider(err.key, err.value, err.problem,
                                      f"add --provider {err.fix.split()[-1]} to move the pod to a provider that serves {args.to}")
        print(f"migrate.py: {err}", file=sys.stderr)
        return err.exit_code
    except ColocateError as err:  # ConfigError, and AdminError when the cell cannot be asked
        print(f"migrate.py: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
