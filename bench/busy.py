"""make bench-busy: keys that fill the pod's prefill queue with long prompts, against a quiet key.

The sandbox cell runs on its stack's settings (stacks/Pulumi.sandbox.yaml: one stand-in pod on
the default profile, RTX 4090 with Qwen2.5-7B INT4, which models vLLM's prefill queue; the
stack's deadline). Every key has the cell's default limits (colocate:keys.defaults). For each
number of attacking keys in ``--attackers`` (default 1 and 2), for ``--seconds``:

* each attacking key keeps ``--inflight`` requests going at once (4, under the default
  max_parallel 8), each a non-streamed chat completion of about ``--prompt-tokens`` tokens of
  fresh text (random words, no two prompts alike: no prefix cache helps) with ``max_tokens: 1``;
  a 429 is honoured as OpenAI's SDKs do (they wait ``Retry-After``, then send again);
* a quiet key sends short chat completions (``max_tokens`` 8) from three clients, each one at a
  time with 250 ms between.

Reported per phase: who served the quiet key's requests (the goal: at most 5 % by the fallback)
and their time, what the attacking keys got (served by the pod or the fallback, refused and
why), every breaker state any pod was seen in (polled each second from /_colocate/metrics; the
goal: always closed), and the live view's ``queue`` (a pod request's wait for its first token)
over the phase. Exit 0 when every phase meets both goals; 1 otherwise; 2 usage or setup.

Usage: .venv/bin/python -m bench.busy [--attackers 1,2] [--seconds 30] [--inflight 4]
       [--prompt-tokens 5000] [--seed 58] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from bench.answers import BreakerWatch
from bench.pod import counts

QUIET_EVERY_S = 0.25
QUIET_CLIENTS = 3
QUIET_MAX_TOKENS = 8
FALLBACK_GOAL = 0.05
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TIMEOUT_S = 120.0


def fresh_text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words no prompt shares (a word of 3 to 7 letters with its space is one token)."""
    return " ".join("".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 7))) for _ in range(tokens))


@dataclass
class Phase:
    attackers: int
    seconds: float
    quiet: list[tuple[int | None, str | None, float]] = field(default_factory=list)  # status, backend, ms
    attack: dict[str, int] = field(default_factory=dict)  # "200 pod-0", "429 too_many_parallel_tokens", ...
    breakers: list[tuple[str, str]] = field(default_factory=list)  # (pod, state) seen other than closed
    queue_ms: dict[str, dict] = field(default_factory=dict)  # pod -> {n, p50, p90, p99}

    @property
    def quiet_fallback_share(self) -> float:
        return sum(1 for _s, b, _ms in self.quiet if b == "fallback") / max(1, len(self.quiet))

    @property
    def quiet_failed(self) -> int:
        return sum(1 for s, _b, _ms in self.quiet if s != 200)

    def quiet_ms(self, q: float) -> float | None:
        ms = sorted(m for s, _b, m in self.quiet if s == 200)
        return round(ms[min(len(ms) - 1, int(q * len(ms)))]) if ms else None

    @property
    def ok(self) -> bool:
        return bool(self.quiet) and self.quiet_failed == 0 and self.quiet_fallback_share <= FALLBACK_GOAL and not self.breakers


def post(session: requests.Session, url: str, key: str, body: dict) -> tuple[int | None, str | None, str, float]:
    t0 = time.monotonic()
    try:
        r = session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S)
        code = ""
        if r.status_code != 200:
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = r.text[:60]
        wait = float(r.headers.get("retry-after", "1")) if r.status_code == 429 else 0.0
        out: tuple[int | None, str | None, str, float] = (r.status_code, r.headers.get("x-colocate-backend"), code, wait)
    except requests.RequestException as exc:
        out = (None, None, type(exc).__name__, 0.0)
    return out[0], out[1], out[2], (time.monotonic() - t0) * 1000 if out[3] == 0.0 else out[3]


