"""A pure model of one vLLM engine, step by step, after vLLM v1's scheduler.

vllm-project/vllm ``vllm/v1/core/sched/scheduler.py``: ``schedule()`` fills one engine step from
the running queue, then the waiting queue, within a token budget (``max_num_batched_tokens``,
chunked prefill) and a sequence cap (``max_num_seqs``); the KV cache is a manager of its own
(``vllm/v1/core/kv_cache_manager.py``) that hands out 16-token blocks, finds a prompt's cached
prefix by chained block hashes, and says no when it is full, whereupon the last running request is
preempted (its blocks freed, its tokens recomputed later). Here the same, with the step's time
taken from the profile (``Profile.step_ms``) instead of a GPU.

Nothing here sleeps or reads a clock: ``Engine.step()`` returns the step's duration and the tokens
it made, and the caller advances time. The stand-in's engine thread waits that long in real time
(``standin/``); ``simulate`` and ``knee`` run it in virtual time, a sweep in milliseconds.
"""

from __future__ import annotations

import heapq
import math
import random
import re
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .profiles import (
    BLOCK_SIZE,
    DEFAULT_TPOT_P50_BUDGET_MS,
    DEFAULT_TTFT_P99_BUDGET_MS,
    KNEE_INPUT_TOKENS,
    KNEE_OUTPUT_TOKENS,
    KNEE_SECONDS,
    Profile,
)

# ---- the prompt's tokens ---------------------------------------------------------------------
# No tokenizer can be downloaded here, so prompts are cut into tokens the way a byte-level BPE
# with a 150k vocabulary (Qwen2.5's) cuts English: its pre-tokenizer's pieces (a word with its
# leading space, one digit, a run of punctuation), each piece one token when it is a common word's
# length (up to 8 characters with the space), longer pieces one token per 4 characters. Qwen's
# special tokens (<|im_start|> ...) are one token each. It gives 3.3 characters a token on
# docs/pods.md (prose, code, tables) and 4.4 on plain English (tests/test_engine.py), where BPE vocabularies
# of this size give about 4 on English: within about 15 %, by that yardstick only (no tokenizer can
# be downloaded here to measure against Qwen's own).
_PIECE = re.compile(r"<\|[a-z_]+\|>|'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+|\d| ?[^\s\w]+|\s+", re.UNICODE)


def tokenize(text: str) -> list[int]:
    """Token ids for ``text`` (stable across processes: crc32 of each piece, a part's index mixed in)."""
    ids: list[int] = []
    for piece in _PIECE.findall(text):
        if len(piece) <= 8 or piece.startswith("<|"):
            ids.append(zlib.crc32(piece.encode()))
        else:
            for i in range(0, len(piece), 4):
                ids.append(zlib.crc32(piece[i:i + 4].encode()) ^ i)
    return ids or [0]


