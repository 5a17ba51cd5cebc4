"""Every token, whoever hangs up (docs/worker.md): a client that leaves at any moment (while its
body uploads, while it waits for the first token, mid-stream, while a non-streamed answer is
assembled, while the fallback works) cancels the upstream's work, is metered what the pod made
(within 5 %, or the request's ceiling where nothing is known) and frees its max_parallel slot
within a second; a cut stream is charged the pod's own count.

The real Worker in workerd with a stand-in pod on a GPU profile (tokens at its pace; its
vllm:prompt_tokens and vllm:generation_tokens counters say what it made), straight (the client
resets its connection, as Cloudflare's edge cancels a request) and through the sandbox's edge
(the client simply closes: the edge must pass it on). The pure parts, and the fallback's usage
counted as it reports it (the stand-in's context is a pod's): worker/test/hangup.test.js."""

from __future__ import annotations

import json
import re
import socket
import struct
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from colocate.sandbox.geography import Geography, Sites
from colocate.sandbox.pinning import Pins
from colocate.sandbox.proxies import Network, NetworkServers
from colocate.sandbox.statedir import PINS_FILE
from tests.support.workerd import SECRETS, auth, running_cell

pytestmark = pytest.mark.slow

PROFILE = "rtx4090-qwen2.5-7b-int4"  # about 67 tokens a second for one sequence
PRICE = 1.0  # $ per 1M tokens, in and out: the fallback's spend is its tokens in micro-dollars


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 2_000}, profile=PROFILE, fallbackPrice={"input": PRICE, "output": PRICE}) as c:
        yield c


@pytest.fixture(scope="module")
def edge(cell):
    """The sandbox's front proxy (Cloudflare's edge) in front of the same workerd: its port."""
    with tempfile.TemporaryDirectory() as tmp:
        net = Network(Geography(same_site_ms=0.0), Sites(client="IAD", edge="IAD", pod="IAD", fallback="IAD"),
                      Pins(Path(tmp) / PINS_FILE), {}, workerd=("127.0.0.1", cell.worker.port))
        with NetworkServers(net) as servers:
            yield servers.front.port


# --- what the pod made, what the cell metered ---------------------------------------------

