"""Prefix affinity measured: multi-turn chats through a cell of stand-in pods, policy by policy.

The workload is what chat apps send: a few apps, each with its system prompt of
1,000 to 3,000 tokens and its own client key; conversations arrive as a Poisson process, each
sends 4 to 12 turns (``--turns``), and each turn resends the whole history (system prompt, every earlier
question and answer) plus a new question, after a think time. Every turn is a streamed chat
completion whose answer is `--answer` tokens (``max_tokens`` with ``ignore_eos``, as vLLM's
benchmarks fix output lengths), so policies are compared on the same work.

For each policy (``colocate:worker.balance``: random, least_busy, load, prefix; ``prefix@C`` is prefix
with ``colocate:worker.prefixBound`` C) and each load (a
fraction of the cell's capacity), a fresh sandbox cell of ``--pods`` stand-in pods (their prefix
caches empty) serves the same workload (same seed). Reported per run: TTFT p50/p99 (the first
content token of the stream), end-to-end p50, throughput (turns and output tokens a second), the
prefix-cache hit rate each pod reports on its ``/metrics`` (vLLM's ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, tokens), and the most-loaded pod's prompt tokens against the mean.

Capacity: the requests a second the cell serves with TTFT p99 within the profile's budget when
every turn must prefill what no policy can reuse (the history; each pod soon holds every app's
system prompt): ``--pods`` x the stand-in engine's knee (``colocate.pods.engine.knee``) at the
workload's mean uncached prompt and answer length, or ``--capacity``.

``--isolates N`` (N > 1) serves every run from N isolates instead of the cell's one: a
second workerd runs the cell's own config (the same Worker bytes, plan, pods, hops and emulated
network) with its edge Worker defined N times, each its own isolate (workerd gives every Worker
definition an isolate of its own; ``inherit`` would share one) on its own port, all over one
object host, as isolates in one colo share their generation object; the driver sends each turn to
an isolate drawn at random, as an edge spreads requests. Those runs skip the emulated
client -> edge hop (the front proxy fronts the cell's own workerd).
``across`` is the ``same pod`` share of the turns that another isolate than their previous
turn's routed.

``--url URL --key KEY`` drives any OpenAI-compatible URL once instead (a cell, a pod, a real
vLLM): no sandbox, no policy, the same table.

The defaults are the run docs/benchmarks.md shows ("Prefix affinity"): every policy on 2 pods at
80 % load, conversations arriving for 180 s, the first 60 s left out.

Usage: .venv/bin/python -m bench.prefix [--policies random,least_busy,load,prefix] [--loads 0.8]
       [--pods 2] [--seconds 180] [--warmup 60] [--turns 4-12] [--capacity RPS] [--isolates N] [--json PATH|-]
Exit: 0 done (goals are printed, not enforced), 2 usage error or setup failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from bench import harness
from bench.load import MODEL  # the name the sandbox's pods serve (any other is vLLM's 404)

PATH = "/v1/chat/completions"
POLICIES = ("random", "least_busy", "load", "prefix")
LOADS = (0.8,)
TURNS = "4-12"
# Two pods: at 80 % of their knee the cell streams about 2,200 tokens a second through the emulated
# hops, what these two shared cores carry with room to spare (docs/benchmarks.md); four would need 4,300.
PODS = 2
# Short words, each one token with its leading space in a byte-level BPE (and in the stand-in's
# tokenizer, colocate.pods.engine.tokenize): a text of N words is about N tokens.
WORDS = ("the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as",
         "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but",
         "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each",
         "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then",
         "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look",
         "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than", "first",
         "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get",
         "come", "made", "may", "part")
# What the issue asks of prefix affinity at 80 % load, against the best other policy.
# Longer than an isolate's flush of what it recorded (worker/src/state.js FLUSH_MAX_MS = 1 s).
SYNC_S = 2.5
GOALS = {"ttft_p50": 0.5, "ttft_p99": 0.8, "throughput": 0.95, "max_over_mean": 1.3}


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


# ---- the workload (pure, seeded) -----------------------------------------------------------

@dataclass(frozen=True)
class App:
    name: str
    system: str
    system_tokens: int


@dataclass(frozen=True)
class Conversation:
    index: int
    app: int
    at_s: float  # arrival after the run's start
    questions: tuple[str, ...]  # one per turn
    think_s: tuple[float, ...]  # before each turn after the first


@dataclass(frozen=True)
class Workload:
    apps: tuple[App, ...]
    conversations: tuple[Conversation, ...]
    answer_tokens: int

    def mean_turns(self) -> float:
        return statistics.fmean(len(c.questions) for c in self.conversations) if self.conversations else 0.0

    def mean_uncached_tokens(self, question_tokens: float) -> float:
        """A turn's mean prompt past its app's system prompt: what a pod without this conversation must prefill."""
        per = []
        for c in self.conversations:
            for k in range(len(c.questions)):
                per.append(question_tokens * (k + 1) + self.answer_tokens * k)
        return statistics.fmean(per) if per else question_tokens


def workload(*, seed: int, seconds: float, rate_per_s: float, apps: int = 3, answer_tokens: int = 200,
             turns: tuple[int, int] = (2, 8), system_tokens: tuple[int, int] = (1000, 3000),
             question_tokens: tuple[int, int] = (30, 120), think_s: float = 4.0) -> Workload:
    """Conversations arriving at ``rate_per_s`` (Poisson) for ``seconds``, each over one of ``apps`` apps."""
    rng = random.Random(seed)
    app_list = []
    for a in range(apps):
        n = rng.randint(*system_tokens)
        app_list.append(App(f"app-{a}", f"You are assistant {a} of the colocate benchmark. " + text(rng, n), n))
    convs: list[Conversation] = []
    t = 0.0
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        if t >= seconds:
            break
        n = rng.randint(*turns)
        qs = tuple(f"question {len(convs)}.{k}: " + text(rng, rng.randint(*question_tokens)) for k in range(n))
        thinks = tuple(rng.expovariate(1 / think_s) for _ in range(n - 1))
        convs.append(Conversation(len(convs), rng.randrange(apps), t, qs, thinks))
    return Workload(tuple(app_list), tuple(convs), answer_tokens)


# ---- the driver ------------------------------------------------------------------------------

@dataclass
class Turn:
    conversation: int
    turn: int
    sent_s: float  # after the run's start
    status: int | None
    ttft_ms: float | None
    e2e_ms: float | None
    tokens: int  # content chunks received (one per token from vLLM and the stand-in)
    backend: str | None
    error: str | None = None
    isolate: int | None = None  # which of the URLs (isolates) the turn went to


def stream_turn(session: requests.Session, url: str, key: str, body: dict, timeout_s: float) -> tuple[Turn, str]:
    """One streamed chat turn: its timing and the answer's text."""
    t0 = time.perf_counter()
    parts: list[str] = []
    ttft = None
    try:
        with session.post(url + PATH, json=body, headers={"Authorization": f"Bearer {key}"}, stream=True,
                          timeout=timeout_s) as r:
            backend = r.headers.get("x-colocate-backend")
            if r.status_code != 200:
                return Turn(0, 0, 0, r.status_code, None, None, 0, backend, r.text[:200]), ""
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    continue
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") or ch.get("text")
                    if piece:
                        if ttft is None:
                            ttft = (time.perf_counter() - t0) * 1000
                        parts.append(piece)
            e2e = (time.perf_counter() - t0) * 1000
            return Turn(0, 0, 0, 200, ttft, e2e, len(parts), backend), "".join(parts)
    except requests.RequestException as exc:
        return Turn(0, 0, 0, None, None, None, 0, None, type(exc).__name__), ""


