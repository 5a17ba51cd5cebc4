#!/usr/bin/env python3
"""What the cell costs against the fallback API: pods' cost, tokens by pods and fallback, break-even.

    cost.py --stack S [--since 30d] [--json] [--plot PNG]
            [--url URL] [--state-dir DIR] [--cost-per-hr X] [--hours H] [--capacity-rpm N]

The usage comes from the Worker (GET /_colocate/usage, read token): a running sandbox of the
stack, else the deployed stack (`pulumi stack output`), or --url with COLOCATE_READ_TOKEN.
The pods' $/hr is the stack's podsCostPerHr output (what the providers reported; for endpoints the
team runs, the sum of their colocate:pod.endpoints[].costPerHr, the team's own figure, 0 unless set,
and said so); a sandbox's stand-in reports no price, so there it is colocate:pod.maxPricePerHr x
pod.count (an existing cell's declared figures), and said so.
The hours are the window's, or since the sandbox's pods started; --hours overrides.
The fallback's price is colocate:fallbackPrice {input, output} in $ per 1M tokens.
Exit 0 with the report, 2 on a usage error or an unreachable target. See docs/probe.md, "Cost".
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import admin, stackfile
from colocate.cell import capacity, outputs as names, settings
from colocate.errors import ColocateError, ConfigError, NoCapacity, ScriptError  # noqa: E402
from colocate.probe import sandbox as probe_sandbox  # noqa: E402
from colocate.sandbox.statedir import local_pod_records  # noqa: E402
from colocate.scaling import cost

DAY_S = 86_400
PULUMI_TIMEOUT_S = 120


class CostError(ScriptError):
    """The report cannot be made; the message names the flag or source and the fix (exit 2)."""

    exit_code = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cost.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", metavar="S", help="the stack: its config (fallbackPrice, pod) and its cell (sandbox or deployed)")
    p.add_argument(
        "--since", default="30d", metavar="30d", help="the window: whole days back from today, e.g. 7d, 30d (default 30d)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="PNG", help="monthly cost against daily volume: the cell flat, the API through zero")
    p.add_argument("--url", help="the Worker's URL (the read token from COLOCATE_READ_TOKEN)")
    p.add_argument("--state-dir", type=Path, help="a sandbox's state directory")
    p.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help=argparse.SUPPRESS)
    p.add_argument("--cost-per-hr", type=float, metavar="USD", help="the pods' $/hr together (default: podsCostPerHr)")
    p.add_argument("--hours", type=float, metavar="H", help="hours the pods ran in the window (default: the window's)")
    p.add_argument("--capacity-rpm", type=float, metavar="N",
                   help="requests per minute one pod can serve; gives the utilisation (default: the knee of the "
                        "default pod profile, colocate/cell/capacity.py; measure yours with make bench-pod)")
    p.add_argument(
        "--price", metavar="IN,OUT", help="the fallback's $ per 1M input,output tokens (default: colocate:fallbackPrice)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return _run(args)
    except ColocateError as exc:
        print(f"cost: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"cost: cannot write {exc.filename or 'output'}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def window_days(text: str) -> int:
    t = (text or "").strip().lower()
    num = t[:-1] if t.endswith("d") else t
    if not num.isdigit() or not 1 <= int(num) <= 400:
        raise CostError(f"--since {text!r}: the window is whole days, 1d to 400d. Fix: e.g. --since 30d")
    return int(num)


def _price(args, raw: dict) -> cost.Price | None:
    if args.price:
        parts = args.price.split(",")
        try:
            vals = [float(x) for x in parts]
        except ValueError:
            vals = []
        if len(vals) != 2 or any(not v >= 0 for v in vals):
            raise CostError(f"--price {args.price!r}: expected IN,OUT in $ per 1M tokens. Fix: e.g. --price 0.15,0.6")
        return cost.Price(*vals)
    p = settings.parse_fallback_price(raw.get("fallbackPrice"))
    return cost.Price(*p) if p else None


def _positive(flag: str, v: float | None, allow_zero: bool = True) -> None:
    if v is None:
        return
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise CostError(f"{flag} {v!r}: must be a number {'>= 0' if allow_zero else '> 0'}. Fix: e.g. {flag} 1")


def _deployed_cost_per_hr(stack: str) -> float:
    cmd = ["pulumi", "stack", "output", "--json", "--stack", stack]  # no --show-secrets: only podsCostPerHr is read
    try:
        proc = subprocess.run(cmd, cwd=stackfile.ROOT, capture_output=True, text=True, timeout=PULUMI_TIMEOUT_S, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        raise CostError(f"--stack {stack}: `pulumi stack output` could not run; pass --cost-per-hr USD") from None
    try:
        value = json.loads(proc.stdout).get(names.PODS_COST_PER_HR) if proc.returncode == 0 else None
    except (ValueError, AttributeError):
        value = None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise CostError(f"--stack {stack}: no {names.PODS_COST_PER_HR} output (run `pulumi up -s {stack}` first); "
                        "or pass --cost-per-hr USD")
    return float(value)


def _sandbox_started(state_dir: Path) -> float | None:
    """When the sandbox's pods were created (the earliest local pod record), epoch seconds."""
    created = []
    for record in local_pod_records(state_dir):
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("created"), int | float):
            created.append(float(data["created"]))
    return min(created) if created else None


