"""Number keys take numeric text: `pulumi config set --path K 0.6` stores the string "0.6".

Pure and fast: settings.parse only.
"""

from __future__ import annotations

import pytest

from colocate.cell import settings
from colocate.errors import ConfigError
from tests.support.images import GUARDED_IMAGE

SECRETS = frozenset({"podToken", "probeToken", "fallbackUrl", "fallbackApiKey", "runpodApiKey"})


def parse(**over):
    raw = {
        "region": "apac-jp",
        "generations": [{"name": "apac-jp.g1", "region": "apac-jp", "status": "active"}],
        "accountId": "0123456789abcdef0123456789abcdef",
        "pod": {"provider": "runpod", "image": GUARDED_IMAGE},  # RunPod's proxy: the kit's image (the guard)
        "worker": {"subdomain": "acme"},
        "fallbackModel": "gpt-4o-mini",
        "fallbackCap": {"cellUsdPerDay": 0},  # no cap, knowingly: the cap's own tests set one
    }
    for name, value in over.items():  # "pod.maxPricePerHr" sets one nested key
        top, _, sub = name.partition(".")
        raw[top] = {**(raw.get(top) or {}), sub: value}
    return settings.parse(raw, "t", secrets=SECRETS)


# Every number key, the attribute it lands in, and (text, value) it must take. The list is
# checked against POD/WORKER/PROBE defaults below so a new number key cannot be missed.
NUMBER_KEYS = {
    "pod.gpuCount": (lambda s: s.pod.gpu_count, "2", 2),
    "pod.port": (lambda s: s.pod.port, "8000", 8000),
    "pod.diskGb": (lambda s: s.pod.disk_gb, "60", 60),
    "pod.maxPricePerHr": (lambda s: s.pod.max_price_per_hr, "0.6", 0.6),
    "pod.minReliability": (lambda s: s.pod.min_reliability, "0.95", 0.95),
    "pod.maxTransferPerGb": (lambda s: s.pod.max_transfer_per_gb, "0.05", 0.05),
    "pod.readyTimeoutS": (lambda s: s.pod.ready_timeout_s, "1200", 1200),
    "pod.computeMs": (lambda s: s.pod.compute_ms, "0", 0),
    "pod.count": (lambda s: s.pod.count, "3", 3),
    "pod.renewal": (lambda s: s.pod.renewal, "0", 0),
    "pod.maxModelLen": (lambda s: s.pod.max_model_len, "32768", 32768),
    "pod.onDemandFloor": (lambda s: s.pod.on_demand_floor, "2", 2),
    "pod.spare": (lambda s: s.pod.spare, "0", 0),  # above 0 only beside market interruptible or mix (test_market.py)
    "pod.bidPerHr": (lambda s: s.pod.bid_per_hr, "0.25", 0.25),
    "worker.deadlineMs": (lambda s: s.worker.deadline_ms, "1500", 1500),
    "worker.maxBodyBytes": (lambda s: s.worker.max_body_bytes, "2048", 2048),
    "worker.failureThreshold": (lambda s: s.worker.failure_threshold, "5", 5),
    "worker.openMs": (lambda s: s.worker.open_ms, "10000", 10000),
    "worker.stateTtlMs": (lambda s: s.worker.state_ttl_ms, "0", 0),
    "worker.stallMs": (lambda s: s.worker.stall_ms, "3000", 3000),
    "worker.bodyTimeoutMs": (lambda s: s.worker.body_timeout_ms, "30000", 30000),
    "worker.servedKeepMs": (lambda s: s.worker.served_keep_ms, "10000", 10000),
    "worker.minTokensPerS": (lambda s: s.worker.min_tokens_per_s, "12.5", 12.5),
    "worker.prefixBound": (lambda s: s.worker.prefix_bound, "1.25", 1.25),
    "probe.samples": (lambda s: s.samples, "40", 40),
    "probe.maxFallbackShare": (lambda s: s.max_fallback_share, "0.25", 0.25),
    "budgets.e2e": (lambda s: s.budgets["e2e"], "612.5", 612.5),
    "budgets.state": (lambda s: s.budgets["state"], "25", 25.0),
}


