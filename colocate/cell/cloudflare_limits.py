"""Cloudflare's published limits on a Worker's upload, checked at plan time. Pure.

workerd enforces none of them, so without this check the sandbox would pass what the
cloud refuses at upload, after the pods are rented. Where the Free and Paid plans differ
the lower limit is used: it holds on both.

Source: developers.cloudflare.com/workers/platform/limits ("Account plan limits":
environment variables 64 per Worker on Free, 128 on Paid; environment variable size 5 KB;
Worker size 3 MB on Free, 10 MB on Paid, after compression), read 2026-12-05.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Mapping

from ..errors import ConfigError

SOURCE = "developers.cloudflare.com/workers/platform/limits"
ENV_VAR_BYTES = 5 * 1024  # each plain_text, json or secret_text binding's value
ENV_VARS = 64  # plain_text, json and secret_text bindings together (128 on Workers Paid)
SCRIPT_GZIP_BYTES = 3 * 1024 * 1024  # all modules, after compression (10 MB on Workers Paid)
ENV_VAR_TYPES = ("plain_text", "json", "secret_text")


def check_binding_value(script: str, name: str, value: str, key: str) -> None:
    """One environment variable's value against the 5 KB limit; ``key`` is the setting
    that decides it (named in the error)."""
    size = len(value.encode())
    if size > ENV_VAR_BYTES:
        raise ConfigError(key, f"[{size} bytes]",
                          f"makes binding {name} of Worker {script} {size} bytes; Cloudflare refuses an environment "
                          f"variable over {ENV_VAR_BYTES} bytes (5 KB, {SOURCE}) at upload",
                          f"make {key} shorter")


def gzip_bound(n: int) -> int:
    """The most bytes gzip can make of ``n``: zlib's deflateBound (``n + n/4096 + n/16384 + n/2**25 +
    13``; stored blocks when nothing compresses) and gzip's 18-byte header and trailer, rounded up."""
    return n + (n >> 12) + (n >> 14) + (n >> 25) + 13 + 18 + 64


def check_worker(script: str, modules: Iterable[tuple[str, bytes]], bindings: Iterable[tuple[str, str, str | None]],
                 keys: Mapping[str, str], default_key: str) -> None:
    """The script's size and its bindings against the limits. ``bindings``: (name, type,
    value or None when only known once resources exist); ``keys``: the setting behind
    each binding, ``default_key`` for the others."""
    env_vars = 0
    for name, kind, value in bindings:
        if kind not in ENV_VAR_TYPES:
            continue
        env_vars += 1
        if value is not None:
            check_binding_value(script, name, value, keys.get(name, default_key))
    if env_vars > ENV_VARS:
        raise ConfigError(default_key, env_vars,
                          f"Worker {script} would have {env_vars} environment variables (text, json and secret "
                          f"bindings); Cloudflare allows {ENV_VARS} on Workers Free (128 on Paid; {SOURCE})",
                          "use fewer cells or pods")
    body = b"".join(content for _, content in modules)
    if gzip_bound(len(body)) <= SCRIPT_GZIP_BYTES:
        return  # no compression can make it larger than the limit: it is not compressed (~0.1 s a plan)
    size = len(gzip.compress(body, mtime=0))
    if size > SCRIPT_GZIP_BYTES:
        raise ConfigError(default_key, f"[{size} bytes compressed]",
                          f"Worker {script}'s modules are {size} bytes after compression; Cloudflare allows "
                          f"{SCRIPT_GZIP_BYTES} (3 MB) on Workers Free (10 MB on Paid; {SOURCE})",
                          "upload fewer or smaller modules")
