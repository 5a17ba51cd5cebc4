"""Fixtures for the Worker tests: a cell (stand-in pod + stand-in fallback + workerd)
configured from the sandbox stack's plan, and a small HTTP client.

The plan comes from ``stacks/Pulumi.sandbox.yaml`` through ``colocate.cell.settings.parse``
and ``colocate.cell.plan.plan_cell``, as the Pulumi program builds it; only runtime numbers
(``colocate:worker``) and the generation ledger are overridden in the raw config.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from colocate import stackfile
from colocate.cell import plan as plan_mod, settings as settings_mod
from colocate.pods import standin
from colocate.workerd import Workerd, render_config

# Distinct, greppable secret values: no log line or response may contain them.
SECRETS = {
    "POD_TOKEN": "pod-token-7f3a9c1e55d2",
    "FALLBACK_API_KEY": "fallback-key-b81d4e0f9a63",
    "PROBE_TOKEN": "probe-token-2c6e8d4b7a19",
}
SECRET_SETTINGS = frozenset({"podToken", "probeToken", "fallbackUrl", "fallbackApiKey"})
# A cell with one credential per operator role (running_cell(split_tokens=True)), by settings key.
OPERATOR_TOKENS = {"readToken": "read-token-5b1e93c07d24", "adminToken": "admin-token-e4a8260f1c37",
                   "exchangeToken": "exchange-token-91d3c5a7e802"}
ROOT = Path(__file__).resolve().parent.parent.parent
FALLBACK_MODEL_NAME = "sandbox/fallback"  # the sandbox stack's colocate:fallbackModel (colocate/sandbox/runner.py)


def cell_plan(worker: dict | None = None, generations: list[dict] | None = None, stack: str = "sandbox",
              split_tokens: bool = False, **raw_overrides):
    """The sandbox stack's cell plan with runtime numbers, the ledger, or other raw
    ``colocate:*`` values (e.g. ``fallbackModel``) overridden before parsing."""
    raw, secrets = stackfile.read_config(stack)
    raw.update(raw_overrides)
    if worker:
        raw["worker"] = {**(raw.get("worker") or {}), **worker}
    if generations is not None:
        raw["generations"] = generations
    names = set(secrets) | SECRET_SETTINGS
    if split_tokens:  # the three operator credentials, and no old single token
        names = (names | set(OPERATOR_TOKENS)) - {"probeToken"}
    settings = settings_mod.parse(raw, stack, secrets=names)
    return plan_mod.plan_cell(settings)


def legacy_plan(worker_dir: Path, worker: dict | None = None):
    """The sandbox plan run on an earlier Worker's modules (``worker_dir``, from git), with the
    single operator credential those read (PROBE_TOKEN) bound beside the per-role ones."""
    import dataclasses

    raw, secrets = stackfile.read_config("sandbox")
    raw["worker"] = {**(raw.get("worker") or {}), **(worker or {})}
    settings = settings_mod.parse(raw, "sandbox", secrets=set(secrets) | SECRET_SETTINGS)
    plan = plan_mod.plan_cell(settings, worker_dir=worker_dir)
    bindings = (*plan.worker.bindings, plan_mod.Binding("PROBE_TOKEN", "secret_text", secret="probeToken"))
    return dataclasses.replace(plan, worker=dataclasses.replace(plan.worker, bindings=bindings))


def values_for(pod_url: str | list[str], fallback_url: str) -> dict[str, str]:
    # FALLBACK_URL is a secret too: it is keyed by its settings name here, to exercise both lookups.
    urls = [pod_url] if isinstance(pod_url, str) else pod_url
    # The sandbox stack sets only the old probeToken: the plan binds it for every operator role.
    return {"POD_URLS": plan_mod.pod_urls_text(urls), "fallbackUrl": fallback_url, "probeToken": SECRETS["PROBE_TOKEN"],
            **OPERATOR_TOKENS, **SECRETS}


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    def timing(self) -> dict[str, float]:
        out = {}
        for part in self.headers.get("server-timing", "").split(","):
            name, *params = [p.strip() for p in part.strip().split(";")]
            if name:  # params besides dur (the front door's desc="NRT") are not durations
                out[name] = next((float(p[4:]) for p in params if p.startswith("dur=")), 0.0)
        return out


def request(url: str, method: str = "GET", path: str = "/", body: bytes | dict | None = None,
            headers: dict | None = None, timeout: float = 30.0, chunked: bool = False) -> Response:
    """One HTTP request on a fresh connection (bounded by ``timeout``)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if isinstance(body, dict):
            hdrs.setdefault("content-type", "application/json")
        if chunked:
            conn.putrequest(method, path)
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.putheader("transfer-encoding", "chunked")
            conn.endheaders()
            for i in range(0, len(data), 4096):
                piece = data[i:i + 4096]
                conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            conn.send(b"0\r\n\r\n")
        else:
            # The server answered early (a 413 by Content-Length) and closed before the
            # whole body was sent: its answer is already on the socket, read it below.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(method, path, body=data, headers=hdrs)
        res = conn.getresponse()
        return Response(res.status, {k.lower(): v for k, v in res.getheaders()}, res.read())
    finally:
        conn.close()


