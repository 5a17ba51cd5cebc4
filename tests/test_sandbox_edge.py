"""The sandbox's front proxy answers malformed HTTP as Cloudflare's edge would: the right
status, OpenAI's JSON error shape, no internal address, exception text or HTML; and a
client that leaves is not an error (no traceback, no line).

Raw sockets against a real front proxy in front of a real workerd running the sandbox plan
(tests.support.workerd.running_cell), so what the edge forwards is answered by the Worker."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest

from colocate.sandbox.geography import Geography, Sites
from colocate.sandbox.pinning import Pins
from colocate.sandbox.proxies import Network, NetworkServers
from colocate.sandbox.statedir import PINS_FILE
from tests.support.workerd import SECRETS, running_cell

MAX_HEADER_BYTES, MAX_URL_BYTES = 16384, 16384

pytestmark = pytest.mark.slow  # a real edge proxy in front of a real workerd

EDGE = "IAD"


@contextlib.contextmanager
def _front(workerd: tuple[str, int] | None):
    with tempfile.TemporaryDirectory() as tmp:
        net = Network(Geography(same_site_ms=0.0), Sites(client=EDGE, edge=EDGE, pod=EDGE, fallback=EDGE),
                      Pins(Path(tmp) / PINS_FILE), {}, workerd=workerd)
        with NetworkServers(net) as servers:
            yield servers.front.port


@pytest.fixture(scope="module")
def edge():
    """(front proxy port, client key) for a running cell; one for the whole module."""
    with running_cell(compute_ms=1) as cell, _front(("127.0.0.1", cell.worker.port)) as port:
        yield port, cell.key


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, closed: bool):
        self.status, self.headers, self.body, self.closed = status, headers, body, closed

    def json(self) -> dict:
        return json.loads(self.body)


def exchange(port: int, data: bytes, timeout: float = 15.0) -> Answer:
    """Send ``data`` (from a thread: the edge may answer before it has read it all) and read
    one response; ``closed`` says whether the edge then closed the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def send():
        with contextlib.suppress(OSError):
            sock.sendall(data)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        closed = False
        if headers.get("connection", "").lower() == "close":  # then the socket must really end (EOF)
            sock.settimeout(3.0)
            try:
                closed = resp.fp.read(1) == b"" if resp.fp else sock.recv(1) == b""
            except (TimeoutError, OSError):
                closed = False
        return Answer(resp.status, headers, body, closed)
    finally:
        sock.close()
        sender.join(timeout=5)


def request_bytes(method: str = "GET", target: bytes | str = "/v1/models", headers: list[tuple[str, str]] | None = None,
                  body: bytes = b"") -> bytes:
    target = target.encode("latin-1") if isinstance(target, str) else target
    lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: sandbox.local"]
    lines += [f"{k}: {v}".encode("latin-1") for k, v in headers or []]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def assert_edge_error(a: Answer, status: int, code: str | None = None) -> dict:
    """The answer is ``status`` in OpenAI's error shape and gives nothing internal away."""
    assert a.status == status, (a.status, a.body[:300])
    assert a.headers.get("content-type", "").startswith("application/json"), a.headers
    err = a.json()["error"]
    assert set(err) >= {"message", "type", "code"}, err
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if code:
        assert err["code"] == code, err
    text = a.body.decode("utf-8", "replace")
    for leak in ("127.0.0.1", "localhost:", "Error", "Traceback", "invalid literal", "<html", "<!DOCTYPE"):
        assert leak not in text, (leak, text)
    return err


def chat_body(**extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def chunked(data: bytes, piece: int = 65536) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + piece]), data[i:i + piece]) for i in range(0, len(data), piece))
    return out + b"0\r\n\r\n"


def test_a_good_request_is_forwarded_and_the_connection_kept(edge):
    port, key = edge
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        for _ in range(2):  # two requests on one connection
            sock.sendall(request_bytes(headers=[("Authorization", f"Bearer {key}")]))
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            assert resp.status == 200 and json.loads(resp.read())["data"]
            assert resp.getheader("cf-ray", "").endswith(f"-{EDGE}")


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
@pytest.mark.parametrize("mb", [2, 20])
def test_a_big_body_gets_the_workers_413_either_way(edge, framing, mb):
    """The Worker answers 413 before reading a body over its limit and closes: the edge
    relays that answer (it used to turn it into a 502 naming workerd's address, a broken pipe,
    from 8 MB up on this machine)."""
    port, key = edge
    big = chat_body(pad="x" * (mb * 1024 * 1024))
    if framing == "chunked":
        data = request_bytes("POST", "/v1/chat/completions", [("Authorization", f"Bearer {key}"),
                                                              ("Transfer-Encoding", "chunked")], chunked(big))
    else:
        data = request_bytes("POST", "/v1/chat/completions", [("Authorization", f"Bearer {key}"),
                                                              ("Content-Length", str(len(big)))], big)
    for _ in range(2):
        err = assert_edge_error(exchange(port, data), 413, "payload_too_large")
        assert "MAX_BODY_BYTES" in err["message"]  # the Worker's own answer, not the edge's


