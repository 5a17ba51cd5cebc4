"""RunPod, REST v2 only (``/v2/pods``; v1 was retired on 2026-11-15).

One data centre at a time, in catalogue order: ``dataCenterIds`` holds exactly one id per
create, so a capacity refusal in the first is retried in the second and never elsewhere.
The pod exposes its port the way the Worker will reach it (the spec's ``path``):
``<port>/tcp`` for a DNS-only record on the operator's zone (a direct public ip + mapped
port from ``runtime.ports``, which skips RunPod's HTTP proxy: extra latency, a 100 s cut;
the mapped port changes on reset, the create's output carries the current one), or
``<port>/http`` for RunPod's proxy hostname ``https://<pod id>-<port>.proxy.runpod.net``
when there is no zone (a Worker cannot fetch an IP address). ``RUNPOD_PROXY_TEMPLATE``
overrides that address's form (tests point it at a local server).
"""

from __future__ import annotations

import os

from ..plan import PATH_PROVIDER_PROXY, RUNPOD_PROXY_TEMPLATE, runpod_proxy_url
from .base import DEAD, RUNNING, STARTING, PodInfo, Provider, api_key
from .errors import CapacityError, FatalError, ProviderError
from .http import Api

DEFAULT_BASE = "https://api.runpod.io"
CAPACITY_WORDS = ("no longer any instances available", "not enough", "no instances", "capacity",
                  "could not be placed", "unavailable")
_STATES = {"PROVISIONING": STARTING, "STARTING": STARTING, "RUNNING": RUNNING,
           "EXITED": DEAD, "ERROR": DEAD, "TERMINATED": DEAD}


class RunPod(Provider):
    name = "runpod"

    def __init__(self, token: str = ""):
        key = api_key("RUNPOD_API_KEY", "runpodApiKey")
        self.api = Api("runpod", os.environ.get("RUNPOD_API_BASE") or DEFAULT_BASE, key, secrets=(token,))

    def close(self) -> None:
        self.api.close()

    def candidates(self, spec):
        return list(spec.locations), []

    def create(self, spec, location: str, token: str) -> str:
        body = {
            "name": spec.name,
            "image": spec.image,
            "gpu": {"id": spec.gpu, "count": spec.gpu_count},
            "cloud": spec.cloud,
            "dataCenterIds": [location],
            "ports": [f"{spec.port}/{'http' if spec.path == PATH_PROVIDER_PROXY else 'tcp'}"],
            "env": {"VLLM_API_KEY": token},
            "args": " ".join(spec.vllm_args()),
            "disk": spec.disk_gb,
        }
        try:
            reply = self.api.call("POST", "/v2/pods", json_body=body, create=True, ok=(200, 201))
        except FatalError as exc:
            detail = _detail(exc)
            # 400 carries both rule violations and "no capacity" (no machine code for the latter);
            # 403 means this pool is closed to the account: both move on to the next data centre.
            if exc.status == 400 and any(w in detail.lower() for w in CAPACITY_WORDS):
                raise CapacityError(f"{location}: {detail}", [(location, spec.gpu, detail)]) from None
            if exc.status == 403:
                raise CapacityError(f"{location}: forbidden: {detail}", [(location, spec.gpu, f"403 {detail}")]) from None
            raise
        return str(reply.body["id"])

    def describe(self, pod_id: str) -> PodInfo:
        return self._info(self.api.call("GET", f"/v2/pods/{pod_id}").body, port=None)

    def destroy(self, pod_id: str) -> bool:
        from .errors import NotFoundError
        try:
            self.api.call("DELETE", f"/v2/pods/{pod_id}", ok=(200, 204))
            return True
        except NotFoundError:
            return False

    def list_pods(self) -> list[PodInfo]:
        return [self._info(p, port=None) for p in self.api.call("GET", "/v2/pods").body.get("pods", [])]

    def _info(self, pod: dict, port: int | None) -> PodInfo:
        status = pod.get("status", "?")
        private, proto = _private_port(pod)
        ip = public = proxy = None
        for p in ((pod.get("runtime") or {}).get("ports") or []):
            if p.get("private") == private and p.get("type") == "tcp" and p.get("ip") and p.get("public"):
                ip, public = p["ip"], int(p["public"])
        if proto == "http" and private is not None and status == "RUNNING":
            proxy = runpod_proxy_url(str(pod["id"]), private, os.environ.get("RUNPOD_PROXY_TEMPLATE") or RUNPOD_PROXY_TEMPLATE)
        return PodInfo(id=str(pod["id"]), name=pod.get("name", ""), state=_STATES.get(status, STARTING),
                       raw_state=status, location=pod.get("dataCenterId"), ip=ip, port=public,
                       cost_per_hr=pod.get("cost"), gpu=(pod.get("gpu") or {}).get("id"), proxy_url=proxy)


def _private_port(pod: dict) -> tuple[int | None, str | None]:
    """The inference port and how it is exposed ("tcp" or "http")."""
    for p in pod.get("ports") or []:
        num, _, proto = str(p).partition("/")
        if proto in ("tcp", "http") and num.isdigit():
            return int(num), proto
    return None, None


def _detail(exc: ProviderError) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or body)
    return str(body or exc)
