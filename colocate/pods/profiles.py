"""What a GPU pod serving one model can do: the numbers the stand-in's engine (``engine.py``) runs on.

A profile is data: the GPU (memory, bandwidth, tensor throughput, and the share of the bandwidth
its reads reach), the model (weight bytes, parameters, KV-cache bytes per token), the server
(``Server``: its kernels' share of the tensor throughput and its CPU time per step, sequence and
request, and its API queue) and vLLM's serving knobs. Both RTX 4090 sweeps published
(``MISTRAL7B_SWEEP``, ``LLAMA3_8B_SWEEP``, kept with their sources) are fitted with one GPU and a
server each, so a test and ``make bench-pod`` can check the fit; the kit's INT4 pod is derived from
them (``marlin_int4``). ``oracle`` is the stand-in of old: every request answered in a fixed 95 ms,
whatever its length or load, for tests that need speed.

Public names: ``PROFILES`` (name -> Profile), ``DEFAULT_PROFILE`` (the kit's pod), ``ORACLE``,
``get(name)``, ``DEFAULT_TTFT_P99_BUDGET_MS``, ``DEFAULT_TPOT_P50_BUDGET_MS`` and, per profile,
``knee_rps`` (the highest Poisson request rate of the knee workload within both budgets; checked
against ``engine.knee`` by tests/test_engine.py), ``decode_floor_ms`` and ``knee_rpm`` (the same,
per minute: the autoscaler's unit).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

GIB = 1024**3
DATA = Path(__file__).resolve().parents[1] / "data"
BLOCK_SIZE = 16  # vLLM's KV-cache block: 16 tokens
# The TTFT p99 a pod may reach at its knee. 1 s: a chat UI's first words within a second (the
# probe's new TTFT segment uses its own budget; this is the capacity planner's).
DEFAULT_TTFT_P99_BUDGET_MS = 1000.0
# The median pace a pod keeps at its knee: a token every 40 ms a sequence, the router's default
# minTokensPerS (25, colocate.cell.settings), so a pod at its capacity is never one the router marks slow.
DEFAULT_TPOT_P50_BUDGET_MS = 40.0
# The workload a profile's knee_rps is measured on: a short chat turn (the cited 4090 sweep's shape).
KNEE_INPUT_TOKENS, KNEE_OUTPUT_TOKENS = 256, 128
# ... sent for this long at each rate tried (engine.knee_requests): long enough for a queue to build
# where the pod cannot keep up, however long its answers take.
KNEE_SECONDS = 60.0


@dataclass(frozen=True)
class Point:
    """One row of a published sweep: at ``level`` (concurrency, or offered requests/s), what was measured."""

    level: float
    req_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None


@dataclass(frozen=True)
class Sweep:
    """A published sweep: its workload and rows, and where it is from.

    ``arrivals`` says how its requests were sent: "concurrency" (all queued at once, ``level``
    at a time, each client sending its next when its answer ends) or "poisson" (``level``
    requests/s, vLLM's benchmark_serving's schedule, ``engine.benchmark_serving_arrivals``).
    ``lengths``: a file in colocate/data of (prompt, answer) tokens per request, each answer
    exactly that long; else every prompt ``input_tokens`` long and ``max_tokens = output_tokens``."""

    name: str
    source: str  # title and URL
    measured: str  # what was measured (GPU, model, server), as the source says
    arrivals: str
    prompts: int  # requests per point
    points: tuple[Point, ...]
    input_tokens: int = 0
    output_tokens: int = 0  # max_tokens of each request
    lengths: str = ""
    mean_output_tokens: float | None = None  # output tok/s ÷ req/s, when the answers stopped early

    def requests(self) -> list[tuple[int, int]] | None:
        """The per-request (prompt, answer) tokens from ``lengths``; None for a fixed-length sweep."""
        if not self.lengths:
            return None
        with open(DATA / self.lengths) as f:
            return [(int(p), int(c)) for p, c in json.load(f)]


@dataclass(frozen=True)
class Server:
    """The serving software on its host: its kernels' share of the GPU's tensor throughput, and the
    CPU time a step, a sequence and a request take beside the GPU's; fitted per source, because
    they depend on the server's version (its kernels, its engine loop) and the host's CPU.

    A step costs ``step_ms`` (scheduling, launching, sampling) plus ``seq_ms`` for each sequence in
    it (preparing its input and handling its token where the engine's loop does it). A request
    spends ``request_ms`` in the API server before the engine sees it (parsing, tokenizing) and
    after its first token (detokenizing, the first write). The API server's queue: a new request
    waits ``frontend_queue_ms x rho^k / (1 - rho)`` behind the streams it already serves, ``rho`` =
    output tokens/s x ``frontend_ms_per_token`` / 1000 (its busy share), ``k`` =
    ``frontend_queue_power``: an M/M/1 queue's mean wait, rho x S / (1 - rho), with a service time
    S that grows as rho^(k-1) (each turn of the server's loop handles more streams' tokens)."""

    name: str
    measured: str
    compute_efficiency: float  # the share of the GPU's tensor_tflops its kernels reach in a step's products
    step_ms: float
    seq_ms: float
    request_ms: float = 0.0
    frontend_ms_per_token: float = 0.0
    frontend_queue_ms: float = 0.0
    frontend_queue_power: float = 2.0


@dataclass(frozen=True)
class Profile:
    """One GPU serving one model behind one server. A step's time is a roofline over its batch
    (``step_ms``): the linear layers take the longer of reading every weight once and computing
    every token of the step, attention reads each sequence's KV cache, and the server adds its
    CPU time; the GPU's bandwidth and tensor throughput at the efficiencies fitted to the sources."""

    name: str
    gpu: str
    model: str  # the model name the pod serves (vLLM's --served-model-name)
    gpu_memory_gib: float
    bandwidth_gb_s: float  # GB/s, 10^9 bytes
    tensor_tflops: float  # dense 16-bit tensor throughput, FP32 accumulate (what cuBLAS and Marlin reach for)
    weight_gb: float  # bytes of weights read per decode step, 10^9
    params_b: float  # parameters multiplied per token (every weight but the input embedding), 10^9: 2 FLOPs each
    kv_bytes_per_token: int  # layers x KV heads x head dim x 2 (K and V) x bytes per value
    bandwidth_efficiency: float  # the share of bandwidth_gb_s a step's reads reach
    server: Server
    gpu_memory_utilization: float = 0.9
    non_kv_gib: float = 1.5  # activations, CUDA graphs, the sampler: what vLLM's profiling run keeps out of the cache
    max_model_len: int = 8192
    max_num_seqs: int = 256  # vLLM's default
    max_num_batched_tokens: int = 2048  # vLLM's default for the OpenAI server on a GPU under 70 GiB
    # An answer's length when the request leaves it open (no ignore_eos): log-normal, in tokens.
    answer_median_tokens: float = 150.0
    answer_sigma: float = 0.6
    sweeps: tuple[Sweep, ...] = ()  # the published sweeps this profile is fitted to (bench.pod --compare)
    # Requests/s at the knee: Poisson arrivals of KNEE_INPUT_TOKENS in, max KNEE_OUTPUT_TOKENS out, for
    # KNEE_SECONDS, TTFT p99 within DEFAULT_TTFT_P99_BUDGET_MS and TPOT p50 within DEFAULT_TPOT_P50_BUDGET_MS
    # (engine.knee; tests/test_engine.py checks the figure).
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
    def frontend_ms_per_token(self) -> float:
        return self.server.frontend_ms_per_token

    @property
    def frontend_queue_ms(self) -> float:
        return self.server.frontend_queue_ms

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds: GPU memory x utilization, less weights and non-KV memory, in whole blocks."""
        free = self.gpu_memory_gib * GIB * self.gpu_memory_utilization - self.weight_gb * 1e9 - self.non_kv_gib * GIB
        return max(0, int(free // (self.kv_bytes_per_token * BLOCK_SIZE))) * BLOCK_SIZE

    @property
    def kv_blocks(self) -> int:
        return self.kv_cache_tokens // BLOCK_SIZE

    def step_ms(self, decodes: int, prefill_tokens: int, kv_tokens: int = 0) -> float:
        """One engine step's time for its batch: ``decodes`` sequences making a token, ``prefill_tokens``
        of prompts, ``kv_tokens`` of context their attention reads."""
        if self.oracle_ms is not None:
            return 0.0
        read = 1e-6 / (self.bandwidth_gb_s * self.bandwidth_efficiency)  # ms per byte
        weights = self.weight_gb * 1e9 * read
        compute = 2e9 * self.params_b * (decodes + prefill_tokens) / (self.tensor_tflops * 1e9 * self.server.compute_efficiency)
        seqs = decodes + (1 if prefill_tokens else 0)
        return (self.server.step_ms + self.server.seq_ms * seqs + max(weights, compute)
                + kv_tokens * self.kv_bytes_per_token * read)

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

MISTRAL7B_SWEEP = Sweep(
    name="mistral-7b-4090",
    source='mushfiqrahman.dev, "Benchmarking Mistral-7B on RTX 4090: vLLM Concurrency, Latency, and Capacity '
           'Planning" (https://mushfiqrahman.dev/benchmarking-mistral-7b-on-rtx-4090-vllm-concurrency-latency-'
           'and-capacity-planning/), Part 1',
    measured="one RTX 4090 24 GB, vLLM (OpenAI server, version not stated), mistralai/Mistral-7B-Instruct-v0.3 "
             "(16-bit); 300 prompts of 256 tokens, max 128 out, all sent at once under a concurrency cap",
    arrivals="concurrency", prompts=300, input_tokens=256, output_tokens=128,
    points=(Point(4, 2.09, 210, 53, 157), Point(8, 3.78, 377, 55, 268), Point(16, 6.44, 644, 97, 503),
            Point(32, 9.73, 975, 277, 938), Point(48, 11.87, 1190, 840, 1483)),
    mean_output_tokens=100.0,  # 210/2.09 .. 1190/11.87: the answers stopped at ~100 tokens on average
)

LLAMA3_8B_SWEEP = Sweep(
    name="llama3-8b-4090",
    source="IOG-Foundation, llm-inference-benchmarks (https://github.com/IOG-Foundation/llm-inference-benchmarks), "
           "results/vllm_200prompts{1,4,8,16,32}qps_Meta-Llama-3-8B-Instruct_sharegpt_1xNVIDIA-GeForce-RTX-4090.json, "
           "dated 2025-06-10",
    measured="one RTX 4090 on io.net, vLLM 0.8.5 (vllm/vllm-openai:v0.8.5) serving meta-llama/Meta-Llama-3-8B-Instruct "
             "in 16-bit; vLLM 0.8.5's benchmark_serving, streamed /v1/completions, 200 ShareGPT V3 prompts (206 tokens "
             "in, 202 out on average, each answer capped at its reference), Poisson arrivals (seed 42) at 32, 16, 8, 4, "
             "then 1 requests/s on one server",
    arrivals="poisson", prompts=200, lengths="sharegpt-llama3-200.json",
    # (offered requests/s, achieved req/s, output tok/s, TTFT p50, TTFT p99, ITL p50)
    points=(Point(1, 1.04, 210, 43.5, 110.7, 19.24), Point(4, 3.39, 685, 50.0, 132.1, 21.31),
            Point(8, 5.27, 1063, 61.0, 180.3, 24.09), Point(16, 6.97, 1408, 74.4, 193.1, 26.73),
            Point(32, 8.16, 1646, 162.9, 330.5, 28.41)),
)

# ---- servers ----------------------------------------------------------------------------------

# vLLM 0.8.5: the V1 engine, whose API server is a process of its own (tokenizing, detokenizing and
# streaming off the engine's loop). The kit's pods run a later V1 vLLM (settings: vllm/vllm-openai:v0.33),
# so the kit's default profile takes this server: the nearest one measured.
VLLM_V1_SERVER = Server(
    name="vllm-0.8.5", measured="fitted to LLAMA3_8B_SWEEP (vLLM 0.8.5 on an io.net RTX 4090 host)",
    compute_efficiency=0.9, step_ms=0.9, seq_ms=0.075, request_ms=10.0,
)

# The Mistral sweep's server: its version is not stated. Its decode is slower per sequence than the
# hardware's (0.8.5 on the same GPU makes a larger model's tokens faster at a larger batch), and
# its first token waits far longer at concurrency 32-48 than any queue in the engine explains
# (48 clients never fill vLLM's 256 sequences nor the KV cache), which is what vLLM's V0 engine
# did: the scheduler, detokenizing and the API server on the CPU beside every step.
MISTRAL_SWEEP_SERVER = Server(
    name="mistral-sweep-server", measured="fitted to MISTRAL7B_SWEEP (vLLM of unstated version; behaves as V0)",
    compute_efficiency=0.7, step_ms=1.0, seq_ms=0.16, request_ms=11.0, frontend_ms_per_token=0.7,
    frontend_queue_ms=220.0, frontend_queue_power=3.0,
)

PROFILES: dict[str, Profile] = {}


def _add(p: Profile) -> Profile:
    PROFILES[p.name] = p
    return p


# ---- one RTX 4090: the GPU, fitted once to both 16-bit sweeps ------------------------------------

class Gpu(TypedDict):
    """A GPU's fields of a Profile: its memory, bandwidth and 16-bit tensor throughput (the vendor's
    figures) and the share of the bandwidth a decode step's reads reach (fitted)."""

    gpu: str
    gpu_memory_gib: float
    bandwidth_gb_s: float
    tensor_tflops: float
    bandwidth_efficiency: float


