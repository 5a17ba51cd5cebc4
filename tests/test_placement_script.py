"""scripts/placement.py against a local stand-in of Cloudflare's script-settings endpoint."""

from __future__ import annotations

import importlib.util
import io
import json
import threading
from email.parser import BytesParser
from email.policy import default as email_policy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = "0123456789abcdef0123456789abcdef"
TOKEN = "cf-token-s3cret"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("placement_script", ROOT / "scripts" / "placement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Settings(ThreadingHTTPServer):
    """PATCH /accounts/{a}/workers/scripts/{s}/settings as the API documents it: multipart with
    a JSON ``settings`` part; answers {success, result: {placement}}. ``answers`` scripts the
    status codes; ``report`` replaces the placement it reports (a dropped block)."""

    def __init__(self, answers=(200,), report=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.answers, self.report, self.seen = list(answers), report, []

    @property
    def base(self):
        return f"http://127.0.0.1:{self.server_address[1]}/client/v4"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_PATCH(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        msg = BytesParser(policy=email_policy).parsebytes(
            b"content-type: " + self.headers["content-type"].encode() + b"\r\n\r\n" + body)
        parts = {p.get_param("name", header="content-disposition"): p for p in msg.iter_parts()}
        settings = json.loads(parts["settings"].get_content()) if "settings" in parts else None
        self.server.seen.append({"path": self.path, "auth": self.headers["authorization"], "settings": settings,
                                 "type": parts["settings"].get_content_type() if "settings" in parts else None})
        status = self.server.answers.pop(0) if self.server.answers else 200
        if status == 200:
            placement = self.server.report if self.server.report is not None else settings["placement"]
            doc = {"success": True, "errors": [], "result": {"placement": placement}}
        else:
            doc = {"success": False, "errors": [{"code": 10021, "message": "bad settings"}], "result": None}
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def api(request):
    server = Settings(**getattr(request, "param", {}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run(script, monkeypatch, capsys, api, block, token=TOKEN):
    monkeypatch.setenv("CLOUDFLARE_API_BASE", api.base)
    if token:
        monkeypatch.setenv("CLOUDFLARE_API_TOKEN", token)
    else:
        monkeypatch.delenv("CLOUDFLARE_API_TOKEN", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(block)))
    monkeypatch.setattr(script.time, "sleep", lambda s: None)  # backoff: the retries, not the wait, are tested
    code = script.main(["apply", "--account", ACCOUNT, "--script", "colocate-apac-jp"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("block", [{"host": "pod-apac-jp-g1.example.com:41234"}, {"region": "aws:ap-northeast-1"},
                                   {"mode": "smart"}])
def test_sends_the_block_as_the_settings_part_and_checks_it_is_reported(script, monkeypatch, capsys, api, block):
    code, out, err = run(script, monkeypatch, capsys, api, block)
    assert code == 0, err
    assert api.seen == [{"path": f"/client/v4/accounts/{ACCOUNT}/workers/scripts/colocate-apac-jp/settings",
                         "auth": f"Bearer {TOKEN}", "settings": {"placement": block}, "type": "application/json"}]
    assert json.loads(out) == {"script": "colocate-apac-jp", "placement": block, "reported": block}
    assert TOKEN not in out + err


@pytest.mark.parametrize("api", [{"report": {"mode": "targeted", "target": [{"host": "pod-x.example.com:1"}]}}],
                         indirect=True)
def test_the_targeted_shape_cloudflare_reports_counts(script, monkeypatch, capsys, api):
    assert run(script, monkeypatch, capsys, api, {"host": "pod-x.example.com:1"})[0] == 0


@pytest.mark.parametrize("api", [{"report": {}}], indirect=True)
def test_a_placement_accepted_but_not_reported_fails(script, monkeypatch, capsys, api):
    code, _, err = run(script, monkeypatch, capsys, api, {"host": "pod-x.example.com:1"})
    assert code == 1 and "reports placement {}" in err and "was not applied" in err


@pytest.mark.parametrize("api", [{"answers": [503, 429, 200]}], indirect=True)
def test_5xx_and_429_are_retried(script, monkeypatch, capsys, api):
    assert run(script, monkeypatch, capsys, api, {"region": "gcp:asia-east1"})[0] == 0
    assert len(api.seen) == 3


@pytest.mark.parametrize("api", [{"answers": [400]}], indirect=True)
def test_a_refusal_says_what_was_sent_and_stops(script, monkeypatch, capsys, api):
    code, _, err = run(script, monkeypatch, capsys, api, {"region": "gcp:asia-east1"})
    assert code == 1 and len(api.seen) == 1
    assert '{"placement": {"region": "gcp:asia-east1"}}' in err and "10021" in err and "cloudflare:apiToken" in err


def test_usage_errors_exit_2_before_any_request(script, monkeypatch, capsys, api):
    code, _, err = run(script, monkeypatch, capsys, api, {"host": "no-port.example.com"})
    assert code == 2 and "placement.host" in err and "host and port" in err
    code, _, err = run(script, monkeypatch, capsys, api, {"region": "x", "host": "y:1"})
    assert code == 2
    code, _, err = run(script, monkeypatch, capsys, api, {"mode": "smart"}, token=None)
    assert code == 2 and "CLOUDFLARE_API_TOKEN" in err and "cloudflare:apiToken" in err
    assert api.seen == []