@contextlib.contextmanager
def _answers_early(status_line: bytes = b"HTTP/1.1 413 Payload Too Large"):
    """An upstream that answers as soon as it has the request's head (as the Worker answers a body
    over its limit) and then reads whatever follows until the edge closes: its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            got = b""
            while b"\r\n\r\n" not in got:
                got += conn.recv(65536)
            body = b'{"error":{"message":"too large","type":"invalid_request_error","code":"payload_too_large"}}'
            conn.sendall(status_line + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
                         + b"content-length: %d\r\n\r\n%s" % (len(body), body))
            while conn.recv(65536):
                pass

    def serve():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                threading.Thread(target=answer, args=(listener.accept()[0],), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=10)
        listener.close()


def test_a_body_still_arriving_after_an_early_answer_ends_quietly():
    """The upstream answers before the body is all there (the Worker's 413) and the client goes on
    sending it: the edge relays the answer and closes, and its body sender, waiting on the client
    when the connection closed under it, ends quietly (no thread exception). Which of the sender's
    reads meets the closed connection is the scheduler's choice: a few connections try several."""
    head = request_bytes("POST", "/v1/chat/completions", [("Transfer-Encoding", "chunked")])
    with _answers_early() as upstream, _front(("127.0.0.1", upstream)) as port:
        for _ in range(6):
            with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
                sock.sendall(head + b"4\r\n{}{}\r\n")
                resp = http.client.HTTPResponse(sock)
                resp.begin()
                assert resp.status == 413, resp.status
                resp.read()
                time.sleep(0.1)  # the edge has closed its side; its sender still waits on the client
                with contextlib.suppress(OSError):
                    for piece in (b"1\r\n", b"x\r\n") * 3:
                        sock.sendall(piece)
                        time.sleep(0.02)
        time.sleep(0.2)  # the senders' last reads have returned


@pytest.mark.parametrize("value", ["abc", "-1", "1e3", "10, 12", " "])
def test_a_content_length_that_is_not_a_number_is_400_at_once(edge, value):
    port, key = edge
    t0 = time.monotonic()
    a = exchange(edge[0], request_bytes("POST", "/v1/chat/completions",
                                        [("Authorization", f"Bearer {key}"), ("Content-Length", value)], b"{}"))
    assert_edge_error(a, 400, "invalid_content_length")
    assert a.closed and time.monotonic() - t0 < 10  # answered, not left waiting for -1 bytes


def test_framing_errors(edge):
    port, key = edge
    auth = ("Authorization", f"Bearer {key}")
    both = request_bytes("POST", "/v1/chat/completions", [auth, ("Content-Length", "2"), ("Transfer-Encoding", "chunked")],
                         b"2\r\n{}\r\n0\r\n\r\n")
    assert_edge_error(exchange(port, both), 400, "invalid_content_length")
    gzip = request_bytes("POST", "/v1/chat/completions", [auth, ("Transfer-Encoding", "gzip, chunked")], b"0\r\n\r\n")
    assert_edge_error(exchange(port, gzip), 501, "unsupported_transfer_encoding")
    bad_chunk = request_bytes("POST", "/v1/chat/completions", [auth, ("Transfer-Encoding", "chunked")], b"zz\r\n{}\r\n0\r\n\r\n")
    assert_edge_error(exchange(port, bad_chunk), 400, "invalid_chunked_body")


def test_a_body_over_the_edge_limit_is_413_without_reading_it(edge):
    port, key = edge
    huge = request_bytes("POST", "/v1/chat/completions", [("Authorization", f"Bearer {key}"),
                                                          ("Content-Length", str(64 * 1024 * 1024))], b"{")
    assert_edge_error(exchange(port, huge), 413, "payload_too_large")


@pytest.mark.parametrize("target", [b"/v1/models\x00x", b"/v1/mo\x01dels", b"/v1/models\x7f", b"v1/models", b"*"])
def test_a_bad_request_target_is_400(edge, target):
    a = exchange(edge[0], request_bytes(target=target))
    assert_edge_error(a, 400, "invalid_request_target")
    assert a.closed


def test_non_ascii_bytes_in_the_path_are_percent_encoded_and_reach_the_worker(edge):
    port, key = edge
    a = exchange(port, request_bytes(target=b"/v1/models\xff\xfe", headers=[("Authorization", f"Bearer {key}")]))
    # The Worker answers it (a route it does not have), in its own JSON: the edge neither
    # closed the connection nor answered 5xx.
    assert a.status < 500 and a.headers["content-type"].startswith("application/json"), (a.status, a.body)
    assert "cf-ray" in a.headers  # it went through to the Worker


@pytest.mark.parametrize("line, status", [(b"GARBAGE", 400), (b"GET /v1/models", 400), (b"GET /v1/models HTTP/2.0", 505),
                                          (b"GET /v1/models HTTP/x", 400), (b"GET /a b HTTP/1.1", 400)])
def test_a_bad_request_line(edge, line, status):
    a = exchange(edge[0], line + b"\r\nHost: x\r\n\r\n")
    assert_edge_error(a, status)
    assert a.closed


@pytest.mark.parametrize("method", ["FOO", "get", "CONNECT", "TRACE"])
def test_a_method_the_edge_does_not_forward_is_501(edge, method):
    a = exchange(edge[0], request_bytes(method))
    assert_edge_error(a, 501, "method_not_implemented")


@pytest.mark.parametrize("size", [MAX_URL_BYTES + 10, 70_000])
def test_a_long_url_is_414(edge, size):
    a = exchange(edge[0], request_bytes(target="/v1/models?q=" + "a" * size))
    assert_edge_error(a, 414, "uri_too_long")


@pytest.mark.parametrize("headers", [
    [("X-Big", "a" * (MAX_HEADER_BYTES + 10))],  # one header over 16 KB
    [(f"X-Part-{i}", "a" * 10_000) for i in range(4)],  # 40 KB in all
    [("X-Huge", "a" * 70_000)],  # longer than the line the stdlib reads
    [(f"X-Many-{i}", "1") for i in range(120)],  # more header lines than the stdlib takes
])
def test_huge_headers_are_431(edge, headers):
    assert_edge_error(exchange(edge[0], request_bytes(headers=headers)), 431, "request_header_fields_too_large")


def test_two_authorization_headers_reach_the_worker_and_it_refuses(edge):
    port, key = edge
    # Forwarding only the last value would let this through with the valid key (200).
    for pair in ([("Authorization", "Bearer clc_" + "x" * 32), ("Authorization", f"Bearer {key}")],
                 [("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {key}")]):
        a = exchange(port, request_bytes(headers=pair))
        assert a.status == 401, (a.status, a.body)
        assert a.json()["error"]["code"] == "invalid_api_key"
    assert exchange(port, request_bytes(headers=[("Authorization", f"Bearer {key}")])).status == 200
    # The operator endpoints too: the probe token twice is no probe token.
    token = [("Authorization", f"Bearer {SECRETS['PROBE_TOKEN']}")]
    assert exchange(port, request_bytes(target="/_colocate/keys", headers=token * 2)).status == 401
    assert exchange(port, request_bytes(target="/_colocate/keys", headers=token)).status == 200


def test_an_unreachable_worker_is_a_502_that_names_nothing_internal(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed when the block ends: nothing listens there
    with _front(("127.0.0.1", dead)) as port:
        a = exchange(port, request_bytes())
    err = assert_edge_error(a, 502, "upstream_unreachable")
    assert str(dead) not in a.body.decode() and "Worker" in err["message"]
    log = capsys.readouterr().err
    assert log.count("\n") == 1 and f"127.0.0.1:{dead}" in log and "Traceback" not in log  # the detail is in the log


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a client that crashes or is killed does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_client_that_leaves_leaves_no_traceback(edge, capsys):
    port, key = edge
    capsys.readouterr()
    # 1. connects and resets at once; 2. resets mid-headers; 3. mid-body; 4. mid-stream.
    s = socket.create_connection(("127.0.0.1", port))
    _reset(s)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    time.sleep(0.1)
    _reset(s)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(request_bytes("POST", "/v1/chat/completions", [("Content-Length", "1000")], b"{\"mo"))
    time.sleep(0.1)
    _reset(s)
    s = socket.create_connection(("127.0.0.1", port), timeout=15)
    body = chat_body(stream=True, max_tokens=8)
    s.sendall(request_bytes("POST", "/v1/chat/completions", [("Authorization", f"Bearer {key}"),
                                                             ("Content-Length", str(len(body)))], body))
    assert s.recv(1024).startswith(b"HTTP/1.1 200")
    _reset(s)
    time.sleep(0.5)  # the server threads notice
    # After all that the edge still serves, and said nothing.
    assert exchange(port, request_bytes(headers=[("Authorization", f"Bearer {key}")])).status == 200
    # The operator endpoints too: the probe token twice is no probe token.
    token = [("Authorization", f"Bearer {SECRETS['PROBE_TOKEN']}")]
    assert exchange(port, request_bytes(target="/_colocate/keys", headers=token * 2)).status == 401
    assert exchange(port, request_bytes(target="/_colocate/keys", headers=token)).status == 200
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err
