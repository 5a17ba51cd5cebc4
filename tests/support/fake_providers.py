"""Fake RunPod v2 and Vast.ai APIs on loopback (port 0) that hold requests to the vendors' specs.

Every request is validated with openapi-core against tests/fixtures/specs/runpod-v2-openapi.json
or vastai-openapi.yaml (path, method, query, auth and body), and every answer is validated
against the same operation's response schema before it is sent. Anything that does not
match is recorded in ``violations`` and answered 599; the ``fake_*`` fixtures fail the test
if ``violations`` is not empty at the end, so a drifting client fails loudly.

Spec errata (where the published spec disagrees with the live API, seen in its answers):
* Vast.ai paths are served with a trailing slash (``/api/v0/bundles/``); the spec lists
  them without one. One trailing slash is removed before matching.
* Vast.ai ``Instance.ports`` is an object ``{"8000/tcp": [{"HostPort": "41234"}]}`` in the
  live API (the spec says an array of integers); the schema is widened to accept it.
* Vast.ai's create request (``PUT /api/v0/asks/{id}/``) takes ``env`` as a JSON object
  ``{"VAR": "val", "-p 8000:8000": "1"}`` (docs.vast.ai, "Creating instances with the API";
  the ``vastai`` CLI sends ``parse_env``'s dict); the spec says a string of Docker flags. The
  schema is widened to accept both.

Each created pod is backed by a real stand-in server, so readiness is a real HTTP check.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from colocate.pods import podtls, standin

# openapi_core (~0.5 s of CPU to import) is imported where a fake API validates, not at import:
# every xdist worker imports this module while collecting, few of them run a provider test.
if TYPE_CHECKING:
    from openapi_core import OpenAPI

SPECS = Path(__file__).resolve().parents[1] / "fixtures" / "specs"
API_KEY = "test-provider-key-0123456789"
CAPACITY_DETAIL = ("There are no longer any instances available with the requested specifications. "
                   "Please refresh and try again.")


def _openapi(spec: dict) -> OpenAPI:
    from openapi_core import Config, OpenAPI

    config = Config(spec_validator_cls=None,
                    extra_media_type_deserializers={"application/problem+json": json.loads})
    return OpenAPI.from_dict(spec, config=config)


_SPEC_CACHE: dict[str, OpenAPI] = {}
_SPEC_LOCK = threading.Lock()


def runpod_openapi() -> OpenAPI:
    with _SPEC_LOCK:
        if "runpod" not in _SPEC_CACHE:
            _SPEC_CACHE["runpod"] = _openapi(json.loads((SPECS / "runpod-v2-openapi.json").read_text()))
        return _SPEC_CACHE["runpod"]


def vastai_openapi() -> OpenAPI:
    with _SPEC_LOCK:
        if "vastai" not in _SPEC_CACHE:
            # PyYAML's libyaml loader (PyYAML comes with pulumi): 0.08 s against ruamel's 1.1 s in
            # pure Python, in every worker; the two read this spec to the same dict.
            loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
            spec = yaml.load((SPECS / "vastai-openapi.yaml").read_text(), Loader=loader)
            spec["components"]["schemas"]["Instance"]["properties"]["ports"] = {"type": ["array", "object"]}  # erratum
            create = spec["paths"]["/api/v0/asks/{id}"]["put"]["requestBody"]["content"]["application/json"]["schema"]
            create["properties"]["env"] = {"type": ["string", "object"], "additionalProperties": {"type": "string"}}  # erratum
            _SPEC_CACHE["vastai"] = _openapi(spec)
        return _SPEC_CACHE["vastai"]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_UNSERVABLE = object()


class FakeApi(ThreadingHTTPServer):
    """Base: spec validation, auth, scripted 429s, a log of requests; subclasses implement ``route``."""

    daemon_threads = True
    server_url = ""
    strip_trailing_slash = False

    def __init__(self, openapi: OpenAPI, pod_token: str = "pod-token"):
        self.openapi = openapi
        self.pod_token = pod_token
        self.violations: list[str] = []
        self.log: list[tuple[str, str, object]] = []
        self.lock = threading.RLock()
        self.rate_limits: list[tuple[str, str, int, str]] = []  # (method, path prefix, count, retry-after)
        self.rate_limited_at: list[float] = []
        self.backends = contextlib.ExitStack()
        self.standins: dict[str, contextlib.ExitStack] = {}
        self.pod_errors: list[str] = []  # pods whose TLS material did not load (the pod's own log)
        # Variables the platform puts in a pod's environment ahead of the request's (RunPod's own
        # order is not documented): a test sets them to show what a hidden bundle does.
        self.platform_env: dict[str, str] = {}
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> FakeApi:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=10)
        for stack in list(self.standins.values()):
            stack.close()
        self.standins.clear()

    def rate_limit(self, method: str, prefix: str, count: int, retry_after: str = "1") -> None:
        self.rate_limits.append((method, prefix, count, retry_after))

    def calls(self, method: str, prefix: str) -> list:
        return [b for m, p, b in self.log if m == method and p.startswith(prefix)]

    # -- backends: one real stand-in per pod ---------------------------------
    def start_backend(self, pod_id: str, env: dict | None = None, args: str = "") -> standin.StandinServer:
        """The pod's stand-in. With ``env`` (the create request's environment, in its order) it
        serves mutual TLS as vLLM would: from COLOCATE_POD_TLS read back through a copy of the
        environment laid out as /proc/self/environ is (NUL-separated ``K=V``, in order), so a
        request whose variables hide the bundle from OpenSSL brings up a pod that never serves. Without
        vLLM's TLS flags in ``args`` the pod serves plain HTTP, as vLLM would."""
        stack = contextlib.ExitStack()
        tls = None
        if env and podtls.ENV in env and " ".join(podtls.vllm_args()) in args:
            d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fake-pod-")))
            environ = d / "environ"
            environ.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
            try:
                tls = podtls.server_context(str(environ))
            except podtls.PodTlsError as exc:
                self.pod_errors.append(f"{pod_id}: {exc}")
                tls = _UNSERVABLE  # vLLM exits at start; the port never answers
        server = stack.enter_context(standin.serve(compute_ms=1, token=self.pod_token, name=pod_id,
                                                   tls=None if tls is _UNSERVABLE else tls))
        if tls is _UNSERVABLE:
            server.set_fault("error")
        self.standins[pod_id] = stack
        return server

    def stop_backend(self, pod_id: str) -> None:
        stack = self.standins.pop(pod_id, None)
        if stack:
            stack.close()

    # -- validation ----------------------------------------------------------
    def handle_call(self, method: str, raw_path: str, headers: dict, body: bytes):
        parts = urlsplit(raw_path)
        path = parts.path
        if self.strip_trailing_slash and path.endswith("/") and len(path) > 1:
            path = path[:-1]
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        from openapi_core.testing import MockRequest

        req = MockRequest(self.server_url, method.lower(), path, args=query, headers=headers,
                          data=body or None, content_type=headers.get("Content-Type", "application/json"))
        try:
            self.openapi.validate_request(req)
        except Exception as exc:  # noqa: BLE001 - any mismatch is a test failure, recorded with its cause
            cause = exc.__cause__ or exc
            self.violations.append(f"REQUEST {method} {raw_path}: {type(exc).__name__}: {cause} body={body[:300]!r}")
            return 599, {"violation": str(exc)}, {}, "application/json", None
        if headers.get("Authorization") != f"Bearer {API_KEY}":
            status, payload, extra, ctype = self.unauthorized()
            return self._check(req, status, payload, extra, ctype)
        parsed = json.loads(body) if body else None
        with self.lock:
            self.log.append((method, path, parsed))
            for i, (m, prefix, count, after) in enumerate(self.rate_limits):
                if m == method and path.startswith(prefix) and count > 0:
                    self.rate_limits[i] = (m, prefix, count - 1, after)
                    self.rate_limited_at.append(time.monotonic())
                    status, payload, extra, ctype = self.too_many(after)
                    return self._check(req, status, payload, extra, ctype)
            status, payload, extra, ctype = self.route(method, path, query, parsed)
        return self._check(req, status, payload, extra, ctype)

    def _check(self, req, status, payload, extra, ctype):
        from openapi_core.testing import MockResponse

        data = b"" if payload is None else json.dumps(payload).encode()
        try:
            self.openapi.validate_response(req, MockResponse(data, status, headers=extra, content_type=ctype))
        except Exception as exc:  # noqa: BLE001
            cause = exc.__cause__ or exc
            self.violations.append(f"RESPONSE {req.method} {req.path} {status}: {type(exc).__name__}: {cause}")
        return status, payload, extra, ctype, data

    def route(self, method, path, query, body):
        raise NotImplementedError

    def unauthorized(self):
        raise NotImplementedError

    def too_many(self, retry_after: str):
        raise NotImplementedError


