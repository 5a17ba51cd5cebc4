"""What vLLM writes, as the stand-in writes it: answers, stream events, errors, ``/v1/models``.

vLLM is the reference for everything but timing and faults: every shape here is
vLLM 0.32's (``vllm/entrypoints/openai/chat_completion/protocol.py``, ``completion/protocol.py``,
``serve/engine/protocol.py``, and their ``serving.py`` generators), keys in its order, null
where vLLM writes null and absent where it leaves a key out, so that a client, the router's
assembler and the tests see the stand-in and a real pod alike. vLLM serialises a non-streamed
answer whole (``model_dump()``: every field, null when unset), a stream event with
``exclude_unset`` (only the fields its generator set), and the last usage event with
``exclude_none``. ``tests/engine_contract`` runs the same checks against the stand-in and a
live vLLM.
"""

from __future__ import annotations

import hashlib
import json

VLLM_VERSION = "0.32.0"  # the engine the shapes were read from and checked against


def fingerprint(model: str, max_model_len: int) -> str:
    """``system_fingerprint``: vLLM's is its version and a hash of its configuration."""
    digest = hashlib.sha256(f"{model}:{max_model_len}".encode()).hexdigest()[:8]
    return f"vllm-{VLLM_VERSION}-{digest}"


# ---- errors ------------------------------------------------------------------------------

def error(message: str, type_: str = "BadRequestError", param: str | None = None, code: int = 400) -> dict:
    """vLLM's ErrorResponse."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, value=None) -> str:
    """The text of vLLM's VLLMValidationError: ``message (parameter=P, value=V)``."""
    extras = [f"parameter={param}"] if param is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's --api-key middleware: not an ErrorResponse


def summarized(value) -> object:
    """A validation error's ``input`` as vLLM shows it (containers described, not written out)."""
    if isinstance(value, str):
        return value[:200] + "...[truncated]" if len(value) > 200 else value
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def validation_error(kind: str, loc: str, msg: str, value, ctx: dict | None = None) -> dict:
    """vLLM's 400 for a body pydantic refuses: one error, rendered as Python prints it."""
    err: dict = {"type": kind, "loc": loc, "msg": msg, "input": summarized(value)}
    if ctx is not None:
        err["ctx"] = ctx
    return error(f"1 validation error:\n  {err}", "Bad Request", loc, 400)


# ---- /v1/models --------------------------------------------------------------------------

def models(model: str, max_model_len: int, created: int, perm_id: str) -> dict:
    """vLLM's ModelList for its one served model (``root``: what it was started with)."""
    permission = {"id": f"modelperm-{perm_id}", "object": "model_permission", "created": created, "allow_create_engine": False,
                  "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    card = {"id": model, "object": "model", "created": created, "owned_by": "vllm", "root": model, "parent": None,
            "max_model_len": max_model_len, "permission": [permission]}
    return {"object": "list", "data": [card]}


# ---- logprobs ----------------------------------------------------------------------------

def _logprob(i: int, rank: int) -> float:
    return -0.25 * (rank + 1) - 0.01 * (i % 7)


def chat_logprobs(tokens: list[str], first: int, top: int) -> dict:
    """ChatCompletionLogProbs of ``tokens`` (the ``first``-th token of the answer onwards)."""
    content = []
    for k, tok in enumerate(tokens):
        i = first + k
        alts = [{"token": tok, "logprob": _logprob(i, 0), "bytes": list(tok.encode())}]
        alts += [{"token": f"{tok}~{r}", "logprob": _logprob(i, r), "bytes": list(f"{tok}~{r}".encode())} for r in range(1, top)]
        content.append({"token": tok, "logprob": _logprob(i, 0), "bytes": list(tok.encode()), "top_logprobs": alts[:top]})
    return {"content": content}


def completion_logprobs(tokens: list[str], first: int, offset: int, top: int) -> dict:
    """CompletionLogProbs of ``tokens``; ``offset``: the text offset of the first (vLLM's are absolute)."""
    out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for k, tok in enumerate(tokens):
        i = first + k
        out["text_offset"].append(offset)
        offset += len(tok)
        out["token_logprobs"].append(_logprob(i, 0))
        out["tokens"].append(tok)
        out["top_logprobs"].append({tok: _logprob(i, 0), **{f"{tok}~{r}": _logprob(i, r) for r in range(1, top)}})
    return out


# ---- answers -----------------------------------------------------------------------------

