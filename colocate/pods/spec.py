"""The create request: the JSON of ``colocate.cell.plan.PodPlan.spec()``, checked again at the edge.

The spec is re-checked against the catalogue so a hand-written or stale spec cannot
place a pod outside the cell's region: its provider must serve the region, and its
locations must be the catalogue's locations for that region (a subset, in catalogue order).
Also here: the vLLM serve arguments for the real pod (one place, used by both clouds).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cell import catalogue
from ..cell.catalogue import EXISTING
from ..cell.market import RUNPOD_HAS_NONE
from ..cell.plan import MAX_MODEL_LEN, POD_PATHS
from ..errors import ConfigError
from . import podtls
from .errors import PodConfigError

REQUIRED: dict[str, type | tuple[type, ...]] = {
    "name": str, "stack": str, "region": str, "generation": str, "provider": str, "locations": list,
    "gpu": str, "gpu_count": int, "image": str, "min_cuda_version": str, "model": str, "port": int, "disk_gb": int,
    "max_price_per_hr": (int, float), "cloud": str, "min_reliability": (int, float),
    "ready_timeout_s": (int, float), "compute_ms": (int, float), "index": int, "path": str, "tls_name": str,
    "profile": str}
# Keys a spec of an older kit may lack, with the value it meant.
OPTIONAL: dict[str, tuple[type | tuple[type, ...], object]] = {
    "max_model_len": (int, MAX_MODEL_LEN), "command": (str, ""), "url": (str, ""),
    "max_transfer_per_gb": ((int, float), 0.02), "market": (str, "ondemand"), "on_demand_fallback": (bool, False),
    "bid_per_hr": ((int, float), 0.3), "endpoint": ((dict, type(None)), None)}


@dataclass(frozen=True)
class PodSpec:
    name: str
    stack: str
    region: str
    generation: str
    provider: str
    locations: tuple[str, ...]
    gpu: str
    gpu_count: int
    image: str
    min_cuda_version: str  # the host's lowest CUDA, "major.minor"; "" = no floor
    model: str
    port: int
    disk_gb: int
    max_price_per_hr: float
    cloud: str
    min_reliability: float
    ready_timeout_s: float
    compute_ms: float
    index: int  # the pod's place in the cell (colocate:pod.count)
    path: str  # how the Worker reaches it (plan.POD_PATHS): RunPod exposes an HTTP port for its proxy
    tls_name: str  # the name on the pod's certificate when the hop is mutual TLS; "" = plain HTTP
    profile: str = "oracle"  # the local stand-in's GPU and model (colocate.pods.profiles); a GPU pod ignores it
    max_transfer_per_gb: float = 0.02  # Vast.ai: the most an offer may charge per GB down or up (settings' default)
    max_model_len: int = MAX_MODEL_LEN  # vLLM's --max-model-len (colocate:pod.maxModelLen)
    command: str = ""  # local: the sandbox's pod is this command (colocate:pod.command), not the stand-in
    url: str = ""  # local: where that command, or a server the user runs, serves (colocate:pod.url)
    # existing: {host, ip, port, location, cost_per_hr} (plan.PodPlan.endpoint_spec); None for a pod the kit rents
    endpoint: dict | None = None
    market: str = "ondemand"  # ondemand | interruptible (colocate/cell/market.py pod_market)
    on_demand_fallback: bool = False  # interruptible: rent on demand when no interruptible capacity is left (mix)
    bid_per_hr: float = 0.3  # interruptible: the bid, $/h (Vast.ai's create `price`)

    @property
    def interruptible(self) -> bool:
        return self.market == "interruptible"

    @property
    def mtls(self) -> bool:
        return bool(self.tls_name)

    @property
    def engine(self) -> bool:
        """Whether the local pod is a server of the user's (a command, or one already running) rather than the stand-in."""
        return bool(self.command or self.url)

    @classmethod
    def from_dict(cls, data: object) -> PodSpec:
        if not isinstance(data, dict):
            raise PodConfigError(f"spec: expected a JSON object (PodPlan.spec()), got {type(data).__name__}")
        for key, typ in REQUIRED.items():
            if key not in data:
                raise PodConfigError(f"spec.{key}: missing. Fix: pass the JSON of colocate.cell.plan.PodPlan.spec()")
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, typ):
                raise PodConfigError(f"spec.{key}: wrong type (got {value!r}). Fix: regenerate the spec from the plan")
        fields: dict[str, Any] = {k: (tuple(data[k]) if k == "locations" else data[k]) for k in REQUIRED}
        for key, (typ, default) in OPTIONAL.items():
            given: Any = data.get(key, default)
            if (isinstance(given, bool) and typ is not bool) or not isinstance(given, typ):
                raise PodConfigError(f"spec.{key}: wrong type (got {given!r}). Fix: regenerate the spec from the plan")
            fields[key] = given
        for key in ("max_transfer_per_gb", "bid_per_hr"):  # $ amounts: never negative
            amount = float(fields[key])
            if amount < 0:
                raise PodConfigError(f"spec.{key}: negative (got {amount!r}). Fix: regenerate the spec from the plan")
            fields[key] = amount
        fields["endpoint"] = _endpoint(fields["endpoint"])
        spec = cls(**fields)
        spec._check()
        return spec

    def _check(self) -> None:
        if not self.name.startswith(f"colocate-{self.stack}-"):
            raise PodConfigError(f"spec.name: {self.name!r} does not start with 'colocate-{self.stack}-'. "
                                 "Fix: use the name the plan derives (sweep finds pods by it)")
        try:
            allowed = catalogue.region(self.region, key="spec.region").locations(self.provider)
        except ConfigError as exc:
            raise PodConfigError(str(exc)) from None
        stray = [loc for loc in self.locations if loc not in allowed]
        if not self.locations or stray:
            raise PodConfigError(
                f"spec.locations: {list(self.locations)!r} must be a non-empty subset of {self.region}'s "
                f"{self.provider} locations {list(allowed)}. Fix: regenerate the spec; a pod never leaves its region")
        if self.path not in POD_PATHS:
            raise PodConfigError(
                f"spec.path: {self.path!r} is not one of {', '.join(POD_PATHS)}. Fix: regenerate the spec from the plan"
            )
        if not 0 < self.port < 65536:
            raise PodConfigError(f"spec.port: {self.port} is not a TCP port. Fix: colocate:pod.port 1-65535")
        if self.min_cuda_version and not re.fullmatch(r"[0-9]+\.[0-9]+", self.min_cuda_version):
            raise PodConfigError(f"spec.min_cuda_version: {self.min_cuda_version!r} is not major.minor (e.g. \"12.8\"). "
                                 "Fix: colocate:pod.minCudaVersion, then regenerate the spec from the plan")
        if self.ready_timeout_s <= 0:
            raise PodConfigError(f"spec.ready_timeout_s: {self.ready_timeout_s} must be > 0")
        if self.max_model_len < 1:
            raise PodConfigError(f"spec.max_model_len: {self.max_model_len} must be > 0. Fix: colocate:pod.maxModelLen")
        if self.market not in ("ondemand", "interruptible"):
            raise PodConfigError(f"spec.market: {self.market!r} is not ondemand or interruptible. Fix: regenerate the spec "
                                 "from the plan (colocate/cell/market.py pod_market)")
        if self.interruptible and self.provider == "runpod":
            raise PodConfigError(f"spec.market: interruptible on runpod: {RUNPOD_HAS_NONE}. Fix: pulumi config set --path "
                                 "colocate:pod.market ondemand, or colocate:pod.provider vastai")
        if self.interruptible and not 0 < self.bid_per_hr <= self.max_price_per_hr:
            raise PodConfigError(f"spec.bid_per_hr: {self.bid_per_hr} must be above 0 and at most max_price_per_hr "
                                 f"({self.max_price_per_hr}). Fix: colocate:pod.bidPerHr")
        if (self.endpoint is not None) != (self.provider == EXISTING):
            raise PodConfigError(f"spec.endpoint: {'missing' if self.endpoint is None else 'set'} for provider "
                                 f"{self.provider}. Fix: regenerate the spec from the plan")
        if self.endpoint is not None and (list(self.locations) != [self.endpoint["location"]]
                                          or self.port != self.endpoint["port"]):
            raise PodConfigError(f"spec.endpoint: {self.endpoint!r} disagrees with the spec's locations and port. "
                                 "Fix: regenerate the spec from the plan")
        if self.engine and self.provider != "local":
            raise PodConfigError(f"spec.command/url: a server of the user's is a sandbox pod, not a {self.provider} one. "
                                 "Fix: regenerate the spec from the plan")

    def vllm_args(self) -> list[str]:
        """Arguments for vLLM's OpenAI-compatible server (the image's entrypoint): the model, positionally
        (vLLM's ``--model`` is deprecated), then ``serve_args``."""
        return [self.model, *self.serve_args("0.0.0.0", self.port)]

    def serve_args(self, host: str, port: int) -> list[str]:
        """Everything after the model: how the kit's pod serves it, on ``host``:``port``.

        The token is not here: it travels as the env variable ``VLLM_API_KEY``, which vLLM
        treats exactly like ``--api-key`` and which keeps it out of the container's argv.
        On a mutual-TLS hop vLLM serves TLS from ``COLOCATE_POD_TLS`` and refuses a caller
        without a client certificate of the cell's CA (``podtls``). Its API docs are off on every hop.
        """
        args = ["--quantization", "gptq_marlin", "--host", host, "--port", str(port),
                "--served-model-name", self.model, "--max-model-len", str(self.max_model_len),
                "--gpu-memory-utilization", "0.90"]
        # The API docs (/docs, /redoc, /openapi.json) are nobody's job on any hop.
        args.append("--disable-fastapi-docs")
        if self.mtls:
            args += podtls.vllm_args()
        return args


