"""A `pod.py` killed with SIGKILL at any phase leaves no pod billing off the record.

pulumi-command cancels a create (Ctrl-C, `pulumi cancel`, a timeout) with SIGKILL: no handler
runs. Each test kills a real `scripts/pod.py` process against the fake RunPod (held to the v2
spec) at one phase, then plays what comes next: the next `pulumi up` (`rent` then `wait` of the
same spec, which adopts the pod by name; or of a changed spec, followed by the program's sweep
with the declared ids kept), or `pulumi destroy` (the rent's delete with the rent's output).
Every path ends with 0 live pods."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from tests.test_pod_providers import env, fake_runpod, fake_vast, make_spec, offer, pod, stack_file, write_spec  # noqa: F401

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
POD = [sys.executable, str(ROOT / "scripts" / "pod.py")]


def pod_py(*argv: str, stdin: str | None = None, extra_env: dict | None = None) -> tuple[int, dict | None, str]:
    """scripts/pod.py's main in this process, as tests/test_pod_providers.py runs it: only the
    killed command needs a process of its own (SIGKILL lands in it mid-call); what comes after
    finds the pod through the provider alone either way, and a process start is a third of a
    CPU-second of imports."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, extra_env or {}), mock.patch.object(sys, "stdin", io.StringIO(stdin or "")), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pod.main(list(argv))
    text = out.getvalue().strip()
    return code, (json.loads(text) if text else None), err.getvalue()


