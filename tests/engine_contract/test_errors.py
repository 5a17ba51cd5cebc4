"""Refusals, body for body, as vLLM 0.32 answers them: its --api-key middleware's 401, the 404 of
a model it does not serve, pydantic's 400 "Bad Request" (the error as Python prints it, `param`
its location), and the 400 "BadRequestError" of its own checks (`param` where it names one)."""

from __future__ import annotations

import json

import pytest

HI = [{"role": "user", "content": "hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def bad_request(message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def pydantic(errors: list[dict], param: str) -> dict:
    lines = "".join(f"  {e}\n" for e in errors).rstrip()
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n{lines}"
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


def err(kind: str, loc: str, msg: str, value: str, **ctx) -> dict:
    return {"type": kind, "loc": loc, "msg": msg, "input": value, **({"ctx": ctx} if ctx else {})}


MESSAGE_TYPES = ("ChatCompletionDeveloperMessageParam", "ChatCompletionSystemMessageParam", "ChatCompletionUserMessageParam",
                 "ChatCompletionAssistantMessageParam", "ChatCompletionToolMessageParam", "ChatCompletionFunctionMessageParam",
                 "CustomChatCompletionMessageParam")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NOT_A_DICT = "Input should be a valid dictionary or object to extract fields from"

# (path, body: a dict with the model added, or raw bytes, expected answer)
REFUSED = [
    (CHAT, {}, pydantic([err("missing", "body.messages", "Field required", "<dict of 1 items>")], "body.messages")),
    (CHAT, {"messages": "hi"}, pydantic([err("list_type", "body.messages", "Input should be a valid list", "hi")],
                                        "body.messages")),
    (CHAT, {"messages": ["hi"]}, pydantic(
        [*(err("dict_type", f"body.messages.0.{t}", "Input should be a valid dictionary", "hi") for t in MESSAGE_TYPES),
         err("model_attributes_type", "body.messages.0.Message", NOT_A_DICT, "hi")],
        f"body.messages.0.{MESSAGE_TYPES[0]}")),
    (CHAT, {"messages": HI, "model": 7}, pydantic([err("string_type", "body.model", "Input should be a valid string", "7")],
                                                  "body.model")),
    (CHAT, {"messages": HI, "max_tokens": "lots"}, pydantic([err(
        "int_parsing", "body.max_tokens", "Input should be a valid integer, unable to parse string as an integer", "lots")],
        "body.max_tokens")),
    (CHAT, b', "max_tokens": 1e309', pydantic([err("finite_number", "body.max_tokens", "Input should be a finite number", "inf")],
                                               "body.max_tokens")),
    (CHAT, {"messages": HI, "temperature": "hot"}, pydantic([err(
        "float_parsing", "body.temperature", "Input should be a valid number, unable to parse string as a number", "hot")],
        "body.temperature")),
    (CHAT, {"messages": HI, "stream": "maybe"}, pydantic([err(
        "bool_parsing", "body.stream", "Input should be a valid boolean, unable to interpret input", "maybe")], "body.stream")),
    (CHAT, {"messages": HI, "stream": [True]}, pydantic([err("bool_type", "body.stream", "Input should be a valid boolean",
                                                             "<list of 1 items>")], "body.stream")),
    (CHAT, {"messages": HI, "stream": True, "stream_options": "yes"}, pydantic(
        [err("model_attributes_type", "body.stream_options", NOT_A_DICT, "yes")], "body.stream_options")),
    (CHAT, {"messages": HI, "stop": 5}, pydantic([err("string_type", "body.stop", "Input should be a valid string", "5"),
                                                  err("list_type", "body.stop", "Input should be a valid list", "5")],
                                                 "body.stop")),
    (CHAT, b"[1]", pydantic([err("model_attributes_type", "body", NOT_A_DICT, "<list of 1 items>")], "body")),
    (CHAT, b"not json", pydantic([err("json_invalid", "body.0", "JSON decode error", "<dict of 0 items>",
                                      error="Expecting value")], "body.0")),
    (CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, bad_request(
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options")),
    (CHAT, {"messages": HI, "max_tokens": -1}, bad_request(
        "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)", "max_tokens")),
    (CHAT, {"messages": HI, "max_tokens": 2, "max_completion_tokens": -5}, bad_request(
        "max_tokens must be at least 1, got -5. (parameter=max_tokens, value=-5)", "max_tokens")),
    (CHAT, {"messages": HI, "n": 0}, bad_request("n must be at least 1, got 0.")),
    (CHAT, {"messages": HI, "n": 1000000}, bad_request(
        "n must be at most 16384, got 1000000. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.")),
    (CHAT, {"messages": HI, "temperature": -0.5}, bad_request(
        "temperature must be non-negative, got -0.5. (parameter=temperature, value=-0.5)", "temperature")),
    (CHAT, {"messages": HI, "temperature": 2.5}, bad_request(
        "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)", "temperature")),
    (CHAT, {"messages": HI, "top_p": 0}, bad_request("top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p")),
    (CHAT, {"messages": HI, "presence_penalty": 3}, bad_request("presence_penalty must be in [-2, 2], got 3.0.")),
    (CHAT, {"messages": HI, "max_tokens": 2, "min_tokens": 5}, bad_request(
        "min_tokens must be less than or equal to max_tokens=2, got 5.")),
    (CHAT, {"messages": HI, "min_tokens": -1}, bad_request("min_tokens must be greater than or equal to 0, got -1.")),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 30}, bad_request(
        "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)", "logprobs")),
    (CHAT, {"messages": []}, bad_request("Cannot apply chat template to an empty conversation. Provide at least one message.")),
    # The kit's pods run no tool parser (PodSpec.vllm_args): tools are refused unless tool_choice is "none".
    (CHAT, {"messages": HI, "tools": [TOOL]}, bad_request(
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')),
    (CHAT, {"messages": HI, "tools": [TOOL], "tool_choice": "required"}, bad_request(
        'tool_choice="required" requires --tool-call-parser to be set')),
    (CHAT, {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     bad_request('tool_choice=function "get_weather" requires --tool-call-parser to be set')),
    (CHAT, {"messages": HI, "tool_choice": "required"}, bad_request(
        "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice")),
    (CHAT, {"messages": HI, "tools": []}, bad_request(
        "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. (parameter=tools)",
        "tools")),
    (TEXT, {}, bad_request("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt")),
    (TEXT, {"prompt": ""}, bad_request("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                                       "prompt")),
    (TEXT, {"prompt": []}, bad_request("You must pass at least one prompt")),
    (TEXT, {"prompt": {"a": 1}}, pydantic(
        [err("list_type", "body.prompt", "Input should be a valid list", "<dict of 1 items>")] * 2
        + [err("string_type", "body.prompt", "Input should be a valid string", "<dict of 1 items>"),
           err("list_type", "body.prompt", "Input should be a valid list", "<dict of 1 items>")], "body.prompt")),
    (TEXT, {"prompt": "x", "logprobs": 30}, bad_request(
        "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)", "logprobs")),
]


def body_of(engine, body):
    if body in (b"[1]", b"not json"):
        return body
    if isinstance(body, bytes):  # JSON Python will not write (1e309): spliced into a valid body
        return json.dumps({"model": engine.model, "messages": HI})[:-1].encode() + body + b"}"
    return {"model": engine.model, **body}


@pytest.mark.parametrize("path, body, expected", REFUSED,
                         ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, _b, _e) in enumerate(REFUSED)])
def test_refusals_are_vllms_body_for_body(engine, path, body, expected):
    status, answer = engine.post(path, body_of(engine, body))
    assert (status, answer) == (400, expected)


def test_a_model_it_does_not_serve_is_404(engine):
    status, answer = engine.post(CHAT, {"model": "other/model", "messages": HI, "max_tokens": 1})
    message = f"The model `other/model` does not exist. Valid aliases: {engine.model}."
    assert (status, answer) == (404, {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}})


def test_no_model_means_the_served_one(engine):
    status, answer = engine.post(CHAT, {"messages": HI, "max_tokens": 1})
    assert status == 200 and answer["model"] == engine.model


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_a_wrong_or_missing_token_is_401_with_vllms_body(engine, token):
    for method, path, body in (("GET", "/v1/models", None), ("POST", CHAT, {"model": engine.model, "messages": HI})):
        status, headers, raw = engine.request(method, path, body, token=token)
        assert (status, json.loads(raw)) == (401, {"error": "Unauthorized"})
        assert headers["content-type"] == "application/json"