def auth(token: str | None = None) -> dict:
    return {"authorization": f"Bearer {token or SECRETS['PROBE_TOKEN']}"}


def chat(stream: bool = False, model: str = "client/model") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": stream}


@dataclass
class Cell:
    worker: Workerd
    pods: list[standin.StandinServer]
    fallback: standin.StandinServer
    plan: object
    responses: list[Response] = field(default_factory=list)

    @property
    def pod(self) -> standin.StandinServer:
        return self.pods[0]

    @property
    def url(self) -> str:
        return self.worker.url

    def call(self, method: str, path: str, **kw) -> Response:
        """One request; routed paths (/v1/...) carry the cell's client key unless the caller
        sends its own Authorization header (pass ``headers={"authorization": ""}`` for none)."""
        if path.startswith("/v1/") and self.key:
            headers = dict(kw.pop("headers", None) or {})
            if not any(k.lower() == "authorization" for k in headers):
                headers["authorization"] = f"Bearer {self.key}"
            headers = {k: v for k, v in headers.items() if v != ""}
            kw["headers"] = headers
        res = request(self.url, method, path, **kw)
        self.responses.append(res)
        return res

    def breaker(self) -> dict:
        res = self.call("GET", "/_colocate/breaker", headers=auth())
        assert res.status == 200, res.body
        return res.json()["breaker"]

    def wait_breaker(self, state: str, timeout_s: float = 15.0) -> dict:
        """Poll the object (not the isolate's cache) until the breaker is in ``state``."""
        deadline = time.monotonic() + timeout_s
        snap = self.breaker()
        while snap["state"] != state and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = self.breaker()
        return snap

    def wait_for(self, predicate, timeout_s: float = 15.0) -> dict:
        """Poll the object's snapshot until ``predicate(snapshot)`` holds (bounded)."""
        deadline = time.monotonic() + timeout_s
        snap = self.breaker()
        while not predicate(snap) and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = self.breaker()
        return snap

    def restart(self, plan) -> None:
        """Stop workerd and start it again (same port, same storage) with another plan."""
        self.worker.stop()
        self.plan = plan
        self.worker.start(
            render_config(
                plan.worker,
                values_for([p.url for p in self.pods], self.fallback.url),
                port=self.worker.port,
                storage_dir=self._storage or self.worker.directory / "objects",
            )
        )

    def create_key(self, name: str = "test", **limits) -> dict:
        """A new client key through the admin endpoint (the plaintext is in ``["key"]``)."""
        res = self.call("POST", "/_colocate/keys", body={"name": name, **limits}, headers=auth(self.admin_token))
        assert res.status == 201, res.body
        return res.json()

    _storage: Path | None = None
    key: str | None = None
    admin_token: str = SECRETS["PROBE_TOKEN"]


