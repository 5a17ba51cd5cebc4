"""Vast.ai (``console.vast.ai`` REST, ``/api/v0``).

Offers are searched once for the whole region (``geolocation`` in the region's countries,
the GPU, ``reliability``, ``direct_port_count`` >= 1, ``static_ip`` (the DNS record keeps the
address create saw), ``disk_space`` >= the disk,
``cuda_max_good`` >= the CUDA floor, rentable, verified, ``dph_total`` <= the cap with
``allocated_storage`` = the disk, so the price held to the cap is the one rented,
``inet_down_cost`` and ``inet_up_cost`` <= ``maxTransferPerGb`` (traffic is billed per GB); with
``cloud`` SECURE, the default, only datacenter hosts: ``datacenter`` = true, Vast.ai's Secure
Cloud, hosts in certified data centres rather than a stranger's machine at home),
re-checked here (the country is the last part of an offer's ``geolocation``, e.g.
"Taipei, TW") and tried cheapest first. An offer taken in the meantime (404/410 no_such_ask)
moves on to the next one; a 401/403 on the rent is the key or the account, never capacity, and
stops at once naming the key. Instance state ``exited``, ``unknown`` or ``offline`` never
becomes ``running``: such an instance is reported dead and destroyed. On a mutual-TLS hop the
create request carries the pod's TLS bundle as the first variable of ``env`` (a JSON object)
and vLLM's TLS flags in ``args`` (``podtls``), as RunPod's does.

Interruptible pods (``colocate:pod.market``, colocate/cell/market.py) are rented by bid: the search
asks ``type: bid`` and ``min_bid`` <= ``bidPerHr`` (no on-demand price cap), the create carries
``price`` = ``bidPerHr`` ("Bid price per machine (in $/hour). Only for interruptible instances",
the spec's createInstance), and a host then runs the highest bidder: an outbid instance is
stopped, killing its processes (Vast.ai's rental-types FAQ), and reports ``stopped`` while its
``intended_status`` is still ``running``, which is reported dead (``stopped (outbid)``): it
serves nothing until it wins the host back, maybe hours later. Offers are spread over failure
domains, SpotHedge's way: a host where one of the stack's interruptible pods was outbid is left
out, and a host, then a country, that holds a live pod of the stack goes after those that hold none.
"""

from __future__ import annotations

import json
import os

from . import podtls
from .base import DEAD, RUNNING, STARTING, PodInfo, Provider, api_key, belongs_to_stack
from .errors import CapacityError, FatalError, NotFoundError
from .http import Api, redact

DEFAULT_BASE = "https://console.vast.ai"
MAX_OFFERS_TRIED = 5
_DEAD = ("exited", "unknown", "offline")
_STOPPED = "stopped"  # with intended_status running: stopped by someone else (outbid, or the host's contract end)
OUTBID = "stopped (outbid)"


def country(geolocation: str | None) -> str:
    return (geolocation or "").rsplit(",", 1)[-1].strip().upper()


