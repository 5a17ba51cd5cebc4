"""make bench-answers: non-streamed answers of every length through the sandbox cell, against the model.

The sandbox cell runs on its stack's settings (stacks/Pulumi.sandbox.yaml: one stand-in pod on
the default profile, RTX 4090 with Qwen2.5-7B INT4, the stack's deadline). For each answer
length (``--lengths``, default 50, 200, 600 and 1,500 tokens: ``max_tokens`` with ``ignore_eos``,
so every answer is exactly that long) it sends non-streamed chat completions of about
``--input-tokens`` prompt tokens (random common words: no two share a prefix past the template):

* at concurrency 1: ``--serial`` requests, one after the other;
* at the pod's knee for that answer: Poisson arrivals for ``--knee-seconds`` at the highest rate
  whose TTFT p99 the profile's engine keeps within 1 s (``engine.knee`` at that prompt and answer).

Checked for every request: the backend that served it (``x-colocate-backend``: a pod, never the
fallback) and, polled every second from the cell's ``/_colocate/metrics``, that no pod's breaker
left ``closed``. Each run's end-to-end times are set against the model: the profile's engine run
in virtual time on the same schedule (prefill, queue and decode: ``engine.simulate`` with the
measured prompt's token count and the arrival times really sent), plus the router's overhead,
measured in the same run as a 1-token answer's time through the cell less the model's for it.
A run is within the goal when its measured p50 is within 25 % of the model's p50 plus that overhead.

Usage: .venv/bin/python -m bench.answers [--lengths 50,200,600,1500] [--serial 4]
       [--knee-seconds 30 (0: concurrency 1 only)] [--input-tokens 256] [--seed 46] [--json PATH|-]
Exit: 0 every run served by the pod with no breaker opened and within 25 %; 1 otherwise; 2 usage or setup.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from bench.pod import counts
from colocate.pods import engine, profiles

LENGTHS = (50, 200, 600, 1500)
TOLERANCE = 0.25
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were")
TEMPLATE_TOKENS = 30  # the chat template's own tokens around one user message (bench/pod.py)
REQUEST_TIMEOUT_S = 300.0
MAX_KNEE_REQUESTS = 400  # bounded whatever the knee


@dataclass
class Run:
    length: int
    load: str  # "c=1" or "knee <rate>/s"
    sent: int
    by_pod: int = 0
    by_fallback: int = 0
    failed: list[str] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    model_ms: list[float] = field(default_factory=list)
    overhead_ms: float = 0.0

    @property
    def measured_p50(self) -> float:
        return engine.percentile(sorted(self.e2e_ms), 50)

    @property
    def expected_p50(self) -> float:
        return engine.percentile(sorted(self.model_ms), 50) + self.overhead_ms

    def p90s(self) -> tuple[float, float]:
        """(measured p90, model p90 + overhead): the tail, shown beside the goal's p50."""
        return (engine.percentile(sorted(self.e2e_ms), 90),
                engine.percentile(sorted(self.model_ms), 90) + self.overhead_ms)

    @property
    def off(self) -> float:
        return self.measured_p50 / self.expected_p50 - 1 if self.expected_p50 else float("inf")

    @property
    def ok(self) -> bool:
        return self.by_pod == self.sent and not self.failed and abs(self.off) <= TOLERANCE


class BreakerWatch:
    """Polls the cell's Prometheus text every second: every breaker state any pod was seen in."""

    def __init__(self, worker_url: str, read_token: str):
        self.url, self.token = worker_url + "/_colocate/metrics", read_token
        self.seen: set[tuple[str, str]] = set()  # (pod, state) with value 1
        self.polls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        try:
            text = requests.get(self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10).text
        except requests.RequestException:
            return
        self.polls += 1
        for line in text.splitlines():
            if line.startswith("colocate_breaker_state{") and line.endswith(" 1"):
                labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
                self.seen.add((labels["pod"].strip('"'), labels["state"].strip('"')))

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            self.poll()

    def opened(self) -> list[tuple[str, str]]:
        return sorted(s for s in self.seen if s[1] != "closed")

    def __enter__(self) -> BreakerWatch:
        self.poll()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=20)
        self.poll()


def prompt(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens - TEMPLATE_TOKENS)))


