"""Sending the probe's requests and recording what came back, untouched.

One ``requests.Session`` carries every request, so after the warm-up the connection
(and its TLS session) is reused: ``e2e`` is the steady-state round trip a client with a
keep-alive connection sees, not a cold connect. ``e2e`` is measured with
``time.perf_counter`` (monotonic) around the whole request, reading the body included.

Order: one warm-up ``GET /_colocate/probe`` (it is also the first touch of a new
generation, from where the Worker runs), the client key (given, or minted: see ``keys``),
one fallback check (``GET /_colocate/probe?fallback=1``: one authenticated GET of the
fallback's model list, made by the Worker), the model from ``GET /v1/models`` unless given,
then ``samples`` rounds of (probe, routed) requests, interleaved so that drift over the
run affects both kinds alike. Given a sandbox's pod hops (``connections.HopControl``), each
round starts with one more probe request on new pod connections: the hops' connections
closed first, and counted after (``pod_rtt_new``). Everything is bounded: 3 + 2N requests
(3 + 3N with the hops, plus two calls to the sandbox's control endpoint a round; plus the
key's mint and revoke), each with a timeout. The probe token goes only to ``/_colocate/*``,
the client key only to the routed paths.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from . import timing
from .connections import HopControl, opened
from .errors import TargetError, Unauthorized, Unreachable

PROBE_PATH = "/_colocate/probe"
POD_ONLY = "?only=pods"  # the pods' health checks alone: what a new-connection sample times
ROUTED_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
ROUTED_METRICS = ("state", "upstream", "fallback", "total")
PROBE_METRICS = ("state_rtt", "pod_rtt")
# The streamed sample: a realistic chat answer (about 200 tokens), next to the 1-token "ping".
STREAM_TOKENS = 200
STREAM_SEGMENTS = ("ttft", "itl")
STREAM_PROMPT = "Explain in about 150 words how a CDN edge cache decides what to keep."
TOKEN_HELP = "pass --token or set COLOCATE_READ_TOKEN (the stack's readToken output)"
KEY_HELP = ("pass a live key with --key or COLOCATE_CLIENT_KEY (`.venv/bin/python scripts/keys.py create`), "
            "or give neither and the probe mints a short-lived one")
_RAY = re.compile(r"-([A-Za-z]{3})$")


def ray_colo(cf_ray: str | None) -> str | None:
    """The colo suffix of a ``cf-ray`` value (``8c1f...-NRT`` → ``NRT``), else None."""
    m = _RAY.search((cf_ray or "").strip())
    return m.group(1).upper() if m else None


@dataclass
class Sample:
    """One request: ``error`` is None for a 2xx answer, else why it failed."""

    kind: str  # "probe" | "routed"
    e2e_ms: float | None
    status: int | None
    error: str | None
    timing: timing.Timing
    ray_colo: str | None = None
    backend: str | None = None  # routed: x-colocate-backend
    cell: str | None = None  # routed through a fleet's front door: x-colocate-cell
    body: dict | None = None  # probe: the JSON document
    body_problem: str | None = None  # probe: why the body is unusable
    cf_placement: str | None = None  # the response's cf-placement header (remote-XXX / local-XXX), if any
    new_ports: frozenset[str] = frozenset()  # probe on new connections: the pod hops that accepted one meanwhile
    hop_ports: frozenset[str] = frozenset()  # ... and every pod hop the sandbox counts
    ttft_ms: float | None = None  # stream: the first token's arrival, from the request's start
    itl_ms: float | None = None  # stream: the mean gap between its tokens, (last - first) / (tokens - 1)
    tokens: int = 0  # stream: content chunks received (one a token from vLLM)

    @property
    def ok(self) -> bool:
        return self.error is None


SETTLE_STREAK = 3  # the same in-region colo this many probes in a row: the placement has settled
SETTLE_INTERVAL_S = 2.0


@dataclass
class Settling:
    """Waiting for a new placement to be applied: the Worker's colo, probe after probe."""

    settled: bool
    seconds: float
    colos: list[str | None]  # the Worker's colo at each probe, in order (None: not reported)