class VastAI(Provider):
    name = "vastai"

    def __init__(self, token: str = ""):
        key = api_key("VASTAI_API_KEY", "vastaiApiKey")
        self.api = Api("vastai", os.environ.get("VASTAI_API_BASE") or DEFAULT_BASE, key, secrets=(token,))
        self.serve_port: int | None = None  # set by the lifecycle when the spec is known

    def close(self) -> None:
        self.api.close()

    def candidates(self, spec):
        # Offers carry the host's CUDA as a number (12.8), compared as one, as Vast.ai's filter does.
        cuda = float(spec.min_cuda_version) if spec.min_cuda_version else None
        query = {
            "gpu_name": {"in": [spec.gpu]},
            "num_gpus": {"in": [spec.gpu_count]},
            "geolocation": {"in": list(spec.locations)},
            "reliability": {"gte": spec.min_reliability},
            "direct_port_count": {"gte": 1},
            # The DNS record holds the address create saw: Vast.ai sets PUBLIC_IPADDR at start and does
            # not update it when the address changes, and addresses pass to other machines and instances.
            "static_ip": {"eq": True},
            "disk_space": {"gte": spec.disk_gb},  # a host short on disk refuses the rent
            **({"cuda_max_good": {"gte": cuda}} if cuda is not None else {}),
            "rentable": {"eq": True},
            "verified": {"eq": True},
            # The pod holds the cell's TLS key and every prompt: on SECURE (the default) only hosts in
            # certified data centres; COMMUNITY relaxes it, knowingly (colocate:pod.cloud).
            **({"datacenter": {"eq": True}} if spec.cloud == "SECURE" else {}),
            # dph_total includes the disk, priced at allocated_storage (8 GB unless sent): the cap
            # must be held against the price of the disk create rents.
            "allocated_storage": spec.disk_gb,
            # On demand: the host's price, disk included, within the cap. Interruptible: the least bid the
            # host takes within ours (the create's `price`), priced as a bid (the search's `type`).
            **({"type": "bid", "min_bid": {"lte": spec.bid_per_hr}} if spec.interruptible
               else {"dph_total": {"lte": spec.max_price_per_hr}}),
            # Traffic is billed per GB beside the hour, and each boot pulls ~16 GB (colocate:pod.maxTransferPerGb).
            "inet_down_cost": {"lte": spec.max_transfer_per_gb},
            "inet_up_cost": {"lte": spec.max_transfer_per_gb},
            # On demand no "type": on-demand pricing is its default (the spec's enum says "ondemand ... Default";
            # the official client sends "on-demand", which the same spec's enum does not list).
            "limit": 50,
        }
        offers = self.api.call("POST", "/api/v0/bundles/", json_body=query).body.get("offers") or []
        # Trust but verify: the region guarantee must not rest on the provider's filter alone.
        fit = [o for o in offers
               if country(o.get("geolocation")) in spec.locations and o.get("gpu_name") == spec.gpu
               and _price(o, spec) <= (spec.bid_per_hr if spec.interruptible else spec.max_price_per_hr)
               and float(o.get("reliability") or 0) >= spec.min_reliability
               and int(o.get("direct_port_count") or 0) >= 1 and o.get("static_ip") is True
               and float(o.get("disk_space") or 0) >= spec.disk_gb
               and float(o.get("inet_down_cost", 1e9) or 0) <= spec.max_transfer_per_gb
               and float(o.get("inet_up_cost", 1e9) or 0) <= spec.max_transfer_per_gb
               and (cuda is None or float(o.get("cuda_max_good") or 0) >= cuda)]
        if spec.interruptible:
            fit = spread(fit, self._stack_pods(spec))
        else:
            fit.sort(key=lambda o: float(o["dph_total"]))
        floor = f"CUDA >= {spec.min_cuda_version}, " if cuda is not None else ""
        hosts = "verified datacenter hosts" if spec.cloud == "SECURE" else "verified hosts"
        traffic = f"<= ${spec.max_transfer_per_gb}/GB of traffic"
        price = (f"an interruptible bid of ${spec.bid_per_hr}/h at least the host's min_bid" if spec.interruptible
                 else f"<= ${spec.max_price_per_hr}/h")
        empty = [(loc, spec.gpu, f"no offer (reliability >= {spec.min_reliability}, {price} "
                  f"with a {spec.disk_gb} GB disk, {traffic}, {floor}direct port, static ip, {hosts}; colocate:pod.cloud "
                  "COMMUNITY admits other hosts)" if spec.cloud == "SECURE" else
                  f"no offer (reliability >= {spec.min_reliability}, {price} "
                  f"with a {spec.disk_gb} GB disk, {traffic}, {floor}direct port, static ip, {hosts})")
                 for loc in spec.locations if not any(country(o.get("geolocation")) == loc for o in fit)]
        return fit[:MAX_OFFERS_TRIED], empty

    def _stack_pods(self, spec) -> list[PodInfo]:
        """The stack's pods as Vast.ai lists them: where they run, and which were outbid."""
        return [p for p in self.list_pods() if belongs_to_stack(p.name, spec.stack)]

    def _environment(self, spec, token: str) -> dict[str, str]:
        env = {"VLLM_API_KEY": token, f"-p {spec.port}:{spec.port}": "1"}
        return podtls.environment(self.pod_tls, env) if spec.mtls else env

    def location_of(self, offer: dict) -> str:
        return country(offer.get("geolocation"))

    def create(self, spec, offer: dict, token: str) -> str:
        body = {
            "image": spec.image,
            "label": spec.name,
            "disk": spec.disk_gb,
            # A JSON object, as Vast.ai's CLI sends it (its OpenAPI spec says a string of Docker
            # flags, which cannot hold a PEM): the token reaches vLLM as VLLM_API_KEY, "-p" asks
            # for the serve port as a direct port, and on a mutual-TLS hop the pod's TLS bundle
            # comes first (podtls.environment: Docker puts the request's variables first, in order).
            "env": self._environment(spec, token),
            "runtype": "args",
            "args": spec.vllm_args(),
            "target_state": "running",
            # An instance that cannot run now is not created (an interruptible one would wait, paused, for its
            # host: the spec's default for interruptibles is false).
            "cancel_unavail": True,
            **({"price": spec.bid_per_hr} if spec.interruptible else {}),
        }
        loc = country(offer.get("geolocation"))
        what = (f"offer {offer['id']} (interruptible, bid ${spec.bid_per_hr:.3f}/h, min ${_price(offer, spec):.3f}/h)"
                if spec.interruptible else f"offer {offer['id']} (${float(offer['dph_total']):.3f}/h)")
        try:
            reply = self.api.call("PUT", f"/api/v0/asks/{offer['id']}/", json_body=body, create=True)
        except (NotFoundError, FatalError) as exc:
            if exc.status in (404, 410):
                raise CapacityError(f"{what} is gone", [(loc, what, "taken before we could rent it")]) from None
            if exc.status in (401, 403):
                # The key or the account, not the offer: every other offer would be refused the same way.
                said = redact((exc.body.get("msg") if isinstance(exc.body, dict) else None) or exc.body, self.api.secrets)
                raise FatalError(
                    f"vastai refused to rent {what} with {exc.status} ({said}): the key in VASTAI_API_KEY (pulumi "
                    "config colocate:vastaiApiKey) may not create instances. Fix: use an API key of a Vast.ai renter "
                    "account with permission to create instances: `pulumi config set --secret colocate:vastaiApiKey "
                    f"<key>` (or export VASTAI_API_KEY=<key>). Nothing was rented.\n{exc}") from None
            raise
        if not isinstance(reply.body, dict) or not reply.body.get("success") or "new_contract" not in reply.body:
            raise CapacityError(f"{what} refused", [(loc, what, f"refused: {json.dumps(reply.body)[:200]}")])
        return str(reply.body["new_contract"])

    def describe(self, pod_id: str) -> PodInfo:
        try:
            body = self.api.call("GET", f"/api/v0/instances/{pod_id}/").body or {}
        except FatalError as exc:
            if "no_such_instance" in json.dumps(exc.body):
                raise NotFoundError(f"vastai instance {pod_id} not found") from None
            raise
        inst = body.get("instances")
        if not inst:
            raise NotFoundError(f"vastai instance {pod_id} not found")
        return self._info(inst)

    def destroy(self, pod_id: str) -> bool:
        try:
            self.api.call("DELETE", f"/api/v0/instances/{pod_id}/")
            return True
        except NotFoundError:
            return False
        except FatalError as exc:
            if "no_such_instance" in json.dumps(exc.body):
                return False
            raise

    def list_pods(self) -> list[PodInfo]:
        pods, token = [], None
        for _ in range(40):  # 25 per page: 1,000 instances is far past any account this kit manages
            params = {"limit": 25, **({"after_token": token} if token else {})}
            body = self.api.call("GET", "/api/v1/instances/", params=params).body or {}
            pods += [self._info(i) for i in body.get("instances") or []]
            token = body.get("next_token")
            if not token:
                break
        return pods

    def _info(self, inst: dict) -> PodInfo:
        status = inst.get("actual_status") or inst.get("cur_state") or "loading"
        bid = inst.get("is_bid") is True
        # Stopped while it is meant to run: someone else stopped it, a higher bid (an interruptible
        # instance) or its host (an on-demand contract's end). It serves nothing: dead.
        stopped = status == _STOPPED and inst.get("intended_status") == "running"
        state = DEAD if status in _DEAD or stopped else RUNNING if status == "running" else STARTING
        raw = (OUTBID if bid else f"{status} by its host") if stopped else status
        machine = inst.get("machine_id")
        return PodInfo(id=str(inst["id"]), name=inst.get("label") or "", state=state, raw_state=raw,
                       location=country(inst.get("geolocation")) or None, ip=inst.get("public_ipaddr") or None,
                       port=_host_port(inst.get("ports"), self.serve_port), cost_per_hr=inst.get("dph_total"),
                       gpu=inst.get("gpu_name"), market="interruptible" if bid else "ondemand",
                       host=None if machine is None else str(machine))


