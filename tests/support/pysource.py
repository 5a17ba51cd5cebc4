"""Parsing the project's Python for the tests that read its source (names, imports, printed
commands)."""

from __future__ import annotations

import ast
import gc


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse`` with the garbage collector held off. On CPython 3.11 a collection during
    ``ast.parse`` can finalize an asyncio future left by a refused Pulumi mock run; its
    "exception was never retrieved" log formats a traceback, whose caret anchors call
    ``ast.parse`` again, and the outer parse then fails with "AST constructor recursion depth
    mismatch" (the AST state is shared; python/cpython#106905). Seen once in six `make
    test-fast` runs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename)
    finally:
        if enabled:
            gc.enable()
