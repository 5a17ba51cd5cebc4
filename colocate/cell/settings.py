"""Stack settings: the ``colocate:*`` keys, their defaults, and their validation.

``SCHEMA`` is the single list of keys; ``Pulumi.yaml`` declares the same keys (a test
keeps the two equal) and docs/configuration.md's table is written from it. ``parse`` turns the raw
values of one stack into a validated ``Settings`` or raises a ``ConfigError`` that
names the key, the value and the fix. Only ``colocate:region`` names a region.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import urlsplit

from ..errors import ConfigError, MissingSetting
from ..pods.profiles import DEFAULT_PROFILE, PROFILES
from . import endpoints as endpoints_mod, market as market_mod
from .capacity import pod_capacity
from .catalogue import EXISTING, PROVIDERS, Region, check_gpu, gpu_name, region as lookup_region
from .endpoints import Endpoint
from .ledger import Ledger

NS = "colocate"
# pod_rtt: the pod hop on the Worker's pooled connection; pod_rtt_new: on a new one (colocate/probe/connections.py).
SEGMENTS = ("e2e", "state", "state_rtt", "upstream", "pod_rtt", "pod_rtt_new", "fallback", "total", "ttft", "itl")


@dataclass(frozen=True)
class Key:
    name: str
    type: str  # Pulumi.yaml config type: string, integer, boolean, array, object
    default: Any
    description: str
    secret: bool = False


POD_DEFAULTS = {
    "provider": "runpod",
    "gpu": "NVIDIA GeForce RTX 4090",
    "gpuCount": 1,
    "image": "vllm/vllm-openai:v0.33.0-cu129",  # outside vLLM's advisories: docs/pods.md, "The real pod"
    "minCudaVersion": "12.9",  # the CUDA the default image is built for (-cu129)
    "model": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "port": 8000,
    "diskGb": 40,
    "maxPricePerHr": 0.8,
    # Vast.ai bills traffic per GB on top of the hour (offers' inet_down_cost, inet_up_cost): a boot pulls
    # about 16 GB (the image, ~11, and the weights, ~5), so $0.02/GB holds it to $0.32, under half an hour
    # of the price cap; the answers a pod sends are text (colocate/pods/vastai.py).
    "maxTransferPerGb": 0.02,
    "cloud": "SECURE",
    "minReliability": 0.98,
    "readyTimeoutS": 1800,  # covers a real pod's boot: 15-20 min to a first token (colocate/cell/capacity.py BOOT_S)
    "computeMs": 95,
    # The local stand-in's GPU and model (colocate.pods.profiles): the kit's default pod as it behaves
    # under load (docs/pods.md); "oracle" answers anything in computeMs at any load, for tests that need speed.
    "profile": DEFAULT_PROFILE,
    "count": 1,
    "renewal": 0,  # raised by one to re-place every pod (docs/pods.md "Getting a new pod")
    # {pod index: n}: the keeper's replacements of one pod each (scripts/scale.py writes it; the
    # generation's record wins at every `pulumi up`): part of that pod's identity only.
    "replaced": {},
    "hop": "auto",  # how the Worker reaches the pod: mutual TLS where it can (docs/pods.md "Who can reach the pod")
    "maxModelLen": 8192,  # vLLM's --max-model-len: the context, prompt included; the router's ceilings follow it
    # local only: an OpenAI-compatible server of the user's as the sandbox's pod (docs/sandbox.md "Your own engine")
    "command": "",
    "url": "",
    # Where pods are rented (colocate/cell/market.py): ondemand | interruptible | mix. onDemandFloor: mix's pods
    # 0..n-1 on demand; spare: interruptible pods beyond the need (SpotHedge's over-provisioning); bidPerHr:
    # an interruptible pod's bid, what Vast.ai bills it (its create's `price`), at most maxPricePerHr.
    "market": "ondemand",
    "onDemandFloor": 1,
    "spare": 0,
    "bidPerHr": 0.3,
    # provider existing only: the endpoints the team already runs, one pod each (colocate/cell/endpoints.py)
    "endpoints": [],
}
# colocate:pod.maxModelLen's bounds: vLLM's block (16 tokens) at least; Qwen2.5's longest context (YaRN) at most.
MAX_MODEL_LEN_RANGE = (16, 131072)
# colocate:pod.hop. mtls: the pod admits only the Worker's client certificate; token: plain HTTP
# (HTTPS to RunPod's proxy) behind POD_TOKEN alone; auto: mtls wherever the provider and path can
# carry it (colocate.cell.plan.hop_is_mtls).
HOPS = ("auto", "mtls", "token")
WORKER_DEFAULTS = {
    "name": "",  # empty: colocate-<stack>
    "subdomain": "",  # the account's workers.dev subdomain (needed without a zone)
    "placement": "auto",  # pod on the zone-dns path, targeted elsewhere (docs/pods.md "Placement")
    "deadlineMs": 2000,  # to a pod's first token (docs/worker.md "Routing")
    # After the first token: no byte for stallMs is a stall (the pod's failure), and an answer
    # slower than minTokensPerS a choice counts towards marking its pod slow ("Pace"). 25 is a pace a
    # reader keeps up with, under what the default profile (RTX 4090, Qwen2.5-7B INT4,
    # colocate/pods/profiles.py) makes a sequence alone (169 tokens/s) or at a batch of 64 (76); its
    # knee is held to this pace (profiles.DEFAULT_TPOT_P50_BUDGET_MS), so a pod at capacity is not marked.
    "stallMs": 2000,
    "minTokensPerS": 25,
    # A conversation's turns to the pod holding its prefix: the lowest TTFT and e2e p50 measured
    # (docs/benchmarks.md, "Prefix affinity").
    "balance": "prefix",  # BALANCES
    "maxBodyBytes": 1_048_576,
    # A body must arrive this long after its headers: a slow upload holds its key's slot.
    "bodyTimeoutMs": 10_000,
    "failureThreshold": 3,
    "openMs": 30_000,
    "stateTtlMs": 2_000,
    # How long an isolate asks for a key's counters and lease after serving it: the sliding
    # minute's two buckets.
    "servedKeepMs": 120_000,
    "migrationTag": "",
    "allowClassDeletion": False,
    "prefixBound": 1.5,  # prefix affinity's load bound c: no pod past c x the mean load
    "contentParts": [],  # media content part types the pods may be sent besides text (CONTENT_PARTS)
}
# colocate:worker.contentParts: the chat content parts a cell may pass to its pods besides text
# (worker/src/podfields.js MEDIA_PARTS). The pod fetches a URL part's media itself.
CONTENT_PARTS = ("image_url", "input_audio", "audio_url", "video_url")
PROBE_DEFAULTS = {"samples": 25, "enforce": False, "maxFallbackShare": 0.10}
# ttft and itl: a streamed answer's first token and the mean gap between its tokens, as the probe's
# client sees them (docs/probe.md): generous for a 7B model on one GPU, seen from anywhere.
BUDGET_DEFAULTS = {"state": 25, "state_rtt": 40, "ttft": 1000, "itl": 100}
# A new key's limits when its creator names none: finite, so no key is unbounded by
# accident (docs/worker.md, "Limits"). 0 for one of them means no limit. maxParallelTokens: the
# prompt tokens of a key's requests waiting for a pod's first token, at once; one context of the
# default pod (its --max-model-len), so one key's prompts queue at most one context's prefill
# ahead of other keys (docs/worker.md, "Busy is not broken"). fallbackUsdPerDay: each key's own
# cap on the fallback's spend a UTC day ($; counted at colocate:fallbackPrice), a tenth of the
# suggested cell cap: one key alone cannot spend the cell's.
KEY_LIMIT_DEFAULTS = {"rpm": 3000, "tpm": 3_000_000, "monthlyTokens": 1_000_000_000, "maxParallel": 8,
                      "maxParallelTokens": PROFILES[DEFAULT_PROFILE].max_model_len, "fallbackUsdPerDay": 2}
KEYS_DEFAULTS = {"defaults": KEY_LIMIT_DEFAULTS}
KEY_LIMIT_FIELDS = {"rpm": "rpm", "tpm": "tpm", "monthlyTokens": "monthly_tokens", "maxParallel": "max_parallel",
                    "maxParallelTokens": "max_parallel_tokens", "fallbackUsdPerDay": "fallback_microusd_day"}
# colocate:scale (docs/pods.md "Scaling with demand"). Unset: the cell runs colocate:pod.count
# pods. Set: scripts/scale.py decides the count and writes `pods` (in rotation) and `draining`
# (declared, out of rotation until their requests finish); the owner writes the rest.
# target: one pod's capacity, the knee of the default pod profile (colocate/cell/capacity.py), not a guess.
SCALE_DEFAULTS = {"min": 1, "max": 2, "target": pod_capacity(), "upAfterS": 120, "downAfterS": 900, "policy": "latency",
                  "pods": None, "draining": 0}
SCALE_POLICIES = ("latency", "cost")
# colocate:worker.balance: how the Worker picks among healthy pods (worker/src/pods.js POLICIES).
# prefix: a conversation's turns to the pod holding its prefix, within a load bound (affinity.js,
# docs/worker.md "Prefix affinity"); load: the cell's requests in flight there (all isolates) and
# what the pod reports (vLLM's /metrics: running, waiting, KV cache); least_busy: this isolate's
# requests in flight only; random: a baseline (bench/prefix.py).
BALANCES = ("prefix", "load", "least_busy", "random")

SCHEMA: tuple[Key, ...] = (
    Key("region", "string", None,
        "The cell's region (apac-tw, apac-jp, us-east, us-west, eu-west). The only key that names a region."),
    Key("generations", "array", None,
        "The generation ledger: [{name, region, status}], exactly one active in colocate:region. Edit with "
        "scripts/migrate.py."),
    Key("accountId", "string", None, "Cloudflare account id (32 hex characters)."),
    Key("pod", "object", POD_DEFAULTS,
        "GPU pod: provider (runpod | vastai | local | existing: endpoints you already run), gpu, gpuCount, image, "
        "minCudaVersion (the host's lowest acceptable CUDA, major.minor: the image's CUDA build), model, port, diskGb, "
        "maxPricePerHr, maxTransferPerGb (Vast.ai: the most a host may charge per GB down or up), cloud, minReliability, "
        "readyTimeoutS, computeMs (local only), profile (local only: the stand-in's GPU and model, "
        "colocate.pods.profiles), count (pods in the cell, spread over the region's locations), renewal "
        "(raise by one to replace every pod, and the hop's certificates, with new ones), replaced ({pod index: n}: the "
        "keeper's replacements of single pods, written by scripts/scale.py), hop (auto | mtls | token: "
        "auto is mutual TLS on colocate:zone and the pod token behind the pod's guard on RunPod's proxy; token is "
        "refused on a zone), maxModelLen (vLLM's --max-model-len: the context, prompt included; the router's "
        "ceilings follow it), command and url (local only: an OpenAI-compatible server as the sandbox's pod, started "
        "by the sandbox or already running at url), market (ondemand | interruptible | mix: where pods are rented; "
        "interruptible and mix need vastai or local), onDemandFloor (mix: pods 0..n-1 on demand), spare (interruptible "
        "pods run beyond the need, under the cost policy while they pay), bidPerHr (an interruptible pod's bid in $/h, at most "
        "maxPricePerHr), endpoints (existing only: [{host or ip, port, location, costPerHr}], "
        "one pod each: a DNS name you own or a public ip the kit names on colocate:zone, the Cloudflare colo nearest "
        "the box, its $/hr; never created, replaced or deleted by the kit)."),
    Key("worker", "object", WORKER_DEFAULTS,
        "Router Worker: name, subdomain (the account's workers.dev subdomain, needed without colocate:zone), placement "
        "(auto | pod | targeted | smart; auto = pod on the zone-dns path, else targeted), deadlineMs (to a pod's first "
        "token), stallMs (no byte this long after it: a stall), minTokensPerS (a slower answer counts towards marking its "
        "pod slow), maxBodyBytes, bodyTimeoutMs (a body not all there this long after its headers gets a 408), "
        "failureThreshold, openMs, stateTtlMs, servedKeepMs (an isolate asks for a key's counters and fleet lease this long "
        "after serving it), migrationTag (optional offline fallback: the kit reads the applied tag "
        "from Cloudflare), allowClassDeletion, balance (prefix, the default: a conversation's turns to the pod "
        "holding its prefix | load: the cell's counts and the pods' reports | least_busy | random: a baseline), "
        "prefixBound (prefix's load bound c > 1: no pod past c x the mean load), contentParts (chat content part types "
        "the pods may be sent besides text: image_url, input_audio, audio_url, video_url; the pod fetches a URL part's "
        "media)."),
    Key("keys", "object", KEYS_DEFAULTS,
        "Client keys: defaults {rpm, tpm, monthlyTokens, maxParallel, maxParallelTokens (prompt tokens not yet begun at "
        "a pod, at once), fallbackUsdPerDay (the key's own cap on the fallback's spend a UTC day, in $ at "
        "colocate:fallbackPrice)}, the limits of a key created without them (0 = no limit; defaultMaxParallel, the older "
        "name of defaults.maxParallel, is still read)."),
    Key("budgets", "object", BUDGET_DEFAULTS,
        "Latency budgets in ms per segment (e2e, state, state_rtt, upstream, pod_rtt, fallback, total, ttft, itl)."),
    Key("probe", "object", PROBE_DEFAULTS,
        "Post-deploy probe: samples, enforce (a failed check fails pulumi up), maxFallbackShare (the probe and the "
        "live view fail above it)."),
    Key("scale", "object", {},
        "Optional. Pods follow demand instead of colocate:pod.count (refused together): min (0 = scale to zero), max, "
        "target (requests per minute one pod serves within budget; default the pod profile's knee), upAfterS and "
        "downAfterS (how long demand must hold "
        "before pods are added or removed), policy (latency: enough pods for the traffic; cost: a pod only while it costs "
        "less than colocate:fallbackPrice for the same tokens); pods and draining are written by scripts/scale.py."),
    Key("zone", "object", {},
        "Optional Cloudflare zone: {id, name, workerHostname, podHostname, acmeServer (the ACME directory of the pods' "
        "certificates, DNS-01 on the zone; default Let's Encrypt)}. Without it the Worker is on workers.dev and reaches "
        "a RunPod pod through RunPod's proxy hostname; Vast.ai pods need it."),
    Key("fleet", "object", {},
        "A fleet stack only (docs/fleet.md): {cells: [cell stack names], rememberMs, exchangeMs, affinity (nearest | "
        "conversation: a conversation stays in one cell within budget)}. Set, it makes the stack a front door over those "
        "cells instead of a cell."),
    Key("fallbackModel", "string", None,
        "Required. The model name sent to the fallback API (e.g. gpt-4o-mini), or passthrough to send the client's model "
        "unchanged, for the models colocate:fallbackModels names only."),
    Key("fallbackModels", "object", {},
        "With fallbackModel passthrough, required: the client models the fallback may be sent, a list (each priced at "
        "colocate:fallbackPrice) or a mapping of model to {input, output} in $ per 1M tokens (a price each). Any other "
        "model gets 404 model_not_found when no pod can serve it."),
    Key("fallbackPrice", "object", {},
        "Optional. The fallback API's price in $ per 1M tokens, {input, output}, as its pricing page lists it (e.g. "
        "platform.openai.com/docs/pricing for gpt-4o-mini). scripts/cost.py compares the cell with it; unset, it reports "
        "the pods' cost alone."),
    Key("fallbackCap", "object", {},
        "Required (cellUsdPerDay). The most the fallback API may cost per UTC day at colocate:fallbackPrice (which a cap "
        "above 0 needs), in $: {cellUsdPerDay, keyUsdPerDay}, for the whole cell and for each client key (0 = no cap, "
        "chosen knowingly; keyUsdPerDay unset = no per-key cap). Past one, the fallback is not called: 429 "
        "insufficient_quota naming the cap, Retry-After to the day's end. A finite cap also bounds keys.defaults."
        "monthlyTokens."),
    Key("fallbackFields", "array", [],
        "Optional. Request fields the fallback API may receive beyond each endpoint's allowlist (the OpenAI fields the "
        "pods serve too), e.g. [\"store\", \"metadata\", \"service_tier\"]: those keep prompts in, or bill above "
        "colocate:fallbackPrice, the owner's account, so they are dropped unless listed (docs/worker.md)."),
    Key("podToken", "string", None, "Bearer token the pod checks (vLLM --api-key).", secret=True),
    Key("readToken", "string", None,
        "Operator credential that reads: the probe, the live view, the breaker, the key list, usage.", secret=True),
    Key("adminToken", "string", None,
        "Operator credential that administers: mints and revokes keys, purges, forces the breaker (and reads).", secret=True),
    Key("exchangeToken", "string", None,
        "Credential of a fleet's front door: the limits exchange and its defer header, nothing else.", secret=True),
    Key("probeToken", "string", None,
        "Deprecated: the one token of earlier releases; stands in for readToken, adminToken and exchangeToken "
        "when they are unset (with a warning).", secret=True),
    Key("fallbackUrl", "string", None, "Base URL of the external OpenAI-compatible fallback API.", secret=True),
    Key("fallbackApiKey", "string", None, "API key of the fallback API.", secret=True),
    # Optional (the environment may carry them instead), so they have a default and no
    # `secret: true` in Pulumi.yaml, which would make the CLI demand them on every stack.
    Key("runpodApiKey", "string", "",
        "RunPod API key, set with --secret (or RUNPOD_API_KEY in the environment); runpod pods only."),
    Key("vastaiApiKey", "string", "",
        "Vast.ai API key, set with --secret (or VASTAI_API_KEY in the environment); vastai pods only."),
)
KEYS = {k.name: k for k in SCHEMA}
OPERATOR_TOKENS = {"read": "readToken", "admin": "adminToken", "exchange": "exchangeToken"}  # role -> settings key
LEGACY_TOKEN = "probeToken"  # one release: fills the operator tokens a stack has not set yet
ALWAYS_SECRET = ("podToken", "fallbackUrl", "fallbackApiKey", *OPERATOR_TOKENS.values())
CELL_SECRETS = (*ALWAYS_SECRET, LEGACY_TOKEN)
PROVIDER_SECRET = {"runpod": ("runpodApiKey", "RUNPOD_API_KEY"), "vastai": ("vastaiApiKey", "VASTAI_API_KEY")}
# colocate:fallbackModel's explicit "send the client's model" value. Required rather than
# an empty default: an empty value sent Qwen/... to api.openai.com, which rejects it.
FALLBACK_PASSTHROUGH = "passthrough"
_ACCOUNT = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class PodSettings:
    provider: str
    gpu: str
    gpu_count: int
    image: str
    model: str
    port: int
    disk_gb: int
    max_price_per_hr: float
    cloud: str
    min_reliability: float
    ready_timeout_s: int
    compute_ms: int
    count: int = 1
    min_cuda_version: str = str(POD_DEFAULTS["minCudaVersion"])  # "" = no floor
    renewal: int = 0  # part of the pods' identity: a new value re-places them
    hop: str = "auto"  # colocate:pod.hop (HOPS)
    profile: str = str(POD_DEFAULTS["profile"])  # colocate:pod.profile: the local stand-in's (pods.profiles)
    max_transfer_per_gb: float = float(cast(float, POD_DEFAULTS["maxTransferPerGb"]))  # colocate:pod.maxTransferPerGb
    max_model_len: int = 8192  # colocate:pod.maxModelLen (POD_DEFAULTS)
    command: str = ""  # colocate:pod.command (local): the pod is this command, not the stand-in
    url: str = ""  # colocate:pod.url (local): where that command, or a server the user runs, serves
    replaced: tuple[tuple[int, int], ...] = ()  # colocate:pod.replaced as (index, n) pairs, n > 0, index order
    market: str = "ondemand"  # colocate:pod.market (colocate/cell/market.py MARKETS)
    on_demand_floor: int = 1  # colocate:pod.onDemandFloor: mix's pods 0..n-1 on demand
    spare: int = 0  # colocate:pod.spare: interruptible pods beyond the need
    bid_per_hr: float = 0.3  # colocate:pod.bidPerHr: an interruptible pod's bid, $/h
    endpoints: tuple[Endpoint, ...] = ()  # colocate:pod.endpoints (provider existing): one pod each, index order

    def replaced_count(self, index: int) -> int:
        """How often the keeper replaced pod ``index`` (0: never): part of that pod's name."""
        return dict(self.replaced).get(index, 0)

    def market_of(self, index: int) -> market_mod.PodMarket:
        """Pod ``index``'s market (colocate/cell/market.py ``pod_market``)."""
        return market_mod.pod_market(self.market, self.on_demand_floor, index)

    @property
    def spare_pods(self) -> int:
        """The spare interruptible pods run beside any that serve the demand (none on demand)."""
        return 0 if self.market == market_mod.ONDEMAND else self.spare

    @property
    def price_cap(self) -> float:
        """What one pod bills at most, $/h: the bid where every pod is interruptible, else the on-demand cap."""
        return self.bid_per_hr if self.market == market_mod.INTERRUPTIBLE else self.max_price_per_hr


