"""Run the router Worker in workerd, Cloudflare's own runtime, from a ``WorkerPlan``.

The cloud and this module consume the same plan: the modules are read from disk
(the bytes the Pulumi program uploads), the compatibility date and the bindings are
the plan's (``colocate.cell.plan.worker_bindings``), never hand-copied. Values the plan
cannot hold (secrets, the pod's URL known only once the pod exists) come in
``values``, keyed by binding name (``POD_TOKEN``, ``POD_URLS``), by settings key
(``podToken``) or by output name (``pod.urls``). Imports no Pulumi.

Building blocks, composable for bigger configs (the sandbox hosts the same
``Breaker`` class in several DO-hosting services, each with its own outbound)::

    capnp_text(s)                      a Cap'n Proto string literal
    resolve_bindings(worker, values)   {binding name: value}; BindingValueMissing names the gap
    modules_capnp(worker, extra=())    the module list (main module first); extra = (name, source)
    bindings_capnp(worker, values, do_service=None)
    worker_capnp(worker, values, ...)  one ``Workerd.Worker`` literal
    external_service(name, host, port, inject_headers=None)
    network_service(name)              loopback-and-public network (the default outbound here)
    pod_tls_service(name, client)      the same network, its https presenting the Worker's client
                                       certificate and trusting only the pods' public root: what
                                       the plan's ``mtls_certificate`` binding (POD_TLS) is here
    disk_service(name, path)           writable directory for ``durableObjectStorage.localDisk``
                                       (the generation object uses SQLite, which workerd offers
                                       only on localDisk; ``inMemory`` has the KV API alone)
    config_capnp(services, sockets)    the whole file; services/sockets are (name, literal) pairs
    socket_capnp(name, port, service)
    render_config(worker, values, *, port, ...)   all of the above for one worker

Outbound traffic. workerd's default ``internet`` service refuses private and loopback
addresses, so a plain config here routes the Worker's subrequests through
``network_service`` (public + private + local): a pod on 127.0.0.1 is reachable, and
``https://www.cloudflare.com/cdn-cgi/trace`` simply fails offline (the probe then
reports ``worker_colo: null``). With ``global_outbound=(host, port)`` every subrequest
(pod, fallback, cdn-cgi/trace, from the Worker and from the Durable Object) goes to
that one external HTTP server instead. Checked in workerd 1.20261117.1 (see
tests/test_worker_workerd.py::test_global_outbound_shape): the request arrives as
plain HTTP in *host* style: the request line holds only the path
(``GET /cdn-cgi/trace``) and the ``Host`` header keeps the original host
(``www.cloudflare.com``, or ``127.0.0.1:8123`` for the pod), whatever the scheme was;
``https`` is not signalled (set ``HttpOptions.forwardedProtoHeader`` on a socket to
carry it, not needed here). ``inject_headers`` are added on that hop
(``HttpOptions.injectRequestHeaders``; an existing header of that name is replaced).

Ports. ``Workerd`` binds 127.0.0.1:0 itself and hands the listening socket to workerd
(``--socket-fd http=<fd>``), so there is no window in which another process could
take the port. ``free_port()`` (bind 0, read, close) is there for configs whose port
must be known before starting; it has the usual small race.

The pod hop. The plan's ``mtls_certificate`` binding (``POD_TLS``) is, in the cloud, an
uploaded client certificate whose ``fetch`` presents it and verifies the server with public trust,
as the global ``fetch`` does. Here it is a service binding to ``pod_tls_service``: a network
service whose ``tlsOptions`` carry the client keypair and the sandbox's stand-in for the public
CAs as the only trusted root (checked in workerd 1.20261117.1: the keypair is presented to a
server that asks for a client certificate, and a server certificate of another CA, the cell's
own included, or for another name fails the fetch). ``network_service(public_roots=...)`` gives
the Worker's other fetches (the fallback) the same public trust and nothing else. Given no
``HopClient``, the binding goes to the worker's own
outbound, so harnesses whose stand-ins serve plain HTTP keep working; the sandbox always gives one.

The rendered config holds secret values: it is written with mode 0600, and is never
printed; workerd's own log never sees the values unless the Worker logs them (it
redacts them, see worker/src/errors.js).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .cell.plan import BREAKER_CLASS, Binding, WorkerPlan
from .sandbox.errors import SandboxError

ROOT = Path(__file__).resolve().parent.parent
WORKERD_BIN = ROOT / "node_modules" / ".bin" / "workerd"
MAIN_SERVICE = "main"
SOCKET_NAME = "http"
STARTUP_TIMEOUT_S = 30.0  # how long start() waits for a first answer before calling it hung
UNDER_LAUNCHER_FACTOR = 10  # the same under a launcher that slows workerd (valgrind: 40 x)
NETWORK_SERVICE = "colocate-net"
OUTBOUND_SERVICE = "colocate-outbound"
STORAGE_SERVICE = "colocate-do-storage"


class WorkerdError(SandboxError):
    """Errors of this module (drawn in colocate/sandbox/errors.py's tree)."""


class BindingValueMissing(WorkerdError):
    def __init__(self, binding: Binding):
        source = f"secret {binding.secret!r}" if binding.secret else f"output {binding.from_output!r}"
        keys = " or ".join(repr(k) for k in (binding.name, binding.secret or binding.from_output))
        super().__init__(f"binding {binding.name} ({source}) has no value: pass values[{keys}]")
        self.binding = binding.name


@dataclass(frozen=True)
class HopClient:
    """The Worker's side of the pod hop: its client certificate and key (of the cell's CA), and the
    root it verifies the pods' server certificates by (PEM): the public CAs in the cloud, the
    sandbox's stand-in for them here (colocate/sandbox/hopcerts.py), never the cell's CA."""

    cert_pem: str
    key_pem: str
    ca_pem: str


POD_TLS_SERVICE = "colocate-pod-tls"


class WorkerdNotInstalled(WorkerdError):
    pass


class WorkerdStartFailed(WorkerdError):
    pass


# --- Cap'n Proto text ------------------------------------------------------------------

# capnp_text escapes with str.replace and one regex pass (C speed), not a Python loop per
# character: each workerd config writes the Worker's whole source (~500 KB) once per service.
_CAPNP_ESCAPES = (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\t", "\\t"), ("\r", "\\r"))  # backslash first
_CAPNP_OTHER = re.compile(r"[^ -~]+")


def _capnp_bytes(match: re.Match) -> str:
    return "".join(f"\\x{b:02x}" for b in match.group().encode("utf-8"))


def capnp_text(value: str) -> str:
    """A Cap'n Proto string literal. Non-ASCII is written as UTF-8 byte escapes."""
    for ch, escaped in _CAPNP_ESCAPES:
        value = value.replace(ch, escaped)
    return '"' + _CAPNP_OTHER.sub(_capnp_bytes, value) + '"'


def resolve_bindings(worker: WorkerPlan, values: Mapping[str, str]) -> dict[str, str]:
    """Every text binding's value: plain ones from the plan, the rest from ``values``."""
    out = {}
    for b in worker.bindings:
        if b.type in ("durable_object_namespace", "mtls_certificate"):
            continue
        if b.text is not None:
            out[b.name] = b.text
            continue
        for key in (b.name, b.secret, b.from_output):
            if key and values.get(key) is not None:
                out[b.name] = str(values[key])
                break
        else:
            raise BindingValueMissing(b)
    return out


def modules_capnp(worker: WorkerPlan, extra: Iterable[tuple[str, str]] = (), *, first: str | None = None) -> str:
    """The module list. The plan's modules come from disk, main module first; ``extra``
    adds (name, ES module source) pairs, e.g. a sandbox-only wrapper entry, placed first
    when ``first`` names it (workerd's main module is the first in the list)."""
    entries = [(name, src) for name, src in extra]
    entries += [(m.name, m.content()) for m in worker.modules]
    if first:
        entries.sort(key=lambda e: e[0] != first)
    return "[\n" + ",\n".join(f"    (name = {capnp_text(n)}, esModule = {capnp_text(s)})" for n, s in entries) + "\n  ]"


def bindings_capnp(worker: WorkerPlan, values: Mapping[str, str], *, do_service: str | None = None,
                   extra: Iterable[str] = (), pod_tls_service: str | None = None) -> str:
    """The binding list. ``do_service`` hosts the Durable Object class elsewhere (another
    worker service in the same config); None = this worker's own namespace. ``extra``
    appends binding literals that are not the plan's (the sandbox's own ``__SANDBOX_*``).
    ``pod_tls_service`` is the service an ``mtls_certificate`` binding fetches through."""
    texts = resolve_bindings(worker, values)
    items = []
    for b in worker.bindings:
        if b.type == "mtls_certificate":
            if not pod_tls_service:
                raise WorkerdError(f"binding {b.name} (mtls_certificate) needs a service: pass pod_tls_service")
            items.append(f"(name = {capnp_text(b.name)}, service = {capnp_text(pod_tls_service)})")
        elif b.type == "durable_object_namespace":
            cls = capnp_text(b.class_name or BREAKER_CLASS)
            target = f"(className = {cls}, serviceName = {capnp_text(do_service)})" if do_service else cls
            items.append(f"(name = {capnp_text(b.name)}, durableObjectNamespace = {target})")
        else:
            items.append(f"(name = {capnp_text(b.name)}, text = {capnp_text(texts[b.name])})")
    items.extend(extra)
    return "[\n" + ",\n".join("    " + i for i in items) + "\n  ]"


def unique_key(worker: WorkerPlan, class_name: str = BREAKER_CLASS) -> str:
    # Stable across runs so a localDisk store is found again after a restart.
    return f"{worker.script_name}-{class_name}"


def worker_capnp(worker: WorkerPlan, values: Mapping[str, str], *, storage_service: str | None = None,
                 global_outbound: str | None = NETWORK_SERVICE, do_service: str | None = None,
                 host_objects: bool = True, extra_modules: Iterable[tuple[str, str]] = (),
                 main_module: str | None = None, namespace_key: str | None = None,
                 extra_bindings: Iterable[str] = (), pod_tls_service: str | None = None) -> str:
    """One ``Workerd.Worker`` literal. ``host_objects`` declares the Breaker namespace here
    (with SQLite, in memory or on ``storage_service``'s disk); several services hosting
    the class in one config each need their own ``namespace_key`` (default
    ``unique_key(worker)``; keep it stable, it names the on-disk directory). The plan's
    POD_TLS binding fetches through ``pod_tls_service`` (default: the global outbound)."""
    bindings = bindings_capnp(worker, values, do_service=do_service, extra=extra_bindings,
                              pod_tls_service=pod_tls_service or global_outbound)
    fields = [
        f"modules = {modules_capnp(worker, extra_modules, first=main_module)}",
        f"compatibilityDate = {capnp_text(worker.compatibility_date)}",
        f"bindings = {bindings}",
    ]
    if worker.compatibility_flags:  # the plan's, as uploaded: the cloud and workerd run the same flags
        fields.append(f"compatibilityFlags = [{', '.join(capnp_text(f) for f in worker.compatibility_flags)}]")
    if host_objects:
        fields.append(
            f"durableObjectNamespaces = [(className = {capnp_text(BREAKER_CLASS)}, "
            f"uniqueKey = {capnp_text(namespace_key or unique_key(worker))}, enableSql = true)]"
        )
        storage = f"(localDisk = {capnp_text(storage_service)})" if storage_service else "(inMemory = void)"
        fields.append(f"durableObjectStorage = {storage}")
    if global_outbound:
        fields.append(f"globalOutbound = {capnp_text(global_outbound)}")
    return "(\n  " + ",\n  ".join(fields) + "\n)"


def _headers(headers: Mapping[str, str] | None) -> str:
    if not headers:
        return ""
    items = ", ".join(f"(name = {capnp_text(k)}, value = {capnp_text(v)})" for k, v in headers.items())
    return f"injectRequestHeaders = [{items}]"


def external_service(name: str, host: str, port: int, inject_headers: Mapping[str, str] | None = None) -> tuple[str, str]:
    """A plain-HTTP server every fetch through this service reaches (host-style requests)."""
    return (
        name,
        f"(name = {capnp_text(name)}, external = (address = {capnp_text(f'{host}:{port}')}, "
        f"http = ({_headers(inject_headers)})))",
    )


def network_service(name: str = NETWORK_SERVICE, public_roots: Sequence[str] = ()) -> tuple[str, str]:
    """The loopback-and-public network; with ``public_roots`` its https trusts those roots (the
    sandbox's stand-in for the public CAs) and no other: no private CA of the cell's."""
    if not public_roots:
        return name, f'(name = {capnp_text(name)}, network = (allow = ["public", "private", "local"]))'
    roots = ", ".join(capnp_text(r) for r in public_roots)
    return name, (f'(name = {capnp_text(name)}, network = (allow = ["public", "private", "local"], '
                  f"tlsOptions = (trustBrowserCas = false, trustedCertificates = [{roots}])))")


def pod_tls_service(name: str, client: HopClient) -> tuple[str, str]:
    """A network service whose https presents ``client``'s certificate and trusts only its CA."""
    keypair = f"keypair = (privateKey = {capnp_text(client.key_pem)}, certificateChain = {capnp_text(client.cert_pem)})"
    tls = f"tlsOptions = ({keypair}, trustBrowserCas = false, trustedCertificates = [{capnp_text(client.ca_pem)}])"
    return name, f'(name = {capnp_text(name)}, network = (allow = ["public", "private", "local"], {tls}))'


def disk_service(name: str, path: Path | str) -> tuple[str, str]:
    """A writable directory service (created if missing: workerd refuses a missing one)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    return name, f"(name = {capnp_text(name)}, disk = (path = {capnp_text(str(Path(path).resolve()))}, writable = true))"


def worker_service(name: str, worker_literal: str) -> tuple[str, str]:
    return name, f"(name = {capnp_text(name)}, worker = {worker_literal})"


def socket_capnp(name: str, port: int, service: str, host: str = "127.0.0.1") -> tuple[str, str]:
    return (
        name,
        f"(name = {capnp_text(name)}, address = {capnp_text(f'{host}:{port}')}, http = (), service = {capnp_text(service)})",
    )


CONFIG_OPEN = "const config :Workerd.Config = (\n"


def config_capnp(services: Iterable[tuple[str, str]], sockets: Iterable[tuple[str, str]]) -> str:
    svc = ",\n    ".join(lit for _, lit in services)
    sock = ",\n    ".join(lit for _, lit in sockets)
    return (
        "# Generated by colocate/workerd.py from the cell plan. Holds secret values: do not share.\n"
        'using Workerd = import "/workerd/workerd.capnp";\n\n'
        f"{CONFIG_OPEN}  services = [\n    {svc}\n  ],\n  sockets = [\n    {sock}\n  ]\n);\n"
    )


def with_v8_flags(config: str, flags: Sequence[str]) -> str:
    """``config`` (from config_capnp) with V8 flags set for the whole process."""
    if config.count(CONFIG_OPEN) != 1:
        raise WorkerdError(f"v8 flags {list(flags)} need a config from config_capnp (one {CONFIG_OPEN.strip()!r} line)")
    items = ", ".join(capnp_text(f) for f in flags)
    return config.replace(CONFIG_OPEN, f"{CONFIG_OPEN}  v8Flags = [{items}],\n")


def render_config(worker: WorkerPlan, values: Mapping[str, str], *, port: int, storage_dir: Path | str | None = None,
                  global_outbound: tuple[str, int] | None = None, inject_headers: Mapping[str, str] | None = None,
                  pod_tls: HopClient | None = None, public_roots: Sequence[str] = ()) -> str:
    """A complete workerd config running ``worker`` on 127.0.0.1:``port``; ``pod_tls`` makes the pod hop mutual
    TLS; ``public_roots`` are the roots the Worker's own https fetches trust (network_service)."""
    services = []
    if pod_tls is not None:
        services.append(pod_tls_service(POD_TLS_SERVICE, pod_tls))
    if global_outbound:
        services.append(external_service(OUTBOUND_SERVICE, global_outbound[0], global_outbound[1], inject_headers))
        outbound = OUTBOUND_SERVICE
    else:
        if inject_headers:
            raise ValueError("inject_headers applies to the global_outbound hop: pass global_outbound too")
        services.append(network_service(public_roots=public_roots))
        outbound = NETWORK_SERVICE
    storage = None
    if storage_dir is not None:
        services.append(disk_service(STORAGE_SERVICE, storage_dir))
        storage = STORAGE_SERVICE
    lit = worker_capnp(worker, values, storage_service=storage, global_outbound=outbound,
                       pod_tls_service=POD_TLS_SERVICE if pod_tls is not None else None)
    services.insert(0, worker_service(MAIN_SERVICE, lit))
    return config_capnp(services, [socket_capnp(SOCKET_NAME, port, MAIN_SERVICE)])


# --- Running workerd -------------------------------------------------------------------

def workerd_binary(root: Path = ROOT) -> Path:
    path = Path(root) / "node_modules" / ".bin" / "workerd"
    if not path.exists():
        raise WorkerdNotInstalled(f"{path} is missing: run `make setup` (npm ci installs the pinned workerd)")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind 0, read, close: another process could
    take it before workerd binds it; prefer Workerd's own socket hand-over)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A bound, listening socket on a free port, to hand to workerd (no race)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(128)
    return s


class Workerd:
    """workerd serving a config, as a context manager.

    Shortest form: ``with Workerd.serve(plan.worker, values) as w: w.url``. For a
    composed config: ``with Workerd() as w: w.start(config_text_using(w.port))``;
    ``stop()`` then ``start()`` again restarts on the same port (state kept when the
    config stores objects on disk).

    ``config`` is the text of a config whose socket ``socket_name`` listens on ``port``
    (render with ``render_config(..., port=w.port)`` after creating ``w = Workerd.reserve()``,
    or pass ``port`` yourself). Output goes to ``log_path`` (default: beside the config).
    ``stop()`` terminates the process group and waits; exit from the ``with`` block,
    an exception included, always stops it.
    """

    def __init__(self, directory: Path | str | None = None, *, host: str = "127.0.0.1", sock: socket.socket | None = None,
                 port: int | None = None, socket_name: str = SOCKET_NAME, startup_timeout_s: float | None = None,
                 launcher: Sequence[str] = (), extra_args: Sequence[str] = (), v8_flags: Sequence[str] = ()):
        if sock is None and port is None:
            sock = listening_socket(host)
        self._sock = sock
        self.host = host
        self.port: int = sock.getsockname()[1] if sock is not None else int(port or 0)  # one of them is set
        self.socket_name = socket_name
        # Only a hang's bound (readiness is polled): 30 s natively; under a launcher (valgrind runs
        # workerd 40 times slower) a start on a loaded machine took longer than 30 s.
        self.startup_timeout_s = startup_timeout_s or (STARTUP_TIMEOUT_S * (UNDER_LAUNCHER_FACTOR if launcher else 1))
        self._tmp = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="colocate-workerd-")
            directory = self._tmp.name
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path = self.directory / "config.capnp"
        self.log_path = self.directory / "workerd.log"
        # Benchmarks only: ``launcher`` runs workerd under another program (valgrind),
        # ``extra_args`` adds flags (--inspector-addr), ``v8_flags`` sets the config's
        # v8Flags; the process id stays workerd's own.
        self.launcher = tuple(launcher)
        self.extra_args = tuple(extra_args)
        self.v8_flags = tuple(v8_flags)
        self.proc: subprocess.Popen | None = None

    @classmethod
    def serve(cls, worker: WorkerPlan, values: Mapping[str, str], *, directory: Path | str | None = None,
              storage_dir: Path | str | None = None, global_outbound: tuple[str, int] | None = None,
              inject_headers: Mapping[str, str] | None = None, launcher: Sequence[str] = (),
              v8_flags: Sequence[str] = (), pod_tls: HopClient | None = None,
              public_roots: Sequence[str] = ()) -> Workerd:
        """Render ``worker`` for a fresh port and start it: ``with Workerd.serve(plan.worker, values) as w``."""
        w = cls(directory, launcher=launcher, v8_flags=v8_flags)
        try:
            # SQLite (the generation object's storage) needs localDisk storage in workerd.
            w.start(render_config(worker, values, port=w.port, storage_dir=storage_dir or w.directory / "objects",
                                  global_outbound=global_outbound, inject_headers=inject_headers, pod_tls=pod_tls,
                                  public_roots=public_roots))
        except BaseException:
            w.close()
            raise
        return w

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, config: str, extra_sockets: Mapping[str, socket.socket] | None = None) -> Workerd:
        """Start workerd on ``config``. ``extra_sockets`` hands more bound sockets to it, by
        the config's socket name (the caller keeps them open while workerd runs)."""
        binary = workerd_binary()
        if self.v8_flags:
            config = with_v8_flags(config, self.v8_flags)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(config)
        args = [*self.launcher, str(binary), "serve", str(self.config_path), *self.extra_args]
        pass_fds: tuple[int, ...] = ()
        if self._sock is not None:
            args.append(f"--socket-fd={self.socket_name}={self._sock.fileno()}")
            pass_fds = (self._sock.fileno(),)
        for name, s in (extra_sockets or {}).items():
            args.append(f"--socket-fd={name}={s.fileno()}")
            pass_fds += (s.fileno(),)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         pass_fds=pass_fds, start_new_session=True, cwd=self.directory)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def process(self) -> subprocess.Popen:
        """The running workerd process (WorkerdError before ``start`` or after ``stop``)."""
        if self.proc is None:
            raise WorkerdError("workerd is not running: start() it first")
        return self.proc

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise WorkerdStartFailed(f"workerd exited with {self.process.returncode}:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.05)
        raise WorkerdStartFailed(
            f"workerd did not answer on {self.url} within {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def _answers(self) -> bool:
        # With a handed-over socket, connect() succeeds before workerd runs; a real
        # HTTP answer (any status) shows it is serving.
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as c:
                c.sendall(b"GET /__colocate_ready HTTP/1.1\r\nHost: ready\r\nConnection: close\r\n\r\n")
                c.settimeout(2.0)
                return c.recv(12).startswith(b"HTTP/1.")
        except OSError:
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        elif proc is not None:
            proc.wait()

    def close(self) -> None:
        self.stop()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Workerd:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