class _FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeApi

    def log_message(self, format, *args):  # noqa: A002
        pass

    def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        status, payload, extra, ctype, data = self.server.handle_call(self.command, self.path, dict(self.headers), body)
        if data is None:
            data = json.dumps(payload).encode()
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        if data:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any  # noqa: N815


# ---------------------------------------------------------------------------- RunPod
class FakeRunPod(FakeApi):
    server_url = "https://api.runpod.io"

    def __init__(self, pod_token: str = "pod-token"):
        super().__init__(runpod_openapi(), pod_token)
        self.capacity: dict[str, bool] = {}  # data centre -> has capacity (default True)
        self.refusals: dict[str, tuple[int, str]] = {}  # data centre -> (status, detail) every create there answers
        # data centre asked -> where RunPod puts the pod: dataCenterIds are "preferred data centers" (v2)
        self.placed_in: dict[str, str] = {}
        self.ready_after = 1  # GETs of a pod before it is RUNNING
        self.healthy = True  # whether the pod's server answers /health 200
        self.public_ip = True  # False: a running pod gets no public ip and port (a Community host without one)
        self.lost_create_replies = 0  # the next k creates land but answer 503 (a reply lost on the way)
        self.on_create = None  # called with the pod's id once a create has landed, before it is answered
        # The catalogue's list price per GPU and cloud ($/h); a pod is billed that times its count, plus
        # extra_cost (what the list does not show: disk, a price changed since the look-up).
        self.gpu_prices: dict[str, dict[str, float]] = {"NVIDIA GeForce RTX 4090": {"secure": 0.69, "community": 0.34}}
        self.extra_cost = 0.0
        self.pods: dict[str, dict] = {}
        self.polls: dict[str, int] = {}
        self.ids = (f"fakepod{n:04d}" for n in itertools.count(1))
        self.proxy_ports: dict[str, int] = {}  # pod id -> its backend's port, for the proxy below

    @property
    def proxy_template(self) -> str:
        """RUNPOD_PROXY_TEMPLATE for tests: this server plays RunPod's HTTP proxy at /proxy/<id>-<port>."""
        return self.url + "/proxy/{pod_id}-{port}"

    def handle_call(self, method: str, raw_path: str, headers: dict, body: bytes):
        if raw_path.startswith("/proxy/"):
            return self._proxy(method, raw_path, headers, body)
        return super().handle_call(method, raw_path, headers, body)

    def _proxy(self, method: str, raw_path: str, headers: dict, body: bytes):
        target, _, rest = raw_path[len("/proxy/"):].partition("/")
        pod_id = target.rsplit("-", 1)[0]
        port = self.proxy_ports.get(pod_id)
        pod = self.pods.get(pod_id)
        if port is None or pod is None or pod["status"] != "RUNNING" or not pod["ports"][0].endswith("/http"):
            return 502, {"error": "no such pod behind the proxy"}, {}, "application/json", None
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            fwd = {k: v for k, v in headers.items() if k.lower() in ("authorization", "content-type")}
            conn.request(method, "/" + rest, body=body or None, headers=fwd)
            res = conn.getresponse()
            return res.status, None, {}, res.getheader("content-type") or "application/json", res.read()
        finally:
            conn.close()

    def live(self) -> list[dict]:
        with self.lock:
            return [p for p in self.pods.values() if p["status"] != "TERMINATED"]

    def _problem(self, status: int, title: str, detail: str, extra=None):
        return status, {"title": title, "status": status, "detail": detail}, extra or {}, "application/problem+json"

    def unauthorized(self):
        return self._problem(401, "Unauthorized", "invalid bearer token")

    def too_many(self, retry_after):
        return self._problem(429, "Too Many Requests", "rate limit exceeded for the minute window",
                             {"Retry-After": retry_after})

    def route(self, method, path, query, body):
        if path == "/v2/pods" and method == "GET":
            return 200, {"pods": [self._view(p) for p in self.live()]}, {}, "application/json"
        if path.startswith("/v2/catalog/gpus/") and method == "GET":
            gpu_id = unquote(path[len("/v2/catalog/gpus/"):])
            price = self.gpu_prices.get(gpu_id, {"secure": 0.69, "community": 0.34})
            return 200, {"id": gpu_id, "name": gpu_id.removeprefix("NVIDIA GeForce "), "pool": None,
                         "manufacturer": "NVIDIA", "memory": 24, "secure": True, "community": True,
                         "price": dict(price), "maxCount": {"secure": 8, "community": 4}}, {}, "application/json"
        if path == "/v2/pods" and method == "POST":
            dc = (body.get("dataCenterIds") or ["?"])[0]
            if dc in self.refusals:
                status, detail = self.refusals[dc]
                return self._problem(status, {400: "Bad Request", 403: "Forbidden"}.get(status, "Error"), detail)
            if not self.capacity.get(dc, True):
                return self._problem(400, "Bad Request", CAPACITY_DETAIL)
            pod_id = next(self.ids)
            self.pods[pod_id] = {
                "id": pod_id, "name": body["name"], "status": "PROVISIONING", "actions": ["terminate"],
                "image": body["image"], "args": body.get("args", ""), "disk": body.get("disk", 20),
                "mounts": {}, "ports": body.get("ports", []), "env": body.get("env", {}), "registry": None,
                "gpu": {"id": body["gpu"]["id"], "count": body["gpu"].get("count", 1)},
                "cloud": body.get("cloud", "SECURE"), "dataCenterId": self.placed_in.get(dc, dc), "cudaVersion": "12.9",
                "ssh": {"proxy": None, "direct": None}, "template": None, "locked": False,
                "cost": round(self.gpu_prices.get(body["gpu"]["id"], {"secure": 0.69, "community": 0.34})[
                    body.get("cloud", "SECURE").lower()] * body["gpu"].get("count", 1) + self.extra_cost, 4),
                "globalNetworking": {"enabled": False}, "runtime": None, "createdAt": _now(), "startedAt": None,
            }
            self.polls[pod_id] = 0
            if self.on_create is not None:
                self.on_create(pod_id)
            if self.lost_create_replies > 0:
                self.lost_create_replies -= 1
                return self._problem(503, "Service Unavailable", "upstream timeout")
            return 201, self._view(self.pods[pod_id]), {}, "application/json"
        if path.startswith("/v2/pods/"):
            pod_id = path.split("/")[3]
            pod = self.pods.get(pod_id)
            if pod is None or pod["status"] == "TERMINATED":
                return self._problem(404, "Not Found", "pod not found")
            if method == "GET":
                self.polls[pod_id] += 1
                if pod["status"] == "PROVISIONING" and self.polls[pod_id] >= self.ready_after:
                    env = {**self.platform_env, **pod["env"]} if isinstance(pod["env"], dict) else None
                    server = self.start_backend(pod_id, env, pod["args"])
                    if not self.healthy:
                        server.set_fault("error")
                    private = int(pod["ports"][0].split("/")[0]) if pod["ports"] else 8000
                    http = bool(pod["ports"]) and pod["ports"][0].endswith("/http")
                    # An HTTP port is served by RunPod's proxy (tests point RUNPOD_PROXY_TEMPLATE at
                    # proxy_template below); a TCP port gets a public ip and mapped port.
                    self.proxy_ports[pod_id] = server.port
                    pod.update(status="RUNNING", startedAt=_now(), actions=["stop", "restart", "terminate"],
                               runtime={"uptime": 1, "ports": [] if http or not self.public_ip else [
                                   {"private": private, "public": server.port, "type": "tcp", "ip": "127.0.0.1"}]})
                return 200, self._view(pod), {}, "application/json"
            if method == "DELETE":
                pod.update(status="TERMINATED", cost=0.0, runtime=None)
                self.stop_backend(pod_id)
                return 204, None, {}, "application/json"
        return self._problem(404, "Not Found", f"no fake route {method} {path}")

    @staticmethod
    def _view(pod: dict) -> dict:
        return json.loads(json.dumps(pod))

    # -- what happens to a pod after deploy (the keeper's cases) ----------------
    def set_status(self, pod_id: str, status: str) -> None:
        """The pod goes EXITED (its container stopped) or ERROR, as v2's PodStatus enum lists them;
        its server stops answering."""
        with self.lock:
            self.pods[pod_id].update(status=status, runtime=None)
            self.stop_backend(pod_id)

    def reset(self, pod_id: str) -> int:
        """A host reset: the pod comes back RUNNING with its TCP port mapped anew (a new public port,
        as ``runtime.ports`` then reports). Returns the new public port."""
        with self.lock:
            pod = self.pods[pod_id]
            self.stop_backend(pod_id)
            env = {**self.platform_env, **pod["env"]} if isinstance(pod["env"], dict) else None
            server = self.start_backend(pod_id, env, pod["args"])
            self.proxy_ports[pod_id] = server.port
            private = int(pod["ports"][0].split("/")[0]) if pod["ports"] else 8000
            pod["runtime"] = {"uptime": 1, "ports": [{"private": private, "public": server.port, "type": "tcp",
                                                      "ip": "127.0.0.1"}]}
            return server.port

    def move(self, pod_id: str, data_center: str) -> None:
        """The pod reported in another data centre (``dataCenterId``)."""
        with self.lock:
            self.pods[pod_id]["dataCenterId"] = data_center