@contextlib.contextmanager
def running_cell(worker: dict | None = None, generations: list[dict] | None = None, *, compute_ms: float = 5,
                 storage_dir: Path | None = None, with_key: bool = True, pods: int = 1, split_tokens: bool = False,
                 profile: str = "oracle", **raw_overrides) -> Iterator[Cell]:
    """A stand-in pod and fallback (separate tokens) and workerd running the sandbox plan,
    with a client key (``cell.key``) that routed calls carry. Objects are stored on disk
    (``storage_dir``, default inside workerd's directory): workerd offers SQLite to
    Durable Objects only with localDisk storage. ``profile``: the pods' (colocate.pods.profiles;
    the default, oracle, answers in ``compute_ms`` at any load)."""
    plan = cell_plan(worker, generations, split_tokens=split_tokens, **raw_overrides)
    with contextlib.ExitStack() as stack:
        names = ["pod"] if pods == 1 else [f"pod-{i}" for i in range(pods)]
        started = [stack.enter_context(standin.serve(compute_ms=compute_ms, token=SECRETS["POD_TOKEN"], name=n, profile=profile))
                   for n in names]
        fb = stack.enter_context(standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME,
                                               name="fallback"))
        w = stack.enter_context(Workerd())
        w.start(render_config(plan.worker, values_for([p.url for p in started], fb.url), port=w.port,
                              storage_dir=storage_dir or w.directory / "objects"))
        cell = Cell(w, started, fb, plan)
        cell._storage = storage_dir
        if split_tokens:
            cell.admin_token = OPERATOR_TOKENS["adminToken"]
        if with_key:
            # The cell's own key has no limits (colocate:keys.defaults would give it some): tests send freely.
            cell.key = cell.create_key("test", rpm=0, tpm=0, monthly_tokens=0, max_parallel=0, max_parallel_tokens=0)["key"]
        yield cell


class Outbound(ThreadingHTTPServer):
    """A stand-in for the whole outside world, used as workerd's global outbound: it
    records each request (method, path, Host, every header) and answers
    ``/cdn-cgi/trace`` with ``colo=<colo>`` and everything else with 200 {"status":"ok"}."""

    daemon_threads = True

    def __init__(self, colo: str = "TST"):
        self.colo = colo
        self.seen: list[dict] = []
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _OutboundHandler)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _OutboundHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        with self.server._lock:
            self.server.seen.append(
                {"method": "GET", "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
            )
        if self.path.startswith("/cdn-cgi/trace"):
            body = f"fl=1\nh={self.headers.get('host')}\ncolo={self.server.colo}\n".encode()
            ctype = "text/plain"
        else:
            body, ctype = b'{"status":"ok"}', "application/json"
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def outbound(colo: str = "TST") -> Iterator[Outbound]:
    server = Outbound(colo)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=10)


# --- Counting object calls, and two isolates sharing one generation ------------------

# The counting entry (never uploaded): bench/count_calls.js wraps the product's BREAKER
# and answers GET /__count/calls.
COUNTING_ENTRY = "count_calls.js"
COUNTING_JS = (ROOT / "bench" / COUNTING_ENTRY).read_text()


def object_calls(url: str) -> dict:
    """The calls the isolate behind ``url`` has made on generation objects so far:
    {"calls", "hot" (before a response left), "background", "methods"}."""
    return request(url, "GET", "/__count/calls").json()


@dataclass
class TwinCell:
    """Two isolates (two worker services in one workerd) routing for one generation: the
    first hosts the objects, the second reaches them through the first's namespace, as two
    Cloudflare isolates share one Durable Object."""

    worker: Workerd
    pod: standin.StandinServer
    fallback: standin.StandinServer
    plan: object
    urls: tuple[str, str]
    key: str | None = None


