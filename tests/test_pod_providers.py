"""scripts/pod.py against fake RunPod v2 / Vast.ai servers that validate every call against the vendors' specs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from colocate.cell import catalogue
from colocate.cell.plan import PodPlan
from colocate.cell.settings import POD_DEFAULTS, PodSettings
from tests.support.fake_providers import API_KEY, FakeRunPod, FakeVast, offer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import pod  # noqa: E402  (scripts/pod.py)

TOKEN = "pod-token-s3cret"


def make_spec(region: str, provider: str, stack: str = "t1", gen: int = 1, **over) -> dict:
    d = {**POD_DEFAULTS, "provider": provider, "readyTimeoutS": 20, "computeMs": 1,
         "gpu": "RTX 4090" if provider == "vastai" else POD_DEFAULTS["gpu"], **over}
    settings = PodSettings(provider=d["provider"], gpu=d["gpu"], gpu_count=d["gpuCount"], image=d["image"],
                           model=d["model"], port=d["port"], disk_gb=d["diskGb"], max_price_per_hr=d["maxPricePerHr"],
                           cloud=d["cloud"], min_reliability=d["minReliability"], ready_timeout_s=d["readyTimeoutS"],
                           compute_ms=d["computeMs"], min_cuda_version=d["minCudaVersion"],
                           # The providers' mechanics, not the pod's timing: a local pod answers in computeMs.
                           profile=over.get("profile", "oracle"),
                           # The providers' placement, not the hop: tests/test_pod_hop.py covers mutual TLS.
                           hop="auto" if over.get("hop", "token") == "token" else over["hop"])
    generation = f"{region}.g{gen}"
    plan = PodPlan(index=0, name=f"colocate-{stack}-{generation}".replace(".", "-"), stack=stack, region=region,
                   generation=generation, settings=settings,
                   locations=catalogue.region(region).locations(provider), pod_hostname=None)
    spec = plan.spec()
    if over.get("hop", "token") == "token":
        spec["tls_name"] = ""  # a plain-HTTP pod: the providers' mechanics (a zone refuses it in the plan)
    return spec


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("POD_TOKEN", TOKEN)
    monkeypatch.setenv("COLOCATE_POD_POLL_S", "0.05")
    monkeypatch.setenv("COLOCATE_POD_BACKOFF_S", "0.05")
    monkeypatch.setenv("COLOCATE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("PULUMI_COMMAND_STDOUT", raising=False)
    return tmp_path


def serving(fake, monkeypatch, env_prefix: str, api: str):
    """A fixture body: ``fake`` started as the API the client finds in ``<env_prefix>_API_BASE``;
    the test fails on any request or answer outside ``api``'s spec."""
    fake.start()
    monkeypatch.setenv(f"{env_prefix}_API_BASE", fake.url)
    monkeypatch.setenv(f"{env_prefix}_API_KEY", API_KEY)
    yield fake
    fake.stop()
    assert fake.violations == [], f"requests or answers outside the {api} spec:\n" + "\n".join(fake.violations)


@pytest.fixture
def fake_runpod(env, monkeypatch):
    yield from serving(FakeRunPod(pod_token=TOKEN), monkeypatch, "RUNPOD", "RunPod v2")


@pytest.fixture
def fake_vast(env, monkeypatch):
    yield from serving(FakeVast(pod_token=TOKEN), monkeypatch, "VASTAI", "Vast.ai")


