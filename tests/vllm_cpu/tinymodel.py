"""A tiny random-weight model of the default model's shape, built locally and cached.

The kit's default pod serves ``Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4``. No weights can be downloaded
here, and none are needed: vLLM serves a local directory with ``--load-format dummy`` (random
weights), so the model is a ``config.json`` of the same architecture (Qwen2ForCausalLM) with tiny
sizes and a ``quantization_config`` like the real model's (GPTQ, 4 bits, group 128: so the pod's
``--quantization gptq_marlin`` stays in its arguments), a tokenizer, and the real chat template.
On a CPU without AVX-512 the model is unquantized (``quantized()``): vLLM's CPU build has GPTQ's kernel
(``cpu_gemm_wna16``) only in its AVX-512 libraries, and on AVX2 it loads ``_C_AVX2``, which lacks it.

- The chat template is Qwen2.5-7B-Instruct's own, tools included, byte for byte:
  ``qwen2.5-instruct-chat-template.jinja`` beside this file is llama.cpp's
  ``models/templates/Qwen-Qwen2.5-7B-Instruct.jinja`` (written by llama.cpp's
  ``scripts/get_chat_template.py Qwen/Qwen2.5-7B-Instruct`` from the model's tokenizer_config.json;
  read from the llama-cpp-python 0.3.36 sdist on PyPI, ``vendor/llama.cpp/``), sha256 ``TEMPLATE_SHA256``.
  The GPTQ-Int4 model ships the same template.
- The tokenizer is a byte-level BPE like Qwen2's, trained here (one thread: deterministic) on the
  Python sources of vLLM's own ``entrypoints`` package in the pinned venv, text whose bytes the pin
  fixes, with Qwen2's special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and its
  tool-call markers (``<tool_call>``, ``</tool_call>``).
- ``generation_config.json`` carries the real model's sampling defaults (vLLM applies them).

    python -m tests.vllm_cpu.tinymodel     (prints the model's directory; builds it when absent)

The directory's name carries a digest of this file, the template and the venv's pins; it is
built in a temporary directory and renamed into place whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "qwen2.5-instruct-chat-template.jinja"
TEMPLATE_SHA256 = "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"
SERVED = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"  # the default colocate:pod.model, the name the tests ask for
VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKERS = ["<tool_call>", "</tool_call>"]  # added, not special, as in Qwen2's tokenizer

# Qwen2.5-7B-Instruct-GPTQ-Int4's config.json with the sizes cut down (head_dim 32, two layers).
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 32768, "max_window_layers": 2,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": 32768, "use_sliding_window": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "attention_dropout": 0.0,
    "quantization_config": {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False,
                            "static_groups": False, "sym": True, "true_sequential": True,
                            "model_name_or_path": None, "model_file_base_name": "model", "quant_method": "gptq"},
}


def quantized() -> bool:
    """Whether vLLM's CPU build can serve GPTQ here: it loads its AVX-512 kernels (which have
    ``cpu_gemm_wna16``) only where the CPU has AVX-512 (vllm/platforms/cpu.py ``import_kernels``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags


def config() -> dict:
    """The model's config.json (less its token ids): GPTQ's quantization_config only where vLLM can serve it."""
    if quantized():
        return dict(CONFIG)
    return {k: v for k, v in CONFIG.items() if k != "quantization_config"}


def digest() -> str:
    from .venv import PINS

    h = hashlib.sha256(Path(__file__).read_bytes() + TEMPLATE.read_bytes() + PINS.encode())
    return h.hexdigest()[:12]


def model_dir() -> Path:
    from .venv import cache_root

    return cache_root() / "models" / f"qwen2-tiny-{digest()}{'' if quantized() else '-bf16'}"


def ensure(venv: Path) -> Path:
    """The model's directory, built now (with the venv's python, which has ``tokenizers``) if absent."""
    out = model_dir()
    if (out / "config.json").is_file():
        return out
    if hashlib.sha256(TEMPLATE.read_bytes()).hexdigest() != TEMPLATE_SHA256:
        raise SystemExit(f"test-vllm: {TEMPLATE} is not Qwen2.5-Instruct's template (sha256 differs); restore it from git")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run([str(venv / "bin" / "python"), str(Path(__file__)), str(tmp), str(venv)], check=True, env=env,
                       stdin=subprocess.DEVNULL)
        try:
            os.rename(tmp, out)
        except OSError:  # another run built it first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"test-vllm: built {out} in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def corpus(venv: Path) -> list[str]:
    """The training text: vLLM's entrypoints sources in the pinned venv, in a fixed order."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    files = sorted(str(p) for p in (site / "vllm" / "entrypoints").rglob("*.py"))
    if not files:
        raise SystemExit(f"test-vllm: no vLLM sources under {site}: is {venv} the vLLM venv?")
    return files


def build(out: Path, venv: Path) -> None:
    """Run by the venv's python: write the tokenizer, its config, the model config and the generation config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(TOOL_MARKERS), special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus(venv), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_MARKERS])
    if tok.get_vocab_size() > VOCAB:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, more than the model's {VOCAB}")
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    template = TEMPLATE.read_text()
    template = template[:-1] if template.endswith("\n") else template  # the file ends with print()'s newline
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 131072, "chat_template": template,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "errors": "replace",
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "add_prefix_space": False}, indent=1))
    (out / "config.json").write_text(json.dumps({**config(), "bos_token_id": ids["<|endoftext|>"],
                                                 "eos_token_id": ids["<|im_end|>"]}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"], "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "repetition_penalty": 1.05,
        "temperature": 0.7, "top_p": 0.8, "top_k": 20}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3:  # the venv's python, building into a directory
        build(Path(sys.argv[1]), Path(sys.argv[2]))
    else:
        sys.path.insert(0, str(HERE.parent.parent))
        from tests.vllm_cpu import venv as _venv

        print(ensure(_venv.ensure()))