MAX_PODS = 8
# colocate:worker.placement. pod: placement.host = pod 0's DNS-only hostname and public port;
# targeted: the region's cloud hint; smart: Smart Placement; auto: pod where the pod has a
# DNS-only record (zone-dns), targeted elsewhere (colocate.cell.plan.placement_mode).
PLACEMENTS = ("auto", "pod", "targeted", "smart")


@dataclass(frozen=True)
class WorkerSettings:
    name: str
    subdomain: str
    placement: str
    deadline_ms: int
    max_body_bytes: int
    failure_threshold: int
    open_ms: int
    state_ttl_ms: int
    migration_tag: str
    allow_class_deletion: bool
    stall_ms: int = 2000
    body_timeout_ms: int = 10_000
    served_keep_ms: int = 120_000
    min_tokens_per_s: float = 25.0
    balance: str = str(WORKER_DEFAULTS["balance"])
    prefix_bound: float = float(cast(float, WORKER_DEFAULTS["prefixBound"]))
    content_parts: tuple[str, ...] = ()  # colocate:worker.contentParts (CONTENT_PARTS)


# The ACME directory that issues the pods' publicly trusted certificates on the zone (DNS-01):
# Let's Encrypt's production directory (letsencrypt.org/docs/acme-protocol-updates).
ACME_SERVER = "https://acme-v02.api.letsencrypt.org/directory"


