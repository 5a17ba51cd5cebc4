"""Endpoints the team already runs (``colocate:pod.provider: existing``): each one's address, place and
price, checked as a rented pod's would be, and the hop that can reach them safely. Pure: no I/O.

``colocate:pod.endpoints`` is a list of ``{host | ip, port, location, costPerHr}``:

- ``host``: a DNS name the team owns (a deployed Worker cannot fetch an IP literal: Cloudflare's
  error 1003). ``ip``: the box's public address; the kit then declares a DNS-only record for it on
  ``colocate:zone`` (``pod-<generation>.<zone>``, ``-p<i>`` for pod i), as it does for a Vast.ai pod.
- ``port``: where the box serves HTTPS (default ``colocate:pod.port``).
- ``location``: the Cloudflare colo nearest the box, one of the region's in-region colos
  (``catalogue.Region.in_region_colos``): placed and probed like a rented pod's location.
- ``costPerHr``: what the box costs the team an hour, their own figure (default 0), summed into
  ``podsCostPerHr`` for ``scripts/cost.py``.

The hop (``resolve_hop``): mutual TLS when every endpoint's name is on the zone (the kit issues its
certificate by ACME DNS-01 there, as for a rented pod, and the operator installs it); otherwise the
pod token behind the pod's guard over HTTPS that the box terminates with a publicly trusted
certificate of its own. Plain HTTP is never an option: the Worker always fetches ``https://``.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass

from ..errors import ConfigError

KEY = "colocate:pod.endpoints"
FIELDS = ("host", "ip", "port", "location", "costPerHr")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# Names no public resolver answers (RFC 6761 localhost, mDNS's .local) and common private suffixes.
PRIVATE_SUFFIXES = ("localhost", "local", "internal", "lan", "home.arpa")
# Addresses the Worker, on Cloudflare's edge, cannot reach: RFC 1918, shared (CGNAT), loopback,
# link-local, IPv6 unique-local. Documentation ranges pass: the shipped stack uses one as a placeholder.
UNREACHABLE = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))
# Hostnames of providers' shared HTTPS proxies: anycast, so Cloudflare's placement probes cannot
# locate them (plan.placement_mode); RunPod's proxy answers a pod by its id and port.
ANYCAST_SUFFIXES = ("proxy.runpod.net",)


@dataclass(frozen=True)
class Endpoint:
    """One endpoint. ``host`` is the name the Worker fetches: the declared one, or (``ip`` given)
    empty until the plan names it on the zone (``plan.endpoint_name``)."""

    host: str
    ip: str
    port: int
    location: str
    cost_per_hr: float = 0.0

    def on_zone(self, zone_name: str | None) -> bool:
        """Whether the kit can get a certificate for this endpoint's name (ACME DNS-01 on the zone)."""
        if self.ip:
            return zone_name is not None
        return zone_name is not None and (self.host == zone_name or self.host.endswith("." + zone_name))


def _fix(i: int, field: str, example: str) -> str:
    return f"pulumi config set --path '{KEY}[{i}].{field}' {example}"


def _hostname(i: int, value: object) -> str:
    key = f"{KEY}[{i}].host"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, value, "must be the box's DNS name", _fix(i, "host", "gpu1.example.com"))
    name = value.strip().rstrip(".").lower()
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        pass
    else:
        raise ConfigError(key, value, "is an IP address, and a deployed Worker cannot fetch an IP literal "
                          "(Cloudflare error 1003)",
                          f"pulumi config set --path '{KEY}[{i}].ip' {name.strip('[]')} (the kit names it with a "
                          "DNS-only record on colocate:zone), or a DNS name you own that points at it")
    labels = name.split(".")
    if len(name) > 253 or len(labels) < 2 or not all(_LABEL.fullmatch(label) for label in labels) \
            or labels[-1].isdigit():
        raise ConfigError(key, value, "is not a DNS name (letters, digits and '-' in dot-separated labels)",
                          _fix(i, "host", "gpu1.example.com"))
    if any(name == s or name.endswith("." + s) for s in PRIVATE_SUFFIXES):
        raise ConfigError(key, value, "no public resolver answers this name, and the Worker resolves it on "
                          "Cloudflare's edge", _fix(i, "host", "<a name in public DNS>"))
    return name


def _address(i: int, value: object) -> str:
    key = f"{KEY}[{i}].ip"
    try:
        addr = ipaddress.ip_address(str(value).strip())
    except ValueError:
        raise ConfigError(key, value, "is not an IPv4 or IPv6 address", _fix(i, "ip", "203.0.113.7")) from None
    if (addr.is_loopback or addr.is_link_local or addr.is_multicast or addr.is_unspecified
            or any(addr in net for net in UNREACHABLE if net.version == addr.version)):
        raise ConfigError(key, value, "is not reachable from the internet, where the Worker runs (Cloudflare's edge)",
                          _fix(i, "ip", "<the box's public address>") + " (port-forward the box's port to it)")
    return str(addr)


def _port(i: int, value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{KEY}[{i}].port", value, "must be a TCP port, 1 to 65535", _fix(i, "port", "8000"))
    return value


def _cost(i: int, value: object) -> float:
    n = value
    if isinstance(value, str):
        try:
            n = float(value)
        except ValueError:
            n = None
    if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n) or n < 0:
        raise ConfigError(f"{KEY}[{i}].costPerHr", value, "must be a number of $ an hour, at least 0",
                          _fix(i, "costPerHr", "0.35 (what the box costs you an hour)"))
    return float(n)