def _run(args: argparse.Namespace) -> int:
    days = window_days(args.since)
    for flag, v in (("--cost-per-hr", args.cost_per_hr), ("--hours", args.hours)):
        _positive(flag, v)
    _positive("--capacity-rpm", args.capacity_rpm, allow_zero=False)
    if args.price:
        _price(args, {})  # a bad --price is refused before any request
    if not (args.stack or args.url or args.state_dir):
        raise CostError("no target: pass --stack S (a running sandbox or a deployed stack), --state-dir DIR (a "
                        "sandbox started with that --state-dir), or --url URL")
    target = admin.resolve(url=args.url, stack=args.stack, state_dir=args.state_dir, role="read")
    # A sandbox named by its directory alone: its own stack file (the one `up` was given) has the price.
    cell = probe_sandbox.read(args.state_dir) if args.state_dir and not args.stack else None
    stack, stacks_dir = (cell.stack, cell.stacks_dir or args.stacks_dir) if cell else (args.stack, args.stacks_dir)
    raw: dict = {}
    if stack:
        try:
            raw, _ = stackfile.read_config(stack, stacks_dir)
        except ConfigError as exc:
            raise CostError(f"--stack {stack}: {exc}") from None
    price = _price(args, raw)
    try:
        caps = settings.parse_fallback_cap(raw.get("fallbackCap"), (price.input, price.output) if price else None)
    except ConfigError as exc:
        raise CostError(f"--stack {stack}: {exc}") from None
    pod = settings.parse_pod(raw) if raw else None
    now = time.time()
    since_day = time.strftime("%Y-%m-%d", time.gmtime(now - (days - 1) * DAY_S))
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    usage = admin.AdminClient(target).usage(since=since_day, until=today)
    rows = usage.get("usage")
    if not isinstance(rows, list):
        raise CostError(f"{target.url}: GET /_colocate/usage answered without a usage list")

    notes = []
    hours = args.hours
    window_h = days * 24.0
    if target.source == "sandbox":
        started = _sandbox_started(Path(args.state_dir) if args.state_dir else _default_state_dir(args.stack))
        if hours is None and started is not None:
            hours = min(window_h, max(0.0, (now - started) / 3600))
            notes.append(f"the sandbox's pods started {cost.duration(hours)} ago: the window is that long")
    if hours is None:
        hours = window_h
        notes.append(f"assumes the pods ran the whole {days}-day window; pass --hours if they did not")
    cost_per_hr, source = args.cost_per_hr, "--cost-per-hr"
    own = pod is not None and pod.provider == settings.EXISTING
    if own and cost_per_hr is None:
        assert pod is not None
        declared = sum(e.cost_per_hr for e in pod.endpoints)
        notes.append("the pods are endpoints you run: their cost is your own figure, colocate:pod.endpoints[].costPerHr"
                     + (" (unset: 0, so they look free here; set each to what its box costs you an hour)"
                        if declared == 0 else f" (${declared:g}/hr together), not a provider's bill"))
        if target.source != "stack":  # a deployed stack's podsCostPerHr is the figure it declared
            cost_per_hr, source = declared, "colocate:pod.endpoints[].costPerHr"
    if cost_per_hr is None:
        if target.source == "sandbox" and pod is not None:
            cost_per_hr = pod.max_price_per_hr * pod.count
            source = (f"colocate:pod.maxPricePerHr x pod.count = {pod.max_price_per_hr:g} x {pod.count} "
                      "(the sandbox's stand-in reports no price)")
        elif target.source == "stack" and args.stack:
            cost_per_hr, source = _deployed_cost_per_hr(args.stack), "podsCostPerHr output"
        else:
            raise CostError("--cost-per-hr: no price for the pods: --url gives the usage, not what the pods cost; "
                            f"pass --cost-per-hr USD (the stack's {names.PODS_COST_PER_HR} output) or --stack S")
    # A window shorter than the days asked (a sandbox up for minutes): volumes per day of what ran.
    span_days = min(days, hours / 24) if hours > 0 else days
    capacity_rpm, request_tokens = args.capacity_rpm, None
    if capacity_rpm is None:  # a pod's capacity from its profile's knee, not a guess: the sandbox's own
        profile = pod.profile if pod is not None and pod.provider == "local" else capacity.DEFAULT_PROFILE
        try:
            knee, where = capacity.knee_rps(profile)
        except NoCapacity as exc:
            notes.append(f"no capacity to count utilisation by: {exc}; pass --capacity-rpm")
        else:
            capacity_rpm, request_tokens = round(knee * 60, 1), capacity.knee_request_tokens(profile)
            notes.append(f"capacity {capacity_rpm:g} req/min a pod: {where}; pass --capacity-rpm for your own pods")
    r = cost.report(rows, cost_per_hr=cost_per_hr, hours=hours, window_days=span_days or days, price=price,
                    cost_source=source, pod_count=pod.count if pod else 1, capacity_rpm=capacity_rpm, today=today,
                    caps=caps, price_counted=not args.price, capacity_tokens_per_request=request_tokens)
    r.notes[:0] = notes
    if args.json:
        print(json.dumps({**cost.to_json(r), "since_day": since_day, "until_day": today, "url": target.url}, indent=2))
    else:
        print(cost.table(r), end="")
    if args.plot:
        cost.plot(r, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _default_state_dir(stack: str) -> Path:
    from colocate.sandbox.supervisor import default_state_dir

    return default_state_dir(stack)


if __name__ == "__main__":
    sys.exit(main())
