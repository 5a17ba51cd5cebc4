"""What the keeper's tests run it against without a Pulumi CLI: a generation's /_colocate/scale kept in
memory (its lease, records and desired state, as worker/src/generation.js keeps them; the Worker's
own are tested in workerd), and a cell's pods on a (fake) provider, each made as the program
declares it: pod i is `pod.py create` of pod i's spec, named after its identity (the keeper's
``replaced`` count in it), and a targeted replacement creates the renamed pod, waits for it to serve,
then deletes the old one (create before delete, infra/cell.py), touching no other pod."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from colocate.cell import catalogue
from colocate.cell.plan import PodPlan
from colocate.cell.settings import POD_DEFAULTS, PodSettings
from colocate.pods import lifecycle
from colocate.pods.base import PodInfo
from colocate.pods.spec import PodSpec
from colocate.scaling.keeper import RunningPod


class Generation:
    """The generation's side of /_colocate/scale: one lease, the last decision, desired, keeper."""

    def __init__(self, worker_hash: str | None = None):
        self.holder: str | None = None
        self.decisions: list[dict] = []
        self.desired: dict | None = None
        self.keeper: dict | None = None
        self.worker_hash = worker_hash
        self.health: dict | None = None  # GET /_colocate/probe's answer, when a test gives one

    def state(self) -> dict:
        return {"backends": {}, "inflight": {}, "desired": self.desired, "keeper": self.keeper,
                "worker_hash": self.worker_hash, "routed_pods": None}

    def lock(self, owner, ttl_s, release=False):
        if self.holder not in (None, owner):
            return False, {"owner": self.holder}
        self.holder = None if release else owner
        return True, {"owner": owner}

    def record(self, owner, decision, desired=None, replaced=None, keeper=None) -> bool:
        if self.holder != owner:
            return False
        self.decisions.append(decision)
        if desired is not None:  # a desired without `replaced` keeps the recorded one (generation.js scaleRecord)
            kept = (self.desired or {}).get("replaced")
            self.desired = {"pods": desired[0], "draining": desired[1]}
            if replaced is not None or kept:
                self.desired["replaced"] = {str(k): v for k, v in replaced.items()} if replaced is not None else kept
        if keeper is not None:
            self.keeper = keeper
        return True

    def probe(self) -> dict | None:
        return self.health


def pod_plans(stack: str, region: str, provider: str, count: int, **settings) -> list[PodPlan]:
    """The cell's pod plans as plan_cell makes them (plain HTTP: the providers' mechanics, not the hop)."""
    d = {**POD_DEFAULTS, "provider": provider, "readyTimeoutS": 20, "computeMs": 1,
         "gpu": "RTX 4090" if provider == "vastai" else POD_DEFAULTS["gpu"]}
    pod = PodSettings(provider=provider, gpu=d["gpu"], gpu_count=d["gpuCount"], image=d["image"], model=d["model"],
                      port=d["port"], disk_gb=d["diskGb"], max_price_per_hr=d["maxPricePerHr"], cloud=d["cloud"],
                      min_reliability=d["minReliability"], ready_timeout_s=d["readyTimeoutS"], compute_ms=d["computeMs"],
                      min_cuda_version=d["minCudaVersion"], profile="oracle", count=count, **settings)
    locations = catalogue.region(region).locations(provider)
    return [PodPlan(index=i, name="", stack=stack, region=region, generation=f"{region}.g1", settings=pod,
                    locations=locations[i % len(locations):] + locations[:i % len(locations)], pod_hostname=None,
                    path="zone-dns").with_derived_name()
            for i in range(count)]


def spec_of(plan: PodPlan) -> PodSpec:
    spec = plan.spec()
    spec["tls_name"] = ""  # plain HTTP: tests/test_pod_hop.py covers the hop's TLS (zone-dns: a TCP port with a
    # public address, RunPod's runtime.ports, which a reset maps anew)
    return PodSpec.from_dict(spec)


class ProviderCell:
    """The cell's pods on a provider, owned as the Pulumi program owns them (see the module's docstring).
    ``fail_replacements``: the next k replacements fail after the renamed pod's create was tried."""

    def __init__(self, plans: Sequence[PodPlan]):
        self.plans = list(plans)
        self.made: dict[int, dict] = {}  # index -> pod.py create's output
        self.replacements: list[list[int]] = []  # the indices of each targeted update
        self.deleted: list[str] = []

    def deploy_all(self) -> None:
        for plan in self.plans:
            self.made[plan.index] = lifecycle.create(spec_of(plan))

    # the scaling controller's deployer (a fixed count: never asked to scale)
    def declared(self) -> tuple[int, int]:
        return len(self.made), 0

    def deploy(self, pods: int, draining: int) -> None:
        raise AssertionError("a fixed cell is never scaled")

    # the keeper's
    def pods(self) -> list[RunningPod]:
        return [RunningPod(i, m["id"], m["provider"], m.get("ip"), m.get("port"), m.get("location"),
                           tuple(self.plans[i].locations)) for i, m in sorted(self.made.items())]

    def describe(self, pod: RunningPod) -> PodInfo:
        provider = lifecycle.provider_for(pod.provider)
        try:
            if hasattr(provider, "serve_port"):
                provider.serve_port = self.plans[pod.index].settings.port
            return provider.describe(pod.id)
        finally:
            provider.close()

    def replace(self, indices: Sequence[int], replaced: Mapping[int, int]) -> None:
        self.replacements.append(list(indices))
        for i in indices:
            settings = dataclasses.replace(self.plans[i].settings, replaced=tuple(sorted(
                {**dict(self.plans[i].settings.replaced), i: replaced[i]}.items())))
            new = dataclasses.replace(self.plans[i], settings=settings).with_derived_name()
            made = lifecycle.create(spec_of(new))  # raises when it cannot: the old pod stays on record
            old = self.made[i]
            self.plans[i], self.made[i] = new, made
            lifecycle.delete(old["provider"], old["id"], old["name"])  # at the end of the update, as Pulumi does
            self.deleted.append(old["id"])

    def certificates(self) -> dict[str, str | None]:
        return {}

    def renew(self, role: str) -> None:
        raise AssertionError("plain HTTP pods hold no certificate")
