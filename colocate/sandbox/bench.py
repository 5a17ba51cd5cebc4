"""A router whose state object is far away, for ``bench/router.py --far-state-ms``.

The Worker runs behind the sandbox entry with its active generation pinned at a far site
(IAD, the Worker at TPE) and only that hop delayed, by exactly ``delay_ms`` of round
trip: same-site hops cost 0 here and the client talks to workerd directly, so what the
benchmark sees beyond the plain router is the state hop alone.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..cell.plan import CellPlan
from ..workerd import Workerd
from . import config as config_mod
from .geography import Geography, Sites
from .pinning import Pins
from .proxies import Network, NetworkServers, local_url
from .statedir import OBJECTS_DIR, PINS_FILE

EDGE, FAR = "TPE", "IAD"


def _hostport(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


@contextlib.contextmanager
def router_with_state_delay(plan: CellPlan, values: Mapping[str, str], delay_ms: float) -> Iterator[Workerd]:
    """Yield workerd (``.url``, ``.proc.pid``) running ``plan``'s Worker with its state ``delay_ms`` away."""
    geography = Geography.from_args(1.0, (f"{EDGE}:{FAR}={delay_ms:g}",), same_site_ms=0.0)
    with tempfile.TemporaryDirectory(prefix="colocate-far-state-") as tmp:
        tmp_path = Path(tmp)
        pins = Pins(tmp_path / PINS_FILE)
        pins.touch(plan.state.active.name, FAR)  # as if first touched from over there
        sites = Sites(client=EDGE, edge=EDGE, pod=EDGE, fallback=EDGE)
        # The outbound proxy refuses IP literals as Cloudflare does: the Worker gets names.
        values = dict(values)
        pod_urls = [local_url(u) for u in json.loads(values["POD_URLS"])]
        values["POD_URLS"] = json.dumps(pod_urls)
        for k in ("FALLBACK_URL", "fallbackUrl"):
            if k in values:
                values[k] = local_url(values[k])
        fallback = values.get("FALLBACK_URL") or values["fallbackUrl"]
        targets = {**{_hostport(u): EDGE for u in pod_urls}, _hostport(fallback): EDGE}
        with NetworkServers(Network(geography, sites, pins, targets)) as servers:
            objects = tmp_path / OBJECTS_DIR
            text = config_mod.compose(plan, values=dict(values), edge_site=EDGE, state_sites=[EDGE, FAR],
                                      outbound=("127.0.0.1", servers.outbound.port), objects_dir=objects)
            for s in (EDGE, FAR):
                (objects / s).mkdir(parents=True, exist_ok=True)
            with Workerd(tmp_path / "workerd", socket_name=config_mod.SOCKET_NAME) as w:
                w.start(text)
                yield w
