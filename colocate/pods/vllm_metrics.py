"""vLLM's ``/metrics``, as the stand-in writes it: every ``vllm:`` family vLLM 0.32 exposes.

vLLM registers its metrics with prometheus_client, whose text format (0.0.4) the kit's readers
and Prometheus read: a counter ``X`` is exposed as ``X_total`` with a ``X_created`` gauge (when
the series began), a histogram as ``X_bucket`` / ``X_count`` / ``X_sum`` with ``X_created``, a
gauge as it is; labels in name order; numbers as Go spells them (``1.7e+09``). FAMILIES lists
each family vLLM 0.32 (CPU build, ``--max-model-len 8192``) exposes, read from its ``/metrics``
and checked against a live one by tests/engine_contract/test_metrics.py: name, type, help,
its one enumerated label (with its values) and its buckets. The stand-in reports what its
engine models (requests running and waiting, KV-cache use, prefix-cache queries and hits,
preemptions, tokens, finished requests, first-token and inter-token latency) and zero for the
rest. The server's own families (``http_*``, ``process_*``, ``python_*``) are not written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, tuple[str, ...]] | None = None  # the one label besides engine and model_name, and its values
    buckets: tuple[float, ...] = ()
    engine: bool = True  # labelled engine="0" (one family is not)


# vLLM's one request-latency bucket list (its metrics.py `request_latency_buckets`), shared by the
# e2e, queue, inference, prefill and decode histograms.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)

FAMILIES = (
    Family('vllm:estimated_flops_per_gpu', 'counter',
           'Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).'),
    Family('vllm:estimated_read_bytes_per_gpu', 'counter',
           'Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).'),
    Family('vllm:estimated_write_bytes_per_gpu', 'counter',
           'Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).'),
    Family('vllm:num_requests_running', 'gauge',
           'Number of requests in model execution batches.'),
    Family('vllm:num_requests_waiting', 'gauge',
           'Number of requests waiting to be processed.'),
    Family('vllm:num_requests_waiting_by_reason', 'gauge',
           ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of "
            'all reasons equals vllm:num_requests_waiting.'),
           labels=('reason', ('capacity', 'deferred'))),
    Family('vllm:engine_sleep_state', 'gauge',
           ('Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; '
            'weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.'),
           labels=('sleep_state', ('awake', 'weights_offloaded', 'discard_all'))),
    Family('vllm:kv_cache_usage_perc', 'gauge',
           'KV-cache usage. 1 means 100 percent usage.'),
    Family('vllm:prefix_cache_queries', 'counter',
           'Prefix cache queries, in terms of number of queried tokens.'),
    Family('vllm:prefix_cache_hits', 'counter',
           'Prefix cache hits, in terms of number of cached tokens.'),
    Family('vllm:external_prefix_cache_queries', 'counter',
           ('External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of '
            'queried tokens.')),
    Family('vllm:external_prefix_cache_hits', 'counter',
           ('External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of '
            'cached tokens.')),
    Family('vllm:mm_cache_queries', 'counter',
           'Multi-modal cache queries, in terms of number of queried items.'),
    Family('vllm:mm_cache_hits', 'counter',
           'Multi-modal cache hits, in terms of number of cached items.'),
    Family('vllm:num_preemptions', 'counter',
           'Cumulative number of preemption from the engine.'),
    Family('vllm:prompt_tokens', 'counter',
           'Number of prefill tokens processed.'),
    Family('vllm:prompt_tokens_by_source', 'counter',
           'Number of prompt tokens by source.',
           labels=('source', ('local_compute', 'local_cache_hit', 'external_kv_transfer'))),
    Family('vllm:prompt_tokens_cached', 'counter',
           'Number of cached prompt tokens (local + external).'),
    Family('vllm:prompt_tokens_cached_by_source', 'counter',
           ('Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to'
            ' DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at '
            'admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.'),
           labels=('source', ('device', 'host', 'p2p', 'disk', 'external_unspecified'))),
    Family('vllm:generation_tokens', 'counter',
           'Number of generation tokens processed.'),
    Family('vllm:request_success', 'counter',
           'Count of successfully processed requests.',
           labels=('finished_reason', ('stop', 'length', 'abort', 'error', 'repetition'))),
    Family('vllm:admission_rejections', 'counter',
           'Number of admission attempts rejected by a queue limit, by reason.',
           labels=('reason', ('max_num_queued_reqs', 'max_num_queued_tokens')), engine=False),
    Family('vllm:request_prompt_tokens', 'histogram',
           'Number of prefill tokens processed.',
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)),
    Family('vllm:request_generation_tokens', 'histogram',
           'Number of generation tokens processed.',
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)),
    Family('vllm:iteration_tokens_total', 'histogram',
           'Histogram of number of tokens per engine_step.',
           buckets=(1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)),
    Family('vllm:request_max_num_generation_tokens', 'histogram',
           'Histogram of maximum number of requested generation tokens.',
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)),
    Family('vllm:request_params_n', 'histogram',
           'Histogram of the n request parameter.',
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0)),
    Family('vllm:request_params_max_tokens', 'histogram',
           'Histogram of the max_tokens request parameter.',
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)),
    Family('vllm:time_to_first_token_seconds', 'histogram',
           'Histogram of time to first token in seconds.',
           buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)),
    Family('vllm:inter_token_latency_seconds', 'histogram',
           'Histogram of inter-token latency in seconds.',
           buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)),
    Family('vllm:request_time_per_output_token_seconds', 'histogram',
           'Histogram of time_per_output_token_seconds per request.',
           buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)),
    Family('vllm:e2e_request_latency_seconds', 'histogram',
           'Histogram of e2e request latency in seconds.',
           buckets=REQUEST_LATENCY_BUCKETS),
    Family('vllm:request_queue_time_seconds', 'histogram',
           'Histogram of time spent in WAITING phase for request.',
           buckets=REQUEST_LATENCY_BUCKETS),
    Family('vllm:request_inference_time_seconds', 'histogram',
           'Histogram of time spent in RUNNING phase for request.',
           buckets=REQUEST_LATENCY_BUCKETS),
    Family('vllm:request_prefill_time_seconds', 'histogram',
           'Histogram of time spent in PREFILL phase for request.',
           buckets=REQUEST_LATENCY_BUCKETS),
    Family('vllm:request_decode_time_seconds', 'histogram',
           'Histogram of time spent in DECODE phase for request.',
           buckets=REQUEST_LATENCY_BUCKETS),
    Family('vllm:request_num_preemptions', 'histogram',
           'Histogram of the number of times a request was preempted.',
           buckets=(1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)),
    Family('vllm:request_prefill_kv_computed_tokens', 'histogram',
           'Histogram of new KV tokens computed during prefill (excluding cached tokens).',
           buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)),
)
BY_NAME = {f.name: f for f in FAMILIES}
TTFT_BUCKETS = BY_NAME["vllm:time_to_first_token_seconds"].buckets
ITL_BUCKETS = BY_NAME["vllm:inter_token_latency_seconds"].buckets

# vllm:cache_config_info: one series whose labels are the engine's cache settings (a stand-in's, here).
CACHE_CONFIG = {
    "_block_size_resolved": "True", "block_size": "16", "cache_dtype": "auto", "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": "16", "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9", "hash_block_size": "None", "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None", "kv_cache_max_concurrency": "None",
    "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": "None", "kv_offloading_backend": "native",
    "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None", "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none", "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32",
    "num_cpu_blocks": "None", "num_gpu_blocks": "None", "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None", "sliding_window": "None", "swa_bounded_replay": "True", "use_kda_recoverssm": "False",
    "use_replayssm": "False", "user_specified_block_size": "False",
}
CACHE_CONFIG_HELP = "Information of the LLMEngine CacheConfig"


class Histogram:
    """One histogram series: cumulative bucket counts as prometheus_client keeps them."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1


