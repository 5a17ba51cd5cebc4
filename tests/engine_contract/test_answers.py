"""Non-streamed answers, field by field, as vLLM 0.32 writes them; the context: vLLM cuts
max_tokens to what fits beside the prompt (200), and refuses only a limit past the context or a
prompt that fills it (400, naming the parameter).

The keys below are vLLM's (vllm/entrypoints/openai/chat_completion/protocol.py
ChatCompletionResponse, completion/protocol.py CompletionResponse), written out here rather than
read from colocate.pods.shapes, so the stand-in's side cannot agree with itself: the same test
against a live vLLM (COLOCATE_ENGINE=vllm) is what shows they are vLLM's.
"""

from __future__ import annotations

import re

CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage", "prompt_logprobs",
             "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"]
TEXT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage", "kv_transfer_params",
             "ec_transfer_params", "metrics"]
CHAT_CHOICE = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
TEXT_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids",
               "routed_experts"]
MESSAGE = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details"]
FINGERPRINT = re.compile(r"vllm-\d+\.\d+\.\d+-[0-9a-f]{8}")
HELLO = [{"role": "user", "content": "Say hello."}]


def chat(engine, **extra) -> dict:
    return {"model": engine.model, "messages": HELLO, **extra}


def test_a_chat_answer_is_vllms_key_for_key(engine):
    status, a = engine.post("/v1/chat/completions", chat(engine, max_tokens=3, ignore_eos=True))
    assert status == 200, a
    assert list(a) == CHAT_KEYS
    assert a["id"].startswith("chatcmpl-") and a["object"] == "chat.completion" and a["model"] == engine.model
    assert isinstance(a["created"], int) and FINGERPRINT.fullmatch(a["system_fingerprint"])
    assert all(a[k] is None for k in ("service_tier", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                                      "ec_transfer_params", "metrics"))
    [c] = a["choices"]
    assert list(c) == CHAT_CHOICE and c["index"] == 0
    assert c["finish_reason"] == "length"
    assert all(c[k] is None for k in ("logprobs", "stop_reason", "token_ids", "routed_experts"))
    m = c["message"]
    assert list(m) == MESSAGE  # no tool_calls key when there are none; reasoning null without a reasoning parser
    assert m["role"] == "assistant" and isinstance(m["content"], str)
    assert all(m[k] is None for k in ("refusal", "annotations", "audio", "function_call", "reasoning"))
    u = a["usage"]
    assert list(u) == USAGE and u["completion_tokens"] == 3 and u["total_tokens"] == u["prompt_tokens"] + 3
    assert u["prompt_tokens_details"] is None and u["completion_tokens_details"] is None


def test_a_completion_answer_is_vllms_key_for_key(engine):
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": "Once upon", "max_tokens": 2,
                                                "ignore_eos": True})
    assert status == 200, a
    assert list(a) == TEXT_KEYS
    assert a["id"].startswith("cmpl-") and a["object"] == "text_completion" and FINGERPRINT.fullmatch(a["system_fingerprint"])
    [c] = a["choices"]
    assert list(c) == TEXT_CHOICE and isinstance(c["text"], str) and c["finish_reason"] == "length"
    assert all(c[k] is None for k in ("logprobs", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids",
                                      "routed_experts"))
    assert list(a["usage"]) == USAGE and a["usage"]["completion_tokens"] == 2


def test_n_choices_and_a_prompt_list_are_indexed_as_vllm_indexes_them(engine):
    status, a = engine.post("/v1/chat/completions", chat(engine, max_tokens=2, n=2, ignore_eos=True, seed=3, temperature=0.7))
    assert status == 200, a
    assert [c["index"] for c in a["choices"]] == [0, 1] and a["usage"]["completion_tokens"] == 4
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": ["One,", "Two,"], "n": 2, "max_tokens": 2,
                                                "ignore_eos": True})
    assert status == 200, a
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3] and a["usage"]["completion_tokens"] == 8  # prompt * n + j


