#!/usr/bin/env python3
"""Client API keys of a cell: create, list, revoke, and usage per key and day.

    keys.py create --stack S --name NAME [--rpm N] [--tpm N] [--monthly-tokens N] [--max-parallel N] [--expires-in SECONDS]
    keys.py list   --stack S
    keys.py revoke --stack S KEY_ID
    keys.py usage  --stack S [--from YYYY-MM-DD] [--to YYYY-MM-DD] [--key KEY_ID]

Every command also takes --json (one JSON object on stdout instead of a table), and a
target: --stack S (a running sandbox of S, else the deployed stack's outputs through
`pulumi stack output --show-secrets`), --state-dir DIR (a sandbox), or --url URL with the
probe token in COLOCATE_PROBE_TOKEN. Keys live in the cell's active generation and move
with it (scripts/migrate.py). `create` prints the key once: store it, it is never shown
again (the cell keeps only its SHA-256). Limits of 0 mean no limit.
Exit: 0 done, 1 the Worker refused (e.g. an unknown key id), 2 usage error or no target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate.admin import AdminClient, AdminError, Refused, resolve  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keys.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--stack", help="the stack (a running sandbox of it, else its deployed outputs)")
        sp.add_argument("--state-dir", type=Path, help="a sandbox's state directory")
        sp.add_argument("--url", help="the Worker's URL (the probe token comes from COLOCATE_PROBE_TOKEN)")
        sp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    c = sub.add_parser("create", help="create a key and print it once")
    common(c)
    c.add_argument("--name", required=True, help="who or what the key is for (1-64 characters)")
    c.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    c.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    c.add_argument("--monthly-tokens", type=int, default=0, help="tokens per UTC calendar month (0: no limit)")
    c.add_argument("--max-parallel", type=int, default=None,
                   help="requests in flight at once (0: no limit; default: the cell's colocate:keys.defaultMaxParallel)")
    c.add_argument("--expires-in", type=int, metavar="SECONDS", help="the key stops working after this long")
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
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    return "\n".join(lines) + "\n"


def keys_table(keys: list[dict]) -> str:
    def limit(n: int) -> str:
        return str(n) if n else "-"

    rows = [[k["id"], k["name"], k["prefix"] + "…", limit(k["rpm"]), limit(k["tpm"]), limit(k["monthly_tokens"]),
             limit(k.get("max_parallel", 0)), _when(k["created_at"]), _when(k["expires_at"]), "revoked " + _when(k["revoked_at"]) if k["revoked_at"] else "active"]
            for k in keys]
    return _table(["id", "name", "key", "rpm", "tpm", "monthly", "parallel", "created (UTC)", "expires", "status"], rows,
                  {3, 4, 5, 6})


def usage_table(rows: list[dict]) -> str:
    def share(r: dict) -> str:
        served = r["pod_requests"] + r["fallback_requests"]
        return f"{100 * r['fallback_requests'] / served:.1f} %" if served else "-"

    body = [[r["day"], r["name"] or r["key_id"], r["requests"], r["prompt_tokens"], r["completion_tokens"],
             r["pod_requests"], r["fallback_requests"], share(r)] for r in rows]
    if rows:
        total = {k: sum(r[k] for r in rows) for k in ("requests", "prompt_tokens", "completion_tokens", "pod_requests",
                                                     "fallback_requests")}
        body.append(["total", "", total["requests"], total["prompt_tokens"], total["completion_tokens"],
                     total["pod_requests"], total["fallback_requests"], share(total)])
    return _table(["day", "key", "requests", "prompt tok", "completion tok", "pod", "fallback", "fallback share"],
                  body, {2, 3, 4, 5, 6, 7})


def run(args: argparse.Namespace) -> int:
    target = resolve(url=args.url, stack=args.stack, state_dir=args.state_dir)
    client = AdminClient(target)
    if args.cmd == "create":
        made = client.create_key(args.name, rpm=args.rpm, tpm=args.tpm, monthly_tokens=args.monthly_tokens,
                                 max_parallel=args.max_parallel, expires_in_s=args.expires_in)
        if args.json:
            print(json.dumps(made, indent=2))
        else:
            print(made["key"])
            print(f"created {made['id']} ({made['name']}) on {target.url}: the key above is shown only once; "
                  "store it now (OpenAI clients take it as api_key)", file=sys.stderr)
        return 0
    if args.cmd == "list":
        keys = client.list_keys()
        print(json.dumps({"keys": keys}, indent=2) if args.json else keys_table(keys), end="\n" if args.json else "")
        return 0
    if args.cmd == "revoke":
        row = client.revoke_key(args.key_id)
        print(json.dumps(row, indent=2) if args.json else f"revoked {row['id']} ({row['name']}) at {_when(row['revoked_at'])} UTC")
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
    except Refused as exc:
        print(f"keys.py {args.cmd}: {exc}", file=sys.stderr)
        return 1 if exc.status < 500 and exc.status not in (400, 401) else 2
    except AdminError as exc:
        print(f"keys.py {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
