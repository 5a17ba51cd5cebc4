"""The cell plan: settings in, everything a cell is made of out. Pure Python, no Pulumi.

Both realisations consume the same ``CellPlan``: the Pulumi program (``infra/``)
declares it in the cloud, the sandbox (``scripts/sandbox.py``) runs it on this machine.
If they ever needed different plans, this module would be wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from . import cloudflare_limits, geo
from .catalogue import EXISTING, Region, region as lookup_region
from .endpoints import Endpoint, anycast
from .ledger import UNKNOWN_REGION, Generation
from .market import PodMarket
from .settings import LEGACY_TOKEN, PodSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
WORKER_DIR = ROOT / "worker" / "src"
MAIN_MODULE = "index.js"
# The generation object's class keeps its first name: a Durable Object class name is pinned by
# the deployed migrations (renaming it is a migration step that moves every object).
BREAKER_CLASS = "Breaker"
# Its namespace's binding is named after the class; the upgrade tests run earlier Workers,
# which read env.BREAKER, on today's bindings, so the name stays.
GENERATION_BINDING = "BREAKER"
WORKER_HASH_BINDING = "WORKER_HASH"  # the content hash of the modules uploaded beside it
# allow_custom_ports (the pod listens on :8000) is the default from 2024-09-02;
# the date is also the newest the pinned workerd (1.20261117.1) accepts.
COMPATIBILITY_DATE = "2026-11-01"
# Flags every cell's Worker runs with. enable_request_signal: a client's disconnect reaches the
# router as the request's abort signal (`Request.signal`), so it cancels the pod's work, meters
# what was made and frees the key's slot (docs/worker.md, "Every token, whoever hangs up"). It
# has no default date (workerd's compatibility-date.capnp: "the compat flag has no default
# enable date"): set by name, in the cloud and in workerd alike.
WORKER_COMPATIBILITY_FLAGS = ("enable_request_signal",)
# The kit's Durable Object migrations, in order. Tags are applied once each. Cloudflare
# reports the tag a script last applied (the Workers scripts list, `migration_tag`): the
# program reads it at plan time and sends only the steps after it (``migration_decision``).
# Steps only ever add: nothing here deletes a class.
MIGRATIONS: tuple[tuple[str, dict], ...] = (("v1", {"new_sqlite_classes": [BREAKER_CLASS]}),)
POD_URLS_FROM_OUTPUT = "pod.urls"  # marks a binding whose value is the created pods' URLs


def pod_urls_text(urls: list[str]) -> str:
    """The POD_URLS binding's value: a JSON array of the pods' base URLs, in pod index order."""
    return json.dumps([u.rstrip("/") for u in urls])


@dataclass(frozen=True)
class Binding:
    """One Worker binding. ``secret`` names the settings key whose secret value fills it;
    ``from_output`` names a value only known once a resource exists."""

    name: str
    type: str  # plain_text | secret_text | durable_object_namespace | mtls_certificate
    text: str | None = None
    secret: str | None = None
    class_name: str | None = None
    from_output: str | None = None


@dataclass(frozen=True)
class Module:
    """One ES module of an upload: read from ``path``, or ``text`` made by the plan (the
    fleet's ranking, ``colocate.fleet.plan.rank_module``)."""

    name: str
    path: Path | None
    text: str | None = None

    def content(self) -> str:
        if self.text is not None:
            return self.text
        assert self.path is not None, f"module {self.name} has neither a path nor a text"
        return self.path.read_text()


PLACEMENT_POD, PLACEMENT_TARGETED, PLACEMENT_SMART = "pod", "targeted", "smart"
POD_PORT_FROM_OUTPUT = "pod.port"  # marks a value taken from pod 0's create output (its public port)


@dataclass(frozen=True)
class PlacementHost:
    """``placement.host`` in pod mode: pod 0's DNS-only hostname and its public port.

    The hostname is the plan's (stable across pod replacements within a generation); the
    port is the one the provider mapped, known only once the pod exists, so it is taken from
    pod 0's create output (``from_output``), as the pod URLs are. Cloudflare probes it over
    TCP (layer 4) and runs the Worker in the colo nearest it (docs/pods.md, "Placement")."""

    hostname: str
    pod_index: int = 0
    from_output: str = POD_PORT_FROM_OUTPUT
    # On zone-dns the record's name carries the pod's instance (``instance_host``): its provider.
    instance_of: str = ""

    def value(self, created: dict) -> str:
        """``host:port`` for pod ``pod_index``'s ``pod.py create`` output."""
        host = instance_host(self.hostname, self.instance_of, created["id"]) if self.instance_of else self.hostname
        return f"{host}:{created['port']}"

    def describe(self, new: bool = False) -> str:
        """What ``value`` will be, in words (``new``: of the pod that replaces pod ``pod_index``)."""
        whose = f"{'the new ' if new else ''}pod {self.pod_index}'s"
        where = f"<{whose} instance>.{self.hostname}" if self.instance_of else self.hostname
        return f"{where}:<{whose} public port>"


def instance_label(provider: str, pod_id: str) -> str:
    """A DNS label derived from the pod's instance (provider and id): a replacement, a new instance,
    never gets its predecessor's hostname. Addresses are reused across instances (Vast.ai says so),
    and a record's TTL and the Worker's URL list change at different times: under one name, the
    Worker could dial a new address on an old port, another tenant's."""
    return "i" + hashlib.sha256(f"{provider}:{pod_id}".encode()).hexdigest()[:12]


def instance_host(base: str, provider: str, pod_id: str) -> str:
    """Pod ``pod_id``'s hostname under the plan's ``base`` (``pod_hostname``): ``<instance label>.<base>``."""
    return f"{instance_label(provider, pod_id)}.{base}"


def placement_mode(setting: str, path: str, pod0_host: str = "") -> str:
    """The placement mode a cell runs under, from ``colocate:worker.placement`` and the pod path.

    ``auto`` is ``pod`` where the pod has a DNS-only record of its own (``zone-dns``) and
    ``targeted`` elsewhere. ``pod`` needs a single-homed address: RunPod's proxy hostnames
    are anycast and shared, which Cloudflare's placement probes cannot locate (changelog
    2026-01-22, "not suitable for anycasted or multicasted resources"), so it is refused
    there. ``local-hostname`` (the sandbox) takes it; the Pulumi program refuses it there. An existing
    endpoint (``endpoint``) is a box of its own at its name (``pod0_host``), unless that name is a
    provider's shared proxy (``endpoints.anycast``).
    """
    single = path == PATH_ZONE_DNS or (path == PATH_ENDPOINT and not anycast(pod0_host))
    if setting == "auto":
        return PLACEMENT_POD if single else PLACEMENT_TARGETED
    if setting == PLACEMENT_POD and path == PATH_ENDPOINT and not single:
        raise ConfigError("colocate:worker.placement", setting,
                          f"pod 0 is reached at {pod0_host}, a provider's shared proxy (anycast): Cloudflare's placement "
                          "probes cannot locate it (they are for single-homed hosts)",
                          "pulumi config set --path colocate:worker.placement targeted (the region's cloud hint), or "
                          "declare the box by its own address (colocate:pod.endpoints[0].ip on colocate:zone)")
    if setting == PLACEMENT_POD and path == PATH_PROVIDER_PROXY:
        raise ConfigError("colocate:worker.placement", setting,
                          "the pod is reached through RunPod's proxy hostname, which is anycast and shared by "
                          "many pods: Cloudflare's placement probes cannot locate it (they are for "
                          "single-homed hosts)",
                          "set colocate:zone (the kit then gives pod 0 a DNS-only record that placement can "
                          "probe), or pulumi config set --path colocate:worker.placement targeted (the "
                          "region's cloud hint)")
    return setting


@dataclass(frozen=True)
class WorkerPlan:
    account_id: str
    zone_id: str | None
    script_name: str
    main_module: str
    modules: tuple[Module, ...]
    compatibility_date: str
    # {"region": "gcp:asia-east1"}, {"mode": "smart"}, or in pod mode {"host": "<hostname>:<pod 0's
    # port>"}, the port filled from pod 0's output (``placement_host``; ``placement_args``)
    placement: dict
    bindings: tuple[Binding, ...]
    migrations: dict | None  # {"old_tag", "new_tag", "steps"}; None: nothing pending, send no block
    pending_migrations: tuple[str, ...]
    migration_warning: str | None  # the stack file's tag disagrees with the live one
    hostname: str | None  # custom domain when a zone is set, else workers.dev
    url: str  # where clients (and the probe) reach the Worker
    placement_mode: str = PLACEMENT_TARGETED  # pod | targeted | smart (auto already resolved)
    placement_host: PlacementHost | None = None  # pod mode only
    # WORKER_COMPATIBILITY_FLAGS only: a flag such as cots_on_external_fetch would put every external
    # fetch of the script (the fallback, /cdn-cgi/trace) on the zone's Custom Origin Trust Store (docs/worker.md).
    compatibility_flags: tuple[str, ...] = ()

    def placement_args(self, pod0: dict | None = None) -> dict:
        """The placement block as uploaded; pod mode needs pod 0's create output."""
        if self.placement_host is None:
            return dict(self.placement)
        if pod0 is None:
            raise ValueError("pod placement needs pod 0's create output (its public port)")
        return {"host": self.placement_host.value(pod0)}

    def binding(self, name: str) -> Binding:
        return next(b for b in self.bindings if b.name == name)

    def content_hash(self) -> str:
        return modules_hash(self.modules)


def modules_hash(modules: tuple[Module, ...]) -> str:
    """The Worker's content hash: its modules' names and bytes (``WorkerPlan.content_hash``)."""
    h = hashlib.sha256()
    for m in modules:
        h.update(m.name.encode() + b"\0" + m.content().encode() + b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class StatePlan:
    active: Generation
    hint: str
    draining: Generation | None
    draining_hint: str
    purge: tuple[str, ...]  # retired generations whose storage the next deploy purges


PATH_ZONE_DNS = "zone-dns"  # a DNS-only A record on colocate:zone, straight to the pod's public port
PATH_PROVIDER_PROXY = "provider-proxy"  # RunPod's HTTPS proxy hostname (through Cloudflare and RunPod's balancer)
PATH_LOCAL_HOSTNAME = "local-hostname"  # the sandbox: localhost, a name that resolves to 127.0.0.1
# An endpoint the team already runs (provider existing): its own name, or the kit's DNS-only record
# on the zone for its ip, on its own port, always https (colocate/cell/endpoints.py).
PATH_ENDPOINT = "endpoint"
POD_PATHS = (PATH_ZONE_DNS, PATH_PROVIDER_PROXY, PATH_LOCAL_HOSTNAME, PATH_ENDPOINT)
# Paths on which the Worker reaches the pod itself, so the hop can be mutual TLS end to end
# (docs/pods.md, "Who can reach the pod"): the pod serves a publicly trusted certificate for its
# name on the zone (ACME DNS-01, infra/hop.py) and admits only a client certificate of the cell's
# CA; the Worker verifies the pod with public trust and presents its certificate through its
# POD_TLS binding. Nothing in the zone trusts the cell's CA. RunPod's proxy terminates TLS itself
# and speaks HTTP to the pod: no client certificate can reach the pod that way, and the pod's
# guard (vLLM --middleware: the router's routes only, with the pod token) keeps strangers out.
MTLS_PATHS = (PATH_LOCAL_HOSTNAME, PATH_ZONE_DNS, PATH_ENDPOINT)
# Providers whose create request can carry the pod's TLS bundle (multi-line PEM) in the pod's
# environment: RunPod's `env` is a JSON object, and so is Vast.ai's as its API takes it (its
# OpenAPI spec says a string of Docker flags; docs/pods.md). A new provider joins this list
# only once it can; until then a mutual-TLS hop to it is refused by name. An existing endpoint's
# operator installs the bundle the kit writes (colocate/pods/existing.py).
MTLS_PROVIDERS = ("local", "runpod", "vastai", EXISTING)
POD_TLS_BINDING = "POD_TLS"
POD_TLS_FROM_OUTPUT = "pod.tls"  # marks the binding whose value is the Worker's client certificate


def hop_is_mtls(provider: str, path: str, setting: str) -> bool:
    """Whether the hop to the pods is mutual TLS (``colocate:pod.hop``).

    ``auto``: mutual TLS wherever the path and the provider can carry it; on RunPod's proxy, the
    pod token behind the pod's guard. ``mtls`` where it cannot be is refused, and so is ``token``
    on a zone: the pod's port is public there, and a token hop would be plain HTTP on it."""
    possible = path in MTLS_PATHS and provider in MTLS_PROVIDERS
    if setting == "token" and path == PATH_ZONE_DNS:
        raise ConfigError("colocate:pod.hop", setting,
                          "on colocate:zone the Worker reaches the pod at its public address, and a token hop would "
                          "send every prompt and the pod token there in plain HTTP; mutual TLS there needs nothing "
                          "from the zone but DNS (the pod's certificate is publicly trusted, issued by ACME DNS-01)",
                          "pulumi config rm --path colocate:pod.hop (auto: mutual TLS), or remove colocate:zone on a "
                          "RunPod cell (RunPod's proxy, with the pod's guard)")
    if setting != "mtls":
        return setting == "auto" and possible
    if path == PATH_PROVIDER_PROXY:
        raise ConfigError("colocate:pod.hop", setting,
                          "without colocate:zone the Worker reaches the pod through RunPod's proxy, which ends the "
                          "TLS itself and speaks HTTP to the pod: no client certificate can reach it",
                          "set colocate:zone (the Worker then reaches the pod by a DNS-only record, over mutual TLS), "
                          "or pulumi config set --path colocate:pod.hop auto (the pod token behind the pod's guard)")
    if not possible:
        raise ConfigError("colocate:pod.hop", setting,
                          f"a {provider} pod cannot be given its TLS certificate and key",
                          f"use a pod.provider among {', '.join(MTLS_PROVIDERS)}")
    return True


# The stock image's name: its entrypoint is `vllm serve`, with no pod guard (pod/Dockerfile adds it).
STOCK_IMAGE = "vllm/vllm-openai"


def check_guard_image(provider: str, path: str, setting: str, image: str) -> None:
    """Refuse the stock image where only the pod's guard keeps strangers out (RunPod's proxy): its
    ``vllm serve`` answers ``/invocations``, ``/tokenize`` and ``/metrics`` to whoever learns the
    pod's URL. The kit's image (pod/Dockerfile) always runs the guard."""
    if provider == EXISTING:  # the kit starts nothing there; its readiness check refuses an unguarded box
        return
    repository = image.split("@", 1)[0].rsplit(":", 1)[0] if "/" in image else image
    if pod_guarded(provider, path, setting) and repository.removeprefix("docker.io/") == STOCK_IMAGE:
        raise ConfigError("colocate:pod.image", image,
                          "without colocate:zone the pod is reached through RunPod's proxy, where only the pod's guard "
                          "keeps strangers off vLLM's routes that its --api-key leaves open (/invocations, /tokenize, "
                          "/metrics), and the stock image has no guard",
                          "build pod/Dockerfile, push it to a public registry and `pulumi config set --path "
                          "colocate:pod.image <registry>/colocate-vllm:v0.33.0-cu129` (docs/pods.md, \"The pod's "
                          "guard\"), or set colocate:zone (mutual TLS, any image)")


def pod_guarded(provider: str, path: str, setting: str) -> bool:
    """Whether the pod must run its guard (vLLM ``--middleware``: only the router's routes, only
    with the pod token; readiness's token reaches /health alone): every cloud pod no client
    certificate protects. The only such path is RunPod's proxy (``hop_is_mtls`` refuses the rest)."""
    return provider != "local" and not hop_is_mtls(provider, path, setting)


RUNPOD_PROXY_TEMPLATE = "https://{pod_id}-{port}.proxy.runpod.net"


def runpod_proxy_url(pod_id: str, internal_port: int, template: str = RUNPOD_PROXY_TEMPLATE) -> str:
    """RunPod's proxy address for a pod's HTTP port (docs.runpod.io, pods/configuration/expose-ports)."""
    return template.format(pod_id=pod_id, port=internal_port)


def pod_path(provider: str, zoned: bool) -> str:
    """Which path the Worker takes to a pod; refuses a provider with no hostname when no zone is set."""
    if provider == "local":
        return PATH_LOCAL_HOSTNAME
    if provider == EXISTING:
        return PATH_ENDPOINT
    if zoned:
        return PATH_ZONE_DNS
    if provider == "runpod":
        return PATH_PROVIDER_PROXY
    raise ConfigError("colocate:zone", None,
                      f"a {provider} pod has only an IP address and a deployed Worker cannot fetch an IP literal "
                      "(Cloudflare error 1003), so the Worker needs a DNS-only hostname for it on one of your zones",
                      "pulumi config set --path colocate:zone.id <zone id> and --path colocate:zone.name <example.com> "
                      "(the kit creates pod-<generation>.<zone> as a DNS-only record), or use pod.provider runpod "
                      "where the region has RunPod capacity")


def check_pod_cloud(provider: str, path: str, cloud: str) -> None:
    """A DNS-only record needs the pod's public ip, and a RunPod Community Cloud host may have
    none: REST v1's create had ``supportPublicIp`` for that; v2 has no such field, so the pod
    would run unreachable until readiness gave up. Refused before any pod is rented."""
    if provider == "runpod" and path == PATH_ZONE_DNS and cloud == "COMMUNITY":
        raise ConfigError("colocate:pod.cloud", cloud,
                          "with colocate:zone set the Worker reaches the pod at its public ip, and a RunPod "
                          "Community Cloud host may have none (RunPod's REST v2 cannot ask for one)",
                          "pulumi config set --path colocate:pod.cloud SECURE, or remove colocate:zone (the "
                          "Worker then uses RunPod's proxy hostname, which needs no public ip)")


def endpoint_named(endpoint: Endpoint, settings: Settings, generation: str, index: int) -> Endpoint:
    """An endpoint with the name the Worker fetches: its own host, or for an ip the kit's DNS-only record
    on the zone, named as a rented pod's slot (``pod_hostname_of``; settings refused an ip without a zone)."""
    if endpoint.host or settings.zone is None:
        return endpoint
    return replace(endpoint, host=pod_hostname_of(settings.zone.pod_hostname, generation, index))


def pod_hostname_of(template: str, generation: str, index: int) -> str:
    """Pod i's DNS-only hostname. Pod 0 keeps the template's name (so adding pods leaves
    its record alone); pod i>0 gets ``-p<i>`` on the first label, or fills ``{index}``."""
    host = template.format(generation=generation.replace(".", "-"), index=index)
    if index == 0 or "{index}" in template:
        return host
    first, _, rest = host.partition(".")
    return f"{first}-p{index}.{rest}"


TOKEN_FINGERPRINT_PREFIX = b"colocate:podToken fingerprint v1\0"


def cert_fingerprint(cert_pem: str) -> str:
    """The first 8 hex digits of the sha256 of a certificate's PEM: public, as the certificate is."""
    return hashlib.sha256(cert_pem.encode()).hexdigest()[:8]


def token_fingerprint(token: str) -> str:
    """A short digest of ``colocate:podToken`` that tells a rotated token apart (the pod
    must then be replaced) without declaring the token. The fixed prefix keeps it off
    generic sha256 tables; like the pod's own 401, it can confirm a guess of a weak token,
    so the token should be random (README: ``openssl rand -hex 24``)."""
    return hashlib.sha256(TOKEN_FINGERPRINT_PREFIX + token.encode()).hexdigest()[:8]


def pod_scope(organization: str, project: str) -> str:
    """Six hex digits naming the Pulumi organization and project a stack belongs to: two projects (or
    organizations) with a stack of the same name on one provider account keep apart (sweep, adoption)."""
    return hashlib.sha256(f"colocate pod scope v1\0{organization}\0{project}".encode()).hexdigest()[:6]


def pod_name(stack: str, generation: str, index: int, identity: list[str], scope: str = "") -> str:
    """``colocate-<stack>-<scope>-<generation>-p<i>-<digest of the identity>`` (sweep's pattern; without
    a scope, the sandbox's and earlier releases', ``colocate-<stack>-<generation>-...``)."""
    digest = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:6]
    scoped = f"{stack}-{scope}" if scope else stack
    return f"colocate-{scoped}-{generation}-p{index}-{digest}".replace(".", "-").replace("_", "-").lower()


@dataclass(frozen=True)
class PodPlan:
    """One pod of the cell. ``index`` is stable: pod i keeps its name, triggers and
    binding position when the count changes, so only the pods concerned are touched."""

    index: int
    name: str
    stack: str
    region: str
    generation: str
    settings: PodSettings
    locations: tuple[str, ...]
    pod_hostname: str | None  # DNS-only hostname the Worker uses (path zone-dns)
    path: str = PATH_ZONE_DNS  # how the Worker reaches this pod: one of POD_PATHS
    # token_fingerprint(colocate:podToken); "" where the plan is built without the token
    # (the sandbox, `migrate.py plan`). infra/cell.py fills it from the secret.
    token_fingerprint: str = ""
    # cert_fingerprint(the pod's certificate) on a mutual-TLS hop, filled by infra/hop.py: the pod
    # reads its certificate once, at start, so a re-issued one must replace the pod. "" elsewhere.
    tls_fingerprint: str = ""
    # False while the pod drains before a scale-down (colocate:scale.draining): still
    # declared and running, no longer in the Worker's POD_URLS. Not part of the identity.
    in_rotation: bool = True
    scope: str = ""  # pod_scope(organization, project) in the cloud; "" in the sandbox
    # provider existing: the endpoint this pod is, its ``host`` the name the Worker fetches (the
    # declared one, or the kit's record on the zone for its ip). None for a pod the kit rents.
    endpoint: Endpoint | None = None

    @property
    def market(self) -> PodMarket:
        """How this pod is rented (colocate:pod.market; colocate/cell/market.py)."""
        return self.settings.market_of(self.index)

    def worker_url(self, created: dict) -> str:
        """The URL the Worker uses for the pod, from ``pod.py create``'s output.

        Always a hostname: a deployed Worker cannot fetch an IP literal (Cloudflare's
        Workers known issues: error 1003). ``zone-dns``: the DNS-only record on the pod's
        public port (providers map ports, so the port is only known once the pod exists;
        custom ports need allow_custom_ports, the default from 2024-09-02).
        ``provider-proxy``: RunPod's proxy hostname on the pod's own (internal) port.
        ``local-hostname``: ``localhost`` on the stand-in's port.
        """
        if self.endpoint is not None:  # always https: the box's TLS (mutual, or its own)
            return f"https://{self.endpoint.host}:{self.endpoint.port}"
        scheme = "https" if self.mtls else "http"
        if self.path == PATH_ZONE_DNS:
            return f"{scheme}://{self.host(created)}:{created['port']}"
        if self.path == PATH_PROVIDER_PROXY:
            return runpod_proxy_url(created["id"], self.settings.port)
        return f"{scheme}://localhost:{created['port']}"

    @property
    def mtls(self) -> bool:
        """Whether the hop to this pod is mutual TLS (``hop_is_mtls``)."""
        return hop_is_mtls(self.settings.provider, self.path, self.settings.hop)

    def host(self, created: dict) -> str:
        """On ``zone-dns``, the DNS-only record's name for the instance ``created`` (``pod.py``'s output):
        ``instance_host`` under ``pod_hostname``, so every new instance has a name of its own."""
        assert self.pod_hostname is not None, "only a zone-dns pod has a hostname"
        return instance_host(self.pod_hostname, self.settings.provider, str(created["id"]))

    @property
    def tls_name(self) -> str:
        """The name the pod's certificate carries: the one the Worker fetches it by. On ``zone-dns``
        the instance's label is known only once it exists, after its certificate was issued, so the
        certificate names every label under ``pod_hostname`` (``*.``): one level, that pod's slot only."""
        if not self.mtls:
            return ""
        if self.endpoint is not None:  # known before it serves: the certificate names it exactly
            return self.endpoint.host
        return f"*.{self.pod_hostname}" if self.path == PATH_ZONE_DNS and self.pod_hostname else "localhost"

    def spec(self) -> dict:
        """The JSON request ``scripts/pod.py create --spec`` receives. Holds no secret."""
        s = self.settings
        return {
            "name": self.name,
            "stack": self.stack,
            "region": self.region,
            "generation": self.generation,
            "provider": s.provider,
            "locations": list(self.locations),
            "gpu": s.gpu,
            "gpu_count": s.gpu_count,
            "image": s.image,
            "min_cuda_version": s.min_cuda_version,
            "model": s.model,
            "port": self.endpoint.port if self.endpoint is not None else s.port,
            "disk_gb": s.disk_gb,
            "max_price_per_hr": s.max_price_per_hr,
            "max_transfer_per_gb": s.max_transfer_per_gb,
            "cloud": s.cloud,
            "min_reliability": s.min_reliability,
            "ready_timeout_s": s.ready_timeout_s,
            "compute_ms": s.compute_ms,
            "profile": s.profile,
            "index": self.index,
            "path": self.path,
            "tls_name": self.tls_name,
            "max_model_len": s.max_model_len,
            "command": s.command,
            "url": s.url,
            "market": self.market.market,
            "on_demand_fallback": self.market.on_demand_fallback,
            "bid_per_hr": s.bid_per_hr,
            "endpoint": self.endpoint_spec() if self.endpoint is not None else None,
        }

    def endpoint_spec(self) -> dict:
        """An existing endpoint as ``scripts/pod.py`` checks it (colocate/pods/existing.py)."""
        e = self.endpoint
        assert e is not None
        return {"host": e.host, "ip": e.ip, "port": e.port, "location": e.location, "cost_per_hr": e.cost_per_hr}

    def identity(self) -> list[str]:
        """What makes the pod the pod it is: everything its create request fixes for its
        life (vLLM reads its port and key once, at start). The name's digest and the
        triggers both come from this list, so they change together: a change replaces the
        pod under a new name. A name kept across a change would be fatal: the new pod's
        create adopts the live pod of that name, then the old one's delete destroys it.
        Placement criteria (maxPricePerHr, minReliability, readyTimeoutS, locations) are
        left out on purpose: they choose where the next pod goes, not what a running pod is.
        ``pod.renewal`` is in it only to be changed: the owner's way to get new pods under
        new names (a sick pod, a lower price cap now). At 0 it adds nothing, so the names of
        pods placed before the key existed stay as they are.
        """
        s = self.settings
        if self.endpoint is not None:  # what the Worker reaches and how; the box is the team's, not a spec's
            e = self.endpoint
            ident = [self.region, s.provider, self.generation, f"endpoint={e.host}:{e.port}", f"path={self.path}"]
            if e.ip:
                ident.append(f"ip={e.ip}")
        else:
            ident = [self.region, s.provider, s.gpu, str(s.gpu_count), s.image, s.model, self.generation,
                     f"port={s.port}", f"diskGb={s.disk_gb}", f"cloud={s.cloud}", f"path={self.path}"]
        if s.provider == "local":  # the stand-in's compute time; a GPU pod ignores it
            ident.append(f"computeMs={s.compute_ms}")
            if s.profile != "oracle":  # the first profile adds nothing: names of pods placed before stay
                ident.append(f"profile={s.profile}")
        if s.max_model_len != MAX_MODEL_LEN:  # the default adds nothing: names of pods placed before stay
            ident.append(f"maxModelLen={s.max_model_len}")
        if s.command or s.url:  # the sandbox's pod is a server of the user's
            engine = hashlib.sha256("\0".join((s.command, s.url)).encode()).hexdigest()[:12]
            ident.append(f"engine={engine}")
        if self.mtls:  # the pod's start command and certificate
            ident.append("hop=mtls")
        if self.market.interruptible:  # a running pod cannot change how it is rented (on demand adds nothing)
            ident.append(f"market={self.market.market}")
        if s.renewal:
            ident.append(f"renewal={s.renewal}")
        replaced = 0 if self.endpoint is not None else s.replaced_count(self.index)  # the kit replaces no endpoint
        if replaced:  # the keeper's replacements of this pod alone (colocate/scaling/keeper.py)
            ident.append(f"replaced={replaced}")
        if self.token_fingerprint:
            ident.append(f"podToken=sha256:{self.token_fingerprint}")
        if self.tls_fingerprint:
            ident.append(f"cert=sha256:{self.tls_fingerprint}")
        return ident

    def triggers(self) -> list[str]:
        # Any change here replaces the pod (create the new one, then delete the old).
        return self.identity() + [f"pod-{self.index}"]

    def with_tls_fingerprint(self, fingerprint: str) -> PodPlan:
        """This pod for a given certificate of its own (``cert_fingerprint``): a re-issued
        certificate renames and replaces the pod, which cannot load a new one while it runs."""
        return replace(self, tls_fingerprint=fingerprint).with_derived_name()

    def with_token_fingerprint(self, fingerprint: str) -> PodPlan:
        """This pod for a given pod token: the fingerprint joins the identity, so the name
        and the triggers change when the token is rotated (the running pod keeps the key
        it started with; adopting it would answer every forward with 401)."""
        return replace(self, token_fingerprint=fingerprint).with_derived_name()

    def with_derived_name(self) -> PodPlan:
        """This pod named after its identity (``pod_name``)."""
        return replace(self, name=pod_name(self.stack, self.generation, self.index, self.identity(), self.scope))


PROBE_WAIT_S = 120  # a new route or custom domain can take a while to answer after a deploy
# The post-deploy probe follows a placement settings call (every upload re-applies it), and
# Cloudflare applies a new placement some time later: wait this long for the Worker's colo
# to settle before judging it; unsettled, a failed placement check is only provisional.
PROBE_SETTLE_S = 300


@dataclass(frozen=True)
class ProbePlan:
    region: str
    expected_colos: tuple[str, ...]
    budgets: dict[str, float]
    samples: int
    enforce: bool
    floor_ms: dict[str, float]  # expected floors for an in-region cell

    pod_path: str = PATH_ZONE_DNS  # reported by the probe next to the measured pod_rtt
    placement_mode: str = PLACEMENT_TARGETED  # reported by the probe; pod mode adds the pod check
    # A scaling step's update (colocate/scaling/controller.py): the probe reports but cannot fail it, and waits
    # for nothing to settle: the step runs under the load that called for it, placement unchanged.
    step: bool = False

    def argv(self, url: str, pod_locations: list[str], placement_host: str | None = None,
             hop_not_after: str | None = None) -> list[str]:
        """The post-deploy probe's arguments (the read token travels in COLOCATE_READ_TOKEN);
        one --pod-location per pod, in index order; ``placement_host`` (pod mode) is the
        ``host:port`` Cloudflare was given; ``hop_not_after`` the hop certificates' earliest end."""
        args = ["scripts/probe.py", url, "--expect-region", self.region, "--samples", str(self.samples)]
        for location in pod_locations:
            args += ["--pod-location", location]
        args += ["--pod-path", self.pod_path, "--placement-mode", self.placement_mode]
        if placement_host:
            args += ["--placement-host", placement_host]
        if hop_not_after:
            args += ["--hop-not-after", hop_not_after]
        for name, ms in sorted(self.budgets.items()):
            args += ["--budget", f"{name}={ms:g}"]
        if not self.step:
            args += ["--wait", str(PROBE_WAIT_S)]
        if self.placement_mode != PLACEMENT_SMART and not self.step:  # smart placement learns from traffic
            args += ["--settle", str(PROBE_SETTLE_S)]
        args += ["--json", "-"]
        if not self.enforce or self.step:
            args.append("--warn-only")  # report, but let the deploy finish
        return args


@dataclass(frozen=True)
class CellPlan:
    stack: str
    region: Region
    worker: WorkerPlan
    state: StatePlan
    pods: tuple[PodPlan, ...]  # pod.count pods (colocate:scale: pods + draining), index order
    probe: ProbePlan
    pod_path: str = PATH_ZONE_DNS  # how the Worker reaches the pods (one of POD_PATHS), even with none
    pod_settings: PodSettings | None = None  # what every pod is made of, even with none
    # The ACME directory that issues the pods' certificates (DNS-01 on colocate:zone); None off zone-dns.
    acme_server: str | None = None
    scope: str = ""  # pod_scope of the stack's organization and project, in every pod's name

    @property
    def mtls(self) -> bool:
        """Whether the hop to the pods is mutual TLS (the stack then declares its certificates)."""
        s = self.pod_settings
        return s is not None and hop_is_mtls(s.provider, self.pod_path, s.hop)

    @property
    def pod(self) -> PodPlan:
        """Pod 0 (a cell with a fixed count has at least one; a scaled one may have none)."""
        return self.pods[0]

    @property
    def serving(self) -> tuple[PodPlan, ...]:
        """The pods in the Worker's POD_URLS: all but those draining (colocate:scale.draining)."""
        return tuple(p for p in self.pods if p.in_rotation)

    @property
    def sweep_provider(self) -> str | None:
        """The provider whose pods of this stack that no declared pod holds are deleted after each
        change of the pods (a rent killed mid-request whose spec then changed: docs/pods.md, "Never
        orphan"); None without pods, for local stand-ins, which are this machine's processes, and for
        existing endpoints, which the kit never deletes."""
        s = self.pod_settings
        return s.provider if self.pods and s is not None and s.provider not in ("local", EXISTING) else None


def module_closure(directory: Path, main: str) -> tuple[Module, ...]:
    """``main`` and every module it imports, transitively: main first, then by name (the
    upload order). Only what the entry reaches is uploaded, so the cell's router and the
    fleet's front door, which share the folder, each carry their own modules only."""
    found: list[str] = []
    todo = [main]
    while todo:
        name = todo.pop(0)
        if name in found:
            continue
        path = directory / name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the Worker sources are part of the kit")
        found.append(name)
        todo += _IMPORT_RE.findall(path.read_text())
    return tuple(Module(n, directory / n) for n in [found[0], *sorted(found[1:])])


_IMPORT_RE = re.compile(r'^\s*(?:import|export)\b[^;]*?from\s+"\./([A-Za-z0-9_.-]+\.js)"', re.M | re.S)


def worker_modules(directory: Path = WORKER_DIR) -> tuple[Module, ...]:
    """The router's ES modules: ``index.js`` and what it imports, main module first."""
    return module_closure(directory, MAIN_MODULE)


@dataclass(frozen=True)
class MigrationDecision:
    """What the next upload carries, from the live tag (Cloudflare) and the stack file's."""

    migrations: dict | None  # None: nothing pending, the upload carries no migrations block
    pending: tuple[str, ...]
    applied: str  # the tag the decision starts from ("" = none applied yet)
    source: str  # "cloudflare" or "stack-file" (offline fallback)
    warning: str | None = None


def migration_decision(live: str | None, file_tag: str = "", *, script: str = "",
                       allow_class_deletion: bool = False,
                       migrations: tuple[tuple[str, dict], ...] | None = None) -> MigrationDecision:
    """The pending Durable Object migration steps.

    ``live`` is the tag Cloudflare reports for the script: "" when the script does not
    exist yet or has applied none, None when it could not be read (offline), in which case
    the stack file's ``colocate:worker.migrationTag`` is the fallback. When both are known
    and differ, Cloudflare wins and the decision carries a warning. ``migrations``: another
    script's list (a fleet's front door, ``colocate.fleet.plan.LEDGER_MIGRATIONS``); default the cell's.
    """
    all_steps = MIGRATIONS if migrations is None else migrations
    tags = [t for t, _ in all_steps]
    known = ", ".join(tags)
    if file_tag and file_tag not in tags:
        raise ConfigError("colocate:worker.migrationTag", file_tag, "not a tag this kit ever applied",
                          f"remove it (the kit reads the applied tag from Cloudflare), or set one of {known}")
    warning = None
    if live is None:
        applied, source = file_tag, "stack-file"
    else:
        applied, source = live, "cloudflare"
        if applied not in ("", *tags):
            raise ConfigError("colocate:worker.name", script or None,
                              f"Cloudflare reports Durable Object migration tag {applied!r} on this script, "
                              f"which this kit never applied (its tags: {known}); another tool or a newer kit "
                              "deployed it, and uploading now would rewind its classes",
                              "deploy with the kit version that wrote that tag, or pick another "
                              "colocate:worker.name for this cell")
        if file_tag and file_tag != live:
            warning = (f"colocate:worker.migrationTag is {file_tag!r} in the stack file but Cloudflare reports "
                       f"{live or 'no tag'!r} on {script or 'the script'}; using Cloudflare's. The stack-file value "
                       "is only an offline fallback: remove it or update it.")
    start = tags.index(applied) + 1 if applied else 0
    steps = [dict(step) for _, step in all_steps[start:]]
    if any("deleted_classes" in step for step in steps) and not allow_class_deletion:
        raise ConfigError("colocate:worker.allowClassDeletion", False, "a pending migration deletes a class and all its objects",
                          "set colocate:worker.allowClassDeletion true only if that data may go")
    # As wrangler does: nothing pending, no migrations block at all (an empty step list
    # with old_tag == new_tag is not the same request).
    block = {"old_tag": applied or None, "new_tag": tags[-1], "steps": steps} if steps else None
    return MigrationDecision(block, tuple(tags[start:]), applied, source, warning)


def hint_of(gen: Generation) -> str:
    return "" if gen.region == UNKNOWN_REGION else lookup_region(gen.region).location_hint


# The Worker's operator credentials by role (worker/src/config.js, admin.js).
OPERATOR_BINDINGS = {"read": "READ_TOKEN", "admin": "ADMIN_TOKEN", "exchange": "EXCHANGE_TOKEN"}


# The context the kit's pods serve by default (colocate:pod.maxModelLen: vLLM --max-model-len,
# colocate/pods/spec.py), bound as the Worker's MAX_MODEL_LEN: what a request may cost is bounded by
# it (docs/worker.md, "What a request may cost").
MAX_MODEL_LEN = 8192


def worker_bindings(settings: Settings, state: StatePlan, path: str = PATH_ZONE_DNS) -> tuple[Binding, ...]:
    w = settings.worker
    plain = [
        ("CELL_REGION", settings.region.name),
        ("ACTIVE_GENERATION", state.active.name),
        ("ACTIVE_HINT", state.hint),
    ]
    if state.draining:
        plain += [("DRAINING_GENERATION", state.draining.name), ("DRAINING_HINT", state.draining_hint)]
    plain += [
        ("DEADLINE_MS", str(w.deadline_ms)),
        ("STALL_MS", str(w.stall_ms)),
        ("MIN_TOKENS_PER_S", repr(w.min_tokens_per_s)),
        ("BALANCE", w.balance),
        ("MAX_BODY_BYTES", str(w.max_body_bytes)),
        ("BODY_TIMEOUT_MS", str(w.body_timeout_ms)),
        ("FAILURE_THRESHOLD", str(w.failure_threshold)),
        ("OPEN_MS", str(w.open_ms)),
        ("STATE_TTL_MS", str(w.state_ttl_ms)),
        ("SERVED_KEEP_MS", str(w.served_keep_ms)),
        ("PREFIX_BOUND", repr(w.prefix_bound)),
        ("DEFAULT_RPM", str(settings.key_defaults["rpm"])),
        ("DEFAULT_TPM", str(settings.key_defaults["tpm"])),
        ("DEFAULT_MONTHLY_TOKENS", str(settings.key_defaults["monthly_tokens"])),
        ("DEFAULT_MAX_PARALLEL", str(settings.key_defaults["max_parallel"])),
        ("DEFAULT_MAX_PARALLEL_TOKENS", str(settings.key_defaults["max_parallel_tokens"])),
        # What a request may cost is bounded by the context the pods serve (worker/src/usage.js).
        ("MAX_MODEL_LEN", str(settings.pod.max_model_len)),
    ]
    if w.content_parts:
        plain.append(("CONTENT_PARTS", json.dumps(list(w.content_parts))))
    if settings.fallback_fields:
        plain.append(("FALLBACK_FIELDS", json.dumps(list(settings.fallback_fields))))
    if settings.fallback_model:
        plain.append(("FALLBACK_MODEL", settings.fallback_model))
    if settings.fallback_price is not None:
        # The fallback's spend is counted at this price, and capped per day (colocate:fallbackCap).
        plain.append(("FALLBACK_PRICE", json.dumps({"input": settings.fallback_price[0], "output": settings.fallback_price[1]})))
        cell_cap, key_cap = settings.fallback_cap
        plain += [("FALLBACK_CELL_CAP_USD", repr(cell_cap)), ("FALLBACK_KEY_CAP_USD", repr(key_cap)),
                  # a new key's own daily cap (colocate:keys.defaults.fallbackUsdPerDay), in millionths of a dollar
                  ("DEFAULT_FALLBACK_MICROUSD", str(settings.key_defaults["fallback_microusd_day"]))]
    if settings.fallback_models:
        # passthrough: the client models the fallback may be sent, each with its own price or null (FALLBACK_PRICE's)
        plain.append(("FALLBACK_MODELS", json.dumps({m: None if p is None else {"input": p[0], "output": p[1]}
                                                     for m, p in settings.fallback_models.items()})))
    bindings = [Binding(GENERATION_BINDING, "durable_object_namespace", class_name=BREAKER_CLASS)]
    bindings += [Binding(name, "plain_text", text=value) for name, value in plain]
    bindings.append(Binding("POD_URLS", "plain_text", from_output=POD_URLS_FROM_OUTPUT))
    bindings += [
        Binding("POD_TOKEN", "secret_text", secret="podToken"),
        Binding("FALLBACK_URL", "secret_text", secret="fallbackUrl"),
        Binding("FALLBACK_API_KEY", "secret_text", secret="fallbackApiKey"),
        *(Binding(name, "secret_text", secret=settings.operator_secrets[role]) for role, name in OPERATOR_BINDINGS.items()),
    ]
    if LEGACY_TOKEN in settings.operator_secrets.values():
        # A stack still on the one old token: the Worker of the release before reads only this.
        bindings.append(Binding("PROBE_TOKEN", "secret_text", secret=LEGACY_TOKEN))
    if hop_is_mtls(settings.pod.provider, path, settings.pod.hop):
        bindings.append(Binding(POD_TLS_BINDING, "mtls_certificate", from_output=POD_TLS_FROM_OUTPUT))
    return tuple(bindings)


# The setting behind each binding whose value can grow (named when a limit refuses it).
BINDING_KEYS = {"FALLBACK_MODEL": "colocate:fallbackModel", "FALLBACK_MODELS": "colocate:fallbackModels",
                "POD_URLS": "colocate:pod.count"}


def binding_key(binding: Binding) -> str:
    return f"colocate:{binding.secret}" if binding.secret else BINDING_KEYS.get(binding.name, "colocate:worker")


def check_worker_limits(worker: WorkerPlan) -> None:
    """The cell's Worker against Cloudflare's upload limits; the values known only once
    resources exist (secrets, the pods' URLs) are checked by the program as they resolve."""
    cloudflare_limits.check_worker(
        worker.script_name, [(m.name, m.content().encode()) for m in worker.modules],
        [(b.name, b.type, b.text) for b in worker.bindings],
        {b.name: binding_key(b) for b in worker.bindings}, "colocate:worker.name")


def plan_cell(settings: Settings, worker_dir: Path = WORKER_DIR, *, live_migration_tag: str | None = None,
              scope: str = "") -> CellPlan:
    """Derive the whole cell from validated settings.

    ``scope`` (``pod_scope``: the Pulumi program passes its organization's and project's) goes into
    every pod's name, so sweeps and adoption never reach another project's stack of the same name.

    ``live_migration_tag`` is the tag Cloudflare reports for the Worker ("" when it has
    none or does not exist); None (the sandbox, or Cloudflare unreachable) falls back to
    the stack file's colocate:worker.migrationTag.
    """
    reg = settings.region
    ledger = settings.ledger
    state = StatePlan(
        active=ledger.active,
        hint=hint_of(ledger.active) or reg.location_hint,
        draining=ledger.draining,
        draining_hint=hint_of(ledger.draining) if ledger.draining else "",
        purge=tuple(g.name for g in ledger.retired),
    )
    gen = ledger.active.name
    path = pod_path(settings.pod.provider, settings.zone is not None)
    check_pod_cloud(settings.pod.provider, path, settings.pod.cloud)
    hop_is_mtls(settings.pod.provider, path, settings.pod.hop)  # refuses a hop the path cannot carry
    check_guard_image(settings.pod.provider, path, settings.pod.hop, settings.pod.image)
    locations = reg.locations(settings.pod.provider)
    endpoints = [endpoint_named(e, settings, gen, i) for i, e in enumerate(settings.pod.endpoints)]
    # The name carries a digest of what identifies the pod (PodPlan.identity): a replacement
    # (say, a new image in the same generation) gets a new name, so `create` never adopts
    # the pod that the replacement's `delete` is about to remove.
    pods = tuple(
        PodPlan(
            index=i,
            name="",
            stack=settings.stack,
            region=reg.name,
            generation=gen,
            settings=settings.pod,
            # Pod i prefers the region's i-th location (spread), the others stay as capacity fallbacks;
            # an endpoint is where it is.
            locations=(endpoints[i].location,) if endpoints else
            locations[i % len(locations):] + locations[:i % len(locations)],
            pod_hostname=endpoints[i].host if endpoints else pod_hostname_of(settings.zone.pod_hostname, gen, i)
            if path == PATH_ZONE_DNS and settings.zone is not None else None,
            path=path,
            in_rotation=settings.scale is None or i < settings.scale.pods,
            scope=scope,
            endpoint=endpoints[i] if endpoints else None,
        ).with_derived_name()
        for i in range(settings.pod.count)
    )
    decision = migration_decision(live_migration_tag, settings.worker.migration_tag, script=settings.worker.name,
                                  allow_class_deletion=settings.worker.allow_class_deletion)
    mode = placement_mode(settings.worker.placement, path, endpoints[0].host if endpoints else "")
    if mode == PLACEMENT_POD and settings.scale is not None and settings.scale.min == 0:
        # Pod 0 comes and goes with demand: the Worker cannot follow an address that may not exist.
        if settings.worker.placement == PLACEMENT_POD:
            raise ConfigError("colocate:worker.placement", settings.worker.placement,
                              "'pod' follows pod 0, and colocate:scale.min 0 lets the cell run without pod 0",
                              "pulumi config set --path colocate:worker.placement targeted, or colocate:scale.min 1")
        mode = PLACEMENT_TARGETED
    placement_host = None
    if mode == PLACEMENT_POD:
        pod = pods[0]
        placement_host = PlacementHost(pod.pod_hostname or "localhost", pod.index,
                                       instance_of=settings.pod.provider if pod.pod_hostname and path == PATH_ZONE_DNS
                                       else "")
        placement = {"host": placement_host.describe()}
    elif mode == PLACEMENT_SMART:
        placement = {"mode": "smart"}
    else:
        placement = {"region": reg.placement_region}
    modules = worker_modules(worker_dir)
    worker = WorkerPlan(
        account_id=settings.account_id,
        zone_id=settings.zone.id if settings.zone else None,
        script_name=settings.worker.name,
        main_module=MAIN_MODULE,
        modules=modules,
        compatibility_date=COMPATIBILITY_DATE,
        compatibility_flags=WORKER_COMPATIBILITY_FLAGS,
        placement=placement,
        # The Worker says which code it runs (GET /_colocate/scale's worker_hash): a controller
        # whose checkout would upload other code refuses to act (colocate/scaling/keeper.py).
        bindings=(*worker_bindings(settings, state, path), Binding(WORKER_HASH_BINDING, "plain_text",
                                                                  text=modules_hash(modules))),
        migrations=decision.migrations,
        pending_migrations=decision.pending,
        migration_warning=decision.warning,
        hostname=settings.zone.worker_hostname if settings.zone else None,
        url=(f"https://{settings.zone.worker_hostname}" if settings.zone
             else f"https://{settings.worker.name}.{settings.worker.subdomain}.workers.dev"),
        placement_mode=mode,
        placement_host=placement_host,
    )
    check_worker_limits(worker)
    pod_site = reg.site_of(pods[0].locations[0] if pods else locations[0])  # pod 0's, whether or not it runs now
    probe = ProbePlan(
        region=reg.name,
        expected_colos=reg.in_region_colos,
        budgets=dict(settings.budgets),
        samples=settings.samples,
        enforce=settings.enforce,
        floor_ms={"state_rtt": 0.0, "pod_rtt": round(geo.floor_ms(reg.edge_site, pod_site), 2)},
        pod_path=path,
        placement_mode=mode,
    )
    return CellPlan(settings.stack, reg, worker, state, pods, probe, pod_path=path, pod_settings=settings.pod,
                    acme_server=settings.zone.acme_server if path in (PATH_ZONE_DNS, PATH_ENDPOINT) and settings.zone
                    else None,
                    scope=scope)
