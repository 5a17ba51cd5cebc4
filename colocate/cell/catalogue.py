"""The region catalogue: everything a cell derives from its one ``region`` setting.

Each region names where the Worker is placed, the Durable Object location hint,
the Cloudflare colos that count as in-region, and the GPU locations per provider.
Sources: placement targets and DO hints from cloudflare-docs (``workers/configuration/placement``,
``durable-objects/reference/data-location``); RunPod
data-centre ids from RunPod's public data-centre list (check with
``GET /v2/catalog/datacenters``); Vast.ai ``geolocation`` is a country code. An endpoint the team
already runs (provider ``existing``) says where it is by the Cloudflare colo nearest it, one of
the region's in-region colos: the same check a rented pod's location gets, in a provider-neutral word.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, UnknownRegion, UnsupportedProvider
from . import geo

EXISTING = "existing"  # an endpoint the team already runs: declared, checked, never rented or deleted
PROVIDERS = ("runpod", "vastai", "local", EXISTING)

# Location hints that host Durable Objects. `sam`, `afr` and `me` are valid hint
# names but host nothing today: objects hinted there land elsewhere
# (cloudflare-docs ``durable-objects/reference/data-location``).
HOSTING_HINTS = ("wnam", "enam", "weur", "eeur", "apac", "oc")
NON_HOSTING_HINTS = ("sam", "afr", "me")


@dataclass(frozen=True)
class Region:
    """One cell region. ``edge_site`` is the colo nearest the placement target."""

    name: str
    description: str
    placement_region: str  # Workers placement hint, "<cloud>:<region>"
    location_hint: str  # Durable Object location hint
    edge_site: str  # colo where a Worker placed here runs (and where state is pinned)
    in_region_colos: tuple[str, ...]
    # provider -> ordered locations: RunPod dataCenterIds, Vast.ai countries, "local"
    gpu_locations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # location id -> the colo nearest it, for floors and the sandbox's geography; "local" is
    # where the sandbox's stand-in pod stands (a site of its own, so a cell placed by the pod
    # follows the stand-in, not the placement hint)
    location_sites: dict[str, str] = field(default_factory=dict)
    # provider -> why it cannot serve this region, with what to use instead
    refusals: dict[str, str] = field(default_factory=dict)

    @property
    def providers(self) -> tuple[str, ...]:
        return tuple(p for p in PROVIDERS if self.gpu_locations.get(p))

    def locations(self, provider: str) -> tuple[str, ...]:
        """Ordered GPU locations of ``provider`` here; raises UnsupportedProvider. An existing
        endpoint's location is a colo of the region (``in_region_colos``): where the box stands."""
        if provider not in PROVIDERS:
            raise UnsupportedProvider(
                "colocate:pod.provider", provider, "unknown GPU provider", f"use one of {', '.join(PROVIDERS)}"
            )
        if provider == EXISTING:
            return self.in_region_colos
        locations = self.gpu_locations.get(provider, ())
        if not locations:
            why = self.refusals.get(provider, f"{provider} has no location in {self.name}")
            raise UnsupportedProvider(
                "colocate:pod.provider",
                provider,
                f"{why}; region {self.name} is served by {', '.join(self.providers)}",
                f"pulumi config set --path colocate:pod.provider {self.providers[0]}",
            )
        return locations

    def site_of(self, location: str) -> str:
        """The colo that stands for a GPU location (the edge site when the catalogue has none); an
        existing endpoint's location is a colo already."""
        if location in self.in_region_colos:
            return location
        return self.location_sites.get(location, self.edge_site)

    def is_in_region(self, colo_code: str | None) -> bool:
        return bool(colo_code and colo_code.upper() in self.in_region_colos)


REGIONS: dict[str, Region] = {
    r.name: r
    for r in (
        Region(
            name="apac-tw",
            description="Taiwan",
            placement_region="gcp:asia-east1",
            location_hint="apac",
            edge_site="TPE",
            # HKG is 806 km from TPE (8 ms floor): DO-hosting colos are few, so
            # an apac object for a Taiwan cell may land there and still be near.
            in_region_colos=("TPE", "KHH", "HKG"),
            gpu_locations={"vastai": ("TW",), "local": ("local",)},
            location_sites={"TW": "TPE", "local": "TPE"},
            refusals={"runpod": "RunPod has no data centre in Taiwan (nearest: AP-JP-1); use vastai for apac-tw"},
        ),
        Region(
            name="apac-jp",
            description="Japan",
            placement_region="aws:ap-northeast-1",
            location_hint="apac",
            edge_site="NRT",
            in_region_colos=("NRT", "KIX", "FUK", "OKA"),
            gpu_locations={"runpod": ("AP-JP-1",), "vastai": ("JP",), "local": ("local",)},
            location_sites={"AP-JP-1": "NRT", "JP": "NRT", "local": "NRT"},
        ),
        Region(
            name="us-east",
            description="US East (Virginia)",
            placement_region="aws:us-east-1",
            location_hint="enam",
            edge_site="IAD",
            in_region_colos=("IAD", "EWR", "PHL", "BOS", "ATL", "CLT", "RIC", "ORF", "PIT", "RDU"),
            gpu_locations={"runpod": ("US-DE-1", "US-NC-1", "US-GA-1", "US-GA-2"), "local": ("local",)},
            location_sites={"US-DE-1": "PHL", "US-NC-1": "CLT", "US-GA-1": "ATL", "US-GA-2": "ATL", "local": "IAD"},
            refusals={"vastai": "Vast.ai geolocation is a country: it cannot keep a pod on the US east coast"},
        ),
        Region(
            name="us-west",
            description="US West (N. California)",
            placement_region="aws:us-west-1",
            location_hint="wnam",
            edge_site="SJC",
            in_region_colos=("SJC", "SFO", "LAX", "SMF", "SEA", "PDX", "LAS", "SAN"),
            gpu_locations={"runpod": ("US-CA-2", "US-WA-1"), "local": ("local",)},
            location_sites={"US-CA-2": "SJC", "US-WA-1": "SEA", "local": "SJC"},
            refusals={"vastai": "Vast.ai geolocation is a country: it cannot keep a pod on the US west coast"},
        ),
        Region(
            name="eu-west",
            description="Western Europe",
            placement_region="aws:eu-west-1",
            location_hint="weur",
            edge_site="DUB",
            in_region_colos=("DUB", "LHR", "MAN", "AMS", "BRU", "CDG"),
            gpu_locations={
                "runpod": ("EU-NL-1", "EU-FR-1"),
                "vastai": ("IE", "GB", "NL", "BE", "FR"),
                "local": ("local",),
            },
            location_sites={"EU-NL-1": "AMS", "EU-FR-1": "CDG", "IE": "DUB", "GB": "LHR", "NL": "AMS", "BE": "BRU", "FR": "CDG",
                            "local": "DUB"},
        ),
    )
}