def test_logprobs_are_vllms_shape(engine):
    status, a = engine.post("/v1/chat/completions", chat(engine, max_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=2))
    assert status == 200, a
    content = a["choices"][0]["logprobs"]["content"]
    assert list(a["choices"][0]["logprobs"]) == ["content"] and len(content) == 2
    for t in content:
        assert list(t) == ["token", "logprob", "bytes", "top_logprobs"] and t["bytes"] == list(t["token"].encode())
        assert len(t["top_logprobs"]) == 2 and all(list(x) == ["token", "logprob", "bytes"] for x in t["top_logprobs"])
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": "Once upon", "max_tokens": 2, "ignore_eos": True,
                                                "logprobs": 2})
    assert status == 200, a
    lp = a["choices"][0]["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert all(len(lp[k]) == 2 for k in lp) and lp["text_offset"][1] == lp["text_offset"][0] + len(lp["tokens"][0])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])


def test_max_tokens_past_what_fits_is_cut_to_fit_not_refused(engine):
    # vLLM answers 200 and stops at the context: max_tokens up to the context is a limit, not a promise.
    ctx = engine.max_model_len
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": [5] * (ctx - 6), "max_tokens": ctx,
                                                "ignore_eos": True})
    assert status == 200, a
    assert a["usage"]["prompt_tokens"] == ctx - 6 and a["usage"]["completion_tokens"] == 6
    assert a["choices"][0]["finish_reason"] == "length"
    # A chat prompt near the context: what is left is made. Its length in tokens is the engine's
    # tokenizer's (Qwen's in the stand-in, the tiny model's own in vLLM), so it is measured first.
    def prompt_tokens(n: int) -> int:
        status, a = engine.post("/v1/chat/completions", chat(engine, messages=[{"role": "user", "content": "hi " * n}],
                                                             max_tokens=1))
        assert status == 200, a
        return a["usage"]["prompt_tokens"]

    short, longer = prompt_tokens(100), prompt_tokens(1100)
    per = (longer - short) / 1000
    n = int((ctx - 40 - (short - 100 * per)) / per)  # about 40 tokens short of the context
    status, a = engine.post("/v1/chat/completions", chat(engine, messages=[{"role": "user", "content": "hi " * n}],
                                                         max_tokens=ctx, ignore_eos=True))
    assert status == 200, a
    assert ctx - 60 < a["usage"]["prompt_tokens"] < ctx, (a["usage"], per)
    assert a["usage"]["total_tokens"] == ctx and a["choices"][0]["finish_reason"] == "length"


def test_only_a_limit_past_the_context_or_a_prompt_that_fills_it_is_refused(engine):
    ctx = engine.max_model_len
    status, a = engine.post("/v1/chat/completions", chat(engine, max_tokens=ctx + 1))
    assert (status, a) == (400, {"error": {
        "message": f"max_tokens={ctx + 1} cannot be greater than max_model_len={ctx}. Please request fewer output tokens. "
                   f"(parameter=max_tokens, value={ctx + 1})", "type": "BadRequestError", "param": "max_tokens", "code": 400}})
    status, a = engine.post("/v1/chat/completions", chat(engine, max_completion_tokens=ctx + 5))
    assert status == 400 and a["error"]["param"] == "max_completion_tokens"
    # A text past the context: the tokenizer stops one token past it, so "at least" that many.
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": "hi " * (3 * ctx), "max_tokens": 1})
    assert (status, a) == (400, {"error": {
        "message": f"This model's maximum context length is {ctx} tokens. However, your prompt contains at least {ctx + 1} input "
                   "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
                   f"prompt. (parameter=input_tokens, value={ctx + 1})", "type": "BadRequestError", "param": "input_tokens",
        "code": 400}})
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": [5] * (ctx + 50), "max_tokens": 1})
    assert status == 400 and f"your prompt contains {ctx + 50} input tokens" in a["error"]["message"]
    # A prompt of exactly the context leaves no room: the limit it is cut to is 0.
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": [5] * ctx})
    assert (status, a) == (400, {"error": {"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                                           "type": "BadRequestError", "param": "max_tokens", "code": 400}})


def test_a_stop_string_ends_the_answer_with_its_stop_reason(engine):
    # The oracle's answer is known ("This is the colocate stand-in ..."); vLLM's random one is not:
    # stop at a character the answer has, as it made it.
    status, a = engine.post("/v1/completions", {"model": engine.model, "prompt": "Once upon", "max_tokens": 8, "ignore_eos": True,
                                                "temperature": 0})
    assert status == 200, a
    text = a["choices"][0]["text"]
    stop = next(ch for ch in text[1:] if not ch.isspace())
    status, b = engine.post("/v1/completions", {"model": engine.model, "prompt": "Once upon", "max_tokens": 8, "ignore_eos": True,
                                                "temperature": 0, "stop": [stop]})
    assert status == 200, b
    c = b["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop) and stop not in c["text"][1:]
