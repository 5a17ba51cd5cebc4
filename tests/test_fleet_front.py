"""The front door in real workerd, over three real cells bound by service bindings."""

from __future__ import annotations

import json
import time

import pytest

from colocate.pods import standin
from tests.support.fleet import Fleet, running_fleet
from tests.support.workerd import SECRETS, request

pytestmark = pytest.mark.slow  # real workerd with three cells


@pytest.fixture(scope="module")
def three() -> Fleet:
    # No memory of "no pod" here, so one test's broken cell does not steer the next test's
    # requests; test_no_pod_is_remembered_then_forgotten runs its own fleet with memory.
    with running_fleet(remember_ms=0) as f:
        yield f


@pytest.fixture(autouse=True)
def healthy(three):
    """Every test starts with every pod answering and no breaker forced (memory is short)."""
    for c in three.cells:
        c.pod.set_fault("ok")
        c.breaker(None)
    yield


def pod_requests(f: Fleet) -> dict[str, int]:
    return {c.name: c.pod.requests for c in f.cells}


def fallback_requests(f: Fleet) -> int:
    return request(f.fallback.url, "GET", "/_standin/stats").json()["requests"]


@pytest.mark.parametrize("colo, cell", [("NRT", "apac-jp"), ("FRA", "eu-west"), ("IAD", "us-east"),
                                        ("KIX", "apac-jp"), ("LHR", "eu-west"), ("ORD", "us-east")])
def test_the_nearest_cell_serves(three, colo, cell):
    before = pod_requests(three)
    res = three.call(colo)
    assert res.status == 200, res.body
    assert res.headers["x-colocate-cell"] == cell and res.headers["x-colocate-backend"] == "pod-0"
    after = pod_requests(three)
    assert {k: after[k] - before[k] for k in after} == {c.name: int(c.name == cell) for c in three.cells}


def test_server_timing_has_front_before_the_cells_metrics(three):
    res = three.call("NRT")
    header = res.headers["server-timing"]
    assert header.startswith("front;dur="), header
    t = res.timing()
    assert list(t) == ["front", "state", "upstream", "fallback", "total"]
    assert t["front"] >= 0 and t["upstream"] > 0


def test_unknown_or_missing_colo_uses_the_configured_order(three):
    for colo in (None, "ZZZ"):
        res = three.call(colo)
        assert res.status == 200 and res.headers["x-colocate-cell"] == "apac-jp", colo


def test_a_cell_with_its_breaker_open_is_passed_over_without_the_fallback(three):
    three.cell("apac-jp").breaker("open")
    fb = fallback_requests(three)
    before = pod_requests(three)
    for _ in range(3):
        res = three.call("NRT")
        assert res.status == 200, res.body
        # Tokyo's next nearest cell is eu-west (Dublin), then us-east.
        assert res.headers["x-colocate-cell"] == "eu-west" and res.headers["x-colocate-backend"] == "pod-0"
    after = pod_requests(three)
    assert after["eu-west"] - before["eu-west"] == 3 and after["apac-jp"] == before["apac-jp"]
    assert fallback_requests(three) == fb, "the paid fallback must not be called while another cell can serve"


def test_a_cell_whose_pod_fails_defers_and_the_next_cell_serves(three):
    three.cell("eu-west").pod.set_fault("error")
    fb = fallback_requests(three)
    before = pod_requests(three)
    res = three.call("FRA")
    assert res.status == 200, res.body
    assert res.headers["x-colocate-cell"] == "us-east" and res.headers["x-colocate-backend"] == "pod-0"
    after = pod_requests(three)
    assert after["eu-west"] - before["eu-west"] == 1  # it tried its pod, which failed
    assert fallback_requests(three) == fb


def test_the_last_cell_tried_falls_back_when_all_are_down(three):
    for c in three.cells:
        c.breaker("open")
    fb = fallback_requests(three)
    res = three.call("IAD")
    assert res.status == 200, res.body
    # Two cells at most: us-east deferred, eu-west (the second) was the last and fell back.
    assert res.headers["x-colocate-cell"] == "eu-west" and res.headers["x-colocate-backend"] == "fallback"
    assert fallback_requests(three) == fb + 1


def test_the_defer_header_of_a_client_is_not_obeyed_on_the_last_cell(three):
    for c in three.cells:
        c.breaker("open")
    res = three.call("NRT", headers={"x-colocate-fallback": "defer"})
    assert res.status == 200 and res.headers["x-colocate-backend"] == "fallback"


def test_a_cell_asked_to_defer_with_its_exchange_token_answers_no_pod(three):
    c = three.cell("us-east")
    c.breaker("open")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    res = request(c.url, "POST", "/v1/chat/completions", body=body,
                  headers={"authorization": f"Bearer {three.key}", "x-colocate-fallback": "defer",
                           "x-colocate-front": SECRETS["PROBE_TOKEN"]})  # the fleet's cells hold only the old token
    assert res.status == 503 and res.headers["x-colocate-backend"] == "none"
    assert res.headers["x-colocate-pods-tried"] == "0"
    assert res.json()["error"]["code"] == "no_pod" and res.json()["error"]["type"] == "server_error"
    assert "state;dur=" in res.headers["server-timing"]


