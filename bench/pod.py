"""make bench-pod: a pod's timing under a published sweep's workload, against what that sweep measured.

Each published sweep (``colocate.pods.profiles``: MISTRAL7B_SWEEP, LLAMA3_8B_SWEEP) is replayed as
its source ran it: ``concurrency`` (all prompts queued at once, ``level`` at a time, vLLM's
benchmark_serving with ``--max-concurrency``) or ``poisson`` (``level`` requests/s on
benchmark_serving's own schedule, each request's prompt and answer lengths from the sweep's
ShareGPT sample). Each point prints requests/s, output tokens/s, TTFT p50/p99 and ITL p50/p99 (the
gaps between a stream's tokens, pooled), then the knee: the highest request rate among the points
whose TTFT p99 stays within ``--budget-ms`` (default 1,000 ms, the capacity planner's budget,
``colocate.pods.profiles.DEFAULT_TTFT_P99_BUDGET_MS``).

Target: the profile's engine in virtual time (colocate.pods.engine.simulate: the default, which a
busy machine does not disturb); ``--standin``: a stand-in started with the profile on a free
loopback port, over HTTP in real time; ``--url``: any OpenAI-compatible server on loopback (a real
vLLM through a tunnel, a cell), its key from ``--key-env`` (an environment variable's name: never
on the command line).

``--compare`` replays every published sweep on the profile fitted to it (or on ``--profile``)
and prints each point's ratio to the source (measured / published) for every figure the source
gives; it exits 1 if any is more than 20 % off. Without a sweep (``--sweep none``), the workload is
the flags' own: ``--concurrency`` levels of ``--prompts`` requests of ``--input-tokens``, max
``--output-tokens`` out.

    python -m bench.pod [--compare] [--sweep all|none|NAME] [--profile NAME] [--standin | --url URL
        --key-env VAR --model NAME] [--levels 4,48] [--concurrency 4,8,16,32,48] [--prompts N]
        [--input-tokens 256] [--output-tokens 128] [--ignore-eos] [--budget-ms 1000] [--json PATH|-]
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
from collections.abc import Sequence
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
SWEEPS = {s.name: s for s in (profiles.MISTRAL7B_SWEEP, profiles.LLAMA3_8B_SWEEP)}
# (figure, its key in a point's result, its field in profiles.Point)
FIGURES = (("req/s", "req_s", "req_s"), ("tok/s", "output_tok_s", "output_tok_s"),
           ("TTFT p50", "ttft_p50_ms", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms", "ttft_p99_ms"),
           ("ITL p50", "itl_p50_ms", "itl_p50_ms"))


def counts(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``flag``'s comma-separated whole numbers, each at least 1, or the parser's usage error naming it."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        p.error(f"{flag} takes whole numbers of at least 1 separated by commas (got {text!r}); e.g. 4,8,16")
    return out


def levels(p: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    """``flag``'s comma-separated positive numbers (concurrency levels or requests/s), or the usage error."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        p.error(f"{flag} takes positive numbers separated by commas (got {text!r}); e.g. 4,48")
    return out


def prompt(rng: random.Random, tokens: int, chat: bool = True) -> str:
    """Common words, one token each in any large BPE vocabulary (the chat template's own tokens left out)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(max(1, tokens - (TEMPLATE_TOKENS if chat else 0)))).strip()


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
               ignore_eos: bool = False, chat: bool = True) -> tuple[float, list[float]]:
        """One streamed request (chat, or /v1/completions as benchmark_serving sends ShareGPT): (sent
        at, each content token's arrival time)."""
        body: dict[str, object] = {"max_tokens": max_tokens, "stream": True}
        body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        if ignore_eos:  # vLLM's extra sampling fields: exactly max_tokens tokens
            body.update(ignore_eos=True, min_tokens=max_tokens)
        if self.model:
            body["model"] = self.model
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {self.key}"} if self.key else {})}
        sent = time.perf_counter()
        conn.request("POST", self.base + ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body),
                     headers)
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


