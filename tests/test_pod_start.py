"""The pod's start command (colocate/pods/podstart.sh, pod/Dockerfile's entrypoint) loads the TLS
bundle whatever the provider puts in the environment, and leaves nothing of it on any filesystem.

It is run here as the image runs it (``/bin/sh podstart.sh <vLLM's args>``) with a fake ``vllm`` on
PATH that records its argv and loads the files it is pointed at, as uvicorn does for vLLM's flags,
and a ``mktemp`` that records the directory the script made (the real one makes it). The
environments put provider-like variables (RunPod's, Vast.ai's: names from their docs, values of
random length) ahead of the bundle and behind it, in random orders. tests/vllm_cpu/ runs it with
the real vLLM."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.pods import podtls
from colocate.sandbox.localca import LocalCA

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "colocate" / "pods" / "podstart.sh"
VLLM_ARGS = ["m", "--port", "8000", "--disable-fastapi-docs", *podtls.vllm_args()]
GUARD = ["--middleware", "colocate_pod_guard.PodGuard"]
RUNPOD = ("RUNPOD_POD_ID", "RUNPOD_API_KEY", "PUBLIC_KEY", "RUNPOD_GPU_COUNT", "RUNPOD_POD_HOSTNAME", "RUNPOD_DC_ID")
VAST = ("CONTAINER_API_KEY", "SSH_PUBLIC_KEY", "VAST_CONTAINERLABEL", "PUBLIC_IPADDR", "VAST_TCP_PORT_8000", "CONTAINER_ID")

FAKE_VLLM = r'''#!{python}
import json, os, signal, ssl, stat, sys, time
out = {{"argv": sys.argv[1:], "bundle_in_env": "COLOCATE_POD_TLS" in os.environ, "pid": os.getpid()}}
args = sys.argv[1:]
files = {{flag: args[args.index(flag) + 1] for flag in ("--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs") if flag in args}}
try:
    import colocate_pod_guard  # the --middleware it is given: importable from the PYTHONPATH the script set
    out["guard"] = colocate_pod_guard.__file__
except ImportError as exc:
    out["guard"] = repr(exc)
try:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for _ in range(2):  # read twice, as a reload would: each open starts at the file's beginning
        ctx.load_cert_chain(files["--ssl-certfile"], files["--ssl-keyfile"])
        ctx.load_verify_locations(files["--ssl-ca-certs"])
    out["loaded"] = True
    out["modes"] = sorted({{oct(stat.S_IMODE(os.stat(p).st_mode)) for p in files.values()}})
    out["targets"] = [os.readlink(p) for p in files.values()]
    out["ca"] = open(files["--ssl-ca-certs"]).read()
except Exception as exc:
    out["loaded"] = False
    out["error"] = repr(exc)
if os.environ.get("FAKE_VLLM_WAIT"):  # serve until a signal, as vLLM does
    got = []
    signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
    json.dump(out, open(os.environ["FAKE_VLLM_OUT"] + ".tmp", "w"))
    os.rename(os.environ["FAKE_VLLM_OUT"] + ".tmp", os.environ["FAKE_VLLM_OUT"])
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    open(os.environ["FAKE_VLLM_OUT"] + ".signal", "w").write(str(got))
    sys.exit(0)
json.dump(out, open(os.environ["FAKE_VLLM_OUT"], "w"))
'''
# Records each directory the script makes: the real mktemp makes it.
FAKE_MKTEMP = """#!/bin/sh
made=$(/usr/bin/mktemp "$@") || exit $?
printf '%s\\n' "$made" >> "$FAKE_MKTEMP_LOG"
printf '%s\\n' "$made"
"""


@pytest.fixture(scope="module")
def material():
    ca = LocalCA.create("start test CA")
    leaf = ca.server("localhost")
    return ca, podtls.bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem)


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("vllm", FAKE_VLLM.format(python=sys.executable)), ("mktemp", FAKE_MKTEMP)):
        exe = d / name
        exe.write_text(text)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return d


def made_dirs(tmp: Path) -> list[Path]:
    log = tmp / "mktemp.log"
    return [Path(line) for line in log.read_text().splitlines()] if log.exists() else []


def _provider_env(rng: random.Random) -> dict[str, str]:
    names = RUNPOD if rng.random() < 0.5 else VAST
    return {n: "".join(rng.choice("abcdefghijklmnop0123456789+/=") for _ in range(rng.randint(1, 600))) for n in names}


def start(fake_bin: Path, tmp: Path, ordered_env: list[tuple[str, str]], args=VLLM_ARGS) -> tuple[int, dict, str]:
    out = tmp / "vllm.json"
    out.unlink(missing_ok=True)
    env = dict(ordered_env)
    env.update(PATH=f"{fake_bin}:/usr/bin:/bin", FAKE_VLLM_OUT=str(out), TMPDIR=str(tmp),
               FAKE_MKTEMP_LOG=str(tmp / "mktemp.log"))
    proc = subprocess.run(["/bin/sh", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, (json.loads(out.read_text()) if out.exists() else {}), proc.stderr


def test_the_bundle_loads_with_provider_variables_ahead_of_it_and_behind_it(fake_bin, tmp_path, material):
    ca, bundle = material
    rng = random.Random(48_8)
    for _ in range(30):
        ahead, behind = _provider_env(rng), _provider_env(rng)
        env = [*ahead.items(), (podtls.ENV, bundle), ("VLLM_API_KEY", "t" * 48), *behind.items()]
        code, seen, err = start(fake_bin, tmp_path, env)
        assert code == 0 and seen["loaded"], (err, seen.get("error"))
        assert seen["ca"].strip() == ca.cert_pem.strip()  # the callers' CA only: not the pod's own certificate
        assert seen["modes"] == ["0o600"]
        assert not seen["bundle_in_env"]  # the key is in no process's environment once vLLM runs
        # vLLM reads open files whose directory is already gone: nothing of the key on any filesystem.
        assert all(t.endswith(" (deleted)") for t in seen["targets"]), seen["targets"]
        assert [Path(t.removesuffix(" (deleted)")).name for t in seen["targets"]] == ["cert.pem", "key.pem", "ca.pem"]
        # Only the three --ssl-* values change, each to its own file; every other argument is vLLM's; the guard follows.
        argv = seen["argv"]
        assert argv[0] == "serve" and argv[1 + len(VLLM_ARGS):] == GUARD
        changed = [(a, b) for a, b in zip(VLLM_ARGS, argv[1:1 + len(VLLM_ARGS)], strict=True) if a != b]
        assert [a for a, _ in changed] == [podtls.SOURCE] * 3
        assert [b for _, b in changed] == ["/proc/self/fd/3", "/proc/self/fd/4", "/proc/self/fd/5"]
        assert seen["guard"] == str(ROOT / "colocate" / "pods" / "guard" / "colocate_pod_guard.py")
    made = made_dirs(tmp_path)
    assert len(made) == 30 and not any(d.exists() for d in made), [d for d in made if d.exists()]


def test_the_environ_mechanism_loses_the_bundle_where_the_start_command_does_not(fake_bin, tmp_path, material):
    """300 environments of the same kind, read the stock image's way: OpenSSL pointed at the process's
    environment block (``K=V\\0`` in order, as /proc/self/environ holds it; a file here, read by the
    same call). Some orders hide the bundle; the start command loads it in each of those, and in others."""
    _, bundle = material
    rng = random.Random(300)
    lost, kept = [], []
    block = tmp_path / "environ"
    for _ in range(300):
        env = [*_provider_env(rng).items(), (podtls.ENV, bundle), *_provider_env(rng).items()]
        block.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in dict(env).items()))
        try:
            podtls.server_context(str(block))
            kept.append(env)
        except podtls.PodTlsError:
            lost.append(env)
    assert lost, "no order hid the bundle: this test shows nothing about the mechanism it replaces"
    for env in lost + kept[:10]:
        code, seen, err = start(fake_bin, tmp_path, env)
        assert code == 0 and seen["loaded"], err


def test_without_a_bundle_vllm_gets_its_arguments_unchanged(fake_bin, tmp_path):
    args = ["m", "--disable-fastapi-docs"]
    code, seen, err = start(fake_bin, tmp_path, [("RUNPOD_POD_ID", "abc")], args)
    assert code == 0 and seen["argv"] == ["serve", *args, *GUARD], err
    assert made_dirs(tmp_path) == []


def test_a_bundle_without_a_key_stops_before_vllm_naming_the_variable(fake_bin, tmp_path, material):
    ca, _ = material
    code, seen, err = start(fake_bin, tmp_path, [(podtls.ENV, "\n" + ca.cert_pem)])
    assert code == 78 and seen == {} and "COLOCATE_POD_TLS holds no key" in err
    made = made_dirs(tmp_path)
    assert len(made) == 1 and not made[0].exists()  # the certificate it had written went with it


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_reaches_vllm_and_nothing_of_the_key_remains_after_it_exits(fake_bin, tmp_path, material, sig):
    _, bundle = material
    out = tmp_path / "vllm.json"
    env = {podtls.ENV: bundle, "VLLM_API_KEY": "t" * 48, "PATH": f"{fake_bin}:/usr/bin:/bin", "TMPDIR": str(tmp_path),
           "FAKE_VLLM_OUT": str(out), "FAKE_VLLM_WAIT": "1", "FAKE_MKTEMP_LOG": str(tmp_path / "mktemp.log")}
    proc = subprocess.Popen(["/bin/sh", str(SCRIPT), *VLLM_ARGS], env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = json.loads(out.read_text())
        assert seen["loaded"] and seen["pid"] == proc.pid  # exec'd: the signal goes to vLLM itself
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGTERM:
        assert code == 0 and (tmp_path / "vllm.json.signal").read_text() == f"[{int(signal.SIGTERM)}]"
    else:
        assert code == -signal.SIGKILL
    made = made_dirs(tmp_path)
    assert len(made) == 1 and not made[0].exists()


def test_the_dockerfile_runs_this_script_as_the_entrypoint():
    text = (ROOT / "pod" / "Dockerfile").read_text()
    assert "COPY colocate/pods/podstart.sh /opt/colocate-pod/podstart.sh" in text
    assert "COPY colocate/pods/guard/colocate_pod_guard.py /opt/colocate-pod/guard/colocate_pod_guard.py" in text
    assert 'ENTRYPOINT ["/bin/sh", "/opt/colocate-pod/podstart.sh"]' in text
    assert os.access(SCRIPT, os.R_OK)