RTX4090 = Gpu(gpu="RTX 4090 24 GB", gpu_memory_gib=24.0, bandwidth_gb_s=1008.0, tensor_tflops=165.2,
              bandwidth_efficiency=0.9)

# Mistral-7B-v0.3 in 16-bit: 7.25 B parameters (14.5 GB), 0.13 B of them the input embedding; 32 layers,
# 8 KV heads of 128: 128 KiB of KV cache a token.
RTX4090_MISTRAL7B_FP16 = _add(Profile(
    name="rtx4090-mistral-7b-fp16", model="mistralai/Mistral-7B-Instruct-v0.3", **RTX4090,
    weight_gb=14.5, params_b=7.11, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
    server=MISTRAL_SWEEP_SERVER, answer_median_tokens=130.0, answer_sigma=0.86, sweeps=(MISTRAL7B_SWEEP,),
    knee_rps=10.97, notes="the Mistral sweep's GPU, model and server",
))

# Llama-3-8B in 16-bit: 8.03 B parameters (16.06 GB), 0.53 B the input embedding; 32 layers, 8 KV heads
# of 128: 128 KiB a token.
RTX4090_LLAMA3_8B_FP16 = _add(Profile(
    name="rtx4090-llama3-8b-fp16", model="meta-llama/Meta-Llama-3-8B-Instruct", **RTX4090,
    weight_gb=16.06, params_b=7.50, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
    server=VLLM_V1_SERVER, answer_median_tokens=130.0, answer_sigma=0.86, sweeps=(LLAMA3_8B_SWEEP,),
    knee_rps=17.06, notes="the IOG sweep's GPU, model and server (vLLM 0.8.5)",
))

