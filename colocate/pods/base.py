"""What every provider returns and offers: ``PodInfo`` and the ``Provider`` interface."""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import asdict, dataclass

from ..cell import catalogue
from .errors import PodConfigError

# Normalised states: the orchestration only needs these.
STARTING, RUNNING, DEAD = "starting", "running", "dead"


@dataclass
class PodInfo:
    id: str
    name: str
    state: str  # STARTING | RUNNING | DEAD (dead = will never serve: destroy it)
    raw_state: str  # the provider's own word, for progress lines
    location: str | None = None
    ip: str | None = None
    port: int | None = None
    cost_per_hr: float | None = None
    gpu: str | None = None
    proxy_url: str | None = None  # a provider's HTTPS proxy for the pod (RunPod), when that is the path
    scheme: str = "http"  # "https" when the pod serves mutual TLS (the spec's tls_name)
    market: str | None = None  # ondemand | interruptible, as the provider reports it (None: it does not say)
    host: str | None = None  # the machine it runs on, where the provider says (a failure domain: Vast.ai's machine_id)

    @property
    def url(self) -> str | None:
        if self.proxy_url:
            return self.proxy_url
        return f"{self.scheme}://{self.ip}:{self.port}" if self.ip and self.port else None

    def as_dict(self) -> dict:
        return {**asdict(self), "url": self.url}


class Provider:
    """A GPU provider. ``create`` raises CapacityError for one location; the lifecycle walks the locations."""

    name = "?"
    # Set by the lifecycle on a mutual-TLS hop: the pod's COLOCATE_POD_TLS value (podtls.bundle),
    # and readiness's (client context, name on the pod's certificate).
    pod_tls: str = ""
    checker: tuple[ssl.SSLContext, str] | None = None

    def candidates(self, spec) -> tuple[list, list[tuple[str, str, str]]]:
        """(ordered create candidates, attempt rows for locations with nothing to try)."""
        raise NotImplementedError

    def location_of(self, candidate) -> str:
        return str(candidate)

    def create(self, spec, candidate, token: str) -> str:
        raise NotImplementedError

    def describe(self, pod_id: str) -> PodInfo:
        raise NotImplementedError

    def destroy(self, pod_id: str) -> bool:
        """True if something was destroyed, False if it was already gone."""
        raise NotImplementedError

    def list_pods(self) -> list[PodInfo]:
        raise NotImplementedError

    def no_address_fix(self, spec) -> str | None:
        """Why a RUNNING pod of ``spec`` may never get a public address, and the fix; None
        when it always gets one (readiness then waits its whole timeout for it)."""
        return None

    def close(self) -> None:
        pass


def scope_of(name: str | None, stack: str) -> str | None:
    """The scope (``plan.pod_scope``) a pod named for ``stack`` carries: ``colocate-<stack>-<scope>-<region>-g<N>
    -p<i>-<digest>``; "" for a name without one (``colocate-<stack>-<region>-...``: the sandbox's, and every
    pod named before scopes); None for a pod that is not the stack's (stack ``a`` never claims stack ``a-b``'s)."""
    if not name or not name.startswith(f"colocate-{stack}-"):
        return None
    rest = name[len(f"colocate-{stack}-"):]
    for r in catalogue.REGIONS:
        m = re.fullmatch(r"(?:([0-9a-f]{6})-)?" + re.escape(r) + r"-g\d+(-p\d+)?(-[0-9a-f]{6})?", rest)
        if m:
            return m.group(1) or ""
    return None


def belongs_to_stack(name: str | None, stack: str, scope: str | None = None) -> bool:
    """Whether a pod of this name is the stack's: with ``scope``, a name of that scope or of none (named
    before scopes: still found, so it is deleted); without, a name of the stack in any scope."""
    found = scope_of(name, stack)
    return found is not None and (scope is None or found in ("", scope))


def api_key(env_var: str, config_key: str) -> str:
    """A provider's API key, from the environment only (never argv, never a file)."""
    key = os.environ.get(env_var, "")
    if not key:
        raise PodConfigError(f"{env_var} is not set. Fix: export {env_var}=<key> "
                             f"(from pulumi config colocate:{config_key}); it is never read from argv")
    return key
