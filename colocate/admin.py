"""A client for the Worker's operator endpoints (client keys, usage), and where to find them.

``scripts/keys.py`` and the sandbox use it; the endpoints are documented in docs/worker.md.
For a fleet stack (``colocate.fleet.plan.is_fleet``) it finds every member cell the same way and
replicates keys to them: a key is made here once (the Worker's format) and only its
SHA-256 is imported into each cell (``POST /_colocate/keys/replica``); ``plan_sync`` says
what copies and revocations make the cells agree again.
A target is a Worker URL and one operator credential (admin for keys, read for usage):
from ``--url`` plus ``COLOCATE_ADMIN_TOKEN`` (or ``COLOCATE_READ_TOKEN``),
from a running sandbox of the stack (its ``ready.json``), or from the deployed stack's
outputs (``pulumi stack output --show-secrets``). The token never goes to argv or a log.

    AdminError                   base (a ScriptError); exit 2
    ├── TargetError              no URL or token could be found for the request (names how to give one)
    ├── Unreachable              the Worker did not answer (connection refused, timeout)
    └── Refused                  the Worker answered with an error (status, code and its message); exit 1
                                 for a refusal of what was asked (404, 409), 2 for bad input, a bad token or a 5xx
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ScriptError
from .sandbox.statedir import (  # not the supervisor, whose runner imports admin
    READY_FILE,
    SANDBOX_CMD,
    default_state_dir,
    where_command,
    where_sandboxes_run,
)

if TYPE_CHECKING:
    import requests

# The credential each role takes from the environment; the old single token is read where
# the role's own is unset, for one release (docs/worker.md, "Who holds what").
TOKEN_ENVS = {"admin": "COLOCATE_ADMIN_TOKEN", "read": "COLOCATE_READ_TOKEN"}
LEGACY_TOKEN_ENV = "COLOCATE_PROBE_TOKEN"
TOKEN_ENV = TOKEN_ENVS["admin"]
TIMEOUT_S = 30


class AdminError(ScriptError):
    """The operator endpoints could not be used."""

    exit_code = 2


class TargetError(AdminError):
    """No URL or token could be found for the request."""


class Unreachable(AdminError):
    """The Worker did not answer."""


class Refused(AdminError):
    """The Worker answered with an error."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"the Worker answered {status} {code}: {message}")
        self.status, self.code = status, code
        # 1 when the Worker refused what was asked (no such key, a conflict): the input was
        # well formed; 2 for bad input, a bad token, or a Worker that failed (5xx).
        self.exit_code = 1 if status < 500 and status not in (400, 401) else 2


@dataclass(frozen=True)
class Target:
    url: str
    token: str
    source: str  # "url", "sandbox" or "stack": where the two came from

    def __repr__(self) -> str:  # never print the token
        return f"Target(url={self.url!r}, source={self.source!r}, token=***)"


def token_from_env(env, role: str) -> str | None:
    """The ``role``'s credential from the environment, or the old single token (with a warning on stderr)."""
    token = env.get(TOKEN_ENVS[role])
    if token:
        return token
    legacy = env.get(LEGACY_TOKEN_ENV)
    if legacy:
        print(f"warning: {LEGACY_TOKEN_ENV} is deprecated (this release is the last to read it): "
              f"export {TOKEN_ENVS[role]} instead", file=sys.stderr)
    return legacy or None


def sandbox_target(state_dir: Path, role: str = "admin") -> Target | None:
    """The running sandbox's Worker and its ``role`` credential (ready.json), or None."""
    try:
        ready = json.loads((state_dir / READY_FILE).read_text())
    except (OSError, ValueError):
        return None
    field = "token" if role == "admin" else "read_token"
    if not isinstance(ready, dict) or not ready.get("worker_url") or not (ready.get(field) or ready.get("token")):
        return None
    # A sandbox started by the release before the split credentials wrote only "token".
    return Target(ready["worker_url"], ready.get(field) or ready["token"], "sandbox")