def region(name: object, key: str = "colocate:region") -> Region:
    """Look a region up by name; UnknownRegion lists the known ones."""
    if isinstance(name, str) and name in REGIONS:
        return REGIONS[name]
    known = ", ".join(REGIONS)
    raise UnknownRegion(key, name, "unknown region", f"use one of: {known}")


def region_of_colo(colo_code: str | None) -> Region | None:
    """The catalogue region whose in-region colos hold ``colo_code``, if any."""
    for r in REGIONS.values():
        if r.is_in_region(colo_code):
            return r
    return None


@dataclass(frozen=True)
class Gpu:
    """One GPU model and the name each provider's API takes for it."""

    model: str
    names: dict[str, str]  # provider -> name; the local stand-in pod has no GPU


# RunPod takes the GPU type id (`id` of GET /v2/catalog/gpus, e.g. "NVIDIA GeForce RTX 4090");
# Vast.ai filters offers on `gpu_name` ("RTX 4090"). A name meant for one provider matches
# nothing at the other, which shows up only as "no capacity" once a pod is being created.
# Listed only where both names are documented; unknown names pass. Sources: the Vast.ai
# spec (tests/fixtures/specs) for every Vast.ai name; the RunPod v2 spec for RunPod's 4090,
# 5090 and H100 ids, and RunPod's GPU types table for the 3090's and the A5000's
# (docs.runpod.io/references/gpu-types; runpod/docs, docs/references/gpu-types.md).
GPUS: tuple[Gpu, ...] = (
    Gpu("RTX 4090", {"runpod": "NVIDIA GeForce RTX 4090", "vastai": "RTX 4090"}),
    Gpu("RTX 5090", {"runpod": "NVIDIA GeForce RTX 5090", "vastai": "RTX 5090"}),
    Gpu("RTX 3090", {"runpod": "NVIDIA GeForce RTX 3090", "vastai": "RTX 3090"}),
    Gpu("RTX A5000", {"runpod": "NVIDIA RTX A5000", "vastai": "RTX A5000"}),
    Gpu("H100 SXM", {"runpod": "NVIDIA H100 80GB HBM3", "vastai": "H100 SXM"}),
)


def gpu(name: object) -> Gpu | None:
    """The catalogue GPU that some provider calls ``name``, if any."""
    return next((g for g in GPUS if name in g.names.values()), None)


def gpu_name(name: object, provider: str) -> str | None:
    """``provider``'s name for the GPU called ``name``; None when the catalogue cannot say."""
    g = gpu(name)
    return g.names.get(provider) if g else None


def gpu_names(provider: str) -> tuple[str, ...]:
    """The GPU names the catalogue knows for ``provider``."""
    return tuple(g.names[provider] for g in GPUS if provider in g.names)


def check_gpu(provider: str, name: str, key: str = "colocate:pod.gpu") -> None:
    """Refuse a GPU under another provider's name for it; a name the catalogue lacks passes."""
    right = gpu_name(name, provider)
    known = gpu(name)
    if right is None or right == name or known is None:
        return
    owner = next(p for p, n in known.names.items() if n == name)
    raise ConfigError(key, name, f"that is {owner}'s name for the {known.model}; {provider} knows it only as "
                      f"{right!r} and would report no capacity", f"pulumi config set --path {key} '{right}'")


def _check_catalogue() -> None:
    # Import-time self-check: a typo in a colo code or a non-hosting hint is a bug here.
    known = geo.colos()
    for r in REGIONS.values():
        assert r.location_hint in HOSTING_HINTS, f"{r.name}: hint {r.location_hint} hosts no objects"
        for code in (r.edge_site, *r.in_region_colos, *r.location_sites.values()):
            assert code in known, f"{r.name}: colo {code} not in the colo data"
        assert r.edge_site in r.in_region_colos, r.name
    for g in GPUS:  # a name may stand for one GPU only, or a translation would be ambiguous
        assert set(g.names) <= set(PROVIDERS) and all(gpu(n) is g for n in g.names.values()), g.model


_check_catalogue()