def start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([*POD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    printed = proc.stdout.read()
    proc.stdout.close()
    proc.stderr.close()
    assert printed == ""  # nothing printed: pulumi-command records nothing


def wait_until(check, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def killed_while_creating(fake, *argv: str) -> str:
    """Run ``pod.py argv`` and SIGKILL it once its create has landed but before the answer reaches it."""
    landed, release, ids = threading.Event(), threading.Event(), []

    def hold(pod_id: str) -> None:
        ids.append(pod_id)
        landed.set()
        release.wait(30)

    fake.on_create = hold
    proc = start(*argv)
    try:
        assert landed.wait(60), "the create never reached the provider"
        kill(proc)
    finally:
        release.set()
        fake.on_create = None
    return ids[0]


def killed_while_waiting(fake, *argv: str) -> str:
    """Run ``pod.py argv`` and SIGKILL it while it polls a rented pod that is still provisioning."""
    fake.ready_after = 10 ** 6
    proc = start(*argv)
    try:
        wait_until(lambda: any(n >= 3 for n in fake.polls.values()), "the readiness polls")
        kill(proc)
    finally:
        fake.ready_after = 1  # the pod boots now: the next poll finds it running
    return next(iter(fake.polls))


def next_up(spec_path: str) -> tuple[dict, dict]:
    """What the next `pulumi up` runs for the pod: rent, then wait on the rent's output."""
    code, rented, err = pod_py("rent", "--spec", spec_path)
    assert code == 0, err
    spec = json.loads(Path(spec_path).read_text())
    code, ready, err = pod_py("wait", "--spec", "-", stdin=json.dumps({**spec, "rented": rented}))
    assert code == 0, err
    return rented, ready


def destroy(rented: dict) -> dict:
    """`pulumi destroy`: the rent's delete, with the rent's output as PULUMI_COMMAND_STDOUT."""
    code, out, err = pod_py("delete", extra_env={"PULUMI_COMMAND_STDOUT": json.dumps(rented)})
    assert code == 0, err
    return out


def live(fake) -> list[str]:
    return [p["id"] for p in fake.live()]


@pytest.mark.parametrize("command", ["rent", "create"])
def test_killed_while_its_create_is_in_flight_the_next_up_adopts_the_pod_and_destroy_deletes_it(
        fake_runpod, env, command):  # noqa: F811
    spec = write_spec(env, make_spec("apac-jp", "runpod"))
    landed = killed_while_creating(fake_runpod, command, "--spec", spec)
    assert live(fake_runpod) == [landed]  # billing, on no record: what the next up must find
    rented, ready = next_up(spec)
    assert rented["id"] == ready["id"] == landed and rented.get("adopted") and live(fake_runpod) == [landed]
    destroy(rented)
    assert live(fake_runpod) == []


@pytest.mark.parametrize("command", ["rent", "create"])
def test_vastai_killed_while_its_rent_is_in_flight_the_next_up_adopts_it_and_destroy_deletes_it(
        fake_vast, env, command):  # noqa: F811
    fake_vast.offers = [offer(91, "TW", 0.30), offer(92, "TW", 0.35)]
    spec = write_spec(env, make_spec("apac-tw", "vastai"))
    landed = killed_while_creating(fake_vast, command, "--spec", spec)
    assert [str(i["id"]) for i in fake_vast.live()] == [landed]
    rented, ready = next_up(spec)
    assert rented["id"] == ready["id"] == landed and rented.get("adopted")
    assert len(fake_vast.calls("PUT", "/api/v0/asks/")) == 1  # never a second GPU
    destroy(rented)
    assert fake_vast.live() == []


@pytest.mark.parametrize("command", ["rent", "create"])
def test_killed_while_its_create_is_in_flight_a_changed_spec_leaves_it_to_the_programs_sweep(
        fake_runpod, env, command):  # noqa: F811
    spec = make_spec("apac-jp", "runpod")
    landed = killed_while_creating(fake_runpod, command, "--spec", write_spec(env, spec))
    # The next up declares another pod (say, a renewal): nothing adopts the one the kill left.
    renamed = env / "renamed.json"
    renamed.write_text(json.dumps({**spec, "name": spec["name"] + "-p0-abcdef"}))
    rented, ready = next_up(str(renamed))
    assert sorted(live(fake_runpod)) == sorted([landed, ready["id"]])
    # The program's sweep after the update (infra/cell.py POD_SWEEP), keeping what the stack declares.
    code, out, err = pod_py("sweep", "--stack", "t1", "--stacks-dir", stack_file(env / "stacks"), "--destroy",
                            "--provider", "runpod", "--keep", rented["id"], "--keep", ready["id"])
    assert code == 0, err
    assert out["destroyed"] == [landed] and live(fake_runpod) == [ready["id"]]
    destroy(rented)
    assert live(fake_runpod) == []


def test_wait_killed_during_readiness_leaves_the_pod_on_record_for_destroy_or_the_next_up(fake_runpod, env):  # noqa: F811
    spec = write_spec(env, make_spec("apac-jp", "runpod"))
    code, rented, err = pod_py("rent", "--spec", spec)
    assert code == 0 and set(rented) == {"id", "provider", "name"}, err  # recorded before any wait
    doc = json.dumps({**json.loads(Path(spec).read_text()), "rented": rented})
    doc_path = env / "wait.json"
    doc_path.write_text(doc)
    killed_while_waiting(fake_runpod, "wait", "--spec", str(doc_path))
    assert live(fake_runpod) == [rented["id"]]
    # The next up: the rent is unchanged (no re-run); its wait runs again and finds the pod.
    code, ready, err = pod_py("wait", "--spec", str(doc_path))
    assert code == 0 and ready["id"] == rented["id"], err
    # Or `pulumi destroy` straight after the cancel: the rent's record is enough.
    out = destroy(rented)
    assert out["already_gone"] is False and live(fake_runpod) == []


def test_create_killed_during_readiness_is_found_by_sweep(fake_runpod, env):  # noqa: F811
    spec = write_spec(env, make_spec("apac-jp", "runpod"))
    pod_id = killed_while_waiting(fake_runpod, "create", "--spec", spec)
    assert live(fake_runpod) == [pod_id]
    code, out, err = pod_py("sweep", "--stack", "t1", "--stacks-dir", stack_file(env / "stacks"), "--destroy")
    assert code == 0 and out["destroyed"] == [pod_id], err
    assert live(fake_runpod) == []


def test_killed_before_anything_was_rented_leaves_nothing(fake_runpod, env):  # noqa: F811
    fake_runpod.rate_limit("GET", "/v2/pods", 1, retry_after="30")  # rent holds in its first look-up
    proc = start("rent", "--spec", write_spec(env, make_spec("apac-jp", "runpod")))
    wait_until(lambda: fake_runpod.rate_limited_at, "the look-up")
    kill(proc)
    assert live(fake_runpod) == [] and fake_runpod.calls("POST", "/v2/pods") == []


def test_a_wait_whose_recorded_pod_is_gone_places_one_under_the_name_and_delete_finds_it(fake_runpod, env):  # noqa: F811
    spec = write_spec(env, make_spec("apac-jp", "runpod"))
    code, rented, err = pod_py("rent", "--spec", spec)
    assert code == 0, err
    code, _, err = pod_py("delete", "--id", rented["id"], "--provider", "runpod")  # reclaimed, or deleted by hand
    assert code == 0 and live(fake_runpod) == []
    code, ready, err = pod_py("wait", "--spec", "-", stdin=json.dumps({**json.loads(Path(spec).read_text()),
                                                                         "rented": rented}))
    assert code == 0 and ready["id"] != rented["id"] and live(fake_runpod) == [ready["id"]], err
    out = destroy(rented)  # the rent's record names the old id; the name finds the new pod
    assert out["already_gone"] is True and out["also_deleted"] == [ready["id"]] and live(fake_runpod) == []


def test_wait_refuses_a_document_without_this_specs_rented_pod(fake_runpod, env):  # noqa: F811
    spec = make_spec("apac-jp", "runpod")
    for doc, says in (({**spec}, "spec.rented is missing"),
                      ({**spec, "rented": {"id": "x", "provider": "runpod", "name": "colocate-t1-other"}},
                       "is not this spec's")):
        code, out, err = pod_py("wait", "--spec", "-", stdin=json.dumps(doc))
        assert code == 2 and out is None and says in err and "Fix:" in err, err
    assert fake_runpod.calls("POST", "/v2/pods") == []


def test_a_wait_whose_recorded_pod_exited_destroys_it_and_places_another(fake_vast, env):  # noqa: F811
    fake_vast.offers = [offer(95, "TW", 0.30), offer(96, "TW", 0.35)]
    spec = make_spec("apac-tw", "vastai")
    code, rented, err = pod_py("rent", "--spec", write_spec(env, spec))
    assert code == 0, err
    first = int(rented["id"])
    fake_vast.instances[first]["actual_status"] = "exited"  # it will never run again
    code, ready, err = pod_py("wait", "--spec", "-", stdin=json.dumps({**spec, "rented": rented}))
    assert code == 0 and "will never serve" in err, err
    assert fake_vast.instances[first].get("_destroyed")  # not left stopped, holding its disk
    assert [str(i["id"]) for i in fake_vast.live()] == [ready["id"]] and ready["id"] != rented["id"]
    assert ready["name"] == spec["name"]  # the replacement carries the name the rent's delete looks for