def pod_metrics(cell) -> dict[str, int]:
    """The pod's vllm:prompt_tokens and vllm:generation_tokens counters and its running and waiting
    requests, read as the router reads them: the pod's guard opens /metrics to the pod token only."""
    req = urllib.request.Request(cell.pod.url + "/metrics", headers={"authorization": f"Bearer {SECRETS['POD_TOKEN']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    def one(name: str) -> int:
        m = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        assert m, f"{name} missing from the pod's /metrics"
        return int(float(m.group(1)))
    return {name: one(name) for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                         "vllm:num_requests_running", "vllm:num_requests_waiting")}


def pod_still(cell, timeout_s: float = 20.0) -> tuple[int, int]:
    """The pod's prompt and generation counters once it holds no request and two reads 0.5 s
    apart agree (bounded): agreeing reads alone were taken once while the engine, starved of the
    CPU on a loaded machine, had tokens still to make for a client that had left."""
    deadline = time.monotonic() + timeout_s
    last = pod_metrics(cell)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = pod_metrics(cell)
        if now == last and now["vllm:num_requests_running"] == now["vllm:num_requests_waiting"] == 0:
            break
        last = now
    return last["vllm:prompt_tokens_total"], last["vllm:generation_tokens_total"]


def usage_of(cell, key_id: str, served: int = 1, timeout_s: float = 15.0) -> dict:
    """The key's usage rows summed, once the object holds ``served`` of its requests metered
    (a request is counted when admitted, its tokens when metered; bounded poll)."""
    deadline = time.monotonic() + timeout_s
    fields = ("requests", "prompt_tokens", "completion_tokens", "estimated_tokens", "fallback_microusd", "pod_requests",
              "fallback_requests")
    while True:
        res = cell.call("GET", f"/_colocate/usage?key={key_id}", headers=auth(cell.admin_token))
        assert res.status == 200, res.body
        total = {k: sum(r.get(k, 0) for r in res.json()["usage"]) for k in fields}
        if total["pod_requests"] + total["fallback_requests"] >= served or time.monotonic() > deadline:
            return total
        time.sleep(0.1)


# --- a client that leaves ------------------------------------------------------------------

def request_bytes(key: str, body: dict, path: str = "/v1/chat/completions") -> tuple[bytes, bytes]:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: Bearer {key}\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    return head, data


def leave(sock: socket.socket, reset: bool) -> None:
    """Close the connection: with an RST (``reset``, what a cancelled request is to workerd), else a FIN."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def abandon(port: int, key: str, body: dict, *, events: int = 0, after_s: float = 0.0, reset: bool = True,
            upload_only: bool = False) -> bytes:
    """Send a request and leave: once ``events`` SSE events arrived, or after ``after_s`` (the
    answer not started), or halfway through the body (``upload_only``). Returns what arrived."""
    head, data = request_bytes(key, body)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    got = b""
    try:
        if upload_only:
            sock.sendall(head + data[: len(data) // 2])
            time.sleep(after_s)
            return got
        sock.sendall(head + data)
        if events:
            while got.count(b"data:") < events:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        else:
            time.sleep(after_s)
        return got
    finally:
        leave(sock, reset)


def tokens_seen(got: bytes) -> int:
    """The tokens the client received: its events whose content is not empty (vLLM's first
    event, role only, has "content":""). A token split across two reads is not counted."""
    return len(re.findall(rb'"content": ?"[^"]', got))


def charged_the_pods_count(counted: int, seen: int, made: int) -> bool:
    """Charged the pod's last continuous usage the router read: at least what reached the
    client, at most what the pod made (what it makes after the cut, before it notices, is
    not seen, more of it the more loaded the machine: docs/worker.md)."""
    return 0 < seen <= counted <= made


def slot_is_free(cell, key: str) -> None:
    """A second after the hang-up, the max_parallel 1 key is admitted again."""
    time.sleep(1.0)
    res = cell.call("POST", "/v1/chat/completions", body={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4}, headers={"authorization": f"Bearer {key}"})
    assert res.status == 200, (res.status, res.body[:300])


def long_answer(stream: bool, tokens: int = 6000, content: str = "hi") -> dict:
    """An answer of exactly ``tokens`` tokens (vLLM's min_tokens and ignore_eos): far longer than any test waits."""
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream, "max_tokens": tokens,
            "min_tokens": tokens, "ignore_eos": True}


def key_of(cell, name: str) -> dict:
    return cell.create_key(name, rpm=0, tpm=0, monthly_tokens=0, max_parallel=1)


# --- straight to workerd: the client resets its connection ------------------------------------

def test_a_stream_cut_mid_answer_is_charged_the_pods_count_and_frees_its_slot(cell):
    """7,000 digits are 7,034 tokens for Qwen's tokenizer (the stand-in's), 1,758 at four characters a token."""
    made_key = key_of(cell, "cut-stream")
    before = pod_still(cell)
    got = abandon(cell.worker.port, made_key["key"], long_answer(True, 1000, "7" * 7000), events=30)
    assert b'"usage"' not in got  # the client did not ask for usage: no event carries it
    after = pod_still(cell)
    prompt, made = after[0] - before[0], after[1] - before[1]
    assert prompt == 7034 and 28 <= made < 1000, (prompt, made)  # the pod stopped with the client
    counted = usage_of(cell, made_key["id"])
    assert counted["prompt_tokens"] == prompt, counted
    assert charged_the_pods_count(counted["completion_tokens"], tokens_seen(got), made), (counted, tokens_seen(got), made)
    slot_is_free(cell, made_key["key"])


def test_a_non_streamed_answer_abandoned_while_assembled_stops_the_pod_is_metered_and_frees_its_slot(cell):
    made_key = key_of(cell, "abandon-whole")
    before = pod_still(cell)
    abandon(cell.worker.port, made_key["key"], long_answer(False), after_s=2.0)
    after = pod_still(cell)
    prompt, made = after[0] - before[0], after[1] - before[1]
    assert 0 < made < 1500, made  # stopped with its client, far from its 6,000 tokens
    counted = usage_of(cell, made_key["id"])
    # charged what the router read of the pod's answer, most of what it made in its 2 s: what the pod
    # makes after the cut, before it notices, is unseen (a loaded run made 337 where 307 were read)
    assert counted["prompt_tokens"] == prompt and made // 2 <= counted["completion_tokens"] <= made, (counted, prompt, made)
    slot_is_free(cell, made_key["key"])


def test_a_stream_abandoned_before_its_first_token_is_charged_its_ceiling_and_frees_its_slot(cell):
    made_key = key_of(cell, "abandon-first")
    body = long_answer(True, 500)
    cell.pod.set_fault("slow", delay_ms=1500)  # the pod takes 1.5 s to start: the client leaves first
    try:
        before = pod_still(cell)
        abandon(cell.worker.port, made_key["key"], body, after_s=0.5)
        # The router left at once; the stand-in's slow fault starts the answer after its delay
        # all the same, and stops once its writes fail (vLLM would not start it at all): a few
        # tokens on a loaded machine, never the answer.
        assert pod_still(cell)[1] - before[1] < body["max_tokens"] // 10
    finally:
        cell.pod.set_fault("ok")
    counted = usage_of(cell, made_key["id"])
    # nothing was known: the request's ceiling, its body's bytes and its max_tokens
    assert counted["prompt_tokens"] == len(json.dumps(body)) and counted["completion_tokens"] == 500, counted
    slot_is_free(cell, made_key["key"])


def test_a_fallback_answer_abandoned_is_charged_its_ceiling_at_the_fallbacks_price(cell):
    made_key = key_of(cell, "abandon-fallback")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
    assert cell.call("PUT", "/_colocate/breaker", body={"force": "open"}, headers=auth()).status == 200
    cell.fallback.set_fault("slow", delay_ms=2500)
    try:
        abandon(cell.worker.port, made_key["key"], body, after_s=0.7)
        counted = usage_of(cell, made_key["id"])
        tokens = len(json.dumps(body)) + 300
        assert counted["prompt_tokens"] + counted["completion_tokens"] == tokens, counted
        assert counted["fallback_microusd"] == tokens * PRICE, counted  # it reaches the daily spend cap
        time.sleep(1.0)
        res = cell.call("POST", "/v1/chat/completions", body=body, headers={"authorization": f"Bearer {made_key['key']}"})
        assert res.status == 200, res.body[:300]  # the slot was freed
    finally:
        cell.fallback.set_fault("ok")
        cell.call("PUT", "/_colocate/breaker", body={"force": None}, headers=auth())


def test_a_hang_up_during_the_upload_charges_nothing_and_holds_no_slot(cell):
    made_key = key_of(cell, "abandon-upload")
    abandon(cell.worker.port, made_key["key"], long_answer(False, 100, "x" * 20_000), after_s=0.3, upload_only=True)
    slot_is_free(cell, made_key["key"])
    counted = usage_of(cell, made_key["id"])  # the one served is the slot's check; the abandoned one was never admitted
    assert counted["requests"] == 1 and counted["pod_requests"] == 1, counted


# --- through the sandbox's edge: the client simply closes -------------------------------------

def test_through_the_edge_a_non_streamed_answer_abandoned_stops_the_pod_and_frees_its_slot(cell, edge):
    """A FIN from the client while it waits: workerd alone would never see it; the edge resets its connection."""
    made_key = key_of(cell, "edge-whole")
    before = pod_still(cell)
    abandon(edge, made_key["key"], long_answer(False), after_s=2.0, reset=False)
    after = pod_still(cell)
    prompt, made = after[0] - before[0], after[1] - before[1]
    assert 0 < made < 1500, made
    counted = usage_of(cell, made_key["id"])
    # charged what the router read of the pod's answer, most of what it made in its 2 s: what the pod
    # makes after the cut, before it notices, is unseen (a loaded run made 337 where 307 were read)
    assert counted["prompt_tokens"] == prompt and made // 2 <= counted["completion_tokens"] <= made, (counted, prompt, made)
    slot_is_free(cell, made_key["key"])


def test_through_the_edge_a_stream_abandoned_mid_answer_is_charged_the_pods_count(cell, edge):
    made_key = key_of(cell, "edge-stream")
    before = pod_still(cell)
    got = abandon(edge, made_key["key"], long_answer(True, 1000, "7" * 7000), events=30, reset=False)
    after = pod_still(cell)
    prompt, made = after[0] - before[0], after[1] - before[1]
    assert prompt == 7034 and made < 1000, (prompt, made)
    counted = usage_of(cell, made_key["id"])
    assert counted["prompt_tokens"] == prompt, counted
    assert charged_the_pods_count(counted["completion_tokens"], tokens_seen(got), made), (counted, tokens_seen(got), made)
    slot_is_free(cell, made_key["key"])


def test_through_the_edge_a_stream_abandoned_before_its_first_token_frees_its_slot(cell, edge):
    made_key = key_of(cell, "edge-first")
    body = long_answer(True, 500)
    cell.pod.set_fault("slow", delay_ms=1500)
    try:
        abandon(edge, made_key["key"], body, after_s=0.5, reset=False)
        counted = usage_of(cell, made_key["id"])
    finally:
        cell.pod.set_fault("ok")
    assert counted["prompt_tokens"] == len(json.dumps(body)) and counted["completion_tokens"] == 500, counted
    slot_is_free(cell, made_key["key"])



def test_through_the_edge_a_hang_up_during_the_upload_charges_nothing_and_holds_no_slot(cell, edge):
    """The edge streams the body to the Worker as it arrives, as Cloudflare's does, and resets
    its connection when the client leaves halfway."""
    made_key = key_of(cell, "edge-upload")
    abandon(edge, made_key["key"], long_answer(False, 100, "x" * 200_000), after_s=0.3, upload_only=True, reset=False)
    slot_is_free(cell, made_key["key"])
    counted = usage_of(cell, made_key["id"])  # only the slot's check was served
    assert counted["requests"] == 1 and counted["pod_requests"] == 1, counted