ENDPOINT_FIELDS: dict[str, type | tuple[type, ...]] = {"host": str, "ip": str, "port": int, "location": str,
                                                       "cost_per_hr": (int, float)}


def _endpoint(value: object) -> dict | None:
    """``spec.endpoint``: what the plan says of an existing endpoint (its host the name the Worker fetches)."""
    if value is None:
        return None
    fields: dict[str, Any] = dict(value) if isinstance(value, dict) else {}
    ok = set(fields) == set(ENDPOINT_FIELDS) and all(
        isinstance(fields[k], t) and not isinstance(fields[k], bool) for k, t in ENDPOINT_FIELDS.items())
    if not ok or not fields["host"] or ":" in fields["host"] or not 0 < fields["port"] < 65536:
        raise PodConfigError(f"spec.endpoint: {value!r} is not {{host, ip, port, location, cost_per_hr}}. "
                             "Fix: regenerate the spec from the plan")
    return fields


def load(source: str) -> PodSpec:
    """Read a spec from a file path or ``-`` (stdin)."""
    return load_with(source)[0]


def load_with(source: str, extra: str | None = None) -> tuple[PodSpec, object]:
    """A spec, and the value of its key ``extra`` (``wait``'s ``rented``: the rent's output), from a file or ``-``."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise PodConfigError(f"--spec {source}: cannot read ({exc.strerror}). Fix: give a readable file or - for stdin") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise PodConfigError(f"--spec {source}: not JSON ({exc}). Fix: pass the JSON of PodPlan.spec()") from None
    if extra is None:
        return PodSpec.from_dict(data), None
    if not isinstance(data, dict) or not isinstance(data.get(extra), dict):
        raise PodConfigError(f"--spec {source}: spec.{extra} is missing or not a JSON object. "
                             f"Fix: pass the spec with \"{extra}\" set to the JSON `pod.py rent` printed")
    return PodSpec.from_dict(data), data[extra]
