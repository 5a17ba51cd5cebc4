"""The client key the probe's routed samples carry.

The Worker answers routed paths (``/v1/models``, ``/v1/chat/completions``) only with a client
key. Given one (``--key`` or ``COLOCATE_CLIENT_KEY``), the probe uses it; otherwise it mints a
short-lived key through the Worker's admin endpoint with the admin token
(``POST /_colocate/keys``, ``{"name": "probe-<utc time>", "expires_in_s": 900}``) right after
the warm-up, and revokes it when the run ends, Ctrl-C included (``close`` runs from a
``finally``). Should the revoke fail, the key still expires by itself after 15 minutes.
A Worker without the key endpoints (404) gets no key: its routed paths do not ask for one.

The key is never printed, logged, put in argv or written to the JSON; only its id is named.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import admin
from .errors import TargetError

KEY_ENV = "COLOCATE_CLIENT_KEY"
MINTED_TTL_S = 900


class KeyLease:
    """``get()`` gives the key (minting it on first call when none was given); ``close()`` revokes a minted one."""

    def __init__(self, url: str, token: str, given: str | None = None,
                 say: Callable[[str], None] | None = None, timeout_s: float = admin.TIMEOUT_S):
        self._target = admin.Target(url.rstrip("/"), token, "url")
        self._given = given or None
        self._key: str | None = None
        self._say = say or (lambda _msg: None)
        self._asked = False
        self.minted_id: str | None = None
        self.source = "given" if given else "none"

    def __repr__(self) -> str:  # never print the key
        return f"KeyLease(source={self.source!r}, minted_id={self.minted_id!r}, key=***)"

    def get(self) -> str | None:
        if self._given:
            return self._given
        if not self._asked:
            self._asked = True
            self._mint()
        return self._key

    def _mint(self) -> None:
        name = "probe-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        try:
            rec = admin.AdminClient(self._target).create_key(name, expires_in_s=MINTED_TTL_S)
        except admin.Refused as exc:
            if exc.status == 404:  # a Worker from before client keys: routed paths need none
                self._say("the Worker has no /_colocate/keys: routed samples go without a client key")
                return
            raise TargetError(f"could not mint a client key for the routed samples ({exc}); "
                              f"pass one with --key or {KEY_ENV}, or set {admin.TOKEN_ENVS['admin']} to mint one") from None
        except admin.AdminError as exc:
            raise TargetError(f"could not mint a client key for the routed samples: {exc}") from None
        key, self.minted_id = rec.get("key"), rec.get("id")
        if not isinstance(key, str) or not key:
            raise TargetError(f"POST /_colocate/keys answered without a key; pass one with --key or {KEY_ENV}")
        self._key, self.source = key, "minted"
        self._say(f"minted client key {self.minted_id} ({name}, expires in {MINTED_TTL_S // 60} min); "
                  "revoked when the probe ends")

    def close(self) -> None:
        """Revoke the minted key, once. Never raises: the probe's result matters more."""
        key_id, self.minted_id = self.minted_id, None
        self._key = None
        if not key_id:
            return
        try:
            admin.AdminClient(self._target).revoke_key(key_id)
            self._say(f"revoked client key {key_id}")
        except admin.AdminError as exc:
            self._say(f"could not revoke client key {key_id} ({exc}); it expires by itself within "
                      f"{MINTED_TTL_S // 60} min, or run `.venv/bin/python scripts/keys.py revoke --url URL {key_id}`")

    def __enter__(self) -> KeyLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
