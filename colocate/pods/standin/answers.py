"""The text the stand-in answers with: each choice's tokens, where it stops (``max_tokens``,
``stop``, ``min_tokens``, ``ignore_eos``) and, for a JSON response format, a value that parses."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .. import engine as eng
from .refusals import is_ids


@dataclass
class Choice:
    """One choice of an answer: its tokens' text, finish and stop reasons, and (echo) the prompt before it."""

    pieces: list[str]
    finish: str
    stop_reason: str | None = None
    prefix: str = ""



def prompt_token_ids(prompt, chat: bool) -> list[int]:
    """The engine's tokens of one prompt: a chat's template text, a completion's string, or its token ids."""
    if chat:
        return eng.tokenize(eng.chat_text(prompt or []))
    if is_ids(prompt):
        return list(prompt)
    return eng.tokenize(str(prompt))


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


def cut_at_stop(pieces: list[str], finish: str, stop, min_tokens: int) -> tuple[list[str], str, str | None]:
    """vLLM's stop strings: looked for in each new token's text (with the tail before it) once
    ``min_tokens`` are made; the answer ends before the stop string, the token holding it counted,
    finish "stop" and stop_reason the string found (None when none was)."""
    stops = [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]
    text = ""
    for i, piece in enumerate(pieces):
        start = len(text)
        text += piece
        if i + 1 < min_tokens:
            continue
        found = sorted((at, s) for s in stops if (at := text.find(s, max(0, start - len(s) + 1))) >= 0)
        if found:
            keep = text[:found[0][0]]
            cut = [*pieces[:i], ""]
            # The kept text, re-cut along the pieces it spans (the stop string may start in an earlier one).
            out, pos = [], 0
            for p in cut[:-1]:
                out.append(keep[pos:pos + len(p)])
                pos += len(p)
            out.append(keep[pos:])
            return out, "stop", found[0][1]
    return pieces, finish, None


# The oracle's answer: nine words, then (min_tokens, ignore_eos) the answer's words going round.
WORDS_ORACLE = ("This", " is", " the", " colocate", " stand-in", " answering", " from", " loopback", ".")


def reply_tokens(min_tokens: int, ignore_eos: bool, limit: int) -> tuple[list[str], str]:
    """The oracle's answer and finish reason: it ends after nine words ("stop"), or later for
    ``min_tokens``; ``ignore_eos`` runs to the limit; the limit cuts it ("length"), as in vLLM."""
    natural = limit if ignore_eos else max(len(WORDS_ORACLE), min_tokens)
    n = min(natural, limit)
    words = [*WORDS_ORACLE, *(_WORDS[i % len(_WORDS)] for i in range(max(0, n - len(WORDS_ORACLE))))][:n]
    return words, "length" if ignore_eos or natural > limit else "stop"
