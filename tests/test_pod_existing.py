"""An endpoint the team already runs (provider ``existing``), as scripts/pod.py checks it: real stand-ins
serving TLS on loopback stand in for the team's box, a local CA for the public ones. The check waits for
the box to serve this stack's credentials, refuses a box strangers can use, and never deletes anything."""

from __future__ import annotations

import json
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.cell.plan import ROOT
from colocate.pods import existing, lifecycle, podtls, standin
from colocate.pods.errors import NotReadyError, PodConfigError
from colocate.pods.spec import PodSpec
from colocate.sandbox.localca import LocalCA

pytestmark = pytest.mark.slow
TOKEN = "pod-token-of-the-existing-test"
NAME = "pod-apac-tw-g1.example.com"  # the kit's record on the zone for an ip endpoint


def _spec(port: int, *, host: str = NAME, ip: str = "127.0.0.1", mtls: bool = True, timeout: float = 30) -> PodSpec:
    return PodSpec.from_dict({
        "name": "colocate-own-apac-tw-g1-p0-abcdef", "stack": "own", "region": "apac-tw", "generation": "apac-tw.g1",
        "provider": "existing", "locations": ["TPE"], "gpu": "RTX 4090", "gpu_count": 1,
        "image": "example.org/colocate-vllm:v0.33.0-cu129", "min_cuda_version": "12.9",
        "model": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "port": port, "disk_gb": 40, "max_price_per_hr": 0.8,
        "cloud": "SECURE", "min_reliability": 0.98, "ready_timeout_s": timeout, "compute_ms": 1, "index": 0,
        "path": "endpoint", "tls_name": host if mtls else "", "profile": "oracle",
        "endpoint": {"host": host, "ip": ip, "port": port, "location": "TPE", "cost_per_hr": 0.35}})


@pytest.fixture(scope="module")
def pki():
    """The public CAs (a local root), the cell's CA and readiness's own, as infra/hop.py makes them."""
    public, cell, check_ca = LocalCA.create("public root"), LocalCA.create("cell CA"), LocalCA.create(
        f"colocate t {podtls.READINESS_CA}")
    return {"public": public, "cell": cell, "leaf": public.server(NAME), "worker": cell.client("colocate worker"),
            "check": check_ca.client("colocate pod readiness"), "other": public.server(NAME)}


