"""GET /_colocate/metrics in real workerd, scraped by a real Prometheus: its histogram_quantile
agrees with the clients' own Server-Timing within 5 %, its counters with the traffic sent, and
every expression of the shipped Grafana dashboard evaluates without an error."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess

import pytest

from tests.support import prometheus
from tests.support.workerd import ROOT, SECRETS, auth, chat, running_cell

pytestmark = pytest.mark.slow
DASHBOARD = ROOT / "docs" / "grafana" / "colocate-live.json"
ROUTED = ("state", "upstream", "fallback", "total")


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 300}, compute_ms=1) as c:
        c.pod.set_fault("slow", 30)  # the pod's answers ~30 ms, the fallback's ~1 ms: two modes
        yield c


def metrics_text(cell, token: str | None = None) -> str:
    res = cell.call("GET", "/_colocate/metrics", headers=auth(token))
    assert res.status == 200, res.body
    assert res.headers["content-type"].startswith("text/plain; version=0.0.4")
    return res.body.decode()


def test_metrics_need_the_operator_credential_and_never_show_a_key_or_digest(cell):
    assert cell.call("GET", "/_colocate/metrics", headers={"authorization": ""}).status == 401
    assert cell.call("GET", "/_colocate/metrics", headers={"authorization": f"Bearer {cell.key}"}).status == 401
    assert cell.call("POST", "/v1/chat/completions", body=chat()).status == 200
    text = metrics_text(cell)
    secrets = [cell.key, hashlib.sha256(cell.key.encode()).hexdigest(), *SECRETS.values(), cell.pod.url,
               cell.fallback.url, cell.key[:10]]
    assert not [s for s in secrets if s in text]
    assert 'colocate_keys{state="active"} 1' in text
    assert 'colocate_breaker_state{pod="0",state="closed"} 1' in text
    # every sample line is `name{labels} value`, and every histogram ends in +Inf, _sum and _count
    for line in text.splitlines():
        assert line.startswith("# ") or re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+', line), line
    assert text.count('le="+Inf"') == text.count("colocate_segment_seconds_count{")


def exact_rank(values: list[float], q: float) -> float:
    """Prometheus' quantile: the value ranked q x n among the n observations."""
    data = sorted(values)
    return data[max(0, math.ceil(q * len(data)) - 1)]