class Client:
    def __init__(self, url: str, key: str, model: str):
        self.url, self.model = url + "/v1/chat/completions", model
        self.headers = {"Authorization": f"Bearer {key}"}
        self.local = threading.local()

    def ask(self, text: str, tokens: int) -> tuple[float, str | None, int | None, str]:
        """One non-streamed answer of exactly ``tokens`` tokens: (ms, backend, prompt tokens, error)."""
        s = getattr(self.local, "s", None) or requests.Session()
        self.local.s = s
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                "min_tokens": tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        try:
            r = s.post(self.url, json=body, headers=self.headers, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            return (time.perf_counter() - t0) * 1000, None, None, type(exc).__name__
        ms = (time.perf_counter() - t0) * 1000
        if r.status_code != 200:
            return ms, r.headers.get("x-colocate-backend"), None, f"HTTP {r.status_code}: {r.text[:160]}"
        doc = r.json()
        usage = doc.get("usage") or {}
        if usage.get("completion_tokens") != tokens:
            return ms, r.headers.get("x-colocate-backend"), None, f"{usage.get('completion_tokens')} tokens, not {tokens}"
        return ms, r.headers.get("x-colocate-backend"), usage.get("prompt_tokens"), ""


def record(run: Run, got: tuple[float, str | None, int | None, str]) -> None:
    ms, backend, _prompt_tokens, error = got
    if backend and backend.startswith("pod"):
        run.by_pod += 1
    elif backend == "fallback":
        run.by_fallback += 1
    if error:
        run.failed.append(error)
    else:
        run.e2e_ms.append(ms)


def serial(client: Client, prof: profiles.Profile, rng: random.Random, length: int, n: int,
           input_tokens: int) -> tuple[Run, int]:
    run = Run(length, "c=1", n)
    prompt_tokens = input_tokens
    for _ in range(n):
        got = client.ask(prompt(rng, input_tokens), length)
        record(run, got)
        prompt_tokens = got[2] or prompt_tokens
    model = engine.simulate(prof, requests=n, input_tokens=prompt_tokens, output_tokens=length, concurrency=1,
                            ignore_eos=True)
    run.model_ms = [(last - at) * 1000 for at, _first, last, _n in model.requests]
    return run, prompt_tokens


def at_knee(client: Client, prof: profiles.Profile, rng: random.Random, length: int, seconds: float,
            prompt_tokens: int, seed: int) -> Run:
    rate = engine.knee(prof, input_tokens=prompt_tokens, output_tokens=length, seed=seed, ignore_eos=True).rate
    n = max(4, min(MAX_KNEE_REQUESTS, round(rate * seconds)))
    times = engine.poisson_arrivals(random.Random(seed), rate, n)
    texts = [prompt(rng, prompt_tokens) for _ in range(n)]
    run = Run(length, f"knee {rate:g}/s", n)
    sent_at: list[float] = [0.0] * n
    lock = threading.Lock()

    def one(i: int) -> None:
        got = client.ask(texts[i], length)
        with lock:
            record(run, got)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        for i, t in enumerate(times):
            time.sleep(max(0.0, start + t - time.perf_counter()))
            sent_at[i] = time.perf_counter() - start  # the schedule really sent: the model runs on it
            pool.submit(one, i)
    model = engine.simulate(prof, input_tokens=prompt_tokens, output_tokens=length, arrivals_s=sent_at,
                            ignore_eos=True, requests=n)
    run.model_ms = [(last - at) * 1000 for at, _first, last, _n in model.requests]
    return run


def overhead(client: Client, prof: profiles.Profile, rng: random.Random, n: int, input_tokens: int) -> float:
    """The cell's time for a 1-token answer at concurrency 1, less the model's: the router, the
    emulated network and the stand-in's HTTP, which the engine's step times do not hold."""
    run, prompt_tokens = serial(client, prof, rng, 1, max(3, n), input_tokens)
    return run.measured_p50 - engine.percentile(sorted(run.model_ms), 50)


def table(runs: list[Run]) -> str:
    rows = [f"{'answer':>6}  {'load':<14} {'sent':>4} {'pod':>4} {'fallback':>8} {'failed':>6} "
            f"{'e2e p50':>9} {'model+router':>12} {'off':>6}  {'p90: e2e / model+router':>23}  within 25 %"]
    for r in runs:
        rows.append(f"{r.length:>6}  {r.load:<14} {r.sent:>4} {r.by_pod:>4} {r.by_fallback:>8} {len(r.failed):>6} "
                    f"{r.measured_p50:>9,.0f} {r.expected_p50:>12,.0f} {100 * r.off:>+5.0f}%  "
                    f"{'{:,.0f} / {:,.0f}'.format(*r.p90s()):>23}  {'yes' if r.ok else 'NO'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.answers", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="answer lengths in tokens, comma-separated")
    p.add_argument("--serial", type=int, default=4, help="requests at concurrency 1 per length")
    p.add_argument("--knee-seconds", type=float, default=30.0,
                   help="seconds of Poisson arrivals at the knee per length (0: concurrency 1 only)")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=46)
    p.add_argument("--json", help="also write the runs as JSON here ('-': stdout)")
    args = p.parse_args(argv)
    lengths = counts(p, "--lengths", args.lengths)
    context = profiles.get(profiles.DEFAULT_PROFILE).max_model_len
    if max(lengths) + args.input_tokens > context:
        p.error(f"--lengths {args.lengths!r}: each at most {context - args.input_tokens} (the pods' {context:,}-token "
                f"context less --input-tokens)")
    if args.serial < 1 or args.knee_seconds < 0:
        p.error(f"--serial must be at least 1 (got {args.serial}) and --knee-seconds at least 0 (got {args.knee_seconds})")

    from colocate import stackfile
    from colocate.admin import AdminClient, Target
    from colocate.sandbox import supervisor
    from colocate.sandbox.launch import Launch, build_plan

    rng = random.Random(args.seed)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="colocate-answers-") as tmp:
        stacks = Path(tmp) / "stacks"
        stacks.mkdir()
        (stacks / "Pulumi.sandbox.yaml").write_text(stackfile.path_of("sandbox").read_text())
        pod = build_plan(Launch("sandbox", str(stacks), None, None, (), False))[0].pod_settings
        assert pod is not None  # the sandbox stack always declares its pod
        prof = profiles.get(pod.profile)
        print(f"bench-answers: the sandbox cell on its stack's settings: {pod.count} pod(s) of profile {prof.name}, "
              f"model {pod.model}", file=sys.stderr)
        state_dir = Path(tmp) / "state"
        try:
            cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
        except Exception as exc:  # noqa: BLE001 (any failure to start is this bench's setup failure)
            print(f"bench-answers: the sandbox did not start: {exc}", file=sys.stderr)
            supervisor.down(state_dir, quiet=True)
            return 2
        try:
            admin = AdminClient(Target(cell["worker_url"], cell["token"], "sandbox"))
            key = admin.create_key("answers-bench", rpm=0, tpm=0, max_parallel=0, max_parallel_tokens=0)["key"]
            client = Client(cell["worker_url"], key, pod.model)
            with BreakerWatch(cell["worker_url"], cell["read_token"]) as watch:
                over = overhead(client, prof, rng, args.serial, args.input_tokens)
                print(f"bench-answers: router and network overhead {over:.1f} ms (a 1-token answer, "
                      f"through the cell less the model)", file=sys.stderr)
                for length in lengths:
                    run, prompt_tokens = serial(client, prof, rng, length, args.serial, args.input_tokens)
                    now = [run]
                    if args.knee_seconds:
                        now.append(at_knee(client, prof, rng, length, args.knee_seconds, prompt_tokens, args.seed + length))
                    runs.extend(now)
                    for r in now:
                        r.overhead_ms = over
                        print(f"  {r.length} tokens, {r.load}: {r.by_pod}/{r.sent} by the pod, p50 "
                              f"{r.measured_p50:,.0f} ms against {r.expected_p50:,.0f}", file=sys.stderr)
        finally:
            supervisor.down(state_dir, quiet=True)
    opened = watch.opened()
    print(table(runs))
    print(f"breakers: {'every one stayed closed' if not opened else 'OPENED ' + ', '.join(f'pod {p} {s}' for p, s in opened)} "
          f"({watch.polls} polls of /_colocate/metrics); router overhead {over:.1f} ms")
    for r in runs:
        for e in r.failed[:3]:
            print(f"  {r.length} tokens, {r.load}: {e}")
    if args.json:
        doc = {"profile": prof.name, "overhead_ms": over, "breakers_opened": opened,
               "runs": [{**asdict(r), "measured_p50": r.measured_p50, "expected_p50": r.expected_p50, "ok": r.ok}
                        for r in runs]}
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if runs and all(r.ok for r in runs) and not opened else 1


if __name__ == "__main__":
    sys.exit(main())
