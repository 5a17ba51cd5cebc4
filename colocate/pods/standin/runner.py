"""A GPU profile's engine (colocate/pods/engine.py, vLLM's scheduler modelled) stepped in real time
by a thread of its own: each request's sequences get a ``Ticket``, whose queue receives each token
as its step ends."""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid

from .. import engine as eng, profiles, vllm_metrics


class Ticket:
    """A sequence in the engine, as its handler sees it: each token's (choice, index, finished) as
    its step ends, put on ``tokens`` (shared by the sequences of one request: its n choices)."""

    def __init__(self, rid: str, sink: queue.Queue | None = None, choice: int = 0):
        self.id = rid
        self.choice = choice
        self.tokens: queue.Queue[tuple[int, int, bool]] = sink if sink is not None else queue.Queue()


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
        self._prompts: dict[str, int] = {}  # request id -> its prompt's tokens
        # vLLM's vllm:prompt_tokens and vllm:generation_tokens counters: a prompt counted when its
        # prefill is done (its first token made), every token made, an aborted request's included
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = vllm_metrics.Histogram(vllm_metrics.TTFT_BUCKETS)
        self.itl = vllm_metrics.Histogram(vllm_metrics.ITL_BUCKETS)
        self._stopping = threading.Event()

    def start(self, stopping: threading.Event) -> None:
        self._stopping = stopping
        threading.Thread(target=self._run, name="standin-engine", daemon=True).start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def submit(self, prompt: list[int], length: int, salt: str | None, output_ids: list[int] | None = None,
               sink: queue.Queue | None = None, choice: int = 0) -> Ticket:
        ticket = Ticket(uuid.uuid4().hex, sink, choice)
        with self._cond:
            now = time.monotonic()
            # Past the API server's queue first (Frontend), then into the engine's waiting queue.
            due = now + self.engine.frontend.delay_s(now) * self.factor
            self._pending.append((due, eng.Request(ticket.id, prompt, length, salt=salt, output_ids=output_ids or [])))
            self._tickets[ticket.id] = ticket
            self._arrived[ticket.id] = now
            self._prompts[ticket.id] = len(prompt)
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
        self._prompts.pop(rid, None)

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
                    self.generation_tokens += 1
                    if index == 0:
                        self.prompt_tokens += self._prompts.get(rid, 0)
                        self.ttft.observe(now - self._arrived.get(rid, now))
                    else:
                        self.itl.observe(now - self._last.get(rid, now))
                    self._last[rid] = now
                    ticket.tokens.put((ticket.choice, index, finished))
                    if finished:
                        self._forget(rid)

    def metrics(self) -> dict:
        """The engine's part of ``/metrics`` (vllm_metrics.exposition's values)."""
        with self._cond:
            e = self.engine
            return {"vllm:num_requests_running": len(e.running), "vllm:num_requests_waiting": len(e.waiting),
                    "vllm:num_requests_waiting_by_reason": {"capacity": len(e.waiting)}, "vllm:kv_cache_usage_perc": e.kv.usage,
                    "vllm:prefix_cache_queries": e.kv.queries, "vllm:prefix_cache_hits": e.kv.hits,
                    "vllm:prompt_tokens_cached": e.kv.hits, "vllm:prompt_tokens_cached_by_source": {"device": e.kv.hits},
                    "vllm:num_preemptions": e.preemptions, "vllm:time_to_first_token_seconds": self.ttft,
                    "vllm:inter_token_latency_seconds": self.itl, "vllm:prompt_tokens": self.prompt_tokens,
                    "vllm:generation_tokens": self.generation_tokens}
