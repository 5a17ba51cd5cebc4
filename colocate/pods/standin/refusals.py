"""What vLLM refuses of a request, in its order and with its bodies: ``validate`` turns a request's
body into what the stand-in serves or raises ``Refused`` (vLLM's error answer); pydantic's lax
mode is followed (``stream: "yes"``). Also ``prompt_tokens``, the stand-in's count of a prompt."""

from __future__ import annotations

import json
import math

from .. import shapes
from ..errors import PodError

# vLLM's OpenAI server (0.32, colocate.pods.shapes) takes a body in stages, and the stand-in in
# the same order: pydantic parses it (a wrong type, a missing field, bad JSON: 400 "Bad Request"
# with pydantic's error as Python prints it, `param` its location); the request's own validators;
# the model (404 "NotFoundError" for a name it does not serve; a missing model means the served
# one); the renderer (tools without a parser, an empty prompt, a limit past the context, a
# prompt that does not fit); then the sampling parameters (SamplingParams._verify_args). Those
# after parsing are 400 "BadRequestError", `param` set where vLLM names one.
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: a bigger n is refused
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_MODEL_LEN = 8192  # the kit's pods run with --max-model-len 8192 (PodSpec.vllm_args)
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")  # vLLM's ResponseFormat types
_TRUE = {"1", "on", "t", "true", "y", "yes"}  # pydantic's lax bool strings (stream: "yes" is True)
_FALSE = {"0", "off", "f", "false", "n", "no"}
# What pydantic reports for a chat message that is not an object: one error per message type it tried.
_MESSAGE_TYPES = ("ChatCompletionDeveloperMessageParam", "ChatCompletionSystemMessageParam", "ChatCompletionUserMessageParam",
                  "ChatCompletionAssistantMessageParam", "ChatCompletionToolMessageParam",
                  "ChatCompletionFunctionMessageParam", "CustomChatCompletionMessageParam")


class Refused(PodError):
    """A request vLLM would refuse, with the body vLLM answers (``shapes.error``) and its status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, type_: str = "BadRequestError",
                 payload: dict | None = None):
        super().__init__(message)
        self.status = status
        self.payload = payload or shapes.error(message, type_, param, status)

    def body(self) -> dict:
        return self.payload


def pydantic_error(kind: str, loc: str, msg: str, value, ctx: dict | None = None) -> Refused:
    payload = shapes.validation_error(kind, loc, msg, value, ctx)
    return Refused(payload["error"]["message"], payload=payload)


def _pydantic_all(errors: list[tuple[str, str, str, object]]) -> Refused:
    """Several errors for one field (a union pydantic tried branch by branch), as vLLM lists them."""
    lines = "".join(f"  { {'type': k, 'loc': loc, 'msg': m, 'input': shapes.summarized(v)} }\n" for k, loc, m, v in errors)
    message = f"{len(errors)} validation errors:\n{lines}".rstrip()
    return Refused(message, payload=shapes.error(message, "Bad Request", errors[0][1], 400))


def _as_int(body: dict, field: str) -> int | None:
    value = body.get(field)
    loc = f"body.{field}"
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise pydantic_error("finite_number", loc, "Input should be a finite number", value)
        if value.is_integer():
            return int(value)
        raise pydantic_error("int_from_float", loc, "Input should be a valid integer, got a number with a fractional part", value)
    if isinstance(value, str):
        if value.strip().lstrip("+-").isdigit():
            return int(value.strip())
        raise pydantic_error("int_parsing", loc, "Input should be a valid integer, unable to parse string as an integer", value)
    raise pydantic_error("int_type", loc, "Input should be a valid integer", value)


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
            raise pydantic_error("float_parsing", f"body.{field}",
                                 "Input should be a valid number, unable to parse string as a number", value) from None
    raise pydantic_error("float_type", f"body.{field}", "Input should be a valid number", value)


def _as_bool(body: dict, field: str, loc: str | None = None) -> bool | None:
    value = body.get(field)
    loc = loc or f"body.{field}"
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, (str, int)):
        raise pydantic_error("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value)
    raise pydantic_error("bool_type", loc, "Input should be a valid boolean", value)


def prompt_list(body: dict, chat: bool) -> list:
    """A completion's prompts (a string, strings, or token ids: each one prompt); chat: its messages, one prompt."""
    if chat:
        return [body.get("messages")]
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        return list(p)
    return [p]


