#!/usr/bin/env python3
"""Apply a Worker's placement through Cloudflare's script settings: apply.

    placement.py apply --account ID --script NAME      placement JSON on stdin

Why not ``cloudflare.WorkersScript(placement=...)``: in the Terraform provider that
pulumi-cloudflare 6.x wraps, ``placement.region``, ``placement.host`` and
``placement.hostname`` are read-only (computed) attributes, so a declared region or host is
refused or never sent (terraform-provider-cloudflare #6785 and #6936, open; SST patches
placement the same way, sst PR #6421). This script sends the block the way wrangler does:
``PATCH /accounts/{account}/workers/scripts/{script}/settings`` with a multipart
``settings`` part ``{"placement": {...}}`` (one of ``{"mode": "smart"}``, ``{"region": ..}``,
``{"host": "h:port"}``), then checks that Cloudflare reports it back.

stdout: one JSON object ``{"script", "placement" (sent), "reported" (Cloudflare's)}``. stderr:
what went wrong. Exit 0 when Cloudflare reports the placement, 1 when it refuses or reports
another one, 2 on a usage error. Token from CLOUDFLARE_API_TOKEN; endpoint from
CLOUDFLARE_API_BASE (default https://api.cloudflare.com/client/v4).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colocate import cli  # noqa: E402
from colocate.errors import ScriptError  # noqa: E402

API_BASE = "https://api.cloudflare.com/client/v4"
TOKEN_ENV = "CLOUDFLARE_API_TOKEN"
ATTEMPTS = 4  # 429 and 5xx are retried with backoff; a PATCH of the same settings is idempotent
TIMEOUT_S = 30
KINDS = ("mode", "region", "host", "hostname")


class Failed(ScriptError):
    """The placement request failed (exit 1)."""


class BadInput(Failed):
    """The input (stdin, the token's variable) is wrong; the message names it and the fix (exit 2)."""

    exit_code = 2


def check_placement(block: object) -> dict:
    """One of {"mode": "smart"}, {"region": "<cloud>:<region>"}, {"host": "h:port"}, {"hostname": "h"}."""
    if not isinstance(block, dict) or len(block) != 1 or next(iter(block)) not in KINDS:
        raise BadInput(f"stdin: placement must be one of {{mode: smart}}, {{region}}, {{host}}, {{hostname}} (got {block!r}). "
                       "Fix: pass the plan's placement block")
    kind, value = next(iter(block.items()))
    ok = isinstance(value, str) and {
        "mode": lambda v: v == "smart",
        "region": lambda v: re.fullmatch(r"(aws|gcp|azure):[a-z0-9-]+", v),
        "host": lambda v: re.fullmatch(r"[A-Za-z0-9.-]+:[0-9]{1,5}", v),
        "hostname": lambda v: re.fullmatch(r"[A-Za-z0-9.-]+", v),
    }[kind](value)
    if not ok:
        raise BadInput(f"stdin: placement.{kind} {value!r} is not valid. Fix: "
                       + {"mode": "only mode smart is set this way", "region": "write it like aws:ap-northeast-1",
                          "host": "write it like pod-x.example.com:41234 (host and port)",
                          "hostname": "write a bare hostname"}[kind])
    return {kind: value}


def reported_matches(sent: dict, reported: object) -> bool:
    """Cloudflare reports the block back, sometimes as {"mode": "targeted", <kind>: v} or as
    {"mode": "targeted", "target": [{<kind>: v}]} (terraform-provider-cloudflare #6936)."""
    if not isinstance(reported, dict):
        return False
    kind, value = next(iter(sent.items()))
    if kind == "mode":
        return reported.get("mode") == value
    targets = reported.get("target") or reported.get("targets") or []
    return reported.get(kind) == value or any(isinstance(t, dict) and t.get(kind) == value for t in targets)


def apply(account: str, script: str, placement: dict, token: str, base: str = API_BASE) -> dict:
    url = f"{base.rstrip('/')}/accounts/{account}/workers/scripts/{script}/settings"
    files = {"settings": (None, json.dumps({"placement": placement}), "application/json")}
    headers = {"authorization": f"Bearer {token}"}
    for attempt in range(ATTEMPTS):
        try:
            resp = requests.patch(url, files=files, headers=headers, timeout=TIMEOUT_S)
        except requests.RequestException as exc:
            if attempt == ATTEMPTS - 1:
                raise Failed(f"PATCH {url}: {exc.__class__.__name__} after {ATTEMPTS} attempts") from None
            time.sleep(2 ** attempt)
            continue
        if resp.status_code == 429 or resp.status_code >= 500:
            if attempt == ATTEMPTS - 1:
                raise Failed(f"PATCH {url} answered {resp.status_code} after {ATTEMPTS} attempts")
            time.sleep(2 ** attempt)
            continue
        break
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if resp.status_code >= 400 or not isinstance(doc, dict) or doc.get("success") is False:
        errors = (doc or {}).get("errors") if isinstance(doc, dict) else None
        raise Failed(f"PATCH {url} with settings {{\"placement\": {json.dumps(placement)}}} answered "
                     f"{resp.status_code}: {json.dumps(errors) if errors else resp.text[:300]}. Fix: check that "
                     f"cloudflare:apiToken may edit Workers scripts and that the script {script!r} exists")
    reported = (doc.get("result") or {}).get("placement")
    if not reported_matches(placement, reported):
        raise Failed(f"Cloudflare accepted the settings of {script!r} but reports placement {json.dumps(reported)}, "
                     f"not {json.dumps(placement)}: the placement was not applied")
    return {"script": script, "placement": placement, "reported": reported}


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(prog="placement.py", description=__doc__.split("\n\n")[0])
    sub = cli.subcommands(p, dest="command", required=True)
    a = sub.add_parser("apply", help="set the script's placement from the JSON block on stdin")
    a.add_argument("--account", required=True)
    a.add_argument("--script", required=True)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise BadInput(f"{TOKEN_ENV} is not set. Fix: pulumi config set --secret cloudflare:apiToken <token> "
                           f"(pulumi up passes it), or export {TOKEN_ENV}")
        try:
            block = json.loads(sys.stdin.read())
        except ValueError:
            raise BadInput("stdin: not JSON. Fix: pass the placement block, e.g. {\"host\": \"h:8000\"}") from None
        out = apply(args.account, args.script, check_placement(block), token,
                    os.environ.get("CLOUDFLARE_API_BASE") or API_BASE)
    except Failed as exc:
        print(f"placement: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
