"""The sandbox's workerd config, composed from the cell plan with colocate/workerd.py's blocks.

Services:
    edge            the Worker as the cloud runs it: the plan's modules byte-for-byte, plus
                    the sandbox entry (js/wrapper.js) as main module; the plan's bindings (BREAKER
                    wrapped by the entry) plus the sandbox's own (``__SANDBOX_*``); globalOutbound
                    -> the outbound proxy tagged with the edge's site
    state-<SITE>    one object host per site an object may live at: the same product modules
                    behind the same sandbox entry (its Breaker extends the product's only to
                    hand it the wrapped BREAKER), SQLite storage on disk under
                    <state_dir>/objects/<SITE>/, globalOutbound tagged with <SITE>
    out-<SITE>      the outbound proxy as an external HTTP service injecting ``x-sandbox-site: <SITE>``
    colocate-pod-tls  the plan's POD_TLS binding: https presenting the Worker's client certificate,
                    trusting only the sandbox's CA (the pods' delays are the PodHop relays')
    sandbox-control the pin control endpoint (the same proxy, no site header)

Bindings come from ``plan.worker.bindings`` through ``colocate.workerd`` (never
hand-copied). The config holds secret values, so it is written with mode 0600.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import workerd as wd
from ..cell.plan import BREAKER_CLASS, CellPlan
from .errors import SandboxError
from .proxies import SITE_HEADER

WRAPPER = Path(__file__).parent / "js" / "wrapper.js"
ENTRY_MODULE = "__sandbox_entry.js"
SOCKET_NAME = "http"
CONTROL_SERVICE = "sandbox-control"


def compose(plan: CellPlan, *, values: dict[str, str], edge_site: str, state_sites: list[str],
            outbound: tuple[str, int], objects_dir: Path, pod_tls: wd.HopClient | None = None) -> str:
    """The whole config text. ``values`` fills secret and from-output bindings (by secret
    key, binding name or ``pod.urls``); ``outbound`` is the proxy's (host, port); ``pod_tls``
    the Worker's side of the mutual-TLS pod hop."""
    if edge_site not in state_sites:
        raise SandboxError(f"workerd config: the edge site {edge_site} needs an object host")
    worker = plan.worker
    cls = wd.capnp_text(BREAKER_CLASS)
    host, port = outbound
    entry = [(ENTRY_MODULE, WRAPPER.read_text())]

    def sandbox_bindings(site: str) -> list[str]:
        out = [f'(name = "__SANDBOX_EDGE_SITE", text = {wd.capnp_text(site)})',
               f'(name = "__SANDBOX_CONTROL", service = {wd.capnp_text(CONTROL_SERVICE)})']
        return out + [f"(name = {wd.capnp_text('__SANDBOX_NS_' + s)}, durableObjectNamespace = "
                      f"(className = {cls}, serviceName = {wd.capnp_text('state-' + s)}))" for s in state_sites]

    hop = wd.POD_TLS_SERVICE if pod_tls is not None else None
    try:
        edge = wd.worker_capnp(worker, values, host_objects=False, do_service=f"state-{edge_site}",
                               global_outbound=f"out-{edge_site}", extra_modules=entry, main_module=ENTRY_MODULE,
                               extra_bindings=sandbox_bindings(edge_site), pod_tls_service=hop)
    except wd.BindingValueMissing as exc:
        raise SandboxError(f"workerd config: {exc}") from None
    services = [wd.worker_service("edge", edge)]
    for s in sorted(set(state_sites)):
        # Object hosts run the sandbox entry as well, so the Breaker they host sees the
        # wrapped BREAKER (read-through to a draining generation reaches where it is pinned).
        literal = wd.worker_capnp(worker, values, storage_service=f"disk-{s}", global_outbound=f"out-{s}",
                                  extra_modules=entry, main_module=ENTRY_MODULE, extra_bindings=sandbox_bindings(s),
                                  pod_tls_service=hop)
        services.append(wd.worker_service(f"state-{s}", literal))
        services.append(wd.disk_service(f"disk-{s}", Path(objects_dir) / s))
    for s in sorted(set(state_sites) | {edge_site}):
        services.append(wd.external_service(f"out-{s}", host, port, {SITE_HEADER: s}))
    services.append(wd.external_service(CONTROL_SERVICE, host, port))
    if pod_tls is not None:
        services.append(wd.pod_tls_service(wd.POD_TLS_SERVICE, pod_tls))
    # Port 0 here; the runner hands workerd a socket it bound itself (-S http=<fd>).
    return wd.config_capnp(services, [wd.socket_capnp(SOCKET_NAME, 0, "edge")])


def write(path: Path, text: str, objects_dir: Path, state_sites: list[str]) -> Path:
    """Write the config with mode 0600 and create the object directories it names."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for s in state_sites:
        (Path(objects_dir) / s).mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)
    return path
