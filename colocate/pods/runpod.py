"""RunPod, REST v2 only (``/v2/pods``). v1 is gone: "REST API v1 is deprecated and will be retired on
December 1, 2026" (RunPod's migration guide, docs.runpod.io/api-reference-v2/migrate-from-v1).

One data centre at a time, in catalogue order: ``dataCenterIds`` holds exactly one id per
create, so a refusal in the first is retried in the second and never elsewhere. v2 calls them
"preferred data centers": the created pod's ``dataCenterId`` is checked against the region's
locations, and a pod placed elsewhere is deleted at once (the next location is tried). Refusals follow
the createPod table of the v2 spec: 400 ("could not be placed", or a broken rule: capacity has no
code of its own) and 403 (this key or account cannot use the pool) move on to the next data
centre; when every data centre refused, the error gives the last ``detail`` and says it may be a
problem with the request (400) or with the key's permissions (403). 401, 402 and 422 stop at once.
The pod exposes its port the way the Worker will reach it (the spec's ``path``):
``<port>/tcp`` for a DNS-only record on the operator's zone (a direct public ip + mapped
port from ``runtime.ports``, which skips RunPod's HTTP proxy: extra latency, a 100 s cut;
the mapped port changes on reset, the create's output carries the current one), or
``<port>/http`` for RunPod's proxy hostname ``https://<pod id>-<port>.proxy.runpod.net``
when there is no zone (a Worker cannot fetch an IP address). ``RUNPOD_PROXY_TEMPLATE``
overrides that address's form (tests point it at a local server).
On a mutual-TLS hop the request carries the pod's TLS bundle as the first variable of ``env``
(a JSON object keeps its order on the wire) and vLLM's TLS flags in ``args`` (``podtls``).

The price: v2's create request has no price field, so ``maxPricePerHr`` is held twice. Before
anything is rented, the catalogue's list price (``GET /v2/catalog/gpus/{id}``: per GPU and
cloud, times ``gpu.count``) must be within it; and the create's answer carries the pod's billed
``cost``, so a pod above the cap is deleted at once and the create fails naming the key.
"""

from __future__ import annotations

import os
from urllib.parse import quote

from ..cell.plan import PATH_PROVIDER_PROXY, RUNPOD_PROXY_TEMPLATE, runpod_proxy_url
from . import podtls
from .base import DEAD, RUNNING, STARTING, PodInfo, Provider, api_key
from .errors import CapacityError, FatalError, NotFoundError, OverPriceError, ProviderError, format_attempts
from .http import Api, redact

PRICE_FIX = ("Fix: raise the cap (pulumi config set --path colocate:pod.maxPricePerHr <$/h>), or choose a cheaper "
             "colocate:pod.gpu, colocate:pod.cloud COMMUNITY (without colocate:zone) or a smaller colocate:pod.gpuCount")

DEFAULT_BASE = "https://api.runpod.io"
# createPod's "try your next candidate" answers. Capacity exhaustion is a 400 with prose only, so
# the detail is never matched against words: any rewording would abort a region that has room.
NEXT_CANDIDATE = (400, 403)
KEY_FIX = ("Fix: use a RunPod API key with write access to pods: `pulumi config set --secret "
           "colocate:runpodApiKey <key>` (or export RUNPOD_API_KEY=<key>)")
_STATES = {"PROVISIONING": STARTING, "STARTING": STARTING, "RUNNING": RUNNING,
           "EXITED": DEAD, "ERROR": DEAD, "TERMINATED": DEAD}