@contextlib.contextmanager
def twin_cell(worker: dict | None = None, *, compute_ms: float = 1, **raw_overrides) -> Iterator[TwinCell]:
    from colocate import workerd as wd

    plan = cell_plan(worker, **raw_overrides)
    with standin.serve(compute_ms=compute_ms, token=SECRETS["POD_TOKEN"], name="pod") as pod, \
            standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME, name="fallback") as fb, \
            Workerd() as w:
        second = wd.listening_socket()
        try:
            values = values_for(pod.url, fb.url)
            extra = [(COUNTING_ENTRY, COUNTING_JS)]
            a = wd.worker_capnp(plan.worker, values, storage_service="disk", extra_modules=extra, main_module=COUNTING_ENTRY)
            b = wd.worker_capnp(plan.worker, values, host_objects=False, do_service="a", extra_modules=extra,
                                main_module=COUNTING_ENTRY)
            services = [wd.worker_service("a", a), wd.worker_service("b", b), wd.network_service(),
                        wd.disk_service("disk", w.directory / "objects")]
            sockets = [wd.socket_capnp("http", w.port, "a"), wd.socket_capnp("second", 0, "b")]
            w.start(wd.config_capnp(services, sockets), extra_sockets={"second": second})
            cell = TwinCell(w, pod, fb, plan, (w.url, f"http://127.0.0.1:{second.getsockname()[1]}"))
            res = request(w.url, "POST", "/_colocate/keys", body={"name": "twin"}, headers=auth())
            cell.key = res.json()["key"]
            yield cell
        finally:
            second.close()


# --- Driving the generation object directly (bench/gen_driver.js) ------------------------

DRIVER_ENTRY = "gen_driver.js"
DRIVER_JS = (ROOT / "bench" / DRIVER_ENTRY).read_text()


@dataclass
class DrivenCell:
    """The router (first socket, hosting the objects) and a driver Worker (second socket)
    bound to the same objects, whose POST /rpc calls the object's methods as isolates do."""

    worker: Workerd
    pod: standin.StandinServer
    fallback: standin.StandinServer
    plan: object
    url: str
    driver_url: str
    key: str | None = None

    @property
    def generation(self) -> str:
        return self.plan.state.active.name

    def rpc(self, calls: list[list], gen: str | None = None, timeout: float = 60.0) -> dict:
        """{"results": [...], "bytes": [...]} of ``calls`` ([method, *args]) run at once."""
        res = request(self.driver_url, "POST", "/rpc", body={"gen": gen or self.generation, "calls": calls}, timeout=timeout)
        assert res.status == 200, res.body[:500]
        return res.json()

    def one(self, method: str, *args, gen: str | None = None):
        return self.rpc([[method, *args]], gen)["results"][0]


@contextlib.contextmanager
def driven_cell(worker: dict | None = None, *, plan=None, storage_dir: Path | None = None, compute_ms: float = 1,
                with_key: bool = True, **raw_overrides) -> Iterator[DrivenCell]:
    from colocate import workerd as wd

    plan = plan or cell_plan(worker, **raw_overrides)
    with standin.serve(compute_ms=compute_ms, token=SECRETS["POD_TOKEN"], name="pod") as pod, \
            standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME, name="fallback") as fb, \
            Workerd() as w:
        second = wd.listening_socket()
        try:
            values = values_for(pod.url, fb.url)
            a = wd.worker_capnp(plan.worker, values, storage_service="disk")
            d = wd.worker_capnp(plan.worker, values, host_objects=False, do_service="a",
                                extra_modules=[(DRIVER_ENTRY, DRIVER_JS)], main_module=DRIVER_ENTRY)
            services = [wd.worker_service("a", a), wd.worker_service("d", d), wd.network_service(),
                        wd.disk_service("disk", storage_dir or w.directory / "objects")]
            sockets = [wd.socket_capnp("http", w.port, "a"), wd.socket_capnp("second", 0, "d")]
            w.start(wd.config_capnp(services, sockets), extra_sockets={"second": second})
            cell = DrivenCell(w, pod, fb, plan, w.url, f"http://127.0.0.1:{second.getsockname()[1]}")
            if with_key:
                res = request(w.url, "POST", "/_colocate/keys", body={"name": "driven"}, headers=auth())
                assert res.status == 201, res.body
                cell.key = res.json()["key"]
            yield cell
        finally:
            second.close()