# ---------------------------------------------------------------------------- Vast.ai
# The search schema's allocated_storage: "Default is 8GB". Vast.ai bills disk as storage_cost
# ($/GB/month) over a 30-day month, which dph_total includes for the searched disk size.
DEFAULT_ALLOCATED_GB = 8
HOURS_PER_MONTH = 30 * 24


def offer(offer_id: int, country: str, price: float, gpu: str = "RTX 4090", reliability: float = 0.995,
          direct_ports: int = 10, city: str = "Taipei", cuda: float = 12.9, disk_space: float = 500.0,
          storage_cost: float = 0.0, datacenter: bool = True, static_ip: bool = True, inet_cost: float = 0.005,
          min_bid: float | None = None, machine: int | None = None) -> dict:
    """An offer; ``price`` is its $/h without disk (``dph_base``), so with the default storage_cost of 0
    its dph_total is ``price`` at any disk size. ``min_bid``: the least an interruptible rent may bid
    (default: the spec's example ratio, 0.111111 of 0.234567); ``machine``: its host (default its own)."""
    return {"id": offer_id, "ask_contract_id": offer_id, "gpu_name": gpu, "num_gpus": 1, "geolocation": f"{city}, {country}",
            "min_bid": round(price * 0.111111 / 0.234567, 6) if min_bid is None else min_bid, "is_bid": False,
            "dph_base": price, "storage_cost": storage_cost, "dph_total": _dph(price, storage_cost, DEFAULT_ALLOCATED_GB),
            "reliability": reliability, "direct_port_count": direct_ports, "rentable": True, "verified": True,
            "verification": "verified", "public_ipaddr": "127.0.0.1",
            "machine_id": offer_id * 10 if machine is None else machine,
            "cuda_max_good": cuda, "disk_space": disk_space, "datacenter": datacenter, "static_ip": static_ip,
            "inet_down_cost": inet_cost, "inet_up_cost": inet_cost}


