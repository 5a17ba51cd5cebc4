#!/usr/bin/env python3
"""Probe a deployed cell: measure every segment, check where each part ran, against budgets and floors.

    probe.py URL [--token T | env COLOCATE_READ_TOKEN] [--key K | env COLOCATE_CLIENT_KEY]
             [--samples 25] [--expect-region R] [--pod-location LOC ...] [--pod-path P]
             [--placement-mode M] [--placement-host HOST:PORT]
             [--budget NAME=MS[@pNN] ...] [--json PATH|-] [--plot PNG] [--stack S] [--warn-only]

A warm-up request, one check of the fallback (GET /_colocate/probe?fallback=1), then N samples
of the Worker's probe endpoint (GET /_colocate/probe) and N of a routed request
(POST /v1/chat/completions, max_tokens 1), all over one reused connection. Routed requests
carry a client key: the one given, else a 15-minute key minted with the admin token
(COLOCATE_ADMIN_TOKEN, or the stack's adminToken output) and revoked at the end (Ctrl-C
included). Everything else needs only the read token. A running sandbox (--state-dir, or --stack S
of a running sandbox) adds N probes on new pod connections (pod_rtt_new): the sandbox closes its
pod hops' connections before each and counts the new ones.
With --stack naming a fleet stack: from each client site (--client-site NAME=URL, repeatable),
which cell served, e2e and segments, and whether it was the site's nearest healthy cell.
Exit 0 when every check holds, 1 when a budget or placement check fails (0 with --warn-only,
still reported), 2 on a usage error or an unreachable target. See docs/probe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import cli, stackfile  # noqa: E402
from colocate.cell import catalogue
from colocate.cell.catalogue import EXISTING  # noqa: E402
from colocate.cell.plan import PATH_ENDPOINT, POD_PATHS, placement_mode  # noqa: E402
from colocate.errors import ConfigError  # noqa: E402
from colocate.probe import budgets, connections, fallbackshare, keys, outputs, report, sample  # noqa: E402
from colocate.probe.errors import ProbeError, UsageError  # noqa: E402
from colocate.probe.placement import PLACEMENT_MODES  # noqa: E402
from colocate.sandbox.statedir import FLEET_OUT_FILE  # noqa: E402

TOKEN_ENV = "COLOCATE_READ_TOKEN"  # colocate.admin.TOKEN_ENVS["read"]; the old COLOCATE_PROBE_TOKEN is read for one release
DEFAULT_SAMPLES = 25
MAX_SAMPLES = 1000


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="probe.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", nargs="?", metavar="URL", help="the Worker's base URL (default: the stack's workerUrl output)")
    p.add_argument("--token", help=f"the read token; prefer the environment variable {TOKEN_ENV} (argv is visible to others)")
    p.add_argument("--streams", type=int, metavar="N",
                   help=f"streamed answers of about {sample.STREAM_TOKENS} tokens, spread over the run: their ttft and "
                        "itl (default: --samples / 5; 0: none)")
    p.add_argument("--key", help=f"client key for the routed samples; prefer {keys.KEY_ENV}. Without one the probe "
                                 "mints a 15-minute key with the admin token (COLOCATE_ADMIN_TOKEN) and revokes it at the end")
    p.add_argument(
        "--samples", type=int, help=f"samples per kind (default: the stack's colocate:probe.samples, else {DEFAULT_SAMPLES})"
    )
    p.add_argument(
        "--expect-region",
        metavar="R",
        help="region the cell should run in (default: the stack's colocate:region, else the Worker's own)",
    )
    p.add_argument("--budget", action="append", default=[], metavar="NAME=MS[@pNN]",
                   help="latency budget on a segment's p50 (or the given percentile); repeatable; replaces the stack's budgets")
    p.add_argument(
        "--json", metavar="PATH|-", help="write the JSON result to PATH; '-' prints it on stdout and the table on stderr"
    )
    p.add_argument("--plot", metavar="PNG", help="write a PNG of the per-segment distributions")
    p.add_argument(
        "--stack", metavar="S", help="read URL, token, pod location (outputs) and region, budgets, samples (config) from stack S"
    )
    p.add_argument("--stacks-dir", type=Path, default=stackfile.STACKS_DIR, help=argparse.SUPPRESS)
    p.add_argument("--pod-location", metavar="LOC", action="append", default=[],
                   help="a pod's GPU location, e.g. AP-JP-1 or TW; repeat once per pod, in index order "
                        "(default: the stack's podLocations output)")
    p.add_argument("--pod-path", metavar="P", choices=POD_PATHS,
                   help=f"how the Worker reaches the pods ({', '.join(POD_PATHS)}); reported with the measured "
                        "pod_rtt (default: the stack's podPath output)")
    p.add_argument("--placement-mode", metavar="M", choices=PLACEMENT_MODES,
                   help=f"the Worker's placement mode ({', '.join(PLACEMENT_MODES)}); pod also checks that the Worker "
                        "runs at pod 0 (default: the stack's placementMode output)")
    p.add_argument("--placement-host", metavar="HOST:PORT",
                   help="pod mode: the address Cloudflare places by (default: the stack's placementHost output)")
    p.add_argument("--hop-not-after", metavar="RFC3339",
                   help="when the pod hop's earliest certificate ends: a warning 30 days ahead, a failed check 7 days "
                        "ahead (default: the stack's hopCertsNotAfter output; colocate/cell/certexpiry.py)")
    p.add_argument("--model", help="model for the routed request (default: the first of GET /v1/models)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="per-request timeout in seconds (default 10)")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="keep retrying the warm-up for up to S seconds while the target is not answering yet (after a deploy)")
    p.add_argument("--settle", type=float, default=0.0, metavar="S",
                   help="first wait up to S seconds for the Worker to run in the same in-region colo a few probes in a "
                        "row (a placement just set or changed); a placement check that fails when it never settled is "
                        "PROVISIONAL: exit 0, rerun later (the post-deploy probe passes --settle)")
    p.add_argument("--warn-only", action="store_true", help="report failed checks but exit 0")
    p.add_argument("--max-fallback-share", type=float, metavar="SHARE",
                   help="fail when the fallback answers more than this share (0 to 1) while pods are in rotation "
                        "(default: the stack's colocate:probe.maxFallbackShare, else "
                        f"{fallbackshare.DEFAULT_MAX_SHARE:g})")
    p.add_argument("--live", action="store_true",
                   help="read real traffic instead of sampling: per-segment percentiles, shares and colos recorded by the "
                        "Worker (GET /_colocate/live), with the same verdicts and exit codes")
    p.add_argument(
        "--since", default="1h", metavar="1h", help="with --live: the window, e.g. 15m, 1h, 7d (default 1h; up to 35d)"
    )
    p.add_argument("--state-dir", type=Path, help="a running sandbox's state directory: its URL, token, pod locations "
                   "and path, and its stack file's region, budgets and samples (as --stack S reads a sandbox of S)")
    p.add_argument("--client-site", action="append", default=[], metavar="NAME=URL",
                   help="with --stack <fleet>: a client site and the URL that reaches the front door from there; "
                        "repeatable (default: the running sandbox fleet's sites, else the fleet's workerUrl)")
    p.add_argument("--sandboxes-dir", type=Path,
                   help="with --stack <fleet>: where the cells' (and the fleet's) sandbox state directories are "
                        "(default: where sandbox.py puts them)")
    return p


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError("URL", url, "not an http(s) URL", "give the Worker's base URL, e.g. https://colocate-apac-jp.example.workers.dev")
    return url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    try:
        return _probe(args)
    except (ProbeError, ConfigError) as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # --json or --plot path not writable
        print(f"probe: cannot write {exc.filename or 'output'}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("probe: interrupted", file=sys.stderr)
        return 130


def _probe(args: argparse.Namespace) -> int:
    from colocate import admin

    cells = admin.fleet_cells(args.stack, args.stacks_dir) if args.stack else None
    if cells is not None:
        return _fleet(args, cells)
    if args.client_site:
        raise UsageError("--client-site", args.client_site[0], "only a fleet is probed from client sites",
                         "add --stack <fleet stack> (a stack with colocate:fleet)")
    if args.live:
        return _live(args)
    budget_list = budgets.from_flags(args.budget)  # validate flags before any request
    max_share = _max_share(args, None)
    if args.samples is not None and not 1 <= args.samples <= MAX_SAMPLES:
        raise UsageError("--samples", args.samples, f"must be between 1 and {MAX_SAMPLES}", "e.g. --samples 25")
    if not args.timeout > 0:
        raise UsageError("--timeout", args.timeout, "must be a positive number of seconds", "e.g. --timeout 10")
    region = catalogue.region(args.expect_region, key="--expect-region") if args.expect_region else None

    url, token, locations = args.url, args.token or admin.token_from_env(os.environ, "read"), list(args.pod_location)
    mint_token = os.environ.get(admin.TOKEN_ENVS["admin"])  # only to mint the routed samples' key
    pod_path, samples, worker_placement = args.pod_path, args.samples, args.placement_mode
    placement_host = args.placement_host
    hop_not_after = args.hop_not_after
    cell = _sandbox_cell(args)
    if cell is not None:  # a running sandbox: its files say what a deployed stack's outputs say
        cfg, region, budget_list = _from_stack(args, region, budget_list, cell)
        samples, max_share = samples or cfg.samples, _max_share(args, cfg)
        url, token, pod_path = url or cell.url, token or cell.read_token, pod_path or cell.pod_path
        mint_token = mint_token or cell.token  # the sandbox's admin token, to mint the samples' key
        locations = locations or list(cell.pod_locations)
        worker_placement = worker_placement or placement_mode(cfg.worker_placement, pod_path)
        if region is None and cell.region:
            region = catalogue.region(cell.region, key=f"the region of the sandbox in {cell.state_dir}")
    elif args.stack:
        cfg, region, budget_list = _from_stack(args, region, budget_list)
        samples, max_share = samples or cfg.samples, _max_share(args, cfg)
        if not (url and token and locations and pod_path):  # the post-deploy step passes them all: no CLI call
            out = _deployed_outputs(args.stack)
            url, token, pod_path = url or out.worker_url, token or out.read_token, pod_path or out.pod_path
            mint_token = mint_token or out.admin_token
            worker_placement = worker_placement or out.placement_mode
            placement_host = placement_host or out.placement_host
            hop_not_after = hop_not_after or out.hop_not_after
            if not locations:
                locations = list(out.pod_locations) or ([out.pod_location] if out.pod_location else [])
        if not worker_placement and pod_path:  # not given, or a stack deployed before placementMode: its config says
            worker_placement = placement_mode(cfg.worker_placement, pod_path)
    if not url:
        raise UsageError("URL", None, "no Worker URL", "give it as the first argument, or --stack S")
    url = _check_url(url)
    if not token:
        raise UsageError("--token", None, "no read token", f"set {TOKEN_ENV} (or pass --token, or --stack S)")
    samples = samples or DEFAULT_SAMPLES
    # A sandbox can close its pod hops' connections and count new ones: pod_rtt_new (colocate/probe/connections.py).
    hops = connections.HopControl(cell.control_url, args.timeout) if cell is not None and cell.control_url else None
    fresh = f" + {samples} on new pod connections" if hops else ""
    streams = samples // 5 if args.streams is None else args.streams
    if not 0 <= streams <= samples:
        raise UsageError("--streams", streams, f"must be between 0 and --samples ({samples})", "e.g. --streams 5")
    streamed = f" + {streams} streamed answers of about {sample.STREAM_TOKENS} tokens" if streams else ""
    if not streams:  # nothing measures them: their budgets (the kit's defaults, say) are not this run's to judge
        budget_list = [b for b in budget_list if b.segment not in sample.STREAM_SEGMENTS]
    print(f"probing {url}: warm-up, then {samples} probe{fresh} + {samples} routed requests{streamed}", file=sys.stderr)
    if not 0 <= args.wait <= 900:
        raise UsageError("--wait", args.wait, "must be between 0 and 900 seconds", "e.g. --wait 120")
    if not 0 <= args.settle <= 900:
        raise UsageError("--settle", args.settle, "must be between 0 and 900 seconds", "e.g. --settle 300")
    # Smart placement moves the Worker only once it has traffic to learn from: nothing to wait for.
    settle_s = args.settle if region is not None and worker_placement != "smart" else 0.0
    say = lambda msg: print(f"  {msg}", file=sys.stderr)  # noqa: E731
    # The key lives only in this process: never in argv of a child, a log line or the JSON.
    # A cell whose read token cannot mint (the admin token was not given) refuses with 403,
    # and KeyLease names --key and COLOCATE_CLIENT_KEY as the way on.
    with keys.KeyLease(url, mint_token or token, args.key or os.environ.get(keys.KEY_ENV), say=say) as lease:
        run = sample.run(url, token, samples, args.timeout, args.model, progress=say, wait_s=args.wait,
                         key=lease.get, settle_s=settle_s, in_region=region.is_in_region if region else None,
                         hops=hops, streams=streams)
    result = report.build(run, region, locations, budget_list, worker_placement, pod_path, placement_host,
                          _migrate_flags(args, cell), max_share)

    def plot(path):
        from colocate.probe import plot  # matplotlib only when asked for

        plot.write(result, path)

    if not result.ok and result.provisional:
        print("probe: placement not settled: the verdict is provisional (exit 0); Cloudflare may not have applied "
              f"the new placement yet. Check again in a few minutes: .venv/bin/python scripts/probe.py "
              f"{f'--stack {args.stack}' if args.stack else url}",
              file=sys.stderr)
    table, doc = _keeper(_fetch_scale(url, token, args.timeout), report.table(result), report.to_json(result, args.warn_only))
    table, doc, certs_ok = _hop_certificates(hop_not_after, args.stack, table, doc, pod_path == PATH_ENDPOINT)
    return _emit(args, table, doc, (result.ok or result.provisional) and certs_ok, plot)


def _keeper(scale: dict | None, table: str, doc: dict) -> tuple[str, dict]:
    """The keeper's last pass (colocate/scaling/keeper.py) as the generation holds it: one line and the JSON's
    ``keeper`` (each pod's verdict, the alerts, the last events). Shown, not judged: its alerts page
    through /_colocate/metrics and the keeper's exit status."""
    from colocate.scaling import keeper

    record = (scale or {}).get("keeper")
    if not isinstance(record, dict):
        return table, doc
    shown = {k: record.get(k) for k in ("at", "pods", "alerts", "replacements")}
    return table + keeper.summary(record), {**doc, "keeper": {**shown, "events": (record.get("events") or [])[-3:]}}


def _hop_certificates(not_after: str | None, stack: str | None, table: str, doc: dict,
                      endpoints: bool = False) -> tuple[str, dict, bool]:
    """The hop certificates' verdict (colocate/cell/certexpiry.py) added to the table and the JSON;
    False when they end within FAIL_DAYS (the check fails, as a budget does). ``endpoints``: the pods
    are endpoints the team runs, whose certificates their operator installs."""
    if not not_after:
        return table, doc, True
    from datetime import UTC, datetime

    from colocate.cell import certexpiry

    try:
        verdict = certexpiry.check(not_after, datetime.now(UTC), stack, endpoints=endpoints)
    except ValueError:
        raise UsageError("--hop-not-after", not_after, "is not an RFC 3339 time", "e.g. 2027-03-06T06:00:00Z") from None
    doc = {**doc, "hop_certificates": verdict.as_json()}
    mark = {certexpiry.OK: "ok", certexpiry.WARN: "WARN", certexpiry.FAIL: "FAIL"}[verdict.level]
    if verdict.level != certexpiry.OK:
        print(f"probe: {verdict.message}", file=sys.stderr)
    return table + f"hop certificates: {mark}: {verdict.message}\n", doc, verdict.level != certexpiry.FAIL


def _emit(args: argparse.Namespace, table: str, doc: dict, ok: bool, plot) -> int:
    """The table (stderr when the JSON goes to stdout), the JSON, the plot, and the exit code."""
    print(table, file=sys.stderr if args.json == "-" else sys.stdout, end="")
    text = json.dumps(doc, indent=2)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
    if args.plot:
        plot(args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if ok:
        return 0
    if args.warn_only:
        print("probe: checks failed (--warn-only: exit 0)", file=sys.stderr)
        return 0
    return 1


# A fleet probe judges which cell served each client site; these flags judge one cell.
CELL_ONLY = ("expect_region", "pod_location", "pod_path", "placement_mode", "placement_host", "budget", "plot", "settle",
             "live", "state_dir", "token")


def _fleet(args: argparse.Namespace, cells: tuple[str, ...]) -> int:
    """probe.py --stack <fleet>: from each client site, which cell served and whether it was
    the nearest healthy one (docs/probe.md, "Probing a fleet")."""
    from colocate.probe import fleet as fleet_probe

    if args.live:
        return _fleet_live(args, cells)
    for name in CELL_ONLY:
        if getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(flag, getattr(args, name), f"probes one cell; --stack {args.stack} is a fleet",
                             f"leave {flag} out, or probe a member cell with --stack <cell>")
    if args.samples is not None and not 1 <= args.samples <= MAX_SAMPLES:
        raise UsageError("--samples", args.samples, f"must be between 1 and {MAX_SAMPLES}", "e.g. --samples 25")
    if not args.timeout > 0:
        raise UsageError("--timeout", args.timeout, "must be a positive number of seconds", "e.g. --timeout 10")
    where = (args.sandboxes_dir / args.stack if args.sandboxes_dir else _sandbox_dir(args.stack)) / FLEET_OUT_FILE
    sandbox = fleet_probe.read_sandbox_fleet(where)
    sites = fleet_probe.sites_for(args.stack, args.client_site, args.url, sandbox, where,
                                  lambda: outputs.read_outputs(args.stack).worker_url)
    key = args.key or os.environ.get(keys.KEY_ENV) or (sandbox.key if sandbox else None)
    if not key:
        raise UsageError("--key", None, "no client key for the routed samples (a fleet's key must work in every cell)",
                         f"set {keys.KEY_ENV} to one made by `.venv/bin/python scripts/keys.py create --stack "
                         f"{args.stack} --name probe`")
    samples = args.samples or DEFAULT_SAMPLES
    say = lambda msg: print(f"  {msg}", file=sys.stderr)  # noqa: E731
    print(f"probing fleet {args.stack} ({', '.join(cells)}) from {len(sites)} client site(s): {samples} routed "
          "requests each", file=sys.stderr)
    result = fleet_probe.run(args.stack, cells, sites, key, samples, args.timeout, args.model, stacks_dir=args.stacks_dir,
                             sandboxes_dir=args.sandboxes_dir, sandbox=sandbox, say=say)
    return _emit(args, fleet_probe.table(result), fleet_probe.to_json(result, args.warn_only), result.ok, None)


def _sandbox_cell(args: argparse.Namespace):
    """The running sandbox the flags name: --state-dir DIR (an error when none runs there), or
    --stack S when S's sandbox runs in its default state directory and no URL was given."""
    from colocate.probe import sandbox

    if args.state_dir:
        return sandbox.from_state_dir(args.state_dir)
    if args.stack and not args.url:
        return sandbox.of_stack(args.stack, args.sandboxes_dir)
    return None


def _migrate_flags(args: argparse.Namespace, cell) -> str | None:
    """The flags that name the probed cell's stack to migrate.py, when the probe knows it."""
    stack, stacks_dir = (cell.stack, cell.stacks_dir) if cell is not None else (args.stack, args.stacks_dir)
    if not stack:
        return None
    default = stacks_dir is None or Path(stacks_dir).resolve() == Path(stackfile.STACKS_DIR).resolve()
    return f"--stack {stack}" + ("" if default else f" --stacks-dir {stacks_dir}")


def _deployed_outputs(stack: str):
    """A deployed stack's outputs; when they cannot be read, the error also says how to reach a sandbox."""
    from colocate.probe import sandbox
    from colocate.probe.errors import OutputsError

    try:
        return outputs.read_outputs(stack)
    except OutputsError as exc:
        raise sandbox.no_cell_for_stack(stack, f"its deployed outputs could not be read ({exc})") from None


def _fleet_live(args: argparse.Namespace, cells: tuple[str, ...]) -> int:
    """probe.py --stack <fleet> --live: every cell's live window merged, per colo which cells served
    (docs/probe.md, "A fleet's live view")."""
    from colocate.probe import fleet as fleet_probe, fleet_live, live

    for name in ("expect_region", "pod_location", "pod_path", "placement_mode", "placement_host", "budget", "plot",
                 "state_dir", "token", "client_site", "key", "samples"):
        if getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(flag, getattr(args, name), f"is not used by a fleet's live view (--stack {args.stack} --live)",
                             f"leave {flag} out, or read one cell with --stack <cell> --live")
    try:
        since_ms = live.parse_since(args.since)
    except ValueError as exc:
        raise UsageError("--since", args.since, str(exc), "e.g. --since 15m, --since 1h or --since 7d") from None
    if not args.timeout > 0:
        raise UsageError("--timeout", args.timeout, "must be a positive number of seconds", "e.g. --timeout 10")
    where = (args.sandboxes_dir / args.stack if args.sandboxes_dir else _sandbox_dir(args.stack)) / FLEET_OUT_FILE
    members = fleet_probe.member_targets(cells, stacks_dir=args.stacks_dir, sandboxes_dir=args.sandboxes_dir,
                                         sandbox=fleet_probe.read_sandbox_fleet(where))
    windows = []
    for name, region, target in members:
        if isinstance(target, Exception):
            windows.append(fleet_live.CellWindow(name, region, error=f"not found ({target})"))
            continue
        try:
            windows.append(fleet_live.CellWindow(name, region, _fetch_live(target.url, target.token, since_ms, args.timeout)))
        except ProbeError as exc:
            windows.append(fleet_live.CellWindow(name, region, error=str(exc)))
    result = fleet_live.build(args.stack, windows, since_ms)
    return _emit(args, fleet_live.table(result), fleet_live.to_json(result, args.warn_only), result.ok, None)


def _from_stack(args: argparse.Namespace, region, budget_list, cell=None):
    """The stack file's settings (a sandbox's: the stack and stack directory it was started
    from), and the region and budgets it gives where flags gave none."""
    stack, stacks_dir = (cell.stack, cell.stacks_dir or args.stacks_dir) if cell is not None else (args.stack, args.stacks_dir)
    cfg = outputs.read_config(stack, stacks_dir)
    if region is None and cfg.region is not None:
        region = catalogue.region(cfg.region, key=f"colocate:region of stack {stack}")
    if not args.budget:
        budget_list = budgets.from_stack(cfg.budgets)
    return cfg, region, budget_list


def _live(args: argparse.Namespace) -> int:
    """probe.py --live: judge the window of real traffic the Worker recorded (docs/probe.md, "Live view")."""

    from colocate import admin
    from colocate.probe import live

    budget_list = budgets.from_flags(args.budget)
    max_share = _max_share(args, None)
    try:
        since_ms = live.parse_since(args.since)
    except ValueError as exc:
        raise UsageError("--since", args.since, str(exc), "e.g. --since 15m, --since 1h or --since 7d") from None
    if not args.timeout > 0:
        raise UsageError("--timeout", args.timeout, "must be a positive number of seconds", "e.g. --timeout 10")
    region = catalogue.region(args.expect_region, key="--expect-region") if args.expect_region else None
    url, token = args.url, args.token or admin.token_from_env(os.environ, "read")
    locations, worker_placement = list(args.pod_location), None
    hop_not_after = args.hop_not_after
    cell = _sandbox_cell(args)
    if cell is not None:
        cfg, region, budget_list = _from_stack(args, region, budget_list, cell)
        worker_placement, max_share = cfg.worker_placement, _max_share(args, cfg)
        url, token = url or cell.url, token or cell.read_token
        locations = locations or list(cell.pod_locations)
        if region is None and cell.region:
            region = catalogue.region(cell.region, key=f"the region of the sandbox in {cell.state_dir}")
    elif args.stack:
        cfg, region, budget_list = _from_stack(args, region, budget_list)
        worker_placement, max_share = cfg.worker_placement, _max_share(args, cfg)
        if not (url and token and hop_not_after):
            out = _deployed_outputs(args.stack)
            url, token = url or out.worker_url, token or out.read_token
            hop_not_after = hop_not_after or out.hop_not_after
            locations = locations or list(out.pod_locations) or ([out.pod_location] if out.pod_location else [])
    if not url:
        raise UsageError("URL", None, "no Worker URL", "give it as the first argument, or --stack S")
    url = _check_url(url)
    if not token:
        raise UsageError("--token", None, "no read token", f"set {TOKEN_ENV} (or pass --token, or --stack S)")
    doc = _fetch_live(url, token, since_ms, args.timeout)
    scale = _fetch_scale(url, token, args.timeout)
    routed = scale.get("routed_pods") if isinstance(scale, dict) else None
    result = live.build(doc, region, locations, budget_list, worker_placement, url, max_share,
                        routed if isinstance(routed, int) and not isinstance(routed, bool) else None)
    scale_line, scale_doc = live.scale_summary(scale)
    body = live.to_json(result, args.warn_only)
    if scale_doc is not None:
        body["scale"] = scale_doc
    table, body = _keeper(scale, live.table(result) + scale_line, body)
    table, body, certs_ok = _hop_certificates(hop_not_after, args.stack, table, body, _endpoints(args))
    return _emit(args, table, body, result.ok and certs_ok, lambda path: live.write_plot(result, path))


def _endpoints(args: argparse.Namespace) -> bool:
    """Whether the stack's pods are endpoints the team runs (colocate:pod.provider existing)."""
    if not args.stack:
        return False
    try:
        pod = stackfile.read_config(args.stack, args.stacks_dir)[0].get("pod")
    except ConfigError:
        return False
    return isinstance(pod, dict) and pod.get("provider") == EXISTING


def _max_share(args: argparse.Namespace, cfg) -> float:
    """--max-fallback-share, else the stack's colocate:probe.maxFallbackShare, else the default; checked."""
    given = args.max_fallback_share
    if given is None:
        return cfg.max_fallback_share if cfg is not None else fallbackshare.DEFAULT_MAX_SHARE
    if not 0 <= given <= 1:
        raise UsageError("--max-fallback-share", given, "must be a share from 0 to 1", "e.g. --max-fallback-share 0.1")
    return given


def _fetch_scale(url: str, token: str, timeout_s: float) -> dict | None:
    """The scaling controller's signals and last decision (None where the Worker has none to give)."""
    import requests

    try:
        r = requests.get(f"{url}/_colocate/scale", timeout=timeout_s,
                         headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def _sandbox_dir(stack: str) -> Path:
    from colocate.sandbox.supervisor import default_state_dir

    return Path(default_state_dir(stack))


def _fetch_live(url: str, token: str, since_ms: int, timeout_s: float) -> dict:
    import requests

    from colocate.probe.errors import TargetError, Unauthorized, Unreachable

    where = f"{url}/_colocate/live"
    try:
        r = requests.get(where, params={"since": since_ms}, timeout=timeout_s,
                         headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    except requests.Timeout:
        raise Unreachable(f"{where} did not answer within {timeout_s:g} s (--timeout)") from None
    except requests.ConnectionError:
        raise Unreachable(f"cannot reach {where}: connection refused or no route; is the URL right and the cell up?") from None
    if r.status_code == 401:
        raise Unauthorized(f"{where} answered 401: the read token is missing or wrong; pass --token or set {TOKEN_ENV}")
    if r.status_code == 404:
        raise TargetError(f"{where} answered 404: this Worker records no live view yet; deploy the current Worker (pulumi up)")
    try:
        doc = r.json()
    except ValueError:
        doc = None
    if r.status_code != 200 or not isinstance(doc, dict):
        raise TargetError(f"{where} answered HTTP {r.status_code}: {r.text[:200]}")
    return doc


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM (a supervisor stopping us) ends the run as Ctrl-C does: a minted key is revoked.
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