# ---- the kit's pod: INT4, derived from the 16-bit fits -----------------------------------------

# GPTQ/AWQ INT4 with groups of 128: 4 bits a weight plus a 16-bit scale and a 4-bit zero per 128.
INT4_BITS = 4 + (16 + 4) / 128


def marlin_int4(gpu: Gpu, server: Server, *, linear_params_b: float, lm_head_params_b: float, **kw) -> Profile:
    """An INT4 (Marlin kernel) profile from a 16-bit fit, by one rule: the linear layers' weights are
    read at INT4_BITS instead of 16 (so a decode step at small batch reads 1/3.9 of their bytes:
    Marlin's "close to 4x" on the linear layers up to batch 16-32, Frantar et al., PPoPP 2025,
    arXiv 2408.11743), the output layer (lm_head), the KV cache and every FLOP stay 16-bit; the GPU's
    fitted efficiencies and the server are the 16-bit fit's. The roofline then gives what Marlin
    reports at larger batches: once a step's tokens make the products compute-bound (from ~30
    sequences here) the speed-up falls, and end to end it stays under Marlin's 2.8x in vLLM
    (tests/test_engine.py checks both)."""
    weight_gb = (linear_params_b * INT4_BITS / 8 + lm_head_params_b * 2)
    return Profile(**gpu, server=server, weight_gb=round(weight_gb, 2), params_b=linear_params_b + lm_head_params_b,
                   **kw)