@dataclass(frozen=True)
class ZoneSettings:
    id: str
    name: str
    worker_hostname: str
    pod_hostname: str
    acme_server: str = ACME_SERVER  # colocate:zone.acmeServer


@dataclass(frozen=True)
class ScaleSettings:
    min: int
    max: int
    target: float  # requests per minute one pod serves within the cell's budget
    up_after_s: int
    down_after_s: int
    policy: str  # one of SCALE_POLICIES
    pods: int  # in rotation now (written by scripts/scale.py)
    draining: int = 0  # declared after `pods`, out of rotation, deleted once their requests finish

    @property
    def declared(self) -> int:
        return self.pods + self.draining


@dataclass(frozen=True)
class Settings:
    stack: str
    region: Region
    ledger: Ledger
    account_id: str
    pod: PodSettings
    worker: WorkerSettings
    budgets: dict[str, float]
    samples: int
    enforce: bool
    zone: ZoneSettings | None
    fallback_model: str
    secrets: frozenset[str] = field(default_factory=frozenset)
    fallback_price: tuple[float, float] | None = None  # $ per 1M (input, output) tokens; None: not set
    fallback_cap: tuple[float, float] = (0.0, 0.0)  # $ per UTC day of the fallback, (cell, each key); 0: no cap
    fallback_fields: tuple[str, ...] = ()  # colocate:fallbackFields: request fields the fallback may also receive
    # colocate:fallbackModels with passthrough: model -> its own ($ per 1M input, output), or None (fallbackPrice's)
    fallback_models: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    max_fallback_share: float = 0.10  # colocate:probe.maxFallbackShare: the probe and the live view fail above it
    # colocate:keys.defaults, by the Worker's field name (rpm, tpm, monthly_tokens, max_parallel)
    key_defaults: dict[str, int] = field(default_factory=lambda: {KEY_LIMIT_FIELDS[k]: v for k, v in KEY_LIMIT_DEFAULTS.items()})
    # role -> the settings key whose secret the Worker binds for it (probeToken on an old stack)
    operator_secrets: dict[str, str] = field(default_factory=lambda: dict(OPERATOR_TOKENS))
    credential_warning: str | None = None
    scale: ScaleSettings | None = None  # colocate:scale; None: a fixed colocate:pod.count