def summarise(level: float, results: list[tuple[float, list[float]]], errors: list[str], elapsed: float) -> dict:
    done = [(sent, times) for sent, times in results if times]
    ttft = [1000 * (times[0] - sent) for sent, times in done]
    itl = [1000 * (b - a) for _s, times in done for a, b in zip(times, times[1:], strict=False)]
    tokens = sum(len(times) for _s, times in done)
    return {"level": level, "requests": len(done), "tokens": tokens, "errors": len(errors), "seconds": round(elapsed, 2),
            "req_s": len(done) / elapsed, "output_tok_s": tokens / elapsed,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            **({"first_error": errors[0]} if errors else {})}


def run_point(target: Target, concurrency: int, prompts: int, input_tokens: int, output_tokens: int,
              seed: int, ignore_eos: bool = False) -> dict:
    """``prompts`` chat requests, ``concurrency`` at a time, each client sending its next when its answer ends."""
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
    return summarise(concurrency, results, errors, time.perf_counter() - start)


def run_schedule(target: Target, rate: float, lengths: Sequence[tuple[int, int]], seed: int) -> dict:
    """One completions request per (prompt, answer) length, sent at benchmark_serving's times for ``rate``,
    each answer exactly its length (``ignore_eos``: the source's answers reached their caps)."""
    rng = random.Random(seed)
    texts = [prompt(rng, n, chat=False) for n, _out in lengths]
    at = engine.benchmark_serving_arrivals(rate, len(lengths))
    lock = threading.Lock()
    results: list[tuple[float, list[float]]] = []
    errors: list[str] = []

    def one(i: int) -> None:
        conn = target.connection()
        try:
            got = target.stream(conn, texts[i], lengths[i][1], ignore_eos=True, chat=False)
            with lock:
                results.append(got)
        except (OSError, RuntimeError, http.client.HTTPException) as exc:
            with lock:
                errors.append(str(exc))
        finally:
            conn.close()

    start = time.perf_counter()
    threads = []
    for i, t in enumerate(at):
        time.sleep(max(0.0, start + t - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for th in threads:
        th.join(timeout=REQUEST_TIMEOUT_S)
    return summarise(rate, results, errors, time.perf_counter() - start)


def virtual_point(profile: profiles.Profile, level: float, sweep: profiles.Sweep | None, prompts: int,
                  input_tokens: int, output_tokens: int, seed: int, ignore_eos: bool = False) -> dict:
    """One point in virtual time: the sweep's workload at ``level`` (or the flags' closed loop)."""
    if sweep is not None and sweep.arrivals == "poisson":
        lengths = (sweep.requests() or [])[:prompts]
        r = engine.simulate(profile, arrivals_s=engine.benchmark_serving_arrivals(level, len(lengths)),
                            lengths=lengths, seed=seed)
    else:
        r = engine.simulate(profile, requests=prompts, input_tokens=input_tokens, output_tokens=output_tokens,
                            concurrency=int(level), seed=seed, ignore_eos=ignore_eos)
    return {"level": level, "requests": len(r.requests), "tokens": sum(n for *_x, n in r.requests), "errors": 0,
            "seconds": round(r.duration_s, 2),
            "req_s": r.req_s, "output_tok_s": r.output_tok_s, "ttft_p50_ms": r.ttft_ms(50),
            "ttft_p99_ms": r.ttft_ms(99), "itl_p50_ms": r.itl_ms(50), "itl_p99_ms": r.itl_ms(99)}


def knee(points: list[dict], budget_ms: float) -> dict | None:
    within = [p for p in points if p["requests"] and p["ttft_p99_ms"] <= budget_ms]
    return max(within, key=lambda p: p["req_s"]) if within else None


def ratios(point: dict, ref: profiles.Point) -> dict[str, float]:
    """Measured / published, for each figure the source gives."""
    out = {}
    for name, key, field in FIGURES:
        published = getattr(ref, field)
        if published:
            out[name] = point[key] / published
    return out


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


def fitted_profile(sweep: profiles.Sweep) -> profiles.Profile:
    """The profile fitted to ``sweep``."""
    return next(p for p in profiles.PROFILES.values() if sweep in p.sweeps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/pod.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", default=None, help="a published sweep to replay (" + ", ".join(SWEEPS) +
                   "), all of them, or none (the flags' workload); default: all with --compare, else none")
    p.add_argument("--profile", choices=sorted(profiles.PROFILES),
                   help="the pod's profile (default: the one fitted to each sweep; without a sweep, the kit's pod)")
    p.add_argument("--url", help="an OpenAI-compatible server on loopback")
    p.add_argument("--standin", action="store_true", help="start a stand-in with the profile and sweep it over HTTP")
    p.add_argument("--virtual", action="store_true", help="the profile's engine in virtual time (the default)")
    p.add_argument("--key-env", help="the environment variable holding the server's API key")
    p.add_argument("--model", help="the model name to send (default: none, the server's own)")
    p.add_argument("--levels", help="only these of a sweep's points (concurrency or requests/s), e.g. 4,48")
    p.add_argument("--concurrency", default="4,8,16,32,48", help="without a sweep: the concurrency levels")
    p.add_argument("--prompts", type=int, help="requests per point (default: the sweep's; without one, 300)")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="every answer exactly --output-tokens long (vLLM's "
                   "ignore_eos, as guidellm and vllm bench serve --ignore-eos ask)")
    p.add_argument("--budget-ms", type=float, default=profiles.DEFAULT_TTFT_P99_BUDGET_MS)
    p.add_argument("--compare", action="store_true", help="each point's ratio to its published sweep (±20 %%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the points as JSON here ('-': stdout)")
    a = p.parse_args(argv)
    conc = counts(p, "--concurrency", a.concurrency)
    only = levels(p, "--levels", a.levels) if a.levels else None
    if a.prompts is not None and a.prompts < 1 or a.input_tokens < 1 or a.output_tokens < 1:
        p.error("--prompts, --input-tokens and --output-tokens must be >= 1")
    if a.url and not loopback(a.url):
        p.error(f"--url {a.url}: loopback only (tunnel a remote server to 127.0.0.1, e.g. ssh -L)")
    if a.url and a.standin:
        p.error("--url and --standin: give one target")
    choice = a.sweep or ("all" if a.compare else "none")
    if choice not in ("all", "none", *SWEEPS):
        p.error(f"--sweep {choice!r}: one of all, none, {', '.join(SWEEPS)}")
    sweeps: list[profiles.Sweep | None] = (list(SWEEPS.values()) if choice == "all" else
                                           [None] if choice == "none" else [SWEEPS[choice]])
    if a.compare and sweeps == [None]:
        p.error("--compare needs a published sweep: --sweep all or " + " or ".join(SWEEPS))
    worst_all, report = 0.0, []
    for sweep in sweeps:
        profile = (profiles.get(a.profile) if a.profile else fitted_profile(sweep) if sweep
                   else profiles.get(profiles.DEFAULT_PROFILE))
        prompts = a.prompts or (sweep.prompts if sweep else 300)
        refs = {pt.level: pt for pt in (sweep.points if sweep else ())}
        todo = [lv for lv in (refs or conc) if only is None or lv in only]
        points = run(a, profile, sweep, todo, prompts)
        worst = show(a, profile, sweep, points, refs, prompts)
        worst_all = max(worst_all, worst)
        report.append({"sweep": sweep.name if sweep else None, "profile": profile.name, "points": points,
                       "knee": knee(points, a.budget_ms), "worst_error": worst if a.compare else None})
    if a.json:
        out = json.dumps({"budget_ms": a.budget_ms, "sweeps": report}, indent=1)
        (sys.stdout.write(out + "\n") if a.json == "-" else Path(a.json).write_text(out))
    return 1 if a.compare and worst_all > TOLERANCE else 0


def run(a: argparse.Namespace, profile: profiles.Profile, sweep: profiles.Sweep | None, todo: list,
        prompts: int) -> list[dict]:
    """The points at the levels ``todo``: in virtual time, or over HTTP (a stand-in started here, or --url)."""
    if not (a.url or a.standin):
        return [virtual_point(profile, lv, sweep, prompts, a.input_tokens, a.output_tokens, a.seed, a.ignore_eos)
                for lv in todo]
    proc = None
    points = []
    try:
        url = a.url
        if url is None:
            proc, url = start_standin(profile.name, a.seed)
        target = Target(url, os.environ.get(a.key_env) if a.key_env else None, a.model)
        for lv in todo:
            if sweep is not None and sweep.arrivals == "poisson":
                points.append(run_schedule(target, lv, (sweep.requests() or [])[:prompts], a.seed))
            else:
                inp, out = (sweep.input_tokens, sweep.output_tokens) if sweep else (a.input_tokens, a.output_tokens)
                points.append(run_point(target, int(lv), prompts, inp, out, a.seed + int(lv), a.ignore_eos))
            print(f"  {lv:g}: done in {points[-1]['seconds']} s", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()
    return points


def show(a: argparse.Namespace, profile: profiles.Profile, sweep: profiles.Sweep | None, points: list[dict],
         refs: dict, prompts: int) -> float:
    """Print the points (and with --compare each figure's ratio to the source); the worst error."""
    where = (a.url if a.url else f"stand-in --profile {profile.name} over HTTP" if a.standin
             else f"profile {profile.name}, virtual time")
    if sweep is not None:
        print(f"{sweep.name}: {sweep.source.split(' (')[0]}; {sweep.measured}")
        print(f"  replayed on {where}, {prompts} requests a point")
    else:
        print(f"bench-pod: {where}; {prompts} requests per point, {a.input_tokens} tokens in, max {a.output_tokens} "
              "out, streamed")
    unit = "req/s" if sweep is not None and sweep.arrivals == "poisson" else "conc"
    print(f"{unit:>5} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
          + ("   published: req/s, tok/s, TTFT p50, p99, ITL p50 (ratio measured/published)" if a.compare else ""))
    worst = 0.0
    for pt in points:
        row = (f"{pt['level']:>5g} {pt['req_s']:>7.2f} {pt['output_tok_s']:>7.0f} {pt['ttft_p50_ms']:>7.0f}ms "
               f"{pt['ttft_p99_ms']:>7.0f}ms {pt['itl_p50_ms']:>6.1f}ms {pt['itl_p99_ms']:>6.1f}ms")
        ref = refs.get(pt["level"])
        if a.compare and ref is not None:
            r = ratios(pt, ref)
            pt["ratios"] = r
            worst = max(worst, *(abs(x - 1) for x in r.values()))
            cited = ", ".join(f"{getattr(ref, f):g}" if getattr(ref, f) else "-" for _n, _k, f in FIGURES)
            row += f"   {cited} (" + " ".join(f"x{x:.2f}" for x in r.values()) + ")"
        if pt["errors"]:
            row += f"   {pt['errors']} errors: {pt.get('first_error')}"
        print(row)
    k = knee(points, a.budget_ms)
    at = (lambda lv: f"{lv:g} req/s offered") if unit == "req/s" else (lambda lv: f"concurrency {lv:g}")
    print(f"knee (TTFT p99 <= {a.budget_ms:.0f} ms): " +
          (f"{k['req_s']:.2f} req/s at {at(k['level'])}" if k else "none of the points"))
    if a.compare and sweep is not None:
        print(f"against {sweep.name}: worst error {worst:.0%} ({'within' if worst <= TOLERANCE else 'outside'} "
              f"{TOLERANCE:.0%})")
    print()
    return worst


if __name__ == "__main__":
    sys.exit(main())