def resolve(*, url: str | None = None, stack: str | None = None, state_dir: Path | None = None,
            env: dict | None = None, sandboxes_dir: Path | None = None, role: str = "admin") -> Target:
    """Where the operator endpoints are, with the ``role``'s credential ("admin" or "read"):
    an explicit URL, else the stack's running sandbox (in ``sandboxes_dir``/<stack> when
    given), else the stack's deployed outputs."""
    env = os.environ if env is None else env
    token_env = TOKEN_ENVS[role]
    if url:
        token = token_from_env(env, role)
        if not token:
            raise TargetError(f"--url {url}: no {role} token; export {token_env}=<colocate:{role}Token> "
                              f"(`pulumi config get --show-secrets colocate:{role}Token`), or use --stack S")
        return Target(url.rstrip("/"), token, "url")
    if state_dir is not None or stack is not None:
        where = Path(state_dir) if state_dir else (Path(sandboxes_dir) / stack if sandboxes_dir else default_state_dir(stack))
        sandbox = sandbox_target(where, role)
        if sandbox:
            return sandbox
        if state_dir is not None:
            here = Path(state_dir)
            raise TargetError(f"--state-dir {state_dir}: no sandbox runs there (no ready.json). Fix: start it with "
                              f"`{SANDBOX_CMD} up {where_command(here, stack)}`; {where_sandboxes_run(here)}")
    if stack is None:
        raise TargetError("no target: pass --stack S (a deployed stack or a running sandbox of it), --state-dir DIR "
                          f"(a sandbox started with that --state-dir) or --url URL; {where_sandboxes_run()}")
    import shutil

    from .probe import outputs  # the Pulumi CLI, only for deployed stacks
    from .probe.errors import OutputsError

    def not_found(why: str) -> TargetError:
        # keys.py's own options only (probe.py's messages name options this command lacks).
        return TargetError(f"--stack {stack}: no sandbox of that stack runs in {default_state_dir(stack)} "
                           f"and {why}. Fix: `{SANDBOX_CMD} up --stack {stack}` for a sandbox, --state-dir DIR for a "
                           f"sandbox in another state directory, or --url URL with {token_env} set for a deployed Worker; "
                           f"{where_sandboxes_run()}")

    if shutil.which("pulumi") is None:
        raise not_found("the pulumi CLI, which reads a deployed stack's outputs, is not on PATH")
    try:
        out = outputs.read_outputs(stack)
    except OutputsError as exc:
        raise not_found(f"its deployed outputs could not be read ({exc})") from None
    token = out.admin_token if role == "admin" else out.read_token
    if not out.worker_url or not token:
        raise TargetError(f"--stack {stack}: the stack has no workerUrl/{role}Token outputs; run `pulumi up -s {stack}` first")
    return Target(out.worker_url.rstrip("/"), token, "stack")


class AdminClient:
    def __init__(self, target: Target, session: requests.Session | None = None):
        import requests  # here: the sandbox's up, down and status import this module and never call a cell

        self.target = target
        self.session = session or requests.Session()

    def _call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        import requests

        try:
            res = self.session.request(method, self.target.url + path, json=body, params=params, timeout=TIMEOUT_S,
                                       headers={"authorization": f"Bearer {self.target.token}"})
        except requests.RequestException as exc:
            raise Unreachable(f"{self.target.url} did not answer ({type(exc).__name__}); is the cell up?") from None
        try:
            data = res.json()
        except ValueError:
            data = None
        if res.status_code >= 400 or not isinstance(data, dict):
            err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
            raise Refused(res.status_code, err.get("code", "http_error"), err.get("message", res.text[:200]))
        return data

    def create_key(self, name: str, *, rpm: int | None = None, tpm: int | None = None, monthly_tokens: int | None = None,
                   max_parallel: int | None = None, expires_in_s: int | None = None,
                   fallback_microusd_day: int | None = None, max_parallel_tokens: int | None = None) -> dict:
        """A limit None: the cell's default (colocate:keys.defaults); 0: no limit. ``fallback_microusd_day``:
        the key's own cap on the fallback's spend per UTC day (None or 0: colocate:fallbackCap.keyUsdPerDay).
        ``max_parallel_tokens``: prompt tokens of its requests not yet begun at a pod, at once."""
        limits = {"rpm": rpm, "tpm": tpm, "monthly_tokens": monthly_tokens, "max_parallel": max_parallel,
                  "max_parallel_tokens": max_parallel_tokens, "fallback_microusd_day": fallback_microusd_day}
        body = {"name": name, **{k: v for k, v in limits.items() if v is not None}}
        if expires_in_s is not None:
            body["expires_in_s"] = expires_in_s
        return self._call("POST", "/_colocate/keys", body)

    def list_keys(self) -> list[dict]:
        return self._call("GET", "/_colocate/keys")["keys"]

    def import_key(self, row: dict, fleet_cells: int | None = None) -> dict:
        """Store a key row made elsewhere (id, hash, prefix, name, limits, times); a repeat is a no-op.
        ``fleet_cells``: the fleet's size, so a cell the exchange has not reached yet admits the
        key within its default share of the key's limits from its first request."""
        return self._call("POST", "/_colocate/keys/replica", row if fleet_cells is None else {**row, "fleet_cells": fleet_cells})

    def key_digests(self) -> list[dict]:
        """Every key row with its digest (never the key)."""
        return self._call("GET", "/_colocate/keys/replica")["keys"]

    def revoke_key(self, key_id: str) -> dict:
        return self._call("POST", f"/_colocate/keys/{key_id}/revoke")

    def breaker(self) -> dict:
        """{generation, breaker}: the override, pods and the migration's import (``imported``, ``importing``)."""
        return self._call("GET", "/_colocate/breaker")

    def usage(self, *, since: str | None = None, until: str | None = None, key_id: str | None = None) -> dict:
        params = {k: v for k, v in (("from", since), ("to", until), ("key", key_id)) if v}
        return self._call("GET", "/_colocate/usage", params=params)


# --- one key for a whole fleet ---

