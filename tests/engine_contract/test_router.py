"""The router in front of the engine: what a client gets is what the engine itself writes.

A client that asks for no stream is served from the pod's stream and gets an answer assembled
from it (worker/src/assemble.js), or, for an answer of at most 16 tokens, the pod's own answer
(router.js WHOLE_MAX_TOKENS): either way the engine's non-streamed answer to the same request,
key for key and in its order (ids and times aside). The edge refuses a limit past the context
(400 naming it) and lets through what the engine cuts to fit.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from colocate.pods import standin
from colocate.workerd import Workerd, render_config
from tests.support.workerd import FALLBACK_MODEL_NAME, SECRETS, auth, cell_plan, request, values_for

HELLO = [{"role": "user", "content": "Say hello."}]


@contextlib.contextmanager
def router_before(engine) -> Iterator[tuple[str, str]]:
    """workerd running the sandbox plan with the engine as its one pod: (router URL, a client key)."""
    # A CPU engine under load may take seconds to its first token: the deadline is not what is checked here.
    plan = cell_plan({"deadlineMs": 60_000})
    with standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME, name="fallback") as fb, \
            Workerd() as w:
        values = {**values_for(engine.url, fb.url), "POD_TOKEN": engine.token}
        w.start(render_config(plan.worker, values, port=w.port, storage_dir=w.directory / "objects", pod_tls=engine.hop))
        res = request(w.url, "POST", "/_colocate/keys", body={"name": "contract", "rpm": 0, "tpm": 0, "monthly_tokens": 0,
                                                              "max_parallel": 0}, headers=auth())
        assert res.status == 201, res.body
        yield w.url, res.json()["key"]


@pytest.fixture(scope="module")
def router(engine):
    with router_before(engine) as r:
        yield r


def routed(router, path: str, body: dict):
    url, key = router
    res = request(url, "POST", path, body=body, headers={"authorization": f"Bearer {key}"}, timeout=120)
    return res.status, res.headers, res.body


def chat(engine, **extra) -> dict:
    return {"model": engine.model, "messages": HELLO, "temperature": 0, "ignore_eos": True, **extra}


def text(engine, **extra) -> dict:
    return {"model": engine.model, "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True, **extra}


# Greedy or seeded, and ignore_eos: the engine makes the same tokens for the same request.
CASES = {
    "chat-long": ("/v1/chat/completions", lambda e: chat(e, max_tokens=24)),  # assembled from the pod's stream
    "chat-short": ("/v1/chat/completions", lambda e: chat(e, max_tokens=8)),  # the pod's own answer (at most 16 tokens)
    "chat-n2": ("/v1/chat/completions", lambda e: chat(e, max_tokens=12, n=2, temperature=0.7, seed=11)),
    "chat-logprobs": ("/v1/chat/completions", lambda e: chat(e, max_tokens=20, logprobs=True, top_logprobs=2)),
    "text-long": ("/v1/completions", lambda e: text(e, max_tokens=20)),
    "text-list-n2": ("/v1/completions", lambda e: text(e, prompt=["One,", "Two,"], n=2, max_tokens=5, temperature=0.7, seed=11)),
    "text-logprobs": ("/v1/completions", lambda e: text(e, max_tokens=20, logprobs=2)),
    "text-echo": ("/v1/completions", lambda e: text(e, max_tokens=20, echo=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_non_streamed_answer_through_the_router_is_the_engines_own(engine, router, case):
    path, make = CASES[case]
    body = make(engine)
    status, own = engine.post(path, body)
    assert status == 200, own
    status, headers, raw = routed(router, path, body)
    assert status == 200, raw[:500]
    assert headers["content-type"] == "application/json" and headers["x-colocate-backend"] == "pod-0"
    got = json.loads(raw)
    assert list(got) == list(own)  # the keys, in the engine's order
    assert got == {**own, "id": got["id"], "created": got["created"]}
    assert got["id"].startswith(own["id"].split("-")[0] + "-")


def test_a_limit_the_engine_cuts_to_fit_is_served_and_one_past_the_context_refused_at_the_edge(engine, router):
    ctx = engine.max_model_len
    body = text(engine, prompt=[5] * (ctx - 6), max_tokens=ctx)
    status, _headers, raw = routed(router, "/v1/completions", body)
    assert status == 200, raw[:500]
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["finish_reason"] == "length"
    status, _headers, raw = routed(router, "/v1/chat/completions", chat(engine, max_tokens=ctx + 1))
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "max_tokens" and str(ctx + 1) in error["message"]


def test_a_prompt_the_engine_refuses_comes_back_as_the_engine_wrote_it(engine, router):
    body = text(engine, prompt="hi " * (3 * engine.max_model_len), max_tokens=1)
    status, own = engine.post("/v1/completions", body)
    status2, headers, raw = routed(router, "/v1/completions", body)
    assert (status2, json.loads(raw)) == (status, own) == (400, own)
    assert own["error"]["param"] == "input_tokens" and headers["x-colocate-backend"] == "pod-0"