@pytest.mark.skipif(prometheus.binary() is None, reason="needs Debian's prometheus package (make prometheus; apt unavailable?)")
def test_a_real_prometheus_scrapes_the_cell_and_agrees_with_the_clients(cell, tmp_path):
    token_file = tmp_path / "probe-token"
    token_file.write_text(SECRETS["PROBE_TOKEN"])
    host = cell.url.split("://", 1)[1]
    scrape = [{"job_name": "colocate", "metrics_path": "/_colocate/metrics", "scheme": "http",
               "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
               "static_configs": [{"targets": [host], "labels": {"cell": "sandbox"}}]}]
    with prometheus.running(scrape) as prom:
        assert prom.wait('up{job="colocate"}', lambda v: v == 1) == 1, prom.log.read_text()[-2000:]
        send = lambda n: [cell.call("POST", "/v1/chat/completions", body=chat()).status for _ in range(n)]  # noqa: E731
        assert set(send(60)) == {200}
        assert cell.call("PUT", "/_colocate/breaker", body={"force": "open"}, headers=auth()).status == 200
        assert set(send(30)) == {200}
        assert cell.call("PUT", "/_colocate/breaker", body={"force": None}, headers=auth()).status == 200
        # streamed answers: the dashboard's ttft and itl panels by backend read them
        assert {cell.call("POST", "/v1/chat/completions", body=chat(stream=True)).status for _ in range(5)} == {200}
        seen = {b: {s: [] for s in ROUTED} for b in ("pod-0", "fallback")}
        for res in cell.responses:  # every routed answer of this cell, the earlier test's too
            if "x-colocate-backend" in res.headers:
                for s in ROUTED:
                    seen[res.headers["x-colocate-backend"]][s].append(res.timing()[s])
        n = sum(len(v["total"]) for v in seen.values())
        got = prom.wait('sum(colocate_segment_seconds_count{segment="total"})', lambda v: v >= n)
        assert got == n, prom.log.read_text()[-2000:]

        every = {s: seen["pod-0"][s] + seen["fallback"][s] for s in ROUTED}
        cases = [("total", "", every["total"]), ("total", ',backend="pod-0"', seen["pod-0"]["total"]),
                 ("total", ',backend="fallback"', seen["fallback"]["total"]),
                 ("upstream", ',backend="pod-0"', seen["pod-0"]["upstream"])]
        for seg, sel, values in cases:
            for q in (0.5, 0.9, 0.99):
                expr = f'1000 * histogram_quantile({q}, sum by (le) (colocate_segment_seconds_bucket{{segment="{seg}"{sel}}}))'
                est, want = prom.value(expr), exact_rank(values, q)
                assert abs(est - want) <= max(0.05 * want, 0.25), (seg, sel, q, est, want)

        # counters: requests by backend, tokens as the usage endpoint counts them, the breaker, the keys
        fb = prom.value('colocate_requests_total{backend="fallback"}')
        assert fb >= len(seen["fallback"]["total"])
        usage = cell.call("GET", "/_colocate/usage", headers=auth()).json()["usage"]
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in usage)
        assert prom.wait("sum(colocate_tokens_total)", lambda v: abs(v - tokens) < 0.5) == pytest.approx(tokens, abs=0.5)
        assert prom.value('colocate_breaker_state{pod="0",state="closed"}') == 1
        assert prom.value('colocate_keys{state="active"}') == 1

        # the dashboard: every expression evaluates, with Grafana's variables as an operator's defaults.
        # A rate needs two samples of its series: the streamed ones (ttft, itl) began with the last
        # requests, so wait for their second scrape (bounded), else their four panels are empty.
        streamed = 'min(count_over_time(colocate_segment_seconds_count{segment=~"ttft|itl"}[1m]))'
        scraped = prom.wait(streamed, lambda v: v >= 2)
        assert scraped is not None and scraped >= 2, prom.log.read_text()[-2000:]
        dash = json.loads(DASHBOARD.read_text())
        subs = {"$__rate_interval": "1m", "$cell": ".*", "$price_input": "0.15", "$price_output": "0.60"}
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
        assert len(exprs) >= 10
        empty = []
        for e in exprs:
            for k, v in subs.items():
                e = e.replace(k, v)
            assert "$" not in e, e
            if not prom.query(e):  # raises PrometheusError naming the expression on a bad one
                empty.append(e)
        assert empty == [], "\n".join(empty)  # every panel has data (the breaker's: its 0 gauges)


