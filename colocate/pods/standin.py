"""A local stand-in for the GPU pod: an OpenAI-compatible inference server that only pretends.

It answers what the router forwards to a real vLLM pod, with the same auth rule
(``Authorization: Bearer <POD_TOKEN>`` on ``/v1/*``, ``/health`` open, like vLLM's
``--api-key``). How long an answer takes depends on the profile (``colocate.pods.profiles``):
``oracle`` (the default) spends ``compute_ms`` (95 ms) per request whatever its length or load; a GPU
profile (``rtx4090-qwen2.5-7b-int4``, ...) runs every request through one engine modelled on vLLM's
scheduler (``colocate.pods.engine``), stepped in real time by a thread of its own (``EngineRunner``):
a stream sends each token when its step ends, a JSON answer goes out at its last token, and
``GET /metrics`` reports the engine under vLLM's names (docs/pods.md, "The local stand-in").

Routes:
    GET  /health                 200, no body, as vLLM answers (no auth)
    GET  /v1/models              the one model
    POST /v1/chat/completions    JSON, or SSE with "stream": true (one chunk per token, then [DONE]);
                                 ``stream_options.include_usage``: every chunk carries ``"usage": null``
                                 and a last chunk before [DONE] has ``"choices": []`` and the usage
                                 (OpenAI's documented shape, which vLLM follows); JSON answers always
                                 carry ``usage``
    POST /v1/completions         JSON, or SSE with "stream": true
    POST /_standin/fault         {"mode": "ok"|"error"|"hang"|"slow", "delay_ms": N}, {"mode": "slow_tokens",
                                 "factor": F} (every step, so every token, F times slower), or
                                 {"mode": "hostile", "attack": A} (loopback clients only; below)
    GET  /_standin/stats         {"requests": N, "streams": {"completed": N, "cut": N}, "redirected": N,
                                 "fault": {...}} (loopback clients only; a cut stream lost its client
                                 before [DONE]; ``redirected``: requests that followed the redirect attack)

Inference routes refuse what vLLM refuses, as vLLM answers (``validate``): a body that is not
JSON or not an object, a missing or malformed ``messages``/``prompt``, a field of the wrong type
(``stream: "maybe"``, ``temperature: "hot"``) are 400 ``{"error": {"message", "type": "Bad
Request", "param": null, "code": 400}}``; ``max_tokens`` < 1, ``n`` outside 1..16384,
a negative ``temperature``, ``top_p`` outside (0, 1] are 400 ``BadRequestError`` naming the
``param``, and so is a prompt plus ``max_tokens`` over the pods' 8192-token context (the prompt
counted at four characters a token); a body nested past Python's recursion limit is vLLM's bare 500. What pydantic's lax
mode takes is taken (``stream: "yes"``, ``temperature: "0.5"``), and a missing ``model`` means
the served one, as in vLLM. Another model name is vLLM's 404 ``NotFoundError``, as a real pod
answers, from the CLI (the sandbox's pods); ``--any-model`` serves any name, as the sandbox's
fallback does (``fallbackModel: passthrough``: an API that serves many models). In-process,
``serve()`` defaults to any name (``any_model=True``), for router tests that name models freely.

Routes vLLM answers without its key, mirrored so that tests can show who reaches them:
``POST /invocations`` (a completion, like SageMaker's route in vLLM), ``POST /tokenize``,
``/detokenize``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``, ``GET /metrics``, ``/docs``.

Mutual TLS (``COLOCATE_POD_TLS`` in the environment, as on a real pod; ``colocate.pods.podtls``):
the port serves TLS and refuses a caller without a client certificate of the cell's CA, with one
line on stderr per refused handshake (``standin: refused a TLS handshake from ...: <reason>``).
``/_standin/*`` then moves to a second, plain port on loopback (``control_url``), so the sandbox
and the tests can still inject faults: the pod's own port answers those routes only through TLS.

Faults apply to every route except ``/_standin/*``: ``error`` answers 500, ``hang``
holds the request for ``delay_ms`` (or until shutdown when 0) then drops the connection,
``slow`` adds ``delay_ms`` before answering.

``hostile`` is a pod that lies to the router, on the inference routes, with one ``attack``:
``usage_inflated`` reports 10^300 prompt and completion tokens; ``usage_hidden`` answers a
non-streamed request with vLLM's ``prompt_logprobs`` after ``usage``, a prompt token decoding
to ``"usage"`` last; ``headers`` adds ``Set-Cookie`` and ``Access-Control-Allow-Origin: *``;
``redirect`` answers 307 to ``/_standin/redirected`` (which counts who follows it);
``oversized`` sends a JSON answer of OVERSIZED_BYTES (64 MiB, chunked, stopping when the client
leaves), or to a streamed request an event stream of that size at about 3 MB/s (a pod that streams
on and on: 64 KiB every 20 ms; a stream the client leaves counts as ``cut``). ``{"mode": "ok"}`` ends it.

CLI: ``python -m colocate.pods.standin --host 127.0.0.1 --port 0 [--profile NAME] [--seed N]
--compute-ms 95 --model NAME [--any-model] [--port-file PATH]`` prints one JSON line
``{"url": ..., "port": ...}`` once listening and stops cleanly on SIGTERM/SIGINT. In-process:
``with serve(compute_ms=5, token="t", profile="oracle") as pod: pod.url``.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import ipaddress
import json
import math
import os
import queue
import random
import select
import signal
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from . import engine as eng, podtls, profiles
from .errors import PodError

DEFAULT_COMPUTE_MS = 95.0
DEFAULT_MODEL = "standin/qwen2.5-7b-instruct-gptq-int4"
FAULT_MODES = ("ok", "error", "hang", "slow", "slow_tokens", "hostile")
ATTACKS = ("usage_inflated", "usage_hidden", "headers", "redirect", "oversized")
OVERSIZED_BYTES = 64 * 1024 * 1024  # four times the router's cap on an answer (forward.js MAX_ANSWER_BYTES)
INFLATED = 10**300
MAX_BODY = 8 * 1024 * 1024
_HANG_CAP_S = 300.0  # a hang with no delay lasts until shutdown, but never longer than this


# ---- what vLLM refuses ------------------------------------------------------
# vLLM's OpenAI server (v0.11, the kit's default image) parses a body with pydantic first: a
# field of the wrong type, a missing required field or bad JSON is a 400 with type
# "Bad Request" (its RequestValidationError handler). Then it checks the model (404
# "NotFoundError" for a name it does not serve; a missing model means the served one), then
# the sampling parameters (400 "BadRequestError": SamplingParams._verify_args). Errors are
# {"error": {"message", "type", "param", "code": <status>}} (vLLM >= 0.10's ErrorResponse).
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: a bigger n is refused
MAX_MODEL_LEN = 8192  # the kit's pods run with --max-model-len 8192 (PodSpec.vllm_args)
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")  # vLLM's ResponseFormat types
_TRUE = {"1", "on", "t", "true", "y", "yes"}  # pydantic's lax bool strings (stream: "yes" is True)
_FALSE = {"0", "off", "f", "false", "n", "no"}


class Refused(PodError):
    """A request vLLM would refuse: ``status``, ``type`` and ``param`` as vLLM answers them."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, type_: str = "Bad Request"):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


