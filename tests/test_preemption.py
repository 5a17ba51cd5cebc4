"""A pod preempted under traffic, at the Worker (the real Worker in workerd, two stand-in pods as processes
of their own on a GPU profile, and OpenAI's own Python SDK as the client). A preemption kills the pod's
process at once (the sandbox's local provider does so: colocate/pods/local.py ``preempt``), so:

* a stream cut mid-answer ends with an error event in OpenAI's shape, which the SDK raises as an
  ``APIError`` (code ``upstream_broken``) after what the pod sent; it is counted (``cut`` in the live
  histograms, ``colocate_streams_cut_total`` in /_colocate/metrics) and charged what was sent;
* an answer the client has received no byte of (one being assembled for a client that asked for no
  stream, or one waiting for its first token) is retried on the other pod or the fallback: 0 failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from colocate.pods import standin
from colocate.workerd import Workerd, render_config
from tests.support.workerd import FALLBACK_MODEL_NAME, SECRETS, auth, cell_plan, request, values_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
PROFILE = "rtx4090-qwen2.5-7b-int4"  # about 67 tokens a second for one sequence: answers last seconds


@dataclass
class Pod:
    url: str
    proc: subprocess.Popen

    def preempt(self) -> None:
        """What the local provider's preempt does to the process: SIGKILL to its group, at once."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def running(self) -> tuple[int, int]:
        """vllm:num_requests_running and vllm:generation_tokens_total, from the pod's /metrics."""
        req = urllib.request.Request(self.url + "/metrics", headers={"authorization": f"Bearer {SECRETS['POD_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        run = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        made = re.search(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return int(float(run.group(1))) if run else 0, int(float(made.group(1))) if made else 0


@contextlib.contextmanager
def pod_process(directory: Path, name: str) -> Iterator[Pod]:
    port_file = directory / f"{name}.port.json"
    env = {**os.environ, "POD_TOKEN": SECRETS["POD_TOKEN"],
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(directory / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "colocate.pods.standin", "--port", "0", "--any-model", "--name", name,
                                 "--profile", PROFILE, "--port-file", str(port_file)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (directory / f"{name}.log").read_text()
            time.sleep(0.05)
        yield Pod(json.loads(port_file.read_text())["url"], proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@dataclass
class Cell:
    worker: Workerd
    pods: list[Pod]
    key: str
    key_id: str

    def metrics(self) -> str:
        return request(self.worker.url, "GET", "/_colocate/metrics", headers=auth()).body.decode()


@pytest.fixture
def cell(tmp_path) -> Iterator[Cell]:
    plan = cell_plan({"stallMs": 5000, "deadlineMs": 10_000})
    with pod_process(tmp_path, "pod-0") as a, pod_process(tmp_path, "pod-1") as b, \
            standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], model=FALLBACK_MODEL_NAME, name="fallback") as fb, \
            Workerd() as w:
        w.start(render_config(plan.worker, values_for([a.url, b.url], fb.url), port=w.port, storage_dir=w.directory / "objects"))
        res = request(w.url, "POST", "/_colocate/keys", body={"name": "t", "rpm": 0, "tpm": 0, "monthly_tokens": 0,
                                                               "max_parallel": 0, "max_parallel_tokens": 0}, headers=auth())
        assert res.status == 201, res.body
        yield Cell(w, [a, b], res.json()["key"], res.json()["id"])


def answer(tokens: int, stream: bool = False) -> dict:
    """An answer of exactly ``tokens`` tokens (vLLM's min_tokens and ignore_eos): seconds of decoding."""
    return {"model": "m", "messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": tokens,
            "stream": stream, "extra_body": {"min_tokens": tokens, "ignore_eos": True}}


def until(predicate, timeout_s: float = 20.0, every: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


def usage(cell: Cell) -> dict:
    rows = request(cell.worker.url, "GET", f"/_colocate/usage?key={cell.key_id}", headers=auth()).json()["usage"]
    return {k: sum(r.get(k, 0) for r in rows) for k in ("prompt_tokens", "completion_tokens", "pod_requests")}


def test_a_stream_cut_by_a_preemption_ends_with_an_error_the_sdk_raises_is_counted_and_charged_what_was_sent(cell, openai_client):
    import openai
    client = openai_client(cell.worker.url + "/v1", cell.key, timeout=60)
    stream = client.chat.completions.create(**answer(1500, stream=True))
    backend = stream.response.headers["x-colocate-backend"]
    victim = cell.pods[int(backend.split("-")[1])]
    received = 0
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 40:  # mid-answer: the host takes the pod back
                    victim.preempt()
    assert err.value.code == "upstream_broken" and "broke off" in err.value.message
    assert 40 <= received < 1500
    # charged what the pod sent (its continuous usage up to the cut): what this client read, give or take the
    # few events in flight when the process died
    spent = until(lambda: (u := usage(cell))["pod_requests"] >= 1 and u)
    assert received <= spent["completion_tokens"] <= received + 25, (spent, received)
    # counted, where an operator looks: /_colocate/metrics and the live view (after the isolate's sync)
    line = f'colocate_streams_cut_total{{backend="{backend}"}} 1'
    assert until(lambda: line in cell.metrics()), cell.metrics()[-2000:]
    live = request(cell.worker.url, "GET", "/_colocate/live", headers=auth())
    assert live.status == 200 and any(r[3] == "cut" for r in live.json()["minutes"]), live.body[:500]


def test_answers_no_byte_of_which_was_sent_are_retried_on_the_other_pod_or_the_fallback(cell, openai_client):
    import openai
    client = openai_client(cell.worker.url + "/v1", cell.key, timeout=60)
    results: list[tuple[str, str]] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(**answer(300))
            out = (raw.headers["x-colocate-backend"], raw.parse().choices[0].message.content or "")
        except openai.APIError as exc:  # a failure is the test's, recorded as such
            out = ("failed", f"{type(exc).__name__}: {exc}")
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    victim = cell.pods[0]
    # pod 0 mid-answer: some of the eight are being decoded there, none of their bytes sent (assembled)
    assert until(lambda: (lambda r, m: r > 0 and m >= 20)(*victim.running()), every=0.02)
    victim.preempt()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 8 and [r for r in results if r[0] == "failed"] == []
    assert all(len(text) > 0 for _, text in results)
    assert all(b in ("pod-1", "fallback") for b, _ in results), results  # none of pod 0's answers reached its client
    assert re.search(r'"pod_failed".*"reason":"broken".*"pod":0', cell.worker.log_text()), cell.worker.log_tail()