def validate(body, chat: bool, served: str | None, count=None, max_model_len: int = MAX_MODEL_LEN) -> dict:
    """The request as vLLM would take it (``stream`` etc. coerced), or Refused (see above).
    ``served``: the one model name served, or None to serve any name; ``count(prompt)``: one
    prompt's tokens (default ``prompt_tokens``). The answer's limit per prompt, cut to what
    fits beside it as vLLM cuts it, is in ``out["_limits"]``, each prompt's tokens in
    ``out["_prompt_tokens"]``."""
    if not isinstance(body, dict):
        raise pydantic_error("model_attributes_type", "body",
                             "Input should be a valid dictionary or object to extract fields from", body)
    # pydantic, field by field
    messages = prompt = None
    if chat:
        messages = body.get("messages")
        if "messages" not in body:
            raise pydantic_error("missing", "body.messages", "Field required", body)
        if not isinstance(messages, list):
            raise pydantic_error("list_type", "body.messages", "Input should be a valid list", messages)
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                errors = [("dict_type", f"body.messages.{i}.{t}", "Input should be a valid dictionary", m)
                          for t in _MESSAGE_TYPES]
                raise _pydantic_all([*errors, ("model_attributes_type", f"body.messages.{i}.Message",
                                               "Input should be a valid dictionary or object to extract fields from", m)])
    else:
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise _pydantic_all([("list_type", "body.prompt", "Input should be a valid list", prompt)] * 2
                                + [("string_type", "body.prompt", "Input should be a valid string", prompt),
                                   ("list_type", "body.prompt", "Input should be a valid list", prompt)])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise pydantic_error("string_type", "body.model", "Input should be a valid string", model)
    out = dict(body)
    for field in ("max_tokens", "max_completion_tokens", "n", "min_tokens", "top_logprobs" if chat else "logprobs"):
        out[field] = _as_int(body, field)
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        out[field] = _as_float(body, field)
    for field in ("stream", "ignore_eos", "echo", *(("logprobs",) if chat else ())):
        out[field] = _as_bool(body, field)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise _pydantic_all([("string_type", "body.stop", "Input should be a valid string", stop),
                             ("list_type", "body.stop", "Input should be a valid list", stop)])
    fmt = body.get("response_format")
    if fmt is not None:
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS or (
                fmt["type"] == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict))):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise pydantic_error("literal_error", "body.response_format.type",
                                 "Input should be 'text', 'json_object' or 'json_schema'", kind)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise pydantic_error("model_attributes_type", "body.stream_options",
                             "Input should be a valid dictionary or object to extract fields from", options)
    if options:
        out["stream_options"] = {**options, **{k: _as_bool(options, k, f"body.stream_options.{k}")
                                               for k in ("include_usage", "continuous_usage_stats")}}
    # the request's validators
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    if chat and tools == []:
        raise Refused(shapes.invalid("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                                     "entirely.", "tools"), "tools")
    if chat and tool_choice not in (None, "none") and not tools:
        raise Refused(shapes.invalid("When using `tool_choice`, `tools` must be set.", "tool_choice"), "tool_choice")
    if options and not out["stream"]:
        raise Refused(shapes.invalid("Stream options can only be defined when `stream=True`.", "stream_options"),
                      "stream_options")
    # the model
    if model and served is not None and model != served:
        raise Refused(f"The model `{model}` does not exist. Valid aliases: {served}.", "model", 404, "NotFoundError")
    # the renderer: the kit's pods run no tool parser (PodSpec.vllm_args)
    if chat and tools and tool_choice != "none":
        if tool_choice in (None, "auto"):
            raise Refused('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        named = isinstance(tool_choice, dict)
        desc = f'function "{(tool_choice.get("function") or {}).get("name")}"' if named else f'"{tool_choice}"'
        raise Refused(f"tool_choice={desc} requires --tool-call-parser to be set")
    if chat and not messages:
        raise Refused("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if not chat:
        if prompt is None or prompt == "":
            raise Refused(shapes.invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt"), "prompt")
        if prompt == []:
            raise Refused("You must pass at least one prompt")
    limit_field = "max_completion_tokens" if chat and out["max_completion_tokens"] is not None else "max_tokens"
    asked = out[limit_field]
    if asked is not None and asked > max_model_len:
        raise Refused(shapes.invalid(f"{limit_field}={asked} cannot be greater than max_model_len={max_model_len}. "
                                     "Please request fewer output tokens.", limit_field, asked), limit_field)
    prompts = prompt_list(out, chat)
    counts = [(count or prompt_tokens)(p) for p in prompts]
    for p, n_in in zip(prompts, counts, strict=True):
        if n_in > max_model_len:
            # vLLM's tokenizer stops one token past the context: a longer text reads "at least" that
            shown = n_in if is_ids(p) else max_model_len + 1
            least = "at least " if shown == max_model_len + 1 else ""
            raise Refused(shapes.invalid(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                         f"prompt contains {least}{shown} input tokens, which exceeds this limit even without "
                                         "any output tokens. Please reduce the length of the input prompt.",
                                         "input_tokens", shown), "input_tokens")
    # what fits beside each prompt: vLLM cuts the limit there (get_max_tokens)
    limits = [min(asked, max_model_len - n_in) if asked is not None else max_model_len - n_in for n_in in counts]
    # the sampling parameters
    n = 1 if out["n"] is None else out["n"]
    if n < 1:
        raise Refused(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise Refused(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment "
                      "variable.")
    for field in ("presence_penalty", "frequency_penalty"):
        v = out[field]
        if v is not None and not -2.0 <= v <= 2.0:
            raise Refused(f"{field} must be in [-2, 2], got {v}.")
    temperature = out["temperature"]
    for bad, what in ((temperature is not None and not math.isfinite(temperature), "a finite number"),
                      (temperature is not None and temperature < 0.0, "non-negative"),
                      (temperature is not None and temperature > 2.0, "in [0, 2]")):
        if bad:
            raise Refused(shapes.invalid(f"temperature must be {what}, got {temperature}.", "temperature", temperature),
                          "temperature")
    top_p = out["top_p"]
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise Refused(shapes.invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p), "top_p")
    max_tokens = min(limits)
    if max_tokens < 1:
        raise Refused(shapes.invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens), "max_tokens")
    min_tokens = out["min_tokens"] or 0
    if min_tokens < 0:
        raise Refused(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise Refused(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    wanted = ((out["top_logprobs"] or 0) if out["logprobs"] else None) if chat else out["logprobs"]
    if wanted is not None and wanted > MAX_LOGPROBS:
        raise Refused(shapes.invalid(f"Requested sample logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                                     "logprobs", wanted), "logprobs")
    out["n"] = n
    out["_limits"] = limits
    out["_prompt_tokens"] = counts
    return out


def is_ids(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def prompt_tokens(prompt) -> int:
    """The oracle's token count for one prompt: token ids one each, else about four characters a
    token of its JSON (a chat's messages, a completion's string). A body counts its whole prompt."""
    if isinstance(prompt, dict):
        prompt = prompt.get("messages") or prompt.get("prompt")
    if is_ids(prompt) and prompt:
        return len(prompt)
    return max(1, len(json.dumps(prompt)) // 4)