def run_phase(url: str, model: str, quiet_key: str, attack_keys: list[str], seconds: float, inflight: int,
              prompt_tokens: int, seed: int) -> Phase:
    ph = Phase(len(attack_keys), seconds)
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def attacker(key: str, seed_: int) -> None:
        rng, s = random.Random(seed_), requests.Session()
        while time.monotonic() < stop:
            body = {"model": model, "messages": [{"role": "user", "content": fresh_text(rng, prompt_tokens)}], "max_tokens": 1}
            status, backend, code, extra = post(s, url, key, body)
            with lock:
                k = f"{status} {backend}" if status == 200 else f"{status} {code}"
                ph.attack[k] = ph.attack.get(k, 0) + 1
            if status == 429:
                time.sleep(min(extra, max(0.0, stop - time.monotonic())))  # Retry-After, as OpenAI's SDKs honour it

    def quiet() -> None:
        s = requests.Session()
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": QUIET_MAX_TOKENS}
        while time.monotonic() < stop:
            status, backend, _code, ms = post(s, url, quiet_key, body)
            with lock:
                ph.quiet.append((status, backend, ms))
            time.sleep(QUIET_EVERY_S)

    threads = [threading.Thread(target=attacker, args=(k, seed * 1000 + i * 100 + j), daemon=True)
               for i, k in enumerate(attack_keys) for j in range(inflight)]
    threads += [threading.Thread(target=quiet, daemon=True) for _ in range(QUIET_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + TIMEOUT_S + 10)
    return ph


def queue_of(url: str, read_token: str, since_ms: int) -> dict[str, dict]:
    """The live view's `queue` per pod since ``since_ms`` (minute rows: the minute the phase began in counts whole)."""
    from colocate.probe.histogram import Histogram

    doc = requests.get(f"{url}/_colocate/live?since={since_ms}", headers={"Authorization": f"Bearer {read_token}"},
                       timeout=30).json()
    per: dict[str, Histogram] = {}
    for _at, _colo, who, segment, hist in doc.get("minutes", []):
        if segment == "queue":
            per[who] = per.get(who, Histogram()).add(Histogram.decode(hist))
    return {who: {"n": h.n, **{f"p{q}": round(h.percentile(q) or 0) for q in (50, 90, 99)}} for who, h in sorted(per.items())}


def table(phases: list[Phase]) -> str:
    head = (f"{'attackers':>9}  {'quiet n':>7}  {'by fallback':>11}  {'quiet p50':>9}  {'p90':>6}  {'breaker':>8}  "
            f"{'queue p50/p99 (ms)':>18}  attacking keys got")
    lines = [head]
    for ph in phases:
        q = "; ".join(f"pod {w} {v['p50']}/{v['p99']}" for w, v in ph.queue_ms.items()) or "-"
        got = ", ".join(f"{k}: {v}" for k, v in sorted(ph.attack.items()))
        lines.append(f"{ph.attackers:>9}  {len(ph.quiet):>7}  {ph.quiet_fallback_share:>10.1%}  {ph.quiet_ms(0.5) or '-':>9}  "
                     f"{ph.quiet_ms(0.9) or '-':>6}  {'closed' if not ph.breakers else 'OPENED':>8}  {q:>18}  {got}")
    return "\n".join(lines)


def measure(attackers: list[int], seconds: float, inflight: int, prompt_tokens: int, seed: int, log=print) -> dict:
    """Run the phases on a fresh sandbox cell; the document the bench prints and the test reads."""
    from colocate import stackfile
    from colocate.admin import AdminClient, Target
    from colocate.sandbox import supervisor
    from colocate.sandbox.launch import Launch, build_plan

    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="colocate-busy-") as tmp:
        stacks = Path(tmp) / "stacks"
        stacks.mkdir()
        (stacks / "Pulumi.sandbox.yaml").write_text(stackfile.path_of("sandbox").read_text())
        plan = build_plan(Launch("sandbox", str(stacks), None, None, (), False))[0]
        pod = plan.pod_settings
        assert pod is not None  # the sandbox stack always declares its pod
        state_dir = Path(tmp) / "state"
        try:
            cell = supervisor.up("sandbox", state_dir=state_dir, stacks_dir=stacks)
            admin = AdminClient(Target(cell["worker_url"], cell["token"], "sandbox"))
            # The cell's default limits (colocate:keys.defaults) for every key: none is named.
            quiet_key = admin.create_key("quiet")["key"]
            attack_keys = [admin.create_key(f"attacker-{i}")["key"] for i in range(max(attackers, default=0))]
            deadline = next(b.text for b in plan.worker.bindings if b.name == "DEADLINE_MS")
            log(f"bench-busy: the sandbox cell, {pod.count} pod(s) of profile {pod.profile}, first-token deadline {deadline} ms")
            for n in attackers:
                since = int(time.time() * 1000)
                with BreakerWatch(cell["worker_url"], cell["read_token"]) as watch:
                    ph = run_phase(cell["worker_url"], pod.model, quiet_key, attack_keys[:n], seconds, inflight, prompt_tokens,
                                   seed + n)
                ph.breakers = watch.opened()
                time.sleep(2.5)  # the isolate's histograms ride on its next sync
                ph.queue_ms = queue_of(cell["worker_url"], cell["read_token"], since)
                phases.append(ph)
                log(table([ph]).splitlines()[1])
        finally:
            supervisor.down(state_dir, quiet=True)
    return {"profile": pod.profile, "seconds": seconds, "inflight": inflight, "prompt_tokens": prompt_tokens,
            "fallback_goal": FALLBACK_GOAL, "ok": all(ph.ok for ph in phases),
            "phases": [{**asdict(ph), "quiet_fallback_share": ph.quiet_fallback_share, "quiet_p50_ms": ph.quiet_ms(0.5),
                        "quiet_p90_ms": ph.quiet_ms(0.9), "quiet_failed": ph.quiet_failed, "ok": ph.ok} for ph in phases],
            "table": table(phases)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.busy", description=__doc__.split("\n\n")[0])
    p.add_argument("--attackers", default="1,2", help="attacking keys per phase, comma-separated")
    p.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    p.add_argument("--inflight", type=int, default=4, help="requests each attacking key keeps going at once")
    p.add_argument("--prompt-tokens", type=int, default=5000, help="each attacking prompt's length in tokens")
    p.add_argument("--seed", type=int, default=58)
    p.add_argument("--json", help="also write the result as JSON here ('-': stdout)")
    args = p.parse_args(argv)
    attackers = counts(p, "--attackers", args.attackers)
    if args.seconds <= 0 or args.inflight < 1 or not 1 <= args.prompt_tokens <= 8000:
        p.error(f"--seconds must be > 0 (got {args.seconds}), --inflight at least 1 (got {args.inflight}) and "
                f"--prompt-tokens 1 to 8000, within the pods' context (got {args.prompt_tokens})")
    try:
        doc = measure(attackers, args.seconds, args.inflight, args.prompt_tokens, args.seed,
                      log=lambda m: print(m, file=sys.stderr))
    except Exception as exc:  # noqa: BLE001 (any failure to start is this bench's setup failure)
        print(f"bench-busy: the sandbox cell did not run: {exc}", file=sys.stderr)
        return 2
    print(doc["table"])
    print(f"goal: the quiet key's requests at most {FALLBACK_GOAL:.0%} by the fallback and every breaker closed: "
          f"{'met' if doc['ok'] else 'NOT met'}")
    if args.json:
        text = json.dumps({k: v for k, v in doc.items() if k != "table"}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
