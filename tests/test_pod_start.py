"""The pod's start command (colocate/pods/podstart.sh, pod/Dockerfile's entrypoint) loads the TLS
bundle whatever the provider puts in the environment.

It is run here as the image runs it (``/bin/sh podstart.sh <vLLM's args>``) with a fake ``vllm`` on
PATH that records its argv and loads the files it is pointed at, as uvicorn does for vLLM's flags.
The environments put provider-like variables (RunPod's, Vast.ai's: names from their docs, values of
random length) ahead of the bundle and behind it, in random orders."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.localca import LocalCA
from colocate.pods import podtls

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "colocate" / "pods" / "podstart.sh"
VLLM_ARGS = ["--model", "m", "--port", "8000", "--disable-fastapi-docs", *podtls.vllm_args()]
RUNPOD = ("RUNPOD_POD_ID", "RUNPOD_API_KEY", "PUBLIC_KEY", "RUNPOD_GPU_COUNT", "RUNPOD_POD_HOSTNAME", "RUNPOD_DC_ID")
VAST = ("CONTAINER_API_KEY", "SSH_PUBLIC_KEY", "VAST_CONTAINERLABEL", "PUBLIC_IPADDR", "VAST_TCP_PORT_8000", "CONTAINER_ID")

FAKE_VLLM = r'''#!{python}
import json, os, ssl, stat, sys
out = {{"argv": sys.argv[1:], "bundle_in_env": "COLOCATE_POD_TLS" in os.environ}}
args = sys.argv[1:]
files = {{flag: args[args.index(flag) + 1] for flag in ("--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs") if flag in args}}
try:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(files["--ssl-certfile"], files["--ssl-keyfile"])
    ctx.load_verify_locations(files["--ssl-ca-certs"])
    out["loaded"] = True
    out["modes"] = sorted({{oct(stat.S_IMODE(os.stat(p).st_mode)) for p in files.values()}})
    out["dir_mode"] = oct(stat.S_IMODE(os.stat(os.path.dirname(files["--ssl-certfile"])).st_mode))
    out["ca"] = open(files["--ssl-ca-certs"]).read()
except Exception as exc:
    out["loaded"] = False
    out["error"] = repr(exc)
json.dump(out, open(os.environ["FAKE_VLLM_OUT"], "w"))
'''


@pytest.fixture(scope="module")
def material():
    ca = LocalCA.create("start test CA")
    leaf = ca.server("localhost")
    return ca, podtls.bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem)


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "vllm"
    exe.write_text(FAKE_VLLM.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return d


def _provider_env(rng: random.Random) -> dict[str, str]:
    names = RUNPOD if rng.random() < 0.5 else VAST
    return {n: "".join(rng.choice("abcdefghijklmnop0123456789+/=") for _ in range(rng.randint(1, 600))) for n in names}


def start(fake_bin: Path, tmp: Path, ordered_env: list[tuple[str, str]], args=VLLM_ARGS) -> tuple[int, dict, str]:
    out = tmp / "vllm.json"
    out.unlink(missing_ok=True)
    env = dict(ordered_env)
    env.update(PATH=f"{fake_bin}:/usr/bin:/bin", FAKE_VLLM_OUT=str(out), TMPDIR=str(tmp))
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
        assert seen["modes"] == ["0o600"] and seen["dir_mode"] == "0o700"
        assert not seen["bundle_in_env"]  # the key is in no process's environment once vLLM runs
        # Only the three --ssl-* values change, each to its own file; every other argument is vLLM's.
        argv = seen["argv"]
        assert argv[0] == "serve" and len(argv) == 1 + len(VLLM_ARGS)
        changed = [(a, b) for a, b in zip(VLLM_ARGS, argv[1:], strict=True) if a != b]
        assert [a for a, _ in changed] == [podtls.SOURCE] * 3
        assert [Path(b).name for _, b in changed] == ["cert.pem", "key.pem", "ca.pem"]


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
    args = ["--model", "m", "--disable-fastapi-docs"]
    code, seen, err = start(fake_bin, tmp_path, [("RUNPOD_POD_ID", "abc")], args)
    assert code == 0 and seen["argv"] == ["serve", *args], err


def test_a_bundle_without_a_key_stops_before_vllm_naming_the_variable(fake_bin, tmp_path, material):
    ca, _ = material
    code, seen, err = start(fake_bin, tmp_path, [(podtls.ENV, "\n" + ca.cert_pem)])
    assert code == 78 and seen == {} and "COLOCATE_POD_TLS holds no key" in err


def test_the_dockerfile_runs_this_script_as_the_entrypoint():
    text = (ROOT / "pod" / "Dockerfile").read_text()
    assert "COPY colocate/pods/podstart.sh /usr/local/bin/colocate-pod-start" in text
    assert 'ENTRYPOINT ["/bin/sh", "/usr/local/bin/colocate-pod-start"]' in text
    assert os.access(SCRIPT, os.R_OK)