def stack_file(directory: Path, stack: str = "t1", provider: str = "runpod", secret_key: bool = False) -> str:
    """A minimal stack file for sweep (which needs the stack to exist and reads its provider)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["config:", "  colocate:region: apac-jp", "  colocate:pod:", f"    provider: {provider}"]
    if secret_key:
        lines.append(f"  colocate:{provider}ApiKey:\n    secure: v1:AAAA")
    (directory / f"Pulumi.{stack}.yaml").write_text("\n".join(lines) + "\n")
    return str(directory)


def sweep_argv(env: Path, *extra: str, stack: str = "t1", provider: str = "runpod") -> list[str]:
    return ["sweep", "--stack", stack, "--stacks-dir", stack_file(env / "stacks", stack, provider), *extra]


def run(capsys, argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        import io
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = pod.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) <= 1, f"stdout must hold at most one JSON object: {out!r}"
    return code, (json.loads(lines[0]) if lines else None), err


def write_spec(tmp_path, spec) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


# ------------------------------------------------------------------ RunPod
def test_runpod_happy_path_pins_the_data_centre_and_waits_for_health(fake_runpod, env, capsys):
    fake_runpod.ready_after = 3
    spec = make_spec("apac-jp", "runpod")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 0, err
    assert set(out) >= {"id", "provider", "location", "url", "cost_per_hr", "gpu", "name", "ip", "port"}
    assert out["provider"] == "runpod" and out["location"] == "AP-JP-1" and out["name"] == "colocate-t1-apac-jp-g1"
    assert requests.get(out["url"] + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).status_code == 200
    sent = fake_runpod.calls("POST", "/v2/pods")
    assert len(sent) == 1 and sent[0]["dataCenterIds"] == ["AP-JP-1"] and sent[0]["ports"] == ["8000/tcp"]
    assert sent[0]["env"] == {"VLLM_API_KEY": TOKEN} and "--quantization gptq_marlin" in sent[0]["args"]
    assert TOKEN not in err and API_KEY not in err and "elapsed" not in out
    assert "PROVISIONING" in err and "health 200" in err  # progress lines on stderr


def test_existing_pod_with_the_name_is_adopted_not_duplicated(fake_runpod, env, capsys):
    spec_file = write_spec(env, make_spec("apac-jp", "runpod"))
    code, first, _ = run(capsys, ["create", "--spec", spec_file])
    code2, second, err = run(capsys, ["create", "--spec", spec_file])
    assert (code, code2) == (0, 0)
    assert second["id"] == first["id"] and second.get("adopted") is True and "adopting" in err
    assert len(fake_runpod.live()) == 1 and len(fake_runpod.calls("POST", "/v2/pods")) == 1


def test_capacity_only_in_the_second_location(fake_runpod, env, capsys):
    fake_runpod.capacity["US-DE-1"] = False
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod"))])
    assert code == 0, err
    assert out["location"] == "US-NC-1"
    assert [b["dataCenterIds"] for b in fake_runpod.calls("POST", "/v2/pods")] == [["US-DE-1"], ["US-NC-1"]]
    assert "not placed: US-DE-1 400" in err


def test_no_capacity_anywhere_fails_with_a_table_and_leaves_nothing(fake_runpod, env, capsys):
    locations = catalogue.region("us-east").locations("runpod")
    fake_runpod.capacity.update({loc: False for loc in locations})
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod"))])
    assert code == 1 and out is None
    for loc in locations:
        assert loc in err
    assert "location" in err and "no longer any instances available" in err
    assert [b["dataCenterIds"][0] for b in fake_runpod.calls("POST", "/v2/pods")] == list(locations)  # never elsewhere
    assert fake_runpod.live() == []


US_EAST = catalogue.region("us-east").locations("runpod")


def test_runpod_any_400_moves_to_the_next_data_centre(fake_runpod, env, capsys):
    # The spec: capacity has no code, only prose, so a wording the client has never seen must not
    # abort a region whose next data centre has room.
    fake_runpod.refusals[US_EAST[0]] = (400, "Pool drained for maintenance; come back in a few minutes.")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod"))])
    assert code == 0, err
    assert out["location"] == US_EAST[1]
    assert [b["dataCenterIds"] for b in fake_runpod.calls("POST", "/v2/pods")] == [[US_EAST[0]], [US_EAST[1]]]
    assert "Pool drained for maintenance" in err and US_EAST[0] in err


def test_runpod_400_everywhere_gives_the_last_detail_as_a_possible_request_problem(fake_runpod, env, capsys):
    fake_runpod.refusals.update({loc: (400, f"rule {i} broken: disk too small for this image")
                                 for i, loc in enumerate(US_EAST)})
    fake_runpod.refusals[US_EAST[0]] = (400, f"env VLLM_API_KEY={TOKEN} is not allowed")  # a detail quoting the request
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod"))])
    assert code == 1 and out is None
    assert [b["dataCenterIds"][0] for b in fake_runpod.calls("POST", "/v2/pods")] == list(US_EAST)
    last = f"rule {len(US_EAST) - 1} broken: disk too small for this image"
    assert f"last detail ({US_EAST[-1]}): {last!r}" in err
    assert "may be a problem with the request" in err and "no capacity for" not in err
    assert all(loc in err for loc in US_EAST) and '"dataCenterIds"' in err  # the table and what was sent
    assert TOKEN not in err and API_KEY not in err
    assert fake_runpod.live() == []


def test_runpod_403_is_a_permission_error_naming_the_key(fake_runpod, env, capsys):
    fake_runpod.refusals.update({loc: (403, "access denied") for loc in US_EAST})
    spec_file = write_spec(env, make_spec("us-east", "runpod"))
    code, out, err = run(capsys, ["create", "--spec", spec_file])
    assert code == 1 and out is None
    assert "403 Forbidden in every data centre" in err and "'access denied'" in err
    assert "RUNPOD_API_KEY" in err and "colocate:runpodApiKey" in err and "write access to pods" in err
    assert "no capacity for" not in err and "may be a problem with the request" not in err
    assert fake_runpod.live() == []
    # The spec's createPod table: a 403 in one pool is "skip this candidate, keep going".
    fake_runpod.refusals = {US_EAST[0]: (403, "access denied")}
    code, out, err = run(capsys, ["create", "--spec", spec_file])
    assert code == 0, err
    assert out["location"] == US_EAST[1] and "403 forbidden: access denied" in err


def test_runpod_422_stops_at_the_first_data_centre(fake_runpod, env, capsys):
    # A contract violation is the same everywhere: "Fix the request. Never retry."
    fake_runpod.refusals[US_EAST[0]] = (422, "Request validation failed.")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod"))])
    assert code == 1 and out is None and "422" in err and "Request validation failed." in err
    assert len(fake_runpod.calls("POST", "/v2/pods")) == 1


def test_runpod_create_asks_for_a_host_with_the_images_cuda(fake_runpod, env, capsys):
    # vllm/vllm-openai:v0.33.0-cu129 is built for CUDA 12.9: an older host never gets healthy, and
    # create would burn readyTimeoutS on it.
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 0, err
    assert fake_runpod.calls("POST", "/v2/pods")[-1]["gpu"] == {
        "id": POD_DEFAULTS["gpu"], "count": 1, "minCudaVersion": "12.9"}
    run(capsys, ["delete", "--id", out["id"], "--provider", "runpod"])
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod", minCudaVersion="12.11"))])
    assert code == 0, err
    assert fake_runpod.calls("POST", "/v2/pods")[-1]["gpu"]["minCudaVersion"] == "12.11"  # text, never 12.11 the number


def test_runpod_without_a_cuda_floor_sends_none(fake_runpod, env, capsys):
    code, _, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod", minCudaVersion=""))])
    assert code == 0, err
    assert "minCudaVersion" not in fake_runpod.calls("POST", "/v2/pods")[-1]["gpu"]  # "" would break the spec's pattern


def test_a_spec_whose_cuda_floor_is_not_major_minor_is_refused(fake_runpod, env, capsys):
    spec = {**make_spec("apac-jp", "runpod"), "min_cuda_version": "12"}  # hand-edited
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 2 and out is None and "spec.min_cuda_version" in err and "'12'" in err and "colocate:pod.minCudaVersion" in err
    assert fake_runpod.log == []  # refused at the edge, before any call


def test_rate_limited_then_success_honours_retry_after(fake_runpod, env, capsys):
    fake_runpod.rate_limit("POST", "/v2/pods", count=1, retry_after="1")
    t0 = time.monotonic()
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 0, err
    posts = fake_runpod.calls("POST", "/v2/pods")
    assert len(posts) == 2  # the 429 and the retry
    assert len(fake_runpod.live()) == 1
    # the retry came no sooner than Retry-After (1 s), not after the 0.05 s backoff
    assert time.monotonic() - fake_runpod.rate_limited_at[0] >= 0.95 and time.monotonic() - t0 >= 0.95


def test_a_create_whose_reply_is_lost_is_adopted_not_repeated(fake_runpod, env, capsys):
    # The POST lands but its answer is a 503: posting again blindly would rent a second GPU.
    fake_runpod.lost_create_replies = 1
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 0, err
    assert len(fake_runpod.calls("POST", "/v2/pods")) == 1, "no second create after the lost reply"
    assert [p["id"] for p in fake_runpod.live()] == [out["id"]]
    assert "looking for" in err


def test_readiness_timeout_destroys_the_pod(fake_runpod, env, capsys):
    fake_runpod.healthy = False  # RUNNING, address known, but /health answers 500
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod", readyTimeoutS=1))])
    assert code == 1 and out is None
    assert "not ready after 1s" in err and "health 500" in err and "destroyed" in err
    assert fake_runpod.live() == []


def test_slow_readiness_reports_progress_and_succeeds(fake_runpod, env, capsys):
    fake_runpod.ready_after = 12
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 0, err
    progress = [line for line in err.splitlines() if "PROVISIONING" in line]
    assert len(progress) >= 10 and progress[0].lstrip().startswith("[")


def test_delete_twice_and_from_pulumi_stdout(fake_runpod, env, capsys, monkeypatch):
    code, created, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 0
    monkeypatch.setenv("PULUMI_COMMAND_STDOUT", json.dumps(created))
    code, out, _ = run(capsys, ["delete"])
    assert code == 0 and out == {"id": created["id"], "provider": "runpod", "deleted": True, "already_gone": False}
    assert fake_runpod.live() == []
    code, out, _ = run(capsys, ["delete", "--id", created["id"], "--provider", "runpod"])
    assert code == 0 and out["already_gone"] is True


def test_status_prints_state(fake_runpod, env, capsys):
    code, created, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    code, out, _ = run(capsys, ["status", "--id", created["id"], "--provider", "runpod"])
    assert code == 0 and out["state"] == "running" and out["raw_state"] == "RUNNING" and out["url"] == created["url"]
    run(capsys, ["delete", "--id", created["id"], "--provider", "runpod"])
    code, out, err = run(capsys, ["status", "--id", created["id"], "--provider", "runpod"])
    assert code == 1 and "404" in err


def test_runpod_cannot_serve_taiwan_exit_2_suggesting_vastai(env, capsys, monkeypatch):
    spec = make_spec("apac-jp", "runpod")
    spec["region"] = "apac-tw"  # a stale or hand-edited spec
    monkeypatch.setenv("RUNPOD_API_KEY", "k")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 2 and out is None and "vastai" in err and "Taiwan" in err


def test_a_location_outside_the_region_is_refused(env, capsys, monkeypatch):
    spec = make_spec("apac-jp", "runpod")
    spec["locations"] = ["AP-JP-1", "US-DE-1"]
    monkeypatch.setenv("RUNPOD_API_KEY", "k")
    code, _, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 2 and "US-DE-1" in err and "spec.locations" in err


def test_missing_key_and_token_are_config_errors(env, capsys, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    spec_file = write_spec(env, make_spec("apac-jp", "runpod"))
    code, _, err = run(capsys, ["create", "--spec", spec_file])
    assert code == 2 and "RUNPOD_API_KEY" in err
    monkeypatch.delenv("POD_TOKEN")
    monkeypatch.setenv("RUNPOD_API_KEY", "k")
    code, _, err = run(capsys, ["create", "--spec", spec_file])
    assert code == 2 and "POD_TOKEN" in err
    assert pod.main(["create"]) == 2 and pod.main(["nonsense"]) == 2


def test_unauthorised_fails_at_once_and_redacts(fake_runpod, env, capsys, monkeypatch):
    monkeypatch.setenv("RUNPOD_API_KEY", "wrong-key-value")
    code, _, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod"))])
    assert code == 1 and "401" in err and "wrong-key-value" not in err and TOKEN not in err
    fake_runpod.violations.clear()  # the fake records nothing here, but be explicit: a 401 is an expected answer


def test_crash_between_create_and_readiness_is_found_by_sweep(fake_runpod, env, capsys):
    """A real process killed with SIGKILL mid-readiness (no cleanup possible); sweep finds and destroys the pod."""
    fake_runpod.ready_after = 10_000  # never ready
    spec_file = write_spec(env, make_spec("apac-jp", "runpod", readyTimeoutS=60))
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "pod.py"), "create", "--spec", spec_file],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not fake_runpod.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake_runpod.live(), "the subprocess never created a pod"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    stray = fake_runpod.live()[0]["id"]
    code, out, _ = run(capsys, sweep_argv(env, "--provider", "runpod"))
    assert code == 0 and [s["id"] for s in out["strays"]] == [stray] and out["destroyed"] == []
    assert len(fake_runpod.live()) == 1  # listing alone destroys nothing
    code, out, _ = run(capsys, sweep_argv(env, "--provider", "runpod", "--destroy"))
    assert code == 0 and out["destroyed"] == [stray] and fake_runpod.live() == []


def test_sigterm_during_readiness_destroys_the_pod(fake_runpod, env):
    fake_runpod.ready_after = 10_000
    spec_file = write_spec(env, make_spec("apac-jp", "runpod", readyTimeoutS=60))
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "pod.py"), "create", "--spec", spec_file],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(), cwd=ROOT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not fake_runpod.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode != 0 and out == "" and "destroyed" in err
    assert fake_runpod.live() == []


def test_sigterm_while_the_create_is_answered_destroys_the_pod_it_made(fake_runpod, env):
    """The signal lands while pod.py waits for the create's answer (inside the HTTP client): it
    stops at the next safe point, after the answer, and destroys the pod it made (stop.py)."""
    fake_runpod.ready_after = 10_000
    spec_file = write_spec(env, make_spec("apac-jp", "runpod", readyTimeoutS=60))
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "pod.py"), "create", "--spec", spec_file],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(), cwd=ROOT, text=True)

    def signal_then_answer(_pod_id):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal arrives while pod.py reads the answer

    fake_runpod.on_create = signal_then_answer
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 130 and out == "" and "interrupted" in err, err[-2000:]
    assert fake_runpod.live() == []


def test_sweep_keeps_the_current_pod_and_ignores_other_stacks(fake_runpod, env, capsys):
    _, keep, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod", gen=2))])
    _, other, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod", stack="t1-b"))])
    _, old, _ = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-jp", "runpod", gen=1))])
    code, out, _ = run(capsys, sweep_argv(env, "--provider", "runpod", "--keep", keep["id"], "--destroy"))
    assert code == 0 and out["destroyed"] == [old["id"]]
    assert sorted(p["id"] for p in fake_runpod.live()) == sorted([keep["id"], other["id"]])


# ------------------------------------------------------------------ Vast.ai
def test_vastai_happy_path_cheapest_in_region_offer(fake_vast, env, capsys):
    fake_vast.offers = [offer(11, "TW", 0.55), offer(12, "TW", 0.41), offer(13, "JP", 0.20, city="Tokyo"),
                        offer(14, "TW", 0.30, reliability=0.90), offer(15, "TW", 0.95)]
    fake_vast.ready_after = 3
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", maxPricePerHr=0.6))])
    assert code == 0, err
    assert out["provider"] == "vastai" and out["location"] == "TW" and out["cost_per_hr"] == 0.41
    assert fake_vast.calls("PUT", "/api/v0/asks/")[0]["label"] == "colocate-t1-apac-tw-g1"
    search = fake_vast.calls("POST", "/api/v0/bundles")[0]
    assert search["geolocation"] == {"in": ["TW"]} and search["dph_total"] == {"lte": 0.6}
    assert search["reliability"] == {"gte": 0.98} and search["direct_port_count"] == {"gte": 1}
    assert requests.get(out["url"] + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).ok
    assert TOKEN not in err


def test_vastai_search_asks_for_the_cuda_floor_the_disk_and_its_price(fake_vast, env, capsys):
    fake_vast.offers = [offer(16, "TW", 0.3)]
    code, _, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", diskGb=60))])
    assert code == 0, err
    search = fake_vast.calls("POST", "/api/v0/bundles")[0]
    assert search["cuda_max_good"] == {"gte": 12.9}  # offers carry it as a number
    assert search["disk_space"] == {"gte": 60} and search["allocated_storage"] == 60
    assert fake_vast.calls("PUT", "/api/v0/asks/")[0]["disk"] == 60


@pytest.mark.parametrize("cloud,datacenter", [("SECURE", {"eq": True}), ("COMMUNITY", None)])
def test_vastai_rents_datacenter_hosts_unless_the_owner_relaxes_it(fake_vast, env, capsys, cloud, datacenter):
    fake_vast.offers = [offer(18, "TW", 0.2, datacenter=False), offer(19, "TW", 0.3)]  # the cheaper one is at home
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", cloud=cloud))])
    assert code == 0, err
    assert fake_vast.calls("POST", "/api/v0/bundles")[0].get("datacenter") == datacenter
    assert out["cost_per_hr"] == (0.3 if cloud == "SECURE" else 0.2)


def test_vastai_without_a_cuda_floor_sends_none(fake_vast, env, capsys):
    fake_vast.offers = [offer(17, "TW", 0.3, cuda=11.8)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", minCudaVersion=""))])
    assert code == 0, err
    assert "cuda_max_good" not in fake_vast.calls("POST", "/api/v0/bundles")[0]


def test_vastai_an_offer_below_the_cuda_floor_or_short_on_disk_is_not_rented_even_if_returned(fake_vast, env, capsys):
    # A server that drops these filters (or a stale index) must not get the pod onto such a host:
    # vLLM would never start on the one, and the other refuses the rent.
    fake_vast.ignored_filters = {"cuda_max_good", "disk_space"}
    fake_vast.offers = [offer(61, "TW", 0.30, cuda=12.4), offer(62, "TW", 0.35, disk_space=20.0), offer(63, "TW", 0.50)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 0, err
    assert [path for _, path, _ in fake_vast.log if path.startswith("/api/v0/asks/")] == ["/api/v0/asks/63"]
    assert out["cost_per_hr"] == 0.50
    # With nothing else in the region, the table says what the offers lacked.
    fake_vast.offers = [offer(64, "TW", 0.30, cuda=12.4)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", stack="t2"))])
    assert code == 1 and out is None and "CUDA >= 12.9" in err and "40 GB disk" in err
    assert fake_vast.calls("PUT", "/api/v0/asks/64") == []


def test_vastai_price_cap_holds_for_the_disk_that_is_rented(fake_vast, env, capsys):
    # dph_total includes storage for the searched disk size (8 GB unless allocated_storage says
    # otherwise): offer 71 quotes $0.54/h at 8 GB but costs $0.70/h with the 40 GB create rents.
    fake_vast.offers = [offer(71, "TW", 0.50, storage_cost=3.6), offer(72, "TW", 0.55)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", maxPricePerHr=0.6))])
    assert code == 0, err
    assert out["cost_per_hr"] == 0.55 and fake_vast.calls("PUT", "/api/v0/asks/71") == []


def test_vastai_taken_offer_moves_to_the_next(fake_vast, env, capsys):
    fake_vast.offers = [offer(21, "TW", 0.30), offer(22, "TW", 0.40)]
    fake_vast.taken.add(21)
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 0, err
    assert out["cost_per_hr"] == 0.40 and "taken" in err


def test_vastai_403_on_rent_is_a_permission_error_not_capacity(fake_vast, env, capsys):
    fake_vast.offers = [offer(25, "TW", 0.30), offer(26, "TW", 0.40)]
    fake_vast.rent_refusals[25] = (
        403,
        {
            "success": False,
            "error": "invalid_args",
            "ask_id": 25,
            "msg": "error 403/3586: Offer 25 is not your own. Hosts can only rent their own machines.",
        },
    )
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 1 and out is None
    assert "with 403" in err and "Hosts can only rent their own machines" in err
    assert "VASTAI_API_KEY" in err and "colocate:vastaiApiKey" in err and "no capacity" not in err
    assert len(fake_vast.calls("PUT", "/api/v0/asks/")) == 1 and fake_vast.live() == []
    assert TOKEN not in err and API_KEY not in err


def test_vastai_no_offers_fails_with_a_table(fake_vast, env, capsys):
    fake_vast.offers = [offer(31, "JP", 0.2, city="Tokyo"), offer(32, "TW", 2.0)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 1 and out is None and "no offer" in err and "TW" in err
    assert fake_vast.calls("PUT", "/api/v0/asks/") == [] and fake_vast.live() == []


def test_vastai_exited_instance_is_destroyed(fake_vast, env, capsys):
    fake_vast.offers = [offer(41, "TW", 0.3)]
    fake_vast.ready_after = 100
    fake_vast.dies_after = 3
    code, _, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 1 and "exited" in err and "never serve" in err
    assert fake_vast.live() == []


def test_vastai_429_then_success_and_delete_twice(fake_vast, env, capsys):
    fake_vast.offers = [offer(51, "TW", 0.3)]
    # (the spec declares 429 for renting and showing instances, not for the offer search)
    fake_vast.rate_limit("PUT", "/api/v0/asks/", count=1, retry_after="0")
    fake_vast.rate_limit("GET", "/api/v0/instances/", count=2, retry_after="0")
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 0, err
    assert len(fake_vast.calls("PUT", "/api/v0/asks/")) == 2 and len(fake_vast.live()) == 1
    for expect_gone in (False, True):
        code, res, _ = run(capsys, ["delete", "--id", out["id"], "--provider", "vastai"])
        assert code == 0 and res["already_gone"] is expect_gone
    assert fake_vast.live() == []


def test_vastai_cannot_serve_us_east(env, capsys, monkeypatch):
    spec = make_spec("apac-tw", "vastai")
    spec["region"] = "us-east"
    monkeypatch.setenv("VASTAI_API_KEY", "k")
    code, _, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 2 and "runpod" in err


def test_fake_rejects_a_request_outside_the_spec(fake_runpod):
    """The fake itself must fail loudly: a v1-style path and an unknown body field are violations."""
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.post(
        fake_runpod.url + "/v2/pods", json={"name": "x", "image": "i", "gpu": {"id": "g"}, "bogus": 1}, headers=h, timeout=5
    )
    assert r.status_code == 599
    r = requests.get(fake_runpod.url + "/v1/pods", headers=h, timeout=5)
    assert r.status_code == 599
    assert len(fake_runpod.violations) == 2 and "bogus" in fake_runpod.violations[0]
    fake_runpod.violations.clear()


def test_runpod_without_a_zone_exposes_http_and_reports_the_proxy_address(fake_runpod, env, capsys, monkeypatch):
    """The provider-proxy path: the Worker cannot fetch an IP address, so the pod's port is
    exposed as RunPod HTTP (its proxy hostname) and readiness is checked through it."""
    monkeypatch.setenv("RUNPOD_PROXY_TEMPLATE", fake_runpod.proxy_template)
    spec = {**make_spec("apac-jp", "runpod"), "path": "provider-proxy"}
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 0, err
    sent = fake_runpod.calls("POST", "/v2/pods")
    assert sent[-1]["ports"] == ["8000/http"]
    assert out["url"] == fake_runpod.proxy_template.format(pod_id=out["id"], port=8000)
    assert requests.get(out["url"] + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).status_code == 200


def test_the_real_proxy_address_form():
    from colocate.cell.plan import runpod_proxy_url

    assert runpod_proxy_url("abc123", 8000) == "https://abc123-8000.proxy.runpod.net"


def test_a_running_pod_without_a_public_address_fails_fast_with_the_fix(fake_runpod, env, capsys, monkeypatch):
    # A Community host may give the pod no public ip: fail soon after it runs, not at readyTimeoutS.
    fake_runpod.public_ip = False
    monkeypatch.setenv("COLOCATE_POD_NO_ADDRESS_S", "0.2")
    spec = make_spec("apac-jp", "runpod", readyTimeoutS=600)
    spec["path"] = "zone-dns"
    t = time.monotonic()
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, spec)])
    assert code == 1 and out is None and time.monotonic() - t < 120
    assert "no public address" in err and "pulumi config set --path colocate:pod.cloud SECURE" in err
    assert "destroyed" in err and fake_runpod.live() == []


def test_runpod_a_pod_placed_outside_the_region_is_deleted_and_the_next_location_tried(fake_runpod, env, capsys):
    """v2's dataCenterIds are preferred data centers: RunPod may put the pod elsewhere. The first create
    lands in EU-RO-1 (outside apac-jp): it is deleted at once and the next location of the region is tried."""
    locations = catalogue.region("us-east").locations("runpod")
    fake_runpod.placed_in = {locations[0]: "EU-RO-1"}
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod"))])
    assert code == 0, err
    assert out["location"] == locations[1] and [p["id"] for p in fake_runpod.live()] == [out["id"]]
    assert "placed in EU-RO-1, outside us-east" in err
    assert [b["dataCenterIds"] for b in fake_runpod.calls("POST", "/v2/pods")] == [[locations[0]], [locations[1]]]
    # Nowhere in the region: nothing is left running, and the table says where each one landed.
    fake_runpod.placed_in = {loc: "EU-RO-1" for loc in locations}
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("us-east", "runpod", stack="t2"))])
    assert code == 1 and out is None and "EU-RO-1" in err
    assert [p["id"] for p in fake_runpod.live()] == [fake_runpod.live()[0]["id"]]  # only the first stack's


def test_vastai_offers_are_capped_on_traffic_as_well_as_the_hour(fake_vast, env, capsys):
    """Each boot pulls ~16 GB: an offer that bills traffic above colocate:pod.maxTransferPerGb ($0.02/GB by
    default) is neither asked for nor rented, even if the server returns it. No `type` is sent: on-demand
    is the spec's default (its enum lists "ondemand"; the official client sends "on-demand")."""
    fake_vast.ignored_filters = {"inet_down_cost", "inet_up_cost"}
    fake_vast.offers = [offer(81, "TW", 0.20, inet_cost=0.20), offer(82, "TW", 0.40)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai"))])
    assert code == 0, err
    search = fake_vast.calls("POST", "/api/v0/bundles")[0]
    assert search["inet_down_cost"] == {"lte": 0.02} and search["inet_up_cost"] == {"lte": 0.02}
    assert "type" not in search
    assert out["cost_per_hr"] == 0.40 and fake_vast.calls("PUT", "/api/v0/asks/81") == []
    fake_vast.offers = [offer(83, "TW", 0.20, inet_cost=0.20)]
    code, out, err = run(capsys, ["create", "--spec", write_spec(env, make_spec("apac-tw", "vastai", stack="t2"))])
    assert code == 1 and "$0.02/GB of traffic" in err


def test_the_vast_specs_type_enum_is_what_the_kit_relies_on():
    import yaml

    from tests.support.fake_providers import SPECS

    spec = yaml.safe_load((SPECS / "vastai-openapi.yaml").read_text())
    body = spec["paths"]["/api/v0/bundles"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    kind = body["properties"]["type"]
    assert "ondemand" in kind["enum"] and "on-demand" not in kind["enum"] and "Default" in kind["description"]