# The kit's default pod (colocate.cell.settings: RTX 4090, Qwen2.5-7B-Instruct GPTQ-Int4, --max-model-len 8192):
# 6.53 B parameters in the 28 layers' linear layers, 0.545 B in the output layer and as many in the input
# embedding (untied); 28 layers, 4 KV heads of 128: 56 KiB of KV cache a token.
RTX4090_QWEN7B_INT4 = _add(marlin_int4(
    RTX4090, VLLM_V1_SERVER, linear_params_b=6.53, lm_head_params_b=0.545,
    name="rtx4090-qwen2.5-7b-int4", model="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    kv_bytes_per_token=28 * 4 * 128 * 2 * 2,
    answer_median_tokens=130.0, answer_sigma=0.86, knee_rps=22.31,
    notes="derived from the 4090's 16-bit fits by marlin_int4, behind vLLM 0.8.5's server",
))
# The same model in 16-bit: what marlin_int4's speed-up is measured against (tests/test_engine.py).
RTX4090_QWEN7B_FP16 = replace(RTX4090_QWEN7B_INT4, name="rtx4090-qwen2.5-7b-fp16", model="Qwen/Qwen2.5-7B-Instruct",
                              weight_gb=round((6.53 + 0.545) * 2, 2), knee_rps=0.0, notes="16-bit reference of the default")