def test_an_openai_client_through_the_front_door(three, openai_client):
    openai = pytest.importorskip("openai")
    client = openai_client(three.url + "/v1", three.key, default_headers={"cf-blob": json.dumps({"colo": "FRA"})})
    raw = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-colocate-cell"] == "eu-west"
    out = raw.parse()
    assert out.choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [m.id for m in client.models.list()] == [standin.DEFAULT_MODEL]
    bad = openai_client(three.url + "/v1", "clc_not-a-key")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_bad_input_is_json_in_openais_shape(three):
    res = three.call("NRT", "GET", "/_colocate/probe")
    assert res.status == 404 and res.json()["error"]["code"] == "not_found"
    res = three.call("NRT", "GET", "/v1/chat/completions")
    assert res.status == 405 and res.headers["allow"] == "POST"
    res = three.call("NRT", body=b"x" * (1_048_576 + 1), headers={"content-type": "application/json"})
    assert res.status == 413 and res.json()["error"]["code"] == "payload_too_large"
    res = three.call("NRT", body=b"{not json", headers={"content-type": "application/json"})
    assert res.status == 400 and res.json()["error"]["code"] == "invalid_json"
    assert res.headers["x-colocate-cell"] == "apac-jp"  # the cell judged it, and the client knows which
    res = three.call("NRT", headers={"authorization": ""})
    assert res.status == 401 and res.json()["error"]["code"] == "missing_api_key"


def test_a_streamed_body_is_buffered_once_and_sent_to_the_second_cell(three):
    three.cell("apac-jp").breaker("open")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    res = three.call("NRT", body=body, headers={"content-type": "application/json"}, chunked=True)
    assert res.status == 200 and res.headers["x-colocate-cell"] == "eu-west", res.body


def test_no_pod_is_remembered_then_forgotten():
    with running_fleet(("apac-jp", "us-east"), remember_ms=800) as f:
        jp = f.cell("apac-jp")
        # A pod that failed once is its cell's breaker's business: not remembered.
        jp.pod.set_fault("error")
        assert f.call("NRT").headers["x-colocate-cell"] == "us-east"
        jp.pod.set_fault("ok")
        assert f.call("NRT").headers["x-colocate-cell"] == "apac-jp"
        # No pod to try at all (breaker open): remembered for rememberMs.
        jp.breaker("open")
        assert f.call("NRT").headers["x-colocate-cell"] == "us-east"
        jp.breaker(None)  # healthy again, but the front door remembers "no pod" for a while
        assert f.call("NRT").headers["x-colocate-cell"] == "us-east"
        deadline = time.monotonic() + 15
        served = None
        while time.monotonic() < deadline:
            served = f.call("NRT").headers["x-colocate-cell"]
            if served == "apac-jp":
                break
            time.sleep(0.2)
        assert served == "apac-jp"


def test_a_cell_without_pods_sends_its_users_only_as_far_as_its_e2e_budget():
    # apac-jp's budget (120 ms) is under the round trip to any other cell from Tokyo; eu-west's
    # (600 ms) reaches both others.
    with running_fleet(remember_ms=0, budgets={"apac-jp": 120, "eu-west": 600}) as f:
        jp, eu = f.cell("apac-jp"), f.cell("eu-west")
        assert [c["name"] for c in f.plan.cells_output()] == ["apac-jp", "eu-west", "us-east"]
        assert f.plan.rank["NRT"] == [0] and f.plan.rank["FRA"] == [1, 2, 0]
        jp.breaker("open")
        eu.breaker("open")
        before = pod_requests(f)
        fb = fallback_requests(f)
        res = f.call("NRT")  # no pod at home, none within the budget: its own fallback
        assert res.status == 200, res.body
        assert (res.headers["x-colocate-cell"], res.headers["x-colocate-backend"]) == ("apac-jp", "fallback")
        res = f.call("FRA")  # no pod at home: the nearest cell with pods within the budget
        assert res.status == 200, res.body
        assert (res.headers["x-colocate-cell"], res.headers["x-colocate-backend"]) == ("us-east", "pod-0")
        assert fallback_requests(f) == fb + 1
        after = pod_requests(f)
        assert {k: after[k] - before[k] for k in after} == {"apac-jp": 0, "eu-west": 0, "us-east": 1}


def test_a_cell_losing_its_pod_under_load_fails_no_request():
    """~30 requests/s from Tokyo; apac-jp's pod starts failing a third of the way in:
    every request is answered 200, by apac-jp before and eu-west after, never the fallback."""
    with running_fleet(("apac-jp", "eu-west"), remember_ms=5000) as f:
        fb = fallback_requests(f)
        served = []
        for i in range(60):
            if i == 20:
                f.cell("apac-jp").pod.set_fault("error")
            res = f.call("NRT")
            assert res.status == 200, (i, res.body)
            served.append((res.headers["x-colocate-cell"], res.headers["x-colocate-backend"]))
            time.sleep(1 / 30)
        assert served[:20] == [("apac-jp", "pod-0")] * 20
        assert served[20:] == [("eu-west", "pod-0")] * 40
        assert fallback_requests(f) == fb
        # The breaker opened after a few failures; from then on apac-jp was passed over
        # without being asked (its pod saw only those few).
        extra = f.cell("apac-jp").pod.requests - 20
        assert 1 <= extra <= 5, extra
