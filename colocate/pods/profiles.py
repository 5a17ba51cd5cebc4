"""What a GPU pod serving one model can do: the numbers the stand-in's engine (``engine.py``) runs on.

A profile is data: the GPU (memory, bandwidth), the model (weight bytes, KV-cache bytes per token),
vLLM's serving knobs (``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``,
``max_num_batched_tokens``) and the step-time coefficients fitted to a published sweep, which is
kept beside them (``Sweep``) with its source so that a test and ``make bench-pod`` can check the
fit. ``oracle`` is the stand-in of old: every request answered in a fixed 95 ms, whatever its
length or load, for tests that need speed.

Public names: ``PROFILES`` (name -> Profile), ``DEFAULT_PROFILE`` (the kit's pod),
``ORACLE``, ``get(name)``, ``DEFAULT_TTFT_P99_BUDGET_MS`` and, per profile, ``knee_rps`` (the
highest Poisson request rate of the profile's sweep workload whose TTFT p99 stays within that
budget; checked against ``engine.knee`` by tests/test_engine.py), ``decode_floor_ms`` and
``knee_rpm`` (the same, per minute: the autoscaler's unit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1024**3
BLOCK_SIZE = 16  # vLLM's KV-cache block: 16 tokens
# The TTFT p99 a pod may reach at its knee. 1 s: a chat UI's first words within a second (the
# probe's new TTFT segment uses its own budget; this is the capacity planner's).
DEFAULT_TTFT_P99_BUDGET_MS = 1000.0
# The workload a profile's knee_rps is measured on: a short chat turn (the cited 4090 sweep's shape).
KNEE_INPUT_TOKENS, KNEE_OUTPUT_TOKENS = 256, 128


@dataclass(frozen=True)
class Point:
    """One row of a published sweep: at ``concurrency`` (or Poisson ``rate``), what was measured."""

    concurrency: int
    req_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float | None = None


@dataclass(frozen=True)
class Sweep:
    """A published sweep the profile is fitted to: its workload and rows, and where it is from."""

    source: str  # title and URL
    measured: str  # what was measured (GPU, model, server), as the source says
    input_tokens: int
    output_tokens: int  # max_tokens of each request
    prompts: int  # requests per point
    points: tuple[Point, ...]
    mean_output_tokens: float | None = None  # output tok/s ÷ req/s, when the answers stopped early


@dataclass(frozen=True)
class Profile:
    name: str
    gpu: str
    model: str  # the model name the pod serves (vLLM's --served-model-name)
    gpu_memory_gib: float
    bandwidth_gb_s: float  # GB/s, 10^9 bytes
    weight_gb: float  # bytes of weights read per decode step, 10^9
    kv_bytes_per_token: int  # layers x KV heads x head dim x 2 (K and V) x bytes per value
    # Step time (ms) = step_base_ms + decode_ms_per_seq x decoding sequences
    #                  + prefill_ms_per_token x prompt tokens in the step + attention_ms_per_1k_kv x context (k tokens)
    step_base_ms: float
    decode_ms_per_seq: float
    prefill_ms_per_token: float
    attention_ms_per_1k_kv: float = 0.0
    # The API server in front of the engine (one Python process: detokenizing, streaming): a new
    # request reaches the engine after frontend_queue_ms x rho^2 / (1 - rho), the mean queue of an
    # M/M/1 server at utilisation rho = output tokens/s x frontend_ms_per_token / 1000.
    frontend_ms_per_token: float = 0.0
    frontend_queue_ms: float = 0.0
    gpu_memory_utilization: float = 0.9
    non_kv_gib: float = 1.5  # activations, CUDA graphs, the sampler: what vLLM's profiling run keeps out of the cache
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # vLLM's default for the OpenAI server on a GPU under 70 GiB
    # An answer's length when the request leaves it open (no ignore_eos): log-normal, in tokens.
    answer_median_tokens: float = 150.0
    answer_sigma: float = 0.6
    sweep: Sweep | None = None
    # Requests/s at the knee: Poisson arrivals of KNEE_INPUT_TOKENS in, max KNEE_OUTPUT_TOKENS out, TTFT p99
    # within DEFAULT_TTFT_P99_BUDGET_MS (engine.knee; tests/test_engine.py checks the figure).
    knee_rps: float = 0.0
    notes: str = ""
    oracle_ms: float | None = None  # set: no engine, every request takes this long (the stand-in of old)
    extra: dict = field(default_factory=dict)

    @property
    def decode_floor_ms(self) -> float:
        """The physical floor of one decode step: every weight read once from GPU memory."""
        return self.weight_gb / self.bandwidth_gb_s * 1000.0

    @property
    def knee_rpm(self) -> float:
        return self.knee_rps * 60.0

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds: GPU memory x utilization, less weights and non-KV memory, in whole blocks."""
        free = self.gpu_memory_gib * GIB * self.gpu_memory_utilization - self.weight_gb * 1e9 - self.non_kv_gib * GIB
        return max(0, int(free // (self.kv_bytes_per_token * BLOCK_SIZE))) * BLOCK_SIZE

    @property
    def kv_blocks(self) -> int:
        return self.kv_cache_tokens // BLOCK_SIZE

    def step_ms(self, decodes: int, prefill_tokens: int, kv_tokens: int = 0) -> float:
        """One engine step's time for its batch."""
        return (self.step_base_ms + self.decode_ms_per_seq * decodes + self.prefill_ms_per_token * prefill_tokens
                + self.attention_ms_per_1k_kv * kv_tokens / 1000.0)

    @property
    def single_stream_tok_s(self) -> float:
        return 1000.0 / self.step_ms(1, 0)

    def answer_mean_tokens(self, cap: int) -> float:
        """Mean of min(natural length, cap): what an answer of ``max_tokens = cap`` averages."""
        # E[min(L, c)] for log-normal L, by a fine sum over the quantiles (no scipy here).
        n = 2000
        total = 0.0
        for i in range(n):
            q = (i + 0.5) / n
            total += min(cap, self.answer_median_tokens * math.exp(self.answer_sigma * _probit(q)))
        return total / n


def _probit(q: float) -> float:
    """The standard normal's quantile (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if q < 0.02425:
        r = math.sqrt(-2 * math.log(q))
        return (((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) / \
            ((((d[0] * r + d[1]) * r + d[2]) * r + d[3]) * r + 1)
    if q > 1 - 0.02425:
        return -_probit(1 - q)
    r = q - 0.5
    s = r * r
    return (((((a[0] * s + a[1]) * s + a[2]) * s + a[3]) * s + a[4]) * s + a[5]) * r / \
        (((((b[0] * s + b[1]) * s + b[2]) * s + b[3]) * s + b[4]) * s + 1)


# ---- the published sweeps --------------------------------------------------------------------

RTX4090_SWEEP = Sweep(
    source='mushfiqrahman.dev, "Benchmarking Mistral-7B on RTX 4090: vLLM Concurrency, Latency, and Capacity '
           'Planning" (https://mushfiqrahman.dev/benchmarking-mistral-7b-on-rtx-4090-vllm-concurrency-latency-'
           'and-capacity-planning/), Part 1',
    measured="one RTX 4090 24 GB, vLLM (OpenAI server), mistralai/Mistral-7B-Instruct-v0.3; 300 prompts of 256 "
             "tokens, max 128 out, all sent at once under a concurrency cap",
    input_tokens=256, output_tokens=128, prompts=300,
    points=(Point(4, 2.09, 210, 53, 157), Point(8, 3.78, 377, 55, 268), Point(16, 6.44, 644, 97, 503),
            Point(32, 9.73, 975, 277, 938), Point(48, 11.87, 1190, 840, 1483)),
    mean_output_tokens=100.0,  # 210/2.09 .. 1190/11.87: the answers stopped at ~100 tokens on average
)

PROFILES: dict[str, Profile] = {}


def _add(p: Profile) -> Profile:
    PROFILES[p.name] = p
    return p


# The kit's default pod (colocate.settings: RTX 4090, Qwen2.5-7B-Instruct GPTQ-Int4, --max-model-len 8192).
# Its timing is fitted to the Mistral-7B sweep above: the one public concurrency sweep of a 7B model in
# vLLM on this GPU. That run's decode step (~19 ms at 4 sequences) is 1.3x an FP16 7B's floor
# (14.5 GB / 1,008 GB/s = 14.4 ms) and 4x this INT4 model's (4.5 GB: 4.5 ms), so the profile is
# conservative for INT4: a real INT4 pod decodes faster, and its knee is higher.
RTX4090_QWEN7B_INT4 = _add(Profile(
    name="rtx4090-qwen2.5-7b-int4", gpu="RTX 4090 24 GB", model="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    gpu_memory_gib=24.0, bandwidth_gb_s=1008.0, weight_gb=4.5,
    kv_bytes_per_token=28 * 4 * 128 * 2 * 2,  # 28 layers, 4 KV heads, head dim 128, K and V, FP16: 56 KiB
    step_base_ms=14.5, decode_ms_per_seq=0.30, prefill_ms_per_token=0.10,
    frontend_ms_per_token=0.72, frontend_queue_ms=110.0,
    # Fitted, not vLLM's default (256): the source's TTFT at concurrency 48 is a queue of ~8 requests
    # (Little's law on its mean TTFT: 0.667 s x 11.87 req/s), as if at most ~40 sequences ran.
    max_num_seqs=40,
    answer_median_tokens=130.0, answer_sigma=0.86,
    sweep=RTX4090_SWEEP, knee_rps=9.69,
    notes="timing fitted to a Mistral-7B (FP16) sweep on the same GPU; conservative for INT4",
))

A100_SOURCE = ('John Musgrave, "vLLM throughput-latency sweep on NVIDIA A100" '
               "(https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on): one A100 40GB, vLLM 0.23.0 defaults, "
               "meta-llama/Llama-3.1-8B-Instruct BF16; vllm bench serve, random 1,024 tokens in, 128 out with "
               "--ignore-eos, --max-concurrency C, C x 20 prompts. Its summary: one request decodes at about 75 "
               "tokens/s (77 % of the bandwidth ceiling); concurrency 8 gives 6.6x the throughput at almost no "
               "latency cost; the knee sits at 8")

# A second GPU: the full table of the source above was not reachable here, so the profile is fitted to
# the two figures its summary states (A100_CLAIMS) and the rest follows from the model.
A100_LLAMA8B = _add(Profile(
    name="a100-40gb-llama3.1-8b", gpu="A100 40GB", model="meta-llama/Llama-3.1-8B-Instruct",
    gpu_memory_gib=40.0, bandwidth_gb_s=1555.0, weight_gb=16.06,
    kv_bytes_per_token=32 * 8 * 128 * 2 * 2,  # 32 layers, 8 KV heads, head dim 128, K and V, BF16: 128 KiB
    # A prompt token costs less than its FLOPs alone (0.05 ms at 62 % of 312 TFLOPS): in a mixed step the
    # prompt shares the decode's read of the weights, which this linear model folds into the coefficient.
    step_base_ms=13.2, decode_ms_per_seq=0.10, prefill_ms_per_token=0.04,
    answer_median_tokens=130.0, answer_sigma=0.86,
    knee_rps=56.62,
    notes="fitted to the two figures of its source's summary (A100_CLAIMS); no API-server queue modelled",
))
# (concurrency 1: decode tokens/s of one stream; concurrency 8: output throughput / concurrency 1's)
A100_CLAIMS = {"single_stream_tok_s": 75.0, "throughput_gain_c8": 6.6, "input_tokens": 1024, "output_tokens": 128}

ORACLE = _add(Profile(
    name="oracle", gpu="none", model="standin/qwen2.5-7b-instruct-gptq-int4", gpu_memory_gib=0.0,
    bandwidth_gb_s=1.0, weight_gb=0.0, kv_bytes_per_token=1, step_base_ms=0.0, decode_ms_per_seq=0.0,
    prefill_ms_per_token=0.0, oracle_ms=95.0,
    notes="the stand-in of old: any request in 95 ms (compute_ms), nine tokens at most, at any load",
))

DEFAULT_PROFILE = RTX4090_QWEN7B_INT4.name


def get(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown pod profile {name!r}: one of {', '.join(sorted(PROFILES))}") from None