def _merged(raw: dict, name: str) -> dict:
    value = raw.get(name)
    if value is None:
        return dict(KEYS[name].default)
    if not isinstance(value, dict):
        raise ConfigError(f"{NS}:{name}", value, "must be a mapping", f"see docs/configuration.md for {NS}:{name}")
    unknown = sorted(set(value) - set(KEYS[name].default)) if KEYS[name].default else []
    if unknown:
        raise ConfigError(f"{NS}:{name}.{unknown[0]}", value[unknown[0]], "unknown key",
                          f"use only {', '.join(KEYS[name].default)}")
    return {**KEYS[name].default, **value}


# `pulumi config set --path K 0.6` stores the text "0.6": the CLI types only true/false and
# integer text. So a number key also takes plain decimal text (no nan, inf, 1_000 or hex).
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_DECIMAL_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _number(key: str, value: object, *, integer: bool = False, minimum: float = 0, strict: bool = True,
            maximum: float | None = None) -> Any:
    n: Any = value
    if isinstance(value, str) and (_INTEGER_TEXT if integer else _DECIMAL_TEXT).fullmatch(value.strip()):
        n = int(value) if integer else float(value)
    ok_type = isinstance(n, int) if integer else isinstance(n, (int, float))
    if (isinstance(n, bool) or not ok_type or not math.isfinite(n) or (n <= minimum if strict else n < minimum)
            or (maximum is not None and n > maximum)):
        kind = "a whole number" if integer else "a number"
        bound = (f"greater than {minimum}" if strict else f"at least {minimum}") + (
            f" and at most {maximum}" if maximum is not None else "")
        raise ConfigError(key, value, f"must be {kind} {bound}", f"pulumi config set --path {key} <{kind} {bound}>")
    return n


