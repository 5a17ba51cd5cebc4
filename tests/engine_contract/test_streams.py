"""Streamed answers, event by event, as vLLM 0.32 streams them (its serving.py generators write
each event with exclude_unset, the last usage event with exclude_none): chat opens each choice
with its role and empty content; no event carries ``"usage": null``; the finish comes with the
last token, ``system_fingerprint`` with the last event; ``include_usage`` adds one usage event,
``continuous_usage_stats`` a usage on every event. An event carries the tokens made since the last
one: one a step, or several when the server falls behind its engine (a loaded vLLM does), so the
tests count tokens, not events."""

from __future__ import annotations

HELLO = [{"role": "user", "content": "Say hello."}]
HEAD = ["id", "object", "created", "model", "choices"]


def chat(engine, **extra) -> dict:
    return {"model": engine.model, "messages": HELLO, "stream": True, "ignore_eos": True, **extra}


def opening(e: dict, index: int = 0) -> bool:
    role = {"role": "assistant", "content": ""}
    return e["choices"] == [{"index": index, "delta": role, "logprobs": None, "finish_reason": None}]


def test_a_chat_stream_opens_with_the_role_alone_and_carries_no_usage(engine):
    events = engine.events("/v1/chat/completions", chat(engine, max_tokens=3))
    first, *tokens = events
    assert list(first) == [*HEAD, "prompt_token_ids", "prompt_text"] and opening(first)
    assert first["prompt_token_ids"] is None and first["prompt_text"] is None
    assert first["id"].startswith("chatcmpl-") and first["object"] == "chat.completion.chunk" and first["model"] == engine.model
    assert 1 <= len(tokens) <= 3 and all(e["id"] == first["id"] and e["created"] == first["created"] for e in tokens)
    for e in tokens[:-1]:
        assert list(e) == HEAD
        [c] = e["choices"]
        assert list(c) == ["index", "delta", "logprobs", "finish_reason", "token_ids"] and list(c["delta"]) == ["content"]
        assert (c["index"], c["logprobs"], c["finish_reason"], c["token_ids"]) == (0, None, None, None)
    last = tokens[-1]
    assert list(last) == [*HEAD, "system_fingerprint"]  # the fingerprint on the last event when no usage event follows
    [c] = last["choices"]
    assert list(c) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None) and list(c["delta"]) == ["content"]
    assert not any("usage" in e for e in events)


def test_include_usage_adds_one_usage_event_and_nothing_to_the_others(engine):
    events = engine.events("/v1/chat/completions", chat(engine, max_tokens=2, stream_options={"include_usage": True}))
    *answer, usage = events
    assert not any("usage" in e or "system_fingerprint" in e for e in answer)
    assert list(usage) == [*HEAD, "usage", "system_fingerprint"] and usage["choices"] == []
    u = usage["usage"]
    assert list(u) == ["prompt_tokens", "total_tokens", "completion_tokens"]  # exclude_none: no null details
    assert u["completion_tokens"] == 2 and u["total_tokens"] == u["prompt_tokens"] + 2


def test_continuous_usage_stats_put_a_usage_on_every_event(engine):
    events = engine.events("/v1/chat/completions", chat(engine, max_tokens=2, n=2, seed=5, temperature=0.7,
                                                        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert opening(events[0], 0) and opening(events[1], 1)
    *answer, last = events
    prompt = last["usage"]["prompt_tokens"]
    made = {0: 0, 1: 0}
    for e in answer:
        [c] = e["choices"]
        u = e["usage"]
        assert list(u) == ["prompt_tokens", "total_tokens", "completion_tokens", "completion_tokens_details"]
        assert u["completion_tokens_details"] is None and u["prompt_tokens"] == prompt
        assert u["total_tokens"] == prompt + u["completion_tokens"]
        # the choice's own tokens so far: 0 on its opening, then more with each of its events
        assert u["completion_tokens"] == 0 if "role" in c["delta"] else u["completion_tokens"] > made[c["index"]]
        made[c["index"]] = u["completion_tokens"]
    assert made == {0: 2, 1: 2} and last["usage"]["completion_tokens"] == 4
    assert [c["finish_reason"] for e in answer for c in e["choices"] if c["finish_reason"]] == ["length", "length"]


def test_n_choices_stream_each_from_its_role_to_its_finish(engine):
    events = engine.events("/v1/chat/completions", chat(engine, max_tokens=3, n=2, seed=5, temperature=0.7))
    assert opening(events[0], 0) and opening(events[1], 1)
    per = {0: [], 1: []}
    for e in events[2:]:
        [c] = e["choices"]
        per[c["index"]].append(c)
    for cs in per.values():
        assert 1 <= len(cs) <= 3 and [c["finish_reason"] for c in cs] == [None] * (len(cs) - 1) + ["length"]
    assert sum("system_fingerprint" in e for e in events) == 2  # each choice's last event


def test_a_completion_stream_is_vllms_shape(engine):
    body = {"model": engine.model, "prompt": "Once upon", "max_tokens": 2, "ignore_eos": True, "stream": True}
    events = engine.events("/v1/completions", body)
    assert 1 <= len(events) <= 2
    for e in events:
        assert list(e)[:5] == HEAD and e["object"] == "text_completion" and e["id"].startswith("cmpl-")
        [c] = e["choices"]
        assert list(c) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"]
    assert list(events[-1]) == [*HEAD, "system_fingerprint"] and events[-1]["choices"][0]["finish_reason"] == "length"
    events = engine.events("/v1/completions", {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *answer, last = events
    prompt = last["usage"]["prompt_tokens"]
    made = [e["usage"]["completion_tokens"] for e in answer]
    assert made == sorted(set(made)) and made[-1] == 2 and made[0] >= 1
    assert [e["usage"] for e in answer] == [{"prompt_tokens": prompt, "total_tokens": prompt + k, "completion_tokens": k}
                                             for k in made]  # no completion_tokens_details here
    assert list(last) == [*HEAD, "usage", "system_fingerprint"] and last["choices"] == []