ALERTS = ROOT / "docs" / "grafana" / "alerts.yml"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs Debian's prometheus package (promtool; make prometheus)")
def test_the_fallback_share_alert_pages_for_a_cell_whose_pods_do_not_serve_and_only_then(tmp_path):
    """promtool's own rule tests: three cells' counters over 10 minutes. `down` has a pod in rotation
    and the fallback answers 1 request a second of 2 (50 %); `ok` 1 of 100 (1 %); `zero` routes to no
    pod (no breaker series: scaled to zero) and everything is the fallback's."""
    series = [
        {"series": 'colocate_requests_total{cell="down",backend="pod-0"}', "values": "0+60x10"},
        {"series": 'colocate_requests_total{cell="down",backend="fallback"}', "values": "0+60x10"},
        {"series": 'colocate_breaker_state{cell="down",pod="0",state="closed"}', "values": "1x10"},
        {"series": 'colocate_requests_total{cell="ok",backend="pod-0"}', "values": "0+5940x10"},
        {"series": 'colocate_requests_total{cell="ok",backend="fallback"}', "values": "0+60x10"},
        {"series": 'colocate_breaker_state{cell="ok",pod="0",state="closed"}', "values": "1x10"},
        {"series": 'colocate_requests_total{cell="zero",backend="fallback"}', "values": "0+60x10"},
    ]
    fired = {"eval_time": "9m", "alertname": "ColocateFallbackShareHigh",
             "exp_alerts": [{"exp_labels": {"cell": "down", "severity": "page"},
                             "exp_annotations": {"summary": "down: the fallback answers 50% of requests",
                                                 "description": "The pods are not serving and every request is bought "
                                                                "from the paid API. Check `scripts/probe.py --stack down "
                                                                "--live` and `scripts/pod.py status`."}}]}
    not_yet = {"eval_time": "1m", "alertname": "ColocateFallbackShareHigh", "exp_alerts": []}  # `for: 2m`
    spec = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [fired, not_yet]}]}
    (tmp_path / "alerts.test.yml").write_text(json.dumps(spec))  # JSON is YAML
    proc = subprocess.run(["promtool", "test", "rules", str(tmp_path / "alerts.test.yml")], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # and the rule fails the test when it would page the healthy cell: the test can fail
    fired["exp_alerts"][0]["exp_labels"]["cell"] = "ok"
    (tmp_path / "alerts.test.yml").write_text(json.dumps(spec))
    wrong = subprocess.run(["promtool", "test", "rules", str(tmp_path / "alerts.test.yml")], capture_output=True,
                           text=True, timeout=60, check=False)
    assert wrong.returncode != 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs Debian's prometheus package (promtool; make prometheus)")
def test_the_keepers_alerts_page_for_the_cell_that_raised_one_and_for_a_keeper_that_stopped(tmp_path):
    """Two cells over 30 minutes: `stuck` raises replace_failed from minute 3 and its keeper stops
    recording at minute 5 (10 minutes without a pass at minute 16, then `for: 5m`); `ok` raises
    nothing and records a pass every minute."""
    series = [{"series": f'colocate_keeper_alert{{cell="{cell}",alert="{name}"}}',
               "values": "0 0 0 1x27" if (cell, name) == ("stuck", "replace_failed") else "0x30"}
              for cell in ("stuck", "ok") for name in ("replace_failed", "update_failing", "stack_locked", "stale_checkout")]
    series += [{"series": 'colocate_keeper_last_pass_timestamp_seconds{cell="ok"}', "values": "0+60x30"},
               {"series": 'colocate_keeper_last_pass_timestamp_seconds{cell="stuck"}', "values": "0+60x5 300x25"}]
    raised = {"eval_time": "4m", "alertname": "ColocateKeeperAlert",
              "exp_alerts": [{"exp_labels": {"cell": "stuck", "alert": "replace_failed", "severity": "page"},
                              "exp_annotations": {"summary": "stuck: the keeper raised replace_failed",
                                                  "description": "The keeper cannot mend this alone. `scripts/scale.py "
                                                                 "status --stack stuck` shows its record and the message; "
                                                                 "docs/pods.md, \"The keeper\", says what each means."}}]}
    stopped = {"eval_time": "22m", "alertname": "ColocateKeeperStopped",
               "exp_alerts": [{"exp_labels": {"cell": "stuck", "severity": "ticket"},
                               "exp_annotations": {"summary": "stuck: the keeper has not passed for 17m 0s",
                                                   "description": "Nothing checks the cell's pods or renews its "
                                                                  "certificates. Start it again: `scripts/scale.py run "
                                                                  "--stack stuck` under systemd or cron."}}]}
    not_yet = {"eval_time": "20m", "alertname": "ColocateKeeperStopped", "exp_alerts": []}  # pending: `for: 5m`
    spec = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [raised, stopped, not_yet]}]}
    (tmp_path / "keeper.test.yml").write_text(json.dumps(spec))
    proc = subprocess.run(["promtool", "test", "rules", str(tmp_path / "keeper.test.yml")], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raised["exp_alerts"][0]["exp_labels"]["cell"] = "ok"  # the test can fail: the healthy cell does not page
    (tmp_path / "keeper.test.yml").write_text(json.dumps(spec))
    wrong = subprocess.run(["promtool", "test", "rules", str(tmp_path / "keeper.test.yml")], capture_output=True,
                           text=True, timeout=60, check=False)
    assert wrong.returncode != 0
