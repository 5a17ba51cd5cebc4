"""make bench-pod: a concurrency sweep against one OpenAI-compatible server, as vLLM's
benchmark_serving runs it (``--max-concurrency``, all prompts queued at once).

Each point sends ``--prompts`` streamed chat requests of about ``--input-tokens`` tokens (common
words, one token each in any large BPE vocabulary; random, so no two share a prefix) asking
``max_tokens = --output-tokens``, ``--concurrency`` at a time, and prints requests/s, output
tokens/s, TTFT and ITL (the gaps between a stream's tokens) p50/p99, then the knee: the highest
request rate among the points whose TTFT p99 stays within ``--budget-ms`` (default 1,000 ms, the
capacity planner's budget, ``colocate.pods.profiles.DEFAULT_TTFT_P99_BUDGET_MS``).

Target: ``--url`` (a stand-in, a real vLLM through a tunnel, a cell; loopback only here), its key
from ``--key-env`` (an environment variable's name: never on the command line). Without
``--url``, a stand-in is started with ``--profile`` on a free loopback port and stopped after.
``--compare`` prints the profile's cited sweep beside each point and exits 1 if any measured
req/s, output tok/s or TTFT p50 is more than 20 % off it. ``--virtual`` runs the same sweep through
the profile's engine in virtual time (colocate.pods.engine.simulate) instead of over HTTP.

    python bench/pod.py [--url URL --key-env VAR --model NAME] [--profile rtx4090-qwen2.5-7b-int4]
        [--concurrency 4,8,16,32,48] [--prompts 300] [--input-tokens 256] [--output-tokens 128]
        [--ignore-eos] [--budget-ms 1000] [--compare] [--virtual] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from colocate.pods import engine, profiles  # noqa: E402

WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her",
         "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will",
         "can", "more", "other", "what", "up", "out")
TEMPLATE_TOKENS = 30  # the chat template's own tokens around one user message (Qwen2.5's, default system prompt)
TOLERANCE = 0.20
REQUEST_TIMEOUT_S = 300.0


def counts(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``flag``'s comma-separated whole numbers, each at least 1, or the parser's usage error naming it."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        p.error(f"{flag} takes whole numbers of at least 1 separated by commas (got {text!r}); e.g. 4,8,16")
    return out


def prompt(rng: random.Random, tokens: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(max(1, tokens - TEMPLATE_TOKENS))).strip()


def percentile(values: list[float], q: float) -> float:
    return engine.percentile(sorted(values), q)


class Target:
    def __init__(self, url: str, key: str | None, model: str | None):
        u = urllib.parse.urlsplit(url)
        self.https, self.host, self.port = u.scheme == "https", u.hostname or "127.0.0.1", u.port
        self.base = u.path.rstrip("/")
        self.key, self.model = key, model

    def connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=REQUEST_TIMEOUT_S)

    def stream(self, conn: http.client.HTTPConnection, text: str, max_tokens: int,
               ignore_eos: bool = False) -> tuple[float, list[float]]:
        """One streamed chat request: (sent at, each content token's arrival time)."""
        body: dict[str, object] = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                                   "stream": True}
        if ignore_eos:  # vLLM's extra sampling fields: exactly max_tokens tokens
            body.update(ignore_eos=True, min_tokens=max_tokens)
        if self.model:
            body["model"] = self.model
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {self.key}"} if self.key else {})}
        sent = time.perf_counter()
        conn.request("POST", self.base + "/v1/chat/completions", json.dumps(body), headers)
        res = conn.getresponse()
        if res.status != 200:
            raise RuntimeError(f"HTTP {res.status}: {res.read()[:200]!r}")
        times: list[float] = []
        while True:
            line = res.readline()
            if not line:
                break
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    if (c.get("delta") or {}).get("content") or c.get("text"):
                        times.append(time.perf_counter())
            elif line.startswith(b"data: [DONE]"):
                res.read()
                break
        return sent, times


def run_point(target: Target, concurrency: int, prompts: int, input_tokens: int, output_tokens: int,
              seed: int, ignore_eos: bool = False) -> dict:
    rng = random.Random(seed)
    texts = [prompt(rng, input_tokens) for _ in range(prompts)]
    lock = threading.Lock()
    results: list[tuple[float, list[float]]] = []
    errors: list[str] = []

    def worker() -> None:
        conn = target.connection()
        try:
            while True:
                with lock:
                    if not texts or len(errors) > 10:
                        return
                    text = texts.pop()
                try:
                    got = target.stream(conn, text, output_tokens, ignore_eos)
                except (OSError, RuntimeError, http.client.HTTPException) as exc:
                    with lock:
                        errors.append(str(exc))
                    conn.close()
                    conn = target.connection()
                    continue
                with lock:
                    results.append(got)
        finally:
            conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S * prompts)
    elapsed = time.perf_counter() - start
    done = [(sent, times) for sent, times in results if times]
    ttft = [1000 * (times[0] - sent) for sent, times in done]
    itl = [1000 * (b - a) for _s, times in done for a, b in zip(times, times[1:], strict=False)]
    tokens = sum(len(times) for _s, times in done)
    return {"concurrency": concurrency, "requests": len(done), "errors": len(errors), "seconds": round(elapsed, 2),
            "req_s": len(done) / elapsed, "output_tok_s": tokens / elapsed,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            **({"first_error": errors[0]} if errors else {})}