def go_float(v: float) -> str:
    """A number as prometheus_client writes it (its floatToGoString)."""
    d = float(v)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}"


def exposition(model: str, values: dict, created: float) -> str:
    """The ``vllm:`` families in prometheus_client's text format. ``values``: family name -> a
    number, a {label value: number} map (the family's enumerated label), or a Histogram;
    absent: zero. ``created``: when the series began (seconds since the epoch)."""
    lines: list[str] = []
    for f in FAMILIES:
        base = {"engine": "0", "model_name": model} if f.engine else {"model_name": model}
        series = [base] if f.labels is None else [{**base, f.labels[0]: v} for v in f.labels[1]]
        got = values.get(f.name)

        def value(s: dict, got=got, f=f):
            if isinstance(got, dict):
                return got.get(s[f.labels[0]], 0.0) if f.labels else 0.0
            return got if isinstance(got, (int, float)) else 0.0

        if f.kind == "histogram":
            h = got if isinstance(got, Histogram) else Histogram(f.buckets)
            lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} histogram"]
            for s in series:
                for edge, n in zip(f.buckets, h.counts, strict=True):
                    lines.append(f"{f.name}_bucket{_labels({**s, 'le': go_float(edge)})} {go_float(n)}")
                lines.append(f"{f.name}_bucket{_labels({**s, 'le': '+Inf'})} {go_float(h.count)}")
                lines.append(f"{f.name}_count{_labels(s)} {go_float(h.count)}")
                lines.append(f"{f.name}_sum{_labels(s)} {go_float(h.sum)}")
        else:
            sample = f"{f.name}_total" if f.kind == "counter" else f.name
            lines += [f"# HELP {sample} {f.help}", f"# TYPE {sample} {f.kind}"]
            lines += [f"{sample}{_labels(s)} {go_float(value(s))}" for s in series]
        if f.kind != "gauge":
            lines += [f"# HELP {f.name}_created {f.help}", f"# TYPE {f.name}_created gauge"]
            lines += [f"{f.name}_created{_labels(s)} {go_float(created)}" for s in series]
    lines += [f"# HELP vllm:cache_config_info {CACHE_CONFIG_HELP}", "# TYPE vllm:cache_config_info gauge",
              f"vllm:cache_config_info{_labels({**CACHE_CONFIG, 'engine': '0'})} 1.0"]
    return "\n".join(lines) + "\n"
