"""The sandbox's outbound network refuses what Cloudflare refuses: a fetch to an IP literal;
and its state hop survives a client that resets a connection mid-request."""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
from pathlib import Path

import pytest

from colocate.pods import standin
from colocate.sandbox import config as config_mod
from colocate.sandbox.geography import Geography, Sites
from colocate.sandbox.pinning import Pins
from colocate.sandbox.proxies import (
    IP_LITERAL_BODY,
    IP_LITERAL_STATUS,
    SITE_HEADER,
    Network,
    NetworkServers,
    ip_literal,
    local_url,
)
from colocate.sandbox.statedir import PINS_FILE
from colocate.workerd import Workerd
from tests.support.workerd import SECRETS, cell_plan, request, values_for

EDGE = "IAD"


def test_ip_literal_and_local_url():
    assert ip_literal("127.0.0.1") and ip_literal("[::1]") and ip_literal("203.0.113.7")
    assert not ip_literal("localhost") and not ip_literal("pod-0.example.com") and not ip_literal(None)
    assert local_url("http://127.0.0.1:8123") == "http://localhost:8123"
    assert local_url("http://127.0.0.1:8123/v1") == "http://localhost:8123/v1"
    assert local_url("https://api.openai.com/v1") == "https://api.openai.com/v1"


@contextlib.contextmanager
def _network(targets: dict[str, str], pins: type[Pins] = Pins):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        net = Network(Geography(same_site_ms=0.0), Sites(client=EDGE, edge=EDGE, pod=EDGE, fallback=EDGE),
                      pins(Path(tmp) / PINS_FILE), dict(targets))
        with NetworkServers(net) as servers:
            yield net, servers, Path(tmp)


def _outbound(servers, host: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", servers.outbound.port, timeout=10)
    try:
        conn.request("GET", "/health", headers={"host": host, SITE_HEADER: EDGE, "authorization": "Bearer t"})
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def test_outbound_answers_an_ip_literal_like_cloudflare_and_a_name_is_routed():
    with standin.serve(compute_ms=1, token="t") as pod:
        ip_key, name_key = f"127.0.0.1:{pod.port}", f"localhost:{pod.port}"
        # Even a registered target is refused by its address: the rule is about the URL, as in the cloud.
        with _network({ip_key: EDGE, name_key: EDGE}) as (_, servers, _):
            status, ctype, body = _outbound(servers, ip_key)
            assert (status, body) == (IP_LITERAL_STATUS, IP_LITERAL_BODY) == (403, b"error code: 1003")
            assert ctype.startswith("text/plain")
            assert _outbound(servers, f"[::1]:{pod.port}")[0] == 403
            status, _, body = _outbound(servers, name_key)
            assert status == 200 and body == b""  # the pod's GET /health, through: 200 and no body, as vLLM's
            assert _outbound(servers, "localhost:1")[0] == 502  # a name with no route is still refused


@pytest.mark.slow
@pytest.mark.parametrize("literal", [True, False])
def test_a_worker_with_an_ip_literal_pod_url_fails_in_the_sandbox(tmp_path, literal):
    """The probe through the sandbox's Worker: POD_URLS with an IP literal reaches no pod
    (the Worker sees Cloudflare's 403), the same pod by name does."""
    plan = cell_plan()
    with standin.serve(compute_ms=1, token=SECRETS["POD_TOKEN"]) as pod, \
            standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], name="fallback") as fb:
        pod_url = pod.url if literal else local_url(pod.url)
        fallback_url = local_url(fb.url)
        targets = {pod_url.split("://")[1]: EDGE, fallback_url.split("://")[1]: EDGE}
        with _network(targets) as (_, servers, tmp):
            values = values_for(pod_url, fallback_url)
            text = config_mod.compose(plan, values=values, edge_site=EDGE, state_sites=[EDGE],
                                      outbound=("127.0.0.1", servers.outbound.port), objects_dir=tmp / "objects")
            (tmp / "objects" / EDGE).mkdir(parents=True, exist_ok=True)
            with Workerd(tmp_path / "workerd", socket_name=config_mod.SOCKET_NAME) as w:
                w.start(text)
                probe = request(w.url, path="/_colocate/probe",
                                headers={"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}"}).json()
    pod0 = probe["pods"][0]
    if literal:
        assert pod0["ok"] is False and pod0["status"] == 403, probe
        assert probe["pod_ok"] is False
    else:
        assert pod0["ok"] is True and pod0["status"] == 200, probe