def drive(url: str | Sequence[str], keys: Sequence[str], load: Workload, *, model: str = MODEL,
          timeout_s: float = 120, stop_after_s: float | None = None, seed: int = 0) -> tuple[list[Turn], float]:
    """Run every conversation of ``load`` in real time (a thread each, started at its arrival);
    no turn starts after ``stop_after_s``. Several URLs (isolates): each turn goes to one drawn at
    random (seeded). Returns the turns and the run's length in seconds."""
    urls = [url] if isinstance(url, str) else list(url)
    pick = random.Random(seed)
    turns: list[Turn] = []
    lock = threading.Lock()
    start = time.monotonic()
    limit = stop_after_s if stop_after_s is not None else math.inf
    local = threading.local()

    def one(c: Conversation) -> None:
        s = getattr(local, "s", None) or requests.Session()
        local.s = s
        app = load.apps[c.app]
        messages: list[dict] = [{"role": "system", "content": app.system}]
        for k, q in enumerate(c.questions):
            if k:
                time.sleep(c.think_s[k - 1])
            sent = time.monotonic() - start
            if sent > limit:
                return
            messages.append({"role": "user", "content": q})
            body = {"model": model, "messages": messages, "stream": True, "max_tokens": load.answer_tokens,
                    "ignore_eos": True}
            with lock:
                which = pick.randrange(len(urls))
            t, answer = stream_turn(s, urls[which], keys[c.app % len(keys)], body, timeout_s)
            t.conversation, t.turn, t.sent_s, t.isolate = c.index, k, sent, which
            with lock:
                turns.append(t)
            if t.status != 200:
                return  # a conversation whose turn failed ends, as a user would retry later
            messages.append({"role": "assistant", "content": answer})

    threads = []
    for c in load.conversations:
        wait = c.at_s - (time.monotonic() - start)
        if wait > 0:
            time.sleep(wait)
        if time.monotonic() - start > limit:
            break
        th = threading.Thread(target=one, args=(c,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=max(1.0, timeout_s * 10))
    return turns, time.monotonic() - start


# ---- what the pods report -----------------------------------------------------------------

_SAMPLE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def prefix_counters(metrics_text: str) -> dict[str, float] | None:
    """vLLM's prefix-cache counters from a /metrics text ({hits, queries} in tokens), or None when absent."""
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(metrics_text):
        k = name.rsplit("_", 1)[1]
        out[k] = out.get(k, 0.0) + float(value)
    return out if {"hits", "queries"} <= out.keys() else None


def scrape(url: str | None, timeout_s: float = 5) -> dict[str, float] | None:
    """A pod's counters from its own /metrics (reachable from here: --url, a plain stand-in)."""
    if not url:
        return None
    try:
        r = requests.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    except requests.RequestException:
        return None
    return prefix_counters(r.text) if r.status_code == 200 else None


def scrape_cell(worker_url: str, read_token: str, pods: int, timeout_s: float = 10) -> list[dict | None]:
    """Every pod's counters as the cell's Worker read them over the pod hop (``pod_prefix`` of
    ``GET /_colocate/live``): the sandbox's pods answer only the Worker's client certificate."""
    try:
        r = requests.get(worker_url + "/_colocate/live", params={"since": int(time.time() * 1000)},
                         headers={"Authorization": f"Bearer {read_token}"}, timeout=timeout_s)
        got = r.json().get("pod_prefix") or [] if r.status_code == 200 else []
    except (requests.RequestException, ValueError):
        got = []
    by = {p["index"]: {"hits": float(p["hits"]), "queries": float(p["queries"])} for p in got if isinstance(p, dict)}
    return [by.get(i) for i in range(pods)]


_PICK = re.compile(r'^colocate_balance_picks_total\{[^}]*by="(affinity|load)"[^}]*\}\s+([0-9.eE+-]+)\s*$', re.M)


def picks(metrics_text: str) -> dict[str, float]:
    """The prefix policy's picks from the cell's Prometheus text: {"affinity": sent to the
    prefix's own pod, "load": shed to another by the load bound}, summed over pods."""
    out = {"affinity": 0.0, "load": 0.0}
    for by, value in _PICK.findall(metrics_text):
        out[by] += float(value)
    return out


def scrape_picks(worker_url: str, read_token: str, timeout_s: float = 10) -> dict[str, float] | None:
    """The cell's picks (``GET /_colocate/metrics``: every isolate's, as of its last sync)."""
    try:
        r = requests.get(worker_url + "/_colocate/metrics", headers={"Authorization": f"Bearer {read_token}"},
                         timeout=timeout_s)
    except requests.RequestException:
        return None
    return picks(r.text) if r.status_code == 200 else None


_TTFT = re.compile(r"^vllm:time_to_first_token_seconds_(sum|count)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def pod_ttfts(cell: dict, timeout_s: float = 5) -> list[dict[str, float] | None]:
    """Each sandbox pod's own TTFT counters ({sum in s, count}: vllm:time_to_first_token_seconds, from
    its arrival at the API server to its first token, queue included), read from the pod directly
    over its mutual TLS with the Worker's certificate (no emulated hop), trusting the root that
    signs the pods' server certificate (the sandbox's public root, not the cell's CA)."""
    from colocate.sandbox import hopcerts
    from colocate.sandbox.statedir import load_secrets

    hop = Path(cell["state_dir"]) / hopcerts.DIR
    worker, public = (hop / hopcerts.FILES["worker"], hop / f"{hopcerts.FILES['public']}.pem")
    auth = {"Authorization": f"Bearer {load_secrets(Path(cell['state_dir']))['podToken']}"}  # the pod's guard
    out: list[dict[str, float] | None] = []
    for pod in cell["pods"]:
        try:
            r = requests.get(pod["address"].replace("//127.0.0.1:", "//localhost:") + "/metrics", timeout=timeout_s,
                             headers=auth,
                             cert=(f"{worker}.pem", f"{worker}.key"), verify=str(public))
            got = {k: float(v) for k, v in _TTFT.findall(r.text)} if r.status_code == 200 else {}
        except (requests.RequestException, OSError, ValueError):
            got = {}
        out.append(got if {"sum", "count"} <= got.keys() else None)
    return out


# ---- one run's summary ----------------------------------------------------------------------

def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (pos - lo), 1)


@dataclass
class Summary:
    policy: str
    load: float | None
    rate_per_s: float  # offered turns a second
    turns: int
    failed: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    turns_per_s: float
    tokens_per_s: float
    pods: list[dict] = field(default_factory=list)  # per pod: turns, prompt share, hit rate
    max_over_mean: float | None = None  # the most-loaded pod's turns over the mean
    same_pod: float | None = None  # turns after the first on their previous turn's pod
    same_pod_across: float | None = None  # of those, the ones another isolate than the previous turn's routed
    across_turns: int = 0  # how many turns that is
    shed: float | None = None  # the prefix policy's picks shed by the load bound (the cell's counters)
    # Where the first token's time goes (means, ms): the client's, the pods' own (arrival at the API
    # server to first token), and of that the API server's queue as the profile models it.
    ttft_mean_ms: float | None = None
    pod_ttft_mean_ms: float | None = None
    api_queue_ms: float | None = None


def summarise(policy: str, load: float | None, rate: float, turns: list[Turn], window: tuple[float, float],
              pods: int, hits: Sequence[dict | None] = (), shed: dict[str, float] | None = None,
              pod_ttft: Sequence[dict | None] = (), profile: str | None = None) -> Summary:
    lo, hi = window
    inside = [t for t in turns if lo <= t.sent_s < hi]
    good = [t for t in inside if t.status == 200]
    span = max(1e-9, hi - lo)
    per = [0] * pods
    for t in good:
        if t.backend and t.backend.startswith("pod-"):
            i = int(t.backend[4:])
            if 0 <= i < pods:
                per[i] += 1
    mean = statistics.fmean(per) if pods else 0
    prev: dict[int, Turn] = {}
    kept = later = kept_across = across = 0
    for t in sorted(turns, key=lambda t: (t.conversation, t.turn)):
        before = prev.get(t.conversation)
        if t.turn > 0 and before is not None and t.status == 200:
            later += 1
            kept += before.backend == t.backend
            if t.isolate is not None and before.isolate is not None and t.isolate != before.isolate:
                across += 1
                kept_across += before.backend == t.backend
        prev[t.conversation] = t
    pod_rows = []
    for i in range(pods):
        h = hits[i] if i < len(hits) else None
        rate_i = round(h["hits"] / h["queries"], 3) if h and h.get("queries") else None
        pod_rows.append({"pod": i, "turns": per[i], "prefix_cache_hit_rate": rate_i})
    ttfts = [t.ttft_ms for t in good if t.ttft_ms is not None]
    tokens_per_s = sum(t.tokens for t in good) / span
    seen = [p for p in pod_ttft if p and p.get("count")]
    return Summary(
        policy=policy, load=load, rate_per_s=round(rate, 3), turns=len(inside), failed=len(inside) - len(good),
        ttft_p50_ms=pct([t.ttft_ms for t in good if t.ttft_ms is not None], 50),
        ttft_p99_ms=pct([t.ttft_ms for t in good if t.ttft_ms is not None], 99),
        e2e_p50_ms=pct([t.e2e_ms for t in good if t.e2e_ms is not None], 50),
        turns_per_s=round(len(good) / span, 3), tokens_per_s=round(tokens_per_s, 1),
        pods=pod_rows, max_over_mean=round(max(per) / mean, 3) if mean else None,
        same_pod=round(kept / later, 3) if later else None,
        same_pod_across=round(kept_across / across, 3) if across else None, across_turns=across,
        shed=round(shed["load"] / (shed["load"] + shed["affinity"]), 3) if shed and shed["load"] + shed["affinity"] else None,
        ttft_mean_ms=round(statistics.fmean(ttfts), 1) if ttfts else None,
        pod_ttft_mean_ms=round(1000 * sum(p["sum"] for p in seen) / sum(p["count"] for p in seen), 1) if seen else None,
        api_queue_ms=api_queue_ms(profile, tokens_per_s / pods) if profile and pods else None,
    )


def api_queue_ms(profile: str, tokens_per_s: float) -> float | None:
    """The stand-in's API server (engine.Frontend) at a pod's output rate: its own time for a request
    and its queue behind the streams it serves; the same for every policy."""
    try:
        from colocate.pods import engine, profiles
    except ImportError:
        return None
    prof = profiles.get(profile)
    if prof.oracle_ms is not None:
        return None
    rho = tokens_per_s * prof.frontend_ms_per_token / 1000
    return round(prof.server.request_ms + engine.queue_ms(prof, rho), 1)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def breakdown(rows: Sequence[Summary]) -> str:
    """Where each run's mean TTFT goes: the hops (the client's less the pods' own), the pods' API
    queue (modelled) and their engine (queue for a step, then the step that prefills the turn)."""
    lines = [f"{'policy':11} {'load':>5} {'TTFT mean':>9} {'hops':>6} {'pod':>6} {'API queue':>9} {'engine':>6}  (ms)"]
    for r in rows:
        if r.ttft_mean_ms is None or r.pod_ttft_mean_ms is None:
            continue
        load = "-" if r.load is None else f"{100 * r.load:.0f}%"
        engine = None if r.api_queue_ms is None else r.pod_ttft_mean_ms - r.api_queue_ms
        lines.append(f"{r.policy:11} {load:>5} {_ms(r.ttft_mean_ms):>9} {_ms(r.ttft_mean_ms - r.pod_ttft_mean_ms):>6} "
                     f"{_ms(r.pod_ttft_mean_ms):>6} {_ms(r.api_queue_ms):>9} {_ms(engine):>6}")
    return "\n".join(lines)


def goals(rows: Sequence[Summary], load: float) -> list[str]:
    """The issue's targets at ``load``: prefix against the best other policy."""
    at = [r for r in rows if r.load == load]
    mine = next((r for r in at if r.policy == "prefix"), None)
    others = [r for r in at if not r.policy.startswith("prefix")]
    if mine is None or not others or mine.ttft_p50_ms is None:
        return []
    out = []

    def best(attr: str, low: bool) -> Summary | None:
        have = [r for r in others if getattr(r, attr) is not None]
        return (min if low else max)(have, key=lambda r: getattr(r, attr)) if have else None

    for attr, goal, low, name in (("ttft_p50_ms", GOALS["ttft_p50"], True, "TTFT p50"),
                                  ("ttft_p99_ms", GOALS["ttft_p99"], True, "TTFT p99"),
                                  ("turns_per_s", GOALS["throughput"], False, "throughput")):
        b = best(attr, low)
        if b is None or not getattr(b, attr):
            continue
        ratio = getattr(mine, attr) / getattr(b, attr)
        ok = ratio <= goal if low else ratio >= goal
        out.append(f"{name}: prefix {getattr(mine, attr)} vs {b.policy} {getattr(b, attr)} = {ratio:.2f}x "
                   f"(goal {'<=' if low else '>='} {goal}x) {'ok' if ok else 'MISSED'}")
    if mine.max_over_mean is not None:
        ok = mine.max_over_mean <= GOALS["max_over_mean"]
        out.append(f"most-loaded pod: {mine.max_over_mean}x the mean (goal <= {GOALS['max_over_mean']}x) "
                   f"{'ok' if ok else 'MISSED'}")
    return out


def table(rows: Sequence[Summary]) -> str:
    head = (f"{'policy':11} {'load':>5} {'turns/s':>8} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} "
            f"{'max/mean':>8} {'same pod':>8} {'across':>6} {'shed':>5} {'failed':>6}  prefix-cache hit rate per pod")
    lines = [head]
    for r in rows:
        hit = " ".join("-" if p["prefix_cache_hit_rate"] is None else f"{100 * p['prefix_cache_hit_rate']:.0f}%"
                       for p in r.pods)
        load = "-" if r.load is None else f"{100 * r.load:.0f}%"
        lines.append(f"{r.policy:11} {load:>5} {r.turns_per_s:8.2f} {r.tokens_per_s:7.0f} {_ms(r.ttft_p50_ms):>9} "
                     f"{_ms(r.ttft_p99_ms):>9} {_ms(r.e2e_p50_ms):>8} {'-' if r.max_over_mean is None else r.max_over_mean:>8} "
                     f"{'-' if r.same_pod is None else r.same_pod:>8} "
                     f"{'-' if r.same_pod_across is None else r.same_pod_across:>6} {'-' if r.shed is None else r.shed:>5} "
                     f"{r.failed:6d}  {hit}")
    return "\n".join(lines)


# ---- the cell ---------------------------------------------------------------------------

def capacity(pods: int, load: Workload, question_tokens: float, profile: str | None) -> float:
    """The cell's requests a second at the knee (module doc); ValueError when the engine is absent."""
    try:
        from colocate.pods import engine, profiles  # type: ignore[attr-defined]
    except ImportError as exc:
        raise ValueError("this checkout's stand-in has no engine (colocate.pods.engine): pass --capacity RPS") from exc
    prof = profiles.get(profile or profiles.DEFAULT_PROFILE)
    k = engine.knee(prof, input_tokens=round(load.mean_uncached_tokens(question_tokens)), output_tokens=load.answer_tokens)
    return pods * k.rate


_EDGE = '(name = "edge", worker = '  # colocate.sandbox.config's edge service, as colocate.workerd writes it


def _closing(text: str, start: int) -> int:
    """Just past the parenthesis closing the one at or after ``start`` in Cap'n Proto text (strings skipped)."""
    depth, i, quoted = 0, start, False
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("the config's edge service has no closing parenthesis")


def isolates_config(text: str, isolates: int, objects_from: Path, objects_to: Path) -> tuple[str, list[str]]:
    """A sandbox cell's workerd config (colocate/sandbox/config.py) with its edge Worker defined
    ``isolates`` times, byte for byte (``edge``, ``edge-1``, ...: workerd runs each Worker definition
    in an isolate of its own), each on a socket of its own, and its object hosts storing under
    ``objects_to``: the config and its socket names, in isolate order. ValueError when the text is
    not such a config."""
    from colocate import workerd as wd

    start = text.find(_EDGE)
    if start < 0 or text.find(_EDGE, start + 1) >= 0:
        raise ValueError("expected one edge service in the sandbox's workerd config")
    end = _closing(text, start)
    edge = text[start:end]
    copies = [edge] + [edge.replace(_EDGE, f'(name = "edge-{k}", worker = ', 1) for k in range(1, isolates)]
    text = text[:start] + ",\n    ".join(copies) + text[end:]
    old = wd.capnp_text(str(Path(objects_from).resolve()))[:-1]  # the disk services' paths, open-ended
    if old not in text:
        raise ValueError(f"the sandbox's workerd config stores no objects under {objects_from}")
    text = text.replace(old, wd.capnp_text(str(Path(objects_to).resolve()))[:-1])
    at = text.rfind("sockets = [")
    if at < 0:
        raise ValueError("the sandbox's workerd config has no sockets")
    names = [f"http-{k}" for k in range(isolates)]
    socks = ",\n    ".join(wd.socket_capnp(n, 0, "edge" if k == 0 else f"edge-{k}")[1] for k, n in enumerate(names))
    return text[:at] + f"sockets = [\n    {socks}\n  ]\n);\n", names


@contextlib.contextmanager
def isolates_of(cell: dict, isolates: int, directory: Path) -> Iterator[list[str]]:
    """The cell's Worker served by ``isolates`` isolates beside its own (isolates_config): their
    URLs, while the block runs. They share one object host of their own (empty: the block's keys
    are made through them), and reach the cell's pods, fallback and control through its network."""
    from colocate import workerd as wd
    from colocate.sandbox.statedir import OBJECTS_DIR, WORKERD_CONFIG_FILE

    state_dir = Path(cell["state_dir"])
    objects = directory / "objects"
    for site in (state_dir / OBJECTS_DIR).iterdir():
        if site.is_dir():
            (objects / site.name).mkdir(parents=True, exist_ok=True)
    text, names = isolates_config((state_dir / WORKERD_CONFIG_FILE).read_text(), isolates, state_dir / OBJECTS_DIR,
                                  objects)
    socks = {n: wd.listening_socket() for n in names[1:]}
    w = wd.Workerd(directory, socket_name=names[0])
    try:
        w.start(text, extra_sockets=socks)
        yield [w.url] + [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks.values()]
    finally:
        w.close()
        for s in socks.values():
            s.close()


@contextlib.contextmanager
def fresh_cell(policy: str | None, pods: int, extra_pod: dict, bound: float | None) -> Iterator[dict]:
    """One fresh sandbox cell of ``pods`` pods under ``policy``, down after the block.
    ``policy`` None keeps the shipped stack's Worker settings as they are (its policy, its deadline);
    a policy also lifts the deadline, so that a bench's overload is measured, not sent to the fallback."""
    from colocate import stackfile
    from colocate.sandbox import supervisor

    with tempfile.TemporaryDirectory(prefix="colocate-prefix-") as tmp:
        stacks = Path(tmp) / "stacks"
        stacks.mkdir()
        (stacks / "Pulumi.sandbox.yaml").write_text(stackfile.path_of("sandbox").read_text())
        raw, _ = stackfile.read_config("sandbox", stacks)
        worker: dict = {**(raw.get("worker") or {})}
        if policy is not None:
            worker |= {"balance": policy, "deadlineMs": 60_000}
        if bound is not None:
            worker["prefixBound"] = bound
        stackfile.write_config("sandbox", {"pod": {**(raw.get("pod") or {}), "count": pods, **extra_pod}, "worker": worker},
                               stacks)
        state_dir = Path(tmp) / "state"
        try:
            yield supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        finally:
            supervisor.down(state_dir, quiet=True)


def run_on(cell: dict, pods: int, load: Workload, seconds: float, isolates: int = 1, seed: int = 0,
           warmup: float = 0.0) -> tuple[list[Turn], list[dict | None], dict[str, float] | None, list[dict | None]]:
    """The workload through ``cell``'s ``pods`` pods (through ``isolates`` isolates when more than one,
    isolates_of, with an object host of their own): the turns, each pod's counters and the routing
    Worker's picks over the run (after less before, so a cell may serve several runs), and each pod's
    own TTFT counters from ``warmup`` seconds on (pod_ttfts)."""
    from colocate.admin import AdminClient, Target

    with tempfile.TemporaryDirectory(prefix="colocate-prefix-isolates-") as tmp, contextlib.ExitStack() as more:
        urls = [cell["worker_url"]]
        if isolates > 1:
            urls = more.enter_context(isolates_of(cell, isolates, Path(tmp)))
        admin = AdminClient(Target(urls[0], cell["token"], "sandbox"))
        # No rate limits (the load is the bench's to set); the month's tokens the cell's default.
        keys = [admin.create_key(f"prefix-bench-{a.name}", rpm=0, tpm=0, max_parallel=0, max_parallel_tokens=0)["key"]
                for a in load.apps]
        before = scrape_cell(urls[0], cell["read_token"], pods)
        picked = scrape_picks(urls[0], cell["read_token"])
        at_warmup: list[list[dict | None]] = []
        timer = threading.Timer(warmup, lambda: at_warmup.append(pod_ttfts(cell)))
        timer.start()
        try:
            turns, _ = drive(urls, keys, load, stop_after_s=seconds, seed=seed)
        finally:
            timer.cancel()
        ttft_end = pod_ttfts(cell)
        after = scrape_cell(urls[0], cell["read_token"], pods)
        time.sleep(SYNC_S)  # every isolate's last picks reach the object
        now = scrape_picks(urls[0], cell["read_token"])
    # a pod that reported nothing before had served nothing yet: its counters started at 0
    hits = [None if a is None else {k: a[k] - (b or {}).get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    shed = {k: now[k] - picked[k] for k in now} if now is not None and picked is not None else None
    start = at_warmup[0] if at_warmup else [None] * len(ttft_end)
    pod_ttft = [None if e is None else {k: e[k] - (b or {}).get(k, 0.0) for k in e} for e, b in zip(ttft_end, start, strict=True)]
    return turns, hits, shed, pod_ttft


def run_cell(policy: str | None, pods: int, load: Workload, seconds: float, extra_pod: dict, bound: float | None,
             on_ready: Callable[[dict], None] | None = None, isolates: int = 1, seed: int = 0,
             warmup: float = 0.0) -> tuple[list[Turn], list[dict | None], dict[str, float] | None, list[dict | None]]:
    """One fresh sandbox cell under ``policy`` (fresh_cell), the workload through it (run_on)."""
    with fresh_cell(policy, pods, extra_pod, bound) as cell:
        if on_ready:
            on_ready(cell)
        return run_on(cell, pods, load, seconds, isolates, seed, warmup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="colocate:worker.balance values, comma-separated; prefix@C: prefix with bound C")
    p.add_argument("--loads", default=",".join(str(x) for x in LOADS), help="fractions of the cell's capacity")
    p.add_argument("--pods", type=int, default=PODS)
    p.add_argument("--seconds", type=float, default=180, help="conversations arrive for this long; turns after it are not sent")
    p.add_argument("--warmup", type=float, default=60, help="turns sent before this are left out of the numbers")
    p.add_argument("--capacity", type=float, help="the cell's requests a second at 100 %% (default: the engine's knee)")
    p.add_argument("--profile", help="the stand-in profile the capacity is computed for (default: the stand-in's default)")
    p.add_argument("--pod-config", default="{}", help="JSON merged into colocate:pod for the cell (default: the --profile)")
    p.add_argument("--isolates", type=int, default=1, help="serve each run from this many isolates (module doc)")
    p.add_argument("--bound", type=float, help="colocate:worker.prefixBound for the prefix runs")
    p.add_argument("--apps", type=int, default=3)
    p.add_argument("--answer", type=int, default=200, help="answer tokens per turn")
    p.add_argument("--think", type=float, default=4.0, help="mean think time between turns, seconds")
    p.add_argument("--turns", default=TURNS, help="turns per conversation, LO-HI (uniform)")
    p.add_argument("--seed", type=int, default=49)
    p.add_argument("--url", help="drive this OpenAI-compatible URL once (no cell); with --key")
    p.add_argument("--key", help="the client key for --url (or COLOCATE_CLIENT_KEY)")
    p.add_argument("--json", metavar="PATH|-")
    args = p.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
        extra_pod = json.loads(args.pod_config)
    except ValueError as exc:
        print(f"prefix: --loads is fractions like 0.5,0.8 and --pod-config JSON ({exc})", file=sys.stderr)
        return 2
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for policy in policies:
        name, at, bound = policy.partition("@")
        try:
            ok = not at or (name == "prefix" and float(bound) > 1)
        except ValueError:
            ok = False
        if not ok:
            print(f"prefix: --policies {policy!r}: a bound goes with prefix only and is a number > 1, e.g. prefix@2",
                  file=sys.stderr)
            return 2
    lo, _, hi = args.turns.partition("-")
    try:
        turns = (int(lo), int(hi or lo))
    except ValueError:
        turns = (0, 0)
    if not 1 <= turns[0] <= turns[1] <= 64:
        print(f"prefix: --turns {args.turns!r}: expected LO-HI with 1 <= LO <= HI <= 64, e.g. 2-8", file=sys.stderr)
        return 2
    if not (loads and all(0 < x <= 2 for x in loads) and policies and 1 <= args.pods <= 16 and 1 <= args.isolates <= 16
            and 0 <= args.warmup < args.seconds <= 3600 and isinstance(extra_pod, dict)):
        print("prefix: need loads in (0, 2], at least one policy, 1..16 pods, 1..16 isolates, "
              "0 <= --warmup < --seconds <= 3600",
              file=sys.stderr)
        return 2
    if "profile" not in extra_pod and not args.url:
        try:
            from colocate.pods import profiles

            extra_pod["profile"] = args.profile or profiles.DEFAULT_PROFILE
        except ImportError:
            pass  # a stand-in without profiles: the cell's own
    question_mean = 75.0  # the workload's question tokens, (30 + 120) / 2
    probe = workload(seed=args.seed, seconds=600, rate_per_s=1, apps=args.apps, answer_tokens=args.answer,
                     think_s=args.think, turns=turns)
    if args.capacity is not None:
        cap = args.capacity
    elif args.url:
        cap = 1.0
    else:
        try:
            cap = capacity(args.pods, probe, question_mean, args.profile)
        except ValueError as exc:
            print(f"prefix: {exc}", file=sys.stderr)
            return 2
    rows: list[Summary] = []
    window = (args.warmup, args.seconds)
    if args.url:
        import os

        key = args.key or os.environ.get("COLOCATE_CLIENT_KEY")
        if not key:
            print("prefix: --url needs --key or COLOCATE_CLIENT_KEY", file=sys.stderr)
            return 2
        rate = cap * loads[0]
        load = workload(seed=args.seed, seconds=args.seconds, rate_per_s=rate / probe.mean_turns(), apps=args.apps,
                        answer_tokens=args.answer, think_s=args.think, turns=turns)
        sent, _ = drive(args.url.rstrip("/"), [key], load, stop_after_s=args.seconds)
        rows.append(summarise("url", loads[0], rate, sent, window, args.pods))
    else:
        from colocate.errors import ConfigError
        from colocate.sandbox.errors import SandboxError

        for lf in loads:
            rate = cap * lf
            load = workload(seed=args.seed, seconds=args.seconds, rate_per_s=rate / probe.mean_turns(), apps=args.apps,
                            answer_tokens=args.answer, think_s=args.think, turns=turns)
            for policy in policies:
                print(f"prefix: {policy} at {100 * lf:.0f} % ({rate:.2f} turns/s, {len(load.conversations)} conversations)",
                      file=sys.stderr)
                try:
                    name, _, at = policy.partition("@")  # prefix@2: the prefix policy with bound 2
                    bound = float(at) if at else args.bound if name == "prefix" else None
                    sent, hits, shed, pod_ttft = run_cell(name, args.pods, load, args.seconds, extra_pod, bound,
                                                          isolates=args.isolates, seed=args.seed, warmup=args.warmup)
                except (ConfigError, SandboxError) as exc:
                    print(f"prefix: {exc}", file=sys.stderr)
                    return exc.exit_code
                rows.append(summarise(policy, lf, rate, sent, window, args.pods, hits,
                                      shed if name == "prefix" else None, pod_ttft, extra_pod.get("profile")))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)  # each run as it ends
    print(table(rows))
    if any(r.pod_ttft_mean_ms is not None for r in rows):
        print(breakdown(rows))
    verdicts = [g for lf in loads for g in goals(rows, lf) if lf == max(loads)]
    for line in verdicts:
        print(line)
    out = {"options": vars(args) | {"json": None, "key": None}, "capacity_per_s": round(cap, 3),
           "rows": [asdict(r) for r in rows], "goals": verdicts}
    harness.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