def parse(value: object, default_port: int) -> tuple[Endpoint, ...]:
    """``colocate:pod.endpoints``, syntax only: the region, the zone and the hop are ``check``'s."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(KEY, value, "must be a list of {host or ip, port, location, costPerHr}",
                          f"pulumi config set --path '{KEY}[0].host' gpu1.example.com (and .location, .port)")
    out = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise ConfigError(f"{KEY}[{i}]", raw, "must be a mapping {host or ip, port, location, costPerHr}",
                              _fix(i, "host", "gpu1.example.com"))
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{KEY}[{i}].{unknown[0]}", raw[unknown[0]], "unknown key", f"use only {', '.join(FIELDS)}")
        if ("host" in raw) == ("ip" in raw):
            raise ConfigError(f"{KEY}[{i}]", raw, "needs exactly one of host (a DNS name you own) and ip (the kit "
                              "names it on colocate:zone)", _fix(i, "host", "gpu1.example.com"))
        location = raw.get("location")
        if not isinstance(location, str) or not location.strip():
            raise ConfigError(f"{KEY}[{i}].location", location, "must be the Cloudflare colo nearest the box "
                              "(an IATA code of the region)", _fix(i, "location", "TPE"))
        out.append(Endpoint(
            host=_hostname(i, raw["host"]) if "host" in raw else "",
            ip=_address(i, raw["ip"]) if "ip" in raw else "",
            port=_port(i, raw.get("port", default_port)),
            location=location.strip().upper(),
            cost_per_hr=_cost(i, raw.get("costPerHr", 0)),
        ))
    seen: dict[tuple[str, int], int] = {}
    for i, e in enumerate(out):
        where = (e.host or e.ip, e.port)
        if where in seen:
            raise ConfigError(f"{KEY}[{i}]", f"{where[0]}:{where[1]}", f"is endpoint {seen[where]} again: one box "
                              "serves as one pod", f"pulumi config rm --path '{KEY}[{i}]'")
        seen[where] = i
    return tuple(out)


def check(endpoints: tuple[Endpoint, ...], region_name: str, in_region: tuple[str, ...],
          zone_name: str | None) -> None:
    """Each endpoint where a rented pod of the region may be, and named where the Worker can reach it."""
    for i, e in enumerate(endpoints):
        if e.location not in in_region:
            raise ConfigError(f"{KEY}[{i}].location", e.location,
                              f"is not a colo of region {region_name} ({', '.join(in_region)}): the cell's state and "
                              "its Worker are placed there, and a pod elsewhere would split them",
                              _fix(i, "location", f"<the colo nearest the box: {', '.join(in_region)}>") +
                              ", or serve this box from a cell in its own region")
        if e.ip and zone_name is None:
            raise ConfigError(f"{KEY}[{i}].ip", e.ip, "needs colocate:zone: a deployed Worker cannot fetch an IP "
                              "literal, so the kit names the box with a DNS-only record on your zone",
                              "pulumi config set --path colocate:zone.id <zone id> and --path colocate:zone.name "
                              f"<example.com>, or pulumi config set --path '{KEY}[{i}].host' <a DNS name of the box>")


def resolve_hop(endpoints: tuple[Endpoint, ...], setting: str, zone_name: str | None) -> str:
    """``colocate:pod.hop`` for a cell of endpoints: ``mtls`` or ``token`` (``auto`` resolved).

    ``mtls``: every name is on the zone, so the kit can issue the box's publicly trusted certificate
    (ACME DNS-01) and the box admits only the Worker's client certificate. ``token``: the box
    terminates TLS itself with a publicly trusted certificate for its own name and answers only the
    pod token, behind the pod's guard (the readiness check at ``pulumi up`` refuses a box that answers
    vLLM's open routes to strangers). ``auto``: ``mtls`` when every endpoint is on the zone, else ``token``."""
    on_zone = [e.on_zone(zone_name) for e in endpoints]
    hop = ("mtls" if all(on_zone) else "token") if setting == "auto" else setting
    if hop == "mtls":
        off = next((i for i, ok in enumerate(on_zone) if not ok), None)
        if off is not None:
            e = endpoints[off]
            raise ConfigError(f"{KEY}[{off}].host", e.host,
                              f"is not on colocate:zone ({zone_name or 'not set'}), and a mutual-TLS hop needs the "
                              "box's certificate from the kit, which it issues by ACME DNS-01 on the zone",
                              f"pulumi config set --path '{KEY}[{off}].ip' <the box's public address> (the kit names "
                              "it on the zone), or a host under the zone, or pulumi config set --path colocate:pod.hop "
                              "token (your own TLS, the pod token behind the pod's guard)")
        return hop
    by_ip = next((i for i, e in enumerate(endpoints) if e.ip), None)
    if by_ip is not None:
        raise ConfigError(f"{KEY}[{by_ip}].ip", endpoints[by_ip].ip,
                          "a token hop needs the box to terminate TLS itself with a publicly trusted certificate for "
                          "the name the Worker fetches, and the box holds none for the name the kit makes on the zone"
                          + (" (other endpoints are off the zone, so auto chose token)" if setting == "auto" else ""),
                          "give every endpoint a name on colocate:zone (ip:, or a host under the zone) for mutual TLS, "
                          f"or pulumi config set --path '{KEY}[{by_ip}].host' <your name, with your certificate>")
    return hop


def anycast(host: str) -> bool:
    """Whether ``host`` is a provider's shared proxy name, which placement cannot locate."""
    return any(host == s or host.endswith("." + s) for s in ANYCAST_SUFFIXES)