def virtual_point(profile: profiles.Profile, concurrency: int, prompts: int, input_tokens: int, output_tokens: int,
                  seed: int, ignore_eos: bool = False) -> dict:
    r = engine.simulate(profile, requests=prompts, input_tokens=input_tokens, output_tokens=output_tokens,
                        concurrency=concurrency, seed=seed, ignore_eos=ignore_eos)
    return {"concurrency": concurrency, "requests": len(r.requests), "errors": 0, "seconds": round(r.duration_s, 2),
            "req_s": r.req_s, "output_tok_s": r.output_tok_s, "ttft_p50_ms": r.ttft_ms(50),
            "ttft_p99_ms": r.ttft_ms(99), "itl_p50_ms": r.itl_ms(50), "itl_p99_ms": r.itl_ms(99)}


def knee(points: list[dict], budget_ms: float) -> dict | None:
    within = [p for p in points if p["requests"] and p["ttft_p99_ms"] <= budget_ms]
    return max(within, key=lambda p: p["req_s"]) if within else None


def start_standin(profile: str, seed: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("POD_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port", "0", "--profile", profile,
                             "--seed", str(seed)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
    line = proc.stdout.readline() if proc.stdout else b""
    if not line:
        proc.kill()
        raise SystemExit("bench-pod: the stand-in did not start")
    return proc, json.loads(line)["url"]


def loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/pod.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an OpenAI-compatible server on loopback (default: start a stand-in)")
    p.add_argument("--key-env", help="the environment variable holding its API key")
    p.add_argument("--model", help="the model name to send (default: none, the server's own)")
    p.add_argument("--profile", default=profiles.DEFAULT_PROFILE, choices=sorted(profiles.PROFILES))
    p.add_argument("--concurrency", default="4,8,16,32,48")
    p.add_argument("--prompts", type=int, default=300, help="requests per point (the cited sweep's 300)")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="every answer exactly --output-tokens long (vLLM's "
                   "ignore_eos, as guidellm and vllm bench serve --ignore-eos ask)")
    p.add_argument("--budget-ms", type=float, default=profiles.DEFAULT_TTFT_P99_BUDGET_MS)
    p.add_argument("--compare", action="store_true", help="check each point against the profile's cited sweep (±20 %%)")
    p.add_argument("--virtual", action="store_true", help="the profile's engine in virtual time, no HTTP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the points as JSON here ('-': stdout)")
    a = p.parse_args(argv)
    levels = counts(p, "--concurrency", a.concurrency)
    if a.prompts < 1 or a.input_tokens < 1 or a.output_tokens < 1:
        p.error("--prompts, --input-tokens and --output-tokens must be >= 1")
    if a.url and not loopback(a.url):
        p.error(f"--url {a.url}: loopback only (tunnel a remote server to 127.0.0.1, e.g. ssh -L)")
    profile = profiles.get(a.profile)
    proc = None
    points = []
    try:
        if a.virtual:
            where = f"profile {profile.name}, virtual time"
            points = [virtual_point(profile, c, a.prompts, a.input_tokens, a.output_tokens, a.seed, a.ignore_eos)
                      for c in levels]
        else:
            url = a.url
            if url is None:
                proc, url = start_standin(profile.name, a.seed)
            where = url if a.url else f"stand-in --profile {profile.name} at {url}"
            target = Target(url, os.environ.get(a.key_env) if a.key_env else None, a.model)
            for c in levels:
                points.append(run_point(target, c, a.prompts, a.input_tokens, a.output_tokens, a.seed + c,
                                        a.ignore_eos))
                print(f"  concurrency {c}: done in {points[-1]['seconds']} s", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()
    cited = {pt.concurrency: pt for pt in (profile.sweep.points if profile.sweep else ())}
    print(f"bench-pod: {where}; {a.prompts} requests per point, {a.input_tokens} tokens in, max {a.output_tokens} out, "
          "streamed")
    head = f"{'conc':>4} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
    print(head + ("   cited req/s, tok/s, TTFT p50 (error)" if a.compare else ""))
    worst = 0.0
    for pt in points:
        row = (f"{pt['concurrency']:>4} {pt['req_s']:>7.2f} {pt['output_tok_s']:>7.0f} {pt['ttft_p50_ms']:>7.0f}ms "
               f"{pt['ttft_p99_ms']:>7.0f}ms {pt['itl_p50_ms']:>6.1f}ms {pt['itl_p99_ms']:>6.1f}ms")
        ref = cited.get(pt["concurrency"])
        if a.compare and ref:
            errs = [pt["req_s"] / ref.req_s - 1, pt["output_tok_s"] / ref.output_tok_s - 1,
                    pt["ttft_p50_ms"] / ref.ttft_p50_ms - 1]
            pt["error"] = errs
            worst = max(worst, *map(abs, errs))
            row += (f"   {ref.req_s:.2f}, {ref.output_tok_s:.0f}, {ref.ttft_p50_ms:.0f} ms "
                    f"({errs[0]:+.0%}, {errs[1]:+.0%}, {errs[2]:+.0%})")
        if pt["errors"]:
            row += f"   {pt['errors']} errors: {pt.get('first_error')}"
        print(row)
    k = knee(points, a.budget_ms)
    print(f"knee (TTFT p99 <= {a.budget_ms:.0f} ms): " +
          (f"{k['req_s']:.2f} req/s at concurrency {k['concurrency']}" if k else "none of the points"))
    if a.json:
        out = json.dumps({"target": where, "points": points, "knee": k, "budget_ms": a.budget_ms}, indent=1)
        (sys.stdout.write(out + "\n") if a.json == "-" else Path(a.json).write_text(out))
    if a.compare and profile.sweep:
        ok = worst <= TOLERANCE
        print(f"against {profile.sweep.source.split(' (')[0]}: worst error {worst:.0%} "
              f"({'within' if ok else 'outside'} {TOLERANCE:.0%})")
        return 0 if ok else 1
    if a.compare:
        print(f"{profile.name} has no cited sweep table to compare with ({profile.notes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