def ran_colo(s: Sample) -> str | None:
    """Where the Worker ran: its own trace (``worker_colo``), else ``cf-placement`` (header or body)."""
    body = s.body or {}
    if isinstance(body.get("worker_colo"), str) and body["worker_colo"]:
        return body["worker_colo"].upper()
    for value in (s.cf_placement, body.get("cf_placement")):
        kind, _, code = (value or "").strip().partition("-")
        if kind.lower() in ("remote", "local") and len(code) == 3 and code.isalpha():
            return code.upper()
    return None


@dataclass
class Run:
    url: str
    model: str
    warmup: Sample
    probe: list[Sample] = field(default_factory=list)
    routed: list[Sample] = field(default_factory=list)
    fallback_check: Sample | None = None  # the one ?fallback=1 probe (its body's "fallback")
    settling: Settling | None = None  # --settle: how the placement was waited for
    probe_new: list[Sample] | None = None  # probes after the pod hops' connections were closed; None: not measured
    streamed: list[Sample] = field(default_factory=list)  # realistic streamed answers: ttft, itl


class Sampler:
    """Sends the probe's requests over one session. Use as a context manager."""

    def __init__(self, url: str, token: str, timeout_s: float, key: Callable[[], str | None] | None = None):
        self.url = url.rstrip("/")
        self._token = token
        self._key = key or (lambda: None)
        self.timeout_s = timeout_s
        self.session = requests.Session()

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()

    def _send(self, method: str, path: str, **kw) -> tuple[requests.Response, float]:
        start = time.perf_counter()
        response = self.session.request(method, self.url + path, timeout=self.timeout_s, **kw)
        _ = response.content  # the body is part of the round trip
        return response, (time.perf_counter() - start) * 1000

    def _routed_headers(self, **extra: str) -> dict[str, str]:
        key = self._key()
        return {**extra, **({"Authorization": f"Bearer {key}"} if key else {})}

    def probe(self, query: str = "") -> Sample:
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        try:
            r, ms = self._send("GET", PROBE_PATH + query, headers=headers)
        except requests.Timeout:
            return Sample("probe", None, None, "timeout", timing.Timing())
        except requests.ConnectionError:
            return Sample("probe", None, None, "connection failed", timing.Timing())
        st = timing.parse(r.headers.get("Server-Timing"), PROBE_METRICS)
        sample = Sample("probe", ms, r.status_code, None if r.ok else f"HTTP {r.status_code}", st,
                        ray_colo(r.headers.get("cf-ray")), cf_placement=r.headers.get("cf-placement"))
        if r.ok:
            try:
                body = r.json()
            except ValueError:
                body = None
            if isinstance(body, dict):
                sample.body = body
            else:
                sample.body_problem = "body is not a JSON object"
        return sample

    def routed(self, model: str) -> Sample:
        body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        try:
            r, ms = self._send("POST", ROUTED_PATH, data=json.dumps(body),
                               headers=self._routed_headers(**{"Content-Type": "application/json"}))
        except requests.Timeout:
            return Sample("routed", None, None, "timeout", timing.Timing())
        except requests.ConnectionError:
            return Sample("routed", None, None, "connection failed", timing.Timing())
        st = timing.parse(r.headers.get("Server-Timing"), ROUTED_METRICS)
        backend = (r.headers.get("x-colocate-backend") or "").strip().lower() or None
        return Sample("routed", ms, r.status_code, None if r.ok else f"HTTP {r.status_code}", st,
                      ray_colo(r.headers.get("cf-ray")), backend, cell=(r.headers.get("x-colocate-cell") or "").strip() or None,
                      cf_placement=r.headers.get("cf-placement"))

    def streamed(self, model: str, max_tokens: int = STREAM_TOKENS) -> Sample:
        """A streamed answer of about ``max_tokens`` tokens: what a chat user waits for (TTFT) and
        the pace of its tokens (ITL), timed by the client as each event arrives."""
        body = {"model": model, "messages": [{"role": "user", "content": STREAM_PROMPT}], "max_tokens": max_tokens,
                "stream": True}
        start = time.perf_counter()
        stamps: list[float] = []
        try:
            with self.session.post(self.url + ROUTED_PATH, data=json.dumps(body), stream=True, timeout=self.timeout_s,
                                   headers=self._routed_headers(**{"Content-Type": "application/json"})) as r:
                st = timing.parse(r.headers.get("Server-Timing"), ROUTED_METRICS)
                backend = (r.headers.get("x-colocate-backend") or "").strip().lower() or None
                if not r.ok:
                    _ = r.content
                    return Sample("stream", None, r.status_code, f"HTTP {r.status_code}", st, backend=backend)
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]" and _has_content(line[6:]):
                        stamps.append(time.perf_counter())
        except requests.Timeout:
            return Sample("stream", None, None, "timeout", timing.Timing())
        except requests.RequestException:
            return Sample("stream", None, None, "connection failed", timing.Timing())
        e2e = (time.perf_counter() - start) * 1000
        if not stamps:
            return Sample("stream", e2e, r.status_code, "stream without a token", st, backend=backend)
        ttft = (stamps[0] - start) * 1000
        itl = (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1) if len(stamps) > 1 else None
        return Sample("stream", e2e, r.status_code, None, st, ray_colo(r.headers.get("cf-ray")), backend,
                      ttft_ms=ttft, itl_ms=itl, tokens=len(stamps))

    def models(self) -> requests.Response:
        """``GET /v1/models`` with the client key; a 401 is Unauthorized, a transport
        failure the caller's to word (requests' own exception)."""
        r, _ = self._send("GET", MODELS_PATH, headers=self._routed_headers(Accept="application/json"))
        if r.status_code == 401:
            raise Unauthorized(f"GET {self.url + MODELS_PATH} answered 401: the client key was refused; {KEY_HELP}")
        return r

    @staticmethod
    def model_of(r: requests.Response) -> str | None:
        """The first model a ``/v1/models`` answer lists (``data[0].id``), or None."""
        try:
            data = r.json().get("data") if r.ok else None
            model = data[0]["id"] if data else None
        except (ValueError, AttributeError, LookupError, TypeError):
            return None
        return model if isinstance(model, str) and model else None

    def first_model(self) -> str:
        where = self.url + MODELS_PATH
        try:
            r = self.models()
        except requests.RequestException as exc:
            raise TargetError(f"GET {where} failed ({type(exc).__name__}): pass --model NAME") from None
        model = self.model_of(r)
        if model is None:
            raise TargetError(f"GET {where} answered HTTP {r.status_code} without a model in data[0].id: "
                              "pass --model NAME")
        return model

    def warm_up(self, wait_s: float = 0.0) -> Sample:
        """The first probe request: refused, timed out or 401 end the run here.

        ``wait_s`` > 0 retries (once a second, bounded) while the target refuses, times out
        or answers 404/5xx: right after a deploy, a new workers.dev route or custom domain
        can take a few seconds to answer.
        """
        where = self.url + PROBE_PATH
        deadline = time.monotonic() + wait_s
        s = self.probe()
        while time.monotonic() < deadline and (
            s.error in ("connection failed", "timeout") or s.status == 404 or (s.status or 0) >= 500
        ):
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            s = self.probe()
        if s.error == "connection failed":
            raise Unreachable(f"cannot reach {where}: connection refused or no route; is the URL right and the cell up?")
        if s.error == "timeout":
            raise Unreachable(f"{where} did not answer within {self.timeout_s:g} s (--timeout)")
        if s.status == 401:
            raise Unauthorized(f"{where} answered 401: the probe token is missing or wrong; {TOKEN_HELP}")
        if s.status in (404, 405):
            raise TargetError(f"{where} answered HTTP {s.status}: is {self.url} a colocate Worker?")
        return s