@pytest.fixture
def env(monkeypatch, tmp_path, pki):
    """What `pulumi up` hands scripts/pod.py for an existing mutual-TLS endpoint (infra/cell.py)."""
    monkeypatch.setenv("COLOCATE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("COLOCATE_POD_POLL_S", "0.05")
    monkeypatch.setenv("POD_TOKEN", TOKEN)
    monkeypatch.setenv(podtls.BUNDLE_ENV, podtls.bundle(pki["leaf"].cert_pem, pki["leaf"].key_pem, pki["cell"].cert_pem))
    monkeypatch.setenv(podtls.CHECK_ENV, json.dumps({"cert": pki["check"].cert_pem, "key": pki["check"].key_pem,
                                                     "ca": pki["public"].cert_pem}))
    return tmp_path


def _box(tmp: Path, leaf, client_ca: str | None) -> ssl.SSLContext:
    """The box's TLS: its certificate, and (mutual TLS) the Worker's CA as the only one it admits."""
    if client_ca is not None:
        path = tmp / f"bundle-{len(list(tmp.glob('bundle-*')))}"
        path.write_text(podtls.bundle(leaf.cert_pem, leaf.key_pem, client_ca))
        return podtls.server_context(str(path))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with podtls.client_files(leaf.cert_pem, leaf.key_pem, "") as ((cert, key), _):
        ctx.load_cert_chain(cert, key)
    return ctx


def test_a_box_serving_the_stacks_certificate_is_ready_and_the_copy_of_its_key_is_removed(env, pki, capsys):
    with standin.serve(compute_ms=1, token=TOKEN, tls=_box(env, pki["leaf"], pki["cell"].cert_pem),
                       log=lambda _l: None) as box:
        spec = _spec(box.port)
        rented = lifecycle.rent(spec)
        assert rented == {"id": f"{NAME}:{box.port}", "provider": "existing", "name": spec.name}
        out = lifecycle.wait(spec, rented)
    assert out == {"id": f"{NAME}:{box.port}", "provider": "existing", "location": "TPE",
                   "url": f"https://{NAME}:{box.port}", "cost_per_hr": 0.35, "gpu": "RTX 4090", "name": spec.name,
                   "ip": "127.0.0.1", "port": box.port}
    assert "serving this stack's certificate" in capsys.readouterr().err
    assert not existing.credentials_dir(spec).exists()


def test_until_the_box_serves_them_the_credentials_wait_in_private_files_with_the_command_to_install_them(env, pki,
                                                                                                          capsys):
    # The box serves another certificate for its name (last quarter's): publicly trusted, not this stack's.
    with standin.serve(compute_ms=1, token=TOKEN, tls=_box(env, pki["other"], pki["cell"].cert_pem),
                       log=lambda _l: None) as box:
        spec = _spec(box.port, timeout=0.5)
        with pytest.raises(NotReadyError, match="did not serve this cell's credentials") as err:
            lifecycle.wait(spec, lifecycle.rent(spec))
    assert "deleted nothing" in str(err.value)
    d = existing.credentials_dir(spec)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in (existing.TOKEN_FILE, existing.TLS_FILE):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    assert (d / existing.TOKEN_FILE).read_text() == TOKEN
    assert (d / existing.TLS_FILE).read_text() == podtls.bundle_from_env()
    said = capsys.readouterr().err
    assert "another certificate" in said and f"scp -rp {d} <user>@127.0.0.1:colocate-pod" in said
    assert 'COLOCATE_POD_TLS="$(cat ~/colocate-pod/pod-tls.pem)"' in said and "podstart.sh" in said
    assert "docker run" in said and "-e COLOCATE_POD_TLS" in said and TOKEN not in said
    # Installed (the box restarted with them): the same check passes and removes the copy.
    with standin.serve(compute_ms=1, token=TOKEN, tls=_box(env, pki["leaf"], pki["cell"].cert_pem),
                       log=lambda _l: None) as box:
        spec = _spec(box.port)
        existing.write_credentials(spec, TOKEN, "x")
        assert lifecycle.wait(spec, lifecycle.rent(spec))["port"] == box.port
    assert not existing.credentials_dir(spec).exists()


def test_a_box_that_admits_any_client_certificate_is_refused_at_once(env, pki, capsys):
    with standin.serve(compute_ms=1, token=TOKEN, tls=_box(env, pki["leaf"], None), log=lambda _l: None) as box:
        spec = _spec(box.port, timeout=600)  # refused without waiting it out
        with pytest.raises(NotReadyError, match="does not check the caller's certificate") as err:
            lifecycle.wait(spec, lifecycle.rent(spec))
    assert "--ssl-cert-reqs 2" in str(err.value) and "nothing was changed or deleted" in str(err.value)
    assert capsys.readouterr().err.count("https://") == 1  # one look was enough


@pytest.fixture
def public_trust(monkeypatch, tmp_path, pki):
    """requests trusts the local root as the public ones (certifi's roots stand for them in the cloud)."""
    path = tmp_path / "public-root.pem"
    path.write_text(pki["public"].cert_pem)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(path))


def test_a_box_behind_its_own_tls_and_the_guard_is_ready(env, pki, public_trust):
    leaf = pki["public"].server("localhost")
    with standin.serve(compute_ms=1, token=TOKEN, tls=_box(env, leaf, None), log=lambda _l: None) as box:
        spec = _spec(box.port, host="localhost", ip="", mtls=False)
        out = lifecycle.create(spec)
    assert out["url"] == f"https://localhost:{box.port}" and out["ip"] == "localhost"
    assert not existing.credentials_dir(spec).exists()


def test_a_box_whose_open_routes_answer_strangers_is_refused(env, pki, public_trust):
    # No guard: the stand-in without a token answers /metrics to anyone, as vLLM does.
    leaf = pki["public"].server("localhost")
    with standin.serve(compute_ms=1, token=None, tls=_box(env, leaf, None), log=lambda _l: None) as box:
        spec = _spec(box.port, host="localhost", ip="", mtls=False, timeout=600)
        with pytest.raises(NotReadyError, match="GET /metrics answered 200 to a stranger") as err:
            lifecycle.create(spec)
    assert "runs the pod's guard" in str(err.value)


