"""A server of the user's as the sandbox's pod (``colocate:pod.command`` / ``.url``): what it is
given, exactly what a cloud pod gets, and the command that starts vLLM that way by hand.

A cloud pod gets the pod token (``VLLM_API_KEY``) and, on a mutual-TLS hop, ``COLOCATE_POD_TLS``:
its certificate, key and the Worker's CA, without the readiness CA (vLLM cannot tell callers apart
by certificate, so readiness is refused in the handshake, which it reads as serving). The sandbox's
stand-in alone trusts the readiness CA (``hopcerts.HopCredentials.pod_env``).

``files(state_dir)`` writes those two values to ``<state>/engine/`` (directory 0700, files 0600):
``sandbox.py pod-command`` prints a command that reads them there, so no secret is printed.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..pods import podtls
from ..pods.spec import PodSpec
from . import hopcerts
from .statedir import ROOT, load_secrets

DIR = "engine"
PODSTART = ROOT / "colocate/pods/podstart.sh"


def pod_bundle(state_dir: Path) -> str:
    """``COLOCATE_POD_TLS`` for an engine pod: the cloud's form (no readiness CA)."""
    hop = hopcerts.load(state_dir)
    return podtls.bundle(hop.pod.cert_pem, hop.pod.key_pem, hop.ca.cert_pem)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def files(state_dir: Path, mtls: bool) -> dict[str, Path]:
    """The pod token (and, on a mutual-TLS hop, the bundle) in files only the user can read."""
    d = Path(state_dir) / DIR
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    out = {"token": d / "pod-token"}
    _write(out["token"], load_secrets(state_dir)["podToken"])
    if mtls:
        out["tls"] = d / "pod-tls.pem"
        _write(out["tls"], pod_bundle(state_dir))
    return out


def vllm_command(state_dir: Path, spec: PodSpec, model: str | None = None, extra: tuple[str, ...] = ()) -> str:
    """The shell command that starts vLLM as the cell's pod at ``spec.url``: the kit's start command
    (podstart.sh: the bundle to private files, the pod's guard) with the kit's arguments."""
    made = files(state_dir, spec.mtls)
    parts = spec.url.split("://", 1)[1].rsplit(":", 1)
    host, port = parts[0].strip("[]"), int(parts[1])
    env = [f"VLLM_API_KEY=\"$(cat {shlex.quote(str(made['token']))})\""]
    if "tls" in made:
        env.insert(0, f"COLOCATE_POD_TLS=\"$(cat {shlex.quote(str(made['tls']))})\"")
    args = [model or spec.model, *spec.serve_args(host, port), *extra]
    return " ".join(["env", *env, "/bin/sh", shlex.quote(str(PODSTART)), shlex.join(args)])
