"""A tokenizer made on this machine for an outside benchmark client (guidellm), which needs one and
cannot download any: one token per word of the word list guidellm's synthetic prompts are drawn
from (Faker's lorem words), saved as a Hugging Face tokenizer directory.

Runs in a throwaway venv with guidellm installed (not the kit's: guidellm is not a requirement):

    python3 -m venv /tmp/gl-venv && /tmp/gl-venv/bin/pip install guidellm
    /tmp/gl-venv/bin/python bench/local_tokenizer.py /tmp/gl-tok

The words are common English ones, so the stand-in's estimator (colocate.pods.engine.tokenize) and
a real BPE tokenizer count almost every one as one token too (docs/pods.md, "An outside client").
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: local_tokenizer.py OUT_DIR", file=sys.stderr)
        return 2
    from faker.providers.lorem.en_US import Provider  # type: ignore[import-not-found]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # type: ignore[import-not-found]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found]

    words = sorted({w.lower() for w in Provider.word_list} | {w.capitalize() for w in Provider.word_list})
    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # decoding joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(argv[0])
    print(f"{len(vocab)} tokens written to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
