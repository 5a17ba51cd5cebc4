"""Record a live vLLM's answers as the fixtures of worker/test/assemble.test.js.

Each fixture is one request asked twice of the same engine, greedy or seeded so that both
make the same tokens: ``NAME.sse`` the stream (``include_usage``, as the router asks it),
``NAME.json`` the non-streamed answer. The router's assembler must turn the first into the
second (ids and times aside, which the test takes from the stream). The fast suite has no
engine, so these are the engine's own bytes, kept:

    .venv/bin/python -m tests.engine_contract.capture_answers URL TOKEN [--reasoning] [--only NAME]

``--reasoning``: the engine runs a reasoning parser (``--reasoning-parser deepseek_r1`` on a model
whose tokenizer has ``<think>``): it records ``chat-reasoning``, the rest come from a plain engine.
docs/testing.md says how the fixtures in the repository were made.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "worker" / "test" / "fixtures" / "answers"
HELLO = [{"role": "user", "content": "Say hello, then count to five."}]

PLAIN = {
    "chat-plain": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 24, "temperature": 0}),
    "chat-n2-logprobs": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 7,
                                                  "logprobs": True, "top_logprobs": 2}),
    "chat-stop": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 40, "temperature": 0, "stop": ["i"]}),
    "text-n2-logprobs": ("/v1/completions", {"prompt": ["One, two,", "Alpha, beta,"], "max_tokens": 5, "n": 2, "temperature": 0.8,
                                             "seed": 7, "logprobs": 2}),
    "text-echo": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "echo": True}),
}
REASONING = {
    "chat-reasoning": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 3}),
}


def post(url: str, token: str, path: str, body: dict) -> bytes:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"authorization": f"Bearer {token}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as res:
        return res.read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("token")
    p.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4")
    p.add_argument("--reasoning", action="store_true")
    p.add_argument("--only", action="append")
    args = p.parse_args(argv)
    cases = REASONING if args.reasoning else PLAIN
    for name, (path, body) in cases.items():
        if args.only and name not in args.only:
            continue
        body = {"model": args.model, **body}
        try:
            whole = post(args.url, args.token, path, body)
            stream = post(args.url, args.token, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        except (OSError, urllib.error.HTTPError) as exc:
            print(f"capture_answers: {name}: {exc}", file=sys.stderr)
            return 1
        (OUT / f"{name}.json").write_bytes(whole.rstrip() + b"\n")
        (OUT / f"{name}.sse").write_bytes(stream)
        print(f"{name}: {len(stream)} bytes of stream, {len(whole)} of answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
