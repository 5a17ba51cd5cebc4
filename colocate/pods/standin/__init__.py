"""The local stand-in for a GPU pod: an OpenAI-compatible server that answers as vLLM 0.32 does,
only pretending to infer (docs/pods.md, "The local stand-in"). Its seams:

    server.py    the HTTP server: routes, auth, mutual TLS, faults and hostile attacks, counters, CLI
    refusals.py  what vLLM refuses of a request, in its order and with its bodies (``validate``)
    runner.py    a GPU profile's engine (colocate/pods/engine.py) stepped in real time
    answers.py   the text it generates: lengths, stops, JSON modes

``python -m colocate.pods.standin`` runs ``server.main``; in-process, ``serve()``.
"""

from .answers import answer_pieces
from .refusals import Refused, prompt_tokens, validate
from .runner import CATCH_UP_S, EngineRunner
from .server import (
    ATTACKS,
    DEFAULT_COMPUTE_MS,
    DEFAULT_MODEL,
    FAULT_MODES,
    OPEN_ROUTES,
    OVERSIZED_BYTES,
    StandinServer,
    main,
    serve,
)

__all__ = ["ATTACKS", "CATCH_UP_S", "DEFAULT_COMPUTE_MS", "DEFAULT_MODEL", "FAULT_MODES", "OPEN_ROUTES", "OVERSIZED_BYTES",
           "EngineRunner", "Refused", "StandinServer", "answer_pieces", "main", "prompt_tokens", "serve", "validate"]