def _invalid(field: str, what: str, value) -> Refused:
    return Refused(f"1 validation error for request: {field}: {what} (got {json.dumps(value)[:80]})")


def _as_int(body: dict, field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    raise _invalid(field, "Input should be a valid integer", value)


def _as_float(body: dict, field: str) -> float | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise _invalid(field, "Input should be a valid number", value)


def _as_bool(body: dict, field: str) -> bool | None:
    value = body.get(field)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _invalid(field, "Input should be a valid boolean", value)


def validate(body, chat: bool, served: str | None, count=None, max_model_len: int = MAX_MODEL_LEN) -> dict:
    """The request as vLLM would take it (``stream`` etc. coerced), or Refused.
    ``served``: the one model name served, or None to serve any name; ``count``: the prompt's
    tokens (default ``prompt_tokens``, four characters a token)."""
    if not isinstance(body, dict):
        raise Refused("1 validation error for request: Input should be a valid dictionary or object")
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise Refused("1 validation error for request: messages: Field required")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in messages):
            raise _invalid("messages", "Input should be a list of messages, each an object with a role", messages)
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise Refused("Either prompt or prompt_embeds must be provided and non-empty.")
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt) or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt)))
        if not ok:
            raise _invalid("prompt", "Input should be a string, a list of strings or a list of token ids", prompt)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "Input should be a valid string", model)
    out = dict(body)
    for field in ("max_tokens", "max_completion_tokens", "n", "min_tokens"):
        out[field] = _as_int(body, field)
    out["ignore_eos"] = _as_bool(body, "ignore_eos")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise _invalid("stop", "Input should be a string or a list of strings", stop)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS:
            raise _invalid("response_format", f"type should be one of {', '.join(map(repr, RESPONSE_FORMATS))}", fmt)
        spec = fmt.get("json_schema")
        if fmt["type"] == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict)):
            raise _invalid("response_format.json_schema", "Input should be an object with a schema object", fmt)
    for field in ("temperature", "top_p"):
        out[field] = _as_float(body, field)
    out["stream"] = _as_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("stream_options", "Input should be a valid dictionary or object", options)
    if options and not out["stream"]:
        raise Refused("Stream options can only be defined when `stream=True`.", "stream_options")
    if options:
        out["stream_options"] = {**options, "include_usage": _as_bool(options, "include_usage")}
    if model and served is not None and model != served:
        raise Refused(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")
    max_tokens = (out["max_completion_tokens"] if chat else None) or out["max_tokens"]
    if max_tokens is not None and max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", type_="BadRequestError")
    min_tokens = out["min_tokens"]
    if min_tokens is not None and min_tokens < 0:
        raise Refused(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens",
                      type_="BadRequestError")
    if min_tokens and max_tokens is not None and min_tokens > max_tokens:
        raise Refused(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                      "min_tokens", type_="BadRequestError")
    n = 1 if out["n"] is None else out["n"]
    if n < 1:
        raise Refused(f"n must be at least 1, got {n}.", "n", type_="BadRequestError")
    if n > MAX_N:
        raise Refused(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
                      "environment variable.", "n", type_="BadRequestError")
    temperature = out["temperature"]
    if temperature is not None and not temperature >= 0.0:  # NaN too
        raise Refused(f"temperature must be non-negative, got {temperature}.", "temperature", type_="BadRequestError")
    top_p = out["top_p"]
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise Refused(f"top_p must be in (0, 1], got {top_p}.", "top_p", type_="BadRequestError")
    # vLLM's context check (OpenAIServing._validate_input), on the stand-in's token estimate.
    inputs = (count or prompt_tokens)(out)
    if inputs >= max_model_len:
        raise Refused(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                      f"{inputs} input tokens. Please reduce the length of the input messages.", "input_tokens",
                      type_="BadRequestError")
    if max_tokens is not None and inputs + max_tokens > max_model_len:
        raise Refused(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                      f"context length is {max_model_len} tokens and your request has {inputs} input tokens "
                      f"({max_tokens} > {max_model_len} - {inputs}).", "max_tokens", type_="BadRequestError")
    return out


def prompt_tokens(body: dict) -> int:
    """The stand-in's token count for the prompt: about four characters a token."""
    return max(1, len(json.dumps(body.get("messages") or body.get("prompt"))) // 4)


# Routes vLLM serves without checking --api-key (its security guide), each with what it answers.
OPEN_ROUTES = {"/invocations": "POST", "/tokenize": "POST", "/detokenize": "POST", "/pooling": "POST",
               "/classify": "POST", "/score": "POST", "/rerank": "POST", "/metrics": "GET", "/docs": "GET"}
HANDSHAKE_TIMEOUT_S = 10.0


# ---- the engine in real time ------------------------------------------------------------------
# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{edge}"}} {float(n)}' for edge, n in zip(self.buckets, self.counts, strict=True)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        return [*out, f"{name}_count{{{labels}}} {float(self.count)}", f"{name}_sum{{{labels}}} {self.sum}"]


class Ticket:
    """A request in the engine, as its handler sees it: each token's (index, finished) as its step ends."""

    def __init__(self, rid: str):
        self.id = rid
        self.tokens: queue.Queue[tuple[int, bool]] = queue.Queue()


CATCH_UP_S = 0.05


class EngineRunner:
    """One engine, stepped in real time by a thread of its own: it schedules a step, waits the
    step's duration (times the ``slow_tokens`` factor), then hands out the tokens the step made."""

    def __init__(self, profile: profiles.Profile, seed: int | None = None):
        self.profile = profile
        self.engine = eng.Engine(profile)
        self.rng = random.Random(seed)
        self.factor = 1.0
        self._cond = threading.Condition()
        self._tickets: dict[str, Ticket] = {}
        self._pending: list[tuple[float, eng.Request]] = []
        self._last: dict[str, float] = {}  # request id -> when its last token was handed out
        self._arrived: dict[str, float] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self._stopping = threading.Event()

    def start(self, stopping: threading.Event) -> None:
        self._stopping = stopping
        threading.Thread(target=self._run, name="standin-engine", daemon=True).start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def submit(self, prompt: list[int], length: int, salt: str | None, output_ids: list[int] | None = None) -> Ticket:
        ticket = Ticket(uuid.uuid4().hex)
        with self._cond:
            now = time.monotonic()
            # Past the API server's queue first (Frontend), then into the engine's waiting queue.
            due = now + self.engine.frontend.delay_s(now) * self.factor
            self._pending.append((due, eng.Request(ticket.id, prompt, length, salt=salt, output_ids=output_ids or [])))
            self._tickets[ticket.id] = ticket
            self._arrived[ticket.id] = now
            self._cond.notify_all()
        return ticket

    def answer_length(self, max_tokens: int | None, min_tokens: int, ignore_eos: bool, room: int) -> tuple[int, str]:
        """The answer's length and finish reason (engine.answer_length), from the engine's seeded draws."""
        with self._cond:
            return eng.answer_length(self.profile, self.rng, max_tokens, min_tokens, ignore_eos, room=room)

    def _admit(self, now: float) -> float | None:
        """Move the requests past the API server into the engine; when the next one is due."""
        keep = []
        for due, req in self._pending:
            if due <= now:
                self.engine.add(req)
            else:
                keep.append((due, req))
        self._pending = keep
        return min((due for due, _r in keep), default=None)

    def abort(self, ticket: Ticket) -> None:
        with self._cond:
            self._pending = [(due, r) for due, r in self._pending if r.id != ticket.id]
            self.engine.abort(ticket.id)
            self._forget(ticket.id)

    def _forget(self, rid: str) -> None:
        self._tickets.pop(rid, None)
        self._last.pop(rid, None)
        self._arrived.pop(rid, None)

    def _run(self) -> None:
        ended: float | None = None
        while not self._stopping.is_set():
            with self._cond:
                next_due = self._admit(time.monotonic())
                if not self.engine.busy:
                    ended = None
                    self._cond.wait(0.5 if next_due is None else max(0.0, min(0.5, next_due - time.monotonic())))
                    continue
                now = time.monotonic()
                # Back to back, a step starts when the last one ended, not when this thread got round to it:
                # handing out tokens and a busy machine's lag are not GPU time (up to CATCH_UP_S of it).
                started = ended if ended is not None and now - ended < CATCH_UP_S else now
                step = self.engine.step()
            ended = started + step.duration_s * self.factor
            self._stopping.wait(max(0.0, ended - time.monotonic()))
            now = time.monotonic()
            with self._cond:
                self.engine.frontend.tokens(now, len(step.made))
                for rid, index, finished in step.made:
                    ticket = self._tickets.get(rid)
                    if ticket is None:
                        continue
                    if index == 0:
                        self.ttft.observe(now - self._arrived.get(rid, now))
                    else:
                        self.itl.observe(now - self._last.get(rid, now))
                    self._last[rid] = now
                    ticket.tokens.put((index, finished))
                    if finished:
                        self._forget(rid)

    def metrics(self, model: str) -> str:
        with self._cond:
            e = self.engine
            return prometheus_text(model, len(e.running), len(e.waiting), e.kv.usage, e.kv.queries, e.kv.hits,
                                   e.preemptions, self.ttft, self.itl)


def prometheus_text(model: str, running: int, waiting: int, kv_usage: float, queries: int, hits: int,
                    preemptions: int, ttft: Histogram, itl: Histogram) -> str:
    """vLLM's /metrics (V1 names) in Prometheus text; counters carry ``_total``, as prometheus_client writes them."""
    labels = f'engine="0",model_name="{model}"'

    def one(name: str, kind: str, help_: str, value: float) -> list[str]:
        sample = f"{name}_total" if kind == "counter" else name
        return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{sample}{{{labels}}} {float(value)}"]

    lines = [*one("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", running),
             *one("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", waiting),
             *one("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", kv_usage),
             *one("vllm:prefix_cache_queries", "counter",
                  "Prefix cache queries, in terms of number of queried tokens.", queries),
             *one("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", hits),
             *one("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", preemptions)]
    for name, help_, hist in (("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft),
                              ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl)):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name, labels)]
    return "\n".join(lines) + "\n"


