"""``/v1/models``, ``/health`` and ``/metrics`` as vLLM 0.32 answers them.

``/metrics`` is compared family by family with vLLM's own (fixtures/vllm-0.32.0-metrics.txt,
captured from the CPU build as its first lines say): every ``vllm:`` family, its type and help,
its labels and their values (the model's name aside), its buckets, in prometheus_client's
spelling (a counter ``X`` as ``X_total`` and ``X_created``, a histogram's ``_created`` too).
Against a live vLLM the same comparison shows the fixture is still what vLLM writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32.0-metrics.txt"
SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def families(text: str) -> dict[str, dict]:
    """vllm: families by the name their TYPE line gives: type, help, label names, label values
    (per label, model_name and le aside), bucket edges, and the order of sample names."""
    out: dict[str, dict] = {}
    helps: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, text_ = line[7:].partition(" ")
            helps[name] = text_
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            current = {"type": kind, "help": helps.get(name), "labels": {}, "le": [], "samples": []} \
                if name.startswith("vllm:") else None
            if current is not None:
                out[name] = current
        elif line and not line.startswith("#") and current is not None:
            m = SAMPLE.match(line)
            assert m, line
            float(m.group(3).replace("+Inf", "inf"))  # a number as Prometheus reads it
            labels = dict(LABEL.findall(m.group(2) or ""))
            assert list(labels) == sorted(labels), line  # prometheus_client's label order
            if m.group(1) not in current["samples"]:
                current["samples"].append(m.group(1))
            for k, v in labels.items():
                if k == "le":
                    if v not in current["le"]:
                        current["le"].append(v)
                elif k != "model_name":
                    current["labels"].setdefault(k, [])
                    if v not in current["labels"][k] and k not in CONFIG_LABELS:
                        current["labels"][k].append(v)
    return out


# vllm:cache_config_info's labels are the engine's cache settings: their names are the contract, not their values
# (mamba_ssm_cache_dtype follows the model's quantization: float32 for the GPTQ model, auto for test-vllm's
# unquantized one on a CPU without AVX-512, tests/vllm_cpu/tinymodel.py).
CONFIG_LABELS = {"block_size", "gpu_memory_utilization", "kv_cache_max_concurrency", "kv_cache_memory_bytes",
                 "kv_cache_size_tokens", "num_gpu_blocks", "effective_attention_block_size", "mamba_ssm_cache_dtype"}


def test_metrics_are_vllms_families_in_prometheus_clients_spelling(engine):
    # vLLM serves /metrics to anyone; the pod's guard (in front of both engines) only to the pod token
    status, headers, raw = engine.request("GET", "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
    got, want = families(raw.decode()), families(FIXTURE.read_text())
    assert list(got) == list(want)
    for name, fam in want.items():
        assert got[name] == fam, name
    # the kit reads these (pods.js putMetrics, podmetrics.js): counters as X_total with X_created beside them
    for counter in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
        assert got[f"{counter}_total"]["type"] == "counter" and got[f"{counter}_created"]["type"] == "gauge"
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert got[gauge]["type"] == "gauge" and f"{gauge}_total" not in got
    hist = got["vllm:time_to_first_token_seconds"]
    assert hist["samples"] == ["vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count",
                               "vllm:time_to_first_token_seconds_sum"] and hist["le"][-1] == "+Inf"
    assert f'model_name="{engine.model}"' in raw.decode()


def test_models_lists_the_one_served_model_as_vllm_does(engine):
    status, headers, raw = engine.request("GET", "/v1/models")
    assert status == 200 and headers["content-type"] == "application/json"
    answer = json.loads(raw)
    assert list(answer) == ["object", "data"] and answer["object"] == "list"
    [card] = answer["data"]
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
    assert (card["id"], card["object"], card["owned_by"], card["parent"], card["max_model_len"]) == (
        engine.model, "model", "vllm", None, engine.max_model_len)
    assert isinstance(card["root"], str) and isinstance(card["created"], int)
    [perm] = card["permission"]
    assert perm == {**perm, "object": "model_permission", "allow_create_engine": False, "allow_sampling": True,
                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                    "organization": "*", "group": None, "is_blocking": False}
    assert list(perm) == ["id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs",
                          "allow_search_indices", "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking"]
    assert perm["id"].startswith("modelperm-")


def test_health_is_empty_to_the_pod_token_and_refused_to_anyone_else(engine):
    status, _headers, raw = engine.request("GET", "/health")
    assert (status, raw) == (200, b"")
    status, _headers, raw = engine.request("GET", "/health", token=None)  # the pod's guard: vLLM's own 401
    assert (status, json.loads(raw)) == (401, {"error": "Unauthorized"})