class RunPod(Provider):
    name = "runpod"

    def __init__(self, token: str = ""):
        key = api_key("RUNPOD_API_KEY", "runpodApiKey")
        self.api = Api("runpod", os.environ.get("RUNPOD_API_BASE") or DEFAULT_BASE, key, secrets=(token,))
        # (pod name, data centre) -> (status, detail, full error) of each refused create, so the
        # refusal of the last data centre can say what every one of them answered.
        self._refused: dict[tuple[str, str], tuple[int, str, str]] = {}

    def close(self) -> None:
        self.api.close()

    def candidates(self, spec):
        self._check_list_price(spec)
        return list(spec.locations), []

    def _check_list_price(self, spec) -> None:
        """The catalogue's price for the spec's GPUs on its cloud, held to the cap before renting."""
        gpu = self.api.call("GET", f"/v2/catalog/gpus/{quote(spec.gpu, safe='')}").body or {}
        per_gpu = (gpu.get("price") or {}).get(spec.cloud.lower())
        if not isinstance(per_gpu, int | float):
            raise OverPriceError(f"runpod's catalogue gives no {spec.cloud} price for {spec.gpu}, so "
                                 f"colocate:pod.maxPricePerHr ({spec.max_price_per_hr}) cannot be held; nothing was "
                                 "rented. Fix: check colocate:pod.gpu against GET /v2/catalog/gpus, or colocate:pod.cloud")
        price = round(per_gpu * spec.gpu_count, 4)
        if price > spec.max_price_per_hr:
            raise OverPriceError(f"runpod lists {spec.gpu} x{spec.gpu_count} on {spec.cloud} at ${price}/h, above "
                                 f"colocate:pod.maxPricePerHr ${spec.max_price_per_hr}/h; nothing was rented. {PRICE_FIX}")

    def create(self, spec, location: str, token: str) -> str:
        body = {
            "name": spec.name,
            "image": spec.image,
            # The host's CUDA floor: below the image's CUDA build vLLM never starts, and create
            # would wait out ready_timeout_s on it. A floor, not allowedCudaVersions (exclusive).
            "gpu": {"id": spec.gpu, "count": spec.gpu_count,
                    **({"minCudaVersion": spec.min_cuda_version} if spec.min_cuda_version else {})},
            "cloud": spec.cloud,
            "dataCenterIds": [location],
            "ports": [f"{spec.port}/{'http' if spec.path == PATH_PROVIDER_PROXY else 'tcp'}"],
            # On a mutual-TLS hop COLOCATE_POD_TLS goes first: OpenSSL reads it back from
            # /proc/self/environ, and a variable before it can hide it (podtls.environment).
            "env": podtls.environment(self.pod_tls, {"VLLM_API_KEY": token}) if spec.mtls else {"VLLM_API_KEY": token},
            "args": " ".join(spec.vllm_args()),
            "disk": spec.disk_gb,
        }
        try:
            reply = self.api.call("POST", "/v2/pods", json_body=body, create=True, ok=(200, 201))
        except FatalError as exc:
            if exc.status not in NEXT_CANDIDATE:
                raise  # 401, 402, 422: the same answer in every data centre
            detail = redact(_detail(exc), self.api.secrets)  # a detail may quote the request
            self._refused[(spec.name, location)] = (exc.status, detail, str(exc))
            if all((spec.name, loc) in self._refused for loc in spec.locations):
                raise self._refused_everywhere(spec, location) from None
            why = f"403 forbidden: {detail}" if exc.status == 403 else f"400 not placed: {detail}"
            raise CapacityError(f"{location}: {why}", [(location, spec.gpu, why)]) from None
        pod_id = str(reply.body["id"])
        placed = reply.body.get("dataCenterId")
        if placed not in spec.locations:
            # v2's dataCenterIds are "preferred data centers": a pod outside the region is deleted at
            # once and the walk moves on (never another region, whatever RunPod prefers).
            why = f"placed in {placed or 'no data centre'}, outside {spec.region} ({', '.join(spec.locations)})"
            try:
                self.destroy(pod_id)
                why += f"; pod {pod_id} was deleted"
            except ProviderError as exc:
                raise FatalError(f"runpod {why}, and deleting pod {pod_id} failed ({exc}): it may be billing. Run "
                                 f"`.venv/bin/python scripts/pod.py sweep --stack {spec.stack} --destroy`") from None
            raise CapacityError(f"{location}: {why}", [(location, spec.gpu, why)])
        cost = reply.body.get("cost")
        if isinstance(cost, int | float) and cost > spec.max_price_per_hr:
            # The billed rate can exceed the list price (disk, a price change since the look-up).
            try:
                self.destroy(pod_id)
                left = f"pod {pod_id} was deleted"
            except ProviderError as exc:
                left = (f"deleting pod {pod_id} failed ({exc}): it may be billing. Run `.venv/bin/python "
                        f"scripts/pod.py sweep --stack {spec.stack} --destroy`")
            raise OverPriceError(f"runpod created {spec.name} in {location} at ${cost}/h, above "
                                 f"colocate:pod.maxPricePerHr ${spec.max_price_per_hr}/h; {left}. {PRICE_FIX}")
        return pod_id

    def _refused_everywhere(self, spec, last: str) -> FatalError:
        """Every data centre refused: a FatalError (not "no capacity") that reads the last detail as the spec says."""
        answers = {loc: self._refused[(spec.name, loc)] for loc in spec.locations}
        rows = [(loc, spec.gpu, f"{status} {said}") for loc, (status, said, _) in answers.items()]
        statuses = {status for status, _, _ in answers.values()}
        _, detail, full = answers[last]
        floor = f", host CUDA >= {spec.min_cuda_version}" if spec.min_cuda_version else ""  # it narrows the pool
        what = f"{spec.gpu} x{spec.gpu_count} ({spec.cloud}{floor})"
        where = f"{spec.region} ({', '.join(spec.locations)})"
        if statuses == {403}:
            head = (f"runpod refused to create {what} with 403 Forbidden in every data centre of {where}; last detail ({last}): "
                    f"{detail!r}. The key in RUNPOD_API_KEY (pulumi config colocate:runpodApiKey) is valid but does not "
                    f"grant this: it lacks write access to pods, or the account cannot use this GPU pool. {KEY_FIX}; "
                    "if it already has that access, choose another colocate:pod.gpu or colocate:pod.cloud")
        else:
            # The spec: a broken rule fails identically on every candidate, so an all-400 walk is
            # read as a problem with the request rather than as absent capacity.
            head = (
                f"runpod could not place {what} in any data centre of {where}; last detail ({last}): {detail!r}. "
                "RunPod answers 400 "
                'both for "could not be placed here" and for a request that breaks a rule, which fails the same '
                "way everywhere: this may be a problem with the request (sent below), not capacity. Fix: if the "
                "detail names a field or rule, correct colocate:pod (gpu, gpuCount, cloud, diskGb, image, minCudaVersion); "
                "if it "
                "reads as capacity, retry later or choose another colocate:pod.gpu"
            )
            if 403 in statuses:
                head += f". Some data centres answered 403 (this key or account cannot use that pool). {KEY_FIX}"
        return FatalError(f"{head}. Nothing was created.\n{format_attempts(rows)}\nlast answer: {full}")

    def no_address_fix(self, spec) -> str | None:
        if spec.path == PATH_PROVIDER_PROXY:
            return None  # RunPod's proxy needs no public ip
        return ("RunPod gave the pod no public ip and port for its TCP port: a Community Cloud host may have "
                "none, and REST v2 cannot ask for one. Fix: pulumi config set --path colocate:pod.cloud SECURE, "
                "or remove colocate:zone (RunPod's proxy hostname needs no public ip)")

    def describe(self, pod_id: str) -> PodInfo:
        return self._info(self.api.call("GET", f"/v2/pods/{pod_id}").body, port=None)

    def destroy(self, pod_id: str) -> bool:
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
                       cost_per_hr=pod.get("cost"), gpu=(pod.get("gpu") or {}).get("id"), proxy_url=proxy,
                       market="ondemand")  # v2 rents no other kind (colocate/cell/market.py)


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