@pytest.mark.parametrize("case", ["another token", "not publicly trusted"])
def test_a_token_endpoint_waits_for_its_token_and_a_trusted_certificate(env, pki, monkeypatch, tmp_path, case):
    leaf = pki["public"].server("localhost")
    if case == "another token":
        path = tmp_path / "public-root.pem"
        path.write_text(pki["public"].cert_pem)
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(path))
    with standin.serve(compute_ms=1, token="the box's old token", tls=_box(env, leaf, None), log=lambda _l: None) as box:
        spec = _spec(box.port, host="localhost", ip="", mtls=False, timeout=0.5)
        with pytest.raises(NotReadyError) as err:
            lifecycle.create(spec)
    seen = "answered 401" if case == "another token" else "not publicly trusted"
    assert seen in str(err.value)
    d = existing.credentials_dir(spec)
    assert (d / existing.TOKEN_FILE).read_text() == TOKEN and not (d / existing.TLS_FILE).exists()


def _pod_py(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/pod.py"), *argv], capture_output=True, text=True,
                          env=env, timeout=60, cwd=ROOT)


def test_pod_py_never_deletes_an_endpoint():
    proc = _pod_py("delete", "--id", f"{NAME}:8443", "--provider", "existing")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "the kit never deletes it" in proc.stderr and "Fix:" in proc.stderr
    with pytest.raises(PodConfigError):
        lifecycle.provider_for("existing").destroy(f"{NAME}:8443")
    assert lifecycle.provider_for("existing").list_pods() == []  # a sweep finds nothing of it to delete


def test_the_printed_start_command_without_docker_runs_as_pasted_and_leaves_no_copy(env, pki, tmp_path, capsys):
    """The bare form of the printed install (a checkout of the kit on the box, vLLM on PATH): read the files,
    remove them, exec podstart.sh with the bundle; a fake vllm (tests/test_pod_start.py) loads what it gets."""
    from tests.test_pod_start import FAKE_VLLM

    spec = _spec(8443, timeout=0.1)
    with pytest.raises(NotReadyError):
        lifecycle.wait(spec, lifecycle.rent(spec))  # nothing serves: the files and the commands are printed
    bare = next(line for line in capsys.readouterr().err.splitlines() if "podstart.sh" in line and "(export" in line)
    bare = bare[bare.index("(export"):]
    home, checkout, bin_dir = tmp_path / "home", tmp_path / "checkout", tmp_path / "bin"
    for d in (home, checkout, bin_dir):
        d.mkdir()
    subprocess.run(["cp", "-rp", str(existing.credentials_dir(spec)), str(home / "colocate-pod")], check=True)  # as scp -rp
    (checkout / "colocate").symlink_to(ROOT / "colocate")
    (bin_dir / "vllm").write_text(FAKE_VLLM.format(python=sys.executable))
    (bin_dir / "vllm").chmod(0o755)
    out = tmp_path / "vllm.json"
    run = subprocess.run(["/bin/sh", "-c", f"{bare}\nwait"], cwd=checkout, timeout=60, capture_output=True, text=True,
                         env={"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_VLLM_OUT": str(out)})
    assert run.returncode == 0, run.stderr + (checkout / "colocate-pod.log").read_text()
    seen = json.loads(out.read_text())
    assert seen["loaded"] and not seen["bundle_in_env"] and seen["guard"].endswith("colocate_pod_guard.py"), seen
    assert seen["ca"].strip() == pki["cell"].cert_pem.strip()  # the box admits the Worker's CA, and only it
    assert not (home / "colocate-pod").exists()


@pytest.mark.parametrize("mtls", [True, False])
def test_a_box_that_never_answers_fails_the_check_with_what_it_saw_and_nothing_deleted(env, mtls):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = _spec(port, timeout=0.3, **({} if mtls else {"host": "localhost", "ip": ""}), mtls=mtls)
    with pytest.raises(NotReadyError) as err:
        lifecycle.create(spec)
    said = str(err.value)
    assert f"endpoint 0 (https://{spec.endpoint['host']}:{port}) did not serve" in said
    assert ("no TLS 1.3 handshake" if mtls else "no answer") in said and "the kit deleted nothing" in said