def usage(prompt: int, completion: int) -> dict:
    """UsageInfo as a non-streamed answer writes it."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def chat_answer(rid: str, created: int, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                system_fingerprint: str) -> dict:
    """ChatCompletionResponse; each of ``choices``: {text, finish, stop_reason, logprobs}."""
    out = []
    for i, c in enumerate(choices):
        message = {"role": "assistant", "content": c["text"], "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}
        out.append({"index": i, "message": message, "logprobs": c.get("logprobs"), "finish_reason": c["finish"],
                    "stop_reason": c.get("stop_reason"), "token_ids": None, "routed_experts": None})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out, "service_tier": None,
            "system_fingerprint": system_fingerprint, "usage": usage(prompt_tokens, completion_tokens), "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None}


def completion_answer(rid: str, created: int, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                      system_fingerprint: str) -> dict:
    """CompletionResponse; each of ``choices``: {text, finish, stop_reason, logprobs}."""
    out = [{"index": i, "text": c["text"], "logprobs": c.get("logprobs"), "finish_reason": c["finish"],
            "stop_reason": c.get("stop_reason"), "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            "routed_experts": None} for i, c in enumerate(choices)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out, "service_tier": None,
            "system_fingerprint": system_fingerprint, "usage": usage(prompt_tokens, completion_tokens),
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


# ---- stream events -----------------------------------------------------------------------

def event(obj: dict) -> bytes:
    """One SSE event, spelt as vLLM's pydantic writes JSON (no blanks, non-ASCII as is)."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class Stream:
    """The events of one streamed answer, in the order and shape vLLM's generators write them.

    ``options``: the request's ``stream_options`` (``include_usage``, ``continuous_usage_stats``);
    ``prompt_tokens``: per prompt (a completions list has several; chat one); ``n`` choices per
    prompt, indexed ``prompt * n + j`` as vLLM indexes them.
    """

    def __init__(self, chat: bool, rid: str, created: int, model: str, prompt_tokens: list[int], n: int,
                 options: dict | None, system_fingerprint: str):
        self.chat, self.n = chat, n
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                     "model": model}
        self.prompt_tokens = prompt_tokens
        options = options or {}
        self.include_usage = bool(options.get("include_usage"))
        self.continuous = self.include_usage and bool(options.get("continuous_usage_stats"))
        self.fingerprint = system_fingerprint
        self.made = [0] * (n * len(prompt_tokens))  # tokens sent, per choice

    def _prompt(self, choice: int) -> int:
        return self.prompt_tokens[choice // self.n]

    def _usage(self, choice: int) -> dict:
        p, c = self._prompt(choice), self.made[choice]
        u: dict = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
        if self.chat:
            u["completion_tokens_details"] = None  # set (to None) by the chat generator, so written
        return u

    def opening(self) -> list[bytes]:
        """Chat's first events: each choice's role with empty content (completions have none)."""
        if not self.chat:
            return []
        out = []
        for i in range(self.n):
            chunk: dict = {**self.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                                      "finish_reason": None}]}
            if self.continuous:
                chunk["usage"] = self._usage(i)
            chunk["prompt_token_ids"] = None
            chunk["prompt_text"] = None
            out.append(event(chunk))
        return out

    def token(self, choice: int, text: str, finish: str | None = None, stop_reason=None, logprobs: dict | None = None,
              tokens: int = 1) -> bytes:
        """The event of ``tokens`` new tokens of ``choice`` (``text``), the last one when ``finish``."""
        self.made[choice] += tokens
        c: dict
        if self.chat:
            c = {"index": choice, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = stop_reason
            c["token_ids"] = None
        else:
            c = {"index": choice, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason,
                 "prompt_token_ids": None, "token_ids": None}
        chunk: dict = {**self.head, "choices": [c]}
        if self.continuous:
            chunk["usage"] = self._usage(choice)
        if finish is not None and not self.include_usage:
            chunk["system_fingerprint"] = self.fingerprint
        return event(chunk)

    def closing(self) -> list[bytes]:
        """The usage event (when asked; ``exclude_none``: no null details), then [DONE]."""
        if not self.include_usage:
            return [DONE]
        p, c = sum(self.prompt_tokens), sum(self.made)
        chunk: dict = {**self.head, "choices": [], "usage": {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c},
                       "system_fingerprint": self.fingerprint}
        return [event(chunk), DONE]