def _string(key: str, value: object, allowed: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or not value or (allowed and value not in allowed):
        fix = f"use one of {', '.join(allowed)}" if allowed else f"pulumi config set --path {key} <text>"
        raise ConfigError(key, value, "must be " + ("one of the listed values" if allowed else "non-empty text"), fix)
    return value


def default_gpu(provider: str) -> str:
    """The default GPU under ``provider``'s own name (POD_DEFAULTS holds RunPod's)."""
    return gpu_name(str(POD_DEFAULTS["gpu"]), provider) or str(POD_DEFAULTS["gpu"])


def parse_pod(raw: dict) -> PodSettings:
    p = _merged(raw, "pod")
    k = f"{NS}:pod."
    provider = _string(k + "provider", p["provider"], PROVIDERS)
    if "gpu" not in (raw.get("pod") or {}):
        p["gpu"] = default_gpu(provider)  # a Vast.ai pod without a gpu key rents Vast.ai's "RTX 4090"
    return PodSettings(
        provider=provider,
        gpu=_string(k + "gpu", p["gpu"]),
        gpu_count=_number(k + "gpuCount", p["gpuCount"], integer=True),
        image=_string(k + "image", p["image"]),
        model=_string(k + "model", p["model"]),
        port=_number(k + "port", p["port"], integer=True),
        disk_gb=_number(k + "diskGb", p["diskGb"], integer=True),
        max_price_per_hr=float(_number(k + "maxPricePerHr", p["maxPricePerHr"])),
        max_transfer_per_gb=float(_number(k + "maxTransferPerGb", p["maxTransferPerGb"], strict=False)),
        cloud=_string(k + "cloud", p["cloud"], ("SECURE", "COMMUNITY")),
        min_reliability=float(_number(k + "minReliability", p["minReliability"], strict=False, maximum=1)),
        ready_timeout_s=_number(k + "readyTimeoutS", p["readyTimeoutS"], integer=True),
        compute_ms=_number(k + "computeMs", p["computeMs"], integer=True, strict=False),
        count=len(p["endpoints"] or ()) if provider == EXISTING else _pod_count(k + "count", p["count"]),
        min_cuda_version=_cuda_version(k + "minCudaVersion", p["minCudaVersion"]),
        renewal=_number(k + "renewal", p["renewal"], integer=True, strict=False),
        hop=_string(k + "hop", p["hop"], HOPS),
        profile=_string(k + "profile", p["profile"], tuple(sorted(PROFILES))),
        max_model_len=_number(k + "maxModelLen", p["maxModelLen"], integer=True, strict=False,
                              minimum=MAX_MODEL_LEN_RANGE[0], maximum=MAX_MODEL_LEN_RANGE[1]),
        **_engine(k, provider, p["command"], p["url"]),
        replaced=parse_replaced(k + "replaced", p["replaced"]),
        **_market(k, provider, p),
        endpoints=_endpoints(k, provider, p, raw.get("pod") or {}),
    )


def _market(k: str, provider: str, p: dict) -> dict[str, Any]:
    """colocate:pod.market and its knobs (colocate/cell/market.py)."""
    market = _string(k + "market", p["market"], market_mod.MARKETS)
    if market not in market_mod.PROVIDERS.get(provider, (market_mod.ONDEMAND,)):
        raise ConfigError(k + "market", market, f"{market_mod.RUNPOD_HAS_NONE} (colocate:pod.provider is {provider})",
                          f"pulumi config set --path {k}market ondemand, or pulumi config set --path {k}provider vastai "
                          "(Vast.ai rents interruptible instances by bid)")
    floor = _number(k + "onDemandFloor", p["onDemandFloor"], integer=True, strict=False, maximum=MAX_PODS)
    spare = _number(k + "spare", p["spare"], integer=True, strict=False, maximum=MAX_PODS - 1)
    if spare and market == market_mod.ONDEMAND:
        raise ConfigError(k + "spare", spare, "spare pods are interruptible ones run as a safeguard against preemption, "
                          f"and {k}market is ondemand", f"pulumi config rm --path {k}spare, or pulumi config set --path "
                          f"{k}market interruptible (or mix)")
    bid = float(_number(k + "bidPerHr", p["bidPerHr"]))
    cap = float(_number(k + "maxPricePerHr", p["maxPricePerHr"]))
    if market != market_mod.ONDEMAND and bid > cap:
        raise ConfigError(k + "bidPerHr", bid, f"an interruptible pod bid above {k}maxPricePerHr ({cap:g}) costs more "
                          "than an on-demand one may", f"pulumi config set --path {k}bidPerHr {cap / 2:g} (or raise "
                          f"{k}maxPricePerHr)")
    return {"market": market, "on_demand_floor": floor, "spare": spare, "bid_per_hr": bid}


def _endpoints(k: str, provider: str, p: dict, given: dict) -> tuple[Endpoint, ...]:
    """colocate:pod.endpoints: the pods of an ``existing`` cell, and only of one; their number is its count."""
    found = endpoints_mod.parse(p["endpoints"], _number(k + "port", p["port"], integer=True))
    if provider != EXISTING:
        if found:
            raise ConfigError(k + "endpoints", p["endpoints"], f"are served by provider {EXISTING}, not {provider}",
                              f"pulumi config set --path {k}provider {EXISTING}, or pulumi config rm --path {k}endpoints")
        return ()
    if not found:
        raise MissingSetting(k + "endpoints", None, f"provider {EXISTING} serves the endpoints you declare, and none is",
                             f"pulumi config set --path '{k}endpoints[0].host' <the box's DNS name> (and .port, "
                             ".location; docs/pods.md, \"An endpoint you already run\")")
    if len(found) > MAX_PODS:
        raise ConfigError(k + "endpoints", len(found), f"a cell runs at most {MAX_PODS} pods",
                          "split the endpoints over several cells")
    if "count" in given and _number(k + "count", given["count"], integer=True) != len(found):
        raise ConfigError(k + "count", given["count"], f"an {EXISTING} cell runs one pod per endpoint ({len(found)})",
                          f"pulumi config rm --path {k}count")
    return found


def _engine(k: str, provider: str, command: object, url: object) -> dict[str, Any]:  # Any: ** beside typed fields
    """colocate:pod.command and .url: a server of the user's as the sandbox's pod (local only)."""
    for key, value in (("command", command), ("url", url)):
        if not isinstance(value, str):
            raise ConfigError(k + key, value, "must be text", f"pulumi config set --path {k}{key} <text>")
        if value and provider != "local":
            raise ConfigError(k + key, value, f"runs the pod on this machine, which only the sandbox does "
                              f"(colocate:pod.provider is {provider})",
                              f"pulumi config rm --path {k}{key}, or pulumi config set --path {k}provider local")
    if url:
        parts = urlsplit(str(url))
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or not port or parts.path.strip("/") \
                or parts.query or parts.username:
            raise ConfigError(k + "url", url, "must be the server's scheme, host and port, nothing else",
                              f"pulumi config set --path {k}url https://localhost:8000 (https on a mutual-TLS hop)")
        if parts.hostname not in ("localhost", "::1") and not parts.hostname.startswith("127."):
            raise ConfigError(k + "url", url, "must be on this machine (localhost or 127.x): the sandbox's pod "
                              "is reached by name localhost, on this machine's loopback",
                              f"run the server here and pulumi config set --path {k}url https://localhost:{port}")
    return {"command": str(command), "url": str(url)}


def _existing(pod: PodSettings, cell_region: Region, zone: ZoneSettings | None, raw: dict) -> PodSettings:
    """An ``existing`` cell: its endpoints in the region and named where the Worker can reach them, the
    hop resolved for them (``endpoints.resolve_hop``), and no pod count the kit would change."""
    endpoints_mod.check(pod.endpoints, cell_region.name, cell_region.in_region_colos, zone.name if zone else None)
    if raw.get("scale"):
        raise ConfigError(f"{NS}:scale", raw["scale"], f"the pods of an {EXISTING} cell are the endpoints you run: "
                          "the kit adds and removes none", f"pulumi config rm {NS}:scale")
    return replace(pod, hop=endpoints_mod.resolve_hop(pod.endpoints, pod.hop, zone.name if zone else None))


def parse_replaced(key: str, value: object) -> tuple[tuple[int, int], ...]:
    """colocate:pod.replaced: {pod index: how often the keeper replaced it}, as sorted (index, n)
    pairs with n > 0. Indices come as numbers or digit text (a YAML or JSON mapping's keys)."""
    fix = (f"leave it to scripts/scale.py, which writes it; by hand: pulumi config set --path '{key}[\"1\"]' 2 "
           f"(pod 1 replaced twice), or pulumi config rm --path {key}")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(key, value, "must be a mapping of pod index to a count", fix)
    out = {}
    for raw_index, raw_n in value.items():
        text = str(raw_index).strip()
        if isinstance(raw_index, bool) or not text.isdigit() or int(text) >= MAX_PODS:
            raise ConfigError(f"{key}.{raw_index}", raw_n, f"a pod index is 0 to {MAX_PODS - 1}", fix)
        try:
            n = _number(f"{key}.{raw_index}", raw_n, integer=True, strict=False)
        except ConfigError as err:
            raise ConfigError(err.key, raw_n, err.problem, fix) from None
        if n:
            out[int(text)] = n
    return tuple(sorted(out.items()))


# RunPod's minCudaVersion pattern (^\d+\.\d+$, ASCII digits). Vast.ai's offers carry the same
# version as a number, so the text must be one both can read.
_CUDA_VERSION = re.compile(r"[0-9]+\.[0-9]+")


def _cuda_version(key: str, value: object) -> str:
    """The host's CUDA floor as ``major.minor`` text; "" sends none.

    A hand-written stack file may hold the YAML number 12.8: it is read as the text "12.8"
    (YAML has already turned 12.10 into 12.1 by then, hence the quotes in the fix).
    """
    text = repr(value) if isinstance(value, float) else value
    if not isinstance(text, str) or not (text == "" or _CUDA_VERSION.fullmatch(text)):
        raise ConfigError(key, value, 'must be a CUDA version as major.minor text, e.g. "12.8", or "" for no floor',
                          f'pulumi config set --path {key} 12.9 (the CUDA version colocate:pod.image is built for; '
                          f'{POD_DEFAULTS["image"]} needs 12.9), or write it quoted in the stack file: minCudaVersion: "12.9"')
    return text


def _pod_count(key: str, value: object) -> int:
    n: int = _number(key, value, integer=True)
    if n > MAX_PODS:
        raise ConfigError(key, value, f"a cell runs at most {MAX_PODS} pods",
                          f"pulumi config set --path {key} <1..{MAX_PODS}>, or split the traffic over several cells")
    return n


def parse_worker(raw: dict, stack: str) -> WorkerSettings:
    w = _merged(raw, "worker")
    k = f"{NS}:worker."
    name = w["name"] or f"colocate-{stack}"
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", name):
        raise ConfigError(
            k + "name", name, "a Worker name is lower-case letters, digits and '-'", "pick a name like colocate-prod"
        )
    if not isinstance(w["allowClassDeletion"], bool):
        raise ConfigError(k + "allowClassDeletion", w["allowClassDeletion"], "must be true or false", "set true or false")
    tag = w["migrationTag"]
    if not isinstance(tag, str):
        raise ConfigError(k + "migrationTag", tag, "must be text", "remove it: the kit reads the applied tag from Cloudflare")
    subdomain = w["subdomain"]
    if not isinstance(subdomain, str) or (subdomain and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", subdomain)):
        raise ConfigError(k + "subdomain", subdomain, "must be the bare workers.dev subdomain",
                          "write only the part before .workers.dev, for example acme")
    return WorkerSettings(
        name=name,
        subdomain=subdomain,
        placement=_string(k + "placement", w["placement"], PLACEMENTS),
        deadline_ms=_number(k + "deadlineMs", w["deadlineMs"], integer=True),
        max_body_bytes=_number(k + "maxBodyBytes", w["maxBodyBytes"], integer=True),
        failure_threshold=_number(k + "failureThreshold", w["failureThreshold"], integer=True),
        open_ms=_number(k + "openMs", w["openMs"], integer=True),
        state_ttl_ms=_number(k + "stateTtlMs", w["stateTtlMs"], integer=True, strict=False),
        migration_tag=tag,
        allow_class_deletion=w["allowClassDeletion"],
        stall_ms=_number(k + "stallMs", w["stallMs"], integer=True),
        body_timeout_ms=_number(k + "bodyTimeoutMs", w["bodyTimeoutMs"], integer=True),
        served_keep_ms=_number(k + "servedKeepMs", w["servedKeepMs"], integer=True),
        min_tokens_per_s=float(_number(k + "minTokensPerS", w["minTokensPerS"])),
        balance=_balance(k + "balance", w["balance"]),
        prefix_bound=float(_number(k + "prefixBound", w["prefixBound"], minimum=1)),
        content_parts=_content_parts(k + "contentParts", w["contentParts"]),
    )


def _content_parts(key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v in CONTENT_PARTS for v in value):
        raise ConfigError(key, value, f"must be a list of content part types from {', '.join(CONTENT_PARTS)}",
                          f"pulumi config set --path '{key}[0]' image_url (the pod then fetches the images clients name), "
                          f"or pulumi config rm --path {key} (text only)")
    return tuple(dict.fromkeys(value))


def _balance(key: str, value: object) -> str:
    if value not in BALANCES:
        raise ConfigError(key, value, f"must be one of {', '.join(BALANCES)}",
                          f"pulumi config set --path {key} load (or least_busy: each isolate's own in-flight counts only)")
    return str(value)


def parse_budgets(raw: object, key: str = f"{NS}:budgets") -> dict[str, float]:
    if raw is None:
        return dict(BUDGET_DEFAULTS)
    if not isinstance(raw, dict):
        raise ConfigError(key, raw, "budgets are a mapping of segment to milliseconds",
                          f"pulumi config set --path {key}.state 25")
    out = {}
    for name, ms in raw.items():
        if name not in SEGMENTS:
            raise ConfigError(f"{key}.{name}", ms, "unknown segment", f"use one of {', '.join(SEGMENTS)}")
        out[name] = float(_number(f"{key}.{name}", ms))
    return out


def parse_fallback_model(value: object) -> str:
    """The model the Worker sends to the fallback; "" means the client's (``passthrough``)."""
    key = f"{NS}:fallbackModel"
    fix = (f"pulumi config set {key} <the fallback's model, e.g. gpt-4o-mini>, or {FALLBACK_PASSTHROUGH} "
           "if the fallback serves the same model as the pod")
    if value is None or value == "":
        raise MissingSetting(key, value, "the fallback API needs a model name it serves (the client's model "
                             "is the pod's, which another provider rejects)", fix)
    if not isinstance(value, str) or value != value.strip():
        raise ConfigError(key, value, "must be a model name without surrounding spaces", fix)
    return "" if value == FALLBACK_PASSTHROUGH else value


_MODEL_NAME = re.compile(r"[^\s]{1,256}")


def parse_fallback_models(raw: object, fallback_model: str) -> dict[str, tuple[float, float] | None]:
    """``colocate:fallbackModels``: the client models a passthrough fallback may be sent, each with its
    own price or None (priced at colocate:fallbackPrice); required with passthrough, refused without."""
    key = f"{NS}:fallbackModels"
    fix = (f"pulumi config set --path '{key}[0]' <model> (priced at {NS}:fallbackPrice), or pulumi config set --path "
           f"{key}.<model>.input <$ per 1M> and .output (a price each)")
    if raw is None or raw == {} or raw == []:
        if fallback_model == "":
            raise MissingSetting(key, raw, f"{NS}:fallbackModel is {FALLBACK_PASSTHROUGH}: the fallback is sent the client's "
                                 "model, so the models it may be sent (and their price) must be named", fix)
        return {}
    if fallback_model != "":
        raise ConfigError(key, raw, f"is read only with {NS}:fallbackModel {FALLBACK_PASSTHROUGH} (it is {fallback_model!r})",
                          f"pulumi config rm {key}, or pulumi config set {NS}:fallbackModel {FALLBACK_PASSTHROUGH}")
    items = [(m, None) for m in raw] if isinstance(raw, list) else list(raw.items()) if isinstance(raw, dict) else None
    if items is None:
        raise ConfigError(key, raw, "must be a list of model names or a mapping of model to {input, output}", fix)
    out: dict[str, tuple[float, float] | None] = {}
    for name, price in items:
        if not isinstance(name, str) or not _MODEL_NAME.fullmatch(name):
            raise ConfigError(key, name, "must be a model name (no blanks, at most 256 characters)", fix)
        out[name] = None if price is None else parse_fallback_price(price, f"{key}.{name}")
    return out


def parse_fallback_price(raw: object, key: str = f"{NS}:fallbackPrice") -> tuple[float, float] | None:
    """``colocate:fallbackPrice`` (or a passthrough model's price) {input, output} in $ per 1M tokens; None when unset."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict) or set(raw) != {"input", "output"}:
        raise ConfigError(key, raw, "must be a mapping {input, output} of $ per 1M tokens",
                          f"pulumi config set --path {key}.input 0.15 and pulumi config set --path {key}.output 0.6 "
                          "(the fallback's prices from its pricing page)")
    return (float(_number(f"{key}.input", raw["input"], strict=False)),
            float(_number(f"{key}.output", raw["output"], strict=False)))


FALLBACK_CAP_FIELDS = ("cellUsdPerDay", "keyUsdPerDay")
# The cap the README's minimal stack file and the refusal suggest: about one pod-day at the default
# colocate:pod.maxPricePerHr ($0.80 x 24 h = $19.20), so the fallback can at most double a
# one-pod cell's daily bill.
SUGGESTED_CELL_CAP_USD = 20
# A key's monthly tokens, bought at the fallback's price, may cost no more than its cap
# allows over the longest month.
MONTH_DAYS = 31


def require_fallback_cap(raw: object) -> None:
    """A cell's fallback spend has a daily cap the operator chose: a number, or 0 knowingly.
    Unset, it would be bounded only by each key's monthly tokens (a billion by default)."""
    key = f"{NS}:fallbackCap.{FALLBACK_CAP_FIELDS[0]}"
    if isinstance(raw, dict) and raw.get(FALLBACK_CAP_FIELDS[0]) is not None:
        return
    raise MissingSetting(
        key, None,
        "the fallback API's daily spend needs a cap the operator chose (unset, a cell's fallback spend is bounded "
        "only by each key's monthly tokens)",
        f"pulumi config set --path {key} {SUGGESTED_CELL_CAP_USD} (about one pod-day at the default $0.80/h; a cap "
        f"counts spend at {NS}:fallbackPrice, so set its .input and .output too), or pulumi config set --path {key} 0 "
        "to run with no cap, knowingly")


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_fallback_fields(raw: object) -> tuple[str, ...]:
    """``colocate:fallbackFields``: request field names the fallback may receive beyond the Worker's allowlist."""
    key = f"{NS}:fallbackFields"
    fix = f"pulumi config set --path '{key}[0]' store (one field name per entry), or pulumi config rm {key}"
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(key, raw, "must be a list of request field names", fix)
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name):
            raise ConfigError(f"{key}[{i}]", name, "must be a request field name (letters, digits, _)", fix)
    return tuple(dict.fromkeys(raw))


def parse_fallback_cap(raw: object, fallback_price: tuple[float, float] | None) -> tuple[float, float]:
    """``colocate:fallbackCap`` as (cell, key) $ per UTC day, 0 meaning no cap; a cap needs a price to count spend."""
    key = f"{NS}:fallbackCap"
    if raw is None or raw == {}:
        return (0.0, 0.0)
    if not isinstance(raw, dict):
        raise ConfigError(key, raw, "must be a mapping {cellUsdPerDay, keyUsdPerDay} of $ per UTC day",
                          f"pulumi config set --path {key}.cellUsdPerDay 50")
    unknown = sorted(set(raw) - set(FALLBACK_CAP_FIELDS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", raw[unknown[0]], "unknown key", f"use only {', '.join(FALLBACK_CAP_FIELDS)}")
    cell, per_key = (float(_number(f"{key}.{f}", raw.get(f, 0), strict=False)) for f in FALLBACK_CAP_FIELDS)
    if (cell > 0 or per_key > 0) and fallback_price is None:
        named = f"{key}.{FALLBACK_CAP_FIELDS[0] if cell > 0 else FALLBACK_CAP_FIELDS[1]}"
        raise ConfigError(named, cell if cell > 0 else per_key,
                          f"a spend cap counts the fallback's tokens at {NS}:fallbackPrice, which is not set",
                          f"pulumi config set --path {NS}:fallbackPrice.input <$ per 1M> and .output <$ per 1M>, "
                          f"or pulumi config rm {key}")
    return (cell, per_key)


def parse_scale(raw: dict, fallback_price: tuple[float, float] | None, spare: int = 0) -> ScaleSettings | None:
    """``colocate:scale``; None when unset (the cell runs ``colocate:pod.count`` pods). ``spare``: the
    interruptible pods run beside any that serve (colocate/cell/market.py), counted in ``pods``."""
    key = f"{NS}:scale"
    value = raw.get("scale")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ConfigError(key, value, "must be a mapping {min, max, target, upAfterS, downAfterS, policy}",
                          f"pulumi config set --path {key}.max 2 (and the other keys; docs/pods.md)")
    unknown = sorted(set(value) - set(SCALE_DEFAULTS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", value[unknown[0]], "unknown key", f"use only {', '.join(SCALE_DEFAULTS)}")
    if isinstance(raw.get("pod"), dict) and "count" in raw["pod"]:
        raise ConfigError(f"{NS}:pod.count", raw["pod"]["count"], f"the pod count is {key}'s to decide while {key} is set",
                          f"pulumi config rm --path {NS}:pod.count (keep {key}), or pulumi config rm {key} (a fixed count)")
    v = {**SCALE_DEFAULTS, **value}
    k = f"{key}."
    low = _number(k + "min", v["min"], integer=True, strict=False, maximum=MAX_PODS)
    high = _number(k + "max", v["max"], integer=True, maximum=MAX_PODS)
    if high < low:
        raise ConfigError(k + "max", high, f"must be at least {k}min ({low})", f"pulumi config set --path {k}max {max(low, 1)}")
    policy = _string(k + "policy", v["policy"], SCALE_POLICIES)
    if policy == "cost" and fallback_price is None:
        raise ConfigError(k + "policy", policy, f"the cost policy weighs a pod against {NS}:fallbackPrice, which is not set",
                          f"pulumi config set --path {NS}:fallbackPrice.input <$ per 1M> and .output <$ per 1M>, "
                          f"or pulumi config set --path {k}policy latency")
    if high + spare > MAX_PODS:
        raise ConfigError(k + "max", high, f"with {spare} spare pods ({NS}:pod.spare) a cell would run more than {MAX_PODS}",
                          f"pulumi config set --path {k}max {MAX_PODS - spare}")
    lo_pods, hi_pods = low, high + spare  # the cost policy runs its spare pods only while they pay
    pods = lo_pods if v["pods"] is None else _number(k + "pods", v["pods"], integer=True, strict=False, maximum=MAX_PODS)
    if not lo_pods <= pods <= hi_pods:
        raise ConfigError(k + "pods", pods, f"must be within {k}min..{k}max ({lo_pods}..{hi_pods}"
                          + (f", with {spare} spare" if spare else "") + ")",
                          f"pulumi config set --path {k}pods {min(max(pods, lo_pods), hi_pods)} (scripts/scale.py writes it)")
    draining = _number(k + "draining", v["draining"], integer=True, strict=False, maximum=MAX_PODS - pods)
    return ScaleSettings(
        min=low, max=high, target=float(_number(k + "target", v["target"])),
        up_after_s=_number(k + "upAfterS", v["upAfterS"], integer=True, strict=False),
        down_after_s=_number(k + "downAfterS", v["downAfterS"], integer=True, strict=False),
        policy=policy, pods=pods, draining=draining,
    )


def parse_zone(raw: object) -> ZoneSettings | None:
    if not raw:
        return None
    key = f"{NS}:zone"
    if not isinstance(raw, dict):
        raise ConfigError(key, raw, "must be a mapping {id, name, workerHostname, podHostname}", "see docs/configuration.md")
    zid = raw.get("id")
    if not isinstance(zid, str) or not re.fullmatch(r"[0-9a-f]{32}", zid):
        raise ConfigError(key + ".id", zid, "a zone id is 32 hex characters", "copy it from the zone's overview page")
    name = _string(key + ".name", raw.get("name"))
    unknown = sorted(set(raw) - set(ZONE_FIELDS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", raw[unknown[0]], "unknown key", f"use only {', '.join(ZONE_FIELDS)}")
    acme = raw.get("acmeServer") or ACME_SERVER
    if not isinstance(acme, str) or not acme.startswith("https://"):
        raise ConfigError(key + ".acmeServer", acme, "must be the https:// URL of an ACME directory whose certificates "
                          "are publicly trusted (the Worker verifies the pods with public trust)",
                          f"pulumi config rm --path {key}.acmeServer (Let's Encrypt: {ACME_SERVER})")
    return ZoneSettings(
        id=zid,
        name=name,
        worker_hostname=raw.get("workerHostname") or f"infer.{name}",
        pod_hostname=raw.get("podHostname") or f"pod-{{generation}}.{name}",
        acme_server=acme,
    )


ZONE_FIELDS = ("id", "name", "workerHostname", "podHostname", "acmeServer")


def parse_key_defaults(raw: object, cap: tuple[float, float] = (0.0, 0.0),
                       fallback_price: tuple[float, float] | None = None) -> dict[str, int]:
    """``colocate:keys.defaults`` by the Worker's field name; ``defaultMaxParallel`` is the older name of
    ``defaults.maxParallel``. With a finite ``colocate:fallbackCap`` and a price, ``monthlyTokens``
    is at most what the cap allows (monthly_tokens_within_cap): derived when unset, refused above."""
    raw = dict(raw) if isinstance(raw, dict) else raw
    older = raw.pop("defaultMaxParallel", None) if isinstance(raw, dict) else None
    _merged({"keys": raw}, "keys")  # refuses a key other than defaults
    given = cast(dict, raw or {}).get("defaults") or {}  # _merged refused anything but a mapping
    if not isinstance(given, dict):
        raise ConfigError(f"{NS}:keys.defaults", given,
                          "must be a mapping {rpm, tpm, monthlyTokens, maxParallel, maxParallelTokens, fallbackUsdPerDay}",
                          f"pulumi config set --path {NS}:keys.defaults.maxParallel 8")
    unknown = sorted(set(given) - set(KEY_LIMIT_DEFAULTS))
    if unknown:
        raise ConfigError(f"{NS}:keys.defaults.{unknown[0]}", given[unknown[0]], "unknown key",
                          f"use only {', '.join(KEY_LIMIT_DEFAULTS)}")
    merged = {**KEY_LIMIT_DEFAULTS, **({"maxParallel": older} if older is not None else {}), **given}
    usd = float(_number(f"{NS}:keys.defaults.fallbackUsdPerDay", merged.pop("fallbackUsdPerDay"), strict=False))
    out = {KEY_LIMIT_FIELDS[k]: _number(f"{NS}:keys.defaults.{k}", v, integer=True, strict=False) for k, v in merged.items()}
    if usd > 0 and fallback_price is None and "fallbackUsdPerDay" in given:
        raise ConfigError(f"{NS}:keys.defaults.fallbackUsdPerDay", given["fallbackUsdPerDay"],
                          f"a key's fallback cap counts its spend at {NS}:fallbackPrice, which is not set",
                          f"pulumi config set --path {NS}:fallbackPrice.input <$ per 1M> and .output <$ per 1M>, "
                          f"or pulumi config rm --path {NS}:keys.defaults.fallbackUsdPerDay")
    # In millionths of a dollar, as the Worker counts spend; without a price no spend is counted, so no cap.
    out["fallback_microusd_day"] = round(usd * 1e6) if fallback_price is not None else 0
    bound = monthly_tokens_within_cap(cap, fallback_price)
    if bound is None:
        return out
    if "monthlyTokens" not in given:
        out["monthly_tokens"] = min(out["monthly_tokens"], bound)  # derived: the cap's worth, at most the default
    elif out["monthly_tokens"] == 0 or out["monthly_tokens"] > bound:
        which, usd = cast(tuple, tightest_cap(cap))  # a bound implies a cap
        raise ConfigError(
            f"{NS}:keys.defaults.monthlyTokens", given["monthlyTokens"],
            f"a key's month of tokens at {NS}:fallbackPrice (${max(fallback_price or (0, 0)):g} per 1M) may cost "
            f"no more than {MONTH_DAYS} days of {NS}:fallbackCap.{which} (${usd:g} a day) allow",
            f"pulumi config set --path {NS}:keys.defaults.monthlyTokens {bound} (or less), or leave it unset: it is "
            f"then derived from the cap")
    return out


def monthly_tokens_within_cap(cap: tuple[float, float], fallback_price: tuple[float, float] | None) -> int | None:
    """The most tokens a key may have a month so that, all bought from the fallback at its dearer
    price, they cost no more than MONTH_DAYS days of the tightest cap that applies to a key (its
    own, else the cell's). None when there is no finite cap or no price to count with."""
    tightest = tightest_cap(cap)
    if tightest is None or not fallback_price or max(fallback_price) <= 0:
        return None
    return int(tightest[1] * MONTH_DAYS * 1e6 / max(fallback_price))


def tightest_cap(cap: tuple[float, float]) -> tuple[str, float] | None:
    """The fallbackCap field that bounds one key's spend first, and its $ a day; None: no cap."""
    named = [(f, c) for f, c in zip(FALLBACK_CAP_FIELDS, cap, strict=True) if c > 0]
    return min(named, key=lambda fc: fc[1]) if named else None


def parse_operator_tokens(secrets: frozenset[str] | set[str]) -> tuple[dict[str, str], str | None]:
    """Which secret serves each operator role, and the warning for a stack that still
    leans on the old single ``probeToken`` (it keeps working for this release)."""
    missing = [key for key in OPERATOR_TOKENS.values() if key not in secrets]
    if missing and LEGACY_TOKEN not in secrets:
        raise MissingSetting(f"{NS}:{missing[0]}", None, "secret is not set",
                             f"pulumi config set --secret {NS}:{missing[0]} \"$(openssl rand -hex 24)\" "
                             f"(one distinct value each for {', '.join(f'{NS}:{k}' for k in OPERATOR_TOKENS.values())})")
    operator = {role: key if key in secrets else LEGACY_TOKEN for role, key in OPERATOR_TOKENS.items()}
    if not missing:
        return operator, None
    return operator, (f"{NS}:{LEGACY_TOKEN} opens every operator endpoint and is deprecated (this release is the last "
                      f"to take it): set {', '.join(f'{NS}:{k}' for k in missing)} (one distinct value each, "
                      f"`pulumi config set --secret {NS}:<key> \"$(openssl rand -hex 24)\"`), hand the read token to "
                      f"monitoring and keep the admin token for scripts/keys.py, then `pulumi config rm {NS}:{LEGACY_TOKEN}`")


def parse(
    raw: dict,
    stack: str,
    secrets: frozenset[str] | set[str] = frozenset(),
    env: dict | None = None,
    *,
    allow_split_state: bool = False,
    require_cap: bool = True,
) -> Settings:
    """Validate one stack's raw ``colocate:*`` values (keys without the namespace).

    ``secrets`` names the secret keys that are set; their values never reach the plan.
    ``env`` is consulted for provider API keys (RUNPOD_API_KEY, VASTAI_API_KEY).
    ``allow_split_state`` skips the one check that keeps state and compute together. Only
    the sandbox's demo passes it, to show what a hand-rolled move does; the Pulumi
    program never does. ``require_cap=False`` accepts a stack without
    ``colocate:fallbackCap``: only for planning that spends nothing (``migrate.py plan``).
    """
    env = env or {}
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ConfigError(f"{NS}:{unknown[0]}", raw[unknown[0]], "unknown key",
                          "colocate:region is the only region setting; docs/configuration.md lists every key")
    fleet = raw.get("fleet")
    if isinstance(fleet, dict) and fleet:  # colocate/fleet/plan.py parses a fleet stack
        raise ConfigError(f"{NS}:fleet", fleet, f"stack {stack} is a fleet (a front door over cells), not a cell",
                          f"use a member cell's stack ({', '.join(map(str, fleet.get('cells') or [])) or 'none listed'}); "
                          "docs/fleet.md says what a fleet stack does")
    cell_region = lookup_region(raw.get("region"))
    ledger = Ledger.parse(raw.get("generations"))
    if not allow_split_state:
        ledger.check_region(cell_region.name, stack)
    pod = parse_pod(raw)
    cell_region.locations(pod.provider)  # refuses a provider that cannot serve the region
    check_gpu(pod.provider, pod.gpu)  # refuses e.g. RunPod's GPU id on a Vast.ai pod

    account = raw.get("accountId")
    if not isinstance(account, str) or not _ACCOUNT.match(account):
        problem = "is not set" if account is None else "must be 32 lower-case hex characters"
        raise MissingSetting(f"{NS}:accountId", account, problem,
                             f"pulumi config set {NS}:accountId <id from the Cloudflare dashboard>")
    operator, credential_warning = parse_operator_tokens(secrets)
    required = [(name, "") for name in ALWAYS_SECRET if name not in OPERATOR_TOKENS.values()]
    if pod.provider in PROVIDER_SECRET:
        required.append(PROVIDER_SECRET[pod.provider])
    for name, env_name in required:
        if name not in secrets and not (env_name and env.get(env_name)):
            also = f" (or export {env_name})" if env_name else ""
            raise MissingSetting(f"{NS}:{name}", None, "secret is not set",
                                 f"pulumi config set --secret {NS}:{name} <value>{also}")

    probe = _merged(raw, "probe")
    samples = _number(f"{NS}:probe.samples", probe["samples"], integer=True)
    if not isinstance(probe["enforce"], bool):
        raise ConfigError(
            f"{NS}:probe.enforce",
            probe["enforce"],
            "must be true or false",
            "pulumi config set --path colocate:probe.enforce true",
        )
    max_fallback_share = _number(f"{NS}:probe.maxFallbackShare", probe["maxFallbackShare"], strict=False, maximum=1)
    worker = parse_worker(raw, stack)
    zone = parse_zone(raw.get("zone"))
    if pod.provider == EXISTING:
        pod = _existing(pod, cell_region, zone, raw)
    if zone is None and not worker.subdomain:
        raise MissingSetting(
            f"{NS}:worker.subdomain",
            None,
            "the Worker needs a public address: no zone and no workers.dev subdomain",
            f"pulumi config set --path {NS}:worker.subdomain <your-account-subdomain> (the part before .workers.dev), "
            f"or set {NS}:zone",
        )
    fallback_model = parse_fallback_model(raw.get("fallbackModel"))
    fallback_models = parse_fallback_models(raw.get("fallbackModels"), fallback_model)
    fallback_price = parse_fallback_price(raw.get("fallbackPrice"))
    priced = [p for p in fallback_models.values() if p is not None]
    if fallback_price is None and priced:
        # Each passthrough model priced, none by colocate:fallbackPrice: the dearest bounds what the caps derive.
        fallback_price = (max(p[0] for p in priced), max(p[1] for p in priced))
    if require_cap:
        require_fallback_cap(raw.get("fallbackCap"))
    fallback_cap = parse_fallback_cap(raw.get("fallbackCap"), fallback_price)
    fallback_fields = parse_fallback_fields(raw.get("fallbackFields"))
    scale = parse_scale(raw, fallback_price, pod.spare_pods)
    if scale is not None:
        pod = replace(pod, count=scale.declared)
    else:  # a fixed count, and the spare interruptible pods beside it
        if pod.count + pod.spare_pods > MAX_PODS:
            raise ConfigError(f"{NS}:pod.spare", pod.spare, f"{NS}:pod.count {pod.count} and {pod.spare} spare pods are "
                              f"more than the {MAX_PODS} a cell runs", f"pulumi config set --path {NS}:pod.spare "
                              f"{max(0, MAX_PODS - pod.count)}, or split the traffic over several cells")
        pod = replace(pod, count=market_mod.with_spare(pod.count, pod.market, pod.spare))
    key_defaults = parse_key_defaults(raw.get("keys"), fallback_cap, fallback_price)
    return Settings(
        stack=stack,
        region=cell_region,
        ledger=ledger,
        account_id=account,
        pod=pod,
        worker=worker,
        budgets=parse_budgets(raw.get("budgets")),
        samples=samples,
        enforce=probe["enforce"],
        max_fallback_share=max_fallback_share,
        zone=zone,
        fallback_model=fallback_model,
        secrets=frozenset(secrets),
        fallback_price=fallback_price,
        fallback_cap=fallback_cap,
        fallback_fields=fallback_fields,
        fallback_models=fallback_models,
        key_defaults=key_defaults,
        operator_secrets=operator,
        credential_warning=credential_warning,
        scale=scale,
    )
