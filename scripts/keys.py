#!/usr/bin/env python3
"""Client API keys of a cell or a fleet: create, list, revoke, and usage per key and day.

    keys.py create --stack S --name NAME [--rpm N] [--tpm N] [--monthly-tokens N] [--max-parallel N]
                   [--expires-in SECONDS] [--env]
    keys.py list   --stack S
    keys.py revoke --stack S KEY_ID
    keys.py usage  --stack S [--from YYYY-MM-DD] [--to YYYY-MM-DD] [--key KEY_ID]
    keys.py sync   --stack FLEET

With a fleet stack (one whose config has colocate:fleet), every command works on all its
member cells, each found as a single cell is: `create` makes the key here once and imports
only its SHA-256 into every cell; `revoke` revokes it in every cell; `list` and `usage`
show each key per cell. A cell that cannot be reached or refuses is named, the command
exits 1 and prints the command that finishes the job: `sync`, which copies keys present
in some cells to the cells missing them (same id and digest) and carries revocations to
every cell.

Every command also takes --json (one JSON object on stdout instead of a table), and a
target: --stack S (a running sandbox of S, else the deployed stack's outputs through
`pulumi stack output --show-secrets`), --state-dir DIR (a sandbox), or --url URL with the
admin token in COLOCATE_ADMIN_TOKEN. Keys live in the cell's active generation and move
with it (scripts/migrate.py). `create` prints the key once: store it, it is never shown
again (the cell keeps only its SHA-256). Limits of 0 mean no limit.
Exit: 0 done, 1 the Worker refused (e.g. an unknown key id) or a fleet's cells are left
unequal (the message says which and how to finish), 2 usage error or no target.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import admin, cli  # noqa: E402
from colocate.admin import AdminClient, AdminError, Refused, resolve  # noqa: E402
from colocate.errors import ColocateError, ScriptError  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="keys.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = cli.subcommands(p, dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--stack", help="the stack (a running sandbox of it, else its deployed outputs); "
                        "a fleet stack: each of its cells, found the same way")
        sp.add_argument("--state-dir", type=Path, help="a sandbox's state directory")
        sp.add_argument("--url", help="the Worker's URL (the admin token comes from COLOCATE_ADMIN_TOKEN)")
        sp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        sp.add_argument("--stacks-dir", type=Path, help="where Pulumi.<stack>.yaml files are (default: stacks/)")
        sp.add_argument("--sandboxes-dir", type=Path,
                        help="where running sandboxes keep their state, one directory per stack (default: .colocate/sandbox)")

    c = sub.add_parser("create", help="create a key and print it once")
    common(c)
    c.add_argument("--name", required=True, help="who or what the key is for (1-64 characters)")
    # Each limit left out takes the cell's colocate:keys.defaults (printed after the key).
    c.add_argument("--rpm", type=int, default=None, help="requests per minute (0: no limit; default: colocate:keys.defaults)")
    c.add_argument("--tpm", type=int, default=None, help="tokens per minute (0: no limit; default: colocate:keys.defaults)")
    c.add_argument("--monthly-tokens", type=int, default=None,
                   help="tokens per UTC calendar month (0: no limit; default: colocate:keys.defaults)")
    c.add_argument("--max-parallel", type=int, default=None,
                   help="requests in flight at once (0: no limit; default: colocate:keys.defaults)")
    c.add_argument("--max-parallel-tokens", type=int, default=None,
                   help="prompt tokens of its requests not yet begun at a pod, at once (one a byte of the body; "
                        "0: no limit; default: colocate:keys.defaults)")
    c.add_argument("--fallback-usd-per-day", type=float, default=None, metavar="USD",
                   help="the key's own cap on the fallback's spend per UTC day (default: colocate:fallbackCap.keyUsdPerDay)")
    c.add_argument("--expires-in", type=int, metavar="SECONDS", help="the key stops working after this long")
    c.add_argument("--env", action="store_true",
                   help="print `export OPENAI_BASE_URL=... OPENAI_API_KEY=...` for a shell's eval (OpenAI clients read both)")
    ls = sub.add_parser("list", help="every key, revoked ones too (never the key itself)")
    common(ls)
    r = sub.add_parser("revoke", help="revoke a key (takes effect within colocate:worker.stateTtlMs everywhere)")
    common(r)
    r.add_argument("key_id", metavar="KEY_ID", help="the key's id (key_...), from `list`")
    u = sub.add_parser("usage", help="requests and tokens per key and UTC day, and who served them")
    common(u)
    u.add_argument("--from", dest="since", metavar="YYYY-MM-DD", help="first day (default: the first of this month)")
    u.add_argument("--to", dest="until", metavar="YYYY-MM-DD", help="last day (default: today)")
    u.add_argument("--key", dest="key_id", metavar="KEY_ID", help="one key only")
    sy = sub.add_parser("sync", help="make a fleet's cells agree: copy missing keys, carry revocations")
    common(sy)
    return p


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ms / 1000))


def _table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        lines.append(
            "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
        )
    return "\n".join(lines) + "\n"


def keys_table(keys: list[dict]) -> str:
    def limit(n: int) -> str:
        return str(n) if n else "-"

    rows = [
        [
            k["id"],
            k["name"],
            k["prefix"] + "…",
            limit(k["rpm"]),
            limit(k["tpm"]),
            limit(k["monthly_tokens"]),
            limit(k.get("max_parallel", 0)),
            "default" if k.get("max_parallel_tokens") is None else limit(k["max_parallel_tokens"]),
            _when(k["created_at"]),
            _when(k["expires_at"]),
            "revoked " + _when(k["revoked_at"]) if k["revoked_at"] else "active",
        ]
        for k in keys
    ]
    return _table(["id", "name", "key", "rpm", "tpm", "monthly", "parallel", "prompt tokens", "created (UTC)", "expires",
                   "status"], rows, {3, 4, 5, 6, 7})


def usage_table(rows: list[dict]) -> str:
    def share(r: dict) -> str:
        served = r["pod_requests"] + r["fallback_requests"]
        return f"{100 * r['fallback_requests'] / served:.1f} %" if served else "-"

    body = [[r["day"], r["name"] or r["key_id"], r["requests"], r.get("refused", 0), r["prompt_tokens"], r["completion_tokens"],
             r["pod_requests"], r["fallback_requests"], share(r)] for r in rows]
    if rows:
        total = {k: sum(r.get(k, 0) for r in rows) for k in ("requests", "refused", "prompt_tokens", "completion_tokens",
                                                            "pod_requests", "fallback_requests")}
        body.append(["total", "", total["requests"], total["refused"], total["prompt_tokens"], total["completion_tokens"],
                     total["pod_requests"], total["fallback_requests"], share(total)])
    return _table(["day", "key", "requests", "refused", "prompt tok", "completion tok", "pod", "fallback", "fallback share"],
                  body, {2, 3, 4, 5, 6, 7, 8})


class UsageError(ScriptError):
    """A command keys.py cannot do for this stack (exit 2)."""

    exit_code = 2


def finish_command(args: argparse.Namespace, *rest: str) -> str:
    """The exact keys.py command line for this fleet (with the directories it was given)."""
    parts = [cli.script("keys.py"), *rest, "--stack", args.stack]
    if args.stacks_dir:
        parts += ["--stacks-dir", str(args.stacks_dir)]
    if args.sandboxes_dir:
        parts += ["--sandboxes-dir", str(args.sandboxes_dir)]
    return " ".join(parts)


def report_failed(
    args: argparse.Namespace, failed: dict[str, AdminError], done: list[str], what: str, finish: str | None
) -> None:
    for cell, why in failed.items():
        print(f"keys.py {args.cmd}: cell {cell}: {why}", file=sys.stderr)
    print(f"keys.py {args.cmd}: {what} in: {', '.join(done) or 'no cell'}; NOT in: {', '.join(failed)}", file=sys.stderr)
    if finish:
        print(f"keys.py {args.cmd}: to finish, once those cells answer: {finish}", file=sys.stderr)


def limits_line(row: dict, args: argparse.Namespace) -> str:
    """The key's limits, and which came from the cell's colocate:keys.defaults."""
    given = {"rpm": args.rpm, "tpm": args.tpm, "monthly_tokens": args.monthly_tokens, "max_parallel": args.max_parallel,
             "max_parallel_tokens": args.max_parallel_tokens}
    parts = [f"{name} {row.get(name) or 'no limit'}{'' if given[name] is not None else ' (default)'}" for name in given]
    own = row.get("fallback_microusd_day") or 0
    parts.append(f"fallback ${own / 1e6:g} a day" if own else "fallback: the cell's per-key cap")
    if args.fallback_usd_per_day is None:
        parts[-1] += " (default)"
    return "limits: " + ", ".join(parts) + "; (default) = the cell's colocate:keys.defaults, 0 = no limit"


def fallback_cap(args: argparse.Namespace) -> int | None:
    """--fallback-usd-per-day as the Worker's fallback_microusd_day (millionths of a dollar)."""
    usd = args.fallback_usd_per_day
    if usd is None:
        return None
    if not math.isfinite(usd) or usd < 0:
        raise UsageError(f"--fallback-usd-per-day {usd!r}: must be a number of $ >= 0 (0: the cell's per-key cap)")
    return round(usd * 1_000_000)


