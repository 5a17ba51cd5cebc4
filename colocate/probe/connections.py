"""New connections on the pod hop: where the probe can make one and show it was one (``pod_rtt_new``).

A Worker cannot ask for a new connection. ``fetch`` has no option for it (the mTLS binding's
``fetch`` has the same signature); workerd keeps each host's idle connections and gives the
next request one of them; Cloudflare reuses an open connection to an origin for up to 900 s
after its last request (developers.cloudflare.com/fundamentals/reference/connection-limits,
"Proxy Idle Timeout"). So the probe makes new connections from outside, where the old ones
can be closed and the new ones counted: a sandbox closes its pod hops' connections
(``POST /_sandbox/pod-hop/cut``) and counts the connections each hop accepts. A sample
counts as new for a pod only if that pod's hop accepted a connection while it ran. A deployed
cell has no such place, so there ``pod_rtt_new`` is not measured and the result says why.
"""

from __future__ import annotations

import requests

from .errors import Unreachable

CUT_PATH = "/_sandbox/pod-hop/cut"
COUNT_PATH = "/_sandbox/pod-hop/connections"
NOT_MEASURED = ("a Worker cannot open a new connection on demand (Cloudflare reuses a connection to the pod for "
                "up to 900 s idle), so only a sandbox, which closes its pod hops' connections and counts the new "
                "ones, measures pod_rtt_new")


class HopControl:
    """A sandbox's pod hops, through its network's control endpoint: close their connections, count new ones."""

    def __init__(self, control_url: str, timeout_s: float):
        self.url = control_url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str) -> dict[str, int]:
        try:
            r = requests.request(method, self.url + path, timeout=self.timeout_s)
            r.raise_for_status()
            counts = r.json()["connections"]
        except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
            raise Unreachable(f"the sandbox's network control {self.url + path} failed ({type(exc).__name__}): "
                              "is the sandbox still up? `.venv/bin/python scripts/sandbox.py status`") from None
        return {str(port): int(n) for port, n in counts.items()}

    def cut(self) -> dict[str, int]:
        """Close every open connection of the pod hops; each hop's connections accepted so far, by port."""
        return self._call("POST", CUT_PATH)

    def counts(self) -> dict[str, int]:
        return self._call("GET", COUNT_PATH)


def opened(before: dict[str, int], after: dict[str, int]) -> frozenset[str]:
    """The hop ports that accepted a connection between the two counts."""
    return frozenset(port for port, n in after.items() if n > before.get(port, 0))


def port_of(host: object) -> str | None:
    """The port of a pod host as the probe body lists it (``localhost:41234`` → ``41234``)."""
    if not isinstance(host, str) or ":" not in host:
        return None
    port = host.rsplit(":", 1)[1]
    return port if port.isdigit() else None