def _price(offer: dict, spec) -> float:
    """What the offer would bill the spec's pod: its least bid (interruptible) or its price, disk included."""
    return float(offer.get("min_bid" if spec.interruptible else "dph_total") or 1e9)


def spread(offers: list[dict], stack_pods: list[PodInfo]) -> list[dict]:
    """Interruptible offers in the order SpotHedge would try them: never a host where one of the
    stack's pods was outbid (its bids lose there), then hosts and countries that hold none of the
    stack's live pods before those that do (a correlated preemption takes fewer at once), each
    group cheapest bid first."""
    outbid = {p.host for p in stack_pods if p.raw_state == OUTBID and p.host}
    live = [p for p in stack_pods if p.state != DEAD]
    hosts = {p.host for p in live if p.host}
    countries = {p.location for p in live if p.location}
    usable = [o for o in offers if str(o.get("machine_id")) not in outbid]
    return sorted(usable, key=lambda o: (str(o.get("machine_id")) in hosts, country(o.get("geolocation")) in countries,
                                         float(o.get("min_bid") or 1e9)))


def _host_port(ports, serve_port: int | None) -> int | None:
    """The public port mapped to the serve port: ``{"8000/tcp": [{"HostPort": "41234"}]}`` (the live API's form)."""
    if not isinstance(ports, dict):
        return None
    for key, binds in ports.items():
        if (key == f"{serve_port}/tcp" if serve_port else key.endswith("/tcp")) and binds:
            try:
                return int(binds[0]["HostPort"])
            except (KeyError, TypeError, ValueError, IndexError):
                continue
    return None