class _FirstTouchHeld(Pins):
    """The pin table, its first look-up held until released: a look-up still under way."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.asked, self.release = threading.Event(), threading.Event()
        self._first = threading.Lock()

    def touch(self, name: str, edge: str, hint: str = "") -> tuple[str, bool]:
        if self._first.acquire(blocking=False):
            self.asked.set()
            self.release.wait(30)
        return super().touch(name, edge, hint)


def _reset(url: str, raw: bytes) -> socket.socket:
    """A connection that has sent ``raw``; closing it sends a reset, as a client that gives up may."""
    host, port = url.split("://")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.sendall(raw)
    return sock


@pytest.mark.slow
def test_a_request_reset_during_the_first_state_look_up_leaves_the_state_reachable(tmp_path):
    """The Worker's first state call asks the sandbox where the object lives. A client that
    resets that request meanwhile ends it in workerd, and with it every promise it made: a
    later request that waited on that look-up would fail, and so would every state call of
    the isolate after it (500 here, 503 state_unavailable to a client's key)."""
    plan = cell_plan()
    probe = {"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}"}
    with standin.serve(compute_ms=1, token=SECRETS["POD_TOKEN"]) as pod, \
            standin.serve(compute_ms=1, token=SECRETS["FALLBACK_API_KEY"], name="fallback") as fb:
        pod_url, fallback_url = local_url(pod.url), local_url(fb.url)
        targets = {pod_url.split("://")[1]: EDGE, fallback_url.split("://")[1]: EDGE}
        with _network(targets, pins=_FirstTouchHeld) as (net, servers, tmp):
            held = net.pins
            assert isinstance(held, _FirstTouchHeld)
            text = config_mod.compose(plan, values=values_for(pod_url, fallback_url), edge_site=EDGE, state_sites=[EDGE],
                                      outbound=("127.0.0.1", servers.outbound.port), objects_dir=tmp / "objects")
            (tmp / "objects" / EDGE).mkdir(parents=True, exist_ok=True)
            with Workerd(tmp_path / "workerd", socket_name=config_mod.SOCKET_NAME) as w:
                w.start(text)
                try:
                    first = _reset(w.url, b"GET /_colocate/probe HTTP/1.1\r\nhost: cell\r\nauthorization: "
                                   + probe["authorization"].encode() + b"\r\n\r\n")
                    assert held.asked.wait(30)  # its state call is asking where the object lives
                    first.close()  # a reset: workerd ends that request
                    # Answered while the first look-up is still held: nothing waits on the ended request.
                    after = [request(w.url, path="/_colocate/probe", headers=probe, timeout=30) for _ in range(2)]
                finally:
                    held.release.set()
    assert [a.status for a in after] == [200, 200], [a.body[:300] for a in after]
    assert [a.json()["state_colo"] for a in after] == [EDGE, EDGE]  # the object answered, where it was pinned


def test_a_deploy_swap_is_recorded_as_one_hold_from_pause_to_resume(tmp_path):
    net = Network(Geography(same_site_ms=0.0), Sites(client=EDGE, edge=EDGE, pod=EDGE, fallback=EDGE),
                  Pins(tmp_path / PINS_FILE), workerd=("127.0.0.1", 1))
    assert net.enter(timeout_s=1) == ("127.0.0.1", 1)
    assert net.pause(drain_s=0.05) is False  # one request still in flight: the drain timed out, the edge holds
    assert net.enter(timeout_s=0.05) is None  # a new request waits (here: past its bound)
    net.leave()
    assert net.pause(drain_s=1) is True  # paused again before the resume: still one hold
    net.resume(("127.0.0.1", 2))
    assert net.enter(timeout_s=1) == ("127.0.0.1", 2)
    [(start, end)] = net.holds
    assert 0.05 <= end - start < 30
    net.leave()
    net.resume(("127.0.0.1", 2))  # a resume with no pause before it is no hold
    assert len(net.holds) == 1