KEY_PREFIX = "clc_"


def new_key() -> str:
    """A client key as the Worker makes one: clc_ + 32 base64url characters (24 random bytes)."""
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode().rstrip("=")


def new_key_id() -> str:
    return "key_" + secrets.token_hex(6)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_row(key: str, name: str, *, rpm: int | None = None, tpm: int | None = None, monthly_tokens: int | None = None,
            max_parallel: int | None = None, expires_in_s: int | None = None, now_ms: int | None = None,
            fallback_microusd_day: int | None = None, max_parallel_tokens: int | None = None) -> dict:
    """The row every cell imports for ``key``: its digest and display prefix, never the key. A
    limit None is left out: each cell gives it its colocate:keys.defaults."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    row = {"id": new_key_id(), "hash": key_hash(key), "prefix": key[:len(KEY_PREFIX) + 6], "name": name,
           "created_at": now_ms, "expires_at": now_ms + expires_in_s * 1000 if expires_in_s else None}
    limits = {"rpm": rpm, "tpm": tpm, "monthly_tokens": monthly_tokens, "max_parallel": max_parallel,
              "max_parallel_tokens": max_parallel_tokens, "fallback_microusd_day": fallback_microusd_day}
    return {**row, **{k: v for k, v in limits.items() if v is not None}}


IMPORT_FIELDS = ("id", "hash", "prefix", "name", "rpm", "tpm", "monthly_tokens", "max_parallel", "created_at", "expires_at",
                 "fallback_microusd_day", "max_parallel_tokens")


def fleet_cells(stack: str, stacks_dir: Path | None = None) -> tuple[str, ...] | None:
    """The member cell stacks of ``stack`` when its stack file makes it a fleet, else None."""
    from . import stackfile
    from .errors import ConfigError
    from .fleet import plan as fleet

    try:
        raw, _ = stackfile.read_config(stack, stacks_dir or stackfile.STACKS_DIR)
    except ConfigError:
        return None  # no stack file here: a cell known only to the Pulumi backend
    if not fleet.is_fleet(raw):
        return None
    return fleet.parse_cells(raw["fleet"].get("cells"), stack)


def fleet_targets(cells: tuple[str, ...], *, sandboxes_dir: Path | None = None,
                  env: dict | None = None) -> dict[str, Target | AdminError]:
    """Each member's target, found as for one cell; a cell that cannot be found is its error."""
    found: dict[str, Target | AdminError] = {}
    for cell in cells:
        try:
            found[cell] = resolve(stack=cell, sandboxes_dir=sandboxes_dir, env=env)
        except AdminError as exc:
            found[cell] = exc
    return found


def fan_out(targets: Mapping[str, Target | AdminError], call) -> tuple[dict[str, object], dict[str, AdminError]]:
    """``call(client)`` in every cell: (answers by cell, errors by cell)."""
    done, failed = {}, {}
    for cell, target in targets.items():
        if isinstance(target, AdminError):
            failed[cell] = target
            continue
        try:
            done[cell] = call(AdminClient(target))
        except AdminError as exc:
            failed[cell] = exc
    return done, failed


def plan_sync(digests: Mapping[str, list[dict]], complete: bool = True) -> dict:
    """What makes the cells agree, from each cell's key rows with digests:

    - ``imports`` [(cell, row)]: a key active in some cell and revoked in none, missing here;
    - ``revokes`` [(cell, id)]: a key revoked in some cell, still active here (revocation wins);
    - ``conflicts`` [id]: one id with different digests in different cells, or one digest
      under different ids, while active somewhere (nothing is done: the operator revokes).
    A key missing in a cell and revoked elsewhere needs nothing: that cell refuses it already.
    Not ``complete`` (a cell did not answer): no imports, only revocations, since the silent
    cell may hold the revocation that a copy would undo.
    """
    by_id: dict[str, dict[str, dict]] = {}
    ids_of: dict[str, set[str]] = {}
    for cell, rows in digests.items():
        for row in rows:
            by_id.setdefault(row["id"], {})[cell] = row
            ids_of.setdefault(row["hash"], set()).add(row["id"])
    imports, revokes, conflicts = [], [], []
    for key_id in sorted(by_id):
        held = by_id[key_id]
        twins = set().union(*(ids_of[r["hash"]] for r in held.values()))
        if len({r["hash"] for r in held.values()}) > 1 or len(twins) > 1:
            if any(not by_id[t][c].get("revoked_at") for t in twins for c in by_id[t]):
                conflicts.append(key_id)
            continue  # revoked everywhere: refused in every cell, nothing to mend
        revoked = any(r.get("revoked_at") for r in held.values())
        for cell in digests:
            row = held.get(cell)
            if revoked and row is not None and not row.get("revoked_at"):
                revokes.append((cell, key_id))
            elif not revoked and row is None and complete:
                source = next(iter(held.values()))
                imports.append((cell, {f: source.get(f) for f in IMPORT_FIELDS}))
    return {"imports": imports, "revokes": revokes, "conflicts": conflicts}
