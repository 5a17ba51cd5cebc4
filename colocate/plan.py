"""The cell plan: settings in, everything a cell is made of out. Pure Python, no Pulumi.

Both realisations consume the same ``CellPlan``: the Pulumi program (``infra/``)
declares it in the cloud, the sandbox (``scripts/sandbox.py``) runs it on this machine.
If they ever needed different plans, this module would be wrong.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from . import geo
from .catalogue import Region, region as lookup_region
from .errors import ConfigError
from .ledger import UNKNOWN_REGION, Generation
from .settings import PodSettings, Settings

ROOT = Path(__file__).resolve().parent.parent
WORKER_DIR = ROOT / "worker" / "src"
MAIN_MODULE = "index.js"
BREAKER_CLASS = "Breaker"
# allow_custom_ports (the pod listens on :8000) is the default from 2024-09-02;
# the date is also the newest the pinned workerd (1.20261117.1) accepts.
COMPATIBILITY_DATE = "2026-11-01"
# The kit's Durable Object migrations, in order. Tags are applied once each; the
# provider keeps no record of them (write-only in its state), so the stack file does
# (colocate:worker.migrationTag). Steps only ever add: nothing here deletes a class.
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
    type: str  # plain_text | secret_text | durable_object_namespace
    text: str | None = None
    secret: str | None = None
    class_name: str | None = None
    from_output: str | None = None


@dataclass(frozen=True)
class Module:
    name: str
    path: Path

    def content(self) -> str:
        return self.path.read_text()


@dataclass(frozen=True)
class WorkerPlan:
    account_id: str
    zone_id: str | None
    script_name: str
    main_module: str
    modules: tuple[Module, ...]
    compatibility_date: str
    placement: dict  # {"region": "gcp:asia-east1"} or {"mode": "smart"}
    bindings: tuple[Binding, ...]
    migrations: dict  # {"old_tag", "new_tag", "steps"}
    pending_migrations: tuple[str, ...]
    hostname: str | None  # custom domain when a zone is set, else workers.dev
    url: str  # where clients (and the probe) reach the Worker

    def binding(self, name: str) -> Binding:
        return next(b for b in self.bindings if b.name == name)

    def content_hash(self) -> str:
        h = hashlib.sha256()
        for m in self.modules:
            h.update(m.name.encode() + b"\0" + m.path.read_bytes() + b"\0")
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class StatePlan:
    active: Generation
    hint: str
    draining: Generation | None
    draining_hint: str
    purge: tuple[str, ...]  # retired generations whose storage the next deploy purges


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
    pod_hostname: str | None  # DNS-only hostname the Worker uses, when a zone is set

    def worker_url(self, created: dict) -> str:
        """The URL the Worker uses for the pod, from ``pod.py create``'s output.

        With a zone: the DNS-only hostname on the pod's public port (providers map ports,
        so it is only known once the pod exists; custom ports need allow_custom_ports,
        the default from 2024-09-02). Without one: the address the provider reports.
        """
        if self.pod_hostname:
            return f"http://{self.pod_hostname}:{created['port']}"
        if self.settings.provider == "local":
            # A hostname, as on Cloudflare (Workers cannot fetch IP literals).
            return f"http://localhost:{created['port']}"
        return created["url"]

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
            "model": s.model,
            "port": s.port,
            "disk_gb": s.disk_gb,
            "max_price_per_hr": s.max_price_per_hr,
            "cloud": s.cloud,
            "min_reliability": s.min_reliability,
            "ready_timeout_s": s.ready_timeout_s,
            "compute_ms": s.compute_ms,
            "index": self.index,
        }

    def triggers(self) -> list[str]:
        # Any change here replaces the pod (create the new one, then delete the old).
        return _pod_identity(self.region, self.settings, self.generation) + [f"pod-{self.index}"]


def _pod_identity(region: str, s: PodSettings, generation: str) -> list[str]:
    return [region, s.provider, s.gpu, str(s.gpu_count), s.image, s.model, generation]


PROBE_WAIT_S = 120  # a new route or custom domain can take a while to answer after a deploy


@dataclass(frozen=True)
class ProbePlan:
    region: str
    expected_colos: tuple[str, ...]
    budgets: dict[str, float]
    samples: int
    enforce: bool
    floor_ms: dict[str, float]  # expected floors for an in-region cell

    def argv(self, url: str, pod_location: str) -> list[str]:
        """The post-deploy probe's arguments (the token travels in COLOCATE_PROBE_TOKEN)."""
        args = ["scripts/probe.py", url, "--expect-region", self.region, "--samples", str(self.samples),
                "--pod-location", pod_location]
        for name, ms in sorted(self.budgets.items()):
            args += ["--budget", f"{name}={ms:g}"]
        args += ["--wait", str(PROBE_WAIT_S), "--json", "-"]
        if not self.enforce:
            args.append("--warn-only")  # report, but let the deploy finish
        return args


@dataclass(frozen=True)
class CellPlan:
    stack: str
    region: Region
    worker: WorkerPlan
    state: StatePlan
    pods: tuple[PodPlan, ...]  # pod.count pods, index order
    probe: ProbePlan

    @property
    def pod(self) -> PodPlan:
        """Pod 0 (every cell has at least one)."""
        return self.pods[0]