def test_the_list_holds_every_number_key():
    defaults = {"pod": settings.POD_DEFAULTS, "worker": settings.WORKER_DEFAULTS, "probe": settings.PROBE_DEFAULTS}
    numbers = {f"{top}.{k}" for top, d in defaults.items() for k, v in d.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numbers == {k for k in NUMBER_KEYS if not k.startswith("budgets.")}


def test_a_decimal_price_set_with_path_is_accepted_as_a_float():
    s = parse(**{"pod.maxPricePerHr": "0.6"})
    assert s.pod.max_price_per_hr == 0.6 and isinstance(s.pod.max_price_per_hr, float)


def test_integer_text_for_an_integer_key_is_accepted_as_an_int():
    s = parse(**{"pod.port": "8000"})
    assert s.pod.port == 8000 and type(s.pod.port) is int


@pytest.mark.parametrize("key", sorted(NUMBER_KEYS))
def test_every_number_key_takes_numeric_text(key):
    get, text, want = NUMBER_KEYS[key]
    got = get(parse(**{key: text}))
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("key, value", [
    ("pod.maxPricePerHr", "abc"),
    ("pod.maxPricePerHr", "nan"),
    ("pod.maxPricePerHr", "inf"),
    ("pod.maxPricePerHr", "-1"),
    ("pod.maxPricePerHr", "0"),  # a cap of 0 rents nothing
    ("pod.maxPricePerHr", "1e400"),  # text that overflows to inf
    ("pod.maxPricePerHr", True),
    ("pod.maxPricePerHr", float("nan")),  # YAML .nan
    ("pod.maxPricePerHr", float("inf")),  # YAML .inf
    ("pod.maxPricePerHr", ""),
    ("pod.minReliability", "1.5"),  # a share: above 1 no Vast.ai host qualifies
    ("pod.minReliability", "-0.1"),
    ("pod.port", "8000.5"),
    ("pod.port", "abc"),
    ("pod.port", "-1"),
    ("pod.port", "1_000"),
    ("pod.port", True),
    ("pod.count", "9"),  # above MAX_PODS
    ("pod.renewal", "-1"),
    ("pod.renewal", "1.5"),
    ("budgets.e2e", "nan"),
    ("probe.samples", "inf"),
])
def test_bad_numbers_are_refused_naming_key_and_value(key, value):
    with pytest.raises(ConfigError) as err:
        parse(**{key: value})
    msg = str(err.value)
    assert err.value.key == f"colocate:{key}"
    assert f"colocate:{key}" in msg and repr(value) in msg
    assert f"pulumi config set --path colocate:{key}" in msg


def test_the_printed_fix_stores_what_the_kit_accepts():
    # The fix says `pulumi config set --path K <a number ...>`; the CLI stores "0.7" as text.
    with pytest.raises(ConfigError) as err:
        parse(**{"pod.maxPricePerHr": "abc"})
    assert "<a number greater than 0>" in err.value.fix
    assert parse(**{"pod.maxPricePerHr": "0.7"}).pod.max_price_per_hr == 0.7


# colocate:pod.minCudaVersion is text in RunPod's form (^\d+\.\d+$), not a number key: 12.11
# is above 12.2 there. A YAML number in a hand-written stack file is read as its text.
@pytest.mark.parametrize("value, want", [
    ("12.8", "12.8"),
    (12.8, "12.8"),  # minCudaVersion: 12.8 unquoted in the stack file
    ("12.85", "12.85"),  # RunPod's pattern takes any major.minor
    ("12.11", "12.11"),
    ("13.0", "13.0"),
    ("", ""),  # no floor: neither provider is sent one
])
def test_the_cuda_floor_takes_major_minor_text_or_a_yaml_number(value, want):
    got = parse(**{"pod.minCudaVersion": value}).pod.min_cuda_version
    assert got == want and type(got) is str


def test_the_cuda_floor_defaults_to_the_default_images_cuda():
    assert parse().pod.min_cuda_version == "12.9" == settings.POD_DEFAULTS["minCudaVersion"]


@pytest.mark.parametrize("value", [
    "12",  # no minor: RunPod's pattern refuses it
    12,  # pulumi config set --path ... 12 stores an integer
    "abc",
    "12.8.1",
    " 12.8",
    "v12.8",
    "12.",
    "\uff11\uff12.\uff18",  # full-width digits: \d in Python, not in RunPod's pattern
    True,
    float("nan"),
    1e20,  # a YAML number that is no version
    None,
])
def test_a_cuda_floor_not_in_major_minor_form_is_refused_naming_key_value_and_fix(value):
    with pytest.raises(ConfigError) as err:
        parse(**{"pod.minCudaVersion": value})
    msg = str(err.value)
    assert err.value.key == "colocate:pod.minCudaVersion" and repr(value) in msg
    assert "pulumi config set --path colocate:pod.minCudaVersion 12.9" in msg and "major.minor" in msg
