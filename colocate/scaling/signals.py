"""What the scaling controller reads and writes in the cell's generation: the Worker's scaling
endpoints (``GET``/``POST /_colocate/scale``, its lock, ``GET /_colocate/probe``) through
``CellClient``, and what their answers say (``desired_of``, ``sample_of``, ``draining_inflight``).

The Pulumi program reads the controller's count here at every ``up`` (infra/program.py), so it
depends on this module and never on the controller (colocate/scaling/controller.py), which runs
``pulumi up`` itself. urllib only: no Pulumi, no subprocess.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from .policy import Sample

SCALE_STEP_ENV = "COLOCATE_SCALE_STEP"  # set for the controller's `pulumi up`: the program softens the probe


class CellClient:
    """The Worker's scaling endpoints, with the admin token (never in argv or logs): reading the
    signals takes the read token, the lock and the records the admin one."""

    def __init__(self, url: str, token: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"authorization": f"Bearer {self._token}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            with err:  # an HTTPError holds the connection until closed
                text = err.read()
            try:
                return err.code, json.loads(text)
            except ValueError:
                return err.code, {"error": text[:200].decode(errors="replace")}

    def state(self) -> dict:
        status, body = self._call("/_colocate/scale")
        if status != 200:
            raise OSError(f"GET /_colocate/scale answered {status}: {body}")
        return body

    def lock(self, owner: str, ttl_s: float, release: bool = False) -> tuple[bool, dict | None]:
        status, body = self._call("/_colocate/scale/lock", {"owner": owner, "ttl_ms": max(1, int(ttl_s * 1000)),
                                                             "release": release})
        if status not in (200, 409):
            raise OSError(f"POST /_colocate/scale/lock answered {status}: {body}")
        return status == 200, body.get("lock")

    def record(self, owner: str, decision: dict, desired: tuple[int, int] | None = None,
               replaced: dict[int, int] | None = None, keeper: dict | None = None) -> bool:
        """Record a decision; with ``desired`` (pods, draining), also the count every ``pulumi up`` applies,
        with ``replaced`` its colocate:pod.replaced, and with ``keeper`` the keeper's last pass."""
        body: dict = {"owner": owner, "decision": decision}
        if desired is not None:
            body["desired"] = {"pods": desired[0], "draining": desired[1]}
            if replaced is not None:
                body["desired"]["replaced"] = {str(k): v for k, v in sorted(replaced.items())}
        if keeper is not None:
            body["keeper"] = keeper
        status, _ = self._call("/_colocate/scale", body)
        return status == 200

    def probe(self) -> dict | None:
        """The Worker's health check of each pod and their breakers (``GET /_colocate/probe``); None when unread."""
        try:
            status, body = self._call("/_colocate/probe")
        except (OSError, ValueError):
            return None
        return body if status == 200 else None


def desired_of(state: dict) -> tuple[int, int] | None:
    """(pods, draining) the controller last asked for, from ``GET /_colocate/scale``; None when none did."""
    d = state.get("desired")
    if not isinstance(d, dict) or not isinstance(d.get("pods"), int) or not isinstance(d.get("draining"), int):
        return None
    return d["pods"], d["draining"]


def sample_of(state: dict, at: float) -> Sample:
    """A decision sample from the generation's answer, stamped with the controller's clock."""
    backends = state.get("backends") or {}
    return Sample(
        at=at,
        requests={b: int(v.get("requests", 0)) for b, v in backends.items()},
        tokens={b: (int(v.get("prompt_tokens", 0)), int(v.get("completion_tokens", 0))) for b, v in backends.items()},
        inflight={str(k): int(v) for k, v in (state.get("inflight") or {}).items()},
    )


def draining_inflight(state: dict, first: int) -> int:
    """Requests in flight on pods ``first`` and up (the ones leaving)."""
    return sum(int(n) for k, n in (state.get("inflight") or {}).items() if int(k) >= first)
