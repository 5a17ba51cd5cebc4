"""Bad input gets a JSON error with the right status, and no secret ever leaks."""

import pytest

from tests.support.workerd import SECRETS, auth, chat, running_cell

pytestmark = pytest.mark.slow
MAX_BODY = 2048
ADMIN = [("GET", "/_colocate/probe"), ("GET", "/_colocate/breaker"), ("PUT", "/_colocate/breaker"),
         ("POST", "/_colocate/purge")]


@pytest.fixture(scope="module")
def cell():
    with running_cell({"maxBodyBytes": MAX_BODY, "deadlineMs": 2000, "stateTtlMs": 60_000}) as c:
        yield c


def error_of(res, status, code):
    assert res.status == status, (res.status, res.body)
    assert res.headers["content-type"].startswith("application/json")
    err = res.json()["error"]
    assert err["code"] == code and err["message"]
    assert set(res.json()) == {"error"}
    return err


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/completions", "POST"),
    ("POST", "/v1/models", "GET"), ("POST", "/_colocate/probe", "GET"), ("DELETE", "/_colocate/breaker", "GET, PUT"),
    ("GET", "/_colocate/purge", "POST"),
])
def test_wrong_method_is_405_with_allow(cell, method, path, allow):
    res = cell.call(method, path)
    err = error_of(res, 405, "method_not_allowed")
    assert res.headers["allow"] == allow and method in err["message"]


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/embeddings", "/_colocate", "/v1/models/extra"])
def test_unknown_path_is_404(cell, path):
    error_of(cell.call("GET", path), 404, "not_found")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_413(cell, chunked):
    before = cell.pod.requests
    big = {"model": "m", "prompt": "x" * (MAX_BODY + 10)}
    error_of(cell.call("POST", "/v1/completions", body=big, chunked=chunked), 413, "payload_too_large")
    assert cell.pod.requests == before
    ok = cell.call("POST", "/v1/completions", body={"model": "m", "prompt": "x" * 100}, chunked=chunked)
    assert ok.status == 200 and ok.headers["x-colocate-backend"] == "pod-0"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
def test_malformed_json_is_400(cell, path, body):
    error_of(cell.call("POST", path, body=body, headers={"content-type": "application/json"}), 400, "invalid_json")


def test_malformed_admin_bodies_are_400(cell):
    error_of(cell.call("PUT", "/_colocate/breaker", body=b"{", headers=auth()), 400, "invalid_json")
    err = error_of(cell.call("PUT", "/_colocate/breaker", body={"force": "sideways"}, headers=auth()), 400, "invalid_field")
    assert "force" in err["message"]
    error_of(cell.call("PUT", "/_colocate/breaker", body={}, headers=auth()), 400, "invalid_field")
    error_of(cell.call("POST", "/_colocate/purge", body={"generation": 7}, headers=auth()), 400, "invalid_field")


@pytest.mark.parametrize("method,path", ADMIN)
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"},
                                     {"authorization": f"Bearer {SECRETS['PROBE_TOKEN']}x"}],
                         ids=["missing", "wrong", "not-bearer", "longer"])
def test_missing_or_wrong_probe_token_is_401(cell, method, path, headers):
    error_of(cell.call(method, path, body={"force": None}, headers=headers), 401, "unauthorized")


def test_no_secret_in_responses_or_log(cell):
    # Exercise every path, including failures that log: pod errors and a slow pod.
    cell.call("POST", "/v1/chat/completions", body=chat(), headers={"authorization": "Bearer client"})
    cell.call("GET", "/_colocate/probe", headers=auth())
    cell.pod.set_fault("error")
    try:
        for _ in range(4):
            cell.call("POST", "/v1/chat/completions", body=chat())
    finally:
        cell.pod.set_fault("ok")
    values = list(SECRETS.values()) + [cell.fallback.url]
    texts = [r.body.decode(errors="replace") + repr(r.headers) for r in cell.responses]
    texts.append(cell.worker.log_text())
    assert cell.worker.log_text().strip(), "the router logged nothing: the check would be empty"
    for text in texts:
        for v in values:
            assert v not in text
    for r in cell.responses:  # no stack trace: no "at fn (file.js:1:2)" frames, no module paths
        body = r.body.decode(errors="replace")
        assert "    at " not in body and ".js:" not in body