class StandinServer(ThreadingHTTPServer):
    """The HTTP server plus the stand-in's state (fault, request count)."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of 32 connections overflows it
    # and the dropped SYNs come back a second later (p99 ~1 s, resets).
    request_queue_size = 128

    def __init__(self, host: str, port: int, *, compute_ms: float, token: str | None, model: str, name: str = "standin",
                 any_model: bool = True, tls: ssl.SSLContext | None = None, log=None,
                 profile: str | profiles.Profile = "oracle", seed: int | None = None):
        self.profile = profile if isinstance(profile, profiles.Profile) else profiles.get(profile)
        # The oracle answers in compute_ms in each handler; a real profile runs one engine for all.
        self.engine = None if self.profile.oracle_ms is not None else EngineRunner(self.profile, seed)
        self.tls = tls
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.control: _ControlServer | None = None
        self.compute_ms = float(compute_ms)
        self.token = token or None
        self.model = model
        self.any_model = any_model  # False: another model name is vLLM's 404, as a real pod answers
        self.name = name
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._fault: dict = {"mode": "ok", "delay_ms": 0}
        self._redirected = 0
        self._requests = 0
        self.seen_headers: list[dict[str, str]] = []  # the last 16 inference requests' headers (in-process tests)
        self.seen_paths: list[str] = []  # and their request targets, query included
        self.seen_bodies: list[dict] = []  # and the last 16 bodies that parsed
        self._streams = {"completed": 0, "cut": 0}
        super().__init__((host, port), _Handler)
        if tls is not None:
            self.control = _ControlServer(self)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def process_request_thread(self, request, client_address) -> None:
        # The handshake runs on the connection's own thread: a stranger who stalls it holds no one else up.
        if self.tls is not None:
            try:
                request.settimeout(HANDSHAKE_TIMEOUT_S)
                request = self.tls.wrap_socket(request, server_side=True)
                request.settimeout(None)
            except (ssl.SSLError, OSError) as exc:
                reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or type(exc).__name__
                self.log(f"standin: refused a TLS handshake from {client_address[0]}:{client_address[1]}: {reason}")
                with contextlib.suppress(OSError):
                    request.close()
                return
        super().process_request_thread(request, client_address)

    def handle_error(self, request, client_address) -> None:
        # A client (the router) that leaves is not an error: no traceback in pod.log.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host = str(self.server_address[0])
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def control_url(self) -> str:
        """Where ``/_standin/*`` answers: a plain loopback port under TLS, else the pod's own."""
        return self.control.url if self.control else self.url

    @property
    def requests(self) -> int:
        """How many ``/v1/*`` requests arrived (health checks and ``/_standin`` calls are not counted)."""
        with self._lock:
            return self._requests

    def metrics(self) -> str:
        """``GET /metrics``: the engine's gauges, counters and histograms (the oracle has no engine: zeros)."""
        if self.engine is not None:
            return self.engine.metrics(self.model)
        return prometheus_text(self.model, 0, 0, 0.0, 0, 0, 0, Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS))

    def count_request(self, headers=None, path: str | None = None) -> None:
        with self._lock:
            self._requests += 1
            if headers is not None:
                self.seen_headers = [*self.seen_headers[-15:], {k.lower(): v for k, v in headers.items()}]
            if path is not None:
                self.seen_paths = [*self.seen_paths[-15:], path]

    @property
    def streams(self) -> dict:
        """SSE answers sent to the end (``completed``) and those whose client went away
        first (``cut``): a router that stops reading must not leave the pod generating."""
        with self._lock:
            return dict(self._streams)

    @property
    def redirected(self) -> int:
        """Requests that arrived at the redirect attack's target: a router must send none."""
        with self._lock:
            return self._redirected

    def count_redirected(self) -> None:
        with self._lock:
            self._redirected += 1

    def count_stream(self, outcome: str) -> None:
        with self._lock:
            self._streams[outcome] += 1

    @property
    def fault(self) -> dict:
        with self._lock:
            return dict(self._fault)

    def set_fault(self, mode: str, delay_ms: float = 0, attack: str | None = None, factor: float | None = None) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"fault mode {mode!r} is not one of {', '.join(FAULT_MODES)}")
        if (mode == "slow_tokens") != (factor is not None):
            raise ValueError(f"factor {factor!r}: mode slow_tokens takes a factor >= 1 (the token rate is divided by it), "
                             "other modes none")
        if factor is not None and not (isinstance(factor, (int, float)) and 1 <= factor <= 1000):
            raise ValueError(f"factor must be a number from 1 to 1000 (got {factor!r})")
        delay = float(delay_ms)
        if delay < 0:
            raise ValueError(f"delay_ms must be >= 0 (got {delay_ms!r})")
        if (mode == "hostile") != (attack is not None) or (attack is not None and attack not in ATTACKS):
            raise ValueError(f"attack {attack!r}: mode hostile takes one of {', '.join(ATTACKS)}, other modes none")
        with self._lock:
            self._fault = {"mode": mode, "delay_ms": delay, **({"attack": attack} if attack else {}),
                           **({"factor": float(factor)} if factor is not None else {})}
        if self.engine is not None:
            self.engine.factor = float(factor) if factor is not None else 1.0

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        if self.engine is not None:
            self.engine.start(self.stopping)
        if self.control is not None:
            threading.Thread(target=self.control.serve_forever, kwargs={"poll_interval": poll_interval},
                             name=f"standin-control-{self.control.port}", daemon=True).start()
        super().serve_forever(poll_interval)

    def stop(self) -> None:
        """Wake any hanging request, stop serving and close the socket."""
        self.stopping.set()
        if self.engine is not None:
            self.engine.wake()
        self.shutdown()
        self.server_close()
        if self.control is not None:
            self.control.shutdown()
            self.control.server_close()


class _ControlServer(ThreadingHTTPServer):
    """``/_standin/*`` on plain loopback HTTP, beside a TLS pod port; the pod's state is shared."""

    daemon_threads = True

    def __init__(self, pod: StandinServer):
        self.pod = pod
        super().__init__(("127.0.0.1", 0), _ControlHandler)

    def __getattr__(self, name: str):
        return getattr(self.pod, name)  # fault, stats, counters: the pod's own

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True  # headers and body go out in separate writes: avoid 40 ms delayed-ACK stalls
    protocol_version = "HTTP/1.1"
    server: StandinServer
    server_version = "colocate-standin/1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: tests and the sandbox read stdout/stderr for their own lines

    def parse_request(self) -> bool:
        # Under TLS each caller gets what its certificate's CA opens (podtls.allows: readiness's, /health only).
        if not super().parse_request():
            return False
        if isinstance(self.connection, ssl.SSLSocket) and not podtls.allows(
                self.connection.getpeercert(), self.command, self.path):
            self.close_connection = True  # the refused request's body is never read
            self._error(403, f"this client certificate does not open {self.path.split('?', 1)[0]}: "
                        "the readiness certificate gets GET /health only", "forbidden")
            return False
        return True

    # ---- plumbing -------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-standin", self.server.name)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-standin", self.server.name)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str, type_: str = "invalid_request_error", headers=None) -> None:
        self._send_json(status, {"error": {"message": message, "type": type_, "code": code}}, headers)

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            total = 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                total += size
                if total > MAX_BODY:
                    return None
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return None
        return self.rfile.read(length) if length else b""

    def _loopback_client(self) -> bool:
        try:
            return ipaddress.ip_address(self.client_address[0]).is_loopback
        except ValueError:
            return False

    def _authorised(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    def _apply_fault(self) -> bool:
        """Returns False when the fault already answered (or dropped) the request."""
        fault = self.server.fault
        mode, delay_s = fault["mode"], fault["delay_ms"] / 1000.0
        if mode == "error":
            self._error(500, "stand-in fault injection: error", "standin_fault", "server_error")
            return False
        if mode == "hang":
            self.server.stopping.wait(delay_s if delay_s > 0 else _HANG_CAP_S)
            self.close_connection = True
            return False
        if mode == "slow" and delay_s > 0:
            self.server.stopping.wait(delay_s)
        return True

    def _compute(self, fraction: float = 1.0) -> None:
        if self.server.compute_ms > 0:
            factor = self.server.fault.get("factor", 1.0)  # slow_tokens: the oracle's tokens come F times slower
            self.server.stopping.wait(self.server.compute_ms * fraction * factor / 1000.0)

    # ---- routes ---------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        path = self.path.split("?", 1)[0]
        if path == "/_standin/stats":
            if not self._loopback_client():
                return self._error(403, "stand-in controls are local only", "forbidden")
            return self._send_json(200, {"requests": self.server.requests, "streams": self.server.streams,
                                         "redirected": self.server.redirected, "fault": self.server.fault})
        if path == "/health":
            if self._apply_fault():
                self._send_text(200, "")  # vLLM's: 200, no body
            return
        if path == "/v1/models":
            self.server.count_request()
            if not self._authorised():
                return self._error(401, "Unauthorized", "invalid_api_key")
            if self._apply_fault():
                self._send_json(200, {"object": "list", "data": [
                    {"id": self.server.model, "object": "model", "created": int(time.time()), "owned_by": "colocate"}]})
            return
        if path == "/metrics":
            if self._apply_fault():
                self._send_text(200, self.server.metrics(), "text/plain; version=0.0.4; charset=utf-8")
            return
        if OPEN_ROUTES.get(path) == "GET":
            return self._open_route(path, b"")
        if path in ("/v1/chat/completions", "/v1/completions", "/_standin/fault"):
            return self._error(405, f"{path} takes POST", "method_not_allowed", headers={"Allow": "POST"})
        self._error(404, f"no route {path}", "not_found")

    def _open_route(self, path: str, raw: bytes) -> None:
        """What vLLM's unguarded routes give anyone who reaches the port: here, a model answer on each."""
        if not self._apply_fault():
            return
        self._compute()
        self._send_json(200, {"route": path, "model": self.server.model, "text": "".join(_reply_tokens({}, False, 8)),
                              "note": "vLLM answers this route without --api-key"})

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        raw = self._read_body()
        if raw is None:
            self.close_connection = True
            return self._error(413, f"body larger than {MAX_BODY} bytes", "body_too_large")
        if path == "/_standin/fault":
            return self._post_fault(raw)
        if OPEN_ROUTES.get(path) == "POST":
            return self._open_route(path, raw)
        if path == "/_standin/redirected":
            self.server.count_redirected()
            return self._send_json(200, {"followed": True})
        if path not in ("/v1/chat/completions", "/v1/completions"):
            if path in ("/health", "/v1/models"):
                return self._error(405, f"{path} takes GET", "method_not_allowed", headers={"Allow": "GET"})
            return self._error(404, f"no route {path}", "not_found")
        self.server.count_request(self.headers, self.path)
        if not self._authorised():
            return self._error(401, "Unauthorized", "invalid_api_key")
        chat = path == "/v1/chat/completions"
        try:
            try:
                parsed = json.loads(raw or b"null")
            except ValueError:
                raise Refused("JSON decode error: the request body is not valid JSON") from None
            runner = self.server.engine
            ids: list[int] = []

            def count(out: dict) -> int:
                ids[:] = eng.tokenize(_prompt_text(out, chat))
                return len(ids)

            body = validate(parsed, chat, None if self.server.any_model else self.server.model,
                            *((count, self.server.profile.max_model_len) if runner is not None else ()))
            self.server.seen_bodies = [*self.server.seen_bodies[-15:], parsed]
        except Refused as exc:
            return self._send_json(exc.status, exc.body())
        except RecursionError:
            # vLLM's server parses with json.loads too; a body nested deeper than Python's
            # recursion limit raises there, outside its JSON error handler: Starlette's bare 500.
            return self._send_text(500, "Internal Server Error")
        if not self._apply_fault():
            return
        attack = self.server.fault.get("attack")
        if attack == "redirect":
            return self._send_json(307, {"redirect": True}, {"Location": "/_standin/redirected"})
        if attack == "oversized":
            return self._oversized_stream(chat) if body.get("stream") else self._oversized()
        options = body.get("stream_options")
        model = body.get("model") or self.server.model
        if runner is not None:
            return self._engine_answer(runner, chat, body, model, ids, attack)
        tokens = _reply_tokens(body, chat, (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens") or 8)
        if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
            cap = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
            tokens, _finish = answer_pieces(len(_reply_tokens({}, chat, 9)), "stop", body["response_format"], cap)
        usage = _usage(body, tokens)
        if attack == "usage_inflated":
            usage = {"prompt_tokens": INFLATED, "completion_tokens": INFLATED, "total_tokens": 2 * INFLATED}
        extra = {"Set-Cookie": "session=standin; Path=/", "Access-Control-Allow-Origin": "*"} if attack == "headers" else None
        if body.get("stream"):
            return self._stream(chat, model, tokens, usage if (options or {}).get("include_usage") else None, extra,
                                "length" if body.get("ignore_eos") else "stop")
        self._compute()
        text = "".join(tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        finish = "length" if body.get("ignore_eos") else "stop"
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                  "model": model, "choices": [choice], "usage": usage}
        if attack == "usage_hidden":
            # vLLM's order: prompt_logprobs after usage; the last prompt token decodes to "usage".
            answer["prompt_logprobs"] = [None, {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "hi"}},
                                         {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "usage"}}]
        self._send_json(200, answer, extra)

    def _engine_answer(self, runner: EngineRunner, chat: bool, body: dict, model: str, prompt: list[int],
                       attack: str | None) -> None:
        """The answer as the engine makes it: a stream sends each token as its step ends; a JSON
        answer goes out at the last token."""
        profile = runner.profile
        max_tokens = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
        length, finish = runner.answer_length(max_tokens, body.get("min_tokens") or 0, bool(body.get("ignore_eos")),
                                              room=profile.max_model_len - len(prompt))
        cap = max_tokens if max_tokens is not None else profile.max_model_len - len(prompt)
        pieces, finish = answer_pieces(length, finish, body.get("response_format"), cap)
        pieces, finish = _cut_at_stop(pieces, finish, body.get("stop"), body.get("min_tokens") or 0)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        # The answer's ids as the next turn's prompt will tokenize them (template: the text, then <|im_end|>).
        ticket = runner.submit(prompt, len(pieces), salt, eng.tokenize("".join(pieces))[:len(pieces)])
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(pieces), "total_tokens": len(prompt) + len(pieces)}
        if attack == "usage_inflated":
            usage = {"prompt_tokens": INFLATED, "completion_tokens": INFLATED, "total_tokens": 2 * INFLATED}
        extra = {"Set-Cookie": "session=standin; Path=/", "Access-Control-Allow-Origin": "*"} if attack == "headers" else None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        if body.get("stream"):
            wants_usage = (body.get("stream_options") or {}).get("include_usage")
            return self._stream_tokens(runner, ticket, chat, model, rid, created, pieces, finish,
                                       usage if wants_usage else None, extra)
        if not self._wait_tokens(runner, ticket, len(pieces), lambda _i: None, streamed=False):
            return
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        answer: dict[str, object] = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                     "created": created, "model": model, "choices": [choice], "usage": usage}
        if attack == "usage_hidden":
            answer["prompt_logprobs"] = [None, {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "hi"}},
                                         {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "usage"}}]
        self._send_json(200, answer, extra)

    def _client_gone(self) -> bool:
        """Whether the client closed its connection while its request waits: vLLM's API server
        listens for the disconnect and aborts the request (``with_cancellation``, a streaming
        response's disconnect listener), so a router that gave up at its deadline frees the queue.
        An HTTP/1.1 client sends nothing while it waits for its answer: on a TLS connection any
        byte is its close_notify; on a plain one, the end of the stream."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            if isinstance(self.connection, ssl.SSLSocket):
                return True
            return socket.socket.recv(self.connection, 1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _wait_tokens(self, runner: EngineRunner, ticket: Ticket, n: int, emit, streamed: bool = True) -> bool:
        """Call ``emit(index)`` for each of the ``n`` tokens as the engine makes it; False (the
        request aborted) if the server stops or ``emit`` finds the client gone."""
        got = 0
        while got < n:
            try:
                index, finished = ticket.tokens.get(timeout=0.5)
            except queue.Empty:
                if self.server.stopping.is_set():
                    runner.abort(ticket)
                    self.close_connection = True
                    return False
                if self._client_gone():  # while it waits in the queue or between tokens
                    runner.abort(ticket)
                    self.close_connection = True
                    if streamed:
                        self.server.count_stream("cut")
                    return False
                continue
            got = index + 1
            try:
                emit(index)
            except (BrokenPipeError, ConnectionResetError):
                runner.abort(ticket)  # vLLM aborts a request whose client left: its blocks are freed
                self.close_connection = True
                self.server.count_stream("cut")
                return False
            if finished:
                break
        return True

    def _stream_tokens(self, runner: EngineRunner, ticket: Ticket, chat: bool, model: str, rid: str, created: int,
                       pieces: list[str], finish: str, usage: dict | None, extra: dict | None) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("x-standin", self.server.name)
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
        except (BrokenPipeError, ConnectionResetError):
            runner.abort(ticket)
            self.close_connection = True
            return
        obj = "chat.completion.chunk" if chat else "text_completion"

        def emit(i: int) -> None:
            last = i == len(pieces) - 1
            if chat:
                delta = {"role": "assistant", "content": pieces[i]} if i == 0 else {"content": pieces[i]}
                choice = {"index": 0, "delta": delta, "finish_reason": finish if last else None}
            else:
                choice = {"index": 0, "text": pieces[i], "finish_reason": finish if last else None}
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if usage is not None:
                chunk["usage"] = None
            self._write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())

        if not self._wait_tokens(runner, ticket, len(pieces), emit):
            return
        self._end_stream({"id": rid, "object": obj, "created": created, "model": model}, usage)

    def _oversized(self) -> None:
        """A JSON answer of OVERSIZED_BYTES, chunked (no length to refuse it by), until the client leaves."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-standin", self.server.name)
        self.end_headers()
        piece = b'{"pad":"' + b"x" * (1024 * 1024 - 10) + b'",'
        try:
            for _ in range(OVERSIZED_BYTES // len(piece)):
                self._write_chunk(piece)
            self._write_chunk(b'"end":1}')
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _oversized_stream(self, chat: bool) -> None:
        """Content events of about 1 KiB, 64 KiB of them every 20 ms up to OVERSIZED_BYTES, until the client leaves."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        choice = {"index": 0, "delta": {"content": "x" * 1000}} if chat else {"index": 0, "text": "x" * 1000}
        event = f"data: {json.dumps({'object': 'chat.completion.chunk' if chat else 'text_completion', 'choices': [choice]})}\n\n"
        piece = event.encode() * 64
        try:
            for _ in range(OVERSIZED_BYTES // len(piece)):
                self._write_chunk(piece)
                time.sleep(0.02)
            self._write_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.server.count_stream("cut")
        else:
            self.server.count_stream("completed")
        self.close_connection = True

    def _post_fault(self, raw: bytes) -> None:
        if not self._loopback_client():
            return self._error(403, "stand-in controls are local only", "forbidden")
        try:
            body = json.loads(raw or b"{}")
            self.server.set_fault(body.get("mode", "ok"), body.get("delay_ms", 0) or 0, body.get("attack"), body.get("factor"))
        except (ValueError, TypeError, AttributeError) as exc:
            return self._error(400, f"bad fault request: {exc}", "invalid_fault")
        self._send_json(200, {"fault": self.server.fault})

    def _stream(self, chat: bool, model: str, tokens: list[str], usage: dict | None = None, extra: dict | None = None,
                finish: str = "stop") -> None:
        """SSE; with ``usage`` (the client asked ``include_usage``) every chunk has
        ``"usage": null`` and one more chunk, ``choices: []`` with the usage, precedes [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-standin", self.server.name)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        # Time to first token is most of the compute; the rest is spread over the tokens.
        self._compute(0.5)
        try:
            for i, tok in enumerate(tokens):
                last = i == len(tokens) - 1
                if chat:
                    delta = {"role": "assistant", "content": tok} if i == 0 else {"content": tok}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish if last else None}
                    obj = "chat.completion.chunk"
                else:
                    choice = {"index": 0, "text": tok, "finish_reason": finish if last else None}
                    obj = "text_completion"
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if usage is not None:
                    chunk["usage"] = None
                self._write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                if not last:
                    self._compute(0.5 / max(1, len(tokens) - 1))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self.server.count_stream("cut")
            return
        self._end_stream({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                          "model": model}, usage)

    def _end_stream(self, head: dict, usage: dict | None) -> None:
        """A stream's end: the usage chunk (``choices: []``) when the client asked for it, [DONE],
        the last chunk; counted ``completed``, or ``cut`` when the client has gone."""
        try:
            if usage is not None:
                self._write_chunk(f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode())
            self._write_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self.server.count_stream("cut")
            return
        self.server.count_stream("completed")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class _ControlHandler(_Handler):
    """The control port: ``/_standin/*`` only."""

    def do_GET(self) -> None:  # noqa: N802
        if not self.path.startswith("/_standin/"):
            return self._error(404, "the control port serves /_standin/* only", "not_found")
        super().do_GET()

    def do_POST(self) -> None:  # noqa: N802
        if not self.path.startswith("/_standin/"):
            return self._error(404, "the control port serves /_standin/* only", "not_found")
        super().do_POST()


def _prompt_text(body: dict, chat: bool) -> str:
    """What the engine tokenizes: the chat template's text, or the completion's prompt."""
    if chat:
        return eng.chat_text(body.get("messages") or [])
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(p if isinstance(p, str) else " ".join(map(str, p)) if isinstance(p, list) else str(p)
                        for p in prompt)
    return str(prompt)


# The answer's words: each a token in any 150k-entry BPE (a common word with its leading space).
_WORDS = ("This", " is", " the", " colocate", " stand", "-in", " answering", " from", " loopback", ".", " It",
          " models", " a", " vLLM", " pod", " step", " by", " step", ",", " one", " token", " at", " a", " time")


def answer_pieces(length: int, finish: str, fmt: dict | None = None, cap: int | None = None) -> tuple[list[str], str]:
    """The answer's tokens and finish reason, from its drawn ``length`` (engine.answer_length).
    ``response_format`` json_object or json_schema: a JSON value (an object of one string field of
    about ``length`` tokens, or the schema's required fields) whose last token closes it, as guided
    decoding ends there; ``cap`` (max_tokens) cuts it, and cut JSON it stays, as in vLLM."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("json_object", "json_schema"):
        return [_WORDS[i % len(_WORDS)] for i in range(length)], finish
    spec = (fmt or {}).get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    run_on = finish == "length" and cap is not None and length >= cap  # ignore_eos, or cut by max_tokens
    if schema and (schema.get("type") != "object" or schema.get("required") or schema.get("properties")):
        text = json.dumps(_instance(schema))
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    else:
        head, tail = ['{"', "answer", '":', ' "'], ['"}']
        pieces = [*head, *(_WORDS[i % len(_WORDS)] for i in range(max(0, length - 5))), *tail]
    if run_on and cap is not None and len(pieces) < cap:
        pieces += [" "] * (cap - len(pieces))  # ignore_eos: whitespace after the value, still valid JSON
    if cap is not None and len(pieces) > cap:
        return pieces[:cap], "length"
    return pieces, "length" if run_on else "stop"


def _instance(schema: dict):
    """A small value that satisfies a JSON schema's common keywords."""
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: _instance(props.get(k) or {}) for k in schema.get("required") or props}
    if kind == "array":
        return [_instance(schema.get("items") or {}) for _ in range(schema.get("minItems") or 0)]
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "x" * (schema.get("minLength") or 0) if kind == "string" else ""


def _cut_at_stop(pieces: list[str], finish: str, stop, min_tokens: int) -> tuple[list[str], str]:
    """vLLM's stop strings: looked for in each new token's text (with the tail before it) once
    ``min_tokens`` are made; the answer ends before the stop string, the token holding it counted."""
    stops = [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]
    text = ""
    for i, piece in enumerate(pieces):
        start = len(text)
        text += piece
        if i + 1 < min_tokens:
            continue
        found = [at for s in stops if (at := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if found:
            keep = text[:min(found)]
            cut = [*pieces[:i], ""]
            # The kept text, re-cut along the pieces it spans (the stop string may start in an earlier one).
            out, pos = [], 0
            for p in cut[:-1]:
                out.append(keep[pos:pos + len(p)])
                pos += len(p)
            out.append(keep[pos:])
            return out, "stop"
    return pieces, finish


def _usage(body: dict, tokens: list[str]) -> dict:
    # About four characters a token: enough for limits and usage accounting to have numbers.
    prompt = prompt_tokens(body)
    return {"prompt_tokens": prompt, "completion_tokens": len(tokens), "total_tokens": prompt + len(tokens)}


def _reply_tokens(body: dict, chat: bool, max_tokens: int) -> list[str]:
    """The oracle's answer: nine words, ended early by ``max_tokens``; ``min_tokens`` and
    ``ignore_eos`` (vLLM's) make it longer, the words going round."""
    words = ["This", " is", " the", " colocate", " stand-in", " answering", " from", " loopback", "."]
    n = min(max_tokens, max(len(words), body.get("min_tokens") or 0))
    if body.get("ignore_eos"):
        n = max_tokens
    return [*words, *(_WORDS[i % len(_WORDS)] for i in range(max(0, n - len(words))))][: max(1, n)]


@contextlib.contextmanager
def serve(compute_ms: float = DEFAULT_COMPUTE_MS, token: str | None = None, model: str = DEFAULT_MODEL,
          host: str = "127.0.0.1", port: int = 0, name: str = "standin", any_model: bool = True,
          tls: ssl.SSLContext | None = None, log=None, profile: str | profiles.Profile = "oracle",
          seed: int | None = None) -> Iterator[StandinServer]:
    """Run a stand-in in a background thread for the ``with`` block; the port is closed on exit.
    ``tls``: serve mutual TLS with this context (``podtls.server_context``); ``log``: where its
    lines go (default stderr); ``profile``: a name of ``profiles.PROFILES`` (default ``oracle``:
    every request in ``compute_ms``), ``seed`` the engine's answer lengths."""
    server = StandinServer(host, port, compute_ms=compute_ms, token=token, model=model, name=name, any_model=any_model,
                           tls=tls, log=log, profile=profile, seed=seed)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"standin-{server.port}", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)


def _write_port_file(path: Path, info: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m colocate.pods.standin", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (reported on stdout)")
    p.add_argument("--compute-ms", type=float, default=DEFAULT_COMPUTE_MS, help="time spent per request (default 95)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--name", default="standin", help="echoed in the x-standin response header")
    p.add_argument("--any-model", action="store_true",
                   help="serve any model name, as a gateway would (the sandbox's fallback); by default another "
                        "name is vLLM's 404, as a real pod answers")
    p.add_argument("--profile", default="oracle", choices=sorted(profiles.PROFILES),
                   help="the GPU and model the stand-in behaves as (colocate.pods.profiles; default oracle: "
                        "every request in --compute-ms)")
    p.add_argument("--seed", type=int, help="seed of the answer lengths (default: random)")
    p.add_argument("--port-file", type=Path, help="also write {url, port, pid} here once listening")
    args = p.parse_args(argv)
    if args.compute_ms < 0:
        p.error(f"--compute-ms must be >= 0 (got {args.compute_ms})")
    token = os.environ.get("POD_TOKEN") or None  # never from argv: argv is visible to every user
    try:
        # As vLLM does with its --ssl-* flags: the material comes from the environment (podtls).
        tls = podtls.server_context() if os.environ.get(podtls.ENV) else None
    except podtls.PodTlsError as exc:
        print(f"standin: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        server = StandinServer(args.host, args.port, compute_ms=args.compute_ms, token=token,
                               model=args.model, name=args.name, any_model=args.any_model, tls=tls,
                               profile=args.profile, seed=args.seed)
    except OSError as exc:
        print(f"standin: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    info = {"url": server.url, "port": server.port, "control_url": server.control_url}
    if args.port_file:
        _write_port_file(args.port_file, {**info, "pid": os.getpid()})
    print(json.dumps(info), flush=True)
    try:
        while not stop.wait(0.2):
            pass
    finally:
        server.stop()
        thread.join(timeout=10)
        if args.port_file:
            with contextlib.suppress(FileNotFoundError):
                args.port_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