A100_SOURCE = ('John Musgrave, "vLLM throughput-latency sweep on NVIDIA A100" '
               "(https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on): one A100 40GB, vLLM 0.23.0 defaults, "
               "meta-llama/Llama-3.1-8B-Instruct BF16; vllm bench serve, random 1,024 tokens in, 128 out with "
               "--ignore-eos, --max-concurrency C, C x 20 prompts. Its summary: one request decodes at about 75 "
               "tokens/s (77 % of the bandwidth ceiling); concurrency 8 gives 6.6x the throughput at almost no "
               "latency cost; the knee sits at 8")

# A second GPU: the full table of the source above was not reachable here, so the profile's two GPU
# efficiencies are fitted to the two figures its summary states (A100_CLAIMS), behind a V1 server as
# vLLM 0.23 is, and the rest follows from the model.
A100_LLAMA8B = _add(Profile(
    name="a100-40gb-llama3.1-8b", gpu="A100 40GB", model="meta-llama/Llama-3.1-8B-Instruct",
    gpu_memory_gib=40.0, bandwidth_gb_s=1555.0, tensor_tflops=312.0, bandwidth_efficiency=0.843,
    weight_gb=16.06, params_b=7.50, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,  # BF16: 128 KiB a token
    server=VLLM_V1_SERVER, answer_median_tokens=130.0, answer_sigma=0.86,
    knee_rps=31.88,
    notes="fitted to the two figures of its source's summary (A100_CLAIMS)",
))
# (concurrency 1: decode tokens/s of one stream; concurrency 8: output throughput / concurrency 1's)
A100_CLAIMS = {"single_stream_tok_s": 75.0, "throughput_gain_c8": 6.6, "input_tokens": 1024, "output_tokens": 128}

ORACLE = _add(Profile(
    name="oracle", gpu="none", model="standin/qwen2.5-7b-instruct-gptq-int4", gpu_memory_gib=0.0,
    bandwidth_gb_s=1.0, tensor_tflops=1.0, weight_gb=0.0, params_b=0.0, kv_bytes_per_token=1,
    bandwidth_efficiency=1.0, server=Server("none", "no server", 1.0, 0.0, 0.0),
    oracle_ms=95.0,
    notes="the stand-in of old: any request in 95 ms (compute_ms), nine tokens at most, at any load",
))

DEFAULT_PROFILE = RTX4090_QWEN7B_INT4.name


def get(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown pod profile {name!r}: one of {', '.join(sorted(PROFILES))}") from None