def _dph(base: float, storage_cost: float, disk_gb: float) -> float:
    return base + round(storage_cost * disk_gb / HOURS_PER_MONTH, 6) if storage_cost else base


def _priced(o: dict, disk_gb: float) -> dict:
    """The offer as quoted for a disk of ``disk_gb``: dph_total includes that disk's storage."""
    return {**o, "dph_total": _dph(o["dph_base"], o["storage_cost"], disk_gb)} if "dph_base" in o else o


class FakeVast(FakeApi):
    server_url = "https://console.vast.ai"
    strip_trailing_slash = True

    def __init__(self, pod_token: str = "pod-token"):
        super().__init__(vastai_openapi(), pod_token)
        self.offers: list[dict] = []
        # Search filters this fake leaves unapplied (it answers offers they would drop), so a
        # test can show the client re-checks what the server sends.
        self.ignored_filters: set[str] = set()
        self.taken: set[int] = set()  # offers that vanish between search and rent (404 no_such_ask)
        self.rent_refusals: dict[int, tuple[int, dict]] = {}  # offer id -> (status, body) its rent answers
        self.ready_after = 1
        self.dies_after: int | None = None  # actual_status becomes "exited" after this many GETs
        self.on_create = None  # called with the instance's id once a rent has landed, before it is answered
        self.instances: dict[int, dict] = {}
        self.polls: dict[int, int] = {}
        self.ids = itertools.count(700001)

    def live(self) -> list[dict]:
        with self.lock:
            return [i for i in self.instances.values() if not i.get("_destroyed")]

    def unauthorized(self):
        return 401, {"success": False, "error": "auth_error", "msg": "Invalid user key"}, {}, "application/json"

    def too_many(self, retry_after):
        return (
            429,
            {"detail": "API requests too frequent endpoint threshold=2.0"},
            {"Retry-After": retry_after},
            "application/json",
        )

    def route(self, method, path, query, body):
        if path == "/api/v0/bundles" and method == "POST":
            disk = body.get("allocated_storage", DEFAULT_ALLOCATED_GB)
            honoured = {k: v for k, v in body.items() if k not in self.ignored_filters}
            priced = [_priced(o, disk) for o in self.offers]
            return 200, {"offers": [o for o in priced if _matches(o, honoured)]}, {}, "application/json"
        if path.startswith("/api/v0/asks/") and method == "PUT":
            ask = int(path.rsplit("/", 1)[1])
            if ask in self.rent_refusals:
                status, payload = self.rent_refusals[ask]
                return status, payload, {}, "application/json"
            if ask in self.taken or not any(o["id"] == ask for o in self.offers):
                return (
                    404,
                    {
                        "success": False,
                        "error": "invalid_args",
                        "ask_id": ask,
                        "msg": f"error 404/3603: no_such_ask Instance type by id {ask} is not available.",
                    },
                    {},
                    "application/json",
                )
            o = _priced(next(o for o in self.offers if o["id"] == ask), body.get("disk", DEFAULT_ALLOCATED_GB))
            bid = body.get("price")
            if bid is not None and bid < o["min_bid"]:  # the host runs the higher bidder: this one never would
                return 400, {"success": False, "error": "invalid_args",
                             "msg": f"bid {bid} is below the machine's min_bid {o['min_bid']}"}, {}, "application/json"
            iid = next(self.ids)
            self.instances[iid] = {"id": iid, "label": body.get("label"), "actual_status": "loading",
                                   "intended_status": "running", "cur_state": "running", "next_state": "running",
                                   "gpu_name": o["gpu_name"], "num_gpus": 1, "geolocation": o["geolocation"],
                                   "dph_total": o["dph_total"] if bid is None else bid, "machine_id": o["machine_id"],
                                   "is_bid": bid is not None, "min_bid": o["min_bid"],
                                   "public_ipaddr": "127.0.0.1", "ports": {}, "_env": body.get("env", ""),
                                   "_args": body.get("args") or []}
            self.polls[iid] = 0
            self.taken.add(ask)
            if self.on_create is not None:
                self.on_create(str(iid))
            return 200, {"success": True, "new_contract": iid}, {}, "application/json"
        if path.startswith("/api/v0/instances/"):
            iid = int(path.rsplit("/", 1)[1])
            inst = self.instances.get(iid)
            if method == "DELETE":
                if inst is None or inst.get("_destroyed"):
                    return 404, {"success": False, "error": "not_found", "msg": "Instance not found"}, {}, "application/json"
                inst["_destroyed"] = True
                self.stop_backend(str(iid))
                return 200, {"success": True}, {}, "application/json"
            if method == "GET":
                if inst is None or inst.get("_destroyed"):
                    return (
                        400,
                        {"success": False, "error": "no_such_instance", "msg": "Instance not found"},
                        {},
                        "application/json",
                    )
                self.polls[iid] += 1
                n = self.polls[iid]
                if self.dies_after is not None and n >= self.dies_after:
                    inst["actual_status"] = "exited"
                elif inst["actual_status"] == "loading" and n >= self.ready_after:
                    # Docker puts the request's variables first, in their order (the image's after them).
                    env = {**self.platform_env, **inst["_env"]} if isinstance(inst["_env"], dict) else None
                    args = inst["_args"]
                    server = self.start_backend(str(iid), env, " ".join(args) if isinstance(args, list) else str(args))
                    inst.update(
                        actual_status="running", ports={"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(server.port)}]}
                    )
                return 200, {"instances": _public(inst)}, {}, "application/json"
        if path == "/api/v1/instances" and method == "GET":
            return (
                200,
                {
                    "success": True,
                    "instances_found": len(self.live()),
                    "next_token": None,
                    # select_cols' default is ["*"], every column (the spec's listInstances)
                    "instances": [_public(i) for i in self.live()],
                },
                {},
                "application/json",
            )
        return 404, {"success": False, "error": "not_found", "msg": f"no fake route {method} {path}"}, {}, "application/json"


    # -- what happens to an instance after deploy (the keeper's cases) ----------
    def set_status(self, iid: str | int, status: str) -> None:
        """``actual_status`` becomes exited, offline or unknown (the host went away); nothing answers."""
        with self.lock:
            self.instances[int(iid)]["actual_status"] = status
            self.stop_backend(str(iid))

    def outbid(self, iid: str | int) -> None:
        """A higher bid takes the interruptible instance's host: it is stopped, its processes killed (Vast.ai's
        rental-types FAQ), while the renter still means it to run (intended_status running)."""
        with self.lock:
            inst = self.instances[int(iid)]
            assert inst["is_bid"], "only an interruptible instance is outbid"
            inst["actual_status"] = "stopped"
            self.stop_backend(str(iid))

    def readdress(self, iid: str | int) -> int:
        """The instance running again at another address (its port mapped anew). Returns the new port."""
        with self.lock:
            inst = self.instances[int(iid)]
            self.stop_backend(str(iid))
            env = {**self.platform_env, **inst["_env"]} if isinstance(inst["_env"], dict) else None
            args = inst["_args"]
            server = self.start_backend(str(iid), env, " ".join(args) if isinstance(args, list) else str(args))
            inst.update(actual_status="running", ports={"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(server.port)}]})
            return server.port


def _public(inst: dict) -> dict:
    return {k: v for k, v in inst.items() if not k.startswith("_")}


def _matches(o: dict, query: dict) -> bool:
    for field, cond in query.items():
        if not isinstance(cond, dict):
            continue
        value = o.get(field)
        if field == "geolocation":
            value = (value or "").rsplit(",", 1)[-1].strip()
        for op, arg in cond.items():
            if not _OPS[op](value, arg):
                return False
    return True


_OPS = {
    "eq": lambda v, a: v == a, "neq": lambda v, a: v != a, "in": lambda v, a: v in a, "notin": lambda v, a: v not in a,
    "gte": lambda v, a: v is not None and v >= a, "lte": lambda v, a: v is not None and v <= a,
    "gt": lambda v, a: v is not None and v > a, "lt": lambda v, a: v is not None and v < a,
}
