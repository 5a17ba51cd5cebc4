"""A requests session for provider APIs: bearer auth, bounded urllib3 retries, redacted errors.

Two retry policies, because a create is not safe to repeat blindly:

* ``safe`` (GET, DELETE, the Vast.ai offer search POST): retries connect errors, read
  timeouts, 429 and 5xx with exponential backoff, honouring ``Retry-After`` (capped).
  DELETE is safe because a second delete of a gone pod answers 404, which is success.
* ``create`` (RunPod ``POST /v2/pods``, Vast.ai ``PUT /asks/{id}/``): retries connect errors
  (the request never left) and 429 (refused before any work), nothing else. After a 5xx or
  a read timeout the pod may or may not exist; the caller looks it up by its deterministic
  name and adopts it instead of posting again, so a retry never rents a second GPU.

Knobs (environment): ``COLOCATE_POD_RETRIES`` (default 5), ``COLOCATE_POD_BACKOFF_S``
(backoff factor, default 0.5), ``COLOCATE_POD_BACKOFF_MAX_S`` (default 30, also caps
Retry-After), ``COLOCATE_POD_HTTP_TIMEOUT_S`` (read timeout, default 30).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from .errors import FatalError, NotFoundError, PodConfigError, RetryableError

RETRY_STATUSES = (429, 500, 502, 503, 504)
REDACTED = "***"
_SECRET_WORDS = ("key", "token", "secret", "password", "authorization")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise PodConfigError(f"{name}={raw!r} is not a number; unset it or give seconds/counts as a number") from None


class CappedRetry(Retry):
    """urllib3 Retry whose Retry-After wait is capped at ``backoff_max`` (a provider asking for an hour is not obeyed)."""

    def get_retry_after(self, response):
        value = super().get_retry_after(response)
        return None if value is None else min(value, self.backoff_max)


def make_retry(create: bool) -> Retry:
    total = int(_env_float("COLOCATE_POD_RETRIES", 5))
    common = dict(backoff_factor=_env_float("COLOCATE_POD_BACKOFF_S", 0.5),
                  backoff_max=_env_float("COLOCATE_POD_BACKOFF_MAX_S", 30.0),
                  respect_retry_after_header=True, raise_on_status=False, raise_on_redirect=False, redirect=0)
    if create:
        return CappedRetry(total=total, connect=total, read=0, other=0, status=total,
                           status_forcelist=(429,), allowed_methods=frozenset({"POST", "PUT"}), **common)
    return CappedRetry(total=total, connect=total, read=total, other=0, status=total,
                       status_forcelist=RETRY_STATUSES,
                       allowed_methods=frozenset({"GET", "DELETE", "POST"}), **common)


def make_session(api_key: str, create: bool) -> requests.Session:
    s = requests.Session()
    adapter = HTTPAdapter(max_retries=make_retry(create))
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    s.headers["Authorization"] = f"Bearer {api_key}"
    s.headers["Accept"] = "application/json"
    s.headers["User-Agent"] = "colocate-pod/1"
    return s


def redact(value, secrets: tuple[str, ...] = ()) -> str:
    """JSON text of ``value`` with secret-looking fields and every known secret string replaced."""

    def walk(v, key=""):
        if isinstance(v, dict):
            # env maps carry tokens under arbitrary names: hide every value
            if key.lower() == "env":
                return {k: REDACTED for k in v}
            return {k: walk(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, key) for x in v]
        if isinstance(v, str) and any(w in key.lower() for w in _SECRET_WORDS):
            return REDACTED
        return v

    text = json.dumps(walk(value)) if not isinstance(value, str) else value
    for s in secrets:
        if s:
            text = text.replace(s, REDACTED)
    return text


@dataclass
class Reply:
    status: int
    body: object
    headers: dict


class Api:
    """One provider's REST API: ``call`` returns a Reply or raises a classified ProviderError."""

    def __init__(self, provider: str, base: str, api_key: str, secrets: tuple[str, ...] = ()):
        self.provider = provider
        self.base = base.rstrip("/")
        self.secrets = (api_key, *secrets)
        self.safe = make_session(api_key, create=False)
        self.create_session = make_session(api_key, create=True)
        self.timeout = (10.0, _env_float("COLOCATE_POD_HTTP_TIMEOUT_S", 30.0))

    def close(self) -> None:
        self.safe.close()
        self.create_session.close()

    def call(self, method: str, path: str, *, json_body=None, params=None, create: bool = False,
             ok: tuple[int, ...] = (200, 201, 204)) -> Reply:
        session = self.create_session if create else self.safe
        what = f"{self.provider} {method} {path}"
        try:
            r = session.request(method, self.base + path, json=json_body, params=params, timeout=self.timeout)
        except requests.exceptions.RetryError as exc:
            raise RetryableError(f"{what}: gave up after retries ({_reason(exc)})") from None
        except (requests.exceptions.Timeout, requests.exceptions.ConnectionError) as exc:
            raise RetryableError(f"{what}: no answer ({_reason(exc)})") from None
        try:
            body = r.json() if r.content else None
        except ValueError:
            body = r.text[:500]
        reply = Reply(r.status_code, body, dict(r.headers))
        r.close()
        if r.status_code in ok:
            return reply
        detail = redact(body, self.secrets) if body is not None else "(empty body)"
        if r.status_code == 404:
            exc = NotFoundError(f"{what} -> 404: {detail}")
        elif r.status_code in RETRY_STATUSES:
            exc = RetryableError(f"{what} -> {r.status_code} after retries: {detail}")
        else:
            sent = f"; sent: {redact(json_body, self.secrets)}" if json_body is not None else ""
            exc = FatalError(f"{what} -> {r.status_code}: {detail}{sent}")
        exc.status, exc.body = r.status_code, body  # providers classify capacity from these
        raise exc


def _reason(exc: Exception) -> str:
    inner = exc.args[0] if exc.args else exc
    reason = getattr(inner, "reason", None)
    return type(reason or inner).__name__ + (f": {reason}" if reason else "")
