"""The sandbox's outbound network refuses what Cloudflare refuses: a fetch to an IP literal."""

from __future__ import annotations

import contextlib
import http.client
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
def _network(targets: dict[str, str]):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        net = Network(Geography(same_site_ms=0.0), Sites(client=EDGE, edge=EDGE, pod=EDGE, fallback=EDGE),
                      Pins(Path(tmp) / PINS_FILE), dict(targets))
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