def fleet_create(args, cells, targets) -> int:
    key = admin.new_key()
    row = admin.key_row(key, args.name, rpm=args.rpm, tpm=args.tpm, monthly_tokens=args.monthly_tokens,
                        max_parallel=args.max_parallel, expires_in_s=args.expires_in,
                        fallback_microusd_day=fallback_cap(args), max_parallel_tokens=args.max_parallel_tokens)
    stored, failed = admin.fan_out(targets, lambda c: c.import_key(row, fleet_cells=len(cells)))
    have = [c for c in cells if c in stored]
    if failed and not have and all(isinstance(e, Refused) and e.status == 400 for e in failed.values()):
        # Every cell refused the input itself (a bad name or limit): a usage error, nothing made.
        refusal = next(iter(failed.values()))
        print(f"keys.py create: {refusal}", file=sys.stderr)
        return refusal.exit_code
    if not have:
        # Only the digest ever left this process: nobody can use a key no one was shown.
        report_failed(args, failed, have, f"key {row['id']}", None)
        print("keys.py create: no cell took the key; nothing to finish: run create again", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**stored[have[0]], "key": key, "cells": have, "missing": list(failed)}, indent=2))
    else:
        print(key)
        print(limits_line(stored[have[0]], args), file=sys.stderr)
    print(f"created {row['id']} ({args.name}) in {len(have)} of {len(cells)} cells of {args.stack}: the key above is "
          "shown only once; store it now (OpenAI clients take it as api_key)", file=sys.stderr)
    if failed:
        report_failed(args, failed, have, f"key {row['id']}", finish_command(args, "sync"))
        return 1
    return 0


