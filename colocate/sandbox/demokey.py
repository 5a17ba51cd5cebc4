"""The sandbox's demo client key (``demo-key.json``), made through the Worker's admin endpoint."""

from __future__ import annotations

from pathlib import Path

from ..admin import AdminClient, AdminError, Target
from .errors import StartupFailed
from .processes import http_ok
from .statedir import DEMO_KEY_FILE, log_path, read_json, write_json

DEMO_KEY_NAME = "sandbox-demo"


def _key_works(worker_url: str, key: str) -> bool | None:
    """True/False when the Worker accepts/refuses the key on a routed path; None if unsure."""
    ok, code = http_ok(worker_url + "/v1/models", {"authorization": f"Bearer {key}"}, timeout=30)
    if ok:
        return True
    return False if code in (401, 403) else None


def demo_key(state_dir: Path, worker_url: str, probe_token: str) -> dict:
    """The sandbox's demo client key: the one in ``demo-key.json`` while the cell still accepts
    it (keys live in the generation's objects, which survive down/up), else a new one created
    through the Worker's admin endpoint. Stored with mode 0600: it is a credential."""
    path = Path(state_dir) / DEMO_KEY_FILE
    stored = read_json(path) or {}
    if stored.get("key") and _key_works(worker_url, stored["key"]) is not False:
        return stored
    try:
        created = AdminClient(Target(worker_url, probe_token, "sandbox")).create_key(DEMO_KEY_NAME)
    except AdminError as exc:
        raise StartupFailed(f"could not create the demo client key: {exc}; see {log_path(state_dir, 'workerd')}") from None
    record = {k: created.get(k) for k in ("id", "key", "name", "prefix", "created_at")}
    write_json(path, record, 0o600)
    return record
