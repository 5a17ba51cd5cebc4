#!/usr/bin/env python3
"""The controller that keeps a cell alive and, with ``colocate:scale``, scales it (docs/pods.md,
"The keeper" and "Scaling with demand").

    scale.py run    --stack S [--interval 15] [--steps N] [--drain-timeout 300]       a real stack: pulumi.automation
    scale.py run    --stack S --sandbox [--state-dir DIR] [--interval 5] [--steps N]  a running sandbox: sandbox.py apply
    scale.py status --stack S [--sandbox [--state-dir DIR]]                            the last decision, the keeper, the lock

``run`` passes every ``--interval`` seconds, holding the generation's lock: it keeps the cell
(colocate/scaling/keeper.py: refuses to deploy from a checkout whose Worker is not the running one,
replaces a dead, remapped or misplaced pod alone, renews certificates one pod at a time), then
reads the cell's signals (``/_colocate/scale``), decides (colocate/scaling/policy.py) and makes the stack
declare the new count. A cell without ``colocate:scale`` is kept, not scaled. The cloud needs the
Pulumi CLI, logged in to the stack's backend, and the provider's API key (RUNPOD_API_KEY,
VASTAI_API_KEY, or the stack's secret), and reads the Worker's URL and admin token from the
stack's outputs (``COLOCATE_ADMIN_TOKEN`` in the environment overrides the token). Exit 2 on bad
input, 1 when the cell cannot be reached at all, 3 as soon as the keeper raises an alert (a pod it
cannot replace, failing updates, a stack lock left behind, a checkout it refuses): a supervisor
restarting it, or cron, sees the alert.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import stackfile  # noqa: E402
from colocate.cell import plan as plan_mod, settings as settings_mod
from colocate.errors import ConfigError  # noqa: E402
from colocate.sandbox.statedir import READY_FILE  # noqa: E402
from colocate.scaling.controller import CellClient, Controller, PulumiDeployer, lease_ttl, policy_of  # noqa: E402
from colocate.scaling.keeper import Keeper  # noqa: E402


def scale_settings(stack: str, stacks_dir: Path):
    raw, _ = stackfile.read_config(stack, stacks_dir)
    fallback_price = settings_mod.parse_fallback_price(raw.get("fallbackPrice"))
    pod = settings_mod.parse_pod({k: v for k, v in raw.items() if k == "pod"})
    scale = settings_mod.parse_scale(raw, fallback_price, pod.spare_pods)  # None: a fixed count, kept and not scaled
    return scale, fallback_price, pod


def cell_of(args, stacks_dir: Path):
    """(client, deployer, pod $/hr) for the sandbox or the stack's real outputs."""
    if args.sandbox:
        from colocate.sandbox.scaling import SandboxDeployer
        from colocate.sandbox.statedir import default_state_dir

        state_dir = Path(args.state_dir or default_state_dir(args.stack)).resolve()
        ready_path = state_dir / READY_FILE
        if not ready_path.exists():
            raise ConfigError("--state-dir", str(state_dir), "no sandbox runs there",
                              f".venv/bin/python scripts/sandbox.py up --stack {args.stack} --state-dir {state_dir}")
        ready = json.loads(ready_path.read_text())
        return CellClient(ready["worker_url"], ready["token"]), SandboxDeployer(args.stack, state_dir), None
    if shutil.which("pulumi") is None:
        raise ConfigError("--stack", args.stack, "the Pulumi CLI is not on PATH: the controller runs `pulumi up` through it",
                          "install it (README, \"Deploy one cell\", step 5), or act on a sandbox with --sandbox")
    deployer = PulumiDeployer(args.stack, ROOT)
    outs = deployer.stack.outputs()
    url = outs.get("workerUrl")
    # the lock and the records take the admin token (the signals alone would need only the read one)
    token = os.environ.get("COLOCATE_ADMIN_TOKEN") or (outs["adminToken"].value if "adminToken" in outs else None)
    if not url or not token:
        raise ConfigError("--stack", args.stack, "the stack has no workerUrl/adminToken outputs: it is not deployed",
                          "pulumi up once, then run the controller")
    cost = outs.get("podsCostPerHr")
    ids = outs.get("podIds")
    per_pod = cost.value / len(ids.value) if cost and cost.value and ids and ids.value else None
    client = CellClient(url.value, token)
    deployer.client = client  # what exists: the pods of the last update and the live Worker's rotation
    return client, deployer, per_pod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scale.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "status"):
        c = sub.add_parser(name)
        c.add_argument("--stack", required=True)
        c.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR)
        c.add_argument("--sandbox", action="store_true", help="act on a running sandbox (sandbox.py apply), not pulumi up")
        c.add_argument("--state-dir", type=Path)
        if name == "run":
            c.add_argument("--interval", type=float, default=15.0, help="seconds between passes (default 15)")
            c.add_argument("--steps", type=int, help="stop after this many passes (default: run until killed)")
            c.add_argument("--drain-timeout", type=float, default=300.0,
                           help="seconds a draining pod's requests may take before it is deleted anyway (default 300)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "run" and (args.interval <= 0 or (args.steps is not None and args.steps < 1)):
            raise ConfigError("--interval/--steps", f"{args.interval}/{args.steps}", "must be positive",
                              "--interval 15 --steps 10, or leave --steps out")
        scale, fallback_price, pod = scale_settings(args.stack, args.stacks_dir)
        client, deployer, per_pod = cell_of(args, args.stacks_dir)
    except ConfigError as err:
        print(f"scale.py: {err}", file=sys.stderr)
        return err.exit_code
    if args.cmd == "status":
        try:
            state = client.state()
        except OSError as err:
            print(f"scale.py: the cell cannot be read: {err}", file=sys.stderr)
            return 1
        pods, draining = deployer.declared()
        print(json.dumps({"declared": {"pods": pods, "draining": draining}, "desired": state.get("desired"),
                          "decision": state.get("decision"), "keeper": state.get("keeper"),
                          "worker_hash": state.get("worker_hash"), "checkout_hash": checkout_hash(),
                          "lock": state.get("lock"), "inflight": state.get("inflight"), "backends": state.get("backends")},
                         indent=2))
        return 0
    policy = policy_of(scale, fallback_price, per_pod or pod.price_cap, pod.spare_pods) if scale is not None else None
    say = lambda line: print(line, flush=True)  # noqa: E731
    keeper = Keeper(deployer, checkout_hash(), say=say)
    ctl = Controller(client, deployer, policy, lock_ttl_s=lease_ttl(args.interval), drain_timeout_s=args.drain_timeout,
                     say=say, keeper=keeper)
    if policy is None:
        say(f"scale: stack {args.stack} has no colocate:scale: keeping its pods, not scaling them")
    alerts = ctl.run(args.interval, steps=args.steps, stop_on_alert=True)
    if alerts:
        print(f"scale.py: stopped on the keeper's alert(s): {', '.join(a['name'] for a in alerts)}", file=sys.stderr)
        return ALERT_EXIT
    return 0


ALERT_EXIT = 3


def checkout_hash() -> str:
    """The content hash of the Worker this checkout would upload (colocate/cell/plan.py WorkerPlan.content_hash)."""
    return plan_mod.modules_hash(plan_mod.worker_modules())


if __name__ == "__main__":
    sys.exit(main())