def fleet_revoke(args, cells, targets) -> int:
    def revoke(client):
        try:
            return client.revoke_key(args.key_id)
        except Refused as exc:
            if exc.status == 404:
                return None  # not in this cell: refused there already
            raise

    rows, failed = admin.fan_out(targets, revoke)
    revoked = [c for c in cells if rows.get(c)]
    absent = [c for c in cells if c in rows and rows[c] is None]
    if args.json:
        print(json.dumps({"id": args.key_id, "revoked": revoked, "absent": absent,
                          "failed": {c: str(e) for c, e in failed.items()}}, indent=2))
    elif revoked:
        print(f"revoked {args.key_id} in {', '.join(revoked)}" + (f" (absent from {', '.join(absent)})" if absent else ""))
    if failed:
        report_failed(args, failed, revoked + absent, f"revocation of {args.key_id}",
                      finish_command(args, "revoke", args.key_id))
        return 1
    if not revoked:
        print(f"keys.py revoke: no cell of {args.stack} has key {args.key_id}: list them with "
              f"{finish_command(args, 'list')}", file=sys.stderr)
        return 1
    return 0


def fleet_keys(cells, listed: dict[str, list[dict]]) -> list[dict]:
    """One row per key id: the first cell's row plus ``cells`` {cell: active|revoked|missing}."""
    merged: dict[str, dict] = {}
    for cell in cells:
        for k in listed.get(cell, []):
            merged.setdefault(k["id"], {**k, "cells": {}})["cells"][cell] = "revoked" if k["revoked_at"] else "active"
    for row in merged.values():
        row["cells"] = {c: row["cells"].get(c, "missing" if c in listed else "unknown") for c in cells}
    return sorted(merged.values(), key=lambda r: (r["created_at"], r["id"]))