def _has_content(data: bytes) -> bool:
    """Whether an SSE event's JSON carries answer text (a chat delta's content, or a completion's text)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    for ch in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
        if isinstance(ch, dict) and ((ch.get("delta") or {}).get("content") or ch.get("text")):
            return True
    return False


def stream_rounds(samples: int, streams: int) -> set[int]:
    """Which of ``samples`` rounds also take a streamed sample: ``streams`` of them, spread evenly."""
    streams = max(0, min(streams, samples))
    return {round(i * samples / streams) for i in range(streams)} if streams else set()


def new_connection_probe(sampler: Sampler, hops: HopControl) -> Sample:
    """The pods' checks on new connections: the sandbox closes its pod hops' connections, the
    Worker checks its pods, and ``new_ports`` says which hops accepted a connection meanwhile."""
    before = hops.cut()
    s = sampler.probe(POD_ONLY)
    after = hops.counts()
    s.new_ports = opened(before, after)
    s.hop_ports = frozenset(after)
    return s


def settle(sampler: Sampler, in_region: Callable[[str], bool], settle_s: float,
           progress: Callable[[str], None] | None = None, interval_s: float | None = None) -> Settling:
    """Probe until the Worker has run in the same in-region colo ``SETTLE_STREAK`` times in a
    row, or ``settle_s`` passes. Cloudflare applies a new placement some time after the
    settings call (host placement probes its target at intervals), so the deploy that sets
    or changes it must not be judged on the colo the Worker ran in before."""
    interval_s = SETTLE_INTERVAL_S if interval_s is None else interval_s
    start = time.monotonic()
    colos: list[str | None] = []
    while True:
        colo = ran_colo(sampler.probe())
        colos.append(colo)
        tail = colos[-SETTLE_STREAK:]
        if len(tail) == SETTLE_STREAK and tail[0] and len(set(tail)) == 1 and in_region(tail[0]):
            return Settling(True, round(time.monotonic() - start, 1), colos)
        elapsed = time.monotonic() - start
        if elapsed >= settle_s:
            return Settling(False, round(elapsed, 1), colos)
        if progress and len(colos) % 10 == 0:
            progress(f"placement not settled after {elapsed:.0f}s (Worker in {colo or 'an unknown colo'})")
        time.sleep(min(interval_s, max(0.0, settle_s - elapsed)))


def run(url: str, token: str, samples: int, timeout_s: float, model: str | None = None,
        progress: Callable[[str], None] | None = None, wait_s: float = 0.0,
        key: Callable[[], str | None] | None = None, check_fallback: bool = True,
        settle_s: float = 0.0, in_region: Callable[[str], bool] | None = None,
        hops: HopControl | None = None, streams: int = 0) -> Run:
    """Warm up, check the fallback once, learn the model, then take ``samples`` (probe, routed) pairs.
    ``settle_s`` > 0 (with ``in_region``): first wait for the placement to settle (``settle``).
    ``hops`` (a sandbox's): each round first takes one probe on new pod connections.
    ``streams``: that many rounds, spread over the run, end with a streamed answer (``ttft``, ``itl``).

    ``key`` is called after the warm-up (so a key is minted only once the cell answers)."""
    with Sampler(url, token, timeout_s, key) as sampler:
        warm = sampler.warm_up(wait_s)
        settling = settle(sampler, in_region, settle_s, progress) if settle_s > 0 and in_region else None
        sampler._key()  # mint now, before any routed request is timed
        fallback = sampler.probe("?fallback=1") if check_fallback else None
        chosen = model or sampler.first_model()
        fresh: list[Sample] = []
        result = Run(sampler.url, chosen, warm, fallback_check=fallback, settling=settling,
                     probe_new=fresh if hops else None)
        streaming = stream_rounds(samples, streams)
        for i in range(samples):
            if hops:  # before the warm probe, so the round's routed request finds the connection warm again
                fresh.append(new_connection_probe(sampler, hops))
            result.probe.append(sampler.probe())
            result.routed.append(sampler.routed(chosen))
            if i in streaming:
                result.streamed.append(sampler.streamed(chosen))
            if progress and ((i + 1) % 5 == 0 or i + 1 == samples):
                progress(f"{i + 1}/{samples} samples")
        return result