def worker_modules(directory: Path = WORKER_DIR) -> tuple[Module, ...]:
    """Every ES module of the router, main module first (the upload order)."""
    files = sorted(directory.glob("*.js"), key=lambda p: (p.name != MAIN_MODULE, p.name))
    if not files or files[0].name != MAIN_MODULE:
        raise FileNotFoundError(f"{directory / MAIN_MODULE} is missing: the Worker sources are part of the kit")
    return tuple(Module(p.name, p) for p in files)


def migrations_after(applied: str, allow_class_deletion: bool = False) -> tuple[dict, tuple[str, ...]]:
    tags = [t for t, _ in MIGRATIONS]
    if applied and applied not in tags:
        raise ConfigError("colocate:worker.migrationTag", applied, "not a tag this kit ever applied",
                          f"set it to the Worker's current tag, one of {', '.join(tags)}")
    start = tags.index(applied) + 1 if applied else 0
    steps = [dict(step) for _, step in MIGRATIONS[start:]]
    if any("deleted_classes" in step for step in steps) and not allow_class_deletion:
        raise ConfigError("colocate:worker.allowClassDeletion", False, "a pending migration deletes a class and all its objects",
                          "set colocate:worker.allowClassDeletion true only if that data may go")
    migrations = {"old_tag": applied or None, "new_tag": tags[-1], "steps": steps}
    return migrations, tuple(tags[start:])


def hint_of(gen: Generation) -> str:
    return "" if gen.region == UNKNOWN_REGION else lookup_region(gen.region).location_hint


def worker_bindings(settings: Settings, state: StatePlan) -> tuple[Binding, ...]:
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
        ("MAX_BODY_BYTES", str(w.max_body_bytes)),
        ("FAILURE_THRESHOLD", str(w.failure_threshold)),
        ("OPEN_MS", str(w.open_ms)),
        ("STATE_TTL_MS", str(w.state_ttl_ms)),
    ]
    if settings.fallback_model:
        plain.append(("FALLBACK_MODEL", settings.fallback_model))
    bindings = [Binding("BREAKER", "durable_object_namespace", class_name=BREAKER_CLASS)]
    bindings += [Binding(name, "plain_text", text=value) for name, value in plain]
    bindings.append(Binding("POD_URLS", "plain_text", from_output=POD_URLS_FROM_OUTPUT))
    bindings += [
        Binding("POD_TOKEN", "secret_text", secret="podToken"),
        Binding("FALLBACK_URL", "secret_text", secret="fallbackUrl"),
        Binding("FALLBACK_API_KEY", "secret_text", secret="fallbackApiKey"),
        Binding("PROBE_TOKEN", "secret_text", secret="probeToken"),
    ]
    return tuple(bindings)


def plan_cell(settings: Settings, worker_dir: Path = WORKER_DIR) -> CellPlan:
    """Derive the whole cell from validated settings."""
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
    pod_hostname = settings.zone.pod_hostname.format(generation=gen.replace(".", "-")) if settings.zone else None
    # The name carries a digest of what identifies the pod: a replacement (say, a new image
    # in the same generation) gets a new name, so `create` never adopts the pod that the
    # replacement's `delete` is about to remove.
    identity = hashlib.sha256("\0".join(_pod_identity(reg.name, settings.pod, gen)).encode()).hexdigest()[:6]
    locations = reg.locations(settings.pod.provider)
    pods = tuple(
        PodPlan(
            index=i,
            name=f"colocate-{settings.stack}-{gen}-p{i}-{identity}".replace(".", "-").replace("_", "-").lower(),
            stack=settings.stack,
            region=reg.name,
            generation=gen,
            settings=settings.pod,
            # Pod i prefers the region's i-th location (spread), the others stay as capacity fallbacks.
            locations=locations[i % len(locations):] + locations[:i % len(locations)],
            pod_hostname=pod_hostname,
        )
        for i in range(settings.pod.count)
    )
    pod = pods[0]
    migrations, pending = migrations_after(settings.worker.migration_tag, settings.worker.allow_class_deletion)
    placement = {"mode": "smart"} if settings.worker.placement == "smart" else {"region": reg.placement_region}
    worker = WorkerPlan(
        account_id=settings.account_id,
        zone_id=settings.zone.id if settings.zone else None,
        script_name=settings.worker.name,
        main_module=MAIN_MODULE,
        modules=worker_modules(worker_dir),
        compatibility_date=COMPATIBILITY_DATE,
        placement=placement,
        bindings=worker_bindings(settings, state),
        migrations=migrations,
        pending_migrations=pending,
        hostname=settings.zone.worker_hostname if settings.zone else None,
        url=(f"https://{settings.zone.worker_hostname}" if settings.zone
             else f"https://{settings.worker.name}.{settings.worker.subdomain}.workers.dev"),
    )
    pod_site = reg.site_of(pod.locations[0])
    probe = ProbePlan(
        region=reg.name,
        expected_colos=reg.in_region_colos,
        budgets=dict(settings.budgets),
        samples=settings.samples,
        enforce=settings.enforce,
        floor_ms={"state_rtt": 0.0, "pod_rtt": round(geo.floor_ms(reg.edge_site, pod_site), 2)},
    )
    return CellPlan(settings.stack, reg, worker, state, pods, probe)