def fleet_keys_table(rows: list[dict]) -> str:
    body = [[r["id"], r["name"], r["prefix"] + "…", r["rpm"] or "-", r["tpm"] or "-", r["monthly_tokens"] or "-",
             " ".join(f"{c}:{s}" for c, s in r["cells"].items())] for r in rows]
    return _table(["id", "name", "key", "rpm", "tpm", "monthly", "cells"], body, {3, 4, 5})


def fleet_list(args, cells, targets) -> int:
    listed, failed = admin.fan_out(targets, lambda c: c.list_keys())
    rows = fleet_keys(cells, listed)
    print(
        json.dumps({"keys": rows, "failed": {c: str(e) for c, e in failed.items()}}, indent=2)
        if args.json
        else fleet_keys_table(rows),
        end="\n" if args.json else "",
    )
    # Revoked in one cell and missing in another is refused in both: only "active" must be everywhere.
    uneven = [r["id"] for r in rows if "active" in r["cells"].values() and set(r["cells"].values()) - {"active", "unknown"}]
    if uneven:
        print(f"keys.py list: the cells disagree on {', '.join(uneven)}; to finish: {finish_command(args, 'sync')} "
              "(it says what it cannot mend)", file=sys.stderr)
    if failed:
        report_failed(args, failed, list(listed), "listed", None)
    return 1 if failed or uneven else 0


USAGE_SUMS = ("requests", "refused", "prompt_tokens", "completion_tokens", "pod_requests", "fallback_requests")


def fleet_usage_rows(cells, answers: dict[str, dict]) -> list[dict]:
    """Per key and cell over the period, a per-key row over all cells, then the total."""
    per: dict[tuple[str, str], dict] = {}
    names: dict[str, str] = {}
    for cell in cells:
        for r in answers.get(cell, {}).get("usage", []):
            names[r["key_id"]] = r["name"] or r["key_id"]
            acc = per.setdefault((r["key_id"], cell), dict.fromkeys(USAGE_SUMS, 0))
            for f in USAGE_SUMS:
                acc[f] += r.get(f, 0)  # a cell of the release before has no `refused`
    out = []
    for key_id in sorted({k for k, _ in per}):
        mine = [(c, per[(key_id, c)]) for c in cells if (key_id, c) in per]
        out += [{"key_id": key_id, "name": names[key_id], "cell": c, **v} for c, v in mine]
        out.append({"key_id": key_id, "name": names[key_id], "cell": "all",
                    **{f: sum(v[f] for _, v in mine) for f in USAGE_SUMS}})
    out.append({"key_id": "total", "name": "", "cell": "all",
                **{f: sum(v[f] for v in per.values()) for f in USAGE_SUMS}})
    return out


def fleet_usage(args, cells, targets) -> int:
    answers, failed = admin.fan_out(targets, lambda c: c.usage(since=args.since, until=args.until, key_id=args.key_id))
    rows = fleet_usage_rows(cells, answers)
    if args.json:
        print(json.dumps({"usage": rows, "cells": answers, "failed": {c: str(e) for c, e in failed.items()}}, indent=2))
    else:
        print(_table(["key", "cell", "requests", "refused", "prompt tok", "completion tok", "pod", "fallback"],
                     [[r["name"] or r["key_id"], r["cell"], *(r[f] for f in USAGE_SUMS)] for r in rows], {2, 3, 4, 5, 6, 7}),
              end="")
    if failed:
        report_failed(args, failed, list(answers), "usage read", None)
        return 1
    return 0


