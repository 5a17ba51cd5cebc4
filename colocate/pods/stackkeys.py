"""Which providers a stack uses, and their API keys found the way ``pulumi up`` finds them.

``pulumi up`` (infra/program.py) gives scripts/pod.py the provider key from the stack's
secret ``colocate:<provider>ApiKey`` when it is set, else from the environment
(``RUNPOD_API_KEY`` / ``VASTAI_API_KEY``). ``sweep`` does the same: when the stack file
holds the key as a secret and the Pulumi CLI is on PATH, it runs
``pulumi config get --show-secrets colocate:<provider>ApiKey --stack S`` (in the project
root, where Pulumi.yaml is); otherwise it reads the environment. A provider the stack uses
whose key cannot be found is a configuration error (exit 2): a sweep that cannot look must
never answer "no strays".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import stackfile
from ..cell.settings import NS, POD_DEFAULTS, PROVIDER_SECRET
from ..errors import ConfigError
from .errors import PodConfigError

PULUMI_TIMEOUT_S = 60


@dataclass(frozen=True)
class StackProviders:
    stack: str
    used: str  # the provider the stack's pods run on (colocate:pod.provider)
    secret_keys: frozenset[str]  # settings keys the stack file stores as secrets


def stack_providers(stack: str, stacks_dir: Path = stackfile.STACKS_DIR) -> StackProviders:
    """The stack's pod provider; an unknown stack is a PodConfigError naming the known ones."""
    try:
        raw, secret_names = stackfile.read_config(stack, stacks_dir)
    except ConfigError as exc:
        raise PodConfigError(f"sweep: unknown stack: {exc}") from None
    pod = raw.get("pod") or {}
    provider = pod.get("provider", POD_DEFAULTS["provider"]) if isinstance(pod, dict) else POD_DEFAULTS["provider"]
    return StackProviders(stack, str(provider), frozenset(secret_names))


def _from_pulumi(stack: str, key_name: str, pulumi: str, cwd: Path) -> tuple[str | None, str]:
    """(the value, or None and why not) from ``pulumi config get --show-secrets``."""
    exe = shutil.which(pulumi)
    if not exe:
        return None, f"the pulumi CLI ({pulumi}) is not on PATH"
    cmd = [exe, "config", "get", "--show-secrets", f"{NS}:{key_name}", "--stack", stack]
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=PULUMI_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"`pulumi config get` did not finish in {PULUMI_TIMEOUT_S} s"
    value = proc.stdout.strip()
    if proc.returncode != 0 or not value:
        why = (proc.stderr or "").strip().splitlines()[-1:] or ["no value"]
        return None, f"`pulumi config get {NS}:{key_name} --stack {stack}` failed (exit {proc.returncode}): {why[0][:200]}"
    return value, "pulumi config"


def provider_key(provider: str, stack: StackProviders, env: Mapping[str, str] | None = None, *,
                 pulumi: str = "pulumi", cwd: Path = stackfile.ROOT) -> tuple[str, str]:
    """(API key, where it came from) for ``provider``, as ``pulumi up`` would find it."""
    env = os.environ if env is None else env
    key_name, env_name = PROVIDER_SECRET[provider]
    notes = []
    if key_name in stack.secret_keys:
        value, why = _from_pulumi(stack.stack, key_name, pulumi, cwd)
        if value:
            return value, why
        notes.append(why)
    else:
        notes.append(f"the stack file has no {NS}:{key_name}")
    if env.get(env_name):
        return env[env_name], f"environment {env_name}"
    notes.append(f"{env_name} is not set")
    raise PodConfigError(
        f"sweep --stack {stack.stack}: cannot query {provider}, which the stack uses "
        f"({NS}:pod.provider): no API key ({'; '.join(notes)}). Fix: export {env_name}=<key>, or "
        f"`pulumi config set --secret {NS}:{key_name} <key> --stack {stack.stack}` with the pulumi CLI on PATH. "
        "Nothing was swept: strays cannot be ruled out")


def delete_keys(provider: str, stack: str | None, stacks_dir: Path = stackfile.STACKS_DIR,
                env: Mapping[str, str] | None = None, *, pulumi: str = "pulumi",
                cwd: Path = stackfile.ROOT) -> list[tuple[str, str]]:
    """The keys a delete tries, current first: the stack's secret as ``pulumi config`` holds
    it now (when ``stack`` is given and its file stores one), then the environment's.

    pulumi-command runs a delete with the environment saved at create, so after a key is
    rotated and the old one revoked the environment holds the revoked key; the stack's
    config holds the current one. Nothing is found: [] (the provider says what is missing)."""
    env = os.environ if env is None else env
    key_name, env_name = PROVIDER_SECRET[provider]
    found: list[tuple[str, str]] = []
    if stack:
        try:
            secret_keys = stack_providers(stack, stacks_dir).secret_keys
        except PodConfigError:
            secret_keys = frozenset()  # a stack file gone since create: the saved key is all there is
        if key_name in secret_keys:
            value, source = _from_pulumi(stack, key_name, pulumi, cwd)
            if value:
                found.append((value, source))
    if env.get(env_name) and env[env_name] not in {k for k, _ in found}:
        found.append((env[env_name], f"environment {env_name}"))
    return found


@contextlib.contextmanager
def keys_in_environment(keys: Mapping[str, str]) -> Iterator[None]:
    """Expose found keys to the providers (which read the environment) for one call, then restore."""
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