def chat_text(messages: Sequence[dict]) -> str:
    """The prompt a Qwen2.5 chat template renders (its default system prompt when none is given)."""
    parts = []
    if not messages or messages[0].get("role") != "system":
        parts.append("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role')}\n{content if isinstance(content, str) else ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# ---- the KV cache ------------------------------------------------------------------------------

@dataclass
class _Block:
    id: int
    ref: int = 0
    hash: int | None = None


def block_hashes(tokens: Sequence[int], salt: str | None = None, known: Sequence[int] = ()) -> list[int]:
    """The chained hashes of the full 16-token blocks of ``tokens``: each hashes its parent's and its
    tokens, the first the ``cache_salt`` too (vLLM's hash_block_tokens with extra keys); ``known``:
    the first hashes, already computed. ``tokens`` starts after the blocks ``known`` hashes."""
    out: list[int] = list(known)
    parent = out[-1] if out else hash(("colocate-none-hash", salt))
    for i in range(len(tokens) // BLOCK_SIZE):
        parent = hash((parent, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
        out.append(parent)
    return out


class KVCacheManager:
    """Blocks of 16 tokens; a free queue in LRU order (a freed block goes to its end, eviction takes
    its head); full blocks stay findable by hash until evicted (automatic prefix caching)."""

    def __init__(self, num_blocks: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.owned: dict[str, list[int]] = {}  # request id -> its blocks, in order
        self.prefix_caching = prefix_caching
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: the share of blocks not free (0-1)."""
        return 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 1.0

    def computed_blocks(self, req: Request) -> list[int]:
        """The blocks of ``req``'s prompt already cached, longest chain from the start. As vLLM,
        never the whole prompt: its last token is computed again to sample the first new one."""
        if not self.prefix_caching:
            return []
        hashes = req.hashes_upto(len(req.prompt) // BLOCK_SIZE)
        if len(hashes) * BLOCK_SIZE == len(req.prompt):
            hashes = hashes[:-1]
        found = []
        for h in hashes:
            bid = self.cached.get(h)
            if bid is None:
                break
            found.append(bid)
        self.queries += len(req.prompt)
        self.hits += len(found) * BLOCK_SIZE
        return found

    def allocate(self, req: Request, new_tokens: int, computed: Sequence[int] = ()) -> bool:
        """Room for ``new_tokens`` more of ``req`` (after ``computed`` cached blocks); False, and
        nothing changed, when there are not enough free blocks."""
        have = self.owned.get(req.id)
        total = req.computed + len(computed) * BLOCK_SIZE + new_tokens
        need = -(-total // BLOCK_SIZE) - (len(have) if have else 0) - len(computed)
        if need <= 0 and not computed and have is not None:
            return True  # a decode step's usual case: its token fits in the blocks it has
        need = max(0, need)
        touched_free = sum(1 for b in computed if self.blocks[b].ref == 0) if computed else 0
        if need > len(self.free) - touched_free:
            return False
        blocks = self.owned.setdefault(req.id, [])
        for b in computed:
            if self.blocks[b].ref == 0:
                del self.free[b]
            self.blocks[b].ref += 1
            blocks.append(b)
        for _ in range(need):
            bid, _none = self.free.popitem(last=False)  # the least recently used
            block = self.blocks[bid]
            if block.hash is not None:
                if self.cached.get(block.hash) == bid:
                    del self.cached[block.hash]
                block.hash = None
            block.ref = 1
            blocks.append(bid)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Make ``req``'s newly full blocks findable by their hashes."""
        if not self.prefix_caching:
            return
        blocks = self.owned.get(req.id, [])
        full = min(req.computed // BLOCK_SIZE, len(blocks))
        if full <= req.cached_blocks:
            return
        hashes = req.hashes_upto(full)
        for i in range(req.cached_blocks, full):
            block = self.blocks[blocks[i]]
            if block.hash is None:
                block.hash = hashes[i]
                self.cached.setdefault(hashes[i], block.id)
        req.cached_blocks = full

    def release(self, req: Request) -> None:
        """Free ``req``'s blocks: its last ones join the free queue first, so its prefix is evicted last."""
        for bid in reversed(self.owned.pop(req.id, [])):
            block = self.blocks[bid]
            block.ref -= 1
            if block.ref == 0:
                self.free[bid] = None
        req.cached_blocks = 0


# ---- requests and the scheduler -----------------------------------------------------------------

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_new: int  # the answer's length, decided at arrival (answer_length)
    salt: str | None = None
    arrival: float = 0.0
    status: str = WAITING
    computed: int = 0  # tokens whose KV is in the cache
    output: int = 0  # tokens sampled
    cached_blocks: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    # The answer's token ids, when known: its blocks are then found again when a next turn's prompt
    # carries the answer back (a chat's history), as vLLM's are.
    output_ids: list[int] = field(default_factory=list, repr=False)
    _hashes: list[int] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.output

    def hashes_upto(self, blocks: int) -> list[int]:
        """The hashes of the first ``blocks`` full blocks of prompt and output (computed once each)."""
        if len(self._hashes) < blocks:
            start, end, n = len(self._hashes) * BLOCK_SIZE, blocks * BLOCK_SIZE, len(self.prompt)
            # Only the blocks not yet hashed. Output tokens without known ids stand for themselves: ids
            # need only be stable for the hashes.
            ids = self.output_ids
            tokens = self.prompt[start:end] + [ids[i] if i < len(ids) else -(i + 1)
                                               for i in range(max(0, start - n), max(0, end - n))]
            self._hashes = block_hashes(tokens, self.salt, self._hashes)
        return self._hashes[:blocks]


@dataclass
class Step:
    """One engine step: who ran how many tokens, its duration, and the tokens it made."""

    scheduled: dict[str, int]
    duration_s: float
    decodes: int
    prefill_tokens: int
    made: list[tuple[str, int, bool]]  # (request id, output token index, finished)
    preempted: list[str]


class Frontend:
    """The API server's queue: how long a new request waits before the engine sees it, from the
    output token rate of the last ``WINDOW_S`` seconds (the server's busy share, rho)."""

    WINDOW_S = 10.0  # long enough that one burst of tokens does not swing the delay
    MAX_RHO = 0.98

    def __init__(self, profile: Profile):
        self.profile = profile
        self._made: deque[tuple[float, int]] = deque()
        self._count = 0

    def tokens(self, now: float, n: int) -> None:
        if n and self.profile.frontend_ms_per_token:
            self._made.append((now, n))
            self._count += n
        while self._made and self._made[0][0] < now - self.WINDOW_S:
            self._count -= self._made.popleft()[1]

    def rho(self, now: float) -> float:
        self.tokens(now, 0)
        return min(self.MAX_RHO, self._count / self.WINDOW_S * self.profile.frontend_ms_per_token / 1000.0)

    def delay_s(self, now: float) -> float:
        """The API server's own time for a new request, plus its wait behind the tokens it streams."""
        return self.profile.server.request_ms / 1000.0 + queue_ms(self.profile, self.rho(now)) / 1000.0


def queue_ms(profile: Profile, rho: float) -> float:
    """The API server's mean queue at busy share ``rho``: ``frontend_queue_ms x rho^k / (1 - rho)``."""
    rho = min(Frontend.MAX_RHO, rho)
    return profile.frontend_queue_ms * rho ** profile.server.frontend_queue_power / (1.0 - rho)


class Engine:
    """vLLM's engine core, modelled: ``add`` requests, call ``step`` while ``busy``."""

    def __init__(self, profile: Profile, prefix_caching: bool = True):
        self.profile = profile
        self.frontend = Frontend(profile)
        self.kv = KVCacheManager(profile.kv_blocks, prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished = 0
        self.preemptions = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        if len(req.prompt) + req.max_new > self.profile.max_model_len:
            raise ValueError(f"request {req.id}: {len(req.prompt)} + {req.max_new} tokens exceed "
                             f"max_model_len {self.profile.max_model_len}")
        self.requests[req.id] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        """The client left: free the request's blocks (vLLM aborts on disconnect)."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req)
        req.status = FINISHED

    def schedule(self) -> tuple[dict[str, int], list[str]]:
        """One step's batch: running requests first (a decode token, or their prompt's next chunk),
        then waiting ones while the token budget, the sequence cap and the KV cache allow."""
        budget = self.profile.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.computed, budget)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()  # the last admitted goes first (vLLM's FCFS policy)
                self.kv.release(victim)
                victim.computed, victim.status = 0, WAITING
                victim.preemptions += 1
                self.preemptions += 1
                self.waiting.appendleft(victim)
                preempted.append(victim.id)
                scheduled.pop(victim.id, None)
                if victim is req:
                    break
            else:
                scheduled[req.id] = n
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
                req = self.waiting[0]
                computed: list[int] = []
                if req.computed == 0:
                    computed = self.kv.computed_blocks(req)
                n = min(req.num_tokens - req.computed - len(computed) * BLOCK_SIZE, budget)
                if not self.kv.allocate(req, n, computed):
                    break
                self.waiting.popleft()
                req.computed += len(computed) * BLOCK_SIZE
                req.prefix_hit_tokens += len(computed) * BLOCK_SIZE
                req.status = RUNNING
                self.running.append(req)
                scheduled[req.id] = n
                budget -= n
        return scheduled, preempted

    def step(self) -> Step:
        """Schedule one step and run it: the step's duration and each token it made."""
        scheduled, preempted = self.schedule()
        decodes = prefill = kv_tokens = 0
        made: list[tuple[str, int, bool]] = []
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if req.computed >= len(req.prompt):
                decodes += 1
            else:
                prefill += n
            kv_tokens += req.computed + n
            req.computed += n
            if req.computed // BLOCK_SIZE > req.cached_blocks:  # a block filled up (cache_full_blocks' own test, early)
                self.kv.cache_full_blocks(req)
            if req.computed >= req.num_tokens:  # the whole context is in: a token is sampled
                req.output += 1
                done = req.output >= req.max_new
                made.append((rid, req.output - 1, done))
                if done:
                    req.status = FINISHED
                    self.running.remove(req)
                    self.kv.release(req)
                    del self.requests[rid]
                    self.finished += 1
        duration = self.profile.step_ms(decodes, prefill, kv_tokens) / 1000.0 if scheduled else 0.0
        return Step(scheduled, duration, decodes, prefill, made, preempted)


# ---- how long an answer is --------------------------------------------------------------------

def answer_length(profile: Profile, rng: random.Random, max_tokens: int | None, min_tokens: int = 0,
                  ignore_eos: bool = False, room: int | None = None) -> tuple[int, str]:
    """(tokens, finish_reason) as vLLM takes a request: ``ignore_eos`` runs to ``max_tokens``;
    otherwise the model's end of sequence comes at a natural length (log-normal, the profile's
    median and sigma), never before ``min_tokens``; ``max_tokens`` (or the context's ``room``
    when unset) cuts it, finish_reason "length"."""
    cap = max_tokens if max_tokens is not None else (room if room is not None else profile.max_model_len)
    if ignore_eos:
        return cap, "length"
    natural = max(1, round(profile.answer_median_tokens * math.exp(profile.answer_sigma * rng.gauss(0.0, 1.0))))
    natural = max(natural, min_tokens)
    return (cap, "length") if natural >= cap else (natural, "stop")


# ---- virtual time -----------------------------------------------------------------------------

@dataclass
class Result:
    """One simulated run: per request, arrival, first token, last token and token count; and every
    gap between two tokens of one stream (s), as vLLM's benchmark_serving pools them."""

    requests: list[tuple[float, float, float, int]]
    duration_s: float
    gaps: list[float] = field(default_factory=list)

    def _ttfts(self) -> list[float]:
        return sorted(first - arrival for arrival, first, _last, _n in self.requests)

    @property
    def req_s(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s else 0.0

    @property
    def output_tok_s(self) -> float:
        return sum(n for *_x, n in self.requests) / self.duration_s if self.duration_s else 0.0

    def ttft_ms(self, q: float) -> float:
        return 1000.0 * percentile(self._ttfts(), q)

    def itl_ms(self, q: float) -> float:
        """The q-th percentile of every gap between two tokens of a stream (benchmark_serving's ITL)."""
        return 1000.0 * percentile(sorted(self.gaps), q) if self.gaps else 0.0

    def tpot_ms(self, q: float) -> float:
        """The q-th percentile of each request's mean gap, (last - first) / (tokens - 1) (its TPOT)."""
        per = sorted((last - first) / (n - 1) for _a, first, last, n in self.requests if n > 1)
        return 1000.0 * percentile(per, q) if per else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted ``values``, linear between ranks (numpy's default)."""
    if not values:
        return 0.0
    pos = (len(values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _prompt(rng: random.Random, n: int) -> list[int]:
    # randrange(1, 1 << 30)'s ids from its own draws (getrandbits(30); it redraws one in 2**30), without its checks
    bits = rng.getrandbits
    return [1 + bits(30) for _ in range(n)]


def poisson_arrivals(rng: random.Random, rate: float, requests: int) -> list[float]:
    """``requests`` arrival times (s) of a Poisson process at ``rate`` a second, from ``rng``."""
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def benchmark_serving_arrivals(rate: float, requests: int, seed: int = 42) -> list[float]:
    """The send times (s) of vLLM's benchmark_serving at ``--request-rate rate --seed seed``
    (burstiness 1): the first at 0, then each after ``numpy.random.gamma(1, 1/rate)``, numpy's global
    generator seeded with ``seed``. Its legacy MT19937, seeded by init_genrand, draws the same doubles
    as Python's own Mersenne Twister given that state, and a gamma of shape 1 is ``-log(1 - u)``."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    rng = random.Random()
    rng.setstate((3, (*mt, 624), None))
    out, t = [0.0], 0.0
    for _ in range(requests - 1):
        t += -math.log(1.0 - rng.random()) / rate
        out.append(t)
    return out[:requests]


def simulate(profile: Profile, *, requests: int = 0, input_tokens: int = 0, output_tokens: int = 0,
             concurrency: int | None = None, rate: float | None = None, seed: int = 0,
             ignore_eos: bool = False, prompts: Iterable[list[int]] | None = None,
             arrivals_s: Sequence[float] | None = None, lengths: Sequence[tuple[int, int]] | None = None) -> Result:
    """Run ``requests`` requests through an engine in virtual time: a closed loop of
    ``concurrency`` clients (each sends its next request when its answer ends, as vLLM's
    benchmark_serving with ``--max-concurrency``), or Poisson arrivals at ``rate`` per second
    (``poisson_arrivals`` drawn from ``seed``), or arrivals at the times ``arrivals_s`` (s): the
    model of a schedule that was really sent. Prompts of ``input_tokens`` random
    tokens (no shared prefix), ``max_tokens = output_tokens``; or, with ``lengths``, request i
    has ``lengths[i] = (prompt tokens, answer tokens)`` and its answer is exactly that long (a
    dataset's requests capped at their reference answers, as benchmark_serving sends ShareGPT)."""
    if (concurrency is None) == (rate is None and arrivals_s is None):
        raise ValueError("simulate: give concurrency, rate or arrivals_s")
    if lengths is not None:
        requests = len(lengths)
        input_tokens = max((i for i, _o in lengths), default=0)
        output_tokens = max((o for _i, o in lengths), default=0)
    if arrivals_s is not None:
        if lengths is not None and len(arrivals_s) != len(lengths):
            raise ValueError(f"simulate: {len(arrivals_s)} arrivals for {len(lengths)} requests")
        requests = len(arrivals_s)
    rng = random.Random(seed)
    engine = Engine(profile)
    given = iter(prompts) if prompts is not None else None
    arrivals: list[tuple[float, int]] = []  # (time, request index)
    admitted: list[tuple[float, int, float]] = []  # (past the API server, index, arrival)
    sent = 0
    clock = 0.0
    if rate is not None or arrivals_s is not None:
        for i, t in enumerate(arrivals_s if arrivals_s is not None else poisson_arrivals(rng, rate or 0.0, requests)):
            heapq.heappush(arrivals, (t, i))
        sent = requests
    else:
        for i in range(min(concurrency or 1, requests)):
            heapq.heappush(arrivals, (0.0, i))
        sent = min(concurrency or 1, requests)
    meta: dict[str, tuple[float, list[float], int]] = {}
    done: list[tuple[float, float, float, int]] = []
    gaps: list[float] = []
    steps = 0
    limit = 50 * requests * (output_tokens + input_tokens) + 1000  # bounded: no run spins forever
    while (arrivals or admitted or engine.busy) and steps < limit:
        while arrivals and arrivals[0][0] <= clock:
            at, i = heapq.heappop(arrivals)
            heapq.heappush(admitted, (at + engine.frontend.delay_s(at), i, at))
        while admitted and admitted[0][0] <= clock:
            _t, i, at = heapq.heappop(admitted)
            if lengths is not None:
                prompt, n = _prompt(rng, lengths[i][0]), lengths[i][1]
            else:
                prompt = next(given) if given is not None else _prompt(rng, input_tokens)
                n, _reason = answer_length(profile, rng, output_tokens, ignore_eos=ignore_eos)
            rid = f"r{i}"
            engine.add(Request(rid, prompt, n, arrival=at))
            meta[rid] = (at, [], n)
        if not engine.busy:
            clock = min([*(a[0] for a in arrivals[:1]), *(a[0] for a in admitted[:1])])
            continue
        step = engine.step()
        steps += 1
        clock += step.duration_s
        engine.frontend.tokens(clock, len(step.made))
        for rid, _idx, finished in step.made:
            meta[rid][1].append(clock)
            if finished:
                at, times, n = meta.pop(rid)
                done.append((at, times[0], times[-1], n))
                gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
                if concurrency is not None and sent < requests:
                    heapq.heappush(arrivals, (clock, sent))
                    sent += 1
    return Result(done, clock, gaps)


@dataclass(frozen=True)
class Knee:
    rate: float  # requests per second
    ttft_p99_ms: float
    output_tok_s: float


def knee_requests(rate: float) -> int:
    """Requests in a knee run at ``rate``: KNEE_SECONDS of arrivals, at least 300. A run shorter than
    its answers hides an overload: its queue has not built up by the time the arrivals stop."""
    return max(300, math.ceil(rate * KNEE_SECONDS))


def knee(profile: Profile, ttft_p99_budget_ms: float = DEFAULT_TTFT_P99_BUDGET_MS, *,
         input_tokens: int | None = None, output_tokens: int | None = None, requests: int | None = None,
         seed: int = 0, ignore_eos: bool = False, tpot_p50_budget_ms: float = DEFAULT_TPOT_P50_BUDGET_MS) -> Knee:
    """The highest Poisson request rate whose TTFT p99 stays within the budget and whose median
    TPOT within ``tpot_p50_budget_ms`` (vLLM's scheduler runs decodes first, so an overloaded pod's
    pace falls before its first token does); bisection over virtual-time runs of ``requests``
    requests, by default ``knee_requests(rate)``; by default the workload of ``Profile.knee_rps``.
    ``ignore_eos``: every answer exactly ``output_tokens`` long (else at most, as the profile's
    lengths fall)."""
    inp = input_tokens or KNEE_INPUT_TOKENS
    out = output_tokens or KNEE_OUTPUT_TOKENS

    def run(rate: float) -> Result:
        return simulate(profile, requests=requests or knee_requests(rate), input_tokens=inp, output_tokens=out,
                        rate=rate, seed=seed, ignore_eos=ignore_eos)

    def within(r: Result) -> bool:
        return r.ttft_ms(99) <= ttft_p99_budget_ms and r.tpot_ms(50) <= tpot_p50_budget_ms

    lo, hi = 0.0, 1.0
    while within(run(hi)) and hi < 10_000:
        lo, hi = hi, hi * 2
    for _ in range(8):  # to 1/256 of the bracket
        mid = (lo + hi) / 2
        if within(run(mid)):
            lo = mid
        else:
            hi = mid
    best = run(lo) if lo > 0 else None
    return Knee(round(lo, 2), best.ttft_ms(99) if best else 0.0, best.output_tok_s if best else 0.0)