def fleet_sync(args, cells, targets) -> int:
    digests, failed = admin.fan_out(targets, lambda c: c.key_digests())
    silent = bool(failed)
    plan = admin.plan_sync(digests, complete=not silent)
    done = {"copied": [], "revoked": []}

    def say(line: str) -> None:
        if not args.json:
            print(line)

    for cell, row in plan["imports"]:
        try:
            AdminClient(targets[cell]).import_key(row)
            done["copied"].append({"id": row["id"], "cell": cell})
            say(f"copied {row['id']} ({row['name']}) to {cell}")
        except AdminError as exc:
            failed[cell] = exc
    for cell, key_id in plan["revokes"]:
        try:
            AdminClient(targets[cell]).revoke_key(key_id)
            done["revoked"].append({"id": key_id, "cell": cell})
            say(f"revoked {key_id} in {cell}")
        except AdminError as exc:
            failed[cell] = exc
    if args.json:
        print(json.dumps({**done, "conflicts": plan["conflicts"], "failed": {c: str(e) for c, e in failed.items()}}, indent=2))
    if silent:
        print("keys.py sync: keys are copied only when every cell answers (a silent cell may hold a revocation); "
              "revocations were carried", file=sys.stderr)
    for key_id in plan["conflicts"]:
        print(f"keys.py sync: {key_id} is not one key in every cell (different digests under this id, or its "
              f"digest under another id); left as it is: revoke it ({finish_command(args, 'revoke', key_id)}) "
              "and create a new key", file=sys.stderr)
    if failed:
        report_failed(args, failed, [c for c in cells if c not in failed], "in sync", finish_command(args, "sync"))
    if not (plan["imports"] or plan["revokes"] or failed or plan["conflicts"]):
        print(f"the {len(cells)} cells of {args.stack} agree on every key", file=sys.stderr)
    return 1 if failed or plan["conflicts"] else 0


FLEET = {"create": fleet_create, "revoke": fleet_revoke, "list": fleet_list, "usage": fleet_usage, "sync": fleet_sync}


def run(args: argparse.Namespace) -> int:
    cells = admin.fleet_cells(args.stack, args.stacks_dir) if args.stack and not (args.url or args.state_dir) else None
    if cells is not None:
        return FLEET[args.cmd](args, cells, admin.fleet_targets(cells, sandboxes_dir=args.sandboxes_dir))
    if args.cmd == "sync":
        raise UsageError(f"sync works on a fleet stack (one with colocate:fleet); --stack {args.stack} is not one")
    target = resolve(url=args.url, stack=args.stack, state_dir=args.state_dir, sandboxes_dir=args.sandboxes_dir)
    client = AdminClient(target)
    if args.cmd == "create":
        made = client.create_key(args.name, rpm=args.rpm, tpm=args.tpm, monthly_tokens=args.monthly_tokens,
                                 max_parallel=args.max_parallel, expires_in_s=args.expires_in,
                                 fallback_microusd_day=fallback_cap(args), max_parallel_tokens=args.max_parallel_tokens)
        if args.json:
            print(json.dumps(made, indent=2))
        elif args.env:
            print(f"export OPENAI_BASE_URL={shlex.quote(target.url.rstrip('/') + '/v1')}\n"
                  f"export OPENAI_API_KEY={shlex.quote(made['key'])}")
            print(f"created {made['id']} ({made['name']}) on {target.url}; {limits_line(made, args)}", file=sys.stderr)
        else:
            print(made["key"])
            print(f"created {made['id']} ({made['name']}) on {target.url}: the key above is shown only once; "
                  "store it now (OpenAI clients take it as api_key)", file=sys.stderr)
            print(limits_line(made, args), file=sys.stderr)
        return 0
    if args.cmd == "list":
        keys = client.list_keys()
        print(json.dumps({"keys": keys}, indent=2) if args.json else keys_table(keys), end="\n" if args.json else "")
        return 0
    if args.cmd == "revoke":
        row = client.revoke_key(args.key_id)
        print(
            json.dumps(row, indent=2) if args.json else f"revoked {row['id']} ({row['name']}) at {_when(row['revoked_at'])} UTC"
        )
        return 0
    data = client.usage(since=args.since, until=args.until, key_id=args.key_id)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"usage of {data['generation']} from {data['from']} to {data['to']} (UTC days)", file=sys.stderr)
        print(usage_table(data["usage"]), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ColocateError as exc:
        print(f"keys.py {args.cmd}: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
